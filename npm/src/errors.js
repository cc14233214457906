// Typed errors: every failure reaches the caller (and the page) as one of these, with a readable message.

export class RuvllmError extends Error {
  /** @param {string} message @param {{cause?: unknown}} [options] */
  constructor(message, options) {
    super(message, options);
    this.name = new.target.name;
    this.code = 'ruvllm_error';
  }
}

/** The model folder or URL, or a file in it, does not exist. */
export class ModelNotFoundError extends RuvllmError {
  constructor(message, options) { super(message, options); this.code = 'model_not_found'; }
}

/** This browser or runtime lacks something ruvllm needs (WebAssembly, Workers, fetch). */
export class UnsupportedRuntimeError extends RuvllmError {
  constructor(message, options) { super(message, options); this.code = 'unsupported_runtime'; }
}

/** The model does not fit in this tab's or process's memory. */
export class OutOfMemoryError extends RuvllmError {
  constructor(message, options) { super(message, options); this.code = 'out_of_memory'; }
}

/** A request field is missing or out of range (`param` names it, as OpenAI's errors do). */
export class InvalidRequestError extends RuvllmError {
  constructor(message, param = null, options) {
    super(message, options);
    this.code = 'invalid_request';
    this.param = param;
  }
}

/** The prompt leaves no room to generate in the model's context. */
export class PromptTooLongError extends InvalidRequestError {
  constructor(message, options) { super(message, 'messages', options); this.code = 'prompt_too_long'; }
}

/** The engine was disposed, or is being used after a failure it cannot recover from. */
export class EngineDisposedError extends RuvllmError {
  constructor(message = 'the engine was disposed', options) { super(message, options); this.code = 'engine_disposed'; }
}

const BY_NAME = { RuvllmError, ModelNotFoundError, UnsupportedRuntimeError, OutOfMemoryError, InvalidRequestError,
  PromptTooLongError, EngineDisposedError };

/** A plain object that crosses postMessage; `fromWire` rebuilds the typed error on the other side. */
export function toWire(error) {
  const e = asRuvllmError(error);
  return { name: e.name, message: e.message, code: e.code, param: e.param ?? null };
}

export function fromWire(wire) {
  const Cls = BY_NAME[wire.name] ?? RuvllmError;
  const e = Cls === InvalidRequestError ? new Cls(wire.message, wire.param) : new Cls(wire.message);
  return e;
}

/** Map anything thrown (Python exceptions, wasm aborts, fetch failures) to a typed error. */
export function asRuvllmError(error) {
  if (error instanceof RuvllmError) return error;
  const text = String(error?.message ?? error);
  if (/out of memory|Cannot enlarge memory|Aborted\(OOM\)|RangeError: (Array buffer allocation|WebAssembly\.Memory)/i.test(text)
      || error instanceof RangeError && /memory|allocation/i.test(text)) {
    return new OutOfMemoryError(`out of memory: ${firstLine(text)} (try a smaller or quantized export)`, { cause: error });
  }
  if (error?.type && error?.constructor?.name === 'PythonError') {
    // Pyodide's PythonError: `type` is the exception's class name, the message ends with "module.Type: text".
    const message = text.trimEnd().split('\n').pop().replace(/^[\w.]*?(\w+): /, '');
    return fromPython(error.type, message, error);
  }
  return new RuvllmError(firstLine(text), { cause: error });
}

const INVALID = new Set(['SamplingParamsError', 'ChatTemplateError', 'ChatTemplateSecurityError', 'TokenizerError',
  'GuidedError', 'GrammarTooLargeError', 'GuidedSyntaxError', 'SpeculativeConfigError']);

function fromPython(kind, message, cause) {
  if (kind === 'PromptTooLongError') return new PromptTooLongError(message, { cause });
  if (INVALID.has(kind)) {
    const param = { SamplingParamsError: paramOf(message), SpeculativeConfigError: 'speculative' }[kind] ?? 'messages';
    return new InvalidRequestError(message, param, { cause });
  }
  if (kind === 'MemoryError') return new OutOfMemoryError(`out of memory in Python: ${message}`, { cause });
  return new RuvllmError(`${kind}: ${message}`, { cause });
}

function paramOf(message) {
  const m = /^(\w+)[: ]/.exec(message);
  return m ? m[1] : null;
}

function firstLine(text) {
  return text.split('\n').find((l) => l.trim()) ?? text;
}
