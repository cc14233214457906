"""In-situ quantization: swap a loaded CausalLM's `nn.Linear`s for quantized modules, in place.

    model, config = load_model(path)
    report = quantize_model(model, QuantConfig.from_options("int4"), model_dir=path, tokenizer=tok)
    optimize_for_cpu(model)  # after: q/k/v and gate/up are fused over the quantized parts
    print(report.table())

The model code never changes (gpt-fast's `replace_linears`): every Linear in
the decoder blocks becomes a `QuantLinear` (weight-only: int8, int4, AWQ,
GPTQ) or a `W8A8Linear` (SmoothQuant), except a mixture-of-experts router,
whose few columns decide which experts run. The LM head becomes int8 per
channel (or 4-bit groups) per `lm_head_bits`; a tied embedding keeps
gathering from its float table, the head quantizes a copy of it.
Calibrated methods (calibration.py, awq.py, gptq.py, smoothquant.py) are
imported only when asked for.
"""
from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor, nn

from ..kernels import cpu_kernels, kernel_step
from ..models.memory import release_library_pages, trim_heap
from .config import QuantConfig
from .embedding import install_quant_embedding
from .kernels import PackedWeight, quantize_rtn_native
from .linear import QuantLinear, W8A8Linear
from .mapped import MappedPages
from .rtn import QuantizedWeight, quantize_rtn


@dataclass(frozen=True)
class QuantReport:
    """What quantize_model did: the CLI prints `table()`."""

    method: str  # QuantConfig.describe()
    layers: int  # modules swapped, the LM head included
    bytes_before: int  # the swapped Linears' weights and biases
    bytes_after: int  # their codes, scales, zero points and biases
    seconds: float
    peak_rss_mb: float  # the process's peak so far

    def table(self) -> str:
        rows = [("method", self.method), ("layers swapped", str(self.layers)),
                ("weights", f"{self.bytes_before / 2**20:,.1f} MiB -> {self.bytes_after / 2**20:,.1f} MiB"),
                ("time", f"{self.seconds:.1f} s"), ("peak RSS", f"{self.peak_rss_mb:,.0f} MiB")]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def quantize_model(model: nn.Module, qconfig: QuantConfig, *, model_dir: str | Path | None = None,
                   tokenizer=None, progress: bool = True) -> QuantReport:
    """Quantize `model` (a CausalLM before optimize_for_cpu) in place as `qconfig` says."""
    start = time.perf_counter()
    qconfig.validate()
    if not qconfig.enabled:
        return QuantReport("none", 0, 0, 0, 0.0, _peak_rss_mb())
    targets = block_linears(model)
    if not targets:
        raise ValueError("quantize_model runs before optimize_for_cpu: found no nn.Linear in the decoder "
                         "blocks (fused projections hold their parts in FusedLinear)")
    before = after = 0
    pages = MappedPages()  # float weights mapped from the checkpoint are given back once replaced
    if qconfig.method in ("int8", "int4"):  # one layer at a time: its float pages and codes go at once
        weights = _rtn_weights(targets, qconfig, progress, pages)
    else:
        calibration = _calibration(model, qconfig, model_dir, tokenizer)
        weights = _drain(_calibrated_weights(model, qconfig, calibration, progress))
        targets = block_linears(model)  # the methods change weights (and may swap modules) in place
    swapped = 0
    for name, weight in weights:
        linear = targets.get(name)
        if linear is None:
            raise KeyError(f"{qconfig.method} returned a weight for {name!r}, not a Linear of the decoder blocks")
        if qconfig.method == "smoothquant":
            layer = W8A8Linear(weight, linear.bias)
        else:  # the weight is dropped below: its 8-bit codes are packed in place
            layer = QuantLinear(weight, linear.bias, consume=True)
        before, after = before + _nbytes(linear), after + layer.nbytes
        _replace(model, name, layer.to(linear.weight.device))
        pages.release(linear.weight)
        swapped += 1
        del weight, layer  # the unpacked codes: holding every layer's added ~0.4 GB to the 0.5B model's peak
        trim_heap()  # and their freed heap pages (models/memory.py)
    head = _quantize_head(model, qconfig, pages)
    if head is not None:
        before, after, swapped = before + head[0], after + head[1], swapped + head[2]
    release_library_pages()  # pages the quantizers ran once (models/memory.py)
    return QuantReport(qconfig.describe(), swapped, before, after, time.perf_counter() - start, _peak_rss_mb())


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder blocks' Linears by module name (model.named_modules()), routers left out."""
    routers = {id(m.gate) for m in model.modules() if type(m).__name__ == "SparseMoE"}
    head = getattr(model, "lm_head", None)
    return {name: m for name, m in model.named_modules()
            if type(m) is nn.Linear and m is not head and id(m) not in routers and ".layers." in f".{name}"}


def _rtn_weights(targets: dict[str, nn.Linear], qconfig: QuantConfig, progress: bool,
                 pages: MappedPages) -> Iterator[tuple[str, QuantizedWeight]]:
    for i, (name, linear) in enumerate(targets.items()):
        # read once: peak memory stays near the codes, not the checkpoint
        yield name, rtn(linear.weight, qconfig.bits, qconfig.group_size, qconfig.symmetric, pages=pages)
        if progress:
            _progress(f"quantizing {qconfig.method}", i + 1, len(targets))


def _drain(weights: dict[str, QuantizedWeight]) -> Iterator[tuple[str, QuantizedWeight]]:
    """The dict's items, each dropped from it as it is taken."""
    for name in list(weights):
        yield name, weights.pop(name)


# Values quantized at a time (whole rows): the block's float source (4 MiB of fp32 pages mapped from the
# checkpoint, given back once read) and its codes are the transient beside the codes kept. 4M values took
# 16 MiB of mapped source and ~8 MiB of freed codes at once: the int8 0.5B model's quantize peak (659 MiB)
# was its head's last blocks.
RTN_CHUNK = 1 << 20


def rtn(weight: Tensor, bits: int, block_size: int | None, symmetric: bool, chunk: int = RTN_CHUNK,
        pages: MappedPages | None = None) -> QuantizedWeight:
    """quantize_rtn's bytes, a block of RTN_CHUNK values (whole rows) at a time: rows are independent.

    In one C pass each on the CPU kernels (rtn.c's rk_quantize_rtn: torch's ~20 passes took
    30-50 s for a 0.5B model on a busy 2-core machine), else with quantize_rtn (whole, the
    151936 x 896 LM head made ~10 temporaries of 0.5 GB). With `pages`, each block's mapped
    float pages are given back once read, so a large head never becomes resident whole.
    """
    with _torch_one_thread(weight, bits):
        return _rtn(weight, bits, block_size, symmetric, chunk, pages)


def _rtn(weight: Tensor, bits: int, block_size: int | None, symmetric: bool, chunk: int,
         pages: MappedPages | None) -> QuantizedWeight:
    n, k = weight.shape
    rows = max(1, chunk // max(k, 1))
    out: QuantizedWeight | None = None  # filled block by block (a torch.cat of the blocks held the codes twice)
    for i in range(0, n, rows):
        block = weight[i:i + rows]
        part = quantize_rtn_native(block, bits, block_size, symmetric) or quantize_rtn(block, bits, block_size,
                                                                                      symmetric)
        if pages is not None:
            pages.release(block)
        if rows >= n:
            return part
        if out is None:
            out = QuantizedWeight(torch.empty(n, part.codes.shape[1], dtype=part.codes.dtype),
                                  torch.empty(n, part.scales.shape[1], dtype=part.scales.dtype),
                                  torch.empty(n, part.zero_points.shape[1], dtype=part.zero_points.dtype),
                                  bits, part.block_size, k, symmetric)
        for whole, piece in zip((out.codes, out.scales, out.zero_points), (part.codes, part.scales, part.zero_points)):
            whole[i:i + rows].copy_(piece)
    assert out is not None
    return out


def _calibration(model: nn.Module, qconfig: QuantConfig, model_dir, tokenizer) -> Tensor:
    from .calibration import calibration_ids

    if model_dir is None or tokenizer is None:
        raise ValueError(f"{qconfig.method} calibrates on text: quantize_model needs model_dir and tokenizer")
    return calibration_ids(model_dir, tokenizer, qconfig)


def _calibrated_weights(model: nn.Module, qconfig: QuantConfig, calibration: Tensor,
                        progress: bool) -> dict[str, QuantizedWeight]:
    if qconfig.method == "awq":
        from .awq import awq_quantize

        return awq_quantize(model, qconfig, calibration, progress)
    if qconfig.method == "gptq":
        from .gptq import gptq_quantize

        return gptq_quantize(model, qconfig, calibration, progress)
    from .smoothquant import smooth_model  # folds the smoothing into the norms, then W8A8 everywhere

    smooth_model(model, qconfig, calibration, progress)
    return {name: rtn(linear.weight, 8, None, True) for name, linear in block_linears(model).items()}


def _quantize_head(model: nn.Module, qconfig: QuantConfig, pages: MappedPages) -> tuple[int, int, int] | None:
    """The LM head to int8 per channel (or 4-bit groups), and the embedding with it: a tied one gathers its
    rows from the head's codes, an untied one is quantized the same way (py_engine.quant.embedding), so no
    float table stays. Returns (bytes before, bytes after, modules swapped)."""
    head = getattr(model, "lm_head", None)
    if qconfig.lm_head_bits is None or type(head) is not nn.Linear:
        return None
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = type(embedding) is nn.Embedding and head.weight is embedding.weight
    layer = _quantized_table(head.weight, head.bias, qconfig, pages)
    model.lm_head = layer  # CausalLM.tie_weights ties only a float head
    before, after, swapped = _nbytes(head), layer.nbytes, 1
    if tied:
        install_quant_embedding(model, layer, tied=True)
    elif type(embedding) is nn.Embedding:
        table = _quantized_table(embedding.weight, None, qconfig, pages)
        if install_quant_embedding(model, table, tied=False) is not None:
            before, after, swapped = before + _nbytes(embedding), after + table.nbytes, 2
    return before, after, swapped


def _quantized_table(weight: Tensor, bias: Tensor | None, qconfig: QuantConfig, pages: MappedPages) -> QuantLinear:
    """An LM head's (or an embedding's) [V, hidden] table as lm_head_bits say; its mapped float pages given back."""
    if qconfig.lm_head_bits == 8:
        packed = rtn_packed(weight, 8, None, True, pages=pages)
    else:
        packed = rtn_packed(weight, 4, qconfig.group_size or 128, False, pages=pages)
    layer = QuantLinear(packed, bias).to(weight.device)
    pages.release(weight)
    trim_heap()
    return layer


def rtn_packed(weight: Tensor, bits: int, block_size: int | None, symmetric: bool, chunk: int = RTN_CHUNK,
               pages: MappedPages | None = None) -> PackedWeight:
    """PackedWeight.pack(rtn(...)), packed a block of RTN_CHUNK values at a time: the unpacked byte-a-code
    codes of a large table (130 MB for Qwen2.5-0.5B's head) never exist whole."""
    with _torch_one_thread(weight, bits):
        return _rtn_packed(weight, bits, block_size, symmetric, chunk, pages)


def _rtn_packed(weight: Tensor, bits: int, block_size: int | None, symmetric: bool, chunk: int,
                pages: MappedPages | None) -> PackedWeight:
    n, k = weight.shape
    rows = max(1, chunk // max(k, 1))
    codes = scales = zeros = None
    layout = (0, 0)  # block size, sub-blocks per group
    for i in range(0, n, rows):
        q = rtn(weight[i:i + rows], bits, block_size, symmetric, chunk, pages)
        part = PackedWeight.pack(q, consume=True)
        del q
        if rows >= n:
            return part
        if codes is None:
            codes, scales, zeros = (torch.empty(n, t.shape[1], dtype=t.dtype)
                                    for t in (part.codes, part.scales, part.zero_points))
        for whole, piece in zip((codes, scales, zeros), (part.codes, part.scales, part.zero_points)):
            whole[i:i + rows].copy_(piece)
        layout = (part.block_size, part.spg)
        del part
    return PackedWeight.from_parts(codes, scales, zeros, bits, layout[0], k, symmetric, layout[1])  # pack's mins


@contextmanager
def _torch_one_thread(weight: Tensor, bits: int) -> Iterator[None]:
    """kernel_step while blocks are quantized: each block's copy and code flip is a few MB, and on a busy
    machine every torch op over 2 OpenMP threads waited milliseconds for the second (1M-value blocks on 2
    threads took 9 CPU s to quantize the 0.5B model). Only where quantize_rtn_native takes the weight:
    elsewhere torch's own passes do the work, on all of torch's threads."""
    kernels = cpu_kernels()
    native = weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and bits in (4, 8)
    if kernels is None or not native:
        yield
        return
    with kernel_step(kernels):
        yield


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def _nbytes(linear: nn.Linear) -> int:
    return sum(p.numel() * p.element_size() for p in linear.parameters(recurse=False))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _progress(label: str, done: int, total: int) -> None:
    if sys.stderr.isatty() or done == total:
        end = "\n" if done == total else ""
        print(f"\r{label}: {done}/{total} layers", end=end, file=sys.stderr, flush=True)
