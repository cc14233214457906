// The measurement of benchmarks/web_spec.py, shared by Node (spec_bench.mjs) and Chromium (the page's module):
// the kernels' pass cost by rows, then one engine answering every prompt with speculation off and on.
//   spec: {precision, threads, rounds, max_tokens, cost_reps, speculative, sets: {name: [prompt...]}}
//   env: {createEngine, WasmBackend, model (URL or path of the export folder), engineOptions, contract, log}

/** ms of one pass of n rows (decode at n = 1, else verify, then rolled back) after a 64-token prompt, the row
 * counts interleaved, median of spec.cost_reps. */
async function stepCosts(spec, env) {
  const file = spec.precision === 'int4' ? 'onnx/model_q4_web.onnx' : 'onnx/model_quantized_web.onnx';
  const base = env.model instanceof URL ? env.model : new URL(`file://${env.model}/`);
  const backend = await env.WasmBackend.load(base, { file, engine: env.contract.files[file].engine },
    { threads: spec.threads, cache: false, kernelsURL: env.kernelsURL });
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
  const runtime = backend.runtimeName;
  backend.release();
  const median = (v) => v.sort((a, b) => a - b)[Math.floor(v.length / 2)];
  return { runtime, ms: Object.fromEntries(counts.map((n) => [n, median(times[n])])) };
}

export async function specBench(spec, env) {
  const costs = await stepCosts(spec, env);
  env.log(`step ms by rows (${costs.runtime}): ${JSON.stringify(costs.ms)}`);
  const engine = await env.createEngine({ ...env.engineOptions, precision: spec.precision, threads: spec.threads,
    speculative: spec.speculative });
  const runs = [];
  for (let round = 0; round < spec.rounds; round++) {
    for (const [set, prompts] of Object.entries(spec.sets)) {
      for (const [i, prompt] of prompts.entries()) {
        const order = (round + i) % 2 === 0 ? [false, true] : [true, false]; // alternate which goes first
        for (const on of order) {
          const done = await engine.chat.completions.create({ messages: [{ role: 'user', content: prompt }],
            max_tokens: spec.max_tokens, temperature: 0, return_token_ids: true, speculative: on });
          const s = engine.lastStats;
          runs.push({ round, set, prompt: i, on, token_ids: done.choices[0].token_ids, tokens: s.completionTokens,
            decode_ms: s.totalMs - s.firstTokenMs, first_token_ms: s.firstTokenMs, forward_passes: s.forwardPasses,
            speculative: s.speculative });
          env.log(`round ${round} ${set} #${i} ${on ? 'on ' : 'off'} ${s.completionTokens} tokens ` +
            `${((s.completionTokens - 1) / ((s.totalMs - s.firstTokenMs) / 1000)).toFixed(1)} tok/s`);
        }
      }
    }
  }
  const load = engine.stats;
  await engine.dispose();
  return { load, runs, step_ms: costs.ms, kernels: costs.runtime };
}
