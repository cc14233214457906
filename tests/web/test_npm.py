"""The npm package, packed and installed in a scratch project as an app would, in Node.

Golden matrix (Node leg): greedy tokens from `ruvllm` in Node (Pyodide running
py_engine's shared layer, onnxruntime-web's wasm running the export) equal the
torch engine's and onnxruntime-in-CPython's, for the built-in model (when
trained) and random-weight models of two families. Also: chat streaming equals
the non-streamed reply, a reader that stops early frees the engine, typed
errors, and the package's types check with `tsc --noEmit` on an example.

Offline: the scratch install takes pyodide and onnxruntime-web from npm's cache
(`npm ci --prefix npm` fills it) and the jinja2/markupsafe wheels from
.cache/wheels (`python -m web.wheels` fills it); the test skips, saying why,
when node or npm is missing or either cache is empty.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from tests.paths import BUILTIN, REPO  # noqa: E402
from tests.guided_cases import GUIDED, check_guided_run  # noqa: E402
from tests.requires import tool  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402
from tests.web.npm_project import NPM_DIR, install_packed, run as _run  # noqa: E402

DRIVER = REPO / "tests" / "web" / "npm"
PROMPT = "To be, or not"
GREEDY = 48
PHI3_LONGROPE = {"max_position_embeddings": 64, "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5,
                 "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.5],
                                  "long_factor": [1.0, 2.0, 4.0, 8.0]}}
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7, "max_tokens": 24, "ignore_eos": True}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A fresh project with the packed tarball installed (offline)."""
    root = tmp_path_factory.mktemp("npm")
    project = install_packed(root, root / "app")
    for name in ("run_engine.mjs", "chat_greedy.mjs", "complete_greedy.mjs", "guided_requests.mjs", "tsconfig.json"):
        shutil.copy(DRIVER / name, project / name)
    shutil.copy(NPM_DIR / "examples" / "chat.ts", project / "chat.ts")
    return project


def _export(model: Path, out: Path, external: bool = False) -> Path:
    """An fp32 export; external=True keeps the weights in onnx/model.onnx_data as graphs over 1 GiB do."""
    import export.exporter as exporter
    from export.options import ExportOptions

    limit = exporter.INLINE_LIMIT
    exporter.INLINE_LIMIT = 1 if external else limit
    try:
        exporter.export_model(model, out, ExportOptions(precision="fp32", target="native"))
    finally:
        exporter.INLINE_LIMIT = limit
    assert (out / "onnx" / "model.onnx_data").exists() == external
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (model folder, fp32 export folder)."""
    root = tmp_path_factory.mktemp("npm-models")
    found = {}
    for family in ("qwen2", "llama"):
        model = build_tiny_model(root / family, family)
        found[family] = (model, _export(model, root / f"{family}-onnx"))
    found["qwen2-external"] = (found["qwen2"][0], _export(found["qwen2"][0], root / "qwen2-external", external=True))
    # Phi-3 LongRoPE: past 16 positions the cache is recomputed with the long factors (in JS too).
    phi3 = build_tiny_model(root / "phi3", "phi3", **PHI3_LONGROPE)
    found["phi3-longrope"] = (phi3, _export(phi3, root / "phi3-onnx"))
    if (BUILTIN / "model.safetensors").exists():
        found["tiny-shakespeare"] = (BUILTIN, _export(BUILTIN, root / "tiny-shakespeare-onnx"))
    return found


def _reference(model: Path, export: Path) -> list[int]:
    from py_engine import LLM, SamplingParams

    params = SamplingParams.greedy(max_tokens=GREEDY, ignore_eos=True)
    torch_ids = LLM(str(model)).generate(PROMPT, params).token_ids
    onnx_ids = LLM(str(export), backend="onnx", dtype="fp32").generate(PROMPT, params).token_ids
    assert onnx_ids == torch_ids, "onnxruntime in CPython differs from torch"
    return torch_ids


def _node(scratch: Path, models: dict, runtime: str, missing: Path) -> dict:
    spec = {"models": [{"name": n, "path": str(e), "precision": "fp32"} for n, (_, e) in models.items()],
            "prompt": PROMPT, "max_tokens": GREEDY, "runtime": runtime, "sampled": SAMPLED, "missing": str(missing),
            "guided": GUIDED}
    path = scratch / f"spec-{runtime}.json"
    path.write_text(json.dumps(spec))
    run = _run(["node", "run_engine.mjs", str(path)], scratch)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def node_run(scratch, models, tmp_path_factory) -> dict:
    """The package in Node on onnxruntime-web's wasm backend."""
    return _node(scratch, models, "web", tmp_path_factory.mktemp("empty") / "nothing")


def test_greedy_tokens_equal_torch_and_cpython(models, node_run):
    assert len(models) >= 4
    for name, (model, export) in models.items():
        expected = _reference(model, export)
        assert len(expected) == GREEDY
        assert node_run["greedy"][name]["token_ids"] == expected, name
        assert node_run["stats"][name]["load"]["runtime"] == "onnxruntime-web"


def test_smollm2_int4_greedy_chat_equals_cpython(scratch, smollm2_web):
    """Golden matrix, SmolLM2 (a real 135M chat model, its Q4_1 GGUF exported int4 for the web): the
    package in Node gives onnxruntime-in-CPython's greedy chat replies, token for token up to a near-tie
    (smollm2_golden.check_greedy; one model load)."""
    from tests.web.smollm2_golden import CHATS, MAX_TOKENS, PRECISION, check_greedy

    spec = {"path": str(smollm2_web.export), "precision": PRECISION, "chats": CHATS, "max_tokens": MAX_TOKENS,
            "runtime": "web"}
    path = scratch / "spec-smollm2.json"
    path.write_text(json.dumps(spec))
    run = _run(["node", "chat_greedy.mjs", str(path)], scratch)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout)
    # the web graph's codes on the package's own wasm kernels (onnxruntime-web runs graphs they do not take)
    assert got["load"]["device"] == "wasm" and got["load"]["runtime"].startswith("ruvllm-wasm"), got["load"]
    check_greedy(got["token_ids"], smollm2_web, "npm in Node")
    from py_engine.tokenizer import Tokenizer

    reply = Tokenizer.from_pretrained(smollm2_web.export).decode(got["token_ids"][0], skip_special_tokens=True)
    assert reply.startswith("The capital of France is Paris."), reply  # transformers' greedy answer too


def test_k_quant_gguf_web_export_greedy_equals_cpython(scratch, kquant_web):
    """Issue 31: a GGUF K-quant mix (Q4_K, Q6_K, Q5_0, Q8_0; a Q4_K token embedding and a Q6_K head) exported int4
    for the web runs on the package's own wasm kernels in Node with onnxruntime-in-CPython's greedy tokens."""
    from tests.web.kquant_web import MAX_TOKENS, PRECISION, PROMPT
    from tests.web.smollm2_golden import check_greedy

    spec = {"path": str(kquant_web.export), "precision": PRECISION, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "runtime": "web"}
    path = scratch / "spec-kquant.json"
    path.write_text(json.dumps(spec))
    run = _run(["node", "complete_greedy.mjs", str(path)], scratch)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout)
    assert got["load"]["device"] == "wasm" and got["load"]["runtime"].startswith("ruvllm-wasm"), got["load"]
    check_greedy([got["token_ids"]], kquant_web, "npm in Node, K-quant GGUF")


def test_seeded_sampling_equals_cpython(models, node_run):
    """Sampling runs in JS (npm/src/sampling.js) with u from Python's seeded rng: the same tokens as CPython."""
    from py_engine import LLM, SamplingParams

    for name, (_, export) in models.items():
        want = LLM(str(export), backend="onnx", dtype="fp32").generate(PROMPT, SamplingParams(**SAMPLED)).token_ids
        assert node_run["sampled"][name] == want, name


def test_structured_outputs_and_tools_equal_cpython(models, node_run):
    """The same seeded tokens as CPython under a JSON schema, a regex and forced tool calls; the
    outputs follow their grammar; a bad schema is an InvalidRequestError naming response_format."""
    assert "tiny-shakespeare" in models
    for name, (_, export) in models.items():
        check_guided_run(node_run["guided"][name], export, strict=name == "tiny-shakespeare")


def test_greedy_text_and_usage(models, node_run):
    from py_engine.tokenizer import Tokenizer

    for name, (model, _) in models.items():
        tok = Tokenizer.from_pretrained(model)
        got = node_run["greedy"][name]
        assert got["text"] == tok.decode(got["token_ids"], skip_special_tokens=True)
        assert got["usage"]["completion_tokens"] == GREEDY
        assert got["usage"]["prompt_tokens"] == len(tok.encode(PROMPT))
        assert node_run["chat"][name]["encoded"] == tok.encode(PROMPT)


def test_chat_stream_equals_whole_and_stop_frees_engine(models, node_run):
    from py_engine import LLM, SamplingParams

    for name, (model, _) in models.items():
        chat = node_run["chat"][name]
        assert chat["streamed"] == chat["whole"] and chat["streamed_ids"] == chat["whole_ids"]
        assert chat["streamed_finish"] == chat["whole_finish"]
        llm = LLM(str(model))
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be, or not to be?"}]
        ref = list(llm.chat(messages, SamplingParams.greedy(max_tokens=12)))
        assert chat["whole"] == "".join(c.text for c in ref)
        assert chat["after_stop"] == node_run["greedy"][name]["token_ids"][:4]


def test_typed_errors(node_run):
    bad = node_run["errors"]["bad_temperature"]
    assert bad["invalid"] and bad["name"] == "InvalidRequestError" and bad["param"] == "temperature"
    missing = node_run["errors"]["missing_model"]
    assert missing["notFound"] and "ruvllm_contract.json" in missing["message"]


def test_types_check_with_tsc(scratch):
    tsc = NPM_DIR / "node_modules" / ".bin" / "tsc"
    if not tsc.exists():
        pytest.skip("typescript is missing: run `npm ci --prefix npm` (make test does)")
    run = _run([str(tsc), "--noEmit", "-p", "tsconfig.json"], scratch)
    assert run.returncode == 0, run.stdout + run.stderr


def test_onnxruntime_node_when_installed(scratch, models, tmp_path):
    """With onnxruntime-node installed beside it, the package uses it, with the same greedy tokens."""
    install = _run(["npm", "install", "--prefer-offline", "--no-audit", "--no-fund", "onnxruntime-node@1.30.0"],
                   scratch)
    if install.returncode != 0:
        pytest.skip(f"onnxruntime-node@1.30.0 could not be installed (not in npm's cache, registry unreachable?): "
                    f"{install.stderr.strip().splitlines()[-1:]}; run `make test-setup` once online")
    got = _node(scratch, models, "auto", tmp_path / "nothing")
    for name, (model, export) in models.items():
        assert got["stats"][name]["load"]["runtime"] == "onnxruntime-node"
        assert got["greedy"][name]["token_ids"] == _reference(model, export), name


def test_pack_refuses_without_the_wheels(tmp_path):
    """`npm pack` runs the prepack check: no wheels, no tarball, and a message that says how to build them."""
    tool("node"), tool("npm")
    copy = tmp_path / "npm"
    shutil.copytree(NPM_DIR, copy, ignore=shutil.ignore_patterns("node_modules", "wheels"))
    packed = _run(["npm", "pack", "--dry-run", "--ignore-scripts=false"], copy, timeout=120)
    assert packed.returncode != 0
    assert "build:wheels" in packed.stderr and not list(copy.glob("*.tgz"))


def test_out_of_memory_reaches_the_caller_as_a_typed_error():
    """A wasm memory that cannot grow, a failed ArrayBuffer and Python's MemoryError inside the real
    Pyodide: each crosses the worker's wire format as OutOfMemoryError with a readable message."""
    pyodide = NPM_DIR / "node_modules" / "pyodide"
    tool("node")
    if not pyodide.is_dir():
        pytest.skip("npm/node_modules/pyodide is missing: run `npm ci --prefix npm` (make test does)")
    done = _run(["node", str(REPO / "tests" / "web" / "js" / "errors_oom.mjs"), str(NPM_DIR / "src"), str(pyodide)],
                REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 3 and results[2]["raw"].startswith("PythonError")
    for r in results:
        assert r["oom"] and r["name"] == "OutOfMemoryError" and r["message"].startswith("out of memory"), r
