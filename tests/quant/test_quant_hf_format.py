"""Quantized checkpoints in the Hugging Face GPTQ and AWQ layouts.

Checkpoints are built here with a reference packing written from the layouts' documentation
(AutoGPTQ's v1 words along K with zero - 1, its 3-bit 10/1/10/1/10 word pattern, AutoAWQ's
interleaved nibbles), independently of py_engine.quant.hf_packing; ruvllm loads them and must give
the logits of the float model holding the dequantized weights. Act-order (desc_act) checkpoints,
their g_idx numbering groups along a random permutation of the columns, must dequantize to the
textbook formula and give transformers' logits on every path (CPU kernels, kernels off, fused
projections, the ONNX export), and write back as they were. Then: quantize -> write -> load ->
generate through the CLI, the saved-vs-in-memory logit difference (fp16 scales), and clear errors.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from py_engine.models import ModelLoadError, load_model  # noqa: E402
from py_engine.quant.config import QuantConfig  # noqa: E402
from py_engine.quant.hf_format import QuantFormatError, save_quantized  # noqa: E402
from py_engine.quant.linear import QuantLinear  # noqa: E402
from tests.paths import BUILTIN, REPO  # noqa: E402
from tests.requires import GPU  # noqa: E402

IDS = torch.tensor([[0] + list(range(40, 100))])
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]

pytestmark = pytest.mark.usefixtures("torch_one_thread")


# --- reference packing, from the layouts' description ------------------------------------------
def ref_pack_k(q: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qweight: codes q [K, N] -> uint32 [K * bits / 32, N], earlier k in lower bits."""
    k, n = q.shape
    q = q.astype(np.uint64)
    out = np.zeros((k * bits // 32, n), dtype=np.uint64)
    if bits in (2, 4, 8):
        per = 32 // bits
        for row in range(out.shape[0]):
            for j in range(per):
                out[row] |= q[row * per + j] << np.uint64(bits * j)
        return out.astype(np.uint32)
    assert bits == 3  # 32 codes in 3 words: 10 codes, one split 2+1 bits, 10, one split 1+2, 10
    i = row = 0
    while row < out.shape[0]:
        for j in range(10):
            out[row] |= q[i + j] << np.uint64(3 * j)
        i += 10
        out[row] |= (q[i] << np.uint64(30)) & np.uint64(0xFFFFFFFF)
        row += 1
        out[row] |= (q[i] >> np.uint64(2)) & np.uint64(1)
        i += 1
        for j in range(10):
            out[row] |= q[i + j] << np.uint64(3 * j + 1)
        i += 10
        out[row] |= (q[i] << np.uint64(31)) & np.uint64(0xFFFFFFFF)
        row += 1
        out[row] |= (q[i] >> np.uint64(1)) & np.uint64(3)
        i += 1
        for j in range(10):
            out[row] |= q[i + j] << np.uint64(3 * j + 2)
        i += 10
        row += 1
    return out.astype(np.uint32)


def ref_pack_n(z: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qzeros: [groups, N] -> [groups, N * bits / 32], the same stream along N."""
    return ref_pack_k(z.T, bits).T


def ref_awq_pack(q: np.ndarray) -> np.ndarray:
    """AWQ: [R, N] 4-bit -> uint32 [R, N / 8]; nibble i of a word holds column AWQ_ORDER[i] of its eight."""
    r, n = q.shape
    out = np.zeros((r, n // 8), dtype=np.uint64)
    for col in range(n // 8):
        for i in range(8):
            out[:, col] |= q[:, col * 8 + AWQ_ORDER[i]].astype(np.uint64) << np.uint64(4 * i)
    return out.astype(np.uint32)


def int32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.uint32).view(np.int32).copy())


def ref_quantize(w: torch.Tensor, bits: int, group: int, sym: bool):
    """Min/max group quantization of W [N, K]: codes [K, N], fp16 scales [G, N], zeros [G, N], dequantized W."""
    n, k = w.shape
    g = k if group == -1 else group
    top = (1 << bits) - 1
    padded = torch.zeros(-(-k // g) * g, n)
    padded[:k] = w.T  # a short last group: zeros, which [min(w, 0), max(w, 0)] already holds
    blocks = padded.reshape(-1, g, n)  # [G, g, N]
    if sym:
        scale = blocks.abs().amax(1) / ((top + 1) / 2 - 0.5)
        zero = torch.full_like(scale, (top + 1) // 2)
    else:
        lo, hi = blocks.amin(1).clamp(max=0), blocks.amax(1).clamp(min=0)
        scale = (hi - lo) / top
        zero = torch.round(-lo / scale).clamp(1, top)  # >= 1 keeps GPTQ v1 lossless
    scale = scale.half()
    q = torch.clamp(torch.round(blocks / scale.float()[:, None] + zero[:, None]), 0, top)
    deq = ((q - zero[:, None]) * scale.float()[:, None]).reshape(-1, n)[:k].T
    return q.reshape(-1, n)[:k].to(torch.int64).numpy(), scale, zero.to(torch.int64).numpy(), deq.contiguous()


def build_checkpoint(folder: Path, method: str, bits: int, group: int, sym: bool = False,
                     fmt: str = "gptq") -> dict[str, torch.Tensor]:
    """The built-in model with every block Linear packed by the reference; returns the float state to compare."""
    state = load_file(BUILTIN / "model.safetensors")
    ref_state = dict(state)
    out = {}
    for name, w in state.items():
        if ".layers." not in name or not name.endswith("proj.weight"):
            out[name] = w
            continue
        base = name[: -len(".weight")]
        q, scale, zero, deq = ref_quantize(w, bits, group, sym)
        ref_state[name] = deq
        out[f"{base}.scales"] = scale
        if method == "awq":
            out[f"{base}.qweight"] = int32(ref_awq_pack(q))
            out[f"{base}.qzeros"] = int32(ref_awq_pack(zero))
        else:
            out[f"{base}.qweight"] = int32(ref_pack_k(q, bits))
            out[f"{base}.qzeros"] = int32(ref_pack_n(zero - (1 if fmt == "gptq" else 0), bits))
            out[f"{base}.g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // (w.shape[1] if group == -1 else group)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, folder / "model.safetensors")
    config = json.loads((BUILTIN / "config.json").read_text())
    if method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                         "version": "gemm"}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False,
                                         "sym": sym, "checkpoint_format": fmt}
    (folder / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(BUILTIN / f, folder / f)
    return ref_state


def float_model(state: dict[str, torch.Tensor], folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors")
    shutil.copy(BUILTIN / "config.json", folder / "config.json")
    return load_model(folder)[0]


def logits(model) -> torch.Tensor:
    """Prefill logits on the exact path: 4-bit prefill rounds x to int8 on AVX-512 VNNI builds (qpanel.c), and
    these tests compare the weights a checkpoint loads, not that rounding (test_quant_kernels checks it)."""
    _exact_decode(model)
    with torch.no_grad():
        return model(IDS, torch.arange(IDS.shape[1])[None])


@pytest.mark.parametrize("method, bits, group, sym, fmt", [
    ("gptq", 4, 128, True, "gptq"), ("gptq", 3, 64, False, "gptq"), ("gptq", 8, -1, True, "gptq"),
    ("gptq", 2, 32, False, "gptq_v2"), ("awq", 4, 64, False, None)])
def test_reference_checkpoint_loads_as_its_dequantized_float_model(tmp_path, method, bits, group, sym, fmt):
    ref_state = build_checkpoint(tmp_path / "q", method, bits, group, sym, fmt or "gptq")
    model, _ = load_model(tmp_path / "q")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 6 * 7 and all(m.bits == bits for m in layers)
    got, want = logits(model), logits(float_model(ref_state, tmp_path / "f"))
    diff = (got - want).abs().max().item()
    print(f"\n{method} {bits}-bit g{group}: max |logit diff| vs dequantized float model {diff:.1e}")
    assert diff < 2e-4


# --- act-order (desc_act) checkpoints: g_idx numbers groups along a permutation of the columns -------
ACT_ORDER_GROUP, ACT_ORDER_PREFILL = 32, 9
PERM_SHARED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
               ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))  # projections that read the same x


def act_order_pack(w: torch.Tensor, bits: int, group: int, perm: torch.Tensor):
    """AutoGPTQ's desc_act layout of W [N, K]: columns quantized in the order perm (min/max here; GPTQ's
    updates change only which codes), groups numbered along it, g_idx[perm[j]] = j // group, codes stored in
    W's own column order. Returns the tensors and W by the textbook formula."""
    q_perm, scale, zero, _ = ref_quantize(w[:, perm], bits, group, sym=False)  # row j: column perm[j]
    where = torch.argsort(perm)  # column k of W is row where[k] of q_perm
    q = q_perm[where.numpy()]  # [K, N]
    g_idx = (torch.arange(w.shape[1]) // group)[where]
    assert torch.equal(g_idx[perm], torch.arange(w.shape[1]) // group)
    # w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])
    textbook = (scale.float()[g_idx] * (torch.from_numpy(q) - torch.from_numpy(zero)[g_idx]).float()).T.contiguous()
    tensors = {"qweight": int32(ref_pack_k(q, bits)), "qzeros": int32(ref_pack_n(zero - 1, bits)), "scales": scale,
               "g_idx": g_idx.to(torch.int32)}
    return tensors, textbook


def build_act_order_checkpoint(folder: Path, shared: bool, bits: int = 4):
    """A tiny random Llama (biases included) as an act-order GPTQ checkpoint: random perms, one per input that
    projections share (`shared`: as AutoGPTQ's equal Hessians give q/k/v and gate/up) or one per projection.
    Returns the transformers model holding the textbook weights, and those weights by module name."""
    from tests.model_cases import FAMILIES, save_hf_model

    hf = save_hf_model(FAMILIES["llama3-rope"], folder / "src")
    state = load_file(folder / "src" / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    out, textbook = dict(state), {}
    for layer in range(hf.config.num_hidden_layers):
        for names in PERM_SHARED:
            perm = None
            for leaf in names:
                base = f"model.layers.{layer}.{leaf}"
                w = out.pop(f"{base}.weight")
                if perm is None or not shared:
                    perm = torch.randperm(w.shape[1], generator=generator)
                tensors, textbook[base] = act_order_pack(w, bits, ACT_ORDER_GROUP, perm)
                out.update({f"{base}.{key}": t for key, t in tensors.items()})
    save_file(out, folder / "model.safetensors")
    config = json.loads((folder / "src" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": ACT_ORDER_GROUP,
                                     "desc_act": True, "sym": False, "checkpoint_format": "gptq"}
    (folder / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        for base, w in textbook.items():
            hf.get_submodule(base).weight.copy_(w)
    return hf, textbook


@pytest.fixture(scope="module", params=[True, False], ids=["shared-perms", "own-perms"])
def act_order(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("act_order")
    hf, textbook = build_act_order_checkpoint(folder, shared=request.param)
    return folder, hf, textbook, request.param


def _exact_decode(model) -> None:
    """Decode steps multiply fp32 x by the dequantized codes (not x rounded to int8), so logits match exactly."""
    from py_engine.quant.linear import set_int8_activations
    set_int8_activations(model, False)


def _act_order_logits(model, hf) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.model_cases import decode_logits, hf_decode_logits, prompt

    ids = prompt(24)
    with torch.no_grad():
        return decode_logits(model, ids, ACT_ORDER_PREFILL), hf_decode_logits(hf, ids, ACT_ORDER_PREFILL)


def test_act_order_layers_dequantize_to_the_textbook_formula(act_order):
    folder, _, textbook, shared = act_order
    model, _ = load_model(folder)
    for base, want in textbook.items():
        layer = model.get_submodule(base)
        assert isinstance(layer, QuantLinear) and layer.perm is not None and "act-order" in repr(layer)
        assert torch.equal(layer.dequantize(), want), base
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.perm is attn.k_proj.perm) == shared  # equal perms are one tensor


def test_act_order_checkpoint_matches_transformers(act_order, monkeypatch):
    """The CPU kernels (decode one token at a time: x gathered in the codes' order), then with the kernels off
    (dequantize in W's order, then matmul), against transformers holding the textbook weights."""
    import py_engine.quant.linear as linear

    folder, hf, _, _ = act_order
    model, _ = load_model(folder)
    _exact_decode(model)
    got, want = _act_order_logits(model, hf)
    planned = [m._plan is not None for m in model.modules() if isinstance(m, QuantLinear)]
    assert all(planned) == (linear.cpu_kernels_for(torch.zeros(1)) is not None)  # the kernels ran where present
    diff = (got - want).abs().max().item()
    monkeypatch.setattr(linear, "cpu_kernels_for", lambda x: None)
    model, _ = load_model(folder)
    off, _ = _act_order_logits(model, hf)
    off_diff = (off - want).abs().max().item()
    print(f"\nact-order: max |logit diff| vs transformers {diff:.1e} (kernels), {off_diff:.1e} (no kernels)")
    assert diff < 1e-4 and off_diff < 1e-4


def test_act_order_fused_projections(act_order):
    """optimize_for_cpu fuses q/k/v and gate/up: one kernel call over x gathered once where the parts share a
    perm, the parts one by one where they do not; the same logits either way."""
    from py_engine.cpu.transforms import optimize_for_cpu

    folder, hf, _, shared = act_order
    model, _ = load_model(folder)
    _exact_decode(model)
    applied = optimize_for_cpu(model)
    got, want = _act_order_logits(model, hf)
    diff = (got - want).abs().max().item()
    print(f"\nact-order fused ({'shared' if shared else 'own'} perms, {applied}): max |logit diff| {diff:.1e}")
    assert diff < 1e-4
    if "cpu_kernels" in applied:
        plan = getattr(model.model.layers[0].self_attn.qkv_proj, "_quant_plan", None)
        assert (plan is not None and plan.perm is not None) == shared


@pytest.mark.parametrize("target", ["native", "web"])
def test_act_order_checkpoint_exports_a_gather_before_its_matmuls(act_order, tmp_path, target):
    pytest.importorskip("onnxruntime")
    from tests.export.export_helpers import onnx_decode_logits, session
    from tests.model_cases import prompt

    from export.exporter import export_model
    from export.options import ExportError, ExportOptions

    folder, hf, _, shared = act_order
    model, config = load_model(folder)
    options = ExportOptions(precision="int4", accuracy_level=0, target=target, quantization="gptq checkpoint")
    if not shared:
        with pytest.raises(ExportError, match="model.layers.0.self_attn/qkv_proj: the projections fused here read "
                                              "their input channels in different act-order permutations"):
            export_model(folder, tmp_path, options, model=model)
        return
    result = export_model(folder, tmp_path, options, model=model)
    if target == "native":  # web graphs get short node names (export/compact.py)
        import onnx
        graph = onnx.load(str(result.model_path), load_external_data=False).graph
        gathers = [n for n in graph.node if n.op_type == "Gather" and n.name.endswith("/ActOrderGather")]
        assert len(gathers) == 4 * config.num_hidden_layers  # qkv, o, gate_up, down: one each
    ids = prompt(24)
    got = onnx_decode_logits(session(result.model_path), config, ids, ACT_ORDER_PREFILL)
    with torch.no_grad():
        want = hf(ids).logits.numpy()
    diff = np.abs(got - want).max()
    print(f"\nact-order {target} export: max |logit diff| onnxruntime vs transformers {diff:.1e}")
    assert diff < 1e-4


def test_act_order_layers_write_back_their_own_tensors(act_order, tmp_path):
    """save_quantized of the loaded model: each layer's qweight, qzeros, scales and g_idx as the checkpoint held
    them (W's column order, g_idx permuted), desc_act true; the AWQ layout, which has no g_idx, refuses them."""
    folder, *_ = act_order
    model, config = load_model(folder)
    qconfig = QuantConfig.from_options("gptq", bits=4, group_size=ACT_ORDER_GROUP, symmetric=False, lm_head_bits=None)
    out = save_quantized(model, config, qconfig, tmp_path / "out", folder)
    written, source = load_file(out / "model.safetensors"), load_file(folder / "model.safetensors")
    assert sorted(written) == sorted(source)
    for name, t in source.items():
        assert torch.equal(written[name], t.to(written[name].dtype)), name
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["desc_act"] is True and q["checkpoint_format"] == "gptq"
    with pytest.raises(QuantFormatError, match="model.layers.0.self_attn.q_proj reads its input channels in "
                                               "act-order .* write it in the GPTQ layout"):
        save_quantized(model, config, QuantConfig.from_options("awq", group_size=ACT_ORDER_GROUP), tmp_path / "awq",
                       folder)


def act_order_layer(seed: int, n: int, k: int, bits: int, group: int, bias: bool) -> tuple[QuantLinear, torch.Tensor]:
    """A QuantLinear loaded from a reference-packed act-order layer (random W and perm), and W by the formula."""
    from py_engine.quant.hf_packing import from_gptq

    torch.manual_seed(seed)
    w, perm = torch.randn(n, k), torch.randperm(k)
    tensors, textbook = act_order_pack(w, bits, group, perm)
    q, got_perm = from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], bits=bits,
                            group_size=group, in_features=k, symmetric=False)
    return QuantLinear.from_weight(q, torch.randn(n) if bias else None, got_perm), textbook


def test_act_order_short_last_group_on_one_layer():
    """K = 96 in groups of 64 (the last group 32 wide), 8-bit: the layer against x @ W^T by the formula."""
    from py_engine.quant.linear import reference_forward

    layer, textbook = act_order_layer(3, 64, 96, 8, 64, bias=True)
    layer.int8_activations = False
    assert torch.equal(layer.dequantize(), textbook)
    for rows in (1, 37):  # decode, prefill
        x = torch.randn(rows, 96)
        want = x @ textbook.T + layer.bias
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(reference_forward(layer, x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"{GPU}needs CUDA")
def test_act_order_layer_on_cuda_reads_x_in_the_codes_order():
    """The CUDA kernel (Triton's, or torch's int4 one: groups of 32, K a multiple of 128) on the permuted
    codes vs W by the formula."""
    layer, textbook = act_order_layer(4, 64, 256, 4, 32, bias=False)
    layer = layer.to("cuda")
    assert layer.perm.is_cuda and torch.equal(layer.dequantize().cpu(), textbook)
    x = torch.randn(37, 256)
    want = x @ textbook.T
    got = layer(x.cuda().to(torch.bfloat16)).float().cpu()
    assert layer._device_weight  # the CUDA kernel ran, not the dequantize fallback
    assert (got - want).abs().max() < 1e-2 * want.abs().max()


def _in_memory_rtn(method: str):
    from py_engine.quant.load import load_quantized
    return load_quantized(BUILTIN, method, dtype="float32")


@pytest.mark.parametrize("method", ["int4", "awq-layout", "awq-as-gptq"])
def test_save_then_load_matches_in_memory_model_up_to_fp16_scales(tmp_path, method):
    model, config, _ = _in_memory_rtn("int4")
    qconfig = QuantConfig.from_options("int4")
    if method != "int4":  # an int4 RTN model written as awq would be (awq's own search is tested elsewhere)
        qconfig = QuantConfig.from_options("awq")
    layout = "gptq" if method == "awq-as-gptq" else "auto"
    save_quantized(model, config, qconfig, tmp_path / "out", BUILTIN, layout=layout)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    q = written["quantization_config"]
    assert q["quant_method"] == ("awq" if method == "awq-layout" else "gptq") and q["meta"]["method"] == qconfig.method
    assert written["tie_word_embeddings"] is False  # the int8 head is its own tensor now
    if method == "awq-layout":
        assert q["modules_to_not_convert"] == ["lm_head"] and q["version"] == "gemm"
    else:
        assert q["dynamic"] == {"+:^lm_head$": {"bits": 8, "group_size": -1, "sym": True}} and not q["sym"]
    loaded, _ = load_model(tmp_path / "out")
    a, b = logits(model), logits(loaded)
    diff = (a - b).abs().max().item()
    print(f"\n{method}: saved vs in-memory max |logit diff| {diff:.1e} (logits up to {a.abs().max():.1f})")
    assert diff < 0.05  # fp16 scales: relative 2**-11 per group


def test_quantize_cli_then_generate_round_trip(tmp_path):
    out = tmp_path / "q"
    run = subprocess.run([sys.executable, "-m", "ruvllm_cli", "quantize", "tiny-shakespeare", "--method", "int4",
                          "--group-size", "64", "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "weights after" in run.stdout and "int4 4-bit g64 asym" in run.stdout
    gen = subprocess.run([sys.executable, "-m", "ruvllm_cli", "generate", "--model", str(out), "--json",
                          "--max-tokens", "12", "--temperature", "0", "ROMEO:"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert gen.returncode == 0, gen.stderr
    result = json.loads(gen.stdout)
    assert len(result["token_ids"]) == 12 and result["text"].strip()
    info = subprocess.run([sys.executable, "-m", "ruvllm_cli", "info", str(out), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert json.loads(info.stdout)["quantization"] == "gptq 4-bit g64 asym"


@pytest.mark.parametrize("head", ["4", "none"])
def test_quantize_cli_lm_head_bits(head, tmp_path):
    """`ruvllm quantize --lm-head-bits`: the head is written as asked and loads back with the same codes."""
    from py_engine import LLM
    from ruvllm_cli.main import main

    out = tmp_path / "q"
    assert main(["quantize", "tiny-shakespeare", "--method", "int4", "--lm-head-bits", head, "--out", str(out)]) == 0
    loaded, _ = load_model(out)
    memory = LLM(quantization=QuantConfig.from_options("int4", lm_head_bits=None if head == "none" else 4)).model
    if head == "none":
        assert not isinstance(loaded.lm_head, QuantLinear) and not isinstance(memory.lm_head, QuantLinear)
        return
    got, expected = loaded.lm_head.qweight, memory.lm_head.qweight
    assert (got.bits, got.block_size) == (4, 128) == (expected.bits, expected.block_size)
    k = got.in_features  # past it the padding of the last group is never read
    assert torch.equal(got.codes[:, :k], expected.codes[:, :k]) and torch.equal(got.zero_points, expected.zero_points)
    torch.testing.assert_close(got.scales, expected.scales, rtol=2 ** -10, atol=0)  # stored as fp16


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "q"
    build_checkpoint(folder, "gptq", 4, 64, True)
    return folder


def _edit_config(folder: Path, **quant) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(quant)
    (folder / "config.json").write_text(json.dumps(config))


def test_unknown_quant_method_is_a_clear_error(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, quant_method="bitsandbytes")
    with pytest.raises(ModelLoadError, match="quant_method 'bitsandbytes' is not supported; ruvllm reads gptq and awq"):
        load_model(folder)


def test_truncated_qweight_names_tensor_and_shapes(tmp_path):
    folder = _copy(tmp_path)
    state = load_file(folder / "model.safetensors")
    state["model.layers.2.mlp.up_proj.qweight"] = state["model.layers.2.mlp.up_proj.qweight"][:-1]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model.layers.2.mlp.up_proj.qweight' has shape \[23, 512\] but a "
                                             r"4-bit group 64 gptq layer 192->512 needs \[24, 512\]"):
        load_model(folder)


@pytest.mark.parametrize("change, message", [
    (lambda g: torch.cat([g[:1] + 1, g[1:]]),  # channel 0 moved to group 1: groups of 63, 65, 64
     r"g_idx is not a grouping of the input channels into groups of 64 in some order \(act-order\): "
     r"group 0 has 63 channels, not 64"),
    (lambda g: g - 1, r"g_idx must give each of the 192 input channels a group in \[0, 3\); found values from -1"),
], ids=["uneven-groups", "out-of-range"])
def test_g_idx_that_is_not_equal_groups_in_some_order_is_refused(tmp_path, change, message):
    folder = _copy(tmp_path)
    _edit_config(folder, desc_act=True)
    model, _ = load_model(folder)  # act-order with contiguous groups (static groups): no perm
    assert all(m.perm is None for m in model.modules() if isinstance(m, QuantLinear))
    state = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.g_idx"
    state[name] = change(state[name])
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: model\.layers\.0\.self_attn\.q_proj: " + message):
        load_model(folder)


@pytest.mark.parametrize("change, message", [
    ({"bits": 5}, "GPTQ bits 5 is not supported"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
])
def test_unsupported_gptq_configs(tmp_path, change, message):
    folder = _copy(tmp_path)
    _edit_config(folder, **change)
    with pytest.raises(ModelLoadError, match=message):
        load_model(folder)


def test_smoothquant_has_no_checkpoint_layout(tmp_path):
    model, config = load_model(BUILTIN)
    with pytest.raises(QuantFormatError, match="smoothquant .* has no Hugging Face checkpoint layout"):
        save_quantized(model, config, QuantConfig.from_options("smoothquant"), tmp_path / "x", BUILTIN)
    cli = subprocess.run([sys.executable, "-m", "ruvllm_cli", "quantize", "tiny-shakespeare", "--method",
                          "smoothquant", "--out", str(tmp_path / "y")], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert cli.returncode == 1 and "has no Hugging Face checkpoint layout" in cli.stderr
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize("method", ["int4", "awq"])
def test_widths_the_layout_cannot_pack_stay_float(tmp_path, method):
    """An MLP 100 wide (stories260K's is 172): GPTQ cannot pack K=100 or N=100 4-bit codes into 32-bit words, AWQ
    cannot pack N=100 by eights; those layers are written as exact dequantized float32 weights, marked unquantized."""
    from tests.model_cases import FAMILIES, save_hf_model
    from py_engine.quant.load import load_quantized

    save_hf_model(dict(FAMILIES["llama3-rope"], intermediate_size=100), tmp_path / "src")
    model, config, _ = load_quantized(tmp_path / "src", QuantConfig.from_options("int4", group_size=32),
                                      dtype="float32")
    out = save_quantized(model, config, QuantConfig.from_options(method, group_size=32), tmp_path / "q",
                         tmp_path / "src")
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    if method == "awq":
        assert q["modules_to_not_convert"] == [f"model.layers.{i}.mlp.{p}" for i in range(2)
                                               for p in ("gate_proj", "up_proj")] + ["lm_head"]
    else:
        assert [k for k in q["dynamic"] if k.startswith("-:")] == [
            f"-:^model\\.layers\\.{i}\\.mlp\\.{p}$" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    loaded, _ = load_model(out)
    up, q_proj = loaded.model.layers[0].mlp.up_proj, loaded.model.layers[0].self_attn.q_proj
    assert type(up) is torch.nn.Linear and isinstance(q_proj, QuantLinear)
    assert torch.equal(up.weight, model.model.layers[0].mlp.up_proj.qweight.dequantize())  # exact
    want, got = model.model.layers[0].self_attn.q_proj.qweight, q_proj.qweight
    assert torch.equal(got.codes[:, :64], want.codes[:, :64]) and torch.equal(got.zero_points, want.zero_points)
    assert torch.equal(got.scales, want.scales.half().float())  # the layouts' fp16 scales
