"""LoRA through the user's doors: LLM(lora=...), `ruvllm generate/eval ppl --lora NAME=PATH --adapter NAME`,
`ruvllm merge-lora`, on the built-in model with a peft adapter, against peft's greedy tokens."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.adapters.lora_cases import save_peft_adapter
from tests.paths import BUILTIN, REPO

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft", reason="peft is in the [test] extra: pip install -e '.[test]'")
from py_engine import LLM, SamplingParams  # noqa: E402
from ruvllm_cli.main import main  # noqa: E402

PROMPT = "ROMEO:"
NEW = 16


def ruvllm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruvllm_cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A peft adapter on the built-in model (attention and MLP, rslora) and peft's greedy continuation."""
    folder = tmp_path_factory.mktemp("builtin-lora")
    hf = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN, dtype=torch.float32).eval()
    peft_model = save_peft_adapter(hf, folder / "adapter", seed=5, r=8, lora_alpha=16, use_rslora=True,
                                   target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    llm = LLM(str(BUILTIN))
    ids = llm.encode(PROMPT)
    with torch.no_grad():
        out = peft_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                                  pad_token_id=0)[0, len(ids):].tolist()
        base = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert out != base, "the adapter should change the greedy tokens"
    return folder / "adapter", out, base


def test_llm_generate_with_and_without_the_adapter(adapter):
    path, expected, base = adapter
    llm = LLM(str(BUILTIN), lora={"x": str(path)})
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    assert llm.generate(PROMPT, params, lora="x").token_ids == expected
    assert llm.generate(PROMPT, params).token_ids == base  # the same LLM, no adapter
    assert llm.loras == ["x"]
    with pytest.raises(ValueError, match="no adapter named 'y'"):
        llm.generate(PROMPT, params, lora="y")


def test_cli_generate_merge_and_eval(adapter, tmp_path, capsys):
    path, expected, _ = adapter
    r = ruvllm("generate", "--lora", f"x={path}", "--adapter", "x", "--max-tokens", str(NEW), "--temperature", "0",
               "--json", PROMPT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"][:NEW] == expected[:len(json.loads(r.stdout)["token_ids"])]
    r = ruvllm("merge-lora", str(BUILTIN), str(path), "--out", str(tmp_path / "merged"))
    assert r.returncode == 0, r.stderr
    merged = LLM(str(tmp_path / "merged"))
    assert merged.generate(PROMPT, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)).token_ids == expected
    ppl = {}
    for name, args in {"unmerged": ["--lora", f"x={path}", "--adapter", "x"], "merged": [],
                       "base": ["--lora", f"x={path}"]}.items():  # in-process: the subprocesses above cover startup
        model = str(tmp_path / "merged") if name == "merged" else str(BUILTIN)
        assert main(["eval", "ppl", model, *args, "--max-tokens", "300", "--json"]) == 0
        ppl[name] = json.loads(capsys.readouterr().out)["perplexity"]
    assert abs(ppl["unmerged"] - ppl["merged"]) < 1e-4 * ppl["merged"]
    assert abs(ppl["unmerged"] - ppl["base"]) > 1e-3 * ppl["base"]


def test_cli_errors(adapter, capsys):
    path, _, _ = adapter
    for args, message in [(["--lora", "x"], "--lora takes NAME=PATH"),
                          (["--lora", f"x={path}", "--adapter", "y"], "--adapter 'y' names no --lora adapter"),
                          (["--lora", "x=/nonexistent"], "no such adapter folder")]:
        assert main(["generate", *args, "--max-tokens", "2", PROMPT]) == 1
        assert message in capsys.readouterr().err
