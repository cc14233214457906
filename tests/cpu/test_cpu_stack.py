"""The one-call decode step (models/cpu_stack.py, kernels/step.c) is the per-module path, bit for bit.

The per-module path is itself tested against transformers (test_cpu_fast.py,
test_quant_transform.py); here every logit of a decode with the stack must
equal, exactly, the same decode with `stack_enabled = False` (and, in
float32, transformers' logits within 1e-4): float32 and
bf16, each tiny family the stack takes (biases, sliding windows, partial
rotary, LongRoPE, GQA), int8/int4 quantized layers on either activation
path. Also: families it must not take fall back; a changed module, a moved
model, a switched kernel mode, a new cache and hooks are noticed; a full
cache is refused as the module path refuses it.
"""
from __future__ import annotations

import pytest

from tests.model_cases import FAMILIES, hf_decode_logits, positions, prompt, save_hf_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from py_engine.backends.torch import TorchBackend  # noqa: E402
from py_engine.kernels import cpu_kernels  # noqa: E402
from py_engine.models import DenseKVCache, load_model  # noqa: E402
from py_engine.cpu.stack import KernelDecoderModel  # noqa: E402
from py_engine.cpu.transforms import optimize_for_cpu  # noqa: E402
from tests.requires import kernels_missing  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason=str(kernels_missing()))

TAKEN = ["llama3-rope", "llama-dynamic", "llama-yarn", "mistral", "qwen2", "phi3-longrope"]
NOT_TAKEN = {"qwen3": "qk-norm", "gemma": "GeGLU", "gemma2": "sandwich norms", "mixtral": "experts"}


def _model(folder, dtype="float32", quantization=None):
    model, _ = load_model(folder, dtype=dtype)
    if quantization is not None:
        from py_engine.quant.config import QuantConfig
        from py_engine.quant.transform import quantize_model

        group = 32 if quantization == "int4" else None
        quantize_model(model, QuantConfig.from_options(quantization, group_size=group), progress=False)
    optimize_for_cpu(model)
    assert isinstance(model.model, KernelDecoderModel)
    return model


def decode_logits(model, ids, prefill):
    """Prefill, then one token at a time into a dense cache of the activations' dtype: [1, T, V]."""
    kv = DenseKVCache.allocate(model.config, 1, ids.shape[1], dtype=model.model.norm.weight.dtype)
    out = [model(ids[:, :prefill], positions(0, prefill), kv)]
    for t in range(prefill, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], positions(t, t + 1), kv))
    return torch.cat(out, dim=1)


def _both(model, ids, prefill=5):
    """Decode logits with the one-call step, then with the per-module path, each on a fresh cache."""
    with torch.no_grad():
        model.model.stack_enabled = True
        fast = decode_logits(model, ids, prefill)
        model.model.stack_enabled = False
        slow = decode_logits(model, ids, prefill)
        model.model.stack_enabled = True
    return fast, slow


@pytest.mark.parametrize("name", TAKEN)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_the_module_path(name, dtype, tmp_path, calls):
    hf = save_hf_model(FAMILIES[name], tmp_path)
    model = _model(tmp_path, dtype)
    ids = prompt(30)
    fast, slow = _both(model, ids)
    assert calls["n"] == ids.shape[1] - 5  # every decode step: the prefill (5 rows) laid the plan out
    assert torch.equal(fast, slow)
    if dtype == "float32":  # and both are transformers' logits (test_cpu_fast's tolerance)
        with torch.no_grad():
            diff = (fast - hf_decode_logits(hf, ids, 5)).abs().max().item()
        assert diff < 1e-4, f"{name}: max abs logit diff {diff:.3g} against transformers"


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("int8_activations", [True, False])
def test_stack_equals_the_module_path_quantized(quantization, dtype, int8_activations, tmp_path, calls):
    from py_engine.quant.linear import set_int8_activations

    save_hf_model(FAMILIES["qwen2"], tmp_path)  # biases on q/k/v, a sliding-window layer
    model = _model(tmp_path, dtype, quantization)
    set_int8_activations(model, int8_activations)
    ids = prompt(24)
    fast, slow = _both(model, ids)
    assert calls["n"] > 0
    assert torch.equal(fast, slow)


def chunk_logits(model, ids, sizes):
    """Logits of ids fed in chunks of `sizes` rows (a prefill, then decode steps and speculative steps) into a
    dense cache: [1, T, V]."""
    kv = DenseKVCache.allocate(model.config, 1, ids.shape[1], dtype=model.model.norm.weight.dtype)
    out, t = [], 0
    for n in sizes:
        out.append(model(ids[:, t:t + n], positions(t, t + n), kv))
        t += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("int8_activations", [True, False])
def test_rows_step_equals_the_module_path_and_decode(quantization, dtype, int8_activations, tmp_path, monkeypatch):
    """A speculative step's k + 1 rows in one rk_rows_step call (stack_rows.py): the module path's bits for every
    row, and decode's (each row as if it came alone)."""
    from py_engine.cpu.stack_rows import RowsStep
    from py_engine.quant.linear import set_int8_activations

    rows_calls = []
    run = RowsStep.__call__
    monkeypatch.setattr(RowsStep, "__call__", lambda self, x, *a: rows_calls.append(x.shape[1]) or run(self, x, *a))
    save_hf_model(FAMILIES["qwen2"], tmp_path)  # biases on q/k/v, a sliding-window layer
    model = _model(tmp_path, dtype, quantization)
    set_int8_activations(model, int8_activations)
    sizes = [5, 1, 3, 2, 5, 1, 9, 17, 32]
    ids = prompt(sum(sizes))
    with torch.no_grad():
        fast = chunk_logits(model, ids, sizes)
        model.model.stack_enabled = False
        slow = chunk_logits(model, ids, sizes)
        one = chunk_logits(model, ids, [5] + [1] * (sum(sizes) - 5))
        model.model.stack_enabled = True
    assert rows_calls == [3, 2, 5, 9, 17, 32]  # after the prefill laid the plan out, every chunk of 2-32 rows
    assert torch.equal(fast, slow)
    assert torch.equal(fast[0, 5:], one[0, 5:])


def test_rows_step_keeps_float_models_on_the_module_path(tmp_path, monkeypatch):
    from py_engine.cpu.stack_rows import RowsStep

    monkeypatch.setattr(RowsStep, "__call__", lambda *a: pytest.fail("a float model took the rows step"))
    save_hf_model(FAMILIES["qwen2"], tmp_path)
    model = _model(tmp_path)
    with torch.no_grad():
        fast = chunk_logits(model, prompt(20), [5, 1, 4, 10])
        model.model.stack_enabled = False
        slow = chunk_logits(model, prompt(20), [5, 1, 4, 10])
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("name", sorted(NOT_TAKEN))
def test_other_blocks_keep_the_module_path(name, tmp_path, calls):
    save_hf_model(FAMILIES[name], tmp_path)
    model = _model(tmp_path)
    fast, slow = _both(model, prompt(12))
    assert calls["n"] == 0, f"{name} has {NOT_TAKEN[name]}: not the plain block"
    assert torch.equal(fast, slow)


def _step(model, kv, token, position):
    with torch.no_grad():
        return model(torch.tensor([[token]]), torch.tensor([[position]]), kv)


def test_changed_weights_moved_model_and_kernel_mode_are_noticed(tmp_path, calls):
    from py_engine.quant.linear import set_int8_activations

    save_hf_model(FAMILIES["llama3-rope"], tmp_path)
    model = _model(tmp_path)
    ids = prompt(16)
    with torch.no_grad():
        decode_logits(model, ids, 5)  # lays the plan out
        assert model.model._stack is not None
        layer = model.model.layers[1]
        down = layer.mlp.down_proj
        down.weight = torch.nn.Parameter(down.weight * 0.5)  # a new tensor: the old pointer must not be used
        fast, slow = _both(model, ids)
        assert torch.equal(fast, slow)
        reference = _model(tmp_path)
        reference.model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(
            reference.model.layers[1].mlp.down_proj.weight * 0.5)
        reference.model.stack_enabled = False
        assert torch.equal(fast, decode_logits(reference, ids, 5))
        model.to(torch.bfloat16)  # .to(): laid out again for the new dtype
        fast, slow = _both(model, ids)
        assert torch.equal(fast, slow) and fast.dtype == torch.float32

        replaced = _model(tmp_path)  # a whole layer replaced in the ModuleList
        decode_logits(replaced, ids, 5)
        replaced.model.layers[1] = reference.model.layers[1]  # its down_proj is halved
        fast, slow = _both(replaced, ids)
        assert torch.equal(fast, slow)

    quantized = _model(tmp_path, quantization="int8")
    fast_int8, _ = _both(quantized, ids)
    set_int8_activations(quantized, False)  # a new plan on every layer: the stack must follow
    fast_exact, slow_exact = _both(quantized, ids)
    assert torch.equal(fast_exact, slow_exact) and not torch.equal(fast_exact, fast_int8)


def test_a_new_cache_and_the_backend(tmp_path, calls):
    save_hf_model(FAMILIES["qwen2"], tmp_path)
    model = _model(tmp_path, quantization="int4")
    config = model.config
    backend = TorchBackend(model, config, max_context=64)

    def generate():
        token, out = backend.argmax(backend.prefill([3, 1, 4, 1, 5])), []
        for _ in range(12):
            token = backend.argmax(backend.decode(token))
            out.append(token)
        return out
    first, second = generate(), generate()  # the second generation's cache is rebound, not laid out again
    model.model.stack_enabled = False
    assert first == second == generate()
    assert calls["n"] >= 2 * 11


def test_a_full_cache_is_refused_like_the_module_path(tmp_path, calls):
    save_hf_model(FAMILIES["llama3-rope"], tmp_path)
    model = _model(tmp_path)
    kv = DenseKVCache.allocate(model.config, 1, 4)
    with torch.no_grad():
        model(prompt(2), torch.arange(2)[None], kv)
        _step(model, kv, 7, 2)
        _step(model, kv, 7, 3)
        assert calls["n"] == 2  # the prefill laid the plan out
        with pytest.raises(ValueError, match="position 4 does not fit a cache of max_len 4"):
            _step(model, kv, 7, 4)
        model.model.stack_enabled = False
        with pytest.raises(ValueError, match="position 4 does not fit a cache of max_len 4"):
            _step(model, kv, 7, 4)


def test_hooks_keep_the_module_path(tmp_path, calls):
    save_hf_model(FAMILIES["mistral"], tmp_path)
    model = _model(tmp_path)
    seen = []
    model.model.layers[0].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    ids = prompt(10)
    with torch.no_grad():
        decode_logits(model, ids, 4)
    assert calls["n"] == 0 and len(seen) == 1 + 6


def test_threads_and_copies(tmp_path, calls):
    """Two threads decoding one model into two caches take turns on the plan's buffers and each get the
    module path's logits; a deep copy of a model with a plan laid out decodes the same."""
    import copy
    import sys
    import threading

    save_hf_model(FAMILIES["qwen2"], tmp_path)
    model = _model(tmp_path)
    ids = [prompt(24, seed=s) for s in (1, 2)]
    with torch.no_grad():
        model.model.stack_enabled = False
        expected = [decode_logits(model, i, 5) for i in ids]
        model.model.stack_enabled = True
        results: list = [None, None]

        def run(k):
            with torch.no_grad():
                for _ in range(10):
                    results[k] = decode_logits(model, ids[k], 5)
        threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads between any two bytecodes: bind and call interleave
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sys.setswitchinterval(interval)
        assert calls["n"] > 0
        assert all(torch.equal(r, e) for r, e in zip(results, expected))
        twin = copy.deepcopy(model)
        assert torch.equal(decode_logits(twin, ids[0], 5), expected[0])
        quantized = _model(tmp_path, quantization="int4")
        before = decode_logits(quantized, ids[0], 5)
        assert torch.equal(decode_logits(copy.deepcopy(quantized), ids[0], 5), before)
