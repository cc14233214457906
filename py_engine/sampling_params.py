"""Sampling parameters: one frozen, validated dataclass per request.

`SamplingParams` is the contract between the API layer (OpenAI-shaped
requests), the pure-Python reference sampler in `py_engine.sampling`, and the
torch and in-browser samplers that are tested against it. It is validated once
in `__post_init__` so that every sampler can trust it; each bad value raises a
`SamplingParamsError` (a `ValueError`) that names the field and its allowed
range. Field names and neutral values follow vLLM: top_k -1 or 0 disables
top-k, top_p 1 disables top-p, min_p 0 disables min-p, penalties of 1 / 0 are
off. Stdlib only, so it imports in Pyodide.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from py_engine.guided.errors import GuidedError
from py_engine.guided.params import StructuredOutputsParams

# Bounds shared with the OpenAI API (penalties, logit_bias).
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# Integers stay within the types the samplers hand them to: counts and token ids in int32, seeds in
# int64 (as vLLM's API); a server narrows top_k and ids further to its vocabulary.
INT32_MAX = 2**31 - 1
SEED_RANGE = (-(2**63), 2**63 - 1)
# Stop strings are matched in memory linear in their total length (stopping.py); these bound that.
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024

# Below this the distribution is all but a point mass on the argmax, and
# x / temperature heads for overflow as it nears 0; vLLM's _SAMPLING_EPS makes
# the same cut. Every sampler must treat it as greedy, so they agree here.
GREEDY_TEMPERATURE = 1e-5


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range or of the wrong type.

    `field` names the offending parameter so an API layer can point at it.
    """

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _is_int(value: Any) -> bool:
    # bool is an int subclass; True as a top_k is a bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _number(name: str, value: Any, lo: float, hi: float, *,
            lo_open: bool = False, hi_open: bool = False) -> float:
    """Check that `value` is a finite real in the interval and return it as float."""
    left, right = "(" if lo_open else "[", ")" if hi_open or hi == math.inf else "]"
    interval = f"{left}{lo:g}, {hi:g}{right}"
    if not (_is_int(value) or isinstance(value, float)):
        raise SamplingParamsError(name, f"must be a number in {interval}, got {type(value).__name__} {value!r}")
    v = float(value)
    inside = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not math.isfinite(v) or not inside:
        raise SamplingParamsError(name, f"must be a finite number in {interval}, got {value!r}")
    return v


def _optional_int(name: str, value: Any, minimum: int, note: str = "", maximum: int = INT32_MAX) -> int | None:
    if value is None:
        return None
    if not _is_int(value):
        raise SamplingParamsError(name, f"must be an integer or None{note}, got {type(value).__name__} {value!r}")
    if not minimum <= value <= maximum:
        raise SamplingParamsError(name, f"must be an integer >= {minimum} and <= {maximum}{note}, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    """repr(value), cut for the error message: a 5,000-digit number must not come back whole."""
    if _is_int(value) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _logit_bias(value: Any) -> Mapping[int, float]:
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise SamplingParamsError("logit_bias", f"must be a dict of token id -> bias, got {type(value).__name__}")
    lo, hi = LOGIT_BIAS_RANGE
    out: dict[int, float] = {}
    for token, bias in value.items():
        if not _is_int(token) or not 0 <= token <= INT32_MAX:
            raise SamplingParamsError("logit_bias", f"keys must be token ids (int in [0, {INT32_MAX}]), "
                                                    f"got {_short(token)}")
        out[token] = _number(f"logit_bias[{token}]", bias, lo, hi)
    # A read-only view: the dataclass is frozen, so its dict must be too.
    return MappingProxyType(out)


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise SamplingParamsError("stop", f"must be a string or a list of strings, got {value!r}")
    if any(s == "" for s in items):
        raise SamplingParamsError("stop", "stop strings must be non-empty")
    if len(items) > MAX_STOP_STRINGS:
        raise SamplingParamsError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    longest = max(map(len, items), default=0)
    if longest > MAX_STOP_LENGTH:
        raise SamplingParamsError("stop", f"a stop string may have at most {MAX_STOP_LENGTH} characters, "
                                          f"got one of {longest}")
    return tuple(items)


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in value):
        raise SamplingParamsError(name, f"must be a list of token ids (int in [0, {INT32_MAX}]), "
                                        f"got {_short(value)}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise SamplingParamsError(name, f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(value)}")
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop; see py_engine.sampling for the semantics.

    temperature: 0 (or below 1e-5, as in vLLM) means greedy argmax.
    top_k: keep the k highest logits (ties at the k-th value kept); -1 or 0 disables.
    top_p: keep the smallest descending-probability prefix with mass >= top_p; in (0, 1].
    min_p: keep tokens whose probability is >= min_p times the top one's; in [0, 1].
    repetition_penalty: HF/CTRL-style, on prompt and generated ids; > 0, 1 is off.
    presence_penalty, frequency_penalty: OpenAI-style, on generated ids only; in [-2, 2].
    logit_bias: token id -> additive bias in [-100, 100] (OpenAI semantics).
    seed: seeds the sampler's own random.Random; None draws one from the OS.
    max_tokens: most tokens to generate; None means until a stop or the context ends.
    stop: strings that end generation; the matched text is not returned.
    stop_token_ids: token ids that end generation (even with ignore_eos).
    ignore_eos: keep generating past the model's EOS token(s).
    logprobs: None for none; k >= 0 returns the chosen token's logprob and the top k.
    n: completions per request; the engine runs n sequences with one Sampler each.
    structured_outputs: a JSON schema, regex or choice the output must follow (py_engine.guided):
        forbidden tokens are masked before sampling, EOS only once the output is complete.
    skip_special_tokens: leave special tokens out of the text (tool-call parsers that read
        markers such as Mistral's [TOOL_CALLS] turn it off).
    speculative: False keeps this request off speculative decoding where the engine has it on (it changes
        no output, only speed; py_engine.speculative).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # hash=False: a mapping is unhashable, and two params differing only in bias
    # colliding in a hash is harmless.
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = field(default=None, hash=False)
    skip_special_tokens: bool = True
    speculative: bool = True

    def __post_init__(self) -> None:
        pen_lo, pen_hi = PENALTY_RANGE
        checked: dict[str, Any] = {
            "temperature": _number("temperature", self.temperature, 0.0, math.inf),
            "top_p": _number("top_p", self.top_p, 0.0, 1.0, lo_open=True),
            "min_p": _number("min_p", self.min_p, 0.0, 1.0),
            "repetition_penalty": _number("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                                          lo_open=True),
            "presence_penalty": _number("presence_penalty", self.presence_penalty, pen_lo, pen_hi),
            "frequency_penalty": _number("frequency_penalty", self.frequency_penalty, pen_lo, pen_hi),
            "top_k": _optional_int("top_k", self.top_k, -1, " (-1 or 0 disables)"),
            "seed": _optional_int("seed", self.seed, SEED_RANGE[0], maximum=SEED_RANGE[1]),
            "max_tokens": _optional_int("max_tokens", self.max_tokens, 1),
            "logprobs": _optional_int("logprobs", self.logprobs, 0),
            "n": _optional_int("n", self.n, 1),
            "logit_bias": _logit_bias(self.logit_bias),
            "stop": _stop_strings(self.stop),
            "stop_token_ids": _token_ids("stop_token_ids", self.stop_token_ids),
        }
        if checked["top_k"] is None:
            raise SamplingParamsError("top_k", "must be an integer >= -1 (-1 or 0 disables), got None")
        if checked["n"] is None:
            raise SamplingParamsError("n", "must be an integer >= 1, got None")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise SamplingParamsError("skip_special_tokens", f"must be a bool, got {self.skip_special_tokens!r}")
        if not isinstance(self.speculative, bool):
            raise SamplingParamsError("speculative", f"must be a bool, got {self.speculative!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs", "must be a StructuredOutputsParams")
        # Frozen: normalized values (int -> float, list -> tuple) go in via object.__setattr__.
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def greedy(cls, **overrides: Any) -> SamplingParams:
        """Argmax decoding (temperature 0); other fields may be overridden."""
        return cls(**{"temperature": 0.0, **overrides})

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax and draws no random number."""
        return self.temperature < GREEDY_TEMPERATURE


# OpenAI request fields (plus vLLM's extensions) copied as they are.
_OPENAI_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "n", "skip_special_tokens",
                  "speculative")


def _openai_logit_bias(value: Any) -> dict[int, Any] | None:
    # JSON object keys are strings: {"50256": -100}.
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SamplingParamsError("logit_bias", f"must be an object of token id -> bias, got {value!r}")
    out: dict[int, Any] = {}
    for key, bias in value.items():
        text = str(key)
        # ASCII digits only: str.isdigit() takes "²" and "٣", and int() reads "٣" as 3. Ten digits hold
        # any int32 id; longer keys are refused before int() (which refuses past 4,300 digits itself).
        if not (text.isascii() and text.isdigit() and len(text) <= 10):
            raise SamplingParamsError("logit_bias", f"keys must be token ids as decimal strings of ASCII digits, "
                                                    f"got {_short(key)}")
        out[int(text)] = bias
    return out


def _openai_logprobs(request: Mapping[str, Any]) -> int | None:
    # Chat: logprobs is a bool and top_logprobs the count; completions: logprobs is the count.
    logprobs, top = request.get("logprobs"), request.get("top_logprobs")
    if isinstance(logprobs, bool) or (logprobs is None and top is not None):
        if top is not None and logprobs is not True:
            raise SamplingParamsError("top_logprobs", "requires logprobs=true")
        return (0 if top is None else top) if logprobs else None
    return logprobs


def from_openai(request: Mapping[str, Any]) -> SamplingParams:
    """Build SamplingParams from an OpenAI chat/completions request body.

    Unknown fields (model, messages, stream, ...) are ignored; null means default.
    max_completion_tokens wins over the older max_tokens.
    """
    kwargs = {k: request[k] for k in _OPENAI_FIELDS if request.get(k) is not None}
    max_tokens = request.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = request.get("max_tokens")
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    bias = _openai_logit_bias(request.get("logit_bias"))
    if bias is not None:
        kwargs["logit_bias"] = bias
    kwargs["logprobs"] = _openai_logprobs(request)
    try:
        kwargs["structured_outputs"] = structured_outputs_from_openai(request)
    except GuidedError as exc:
        raise SamplingParamsError((exc.param or "response_format").split(".")[0], str(exc)) from None
    return SamplingParams(**kwargs)


# vLLM's older per-field extras, still sent by many clients.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern"}


def structured_outputs_from_openai(request: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """The output constraint of a request: `response_format` (OpenAI: json_object, or json_schema
    with its `schema`), vLLM's `structured_outputs` {json, regex, choice, grammar, ...}, its older
    `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, or llama.cpp's `grammar`
    (GBNF). At most one of them may constrain."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = request.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(("response_format", spec))
    if request.get("structured_outputs") is not None:
        found.append(("structured_outputs", _named(lambda: StructuredOutputsParams.from_dict(
            request["structured_outputs"]), "structured_outputs")))
    guided = {new: request[old] for old, new in _GUIDED_FIELDS.items() if request.get(old) is not None}
    if guided and set(guided) != {"whitespace_pattern"}:
        sent = next(old for old, new in _GUIDED_FIELDS.items() if new in guided and new != "whitespace_pattern")
        found.append((sent, _named(lambda: StructuredOutputsParams.from_dict(guided, sent), sent)))
    if request.get("grammar") is not None:
        found.append(("grammar", _named(lambda: StructuredOutputsParams(grammar=request["grammar"]), "grammar")))
    if len(found) > 1:
        raise GuidedError(f"{' and '.join(name for name, _ in found)} both constrain the output; give one",
                          found[1][0])
    if not found:
        return None
    origin, spec = found[0]
    object.__setattr__(spec, "origin", origin)  # the field sent, for error messages
    return spec


def _named(build: Any, sent: str) -> StructuredOutputsParams:
    """build(), its GuidedError naming the field the client sent (a GBNF error says "grammar")."""
    try:
        return build()
    except GuidedError as exc:
        raise GuidedError(str(exc), sent) from None


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
        raise GuidedError("response_format must be an object with a 'type'", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name", ""), str):
            raise GuidedError("response_format.json_schema must be an object with a 'name' and a 'schema'",
                              "response_format")
        schema = spec.get("schema", True)  # OpenAI: no schema means any JSON
        return StructuredOutputsParams(json=schema)
    raise GuidedError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      "response_format")
