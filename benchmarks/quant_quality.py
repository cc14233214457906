"""Quality of each quantization method: perplexity through the real load path (`ruvllm eval ppl`'s).

    .venv/bin/python benchmarks/quant_quality.py                     # both models, every method
    .venv/bin/python benchmarks/quant_quality.py --models builtin --max-tokens 20000

For each row the model is loaded, quantized by `load_quantized` (QuantLinear / W8A8Linear and their
kernels, the LM head int8 per channel as QuantConfig defaults) and scored by py_engine.models.evaluate
(window = the model's context, stride half of it). Columns: perplexity, its change against fp32,
the weights' size in memory (float tensors + the kernels' codes, scales, zero points; a tied table
counted once; the kernels hold 2- and 3-bit codes in 4-bit slots), the size of the GPTQ/AWQ checkpoint
`ruvllm quantize` writes (n/a for SmoothQuant, which has no layout), and the quantization time.

Texts:
- tiny-shakespeare: its held-out validation split (Julius Caesar and Twelfth Night, never trained on);
  calibration uses the model's calibration.txt, a slice of the training split.
- stories260K (../shared/fixtures/checkpoints, imported with `ruvllm import-llama2c`): no TinyStories
  text exists on this machine, so the held-out text is benchmarks/data/stories_heldout.txt, seven short
  stories in TinyStories' style written for this benchmark (by the agent that wrote this script, not by
  the model; 2,884 scored tokens, so its perplexities carry sampling noise of a few percent, though every row
  scores the same tokens). Calibration text for stories260K is self-generated: 64 samples of 256
  tokens from the fp32 model itself (temperature 1, seeded), labelled as such; it never touches the
  scored text.

Writes benchmarks/results/quant_quality.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import REPO  # noqa: E402  (also puts the clone's root on sys.path)

from ruvllm_cli.evaluate import encode_text  # noqa: E402
from py_engine.models.evaluate import perplexity  # noqa: E402
from py_engine.quant.config import QuantConfig  # noqa: E402
from py_engine.quant.linear import QuantLinear  # noqa: E402
from py_engine.quant.load import load_quantized  # noqa: E402
from py_engine.tokenizer import Tokenizer  # noqa: E402

BUILTIN = REPO / "py_engine" / "data" / "tiny-shakespeare"
STORIES = REPO.parent / "shared" / "fixtures" / "checkpoints" / "stories260K"
STORIES_TEXT = REPO / "benchmarks" / "data" / "stories_heldout.txt"
RESULTS = REPO / "benchmarks" / "results" / "quant_quality.json"

ROWS: list[tuple[str, str, dict]] = [  # label, method, QuantConfig options
    ("fp32", "none", {}),
    ("int8 RTN", "int8", {}),
    ("SmoothQuant W8A8", "smoothquant", {}),
    ("int4 RTN g128", "int4", {"group_size": 128}),
    ("int4 RTN g32", "int4", {"group_size": 32}),
    ("AWQ 4-bit g128", "awq", {"group_size": 128}),
    ("AWQ 4-bit g32", "awq", {"group_size": 32}),
    ("GPTQ 4-bit g128", "gptq", {"group_size": 128}),
    ("GPTQ 4-bit g32", "gptq", {"group_size": 32}),
    ("AWQ 2-bit g32", "awq", {"bits": 2, "group_size": 32}),
    ("GPTQ 2-bit g32", "gptq", {"bits": 2, "group_size": 32}),
]


def weight_bytes(model: torch.nn.Module) -> int:
    """Float parameters outside quantized layers (shared ones once) plus each quantized layer's bytes."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.nbytes
            continue
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


def import_stories(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "ruvllm_cli", "import-llama2c", str(STORIES / "stories260K.bin"),
                    str(STORIES / "tok512.bin"), "--out", str(folder)], check=True, cwd=REPO, capture_output=True)
    return folder


@torch.inference_mode()
def self_generated_calibration(folder: Path, samples: int = 64, tokens: int = 256, seed: int = 0) -> Path:
    """Text sampled from the fp32 model itself (temperature 1, from BOS), the calibration of a model without
    a corpus here: one batch of `samples` sequences through a dense cache."""
    from py_engine.models import DenseKVCache, load_model
    model, config = load_model(folder, dtype="float32")
    tok = Tokenizer.from_pretrained(folder)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((samples, 1), tok.bos_token_id, dtype=torch.long)
    kv = DenseKVCache.allocate(config, samples, tokens + 1, dtype=torch.float32)
    for t in range(tokens):
        logits = model(ids[:, -1:], torch.full((samples, 1), t), kv)[:, -1]  # [S, V]
        ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=generator)], dim=1)
    texts = [tok.decode(row.tolist(), skip_special_tokens=True) for row in ids[:, 1:]]
    path = folder / "calibration.txt"
    path.write_text("\n\n".join(texts), encoding="utf-8")
    return path


def checkpoint_mb(model, config, qconfig: QuantConfig, folder: Path) -> float | None:
    """Size of the Hugging Face checkpoint `ruvllm quantize` would write (None: no layout, or float)."""
    from py_engine.quant.hf_format import QuantFormatError, save_quantized
    if not qconfig.enabled:
        return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = save_quantized(model, config, qconfig, tmp, folder)
            return (out / "model.safetensors").stat().st_size / 1e6
    except QuantFormatError:
        return None


def evaluate(name: str, folder: Path, text: Path, max_tokens: int | None, rows: list[str]) -> list[dict]:
    ids = encode_text(Tokenizer.from_pretrained(folder), text.read_text(encoding="utf-8"), max_tokens)
    results, base = [], None
    for label, method, options in ROWS:
        if label not in rows:
            continue
        qconfig = QuantConfig.from_options(method, **options)
        model, config, report = load_quantized(folder, qconfig, dtype="float32", progress=False)
        window = min(config.max_position_embeddings, 4096)
        result = perplexity(model, ids, window, window // 2)
        base = base if base is not None else (result.perplexity if method == "none" else None)
        row = {"model": name, "label": label, "quantization": qconfig.describe(), "perplexity": result.perplexity,
               "delta_pct": None if base is None else 100 * (result.perplexity / base - 1),
               "size_mb": weight_bytes(model) / 1e6, "checkpoint_mb": checkpoint_mb(model, config, qconfig, folder),
               "quantize_seconds": 0.0 if report is None else report.seconds,
               "eval_seconds": result.seconds, "tokens": result.tokens, "window": window, "stride": window // 2}
        results.append(row)
        print(format_row(row), flush=True)
    return results


def format_row(r: dict) -> str:
    delta = "" if r["delta_pct"] is None or r["label"] == "fp32" else f"{r['delta_pct']:+.2f}%"
    checkpoint = "n/a" if r["checkpoint_mb"] is None else f"{r['checkpoint_mb']:.2f}"
    return (f"| {r['model']} | {r['label']} | {r['perplexity']:.3f} | {delta} | {r['size_mb']:.2f} | {checkpoint} | "
            f"{r['quantize_seconds']:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="builtin,stories260k", help="comma list: builtin, stories260k")
    parser.add_argument("--rows", default=",".join(label for label, _, _ in ROWS), help="comma list of row labels")
    parser.add_argument("--max-tokens", type=int, help="score only the first N tokens of each text (default all)")
    parser.add_argument("--output", default=str(RESULTS))
    parser.add_argument("--merge", action="store_true",
                        help="replace only the rows measured now in --output's table (fp32 is re-measured too)")
    args = parser.parse_args()
    rows = args.rows.split(",")
    if "fp32" not in rows:
        rows.insert(0, "fp32")
    print("| model | method | perplexity | vs fp32 | in memory MB | checkpoint MB | quantize s |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    start, results = time.time(), []
    if "builtin" in args.models:
        results += evaluate("tiny-shakespeare", BUILTIN, BUILTIN / "validation.txt", args.max_tokens, rows)
    if "stories260k" in args.models and STORIES.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            folder = import_stories(Path(tmp) / "stories260K")
            self_generated_calibration(folder)
            results += evaluate("stories260K", folder, STORIES_TEXT, args.max_tokens, rows)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(), "python": platform.python_version(),
            "seconds": round(time.time() - start, 1),
            "texts": {"tiny-shakespeare": "validation.txt (held-out plays)",
                      "stories260K": "benchmarks/data/stories_heldout.txt (written for this benchmark, not by the "
                                     "model); calibration: 64 self-generated samples"},
            "note": "every quantized row also has the LM head int8 per channel (QuantConfig's lm_head_bits=8)"}
    output = Path(args.output)
    if args.merge and output.is_file():  # rows measured earlier stay, in ROWS order; the meta says when each was
        fresh = {(r["model"], r["label"]): dict(r, measured=meta["date"]) for r in results}
        old = json.loads(output.read_text(encoding="utf-8"))
        kept = [fresh.pop((r["model"], r["label"]), r) for r in old["rows"]]
        results = kept + list(fresh.values())
        meta["merged_into"] = old["meta"]["date"]
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"meta": meta, "rows": results}, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.output} ({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
