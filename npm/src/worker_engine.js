// The Web Worker engine: the same interface as InThreadEngine, each call a message to worker.js,
// so the page's thread never runs Python or onnxruntime.

import { asRuvllmError, EngineDisposedError, fromWire, UnsupportedRuntimeError } from './errors.js';
import { checkMessage, FROM_WORKER } from './messages.js';
import { checkChatRequest, checkCompletionRequest } from './openai.js';

export class WorkerEngine {
  constructor(worker) {
    this.worker = worker;
    this.pending = new Map(); // id -> {onChunk?, resolve, reject}
    this.nextId = 1;
    this.info = null;
    this.stats = null;
    this.lastStats = null;
    this.chat = { completions: { create: (request, options) => this._create('chat', request, options) } };
    this.completions = { create: (request, options) => this._create('text', request, options) };
    this.tokenizer = {
      encode: (...args) => this._ask({ type: 'tokenize', op: 'encode', args }),
      decode: (...args) => this._ask({ type: 'tokenize', op: 'decode', args }),
    };
  }

  /** @param {import('./index.js').EngineOptions} options */
  static async create(options) {
    if (typeof Worker === 'undefined') {
      throw new UnsupportedRuntimeError('this environment has no Web Workers; use createEngine({worker: false})');
    }
    const url = options.workerURL ?? new URL('./worker.js', import.meta.url);
    const engine = new WorkerEngine(new Worker(url, { type: 'module', name: 'ruvllm' }));
    const { onProgress, worker, workerURL, ...plain } = options;
    await new Promise((resolve, reject) => {
      engine._onLoad = { resolve, reject, onProgress };
      engine.worker.onmessage = (event) => engine._receive(event.data);
      engine.worker.onerror = (event) => {
        event.preventDefault?.();
        const text = event.message || 'script error';
        engine._fail(engine._onLoad && !/memory/i.test(text)
          ? new UnsupportedRuntimeError(`the ruvllm worker failed to start: ${text} (is worker.js served as text/javascript?)`)
          : asRuvllmError(new Error(`the ruvllm worker stopped: ${text}`)));
      };
      engine.worker.postMessage({ type: 'load', options: { ...plain, model: String(options.model) } });
    });
    return engine;
  }

  _receive(data) {
    const message = checkMessage(data, FROM_WORKER);
    if (message.type === 'progress') return this._onLoad?.onProgress?.(message.progress);
    if (message.type === 'loaded') {
      Object.assign(this, { info: message.info, stats: message.stats });
      this._onLoad.resolve();
      this._onLoad = null;
      return undefined;
    }
    if (message.type === 'error' && message.id === null) return this._fail(fromWire(message.error));
    const entry = this.pending.get(message.id);
    if (!entry) return undefined;
    if (message.type === 'chunk') return entry.onChunk(message.chunk);
    this.pending.delete(message.id);
    if (message.type === 'error') return entry.reject(fromWire(message.error));
    const stats = message.stats ?? message.result?.stats; // a non-streamed result's, or a stream's end
    if (stats) this.lastStats = stats;
    return entry.resolve(message.result);
  }

  /** A failure outside any request (load, a crashed worker): every caller hears of it. */
  _fail(error) {
    this._onLoad?.reject(error);
    this._onLoad = null;
    for (const entry of this.pending.values()) entry.reject(error);
    this.pending.clear();
  }

  _ask(message, onChunk) {
    if (!this.worker) return Promise.reject(new EngineDisposedError());
    const id = this.nextId++;
    const answer = new Promise((resolve, reject) => this.pending.set(id, { resolve, reject, onChunk }));
    this.worker.postMessage({ ...message, id });
    return Object.assign(answer, { id });
  }

  async _create(kind, request, options = {}) {
    (kind === 'chat' ? checkChatRequest : checkCompletionRequest)(request);
    const { signal, ...plain } = request;
    const abortSignal = options.signal ?? signal;
    if (!request.stream) {
      const answer = this._ask({ type: 'generate', kind, request: plain });
      abortSignal?.addEventListener('abort', () => this.worker?.postMessage({ type: 'abort', id: answer.id }));
      return answer;
    }
    const queue = [];
    let wake = null;
    const push = (item) => { queue.push(item); wake?.(); wake = null; };
    const answer = this._ask({ type: 'generate', kind, request: plain }, (chunk) => push({ chunk }));
    answer.then(() => push({ done: true }), (error) => push({ error }));
    const abort = () => this.worker?.postMessage({ type: 'abort', id: answer.id });
    abortSignal?.addEventListener('abort', abort);
    return (async function* chunks() {
      let finished = false;
      try {
        for (;;) {
          if (!queue.length) await new Promise((r) => { wake = r; });
          const item = queue.shift();
          if (item.error) throw item.error;
          if (item.done) { finished = true; return; }
          yield item.chunk;
        }
      } finally {
        if (!finished) abort(); // the caller stopped reading: stop generating
      }
    })();
  }

  async dispose() {
    if (!this.worker) return;
    await this._ask({ type: 'dispose' }).catch(() => {});
    this.worker.terminate();
    this.worker = null;
  }
}
