"""A draft model for speculative decoding, distilled from the target's own outputs (`ruvllm learn distill-draft`).

    report = distill_draft("smollm2-135m-instruct", "draft/", layers=2)
    LLM("smollm2-135m-instruct", speculative={"model": "draft/", "num_speculative_tokens": 4})

The student is the target cut to `layers` decoder layers (evenly spaced, first and last kept: deep.kept_layers;
embedding, final norm and head copied), so it starts from the target's own weights and has its vocabulary.
It learns from what the target itself writes, which is what a draft must guess: for each prompt, the target's
greedy answer from ruvllm's engine (its quantized weights and kernels, the arithmetic speculation verifies
against); then the student matches the target's next-token distribution at every answer position (forward
KL at temperature 1, DistillSpec's on-policy recipe; the teacher's logits from the target dequantized to
float32). Prompts: a JSONL file ({"messages": [...]} or {"prompt": "..."} a line), else built-in instructions
through the chat template (`data="chat"`), else windows of the folder's validation.txt (`data="text"`). The
last `eval_prompts` prompts are held out: the draft's acceptance on them, drafting for the target at k tokens
a step, is measured and written to the folder (draft_report.json and config.json's ruvllm_learning), with the
acceptance of the same cut before training beside it. The folder is a normal model folder (float32
safetensors): any command loads it, and `quantization` in the speculative config quantizes it at load.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .deep import _Base, _batches, kept_layers, student_of, write_model

TOPICS = ("the ocean", "a small town", "friendship", "the moon", "coffee", "trains", "a lost key", "winter",
          "learning a language", "volcanoes", "a robot", "gardening", "the history of paper", "bees",
          "saving money", "a rainy day", "chess", "bread", "the internet", "a lighthouse")
INSTRUCTIONS = ("Tell me about {}.", "Write a short story about {}.", "Give me three tips related to {}.",
                "Explain {} to a child.", "Write a poem about {}.", "What are common questions people ask about {}?",
                "Describe {} in a few sentences.", "List five facts about {}.")
MAX_PROMPTS = 10_000


@dataclass(frozen=True)
class DraftSettings:
    layers: int = 2
    max_tokens: int = 96  # of each target answer
    num_prompts: int = 96
    eval_prompts: int = 12  # held out, for the acceptance measurement
    epochs: int = 3
    lr: float = 3e-4
    batch_size: int = 4
    num_speculative_tokens: int = 4  # k of the acceptance measurement
    data: str = "chat"  # or "text"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "max_tokens", "num_prompts", "epochs", "batch_size", "num_speculative_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)!r}")
        if not 0 <= self.eval_prompts < self.num_prompts:
            raise ValueError(f"--eval-prompts must be in [0, {self.num_prompts}), got {self.eval_prompts}")
        if not 0 < self.lr < 1:
            raise ValueError(f"--lr must be in (0, 1), got {self.lr}")
        if self.data not in ("chat", "text"):
            raise ValueError(f"--data must be chat or text, got {self.data!r}")


def prompt_ids(llm: Any, settings: DraftSettings, prompts_file: str | Path | None) -> list[list[int]]:
    """Token ids of every prompt: the file's, else the built-in instructions or the folder's own text."""
    rng = random.Random(settings.seed)
    if prompts_file is not None:
        items = []
        for number, line in enumerate(Path(prompts_file).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError:
                raise ValueError(f"--prompts {prompts_file}:{number}: not a JSON object") from None
            if not isinstance(item, dict) or not (isinstance(item.get("messages"), list)
                                                  or isinstance(item.get("prompt"), str)):
                raise ValueError(f"--prompts {prompts_file}:{number}: needs \"messages\" (a list) or \"prompt\"")
            items.append(item)
            if len(items) > MAX_PROMPTS:
                raise ValueError(f"--prompts {prompts_file}: more than {MAX_PROMPTS} prompts")
        rng.shuffle(items)
        items = items[:settings.num_prompts]
        return [llm.encode(llm.chat_prompt(i["messages"]), add_special_tokens=False) if "messages" in i
                else llm.encode(i["prompt"]) for i in items]
    if settings.data == "chat":
        pairs = [(t, s) for t in INSTRUCTIONS for s in TOPICS]
        rng.shuffle(pairs)
        return [llm.encode(llm.chat_prompt([{"role": "user", "content": t.format(s)}]), add_special_tokens=False)
                for t, s in pairs[:settings.num_prompts]]
    text = (Path(llm.path) / "validation.txt").read_text(encoding="utf-8", errors="replace")
    ids = llm.tokenizer.encode(text[: 400 * settings.num_prompts], add_special_tokens=False)
    starts = sorted(rng.sample(range(max(1, len(ids) - 32)), min(settings.num_prompts, max(1, len(ids) - 32))))
    return [ids[s:s + 24] for s in starts]


def target_answers(llm: Any, prompts: list[list[int]], max_tokens: int,
                   progress: Callable[[int, int, float], None] | None) -> list[tuple[list[int], list[int]]]:
    """(prompt, the target's greedy answer) pairs, from the engine itself."""
    from py_engine.sampling_params import SamplingParams

    room = llm.max_context - max_tokens
    out = []
    for n, ids in enumerate(prompts):
        ids = ids[-room:]
        done = llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
        out.append((ids, list(done.token_ids)))
        if progress is not None:
            progress(n + 1, len(prompts), float(len(done.token_ids)))
    return out


def train_student(base: _Base, keep: list[int], pairs: list[tuple[list[int], list[int]]], settings: DraftSettings,
                  progress: Callable[[int, int, float], None] | None) -> tuple[Any, dict[str, Any]]:
    """The cut student, trained to match the teacher on the answer positions of `pairs` (forward KL, T = 1)."""
    torch.manual_seed(settings.seed)
    teacher = base.model.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    raw = json.loads((base.path / "config.json").read_text(encoding="utf-8"))
    student, changes = student_of(teacher, keep, raw)
    student.train()
    for p in student.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(student.parameters(), lr=settings.lr, weight_decay=0.0)
    batches = _batches([p for p in pairs if p[1]], settings.epochs, settings.batch_size, settings.seed)
    for k, batch in enumerate(batches):
        width = max(len(a) + len(b) for a, b in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width)  # 1 where the position predicts an answer token
        for row, (prompt, answer) in enumerate(batch):
            ids[row, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
            mask[row, len(prompt) - 1:len(prompt) + len(answer) - 1] = 1
        positions = torch.arange(width)[None].expand_as(ids)
        with torch.no_grad():
            target = F.log_softmax(teacher(ids, positions), -1)  # [B, T, V]
        with torch.enable_grad():
            logp = F.log_softmax(student(ids, positions), -1)
            kl = (target.exp() * (target - logp)).sum(-1)  # [B, T]
            loss = (kl * mask).sum() / mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if progress is not None:
            progress(k + 1, len(batches), float(loss.detach()))
    return student.eval(), changes


def acceptance(llm_target: str, draft: str | Path, prompts: list[list[int]], settings: DraftSettings,
               cache_dir: str | None) -> dict[str, Any]:
    """The draft's acceptance drafting k tokens a step for the target on `prompts` (greedy, no throttle)."""
    from py_engine.backends.torch import LLM
    from py_engine.sampling_params import SamplingParams
    from py_engine.speculative import SpecStats

    llm = LLM(llm_target, cache_dir=cache_dir, speculative={
        "model": str(draft), "num_speculative_tokens": settings.num_speculative_tokens, "acceptance_floor": 0})
    total = SpecStats()
    for ids in prompts:
        done = llm.generate(ids[-(llm.max_context - settings.max_tokens):],
                            SamplingParams(temperature=0, max_tokens=settings.max_tokens))
        total.add(SpecStats(**{k: done.speculative[k] for k in ("num_drafts", "num_draft_tokens",
                                                                  "num_accepted_tokens", "accepted_per_position")}))
    out = total.to_dict()
    out["per_position_rate"] = [n / total.num_drafts for n in total.accepted_per_position] if total.num_drafts else []
    return out


def distill_draft(model: str, out: str | Path, settings: DraftSettings = DraftSettings(), *,
                  prompts_file: str | Path | None = None, cache_dir: str | None = None,
                  progress: Callable[[str], Callable[[int, int, float], None]] | None = None) -> dict[str, Any]:
    """Write the distilled draft to `out`; returns the report (what it measured), also in out/draft_report.json."""
    from py_engine.backends.torch import LLM

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} must be a new or empty folder")
    show = progress or (lambda _label: None)
    start = time.perf_counter()
    base = _Base(model, cache_dir)
    keep = kept_layers(len(base.model.model.layers), settings.layers)
    llm = LLM(model, cache_dir=cache_dir)
    prompts = prompt_ids(llm, settings, prompts_file)
    if len(prompts) <= settings.eval_prompts:
        raise ValueError(f"{len(prompts)} prompts leave none to train on after {settings.eval_prompts} held out")
    held = prompts[len(prompts) - settings.eval_prompts:] if settings.eval_prompts else []
    pairs = target_answers(llm, prompts[:len(prompts) - len(held)], settings.max_tokens, show("target answers"))
    del llm
    answered = time.perf_counter()
    student, changes = train_student(base, keep, pairs, settings, show("train"))
    trained = time.perf_counter()
    report: dict[str, Any] = {"target": model, "kept_layers": keep, "settings": settings.__dict__,
                              "train_prompts": len(pairs), "train_answer_tokens": sum(len(a) for _, a in pairs),
                              "seconds": {"answers": answered - start, "train": trained - answered}}
    write_model(student, base.path, out, {"ruvllm_learning": {"method": "distill-draft", **report}}, **changes)
    if held:
        report["held_out_prompts"] = len(held)
        report["acceptance"] = acceptance(model, out, held, settings, cache_dir)
        untrained = out.parent / f".{out.name}-untrained"
        cut, _ = student_of(base.model, keep, json.loads((base.path / "config.json").read_text(encoding="utf-8")))
        write_model(cut, base.path, untrained, {}, **changes)
        try:
            report["acceptance_untrained"] = acceptance(model, untrained, held, settings, cache_dir)
        finally:
            import shutil
            shutil.rmtree(untrained, ignore_errors=True)
        report["seconds"]["measure"] = time.perf_counter() - trained
    (out / "draft_report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report
