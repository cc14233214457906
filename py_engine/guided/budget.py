"""`Budget`: the bounds of one grammar's compilation, checked by every stage, and how it is stopped.

    budget = Budget(max_states=50_000, max_nodes=200_000, seconds=10.0)
    with budget.active():            # node constructors charge it (see charge())
        node = compile_schema(...)   # schema -> regex tree: work units, node weights, time
    dfa = compile_dfa(node, budget)  # tree -> NFA -> DFA: states, time

Three bounds, so a hostile grammar fails fast on whichever it passes first:
  - `max_nodes` bounds the regex tree: the work of building it (every node made, every item a
    concatenation or alternation copies or compares: `charge`) and the size of any one tree once
    its shared parts are counted every time they occur (`check_weight`), which is what Thompson's
    construction, equality and hashing walk. A `$ref` expanded once and shared keeps the work
    small; its weight still tells that the automaton would hold 2^15 copies.
  - `max_states` bounds the NFA and the DFA (subset construction can grow exponentially).
  - `seconds` bounds wall time; `tick` checks it every few thousand units of work, so no stage
    runs long between two checks. `cancel()` makes the next check raise: whoever gave up waiting
    (a server answering with its 400) stops the work instead of leaving it to run on.

The tree constructors in automaton/nodes.py find the budget of the compile they run in through a
context variable (`active()`), so that alt() and concat(), called from every builder, need no
parameter; outside a compile (module constants, tests) nothing is charged. Stdlib only.
"""
from __future__ import annotations

import contextvars
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from py_engine.guided.errors import GrammarTimeoutError, GrammarTooLargeError

TICK_EVERY = 4096  # units of work between two looks at the clock (~1 ms of Python)
_current: contextvars.ContextVar["Budget | None"] = contextvars.ContextVar("guided_budget", default=None)


@dataclass
class Budget:
    """Bounds on one grammar's compilation: tree nodes, automaton states and wall time."""

    max_states: int = 50_000
    seconds: float = 10.0
    max_nodes: int = 200_000
    started: float = field(default_factory=time.monotonic)
    work: int = field(default=0, init=False)  # tree-building units charged so far
    cancelled: bool = field(default=False, init=False)
    _next_tick: int = field(default=TICK_EVERY, init=False, repr=False)
    _ticks: int = field(default=0, init=False, repr=False)

    def cancel(self) -> None:
        """Stop the compilation at its next check (safe from another thread: one attribute write)."""
        self.cancelled = True

    def check_time(self, what: str) -> None:
        if self.cancelled:
            raise GrammarTimeoutError(f"compiling the grammar was cancelled ({what})")
        if time.monotonic() - self.started > self.seconds:
            raise GrammarTimeoutError(f"compiling the grammar took longer than {self.seconds:g} s ({what}); "
                                       "simplify the schema or regex")

    def tick(self, units: int, what: str) -> None:
        """Count `units` of work of any stage; look at the clock every TICK_EVERY of them."""
        self._ticks += units
        if self._ticks >= self._next_tick:
            self._next_tick = self._ticks + TICK_EVERY
            self.check_time(what)

    def charge(self, units: int, what: str = "the grammar's tree") -> None:
        """Count tree-building work; past max_nodes the grammar is too large."""
        self.work += units
        if self.work > self.max_nodes:
            raise GrammarTooLargeError(f"building {what} took more than {self.max_nodes} steps; simplify the "
                                       "schema or regex (many $refs to large definitions, long enums and choices, "
                                       "and deep nesting multiply them)")
        self.tick(units, what)

    def check_weight(self, weight: int) -> None:
        if weight > self.max_nodes:
            raise GrammarTooLargeError(f"the grammar's tree holds more than {self.max_nodes} nodes once its shared "
                                       "parts are counted where they occur (a $ref used twice at every level "
                                       "doubles it each level); simplify the schema or regex")

    def check_states(self, count: int, what: str) -> None:
        if count > self.max_states:
            raise GrammarTooLargeError(f"the grammar needs more than {self.max_states} {what} states; simplify "
                                       "the schema or regex (long strings with minLength/maxLength, big repeat "
                                       "counts and deep nesting multiply them)")
        self.tick(8, what)

    @contextmanager
    def active(self) -> Iterator["Budget"]:
        """Make this the budget that tree constructors charge, for the block (this thread or task only)."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)


def current() -> Budget | None:
    """The budget of the compile running in this context, if any."""
    return _current.get()
