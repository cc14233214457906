// Boots Pyodide and installs py_engine's shared layer from the wheels shipped in this package.
//
// Booting Pyodide from scratch (Python's own start-up, compiling the stdlib it imports from source) takes
// 2-5 s on a 2-core machine; restoring a memory snapshot of a booted heap takes ~0.5 s. So a load starts
// from a snapshot whenever one matches, first found wins:
//   1. the Cache API: a heap this browser kept after an earlier load (`_makeSnapshot`, under a key naming
//      Pyodide's build, the wheels' URLs and the bridge);
//   2. the wheels folder: `python-snapshot.json` naming a gzipped heap made at build time in Node
//      (scripts/python-snapshot.mjs, run by `ruvllm web build`), used only when its `key`, a digest of
//      Pyodide's version, the bridge and the wheels' bytes, equals the one computed here from the files
//      this load installs, so a stale one is never restored;
//   3. neither: a plain boot, which keeps a snapshot in the Cache API for the next load (a shipped heap,
//      once restored, is kept there too: a reload then skips its download and gunzip).
// Either heap holds py_engine and jinja2 imported (`ruvllm_bridge.preload`); the wheels are unpacked again
// after a restore (their files live outside the heap, and py_engine imports some modules late). The model's
// Runtime (tokenizer, template) is built after, either way: Pyodide 314 fails to restore a heap grown past
// its boot size ("offset is out of bounds"). Any failure to restore falls back to a plain boot.

import { IS_NODE } from './ort.js';
import { CACHE_NAME, readBytes, readText } from './files.js';
import { TABLES_FILE } from './bpe_tables.js';

const WHEELS_URL = new URL('../wheels/', import.meta.url);
const BRIDGE_URL = new URL('./bridge.py', import.meta.url);
const SITE = '/lib/python3.14/site-packages';
const RUNTIME = 'ruvllm_runtime'; // the Runtime's name in __main__, where a snapshot keeps it
export const SHIPPED_MANIFEST = 'python-snapshot.json';
const MAX_HEAP_BYTES = 512 * 1024 * 1024; // a booted Pyodide with py_engine is ~30 MiB; wasm32 caps it at 4 GiB

/**
 * Pyodide with ruvllm_bridge importable and a Runtime over the model files `writeModel(pyodide)` writes.
 * @param {{indexURL?: string, wheelsURL?: string|URL, snapshot?: URL|null, maxContext?: number|null,
 *   modelDir: string, writeModel: (pyodide: any) => Promise<void>, mark?: (phase: string) => void}} options
 *   snapshot: false to boot without one (default: where the Cache API exists); mark: called as each phase ends
 * @returns {Promise<{pyodide: any, runtime: any, restored: boolean, start: 'boot'|'cached'|'shipped'}>}
 */
export async function bootRuntime(options) {
  const mark = options.mark ?? (() => {});
  const { loadPyodide, version } = options.indexURL && !IS_NODE
    ? await import(/* @vite-ignore */ new URL('pyodide.mjs', absolute(options.indexURL)).href)
    : await import('pyodide');
  const config = { stdout: () => {}, stderr: (line) => console.warn(`[pyodide] ${line}`) };
  if (options.indexURL) config.indexURL = absolute(options.indexURL).href;
  const base = options.wheelsURL ? absolute(options.wheelsURL) : WHEELS_URL;
  const files = await readWheels(base);
  mark('wheelsRead');
  const allowed = options.snapshot !== false;
  const cache = allowed && typeof caches !== 'undefined' ? await caches.open(CACHE_NAME).catch(() => null) : null;
  const key = cache ? new URL(`__ruvllm_python_snapshot/${await digest(`${base.href}\n${files.index}\n` +
    `${config.indexURL ?? ''}\n${files.bridge}`)}`, base).href : null;
  const saved = key ? await cache.match(key) : null;
  let start = saved ? 'cached' : 'boot';
  let heap = saved ? new Uint8Array(await saved.arrayBuffer()) : null;
  if (!heap && allowed) {
    heap = await shippedSnapshot(base, version, files);
    if (heap) start = 'shipped';
  }
  mark('pythonSetup');
  const keep = start === 'shipped' && cache ? heap : null; // for this browser's next load, once this one is done
  let pyodide = null;
  if (heap) {
    try {
      pyodide = await loadPyodide({ ...config, _loadSnapshot: heap });
      mark('loadPyodide');
      installWheels(pyodide, files);
      mark('wheels');
    } catch (error) {
      console.warn(`ruvllm: the Python snapshot did not restore (${error.message}); booting`);
      if (start === 'cached') await cache.delete(key);
      pyodide = null;
      start = 'boot';
    }
  }
  heap = null;
  if (!pyodide) {
    pyodide = await loadPyodide(cache ? { ...config, _makeSnapshot: true } : config);
    mark('loadPyodide');
    installWheels(pyodide, files);
    mark('wheels');
    preload(pyodide);
    mark('import');
    if (cache) await keepSnapshot(pyodide, cache, key);
    mark('snapshot');
  }
  await options.writeModel(pyodide);
  mark('modelFiles');
  const max = options.maxContext ?? null;
  pyodide.runPython(`import ruvllm_bridge\n${RUNTIME} = ruvllm_bridge.Runtime(${JSON.stringify(options.modelDir)}, ` +
    `${max === null ? 'None' : Number(max)})`);
  mark('tokenizer');
  // The Runtime holds the tokenizer's tables now and never reads the files again (the chat template comes from
  // tokenizer_config.json): dropping them gives back ~2 MiB of in-memory files (SmolLM2) to the worker's JS heap.
  for (const name of ['tokenizer.json', TABLES_FILE]) {
    try {
      pyodide.FS.unlink(`${options.modelDir}/${name}`);
    } catch { /* not written there */ }
  }
  pyodide.runPython(`${RUNTIME}.warm()`);
  mark('template');
  if (keep) keepBytes(cache, key, keep); // not awaited: the load does not wait for a 30 MB write
  return { pyodide, runtime: pyodide.globals.get(RUNTIME), restored: start !== 'boot', start };
}

/** What a snapshot holds beyond Pyodide's own boot: py_engine and jinja2 imported. */
function preload(pyodide) {
  pyodide.runPython('import ruvllm_bridge\nruvllm_bridge.preload()');
}

async function keepSnapshot(pyodide, cache, key) {
  try {
    await keepBytes(cache, key, pyodide.makeMemorySnapshot());
  } catch (error) {
    console.warn(`ruvllm: no Python snapshot kept (${error.message})`);
  }
}

function keepBytes(cache, key, heap) {
  return cache.put(key, new Response(heap, { headers: { 'content-length': String(heap.length) } }))
    .catch((error) => console.warn(`ruvllm: no Python snapshot kept (${error.message})`));
}

/** The wheels (index.json lists them in install order: markupsafe before jinja2, so nothing reaches for a
 * CDN) and the bridge, fetched at once. */
async function readWheels(base) {
  const index = await readText(new URL('index.json', base));
  const [wheels, bridge] = await Promise.all([
    Promise.all(JSON.parse(index).map(async (name) => ({ name, bytes: await readBytes(new URL(name, base)) }))),
    readText(BRIDGE_URL)]);
  return { index, wheels, bridge };
}

function installWheels(pyodide, files) {
  for (const { bytes } of files.wheels) pyodide.unpackArchive(bytes, 'wheel', { extractDir: SITE });
  pyodide.FS.writeFile(`${SITE}/ruvllm_bridge.py`, files.bridge);
}

/**
 * The heap named by the wheels folder's python-snapshot.json ({key, file}), when its key matches these
 * files; null when there is none, it is stale, or this runtime cannot gunzip.
 */
async function shippedSnapshot(base, version, files) {
  let manifest;
  try {
    manifest = JSON.parse(await readText(new URL(SHIPPED_MANIFEST, base)));
  } catch {
    return null; // none shipped (the npm package's own wheels folder has none)
  }
  if (typeof DecompressionStream === 'undefined') return null;
  const key = await contentKey(version, files);
  if (manifest.key !== key) {
    console.warn(`ruvllm: ${SHIPPED_MANIFEST} was made from other wheels or another Pyodide; booting Python`);
    return null;
  }
  try {
    return await gunzipExactly(await readBytes(new URL(manifest.file, base)), manifest.heap_bytes);
  } catch (error) {
    console.warn(`ruvllm: the shipped Python snapshot could not be read (${error.message}); booting Python`);
    return null;
  }
}

/**
 * The gzipped heap `gz`, which must unpack to exactly `size` bytes (the manifest's `heap_bytes`, at most
 * MAX_HEAP_BYTES): a corrupt or truncated file fails as soon as it is read past that, never growing a buffer
 * without bound.
 */
async function gunzipExactly(gz, size) {
  if (!Number.isSafeInteger(size) || size <= 0 || size > MAX_HEAP_BYTES) {
    throw new Error(`its manifest's heap_bytes (${size}) is not a size from 1 to ${MAX_HEAP_BYTES}`);
  }
  const heap = new Uint8Array(size);
  const reader = new Blob([gz]).stream().pipeThrough(new DecompressionStream('gzip')).getReader();
  let at = 0;
  for (let part = await reader.read(); !part.done; part = await reader.read()) {
    if (at + part.value.length > size) {
      await reader.cancel().catch(() => {});
      throw new Error(`it unpacks past the ${size} bytes its manifest names`);
    }
    heap.set(part.value, at);
    at += part.value.length;
  }
  if (at !== size) throw new Error(`it unpacks to ${at} bytes, not the ${size} its manifest names`);
  return heap;
}

/**
 * What a shipped snapshot must have been made from: sha256 over Pyodide's version, the bridge and each
 * wheel's name and bytes (web/snapshot.py computes the same to reuse a build's snapshot).
 */
export async function contentKey(version, files) {
  const text = new TextEncoder();
  const parts = [text.encode(`ruvllm-python-snapshot-v1\n${version}\n`), text.encode(files.bridge)];
  for (const { name, bytes } of files.wheels) parts.push(text.encode(`\n${name}\n`), bytes);
  return digest(new Uint8Array(await new Blob(parts).arrayBuffer()), 32);
}

/**
 * Node, at build time: a heap with the wheels in `wheelsURL` installed and preloaded, as a restore expects.
 * @returns {Promise<{key: string, heap: Uint8Array}>}
 */
export async function makeShippedSnapshot(wheelsURL) {
  const { loadPyodide, version } = await import('pyodide');
  const files = await readWheels(absolute(wheelsURL));
  const pyodide = await loadPyodide({ _makeSnapshot: true, stdout: () => {}, stderr: () => {} });
  installWheels(pyodide, files);
  preload(pyodide);
  return { key: await contentKey(version, files), heap: pyodide.makeMemorySnapshot() };
}

/** A hex SHA-256 of text or bytes, its first `bytes` bytes. */
async function digest(data, bytes = 12) {
  const input = typeof data === 'string' ? new TextEncoder().encode(data) : data;
  const hash = new Uint8Array(await crypto.subtle.digest('SHA-256', input));
  return Array.from(hash.slice(0, bytes), (b) => b.toString(16).padStart(2, '0')).join('');
}

/** A folder URL (with its trailing slash) resolved against the page or worker location. */
function absolute(url) {
  const u = new URL(String(url), globalThis.location?.href);
  if (!u.pathname.endsWith('/')) u.pathname += '/';
  return u;
}
