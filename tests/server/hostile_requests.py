"""Hostile requests to `ruvllm serve` over the built-in model (vocabulary 4096, context 256), one per way a
client once broke or could break the server, each with the status it must get.

Shared by tests/test_server_hostile.py (each once) and scripts/hostile_probe.py (each several times).
`send(client, case, api_key)` sends one over httpx and returns the response; raw bodies go out as bytes
(JSON's NaN, lone surrogates, bad UTF-8, deep nesting are not what json.dumps writes).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

BUILTIN = Path(__file__).resolve().parents[2] / "py_engine" / "data" / "tiny-shakespeare"
VOCAB, CONTEXT = 4096, 256
HOSTILE_TEMPLATES = {  # named templates of the model itself: a client may pick them by name
    "spin": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "bomb": "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
            "{% endfor %}{{ ns.s|length }}",
    "flood": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "boom": "{{ raise_exception('this template refuses') }}",
}
USER = [{"role": "user", "content": "ROMEO:"}]
OK_COMPLETION = {"prompt": "ROMEO:", "max_tokens": 2, "temperature": 0}
ANY = object()  # the error's param is not checked


@dataclass(frozen=True)
class Case:
    name: str
    status: int
    path: str = "/v1/completions"
    body: Any = None  # sent as JSON
    raw: bytes | None = None  # sent as is, with Content-Type application/json
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    param: Any = ANY
    keyless: bool = False  # sent without the API key


def _c(**fields: Any) -> dict[str, Any]:
    return {"prompt": "ROMEO:", "max_tokens": 2, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **fields}


def _deep(levels: int, leaf: str = "1") -> str:
    return "[" * levels + leaf + "]" * levels


CASES = [
    # Numbers past their types or the model (top_k 2**63 killed the engine for good once).
    Case("top_k_int64_overflow", 400, body=_c(top_k=2**63, temperature=1), param="top_k"),
    Case("top_k_over_vocabulary", 400, body=_c(top_k=VOCAB + 1, temperature=1), param="top_k"),
    Case("top_k_below_minus_one", 400, body=_c(top_k=-2), param="top_k"),
    Case("seed_over_int64", 400, body=_c(seed=2**64, temperature=1), param="seed"),
    Case("seed_under_int64", 400, body=_c(seed=-(2**63) - 1, temperature=1), param="seed"),
    Case("n_2_pow_70", 400, body=_c(n=2**70), param="n"),
    Case("n_over_choices", 400, body=_c(n=129), param="n"),
    Case("max_tokens_2_pow_40", 400, body=_c(max_tokens=2**40), param="max_tokens"),
    Case("max_tokens_zero", 400, body=_c(max_tokens=0), param="max_tokens"),
    Case("logprobs_2_pow_40", 400, body=_c(logprobs=2**40), param="logprobs"),
    Case("logprobs_21", 400, body=_c(logprobs=21), param="logprobs"),
    Case("chat_top_logprobs_2_pow_40", 400, "/v1/chat/completions", _chat(logprobs=True, top_logprobs=2**40),
         param="top_logprobs"),
    Case("best_of_2_pow_70", 400, body=_c(best_of=2**70), param="best_of"),
    Case("temperature_nan", 400, raw=b'{"prompt": "ROMEO:", "max_tokens": 2, "temperature": NaN}',
         param="temperature"),
    Case("temperature_infinity", 400, raw=b'{"prompt": "ROMEO:", "max_tokens": 2, "temperature": Infinity}',
         param="temperature"),
    Case("presence_penalty_1e400", 400, raw=b'{"prompt": "ROMEO:", "max_tokens": 2, "presence_penalty": 1e400}',
         param="presence_penalty"),
    Case("temperature_string", 400, body=_c(temperature="1"), param="temperature"),
    Case("prompt_id_2_pow_64", 400, body={"prompt": [2**64], "max_tokens": 2}, param="prompt"),
    Case("prompt_id_negative", 400, body={"prompt": [5, -1], "max_tokens": 2}, param="prompt"),
    Case("prompt_id_vocabulary", 400, body={"prompt": [VOCAB], "max_tokens": 2}, param="prompt"),
    Case("stop_token_id_2_pow_64", 400, body=_c(stop_token_ids=[2**64]), param="stop_token_ids"),
    Case("stop_token_ids_1025", 400, body=_c(stop_token_ids=list(range(1025))), param="stop_token_ids"),
    # logit_bias keys: ASCII decimal token ids within the vocabulary.
    Case("logit_bias_superscript_two", 400, body=_c(logit_bias={"\u00b2": 1}), param="logit_bias"),
    Case("logit_bias_arabic_three", 400, body=_c(logit_bias={"\u0663": 1}), param="logit_bias"),
    Case("logit_bias_5000_digits", 400, body=_c(logit_bias={"9" * 5000: 1}), param="logit_bias"),
    Case("logit_bias_negative_key", 400, body=_c(logit_bias={"-1": 1}), param="logit_bias"),
    Case("logit_bias_over_vocabulary", 400, body=_c(logit_bias={str(VOCAB): 1}), param="logit_bias"),
    Case("logit_bias_value_1e6", 400, body=_c(logit_bias={"5": 1e6}), param="logit_bias"),
    # Stop strings: a 30,000-character one cost 433 MiB per sample once.
    Case("stop_30000_chars_n4", 400, body=_c(n=4, stop=["q" * 30000]), param="stop"),
    Case("stop_65_strings", 400, body=_c(stop=[f"s{i}" for i in range(65)]), param="stop"),
    # Text: lone surrogates reached the byte-level encoder (a 500) once.
    Case("prompt_lone_high_surrogate", 400, raw=b'{"prompt": "x\\ud800y", "max_tokens": 2}'),
    Case("prompt_lone_low_surrogate", 400, raw=b'{"prompt": "x\\udfffy", "max_tokens": 2}'),
    Case("prompt_reversed_pair", 400, raw=b'{"prompt": "\\udc00\\ud800", "max_tokens": 2}'),
    Case("prompt_raw_surrogate_bytes", 400, raw=b'{"prompt": "x\xed\xa0\x80y", "max_tokens": 2}'),
    Case("prompt_invalid_utf8", 400, raw=b'{"prompt": "x\xff\xfey", "max_tokens": 2}'),
    Case("chat_content_lone_surrogate", 400, "/v1/chat/completions",
         raw=b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}'),
    Case("chat_kwargs_key_surrogate", 400, "/v1/chat/completions",
         raw=b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"\\udfff": 1}}'),
    Case("stop_lone_surrogate", 400, raw=b'{"prompt": "x", "max_tokens": 2, "stop": ["\\ud800"]}'),
    # Nesting: 600 levels in tools or chat_template_kwargs raised RecursionError in plain_data once.
    Case("tools_600_deep", 400, "/v1/chat/completions",
         raw=('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "x": %s}]}'
              % _deep(600)).encode()),
    Case("chat_template_kwargs_600_deep", 400, "/v1/chat/completions",
         raw=('{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": %s}}'
              % _deep(600)).encode()),
    Case("tool_calls_600_deep", 400, "/v1/chat/completions",
         raw=('{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"x": %s}]}, '
              '{"role": "user", "content": "hi"}]}' % _deep(600)).encode()),
    Case("body_100000_deep", 400, raw=_deep(100_000).encode()),
    Case("prompt_65_deep", 400, raw=('{"prompt": %s}' % _deep(64)).encode()),
    # GBNF grammars (issue 33): text, rules, nesting, recursion and the automaton, each bounded.
    Case("grammar_not_a_string", 400, body=_c(grammar={"root": "x"}), param="grammar"),
    Case("grammar_syntax_error", 400, body=_c(grammar='root ::= "a" | ('), param="grammar"),
    Case("grammar_undefined_rule", 400, "/v1/chat/completions", _chat(grammar="root ::= nowhere"), param="grammar"),
    Case("grammar_never_ends", 400, body=_c(grammar='root ::= "(" root ")"'), param="grammar"),
    Case("grammar_over_100k_chars", 400, body=_c(grammar="root ::= " + '"a" ' * 30_000), param="grammar"),
    Case("grammar_parens_100_deep", 400, body=_c(grammar="root ::= " + "(" * 100 + '"a"' + ")" * 100),
         param="grammar"),
    Case("grammar_repeat_count_huge", 400, body=_c(grammar='root ::= "a"{99999999999}'), param="grammar"),
    Case("grammar_automaton_too_big", 400, body=_c(grammar='root ::= ("abcdefghijklmnopqrstuvwxyz" [0-9]){2000}'), param="grammar"),
    Case("grammar_doubling_rules", 400, body=_c(grammar="root ::= r0\n" + "".join(
        f"r{i} ::= r{i + 1} r{i + 1}\n" for i in range(40)) + 'r40 ::= "ab"'), param="grammar"),
    Case("grammar_mutual_recursion_fan", 400, body=_c(grammar="root ::= r0\n" + "".join(
        f"r{i} ::= " + " | ".join(f'"{i}" r{j}' for j in range(30)) + ' | "."\n' for i in range(30))),
        param="grammar"),
    Case("grammar_and_guided_both", 400, body=_c(grammar='root ::= "a"', guided_regex="a"), param=ANY),
    Case("parallel_tool_calls_not_a_bool", 400, "/v1/chat/completions", _chat(parallel_tool_calls="no"),
         param="parallel_tool_calls"),
    # /v1/responses (issue 33): what it does not do is named; its lists, ids and metadata are bounded.
    Case("responses_hosted_tool", 400, "/v1/responses", {"input": "x", "tools": [{"type": "web_search"}]},
         param="tools"),
    Case("responses_reasoning", 400, "/v1/responses", {"input": "x", "reasoning": {"effort": "high"}},
         param="reasoning"),
    Case("responses_reasoning_item", 400, "/v1/responses", {"input": [{"type": "reasoning", "summary": []}]},
         param="input"),
    Case("responses_items_over_limit", 400, "/v1/responses",
         {"input": [{"role": "user", "content": "x"}] * 2049, "max_output_tokens": 2}, param="input"),
    Case("responses_input_not_text", 400, "/v1/responses", {"input": 5}, param="input"),
    Case("responses_metadata_over_16", 400, "/v1/responses",
         {"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, param="metadata"),
    Case("responses_metadata_value_long", 400, "/v1/responses", {"input": "x", "metadata": {"k": "v" * 513}},
         param="metadata"),
    Case("responses_previous_unknown", 404, "/v1/responses", {"input": "x", "previous_response_id": "resp_" + "9" * 500},
         param="previous_response_id"),
    Case("responses_get_unknown", 404, "/v1/responses/resp_nope", method="GET", param="response_id"),
    Case("responses_delete_unknown", 404, "/v1/responses/resp_nope", method="DELETE", param="response_id"),
    Case("responses_output_tokens_over_context", 400, "/v1/responses", {"input": "x", "max_output_tokens": 10**6},
         param="max_tokens"),
    Case("responses_text_format_bad_schema", 400, "/v1/responses", {"input": "x", "text": {"format": {
        "type": "json_schema", "name": "s", "schema": {"type": "string", "contentSchema": {}}}}},
        param="response_format"),
    # /v1/messages (issue 33): Anthropic's error shape (param not sent: named in the message).
    Case("messages_no_max_tokens", 400, "/v1/messages", {"messages": USER}),
    Case("messages_image_block", 400, "/v1/messages", {"max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AAAA"}}]}]}),
    Case("messages_bad_role", 400, "/v1/messages", {"max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}),
    Case("messages_thinking", 400, "/v1/messages", {"max_tokens": 2, "messages": USER,
                                                    "thinking": {"type": "enabled", "budget_tokens": 1024}}),
    Case("messages_server_tool", 400, "/v1/messages", {"max_tokens": 2, "messages": USER,
                                                       "tools": [{"type": "bash_20250124", "name": "bash"}]}),
    Case("messages_tool_choice_bad", 400, "/v1/messages", {"max_tokens": 2, "messages": USER,
                                                           "tool_choice": {"type": "maybe"}}),
    Case("messages_stop_sequences_over_16", 400, "/v1/messages", {"max_tokens": 2, "messages": USER,
                                                                  "stop_sequences": ["x"] * 17}),
    Case("messages_tool_use_from_user", 400, "/v1/messages", {"max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}),
    Case("messages_over_limit", 400, "/v1/messages", {"max_tokens": 2, "messages": USER * 2049}),
    Case("messages_max_tokens_over_context", 400, "/v1/messages", {"max_tokens": 10**6, "messages": USER}),
    Case("messages_wrong_x_api_key", 401, "/v1/messages", {"max_tokens": 2, "messages": USER}, keyless=True,
         headers={"x-api-key": "nope"}),
    Case("messages_count_tokens_bad_block", 400, "/v1/messages/count_tokens",
         {"messages": [{"role": "user", "content": [{"type": "document"}]}]}),
    Case("messages_unknown_model", 404, "/v1/messages", {"model": "claude-9", "max_tokens": 2, "messages": USER}),
    # Chat templates: only the model's own, bounded in time, memory and output.
    Case("client_template_refused", 400, "/v1/chat/completions",
         _chat(chat_template_kwargs={"chat_template": "{% for i in range(99999) %}{% endfor %}"}),
         param="chat_template_kwargs.chat_template"),
    Case("template_kwargs_reserved_name", 400, "/v1/chat/completions",
         _chat(chat_template_kwargs={"render_limits": None}), param="chat_template_kwargs.render_limits"),
    Case("template_kwargs_not_a_string", 400, "/v1/chat/completions",
         _chat(chat_template_kwargs={"chat_template": ["x"]}), param="chat_template_kwargs.chat_template"),
    Case("model_template_spins", 400, "/v1/chat/completions", _chat(chat_template_kwargs={"chat_template": "spin"}),
         param="messages"),
    Case("model_template_exhausts_memory", 400, "/v1/chat/completions",
         _chat(chat_template_kwargs={"chat_template": "bomb"}), param="messages"),
    Case("model_template_floods_output", 400, "/v1/chat/completions",
         _chat(chat_template_kwargs={"chat_template": "flood"}), param="messages"),
    Case("model_template_raises", 400, "/v1/chat/completions", _chat(chat_template_kwargs={"chat_template": "boom"}),
         param="messages"),
    # Bodies.
    Case("content_length_over_limit", 413, raw=b"{}", headers={"content-length": str(5 * 1024 * 1024)}),
    Case("body_over_limit", 413, body=_c(prompt="x" * (4 * 1024 * 1024))),
    Case("body_not_json", 400, raw=b'{"prompt": '),
    Case("body_json_array", 400, raw=b"[1, 2]"),
    Case("body_empty", 400, raw=b""),
    Case("body_form_encoded", 400, raw=b"prompt=hi", headers={"content-type": "application/x-www-form-urlencoded"}),
    Case("messages_empty", 400, "/v1/chat/completions", {"messages": []}, param="messages"),
    Case("prompt_over_context", 400, body={"prompt": list(range(5, 5 + CONTEXT)), "max_tokens": 2}, param="prompt"),
    # Who may ask: the Host header (DNS rebinding), the API key, the schema behind it.
    Case("host_evil", 400, body=OK_COMPLETION, headers={"host": "evil.example:8000"}),
    Case("host_rebinding_lookalike", 400, body=OK_COMPLETION, headers={"host": "localhost.evil.example"}),
    Case("no_api_key", 401, body=OK_COMPLETION, keyless=True),
    Case("wrong_api_key", 401, body=OK_COMPLETION, headers={"authorization": "Bearer nope"}),
    Case("docs_without_key", 401, "/docs", method="GET", keyless=True),
    Case("openapi_without_key", 401, "/openapi.json", method="GET", keyless=True),
    # Paths: the demo files never include dotfiles, nor anything outside their folder.
    Case("dotfile_env", 404, "/.env", method="GET"),
    Case("dotfile_git_config", 404, "/.git/config", method="GET"),
    Case("dotfile_nested", 404, "/sub/.secret", method="GET"),
    Case("traversal_encoded", 404, "/%2e%2e/%2e%2e/etc/passwd", method="GET"),
    Case("unknown_model", 404, body=_c(model="gpt-5"), param="model"),
    Case("wrong_method", 405, method="GET"),
]



# --- grammars (structured outputs): each compiled in a worker within its budget, refused fast -------------
def ref_chain(levels: int, fan: int = 2) -> dict[str, Any]:
    """$defs d0..d{levels}, each an object of `fan` properties that all $ref the next: fan**levels leaves
    once expanded (each $ref names another entry, so the re-entry limit never trips)."""
    defs = {f"d{i}": {"type": "object", "properties": {f"p{j}": {"$ref": f"#/$defs/d{i + 1}"} for j in range(fan)},
                      "required": [f"p{j}" for j in range(fan)]} for i in range(levels)}
    defs[f"d{levels}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def ref_lattice(levels: int) -> dict[str, Any]:
    """Two $defs per level, each anyOf of both of the next level's: 2**levels distinct paths."""
    defs = {f"{side}{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"$ref": f"#/$defs/b{i + 1}"},
                                     {"type": "object", "properties": {side: {"$ref": f"#/$defs/a{i + 1}"}}}]}
            for i in range(levels) for side in "ab"}
    defs[f"a{levels}"], defs[f"b{levels}"] = {"type": "integer"}, {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/a0"}


def _tool(schema: dict[str, Any]) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


def gbnf_doubling(levels: int) -> str:
    """GBNF whose rule r_i is r_{i+1} twice: 2**levels character sets once expanded."""
    rules = [f"r{i} ::= r{i + 1} r{i + 1}" for i in range(levels)]
    return "\n".join(["root ::= r0", *rules, f"r{levels} ::= [a-z]"])


def gbnf_alternatives(count: int) -> str:
    """GBNF of one rule with `count` literal alternatives (an 8,000-entry enum, llama.cpp's way)."""
    return "root ::= " + " | ".join(f'"v{i:05d}"' for i in range(count))


REF_LOOP_IN_ALL_OF = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                      "allOf": [{"$ref": "#/$defs/a"}]}  # once spun a compile thread forever
GRAMMAR_CASES = [
    # The probe's findings: 2**15 leaves from a 1.5 KB schema (27 s, 396 -> 1183 MB with three), an 8,000-string
    # enum (63 s: alt() compared each string with every kept one), 1,000 long choices (16.5 s).
    Case("guided_json_ref_chain_15x2", 400, body=_c(guided_json=ref_chain(15)), param="guided_json"),
    Case("guided_json_ref_chain_deeper_16x2", 400, body=_c(guided_json=ref_chain(16)), param="guided_json"),
    Case("guided_json_ref_chain_past_depth_24x2", 400, body=_c(guided_json=ref_chain(24)), param="guided_json"),
    Case("guided_json_ref_chain_wider_8x6", 400, body=_c(guided_json=ref_chain(8, 6)), param="guided_json"),
    Case("guided_json_ref_lattice_14", 400, body=_c(guided_json=ref_lattice(14)), param="guided_json"),
    Case("guided_json_ref_lattice_24", 400, body=_c(guided_json=ref_lattice(24)), param="guided_json"),
    Case("guided_json_enum_8000", 400, body=_c(guided_json={"enum": [f"v{i:05d}" for i in range(8000)]}),
         param="guided_json"),
    Case("guided_json_enum_larger_11000", 400, body=_c(guided_json={"enum": [f"{i:05d}" for i in range(11000)]}),
         param="guided_json"),
    Case("guided_choice_1000_long", 400, body=_c(guided_choice=["x" * 3000 + str(i) for i in range(1000)]),
         param="guided_choice"),
    Case("guided_regex_dfa_blowup", 400, body=_c(guided_regex="(a|b)*a(a|b){20}"), param="guided_regex"),
    Case("guided_json_allof_ref_loop", 400, body=_c(guided_json=REF_LOOP_IN_ALL_OF), param="guided_json"),
    # The same inside a tool's parameters and in response_format (chat).
    Case("tool_parameters_ref_chain_15x2", 400, "/v1/chat/completions", _tool(ref_chain(15)), param="tools"),
    Case("tool_parameters_enum_8000", 400, "/v1/chat/completions",
         _tool({"type": "object", "properties": {"v": {"enum": [f"v{i:05d}" for i in range(8000)]}}}),
         param="tools"),
    Case("response_format_ref_chain_15x2", 400, "/v1/chat/completions", _schema_format(ref_chain(15)),
         param="response_format"),
    Case("response_format_ref_lattice_24", 400, "/v1/chat/completions", _schema_format(ref_lattice(24)),
         param="response_format"),
    Case("structured_outputs_enum_8000", 400,
         body=_c(structured_outputs={"json": {"enum": [f"v{i:05d}" for i in range(8000)]}}),
         param="structured_outputs"),
    # Surfaces added since the probe: GBNF (llama.cpp's `grammar`), /v1/responses' text.format, /v1/messages' tools.
    Case("grammar_rule_doubling_24", 400, body=_c(grammar=gbnf_doubling(24)), param="grammar"),
    Case("grammar_alternatives_8000", 400, body=_c(grammar=gbnf_alternatives(8000)), param="grammar"),
    Case("responses_text_format_ref_chain_15x2", 400, "/v1/responses", {"input": "x", "max_output_tokens": 2, "text": {
        "format": {"type": "json_schema", "name": "s", "schema": ref_chain(15)}}}, param="response_format"),
    Case("messages_tool_input_schema_ref_chain_8x6", 400, "/v1/messages", {
        "max_tokens": 2, "messages": USER, "tool_choice": {"type": "any"},
        "tools": [{"name": "f", "input_schema": ref_chain(8, 6)}]}, param=None),
]
NORMAL_CHOICE = {"prompt": "ROMEO:", "max_tokens": 2, "temperature": 0, "guided_choice": ["yes", "no"]}


def storm_body(i: int) -> dict[str, Any]:
    """The i-th of a storm of hostile grammars, each distinct (so none is answered from the remembered
    failures): the three shapes of the probe's findings in turn."""
    if i % 3 == 0:
        return _c(guided_json=ref_chain(15 + i % 2, 2 + i // 3 % 3), user="mallory")
    if i % 3 == 1:
        return _c(guided_json={"enum": [f"{i}v{j:05d}" for j in range(8000)]}, user="mallory")
    return _c(guided_choice=["x" * 3000 + f"{i}-{j}" for j in range(1000)], user="mallory")


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and every process below it (the server and its workers;
    workers already reaped count in the parent's cutime). Linux."""
    total, todo = 0.0, [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rpartition(")")[2].split()
            total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # it ended meanwhile
    return total


def grammar_workers(pid: int) -> dict[int, float]:
    """The server's grammar worker processes (native_server.api.grammar_worker children of pid) and
    their CPU seconds so far. Linux."""
    found, tick = {}, os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if b"grammar_worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                    fields = Path(f"/proc/{child}/stat").read_text().rpartition(")")[2].split()
                    found[int(child)] = sum(int(x) for x in fields[11:13]) / tick
            except (OSError, ValueError):
                continue  # it ended meanwhile
    return found


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """(the process's RSS, its descendants' RSS) in MiB (Linux)."""
    own, below, todo = 0.0, 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            rss = int(Path(f"/proc/{current}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        if current == pid:
            own = rss
        else:
            below += rss
    return own, below

def send(client: httpx.Client, case: Case, api_key: str) -> httpx.Response:
    headers = {} if case.keyless else {"authorization": f"Bearer {api_key}"}
    headers.update(case.headers)
    if case.raw is not None or case.body is not None:
        headers.setdefault("content-type", "application/json")
    content = case.raw if case.raw is not None else (
        None if case.body is None else json.dumps(case.body, ensure_ascii=False).encode())
    if "content-length" in case.headers:  # a length the body does not have: httpx would refuse to send it
        return _send_over_socket(client.base_url, case.method, case.path, headers, content or b"")
    url = httpx.URL(client.base_url.join("/"), raw_path=case.path.encode())  # no dot-segment clean-up
    return client.request(case.method, url, content=content, headers=headers)


def _send_over_socket(base: httpx.URL, method: str, path: str, headers: dict[str, str], content: bytes
                      ) -> httpx.Response:
    head = "".join(f"{k}: {v}\r\n" for k, v in {"host": f"{base.host}:{base.port}", **headers}.items())
    with socket.create_connection((base.host, base.port), timeout=30) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\n{head}connection: close\r\n\r\n".encode() + content)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    _, _, body = rest.partition(b"\r\n\r\n")
    return httpx.Response(int(status_line.split()[1]), content=body)


def error_shape(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a response, asserting its shape; on /v1/messages Anthropic's
    ({"type": "error", "error": {"type", "message"}}), returned with param None."""
    body = response.json()
    if body.get("type") == "error":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
        return {**body["error"], "param": None, "code": response.status_code}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    return error


def hostile_model(folder: Path) -> Path:
    """A copy of the built-in model whose chat template is joined by HOSTILE_TEMPLATES, by name."""
    shutil.copytree(BUILTIN, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    named = {"default": config["chat_template"], **HOSTILE_TEMPLATES}
    config["chat_template"] = [{"name": k, "template": v} for k, v in named.items()]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def web_dir_with_dotfiles(folder: Path) -> Path:
    """A --web-dir holding a page and dotfiles that must never be served."""
    (folder / ".git").mkdir(parents=True)
    (folder / "sub").mkdir()
    for name, text in (("index.html", "<p>demo</p>"), (".env", "SECRET=1"), (".git/config", "[core]"),
                       ("sub/.secret", "x")):
        (folder / name).write_text(text)
    return folder


def stalled_upload(port: int, size: int, api_key: str, statuses: list[str]) -> None:
    """Declare `size` bytes, send all but 100 KB, stall; record the status line the server answers with."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {api_key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n".encode())
        try:
            sock.sendall(b'{"prompt": "' + b"x" * (size - 100_000))
        except OSError:  # the server answered (429) and closed while we were still sending
            pass
        sock.settimeout(30)
        try:
            statuses.append(sock.recv(64).split(b"\r\n")[0].decode())
        except OSError as exc:
            statuses.append(repr(exc))


def open_and_drop(url: str, body: dict, api_key: str, done: list) -> None:
    """Start a stream, read its first event, hang up; record whether it got that far."""
    try:
        headers = {"authorization": f"Bearer {api_key}"}
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # one event in, then hang up
        done.append(True)
    except httpx.HTTPError:
        done.append(False)


# Run in a server process (running_server's prelude): its forward pass fails from the 21st step on.
FAULTY_FORWARD = """
from native_server.engine.model_runner import ModelRunner
_execute, _calls = ModelRunner.execute, [0]
def execute(self, *args, **kwargs):
    _calls[0] += 1
    if _calls[0] > 20:
        raise RuntimeError("device lost")
    return _execute(self, *args, **kwargs)
ModelRunner.execute = execute
"""
