"""A request's tool handling, decided once, and one choice's output read into content and calls.

    plan = plan_tools(body.get("tools"), body.get("tool_choice"), template_text,
                      body.get("parallel_tool_calls"))
    params = apply_plan(params, plan)           # the forced-call grammar, specials kept for parsers
    reader = ChoiceReader(plan)                 # per choice
    content, calls = reader.message(text)       # whole; or reader.feed(delta) ... reader.finish()

A forced call (tool_choice required or named) is read as it is generated (call_scan.py): the
reader's events then include ("tool_call_delta", {...}) in OpenAI's streamed shape (the call's
id and name first, then its arguments piece by piece), and the whole calls once the output
ends. Output cut by max_tokens keeps the calls that were complete. `parallel_tool_calls: false`
allows one call: the grammar closes the array after it, and a parsed free output keeps its first.

Shared by the server and the JavaScript runtime (npm/src/bridge.py), so both answer the same.
Raises GuidedError (a 400 / InvalidRequestError) for bad tools. Stdlib only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from py_engine.guided.errors import GuidedError
from py_engine.guided.tools.call_scan import ARGS, ARRAY, OBJECTS, ArgsPiece, CallScanner
from py_engine.guided.tools.parsers import Family, family_of
from py_engine.guided.tools.request import ToolChoice, check_tools, forced_calls_grammar, new_call_id, tool_choice
from py_engine.guided.tools.streaming import ToolCallStream

Event = tuple[str, Any]  # ("content", text), ("tool_call_delta", {...}) or ("tool_calls", [calls])


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]
    choice: ToolChoice
    family: Family | None  # the syntax parsed out of free output (tool_choice auto)
    parallel: bool = True  # parallel_tool_calls: false allows one call

    @property
    def forced(self) -> bool:
        return self.choice.mode in ("required", "named")

    @property
    def active(self) -> bool:
        return self.forced or self.family is not None


NO_TOOLS = ToolPlan([], ToolChoice("none"), None)


def plan_tools(tools: Any, choice: Any, template: Any, parallel: Any = None) -> ToolPlan:
    """tools, tool_choice and parallel_tool_calls of a request; `template` is the chat template text
    (or a dict of named ones)."""
    checked = check_tools(tools)
    mode = tool_choice(choice, checked)
    if parallel not in (None, True, False):
        raise GuidedError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or "".join(template.values())
    family = family_of(template) if mode.mode == "auto" and checked else None
    return ToolPlan(checked, mode, family, parallel is not False)


def apply_plan(params: Any, plan: ToolPlan) -> Any:
    """SamplingParams with the grammar of a forced call, and with special tokens kept in the text
    when the family's markers are special tokens (Mistral's [TOOL_CALLS], Llama's <|python_tag|>)."""
    forced = forced_calls_grammar(plan.tools, plan.choice, plan.parallel)
    if forced is not None:
        if params.structured_outputs is not None:
            raise GuidedError("tool_choice required or a named function constrains the output; it cannot be "
                              "combined with response_format or structured_outputs", "tool_choice")
        params = dataclasses.replace(params, structured_outputs=forced)
    if plan.family is not None and any(m.startswith(("[", "<|")) for m in plan.family.markers):
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


# Families whose calls are JSON objects between markers: their arguments stream as they come too.
_SCANNED = {"hermes": (OBJECTS, ("arguments", "parameters"), ("<tool_call>", "</tool_call>")),
            "llama3_json": (OBJECTS, ("parameters", "arguments"), ("<|python_tag|>",)),
            "mistral": (ARRAY, ("arguments", "parameters"), ("[TOOL_CALLS]",))}


class ChoiceReader:
    """One choice's output as OpenAI message parts, whole (`message`) or streamed (`feed`/`finish`).

    Parsed calls (tool_choice auto) of the JSON families stream too: from the first marker on, the
    held text also goes through a CallScanner; when the output ends and parses as calls, the calls
    are the scanner's (the arguments text as written, so the pieces add up to it), else the parse's."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.stream = ToolCallStream(plan.family) if plan.family is not None else None
        self.scan = None
        self.scanned = 0  # characters of the held text fed to the scanner (auto)
        if plan.forced:
            self.scan = (CallScanner(ARRAY, ("parameters",)) if plan.choice.mode == "required"
                         else CallScanner(ARGS, name=plan.choice.name))
        elif plan.family is not None and plan.family.name in _SCANNED:
            layout, keys, markers = _SCANNED[plan.family.name]
            self.scan = CallScanner(layout, keys, skip=markers)
        self.ids: list[str] = []  # the forced calls' ids, given as each starts
        self.text = ""
        self.called = False

    @property
    def streams_arguments(self) -> bool:
        """Calls go out piece by piece (tool_call_delta events); the whole calls repeat them at the end."""
        return self.scan is not None

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(content, tool_calls) of a whole output."""
        events = self.feed(text) + self.finish()
        content, calls = split_events(events)
        if not self.plan.active:
            return content, None
        return content or None, calls or None

    def feed(self, text: str) -> list[Event]:
        self.text += text
        if self.plan.forced:
            return self._deltas(self.scan.feed(text))
        events = self.stream.feed(text) if self.stream is not None else ([("content", text)] if text else [])
        return events + self._scan_held()

    def _scan_held(self) -> list[Event]:
        """Feed the scanner what the stream holds as calls (auto, JSON families)."""
        stream = self.stream
        if self.scan is None or stream is None or not stream.in_calls:
            return []
        start = max(stream.sent, self.scanned)
        self.scanned = len(stream.text)
        return self._deltas(self.scan.feed(stream.text[start:]))

    def finish(self) -> list[Event]:
        if self.plan.forced:
            self.scan.finish()
            calls = [self._call(i, name, args) for i, (name, args) in enumerate(self.scan.calls)]
            events: list[Event] = ([("tool_calls", calls[:1] if not self.plan.parallel else calls)] if calls
                                   else [("content", self.text)] if self.text else [])
        else:
            held = self._scan_held()
            events = self.stream.finish() if self.stream is not None else []
            self.late: list[Event] = []
            events = held + [(k, self._scanned_calls(v)) if k == "tool_calls" else (k, v) for k, v in events]
            events += self.late
            if not self.plan.parallel:
                events = [(k, v[:1]) if k == "tool_calls" else (k, v) for k, v in events]
        self.called = any(k == "tool_calls" for k, _ in events)
        return events

    def _scanned_calls(self, parsed: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The parsed calls, as the scanner streamed them when it read the same ones; else the parse's,
        sent whole now (tool_call_delta events after the streamed ones: a rare text the scanner misread)."""
        if self.scan is None:
            return parsed
        scanned = self.scan.calls
        if [name for name, _ in scanned] == [c["function"]["name"] for c in parsed]:
            return [self._call(i, name, args) for i, (name, args) in enumerate(scanned)]
        self.late = [("tool_call_delta", {"index": len(self.ids) + j, "id": c["id"], "type": "function",
                                          "function": dict(c["function"])}) for j, c in enumerate(parsed)]
        return parsed

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.called else reason

    def _deltas(self, found: list) -> list[Event]:
        events: list[Event] = []
        for ev in found:
            if isinstance(ev, ArgsPiece):
                events.append(("tool_call_delta", {"index": ev.index, "function": {"arguments": ev.text}}))
                continue
            self.ids.append(new_call_id())
            events.append(("tool_call_delta", {"index": ev.index, "id": self.ids[-1], "type": "function",
                                               "function": {"name": ev.name, "arguments": ""}}))
        return events

    def _call(self, index: int, name: str, arguments: str) -> dict[str, Any]:
        call_id = self.ids[index] if index < len(self.ids) else new_call_id()
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def split_events(events: list[Event]) -> tuple[str, list[dict[str, Any]]]:
    """(content text, whole calls) of a list of events (the streamed pieces of calls are left out)."""
    return ("".join(v for k, v in events if k == "content"),
            [c for k, v in events if k == "tool_calls" for c in v])
