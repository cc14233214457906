"""OpenAI-shaped request and response models of the native server (pydantic).

These models are the server's written contract: FastAPI validates request
bodies against them and publishes them as the OpenAPI schema (`/openapi.json`).
Field names and shapes follow OpenAI's API, plus the sampling extras vLLM
accepts (`top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`,
`ignore_eos`, `chat_template_kwargs`, `structured_outputs` and the older
`guided_json` / `guided_regex` / `guided_choice`, `skip_special_tokens`), and ruvllm's `speculative`
(false: a request's opt-out of speculative decoding).

Types are strict (a string is not a number, `true` is not 1): a wrong type is
a 400, never a silent coercion. Value ranges are *not* repeated here: they live
in `py_engine.sampling_params.SamplingParams`, the one validator every
frontend shares, whose errors the API turns into 400s naming the field.
Unknown fields are accepted and ignored, as OpenAI's clients send extras.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, model_serializer

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # strict floats still take JSON integers (1 -> 1.0)
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
TokenIds = list[Int]


class _Body(BaseModel):
    # "ignore": OpenAI's SDK and other clients send fields we do not know (e.g. `store`, `metadata`).
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: Bool | None = None  # one last chunk with `usage` and no choices


class SamplingFields(_Body):
    """Fields shared by chat and legacy completions; see SamplingParams for their meaning and ranges."""

    model: Str | None = Field(None, description="must name the served model; omitted: the served model")
    n: Int | None = None
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    logit_bias: dict[Str, Float] | None = Field(None, description='token id (decimal string) -> bias in [-100, 100]')
    seed: Int | None = None
    stop: Str | list[Str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: Bool | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    user: Str | None = None
    skip_special_tokens: Bool | None = None
    speculative: Bool | None = Field(None, description="false: this request never speculates (where the server "
                                                       "runs speculative decoding; it changes no output)")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's output constraint: exactly one of json (a JSON schema), regex, choice (a list "
                          "of strings) or json_object; whitespace_pattern optional")
    guided_json: dict[str, Any] | Str | None = None  # vLLM's older names for the same
    guided_regex: Str | None = None
    guided_choice: list[Str] | None = None
    guided_grammar: Str | None = None  # llama.cpp's GBNF, as `grammar`
    grammar: Str | None = Field(None, description="a llama.cpp GBNF grammar (root ::= ...) the output follows")
    guided_whitespace_pattern: Str | None = None


# --- chat ---------------------------------------------------------------------------------------------
class ContentPart(_Body):
    """One part of a multi-part message; only `{"type": "text", "text": ...}` is supported."""

    type: Str
    text: Str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[ContentPart] | None = None
    name: Str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: Str | None = None
    reasoning_content: Str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: Bool | None = None
    top_logprobs: Int | None = None
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                          '{"name", "schema", "strict"}}: the output is constrained to the schema')
    tools: list[dict[str, Any]] | None = Field(
        None, description='[{"type": "function", "function": {"name", "description", "parameters"}}]: handed to '
                          "the chat template; calls in the model's syntax are parsed into tool_calls")
    tool_choice: Any = Field(None, description='"none", "auto" (the default with tools), "required", or '
                                               '{"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: Bool | None = Field(None, description="false: at most one tool call (a forced call's "
                                                               "grammar closes after it)")
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobToken(ChatLogprob):
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class DeltaToolCall(ToolCall):
    index: int


class _NoNulls(BaseModel):
    """Fields left out rather than sent as null (OpenAI's stream pieces carry only what they add)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunction(_NoNulls):
    name: str | None = None
    arguments: str


class DeltaToolCallPiece(_NoNulls):
    """A streamed piece of a call: the first carries id, type and name, the rest arguments only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall | DeltaToolCallPiece] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# --- legacy completions -------------------------------------------------------------------------------
Prompt = Union[Str, list[Str], TokenIds, list[TokenIds]]


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description="a string, a list of token ids, or a batch: a list of either")
    max_tokens: Int | None = 16  # OpenAI's (and vLLM's) default for legacy completions
    logprobs: Int | None = None  # how many top tokens per position (0: the chosen one only)
    echo: Bool | None = False
    suffix: Str | None = None  # not supported: a 400 when set
    best_of: Int | None = None  # only best_of == n is supported


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# --- models, errors -----------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ruvllm"
    root: str  # the model's name (vLLM shows the path it was given; a folder on disk is not for clients)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for the base itself
    max_model_len: int


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's shape); lora_path is under the server's --lora-dir."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    lora_path: str = Field(..., min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(..., min_length=1, max_length=128)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
