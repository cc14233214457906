// Driven by tests/web/test_wasm_kernels.py: the page's own wasm kernels (npm/src/wasm_backend.js) on a web export,
// prefill then greedy decode; then the same tokens again through verify passes (speculative decoding's, with a
// rollback between), whose rows must be decode's bits (verify_mismatches: values that differ).
//   node wasm_decode.mjs NPM_SRC EXPORT_DIR GRAPH THREADS IDS_JSON STEPS -> one JSON line
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';

const [src, dir, file, threads, idsJson, steps] = process.argv.slice(2);
const { WasmBackend } = await import(pathToFileURL(`${src}/wasm_backend.js`).href);
const entry = JSON.parse(readFileSync(`${dir}/ruvllm_contract.json`, 'utf8')).files[file];
const backend = await WasmBackend.load(pathToFileURL(`${dir}/`), { file, engine: entry.engine }, { threads: Number(threads) });
// attention below this position on the calling thread, above it over the pool (engine.c serial_attend): both here
backend.kernels.exports.rk_set_serial_attend(JSON.parse(idsJson).length + Math.floor(Number(steps) / 2));
const argmax = (r) => r.reduce((best, v, i) => (v > r[best] ? i : best), 0);
let row = await backend.prefill(JSON.parse(idsJson));
const logits = [Array.from(row)];
const tokens = [];
for (let i = 0; i < Number(steps); i++) {
  tokens.push(argmax(row));
  row = await backend.decode(tokens.at(-1));
  logits.push(Array.from(row));
}
// Verify: the first 5 tokens in one pass, roll the last 2 back (as rejected drafts), then the rest in one pass.
const V = row.length;
let mismatches = 0;
const same = (rows, from) => {
  for (let r = 0; r < rows.length / V; r++) {
    const want = logits[from + r];
    for (let i = 0; i < V; i++) if (!Object.is(rows[r * V + i], want[i])) mismatches += 1;
  }
};
await backend.prefill(JSON.parse(idsJson));
same(await backend.verify(tokens.slice(0, 5)), 1);
backend.rollback(2);
same(await backend.verify(tokens.slice(3)), 4);
backend.release(); // ends the kernels' threads, so Node exits once stdout is flushed
process.stdout.write(`${JSON.stringify({ tokens, logits, runtime: backend.runtimeName, verify_mismatches: mismatches })}\n`);
