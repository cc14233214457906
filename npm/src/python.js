// Boots Pyodide and installs py_engine's shared layer from the wheels shipped in this package.

import { IS_NODE } from './ort.js';
import { readBytes, readText } from './files.js';

const WHEELS_URL = new URL('../wheels/', import.meta.url);
const BRIDGE_URL = new URL('./bridge.py', import.meta.url);
const SITE = '/lib/python3.14/site-packages';

/**
 * @param {{indexURL?: string, wheelsURL?: string|URL}} [options]
 * @returns {Promise<any>} the Pyodide instance with the `ruvllm_bridge` module importable
 */
export async function bootPython(options = {}) {
  // Browsers given an indexURL (a worker has no import map) load pyodide.mjs from there.
  const { loadPyodide } = options.indexURL && !IS_NODE
    ? await import(/* @vite-ignore */ new URL('pyodide.mjs', absolute(options.indexURL)).href)
    : await import('pyodide');
  const config = { stdout: () => {}, stderr: (line) => console.warn(`[pyodide] ${line}`) };
  if (options.indexURL) config.indexURL = absolute(options.indexURL).href;
  const pyodide = await loadPyodide(config);
  const base = options.wheelsURL ? absolute(options.wheelsURL) : WHEELS_URL;
  // index.json lists the wheels in install order: markupsafe before jinja2, so nothing reaches for a CDN.
  const wheels = JSON.parse(await readText(new URL('index.json', base)));
  for (const name of wheels) {
    pyodide.unpackArchive(await readBytes(new URL(name, base)), 'wheel', { extractDir: SITE });
  }
  pyodide.FS.writeFile(`${SITE}/ruvllm_bridge.py`, await readText(BRIDGE_URL));
  pyodide.pyimport('ruvllm_bridge');
  return pyodide;
}

/** A folder URL (with its trailing slash) resolved against the page or worker location. */
function absolute(url) {
  const u = new URL(String(url), globalThis.location?.href);
  if (!u.pathname.endsWith('/')) u.pathname += '/';
  return u;
}
