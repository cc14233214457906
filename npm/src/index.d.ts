// Types of the `ruvllm` package: one engine interface, two implementations (in-thread, Web Worker).

export type Role = 'system' | 'user' | 'assistant' | 'tool' | 'developer';

export interface ChatMessage {
  role: Role;
  /** null only beside an assistant's tool_calls. */
  content: string | Array<{ type: 'text'; text: string }> | null;
  name?: string;
  tool_calls?: ToolCall[];
  tool_call_id?: string;
}

/** Download and load progress; `file`/`loaded`/`total` are bytes of one file. */
export interface Progress {
  stage: 'boot' | 'download' | 'ready';
  file?: string;
  loaded?: number;
  total?: number;
  cached?: boolean;
}

export interface EngineOptions {
  /** URL of an exported model folder, or (Node) a local folder path. */
  model: string | URL;
  onProgress?: (progress: Progress) => void;
  /** Which graph of the export: 'auto' (default: the smallest present), 'fp32', 'fp16', 'int8', 'int4'. */
  precision?: 'auto' | 'fp32' | 'fp16' | 'int8' | 'int4' | 'int2';
  /** A graph file of the export named outright (e.g. 'onnx/model_q4.onnx'), instead of the manifest's pick. */
  file?: string;
  /** Browsers: run the engine in a Web Worker (same interface). */
  worker?: boolean;
  /** 'auto': onnxruntime-node in Node when installed, else the browser runtimes below. */
  runtime?: 'auto' | 'node' | 'web';
  /**
   * Where the forward pass runs outside onnxruntime-node: 'webgpu' (onnxruntime-web's WebGPU execution
   * provider, the KV cache on the GPU), 'wasm' (the package's own wasm kernels on the web export's codes, or
   * onnxruntime-web's wasm for graphs they do not take), 'auto' (default: WebGPU when navigator.gpu gives an
   * adapter, else wasm). `stats.device` and `stats.runtime` say which ran.
   */
  device?: 'auto' | 'webgpu' | 'wasm';
  /** Threads of the wasm kernels (and onnxruntime-web): default min(4, cores); needs cross-origin isolation. */
  threads?: number;
  /** false: never the package's own kernels (onnxruntime-web's wasm instead). */
  kernels?: boolean;
  maxContext?: number;
  /** The `model` field of responses (default: the model URL or path). */
  modelName?: string;
  /** Where Pyodide's files, onnxruntime-web's wasm files, the wheels and worker.js are served from. */
  pyodideURL?: string;
  wasmPaths?: string;
  /** Browsers without an import map for 'onnxruntime-web/wasm' (workers): the URL of ort.wasm.min.mjs. */
  ortURL?: string;
  /** The same for 'onnxruntime-web/webgpu': the URL of ort.webgpu.min.mjs. */
  ortWebgpuURL?: string;
  /** A folder serving rkw.wasm / rkw-relaxed.wasm (default: the package's src/kernels/). */
  kernelsURL?: string;
  wheelsURL?: string;
  workerURL?: string | URL;
  /**
   * Speculative decoding by prompt lookup (vLLM's `method: 'ngram'` and field names): each step drafts the
   * tokens that followed the latest earlier occurrence of the last prompt_lookup_max..min tokens, and one
   * forward pass verifies them. The output is the same, token for token (greedy, and seeded sampling); only the
   * speed changes. Runs on the package's wasm kernels (the other backends ignore it: stats.speculative says so).
   * true or 'ngram': the defaults. A request can set `speculative: false`.
   */
  speculative?: boolean | 'ngram' | SpeculativeConfig;
}

export interface SpeculativeConfig {
  method?: 'ngram';
  /** Most drafts a step (1-16, default 4); fewer where recent acceptance says they do not pay. */
  num_speculative_tokens?: number;
  /** Longest n-gram looked up (default 4); prompt_lookup_min the shortest (default 2). */
  prompt_lookup_max?: number;
  prompt_lookup_min?: number;
  /** Below this acceptance a step drafts nothing (probing now and then); 0: always draft (default 0.2). */
  acceptance_floor?: number;
}

export interface SpeculativeStats {
  /** vLLM's spec_decode counters for one generation. */
  num_drafts: number;
  num_draft_tokens: number;
  num_accepted_tokens: number;
  accepted_per_position: number[];
  acceptance_rate: number | null;
  mean_acceptance_length: number | null;
}

interface SamplingRequest {
  model?: string;
  stream?: boolean;
  max_tokens?: number | null;
  max_completion_tokens?: number | null;
  temperature?: number | null;
  top_p?: number | null;
  top_k?: number | null;
  min_p?: number | null;
  repetition_penalty?: number | null;
  presence_penalty?: number | null;
  frequency_penalty?: number | null;
  seed?: number | null;
  stop?: string | string[] | null;
  stop_token_ids?: number[] | null;
  ignore_eos?: boolean;
  logit_bias?: Record<string, number> | null;
  stream_options?: { include_usage?: boolean } | null;
  /** vLLM's extension: the generated token ids in each choice (and stream chunk). */
  return_token_ids?: boolean;
  /** false: this request does not speculate where createEngine's `speculative` is on. */
  speculative?: boolean;
  /** vLLM's output constraint (exactly one of json / regex / choice / json_object / grammar). */
  structured_outputs?: StructuredOutputs | null;
  /** A llama.cpp GBNF grammar (`root ::= ...`) the output follows (the same engine as on the server). */
  grammar?: string | null;
  signal?: AbortSignal;
}

export interface StructuredOutputs {
  /** A JSON schema the output must validate against. */
  json?: Record<string, unknown> | boolean | string;
  /** A regular expression the whole output must match. */
  regex?: string;
  /** The output is exactly one of these strings. */
  choice?: string[];
  /** Any JSON object. */
  json_object?: boolean;
  /** A llama.cpp GBNF grammar. */
  grammar?: string;
  /** The whitespace allowed between JSON tokens (default: one optional space). */
  whitespace_pattern?: string;
}

export type ResponseFormat =
  | { type: 'text' }
  | { type: 'json_object' }
  | { type: 'json_schema'; json_schema: { name: string; schema?: Record<string, unknown>; strict?: boolean;
      description?: string } };

export interface Tool {
  type: 'function';
  function: { name: string; description?: string; parameters?: Record<string, unknown>; strict?: boolean };
}

export type ToolChoice = 'none' | 'auto' | 'required' | { type: 'function'; function: { name: string } };

export interface ToolCall {
  id: string;
  type: 'function';
  /** arguments: JSON text, as OpenAI returns it. */
  function: { name: string; arguments: string };
}

export interface ChatCompletionRequest extends SamplingRequest {
  messages: ChatMessage[];
  chat_template_kwargs?: Record<string, unknown>;
  /** json_object or json_schema: the reply is constrained to it (the same code as on the server). */
  response_format?: ResponseFormat | null;
  /** Handed to the chat template; `required` or a named function constrain the reply to calls, `auto`
   * parses the template family's tool-call syntax (Hermes/Qwen, Llama 3 JSON, Mistral). */
  tools?: Tool[] | null;
  tool_choice?: ToolChoice | null;
  /** false: at most one tool call (a forced call's grammar closes after it). */
  parallel_tool_calls?: boolean | null;
}

export interface CompletionRequest extends SamplingRequest {
  prompt: string;
}

export type FinishReason = 'stop' | 'length' | 'abort' | 'tool_calls';

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}

export interface ChatCompletion {
  id: string;
  object: 'chat.completion';
  created: number;
  model: string;
  choices: Array<{ index: number; message: { role: 'assistant'; content: string | null; tool_calls?: ToolCall[] };
    logprobs: null;
    finish_reason: FinishReason; token_ids?: number[] }>;
  usage: Usage;
}

export interface ChatCompletionChunk {
  id: string;
  object: 'chat.completion.chunk';
  created: number;
  model: string;
  choices: Array<{ index: number; delta: { role?: 'assistant'; content?: string;
    tool_calls?: Array<ToolCall & { index: number }> }; logprobs: null;
    finish_reason: FinishReason | null; token_ids?: number[] }>;
  usage?: Usage;
}

export interface Completion {
  id: string;
  object: 'text_completion';
  created: number;
  model: string;
  choices: Array<{ index: number; text: string; logprobs: null; finish_reason: FinishReason | null;
    token_ids?: number[] }>;
  usage?: Usage;
}

export interface CallOptions {
  signal?: AbortSignal;
}

export interface GenerationStats {
  promptTokens: number;
  completionTokens: number;
  firstTokenMs: number;
  decodeMs: number;
  totalMs: number;
  /** Forward passes, the prefill included: completionTokens without speculation, fewer when drafts were kept. */
  forwardPasses: number;
  /** Drafting counts when the generation speculated, else null. */
  speculative: SpeculativeStats | null;
}

export interface LoadStats {
  /** Pyodide booted with py_engine installed (ms from the start of loading). */
  pythonBootMs: number;
  /** Python started from a heap snapshot (pythonStart says which), not a plain boot. */
  pythonRestored: boolean;
  /** 'boot', or the snapshot restored: 'cached' (kept by this browser), 'shipped' (made at build time). */
  pythonStart: 'boot' | 'cached' | 'shipped';
  /** When each phase of the load ended, ms from its start (pythonSetup, loadPyodide, wheels, modelFiles,
   *  tokenizer, template; kernels, download, weights, warm...): where a load's time goes. */
  phases: Record<string, number>;
  /** The graph downloaded (or read from cache), its session created and warmed (ms from the start; overlaps the boot). */
  modelLoadMs: number;
  /** e.g. 'ruvllm-wasm (relaxed SIMD, 2 threads)', 'onnxruntime-web (WebGPU)', 'onnxruntime-node'. */
  runtime: string;
  device: 'wasm' | 'webgpu' | 'cpu';
  precision: string;
  downloadedBytes: number;
  cachedBytes: number;
  /** createEngine's speculative config in full, and whether this backend runs it; null when off. */
  speculative: (SpeculativeConfig & { enabled: boolean; reason?: string }) | null;
}

export interface ModelInfo {
  model_type: string;
  vocab_size: number;
  max_context: number;
  num_layers: number;
  kv_heads: number;
  head_dim: number;
  eos_token_ids: number[];
  longrope_switch_length: number | null;
}

export interface Engine {
  chat: {
    completions: {
      create(request: ChatCompletionRequest & { stream: true }, options?: CallOptions):
        Promise<AsyncIterable<ChatCompletionChunk>>;
      create(request: ChatCompletionRequest & { stream?: false }, options?: CallOptions): Promise<ChatCompletion>;
      create(request: ChatCompletionRequest, options?: CallOptions):
        Promise<ChatCompletion | AsyncIterable<ChatCompletionChunk>>;
    };
  };
  completions: {
    create(request: CompletionRequest & { stream: true }, options?: CallOptions): Promise<AsyncIterable<Completion>>;
    create(request: CompletionRequest & { stream?: false }, options?: CallOptions): Promise<Completion>;
    create(request: CompletionRequest, options?: CallOptions): Promise<Completion | AsyncIterable<Completion>>;
  };
  tokenizer: {
    encode(text: string, options?: { addSpecialTokens?: boolean }): Promise<number[]>;
    decode(ids: number[], options?: { skipSpecialTokens?: boolean }): Promise<string>;
  };
  readonly info: ModelInfo | null;
  readonly stats: LoadStats | null;
  /** Timings of the last finished generation. */
  readonly lastStats: GenerationStats | null;
  dispose(): Promise<void>;
}

export declare class InThreadEngine implements Engine {
  static create(options: EngineOptions): Promise<InThreadEngine>;
  chat: Engine['chat'];
  completions: Engine['completions'];
  tokenizer: Engine['tokenizer'];
  readonly info: ModelInfo;
  readonly stats: LoadStats;
  readonly lastStats: GenerationStats | null;
  dispose(): Promise<void>;
}

export declare class WorkerEngine implements Engine {
  static create(options: EngineOptions): Promise<WorkerEngine>;
  chat: Engine['chat'];
  completions: Engine['completions'];
  tokenizer: Engine['tokenizer'];
  readonly info: ModelInfo | null;
  readonly stats: LoadStats | null;
  readonly lastStats: GenerationStats | null;
  dispose(): Promise<void>;
}

export declare function createEngine(options: EngineOptions): Promise<Engine>;
export declare function clearModelCache(): Promise<boolean>;
export declare const CACHE_NAME: string;

export declare class RuvllmError extends Error {
  code: string;
}
export declare class ModelNotFoundError extends RuvllmError {}
export declare class UnsupportedRuntimeError extends RuvllmError {}
export declare class OutOfMemoryError extends RuvllmError {}
export declare class InvalidRequestError extends RuvllmError {
  constructor(message: string, param?: string | null);
  param: string | null;
}
export declare class PromptTooLongError extends InvalidRequestError {}
export declare class EngineDisposedError extends RuvllmError {}
