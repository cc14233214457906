"""SpeculativeConfig: how a model guesses ahead, with vLLM's `--speculative-config` field names.

    SpeculativeConfig.parse("ngram")                                   # prompt lookup, 4 tokens a step
    SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 5})
    SpeculativeConfig.parse({"model": "path/to/draft", "num_speculative_tokens": 4})   # a draft model
    SpeculativeConfig.parse('{"method": "ngram"}')                     # the CLI's JSON

Fields as vLLM's SpeculativeConfig where they mean the same: `method` ("ngram" or "draft_model"; a `model`
alone means draft_model), `model`, `num_speculative_tokens`, `prompt_lookup_max` / `prompt_lookup_min` (the
longest and shortest n-gram looked up; vLLM requires max for ngram, ruvllm defaults to 4 and 2),
`disable_by_batch_size` (no drafts in a server step with more running sequences than this), `quantization` (of
the draft model). ruvllm's own: `acceptance_floor`: each step a sequence drafts as many tokens (up to
num_speculative_tokens) as its recent acceptance and the engine's measured step costs say are fastest, none
when its estimated acceptance is below this floor or drafting does not pay (stats.DraftLength; speculation
changes no output, so off is always safe); 0 turns that off: always num_speculative_tokens drafts. Every value
is checked here, once; a bad one raises SpeculativeConfigError naming the field. Stdlib only (ring 0).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Mapping

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # drafts a step: the verify pass scores k + 1 rows
MAX_LOOKUP = 32  # the longest n-gram prompt lookup matches
UNSUPPORTED = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")


class SpeculativeConfigError(ValueError):
    """A speculative decoding setting out of range or unknown; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"speculative config {field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    quantization: str | None = None
    acceptance_floor: float = 0.2

    def __post_init__(self) -> None:
        if self.method in UNSUPPORTED:
            raise SpeculativeConfigError("method", f"{self.method!r} needs heads trained for the target model, which "
                                                   f"ruvllm does not run; use one of {', '.join(METHODS)}")
        if self.method not in METHODS:
            raise SpeculativeConfigError("method", f"{self.method!r} is not one of {', '.join(METHODS)}")
        _int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.method == "ngram":
            if self.model is not None:
                raise SpeculativeConfigError("model", "ngram looks tokens up in the context: leave out `model`")
            if self.quantization is not None:
                raise SpeculativeConfigError("quantization", "applies to a draft model only")
            hi = _int("prompt_lookup_max", 4 if self.prompt_lookup_max is None else self.prompt_lookup_max, 1,
                      MAX_LOOKUP)
            lo = _int("prompt_lookup_min", min(2, hi) if self.prompt_lookup_min is None else self.prompt_lookup_min,
                      1, MAX_LOOKUP)
            if lo > hi:
                raise SpeculativeConfigError("prompt_lookup_min", f"{lo} is above prompt_lookup_max {hi}")
            object.__setattr__(self, "prompt_lookup_max", hi)
            object.__setattr__(self, "prompt_lookup_min", lo)
        else:
            if not isinstance(self.model, str) or not self.model:
                raise SpeculativeConfigError("model", "draft_model needs `model`: a model folder, alias or file")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise SpeculativeConfigError("prompt_lookup_max", "prompt_lookup_min/max are for ngram only")
            if self.quantization is not None and not isinstance(self.quantization, str):
                raise SpeculativeConfigError("quantization", "a method name such as int8 or int4")
        if self.disable_by_batch_size is not None:
            _int("disable_by_batch_size", self.disable_by_batch_size, 2, 1 << 20)
        floor = self.acceptance_floor
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= floor <= 1.0:
            raise SpeculativeConfigError("acceptance_floor", f"{floor!r} is not a number in [0, 1]")

    @classmethod
    def parse(cls, value: "str | Mapping[str, Any] | SpeculativeConfig | None",
              num_speculative_tokens: int | None = None) -> "SpeculativeConfig | None":
        """None (off), a config, "ngram", a JSON object (the CLI's), a mapping, or a draft model's name.
        num_speculative_tokens, when given, overrides the value's (the CLI's --num-speculative-tokens)."""
        if value is None or value == "" or value is False:
            return None
        if isinstance(value, SpeculativeConfig):
            config = value
        elif isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as error:
                    raise SpeculativeConfigError("json", f"not a JSON object: {error}") from None
                return cls.parse(value, num_speculative_tokens)
            config = cls() if text == "ngram" else cls(method="draft_model", model=text)
        elif isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise SpeculativeConfigError(unknown[0], f"unknown field; the fields are {', '.join(sorted(known))}")
            args = dict(value)
            if "method" not in args and args.get("model"):
                args["method"] = "draft_model"
            config = cls(**args)
        else:
            raise SpeculativeConfigError("speculative", f"{type(value).__name__} is not a config, a name or a mapping")
        if num_speculative_tokens is not None:
            config = cls(**{**config.to_dict(), "num_speculative_tokens": num_speculative_tokens})
        return config

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpeculativeConfigError(name, f"{value!r} is not an integer in [{lo}, {hi}]")
    return value
