"""The grammar compiler's child process: a request's structured-output params in, a DFA and token masks out.

    python -m native_server.api.grammar_worker     (started by grammars.py; see workers.py for the protocol)

INIT is the vocabulary (`token_bytes` of the served tokenizer); the child builds its own trie
from it, the same trie the server builds, so the token masks it computes mean the same positions
there. Each request compiles one grammar within its Budget (tree nodes, states, seconds; the
child checks it itself and stops) and precomputes the masks of the states nearest the start;
past the job's CPU seconds the kernel ends the child (workers.limit_cpu: SIGXCPU), should a stage
not look at the clock or the server not be there to kill it. Messages are `marshal`ed plain data
(dicts, lists, bytes, ints: nothing that runs code when read). After a failure the child hands
freed memory back to the system, and reports its RSS so the server can replace a child that grew.

Imports py_engine.guided only (the pure-Python layer): no torch, a start-up of ~0.1 s plus the trie.
"""
from __future__ import annotations

import marshal
import sys
import time
from typing import Any

from native_server.api.workers import limit_cpu, limit_memory, release_memory, serve
from py_engine.guided.automaton.dfa import DFA, compile_dfa
from py_engine.guided.budget import Budget
from py_engine.guided.compile import grammar_node
from py_engine.guided.errors import GrammarTimeoutError, GrammarTooLargeError, GuidedError
from py_engine.guided.params import StructuredOutputsParams
from py_engine.guided.tokens.index import TokenGrammar
from py_engine.guided.tokens.vocab import VocabTrie

WORKER_MEMORY_BYTES = 2 << 30  # address space of a child: the trie of a 150k vocabulary and one grammar fit
SPEC_FIELDS = ("json", "regex", "choice", "json_object", "grammar", "whitespace_pattern")
_trie: VocabTrie | None = None


# --- the messages (both sides) --------------------------------------------------------------------------
def job_message(spec: StructuredOutputsParams, eos: tuple[int, ...], budget: Budget, precompute: float,
                cpu_seconds: float) -> bytes:
    """`cpu_seconds`: the child's CPU time for this job, past which the kernel ends it (workers.limit_cpu)."""
    fields = {k: getattr(spec, k) for k in SPEC_FIELDS if getattr(spec, k) is not None}
    return marshal.dumps({"spec": fields, "eos": tuple(eos), "max_states": budget.max_states,
                          "max_nodes": budget.max_nodes, "seconds": budget.seconds, "precompute": precompute,
                          "cpu_seconds": cpu_seconds})


def dfa_of(reply: dict[str, Any]) -> DFA:
    return DFA(reply["classes"], reply["rows"], reply["accepting"], 0)


def error_of(reply: dict[str, Any]) -> GuidedError:
    kind = {"too_large": GrammarTooLargeError, "timeout": GrammarTimeoutError}.get(reply["kind"], GuidedError)
    return kind(reply["error"], reply.get("param"))


# --- the child ------------------------------------------------------------------------------------------
def _init(message: bytes) -> None:
    global _trie
    _trie = VocabTrie(marshal.loads(message))


def _handle(message: bytes) -> bytes:
    try:
        reply = _compile(marshal.loads(message))
    except GuidedError as exc:
        kind = "timeout" if isinstance(exc, GrammarTimeoutError) else (
            "too_large" if isinstance(exc, GrammarTooLargeError) else "invalid")
        reply = {"error": str(exc), "param": exc.param, "kind": kind}
    except MemoryError:
        reply = {"error": f"compiling the grammar needed more than the compiler's {WORKER_MEMORY_BYTES >> 30} GiB; "
                          "simplify the schema or regex", "param": None, "kind": "too_large"}
    except RecursionError:
        reply = {"error": "the grammar nests too deeply to compile; simplify the schema or regex", "param": None,
                 "kind": "too_large"}
    if "error" in reply:  # a failed compile may have built a large tree
        release_memory()
    reply["rss"] = _rss_bytes()
    return marshal.dumps(reply)


def _compile(job: dict[str, Any]) -> dict[str, Any]:
    limit_cpu(job["cpu_seconds"])
    budget = Budget(max_states=job["max_states"], max_nodes=job["max_nodes"], seconds=job["seconds"])
    spec = StructuredOutputsParams(**job["spec"])
    dfa = compile_dfa(grammar_node(spec, budget), budget)  # no DFA cache here: the server keeps the grammars
    assert _trie is not None
    grammar = TokenGrammar(dfa, _trie, job["eos"])
    left = budget.seconds - (time.monotonic() - budget.started)
    grammar.precompute(max(0.0, min(job["precompute"], left)))
    return {"classes": dfa.classes, "rows": dfa.rows, "accepting": dfa.accepting,
            "masks": {q: m.ranges for q, m in grammar.masks().items()}}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


if __name__ == "__main__":
    limit_memory(WORKER_MEMORY_BYTES)
    serve(_handle, sys.stdin.buffer, sys.stdout.buffer, init=_init)
