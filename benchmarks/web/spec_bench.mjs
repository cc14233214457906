// Driven by benchmarks/web_spec.py: prompt lookup speculation in the npm package (the repo's npm/src) in Node, on
// a web export, alternating each request with speculation off and on in one engine.
//   node spec_bench.mjs SPEC.json  ->  one JSON object on stdout
//   SPEC: {model, precision, threads, rounds, max_tokens, speculative, sets: {name: [prompt...]}}
// Per generation: tokens, decode ms (first token to last, wall: the loop, Python and the forward passes), the
// forward passes and the drafting counts; the token ids, so the caller checks on == off.
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';
import { createEngine } from '../../npm/src/index.js';
import { WasmBackend } from '../../npm/src/wasm_backend.js';

const spec = JSON.parse(readFileSync(process.argv[2], 'utf8'));

// Step costs: ms of one pass of n rows (decode at n = 1, else verify, then rolled back) after a 64-token prompt,
// the row counts interleaved, median of spec.cost_reps.
async function stepCosts() {
  const file = spec.precision === 'int4' ? 'onnx/model_q4_web.onnx' : 'onnx/model_quantized_web.onnx';
  const entry = JSON.parse(readFileSync(`${spec.model}/ruvllm_contract.json`, 'utf8')).files[file];
  const backend = await WasmBackend.load(pathToFileURL(`${spec.model}/`), { file, engine: entry.engine },
    { threads: spec.threads, cache: false });
  const ids = Array.from({ length: 64 }, (_, i) => 100 + 37 * i);
  await backend.prefill(ids);
  const counts = [1, 2, 3, 5, 9];
  const times = Object.fromEntries(counts.map((n) => [n, []]));
  for (let rep = 0; rep < spec.cost_reps; rep++) {
    for (const n of counts) {
      const t = performance.now();
      if (n === 1) await backend.decode(7);
      else await backend.verify(ids.slice(0, n));
      times[n].push(performance.now() - t);
      backend.rollback(n);
    }
  }
  backend.release();
  const median = (v) => v.sort((a, b) => a - b)[Math.floor(v.length / 2)];
  return Object.fromEntries(counts.map((n) => [n, median(times[n])]));
}
const costs = await stepCosts();
process.stderr.write(`step ms by rows: ${JSON.stringify(costs)}\n`);
const engine = await createEngine({ model: spec.model, precision: spec.precision, runtime: 'web',
  threads: spec.threads, speculative: spec.speculative });
const runs = [];
for (let round = 0; round < spec.rounds; round++) {
  for (const [set, prompts] of Object.entries(spec.sets)) {
    for (const [i, prompt] of prompts.entries()) {
      const order = (round + i) % 2 === 0 ? [false, true] : [true, false]; // alternate which goes first
      for (const on of order) {
        const done = await engine.chat.completions.create({ messages: [{ role: 'user', content: prompt }],
          max_tokens: spec.max_tokens, temperature: 0, return_token_ids: true, speculative: on });
        const s = engine.lastStats;
        runs.push({ round, set, prompt: i, on, token_ids: done.choices[0].token_ids,
          tokens: s.completionTokens, decode_ms: s.totalMs - s.firstTokenMs, first_token_ms: s.firstTokenMs,
          forward_passes: s.forwardPasses, speculative: s.speculative });
        process.stderr.write(`round ${round} ${set} #${i} ${on ? 'on ' : 'off'} ${s.completionTokens} tokens ` +
          `${((s.completionTokens - 1) / ((s.totalMs - s.firstTokenMs) / 1000)).toFixed(1)} tok/s\n`);
      }
    }
  }
}
const load = engine.stats;
await engine.dispose();
process.stdout.write(JSON.stringify({ load, runs, step_ms: costs }));
