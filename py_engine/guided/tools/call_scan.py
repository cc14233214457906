"""Tool calls read out of JSON text as it is generated: each call's name, then its arguments piece by piece.

    scan = CallScanner(ARRAY, ("parameters",))    # [{"name": ..., "parameters": {...}}, ...]
    for delta in deltas:
        for ev in scan.feed(delta): ...           # CallStart(index, name) / ArgsPiece(index, text)
    scan.calls                                    # the complete calls: [(name, arguments text), ...]

Three layouts: ARRAY (tool_choice required: a JSON array of call objects; Mistral's
[TOOL_CALLS] list), OBJECTS (call objects back to back, separated by whitespace or `;`: Hermes'
<tool_call> bodies, Llama 3.1's JSON calls) and ARGS (tool_choice naming one function: the whole
text is its arguments). The arguments of a call are the exact text of its arguments value, so
the pieces streamed concatenate to the arguments the whole response reports. A call counts once
its object is closed: output cut by max_tokens keeps the calls before the cut. The text is JSON
the grammar (or the model) wrote: anything else ends the scan (`failed`), never raises.
Stdlib only, char by char (a few microseconds a character).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

ARRAY, OBJECTS, ARGS = "array", "objects", "args"
_WS = " \t\n\r"


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgsPiece:
    index: int
    text: str


class CallScanner:
    def __init__(self, layout: str, args_keys: tuple[str, ...] = ("arguments", "parameters"),
                 name: str | None = None, skip: tuple[str, ...] = ()) -> None:
        self.layout, self.args_keys = layout, args_keys
        self.skip = skip  # markers between calls (<tool_call>, </tool_call>, <|python_tag|>): passed over
        self.pos = 0  # the next character to read (a marker's first part waits for the rest)
        self.text = ""
        self.calls: list[tuple[str, str]] = []  # complete calls: (name, arguments text)
        self.failed = False
        self._stack: list[str] = []
        self._in_str = self._esc = False
        self._str_start = 0
        self._item_depth = 2 if layout == ARRAY else 1
        self._fixed_name = name  # ARGS: the named function
        self._reset_item()

    def _reset_item(self) -> None:
        self._key: str | None = None
        self._expect_key = True
        self._capture: str | None = None  # "key" or "name" while in such a string
        self._name: str | None = self._fixed_name
        self._args_start: int | None = None
        self._args_end: int | None = None  # set when the value closed
        self._sent = 0  # characters of the arguments already sent
        self._started = False

    # -- feeding ----------------------------------------------------------------------------------
    def feed(self, delta: str) -> list[CallStart | ArgsPiece]:
        out: list[CallStart | ArgsPiece] = []
        self.text += delta
        while self.pos < len(self.text) and not self.failed:
            if self.skip and not self._stack and not self._in_str:
                rest = self.text[self.pos:]
                whole = next((m for m in self.skip if rest.startswith(m)), None)
                if whole is not None:
                    self.pos += len(whole)
                    continue
                if any(m.startswith(rest) for m in self.skip):
                    break  # maybe a marker: wait for the rest of it
            self._char(self.pos, self.text[self.pos], out)
            self.pos += 1
        self._flush(out, final=False)
        return out

    def _char(self, i: int, c: str, out: list) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                self._end_string(i)
            return
        if c in _WS:
            return
        depth, at_item = len(self._stack), len(self._stack) == self._item_depth
        if self.layout == ARGS and self._args_start is None:
            self._args_start = i
        if c == '"':
            self._in_str, self._str_start = True, i
            if at_item and self.layout != ARGS:
                self._capture = "key" if self._expect_key else ("name" if self._key == "name" else None)
            self._value_start(i, at_item)
        elif c in "{[":
            if depth == 0 and self.layout == ARRAY and c != "[" or depth == 0 and self.layout == OBJECTS and c != "{":
                self.failed = True
                return
            self._value_start(i, at_item)
            self._stack.append(c)
        elif c in "}]":
            if not self._stack or {"}": "{", "]": "["}[c] != self._stack[-1]:
                self.failed = True
                return
            self._stack.pop()
            self._closed(i, len(self._stack), out)
        elif c == ":" and at_item:
            self._expect_key = False
        elif c == "," and at_item:
            self._scalar_end(i)
            self._expect_key, self._key = True, None
        elif c == ";" and depth == 0 and self.layout == OBJECTS:
            pass
        elif c == "," and depth == 1 and self.layout == ARRAY:
            pass
        elif depth == 0 and self.layout != ARGS:
            self.failed = True
        else:
            self._value_start(i, at_item)

    def _value_start(self, i: int, at_item: bool) -> None:
        if (at_item and not self._expect_key and self._key in self.args_keys and self._args_start is None
                and self.layout != ARGS):
            self._args_start = i

    def _end_string(self, i: int) -> None:
        raw = self.text[self._str_start:i + 1]
        if self._capture == "key":
            self._key = _decode(raw)
        elif self._capture == "name":
            self._name = _decode(raw)
        self._capture = None
        if self.layout == ARGS and not self._stack:
            self._args_end = i + 1

    def _scalar_end(self, i: int) -> None:
        """A scalar arguments value ends before the `,` or `}` at i (its trailing whitespace is not its own)."""
        if self._args_start is not None and self._args_end is None:
            self._args_end = self._last_solid(i) + 1

    def _closed(self, i: int, depth: int, out: list) -> None:
        if self.layout == ARGS:
            if depth == 0:
                self._args_end = i + 1
                self._flush(out, final=True)
                self._finish_call()
            return
        if depth == self._item_depth and self._args_start is not None and self._args_end is None:
            self._args_end = i + 1  # the arguments object (or array) closed
        elif depth == self._item_depth - 1:  # the call object closed
            self._scalar_end(i)
            self._flush(out, final=True)
            self._finish_call()

    def _finish_call(self) -> None:
        if self._name is not None:
            args = self.text[self._args_start:self._args_end] if self._args_start is not None else "{}"
            self.calls.append((self._name, args))
        self._reset_item()

    # -- emitting ---------------------------------------------------------------------------------
    def _last_solid(self, before: int | None = None) -> int:
        """Index of the last non-whitespace character before `before` (default: the end)."""
        j = (len(self.text) if before is None else before) - 1
        while j >= 0 and self.text[j] in _WS:
            j -= 1
        return j

    def _flush(self, out: list, final: bool) -> None:
        """Send the call's start once its name and arguments began, then the arguments written so
        far (trailing whitespace held back: it may turn out to follow a scalar value)."""
        if self._name is None or self._args_start is None:
            return
        index = len(self.calls)
        if not self._started:
            self._started = True
            out.append(CallStart(index, self._name))
        end = self._args_end if self._args_end is not None else self._last_solid() + 1
        piece = self.text[self._args_start + self._sent:end]
        if piece:
            self._sent += len(piece)
            out.append(ArgsPiece(index, piece))

    def finish(self) -> None:
        """The output ended: a named function's scalar arguments count once they are whole JSON."""
        if self.layout == ARGS and not self.calls and self._args_start is not None and not self._stack:
            try:
                json.loads(self.text)
            except ValueError:
                return
            self._args_end = self._last_solid() + 1
            self._finish_call()

    def pending(self) -> bool:
        """A call was started and not completed (the output was cut inside it)."""
        return self._started


def _decode(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
