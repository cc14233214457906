// Driven by tests/web/test_wasm_kernels.py: the kernels' float16 widening (qdot.h half4 / half1, which read the
// data file's scales in place) over every finite half, and rk_halves_finite's answers.
//   node wasm_halves.mjs NPM_SRC -> one JSON line {widened: base64 float32 [n], finite: [...]}
import { pathToFileURL } from 'node:url';

const [src] = process.argv.slice(2);
const { loadKernels } = await import(pathToFileURL(`${src}/kernels.js`).href);
const kernels = await loadKernels({ threads: 1 });
const x = kernels.exports;
const finite = [];
for (let h = 0; h < 65536; h++) if ((h & 0x7c00) !== 0x7c00) finite.push(h);
const n = finite.length + 3; // + 3: a tail the SIMD loop leaves to half1
const at = kernels.alloc(2 * n);
const out = kernels.alloc(4 * n);
const halves = new Uint16Array(kernels.memory.buffer, at, n);
halves.set(finite);
halves.set(finite.slice(0, 3), finite.length);
x.rk_widen_halves(at, out, n);
const widened = Buffer.from(new Uint8Array(kernels.memory.buffer, out, 4 * n).slice()).toString('base64');
const answers = [x.rk_halves_finite(at, n)];
for (const bad of [0x7c00, 0xfc00, 0x7e00, 0x7c01]) { // +inf, -inf, NaNs: in the SIMD part and in the tail
  for (const where of [5, n - 1]) {
    const keep = halves[where];
    halves[where] = bad;
    answers.push(x.rk_halves_finite(at, n));
    halves[where] = keep;
  }
}
kernels.dispose();
process.stdout.write(`${JSON.stringify({ widened, finite: answers })}\n`);
