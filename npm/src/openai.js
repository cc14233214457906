// OpenAI-shaped requests and responses: validation at the boundary, then plain objects out.

import { InvalidRequestError } from './errors.js';

const ROLES = new Set(['system', 'user', 'assistant', 'tool', 'developer']);
const UNSUPPORTED = { n: 1, logprobs: null, top_logprobs: null };

/** Check a chat request's shape (sampling ranges are checked by py_engine's SamplingParams). */
export function checkChatRequest(request) {
  checkCommon(request);
  const { messages } = request;
  if (!Array.isArray(messages) || messages.length === 0) {
    throw new InvalidRequestError('messages must be a non-empty array of {role, content}', 'messages');
  }
  messages.forEach((m, i) => {
    if (!m || typeof m !== 'object' || !ROLES.has(m.role)) {
      throw new InvalidRequestError(`messages[${i}].role must be one of ${[...ROLES].join(', ')}`, `messages[${i}].role`);
    }
    const callsOnly = m.role === 'assistant' && Array.isArray(m.tool_calls) && m.content == null;
    if (typeof m.content !== 'string' && !Array.isArray(m.content) && !callsOnly) {
      throw new InvalidRequestError(`messages[${i}].content must be a string or an array of text parts`,
        `messages[${i}].content`);
    }
  });
  if (request.tools != null && !Array.isArray(request.tools)) {
    throw new InvalidRequestError('tools must be an array of {type: "function", function: {...}}', 'tools');
  }
}

export function checkCompletionRequest(request) {
  checkCommon(request);
  if (typeof request.prompt !== 'string') {
    throw new InvalidRequestError('prompt must be a string', 'prompt');
  }
}

function checkCommon(request) {
  if (!request || typeof request !== 'object') throw new InvalidRequestError('the request must be an object');
  for (const [field, ok] of Object.entries(UNSUPPORTED)) {
    const value = request[field];
    if (value !== undefined && value !== null && value !== ok && !(field === 'logprobs' && value === false)) {
      throw new InvalidRequestError(`${field} is not supported by the JavaScript runtime yet`, field);
    }
  }
  if (request.stream !== undefined && typeof request.stream !== 'boolean') {
    throw new InvalidRequestError('stream must be a boolean', 'stream');
  }
}

/** The fields py_engine reads: `from_openai`'s sampling and output constraints, and the tools
 * (everything else stays on this side). */
export function samplingFields(request) {
  const keep = ['temperature', 'top_p', 'top_k', 'min_p', 'repetition_penalty', 'presence_penalty',
    'frequency_penalty', 'seed', 'stop', 'stop_token_ids', 'ignore_eos', 'max_tokens', 'max_completion_tokens',
    'logit_bias', 'skip_special_tokens', 'response_format', 'structured_outputs', 'guided_json', 'guided_regex',
    'guided_choice', 'guided_grammar', 'guided_whitespace_pattern', 'grammar', 'tools', 'tool_choice',
    'parallel_tool_calls', 'speculative'];
  return Object.fromEntries(keep.filter((k) => request[k] !== undefined).map((k) => [k, request[k]]));
}

let counter = 0;
export function requestId(prefix) {
  counter += 1;
  return `${prefix}-${Date.now().toString(36)}${counter.toString(36)}`;
}

export function usage(promptTokens, completionTokens) {
  return { prompt_tokens: promptTokens, completion_tokens: completionTokens, total_tokens: promptTokens + completionTokens };
}

export function chatChunk(meta, delta, finishReason, tokenIds) {
  const choice = { index: 0, delta, logprobs: null, finish_reason: finishReason };
  if (tokenIds) choice.token_ids = tokenIds;
  return { id: meta.id, object: 'chat.completion.chunk', created: meta.created, model: meta.model, choices: [choice] };
}

/** A stream delta: new content, and tool calls (each with its index) once they are complete. */
export function chatDelta(text, calls) {
  const delta = text ? { content: text } : {};
  if (calls?.length) delta.tool_calls = calls.map((call, index) => ({ index, ...call }));
  return delta;
}

export function chatResult(meta, text, finishReason, tokenIds, promptTokens, calls = []) {
  const message = { role: 'assistant', content: calls.length ? (text || null) : text };
  if (calls.length) message.tool_calls = calls;
  const choice = { index: 0, message, logprobs: null, finish_reason: finishReason };
  if (meta.returnTokenIds) choice.token_ids = tokenIds;
  return { id: meta.id, object: 'chat.completion', created: meta.created, model: meta.model, choices: [choice],
    usage: usage(promptTokens, tokenIds.length) };
}

export function completionChunk(meta, text, finishReason, tokenIds) {
  const choice = { index: 0, text, logprobs: null, finish_reason: finishReason };
  if (tokenIds) choice.token_ids = tokenIds;
  return { id: meta.id, object: 'text_completion', created: meta.created, model: meta.model, choices: [choice] };
}

export function completionResult(meta, text, finishReason, tokenIds, promptTokens) {
  const result = completionChunk(meta, text, finishReason, meta.returnTokenIds ? tokenIds : null);
  result.usage = usage(promptTokens, tokenIds.length);
  return result;
}
