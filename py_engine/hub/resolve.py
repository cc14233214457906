"""Model names, the download cache, and what a model directory holds.

A MODEL argument is tried in this order: an existing local directory, the
built-in `tiny-shakespeare`, a `.gguf` file (its config and tokenizer are written
once under `gguf/` in the cache; py_engine.importers.gguf), an alias from
`data/aliases.json` (a GGUF alias: the file its package ships, else its download),
then a Hugging Face repo id (`org/name`) already in the cache. Resolution never downloads:
only `py_engine.hub.download` talks to the network. This module is stdlib-only
(ring 0), so `list` and `info` work without huggingface_hub installed.

Cache layout, under --cache-dir, else $RUVLLM_CACHE_DIR, else
$XDG_CACHE_HOME/ruvllm (~/.cache/ruvllm) (`cache_root`; kernels/ and corpus/
beside models/ hold the CPU kernels' build and the training corpus):

    models/<org>--<name>/<revision>/    the repo's files, as in the repo
        .cache/huggingface/             huggingface_hub's per-file download metadata
        .ruvllm-download.json           written last: the download is complete

`<revision>` is the branch, tag or commit asked for, "main" by default, with
"/" written as "--" (as in `refs--pr--1`). Hugging Face forbids "--" in repo
ids, so the folder name maps back to one repo.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..config import ConfigError, ModelConfig

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
ALIASES_FILE = DATA_DIR / "aliases.json"
BUILTIN_MODEL = "tiny-shakespeare"
BUILTIN_DESCRIPTION = "built-in small model trained on Tiny Shakespeare"
DEFAULT_REVISION = "main"
MANIFEST = ".ruvllm-download.json"

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*")


class ModelNotFoundError(ValueError):
    """A MODEL that names nothing on this machine; the message says what was tried."""


@dataclass(frozen=True)
class Alias:
    """A short name for a Hugging Face repo, read from `data/aliases.json`."""

    name: str
    repo: str
    description: str
    params: str  # as the model card rounds it ("1.5B"), shown before a download
    chat: bool = False
    gated: bool = False  # the repo asks users to accept its terms before downloading
    gguf: str | None = None  # a GGUF file of the repo: the alias is that one file (importers/gguf)
    package: str | None = None  # a Python package that ships the same GGUF file (found without importing it)


@dataclass(frozen=True)
class ModelEntry:
    """One row of `ruvllm list`: an alias, the built-in model, or a downloaded repo."""

    name: str
    description: str
    params: str
    repo: str | None  # None for the built-in model
    revision: str | None
    path: Path | None  # None when it is not on this machine
    installed: bool = False  # its file ships in an installed pip package (no download, nothing in the cache)

    @property
    def status(self) -> str:
        """`ruvllm list`'s STATUS: built-in, installed, downloaded, or - (`ruvllm download NAME` first)."""
        if self.path is None:
            return "-"
        return "built-in" if self.repo is None else "installed" if self.installed else "downloaded"


# --- aliases -------------------------------------------------------------
def load_aliases(path: Path = ALIASES_FILE) -> dict[str, Alias]:
    """Aliases by name, in file order, validated so a typo in the data fails loudly."""
    data = json.loads(path.read_text(encoding="utf-8"))
    aliases = {}
    for name, entry in data.items():
        alias = Alias(name=name, **entry)
        if name != name.lower() or name == BUILTIN_MODEL or not check_repo_id(alias.repo):
            raise ValueError(f"{path}: bad alias {name!r} -> {alias.repo!r}")
        aliases[name] = alias
    return aliases


def check_repo_id(repo: str) -> bool:
    """An `org/name` Hugging Face model id (a bare `name` is not accepted: see `repo_for`)."""
    return bool(_REPO_ID.fullmatch(repo)) and "--" not in repo and ".." not in repo


def repo_for(name: str) -> str:
    """The repo an alias or repo id stands for, for `download`.

    Bare names must be aliases: a typo such as `qwen2` then fails here with the
    list of aliases instead of asking the hub for a repo that does not exist.
    """
    alias = load_aliases().get(name.lower())
    if alias is not None:
        return alias.repo
    if check_repo_id(name):
        return name
    if name == BUILTIN_MODEL:
        raise ModelNotFoundError(f"{BUILTIN_MODEL} is built in; there is nothing to download")
    raise ModelNotFoundError(
        f"unknown model {name!r}: not an alias ({', '.join(load_aliases())}) "
        "nor a Hugging Face repo id such as Qwen/Qwen2.5-0.5B-Instruct; see `ruvllm list`")


# --- cache layout ------------------------------------------------------------
def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """ruvllm's one cache directory (models/, the CPU kernels' kernels/, training's corpus/): the
    argument, else $RUVLLM_CACHE_DIR, else the XDG cache. $RUVLLM_CACHE, which the kernels and the
    corpus once read, still works as a deprecated alias (a FutureWarning) when RUVLLM_CACHE_DIR is unset."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("RUVLLM_CACHE_DIR"):
        return Path(os.environ["RUVLLM_CACHE_DIR"]).expanduser()
    if os.environ.get("RUVLLM_CACHE"):
        warnings.warn("RUVLLM_CACHE is deprecated: set RUVLLM_CACHE_DIR (one cache for models, kernels and corpus)",
                      FutureWarning, stacklevel=2)
        return Path(os.environ["RUVLLM_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "ruvllm"


def check_revision(revision: str) -> str:
    """Refuse revisions that would escape the cache folder (`..`, absolute paths)."""
    if not _REVISION.fullmatch(revision) or ".." in revision:
        raise ValueError(f"invalid revision {revision!r}: use a branch, tag or commit hash")
    return revision


def model_dir(repo: str, revision: str = DEFAULT_REVISION, cache_dir: str | None = None) -> Path:
    """Where `download` puts one revision of a repo."""
    return _repo_dir(repo, cache_dir) / check_revision(revision).replace("/", "--")


def _repo_dir(repo: str, cache_dir: str | None) -> Path:
    return cache_root(cache_dir) / "models" / repo.replace("/", "--")


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The record `download` writes last, or None for a partial or foreign folder."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def is_complete(path: Path) -> bool:
    """True when a download finished here and none of its files has gone since."""
    manifest = read_manifest(path)
    return manifest is not None and all((path / f).is_file() for f in manifest.get("files", ()))


def write_manifest(path: Path, repo: str, revision: str, commit: str | None, files: Iterable[str]) -> None:
    record = {"format": 1, "repo": repo, "revision": revision, "commit": commit, "files": sorted(files)}
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path / MANIFEST)  # atomic: a reader sees no manifest or a whole one


def find_download(repo: str, cache_dir: str | None = None) -> Path | None:
    """The complete download of a repo: its "main" revision, else the newest one."""
    done = [d for d in _revision_dirs(_repo_dir(repo, cache_dir)) if is_complete(d)]
    main = [d for d in done if d.name == DEFAULT_REVISION]
    if main or not done:
        return main[0] if main else None
    return max(done, key=lambda d: (d / MANIFEST).stat().st_mtime)


def downloads(cache_dir: str | None = None) -> Iterator[tuple[str, str, Path]]:
    """(repo, revision, path) of every complete download in the cache, sorted by repo."""
    models = cache_root(cache_dir) / "models"
    for repo_dir in sorted(models.iterdir()) if models.is_dir() else ():
        for rev_dir in _revision_dirs(repo_dir):
            manifest = read_manifest(rev_dir)
            if manifest is not None and is_complete(rev_dir):
                yield manifest["repo"], manifest["revision"], rev_dir


def _revision_dirs(repo_dir: Path) -> list[Path]:
    if not repo_dir.is_dir():
        return []
    return sorted(d for d in repo_dir.iterdir() if d.is_dir() and not d.name.startswith("."))


# --- resolution ----------------------------------------------------------------
def builtin_path() -> Path:
    """Where the built-in model lives; it may not be built yet."""
    return DATA_DIR / BUILTIN_MODEL


def resolve_model(name: str, cache_dir: str | None = None) -> Path:
    """The local directory of a MODEL argument; never downloads.

    Raises ModelNotFoundError with one line naming what was tried and the
    command that would fix it.
    """
    if not name:
        raise ModelNotFoundError("empty model name; see `ruvllm list`")
    local = Path(name).expanduser()
    if local.is_dir():  # a local directory wins, as in transformers' from_pretrained
        return local.resolve()
    if name == BUILTIN_MODEL:
        return builtin_path()
    if name.lower().endswith(".gguf"):
        if not local.is_file():
            raise ModelNotFoundError(f"no GGUF file {name!r}")
        return _gguf_folder(local, cache_dir)
    alias = load_aliases().get(name.lower())
    if alias is not None and alias.gguf:
        return _gguf_folder(_alias_gguf(alias, cache_dir), cache_dir)
    repo = alias.repo if alias else name if check_repo_id(name) else None
    if repo is not None:
        found = find_download(repo, cache_dir)
        if found is not None:
            return found
    root = cache_root(cache_dir) / "models"
    fix = f"`ruvllm download {name}{_cache_flag(cache_dir)}`"
    if repo is not None and _revision_dirs(_repo_dir(repo, cache_dir)):
        raise ModelNotFoundError(f"model {name!r} ({repo}) is only partly downloaded in {root}; run {fix} to finish")
    if alias is not None:
        raise ModelNotFoundError(f"model {name!r} ({repo}) is not downloaded to {root}; run {fix}")
    if repo is not None:
        raise ModelNotFoundError(
            f"model {name!r} is not a local directory and not downloaded to {root}; run {fix} or see `ruvllm list`")
    if name.startswith(("/", ".", "~")) or os.sep in name:
        raise ModelNotFoundError(f"no directory {name!r}; see `ruvllm list` for models by name")
    raise ModelNotFoundError(
        f"unknown model {name!r}: not a local directory, an alias, {BUILTIN_MODEL!r} or a downloaded "
        f"repo id (org/name) in {root}; see `ruvllm list`, or `ruvllm download ORG/NAME`")


def _gguf_folder(file: Path, cache_dir: str | None) -> Path:
    """The folder a GGUF file stands for (config and tokenizer written once; weights read in place)."""
    from ..importers.gguf.folder import gguf_folder  # numpy and gguf: only for .gguf models

    return gguf_folder(file, cache_root(cache_dir))


def _alias_gguf(alias: Alias, cache_dir: str | None) -> Path:
    """An alias's GGUF file: from its package when installed (found, never imported), else downloaded."""
    import importlib.util

    spec = importlib.util.find_spec(alias.package) if alias.package else None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / alias.gguf).is_file():
            return Path(folder) / alias.gguf
    found = find_download(alias.repo, cache_dir)
    if found is not None and (found / alias.gguf).is_file():
        return found / alias.gguf
    where = f"`pip install {alias.package.replace('_', '-')}` or " if alias.package else ""
    raise ModelNotFoundError(f"model {alias.name!r} ({alias.gguf}) is not on this machine; "
                             f"{where}run `ruvllm download {alias.name}{_cache_flag(cache_dir)}`")


def _cache_flag(cache_dir: str | None) -> str:
    return f" --cache-dir {cache_dir}" if cache_dir else ""


# --- what is on disk -------------------------------------------------------------
def model_files(path: Path) -> list[Path]:
    """The model's files under `path`, leaving out hidden bookkeeping (`.cache/`, the manifest)."""
    return sorted(p for p in path.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))


def disk_size(path: Path) -> int:
    return sum(p.stat().st_size for p in model_files(path))


def describe(name: str, cache_dir: str | None = None) -> dict[str, Any]:
    """What `ruvllm info` shows: architecture, parameter count, dtype, context, size, path."""
    path = resolve_model(name, cache_dir)
    if not path.is_dir():
        built_in = " (the built-in model is not built yet)" if name == BUILTIN_MODEL else ""
        raise ModelNotFoundError(f"model directory {path} does not exist{built_in}")
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no config.json in {path}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    manifest = read_manifest(path) or {}
    alias = load_aliases().get(name.lower())
    info: dict[str, Any] = {
        "name": name,
        "repo": manifest.get("repo") or (alias.repo if alias else None),
        "revision": manifest.get("revision"),
        "commit": manifest.get("commit"),
        "path": str(path),
        "model_type": raw.get("model_type") if isinstance(raw, dict) else None,
        "architectures": list(raw.get("architectures") or []) if isinstance(raw, dict) else [],
    }
    try:
        config = ModelConfig.from_dict(raw)
    except ConfigError as e:  # an architecture ruvllm cannot run: report what the file says
        raw = raw if isinstance(raw, dict) else {}
        info.update(supported=False, note=str(e), parameters=None,
                    dtype=raw.get("torch_dtype") or raw.get("dtype"),
                    context_length=raw.get("max_position_embeddings"))
    else:
        info.update(supported=True, parameters=config.num_parameters(), dtype=config.torch_dtype,
                    context_length=config.max_position_embeddings)
    info["quantization"] = _quantization_summary(raw)
    files = model_files(path)
    info["disk_size"] = sum(p.stat().st_size for p in files)
    info["files"] = [p.relative_to(path).as_posix() for p in files]
    gguf = _gguf_source(path)
    if gguf:  # a .gguf model: its weights are the file's, read in place
        info["quantization"] = "gguf " + ", ".join(f"{k} x{v}" for k, v in gguf.get("tensor_types", {}).items())
        info["disk_size"] += int(gguf.get("size", 0))
        info["files"].append(str(gguf.get("file")))
    return info


def _gguf_source(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / "gguf_source.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _quantization_summary(raw: Any) -> str | None:
    """'gptq 4-bit g128 sym' from a config's quantization_config (None for a float checkpoint)."""
    q = raw.get("quantization_config") if isinstance(raw, dict) else None
    if not isinstance(q, dict):
        return None
    group = q.get("group_size") or q.get("q_group_size")
    parts = [str(q.get("quant_method", "unknown")), f"{q.get('bits') or q.get('w_bit') or '?'}-bit",
             f"g{group}" if group and group != -1 else "per-channel"]
    if "sym" in q:
        parts.append("sym" if q["sym"] else "asym")
    elif "zero_point" in q:
        parts.append("asym" if q["zero_point"] else "sym")
    return " ".join(parts)


def list_models(cache_dir: str | None = None) -> list[ModelEntry]:
    """The built-in model, every alias, then downloaded repos no alias points at."""
    builtin = builtin_path()
    entries = [ModelEntry(BUILTIN_MODEL, BUILTIN_DESCRIPTION, _params_of(builtin), None, None,
                          builtin if builtin.is_dir() else None)]
    shown = set()
    for alias in load_aliases().values():
        path = find_download(alias.repo, cache_dir)
        shown.add(path)
        revision = (read_manifest(path) or {}).get("revision") if path else None
        if alias.gguf:  # the file its package ships counts as on this machine
            try:
                path = _alias_gguf(alias, cache_dir)
            except ModelNotFoundError:
                path = None
        installed = path is not None and path.is_file() and not path.is_relative_to(cache_root(cache_dir))
        entries.append(ModelEntry(alias.name, alias.description, alias.params, alias.repo, revision, path, installed))
    for repo, revision, path in downloads(cache_dir):
        if path not in shown:
            note = "" if revision == DEFAULT_REVISION else f"revision {revision}"
            entries.append(ModelEntry(repo, note, _params_of(path), repo, revision, path))
    return entries


def _params_of(path: Path) -> str:
    try:
        return format_count(ModelConfig.from_file(path).num_parameters())
    except (ConfigError, OSError):
        return "?"


def format_count(n: float, units: tuple[str, ...] = ("", "K", "M", "B", "T"), sep: str = "") -> str:
    """Three significant digits with a decimal unit: 494032768 -> "494M"."""
    for power in range(len(units) - 1, 0, -1):
        if n >= 1000 ** power * 0.9995:
            return f"{n / 1000 ** power:.3g}{sep}{units[power]}"
    return f"{n:g}{sep}{units[0]}".strip()


def format_size(n: int) -> str:
    return format_count(n, ("B", "kB", "MB", "GB", "TB"), sep=" ")
