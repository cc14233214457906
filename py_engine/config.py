"""Model and generation configs, parsed once from a model's own JSON files.

`ModelConfig` is a frozen dataclass that keeps Hugging Face's field names, so
the torch model, the exporter and the server all read the same words a
`config.json` uses. Family quirks (Gemma's `(1 + w)` norm, Qwen2's qkv bias,
Phi-3's fused projections) are resolved here into plain fields, so model code
branches on features, never on `model_type` strings.

Both rope layouts are read: transformers 4's `rope_theta` + `rope_scaling`
and transformers 5's `rope_parameters` (which folds `rope_theta` in).
Stdlib only: this module runs in Pyodide.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3", "gemma", "gemma2")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Upper bounds far past any real model: a config beyond them is broken or hostile (10**12 layers would
# exhaust memory building the model before any weight is read).
MAX_SIZES = {"vocab_size": 1 << 24, "hidden_size": 1 << 18, "intermediate_size": 1 << 20, "num_hidden_layers": 1024,
             "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
             "max_position_embeddings": 1 << 30}

# Defaults transformers' config classes apply when a key is absent, per family.
# Only the keys whose default differs between families are listed.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "sliding_window": 4096},
    "mixtral": {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 1e6},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "phi3": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
    "gemma": {"rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "tie_word_embeddings": True,
              "hidden_act": "gelu_pytorch_tanh", "head_dim": 256},
    "gemma2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "tie_word_embeddings": True,
               "hidden_act": "gelu_pytorch_tanh", "head_dim": 256, "sliding_window": 4096,
               "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
}


class ConfigError(ValueError):
    """A config.json that ruvllm cannot run, with the reason and what is supported."""


@dataclass(frozen=True)
class RopeParameters:
    """Rotary embedding settings; field names follow transformers' `rope_parameters`."""

    rope_type: str = "default"
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float | None = None  # linear, dynamic, llama3, yarn, longrope
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn, longrope
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn (DeepSeek style)
    mscale_all_dim: float | None = None  # yarn (DeepSeek style)
    truncate: bool | None = None  # yarn
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None  # longrope

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"unsupported rope type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        needs = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("factor",),
            "longrope": ("short_factor", "long_factor"),
        }.get(self.rope_type, ())
        missing = [n for n in needs if getattr(self, n) is None]
        if missing:
            raise ConfigError(f"rope type {self.rope_type!r} needs {', '.join(missing)} in rope_scaling / rope_parameters")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("rope_type", "truncate") or value is None:
                continue
            numbers = value if isinstance(value, tuple) else (value,)
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in numbers):
                raise ConfigError(f"rope {f.name} must be a finite number, got {value!r:.80}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], rope_theta: float) -> "RopeParameters":
        """Read one `rope_scaling` / `rope_parameters` dict (either layout)."""
        d = dict(d)
        rope_type = d.pop("rope_type", None) or d.pop("type", None) or "default"
        d.pop("type", None)
        # Older Phi-3 checkpoints call LongRoPE "su"; transformers maps it the same way.
        rope_type = {"su": "longrope"}.get(rope_type, rope_type)
        known = {f.name for f in fields(cls)} - {"rope_type"}
        kwargs: dict[str, Any] = {k: v for k, v in d.items() if k in known and v is not None}
        kwargs.setdefault("rope_theta", rope_theta)
        for k in ("short_factor", "long_factor"):
            if k in kwargs:
                kwargs[k] = tuple(float(x) for x in kwargs[k])
        return cls(rope_type=rope_type, **kwargs)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's architecture, with Hugging Face field names, validated once."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_parameters: RopeParameters = field(default_factory=RopeParameters)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before rope
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj tensors
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None  # Gemma 2: attention scale is its -1/2 power
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    num_local_experts: int | None = None  # Mixtral MoE
    num_experts_per_tok: int | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    architectures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in REQUIRED_FIELDS + ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            _check_size(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"unsupported layer types {bad}; supported: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("sliding_attention layers need a positive sliding_window")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")

    # --- derived values -------------------------------------------------
    @property
    def rope_theta(self) -> float:
        return self.rope_parameters.rope_theta

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """transformers-4 view of the rope settings (None for plain rope)."""
        rp = self.rope_parameters
        if rp.rope_type == "default":
            return None
        return {f.name: getattr(rp, f.name) for f in fields(rp)
                if f.name != "rope_theta" and getattr(rp, f.name) is not None}

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_scale(self) -> float:
        """Multiplier of q.k; Gemma 2 replaces head_dim by query_pre_attn_scalar."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def is_gemma(self) -> bool:
        """Gemma norms scale by (1 + w) and embeddings by sqrt(hidden_size)."""
        return self.model_type in ("gemma", "gemma2")

    @property
    def embedding_multiplier(self) -> float:
        return math.sqrt(self.hidden_size) if self.is_gemma else 1.0

    @property
    def sandwich_norms(self) -> bool:
        """Gemma 2 adds post-attention and post-feedforward norms to each block."""
        return self.model_type == "gemma2"

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def num_parameters(self) -> int:
        """Parameter count of the decoder these settings describe."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.attention_bias else 0) + (h if self.o_proj_bias else 0)
        experts = self.num_local_experts or 1
        mlp = experts * (3 * h * i + ((2 * i + h) if self.mlp_bias else 0))
        mlp += h * self.num_local_experts if self.num_local_experts else 0  # router
        norms = (4 if self.sandwich_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * (attn + mlp + norms) + embed + h

    # --- parsing --------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Parse a `config.json` (or a model directory that holds one); any error names the file."""
        path, data = _read_json(path, "config.json")
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:
            message = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
            raise ConfigError(f"{path}: {message}") from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Parse a config dict with Hugging Face keys for a supported family."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a model config must be a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; ruvllm supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        missing = [k for k in REQUIRED_FIELDS if d.get(k) is None]
        if missing:
            raise ConfigError(f"{model_type} config is missing {', '.join(missing)}; required: {', '.join(REQUIRED_FIELDS)}")
        get = _getter(d, _FAMILY_DEFAULTS[model_type])
        heads = _check_size("num_attention_heads", d["num_attention_heads"])
        layers = _check_size("num_hidden_layers", d["num_hidden_layers"])  # before anything is sized by it
        sliding_window = _sliding_window(model_type, get)
        eos = d.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or d["hidden_size"] // heads,
            hidden_act=_activation(model_type, d, get),
            max_position_embeddings=get("max_position_embeddings"),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_parameters=_rope(d, get),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(get("attention_bias", False)),
            o_proj_bias=model_type not in ("qwen2",) and bool(get("attention_bias", False)),
            mlp_bias=bool(get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            fused_projections=model_type == "phi3",
            sliding_window=sliding_window,
            layer_types=_layer_types(model_type, d, layers, sliding_window, get),
            query_pre_attn_scalar=get("query_pre_attn_scalar") if model_type == "gemma2" else None,
            attn_logit_softcapping=get("attn_logit_softcapping") if model_type == "gemma2" else None,
            final_logit_softcapping=get("final_logit_softcapping") if model_type == "gemma2" else None,
            num_local_experts=d.get("num_local_experts") if model_type == "mixtral" else None,
            num_experts_per_tok=d.get("num_experts_per_tok", 2) if model_type == "mixtral" else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=_id_tuple(eos),
            pad_token_id=d.get("pad_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            architectures=tuple(d.get("architectures") or ()),
        )


ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "relu")


# Keys for which an explicit JSON null means "none", not "use the default"
# (Mistral v0.3 sets sliding_window to null to turn Mistral v0.1's 4096 off).
_NULL_MEANS_NONE = frozenset({"sliding_window", "attn_logit_softcapping", "final_logit_softcapping"})


def longrope_switch_length(config: ModelConfig) -> int | None:
    """Sequence length past which LongRoPE uses its long factors, else None.

    Keys cached before a sequence crosses it were rotated with the short
    factors; transformers' generate() then recomputes the whole cache once, and
    so do the backends (each decode() that crosses it prefills every token again).
    """
    rope = config.rope_parameters
    if rope.rope_type != "longrope":
        return None
    return rope.original_max_position_embeddings or config.max_position_embeddings


def longrope_recomputes(switch_length: int | None, tokens: int) -> bool:
    """Whether a sequence of `tokens` tokens, the last just appended, has just crossed LongRoPE's switch length
    (longrope_switch_length): its backend then prefills every token again, with the long factors."""
    return switch_length is not None and tokens == switch_length + 1


def _read_json(path: str | Path, name: str) -> tuple[Path, Any]:
    """A JSON file (or `name` inside a directory), with one ConfigError for missing or malformed."""
    path = Path(path)
    if path.is_dir():
        path = path / name
    try:
        return path, json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no {name} at {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path} nests arrays or objects too deeply to be a config") from None
    except OSError as e:  # a folder in its place, no permission
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None


def _getter(d: Mapping[str, Any], defaults: Mapping[str, Any]):
    """Read a key, falling back to the family default, then to `fallback`."""
    def get(key: str, fallback: Any = None) -> Any:
        if key in d and (d[key] is not None or key in _NULL_MEANS_NONE):
            return d[key]
        return defaults.get(key, fallback)
    return get


def _activation(model_type: str, d: Mapping[str, Any], get) -> str:
    # Gemma 2 names it hidden_activation; Gemma 1 checkpoints carry an old
    # "gelu" that transformers overrides with the tanh approximation.
    if model_type == "gemma2":
        return d.get("hidden_activation") or get("hidden_act")
    if model_type == "gemma":
        return d.get("hidden_activation") or "gelu_pytorch_tanh"
    return get("hidden_act", "silu")


def _rope(d: Mapping[str, Any], get) -> RopeParameters:
    params = d.get("rope_parameters")
    theta = float(get("rope_theta", 10000.0))
    if isinstance(params, Mapping) and "rope_type" not in params and "rope_theta" not in params:
        # Per-layer-type rope (Gemma 3 style): ruvllm reads the full-attention entry.
        params = params.get("full_attention") or next(iter(params.values()), None)
    scaling = params if isinstance(params, Mapping) else d.get("rope_scaling")
    rope = RopeParameters.from_dict(scaling or {}, theta)
    extra = {}
    if d.get("partial_rotary_factor") is not None and rope.partial_rotary_factor == 1.0:
        extra["partial_rotary_factor"] = float(d["partial_rotary_factor"])
    if rope.rope_type == "longrope" and d.get("model_type") == "phi3":
        # Phi-3 keeps original_max_position_embeddings at the top level, and transformers'
        # Phi3Config (default 4096) wins over any value inside rope_scaling.
        extra["original_max_position_embeddings"] = d.get("original_max_position_embeddings") or 4096
    elif rope.rope_type == "longrope" and rope.original_max_position_embeddings is None:
        extra["original_max_position_embeddings"] = d.get("original_max_position_embeddings")
    if extra:
        rope = RopeParameters(**{**{f.name: getattr(rope, f.name) for f in fields(rope)}, **extra})
    return rope


def _sliding_window(model_type: str, get) -> int | None:
    if model_type == "llama" or model_type == "gemma":
        return None
    if model_type in ("qwen2", "qwen3") and not get("use_sliding_window", False):
        return None
    return get("sliding_window")  # an explicit null is kept as "no window" by _getter


def _layer_types(model_type: str, d: Mapping[str, Any], layers: int, window: int | None, get) -> tuple[str, ...]:
    if d.get("layer_types") is not None:
        types = tuple(d["layer_types"])
        return types if window else tuple("full_attention" for _ in types)
    if window is None:
        return ("full_attention",) * layers
    if model_type == "gemma2":  # alternating, starting with a sliding layer
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
    if model_type in ("qwen2", "qwen3"):
        first = get("max_window_layers", layers)
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    return ("sliding_attention",) * layers


def _check_size(name: str, value: Any) -> int:
    limit = MAX_SIZES.get(name, 1 << 30)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
        raise ConfigError(f"{name} must be a positive integer of at most {limit}, got {value!r:.80}")
    return value


def _id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"token ids must be integers >= 0, got {value!r:.80}")
    return ids


@dataclass(frozen=True)
class GenerationConfig:
    """The defaults a checkpoint's `generation_config.json` asks for."""

    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None
    max_length: int | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GenerationConfig":
        if not isinstance(d, Mapping):
            raise ConfigError(f"a generation config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known and v is not None}
        kwargs["eos_token_id"] = _id_tuple(d.get("eos_token_id"))
        for name, value in kwargs.items():
            kind = _GENERATION_TYPES.get(name)
            if kind is not None and (not isinstance(value, kind) or (isinstance(value, bool) and bool not in kind)):
                raise ConfigError(f"{name} must be {' or '.join(k.__name__ for k in kind)}, got {value!r:.80}")
        return cls(**kwargs)

    @classmethod
    def from_model_dir(cls, folder: str | Path) -> "GenerationConfig":
        """A model folder's generation_config.json, or the defaults when it has none."""
        path = Path(folder) / "generation_config.json"
        return cls.from_file(path) if path.is_file() else cls()

    @classmethod
    def from_file(cls, path: str | Path) -> "GenerationConfig":
        """Parse a `generation_config.json` (or a model directory holding one); errors name the file."""
        path, data = _read_json(path, "generation_config.json")
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


_GENERATION_TYPES: dict[str, tuple[type, ...]] = {
    "bos_token_id": (int,), "pad_token_id": (int,), "do_sample": (bool,), "temperature": (int, float),
    "top_k": (int,), "top_p": (int, float), "min_p": (int, float), "repetition_penalty": (int, float),
    "max_new_tokens": (int,), "max_length": (int,)}
