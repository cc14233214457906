"""Consolidated adapters on disk: DIR/adapters/sona-v1, sona-v2, ... and which one is current.

Each version is a peft LoRA folder plus `sona.json` (when and from what it
was trained). `CURRENT` names the version in use; it is replaced atomically
(write, then rename), so a crash never leaves it half written, and rolling
back is pointing it at an older version (or at none: the base model).
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from torch import Tensor

from .lora import load_peft, save_peft

_VERSION = re.compile(r"sona-v(\d+)")
NONE = "none"  # CURRENT's content when the base model is in use


class AdapterStore:
    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def versions(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.folder.iterdir()
                      if (m := _VERSION.fullmatch(p.name)) and (p / "adapter_config.json").is_file())

    def path(self, version: int) -> Path:
        return self.folder / f"sona-v{version}"

    def current(self) -> int | None:
        """The version in use, or None (the base model)."""
        marker = self.folder / "CURRENT"
        if not marker.is_file():
            return None
        m = _VERSION.fullmatch(marker.read_text(encoding="utf-8").strip())
        return int(m.group(1)) if m and int(m.group(1)) in self.versions() else None

    def _point(self, name: str) -> None:
        tmp = self.folder / f".CURRENT.{os.getpid()}"
        tmp.write_text(name + "\n", encoding="utf-8")
        os.replace(tmp, self.folder / "CURRENT")

    def save(self, modules: dict[str, tuple[Tensor, Tensor, float]], info: dict[str, Any],
             base: str | None = None) -> int:
        """Write the next version and make it current; its number."""
        version = max(self.versions(), default=0) + 1
        folder = self.path(version)
        tmp = self.folder / f".sona-v{version}.partial"
        save_peft(tmp, modules, base)
        (tmp / "sona.json").write_text(json.dumps({"version": version, "created": time.time(), **info}, indent=2)
                                       + "\n", encoding="utf-8")
        os.replace(tmp, folder)
        self._point(folder.name)
        return version

    def load(self, version: int) -> dict[str, tuple[Tensor, Tensor, float]]:
        if version not in self.versions():
            raise ValueError(f"no adapter version {version} in {self.folder} (have {self.versions() or 'none'})")
        return load_peft(self.path(version))

    def rollback(self, version: int | None) -> None:
        """Make `version` current again (None or 0: the base model, no consolidated adapter)."""
        if version in (None, 0):
            self._point(NONE)
            return
        if version not in self.versions():
            raise ValueError(f"no adapter version {version} in {self.folder} (have {self.versions() or 'none'})")
        self._point(f"sona-v{version}")

    def info(self, version: int) -> dict[str, Any]:
        return json.loads((self.path(version) / "sona.json").read_text(encoding="utf-8"))
