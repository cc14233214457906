"""The retrieval gate: a request's question, embedded, against its session's and the global patterns.

    gate = Gate(bank, embedder, threshold=0.8)
    match = gate.match(session, question)     # the nearest pattern at least `threshold` similar, or None

A pattern matches when its question's embedding is at least `threshold`
similar to the request's AND the two share a keyword when the pattern has
any: a name (a capitalised word inside a sentence) or a word the embedder's
vocabulary splits into pieces. A sentence embedding of this size puts "What
is the capital of Zorbia?" as near "What is the capital of Branvex?" (0.91)
as its own paraphrase "Which city is Zorbia's capital?": the words differ in
one name, and names are what it knows least. The keyword rule is hybrid
retrieval's lexical half; the embedding is its semantic half.

Nothing near, nothing applied: a request whose question is no stored
pattern's runs on the base model, so what one correction teaches reaches
that question (asked any way) and no other. Embeddings are cached by text
(`EmbeddingCache`, bounded), since a question asked twice is common and its
embedding is the gate's only cost. Ring 0: the embedder is passed in.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence

from .patterns import Match, Pattern, PatternBank

CACHE_SIZE = 4096
MAX_QUESTION_CHARS = 2048  # what is embedded of a question: its end, where a chat's last turn is


_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
_SENTENCE_END = re.compile(r"[.!?:\n]\s*$")


def keywords(text: str, is_rare: Callable[[str], bool] | None = None) -> tuple[str, ...]:
    """The names and rare words of `text`, lower case, sorted: capitalised words that do not start a
    sentence, and words `is_rare` says the vocabulary splits; a possessive 's is dropped."""
    out = set()
    for m in _WORD.finditer(text[-MAX_QUESTION_CHARS:]):
        word = re.sub(r"['’]s$", "", m.group())
        low = word.lower()
        starts = m.start() == 0 or bool(_SENTENCE_END.search(text[max(0, m.start() - 4):m.start()]))
        if len(word) > 1 and ((word[0].isupper() and not starts) or (is_rare is not None and is_rare(low))):
            out.add(low)
    return tuple(sorted(out))


def agree(pattern: Pattern, words: tuple[str, ...]) -> bool:
    """A pattern with keywords needs the question to share one; one without needs nothing."""
    return not pattern.keywords or bool(set(pattern.keywords) & set(words))


class EmbeddingCache:
    """text -> embedding, least recently used out past `size`; `embedder.embed(texts)` fills misses."""

    def __init__(self, embedder: Any, size: int = CACHE_SIZE) -> None:
        self.embedder, self.size = embedder, size
        self.store: OrderedDict[str, list[float]] = OrderedDict()
        self.lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def dim(self) -> int:
        return int(self.embedder.dim)

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        texts = [t[-MAX_QUESTION_CHARS:] for t in texts]
        with self.lock:
            missing = [t for t in dict.fromkeys(texts) if t not in self.store]
            self.hits += len(texts) - len(missing)
            self.misses += len(missing)
        fresh = dict(zip(missing, self.embedder.embed(missing))) if missing else {}
        with self.lock:
            for t, v in fresh.items():
                self.store[t] = v
            out = []
            for t in texts:
                v = fresh.get(t) or self.store.get(t)
                if t in self.store:
                    self.store.move_to_end(t)
                out.append(v)
            while len(self.store) > self.size:
                self.store.popitem(last=False)
        return out


class Gate:
    def __init__(self, bank: PatternBank, embedder: Any, threshold: float, k: int = 4,
                 use_keywords: bool = True) -> None:
        self.bank, self.threshold, self.k, self.use_keywords = bank, threshold, k, use_keywords
        self.cache = embedder if isinstance(embedder, EmbeddingCache) else EmbeddingCache(embedder)
        self.opened = self.closed = 0  # requests that found a pattern / found none (with patterns to find)

    def embed(self, text: str) -> list[float]:
        return self.cache.embed([text])[0]

    def keywords(self, text: str) -> tuple[str, ...]:
        return keywords(text, getattr(self.cache.embedder, "is_rare", None)) if self.use_keywords else ()

    def worth_asking(self, session: str | None) -> bool:
        """Whether any pattern could answer a request of `session` (else the embedding is skipped)."""
        bank = self.bank
        with bank.lock:
            return None in bank.indexes or (session or "") in bank.indexes

    def match(self, session: str | None, question: str) -> Match | None:
        """The nearest of the session's and the global patterns at least `threshold` similar, or None."""
        if not question or not self.worth_asking(session):
            return None
        hits = self.bank.search(session, self.embed(question), self.k, self.threshold)
        words = self.keywords(question) if hits else ()
        for hit in hits:  # best first: the nearest that shares a keyword
            if not self.use_keywords or agree(hit.pattern, words):
                self.opened += 1
                return hit
        self.closed += 1
        return None
