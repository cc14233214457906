// The in-thread engine: Pyodide (py_engine's shared layer) and onnxruntime in the caller's thread.
// WorkerEngine (worker_engine.js) has the same interface and runs this one inside a Web Worker.

import { argmax } from './backend.js';
import { openBackend } from './device.js';
import { asRuvllmError, EngineDisposedError } from './errors.js';
import { sampleToken } from './sampling.js';
import { bootRuntime } from './python.js';
import { modelBase } from './files.js';
import { MODEL_DIR, readContract, writeSharedFiles } from './model.js';
import * as openai from './openai.js';

export class InThreadEngine {
  /** Use `createEngine`; this only wires the parts together. */
  constructor(parts) {
    Object.assign(this, parts); // pyodide, runtime (Python), backend, info, modelName, stats
    this._queue = Promise.resolve();
    this._disposed = false;
    this.chat = { completions: { create: (request, options) => this._create('chat', request, options) } };
    this.completions = { create: (request, options) => this._create('text', request, options) };
    this.tokenizer = {
      // Async like WorkerEngine's, so a page can swap the two.
      encode: async (text, { addSpecialTokens = true } = {}) => this._call(
        () => JSON.parse(this.runtime.encode(text, addSpecialTokens))),
      decode: async (ids, { skipSpecialTokens = false } = {}) => this._call(
        () => this.runtime.decode(JSON.stringify(ids), skipSpecialTokens)),
    };
  }

  /** @param {import('./index.js').EngineOptions} options */
  static async create(options) {
    const progress = options.onProgress ?? (() => {});
    const stats = { pythonBootMs: 0, modelLoadMs: 0, runtime: '', device: '', precision: '', downloadedBytes: 0,
      cachedBytes: 0 };
    const seen = new Map();
    const onFile = (p) => {
      progress({ stage: 'download', ...p });
      if (p.loaded === p.total) seen.set(p.file, p);
    };
    try {
      const base = await modelBase(options.model);
      const contract = await readContract(base);
      const t0 = performance.now();
      // When each phase of the two chains ended (ms since t0): where a load's time goes.
      stats.phases = {};
      const mark = (phase) => { stats.phases[phase] = Math.round(performance.now() - t0); };
      progress({ stage: 'boot' });
      // Two independent chains: Python (boot, tokenizer, template) and the graph (runtime, download,
      // session). Overlapping them hides most of Pyodide's boot behind the download, or the
      // session creation on a cached reload.
      const python = (async () => {
        const { pyodide, runtime, restored, start } = await bootRuntime({ indexURL: options.pyodideURL,
          wheelsURL: options.wheelsURL, snapshot: options.pythonSnapshot, maxContext: options.maxContext, modelDir: MODEL_DIR,
          mark, writeModel: (p) => writeSharedFiles(p, base, onFile) });
        stats.pythonBootMs = performance.now() - t0;
        stats.pythonRestored = restored;
        stats.pythonStart = start; // 'boot', or the snapshot it restored: 'cached' (this browser's), 'shipped'
        return { pyodide, py: runtime };
      })();
      const forward = (async () => {
        const opened = await openBackend(base, contract, { ...options, mark }, onFile);
        mark('weights');
        progress({ stage: 'device', device: opened.device, runtime: opened.runtime });
        await opened.backend.warm();
        mark('warm');
        stats.modelLoadMs = performance.now() - t0;
        return opened;
      })();
      const [{ pyodide, py }, opened] = await Promise.all([python, forward]);
      const { backend } = opened;
      stats.runtime = opened.runtime;
      stats.device = opened.device;
      stats.precision = opened.precision;
      for (const p of seen.values()) stats[p.cached ? 'cachedBytes' : 'downloadedBytes'] += p.total;
      progress({ stage: 'ready' });
      const info = JSON.parse(py.info());
      backend.switchLength = info.longrope_switch_length;
      try {
        stats.speculative = speculativeStats(py, options.speculative, backend);
      } catch (error) {
        backend.release?.();
        throw error;
      }
      return new InThreadEngine({ pyodide, runtime: py, backend,
        info, modelName: options.modelName ?? String(options.model), stats });
    } catch (error) {
      throw asRuvllmError(error);
    }
  }

  _call(fn) {
    if (this._disposed) throw new EngineDisposedError();
    try {
      return fn();
    } catch (error) {
      throw asRuvllmError(error);
    }
  }

  _create(kind, request, options = {}) {
    if (this._disposed) return Promise.reject(new EngineDisposedError());
    try {
      (kind === 'chat' ? openai.checkChatRequest : openai.checkCompletionRequest)(request);
    } catch (error) {
      return Promise.reject(error);
    }
    const meta = { id: openai.requestId(kind === 'chat' ? 'chatcmpl' : 'cmpl'), created: Math.floor(Date.now() / 1000),
      model: request.model ?? this.modelName, returnTokenIds: !!request.return_token_ids };
    const chunks = this._run(kind, request, meta, options.signal ?? request.signal);
    if (request.stream) return Promise.resolve(streamChunks(kind, chunks, meta, request.stream_options));
    return collect(kind, chunks, meta);
  }

  /** Generations run one at a time: each waits for the one before to finish or be dropped. */
  async *_run(kind, request, meta, signal) {
    let release;
    const turn = this._queue;
    this._queue = new Promise((r) => { release = r; });
    await turn;
    try {
      if (this._disposed) throw new EngineDisposedError();
      yield* this._generate(kind, request, meta, signal);
    } catch (error) {
      throw asRuvllmError(error);
    } finally {
      release();
    }
  }

  async *_generate(kind, request, meta, signal) {
    const r = this.runtime;
    const ids = JSON.parse(kind === 'chat' ? r.chat_ids(JSON.stringify({ messages: request.messages,
      chat_template_kwargs: request.chat_template_kwargs, tools: request.tools })) : r.prompt_ids(request.prompt));
    const pass = { rows: null, params: null, sampled: [] }; // the last forward pass's logits [n, V]; output ids
    const generation = r.start(JSON.stringify(ids), JSON.stringify(openai.samplingFields(request)),
      jsSampler(pass, ids, this.info.vocab_size), kind === 'chat', !!this.stats.speculative?.enabled);
    pass.params = JSON.parse(generation.params_json());
    const stats = { promptTokens: ids.length, completionTokens: 0, firstTokenMs: 0, decodeMs: 0, forwardPasses: 0 };
    const started = performance.now();
    try {
      let plan = JSON.parse(generation.first()); // {chunks, forward: {ids, rollback, prefill} | null}
      for (;;) {
        for (const [text, token, reason, calls] of plan.chunks) {
          const finish = reason ?? (signal?.aborted ? 'abort' : null);
          if (token !== null) {
            stats.completionTokens += 1;
            pass.sampled.push(token);
          }
          yield { text, token, finish, calls, meta, stats, promptTokens: ids.length };
          if (finish) return;
        }
        if (!plan.forward) return;
        // onnxruntime's promise resolves without a macrotask, so without this a worker would not see
        // an 'abort' message (nor a page a click) until the whole generation is done.
        if (signal && !plan.forward.prefill) await nextTask();
        const t = performance.now();
        pass.rows = await this._forward(plan.forward);
        if (plan.forward.prefill) stats.firstTokenMs = performance.now() - started;
        else stats.decodeMs += performance.now() - t;
        stats.forwardPasses += 1;
        plan = JSON.parse(generation.step(pass.rows, JSON.stringify(argmaxes(pass.rows, this.info.vocab_size))));
      }
    } finally {
      stats.speculative = JSON.parse(generation.speculative_json());
      generation.close();
      generation.destroy();
      this.lastStats = { ...stats, totalMs: performance.now() - started };
    }
  }

  /** One forward pass of the loop's plan: prefill, decode, or (speculation) rollback + verify. */
  async _forward({ ids, rollback, prefill }) {
    if (prefill) return this.backend.prefill(ids);
    if (rollback) this.backend.rollback(rollback);
    return ids.length === 1 ? this.backend.decode(ids[0]) : this.backend.verify(ids);
  }

  async dispose() {
    this._disposed = true;
    await this._queue;
    this.backend?.dispose();
    await this.backend?.session?.release?.();
    this.backend?.release?.();
    this.runtime?.destroy?.();
  }
}

/** The loop's sampling hook (bridge.py JsHooks): a token from row `index` of the last pass, by npm/src/sampling.js.
 * `fresh`: the JSON of tokens kept earlier in this pass (speculation), which penalties count; state and bitmap: the
 * grammar mask's, copied out of Python once per state. */
function jsSampler(pass, promptIds, vocab) {
  const masks = new Map();
  const maskOf = (state, bitmap) => {
    if (state === null || state === undefined) return null;
    if (!masks.has(state)) masks.set(state, bitmap.toJs());
    return masks.get(state);
  };
  return (u, state, bitmap, index, fresh) => sampleToken(
    pass.rows.length === vocab ? pass.rows : pass.rows.subarray(index * vocab, (index + 1) * vocab), pass.params, u,
    fresh ? [...pass.sampled, ...JSON.parse(fresh)] : pass.sampled, promptIds, maskOf(state, bitmap));
}

/** JS's argmax of each row of a pass's logits [n, V]. */
function argmaxes(rows, vocab) {
  const bests = [];
  for (let i = 0; i < rows.length; i += vocab) bests.push(argmax(rows.subarray(i, i + vocab)));
  return bests;
}

/** createEngine's `speculative` option, checked by Python (vLLM's field names): what stats.speculative says.
 * 'ngram' or true: prompt lookup with the defaults. Only backends with a verify pass (the wasm kernels) run it. */
function speculativeStats(py, option, backend) {
  if (option === undefined || option === null || option === false) return null;
  const wanted = option === true || option === 'ngram' ? { method: 'ngram' } : option;
  const config = JSON.parse(py.set_speculative(JSON.stringify(wanted)));
  if (typeof backend.verify === 'function') return { enabled: true, ...config };
  py.set_speculative('null');
  return { enabled: false, reason: 'only the wasm kernels verify drafts (this model runs on onnxruntime)', ...config };
}

/** Resolve after pending events (messages, clicks) have run; MessageChannel avoids setTimeout's clamping. */
function nextTask() {
  if (typeof setImmediate === 'function') return new Promise((resolve) => setImmediate(resolve));
  return new Promise((resolve) => {
    const channel = new MessageChannel();
    channel.port1.onmessage = () => { channel.port1.close(); resolve(); };
    channel.port2.postMessage(null);
  });
}

/** A generation as OpenAI stream chunks: the role first (chat), then text as it comes, then the finish. */
async function* streamChunks(kind, steps, meta, streamOptions) {
  const ids = (token) => (meta.returnTokenIds ? (token === null ? [] : [token]) : null);
  if (kind === 'chat') yield openai.chatChunk(meta, { role: 'assistant', content: '' }, null, ids(null));
  let last = null;
  for await (const step of steps) {
    last = step;
    // Bytes held back for a whole character, or text that may open a tool call.
    if (!step.text && !step.finish && !step.calls && !meta.returnTokenIds) continue;
    yield kind === 'chat'
      ? openai.chatChunk(meta, openai.chatDelta(step.text, step.calls), step.finish, ids(step.token))
      : openai.completionChunk(meta, step.text, step.finish, ids(step.token));
  }
  if (streamOptions?.include_usage && last) {
    const chunk = kind === 'chat' ? openai.chatChunk(meta, {}, null) : openai.completionChunk(meta, '', null);
    chunk.choices = [];
    chunk.usage = openai.usage(last.promptTokens, last.stats.completionTokens);
    yield chunk;
  }
}

/** Gather a generation into one OpenAI result. */
async function collect(kind, chunks, meta) {
  let text = '';
  const tokens = [];
  const calls = [];
  let finish = 'length';
  let promptTokens = 0;
  for await (const step of chunks) {
    text += step.text;
    if (step.token !== null) tokens.push(step.token);
    if (step.calls) calls.push(...step.calls);
    finish = step.finish ?? finish;
    promptTokens = step.promptTokens;
  }
  return kind === 'chat' ? openai.chatResult(meta, text, finish, tokens, promptTokens, calls)
    : openai.completionResult(meta, text, finish, tokens, promptTokens);
}
