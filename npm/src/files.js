// Reading an export: a URL (fetch, chunked with progress, cached with the Cache API) or, in Node, a folder.

import { IS_NODE } from './ort.js';
import { ModelNotFoundError } from './errors.js';

export const CACHE_NAME = 'ruvllm-models-v1';

/** True for http(s)/blob/data URLs (and file: URLs, read from disk in Node). */
function isUrl(source) {
  return source instanceof URL || /^[a-z][a-z0-9+.-]*:\/\//i.test(String(source));
}

/** The model folder as a URL ending in '/'; a plain string in Node is a local path. */
export async function modelBase(source) {
  if (IS_NODE && !isUrl(source)) {
    const { pathToFileURL } = await import('node:url');
    const { resolve } = await import('node:path');
    return pathToFileURL(resolve(String(source)) + '/');
  }
  const base = new URL(String(source), globalThis.location?.href);
  if (!base.pathname.endsWith('/')) base.pathname += '/';
  return base;
}

export async function readBytes(url) {
  return (await fetchFile(new URL(url), {})).bytes;
}

export async function readText(url) {
  return new TextDecoder().decode(await readBytes(url));
}

/** Whether a file exists (a missing one is not an error here). */
export async function exists(url) {
  url = new URL(url);
  if (url.protocol === 'file:') {
    const { access } = await import('node:fs/promises');
    return access(url).then(() => true, () => false);
  }
  if (await cachedResponse(url)) return true;
  const res = await fetch(url, { method: 'HEAD' }).catch(() => null);
  return !!res?.ok;
}

/**
 * The bytes of one file. `onProgress({file, loaded, total, cached})` reports as chunks arrive;
 * `cache` keeps a fetched file in the Cache API so a reload does not download it again.
 * @returns {Promise<{bytes: Uint8Array, fromCache: boolean}>}
 */
export async function fetchFile(url, { onProgress, cache = false, label } = {}) {
  const file = label ?? url.pathname.split('/').pop();
  if (url.protocol === 'file:') {
    const { readFile } = await import('node:fs/promises');
    let bytes;
    try {
      bytes = new Uint8Array(await readFile(url));
    } catch (error) {
      throw new ModelNotFoundError(`${decodeURIComponent(url.pathname)} does not exist (${error.code ?? error.message})`);
    }
    onProgress?.({ file, loaded: bytes.length, total: bytes.length, cached: false });
    return { bytes, fromCache: false };
  }
  const hit = cache ? await cachedResponse(url) : null;
  let response = hit;
  if (!response) {
    onProgress?.({ file, loaded: 0, total: 0, cached: false }); // a download starts: its size comes with the headers
    try {
      response = await fetch(url);
    } catch (error) {
      throw new ModelNotFoundError(`could not fetch ${url.href}: ${error.message}`, { cause: error });
    }
    if (!response.ok) {
      throw new ModelNotFoundError(`${url.href}: HTTP ${response.status} ${response.statusText}`.trim());
    }
  }
  const bytes = await readChunks(response, (loaded, total) => onProgress?.({ file, loaded, total, cached: !!hit }));
  if (cache && !hit) await storeInCache(url, bytes, response.headers.get('content-type'));
  return { bytes, fromCache: !!hit };
}

/** The body read chunk by chunk into one preallocated buffer when the length is known. */
async function readChunks(response, progress) {
  const total = Number(response.headers.get('content-length')) || 0;
  if (!response.body) {
    const bytes = new Uint8Array(await response.arrayBuffer());
    progress(bytes.length, bytes.length);
    return bytes;
  }
  const reader = response.body.getReader();
  let buffer = new Uint8Array(total || 1 << 20);
  let loaded = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    if (loaded + value.length > buffer.length) {
      const grown = new Uint8Array(Math.max(buffer.length * 2, loaded + value.length));
      grown.set(buffer.subarray(0, loaded));
      buffer = grown;
    }
    buffer.set(value, loaded);
    loaded += value.length;
    progress(loaded, total || loaded);
  }
  progress(loaded, loaded);
  return loaded === buffer.length ? buffer : buffer.slice(0, loaded);
}

async function openCache() {
  if (typeof caches === 'undefined') return null;
  try {
    return await caches.open(CACHE_NAME);
  } catch {
    return null; // opaque origins and some private modes refuse the Cache API: download every time
  }
}

async function cachedResponse(url) {
  const cache = await openCache();
  return cache ? (await cache.match(url.href)) ?? null : null;
}

async function storeInCache(url, bytes, type) {
  const cache = await openCache();
  if (!cache) return;
  const headers = { 'content-type': type ?? 'application/octet-stream', 'content-length': String(bytes.length) };
  try {
    await cache.put(url.href, new Response(bytes, { headers }));
  } catch (error) {
    console.warn(`ruvllm: could not cache ${url.href}: ${error.message}`);
  }
}

/** Empty the model cache; returns whether there was one. */
export async function clearModelCache() {
  return typeof caches === 'undefined' ? false : caches.delete(CACHE_NAME);
}

export const RANGE_BYTES = 16 << 20; // one request's share of a large file
const PARALLEL = 4; // ranges in flight at once

/**
 * A file read straight into memory that `alloc(bytes)` gives (the wasm kernels' heap): no second copy in
 * JavaScript. Over HTTP a large file comes as parallel Range requests of RANGE_BYTES, each streamed into its
 * place as it arrives (a server that ignores Range sends it whole, streamed the same way); with `cache`, each
 * range is kept in the Cache API (under the file's URL with `?ruvllm-range=START-END`, and the list of them
 * under `?ruvllm-ranges`), so a reload reads them back from disk into the same memory, never a second copy.
 * `onProgress({file, loaded, total, cached})` counts bytes across the ranges.
 * @returns {Promise<number>} where the bytes start
 */
export async function fetchInto(url, alloc, { onProgress, cache = false, label } = {}) {
  const file = label ?? url.pathname.split('/').pop();
  if (url.protocol === 'file:') return readFileInto(url, alloc, (loaded, total) => onProgress?.({ file, loaded,
    total, cached: false }));
  const store = cache ? await openCache() : null;
  const listed = store ? await store.match(rangeKey(url, 'ranges')) : null;
  if (listed) {
    const { total, ranges } = await listed.json();
    const at = alloc(total);
    const count = counter(file, total, true, onProgress);
    await inParallel(ranges.map(([a, b]) => async () => {
      const hit = await store.match(rangeKey(url, `range=${a}-${b}`));
      if (!hit) throw new ModelNotFoundError(`the cached ${file} lost its range ${a}-${b}: clear the model cache`);
      await streamInto(hit, alloc, at + a, b - a, count);
    }));
    return at;
  }
  const first = await get(url, `bytes=0-${RANGE_BYTES - 1}`);
  const total = first.status === 206 ? rangeTotal(first) : Number(first.headers.get('content-length')) || 0;
  if (!total || !first.body) return wholeInto(url, first, alloc, file, onProgress, store);
  const at = alloc(total);
  const count = counter(file, total, false, onProgress);
  const ranges = [];
  for (let a = 0; a < total; a += RANGE_BYTES) ranges.push([a, Math.min(total, a + RANGE_BYTES)]);
  if (first.status !== 206) ranges.splice(1); // no Range support: the one response holds everything
  if (first.status !== 206) ranges[0][1] = total;
  await inParallel(ranges.map(([a, b], i) => async () => {
    const response = i === 0 ? first : await get(url, `bytes=${a}-${b - 1}`);
    if (i > 0 && response.status !== 206) throw new ModelNotFoundError(`${url.href} answered a range with ${response.status}`);
    const kept = store ? store.put(rangeKey(url, `range=${a}-${b}`), new Response(response.clone().body,
      { headers: { 'content-length': String(b - a) } })).catch(warnCache(url)) : null;
    await streamInto(response, alloc, at + a, b - a, count);
    await kept;
  }));
  if (store) {
    await store.put(rangeKey(url, 'ranges'), new Response(JSON.stringify({ total, ranges }),
      { headers: { 'content-type': 'application/json' } })).catch(warnCache(url));
  }
  return at;
}

function rangeKey(url, what) {
  const key = new URL(url);
  key.searchParams.set('ruvllm', what);
  return key.href;
}

async function get(url, range) {
  let response;
  try {
    response = await fetch(url, { headers: { Range: range } });
  } catch (error) {
    throw new ModelNotFoundError(`could not fetch ${url.href}: ${error.message}`, { cause: error });
  }
  if (!response.ok) throw new ModelNotFoundError(`${url.href}: HTTP ${response.status} ${response.statusText}`.trim());
  return response;
}

function rangeTotal(response) {
  const match = /\/(\d+)\s*$/.exec(response.headers.get('content-range') ?? '');
  return match ? Number(match[1]) : 0;
}

function counter(file, total, cached, onProgress) {
  let loaded = 0;
  return (n) => {
    loaded += n;
    onProgress?.({ file, loaded, total, cached });
  };
}

/** Run the tasks PARALLEL at a time; the first failure fails the whole. */
async function inParallel(tasks) {
  let next = 0;
  const worker = async () => {
    while (next < tasks.length) await tasks[next++]();
  };
  await Promise.all(Array.from({ length: Math.min(PARALLEL, tasks.length) }, worker));
}

/** length bytes of the response's body into memory at `at`. A BYOB reader fills one reused 1 MiB buffer
 * (wasm's shared memory cannot be handed to a reader): no garbage chunk per read, which on a 1 GB model
 * stayed in the tab until the next collection. */
async function streamInto(response, alloc, at, length, count) {
  let byob = null;
  try {
    byob = response.body.getReader({ mode: 'byob' });
  } catch {
    byob = null; // a stream that is not a byte stream
  }
  const reader = byob ?? response.body.getReader();
  let buffer = new ArrayBuffer(1 << 20);
  let loaded = 0;
  for (;;) {
    const { done, value } = byob ? await byob.read(new Uint8Array(buffer, 0, Math.min(buffer.byteLength,
      Math.max(1, length - loaded)))) : await reader.read();
    if (done) break;
    if (loaded + value.length > length) throw new ModelNotFoundError(`${response.url} is longer than expected`);
    alloc.view(at + loaded, value.length).set(value);
    loaded += value.length;
    count(value.length);
    if (byob) buffer = value.buffer;
    if (byob && loaded === length) {
      await byob.cancel().catch(() => {});
      break;
    }
  }
  if (loaded !== length) throw new ModelNotFoundError(`${response.url} ended after ${loaded} of ${length} bytes`);
}

/** A body of unknown length (compressed): one buffer, then copied in. */
async function wholeInto(url, response, alloc, file, onProgress, store) {
  const bytes = await readChunks(response, (loaded, total) => onProgress?.({ file, loaded, total, cached: false }));
  const at = alloc(bytes.length);
  alloc.view(at, bytes.length).set(bytes);
  if (store) await storeInCache(url, bytes, response.headers.get('content-type'));
  return at;
}

function warnCache(url) {
  return (error) => console.warn(`ruvllm: could not cache ${url.href}: ${error.message}`);
}

async function readFileInto(url, alloc, progress) {
  const { open } = await import('node:fs/promises');
  let handle;
  try {
    handle = await open(url);
  } catch (error) {
    throw new ModelNotFoundError(`${decodeURIComponent(url.pathname)} does not exist (${error.code ?? error.message})`);
  }
  try {
    const { size } = await handle.stat();
    const at = alloc(size);
    const step = 8 << 20;
    for (let done = 0; done < size;) {
      const n = Math.min(step, size - done);
      const { bytesRead } = await handle.read(alloc.view(at + done, n), 0, n, done);
      if (!bytesRead) throw new ModelNotFoundError(`${url.pathname} ended early`);
      done += bytesRead;
      progress(done, size);
    }
    return at;
  } finally {
    await handle.close();
  }
}

