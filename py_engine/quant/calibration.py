"""Calibration data for AWQ, GPTQ and SmoothQuant, and the layer-by-layer runner they share.

    ids = calibration_ids(model_dir, tokenizer, qconfig)         # LongTensor [S, T]
    runner = LayerwiseCalibration(model, ids, desc="GPTQ")
    for index, layer in runner.layers():                          # a tqdm bar over the layers
        runner.run(layer)                                         # forward hooks see the layer's inputs
        ...                                                       # change the layer's weights
    hidden = runner.hidden                                        # [S, T, hidden] after the last layer
    print(runner.report())                                        # time and peak memory

The calibration text is `qconfig.calibration_file`, else the model folder's
`calibration.txt` (the built-in model ships a slice of its training split: see
training/corpus.py), tokenized once; S windows of T tokens are drawn from it with
`qconfig.seed`. The runner embeds the ids once, then walks the decoder one layer at a
time, feeding each layer's outputs to the next, so the quantizers only ever hold one
layer's activations (the [S, T, hidden] residual stream in and out, and one chunk of
sequences inside the layer) instead of the whole model's.
"""
from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from .config import QuantConfig

__all__ = ["CalibrationError", "LayerwiseCalibration", "calibration_ids", "calibration_text_path"]

CALIBRATION_FILE = "calibration.txt"


class CalibrationError(ValueError):
    """No calibration text, or too little of it, with what to give instead."""


def calibration_text_path(model_dir: str | Path | None, qconfig: QuantConfig) -> Path:
    """qconfig.calibration_file, else <model_dir>/calibration.txt; a clear error when neither exists."""
    if qconfig.calibration_file:
        path = Path(qconfig.calibration_file)
        if not path.is_file():
            raise CalibrationError(f"calibration file {path} does not exist")
        return path
    if model_dir is not None and (Path(model_dir) / CALIBRATION_FILE).is_file():
        return Path(model_dir) / CALIBRATION_FILE
    where = f"{model_dir}/{CALIBRATION_FILE}" if model_dir is not None else f"the model's {CALIBRATION_FILE}"
    raise CalibrationError(
        f"{qconfig.method} needs calibration text and there is no {where}: give one with --calibration-file "
        f"FILE (plain text in the model's language and domain; {qconfig.calibration_samples} x "
        f"{qconfig.calibration_seq_len} tokens are drawn from it), or put it at {where}")


def _encode(tokenizer, text: str) -> list[int]:
    """ids of text with ruvllm's Tokenizer or a Hugging Face one (special tokens as the model adds them)."""
    if hasattr(tokenizer, "encode"):
        return list(tokenizer.encode(text))
    return list(tokenizer(text)["input_ids"])


def calibration_ids(model_dir: str | Path | None, tokenizer, qconfig: QuantConfig,
                    context: int | None = None) -> Tensor:
    """LongTensor [S, T]: S = qconfig.calibration_samples windows of T tokens from the calibration text.

    T = min(qconfig.calibration_seq_len, context), the context being the argument or
    max_position_embeddings of <model_dir>/config.json. When the text holds at least S
    whole windows, the windows are S distinct non-overlapping ones (a seeded offset, then a
    seeded choice); otherwise they start at seeded random positions and may overlap.
    """
    path = calibration_text_path(model_dir, qconfig)
    if context is None and model_dir is not None and (Path(model_dir) / "config.json").is_file():
        from ..config import ModelConfig
        context = ModelConfig.from_file(Path(model_dir)).max_position_embeddings
    length = min(qconfig.calibration_seq_len, context or qconfig.calibration_seq_len)
    ids = torch.tensor(_encode(tokenizer, path.read_text(encoding="utf-8")), dtype=torch.long)
    if len(ids) < length + 1:
        raise CalibrationError(f"{path} holds {len(ids)} tokens, fewer than one calibration window of {length}; "
                               f"give a longer text with --calibration-file")
    g = torch.Generator().manual_seed(qconfig.seed)
    samples = qconfig.calibration_samples
    offset = int(torch.randint(0, len(ids) % length + 1, (1,), generator=g))
    whole = (len(ids) - offset) // length
    if whole >= samples:
        starts = offset + torch.randperm(whole, generator=g)[:samples] * length
    else:
        starts = torch.randint(0, len(ids) - length + 1, (samples,), generator=g)
    return torch.stack([ids[s: s + length] for s in starts.tolist()])  # [S, T]


def _progress(iterable, desc: str, enabled: bool, total: int):
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, unit="layer", file=sys.stderr, leave=False)


def _rss_mb() -> float:
    """The process's resident memory now (Linux); elsewhere its peak so far (macOS reports bytes)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2 ** 20 if sys.platform == "darwin" else 2 ** 10)


class LayerwiseCalibration:
    """Calibration sequences walked through a CausalLM's decoder one layer at a time.

    `hidden` [S, T, hidden] holds the inputs of the current layer. `layers()` yields
    (index, layer); after the caller's body it replaces `hidden` by the layer's outputs
    on it (the layer as the body left it: GPTQ feeds quantized layers forward), unless
    the body called `advance()` itself (AWQ takes the float layer's outputs before
    changing it). Sequences go through a layer in chunks of about `chunk_tokens` tokens.
    """

    def __init__(self, model: nn.Module, calibration: Tensor, desc: str = "calibrating",
                 progress: bool = True, chunk_tokens: int = 8192) -> None:
        self.model, self.desc, self.progress = model, desc, progress
        self.decoder = model.model
        self.start = time.perf_counter()
        self.rss_before = self.rss_peak = _rss_mb()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        ids = calibration.to(self.device)
        self.samples, self.length = ids.shape
        self.chunk = max(1, chunk_tokens // self.length)
        positions = torch.arange(self.length, device=self.device)
        self.positions = positions[None].expand(self.chunk, -1)  # [chunk, T]
        self.cos, self.sin = self.decoder.rotary_emb(self.positions, self.dtype)  # [chunk, T, rotary_dim]
        with torch.no_grad():
            x = torch.cat([self.decoder.embed_tokens(ids[i: i + self.chunk])
                           for i in range(0, self.samples, self.chunk)])  # [S, T, hidden]
            if self.decoder.embedding_multiplier != 1.0:  # Gemma, as DecoderModel.forward does it
                x = x * torch.tensor(self.decoder.embedding_multiplier, dtype=x.dtype)
        self.hidden = x
        self._next: Tensor | None = None
        self.activation_bytes = 0

    def chunks(self, inputs: Tensor | None = None) -> Iterator[Tensor]:
        """inputs [S, T, ...] (default `hidden`) in chunks of sequences; [S * T, K] in as many rows."""
        inputs = self.hidden if inputs is None else inputs
        step = self.chunk if inputs.dim() > 2 else self.chunk * self.length
        for i in range(0, inputs.shape[0], step):
            yield inputs[i: i + step]

    def call(self, module: nn.Module, x: Tensor) -> Tensor:
        """module(x) for one chunk x [b, T, ...]: decoder layers and attention get rope and positions."""
        from ..models.attention import NoCache
        from ..models.layers import Attention
        from ..models.transformer import DecoderLayer
        if isinstance(module, (DecoderLayer, Attention)):
            b = x.shape[0]
            return module(x, self.cos[:b], self.sin[:b], self.positions[:b], NoCache())
        return module(x)

    @torch.no_grad()
    def forward(self, module: nn.Module | Callable[[Tensor], Tensor], inputs: Tensor | None = None) -> Tensor:
        """Outputs [S, T, ...] of module on inputs (default `hidden`), chunk by chunk."""
        run = module if not isinstance(module, nn.Module) else (lambda x: self.call(module, x))
        return torch.cat([run(x) for x in self.chunks(inputs)])

    @torch.no_grad()
    def run(self, module: nn.Module, inputs: Tensor | None = None) -> None:
        """module on every chunk, outputs dropped: for forward hooks that gather statistics."""
        for x in self.chunks(inputs):
            self.call(module, x)

    def advance(self, layer: nn.Module) -> None:
        """Compute the next layer's inputs now, from `layer` as it is."""
        self._next = self.forward(layer)

    def layers(self) -> Iterator[tuple[int, nn.Module]]:
        """(index, decoder layer) in order, with a progress bar; `hidden` moves on after each."""
        layers = self.decoder.layers
        for index, layer in _progress(enumerate(layers), self.desc, self.progress, len(layers)):
            self._next = None
            yield index, layer
            if self._next is None:
                self.advance(layer)
            self.rss_peak = max(self.rss_peak, _rss_mb())  # sampled while a layer's data is alive
            self.activation_bytes = max(self.activation_bytes,
                                        (self.hidden.numel() + self._next.numel()) * self.hidden.element_size())
            self.hidden, self._next = self._next, None

    def report(self) -> str:
        """'GPTQ 4-bit: 6 layers, 128 x 256 tokens in 3.1 s; activations 48 MB; RSS 410 MB (+35 at most)'.

        Activations: the residual stream in and out of a layer; RSS: the process's resident
        memory at the start and its largest increase, sampled after each layer."""
        seconds = time.perf_counter() - self.start
        text = (f"{self.desc}: {len(self.decoder.layers)} layers, {self.samples} x {self.length} tokens in "
                f"{seconds:.1f} s; activations {self.activation_bytes / 2 ** 20:.0f} MB; "
                f"RSS {self.rss_before:.0f} MB (+{self.rss_peak - self.rss_before:.0f} at most)")
        if self.device.type == "cuda":
            text += f"; peak CUDA {torch.cuda.max_memory_allocated(self.device) / 2 ** 20:.0f} MB"
        return text
