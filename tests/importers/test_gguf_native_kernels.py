"""GGUF's Q4_0 / Q4_1 / Q8_0 codes in every kernel path: quant.c's decode (int8 and exact x), its prefill
(sgemm over dequantized rows), the one-call decode step (cpu_stack), torch's CUDA kernels, and the
packed layout's round trip. The reference is gguf's own dequantization (`gguf.quants.dequantize`) of the
same bytes, then a float matmul."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

from tests.importers.gguf_builder import byte_level_vocab, hf_model, write_gguf  # noqa: E402
from tests.cpu.test_cpu_stack import _both, decode_logits  # noqa: E402
from tests.cpu.test_kernel_variants import per_group_layout  # noqa: E402
from tests.tiny_models import train_tokenizer  # noqa: E402

from py_engine.hub import resolve_model  # noqa: E402
from py_engine.importers.gguf import quantized  # noqa: E402
from py_engine.importers.gguf.quantized import gguf_packed, gguf_weight, packed_from_file  # noqa: E402
from py_engine.importers.gguf.reader import GGUFTensor  # noqa: E402
from py_engine.kernels import cpu_kernels  # noqa: E402
from py_engine.models import load_model  # noqa: E402
from py_engine.cpu.transforms import optimize_for_cpu  # noqa: E402
from py_engine.quant.kernels import PackedWeight, fake_quantize_blocks  # noqa: E402
from py_engine.quant.mapped import MappedPages  # noqa: E402
from py_engine.quant.linear import QuantLinear, set_int8_activations  # noqa: E402
from tests.requires import GPU, kernels_missing  # noqa: E402

TYPES = ["Q4_0", "Q4_1", "Q8_0"]
kernels_only = pytest.mark.skipif(cpu_kernels() is None, reason=str(kernels_missing()))


def tensor(qtype: str, n: int = 96, k: int = 160, seed: int = 0) -> tuple[GGUFTensor, torch.Tensor]:
    """A GGUF tensor of random weights (one block all equal: Q4_1's d = 0 case) and gguf's dequantization."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1 + 0.03
    w[3, :32] = 0.25
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    return GGUFTensor("w", qtype, (n, k), raw, raw.nbytes), torch.from_numpy(np.asarray(ref, np.float32))


@pytest.mark.parametrize("qtype", TYPES)
def test_codes_dequantize_to_ggml_reference_exactly(qtype):
    t, ref = tensor(qtype)
    q = gguf_weight(t)
    assert torch.equal(q.dequantize(), ref)
    packed = PackedWeight.pack(q)
    assert torch.equal(QuantLinear(q).dequantize(), ref)
    back = packed.unpack()
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scales, q.scales)
    assert torch.equal(back.zero_points, q.zero_points) and back.zero_points.is_contiguous()  # the one byte, as [N, ng]
    assert (back.offsets is None) == (q.offsets is None)
    if q.offsets is not None:
        assert torch.equal(back.offsets, q.offsets)


@pytest.mark.parametrize("qtype", TYPES)
def test_blocks_pack_straight_to_the_kernels_layout(qtype):
    """gguf_packed (the loader's path: the file's bytes, no unpacking) equals packing gguf_weight's codes."""
    t, ref = tensor(qtype)
    rows = np.arange(t.shape[0])[::-1].copy()  # a row order, as q/k un-permuting gives
    for order in (None, rows):
        direct, packed = gguf_packed(t, order), PackedWeight.pack(gguf_weight(t, order))
        for name in ("codes", "scales", "zero_points", "mins", "offsets"):
            a, b = getattr(direct, name), getattr(packed, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
        assert (direct.bits, direct.block_size, direct.in_features, direct.symmetric, direct.spg) == (
            packed.bits, packed.block_size, packed.in_features, packed.symmetric, packed.spg)
    assert torch.equal(QuantLinear(gguf_packed(t)).dequantize(), ref)


@kernels_only
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 20, 40])  # decode, batches (integer tiles) and prefill (sgemm)
def test_cpu_kernels_match_the_reference(qtype, rows):
    t, ref = tensor(qtype)
    layer = QuantLinear(gguf_weight(t))
    x = torch.randn(rows, t.shape[1])
    with torch.no_grad():
        layer.int8_activations = False  # exact: fp32 x against the codes
        exact = layer(x)
        assert (exact - x @ ref.T).abs().max().item() < 1e-5
        layer.int8_activations = True  # x rounded to int8 per 32 values in decode, as llama.cpp's q8 x
        int8 = rows < cpu_kernels().int8_rows_for(layer.bits)  # prefill: fp32 x, or int8 in 4-bit panels
        rounded = fake_quantize_blocks(x, 160) if int8 else x
        assert (layer(x) - rounded @ ref.T).abs().max().item() < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU + "no CUDA device")
@pytest.mark.parametrize("qtype", TYPES)
def test_cuda_matches_the_reference(qtype):
    t, ref = tensor(qtype, n=128, k=256)
    layer = QuantLinear(gguf_weight(t)).to("cuda")
    x = torch.randn(5, 256, device="cuda")
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        y = layer(x.to(dtype)).float().cpu()
        expected = x.cpu() @ ref.T
        assert (y - expected).abs().max().item() < tolerance * max(1.0, expected.abs().max().item()), dtype


@kernels_only
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("int8_activations", [True, False])
def test_one_call_step_equals_the_module_path(qtype, int8_activations, tmp_path, calls):  # noqa: F811
    train_tokenizer(tmp_path)
    vocab = byte_level_vocab(tmp_path / "tokenizer.json", "gpt-2")
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", len(vocab.tokens), intermediate_size=160), vocab,
                      qtype)
    model, _ = load_model(resolve_model(str(path), str(tmp_path / "cache")))
    optimize_for_cpu(model)
    set_int8_activations(model, int8_activations)
    ids = torch.tensor([[5, 17, 200, 3, 99, 42, 7, 150, 64, 8, 250, 33, 1, 77, 120, 9]])
    fast, slow = _both(model, ids)
    assert calls["n"] > 0
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("qtype,block_bytes,zero", [("Q4_0", 16 + 4, 8), ("Q8_0", 32 + 4, 128)])
def test_symmetric_blocks_hold_codes_and_scales_only(qtype, block_bytes, zero, monkeypatch):
    """Q4_0 / Q8_0 have one zero point (8, and 128 on codes + 128): a block of 32 holds its codes and an fp32
    scale, no mins (8 s, which Q4_0 held beside them) and no zero-point byte; the file's 18 / 34 bytes came
    to 25 / 37 so. The file's chunked copy (the 151936-row token_embd) keeps the one byte too."""
    t, ref = tensor(qtype, n=40)
    n, k = t.shape
    for packed in (gguf_packed(t), gguf_packed(t, np.arange(n)[::-1].copy())):
        assert packed.mins is None and packed.zero == zero
        assert packed.nbytes == n * (k // 32) * block_bytes + 1
        assert QuantLinear(packed).nbytes == packed.nbytes
    monkeypatch.setattr(quantized, "CHUNK_ROWS", 16)  # 40 rows: three chunks
    chunked = packed_from_file(t, None, MappedPages())
    assert chunked.zero == zero and chunked.mins is None and chunked.nbytes == packed.nbytes
    assert torch.equal(chunked.codes, gguf_packed(t).codes) and torch.equal(chunked.scales, gguf_packed(t).scales)
    assert torch.equal(QuantLinear(chunked).dequantize(), ref)


@kernels_only
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_logits_equal_the_per_group_layouts(qtype, tmp_path):
    """A Q4_0 / Q8_0 model (its head and quantized embedding table too) gives the logits it gave in the layout
    with an [N, ng] zero-point tensor and mins, bit for bit: prefill (40 rows: panels or sgemm), decode steps."""
    train_tokenizer(tmp_path)
    vocab = byte_level_vocab(tmp_path / "tokenizer.json", "gpt-2")
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", len(vocab.tokens), intermediate_size=160), vocab,
                      qtype)
    model, _ = load_model(resolve_model(str(path), str(tmp_path / "cache")))
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) > 8 and all(m.packed.mins is None and m.packed.zero is not None for m in layers)
    ids = torch.arange(48).reshape(1, 48) * 5 % len(vocab.tokens)
    with torch.no_grad():
        new, held = decode_logits(model, ids, 40), sum(m.nbytes for m in layers)
        for m in layers:
            m.packed, m._plan, m._token = per_group_layout(m.packed), None, object()
        old = decode_logits(model, ids, 40)
    assert sum(m.nbytes for m in layers) > held
    assert torch.equal(new, old)
