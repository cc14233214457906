// Driven by tests/web/test_npm.py in the scratch project: one model, one greedy completion, load stats.
// node complete_greedy.mjs SPEC.json  ->  {"token_ids": [...], "load": engine.stats}
//   SPEC: {"path", "precision", "prompt", "max_tokens", "runtime"}
import { readFileSync } from 'node:fs';
import { createEngine } from 'ruvllm';

const spec = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const engine = await createEngine({ model: spec.path, precision: spec.precision, runtime: spec.runtime });
const r = await engine.completions.create({ prompt: spec.prompt, max_tokens: spec.max_tokens, temperature: 0,
  ignore_eos: true, return_token_ids: true });
process.stdout.write(JSON.stringify({ token_ids: r.choices[0].token_ids, load: engine.stats }));
await engine.dispose();
