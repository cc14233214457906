"""Nearest stored vectors by cosine similarity: exact below a size, HNSW above it (ring 0).

    index = VectorIndex(dim=384)
    index.add(7, vector)                  # unit-normalised on the way in
    index.search(query, k=4)              # [(7, 0.93), ...], best first
    index.remove(7)

Exact search is a scan: with numpy (when importable) one [n, d] @ [d] product,
else plain Python dot products (what runs in the page, under Pyodide without
numpy). From `exact_below` vectors on, a graph index answers instead: faiss's
IndexHNSWFlat (inner product on unit vectors = cosine) when faiss is installed
(`pip install faiss-cpu`: a wheel, nothing to compile); removals there are
tombstones (searched past, the graph rebuilt from the kept vectors once a
quarter of it is dead), since an HNSW graph cannot drop a node. The vectors themselves are always kept here, so the index
can be rebuilt, persisted by its owner, and searched exactly for tests.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

EXACT_BELOW = 4096  # an exact scan of 4096 x 384 floats is ~1 ms with numpy: below it a graph buys nothing
HNSW_M = 32
HNSW_EF_SEARCH = 64


def unit(vector: Sequence[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    if not math.isfinite(norm) or norm == 0.0:
        raise ValueError("a vector to index must be finite and non-zero")
    return [float(x) / norm for x in vector]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # Pyodide without numpy, or ring 0's test with numpy blocked
        return None
    return numpy


class VectorIndex:
    """Keys (ints) to unit vectors of `dim`; `search` gives the `k` nearest by cosine similarity."""

    def __init__(self, dim: int, exact_below: int = EXACT_BELOW, backend: str = "auto") -> None:
        if not 1 <= dim <= 1 << 16:
            raise ValueError(f"dim: 1 to 65536, got {dim}")
        if backend not in ("auto", "exact", "faiss"):
            raise ValueError(f"backend: auto, exact or faiss, got {backend!r}")
        self.dim, self.exact_below, self.backend = dim, exact_below, backend
        self.vectors: dict[int, list[float]] = {}
        self._np = _numpy()
        self._matrix: Any = None  # numpy [n, dim] of self.vectors in self._order, rebuilt when stale
        self._order: list[int] = []
        self._graph: _Graph | None = None

    def __len__(self) -> int:
        return len(self.vectors)

    def __contains__(self, key: int) -> bool:
        return key in self.vectors

    @property
    def kind(self) -> str:
        """What answers a search now: "exact" or the graph library's name."""
        return self._graph.library if self._graph is not None else "exact"

    def add(self, key: int, vector: Sequence[float]) -> None:
        if len(vector) != self.dim:
            raise ValueError(f"vector: {self.dim} numbers expected, got {len(vector)}")
        if key in self.vectors:
            self.remove(key)
        v = unit(vector)
        self.vectors[key] = v
        self._matrix = None
        if self._graph is not None:
            self._graph.add(key, v)
        elif self.backend != "exact" and len(self.vectors) >= self.exact_below:
            self._graph = _Graph.build(self.backend, self.dim, self.vectors)

    def remove(self, key: int) -> bool:
        if self.vectors.pop(key, None) is None:
            return False
        self._matrix = None
        if self._graph is not None:
            self._graph.dead.add(key)
            if len(self.vectors) < self.exact_below:
                self._graph = None
            elif len(self._graph.dead) * 4 > len(self.vectors):
                self._graph = _Graph.build(self._graph.library, self.dim, self.vectors)
        return True

    def search(self, query: Sequence[float], k: int = 1) -> list[tuple[int, float]]:
        """The `k` stored vectors most similar to `query`: (key, cosine), best first."""
        if not self.vectors or k < 1:
            return []
        q = unit(query)
        if self._graph is not None:
            return self._graph.search(q, k, self.vectors)
        return self.exact(q, k)

    def exact(self, q: list[float], k: int) -> list[tuple[int, float]]:
        np = self._np
        if np is None:
            scored = [(key, sum(a * b for a, b in zip(v, q))) for key, v in self.vectors.items()]
        else:
            if self._matrix is None:
                self._order = list(self.vectors)
                self._matrix = np.asarray([self.vectors[key] for key in self._order], dtype=np.float32)
            sims = self._matrix @ np.asarray(q, dtype=np.float32)  # [n]
            top = np.argsort(-sims)[:k] if len(sims) > k else np.argsort(-sims)
            return [(self._order[i], float(sims[i])) for i in top]
        scored.sort(key=lambda item: -item[1])
        return scored[:k]


class _Graph:
    """faiss's HNSW graph over unit vectors, with tombstones for removed keys."""

    def __init__(self, library: str, impl: Any, dim: int) -> None:
        self.library, self.impl, self.dim = library, impl, dim
        self.dead: set[int] = set()

    @classmethod
    def build(cls, backend: str, dim: int, vectors: dict[int, list[float]]) -> "_Graph | None":
        np = _numpy()
        if np is None:
            return None
        try:
            import faiss
        except ImportError:
            if backend != "auto":
                raise ValueError("index backend faiss: pip install faiss-cpu") from None
            return None
        hnsw = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        hnsw.hnsw.efSearch = HNSW_EF_SEARCH
        graph = cls("faiss", faiss.IndexIDMap2(hnsw), dim)
        graph.keep = hnsw  # the wrapper does not own it from Python: keep it alive
        for key, v in vectors.items():
            graph.add(key, v)
        return graph

    def add(self, key: int, v: list[float]) -> None:
        import numpy as np

        self.dead.discard(key)
        self.impl.add_with_ids(np.asarray([v], dtype=np.float32), np.asarray([key], dtype=np.int64))

    def search(self, q: list[float], k: int, live: dict[int, list[float]]) -> list[tuple[int, float]]:
        import numpy as np

        x = np.asarray([q], dtype=np.float32)
        want = min(len(live), k + len(self.dead))  # room for tombstones among the hits
        sims, keys = self.impl.search(x, want)
        hits = [(int(key), float(s)) for key, s in zip(keys[0], sims[0]) if key >= 0]
        out, seen = [], set()
        for key, s in hits:  # a key added again after removal may be in the graph twice: keep its first
            if key in live and key not in self.dead and key not in seen:
                seen.add(key)
                out.append((key, s))
        return out[:k]
