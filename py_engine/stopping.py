"""When generation stops: stop strings on streamed text, stop tokens, EOS, length.

Stop strings are matched on detokenized text, so one can span several tokens
("Obs" + "erv" + "ation:"), and the matched text must never reach the user.
`StopStringMatcher` is fed the text chunks an incremental detokenizer emits and
returns what is safe to show now, holding back the longest tail that could
still be the start of a stop string.

Which stop wins, made independent of how the text was chunked: the stop ends
at the earliest end position in the whole text (so it fires as soon as any
stop string is complete), and among stop strings ending there the one that
starts earliest is cut. The emitted text is everything before it.
(vLLM instead takes the first stop string in list order found after each
token, which can depend on token boundaries.) Stdlib only.
"""
from __future__ import annotations

from typing import Iterable, Literal, NamedTuple, Sequence

from py_engine.sampling_params import SamplingParams

FinishReason = Literal["stop", "length"]


class StopMatch(NamedTuple):
    text: str  # safe to emit now
    stop: str | None  # the stop string hit, or None while generation goes on


class StopStringMatcher:
    """Feed detokenized chunks; get back text safe to emit and whether a stop string was hit.

    After a hit, further feeds return ("", stop). When generation ends for
    another reason, call flush() for the text still held back.
    """

    def __init__(self, stop: Iterable[str]) -> None:
        self.stops = tuple(stop)
        if any(not isinstance(s, str) or s == "" for s in self.stops):
            raise ValueError(f"stop strings must be non-empty str, got {self.stops!r}")
        # Every proper prefix of a stop string: a tail equal to one of them must wait.
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._longest_prefix = max(map(len, self._prefixes), default=0)
        self._held = ""
        self.hit: str | None = None

    def feed(self, chunk: str) -> StopMatch:
        if self.hit is not None:
            return StopMatch("", self.hit)
        buffer = self._held + chunk
        found = self._earliest_stop(buffer)
        if found is not None:
            start, self.hit = found
            self._held = ""
            return StopMatch(buffer[:start], self.hit)
        keep = self._held_back(buffer)
        self._held = buffer[len(buffer) - keep:]
        return StopMatch(buffer[:len(buffer) - keep], None)

    def flush(self) -> str:
        """The held-back tail, for when generation ended without a stop string."""
        text, self._held = ("" if self.hit is not None else self._held), ""
        return text

    def _earliest_stop(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop) of the match that ends first, ties to the earliest start.

        buffer holds no complete match before its held part (it would have
        stopped earlier), so any match found here ends in the new chunk.
        """
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = buffer.find(stop)  # the first occurrence of a string also ends first
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _held_back(self, buffer: str) -> int:
        """Length of the longest tail of buffer that is a proper prefix of a stop string."""
        for k in range(min(len(buffer), self._longest_prefix), 0, -1):
            if buffer[-k:] in self._prefixes:
                return k
        return 0


def finish_reason(params: SamplingParams, token_id: int, num_output_tokens: int,
                  eos_token_ids: Sequence[int] = (), max_new_tokens: int | None = None) -> FinishReason | None:
    """Whether generation ends after appending `token_id`, the num_output_tokens-th token.

    "stop": token_id is in params.stop_token_ids, or is an EOS id and not
    params.ignore_eos. "length": num_output_tokens reached params.max_tokens or
    max_new_tokens (the room left in the context window, from the engine).
    Stop wins when both hold, because the sequence ended on its own (vLLM
    checks length first). A stop string is the StopStringMatcher's call.
    """
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    limits = [m for m in (params.max_tokens, max_new_tokens) if m is not None]
    if limits and num_output_tokens >= min(limits):
        return "length"
    return None
