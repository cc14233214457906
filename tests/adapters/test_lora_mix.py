"""Several adapters in one model: a slot per row, and weights per slot (the hook X-LoRA drives), against peft.

- indices: a batch whose rows use different adapters (or none) gives each row the
  logits it gets alone;
- weights [rows, slots]: peft with both adapters active, each scaled (set_scale);
- weights [rows, layers, slots]: a scale per LoRA layer as well, layers numbered
  in peft's module order (LoraManager.layer_names), on Llama and on Phi-3
  (whose attention defines o_proj before qkv_proj).
"""
from __future__ import annotations

import copy

import pytest

from tests.adapters.lora_cases import save_peft_adapter, target_sets
from tests.model_cases import FAMILIES, positions, prompt, save_hf_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft", reason="peft is in the [test] extra: pip install -e '.[test]'")
from py_engine.adapters import LoraManager  # noqa: E402
from py_engine.cpu.transforms import optimize_for_cpu  # noqa: E402
from py_engine.models import load_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
TOL = 1e-5


@pytest.fixture(scope="module", params=["llama3-rope", "phi3-longrope"])
def two_adapters(request, tmp_path_factory):
    """(base folder, hf model, {name: folder}, family) with adapters 'a' (rank 4) and 'b' (rank 8, rslora)."""
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    hf = save_hf_model(FAMILIES[family], folder / "base")
    targets = target_sets(FAMILIES[family]["model_type"])["all"]
    save_peft_adapter(hf, folder / "a", seed=1, r=4, lora_alpha=8, target_modules=targets)
    save_peft_adapter(hf, folder / "b", seed=2, r=8, lora_alpha=8, use_rslora=True, target_modules=targets[:3])
    return folder / "base", hf, {"a": folder / "a", "b": folder / "b"}, family


def _loaded(base, adapters, optimize=False):
    model, _ = load_model(base)
    if optimize:
        optimize_for_cpu(model)
    manager = LoraManager(model)
    for name, path in adapters.items():
        manager.add(name, path)
    return model, manager


def _peft_both(hf, adapters, scales):
    """peft with adapters a and b active together; scales: LoRA layer (peft's order) -> (scale a, scale b)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    model = PeftModel.from_pretrained(copy.deepcopy(hf), adapters["a"], adapter_name="a")
    model.load_adapter(adapters["b"], adapter_name="b")
    model.base_model.set_adapter(["a", "b"])
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for i, layer in enumerate(layers):
        for j, name in enumerate("ab"):
            if name in layer.scaling:
                layer.set_scale(name, scales(i)[j])
    return model.eval(), len(layers)


@pytest.mark.parametrize("optimize", [False, True])
def test_rows_of_different_adapters_match_each_alone(two_adapters, optimize):
    base, _, adapters, _ = two_adapters
    model, manager = _loaded(base, adapters, optimize)
    ids = torch.cat([prompt(9, seed=s) for s in (1, 2, 3)])  # [3, 9]: rows for a, the base, b
    solo = []
    for row, name in enumerate(["a", None, "b"]):
        with torch.no_grad(), manager.using(name):
            solo.append(model(ids[row:row + 1], positions(0, 9)))
    slots = [manager.slot(n) for n in ("a", None, "b")]
    with torch.no_grad(), manager.using(indices=torch.tensor(slots).repeat_interleave(9)):  # one slot per token
        mixed = model(ids, positions(0, 9).expand(3, 9))
    for row in range(3):
        assert (mixed[row] - solo[row][0]).abs().max().item() < TOL


def test_weights_per_slot_match_peft_with_both_adapters_scaled(two_adapters):
    base, hf, adapters, _ = two_adapters
    model, manager = _loaded(base, adapters)
    ids = prompt(11)
    reference, _ = _peft_both(hf, adapters, lambda layer: (0.5, 1.5))
    with torch.no_grad():
        expected = reference(ids).logits
        weights = torch.zeros(11, manager.num_slots)
        weights[:, manager.slot("a")], weights[:, manager.slot("b")] = 0.5, 1.5
        with manager.using(weights=weights):
            got = model(ids, positions(0, 11))
    assert (got - expected).abs().max().item() < TOL


def test_layerwise_weights_follow_peft_layer_order(two_adapters):
    base, hf, adapters, family = two_adapters
    model, manager = _loaded(base, adapters, optimize=True)  # fused q/k/v still number as separate layers
    scales = lambda layer: (0.2 + 0.1 * layer, 1.3 - 0.05 * layer)  # noqa: E731
    reference, n_layers = _peft_both(hf, adapters, scales)
    assert len(manager.layer_names()) == n_layers
    ids = prompt(11)
    weights = torch.zeros(11, n_layers, manager.num_slots)
    for layer in range(n_layers):
        weights[:, layer, manager.slot("a")], weights[:, layer, manager.slot("b")] = scales(layer)
    with torch.no_grad():
        expected = reference(ids).logits
        with manager.using(weights=weights):
            got = model(ids, positions(0, 11))
    assert (got - expected).abs().max().item() < TOL, family


def test_remove_frees_the_slot_and_restores_the_base(two_adapters):
    base, _, adapters, _ = two_adapters
    model, manager = _loaded(base, {"a": adapters["a"]})
    ids = prompt(5)
    with torch.no_grad():
        plain = model(ids, positions(0, 5))
        manager.remove("a")
        with pytest.raises(ValueError, match="no adapter named 'a'"):
            manager.set_adapter_mix("a")
        assert manager.add("b", adapters["b"]) == 0  # the freed slot is reused
        assert torch.equal(model(ids, positions(0, 5)), plain)
