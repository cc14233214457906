// Driven by tests/web/test_npm_speculative.py inside a scratch project that installed the packed `ruvllm`
// tarball: each model loaded twice (speculation off, then on), the same requests on both.
//   node speculative.mjs SPEC.json  ->  one JSON object on stdout
//   SPEC: {"models": [{"name", "path", "precision"}], "requests": [{"name", "kind": "text"|"chat", ...request}],
//          "speculative": {...}, "bad": {...}}
import { readFileSync } from 'node:fs';
import { createEngine, InvalidRequestError } from 'ruvllm';

const spec = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const out = { runs: {}, load: {}, errors: {} };

async function answer(engine, { name, kind, ...request }) {
  const api = kind === 'chat' ? engine.chat.completions : engine.completions;
  if (!request.stream) {
    const done = await api.create({ ...request, return_token_ids: true });
    const choice = done.choices[0];
    return { token_ids: choice.token_ids, text: choice.text ?? choice.message.content, stats: engine.lastStats };
  }
  const ids = [];
  let text = '';
  for await (const chunk of await api.create({ ...request, return_token_ids: true })) {
    ids.push(...(chunk.choices[0].token_ids ?? []));
    text += chunk.choices[0].text ?? chunk.choices[0].delta?.content ?? '';
  }
  return { token_ids: ids, text, stats: engine.lastStats };
}

for (const m of spec.models) {
  for (const [mode, speculative] of [['off', undefined], ['on', spec.speculative]]) {
    const engine = await createEngine({ model: m.path, precision: m.precision, runtime: 'web', speculative });
    out.load[`${m.name}/${mode}`] = engine.stats.speculative;
    for (const request of spec.requests) out.runs[`${m.name}/${mode}/${request.name}`] = await answer(engine, request);
    await engine.dispose();
  }
}
try {
  await createEngine({ model: spec.models[0].path, precision: spec.models[0].precision, runtime: 'web',
    speculative: spec.bad });
} catch (error) {
  out.errors.bad = { name: error.name, invalid: error instanceof InvalidRequestError, param: error.param,
    message: error.message };
}
process.stdout.write(JSON.stringify(out));
