"""LoRA on the CPU fast path: the one-call decode step (kernels/step.c's lora_add) equals the module path,
which equals peft; quantized bases (int8, int4, GGUF-style Q4) with an adapter equal peft on the dequantized base.

- the stack takes adapted models (every decode step but the first is one C call), with the adapter, with
  the base (no adapter active) and after switching adapters or removing one;
- float32: stack and module path within 1e-5 of each other and of peft (the delta is summed in another order);
  bfloat16: within bf16's rounding of each other;
- quantized: peft over the dequantized weights (as the quantizer rounded them), within the tolerance the
  quantized base alone has against its dequantized float model.
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
from py_engine.kernels import cpu_kernels  # noqa: E402
from py_engine.models import DenseKVCache, load_model  # noqa: E402
from tests.requires import kernels_missing  # noqa: E402

pytestmark = [pytest.mark.skipif(cpu_kernels() is None, reason=str(kernels_missing())),
              pytest.mark.usefixtures("torch_one_thread")]
PREFILL = 5


def _decode(model, ids):
    kv = DenseKVCache.allocate(model.config, 1, ids.shape[1], dtype=model.model.norm.weight.dtype)
    out = [model(ids[:, :PREFILL], positions(0, PREFILL), kv)]
    for t in range(PREFILL, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], positions(t, t + 1), kv))
    return torch.cat(out, dim=1)


def _both(model, ids):
    with torch.no_grad():
        model.model.stack_enabled = True
        fast = _decode(model, ids)
        model.model.stack_enabled = False
        slow = _decode(model, ids)
        model.model.stack_enabled = True
    return fast, slow


@pytest.fixture(scope="module", params=["llama3-rope", "phi3-longrope"])
def family(request, tmp_path_factory):
    """(base folder, hf model, adapters {a: all targets r 8, b: attention r 16 rslora})."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(FAMILIES[request.param], folder / "base")
    sets = target_sets(FAMILIES[request.param]["model_type"])
    save_peft_adapter(hf, folder / "a", seed=1, r=8, lora_alpha=16, target_modules=sets["all"])
    save_peft_adapter(hf, folder / "b", seed=2, r=16, lora_alpha=8, use_rslora=True, target_modules=sets["attention"])
    return folder, hf


def _adapted(folder, dtype="float32", quantization=None):
    model, _ = load_model(folder / "base", dtype=dtype)
    if quantization is not None:
        from py_engine.quant.config import QuantConfig
        from py_engine.quant.transform import quantize_model

        quantize_model(model, QuantConfig.from_options(quantization, group_size=32 if quantization == "int4" else None),
                       progress=False)
    optimize_for_cpu(model)
    manager = LoraManager(model)
    manager.add("a", folder / "a")
    manager.add("b", folder / "b")
    return model, manager


def _peft(hf, adapter):
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(hf), adapter).eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_with_adapters_equals_module_path_and_peft(family, dtype, calls):
    folder, hf = family
    model, manager = _adapted(folder, dtype)
    ids = prompt(16)  # Phi-3 LongRoPE switches factors past 16 tokens, and a cached decode cannot follow
    tol = 1e-5 if dtype == "float32" else 0.1
    for name in ("a", "b", None, "a"):  # switching adapters between sequences, and the base between them
        calls["n"] = 0
        manager.set_adapter_mix(name)
        fast, slow = _both(model, ids)
        assert calls["n"] >= ids.shape[1] - PREFILL - 1, "every decode step (but the first) is one C call"
        assert (fast - slow).abs().max().item() < tol, name
        if dtype == "float32":
            with torch.no_grad():
                expected = (_peft(hf, folder / name) if name else hf)(ids).logits
            assert (fast - expected).abs().max().item() < 1e-5, name
    manager.remove("a")  # the stack notices: adapter a's matrices are gone
    manager.set_adapter_mix("b")
    fast, slow = _both(model, ids)
    assert (fast - slow).abs().max().item() < tol


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_base_with_adapter_equals_peft_on_dequantized_base(family, quantization, calls):
    from py_engine.quant.linear import QuantLinear

    folder, hf = family
    model, manager = _adapted(folder, quantization=quantization)
    dequantized = copy.deepcopy(hf)  # transformers' model with the weights the quantizer kept
    state = {f"{name}.weight": m.qweight.dequantize().float() for name, m in model.named_modules()
             if isinstance(m, QuantLinear)}  # an untied embedding's own codes too (model.embed_tokens.table)
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    hf_names = dict(dequantized.named_parameters())
    for name, w in state.items():  # our fused parts are qkv_proj[.base].parts.N: transformers' q/k/v_proj
        name = name.replace("embed_tokens.table.", "embed_tokens.")
        parent, _, leaf = name.replace(".base.", ".").replace(".parts.", ".").removesuffix(".weight").rpartition(".")
        if leaf.isdigit():
            stem, _, fused_name = parent.rpartition(".")
            name = f"{stem}.{fused[fused_name][int(leaf)]}.weight"
        else:
            name = f"{parent}.{leaf}.weight".lstrip(".")
        assert name in hf_names, name
        hf_names[name].data.copy_(w)
    ids = prompt(16)  # Phi-3 LongRoPE switches factors past 16 tokens, and a cached decode cannot follow
    with torch.no_grad():
        manager.set_adapter_mix(None)
        base_fast, _ = _both(model, ids)
        base_tol = (base_fast - dequantized(ids).logits).abs().max().item()  # the quantized path's own error
        manager.set_adapter_mix("a")
        fast, slow = _both(model, ids)
        expected = _peft(dequantized, folder / "a")(ids).logits
    assert calls["n"] > 0 or model.config.model_type == "phi3"  # a quantized [2 I, H] gate_up takes the module path
    assert (fast - slow).abs().max().item() < 1e-5
    diff = (fast - expected).abs().max().item()
    assert diff < max(2 * base_tol, 1e-4), f"{quantization}: {diff:.3g} against peft (base alone {base_tol:.3g})"


def test_gguf_q4_base_with_adapter_equals_peft_on_its_float_import(tmp_path, calls):
    """A Q4_0 GGUF runs as integer codes; peft runs on `ruvllm import-gguf`'s dequantized folder."""
    pytest.importorskip("gguf", reason="gguf is in the [test] extra")
    import transformers

    from py_engine.hub import resolve_model
    from py_engine.importers.gguf.convert import import_gguf
    from tests.importers.gguf_builder import hf_model, sentencepiece_vocab, write_gguf

    vocab = sentencepiece_vocab()
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", len(vocab.tokens)), vocab, "Q4_0")
    import_gguf(path, tmp_path / "float")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32).eval()
    peft_model = save_peft_adapter(hf, tmp_path / "adapter", seed=3, r=8, lora_alpha=16,
                                   target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    model, _ = load_model(resolve_model(str(path), str(tmp_path / "cache")))
    optimize_for_cpu(model)
    assert any(hasattr(m, "qweight") for m in model.modules()), "the GGUF's Q4_0 codes run as they are"
    manager = LoraManager(model)
    manager.add("x", tmp_path / "adapter")
    ids = prompt(16)
    with torch.no_grad():
        base_fast, _ = _both(model, ids)
        base_tol = (base_fast - hf(ids).logits).abs().max().item()
        manager.set_adapter_mix("x")
        fast, slow = _both(model, ids)
        diff = (fast - peft_model(ids).logits).abs().max().item()
    assert calls["n"] > 0
    assert (fast - slow).abs().max().item() < 1e-5
    assert (fast - base_fast).abs().max().item() > 0.1, "the adapter changes the logits"
    assert diff < max(2 * base_tol, 1e-4), f"{diff:.3g} against peft (base alone {base_tol:.3g})"


def test_stack_setups_keep_no_finished_cache(family, calls):
    """The one-call step keeps a setup per (cache, adapter) it met, but not the caches themselves: LLM.generate
    makes a new cache per call, and a finished one must be freed (the plan holds the current one only)."""
    import gc
    import weakref

    folder, _ = family
    model, manager = _adapted(folder)
    ids, refs = prompt(9), []
    for name in ("a", "b", None, "a", "b"):
        manager.set_adapter_mix(name)
        kv = DenseKVCache.allocate(model.config, 1, ids.shape[1])
        with torch.no_grad():
            model(ids[:, :PREFILL], positions(0, PREFILL), kv)
            for t in range(PREFILL, ids.shape[1]):
                model(ids[:, t:t + 1], positions(t, t + 1), kv)
        refs.append(weakref.ref(kv))
        del kv
    gc.collect()
    assert calls["n"] > 0
    assert sum(r() is not None for r in refs) <= 1, "finished caches are kept alive"
