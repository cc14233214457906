// The browser half of benchmarks/web_bench.py: one run of ruvllm's engine (Web Worker, as the demo
// page) or of transformers.js (main thread) on the same export folder, timed the same way:
// load (everything before the first request), time to first token, decode tokens/s.
import { createEngine } from './ruvllm/index.js';

const here = (path) => new URL(path, location.href).href;

function rates(started, stamps) {
  const [first, last] = [stamps[0], stamps.at(-1)];
  return { ttftMs: first - started, tokens: stamps.length,
    decodeTokPerS: stamps.length > 1 ? (stamps.length - 1) / ((last - first) / 1000) : 0 };
}

export async function ours({ model, precision = 'auto', file = null, threads = 2, prompt, tokens, device = 'wasm' }) {
  const t0 = performance.now();
  const engine = await createEngine({ model: here(`models/${model}/`), precision, file, threads, worker: true, device,
    pyodideURL: here('pyodide/'), wasmPaths: here('ort/'), ortURL: here('ort/ort.wasm.min.mjs'),
    ortWebgpuURL: here('ort/ort.webgpu.min.mjs'),
    wheelsURL: here('wheels/'), workerURL: here('ruvllm/worker.js') });
  const loadMs = performance.now() - t0;
  const stamps = [];
  const started = performance.now();
  const chunks = await engine.completions.create({ prompt, max_tokens: tokens, temperature: 0, ignore_eos: true,
    stream: true, return_token_ids: true });
  for await (const chunk of chunks) {
    for (const _ of chunk.choices[0].token_ids ?? []) stamps.push(performance.now());
  }
  const last = engine.lastStats ?? {};
  // the decode passes' own time (the forward pass alone, without the loop's Python and messages between them)
  const forwardTokPerS = last.decodeMs && last.forwardPasses > 1 ? (last.forwardPasses - 1) / (last.decodeMs / 1000) : 0;
  const out = { engine: 'ruvllm', loadMs, ...engine.stats, ...rates(started, stamps), promptTokens: last.promptTokens,
    forwardTokPerS, uaMemory: await memory() };
  await engine.dispose();
  return out;
}

export async function transformersjs({ model, dtype, threads = 2, prompt, tokens }) {
  const t0 = performance.now();
  const tjs = await import('./tjs/transformers.web.min.js');
  const bootMs = performance.now() - t0;
  tjs.env.allowRemoteModels = false;
  tjs.env.allowLocalModels = true;
  tjs.env.localModelPath = new URL('models/', location.href).pathname; // a path: its pathJoin mangles 'http://'
  tjs.env.useBrowserCache = false;
  tjs.env.backends.onnx.wasm.wasmPaths = here('tjs/ort/');
  tjs.env.backends.onnx.wasm.numThreads = threads;
  const tokenizer = await tjs.AutoTokenizer.from_pretrained(model);
  const lm = await tjs.AutoModelForCausalLM.from_pretrained(model, { dtype, device: 'wasm' });
  const loadMs = performance.now() - t0;
  const inputs = tokenizer(prompt);
  const stamps = [];
  const streamer = new tjs.TextStreamer(tokenizer, { skip_prompt: true, callback_function: () => {},
    token_callback_function: () => stamps.push(performance.now()) });
  const started = performance.now();
  await lm.generate({ ...inputs, max_new_tokens: tokens, min_new_tokens: tokens, do_sample: false, streamer });
  const out = { engine: `transformers.js ${dtype}`, loadMs, pythonBootMs: bootMs, modelLoadMs: loadMs - bootMs,
    ...rates(started, stamps), promptTokens: inputs.input_ids.dims[1] };
  await lm.dispose();
  return out;
}

/** wllama (llama.cpp compiled to wasm, from npm) on a GGUF file, timed the same way. cold: its cache emptied. */
export async function wllama({ gguf, threads = 2, prompt, tokens, cold = true }) {
  const t0 = performance.now();
  const { Wllama } = await import('./wllama/esm/index.js');
  const w = new Wllama({ default: here('wllama/esm/wasm/wllama.wasm') }, { suppressNativeLog: true });
  if (cold) await w.cacheManager.clear();
  const bootMs = performance.now() - t0;
  await w.loadModelFromUrl(here(gguf), { n_threads: threads, n_ctx: 512, n_gpu_layers: 0 });
  const loadMs = performance.now() - t0;
  const stamps = [];
  const started = performance.now();
  const stream = await w.createCompletion({ prompt, max_tokens: tokens, temperature: 0, ignore_eos: true,
    stream: true });
  for await (const chunk of stream) if (chunk.choices?.[0]?.text !== undefined) stamps.push(performance.now());
  const out = { engine: 'wllama 3.8.1', loadMs, pythonBootMs: bootMs, modelLoadMs: loadMs - bootMs,
    threads: w.getNumThreads?.() ?? threads, ...rates(started, stamps), runtime: 'wllama (llama.cpp wasm)',
    uaMemory: await memory() };
  await w.exit();
  return out;
}

/** Chromium's own count of this page's memory (performance.measureUserAgentSpecificMemory: the JS heaps and
 * ArrayBuffers, wasm memories included, of the page and its workers), in bytes, with the share of each
 * kind of context (Window, DedicatedWorkerGlobalScope...); null where the page is not cross-origin isolated. */
export async function memory() {
  if (!performance.measureUserAgentSpecificMemory) return null;
  const result = await performance.measureUserAgentSpecificMemory();
  const byScope = {};
  for (const entry of result.breakdown) {
    const scope = entry.attribution.map((a) => a.scope).join('+') || 'shared';
    byScope[scope] = (byScope[scope] ?? 0) + entry.bytes;
  }
  return { bytes: result.bytes, byScope };
}
