"""GGUF's Q5_0, Q5_1 and K-quants (Q2_K ... Q6_K) kept as the file's blocks (py_engine/quant/ggml.py) and run by
quant.c's kquant.c: weights against gguf's own dequantization bit for bit, every kernel path (decode, integer
tiles, prefill in integer panels (VNNI builds) or sgemm, exact fp32 x, the one-call decode step) against a float matmul of those weights, mixed
per-tensor files (a Q4_K_M mix with a Q6_K head and a Q4_K embedding) against transformers' GGUF loader, and
the load-time checks: a damaged scale, rows that are not whole blocks, the notice for types left to float.
The K-quant test files are made here (tests/importers/kquants.py, after llama.cpp's reference quantizer)."""
from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

from tests.cpu.test_cpu_stack import _both  # noqa: E402
from tests.cpu.test_kernel_variants import kernels  # noqa: E402,F401 (the fixture: every variant this CPU runs)
from tests.importers.gguf_builder import byte_level_vocab, hf_model, quantized_blocks, write_gguf  # noqa: E402
from tests.importers.kquants import quantize as quantize_k  # noqa: E402
from tests.importers.test_gguf_import import IDS, hf_gguf, hf_logits, logits  # noqa: E402
from tests.requires import kernels_missing  # noqa: E402
from tests.tiny_models import train_tokenizer  # noqa: E402

from py_engine.cpu.transforms import optimize_for_cpu  # noqa: E402
from py_engine.hub import resolve_model  # noqa: E402
from py_engine.importers.gguf.quantized import gguf_blocks  # noqa: E402
from py_engine.importers.gguf.reader import GGUFTensor  # noqa: E402
from py_engine.kernels import cpu_kernels  # noqa: E402
from py_engine.models.loader import ModelLoadError, load_model  # noqa: E402
from py_engine.quant.embedding import QuantEmbedding  # noqa: E402
from py_engine.quant.ggml import TYPES, GGMLWeight  # noqa: E402
from py_engine.quant.kernels import QuantPlan, fake_quantize_blocks  # noqa: E402
from py_engine.quant.linear import QuantLinear, set_int8_activations  # noqa: E402

BLOCK_TYPES = list(TYPES)  # Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K
kernels_only = pytest.mark.skipif(cpu_kernels() is None, reason=str(kernels_missing()))


@pytest.fixture(autouse=True)
def _one_thread(torch_one_thread):
    yield


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(folder)
    return byte_level_vocab(folder / "tokenizer.json", "gpt-2")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def weights(n: int = 94, k: int = 512, seed: int = 0) -> np.ndarray:
    """Random rows with what real weights have: an outlier column, a zero block, a row of equal values."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, 7] *= 8.0
    w[2, :256] = 0.0
    w[3, 256:] = 0.02
    return w


def tensor(qtype: str, n: int = 94, k: int = 512, seed: int = 0) -> tuple[GGUFTensor, torch.Tensor]:
    raw = quantized_blocks(weights(n, k, seed), qtype)
    ref = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]), np.float32)
    return GGUFTensor("w", qtype, (n, k), raw, raw.nbytes), torch.from_numpy(ref)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_weights_are_gguf_dequantize_bit_for_bit(qtype):
    t, ref = tensor(qtype)
    w = gguf_blocks(t)
    assert w.nbytes == t.n_bytes  # the file's blocks, nothing unpacked beside them
    assert torch.equal(w.dequantize().view(torch.int32), ref.view(torch.int32))
    rows = np.arange(t.shape[0])[::-1].copy()  # q/k un-permuting gathers whole rows
    assert torch.equal(gguf_blocks(t, rows).dequantize(), ref[torch.from_numpy(rows)])
    q = w.unpack()  # the QuantizedWeight of the same values (exporters read it)
    assert q.bits == TYPES[qtype].bits and q.block_size == TYPES[qtype].sub
    assert torch.equal(q.dequantize(), ref)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_the_test_quantizer_keeps_k_quant_error(qtype):
    """kquants.py's blocks hold the weights as well as a K-quant should (relative RMS error on Gaussian rows,
    measured for llama-quantize's own output: Q2_K 0.30, Q3_K 0.15, Q4_K 0.072, Q5_K 0.036, Q6_K 0.018)."""
    w = np.random.default_rng(3).standard_normal((32, 1024)).astype(np.float32)
    raw = quantize_k(w, qtype)
    back = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]), np.float32)
    rel = float(np.sqrt(((back - w) ** 2).mean() / (w ** 2).mean()))
    bound = {"Q2_K": 0.33, "Q3_K": 0.17, "Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02}[qtype]
    assert 0.3 * bound < rel < bound


@kernels_only
@pytest.mark.parametrize("qtype", BLOCK_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 9, 20, 40, 77])  # decode, tiles (tails too), prefill: panels or sgemm
def test_cpu_kernels_match_a_float_matmul_of_the_weights(qtype, rows):
    t, ref = tensor(qtype)
    layer = QuantLinear(gguf_blocks(t))
    x = torch.randn(rows, t.shape[1]) * torch.linspace(0.2, 3.0, t.shape[1])
    with torch.no_grad():
        layer.int8_activations = False  # fp32 x against the exact weights
        assert (layer(x) - x @ ref.T).abs().max().item() < 1e-5 * max(1.0, (x @ ref.T).abs().max().item())
        layer.int8_activations = True  # x rounded to int8 per 32 values (where sgemm does not take the rows)
        int8 = rows < cpu_kernels().int8_rows_for(4)  # every count on VNNI builds (panels from 32 rows)
        y = layer(x)
        expected = (fake_quantize_blocks(x, t.shape[1]) if int8 else x) @ ref.T
        assert (y - expected).abs().max().item() < 2e-5 * max(1.0, expected.abs().max().item())
        alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
        if rows < cpu_kernels().int8_rows:  # tiles: a row of a batch gets what it gets alone, bit for bit
            assert torch.equal(alone, y)
        elif int8:  # panels: the same products, summed in another float order
            assert (alone - y).abs().max().item() < 1e-5 * max(1.0, expected.abs().max().item())
        xb = x.to(torch.bfloat16)
        assert (layer(xb).float() - layer(xb.float())).abs().max().item() < 0.02 * expected.abs().max().item()


@kernels_only
@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_every_kernel_variant(kernels, qtype):  # noqa: F811
    """AVX2 (maddubs, the fifth bits spread with shuffles), AVX-512 (masked moves) and VNNI builds alike, each
    giving a row of a batch the bits it gets alone."""
    t, ref = tensor(qtype, n=41)
    w, bias = gguf_blocks(t), torch.randn(41)
    for rows in (1, 7, 40, 77):
        x = torch.randn(rows, t.shape[1], generator=torch.Generator().manual_seed(rows))
        exact = QuantPlan(kernels, [w], [bias], QuantPlan.EXACT)(x)
        torch.testing.assert_close(exact, torch.nn.functional.linear(x, ref, bias), rtol=1e-5, atol=1e-4)
        plan = QuantPlan(kernels, [w], [bias], QuantPlan.INT8_BLOCKS)
        got = plan(x)
        xr = fake_quantize_blocks(x, t.shape[1]) if rows < kernels.int8_rows_for(4) else x
        torch.testing.assert_close(got, torch.nn.functional.linear(xr, ref, bias), rtol=1e-5, atol=1e-4)
        # a row of a batch (tiles; 40 and 77 rows: the panels of VNNI builds) is that row alone, bit for bit
        assert torch.equal(torch.cat([plan(x[i:i + 1]) for i in range(rows)]), got)


@kernels_only
def test_one_call_over_mixed_types_equals_each_alone():
    """q/k/v of a Q4_K_M file: Q4_K, Q4_K, Q6_K (and a Q5_0 and a Q8_0 part beside them) in one kernel call."""
    from py_engine.importers.gguf.quantized import packed_from_file
    from py_engine.quant.mapped import MappedPages

    parts = [QuantLinear(packed_from_file(tensor(q, n=n, seed=i)[0], None, MappedPages()))
             for i, (q, n) in enumerate([("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32), ("Q5_0", 48), ("Q8_0", 40)])]
    kernels = cpu_kernels()
    for rows in (1, 5, 40):
        x = torch.randn(rows, 512)
        plan = QuantPlan(kernels, [p.packed for p in parts], [None] * len(parts))
        with torch.no_grad():
            assert torch.equal(plan(x), torch.cat([p(x) for p in parts], dim=-1))


def k_mix(default: str, layers: int):
    """llama.cpp's *_K_M rule (llama_tensor_get_type): the head Q6_K, attn_v and ffn_down Q6_K in the layers
    use_more_bits picks (the first and last eighth, every third between), the rest `default`."""
    def more_bits(i: int) -> bool:
        return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2

    def kind(name: str, data) -> str:
        if name == "output.weight":
            return "Q6_K"
        if (".attn_v." in name or ".ffn_down." in name) and more_bits(int(name.split(".")[1])):
            return "Q6_K"
        return default
    return kind


@kernels_only
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "Q2_K", "Q3_K", "Q5_0", "Q5_1"])
def test_mixed_files_load_as_codes_and_match_transformers(mix, vocab, cache, tmp_path):
    """Every projection, the head and the token embedding stay codes; the exact path's logits are the float
    model's (transformers' GGUF loader, which dequantizes with gguf) within 2e-5 of the largest logit."""
    original = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512, num_hidden_layers=3)
    qtype = k_mix(mix[:4], 3) if mix.endswith("_M") else mix
    path = write_gguf(tmp_path / f"{mix}.gguf", original, vocab, qtype)
    model, config = load_model(resolve_model(str(path), cache))
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 3 * 7 + 2  # + the head and the embedding's own table
    assert all(isinstance(m.packed, GGMLWeight) for m in linears)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    if mix.endswith("_M"):
        assert model.lm_head.packed.type_name == "Q6_K"
        assert model.model.layers[2].self_attn.v_proj.packed.type_name == "Q6_K"
        assert model.model.layers[1].mlp.down_proj.packed.type_name == mix[:4]
    set_int8_activations(model, False)
    reference = hf_logits(hf_gguf(path))
    # fp32 sums in another order than torch's (one chain per output since issue 32, no sgemm): measured 0.6-1.03e-5
    # of this hot model's largest logit (~12); a wrong weight or scale moves logits by 1e-2 and more
    assert (logits(model, config) - reference).abs().max().item() < 2e-5 * reference.abs().max().item()
    # x rounded per 32 values: close, not equal; this hot random model's logits (|max| ~12) moved 0.6-1.3 so
    # for Q8_0 and Q4_0 files of the same weights, 3.5 for Q4_1 (quant.c's own int8-x path): the per-layer test
    # above holds the kernels to the rounded x itself
    set_int8_activations(model, True)
    for n in (1, len(IDS)):
        expected = hf_logits(hf_gguf(path), IDS[:n], decode=0)
        got = logits(model, config, IDS[:n], decode=0)
        assert (got - expected).abs().max().item() < 0.2 * expected.abs().max().item()


@kernels_only
def test_tied_k_quant_head_is_the_embedding_table(vocab, cache, tmp_path):
    original = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    path = write_gguf(tmp_path / "tied.gguf", original, vocab, lambda name, data: "Q6_K" if "token_embd" in name
                      else "Q4_K")
    model, config = load_model(resolve_model(str(path), cache))
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantEmbedding) and embedding.tied and embedding.rows is model.lm_head
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert torch.equal(embedding(ids)[0], model.lm_head.dequantize()[ids[0]])
    set_int8_activations(model, False)
    assert (logits(model, config) - hf_logits(hf_gguf(path))).abs().max().item() < 1e-4


@kernels_only
@pytest.mark.parametrize("int8_activations", [True, False])
def test_one_call_step_equals_the_module_path(int8_activations, vocab, cache, tmp_path, calls):  # noqa: F811
    original = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512)
    path = write_gguf(tmp_path / "m.gguf", original, vocab, k_mix("Q4_K", 2))
    model, _ = load_model(resolve_model(str(path), cache))
    optimize_for_cpu(model)
    set_int8_activations(model, int8_activations)
    fast, slow = _both(model, torch.tensor([IDS]))
    assert calls["n"] > 0
    assert torch.equal(fast, slow)


def test_a_nan_scale_names_the_file_tensor_and_block(vocab, cache, tmp_path):
    original = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512)
    path = write_gguf(tmp_path / "nan.gguf", original, vocab, "Q4_K")
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_up.weight")  # [512, 256]: a block a row
    start = int(t.data_offset) + 3 * 144  # row 3's block: its d
    data = bytearray(path.read_bytes())
    data[start:start + 2] = np.array([np.nan], dtype=np.float16).tobytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: tensor 'blk\.1\.ffn_up\.weight' \(Q4_K\) has a scale of "
                                             r"nan in block 0 of row 3: the file is damaged"):
        load_model(resolve_model(str(bad), cache))


def test_rows_that_are_not_whole_super_blocks_are_refused(vocab, cache, tmp_path):
    """A K-quant row of 128 values (llama-quantize falls back to Q5_0/Q8_0 there): the header's shape is
    checked against the block before any view of the tensor is made."""
    original = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512)
    path = write_gguf(tmp_path / "m.gguf", original, vocab, "Q4_K")
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_gate.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)  # n_dims u32, then dims u64 each
    assert int.from_bytes(data[at + 4:at + 12], "little") == 256
    data[at + 4:at + 12] = (128).to_bytes(8, "little")
    data[at + 12:at + 20] = (1024).to_bytes(8, "little")  # the same bytes, as [1024, 128]
    bad = tmp_path / "shape.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"shape\.gguf: tensor 'blk\.0\.ffn_gate\.weight' of Q4_K has rows of "
                                             r"128 values, not whole blocks of 256"):
        resolve_model(str(bad), cache)


def test_types_left_to_float_are_named_with_their_memory(vocab, cache, tmp_path, caplog):
    original = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512)
    path = write_gguf(tmp_path / "iq.gguf", original, vocab,
                      lambda name, data: "IQ4_NL" if ".ffn_" in name else "Q4_K")
    with caplog.at_level(logging.WARNING, logger="ruvllm.gguf"):
        model, config = load_model(resolve_model(str(path), cache))
    lines = [r.getMessage() for r in caplog.records if r.name == "ruvllm.gguf"]
    mib = 2 * 3 * 256 * 512 * 4 / 2**20  # two layers' gate, up, down in float32
    assert lines == [f"iq.gguf: 6 tensors (6 IQ4_NL; e.g. blk.0.ffn_gate.weight) are not run as codes and are "
                     f"dequantized to float32: {mib:,.1f} MiB"]
    assert not isinstance(model.model.layers[0].mlp.gate_proj, QuantLinear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    set_int8_activations(model, False)
    assert (logits(model, config) - hf_logits(hf_gguf(path))).abs().max().item() < 1e-4


@kernels_only
def test_q4_k_m_mix_routes_give_the_same_bits(vocab, cache, tmp_path):
    """A Q4_K_M-style file with Q5_0 rows (SmolLM2's: rows not whole super-blocks) beside the K-quants: a
    position's logits are the same bits decoded alone, in a prompt of 70 (Q5_0 in panels on VNNI builds) and in
    chunks (tests/cpu/test_batch_invariance.py's routes)."""
    from py_engine.backends.torch import LLM
    from tests.cpu.test_batch_invariance import assert_routes_agree

    original = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    mix = k_mix("Q4_K", 2)
    path = write_gguf(tmp_path / "mix.gguf", original, vocab,
                      lambda name, data: "Q5_0" if ".attn_" in name and "attn_v" not in name else mix(name, data))
    assert_routes_agree(LLM(str(path), cache_dir=cache))


def test_a_loaded_gguf_leaves_no_file_pages_in_the_rss(vocab, cache, tmp_path):
    """Every tensor of a GGUF is copied at load (codes, norms), so after a forward pass none of the file's pages is
    mapped into the process: a norm left as a view of the file put 28 MiB of SmolLM2 Q4_K_M's pages back in the
    RSS (each first touch maps the page cache's large folio around it) beside the copies of the same bytes."""
    import sys

    from py_engine.importers.gguf.reader import open_gguf
    from tests.models.test_memory_release import mapping_rss

    if not sys.platform.startswith("linux"):
        pytest.skip("hardware: /proc/self/smaps is Linux's")
    original = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    path = write_gguf(tmp_path / "m.gguf", original, vocab, k_mix("Q4_K", 2))
    model, config = load_model(resolve_model(str(path), cache))
    whole = np.asarray(next(iter(open_gguf(path).tensors.values())).data)
    while isinstance(whole.base, np.ndarray):
        whole = whole.base
    start, end = whole.ctypes.data, whole.ctypes.data + whole.nbytes
    assert not any(start <= t.data_ptr() < end for t in [*model.parameters(), *model.buffers()])
    logits(model, config)
    assert mapping_rss(start) <= 4 * 4096  # the last partial page, metadata: not the folios around every norm


@kernels_only
def test_the_codes_lie_in_one_arena_of_huge_pages(vocab, cache, tmp_path, monkeypatch):
    """Every QuantLinear array of a GGUF (Q8_0 in quant.c's layout, K-quant blocks) is a view of one mapping
    advised MADV_HUGEPAGE (models/hugepages.HugeArena), in module order, and the logits are the same bits as a
    load with RUVLLM_HUGE_PAGES=0 (each array its own tensor)."""
    import sys

    from tests.models.test_hugepages import vm_flags

    if not sys.platform.startswith("linux"):
        pytest.skip("hardware: /proc/self/smaps is Linux's")
    original = hf_model("llama", len(vocab.tokens), hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    mix = k_mix("Q4_K", 2)
    path = write_gguf(tmp_path / "m.gguf", original, vocab,
                      lambda name, data: "Q8_0" if ".attn_q." in name else mix(name, data))

    def arrays(model):  # the projections' and the head's (an untied embedding's own table is not streamed)
        out, table = [], model.model.embed_tokens.rows
        for m in model.modules():
            if isinstance(m, QuantLinear) and m is not table:
                fields = ("blocks",) if isinstance(m.packed, GGMLWeight) else ("codes", "scales", "mins", "offsets")
                out += [t for f in fields if (t := getattr(m.packed, f)) is not None]
        return out

    model, config = load_model(resolve_model(str(path), cache))
    inside = arrays(model)
    assert len(inside) > 2 * 7 and len({t.untyped_storage().data_ptr() for t in inside}) == 1
    starts = [t.data_ptr() for t in inside]
    assert starts == sorted(starts) and all(s % 64 == 0 for s in starts)
    assert "hg" in vm_flags(starts[0]) and "hg" in vm_flags(starts[-1])
    monkeypatch.setenv("RUVLLM_HUGE_PAGES", "0")
    plain, _ = load_model(resolve_model(str(path), cache))
    assert len({t.untyped_storage().data_ptr() for t in arrays(plain)}) == len(inside)
    assert torch.equal(logits(model, config), logits(plain, config))
