"""The deep loop: a full fine-tune, or a smaller student distilled, from a witness log; a model folder out.

    finetune("tiny-shakespeare", "logs/", "tuned/")          # every weight trained on the feedback
    distill("tiny-shakespeare", "logs/", "student/", layers=3)

Fine-tune: cross-entropy on the target tokens of every trainable feedback
(corrections, accepted answers), all weights in float32, AdamW.
Distil: the teacher is the base model with the log's current consolidated
adapter applied (so what was learned from feedback carries over); the
student keeps `layers` of its decoder layers, evenly spaced (first and last
included), and learns to match the teacher's next-token distribution
(KL at temperature T, Hinton et al.) over every logged prompt and answer and
the model folder's own text. Either writes a Hugging Face folder (config,
model.safetensors, tokenizer and generation files) that every ruvllm command
and transformers load.
"""
from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .lora import applied
from .objective import Example, batch_nll, example_from_feedback
from .store import AdapterStore

COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
          "chat_template.jinja", "validation.txt", "calibration.txt")
MAX_LOG_RECORDS = 200_000


def log_records(folder: str | Path, stream: str) -> Iterator[dict[str, Any]]:
    """Records of one witness-log stream ("witness" or "feedback"), oldest first; torn lines skipped."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"--log {folder}: no such folder (the server's --witness-log DIR)")
    count = 0
    for path in sorted(folder.glob(f"{stream}-[0-9][0-9][0-9][0-9][0-9][0-9].jsonl")):
        with open(path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    count += 1
                    if count > MAX_LOG_RECORDS:
                        return
                    yield record


class _Base:
    """The model to start from, its tokenizer and EOS, loaded once."""

    def __init__(self, model: str, cache_dir: str | None = None) -> None:
        from py_engine.config import GenerationConfig
        from py_engine.generate import eos_token_ids
        from py_engine.hub import resolve_model
        from py_engine.models import load_model
        from py_engine.tokenizer import Tokenizer

        self.path = resolve_model(model, cache_dir)
        self.model, self.config = load_model(self.path, dtype="float32", dequantize=True)
        self.tokenizer = Tokenizer.from_pretrained(self.path)
        eos = eos_token_ids(GenerationConfig.from_model_dir(self.path), self.config, self.tokenizer)
        self.eos = eos[0] if eos else None
        self.max_len = int(self.config.max_position_embeddings)

    def feedback_examples(self, log: str | Path) -> list[Example]:
        return [e for r in log_records(log, "feedback")
                if (e := example_from_feedback(r, self.tokenizer, self.eos, 512, self.max_len)) is not None]


def _batches(items: list, epochs: int, batch_size: int, seed: int) -> list[list]:
    rng, order, out = random.Random(seed), list(items), []
    for _ in range(epochs):
        rng.shuffle(order)
        out += [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return out


def finetune(model: str, log: str | Path, out: str | Path, *, epochs: int = 3, lr: float = 1e-4,
             batch_size: int = 8, seed: int = 0, cache_dir: str | None = None,
             progress: Callable[[int, int, float], None] | None = None) -> Path:
    """Every weight trained on the log's feedback; the model folder written to `out`."""
    base = _Base(model, cache_dir)
    examples = base.feedback_examples(log)
    if not examples:
        raise ValueError(f"--log {log}: no feedback to learn from (corrections or ratings of 1)")
    net = base.model.train()
    for p in net.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    batches = _batches(examples, epochs, batch_size, seed)
    with torch.enable_grad():
        for k, batch in enumerate(batches):
            nll, count = batch_nll(net, batch)
            loss = nll / max(count, 1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if progress is not None:
                progress(k + 1, len(batches), float(loss.detach()))
    return write_model(net.eval(), base.path, out, {"ruvllm_learning": {"method": "finetune", "log": str(log),
                                                                        "examples": len(examples)}})


def _sequences(base: _Base, log: str | Path, window: int, text_tokens: int) -> list[list[int]]:
    """What the student sees: every logged prompt + answer, corrections, and the folder's own text."""
    seqs = []
    for r in log_records(log, "witness"):
        for p, o in zip(r.get("prompts") or [], r.get("outputs") or []):
            seqs.append(list(p.get("token_ids") or []) + list(o.get("token_ids") or []))
    seqs += [list(e.prompt_ids) + list(e.target_ids) for e in base.feedback_examples(log)]
    text = base.path / "validation.txt"
    if text_tokens and text.is_file():
        ids = base.tokenizer.encode(text.read_text(encoding="utf-8", errors="replace")[: 16 * text_tokens],
                                    add_special_tokens=False)[:text_tokens]
        seqs += [ids[i:i + window] for i in range(0, len(ids), window)]
    return [s[-window:] for s in seqs if len(s) >= 2]


def kept_layers(total: int, layers: int) -> list[int]:
    """`layers` indices out of `total`, evenly spaced, first and last included."""
    if not 1 <= layers <= total:
        raise ValueError(f"--layers must be in [1, {total}] (the teacher has {total}), got {layers}")
    return sorted({round(i * (total - 1) / (layers - 1)) for i in range(layers)}) if layers > 1 else [0]


def student_of(teacher: nn.Module, keep: list[int], raw_config: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """A copy of the teacher with only the decoder layers `keep`, and its config.json changes (the
    kept layers' attention types written out, so sliding windows stay where they were)."""
    from py_engine.config import ModelConfig

    student = copy.deepcopy(teacher)
    student.model.layers = nn.ModuleList(student.model.layers[i] for i in keep)
    for new, layer in enumerate(student.model.layers):
        layer.self_attn.layer = new  # its index in the KV cache
    changes: dict[str, Any] = {"num_hidden_layers": len(keep)}
    if teacher.config.sliding_window:
        changes["layer_types"] = [teacher.config.layer_types[i] for i in keep]
    student.config = ModelConfig.from_dict({**raw_config, **changes})
    return student, changes


def distill(model: str, log: str | Path, out: str | Path, *, layers: int | None = None, epochs: int = 2,
            lr: float = 5e-4, batch_size: int = 8, temperature: float = 2.0, text_tokens: int = 16384,
            window: int | None = None, seed: int = 0, cache_dir: str | None = None,
            progress: Callable[[int, int, float], None] | None = None) -> Path:
    """A smaller student (half the layers by default) distilled from the base + the current adapter."""
    base = _Base(model, cache_dir)
    teacher = base.model.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    store = AdapterStore(Path(log) / "adapters") if (Path(log) / "adapters").is_dir() else None
    version = store.current() if store is not None else None
    adapter = store.load(version) if version is not None else None
    keep = kept_layers(len(teacher.model.layers), layers or max(1, len(teacher.model.layers) // 2))
    raw = json.loads((base.path / "config.json").read_text(encoding="utf-8"))
    student, changes = student_of(teacher, keep, raw)
    student.train()
    for p in student.parameters():
        p.requires_grad_(True)
    seqs = _sequences(base, log, window or min(base.max_len, 256), text_tokens)
    if not seqs:
        raise ValueError(f"--log {log}: nothing to distil on (no logged completions, feedback or model text)")
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    batches = _batches(seqs, epochs, batch_size, seed)
    for k, batch in enumerate(batches):
        ids, mask = _pad(batch)
        positions = torch.arange(ids.shape[1])[None].expand_as(ids)
        with torch.no_grad(), applied(teacher, adapter):
            target = F.log_softmax(teacher(ids, positions) / temperature, -1)  # [B, T, V]
        with torch.enable_grad():
            logp = F.log_softmax(student(ids, positions) / temperature, -1)
            kl = (target.exp() * (target - logp)).sum(-1)  # [B, T]
            loss = (kl * mask).sum() / mask.sum() * temperature ** 2
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if progress is not None:
            progress(k + 1, len(batches), float(loss.detach()))
    return write_model(student.eval(), base.path, out, {"ruvllm_learning": {
        "method": "distill", "log": str(log), "teacher_adapter": f"sona-v{version}" if version else None,
        "sequences": len(seqs), "kept_layers": keep}}, **changes)


def _pad(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width)
    for b, s in enumerate(batch):
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = 1
    return ids, mask


def write_model(model: nn.Module, source: Path, out: str | Path, extra: dict[str, Any], **config_changes: Any) -> Path:
    """A Hugging Face folder: config.json (the source's, changed), float32 model.safetensors, the tokenizer."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and (not out.is_dir() or out.resolve() == Path(source).resolve()):
        raise ValueError(f"--out {out} must be a new folder or one other than the model's")
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((Path(source) / "config.json").read_text(encoding="utf-8"))
    raw.pop("quantization_config", None)
    raw.update(config_changes, torch_dtype="float32", **extra)
    state = {name: p.detach().float().contiguous() for name, p in model.named_parameters()}
    for stale in ("model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"):
        (out / stale).unlink(missing_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    for name in COPIED:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, out / name)
    return out
