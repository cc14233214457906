"""The documentation's shape: a short README that links every docs/ page, links that resolve, blocks that run.

The blocks themselves run in test_examples.py; here, that each is of a kind
that runs (or is plain text), that its directive is well formed, and that
skipping stays the exception.
"""
from __future__ import annotations

import re

import pytest

from tests.docs.examples import NOT_CODE, RUNS, examples, pages
from tests.paths import REPO

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
MAX_README_LINES = 250
MAX_SKIPS = 3


def test_the_readme_is_short_and_links_every_docs_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= MAX_README_LINES
    linked = set(LINK.findall(readme))
    docs = sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))
    assert len(docs) >= 9 and [d for d in docs if d not in linked] == []
    assert "benchmarks/README.md" in linked


@pytest.mark.parametrize("page", [*pages(), REPO / "benchmarks" / "README.md"], ids=lambda p: str(p.relative_to(REPO)))
def test_every_local_link_resolves(page):
    targets = [t for t in LINK.findall(page.read_text(encoding="utf-8")) if "://" not in t and not t.startswith("mailto:")]
    assert [t for t in targets if not (page.parent / t).exists()] == []


def test_every_block_runs_or_is_text_and_its_directive_is_well_formed():
    found = [e for page in pages() for e in examples(page)]
    assert len([e for e in found if e.language in RUNS]) >= 20
    assert [e.where for e in found if e.language not in RUNS + NOT_CODE] == []
    servers = [e for e in found if e.directive == "server"]
    assert servers and all(e.argument.isdigit() and e.language == "bash" for e in servers)
    skips = [e for e in found if e.directive == "skip"]
    assert len(skips) <= MAX_SKIPS and all(len(e.argument) > 10 for e in skips)
    assert not [e.where for e in found if e.directive and e.language in NOT_CODE]


def test_the_parser_reads_fences_and_directives(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("intro\n\n<!-- example: expect ^ok$ -->\n```bash\necho ok\n```\n\n```text\nusage: x\n```\n"
                    "```python\nprint(1)\n```\n")
    got = [(e.line, e.language, e.code, e.directive, e.argument) for e in examples(page)]
    assert got == [(4, "bash", "echo ok\n", "expect", "^ok$"), (8, "text", "usage: x\n", None, ""),
                   (11, "python", "print(1)\n", None, "")]
