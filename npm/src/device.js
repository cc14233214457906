// Which forward pass a model gets (`device` in createEngine):
//
//   Node with onnxruntime-node installed   onnxruntime-node on the export's graph (as before)
//   'webgpu', or 'auto' where navigator.gpu gives an adapter
//                                          onnxruntime-web's WebGPU execution provider on the web graph
//                                          (MatMulNBits and GroupQueryAttention on the GPU, the KV cache kept
//                                          there between steps)
//   'wasm', or 'auto' otherwise            the page's own kernels (wasm_backend.js) where the graph's `engine`
//                                          entry allows and shared memory exists, else onnxruntime-web's wasm
//
// The result says which one runs (stats.device, stats.runtime), so the page can show it.

import { OnnxBackend } from './backend.js';
import { InvalidRequestError, UnsupportedRuntimeError } from './errors.js';
import { kernelsSupported } from './kernels.js';
import { loadGraph, pickGraph } from './model.js';
import { IS_NODE, loadOrt } from './ort.js';
import { WasmBackend } from './wasm_backend.js';

export const DEVICES = ['auto', 'webgpu', 'wasm'];

/** A WebGPU adapter, or null (no navigator.gpu, none offered, or a refusal). */
export async function webgpuAdapter() {
  try {
    return (await globalThis.navigator?.gpu?.requestAdapter()) ?? null;
  } catch {
    return null;
  }
}

/**
 * @returns {Promise<{backend: OnnxBackend|WasmBackend, device: string, runtime: string, precision: string}>}
 */
export async function openBackend(base, contract, options, onFile) {
  const device = options.device ?? 'auto';
  if (!DEVICES.includes(device)) {
    throw new InvalidRequestError(`unknown device ${device}; use ${DEVICES.join(', ')}`, 'device');
  }
  const common = { wasmPaths: options.wasmPaths, ortURL: options.ortURL, threads: options.threads };
  if (IS_NODE && options.runtime !== 'web' && device !== 'webgpu') {
    const runtime = await loadOrt({ ...common, runtime: options.runtime }).catch(() => null);
    if (runtime?.name === 'onnxruntime-node') return onnx(base, contract, runtime, options, onFile, 'cpu');
  }
  const gpu = device === 'wasm' ? null : await webgpuAdapter();
  if (device === 'webgpu' && !gpu) {
    throw new UnsupportedRuntimeError('device "webgpu" was asked for, but navigator.gpu gives no adapter here');
  }
  if (gpu) {
    const runtime = await loadOrt({ ...common, runtime: 'web', webgpu: true, ortURL: options.ortWebgpuURL });
    return onnx(base, contract, runtime, options, onFile, 'webgpu');
  }
  const graph = await pickGraph(base, contract, 'onnxruntime-web', options.precision, options.file);
  if (graph.engine && !graph.engine.unsupported && options.kernels !== false && kernelsSupported()) {
    const backend = await WasmBackend.load(base, graph, { onProgress: onFile, threads: options.threads,
      kernelsURL: options.kernelsURL, mark: options.mark });
    return { backend, device: 'wasm', runtime: backend.runtimeName, precision: graph.precision };
  }
  const runtime = await loadOrt({ ...common, runtime: 'web' });
  return onnx(base, contract, runtime, options, onFile, 'wasm', graph);
}

async function onnx(base, contract, runtime, options, onFile, device, picked = null) {
  const graph = picked ?? await pickGraph(base, contract, runtime.name, options.precision, options.file);
  graph.outputNames = (contract.outputs ?? []).map((o) => o.name);
  const session = await loadGraph(runtime, base, graph, { onProgress: onFile, threads: options.threads, device });
  const backend = new OnnxBackend(runtime, session, { ...contract, kv_dtype: graph.kvDtype }, { device });
  const name = device === 'webgpu' ? `${runtime.name} (WebGPU)` : runtime.name;
  return { backend, device, runtime: name, precision: graph.precision };
}
