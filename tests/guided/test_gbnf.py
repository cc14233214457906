"""GBNF grammars (llama.cpp's format) checked against llama.cpp's own grammar engine: the automaton a
grammar compiles to accepts what llama.cpp accepts (strings walked out of it, and hand-written
sentences), and every sample of a seeded T=1 run of LLM.generate under llama.cpp's JSON,
arithmetic and list grammars is a sentence of the grammar (or, cut by max_tokens, a prefix of one)
by llama.cpp's verdict. Plus the parser's and the compiler's errors and bounds."""
from __future__ import annotations

import random

import pytest

from py_engine.guided import GuidedError, StructuredOutputsParams, dfa_for
from py_engine.guided.gbnf import gbnf_node, parse_gbnf
from py_engine.guided.gbnf.compile import MAX_RECURSION
from py_engine.sampling_params import SamplingParams, SamplingParamsError, from_openai
from tests.gbnf_cases import GRAMMARS, MAX_TOKENS, PROMPT, SEEDS
from tests.guided.llama_grammar import llama_grammar_checker

VALID = {
    "json": ['{}', '{"a": 1}', '{"a": [1, 2.5e3, -0.5, "x\\n\\u00e9"], "b": {"c": null}}', '{\n  "k": true}'],
    "arithmetic": ["a=b\n", "x1 +(y*2) =z\n", "(a+(b-c))=d\nq=1\n", "12/ab_3=4\n"],
    "list": ["- one\n", "- a\n- b b\n- é ✓\n"],
}


@pytest.fixture(scope="module")
def check():
    return llama_grammar_checker()


def _walk(dfa, rng: random.Random, limit: int = 60) -> bytes:
    """A random string of the automaton's language (or a prefix of one): random live bytes."""
    q, out = dfa.start, bytearray()
    while len(out) < limit:
        if dfa.accepting[q] and rng.random() < 0.3:
            break
        live = [b for b in range(256) if dfa.row(q)[b] >= 0]
        if not live:
            break
        b = rng.choice(live)
        out.append(b)
        q = dfa.row(q)[b]
    return bytes(out)


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_the_automaton_agrees_with_llama_cpp(check, name):
    grammar = GRAMMARS[name]
    dfa = dfa_for(StructuredOutputsParams(grammar=grammar))
    rng = random.Random(0)
    texts, ours = [], []
    while len(texts) < 40:
        data = _walk(dfa, rng)
        text = data.decode("utf-8", errors="ignore")
        data = text.encode()
        q = dfa.step(dfa.start, data)
        if q < 0:
            continue
        texts.append(text)
        ours.append("complete" if dfa.accepting[q] else "prefix")
    texts += VALID[name]
    ours += ["complete"] * len(VALID[name])
    for text in VALID[name]:
        assert dfa.matches(text.encode()), text
    assert check(grammar, texts) == ours
    bad = ['{"a" 1}', "[1]", "a==b\n", "-x\n", "A=b\n", "- \n", "* a\n"]
    verdicts = check(grammar, bad)
    for text, verdict in zip(bad, verdicts):
        alive = dfa.step(dfa.start, text.encode()) >= 0
        assert alive == (not verdict.startswith("invalid")), (text, verdict)


@pytest.fixture(scope="module")
def llm():
    from py_engine import LLM

    return LLM("tiny-shakespeare", device="cpu")


def grammar_runs(llm, grammar: str) -> list:
    """The seeded T=1 run every runtime repeats (tests/gbnf_cases.py)."""
    return [llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                                                structured_outputs=StructuredOutputsParams(grammar=grammar)))
            for seed in SEEDS]


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_every_sample_follows_the_grammar(check, llm, name):
    outs = grammar_runs(llm, GRAMMARS[name])
    verdicts = check(GRAMMARS[name], [o.text for o in outs])
    for out, verdict in zip(outs, verdicts):
        # ended by the grammar: a sentence; cut by max_tokens: a prefix of one (or a sentence that could go on)
        assert verdict in (("complete",) if out.finish_reason == "stop" else ("complete", "prefix")), (out.text,
                                                                                                     verdict)
    assert len({o.text for o in outs}) > 1  # sampled, not one forced string


def test_recursion_is_bounded_and_loops_are_not():
    nested = 'root ::= "(" root ")" | "x"'
    dfa = dfa_for(StructuredOutputsParams(grammar=nested))
    deep = MAX_RECURSION - 1
    assert dfa.matches(b"(" * deep + b"x" + b")" * deep) and not dfa.matches(b"(" * MAX_RECURSION + b"x" +
                                                                              b")" * MAX_RECURSION)
    # self-calls at the end or the start of a rule are loops: no bound at all
    for grammar in ('root ::= "a" root | "b"', 'root ::= root "a" | "b"', 'root ::= item root | item\nitem ::= [0-9]'):
        long = dfa_for(StructuredOutputsParams(grammar=grammar))
        assert long.max_length() is None
    assert dfa_for(StructuredOutputsParams(grammar='root ::= "a" root | "b"')).matches(b"a" * 200 + b"b")
    assert dfa_for(StructuredOutputsParams(grammar='root ::= root "a" | "b"')).matches(b"b" + b"a" * 200)


@pytest.mark.parametrize("grammar,words", [
    ('root ::= "a" root', "no output of root ends"),
    ("root ::= foo", "'foo' is used but not defined"),
    ('item ::= "a"', "no 'root' rule"),
    ('root ::= "a', "unexpected end"),
    ('root ::= [a-', "unexpected end"),
    ('root := "a"', "expecting ::="),
    ('root ::= "a" )', "expecting a newline"),
    ('root ::= <[12]>', "token references"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "a"{3,1}', "below the minimum"),
    ('root ::= "a"{99999}', "repeat count above"),
    ('root ::= *', "follows nothing"),
    ('root ::= ' + "(" * 100 + '"a"' + ")" * 100, "nested more than"),
    ("", "no rules"),
])
def test_bad_grammars_name_the_problem(grammar, words):
    with pytest.raises(GuidedError, match=words) as info:
        gbnf_node(grammar)
    assert info.value.param == "grammar"


def test_grammar_fields_and_their_errors():
    grammar = 'root ::= "yes" | "no"'
    for body in ({"grammar": grammar}, {"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        spec = from_openai(body).structured_outputs
        assert spec.grammar == grammar and dfa_for(spec).matches(b"yes")
    for field in ("grammar", "guided_grammar"):
        with pytest.raises(SamplingParamsError, match="line 1, column 10") as info:
            from_openai({field: "root ::= ?"})
        assert info.value.field == field
    with pytest.raises(SamplingParamsError, match="both constrain"):
        from_openai({"grammar": grammar, "response_format": {"type": "json_object"}})
    with pytest.raises(GuidedError, match="over 100000 characters"):
        parse_gbnf("root ::= " + '"a" ' * 30_000)
    big = "\n".join(f"r{i} ::= \"a\"" for i in range(2_001)) + "\nroot ::= r0"
    with pytest.raises(GuidedError, match="more than 2000 rules"):
        parse_gbnf(big)
