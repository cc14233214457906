"""The CPU speed work keeps the numbers: native kernels, fused projections, the decode path.

- `py_engine.kernels` linear against F.linear: fp32 and bf16, with and
  without bias, rows that fill whole tiles and rows that do not, any thread count;
- the C norm and one-token attention against the torch modules they stand for;
- `optimize_for_cpu` models against transformers (logits within 1e-4 in
  float32 through prefill and one-token decode, the same greedy tokens) for
  every tiny family, sliding windows and softcapping included;
- TorchBackend's decode step leaves torch's thread count as it found it.
Speed itself is measured in benchmarks/decode_speed.py, never here.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.model_cases import FAMILIES, decode_logits, greedy, hf_decode_logits, prompt, save_hf_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch.nn.functional as F  # noqa: E402

from py_engine.backends.torch import TorchBackend  # noqa: E402
from py_engine.kernels import cpu_kernels  # noqa: E402
from py_engine.models import AttentionSpec, DenseKVCache, load_model  # noqa: E402
from py_engine.models.layers import MLP, Attention, RMSNorm  # noqa: E402
from py_engine.models.rope import apply_rotary  # noqa: E402
from py_engine.cpu.transforms import KernelLinear, model_kernels, optimize_for_cpu  # noqa: E402
from tests.paths import REPO  # noqa: E402
from tests.requires import kernels_missing  # noqa: E402

KERNELS = cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason=str(kernels_missing()))


def _bf16_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    # Summation order differs from torch's, so a value may round to the neighbouring bf16.
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch(dtype, rows, bias):
    g = torch.Generator().manual_seed(rows)
    n, k = 1000, 904  # n not a multiple of any chunk size; k a multiple of 8, not of 32
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(1, rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    assert KERNELS.supports(x, w)
    got = KERNELS.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (1, rows, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    else:
        _bf16_close(got, F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_equal_each_row_alone(dtype):
    """Every count of rows takes the one arithmetic per output (no sgemm): 40 rows give each row's bits alone."""
    g = torch.Generator().manual_seed(3)
    w, x, b = (torch.randn(200, 96, generator=g).to(dtype), torch.randn(40, 96, generator=g).to(dtype),
               torch.randn(200, generator=g).to(dtype))
    got = KERNELS.linear(x, w, b)
    assert torch.equal(got, torch.cat([KERNELS.linear(x[i:i + 1], w, b) for i in range(40)]))
    if dtype == torch.float32:
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    else:
        _bf16_close(got, F.linear(x.float(), w.float(), b.float()).to(dtype))


@needs_kernels
def test_linear_same_result_on_any_thread_count():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4096, 64, generator=g), torch.randn(2, 64, generator=g)
    results = []
    for threads in (1, 3, 2):
        KERNELS.set_threads(threads)
        results.append(KERNELS.linear(x, w))
    KERNELS.set_threads(torch.get_num_threads())
    assert all(torch.equal(r, results[0]) for r in results)  # each row is one thread's dot product


@needs_kernels
def test_supports_refuses_what_the_kernel_cannot_run():
    w = torch.randn(16, 64)
    assert not KERNELS.supports(torch.randn(1, 60), torch.randn(16, 60))  # K % 8
    assert not KERNELS.supports(torch.randn(1, 64).double(), w.double())
    assert not KERNELS.supports(torch.randn(1, 64).bfloat16(), w)  # mixed dtypes


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_matches_the_module(dtype, unit_offset):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(72, 1e-6, unit_offset).to(dtype)
    norm.weight.data = torch.randn(72, generator=g).to(dtype)
    x = (torch.randn(3, 72, generator=g) * 4).to(dtype)
    got, expected = KERNELS.rms_norm(x, norm.weight, norm.eps, unit_offset), norm(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    else:
        _bf16_close(got, expected)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap, rot", [(None, None, 16), (5, None, 16), (None, 3.0, 8)])
def test_attend_one_matches_rope_and_the_cache(dtype, window, softcap, rot):
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, pos = 6, 2, 16, 9
    qkv = torch.randn((heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angle = torch.rand(rot // 2, generator=g) * 3
    cos, sin = torch.cat([angle.cos()] * 2).to(dtype), torch.cat([angle.sin()] * 2).to(dtype)
    keys = torch.randn(1, kv_heads, 12, dim, generator=g).to(dtype)
    values = torch.randn(1, kv_heads, 12, dim, generator=g).to(dtype)
    spec = AttentionSpec(scale=0.25, sliding_window=window, softcap=softcap)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim])
    q = apply_rotary(q.view(1, heads, 1, dim), cos.view(1, 1, rot), sin.view(1, 1, rot))  # [1, H, 1, D]
    k = apply_rotary(k.view(1, kv_heads, 1, dim), cos.view(1, 1, rot), sin.view(1, 1, rot))
    cache = DenseKVCache([keys.clone()], [values.clone()])
    expected = cache.attend(0, q, k, v.view(1, kv_heads, 1, dim), torch.tensor([[pos]]), spec)
    start = 0 if window is None else pos + 1 - window
    got = KERNELS.attend_one(qkv, cos, sin, keys, values, heads, pos, start, spec.scale, softcap)
    assert torch.equal(keys, cache.keys[0]) and torch.equal(values, cache.values[0])  # the same cache write
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected.reshape(-1), rtol=1e-5, atol=1e-6)
    else:
        _bf16_close(got, expected.reshape(-1))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_optimized_model_matches_transformers(name, tmp_path):
    cfg = FAMILIES[name]
    hf = save_hf_model(cfg, tmp_path)
    model, _ = load_model(tmp_path, dtype="float32")
    applied = optimize_for_cpu(model)
    assert all(m.fused for m in model.modules() if isinstance(m, (Attention, MLP)))
    assert (KERNELS is not None) == ("cpu_kernels" in applied)
    ids = prompt(40)
    with torch.no_grad():
        diff = (decode_logits(model, ids, 7) - hf_decode_logits(hf, ids, 7)).abs().max().item()
        assert diff < 1e-4, f"{name}: max abs logit diff {diff:.3g}"
        ids = prompt(7)
        expected = hf.generate(ids, do_sample=False, max_new_tokens=24, min_new_tokens=24,
                               pad_token_id=0)[0].tolist()
        assert greedy(model, ids[0].tolist(), 24) == expected


def test_bf16_optimized_model_tracks_fp32(tmp_path):
    save_hf_model(FAMILIES["qwen2"], tmp_path)
    reference, _ = load_model(tmp_path, dtype="float32")
    model, _ = load_model(tmp_path, dtype="bfloat16")
    optimize_for_cpu(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight or not model.config.tie_word_embeddings
    ids = prompt(20)
    with torch.no_grad():
        got, expected = decode_logits(model, ids, 5), decode_logits(reference, ids, 5)
    assert got.dtype == torch.float32
    assert (got - expected).abs().max().item() < 0.1 * expected.abs().max().item()


@needs_kernels
def test_decode_step_restores_torch_threads(tmp_path):
    save_hf_model(FAMILIES["llama3-rope"], tmp_path)
    model, config = load_model(tmp_path, dtype="float32")
    optimize_for_cpu(model)
    assert isinstance(model.lm_head, KernelLinear) and model_kernels(model) is KERNELS
    before = torch.get_num_threads()
    backend = TorchBackend(model, config, max_context=64)
    token = backend.argmax(backend.prefill([1, 2, 3]))
    for _ in range(3):
        token = backend.argmax(backend.decode(token))
    assert torch.get_num_threads() == before


@needs_kernels
def test_argmax_is_torchs():
    """The first index of the max (ties, a tail past the last 8, -inf) and of the first NaN, as torch."""
    g = torch.Generator().manual_seed(5)
    cases = [torch.randn(n, generator=g) for n in (1, 7, 8, 9, 151936)]
    ties = torch.randn(1003, generator=g)
    ties[[17, 400, 1001]] = 9.0
    tail = torch.randn(1003, generator=g)
    tail[1002] = 50.0
    nan = torch.randn(1003, generator=g)
    nan[[300, 900]] = float("nan")
    late_nan = torch.randn(1003, generator=g)
    late_nan[1001] = float("nan")
    cases += [ties, tail, nan, late_nan, torch.full((20,), float("-inf")), torch.full((13,), 2.5)]
    for x in cases:
        assert KERNELS.argmax(x) == int(torch.argmax(x)), x.numel()
    with pytest.raises(ValueError, match="float32"):
        KERNELS.argmax(torch.zeros(4, dtype=torch.bfloat16))


@needs_kernels
def test_kernels_build_in_ruvllms_one_cache_dir(tmp_path):
    """The shared object lands in $RUVLLM_CACHE_DIR/kernels, where the hub keeps models/ (one cache variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RUVLLM_", "XDG_"))}
    code = "from py_engine.kernels import cpu_kernels; assert cpu_kernels() is not None"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**env, "RUVLLM_CACHE_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert [p.parent.name for p in tmp_path.glob("*/ruvllm_cpu-*.so")] == ["kernels"]
