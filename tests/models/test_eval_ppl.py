"""`ruvllm eval ppl` and py_engine.models.evaluate: sliding-window perplexity.

The built-in model loaded in transformers, scored by a direct loop of Hugging Face's stride method
(labels -100 on the tokens an earlier window scored, the model's own mean loss times the scored
count), must give ruvllm's perplexity to 1e-4 relative; then the CLI's --json object and its errors.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from py_engine.models import load_model  # noqa: E402
from py_engine.models.evaluate import perplexity, sliding_windows  # noqa: E402
from py_engine.tokenizer import Tokenizer  # noqa: E402
from ruvllm_cli.main import main  # noqa: E402
from tests.paths import BUILTIN  # noqa: E402


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def ids() -> list[int]:
    text = (BUILTIN / "validation.txt").read_text(encoding="utf-8")[:6000]
    return Tokenizer.from_pretrained(BUILTIN).encode(text, add_special_tokens=True)[:1100]


@torch.no_grad()
def hf_stride_perplexity(model, ids: list[int], max_length: int, stride: int) -> tuple[float, int]:
    """Hugging Face's documented loop, with the exact count of scored tokens per window."""
    x = torch.tensor([ids])
    n, nll, count, prev_end = x.shape[1], 0.0, 0, 0
    for begin in range(0, n, stride):
        end = min(begin + max_length, n)
        trg_len = end - prev_end
        input_ids = x[:, begin:end]
        labels = input_ids.clone()
        labels[:, :-trg_len] = -100
        valid = int((labels[:, 1:] != -100).sum())
        loss = model(input_ids, labels=labels).loss  # mean over the valid shifted labels
        nll += float(loss) * valid
        count += valid
        prev_end = end
        if end == n:
            break
    return math.exp(nll / count), count


@pytest.mark.parametrize("window, stride", [(256, 128), (256, 256), (200, 64)])
def test_perplexity_matches_transformers_stride_loop(ids, window, stride):
    hf = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN, dtype=torch.float32).eval()
    want, count = hf_stride_perplexity(hf, ids, window, stride)
    model, _ = load_model(BUILTIN, dtype="float32")
    got = perplexity(model, ids, window, stride)
    print(f"\nwindow {window} stride {stride}: ruvllm {got.perplexity:.6f}, transformers {want:.6f}, {got.tokens} tokens")
    assert got.tokens == count
    assert abs(got.perplexity - want) / want < 1e-4


def test_windows_score_every_token_once():
    for n, window, stride in [(10, 4, 2), (11, 4, 4), (5, 8, 4), (1000, 256, 128), (257, 256, 128)]:
        scored = [t for _, end, first in sliding_windows(n, window, stride) for t in range(first, end)]
        if stride < window:
            assert scored == list(range(1, n))
        else:  # non-overlapping windows: each window's first token has no context inside it
            assert scored == [t for t in range(1, n) if t % window]
    with pytest.raises(ValueError, match="1 <= stride <= window"):
        sliding_windows(10, 4, 5)


def test_cli_json_object(capsys):
    assert main(["eval", "ppl", "--max-tokens", "400", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"perplexity", "tokens", "nll", "seconds", "quantization"} <= out.keys()
    assert out["tokens"] == 399 and out["window"] == 256 and out["stride"] == 128 and out["quantization"] == "none"
    assert 20 < out["perplexity"] < 200 and math.isclose(out["perplexity"], math.exp(out["nll"]))


def test_cli_quantized_and_plain_text(capsys):
    assert main(["eval", "ppl", "--max-tokens", "400", "--quantization", "int8"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("perplexity ") and "quantization int8 8-bit per-channel sym" in line


def test_cli_two_tier_kv_cache(capsys):
    """int4 KV with 32 hot tokens: the cold blocks cost perplexity, a little."""
    assert main(["eval", "ppl", "--max-tokens", "400", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert main(["eval", "ppl", "--max-tokens", "400", "--json", "--kv-cache-dtype", "int4", "--kv-hot-tokens", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_cache"] == "int4, 32 hot tokens" and full["kv_cache"] == "auto"
    assert out["perplexity"] != full["perplexity"] and abs(out["perplexity"] / full["perplexity"] - 1) < 0.02


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-dtype", "int4", "--kv-hot-tokens", "300"], "kv_hot_tokens is 300 but must be at least one block"),
    (["--text-file", "/nonexistent/text.txt"], "text file /nonexistent/text.txt does not exist"),
    (["--stride", "300"], "--stride 300 is longer than the window 256"),
    (["--window", "512"], "--window 512 is longer than the model's context 256"),
    (["--quantization", "int8", "--group-size", "64"], "int8 quantizes per output channel"),
])
def test_cli_errors(capsys, argv, message):
    assert main(["eval", "ppl", "--max-tokens", "50", *argv]) == 1
    assert message in capsys.readouterr().err


def test_model_without_validation_text_needs_a_text_file(tmp_path, capsys):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN / name, tmp_path / name)
    assert main(["eval", "ppl", str(tmp_path)]) == 1
    assert "has no validation.txt; pass --text-file FILE" in capsys.readouterr().err
    (tmp_path / "other.txt").write_text("To be, or not to be, that is the question. " * 20)
    assert main(["eval", "ppl", str(tmp_path), "--text-file", str(tmp_path / "other.txt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] > 1
