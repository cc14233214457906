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
