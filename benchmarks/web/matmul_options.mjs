// The Node half of benchmarks/web_matmul_options.py: time one decode token's quantized matmuls of SmolLM2's shapes.
//   node matmul_options.mjs ort NPM_PROJECT GRAPHS_DIR THREADS VARIANTS   (onnxruntime-web from that project)
//   node matmul_options.mjs kernels NPM_SRC "" THREADS                    (the package's own wasm kernels)
// Prints one JSON line {name: {per_op_ms, decode_token_ms}}: 30 x (qkv + o + gate_up + down) + the head.
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';

const [mode, where, graphs, threadsArg, variants] = process.argv.slice(2);
const threads = Number(threadsArg);
const SHAPES = { qkv: [576, 960], o: [576, 576], gu: [576, 3072], down: [1536, 576], head: [576, 49152] };
const out = {};
const token = (per) => Object.entries(per).reduce((t, [n, ms]) => t + (n.startsWith('head') ? ms : 30 * ms), 0);

if (mode === 'ort') {
  const require = createRequire(`${where}/package.json`);
  const ort = require('onnxruntime-web');
  const version = JSON.parse(readFileSync(`${where}/node_modules/onnxruntime-web/package.json`)).version;
  ort.env.wasm.numThreads = threads;
  for (const v of variants.split(',')) {
    const per = {};
    for (const [n, [K]] of Object.entries(SHAPES)) {
      const s = await ort.InferenceSession.create(readFileSync(`${graphs}/${n}_${v}.onnx`),
        { executionProviders: ['wasm'], graphOptimizationLevel: 'all' });
      const x = new ort.Tensor('float32', Float32Array.from({ length: K }, () => Math.random() - 0.5), [1, K]);
      for (let i = 0; i < 3; i++) await s.run({ x });
      const [reps, iters] = n === 'head' ? [1, 10] : [8, 30];
      const t = performance.now();
      for (let i = 0; i < iters; i++) await s.run({ x });
      per[n] = (performance.now() - t) / iters / reps;
      await s.release();
    }
    out[`onnxruntime-web ${version} ${v}`] = { per_op_ms: per, decode_token_ms: token(per) };
  }
} else {
  const { loadKernels } = await import(pathToFileURL(`${where}/kernels.js`).href);
  const k = await loadKernels({ threads });
  const e = k.exports;
  const f32 = (at, n) => new Float32Array(k.memory.buffer, at, n);
  for (const [bits, mins] of [[4, false], [4, true], [8, false]]) {
    const per = {};
    for (const [n, [K, N]] of Object.entries(SHAPES)) {
      const b = n === 'head' ? 8 : bits; // SmolLM2's head is Q8_0
      const blocks = K / 32;
      const codes = k.alloc(N * blocks * 32 * b / 8);
      k.bytes(codes, N * blocks * 32 * b / 8).set(Uint8Array.from({ length: N * blocks * 32 * b / 8 }, () => Math.random() * 256));
      const d = k.alloc(4 * N * blocks);
      f32(d, N * blocks).fill(0.01);
      const m = mins && n !== 'head' ? k.alloc(4 * N * blocks) : 0;
      if (m) f32(m, N * blocks).fill(0.001);
      e.rk_model_init(K, 1, 1, 32, K, 0, N, 64, 1e-6, 1);
      e.rk_set_proj(-1, 0, codes, d, m, 0, b, N, K);
      e.rk_set_tables(0, 0, 0, 1);
      const x = k.alloc(4 * K);
      f32(x, K).set(Float32Array.from({ length: K }, () => Math.random() - 0.5));
      const iters = n === 'head' ? 10 : 100;
      for (let i = 0; i < 3; i++) e.rk_bench_head(x);
      const t = performance.now();
      for (let i = 0; i < iters; i++) e.rk_bench_head(x);
      per[n] = (performance.now() - t) / iters;
    }
    out[`ruvllm kernels ${k.relaxed ? 'relaxed SIMD' : 'SIMD128'} q${bits}${mins ? '+mins' : ''} (${threads} thr)`] =
      { per_op_ms: per, decode_token_ms: token(per) };
  }
  k.dispose();
}
process.stdout.write(`${JSON.stringify(out)}\n`);
