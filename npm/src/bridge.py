"""The Python half of ruvllm's JavaScript runtime, run inside Pyodide.

py_engine's shared layer (tokenizer, chat template, sampling, the generation
loop) runs here unchanged; the forward pass runs in onnxruntime on the JS side.
onnxruntime is async and py_engine.generate.stream is synchronous, so JS runs
each forward pass *before* resuming the loop: `stream` always asks for
`decode(token)` right after yielding a chunk with that token and no
finish_reason, so JS knows the next forward pass in advance and hands its
logits to `Generation.step`, which the backend below then returns.
Logits arrive as a JS Float32Array and cross with one bulk copy
(`to_memoryview`); the argmax and sampled tokens come from JS (the loop's
backend hooks), so decoding never builds a Python list of the vocabulary.
Structured outputs and tools follow py_engine.guided, as on the server: the
grammar's mask for each step crosses to JS as a byte map (once per grammar
state: JS keeps them by state), and tool calls are read out of the text here.
"""
from __future__ import annotations

import json
from typing import Any

from py_engine.chat import load_chat_config, render_chat
from py_engine.config import GenerationConfig, ModelConfig
from py_engine.generate import PromptTooLongError, eos_token_ids, start_ids, stream
from py_engine.guided import GuidedError, guide_for
from py_engine.guided.tools import NO_TOOLS, ChoiceReader, apply_plan, messages_for_template, plan_tools, split_events
from py_engine.sampling_params import SamplingParamsError, from_openai
from py_engine.tokenizer import Tokenizer


class PrefetchBackend:
    """A generate.Backend whose forward passes JS has already run: it returns the row JS handed over.

    Sampling happens in JS too, where the row is (npm/src/sampling.js, tested equal to
    py_engine.sampling.sample_token): greedy takes JS's argmax, and sampled tokens call
    `js_sample(u, state, bitmap)` with u drawn from the loop's own Sampler, so seeds give the same
    tokens; state and bitmap are the grammar mask's (None without structured outputs).
    """

    def __init__(self, max_context: int, js_sample: Any) -> None:
        self.max_context = max_context
        self.js_sample = js_sample
        self.row: Any = None  # memoryview of float32 logits, [V]
        self.best: int | None = None  # JS's argmax of that row

    def give(self, js_row: Any, best: int) -> None:
        self.row, self.best = js_row.to_memoryview(), int(best)

    def _take(self) -> Any:
        if self.row is None:
            raise RuntimeError("the generation loop asked for a forward pass JS did not run")
        row, self.row = self.row, None
        return row

    def prefill(self, token_ids: Any) -> Any:
        return self._take()

    def decode(self, token_id: int) -> Any:
        return self._take()

    def argmax(self, logits: Any) -> int:
        return self.best

    def sample_token(self, logits: Any, params: Any, u: float, output_ids: Any, prompt_ids: Any,
                     mask: Any = None) -> int:
        if mask is None:
            return int(self.js_sample(u, None, None))
        return int(self.js_sample(u, mask.state, mask.bitmap()))


class Generation:
    """One running `stream`; JS calls step(logits, argmax) and gets back
    [content, token_id, finish_reason, tool_calls or null]."""

    def __init__(self, runtime: "Runtime", prompt_ids: list[int], params: Any, js_sample: Any,
                 reader: ChoiceReader) -> None:
        self.params, self.reader = params, reader
        self.backend = PrefetchBackend(runtime.max_context, js_sample)
        self.chunks = stream(self.backend, runtime.tokenizer, prompt_ids, params, runtime.eos_token_ids)

    def params_json(self) -> str:
        """The validated, normalized sampling fields npm/src/sampling.js reads."""
        p = self.params
        return json.dumps({"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
                           "repetition_penalty": p.repetition_penalty, "presence_penalty": p.presence_penalty,
                           "frequency_penalty": p.frequency_penalty,
                           "logit_bias": {str(k): v for k, v in p.logit_bias.items()}})

    def step(self, js_row: Any, best: int) -> str:
        self.backend.give(js_row, best)
        chunk = next(self.chunks)
        reader, reason = self.reader, chunk.finish_reason
        content, calls = split_events(reader.feed(chunk.text) + (reader.finish() if reason else []))
        return json.dumps([content, chunk.token_id, reader.finish_reason(reason), calls or None])


class Runtime:
    """A model folder's tokenizer, chat template and generation defaults (read from Pyodide's FS)."""

    def __init__(self, folder: str, max_context: int | None = None) -> None:
        self.folder = folder
        self.config = ModelConfig.from_file(folder)
        self.tokenizer = Tokenizer.from_pretrained(folder)
        self.generation_config = GenerationConfig.from_model_dir(folder)
        self.eos_token_ids = eos_token_ids(self.generation_config, self.config, self.tokenizer)
        limit = self.config.max_position_embeddings
        self.max_context = min(max_context or limit, limit)
        self._chat = None

    def warm(self) -> None:
        """Import jinja2 and compile the chat template now (about a second in Pyodide), not on the first request."""
        try:
            self.chat_ids(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
        except Exception:  # no template, or one that needs more: the first chat request reports it
            pass

    def info(self) -> str:
        c = self.config
        rope = c.rope_parameters  # LongRoPE: past this length the cache is recomputed with the long factors
        switch = ((rope.original_max_position_embeddings or c.max_position_embeddings)
                  if rope.rope_type == "longrope" else None)
        return json.dumps({"model_type": c.model_type, "vocab_size": c.vocab_size, "max_context": self.max_context,
                           "longrope_switch_length": switch,
                           "num_layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads,
                           "head_dim": c.head_dim, "eos_token_ids": list(self.eos_token_ids)})

    def chat_ids(self, request_json: str) -> str:
        """Prompt ids of an OpenAI chat request: the model's template, then the tokenizer."""
        request = json.loads(request_json)
        if self._chat is None:
            self._chat = load_chat_config(self.folder)
        kwargs = request.get("chat_template_kwargs") or {}
        text = render_chat(messages_for_template(request["messages"]), self._chat, add_generation_prompt=True,
                           tools=request.get("tools"), **kwargs)
        return json.dumps(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, prompt: str) -> str:
        return json.dumps(start_ids(self.tokenizer, prompt))

    def encode(self, text: str, add_special_tokens: bool) -> str:
        return json.dumps(self.tokenizer.encode(text, add_special_tokens=bool(add_special_tokens)))

    def decode(self, ids_json: str, skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(json.loads(ids_json), skip_special_tokens=bool(skip_special_tokens))

    def start(self, prompt_ids_json: str, request_json: str, js_sample: Any, chat: bool = False) -> Generation:
        """Validate the request's sampling fields, tools and grammar (compiled here, once) and the
        prompt length before JS runs the prefill."""
        prompt_ids = json.loads(prompt_ids_json)
        request = json.loads(request_json)
        params = from_openai(request)
        try:
            plan = plan_tools(request.get("tools"), request.get("tool_choice"), self._chat.templates,
                              request.get("parallel_tool_calls")) \
                if chat and self._chat is not None else NO_TOOLS
            params = apply_plan(params, plan)
            guide_for(params, self.tokenizer, self.eos_token_ids)  # compile now: a bad schema fails before the prefill
        except GuidedError as exc:
            spec = params.structured_outputs
            param = exc.param or (spec.origin if spec is not None else None) or "structured_outputs"
            raise SamplingParamsError(param.split(".")[0], str(exc)) from None
        if len(prompt_ids) >= self.max_context:
            raise PromptTooLongError(f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                                     f"{self.max_context} tokens, leaving no room to generate")
        return Generation(self, prompt_ids, params, js_sample, ChoiceReader(plan))
