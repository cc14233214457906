"""The generation loop every single-sequence backend shares: prefill, then sample and decode.

A backend only runs the forward pass: `prefill(prompt_ids)` and `decode(token_id)`
each return the logits of the next position. Everything else (sampling, the
streaming detokenizer, stop tokens and stop strings, the context limit) lives
here, so the torch engine, the onnxruntime backend and the in-browser runtime
(this module runs unchanged in Pyodide) produce the same tokens from the same
logits. Stdlib only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Iterator, Protocol, Sequence

from py_engine.sampling import Sampler, SampleOutput
from py_engine.sampling_params import SamplingParams
from py_engine.stopping import StopStringMatcher, finish_reason


class Backend(Protocol):
    """One sequence's forward pass. Logits are one vocab-size row (list, array, memoryview...)."""

    max_context: int

    def prefill(self, token_ids: Sequence[int]) -> Any:
        """Start a new sequence from token_ids; return the logits after the last one."""

    def decode(self, token_id: int) -> Any:
        """Append one token; return the logits after it."""

    # Optional: argmax(logits) -> int, the first index of the max, used for plain greedy requests;
    # sample_token(logits, params, u, output_ids, prompt_ids[, mask]) -> int with exactly
    # py_engine.sampling.sample_token's semantics, run where the logits are (the browser runtime
    # samples in JavaScript); mask is None or a py_engine.guided TokenMask (structured outputs).
    # mask_logits(logits, mask) -> logits with the mask's forbidden tokens at -inf, done where the
    # logits are (torch), so the reference sampler gets the row already masked.
    # The loop still draws u from its Sampler, so seeded runs replay.
    # Speculative decoding (stream's `speculation`) needs two more: verify(token_ids) -> the rows of logits
    # after each of them (appended as decode would, one call), and rollback(n): forget the last n tokens.


class PromptTooLongError(ValueError):
    """The prompt leaves no room to generate in the model's context."""


@dataclass(frozen=True)
class GenerationChunk:
    """One step of a stream: the text now safe to show and the token that produced it."""

    text: str
    token_id: int | None  # None on the closing chunk that flushes held-back text
    finish_reason: str | None = None
    logprobs: SampleOutput | None = None


@dataclass(frozen=True)
class Forward:
    """The forward pass `steps` needs next: forget the cache's last `rollback` tokens (rejected drafts), then
    feed token_ids and send back the rows of logits after them (a list; prefill: a new sequence, its last row
    only). One token is decode; more are speculative decoding's verify pass (the pending token, then drafts)."""

    token_ids: list[int]
    rollback: int = 0
    prefill: bool = False


def run_forward(backend: Backend, forward: Forward) -> list[Any]:
    """A Forward on a synchronous backend: prefill, decode, or rollback + verify."""
    if forward.prefill:
        return [backend.prefill(forward.token_ids)]
    if forward.rollback:
        backend.rollback(forward.rollback)
    if len(forward.token_ids) == 1:
        return [backend.decode(forward.token_ids[0])]
    return backend.verify(forward.token_ids)


@dataclass
class Completion:
    """A finished generation."""

    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    logprobs: list[SampleOutput] | None = field(default=None)
    speculative: dict[str, Any] | None = field(default=None)  # SpecStats.to_dict() of this generation, if on

    def to_dict(self) -> dict[str, Any]:
        out = {"text": self.text, "prompt_token_ids": self.prompt_token_ids,
               "token_ids": self.token_ids, "finish_reason": self.finish_reason}
        if self.speculative is not None:
            out["speculative"] = self.speculative
        return out


def start_ids(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Prompt ids for text; an empty prompt starts from BOS (or end-of-text for BOS-less models)."""
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens) if text else []
    if ids:
        return ids
    for candidate in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return [candidate]
    raise ValueError("the prompt is empty and the tokenizer has no BOS or EOS token to start from")


def eos_token_ids(gen: Any, config: Any, tokenizer: Any) -> tuple[int, ...]:
    """Stop ids of a model: generation_config.json's, else config.json's, else the tokenizer's EOS."""
    if gen.eos_token_id:
        return tuple(gen.eos_token_id)
    if config.eos_token_id:
        return tuple(config.eos_token_id)
    return (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()


def _fast_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that edits logits: the backend's own argmax gives the same token."""
    return (params.is_greedy and params.logprobs is None and not params.logit_bias
            and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and params.structured_outputs is None)


def _row(logits: Any) -> Any:
    """A plain row for the reference sampler: tensors and numpy arrays become lists."""
    return logits if isinstance(logits, list) else logits.tolist()


def stream(backend: Backend, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams,
           eos_token_ids: Sequence[int] = (), speculation: Any = None) -> Iterator[GenerationChunk]:
    """Generate from prompt_ids, yielding text as soon as it is safe to show: `steps` with the backend's
    forward passes run in place."""
    steps_ = steps(backend, tokenizer, prompt_ids, params, eos_token_ids, speculation)
    try:
        item = next(steps_)
        while True:
            if isinstance(item, Forward):
                item = steps_.send(run_forward(backend, item))
            else:
                yield item
                item = next(steps_)
    except StopIteration:
        return
    finally:
        steps_.close()


def steps(backend: Backend, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams,
          eos_token_ids: Sequence[int] = (), speculation: Any = None) -> Iterator[GenerationChunk | Forward]:
    """The generation loop with its forward passes handed out: yields chunks, and Forward requests whose rows
    of logits the driver sends back (`stream` runs them on the backend; the browser runtime, whose forward pass
    is async JavaScript, returns each to JS and resumes with its rows). The backend still gives max_context
    and the sampling hooks (argmax, sample_token, mask_logits), which run on rows already in hand.

    The stop token's text and a matched stop string never reach the output.
    The last chunk carries finish_reason ("stop" or "length"). With structured outputs each
    token is sampled from what the grammar allows, and generation stops ("stop") once the output
    is complete and nothing may follow.

    speculation (py_engine.speculative.Speculation), with a backend that has verify and rollback: each step
    feeds the pending token and up to k drafts in one call and keeps the drafts the target would have produced
    (speculative/accept.py); every token is still sampled from the target's own row in order, so the output
    is the one generate gives without it (and a seeded run's too, for prompt lookup and greedy drafts).
    """
    from py_engine.guided import guide_for
    from py_engine.tokenizer import IncrementalDecoder

    prompt_ids = list(prompt_ids)
    room = backend.max_context - len(prompt_ids)
    if room < 1:
        raise PromptTooLongError(f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                                 f"{backend.max_context} tokens, leaving no room to generate")
    sampler = Sampler(params)
    guide = guide_for(params, tokenizer, eos_token_ids)
    pick = _Picker(backend, params, sampler, prompt_ids)
    detok = IncrementalDecoder(tokenizer, skip_special_tokens=params.skip_special_tokens)
    stops = StopStringMatcher(params.stop)
    output: list[int] = []
    spec = speculation.start(prompt_ids, params) if speculation is not None and params.speculative else None
    rows, drafts = (yield Forward(prompt_ids, prefill=True)), []
    started: float | None = None  # when the current step's proposal began
    try:
        while True:
            done = False
            for j, logits in enumerate(rows):
                mask = guide.mask() if guide is not None else None
                draft = drafts[j] if j < len(drafts) else None
                sample, kept = pick(logits, output, mask, draft, spec, j)
                token = sample.token_id
                output.append(token)
                reason = finish_reason(params, token, len(output), eos_token_ids, room)
                ended_by_token = reason == "stop"  # a stop token or EOS: its text is never shown
                if guide is not None:
                    guide.advance(token)
                    if guide.terminated and not ended_by_token:  # complete (even on the last token max_tokens allows)
                        reason = "stop"
                text, stop_hit = "", None
                if not ended_by_token:
                    text, stop_hit = stops.feed(detok.push(token))
                if stop_hit is not None:
                    chunk, done = GenerationChunk(text, token, "stop", sample), True
                elif reason is not None:
                    chunk = GenerationChunk(text + stops.feed(detok.flush()).text + stops.flush(), token, reason, sample)
                    done = True
                else:
                    chunk = GenerationChunk(text, token, None, sample)
                if done or not kept:  # the sequence ended, or the target's own token ended the step
                    break
                yield chunk
            accepted = j + (1 if kept else 0)  # drafts kept this step (the last one's too when it ended the sequence)
            if spec is not None:
                spec.record(len(drafts), accepted)
            if done:
                yield chunk
                return
            yield chunk
            rejected = len(drafts) - j if drafts else 0  # the rejected drafts' positions leave the KV cache
            if spec is not None:
                spec.keep(output[len(output) - j - 1:])
            left = room - len(output) if params.max_tokens is None else min(params.max_tokens, room) - len(output)
            if spec is not None:  # the last step's cost, from its proposal to this one's: forward, sampling, the
                now = perf_counter()  # reader (where the page runs the forward pass), not just a GPU's launch
                if started is not None:
                    spec.timed(len(drafts), now - started)
                started = now
            drafts = spec.propose(left - 1) if spec is not None else []  # a step emits one token more than it drafts
            rows = yield Forward([token, *drafts], rejected)
    finally:
        if spec is not None:
            spec.finish()


class _Picker:
    """One position's token from the target's row: the loop's sampling, the fast paths kept."""

    def __init__(self, backend: Backend, params: SamplingParams, sampler: Sampler, prompt_ids: list[int]) -> None:
        self.params, self.sampler, self.prompt_ids = params, sampler, prompt_ids
        self.argmax = getattr(backend, "argmax", None) if _fast_greedy(params) else None
        self.own_sampler = getattr(backend, "sample_token", None) if params.logprobs is None else None
        self.masker = getattr(backend, "mask_logits", None) if params.logprobs is None else None  # logprobs: raw

    def __call__(self, logits: Any, output: list[int], mask: Any, draft: int | None, spec: Any,
                 position: int) -> tuple[SampleOutput, bool]:
        """(the token, whether it is the draft at this position)."""
        params = self.params
        if draft is not None and spec is not None and spec.qs is not None:  # a sampled draft model's proposal
            from py_engine.speculative.accept import accept_sampled
            row = _row(self.masker(logits, mask)) if self.masker is not None and mask is not None else _row(logits)
            token, kept = accept_sampled(row, params, draft, spec.qs[position], spec.rng.random(),
                                         self.sampler.rng.random(), output, self.prompt_ids,
                                         None if self.masker is not None else mask)
            return _logprobs(self.sampler, logits, token), kept
        if self.argmax is not None:
            sample = SampleOutput(self.argmax(logits))
        elif self.own_sampler is not None:
            u = 0.0 if params.is_greedy else self.sampler.rng.random()  # one draw per token, as Sampler does
            masked = () if mask is None else (mask,)  # a hook without structured outputs takes five arguments
            sample = SampleOutput(self.own_sampler(logits, params, u, output, self.prompt_ids, *masked))
        elif self.masker is not None and mask is not None:
            sample = self.sampler.sample_with_logprobs(_row(self.masker(logits, mask)), output, self.prompt_ids)
        else:
            sample = self.sampler.sample_with_logprobs(_row(logits), output, self.prompt_ids, mask)
        return sample, draft is not None and sample.token_id == draft


def _logprobs(sampler: Sampler, logits: Any, token: int) -> SampleOutput:
    if sampler.params.logprobs is None:
        return SampleOutput(token)
    from py_engine.sampling import _with_logprobs
    return _with_logprobs(_row(logits), token, sampler.params.logprobs)


def complete(backend: Backend, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams,
             eos_token_ids: Sequence[int] = (), speculation: Any = None) -> Completion:
    """Run `stream` to the end and gather its chunks."""
    parts: list[str] = []
    tokens: list[int] = []
    logprobs: list[SampleOutput] = []
    reason = "length"
    for chunk in stream(backend, tokenizer, prompt_ids, params, eos_token_ids, speculation):
        parts.append(chunk.text)
        if chunk.token_id is not None:
            tokens.append(chunk.token_id)
        if chunk.logprobs is not None:
            logprobs.append(chunk.logprobs)
        reason = chunk.finish_reason or reason
    return Completion("".join(parts), list(prompt_ids), tokens, reason,
                      logprobs if params.logprobs is not None else None)
