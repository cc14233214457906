"""The server's bounds, piece by piece, without HTTP: the body's shape checks against Python's own JSON
parser, the body reader's time and memory limits, the Host allow-list, templates rendered in killable
workers, the chat template policy. (test_server_hostile.py sends the same things to a real server.)
"""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from native_server.api.errors import APIError
from native_server.api.middleware import AllowedHosts
from native_server.api.prompts import chat_render_args
from native_server.api.protocol import ChatCompletionRequest
from native_server.api.request_body import BodyError, RequestBody, check_json_shape, json_too_deep, lone_surrogate
from native_server.serve import allowed_hosts
from native_server.api.templates import TemplateRenderer
from py_engine.chat import ChatConfig, ChatTemplateError, RenderLimits, render_chat

CHATML = ChatConfig("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", {}, "test")
USER = [{"role": "user", "content": "hi"}]


# --- JSON shape, checked on the raw bytes -------------------------------------------------------------
def depth(value) -> int:
    """The reference: nesting depth of a parsed document."""
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


documents = st.recursive(st.none() | st.integers() | st.text(alphabet='[]{}"\\ab:,'),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                             st.text(alphabet='[]{}"\\a', max_size=3), inner, max_size=3), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(documents, st.integers(1, 8))
def test_depth_check_equals_parsing_the_document(document, limit):
    body = json.dumps(document).encode()  # brackets and quotes inside strings are escaped text, not structure
    assert json_too_deep(body, limit) == (depth(document) > limit)


def test_depth_limit_is_exact_and_cheap():
    for limit in (1, 64):
        assert not json_too_deep(("[" * limit + "]" * limit).encode(), limit)
        assert json_too_deep(("{\"a\":" * (limit + 1) + "1" + "}" * (limit + 1)).encode(), limit)
    start = time.perf_counter()
    assert json_too_deep(b"[" * 2_000_000 + b"]" * 2_000_000, 64)  # 4 MB of nesting
    assert not json_too_deep(b"[" + b"[]," * 1_300_000 + b"[]]", 64)  # 4 MB, flat
    assert time.perf_counter() - start < 5  # linear passes in C; only a gross regression trips this
    assert not json_too_deep(b'{"a": [1, 2', 64)  # malformed: the JSON parser's to report


SURROGATE_CHARS = ["a", "\\", '"', "\ud800", "\udbff", "\udc00", "\udfff", "\U0001F600", "\u00e9"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(SURROGATE_CHARS), max_size=12))
def test_lone_surrogate_finder_equals_decoding(chars):
    text = "".join(chars)
    body = json.dumps({"prompt": text}).encode()  # ensure_ascii: every non-ASCII char is a \\u escape
    decoded = json.loads(body)["prompt"]
    has_lone = any(0xD800 <= ord(c) <= 0xDFFF for c in decoded)
    assert (lone_surrogate(body) is not None) == has_lone


def test_surrogates_and_bad_utf8_are_400():
    assert lone_surrogate(b'"\\ud83d\\ude00"') is None  # an escaped pair is one character
    assert lone_surrogate(b'"x\\ud800y"') == "\\ud800"
    assert lone_surrogate(b'"\\\\ud800"') is None  # an escaped backslash, then text
    assert lone_surrogate(b'"\\\\\\ud800"') == "\\ud800"
    assert lone_surrogate(b'"\\udc00\\ud800"') == "\\udc00"
    for body in ('{"p": "x\ud800y"}'.encode("utf-8", "surrogatepass"), b'{"p": "\xff"}', b'{"p": "\\ud800"}'):
        with pytest.raises(BodyError) as info:
            check_json_shape(body)
        assert info.value.status == 400
    check_json_shape('{"p": "caf\u00e9 \U0001F600", "q": "\\ud83d\\ude00"}'.encode())


# --- the body reader ----------------------------------------------------------------------------------
class Recorder:
    """An ASGI send that keeps the response; an app that records whether it ran."""

    def __init__(self):
        self.messages, self.app_ran = [], False

    async def send(self, message):
        self.messages.append(message)

    async def app(self, scope, receive, send):
        self.app_ran = True
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})

    @property
    def status(self):
        return self.messages[0]["status"]

    def error(self):
        return json.loads(self.messages[1]["body"])["error"]


def scope(**headers):
    return {"type": "http", "method": "POST", "path": "/v1/completions",
            "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def chunks(*parts, delay=0.0, then_wait=None):
    queue = list(parts)

    async def receive():
        if not queue:
            await asyncio.sleep(then_wait or 3600)  # a client that stalls
            return {"type": "http.disconnect"}
        await asyncio.sleep(delay)
        part = queue.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(queue) or then_wait is not None}
    return receive


def test_slow_body_gets_408_and_releases_its_budget():
    async def main():
        rec = Recorder()
        middleware = RequestBody(rec.app, max_bytes=1000, timeout=0.3)
        await middleware(scope(content_type="application/json"), chunks(b'{"a":', then_wait=60), rec.send)
        assert rec.status == 408 and not rec.app_ran and "0.3 s" in rec.error()["message"]
        assert (b"connection", b"close") in rec.messages[0]["headers"]
        assert middleware.budget.used == 0
    asyncio.run(main())


def test_uploads_share_one_memory_budget():
    async def main():
        rec = [Recorder() for _ in range(3)]
        middleware = RequestBody(None, max_bytes=100, timeout=0.5, budget_bytes=150)
        middleware.app = rec[0].app
        stalled = [asyncio.ensure_future(middleware(scope(), chunks(b"x" * 70, then_wait=60), r.send))
                   for r in rec[:2]]
        await asyncio.sleep(0.05)
        third = Recorder()
        middleware.app = third.app
        await middleware(scope(), chunks(b"x" * 70), third.send)  # 140 held + 70 > 150
        assert third.status == 429 and "retry" in third.error()["message"]
        await asyncio.gather(*stalled)
        assert [r.status for r in rec[:2]] == [408, 408] and middleware.budget.used == 0
        fourth = Recorder()
        middleware.app = fourth.app
        await middleware(scope(), chunks(b"[1,", b"2]"), fourth.send)  # the budget is back
        assert fourth.status == 200 and fourth.messages[1]["body"] == b"5"
    asyncio.run(main())


def test_oversized_and_malformed_bodies_never_reach_the_app():
    async def main():
        for headers, parts, status in (({"content_length": "201"}, [b"x"], 413),
                                       ({}, [b"x" * 120, b"x" * 120], 413),
                                       ({"content_type": "application/json"}, [b"[" * 70 + b"]" * 70], 400),
                                       ({}, [b'{"p": "\\udfff"}'], 400)):
            rec = Recorder()
            await RequestBody(rec.app, max_bytes=200)(scope(**headers), chunks(*parts), rec.send)
            assert rec.status == status and not rec.app_ran
        rec = Recorder()  # not JSON: the shape is not the middleware's business
        await RequestBody(rec.app, max_bytes=200)(scope(content_type="text/plain"), chunks(b"[" * 70), rec.send)
        assert rec.status == 200
    asyncio.run(main())


# --- Host header --------------------------------------------------------------------------------------
def test_allowed_hosts():
    hosts = AllowedHosts(None, ("localhost", "127.0.0.1", "::1", "api.example.com", "*.internal"))
    for ok in ("localhost", "localhost:8000", "127.0.0.1:1", "[::1]:8000", "::1", "API.example.com",
               "a.b.internal:80"):
        assert hosts.allows(ok), ok
    for bad in ("evil.com", "localhost.evil.com", "127.0.0.1.nip.io", "internal", "[::2]:80", "example.com"):
        assert not hosts.allows(bad), bad
    assert AllowedHosts(None, ("*",)).allows("anything")
    assert allowed_hosts("127.0.0.1", None) == ("localhost", "127.0.0.1", "::1", "127.0.0.1")
    assert allowed_hosts("0.0.0.0", None) == ("*",)  # every interface, names unknown: warned, not checked
    assert allowed_hosts("0.0.0.0", "a.com, b.org") == ("localhost", "127.0.0.1", "::1", "a.com", "b.org")


def test_refused_host_is_400_before_the_app():
    async def main():
        rec = Recorder()
        await AllowedHosts(rec.app)(scope(host="attacker.example:8000"), chunks(b""), rec.send)
        assert rec.status == 400 and "Host" in rec.error()["message"] and not rec.app_ran
        rec = Recorder()
        await AllowedHosts(rec.app)(scope(host="localhost:8000"), chunks(b""), rec.send)
        assert rec.app_ran
    asyncio.run(main())


# --- chat templates -----------------------------------------------------------------------------------
def test_in_process_render_is_bounded_by_output_and_deadline():
    with pytest.raises(ChatTemplateError, match="limit of 1000 characters"):
        render_chat(USER, "{% for i in range(100000) %}xxxxxxxxxx{% endfor %}",
                    render_limits=RenderLimits(max_chars=1000))
    with pytest.raises(ChatTemplateError, match="longer than 0.2 s"):
        render_chat(USER, "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
                    render_limits=RenderLimits(seconds=0.2))
    for template in ("{{ 'x' * 10**9 }}", "{{ [0] * 10**8 }}", "{{ 7 ** 100000 }}"):
        with pytest.raises(ChatTemplateError, match="sandbox"):
            render_chat(USER, template)
    assert render_chat(USER, "{{ 'ab' * 3 }}{{ 2 ** 10 }}") == "ababab1024"


def test_worker_renders_are_killed_at_the_deadline_and_others_go_on():
    async def main():
        renderer = TemplateRenderer(timeout=0.5, max_chars=10_000, workers=1)
        try:
            assert await renderer.render(USER, CHATML, add_generation_prompt=True) == "<user>hi"
            spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
            start = time.monotonic()
            with pytest.raises(ChatTemplateError, match="longer than 0.5 s"):
                await renderer.render(USER, CHATML, chat_template=spin)
            assert time.monotonic() - start < 5
            renderer.timeout = 30.0  # the worker's memory limit, not the clock, must stop this one
            bomb = ("{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                    "{% endfor %}{{ ns.s|length }}")
            with pytest.raises(ChatTemplateError, match="(?i)memory"):
                await renderer.render(USER, CHATML, chat_template=bomb)
            with pytest.raises(ChatTemplateError, match="10000 characters"):
                await renderer.render(USER, CHATML, chat_template="{% for i in range(5000) %}xyz{% endfor %}")
            with pytest.raises(ChatTemplateError, match="boom"):
                await renderer.render(USER, CHATML, chat_template="{{ raise_exception('boom') }}")
            assert await renderer.render(USER, CHATML) == "<user>hi"  # a fresh worker took the slot
        finally:
            await renderer.close()
    asyncio.run(main())


def test_client_templates_are_refused_unless_allowed():
    named = ChatConfig({"default": "{{ messages }}", "tool_use": "{{ tools }}"}, {}, "test")

    def args(allow, **kwargs):
        request = ChatCompletionRequest.model_validate({"messages": USER, "chat_template_kwargs": kwargs})
        return chat_render_args(request, named, allow)

    with pytest.raises(APIError) as info:
        args(False, chat_template="{% for x in y %}")
    assert info.value.status == 400 and info.value.param == "chat_template_kwargs.chat_template"
    assert "--allow-client-chat-template" in info.value.message
    assert args(True, chat_template="{{ 1 }}")[1]["chat_template"] == "{{ 1 }}"
    assert args(False, chat_template="tool_use")[1]["chat_template"] == "tool_use"  # the model's own, by name
    assert args(False, enable_thinking=False)[1]["enable_thinking"] is False
    for key, value in (("render_limits", None), ("messages", []), ("chat_template", 5)):
        with pytest.raises(APIError) as info:
            args(True, **{key: value})
        assert info.value.status == 400
