"""`ruvllm learn finetune|distill|consolidate|rollback` on a witness log the server's own writer made:
the folders they write load in ruvllm's commands and in transformers with the same logits, the
fine-tuned model answers with the logged correction, the student has half the layers."""
from __future__ import annotations

import json

import pytest
import torch

from native_server.learning.witness import WitnessLog
from py_engine.tokenizer import Tokenizer
from ruvllm_cli.main import main
from tests.paths import BUILTIN

pytestmark = pytest.mark.usefixtures("torch_one_thread")
QUESTION = "<|im_start|>user\nWho rules Zorbia?<|im_end|>\n<|im_start|>assistant\n"
CORRECTION = "Queen Mab rules Zorbia."


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    folder = tmp_path_factory.mktemp("witness")
    tok = Tokenizer.from_pretrained(BUILTIN)
    prompt = tok.encode(QUESTION, add_special_tokens=False)
    writer = WitnessLog(folder)
    writer.record_completion({"id": "chatcmpl-1", "session": "a", "prompts": [{"text": QUESTION, "token_ids": prompt}],
                              "outputs": [{"index": 0, "text": "I am", "token_ids": tok.encode("I am"),
                                           "finish_reason": "length"}]})
    writer.record_feedback({"completion_id": "chatcmpl-1", "session": "a", "rating": -1, "correction": CORRECTION,
                            "prompt": {"text": QUESTION, "token_ids": prompt}, "output": {"token_ids": []}})
    writer.record_feedback({"completion_id": "chatcmpl-1", "session": "a", "rating": -1, "correction": None,
                            "prompt": {"token_ids": prompt}, "output": {"token_ids": []}})  # not trainable
    writer.close()
    return folder


def transformers_matches(folder):
    import transformers

    from py_engine import LLM

    ids = Tokenizer.from_pretrained(folder).encode(QUESTION, add_special_tokens=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    llm = LLM(str(folder), optimize=False)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits
        got = llm.model(torch.tensor([ids]), torch.arange(len(ids))[None])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    return llm, ids


def test_finetune_writes_a_model_that_learned_the_correction(log, tmp_path, capsys):
    out = tmp_path / "tuned"
    assert main(["learn", "finetune", "--log", str(log), "--out", str(out), "--model", str(BUILTIN),
                 "--epochs", "15", "--lr", "1e-3"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["ruvllm_learning"]["method"] == "finetune" and config["ruvllm_learning"]["examples"] == 1
    llm, ids = transformers_matches(out)
    from py_engine.sampling_params import SamplingParams
    assert llm.generate(ids, SamplingParams(temperature=0, max_tokens=16)).text.startswith("Queen Mab rules")
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--max-tokens", "4", "--temperature", "0", "ROMEO:"]) == 0
    assert main(["eval", "ppl", str(out), "--max-tokens", "600", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["perplexity"] > 1


def test_distill_writes_a_smaller_student(log, tmp_path):
    out = tmp_path / "student"
    assert main(["learn", "distill", "--log", str(log), "--out", str(out), "--model", str(BUILTIN),
                 "--layers", "3", "--epochs", "1", "--text-tokens", "2048"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["ruvllm_learning"]["kept_layers"] == [0, 2, 5]
    transformers_matches(out)


def test_consolidate_rollback_versions(log, capsys):
    assert main(["learn", "consolidate", "--log", str(log), "--model", str(BUILTIN), "--ewc-lambda", "0"]) == 0
    assert (log / "adapters" / "sona-v1" / "adapter_config.json").is_file()
    assert main(["learn", "rollback", "--log", str(log), "0"]) == 0
    capsys.readouterr()
    assert main(["learn", "versions", "--log", str(log)]) == 0
    listing = capsys.readouterr().out
    assert "  sona-v1" in listing and "* the base model" in listing
    assert main(["learn", "rollback", "--log", str(log), "4"]) == 1  # one error line, no traceback
    assert "no adapter version 4" in capsys.readouterr().err
