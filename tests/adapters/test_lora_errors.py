"""Adapters ruvllm must refuse, each with one clear AdapterError naming what is wrong (and nothing loaded)."""
from __future__ import annotations

import json

import pytest

from tests.adapters.lora_cases import save_peft_adapter
from tests.model_cases import FAMILIES, save_hf_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft", reason="peft is in the [test] extra: pip install -e '.[test]'")
from py_engine.adapters import AdapterError, LoraManager, load_lora  # noqa: E402
from py_engine.models import load_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
ATTN = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, save_hf_model(FAMILIES["llama-yarn"], folder / "base")


def _refused(model_dir, adapter_dir, match, **kwargs):
    model, _ = load_model(model_dir)
    manager = LoraManager(model, **kwargs)
    with pytest.raises(AdapterError, match=match):
        manager.add("x", adapter_dir)
    assert not manager.slots and not manager.wrappers(), "a refused adapter must leave the model as it was"


@pytest.mark.parametrize("config,match", [
    (dict(r=4, target_modules=ATTN, use_dora=True), "DoRA"),
    (dict(r=4, target_modules=ATTN, modules_to_save=["embed_tokens"]), "modules_to_save.*the embedding"),
    (dict(r=4, target_modules=ATTN + ["embed_tokens"]), "LoRA on the embedding"),
    (dict(r=4, target_modules=ATTN, bias="all"), "bias='all'"),
    (dict(r=16, target_modules=ATTN), "rank 16 is above the limit of 8"),
])
def test_refused_peft_adapters(llama, tmp_path, config, match):
    folder, hf = llama
    save_peft_adapter(hf, tmp_path / "adapter", **config)
    _refused(folder / "base", tmp_path / "adapter", match, max_rank=8)


def test_adapter_for_another_base_is_refused(llama, tmp_path):
    folder, _ = llama
    other = save_hf_model({**FAMILIES["llama-yarn"], "intermediate_size": 96}, tmp_path / "other")
    save_peft_adapter(other, tmp_path / "mlp", r=4, target_modules=["down_proj"])
    _refused(folder / "base", tmp_path / "mlp", r"another base model")
    phi = save_hf_model(FAMILIES["phi3-longrope"], tmp_path / "phi")
    save_peft_adapter(phi, tmp_path / "fused", r=4, target_modules=["qkv_proj"])
    _refused(folder / "base", tmp_path / "fused", r"qkv_proj', which this model does not have")


def test_moe_expert_parameters_are_refused(tmp_path):
    mixtral = save_hf_model(FAMILIES["mixtral"], tmp_path / "base")
    save_peft_adapter(mixtral, tmp_path / "experts", r=4, target_modules=[], target_parameters=["experts.gate_up_proj"])
    with pytest.raises(AdapterError, match="target_parameters"):
        load_lora(tmp_path / "experts")


def test_broken_adapter_folders(llama, tmp_path):
    folder, hf = llama
    with pytest.raises(AdapterError, match="no such adapter folder"):
        load_lora(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_lora(tmp_path / "empty")
    good = tmp_path / "good"
    save_peft_adapter(hf, good, r=4, target_modules=ATTN)
    config = json.loads((good / "adapter_config.json").read_text())
    cases = {
        "json": ("{not json", None, "not valid JSON"),
        "xlora": (json.dumps({**config, "peft_type": "XLORA"}), None, "not a LoRA adapter.*--xlora"),
        "rank": (json.dumps({**config, "r": 0}), None, "r must be a positive integer"),
        "mismatch": (json.dumps({**config, "r": 5}), None, "has rank 4 but adapter_config.json says 5"),
        "truncated": (None, (good / "adapter_model.safetensors").read_bytes()[:200], "safetensors|truncated|header"),
        "noweights": (None, b"", "no adapter weights"),
    }
    for name, (config_text, weights, match) in cases.items():
        bad = tmp_path / name
        bad.mkdir()
        (bad / "adapter_config.json").write_text(config_text or json.dumps(config))
        if weights is None:
            (bad / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
        elif weights:
            (bad / "adapter_model.safetensors").write_bytes(weights)
        with pytest.raises(AdapterError, match=match):
            load_lora(bad)


def test_unknown_adapter_name(llama, tmp_path):
    folder, hf = llama
    save_peft_adapter(hf, tmp_path / "a", r=2, target_modules=ATTN)
    model, _ = load_model(folder / "base")
    manager = LoraManager(model)
    manager.add("a", tmp_path / "a")
    with pytest.raises(AdapterError, match="already loaded"):
        manager.add("a", tmp_path / "a")
    with pytest.raises(AdapterError, match=r"no adapter named 'b' is loaded \(loaded: \['a'\]\)"):
        manager.set_adapter_mix("b")


def _edit_config(folder, **changes):
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def test_a_config_that_lies_about_its_targets_is_refused(llama, tmp_path):
    """peft refuses target_modules it cannot find in the model; a lying config once loaded silently."""
    folder, hf = llama
    save_peft_adapter(hf, tmp_path / "a", r=4, target_modules=ATTN)
    _edit_config(tmp_path / "a", target_modules=[*ATTN, "nonexistent_proj"])
    _refused(folder / "base", tmp_path / "a", r"target_modules 'nonexistent_proj' name no module")
    _edit_config(tmp_path / "a", target_modules=r".*\.nonexistent_proj")
    _refused(folder / "base", tmp_path / "a", r"matches no module")
    _edit_config(tmp_path / "a", target_modules=r".*\.(q|v)_proj")  # peft's regex form, matching: fine
    model, _ = load_model(folder / "base")
    LoraManager(model).add("x", tmp_path / "a")


def test_non_finite_weights_are_refused_by_module(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, hf = llama
    save_peft_adapter(hf, tmp_path / "a", r=4, target_modules=ATTN)
    tensors = load_file(tmp_path / "a" / "adapter_model.safetensors")
    key = sorted(k for k in tensors if k.endswith("v_proj.lora_A.weight"))[0]
    tensors[key][0, 0] = float("inf")
    save_file(tensors, tmp_path / "a" / "adapter_model.safetensors")
    module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
    with pytest.raises(AdapterError, match=rf"non-finite weights \(NaN or inf\) in {module}$"):
        load_lora(tmp_path / "a")


def test_files_linked_out_of_the_allowed_folder_are_refused(llama, tmp_path):
    folder, hf = llama
    root = tmp_path / "root"
    save_peft_adapter(hf, tmp_path / "outside", r=4, target_modules=ATTN)
    save_peft_adapter(hf, root / "a", r=4, target_modules=ATTN)
    load_lora(root / "a", within=root)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "a" / name).unlink()
        (root / "a" / name).symlink_to(tmp_path / "outside" / name)
        with pytest.raises(AdapterError, match=f"a/{name} links outside"):
            load_lora(root / "a", within=root)
        load_lora(root / "a")  # the Python API and --lora take what they are given
        (root / "a" / name).unlink()
        (root / "a" / name).symlink_to(root / ".." / "root" / "a" / ".." / ".." / "outside" / name)
        with pytest.raises(AdapterError, match="links outside"):
            load_lora(root / "a", within=root)
        (root / "a" / name).unlink()
        (root / "a" / name).write_bytes((tmp_path / "outside" / name).read_bytes())
