"""The instant update's fast path, against transformers + peft: a pattern's MicroLoRA, trained from the frozen
pass (float32 or its bfloat16 copy) and the cut softmax, saved as a peft folder, makes transformers' model
give the answer; over a consolidated adapter the frozen copy runs with that adapter too."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from py_engine.learning import SonaConfig
from py_engine.learning.instant import InstantTrainer, frozen_dtype
from py_engine.learning.lora import TrainableLora, applied, fold, save_peft
from py_engine.learning.objective import Example
from py_engine.models import load_model
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("torch_one_thread")
PROMPT, TARGET = (5, 17, 42, 99, 3, 250, 7, 8, 64, 11), (33, 121, 90)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("instant") / "tiny-llama", "llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def ours(model_dir):
    model, _ = load_model(model_dir, dtype="float32")
    return model.requires_grad_(False)


def peft_argmax(model_dir, adapter_dir):
    """transformers' model with the peft adapter: its greedy token at each answer position (teacher forced)."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(hf, adapter_dir) if adapter_dir is not None else hf
    with torch.no_grad():
        logits = wrapped(torch.tensor([PROMPT + TARGET])).logits[0]
    return tuple(logits[len(PROMPT) - 1:-1].argmax(-1).tolist())


def consolidated(model):
    lora = TrainableLora.for_model(model, ("o_proj", "down_proj"), layers=0, rank=4, seed=7)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for B in lora.B:
            B.copy_(torch.randn(B.shape, generator=gen) * 0.3)
    return lora.adapter()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("modules", [("down_proj",), ("o_proj", "down_proj")])
def test_one_update_makes_peft_answer(model_dir, ours, tmp_path, dtype, modules):
    assert peft_argmax(model_dir, None) != TARGET  # the base does not already say it
    trainer = InstantTrainer(ours, SonaConfig(micro_modules=modules, instant_dtype=dtype, micro_steps=200,
                                              micro_lr=5e-2))
    assert trainer.fast and trainer.dtype == getattr(torch, dtype)
    lora, stats = trainer.train(Example(PROMPT, TARGET))
    assert stats.steps < 200 and stats.last_loss < stats.first_loss
    assert sorted(n.rsplit(".", 1)[-1] for n in lora.names) == sorted(modules)
    assert all(n.startswith("model.layers.2.") for n in lora.names)  # the last layer only
    save_peft(tmp_path / "micro", lora.adapter(), base=str(model_dir))
    assert peft_argmax(model_dir, tmp_path / "micro") == TARGET


def test_over_a_consolidated_adapter_the_frozen_copy_applies_it(model_dir, ours, tmp_path):
    under = consolidated(ours)
    trainer = InstantTrainer(ours, SonaConfig(instant_dtype="bfloat16", micro_steps=200))
    with applied(ours, under):  # as Sona.learn calls it: the caller hooks the float model
        lora, _ = trainer.train(Example(PROMPT, TARGET), under)
        reference = InstantTrainer(ours, SonaConfig(instant_dtype="float32")).frozen_pass(Example(PROMPT, TARGET))
    assert trainer.frozen is not ours and not any(m._forward_hooks for m in trainer.frozen.modules())
    with applied(trainer.frozen, under):
        copy = trainer.frozen_pass(Example(PROMPT, TARGET))
    torch.testing.assert_close(copy.x, reference.x, atol=0.05 * float(reference.x.abs().max()), rtol=0.05)
    save_peft(tmp_path / "both", fold([(1.0, under), (1.0, lora.adapter())]), base=str(model_dir))
    save_peft(tmp_path / "under", under, base=str(model_dir))
    assert peft_argmax(model_dir, tmp_path / "under") != TARGET
    assert peft_argmax(model_dir, tmp_path / "both") == TARGET


def test_auto_takes_bfloat16_only_where_the_cpu_has_it():
    weight = torch.zeros(1)
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert frozen_dtype("auto", weight) == (torch.bfloat16 if native else torch.float32)
    assert frozen_dtype("float32", weight) == torch.float32
    assert frozen_dtype("bfloat16", weight) == torch.bfloat16
    with pytest.raises(ValueError, match="instant_dtype"):
        SonaConfig(instant_dtype="fp8")
    with pytest.raises(ValueError, match="micro_modules"):
        SonaConfig(micro_modules=("lm_head",))


def test_consolidation_fits_every_pattern_and_the_keep_term_holds_the_base(model_dir, ours, tmp_path):
    from py_engine.learning.consolidate import consolidate_patterns

    other = Example((9, 4, 200, 31, 77, 5), (140, 12))
    gen = torch.Generator().manual_seed(3)
    keep_ids = torch.randint(3, 250, (257,), generator=gen).tolist()
    config = SonaConfig(rank=8, consolidate_steps=300)
    lora, stats = consolidate_patterns(ours, config, [Example(PROMPT, TARGET), other], keep_ids)
    assert stats.steps < 300 and stats.last_loss < stats.first_loss
    save_peft(tmp_path / "c", lora.adapter(), base=str(model_dir))
    assert peft_argmax(model_dir, tmp_path / "c") == TARGET
    loose, _ = consolidate_patterns(ours, dataclasses.replace(config, keep_weight=0.0),
                                    [Example(PROMPT, TARGET), other], keep_ids)

    def drift(modules):  # mean KL(base || adapted) of the next token over unseen text
        ids = torch.randint(3, 250, (1, 96), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            base = ours(ids, torch.arange(96)[None]).log_softmax(-1)
            with applied(ours, modules):
                logq = ours(ids, torch.arange(96)[None]).log_softmax(-1)
        return float((base.exp() * (base - logq)).sum(-1).mean())
    assert drift(lora.adapter()) < 0.85 * drift(loose.adapter())  # 0.59 vs 0.77 here
