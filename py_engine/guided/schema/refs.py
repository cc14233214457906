"""Local `$ref`s of one JSON schema: where each points, and which of them can re-enter each other.

The compiler expands a `$ref` once per context and shares the result (a schema whose every
definition holds two `$ref`s to the next once expanded 2^15 leaves anew). The result of
expanding `$ref` R depends on how many times each *active* `$ref` (one being expanded further
up the path) is open, because the recursion bound cuts a re-entry. An active ref A can only be
re-entered from R when A reaches R and R reaches A: the same strongly connected component of the
graph "the subschema R points to contains a `$ref` to S". So the context is R's depth and the
counts of the active refs in R's component; for a schema without recursion, just the depth.

Edges are every `$ref` anywhere below a target (more than expansion may follow: a larger
component only costs memo hits, never a wrong tree). Pointers are keyed by their decoded parts
(RFC 6901, as `jsonschema` reads them: `#/$defs//a` is the key "" then "a", not an alias of
`#/$defs/a`).
Work (JSON nodes walked) is charged to the compile's Budget. Stdlib only.
"""
from __future__ import annotations

from typing import Any

from py_engine.guided.budget import Budget
from py_engine.guided.errors import GuidedError

Key = tuple[str, ...]  # a pointer's decoded parts: "#/$defs/a~1b" -> ("$defs", "a/b")
MAX_POINTER_PARTS = 64


class RefGraph:
    def __init__(self, root: Any, budget: Budget | None) -> None:
        self.root, self.budget = root, budget
        self._targets: dict[Key, Any] = {}
        self._edges: dict[Key, list[Key]] = {}
        self._component: dict[Key, int] = {}

    def resolve(self, ref: Any, path: str) -> tuple[Key, Any]:
        """(key, target) of a local `$ref`; GuidedError when it is not local or points nowhere."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise GuidedError(f"only local $refs ('#/...') are supported, got {str(ref)[:200]!r} at {path}")
        # JSON Pointer (RFC 6901): "#/a//b" names a, then the key "", then b (as jsonschema reads it).
        key = tuple(p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")) if ref != "#" else ()
        if len(key) > MAX_POINTER_PARTS:
            raise GuidedError(f"$ref {ref[:200]!r} has more than {MAX_POINTER_PARTS} parts (at {path})")
        if key in self._targets:
            return key, self._targets[key]
        node = self.root
        for part in key:
            if not isinstance(node, dict) or part not in node:
                raise GuidedError(f"$ref {ref[:200]!r} points nowhere (at {path})")
            node = node[part]
        self._targets[key] = node
        return key, node

    def component(self, key: Key) -> int:
        """The strongly connected component of `key` (Tarjan's, iterative, over edges found lazily)."""
        if key not in self._component:
            self._tarjan(key)
        return self._component[key]

    def edges(self, key: Key) -> list[Key]:
        found = self._edges.get(key)
        if found is None:
            found = self._edges[key] = []
            for ref in self._refs_below(self._targets[key]):
                try:
                    found.append(self.resolve(ref, "")[0])
                except GuidedError:
                    pass  # reported where expansion meets it
        return found

    def _refs_below(self, node: Any) -> list[str]:
        refs, todo = [], [node]
        while todo:
            item = todo.pop()
            if self.budget is not None:
                self.budget.charge(1, "the schema's $refs")
            if isinstance(item, dict):
                ref = item.get("$ref")
                if isinstance(ref, str):
                    refs.append(ref)
                todo.extend(v for v in item.values() if isinstance(v, (dict, list)))
            elif isinstance(item, list):
                todo.extend(v for v in item if isinstance(v, (dict, list)))
        return list(dict.fromkeys(refs))

    def _tarjan(self, start: Key) -> None:
        index: dict[Key, int] = {}
        low: dict[Key, int] = {}
        stack: list[Key] = []
        on_stack: set[Key] = set()
        work = [(start, iter(self.edges(start)))]
        index[start] = low[start] = 0
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            child = next(it, None)
            if child is not None:
                if child in self._component:
                    continue  # finished in an earlier search: another component
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(self.edges(child))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                number = len(self._component)
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    self._component[member] = number
                    if member == node:
                        break
