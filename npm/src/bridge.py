"""The Python half of ruvllm's JavaScript runtime, run inside Pyodide.

py_engine's shared layer (tokenizer, chat template, sampling, the generation
loop) runs here unchanged; the forward pass runs on the JS side (the package's
wasm kernels or onnxruntime), which is async while py_engine's loop is
synchronous. So JS drives `generate.steps`, the loop with its forward passes
handed out: each `Generation.step` resumes it with the rows of logits JS ran
and returns the chunks it produced plus the next forward pass it needs
({ids, rollback, prefill}). One id is decode; more are speculative decoding's
verify pass (prompt lookup: the pending token and its drafts, after rolling
back the last step's rejected drafts), which only backends with `verify` get.
Logits stay in JS: the argmax of each row and sampled tokens come from JS
(the loop's backend hooks), so decoding never builds a Python list of the
vocabulary. Structured outputs and tools follow py_engine.guided, as on the
server: the grammar's mask for each step crosses to JS as a byte map (once per
grammar state: JS keeps them by state), and tool calls are read out of the
text here.
"""
from __future__ import annotations

import json
from typing import Any

from py_engine.chat import load_chat_config, render_chat
from py_engine.config import GenerationConfig, ModelConfig
from py_engine.generate import Forward, PromptTooLongError, eos_token_ids, start_ids, steps
from py_engine.guided import GuidedError, guide_for
from py_engine.guided.tools import NO_TOOLS, ChoiceReader, apply_plan, messages_for_template, plan_tools, split_events
from py_engine.sampling_params import SamplingParamsError, from_openai
from py_engine.speculative import Speculation, SpeculativeConfig, SpeculativeConfigError
from py_engine.tokenizer import Tokenizer


class JsRow:
    """Row `index` of the logits JS ran last (they stay in JS), with JS's argmax of it."""

    __slots__ = ("rows", "index", "vocab", "best")

    def __init__(self, rows: Any, index: int, vocab: int, best: int) -> None:
        self.rows, self.index, self.vocab, self.best = rows, index, vocab, best

    def tolist(self) -> list[float]:  # the reference sampler's row (logprobs): one copy out of JS
        return self.rows.subarray(self.index * self.vocab, (self.index + 1) * self.vocab).to_memoryview().tolist()


class JsHooks:
    """generate.steps' backend: max_context and the sampling hooks; JS runs the forward passes.

    Sampling happens in JS too, where the rows are (npm/src/sampling.js, tested equal to
    py_engine.sampling.sample_token): greedy takes JS's argmax, and sampled tokens call
    `js_sample(u, state, bitmap, row, fresh)` with u drawn from the loop's own Sampler, so seeds give the same
    tokens; state and bitmap are the grammar mask's (None without structured outputs), row the row's index in
    the pass and fresh the JSON of output tokens JS has not been handed yet (drafts kept earlier in this pass:
    penalties count them).
    """

    def __init__(self, max_context: int, js_sample: Any) -> None:
        self.max_context = max_context
        self.js_sample = js_sample
        self.handed = 0  # output tokens JS has seen in returned chunks

    def argmax(self, row: JsRow) -> int:
        return row.best

    def sample_token(self, row: JsRow, params: Any, u: float, output_ids: Any, prompt_ids: Any,
                     mask: Any = None) -> int:
        fresh = json.dumps(output_ids[self.handed:]) if len(output_ids) > self.handed else None
        if mask is None:
            return int(self.js_sample(u, None, None, row.index, fresh))
        return int(self.js_sample(u, mask.state, mask.bitmap(), row.index, fresh))


class Generation:
    """One running generation. JS calls first() for the prefill, then step(rows, bests) with each forward pass's
    logits [n, V] and their argmaxes; each returns JSON {chunks: [[content, token_id, finish_reason, tool_calls
    or null]...], forward: {ids, rollback, prefill} or null once finished}."""

    def __init__(self, runtime: "Runtime", prompt_ids: list[int], params: Any, js_sample: Any,
                 reader: ChoiceReader, speculation: Any) -> None:
        self.params, self.reader = params, reader
        self.vocab = runtime.config.vocab_size
        self.hooks = JsHooks(runtime.max_context, js_sample)
        self.seq: Any = None  # this sequence's SequenceSpeculation (its counts), once the loop starts it
        self.steps = steps(self.hooks, runtime.tokenizer, prompt_ids, params, runtime.eos_token_ids,
                           self if speculation is not None else None)
        self.speculation = speculation

    def start(self, prompt_ids: Any, params: Any) -> Any:
        """The loop starting its speculation (steps calls speculation.start): keep the sequence's counts."""
        self.seq = self.speculation.start(prompt_ids, params)
        return self.seq

    def params_json(self) -> str:
        """The validated, normalized sampling fields npm/src/sampling.js reads."""
        p = self.params
        return json.dumps({"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
                           "repetition_penalty": p.repetition_penalty, "presence_penalty": p.presence_penalty,
                           "frequency_penalty": p.frequency_penalty,
                           "logit_bias": {str(k): v for k, v in p.logit_bias.items()}})

    def first(self) -> str:
        return self._advance(None)

    def step(self, js_rows: Any, bests_json: str) -> str:
        bests = json.loads(bests_json)
        return self._advance([JsRow(js_rows, i, self.vocab, int(b)) for i, b in enumerate(bests)])

    def _advance(self, rows: Any) -> str:
        chunks, forward = [], None
        try:
            item = next(self.steps) if rows is None else self.steps.send(rows)
            while not isinstance(item, Forward):
                chunks.append(self._chunk(item))
                item = next(self.steps)
            forward = {"ids": item.token_ids, "rollback": item.rollback, "prefill": item.prefill}
        except StopIteration:
            pass
        return json.dumps({"chunks": chunks, "forward": forward})

    def _chunk(self, chunk: Any) -> list[Any]:
        reader, reason = self.reader, chunk.finish_reason
        content, calls = split_events(reader.feed(chunk.text) + (reader.finish() if reason else []))
        if chunk.token_id is not None:
            self.hooks.handed += 1
        return [content, chunk.token_id, reader.finish_reason(reason), calls or None]

    def speculative_json(self) -> str:
        """This generation's drafting counts (SpecStats.to_dict(): vLLM's spec_decode counters, acceptance),
        or null when it did not speculate."""
        if self.seq is None:
            return "null"
        stats = self.seq.stats
        return json.dumps({**stats.to_dict(), "acceptance_rate": stats.acceptance_rate,
                           "mean_acceptance_length": stats.mean_acceptance_length})

    def close(self) -> None:
        self.steps.close()


def preload() -> None:
    """Import now what a Runtime imports late (jinja2 and its sandbox, for the chat template): called before
    Pyodide's heap is snapshotted (npm/src/python.js), so a restored heap has them and a load does not
    compile them from source again."""
    import jinja2  # noqa: F401
    import jinja2.ext  # noqa: F401
    import jinja2.sandbox  # noqa: F401


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
        self.speculation: Speculation | None = None

    def set_speculative(self, config_json: str) -> str:
        """createEngine's `speculative` option (vLLM's field names; prompt lookup only: a draft model would
        need a second model in the tab): checked here, a bad field raises SpeculativeConfigError naming it.
        Returns the config in full (defaults filled in)."""
        value = json.loads(config_json)
        config = SpeculativeConfig.parse(value) if value is not None else None
        if config is not None and config.method != "ngram":
            raise SpeculativeConfigError("method", f"the browser runtime speculates with prompt lookup only "
                                         f"('ngram'), not {config.method!r}")
        self.speculation = Speculation(config) if config is not None else None
        return json.dumps(config.to_dict() if config is not None else None)

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

    def start(self, prompt_ids_json: str, request_json: str, js_sample: Any, chat: bool = False,
              verify: bool = False) -> Generation:
        """Validate the request's sampling fields, tools and grammar (compiled here, once) and the
        prompt length before JS runs the prefill. verify: the backend has a verify pass (speculation runs
        when createEngine asked for it and the request did not turn it off)."""
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
        speculation = self.speculation if verify and params.speculative else None
        return Generation(self, prompt_ids, params, js_sample, ChoiceReader(plan), speculation)
