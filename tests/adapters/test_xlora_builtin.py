"""The shipped X-LoRA model of the built-in model through the user's doors, against peft.

py_engine/data/adapters/tiny-shakespeare/xlora (training/train_adapters.py) loaded by peft
(PeftModel.from_pretrained with its experts) and by ruvllm: logits and scalings, greedy
tokens from LLM(xlora=...), `ruvllm generate --xlora --json` (with per-token weights),
and one clear error for each bad input.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.paths import BUILTIN, REPO

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft", reason="peft is in the [test] extra: pip install -e '.[test]'")
from py_engine import LLM, SamplingParams  # noqa: E402
from tests.adapters.lora_cases import save_peft_adapter  # noqa: E402
from training.train_adapters import peft_loadable  # noqa: E402
from py_engine.adapters import AdapterError  # noqa: E402
from py_engine.adapters.xlora import load_xlora  # noqa: E402
from py_engine.models import load_model  # noqa: E402

ADAPTERS = REPO / "py_engine" / "data" / "adapters" / "tiny-shakespeare"
XLORA = ADAPTERS / "xlora"
EXPERTS = ("comedies", "tragedies", "milton")
PROMPT = "ROMEO:"
NEW = 24


def ruvllm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruvllm_cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def peft_xlora(tmp_path_factory):
    from peft import PeftModel

    hf = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN, dtype=torch.float32).eval()
    hf.config.use_cache = False
    return PeftModel.from_pretrained(hf, peft_loadable(XLORA, tmp_path_factory.mktemp("xlora"))).eval()


@pytest.fixture(scope="module")
def peft_greedy(peft_xlora):
    ids = LLM(str(BUILTIN)).encode(PROMPT)
    with torch.no_grad():
        out = peft_xlora.generate(input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=NEW,
                                  min_new_tokens=NEW, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_shipped_xlora_matches_peft(peft_xlora):
    text = (BUILTIN / "validation.txt").read_text()[:600]
    ids = torch.tensor([LLM(str(BUILTIN)).encode(text)[:128]])
    with torch.no_grad():
        want = peft_xlora(input_ids=ids).logits
        want_scalings = peft_xlora.get_latest_scalings()
        model, _ = load_model(BUILTIN, dtype="float32")
        xlm = load_xlora(model, XLORA)
        got = xlm(ids, torch.arange(ids.shape[1])[None])
    assert xlm.xlora_config.expert_labels == EXPERTS
    # The base model alone is bit-exact with transformers here; the experts' deltas are summed in another
    # order than peft's, which on logits of up to ~25 leaves float32 rounding of ~1e-5 (relative 1e-6).
    assert (got - want).abs().max().item() < 5e-5
    assert (xlm.last_scalings - want_scalings).abs().max().item() < 1e-5


def test_llm_and_cli_generate_peft_greedy_tokens(peft_greedy):
    llm = LLM(str(BUILTIN), xlora=str(XLORA))
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    assert llm.generate(PROMPT, params).token_ids == peft_greedy
    r = ruvllm("generate", PROMPT, "--xlora", str(XLORA), "--json", "--temperature", "0", "--max-tokens", str(NEW))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"][: len(peft_greedy)] == peft_greedy[: len(out["token_ids"])]
    weights = out["adapter_weights"]
    assert len(weights) == len(out["token_ids"]) and all(set(w) == set(EXPERTS) for w in weights)
    assert all(abs(sum(w.values()) - 1) < 1e-4 for w in weights)  # the classifier's softmax


def test_non_granular_generates(peft_greedy):
    """Non-granular with k = 1: the prompt's scalings for every token; a different but valid mix."""
    llm = LLM(str(BUILTIN), xlora=str(XLORA), xlora_non_granular=1)
    llm.xlora.scalings_log = []
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    weights = llm.xlora.token_weights()
    assert len(out.token_ids) == NEW and all(w == weights[0] for w in weights)


def test_bad_xlora_inputs_fail_clearly(tmp_path):
    model, _ = load_model(BUILTIN, dtype="float32")
    with pytest.raises(AdapterError, match="not 'XLORA'"):
        load_xlora(model, ADAPTERS / "comedies")  # a plain LoRA adapter
    broken = tmp_path / "no-classifier"
    shutil.copytree(XLORA, broken)
    from safetensors.torch import save_file
    save_file({}, str(broken / "adapter_model.safetensors"))  # what peft 0.20-0.21 save
    with pytest.raises(AdapterError, match="classifier's weights are missing"):
        load_xlora(load_model(BUILTIN, dtype="float32")[0], broken)
    cfg = json.loads((XLORA / "adapter_config.json").read_text())
    cfg["adapters"] = {str(i): str(ADAPTERS / name) for i, name in enumerate(EXPERTS)}  # the copies sit elsewhere
    other = tmp_path / "other-base"
    shutil.copytree(XLORA, other)
    (other / "adapter_config.json").write_text(json.dumps({**cfg, "hidden_size": 64}))
    with pytest.raises(AdapterError, match="hidden size 64"):
        load_xlora(load_model(BUILTIN, dtype="float32")[0], other)
    (other / "adapter_config.json").write_text(json.dumps({**cfg, "adapters": {"0": "../nowhere"}}))
    with pytest.raises(AdapterError, match="LoRA expert 0 is neither"):
        load_xlora(load_model(BUILTIN, dtype="float32")[0], other)
    (other / "adapter_config.json").write_text(json.dumps({**cfg, "top_k_lora": 5}))
    with pytest.raises(AdapterError, match="top_k_lora must be 1 to the number of experts"):
        load_xlora(load_model(BUILTIN, dtype="float32")[0], other)
    head = tmp_path / "head-expert"  # an expert on lm_head: peft's XLoraModel cannot load it, nor does ruvllm
    hf = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN, dtype=torch.float32)
    save_peft_adapter(hf, head, r=2, lora_alpha=2, target_modules=["q_proj", "lm_head"])
    experts = {"0": str(head), "1": str(ADAPTERS / "tragedies"), "2": str(ADAPTERS / "milton")}
    (other / "adapter_config.json").write_text(json.dumps({**cfg, "adapters": experts}))
    with pytest.raises(AdapterError, match="adapts lm_head"):
        load_xlora(load_model(BUILTIN, dtype="float32")[0], other)
    r = ruvllm("generate", "x", "--xlora-non-granular", "2")
    assert r.returncode != 0 and "--xlora-non-granular applies to an --xlora model" in r.stderr
    r = ruvllm("generate", "x", "--xlora", str(XLORA), "--lora", f"a={ADAPTERS / 'comedies'}")
    assert r.returncode != 0 and "cannot be combined with --lora" in r.stderr
