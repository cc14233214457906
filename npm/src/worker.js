// The Web Worker side of WorkerEngine: one InThreadEngine, driven by the messages in messages.js.

import { InThreadEngine } from './engine.js';
import { EngineDisposedError, toWire } from './errors.js';
import { checkMessage, TO_WORKER } from './messages.js';

let engine = null;
const aborts = new Map(); // generation id -> AbortController

const post = (message) => self.postMessage(message);

self.onmessage = async (event) => {
  let message;
  try {
    message = checkMessage(event.data, TO_WORKER);
    await handle(message);
  } catch (error) {
    post({ type: 'error', id: message?.id ?? null, error: toWire(error) });
  }
};

async function handle(message) {
  switch (message.type) {
    case 'load': {
      const options = { ...message.options, onProgress: (progress) => post({ type: 'progress', progress }) };
      engine = await InThreadEngine.create(options);
      post({ type: 'loaded', info: engine.info, stats: engine.stats });
      return;
    }
    case 'abort':
      aborts.get(message.id)?.abort();
      return;
    default:
      break;
  }
  if (!engine) throw new EngineDisposedError('the model is not loaded');
  const { id } = message;
  if (message.type === 'generate') {
    const controller = new AbortController();
    aborts.set(id, controller);
    try {
      const api = message.kind === 'chat' ? engine.chat.completions : engine.completions;
      const out = await api.create(message.request, { signal: controller.signal });
      if (!message.request.stream) {
        post({ type: 'result', id, result: out, stats: engine.lastStats });
        return;
      }
      for await (const chunk of out) post({ type: 'chunk', id, chunk });
      post({ type: 'result', id, result: { stats: engine.lastStats } });
    } finally {
      aborts.delete(id);
    }
  } else if (message.type === 'tokenize') {
    post({ type: 'result', id, result: await engine.tokenizer[message.op](...message.args) });
  } else if (message.type === 'dispose') {
    await engine.dispose();
    engine = null;
    post({ type: 'result', id, result: null });
  }
}
