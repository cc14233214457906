// The one module that imports onnxruntime: onnxruntime-node in Node when it is installed,
// else onnxruntime-web's wasm backend (Node and browsers alike).

import { UnsupportedRuntimeError } from './errors.js';

export const IS_NODE = typeof process !== 'undefined' && !!process.versions?.node && typeof window === 'undefined'
  && typeof importScripts === 'undefined';

/**
 * @param {{runtime?: 'auto'|'node'|'web', wasmPaths?: string, ortURL?: string, threads?: number,
 *   webgpu?: boolean}} [options] webgpu: onnxruntime-web's WebGPU build (browsers)
 * @returns {Promise<{ort: any, name: 'onnxruntime-node'|'onnxruntime-web'}>}
 */
export async function loadOrt(options = {}) {
  const want = options.runtime ?? 'auto';
  if (IS_NODE && want !== 'web') {
    try {
      const ort = await import('onnxruntime-node');
      return { ort: ort.default ?? ort, name: 'onnxruntime-node' };
    } catch (error) {
      if (want === 'node') {
        throw new UnsupportedRuntimeError(`onnxruntime-node could not be loaded (${error.message}); ` +
          'install it (ONNXRUNTIME_NODE_INSTALL=skip npm install onnxruntime-node) or use runtime: "web"');
      }
    }
  }
  if (typeof WebAssembly !== 'object') {
    throw new UnsupportedRuntimeError('this browser has no WebAssembly; ruvllm needs a browser from 2021 or later');
  }
  // Node resolves 'onnxruntime-web' to its Node build; browsers take the wasm-only build, or the WebGPU one.
  // A worker has no import map: the page passes the module's URL (ortURL) instead.
  const mod = IS_NODE ? await import('onnxruntime-web')
    : options.ortURL ? await import(/* @vite-ignore */ new URL(options.ortURL, globalThis.location?.href).href)
      : options.webgpu ? await import('onnxruntime-web/webgpu') : await import('onnxruntime-web/wasm');
  const ort = mod.default ?? mod;
  if (options.wasmPaths) ort.env.wasm.wasmPaths = new URL(options.wasmPaths, globalThis.location?.href).href;
  // Threads need SharedArrayBuffer: cross-origin isolated pages, and Node.
  const isolated = IS_NODE || globalThis.crossOriginIsolated === true;
  const cores = globalThis.navigator?.hardwareConcurrency ?? 2;
  ort.env.wasm.numThreads = isolated ? Math.max(1, options.threads ?? Math.min(4, cores)) : 1;
  return { ort, name: 'onnxruntime-web' };
}

/**
 * An inference session over one graph, given as bytes (web) or a path (node).
 * @param {{ort: any, name: string}} runtime
 * @param {Uint8Array|string} model
 * @param {{threads?: number, configEntries?: Object<string, string>,
 *   externalData?: {path: string, data: Uint8Array|string}[]}} [options]
 *   configEntries: session config entries an export file asks for (ruvllm_contract.json's
 *   `session_options`, e.g. {"session.disable_quant_qdq": "1"} so web weights are dequantized once).
 */
export async function createSession(runtime, model, options = {}) {
  const ep = runtime.name === 'onnxruntime-node' ? 'cpu' : options.device === 'webgpu' ? 'webgpu' : 'wasm';
  const opts = { executionProviders: [ep], graphOptimizationLevel: 'all' };
  if (ep === 'webgpu') { // the KV cache stays on the GPU between steps; only the logits come back
    opts.preferredOutputLocation = Object.fromEntries((options.outputNames ?? []).map(
      (n) => [n, n.startsWith('present.') ? 'gpu-buffer' : 'cpu']));
  }
  if (options.threads && runtime.name === 'onnxruntime-node') opts.intraOpNumThreads = options.threads;
  if (options.externalData?.length) opts.externalData = options.externalData;
  const extra = {};
  for (const [key, value] of Object.entries(options.configEntries ?? {})) {
    const [group, name] = key.split('.', 2); // onnxruntime's JS API nests "session.x" as {session: {x}}
    (extra[group] ??= {})[name] = value;
  }
  if (Object.keys(extra).length) opts.extra = extra;
  return runtime.ort.InferenceSession.create(model, opts);
}

/** A tensor of `type` ('int64', 'float32', 'float16') over data with dims. */
export function tensor(runtime, type, data, dims) {
  return new runtime.ort.Tensor(type, data, dims);
}
