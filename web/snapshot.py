"""The Pyodide heap shipped with the page: a first visit restores it instead of booting Python (~0.5 s for 2-5 s).

npm/scripts/python-snapshot.mjs makes it in Node (Pyodide from npm/node_modules, the wheels installed,
ruvllm_bridge preloaded) and writes `python.snapshot.gz` and `python-snapshot.json` beside the wheels.
The manifest's key is a digest of Pyodide's version, the bridge and the wheels' bytes, which
npm/src/python.js recomputes from the files a load installs before restoring, so a stale heap is never
used. Built heaps are kept in .cache/python-snapshot by that key: a rebuild with the same wheels reuses one.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NPM = REPO / "npm"
SCRIPT = NPM / "scripts" / "python-snapshot.mjs"
BRIDGE = NPM / "src" / "bridge.py"
CACHE = REPO / ".cache" / "python-snapshot"
MANIFEST, HEAP = "python-snapshot.json", "python.snapshot.gz"
TIMEOUT_S = 300


class SnapshotError(RuntimeError):
    """The snapshot could not be made; the message says why."""


def pyodide_version() -> str:
    return json.loads((NPM / "node_modules" / "pyodide" / "package.json").read_text(encoding="utf-8"))["version"]


def content_key(wheels_dir: Path) -> str:
    """npm/src/python.js contentKey over the same files: sha256 of the version, the bridge, each wheel."""
    h = hashlib.sha256(f"ruvllm-python-snapshot-v1\n{pyodide_version()}\n".encode())
    h.update(BRIDGE.read_text(encoding="utf-8").encode())
    for name in json.loads((wheels_dir / "index.json").read_text(encoding="utf-8")):
        h.update(f"\n{name}\n".encode())
        h.update((wheels_dir / name).read_bytes())
    return h.hexdigest()


def ship_snapshot(wheels_dir: Path) -> dict:
    """Write the heap and its manifest into wheels_dir (made in Node, or the cached one for these files)."""
    key = content_key(wheels_dir)
    kept = CACHE / key
    if not (kept / MANIFEST).is_file():
        node = shutil.which("node")
        if node is None:
            raise SnapshotError("node is missing: the page's Python snapshot is made with Node (apt-get install nodejs)")
        scratch = CACHE / f"{key}.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.copytree(wheels_dir, scratch)
        try:
            subprocess.run([node, str(SCRIPT), str(scratch)], cwd=NPM, check=True, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        except subprocess.CalledProcessError as exc:
            raise SnapshotError(f"python-snapshot.mjs failed: {exc.stderr.strip()[-2000:]}") from None
        made = json.loads((scratch / MANIFEST).read_text(encoding="utf-8"))
        if made["key"] != key:
            raise SnapshotError(f"Node's key {made['key']} is not this build's {key}: python.js and web/snapshot.py differ")
        kept.mkdir(parents=True, exist_ok=True)
        for name in (HEAP, MANIFEST):  # the manifest last: its presence says the heap is whole
            shutil.copy(scratch / name, kept / name)
        shutil.rmtree(scratch)
    for name in (HEAP, MANIFEST):
        shutil.copy(kept / name, wheels_dir / name)
    return json.loads((wheels_dir / MANIFEST).read_text(encoding="utf-8"))
