// Driven by benchmarks/web_spec.py: spec_core.js in Node on the npm package of this checkout (npm/src).
//   node spec_bench.mjs SPEC.json  ->  one JSON object on stdout (progress on stderr)
import { readFileSync } from 'node:fs';
import { createEngine } from '../../npm/src/index.js';
import { WasmBackend } from '../../npm/src/wasm_backend.js';
import { specBench } from './spec_core.js';

const spec = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const contract = JSON.parse(readFileSync(`${spec.model}/ruvllm_contract.json`, 'utf8'));
const out = await specBench(spec, { createEngine, WasmBackend, model: spec.model, contract,
  engineOptions: { model: spec.model, runtime: 'web' }, log: (line) => process.stderr.write(`${line}\n`) });
process.stdout.write(JSON.stringify(out));
