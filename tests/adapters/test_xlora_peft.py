"""X-LoRA against peft's XLoraModel on tiny random models (tests/model_cases.py families).

Each case saves a peft XLoraModel (three LoRA experts, a classifier) with peft's own
save_pretrained and loads that folder into ruvllm: logits and scalings within 1e-5 of
peft's for depth 1, 2 and 3 (with peft's dropout layers), layerwise on and off, top-k with and without re-normalisation,
softmax off, temperature != 1, a non-zero scaling-pass value and a global weight. The
decode test runs 32 greedy steps with ruvllm's two KV caches and compares every step with
peft's generate-style full recompute (no cache), then the greedy tokens.
"""
from __future__ import annotations

import pytest

from tests.model_cases import FAMILIES, positions, prompt, save_hf_model
from tests.requires import kernels_missing

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft", reason="peft is in the [test] extra: pip install -e '.[test]'")
from tests.adapters.xlora_cases import peft_step, save_experts, xlora_model  # noqa: E402
from py_engine.adapters.xlora import load_xlora, select_scalings  # noqa: E402
from py_engine.cpu.transforms import optimize_for_cpu  # noqa: E402
from py_engine.kernels import cpu_kernels  # noqa: E402
from py_engine.models import DenseKVCache, load_model, longrope_switch_length  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
TOL = 1e-5
STEPS = 32

CONFIGS = {
    "depth1": dict(),
    "depth2-layerwise": dict(xlora_depth=2, xlora_size=16, layerwise_scalings=True),
    "depth2-topk-temperature": dict(xlora_depth=2, xlora_size=8, top_k_lora=2, softmax_temperature=0.5),
    "layerwise-softmax-topk": dict(layerwise_scalings=True, top_k_lora=2, enable_softmax=False,
                                   enable_softmax_topk=True),
    "topk1-softmax-off": dict(top_k_lora=1, enable_softmax=False),
    "scaling-pass-global-weight": dict(scaling_pass_value=0.5, global_scaling_weight=0.7, softmax_temperature=2.0),
    # peft's default dropout numbers the classifier's Linears 0, 3, 6 (ReLU and Dropout between them)
    "depth3-dropout-softmax-topk-only": dict(xlora_depth=3, xlora_size=8, xlora_dropout_p=0.2,
                                             enable_softmax=False, enable_softmax_topk=True),
}
# A spread of families, each with every config: llama (biases, llama3 rope), qwen3 (q/k norms, tied
# head), phi3 (fused qkv / gate_up, LongRoPE), gemma2 (sandwich norms, soft-capping, sliding window).
PARITY_FAMILIES = ("llama3-rope", "qwen3", "phi3-longrope", "gemma2")
STACK_FAMILIES = ("llama3-rope", "phi3-longrope")  # the ones the CPU's one-call decode step takes


@pytest.fixture(scope="module", params=PARITY_FAMILIES)
def family(request, tmp_path_factory):
    cfg = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(cfg, folder / "base")
    return request.param, folder, save_experts(hf, folder, cfg["model_type"])


def load(folder, xlora_dir, optimize: bool = False, dtype: str = "float32", quantization=None, **kwargs):
    model, _ = load_model(folder / "base", dtype=dtype)
    if quantization is not None:
        from py_engine.quant.config import QuantConfig
        from py_engine.quant.transform import quantize_model

        quantize_model(model, QuantConfig.from_options(quantization), progress=False)
    if optimize:
        optimize_for_cpu(model)
    return load_xlora(model, xlora_dir, **kwargs)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_scalings_match_peft(family, name, tmp_path):
    fam, folder, experts = family
    peft_model = xlora_model(folder / "base", experts, **CONFIGS[name])
    peft_model.save_pretrained(str(tmp_path / "xlora"))
    ids = prompt(33)
    want, want_scalings = peft_step(peft_model, ids)
    model = load(folder, tmp_path / "xlora")
    assert want_scalings.shape == (1, 33, model.n_layers, 3)
    with torch.no_grad():
        got = model(ids, positions(0, 33))
        got_scalings = model.last_scalings
        assert (got - want).abs().max().item() < TOL, f"{fam}/{name}: logits"
        assert (got_scalings - want_scalings).abs().max().item() < TOL, f"{fam}/{name}: scalings"
        with model.manager.using(None):  # the experts really move the logits
            assert (model.lm(ids, positions(0, 33)) - want).abs().max() > 0.05


@pytest.mark.parametrize("name", ["depth2-layerwise", "depth2-topk-temperature"])
def test_cached_decode_matches_peft_recompute(family, name, tmp_path, calls):
    """Every step of a cached decode against peft's no-cache recompute of the whole sequence; greedy. On
    the families the one-call decode step takes, both passes of every decode step run there (step.c with
    each column weighted by the token's scalings)."""
    fam, folder, experts = family
    peft_model = xlora_model(folder / "base", experts, seed=1, **CONFIGS[name])
    peft_model.save_pretrained(str(tmp_path / "xlora"))
    model = load(folder, tmp_path / "xlora", optimize=True)
    ids = prompt(7)[0].tolist()
    kv = DenseKVCache.allocate(model.config, 1, 64, layers=model.kv_layers)
    switch = longrope_switch_length(model.config) or -1
    worst = 0.0
    with torch.no_grad():
        logits = model(torch.tensor([ids]), positions(0, len(ids)), kv, last_only=True)
        for step in range(STEPS):
            want, want_scalings = peft_step(peft_model, torch.tensor([ids]))
            worst = max(worst, (logits[0, -1] - want[0, -1]).abs().max().item())
            assert (model.last_scalings[0, -1] - want_scalings[0, -1]).abs().max().item() < TOL, f"step {step}"
            token = int(want[0, -1].argmax())
            assert int(logits[0, -1].argmax()) == token, f"{fam}/{name}: greedy token differs at step {step}"
            ids.append(token)
            n = len(ids)
            if n == switch + 1:  # Phi-3 LongRoPE's long factors: recompute the cache, as TorchBackend does
                logits = model(torch.tensor([ids]), positions(0, n), kv, last_only=True)
            else:
                logits = model(torch.tensor([ids[-1:]]), positions(n - 1, n), kv, last_only=True)
    assert worst < TOL, f"{fam}/{name}: cached decode differs from peft's recompute by {worst:.3g}"
    if fam in STACK_FAMILIES and cpu_kernels() is not None:
        assert calls["n"] >= 2 * (STEPS - 2), "both passes of each decode step are one C call"


def test_non_granular_freezes_scalings_after_k_calls(family, tmp_path):
    """Calls 1..k compute scalings (equal to peft's); later ones reuse call k's last-token scalings."""
    fam, folder, experts = family
    peft_model = xlora_model(folder / "base", experts, **CONFIGS["depth2-layerwise"])
    peft_model.save_pretrained(str(tmp_path / "xlora"))
    model = load(folder, tmp_path / "xlora", non_granular=3)
    ids = prompt(9)[0].tolist()
    kv = DenseKVCache.allocate(model.config, 1, 32, layers=model.kv_layers)
    scratch = DenseKVCache.allocate(model.config, 1, 32)  # the real pass's cache, copied before each frozen call
    with torch.no_grad():
        model(torch.tensor([ids[:5]]), positions(0, 5), kv)
        for t in range(5, 9):
            for i in range(model.config.num_hidden_layers):
                scratch.keys[i].copy_(kv.keys[i])
                scratch.values[i].copy_(kv.values[i])
            logits = model(torch.tensor([ids[t:t + 1]]), positions(t, t + 1), kv)
            _, want = peft_step(peft_model, torch.tensor([ids[:t + 1]]))
            if t < 7:  # calls 2 and 3 are granular
                assert (model.last_scalings[0, -1] - want[0, -1]).abs().max().item() < TOL
                frozen = model.last_scalings[0, -1].clone()
            else:
                assert torch.equal(model.last_scalings[0, -1], frozen)
                assert (model.last_scalings[0, -1] - want[0, -1]).abs().max() > 1e-4
                # the folded adapter (one A/B per projection) gives the frozen weights' logits
                with model.manager.using(weights=model._mix_weights(select_scalings(
                        model.last_scalings, model.xlora_config))):
                    direct = model.lm(torch.tensor([ids[t:t + 1]]), positions(t, t + 1), scratch)
                assert (logits - direct).abs().max().item() < TOL


# The families the one-call step takes (qwen3's q/k norms and gemma2's sandwich norms keep the module path),
# and not a quantized Phi-3, whose [2 I, H] gate_up does not take the one-call step at all.
NON_GRANULAR_CASES = [(fam, layerwise, dtype) for fam in STACK_FAMILIES
                      for layerwise, dtype in [(False, "float32"), (True, "float32"), (True, "bfloat16"), (True, "int8")]
                      if not (fam == "phi3-longrope" and dtype == "int8")]


@pytest.mark.skipif(cpu_kernels() is None, reason=str(kernels_missing()))
@pytest.mark.parametrize("family, layerwise, dtype", NON_GRANULAR_CASES, indirect=["family"])
def test_non_granular_decode_in_the_c_step_equals_module_path(family, layerwise, dtype, tmp_path, calls):
    """Non-granular on the CPU-optimized model: the granular calls run both passes in step.c, and once frozen
    the folded mix runs merged into copies of the float weights, one C call a token; every logit within 1e-5
    of the module path (the folded adapter unmerged), which the test above ties to the weights path. In
    bfloat16 the merged weights are rounded once to bf16, as peft's merge_and_unload rounds them. An int8
    base is not merged: step.c adds the folded mix's columns (its experts' ranks summed) after the int8 products
    (llama: a quantized Phi-3 [2 I, H] gate_up does not take the one-call step at all)."""
    fam, folder, experts = family
    name = "depth2-layerwise" if layerwise else "depth2-topk-temperature"
    xlora_model(folder / "base", experts, **CONFIGS[name]).save_pretrained(str(tmp_path / "xlora"))
    quantization = dtype if dtype == "int8" else None
    dtype = "float32" if quantization else dtype
    model = load(folder, tmp_path / "xlora", optimize=True, dtype=dtype, quantization=quantization, non_granular=3)
    ids = prompt(14)[0].tolist()
    runs = []
    for stack in (True, False):
        model.lm.model.stack_enabled = stack
        kv = DenseKVCache.allocate(model.config, 1, 32, dtype=getattr(torch, dtype), layers=model.kv_layers)
        calls["n"] = 0
        with torch.no_grad():
            out = [model(torch.tensor([ids[:5]]), positions(0, 5), kv)[:, -1]]
            out += [model(torch.tensor([ids[t:t + 1]]), positions(t, t + 1), kv)[:, -1] for t in range(5, len(ids))]
        runs.append((torch.cat(out), calls["n"]))
    (fast, n_fast), (slow, n_slow) = runs
    assert n_slow == 0
    worst = (fast - slow).abs().max().item()
    assert worst < (TOL if dtype == "float32" else 0.1), fam
    stack = model.lm.model._stack
    # every decode step (the 5-row prefill laid the plan out): two granular ones of two C calls, then one each
    assert n_fast == 2 * 2 + (len(ids) - 5 - 2), "granular calls: two C calls; frozen: one"
    adapters = stack.adapters
    if quantization:  # nothing merged: the frozen mix's columns on every adapted projection
        assert not adapters._merged and all(getattr(stack.layers[i], f).lora for i, f, _ in adapters.loras)
    else:
        assert adapters._merged and all(e is not None for e in adapters._merged.values()), "the frozen mix ran merged"
