"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the context's last n tokens.

    lookup = NgramLookup(prompt_ids, max_n=4, min_n=2)
    lookup.extend([token])             # every token the sequence keeps (prompt, then output)
    drafts = lookup.propose(4)         # [] when no n-gram of the last min_n..max_n tokens occurred before

n runs from max_n down to min_n and the first (longest) n that occurred before wins; of its occurrences the
latest, whose continuation is then read from the context itself (up to k tokens, and never past the context's
end). An index per n maps each n-gram to the end of its latest occurrence, updated as tokens arrive (max_n -
min_n + 1 dictionary writes a token), so a proposal costs a few lookups however long the context is. The last n
tokens themselves are indexed only once a token follows them: a match is always an earlier occurrence.
Stdlib only (ring 0): the page's Pyodide runtime proposes with this same code.
"""
from __future__ import annotations

from typing import Iterable, Sequence


class NgramLookup:
    def __init__(self, tokens: Sequence[int] = (), max_n: int = 4, min_n: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n ({min_n}) <= max_n ({max_n})")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # tokens[:_indexed] have every n-gram ending in them recorded
        self.matched: int | None = None  # the length of the n-gram the last proposal matched (None: no match)
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens the sequence keeps (never drafts that may be rejected)."""
        self.tokens.extend(tokens)

    def _index_until(self, end: int) -> None:
        """Record the n-grams ending at positions [_indexed, end) (each at its end, exclusive)."""
        toks = self.tokens
        for stop in range(self._indexed + 1, end + 1):  # an n-gram toks[stop - n:stop]
            for n, table in self._latest.items():
                if stop >= n:
                    table[tuple(toks[stop - n:stop])] = stop
        self._indexed = max(self._indexed, end)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest recurring suffix n-gram; [] if none recurs."""
        toks, length = self.tokens, len(self.tokens)
        if k < 1 or length < self.min_n + 1:
            self.matched = None
            return []
        self._index_until(length - 1)  # every n-gram that ends before the last token
        found, self.matched = None, None
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._latest[n].get(tuple(toks[length - n:]))
            if end is not None:
                found, self.matched = end, n
                break
        return [] if found is None else toks[found:found + k]
