"""Small GGUF files for the import tests, written with ggml's own writer (`gguf.GGUFWriter`).

A transformers model with random weights goes through the steps of llama.cpp's convert_hf_to_gguf.py
that an importer must undo or read: ggml's tensor names (gguf.get_tensor_name_map), llama's q/k rows
permuted per head (`permute`, as the converter writes it), Gemma's norms stored as 1 + w, the head
left out when tied, 2-D weights in the asked type (gguf.quants.quantize: Q4_0, Q4_1, Q8_0, Q5_0, F16,
...; K-quants, which gguf cannot quantize, by kquants.py after llama.cpp's reference quantizer; IQ4 types
as random valid blocks), a type per tensor for mixes (Q4_K_M), and the vocabulary as
tokenizer.ggml.* metadata. Nothing is downloaded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

from tests.importers.kquants import quantize as quantize_k

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
        "arrows of outrageous fortune, or to take arms against a sea of troubles. 1234567890 the end. ") * 3


@dataclass
class Vocab:
    """What the converter writes under tokenizer.ggml.*."""

    model: str  # gpt2 | llama
    tokens: list[str]
    types: list[int]
    merges: list[str] | None = None
    scores: list[float] | None = None
    pre: str | None = None
    ids: dict[str, int] = field(default_factory=dict)  # bos / eos / unknown / padding -> id
    add_bos: bool | None = None
    add_space_prefix: bool | None = None
    chat_template: str | None = CHATML

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        if self.pre is not None:
            w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        if self.merges is not None:
            w.add_token_merges(self.merges)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        for key, value in self.ids.items():
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
        if self.add_bos is not None:
            w.add_add_bos_token(self.add_bos)
        if self.add_space_prefix is not None:
            w.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template:
            w.add_chat_template(self.chat_template)


def byte_level_vocab(tokenizer_json: str | Path, pre: str) -> Vocab:
    """A gpt2 vocabulary from a byte-level BPE tokenizer.json (its added tokens become control tokens)."""
    data = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    vocab = dict(data["model"]["vocab"])
    for t in data["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["id"] for t in data["added_tokens"] if t["special"]}
    user_defined = {t["id"] for t in data["added_tokens"] if not t["special"]}  # matched whole, not special
    tokens = [t or f"[PAD{i}]" for i, t in enumerate(tokens)]
    types = [3 if i in special else 4 if i in user_defined else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    ids = {}
    for key, name in (("eos", "<|im_end|>"), ("eos", "<|end_of_text|>"), ("bos", "<|begin_of_text|>"),
                      ("eos", "<|endoftext|>"), ("padding", "<|endoftext|>")):
        if name in vocab and key not in ids:
            ids[key] = vocab[name]
    return Vocab("gpt2", tokens, types, merges=merges, pre=pre, ids=ids, add_bos="bos" in ids)


def sentencepiece_vocab(merges: int = 80) -> Vocab:
    """A Llama-style SentencePiece BPE vocabulary learned here on TEXT: <unk>, <s>, </s>, 256 byte tokens,
    the text's characters, then `merges` merged pieces (score = -id, best first, as SentencePiece ranks them)."""
    words = ["\u2581" + w for w in TEXT.split()]
    pieces = [list(w) for w in words]
    chars = sorted({c for w in words for c in w})
    learned: list[str] = []
    for _ in range(merges):
        counts: dict[tuple[str, str], int] = {}
        for p in pieces:
            for a, b in zip(p, p[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        best = max(counts, key=lambda k: (counts[k], k))
        learned.append(best[0] + best[1])
        for p in pieces:
            i = 0
            while i < len(p) - 1:
                if (p[i], p[i + 1]) == best:
                    p[i:i + 2] = [best[0] + best[1]]
                i += 1
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + learned
    types = [2, 3, 3] + [6] * 256 + [1] * (len(chars) + len(learned))
    scores = [0.0] * 259 + [-float(i) for i in range(len(chars) + len(learned))]
    return Vocab("llama", tokens, types, scores=scores, ids={"unknown": 0, "bos": 1, "eos": 2}, add_bos=True,
                 chat_template=None)


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rows of each head from halves order to interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_model(model_type: str, vocab_size: int, seed: int = 0, **overrides):
    """A random-weight transformers model (fp32, eval) of a tiny size."""
    import transformers

    config = dict(model_type=model_type, vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.2, tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    if model_type in ("gemma", "gemma2"):
        config.update(head_dim=16, tie_word_embeddings=True)
    if model_type == "gemma2":  # head_dim = query_pre_attn_scalar as Gemma 2 2B/9B: llama.cpp scales by head_dim
        # (GGUF stores no scalar) and transformers' GGUF reader keeps its default of 256
        config.update(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0)
    config.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    return model.float().eval()


def random_blocks(rows: int, cols: int, qtype: gguf.GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """Random but valid blocks of a type gguf cannot quantize and the kernels do not run (IQ4_NL, IQ4_XS: an fp16
    d first, then indices): [rows, bytes]."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    data[..., 0:2] = np.full((rows, cols // block, 1), 0.002, dtype=np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.IQ4_XS:  # scales_h, scales_l after d: keep them small
        data[..., 2:8] = 0
    return data.reshape(rows, -1)


def quantized_blocks(data: np.ndarray, kind: str) -> np.ndarray:
    """data float32 [N, K] as `kind` blocks: gguf's quantizer, the K-quants by tests/importers/kquants.py
    (after llama.cpp's reference), IQ4 types as random valid blocks."""
    q = gguf.GGMLQuantizationType[kind]
    if kind.endswith("_K"):
        return quantize_k(data, kind)
    if kind.startswith("IQ"):
        return random_blocks(*data.shape, q)
    return gguf.quants.quantize(data, q)


QType = str | Callable[[str, np.ndarray], str]


def write_gguf(path: Path, model, vocab: Vocab, qtype: QType = "F32", *, arch: str | None = None,
               tensor_hook: Callable[[str, np.ndarray], np.ndarray] | None = None, general_name: str = "tiny") -> Path:
    """Write `model` as a GGUF file. qtype: a GGMLQuantizationType name for every 2-D weight, or a function
    (gguf name, data) -> name; 1-D tensors stay F32 as the converter keeps them."""
    cfg = model.config
    arch = arch or cfg.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(general_name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    w.add_rope_freq_base(theta)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch in ("gemma", "gemma2"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    vocab.write(w)
    names = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    table = gguf.get_tensor_name_map(names[cfg.model_type], cfg.num_hidden_layers)  # arch may claim another family
    tied = cfg.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
            continue
        stem, _, suffix = name.rpartition(".")
        gname = f"{table.get_name(stem)}.{suffix}"
        data = tensor.float().numpy().copy()
        if cfg.model_type == "llama" and ".attn_q." in gname:
            data = permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif cfg.model_type == "llama" and ".attn_k." in gname:
            data = permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        if arch in ("gemma", "gemma2") and gname.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if tensor_hook is not None:
            data = tensor_hook(gname, data)
        kind = qtype(gname, data) if callable(qtype) else qtype
        if data.ndim == 1 or kind == "F32":
            w.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))
        elif kind == "F16":
            w.add_tensor(gname, data.astype(np.float16))
        else:
            w.add_tensor(gname, quantized_blocks(data, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    scaling = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
    if scaling.get("rope_type") == "llama3":  # the converter stores Llama 3's rope divisors as a tensor
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(scaling, theta, head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_freqs(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for a llama3 rope_scaling: each frequency's divisor."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)
