"""A GGUF file as the loader's checkpoint: HF parameter names -> tensors read from the file.

    checkpoint = GGUFCheckpoint(GGUFFile("model.gguf"), config, model)
    checkpoint.install_quantized(model, "cpu")  # Q4_0 / Q4_1 / Q8_0 projections as QuantLinear
    checkpoint.get("model.layers.0.self_attn.q_proj.weight")  # float32, un-permuted

It answers the loader's Checkpoint interface (`folder`, `files`, `where`, `shape`,
`get`, `release`), so models/loader.py fills a model from a GGUF exactly as from
safetensors, shape checks and error messages included. Tensors the model has no
parameter for are listed under their GGUF names (the loader then names them as
unexpected), except the rope tables config.py already read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .reader import GGUFFile
from .tensors import SMALL_COPY, check_shape, float_tensor, name_map

READ_INTO_CONFIG = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class GGUFCheckpoint:
    """The tensors of one GGUF file under the parameter names of `model` (a CausalLM, on any device)."""

    def __init__(self, gguf: GGUFFile, config: dict[str, Any], model: nn.Module, dequantize: bool = False) -> None:
        self.gguf, self.config, self.dequantize = gguf, config, dequantize
        self.folder: Path = gguf.path.parent
        self.files = {gguf.path.name: gguf}
        params = dict(model.named_parameters())  # a tied lm_head is listed once, as the embedding
        self.names = name_map(gguf, params, config["num_hidden_layers"])  # HF name -> GGUF name
        self.where = {hf: gguf.path.name for hf in self.names}
        mapped = set(self.names.values())
        for name in gguf.tensors:
            if name not in mapped and name not in READ_INTO_CONFIG:
                self.where[name] = gguf.path.name
        self._shapes = {hf: tuple(params[hf].shape) for hf in self.names}
        for hf, name in self.names.items():
            check_shape(gguf, name, hf, self._shapes[hf])

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name] if name in self._shapes else self.gguf.tensors[name].shape

    def get(self, name: str) -> Tensor:
        """float32 on the CPU, as the transformers checkpoint would hold it."""
        values = float_tensor(self.gguf, self.names[name], self.config)
        if values.nbytes <= SMALL_COPY:  # a copied norm or bias: the file's folios its read mapped go again
            self.loaded()
        return torch.from_numpy(values)

    def release(self, name: str, start: int = 0, stop: int | None = None) -> None:
        """Nothing is mapped per tensor here: get() made a copy (dequantized or un-permuted)."""

    def loaded(self) -> None:
        """Every tensor read so far is a copy (get()'s, install_quantized's codes): the file's pages leave this
        process's RSS (models/memory.py drop_pages), as llama.cpp's do not (its weights are those pages)."""
        from ...models.memory import drop_pages

        whole = np.asarray(next(iter(self.gguf.tensors.values())).data)
        while isinstance(whole.base, np.ndarray):  # the memmap of the whole file
            whole = whole.base
        drop_pages(whole.ctypes.data, whole.ctypes.data + whole.nbytes)

    def install_quantized(self, model: nn.Module, device: Any) -> set[str]:
        """QuantLinears for the projections the file stores in a type the kernels run; their names."""
        if self.dequantize:
            return set()
        from .quantized import install_native  # torch-heavy QuantLinear: only for native weights

        return install_native(self, model, device)
