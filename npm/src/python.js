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
  const { loadPyodide } = await import('pyodide');
  const config = { stdout: () => {}, stderr: (line) => console.warn(`[pyodide] ${line}`) };
  if (options.indexURL) config.indexURL = options.indexURL;
  else if (!IS_NODE) config.indexURL = new URL('../../pyodide/', import.meta.url).href;
  const pyodide = await loadPyodide(config);
  const base = options.wheelsURL ? new URL(options.wheelsURL, globalThis.location?.href) : WHEELS_URL;
  // index.json lists the wheels in install order: markupsafe before jinja2, so nothing reaches for a CDN.
  const wheels = JSON.parse(await readText(new URL('index.json', base)));
  for (const name of wheels) {
    pyodide.unpackArchive(await readBytes(new URL(name, base)), 'wheel', { extractDir: SITE });
  }
  pyodide.FS.writeFile(`${SITE}/ruvllm_bridge.py`, await readText(BRIDGE_URL));
  pyodide.pyimport('ruvllm_bridge');
  return pyodide;
}
