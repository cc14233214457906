"""Which tokens each DFA state allows: a walk of the vocabulary trie together with the DFA.

From state q, a token is allowed when the DFA survives all its bytes (the DFA is trimmed, so
surviving means the output can still be completed). The walk goes down the trie carrying the
DFA state per depth; a dead byte skips the whole subtree. Masks are computed lazily, the
first time a state is reached, and kept per state (`TokenGrammar.mask`).

Why this is fast enough in pure Python: most of a JSON document's tokens sit in states that
loop on most bytes (inside a string, among digits). Where the bytes below a trie node all keep
the DFA in its state q (`stay` bytes) the subtree is accepted in one step, its tokens one
range of positions. A state that loops on every character outside ASCII as well (checked
once per state against the UTF-8 automaton) also takes subtrees whose non-ASCII bytes are
valid UTF-8. So a walk visits the nodes above the few tokens that matter (those holding a
quote, a backslash, a control byte) and skips the rest: the cost follows what the grammar
distinguishes, not the vocabulary's size.

A mask is kept as sorted ranges of positions (see vocab.py); ids, a byte map for JavaScript,
or a masked logits row are derived from it on demand.
"""
from __future__ import annotations

import functools
import itertools
import math
import re
import time
from collections import OrderedDict
from typing import Sequence

from py_engine.guided.automaton.dfa import DFA
from py_engine.guided.tokens.vocab import NOT_UTF8, VocabTrie

_NON_ASCII = sum(1 << b for b in range(0x80, 0x100))
_ALL_BYTES = (1 << 256) - 1
_LEADS = ((0xC2, 0xDF, 1, 0x80, 0xBF), (0xE0, 0xE0, 2, 0xA0, 0xBF), (0xE1, 0xEC, 2, 0x80, 0xBF),
          (0xED, 0xED, 2, 0x80, 0x9F), (0xEE, 0xEF, 2, 0x80, 0xBF), (0xF0, 0xF0, 3, 0x90, 0xBF),
          (0xF1, 0xF3, 3, 0x80, 0xBF), (0xF4, 0xF4, 3, 0x80, 0x8F))  # lead bytes: continuations, 1st range
NEG_INF = -math.inf
BITMAPS_KEPT = 128  # byte maps kept per grammar (each vocab_size bytes)


class TokenMask:
    """The tokens allowed in one DFA state: position ranges in the trie's order, plus EOS or not."""

    __slots__ = ("grammar", "state", "ranges", "count", "eos", "key")

    def __init__(self, grammar: TokenGrammar, state: int, ranges: list[int], eos: bool) -> None:
        self.grammar, self.state, self.ranges, self.eos = grammar, state, ranges, eos
        self.count = sum(ranges[1::2]) - sum(ranges[0::2]) + (len(grammar.eos_ids) if eos else 0)
        self.key = (id(grammar), state)

    def allowed_ids(self) -> list[int]:
        """Allowed token ids (in trie order, then EOS ids)."""
        order, r = self.grammar.trie.order, self.ranges
        ids = list(itertools.chain.from_iterable(order[r[i]:r[i + 1]] for i in range(0, len(r), 2)))
        if self.grammar.eos_in_trie:
            ids = [i for i in ids if i not in self.grammar.eos_in_trie]
        return ids + list(self.grammar.eos_ids) if self.eos else ids

    def bitmap(self) -> bytes:
        """1 for an allowed id, 0 otherwise, one byte per vocabulary id (what JavaScript reads)."""
        return self.grammar.bitmap(self)

    def disallowed_ids(self) -> list[int]:
        """The ids of the tokenizer's vocabulary this state forbids (the complement of allowed_ids)."""
        grammar = self.grammar
        order, r = grammar.trie.order, [0, *self.ranges, len(grammar.trie.order)]
        ids = list(itertools.chain.from_iterable(order[r[i]:r[i + 1]] for i in range(0, len(r), 2)))
        ids += grammar.trie.ids_outside if not self.eos else [i for i in grammar.trie.ids_outside
                                                               if i not in grammar.eos_ids]
        if grammar.eos_in_trie:  # EOS ids with text of their own: EOS decides, not the walk
            ids = [i for i in ids if i not in grammar.eos_in_trie]
            ids += [] if self.eos else sorted(grammar.eos_in_trie)
        return ids

    def apply(self, row: list[float]) -> list[float]:
        """A copy of a logits row with every token this state forbids at -inf (ids past the
        tokenizer's vocabulary too). Costs O(the smaller of the allowed and forbidden counts)."""
        vocab = self.grammar.vocab_size
        if self.count * 2 < vocab:  # few allowed: start from -inf
            out = [NEG_INF] * len(row)
            for i in self.allowed_ids():
                out[i] = row[i]
            return out
        out = list(row)
        for i in self.disallowed_ids():
            out[i] = NEG_INF
        if len(row) > vocab:  # padding ids past the tokenizer's vocabulary
            out[vocab:] = [NEG_INF] * (len(row) - vocab)
        return out


class TokenGrammar:
    """A DFA over the vocabulary of one tokenizer: lazily computed, cached token masks per state."""

    def __init__(self, dfa: DFA, trie: VocabTrie, eos_ids: Sequence[int]) -> None:
        self.dfa, self.trie = dfa, trie
        self.eos_ids = tuple(dict.fromkeys(i for i in eos_ids if 0 <= i < trie.vocab_size))
        self.eos_in_trie = {i for i in self.eos_ids if i not in set(trie.ids_outside)}
        self._masks: dict[int, TokenMask] = {}
        self._tests: list[tuple[int, float, bool] | None] = [None] * dfa.num_states  # see _bulk_test
        self._boundary_tests: list[tuple[int, float, bool] | None] = [None] * dfa.num_states
        self._mid_target: dict[int, int] = {}  # a state inside a character -> where it ends (-1: ambiguous)
        self._reaches: dict[tuple[int, int, bool], tuple[float, bool]] = {}
        self._unicode: dict[tuple[int, int], bool] = {}
        self._bitmaps: OrderedDict[int, bytes] = OrderedDict()
        self.walk_seconds = 0.0

    @property
    def vocab_size(self) -> int:
        return self.trie.vocab_size

    def mask(self, state: int) -> TokenMask:
        found = self._masks.get(state)
        if found is None:
            started = time.perf_counter()
            found = TokenMask(self, state, self._walk(state), self.dfa.accepting[state])
            self._masks[state] = found
            self.walk_seconds += time.perf_counter() - started
        return found

    def masks(self) -> dict[int, TokenMask]:
        """The masks computed so far, by state."""
        return dict(self._masks)

    def adopt(self, masks: dict[int, list[int]]) -> None:
        """Take masks computed elsewhere over the same DFA and trie (a compile worker's), by state."""
        for state, ranges in masks.items():
            if 0 <= state < self.dfa.num_states and state not in self._masks:
                self._masks[state] = TokenMask(self, state, list(ranges), self.dfa.accepting[state])

    def eos_mask(self) -> TokenMask | None:
        """Only EOS allowed (None when there is no EOS id: then nothing is masked)."""
        return TokenMask(self, -1, [], True) if self.eos_ids else None

    def precompute(self, seconds: float) -> int:
        """Masks of the states nearest the start first, for up to `seconds`; how many states are done."""
        deadline, seen, todo = time.perf_counter() + seconds, {self.dfa.start}, [self.dfa.start]
        for q in todo:  # breadth first over the DFA's transitions
            if time.perf_counter() > deadline:
                return len(self._masks)
            self.mask(q)
            for t in self.dfa.rows[q]:
                if t >= 0 and t not in seen:
                    seen.add(t)
                    todo.append(t)
        return len(self._masks)

    def bitmap(self, mask: TokenMask) -> bytes:
        found = self._bitmaps.get(mask.state) if mask.state >= 0 else None
        if found is not None:
            self._bitmaps.move_to_end(mask.state)
            return found
        bits = bytearray(self.vocab_size)
        for i in mask.allowed_ids():
            bits[i] = 1
        found = self._bitmaps[mask.state] = bytes(bits)
        if len(self._bitmaps) > BITMAPS_KEPT:
            self._bitmaps.popitem(last=False)
        return found

    def _walk(self, q0: int) -> list[int]:
        """Allowed position ranges [lo0, hi0, lo1, hi1, ...] from state q0 (merged, ascending)."""
        trie, dfa = self.trie, self.dfa
        byte, size, depth, lo, hi, own = trie.byte, trie.size, trie.depth, trie.lo, trie.hi, trie.own
        height, row = trie.height, dfa.row
        tests = self._tests_from(q0)
        key = trie.key_root if tests is self._boundary_tests else trie.key
        rows = [None] * (trie.max_depth + 1)
        rows[0] = row(q0)
        out: list[int] = []
        p, end = 1, len(byte)
        while p < end:
            q = rows[depth[p] - 1][byte[p]]
            if q < 0:
                p += size[p]
                continue
            test = tests[q]
            if test is None:
                test = self._test(q, tests)
            if not key[p] & test[0]:  # every byte below keeps the DFA on its track
                if height[p] <= test[1]:  # and no token is too long for it: take them whole
                    _add(out, lo[p], hi[p])
                    p += size[p]
                    continue
                if test[2]:  # past `reach` characters the track ends: those with at most that many
                    self._short_tokens(out, lo[p], hi[p], trie.pchars[p] + test[1])
                    p += size[p]
                    continue
            if own[p]:
                _add(out, lo[p], lo[p] + own[p])
            rows[depth[p]] = row(q)
            p += 1
        return out

    def _tests_from(self, q0: int) -> list:
        """The bulk tests for a walk from q0: at a character boundary (no continuation byte alive)
        states in the middle of a character may use the test of where the character ends."""
        full = self.dfa.row(q0)
        if any(full[b] >= 0 for b in range(0x80, 0xC0)):
            return self._tests
        self._test(q0, self._boundary_tests)  # marks the states inside q0's characters
        return self._boundary_tests

    def _test(self, q: int, tests: list) -> tuple[int, float, bool]:
        own = self._tests[q]
        if own is None:
            own = self._tests[q] = self._bulk_test(q)
        if tests is self._tests:
            return own
        target = self._mid_target.get(q)
        found = own if target is None or target < 0 else self._test(target, tests)
        tests[q] = found
        return found

    def _short_tokens(self, out: list[int], lo: int, hi: int, most: float) -> None:
        """Add the positions in [lo, hi) whose token has at most `most` characters (runs found in C)."""
        flags = self.trie.nchars[lo:hi].translate(_at_most(min(int(most), 255)))
        for run in _RUNS.finditer(flags):
            _add(out, lo + run.start(), lo + run.end())

    def _bulk_test(self, q: int) -> tuple[int, float, bool]:
        """(bad, reach, ends) of state q: a trie node reached in q whose key has no `bad` bit and
        whose height is at most `reach` has every token below it allowed; when `ends`, a token
        below it is allowed exactly when it has at most `reach` more characters.

        The bytes q moves on most (those it stays on, if any) all lead to one state t; `reach` is
        how many of them in a row keep leading, state after state, to a single next state
        (infinite when t is q: a loop), and `ends` says that after that every one of them is
        dead (a maxLength string's count ran out). Characters outside ASCII count too when every
        one of them leads to that same next state (then `bad` holds NOT_UTF8 instead of their bytes)."""
        full = self.dfa.row(q)
        targets: dict[int, int] = {}
        for b in range(128):
            if full[b] >= 0:
                targets[full[b]] = targets.get(full[b], 0) | 1 << b
        if not targets:
            return _ALL_BYTES | NOT_UTF8, 0, False
        t = q if q in targets else max(targets, key=lambda s: bin(targets[s]).count("1"))
        ascii_bytes = targets[t]
        unicode = self._unicode_to(q, t)
        bad = (_ALL_BYTES & ~ascii_bytes & ~_NON_ASCII) | NOT_UTF8 if unicode else _ALL_BYTES & ~ascii_bytes
        return (bad, *self._reach(q, ascii_bytes, unicode))

    def _reach(self, q: int, ascii_bytes: int, unicode: bool) -> tuple[float, bool]:
        """How many steps from q every byte of `ascii_bytes` (and, with `unicode`, every other
        character) leads to one same live state; and whether after them all of those are dead.
        Memoized along the chain: reach(q) is 1 + reach(next), so a counted string of n states
        costs n steps, not n squared."""
        memo = self._reaches
        picked = [b for b in range(128) if ascii_bytes >> b & 1]
        chain: list[int] = []
        result: tuple[float, bool] | None = None
        while result is None:
            key = (q, ascii_bytes, unicode)
            if key in memo:
                result = memo[key]
                break
            if q in chain or len(chain) > self.trie.max_depth:
                result = (math.inf, False) if q in chain else (0, False)
                break
            full = self.dfa.row(q)
            nxt = set(map(full.__getitem__, picked))
            t = nxt.pop() if len(nxt) == 1 else -1
            if t < 0 or (unicode and not self._unicode_to(q, t)):
                dead = not nxt and t < 0 and (not unicode or all(full[b] < 0 for b in range(0xC2, 0xF5)))
                memo[key] = result = (0, dead)
                break
            if t == q:
                memo[key] = result = (math.inf, False)
                break
            chain.append(q)
            q = t
        steps, dead = result
        for i, state in enumerate(reversed(chain), 1):
            memo[(state, ascii_bytes, unicode)] = (steps + i, dead)
        return (steps + len(chain), dead) if chain else result

    def _unicode_to(self, q: int, target: int) -> bool:
        """Does every non-ASCII character (each valid UTF-8 sequence) lead from q to `target`,
        alive all along? (Cached per pair.)"""
        found = self._unicode.get((q, target))
        if found is None:
            found = self._unicode[(q, target)] = self._check_unicode_to(q, target)
        return found

    def _check_unicode_to(self, q: int, target: int) -> bool:
        row = self.dfa.row
        todo = []
        for first, last, need, c_lo, c_hi in _LEADS:
            for b in range(first, last + 1):
                todo.append((row(q)[b], need, c_lo, c_hi))
        seen, inside = set(), set()
        while todo:
            d, need, c_lo, c_hi = item = todo.pop()
            if d < 0:
                return False
            if item in seen:
                continue
            seen.add(item)
            inside.add(d)
            nxt = row(d)
            for b in range(c_lo, c_hi + 1):
                t = nxt[b]
                if t < 0 or (need == 1 and t != target):
                    return False
                if need > 1:
                    todo.append((t, need - 1, 0x80, 0xBF))
        for d in inside:  # remembered for walks from a boundary: their characters end in `target`
            self._mid_target[d] = target if self._mid_target.get(d, target) == target else -1
        return True


_RUNS = re.compile(b"\x01+")


@functools.lru_cache(maxsize=256)
def _at_most(k: int) -> bytes:
    """A bytes.translate table: 1 for values <= k, else 0."""
    return bytes(int(v <= k) for v in range(256))


def _add(out: list[int], lo: int, hi: int) -> None:
    if out and out[-1] == lo:
        out[-1] = hi
    else:
        out += (lo, hi)
