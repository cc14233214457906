"""LoRA adapters from peft checkpoints against peft itself, for every family of tests/model_cases.py.

Each family gets three adapters (attention, feed-forward, everything with the
LM head) over ranks 1 to 64, with rslora on and off and, once, rank and alpha
patterns. Each must give peft's fp32 logits within 1e-5 unmerged (on the
torch model and on the CPU-optimized one: fused projections, C kernels)
and merged, and peft's greedy tokens.
"""
from __future__ import annotations


import pytest

from tests.adapters.lora_cases import RANKS, save_peft_adapter, target_sets
from tests.model_cases import FAMILIES, greedy, positions, prompt, save_hf_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft", reason="peft is in the [test] extra: pip install -e '.[test]'")
from py_engine.adapters import LoraManager, load_lora, merge_lora  # noqa: E402
from py_engine.cpu.transforms import optimize_for_cpu  # noqa: E402
from py_engine.models import load_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
TOL = 1e-5
NEW_TOKENS = 12


def cases(index: int, model_type: str) -> list[tuple[str, dict]]:
    """Three adapter configs for the family at `index`: the ranks and rslora rotate across families."""
    sets = target_sets(model_type)
    r = [RANKS[(index + k * 3) % len(RANKS)] for k in range(3)]
    return [
        ("attention", dict(r=r[0], lora_alpha=2 * r[0], use_rslora=index % 2 == 0, target_modules=sets["attention"])),
        ("mlp", dict(r=r[1], lora_alpha=16, use_rslora=index % 2 == 1, target_modules=sets["mlp"])),
        ("all", dict(r=r[2], lora_alpha=8, target_modules=sets["all"],
                     rank_pattern={"o_proj": 3}, alpha_pattern={"lm_head": 5})),
    ]


@pytest.mark.parametrize("index,family", list(enumerate(sorted(FAMILIES))))
def test_lora_matches_peft(index, family, tmp_path):
    cfg = FAMILIES[family]
    hf = save_hf_model(cfg, tmp_path / "base")
    ids = prompt(33)
    for name, lora in cases(index, cfg["model_type"]):
        folder = tmp_path / name
        peft_model = save_peft_adapter(hf, folder, seed=index, **lora)
        with torch.no_grad():
            expected = peft_model(ids).logits
            base = hf(ids).logits
        assert (expected - base).abs().max() > 0.1, "the adapter should change the logits"
        for optimize in (False, True):
            model, _ = load_model(tmp_path / "base")
            if optimize:
                optimize_for_cpu(model)
            manager = LoraManager(model)
            manager.add(name, folder)
            with torch.no_grad(), manager.using(name):
                got = model(ids, positions(0, 33))
            diff = (got - expected).abs().max().item()
            assert diff < TOL, f"{family}/{name} (r={lora['r']}, optimize={optimize}): max abs diff {diff:.3g}"
            with torch.no_grad():  # no adapter active: the base model's logits
                assert (model(ids, positions(0, 33)) - base).abs().max().item() < TOL
        merged, _ = load_model(tmp_path / "base")
        merge_lora(merged, load_lora(folder))
        with torch.no_grad():
            diff = (merged(ids, positions(0, 33)) - got).abs().max().item()
        assert diff < TOL, f"{family}/{name}: merged differs from unmerged by {diff:.3g}"
        start = prompt(7)
        with torch.no_grad():
            want = peft_model.generate(input_ids=start, do_sample=False, max_new_tokens=NEW_TOKENS,
                                       min_new_tokens=NEW_TOKENS, pad_token_id=0)[0].tolist()
            with manager.using(name):
                assert greedy(model, start[0].tolist(), NEW_TOKENS) == want, f"{family}/{name}: greedy tokens differ"
