// ruvllm for JavaScript apps: `createEngine` loads an exported model; the engine answers OpenAI-shaped calls.
//
//   import { createEngine } from 'ruvllm';
//   const engine = await createEngine({ model: 'https://host/models/tiny/', onProgress: console.log });
//   const reply = await engine.chat.completions.create({ messages: [{ role: 'user', content: 'Hi' }] });
//   for await (const chunk of await engine.chat.completions.create({ messages, stream: true })) { ... }

import { InThreadEngine } from './engine.js';
import { InvalidRequestError } from './errors.js';

export { InThreadEngine } from './engine.js';
export { WorkerEngine } from './worker_engine.js';
export { clearModelCache, CACHE_NAME } from './files.js';
export * from './errors.js';

/**
 * Load a model. `worker: true` (browsers) runs the engine in a Web Worker; the interface is the same.
 * @param {import('./index.js').EngineOptions} options
 */
export async function createEngine(options) {
  if (!options || (typeof options.model !== 'string' && !(options.model instanceof URL))) {
    throw new InvalidRequestError('createEngine needs { model: URL or path of an exported model folder }', 'model');
  }
  if (options.worker) {
    const { WorkerEngine } = await import('./worker_engine.js');
    return WorkerEngine.create(options);
  }
  return InThreadEngine.create(options);
}
