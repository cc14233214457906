// Loading an export folder: its small JSON files into Pyodide's file system, its graph into onnxruntime.

import { createSession } from './ort.js';
import { exists, fetchFile, readText } from './files.js';
import { InvalidRequestError, ModelNotFoundError, RuvllmError } from './errors.js';
import { bpeTables, TABLES_FILE } from './bpe_tables.js';

export { TABLES_FILE };

export const FORMAT_VERSION = 1; // the newest export.contract.FORMAT_VERSION this reader understands
export const GRAPH_FILES = { fp32: 'model.onnx', fp16: 'model_fp16.onnx', int8: 'model_quantized.onnx', int4: 'model_q4.onnx',
  int2: 'model_q2.onnx' }; // int2: only a model quantized to 2 bits (ruvllm export of a 2-bit GPTQ/AWQ model)
const AUTO_ORDER = ['int4', 'int8', 'fp32', 'fp16']; // smallest download first; never 2-bit unasked
const SHARED_FILES = ['config.json', 'generation_config.json', 'tokenizer.json', 'tokenizer_config.json',
  'special_tokens_map.json', 'chat_template.jinja'];
const REQUIRED = new Set(['config.json', 'tokenizer.json']);
export const MODEL_DIR = '/model';

/** The contract of an export, checked: a missing one means the URL is not an export folder. */
export async function readContract(base) {
  let contract;
  try {
    contract = JSON.parse(await readText(new URL('ruvllm_contract.json', base)));
  } catch (error) {
    if (error instanceof ModelNotFoundError) {
      throw new ModelNotFoundError(`no ruvllm export at ${base.href} (ruvllm_contract.json is missing); ` +
        'create one with `ruvllm export MODEL --out DIR --target web`');
    }
    throw error;
  }
  if (contract.format_version > FORMAT_VERSION) {
    throw new RuvllmError(`${base.href} has export format ${contract.format_version}; this ruvllm reads up to ` +
      `${FORMAT_VERSION}: upgrade ruvllm or re-export`);
  }
  return contract;
}

/**
 * Which graph to load. The export's manifest (`runtimes` in ruvllm_contract.json, written by
 * export/manifest.py) names the file each runtime should load per precision and by default;
 * exports without one fall back to the transformers.js file names, smallest download first.
 */
export async function pickGraph(base, contract, runtimeName, precision = 'auto', file = null) {
  if (file) { // a file named outright (benchmarks: the same graph transformers.js loads)
    const entry = contract.files?.[file] ?? {};
    return { precision: entry.precision ?? precision, file, kvDtype: entry.kv_dtype ?? contract.kv_dtype,
      configEntries: entry.session_options ?? {}, engine: entry.engine ?? null };
  }
  if (precision !== 'auto' && !GRAPH_FILES[precision]) {
    throw new InvalidRequestError(`unknown precision ${precision}; use auto, ${Object.keys(GRAPH_FILES).join(', ')}`,
      'precision');
  }
  const table = contract.runtimes?.[runtimeName];
  if (table) {
    const file = table[precision === 'auto' ? 'default' : precision];
    if (!file) {
      throw new ModelNotFoundError(`${base.href} has no ${precision} graph for ${runtimeName} ` +
        `(it has ${Object.keys(table).filter((k) => k !== 'default').join(', ') || 'none'})`);
    }
    const entry = contract.files?.[file] ?? {};
    return { precision: entry.precision ?? precision, file, kvDtype: entry.kv_dtype ?? contract.kv_dtype,
      configEntries: entry.session_options ?? {}, engine: entry.engine ?? null };
  }
  const kvDtype = (p) => (p === 'fp16' ? 'float16' : 'float32');
  if (precision !== 'auto') return { precision, file: `onnx/${GRAPH_FILES[precision]}`, kvDtype: kvDtype(precision) };
  for (const p of AUTO_ORDER) {
    const file = `onnx/${GRAPH_FILES[p]}`;
    if (await exists(new URL(file, base))) return { precision: p, file, kvDtype: kvDtype(p) };
  }
  throw new ModelNotFoundError(`${base.href} holds no exported graph (expected onnx/model.onnx or a quantized one)`);
}

/** Copy the export's tokenizer/config/template files into Pyodide's FS at MODEL_DIR. */
export async function writeSharedFiles(pyodide, base, progress) {
  pyodide.FS.mkdirTree(MODEL_DIR);
  for (const name of SHARED_FILES) {
    const url = new URL(name, base);
    if (!REQUIRED.has(name) && !(await exists(url))) continue;
    const { bytes } = await fetchFile(url, { onProgress: progress, cache: true });
    if (name !== 'tokenizer.json') {
      pyodide.FS.writeFile(`${MODEL_DIR}/${name}`, bytes);
      continue;
    }
    const { json, tables } = compactTokenizer(bytes);
    if (tables) pyodide.FS.writeFile(`${MODEL_DIR}/${TABLES_FILE}`, tables);
    pyodide.FS.writeFile(`${MODEL_DIR}/${name}`, json);
  }
}

/**
 * tokenizer.json as the page's Python reads it best. A BPE vocabulary whose ids are 0 .. n - 1 and its merges
 * go to a binary file (bpe_tables.js: int32 arrays and one UTF-8 blob, which Python holds as one bytes
 * object), named by the model's "ruvllm_tables"; the JSON keeps the rest (normalizer, pre-tokenizer, added
 * tokens, decoder, post-processor). Pyodide's heap never shrinks, and json's parse of the vocabulary into
 * Python objects was its high-water mark (SmolLM2: 30 MiB restored, ~7 MiB of tokenizer objects, grown to
 * 36). Where the tables cannot say the same as the JSON, the vocabulary goes as a list of its tokens in id
 * order and merges as "a b" strings where no token holds a space (json parses lists of strings, not 49k-key
 * objects through a key memo). py_engine/tokenizer reads every form; anything else is handed over as it is.
 * @param {Uint8Array} bytes
 * @returns {{json: Uint8Array, tables: Uint8Array|null}} tables: the TABLES_FILE the JSON names, if any
 */
export function compactTokenizer(bytes) {
  let spec;
  try {
    spec = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes));
  } catch {
    return { json: bytes, tables: null }; // Python reports what is wrong with it
  }
  const model = spec?.model;
  const kind = model?.type ?? (model && 'merges' in model ? 'BPE' : undefined); // older files leave it out
  if (kind !== 'BPE' || !model.vocab || typeof model.vocab !== 'object' || Array.isArray(model.vocab) ||
    'ruvllm_tables' in model) {
    return { json: bytes, tables: null };
  }
  const entries = Object.entries(model.vocab);
  const tokens = new Array(entries.length);
  for (const [token, id] of entries) {
    if (!Number.isInteger(id) || id < 0 || id >= tokens.length || tokens[id] !== undefined) {
      return { json: bytes, tables: null };
    }
    tokens[id] = token;
  }
  const merges = model.merges ?? [];
  const prefix = model.continuing_subword_prefix;
  const tables = Array.isArray(merges) && (prefix == null || typeof prefix === 'string')
    ? bpeTables(tokens, model.vocab, merges, prefix ?? '') : null;
  if (tables) {
    delete model.vocab;
    delete model.merges;
    model.type = 'BPE'; // older files leave it out and say it by their merges
    model.ruvllm_tables = TABLES_FILE;
    return { json: new TextEncoder().encode(JSON.stringify(spec)), tables };
  }
  const pairs = merges.length > 0 && Array.isArray(merges[0]);
  if (pairs && merges.every((m) => Array.isArray(m) && m.length === 2 && typeof m[0] === 'string' &&
    typeof m[1] === 'string' && !m[0].includes(' ') && !m[1].includes(' '))) {
    model.merges = merges.map((m) => `${m[0]} ${m[1]}`);
  }
  model.vocab = tokens;
  return { json: new TextEncoder().encode(JSON.stringify(spec)), tables: null };
}

/** The graph's bytes (with progress, from the browser cache when there) and its session. */
export async function loadGraph(runtime, base, graph, { onProgress, threads, device = 'wasm' } = {}) {
  const url = new URL(graph.file, base);
  const options = { threads, configEntries: graph.configEntries, device };
  if (url.protocol === 'file:' && runtime.name === 'onnxruntime-node') {
    const { fileURLToPath } = await import('node:url');
    const path = fileURLToPath(url);
    if (!(await exists(url))) throw new ModelNotFoundError(`${path} does not exist`);
    return createSession(runtime, path, options);
  }
  const { bytes } = await fetchFile(url, { onProgress, cache: true, label: graph.file });
  options.externalData = await externalData(url, graph.file, onProgress);
  options.outputNames = graph.outputNames;
  return createSession(runtime, bytes, options);
}

/**
 * Graphs over 1 GiB keep their weights in `<file>_data`, `<file>_data_1`, ... beside them (export/graph.py);
 * onnxruntime-web needs those bytes handed over under the names the graph refers to.
 */
async function externalData(graphUrl, label, onProgress) {
  const parts = [];
  for (let i = 0; ; i++) {
    const name = `${graphUrl.pathname.split('/').pop()}_data${i ? `_${i}` : ''}`;
    const url = new URL(name, graphUrl);
    if (!(await exists(url))) return parts;
    const { bytes } = await fetchFile(url, { onProgress, cache: true, label: `${label}_data${i ? `_${i}` : ''}` });
    parts.push({ path: name, data: bytes });
  }
}
