"""Write `genai_config.json`, onnxruntime-genai's description of an exported decoder."""
from __future__ import annotations

import json
from pathlib import Path

from py_engine.config import ModelConfig

from . import contract as C
from .options import ExportOptions


def write_genai_config(out_dir: Path, config: ModelConfig, options: ExportOptions) -> None:
    pass
