// Boots Pyodide and installs py_engine's shared layer from the wheels shipped in this package.
//
// A reload starts from a memory snapshot where the browser has the Cache API: the first load boots Pyodide
// with `_makeSnapshot`, imports py_engine and keeps Pyodide's heap (~30 MB) in the Cache API under a key
// naming Pyodide's build and the wheels; the next load restores that heap (~1 s where a boot takes several)
// and unpacks the wheels again (their files live outside the heap, and py_engine imports some modules late).
// The model's Runtime (tokenizer, template) is built after, either way: Pyodide 314 fails to restore a heap
// grown past its boot size ("offset is out of bounds"). Any failure to restore falls back to a plain boot.

import { IS_NODE } from './ort.js';
import { CACHE_NAME, readBytes, readText } from './files.js';

const WHEELS_URL = new URL('../wheels/', import.meta.url);
const BRIDGE_URL = new URL('./bridge.py', import.meta.url);
const SITE = '/lib/python3.14/site-packages';
const RUNTIME = 'ruvllm_runtime'; // the Runtime's name in __main__, where a snapshot keeps it

/**
 * Pyodide with ruvllm_bridge importable and a Runtime over the model files `writeModel(pyodide)` writes.
 * @param {{indexURL?: string, wheelsURL?: string|URL, snapshot?: URL|null, maxContext?: number|null,
 *   modelDir: string, writeModel: (pyodide: any) => Promise<void>}} options
 *   snapshot: false to boot without one (default: where the Cache API exists)
 * @returns {Promise<{pyodide: any, runtime: any, restored: boolean}>}
 */
export async function bootRuntime(options) {
  const { loadPyodide } = options.indexURL && !IS_NODE
    ? await import(/* @vite-ignore */ new URL('pyodide.mjs', absolute(options.indexURL)).href)
    : await import('pyodide');
  const config = { stdout: () => {}, stderr: (line) => console.warn(`[pyodide] ${line}`) };
  if (options.indexURL) config.indexURL = absolute(options.indexURL).href;
  const base = options.wheelsURL ? absolute(options.wheelsURL) : WHEELS_URL;
  const wheelsIndex = await readText(new URL('index.json', base));
  const cache = options.snapshot !== false && typeof caches !== 'undefined' ? await caches.open(CACHE_NAME).catch(() => null) : null;
  const key = cache ? await snapshotKey(base, wheelsIndex, config.indexURL ?? '') : null;
  const saved = key ? await cache.match(key) : null;
  let pyodide = null;
  if (saved) {
    try {
      pyodide = await loadPyodide({ ...config, _loadSnapshot: new Uint8Array(await saved.arrayBuffer()) });
      await installWheels(pyodide, base, wheelsIndex);
    } catch (error) {
      console.warn(`ruvllm: the Python snapshot did not restore (${error.message}); booting`);
      await cache.delete(key);
      pyodide = null;
    }
  }
  const restored = !!pyodide;
  if (!pyodide) {
    pyodide = await loadPyodide(cache ? { ...config, _makeSnapshot: true } : config);
    await installWheels(pyodide, base, wheelsIndex);
    pyodide.runPython('import ruvllm_bridge');
    if (cache) await keepSnapshot(pyodide, cache, key);
  }
  await options.writeModel(pyodide);
  const max = options.maxContext ?? null;
  pyodide.runPython(`import ruvllm_bridge\n${RUNTIME} = ruvllm_bridge.Runtime(${JSON.stringify(options.modelDir)}, ` +
    `${max === null ? 'None' : Number(max)})\n${RUNTIME}.warm()`);
  return { pyodide, runtime: pyodide.globals.get(RUNTIME), restored };
}

async function keepSnapshot(pyodide, cache, key) {
  try {
    const snapshot = pyodide.makeMemorySnapshot();
    await cache.put(key, new Response(snapshot, { headers: { 'content-length': String(snapshot.length) } }));
  } catch (error) {
    console.warn(`ruvllm: no Python snapshot kept (${error.message})`);
  }
}

// index.json lists the wheels in install order: markupsafe before jinja2, so nothing reaches for a CDN.
async function installWheels(pyodide, base, wheelsIndex) {
  for (const name of JSON.parse(wheelsIndex)) {
    pyodide.unpackArchive(await readBytes(new URL(name, base)), 'wheel', { extractDir: SITE });
  }
  pyodide.FS.writeFile(`${SITE}/ruvllm_bridge.py`, await readText(BRIDGE_URL));
}

/** A Cache API key (beside the wheels) naming what the heap holds: the wheels, the bridge, Pyodide's build. */
async function snapshotKey(wheelsBase, wheelsIndex, indexURL) {
  const bridge = await readText(BRIDGE_URL);
  const data = new TextEncoder().encode(`${wheelsBase.href}\n${wheelsIndex}\n${indexURL}\n${bridge}`);
  const digest = new Uint8Array(await crypto.subtle.digest('SHA-256', data));
  const hex = Array.from(digest.slice(0, 12), (b) => b.toString(16).padStart(2, '0')).join('');
  return new URL(`__ruvllm_python_snapshot/${hex}`, wheelsBase).href;
}

/** A folder URL (with its trailing slash) resolved against the page or worker location. */
function absolute(url) {
  const u = new URL(String(url), globalThis.location?.href);
  if (!u.pathname.endsWith('/')) u.pathname += '/';
  return u;
}
