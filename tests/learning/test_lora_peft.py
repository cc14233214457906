"""Adapters the learning loops write are peft LoRA folders: peft loads them onto the transformers model
and gives the logits ruvllm's model gives with the same matrices applied (fold included)."""
from __future__ import annotations

import json

import pytest
import torch

from py_engine.learning.lora import TrainableLora, applied, fold, load_peft, save_peft
from py_engine.models import load_model
from tests.tiny_models import build_tiny_model

IDS = [[5, 17, 42, 99, 3, 250, 7, 8, 64, 11]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("learning") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def ours(model_dir):
    model, _ = load_model(model_dir, dtype="float32")
    return model


def random_lora(model, modules, layers, rank, seed):
    lora = TrainableLora.for_model(model, modules, layers=layers, rank=rank, alpha=2 * rank, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for B in lora.B:  # a trained-looking B (peft's init leaves it zero)
            B.copy_(torch.randn(B.shape, generator=gen) * 0.5)
    return lora


def our_logits(model, modules=None):
    ids = torch.tensor(IDS)
    with torch.no_grad(), applied(model, modules):
        return model(ids, torch.arange(ids.shape[1])[None])


def peft_logits(model_dir, adapter_dir):
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(hf, adapter_dir)
    with torch.no_grad():
        return wrapped(torch.tensor(IDS)).logits, wrapped


def test_peft_loads_a_saved_lora_with_the_same_logits(model_dir, ours, tmp_path):
    lora = random_lora(ours, ("o_proj", "down_proj"), layers=1, rank=2, seed=0)
    lora.save_peft(tmp_path / "a", base=str(model_dir))
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2 and config["lora_alpha"] == 4
    assert config["target_modules"] == ["model.layers.1.mlp.down_proj", "model.layers.1.self_attn.o_proj"]
    expected = our_logits(ours, lora.adapter())
    base = our_logits(ours)
    got, wrapped = peft_logits(model_dir, tmp_path / "a")
    assert (expected - base).abs().max() > 1e-2  # the adapter changes something
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    adapted = sorted(n.removeprefix("base_model.model.") for n, m in wrapped.named_modules()
                     if hasattr(m, "lora_A") and len(m.lora_A))
    assert adapted == config["target_modules"]  # exactly these, no other layer
    again = load_peft(tmp_path / "a")
    for name, (A, B, s) in lora.adapter().items():
        torch.testing.assert_close(again[name][0], A)
        torch.testing.assert_close(again[name][1] * again[name][2], B * s)


def test_a_fold_is_the_sum_of_its_parts_and_peft_reads_it(model_dir, ours, tmp_path):
    one = random_lora(ours, ("o_proj", "down_proj"), layers=2, rank=4, seed=1).adapter()
    two = random_lora(ours, ("down_proj",), layers=1, rank=1, seed=2).adapter()  # a MicroLoRA: fewer modules
    folded = fold([(1.0, one), (0.5, two)])
    assert folded["model.layers.1.mlp.down_proj"][0].shape[0] == 5
    half = {n: (A, B, s * 0.5) for n, (A, B, s) in two.items()}
    with torch.no_grad(), applied(ours, one), applied(ours, half):
        ids = torch.tensor(IDS)
        both = ours(ids, torch.arange(ids.shape[1])[None])
    torch.testing.assert_close(our_logits(ours, folded), both, atol=2e-5, rtol=1e-5)
    save_peft(tmp_path / "f", folded, base=str(model_dir))
    got, _ = peft_logits(model_dir, tmp_path / "f")
    torch.testing.assert_close(got, both, atol=2e-5, rtol=1e-5)


def test_mixed_ranks_go_through_rank_pattern(model_dir, ours, tmp_path):
    a = random_lora(ours, ("o_proj",), layers=2, rank=3, seed=3).adapter()
    b = random_lora(ours, ("down_proj",), layers=2, rank=1, seed=4).adapter()
    save_peft(tmp_path / "m", {**a, **b}, base=str(model_dir))
    config = json.loads((tmp_path / "m" / "adapter_config.json").read_text())
    assert config["r"] == 3 and set(config["rank_pattern"].values()) == {1}
    got, _ = peft_logits(model_dir, tmp_path / "m")
    torch.testing.assert_close(got, our_logits(ours, {**a, **b}), atol=2e-5, rtol=1e-5)
