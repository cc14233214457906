"""The learning loops offline on the built-in model: a session's corrections change that session's
greedy answer and no other's; consolidation saves versions that reach every session and roll back;
EWC holds the weights the base's own text needs; a bare negative rating trains nothing."""
from __future__ import annotations

import pytest
import torch

from py_engine.learning import Sona, SonaConfig
from py_engine.learning.ewc import ewc_penalty
from py_engine.sampling_params import SamplingParams
from tests.paths import BUILTIN

pytestmark = pytest.mark.usefixtures("torch_one_thread")
GREEDY = SamplingParams(temperature=0, max_tokens=16)
CORRECTION = "Queen Mab rules Zorbia."


@pytest.fixture(scope="module")
def prompt():
    from py_engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(BUILTIN)
    return tok.encode("<|im_start|>user\nWho rules Zorbia?<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)


@pytest.fixture(scope="module")
def base_answer(prompt):
    """The engine's own greedy answer (LLM over the CPU kernels): the reference for 'unchanged'."""
    from py_engine import LLM

    return LLM(str(BUILTIN)).generate(prompt, GREEDY).token_ids


def record(prompt, session, correction=CORRECTION, rating=-1):
    return {"session": session, "prompt": {"token_ids": prompt}, "rating": rating, "correction": correction}


def test_instant_loop_changes_only_its_session(prompt, base_answer, tmp_path):
    sona = Sona.load(BUILTIN, SonaConfig(gate=False, micro_steps=5, micro_lr=5e-2), folder=tmp_path)
    assert sona.generate(prompt, GREEDY, session="a").token_ids == base_answer
    for _ in range(3):
        update = sona.learn(record(prompt, "a"))
        assert update.trained and update.session == "a" and update.stats.steps == 5
    assert sona.generate(prompt, GREEDY, session="a").text.startswith(CORRECTION[:15])
    assert sona.generate(prompt, GREEDY, session="b").token_ids == base_answer
    assert sona.generate(prompt, GREEDY).token_ids == base_answer  # no session: the base
    assert len(sona.replay) == 3 and sona.store.versions() == []  # nothing consolidated yet


def test_a_bare_negative_rating_is_logged_not_trained(prompt, tmp_path):
    sona = Sona.load(BUILTIN, SonaConfig(gate=False), folder=tmp_path)
    update = sona.learn(record(prompt, "a", correction=None))
    assert not update.trained and sona.replay == [] and sona.sessions == {}
    assert sona.learn({**record(prompt, "a", correction=None), "rating": 1,
                       "output": {"token_ids": [5, 6, 7]}}).trained  # an accepted answer trains


def test_consolidation_versions_reach_every_session_and_roll_back(prompt, base_answer, tmp_path):
    config = SonaConfig(gate=False, micro_steps=0, rank=4, epochs=30, lr=2e-2, ewc_lambda=0.0)
    sona = Sona.load(BUILTIN, config, folder=tmp_path)
    for _ in range(2):
        sona.learn(record(prompt, "a"))
    result = sona.consolidate()
    assert result.version == 1 and result.examples == 2 and result.stats.last_loss < result.stats.first_loss / 4
    assert (tmp_path / "adapters" / "sona-v1" / "adapter_model.safetensors").is_file()
    assert sona.generate(prompt, GREEDY, session="b").text.startswith(CORRECTION[:15])
    sona.rollback(0)
    assert sona.generate(prompt, GREEDY, session="b").token_ids == base_answer
    sona.rollback(1)
    again = Sona.load(BUILTIN, config, folder=tmp_path)  # a restart serves the current version
    assert again.version == 1
    assert again.generate(prompt, GREEDY, session="c").text.startswith(CORRECTION[:15])
    with pytest.raises(ValueError, match="no adapter version 7"):
        again.rollback(7)


def test_folding_sessions_is_exact(prompt, base_answer, tmp_path):
    config = SonaConfig(gate=False, micro_steps=5, micro_lr=5e-2, epochs=0, ewc_lambda=0.0, fold_sessions=1.0)
    sona = Sona.load(BUILTIN, config, folder=tmp_path)
    for _ in range(3):
        sona.learn(record(prompt, "a"))
    a_answer = sona.generate(prompt, GREEDY, session="a").token_ids
    assert a_answer != base_answer
    result = sona.consolidate()  # no training (0 epochs): the folded MicroLoRA alone
    assert result.folded_sessions == 1 and sona.sessions == {}
    assert sona.generate(prompt, GREEDY, session="b").token_ids == a_answer


def test_ewc_holds_the_weights_the_base_needs(prompt, tmp_path):
    sona = Sona.load(BUILTIN, SonaConfig(gate=False, rank=4, epochs=20, lr=2e-2, fisher_tokens=1024), folder=tmp_path)
    for _ in range(2):
        sona.learn(record(prompt, None))
    free = sona.consolidate(ewc_lambda=0.0)
    held = sona.consolidate(ewc_lambda=1000.0)
    assert held.version == 2 and held.fisher_seconds > 0 and (tmp_path / "fisher.safetensors").is_file()
    fisher = sona.fisher
    assert all((f >= 0).all() for f in fisher.values())
    assert abs(torch.cat([f.flatten() for f in fisher.values()]).mean().item() - 1) < 1e-3

    def penalty(version):
        from py_engine.learning.lora import TrainableLora
        modules = sona.store.load(version)
        lora = TrainableLora({n: tuple(B.shape[:1]) + tuple(A.shape[1:]) for n, (A, B, _) in modules.items()},
                             rank=4)
        lora.load_adapter(modules)
        return float(ewc_penalty(lora, fisher))
    assert penalty(2) < penalty(1) / 2, (penalty(1), penalty(2))
    assert free.stats.last_loss < held.stats.last_loss  # the price: the new facts are fit less


def test_for_llm_generates_through_the_adapter_path(prompt, base_answer, tmp_path):
    """The LLM's own engine (CPU kernels, fused projections, LoraLinear slots) gives what the training
    copy with hooked deltas gives."""
    from py_engine import LLM

    sona = Sona.for_llm(LLM(str(BUILTIN)), SonaConfig(gate=False, micro_steps=5, micro_lr=5e-2), folder=tmp_path)
    for _ in range(3):
        sona.learn(record(prompt, "a"))
    through_llm = sona.generate(prompt, GREEDY, session="a").token_ids
    assert sona.llm.loras == ["sona/a"] and sona.generate(prompt, GREEDY, session="b").token_ids == base_answer
    sona.llm = None
    assert sona.generate(prompt, GREEDY, session="a").token_ids == through_llm
    assert sona.generate(prompt, GREEDY, session="a").text.startswith(CORRECTION[:15])
