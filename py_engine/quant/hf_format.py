"""Quantized checkpoints in Hugging Face's GPTQ and AWQ layouts (bit layouts in hf_packing).

    save_quantized(model, config, qconfig, "out/", source_dir="model/")   # `ruvllm quantize`
    load_model("out/")   # the loader calls read_quantization + install_quantized_linears

Which layout a method is written in (decided here, once):
    int4, int8, gptq (2/3/4/8-bit)  GPTQ (`quant_method` "gptq"); int8 is GPTQ 8-bit per channel
    awq 4-bit                       AWQ gemm (`quant_method` "awq", `version` "gemm")
    awq 2/3-bit                     GPTQ (the AWQ gemm layout holds 4-bit codes only); `meta.method` says awq
    smoothquant                     refused: W8A8 (int8 activations) has no standard Hugging Face layout;
                                    quantize at load time with `--quantization smoothquant` instead
The method is recorded in `quantization_config.meta.method`; the layout only says how to dequantize.

A layer whose bits or group differ from the checkpoint's (the int8 per-channel LM head beside 4-bit
groups) gets a gptqmodel `dynamic` override in GPTQ checkpoints; AWQ cannot express one, so there such
a layer is written as its dequantized float32 weight and listed in `modules_to_not_convert`. A layer
whose widths the layout cannot pack (GPTQ: K * bits and N * bits multiples of 32; AWQ: N a multiple
of 8, e.g. stories260K's 172-wide MLP) is also written as its exact dequantized float32 weight, marked
unquantized (`dynamic` "-:" / `modules_to_not_convert`): it loads as an nn.Linear. A
quantized LM head of a tied model is its own tensor, so the written config unties the embeddings.

GPTQ v1 stores zero - 1 and cannot store a zero point of 0 (asymmetric groups whose values are all
>= 0); when one occurs the whole checkpoint is written as `checkpoint_format` "gptq_v2" instead.
Scales are stored as fp16 (both layouts' dtype): a saved model differs from the in-memory one by that
rounding (relative 2**-11 per scale, or worse in fp16's subnormal range below 6e-5).

On load, act-order (`desc_act`) checkpoints load exactly, as AutoGPTQ/GPTQModel write them: a g_idx
that numbers groups of group_size along some permutation of the input channels gives a QuantLinear
over the permuted columns that reads x[..., perm] (hf_packing.act_order_perm, as exllama does); a
g_idx that is not such a grouping is refused. Writing such a layer back (GPTQ layout) gives its
original g_idx and column order, with `desc_act` true; the AWQ layout, which has no g_idx, refuses it.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .config import QuantConfig
from .embedding import QuantEmbedding
from .hf_packing import from_awq, from_gptq, groups_of, to_awq, to_gptq
from .linear import QuantLinear, original_order
from .rtn import QuantizedWeight

GPTQ_BITS = (2, 3, 4, 8)
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                "chat_template.jinja", "validation.txt", "calibration.txt")


class QuantFormatError(ValueError):
    """A quantized checkpoint ruvllm cannot read or a model it cannot write, with the reason."""


# --- writing --------------------------------------------------------------------------------
def checkpoint_layout(qconfig: QuantConfig, layout: str = "auto") -> str:
    """'gptq' or 'awq': the layout `ruvllm quantize` writes for a method (see the module docstring).

    `layout` "gptq" writes any method's codes in the GPTQ layout (AWQ's asymmetric groups fit it exactly,
    and its `dynamic` override keeps the int8 head packed, where the AWQ layout stores it as float)."""
    if not qconfig.enabled:
        raise QuantFormatError("nothing to write: the quantization method is none")
    if qconfig.method == "smoothquant":
        raise QuantFormatError("smoothquant (W8A8) has no Hugging Face checkpoint layout; run the float model "
                               "with --quantization smoothquant instead of writing a quantized copy")
    if layout not in ("auto", "gptq", "awq"):
        raise QuantFormatError(f"unknown layout {layout!r}; choose auto, gptq or awq")
    if layout == "awq" and qconfig.bits != 4:
        raise QuantFormatError(f"the AWQ gemm layout holds 4-bit codes; {qconfig.describe()} needs the GPTQ layout")
    if layout != "auto":
        return layout
    return "awq" if qconfig.method == "awq" and qconfig.bits == 4 else "gptq"


def _group(q: QuantizedWeight) -> int:
    """A weight's group size in quantization_config terms: -1 for one group per output channel."""
    return -1 if q.blocks == 1 and q.block_size >= q.in_features else q.block_size


def _matches(q: QuantizedWeight, bits: int, group: int) -> bool:
    block = q.in_features if group == -1 else group
    return q.bits == bits and (q.block_size == block or (q.blocks == 1 and groups_of(q.in_features, block) == 1))


def _quantized_modules(model: nn.Module) -> dict[str, QuantLinear]:
    found = {}
    tables = [name for name, m in model.named_modules() if isinstance(m, QuantEmbedding)]
    for name, module in model.named_modules():
        if any(name.startswith(t + ".") for t in tables):  # an untied QuantEmbedding's codes: written as floats
            continue
        if isinstance(module, QuantLinear) and not module.per_row:  # per_row: W8A8, int8 activations too
            found[name] = module
        elif hasattr(module, "qweight") and not isinstance(module, (nn.Embedding, QuantEmbedding)):
            raise QuantFormatError(f"{name} is a {type(module).__name__}: only weight-only QuantLinear layers "
                                   "fit the GPTQ and AWQ layouts")
    if not found:
        raise QuantFormatError("the model has no quantized linear layers to write")
    offsets = [name for name, m in found.items() if (m.packed or m._raw).offsets is not None]
    if offsets:
        raise QuantFormatError(f"{offsets[0]} keeps a float minimum per group (GGUF Q4_1), which the GPTQ and AWQ "
                               "layouts cannot hold; run the .gguf itself, or `ruvllm import-gguf` it to float")
    return found


def _float_tensors(model: nn.Module, skip: set[str], dtype: torch.dtype) -> dict[str, Tensor]:
    """Parameters outside the quantized layers (tied ones once), and dequantized quantized embeddings."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        if name in skip or any(name.startswith(s + ".") for s in skip):
            continue
        if isinstance(module, QuantEmbedding):  # the rows it gathers: the head's (tied) or its own codes
            out[f"{name}.weight"] = module.rows.dequantize().to("cpu", dtype)
            continue
        if isinstance(module, nn.Embedding) and isinstance(getattr(module, "qweight", None), QuantizedWeight):
            out[f"{name}.weight"] = module.qweight.dequantize().to(dtype)
            continue
        for leaf, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out[f"{name}.{leaf}" if name else leaf] = p.detach().to("cpu", dtype).contiguous()
    return out


def _gptq_fits(q: QuantizedWeight) -> bool:
    """GPTQ packs codes along K and zero points along N into whole 32-bit words."""
    return (q.in_features * q.bits) % 32 == 0 and (q.out_features * q.bits) % 32 == 0


def _gptq_tensors(layers: dict[str, QuantLinear], weights: dict[str, QuantizedWeight]
                  ) -> tuple[dict[str, Tensor], bool, list[str]]:
    """Every layer in GPTQ tensors, v1 when every zero point allows it (else v2); returns (tensors, v1, left
    float): a layer whose widths do not fill 32-bit words is written as its exact dequantized float32 weight."""
    v1 = all(not bool((q.zero_points == 0).any()) for q in weights.values() if _gptq_fits(q))
    tensors, floats = {}, []
    for name, q in weights.items():
        perm = layers[name].perm  # act-order: q holds W[:, perm]
        if _gptq_fits(q):
            tensors.update({f"{name}.{key}": t for key, t in to_gptq(q, v1=v1, perm=perm).items()})
        else:
            tensors[f"{name}.weight"] = original_order(q.dequantize(), perm)
            floats.append(name)
        if layers[name].bias is not None:
            tensors[f"{name}.bias"] = layers[name].bias.detach().cpu().float()
    return tensors, v1, floats


def _cpu(q: QuantizedWeight) -> QuantizedWeight:
    return replace(q, codes=q.codes.cpu(), scales=q.scales.cpu().float(), zero_points=q.zero_points.cpu())


def _gptq_config(qconfig: QuantConfig, weights: dict[str, QuantizedWeight], v1: bool,
                 floats: list[str], act_order: bool = False) -> dict[str, Any]:
    """The GPTQ quantization_config. act_order: some layer's g_idx is permuted (it was loaded from an act-order
    checkpoint), which `desc_act` must say: loaders that take desc_act false as contiguous groups would misread it."""
    bits, group = qconfig.bits, qconfig.group_size or -1
    dynamic: dict[str, dict] = {f"-:^{re.escape(name)}$": {} for name in floats}  # gptqmodel: left unquantized
    dynamic.update({f"+:^{re.escape(name)}$": {"bits": q.bits, "group_size": _group(q), "sym": q.symmetric}
                    for name, q in weights.items() if name not in floats and not _matches(q, bits, group)})
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
              "sym": qconfig.symmetric, "lm_head": "lm_head" in weights and "lm_head" not in floats,
              "checkpoint_format": "gptq" if v1 else "gptq_v2", "pack_dtype": "int32",
              "damp_percent": qconfig.damp_percent, "true_sequential": True}
    if dynamic:
        config["dynamic"] = dynamic
    config["meta"] = _meta(qconfig)
    return config


def _meta(qconfig: QuantConfig) -> dict[str, Any]:
    from py_engine.version import __version__
    meta: dict[str, Any] = {"quantizer": [f"ruvllm:{__version__}"], "method": qconfig.method,
                            "description": qconfig.describe()}
    if qconfig.method == "gptq":
        meta["act_order"] = qconfig.act_order  # ruvllm's own: stored with contiguous groups (static groups)
    if qconfig.needs_calibration:
        meta["calibration_samples"] = qconfig.calibration_samples
    return meta


def _awq_tensors(layers: dict[str, QuantLinear], group: int) -> tuple[dict[str, Tensor], list[str]]:
    tensors, not_converted = {}, []
    for name, m in layers.items():
        if m.perm is not None:
            raise QuantFormatError(f"{name} reads its input channels in act-order (a permuted GPTQ g_idx), which "
                                   "the AWQ layout cannot hold; write it in the GPTQ layout (--layout gptq)")
        q = _cpu(m.qweight)
        if _matches(q, 4, group) and q.out_features % 8 == 0:
            tensors.update({f"{name}.{k}": t for k, t in to_awq(q).items()})
        else:  # AWQ has no per-layer override: the layer's exact dequantized weight, in float32
            tensors[f"{name}.weight"] = q.dequantize()
            not_converted.append(name)
        if m.bias is not None:
            tensors[f"{name}.bias"] = m.bias.detach().cpu().float()
    return tensors, not_converted


def save_quantized(model: nn.Module, config: Any, qconfig: QuantConfig, out_dir: str | Path,
                   source_dir: str | Path, layout: str = "auto") -> Path:
    """Write model (quantized by quantize_model) as a Hugging Face checkpoint folder; returns out_dir."""
    from safetensors.torch import save_file

    layout = checkpoint_layout(qconfig, layout)
    out, source = Path(out_dir), Path(source_dir)
    if out.resolve() == source.resolve():
        raise QuantFormatError(f"--out {out} is the source model's folder; write the quantized copy elsewhere")
    layers = _quantized_modules(model)
    raw = json.loads((source / "config.json").read_text(encoding="utf-8"))
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(config.torch_dtype or "", torch.float32)
    group = qconfig.group_size or -1
    if layout == "gptq":
        weights = {name: _cpu(m.qweight) for name, m in layers.items()}  # unpacked once per layer
        tensors, v1, floats = _gptq_tensors(layers, weights)
        act_order = any(layers[name].perm is not None for name in weights if name not in floats)
        raw["quantization_config"] = _gptq_config(qconfig, weights, v1, floats, act_order)
    else:
        tensors, not_converted = _awq_tensors(layers, group)
        raw["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                      "version": "gemm", "modules_to_not_convert": not_converted or None,
                                      "meta": _meta(qconfig)}
    tensors.update(_float_tensors(model, set(layers), dtype))
    if "lm_head" in layers and raw.get("tie_word_embeddings"):
        raw["tie_word_embeddings"] = False  # the quantized head is no longer the embedding table
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"):
        (out / stale).unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    for name in COPIED_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out


# --- reading --------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerSpec:
    bits: int
    group_size: int  # -1: one group per output channel
    symmetric: bool


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's quantization_config, validated: what each layer's tensors hold."""

    method: str  # gptq | awq (the layout)
    default: LayerSpec
    v1: bool = True  # GPTQ: zero points stored minus one
    dynamic: tuple[tuple[str, dict[str, Any] | None], ...] = ()  # (regex, overrides); None: left float
    not_converted: tuple[str, ...] = ()
    source: str = "config.json"

    def describe(self) -> str:
        """'gptq checkpoint 4-bit g128 sym' — for logs and tables."""
        d = self.default
        group = "per-channel" if d.group_size == -1 else f"g{d.group_size}"
        return f"{self.method} checkpoint {d.bits}-bit {group} {'sym' if d.symmetric else 'asym'}"

    def spec(self, module: str) -> LayerSpec | None:
        """The module's bits and group (gptqmodel's `dynamic`: first matching pattern wins)."""
        if any(module == n or module.startswith(n + ".") for n in self.not_converted):
            return None
        for pattern, overrides in self.dynamic:
            if re.match(pattern, module):
                if overrides is None:
                    return None
                return LayerSpec(int(overrides.get("bits", self.default.bits)),
                                 int(overrides.get("group_size", self.default.group_size)),
                                 bool(overrides.get("sym", self.default.symmetric)))
        return self.default


def read_quantization(folder: str | Path) -> CheckpointQuantization | None:
    """config.json's quantization_config (or a legacy quantize_config.json); None for a float checkpoint."""
    folder = Path(folder)
    path = folder / "config.json"
    raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    q = raw.get("quantization_config") if isinstance(raw, dict) else None
    if q is None and (folder / "quantize_config.json").is_file():
        path = folder / "quantize_config.json"
        q = json.loads(path.read_text(encoding="utf-8"))
        q.setdefault("quant_method", "gptq")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise QuantFormatError(f"{path}: quantization_config must be an object, got {type(q).__name__}")
    method = str(q.get("quant_method", "")).lower()
    if method == "gptq":
        return _read_gptq(q, path)
    if method == "awq":
        return _read_awq(q, path)
    raise QuantFormatError(f"{path}: quantization_config.quant_method {q.get('quant_method')!r} is not supported; "
                           "ruvllm reads gptq and awq checkpoints (or quantizes a float model at load time "
                           "with --quantization)")


def _read_gptq(q: dict[str, Any], path: Path) -> CheckpointQuantization:
    bits, group = int(q.get("bits", 0)), int(q.get("group_size", -1))
    fmt = str(q.get("checkpoint_format", q.get("format", "gptq"))).lower()
    if bits not in GPTQ_BITS:
        raise QuantFormatError(f"{path}: GPTQ bits {bits} is not supported; ruvllm reads {GPTQ_BITS}")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantFormatError(f"{path}: GPTQ checkpoint_format {fmt!r} is not supported; ruvllm reads the "
                               "gptq (v1) and gptq_v2 layouts (not marlin or bitblas repacks)")
    dynamic = []
    for key, overrides in (q.get("dynamic") or {}).items():
        negative = key.startswith("-:")
        dynamic.append((key[2:] if key[:2] in ("+:", "-:") else key, None if negative else dict(overrides)))
    return CheckpointQuantization("gptq", LayerSpec(bits, group, bool(q.get("sym", True))), v1=fmt == "gptq",
                                  dynamic=tuple(dynamic), source=str(path))


def _read_awq(q: dict[str, Any], path: Path) -> CheckpointQuantization:
    bits, group = int(q.get("bits", q.get("w_bit", 0))), int(q.get("group_size", q.get("q_group_size", -1)))
    version = str(q.get("version", q.get("format", "gemm"))).lower()
    if bits != 4:
        raise QuantFormatError(f"{path}: AWQ bits {bits} is not supported; the gemm layout is 4-bit")
    if version != "gemm":
        raise QuantFormatError(f"{path}: AWQ version {version!r} is not supported; ruvllm reads the gemm layout")
    if not q.get("zero_point", True):
        raise QuantFormatError(f"{path}: AWQ checkpoints without zero points are not supported")
    return CheckpointQuantization("awq", LayerSpec(4, group, False),
                                  not_converted=tuple(q.get("modules_to_not_convert") or ()), source=str(path))


def _expected_shapes(quant: CheckpointQuantization, spec: LayerSpec, k: int, n: int) -> dict[str, tuple[int, ...]]:
    groups = groups_of(k, k if spec.group_size == -1 else spec.group_size)
    if quant.method == "awq":
        return {"qweight": (k, n // 8), "qzeros": (groups, n // 8), "scales": (groups, n)}
    return {"qweight": (k * spec.bits // 32, n), "qzeros": (groups, n * spec.bits // 32), "scales": (groups, n)}


def _layer_weight(quant: CheckpointQuantization, checkpoint: Any, name: str, module: nn.Linear
                  ) -> tuple[QuantizedWeight, Tensor | None]:
    """The layer's QuantizedWeight and its act-order perm (None: g_idx absent or contiguous; see hf_packing)."""
    spec = quant.spec(name)
    k, n = module.in_features, module.out_features
    where = lambda key: f"{checkpoint.folder / checkpoint.where.get(f'{name}.{key}', '?')}"  # noqa: E731
    if spec is None:
        raise QuantFormatError(f"{where('qweight')}: {name} holds quantized tensors but {quant.source} leaves it float")
    per_word = 8 if quant.method == "awq" else 32 // spec.bits
    if (quant.method == "awq" and n % 8) or (quant.method == "gptq" and ((k * spec.bits) % 32 or (n * spec.bits) % 32)):
        raise QuantFormatError(f"{name}: a {k}->{n} layer cannot be held in {spec.bits}-bit {quant.method} words "
                               f"({per_word} codes each)")
    tensors = {}
    for key, shape in _expected_shapes(quant, spec, k, n).items():
        full = f"{name}.{key}"
        if full not in checkpoint.where:
            raise QuantFormatError(f"{checkpoint.folder}: {full!r} is missing ({name} has a qweight)")
        found = tuple(checkpoint.shape(full))
        if found != shape:
            group = "per-channel" if spec.group_size == -1 else f"group {spec.group_size}"
            raise QuantFormatError(f"{where(key)}: tensor {full!r} has shape {list(found)} but a {spec.bits}-bit "
                                   f"{group} {quant.method} layer {k}->{n} needs {list(shape)}")
        tensors[key] = checkpoint.get(full)
    for key in ("qweight", "qzeros"):
        if tensors[key].dtype != torch.int32:
            raise QuantFormatError(f"{where(key)}: {name}.{key} is {tensors[key].dtype}; the layout stores int32")
    try:
        if quant.method == "awq":
            return from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group_size=spec.group_size,
                            in_features=k), None
        g_idx = checkpoint.get(f"{name}.g_idx") if f"{name}.g_idx" in checkpoint.where else None
        if g_idx is not None and tuple(g_idx.shape) != (k,):
            raise ValueError(f"g_idx has shape {list(g_idx.shape)}, expected [{k}]")
        return from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx, bits=spec.bits,
                         group_size=spec.group_size, in_features=k, symmetric=spec.symmetric, v1=quant.v1)
    except ValueError as e:
        raise QuantFormatError(f"{where('qweight')}: {name}: {e}") from None


def install_quantized_linears(model: nn.Module, quant: CheckpointQuantization, checkpoint: Any,
                              device: str | torch.device = "cpu") -> set[str]:
    """Swap each nn.Linear whose `qweight` the checkpoint holds for a QuantLinear built from its tensors.

    `checkpoint` is the loader's Checkpoint (`where`, `shape`, `get`); a bias stays a (meta) parameter
    for the loader to fill. Returns the tensor names consumed here.
    """
    consumed: set[str] = set()
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and f"{n}.qweight" in checkpoint.where]
    perms: dict[bytes, Tensor] = {}  # equal act-order perms (q/k/v, gate/up) as one tensor
    for name, module in targets:
        q, perm = _layer_weight(quant, checkpoint, name, module)
        q = replace(q, codes=q.codes.to(device), scales=q.scales.to(device), zero_points=q.zero_points.to(device))
        if perm is not None:
            perm = perms.setdefault(perm.numpy().tobytes(), perm.to(device))
        bias = None if module.bias is None else torch.empty(module.out_features, device="meta")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, QuantLinear.from_weight(q, bias, perm))
        consumed |= {f"{name}.{k}" for k in ("qweight", "qzeros", "scales", "g_idx")} & set(checkpoint.where)
    return consumed
