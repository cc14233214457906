"""quantize_model: the in-situ transform on an unchanged CausalLM.

The oracle is the same float model with each swapped Linear's weight replaced
by its dequantized codes (and an untied float head holding the head's):
- the quantized model's logits equal the oracle's (prefill: sgemm over
  dequantized rows; decode on the exact path), before and after
  optimize_for_cpu, on a tiny random llama, a qwen2 with biases and the
  built-in model;
- greedy tokens through the LLM machinery equal the oracle's;
- the decode path with int8 activations stays close to the oracle;
- the embedding gathers dequantized rows (py_engine.quant.embedding): a tied one the head's, an untied one
  its own int8 codes; no float table is left, and the logits stay within the int8 tolerance of the model
  with its float table; tie_weights() keeps the quantized head;
- the calibrated methods are dispatched with the interface awq/gptq/smoothquant provide.
"""
from __future__ import annotations

import sys
import types

import pytest

from tests.model_cases import FAMILIES, positions, prompt, save_hf_model
from tests.tiny_models import build_tiny_model

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from py_engine import LLM, SamplingParams  # noqa: E402
from py_engine.hub import builtin_path  # noqa: E402
from py_engine.backends.torch import TorchBackend  # noqa: E402
from py_engine.models import DenseKVCache, load_model  # noqa: E402
from py_engine.cpu.transforms import FusedLinear, optimize_for_cpu  # noqa: E402
from py_engine.quant.config import QuantConfig  # noqa: E402
from py_engine.quant.embedding import QuantEmbedding  # noqa: E402
from py_engine.quant.linear import QuantLinear, W8A8Linear, set_int8_activations  # noqa: E402
from py_engine.quant.transform import block_linears, quantize_model  # noqa: E402
from tests.requires import kernels_missing  # noqa: E402


def make_oracle(oracle: nn.Module, quantized: nn.Module) -> nn.Module:
    """oracle (the float model, loaded again) with the quantized model's dequantized weights (the embedding's
    table too: the rows a QuantEmbedding gathers)."""
    layers = dict(quantized.named_modules())
    for name, module in list(oracle.named_modules()):
        q = layers.get(name)
        if isinstance(q, QuantEmbedding):
            module.weight = nn.Parameter(q.rows.dequantize(), requires_grad=False)  # unties a tied table
            continue
        if not isinstance(q, QuantLinear):
            continue
        if name == "lm_head":  # untie: the head gets its own dequantized weight
            head = nn.Linear(q.in_features, q.out_features, bias=False)
            head.weight = nn.Parameter(q.dequantize(), requires_grad=False)
            oracle.lm_head = head
        else:
            module.weight.data = q.dequantize()
    return oracle


def decode(model: nn.Module, exact: bool = True) -> torch.Tensor:
    set_int8_activations(model, not exact)
    with torch.inference_mode():
        kv_dtype = next(model.parameters()).dtype
        ids = prompt(24)
        kv = DenseKVCache.allocate(model.config, 1, 24, dtype=kv_dtype)
        out = [model(ids[:, :18], positions(0, 18), kv)]  # 18 rows: the sgemm path
        out += [model(ids[:, t:t + 1], positions(t, t + 1), kv) for t in range(18, 24)]
        return torch.cat(out, dim=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_tiny_model_equals_dequantized_oracle(tiny, method):
    model, _ = load_model(tiny, dtype="float32")
    report = quantize_model(model, QuantConfig.from_options(method, group_size=32 if method == "int4" else None),
                            progress=False)
    assert report.layers == 2 * 7 + 1 and report.bytes_after < report.bytes_before / 3
    embedding = model.model.embed_tokens  # tied: the head's rows, no float table left
    assert isinstance(model.lm_head, QuantLinear) and isinstance(embedding, QuantEmbedding) and embedding.tied
    assert embedding.rows is model.lm_head and not list(embedding.parameters())
    model.tie_weights()  # a quantized head is not re-tied to the float table
    assert isinstance(model.lm_head, QuantLinear) and not hasattr(model.lm_head, "weight")
    oracle = make_oracle(load_model(tiny, dtype="float32")[0], model)
    expected = decode(oracle)
    torch.testing.assert_close(decode(model), expected, rtol=1e-4, atol=1e-4)
    optimize_for_cpu(model)
    parts = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(parts, FusedLinear) and all(isinstance(p, QuantLinear) for p in parts.parts)
    torch.testing.assert_close(decode(model), expected, rtol=1e-4, atol=1e-4)
    close = decode(model, exact=False)  # int8 activations in decode: near the oracle, not equal
    assert (close - expected).abs().max() < 0.05 * expected.abs().max()


def test_qwen2_with_biases_bf16_and_greedy_tokens_through_llm(tmp_path):
    save_hf_model(FAMILIES["qwen2"], tmp_path)
    model, _ = load_model(tmp_path, dtype="float32")
    quantize_model(model, QuantConfig.from_options("int4", group_size=32), progress=False)
    oracle = make_oracle(load_model(tmp_path, dtype="float32")[0], model)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    optimize_for_cpu(model)
    optimize_for_cpu(oracle)
    torch.testing.assert_close(decode(model), decode(oracle), rtol=1e-4, atol=1e-4)
    ids = prompt(7)[0].tolist()
    assert greedy_ids(model, ids) == greedy_ids(oracle, ids)
    fp32, _ = load_model(tmp_path, dtype="float32")
    bf16, _ = load_model(tmp_path, dtype="bfloat16")
    for m in (fp32, bf16):
        quantize_model(m, QuantConfig.from_options("int8"), progress=False)
        optimize_for_cpu(m)
    got, expected = decode(bf16, exact=False), decode(fp32)
    assert got.dtype == torch.float32 and (got - expected).abs().max() < 0.1 * expected.abs().max()


def greedy_ids(model: nn.Module, ids: list[int], n: int = 16) -> list[int]:
    set_int8_activations(model, False)
    backend = TorchBackend(model, model.config, 64)
    tokens = [backend.argmax(backend.prefill(ids))]
    while len(tokens) < n:
        tokens.append(backend.argmax(backend.decode(tokens[-1])))
    return tokens


def test_builtin_model_llm_greedy_matches_oracle():
    params = SamplingParams(max_tokens=24, temperature=0.0)
    llm = LLM(str(builtin_path()), dtype="float32", optimize=False)
    report = quantize_model(llm.model, QuantConfig.from_options("int4"), progress=False)
    assert report.seconds < 30 and "int4" in report.table()
    oracle = LLM(str(builtin_path()), dtype="float32", optimize=False)
    make_oracle(oracle.model, llm.model)  # by module name: before fuse_projections renames them
    for model in (llm.model, oracle.model):
        optimize_for_cpu(model)
    set_int8_activations(llm.model, False)
    expected = oracle.generate("ROMEO:", params).token_ids
    assert llm.generate("ROMEO:", params).token_ids == expected
    set_int8_activations(llm.model, True)  # the fast decode path still writes text
    assert len(llm.generate("ROMEO:", params).token_ids) == len(expected)


def test_calibrated_methods_are_dispatched(tiny, monkeypatch):
    """awq/gptq return weights by module name; smoothquant smooths in place, then W8A8 everywhere."""
    calls = []

    def module(name: str, **fns) -> None:
        monkeypatch.setitem(sys.modules, f"py_engine.quant.{name}", types.SimpleNamespace(**fns))

    module("calibration", calibration_ids=lambda d, t, q: calls.append("calibration") or torch.zeros(2, 8).long())

    def weights(model, qconfig, calibration, progress):
        from py_engine.quant.rtn import quantize_rtn
        calls.append(qconfig.method)
        return {n: quantize_rtn(m.weight, 4, 32, False) for n, m in block_linears(model).items()}

    module("awq", awq_quantize=weights)
    module("gptq", gptq_quantize=weights)
    module("smoothquant", smooth_model=lambda model, qconfig, calibration, progress: calls.append("smooth"))
    for method in ("awq", "gptq", "smoothquant"):
        model, _ = load_model(tiny, dtype="float32")
        quantize_model(model, QuantConfig.from_options(method), model_dir=tiny, tokenizer=object(), progress=False)
        kind = W8A8Linear if method == "smoothquant" else QuantLinear
        assert all(isinstance(m, kind) for m in (model.model.layers[0].mlp.down_proj, model.model.layers[1].self_attn.q_proj))
    assert calls == ["calibration", "awq", "calibration", "gptq", "calibration", "smooth"]
    with pytest.raises(ValueError, match="model_dir and tokenizer"):
        quantize_model(load_model(tiny, dtype="float32")[0], QuantConfig.from_options("awq"), progress=False)


RTN_CASES = [(8, None, True), (8, None, False), (8, 64, True), (4, 128, False), (4, 32, True), (4, None, False)]


def rtn_weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g)
    w[3, :64], w[4] = 0, 0  # zero blocks: scale 0
    halves = torch.randint(-16, 16, (300, 200), generator=g).float() / 2  # many w / s + z on a .5 tie
    return [w, halves, halves.to(torch.bfloat16)]


def same_bytes(a, b) -> bool:
    return (torch.equal(a.codes, b.codes) and torch.equal(a.zero_points, b.zero_points)
            and torch.equal(a.scales.view(torch.int32), b.scales.view(torch.int32))  # -0.0 too
            and (a.bits, a.block_size, a.in_features, a.symmetric) == (b.bits, b.block_size, b.in_features, b.symmetric))


@pytest.mark.parametrize("args", RTN_CASES)
def test_native_rtn_gives_quantize_rtn_bytes(args):
    from py_engine.quant.kernels import quantize_rtn_native
    from py_engine.quant.rtn import quantize_rtn

    for w in rtn_weights():
        native = quantize_rtn_native(w, *args)
        if native is None:
            pytest.skip(kernels_missing())
        assert same_bytes(native, quantize_rtn(w, *args))


@pytest.mark.parametrize("args", RTN_CASES)
def test_rtn_in_row_blocks_gives_quantize_rtn_bytes(args, monkeypatch):
    from py_engine.quant import transform
    from py_engine.quant.rtn import quantize_rtn

    monkeypatch.setattr(transform, "quantize_rtn_native", lambda *a: None)
    for w in rtn_weights():
        assert same_bytes(transform.rtn(w, *args, chunk=3000), quantize_rtn(w, *args))


def test_server_engine_runs_a_quantized_model():
    """Paged, batched [1, T] rows through QuantLinear under inference_mode: each prompt's greedy
    tokens as the quantized LLM gives them alone (exact decode path, so batch size cannot matter)."""
    from native_server.engine.llm_engine import LLMEngine

    eng = LLMEngine(str(builtin_path()), dtype="float32", device="cpu", quantization="int4")
    llm = LLM(str(builtin_path()), dtype="float32", quantization="int4")
    assert isinstance(eng.model.lm_head, QuantLinear)
    for model in (eng.model, llm.model):
        set_int8_activations(model, False)
    prompts = [llm.encode(text) for text in ("ROMEO:", "JULIET: O", "First Citizen:\nWe are", "KING")]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}", ids, params)
    got: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    for i, ids in enumerate(prompts):
        assert got[f"r{i}"] == llm.generate(ids, params).token_ids


def test_released_mapped_weights_read_back_the_same(tmp_path):
    """MappedPages drops pages of a checkpoint-mapped tensor; reading it maps the file's bytes again."""
    from safetensors.torch import save_file

    from py_engine.models.safetensors_io import SafetensorsFile
    from py_engine.quant.mapped import MappedPages

    w = torch.randn(512, 1024)
    save_file({"w": w}, tmp_path / "w.safetensors")
    mapped = SafetensorsFile(tmp_path / "w.safetensors").get("w")
    assert torch.equal(mapped, w)
    assert MappedPages().release(mapped) > 0
    assert torch.equal(mapped, w)
    assert MappedPages().release(torch.randn(512, 1024)) == 0  # anonymous memory is never touched
