"""The learning loops' settings (SONA): one frozen dataclass, validated once, stdlib only (ring 0).

    cfg = SonaConfig(micro_rank=2, micro_steps=3, ewc_lambda=100.0)

Instant loop: a MicroLoRA of rank `micro_rank` on `micro_modules` (per
pattern, with the gate) or `target_modules` (per session, gate=False) of the
last `micro_layers` decoder layers, trained at most `micro_steps` Adam steps
at `micro_lr` on each accepted or corrected completion; its frozen pass runs
in `instant_dtype`.
Background loop: every `consolidate_every` feedbacks (or `consolidate_interval_s`
seconds, when set), one LoRA of rank `rank` on `target_modules` of the last
`layers` layers is trained on all logged feedback for `epochs` passes in
batches of `batch_size` at `lr`, with the EWC penalty `ewc_lambda` * sum of
F (dW)^2 (F: the base's diagonal Fisher on `fisher_tokens` of its own
validation text in slices of `fisher_window` tokens, normalised to mean 1;
0 turns EWC off). `fold_sessions` > 0
adds that weight of each session's MicroLoRA into the consolidated adapter
(which then reaches every session).

Retrieval gate (`gate`, the default): each correction or accepted answer
becomes a pattern (bank/): its question's embedding (`embedder`: "minilm",
all-MiniLM-L6-v2, or "model", the model's own hidden states after layer
`embed_layer`), and a MicroLoRA trained on that pair only (instant.py:
`micro_steps` is then the most steps; they stop once the answer wins). A
request whose question is at least `gate_threshold` similar to a pattern of
its session (or a global one) and shares its keywords (`gate_keywords`) gets
what `apply` says: "lora" (the pattern's MicroLoRA), "both" (and the pattern
as a previous turn of the chat) or "context"; a request near no pattern
runs on the base. Consolidation trains one LoRA of rank `rank` in the
MicroLoRAs' shape on every pattern at once (at most `consolidate_steps`
steps at `micro_lr`), keeping the base's predictions on `keep_tokens` of its
own sampled text (KL, `keep_weight`; consolidate.py), makes the patterns
global (each then brings, in every session, the consolidated adapter and,
with `global_micro`, its own MicroLoRA over it), and keeps the gate; `layers`, `target_modules`, `lr`, `epochs`,
`batch_size` and the EWC fields are gate=False's consolidation. `gate=False` is the
per-session MicroLoRA on every request of the session (the ablation).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

# Peft's names for a Llama block's linear layers.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class SonaConfig:
    target_modules: tuple[str, ...] = ("o_proj", "down_proj")
    micro_modules: tuple[str, ...] = ("down_proj",)  # a pattern's MicroLoRA's projections (gate=False: target_modules)
    micro_rank: int = 4
    micro_layers: int = 1
    micro_steps: int = 20
    micro_lr: float = 5e-2
    micro_alpha: float | None = None  # lora_alpha of a MicroLoRA; None: = its rank (scaling 1)
    micro_anchors: int = 0  # other logged prompts whose next-token distribution the update must keep
    micro_anchor_weight: float = 1.0
    instant_dtype: str = "auto"  # the instant update's frozen pass: "float32", "bfloat16", "auto" (bf16 where native)
    rank: int = 8
    layers: int = 0  # decoder layers of the consolidated LoRA, counted from the last; 0: all
    lr: float = 5e-3
    epochs: int = 4
    batch_size: int = 8
    ewc_lambda: float = 10.0
    fisher_tokens: int = 4096
    fisher_window: int = 32  # tokens per Fisher sample: smaller is closer to a per-token Fisher
    consolidate_steps: int = 400  # with the gate: the most steps of the patterns' LoRA (consolidate.py)
    keep_tokens: int = 512  # with the gate: tokens of the base's own (sampled) text whose predictions are kept
    keep_weight: float = 1.0  # with the gate: weight of the KL that keeps them
    global_micro: bool = True  # a promoted pattern brings its own MicroLoRA over the consolidated adapter
    consolidate_every: int = 16  # feedbacks; 0: only on request or interval
    consolidate_interval_s: float = 0.0  # 0: no timer
    fold_sessions: float = 0.0
    max_sessions: int = 64  # MicroLoRAs kept (each is an adapter slot the server computes): LRU beyond
    max_target_tokens: int = 512  # tokens of one trained answer (a longer correction is cut)
    seed: int = 0
    gate: bool = True
    gate_threshold: float = 0.7
    gate_keywords: bool = True
    apply: str = "lora"  # what a matched pattern carries: "lora", "both" (and the pattern as context), "context"
    embedder: str = "minilm"  # "minilm" (all-MiniLM-L6-v2) or "model" (the model's own hidden states)
    embed_layer: int = 0  # with embedder="model": the layer whose output is pooled
    max_patterns: int = 4096
    max_patterns_per_session: int = 256

    def __post_init__(self) -> None:
        for name in ("target_modules", "micro_modules"):
            value = getattr(self, name)
            if isinstance(value, str) or not value or any(m not in PROJECTIONS for m in value):
                raise ValueError(f"{name}: each one of {', '.join(PROJECTIONS)}; got {value!r}")
        for name, lo, hi in (("micro_rank", 1, 64), ("micro_layers", 1, 1024), ("micro_steps", 0, 1000),
                             ("micro_anchors", 0, 64),
                             ("rank", 1, 256), ("layers", 0, 1024), ("epochs", 0, 1000), ("batch_size", 1, 1024),
                             ("fisher_tokens", 0, 1 << 22), ("fisher_window", 2, 1 << 16),
                             ("consolidate_every", 0, 1 << 20), ("consolidate_steps", 1, 100_000),
                             ("keep_tokens", 0, 1 << 16),
                             ("max_sessions", 1, 1 << 20), ("max_target_tokens", 1, 1 << 16),
                             ("embed_layer", 0, 1024), ("max_patterns", 1, 1 << 20),
                             ("max_patterns_per_session", 1, 1 << 20)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ValueError(f"{name}: an integer in [{lo}, {hi}], got {value!r}")
        for name in ("keep_weight", "micro_anchor_weight", "micro_lr", "lr", "ewc_lambda", "consolidate_interval_s", "fold_sessions"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: a finite number >= 0, got {value!r}")

        if self.instant_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"instant_dtype: auto, float32 or bfloat16, got {self.instant_dtype!r}")
        if self.apply not in ("both", "lora", "context"):
            raise ValueError(f"apply: both, lora or context, got {self.apply!r}")
        if self.embedder not in ("minilm", "model"):
            raise ValueError(f"embedder: minilm or model, got {self.embedder!r}")
        if not isinstance(self.gate_threshold, (int, float)) or not -1.0 <= self.gate_threshold <= 1.0:
            raise ValueError(f"gate_threshold: a cosine similarity in [-1, 1], got {self.gate_threshold!r}")
        for name in ("gate", "gate_keywords", "global_micro"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: true or false, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, raw: dict) -> "SonaConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"unknown learning settings: {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        raw = {k: tuple(v) if k in ("target_modules", "micro_modules") and isinstance(v, list) else v
               for k, v in raw.items()}
        return cls(**raw)
