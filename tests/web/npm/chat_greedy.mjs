// Driven by tests/web/test_npm.py in the scratch project: one model, greedy chat replies, load and decode stats.
// node chat_greedy.mjs SPEC.json  ->  {"token_ids": [[...], ...], "load": engine.stats, "load_s": s}
//   SPEC: {"path", "precision", "chats": [[message, ...], ...], "max_tokens", "runtime"}
import { readFileSync } from 'node:fs';
import { createEngine } from 'ruvllm';

const spec = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const started = performance.now();
const engine = await createEngine({ model: spec.path, precision: spec.precision, runtime: spec.runtime });
const loadS = (performance.now() - started) / 1000;
const tokenIds = [];
for (const messages of spec.chats) {
  const r = await engine.chat.completions.create({ messages, max_tokens: spec.max_tokens, temperature: 0,
    ignore_eos: true, return_token_ids: true });
  tokenIds.push(r.choices[0].token_ids);
}
process.stdout.write(JSON.stringify({ token_ids: tokenIds, load: engine.stats, load_s: loadS }));
await engine.dispose();
