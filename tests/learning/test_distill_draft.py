"""`ruvllm learn distill-draft TARGET --layers N --out DIR` on the built-in model: a two-layer student trained on
the target's own greedy answers to windows of its validation text. The folder is a normal model folder (loads
in ruvllm and in transformers with the same logits), drafts for the target without changing a token, and its
measured acceptance on held-out prompts beats the same cut of the target before training (the report says
both). Bad arguments fail before any work."""
from __future__ import annotations

import json

import pytest
import torch

from py_engine import LLM, SamplingParams
from py_engine.kernels import cpu_kernels
from ruvllm_cli.main import main
from tests.paths import BUILTIN
from tests.requires import kernels_missing

pytestmark = [pytest.mark.usefixtures("torch_one_thread"),
              pytest.mark.skipif(cpu_kernels() is None, reason=str(kernels_missing()))]


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    out = tmp_path_factory.mktemp("draft") / "d"
    assert main(["learn", "distill-draft", str(BUILTIN), "--layers", "2", "--data", "text", "--num-prompts", "20",
                 "--eval-prompts", "5", "--max-tokens", "32", "--epochs", "2", "--lr", "1e-3", "--out", str(out)]) == 0
    return out


def test_the_draft_is_a_smaller_model_folder_transformers_loads(draft):
    transformers = pytest.importorskip("transformers")
    config = json.loads((draft / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["ruvllm_learning"]["kept_layers"] == [0, 5]
    ids = torch.tensor([[5, 17, 300, 42, 9]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    ours = LLM(str(draft), quantization=None)
    backend = ours._new_backend()
    with torch.no_grad():
        expected = hf(ids).logits[0, -1]
    got = torch.as_tensor(backend.prefill(ids[0].tolist())).reshape(-1)
    assert torch.allclose(got, expected, atol=1e-3)


def test_it_drafts_without_changing_a_token_and_training_paid(draft):
    report = json.loads((draft / "draft_report.json").read_text())
    trained, untrained = report["acceptance"], report["acceptance_untrained"]
    assert report["held_out_prompts"] == 5 and trained["num_draft_tokens"] > 0
    assert trained["acceptance_rate"] > untrained["acceptance_rate"]
    assert len(trained["per_position_rate"]) == 4
    plain = LLM(str(BUILTIN))
    spec = LLM(str(BUILTIN), speculative={"model": str(draft), "num_speculative_tokens": 3, "acceptance_floor": 0})
    params = SamplingParams(temperature=0, max_tokens=32)
    for prompt in ["ROMEO: What light", "First Citizen:\nWe are accounted poor"]:
        a, b = plain.generate(prompt, params), spec.generate(prompt, params)
        assert a.token_ids == b.token_ids and b.speculative["num_accepted_tokens"] > 0


def test_bad_arguments_fail_before_any_work(tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    assert main(["learn", "distill-draft", str(BUILTIN), "--out", str(full)]) != 0
    assert "must be a new or empty folder" in capsys.readouterr().err and (full / "x").read_text() == "keep me"
    assert main(["learn", "distill-draft", str(BUILTIN), "--layers", "0", "--out", str(tmp_path / "a")]) != 0
    assert "--layers" in capsys.readouterr().err
    assert main(["learn", "distill-draft", str(BUILTIN), "--layers", "9", "--data", "text", "--num-prompts", "4",
                 "--eval-prompts", "1", "--out", str(tmp_path / "b")]) != 0
    assert "--layers must be in [1, 6]" in capsys.readouterr().err
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n[1, 2]\n')
    assert main(["learn", "distill-draft", str(BUILTIN), "--prompts", str(bad), "--out", str(tmp_path / "c")]) != 0
    assert "p.jsonl:2" in capsys.readouterr().err
