"""The sizes the documentation gives for SmolLM2's int4 web export are the export's (they drifted once: 132 MB
written, 145.7 MB made)."""
from __future__ import annotations

import re

import pytest

from tests.paths import REPO

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

PAGES = {"npm/README.md": r"kept as they are \((\d+(?:\.\d+)?) MB", "docs/models.md": r"as they are, (\d+(?:\.\d+)?) MB"}

pytestmark = pytest.mark.slow


def test_the_int4_web_export_of_smollm2_is_the_size_the_docs_say(smollm2_web):
    made = sum(p.stat().st_size for p in smollm2_web.export.rglob("*") if p.is_file()) / 1e6  # decimal MB
    for page, pattern in PAGES.items():
        found = re.search(pattern, (REPO / page).read_text(encoding="utf-8"))
        assert found, f"{page} no longer states the size ({pattern})"
        assert abs(float(found.group(1)) - made) < 0.15, f"{page} says {found.group(1)} MB; the export is {made:.1f} MB"
