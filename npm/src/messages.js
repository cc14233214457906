// The messages between WorkerEngine (page) and worker.js (Web Worker). Every message is a plain object
// with a `type`; requests carry an `id` the answers repeat.
//
// page -> worker
//   {type: 'load', options}                          EngineOptions without functions
//   {type: 'generate', id, kind: 'chat'|'text', request}
//   {type: 'abort', id}                              stop generation `id` at the next token
//   {type: 'tokenize', id, op: 'encode'|'decode', args}
//   {type: 'dispose', id}
// worker -> page
//   {type: 'progress', progress}                     Progress (see index.d.ts)
//   {type: 'loaded', info, stats}
//   {type: 'chunk', id, chunk}                       one OpenAI stream chunk
//   {type: 'result', id, result, stats?}             a non-streamed result (stats: its generation's), a tokenizer
//                                                    answer, or {stats} at a stream's end
//   {type: 'error', id, error}                       errors.toWire(error); id null for load failures

export const TO_WORKER = Object.freeze(['load', 'generate', 'abort', 'tokenize', 'dispose']);
export const FROM_WORKER = Object.freeze(['progress', 'loaded', 'chunk', 'result', 'error']);

/** Refuse malformed messages at the boundary instead of hanging on them. */
export function checkMessage(message, allowed) {
  if (!message || typeof message !== 'object' || !allowed.includes(message.type)) {
    throw new TypeError(`unexpected worker message: ${JSON.stringify(message)?.slice(0, 200)}`);
  }
  return message;
}
