"""The errors of constrained decoding: a request's grammar is bad, unsupported, or too big.

All are ValueErrors, so the API layers turn them into 400s; `param` names the request field
when the caller knows it (the server fills it in), and the message names the schema keyword,
the regex construct or the bound that was hit.
"""
from __future__ import annotations


class GuidedError(ValueError):
    """A grammar that cannot be compiled as asked (bad or unsupported input)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class GrammarTooLargeError(GuidedError):
    """Compiling the grammar passed a bound (automaton states, nesting depth or time)."""


class GrammarTimeoutError(GrammarTooLargeError):
    """Compiling the grammar took longer than its time bound (or was cancelled): unlike the size
    bounds this depends on the machine's load, so a server does not remember it as the grammar's."""
