"""The fenced code blocks of the documentation, and how each one runs (tests/docs/test_examples.py).

A block runs by its language: ```python with the project's Python, ```bash
with bash -e, ```js as an ES module in Node beside the installed npm package.
```text blocks (a command's synopsis, a program's output, a file layout) are
not code and do not run; nothing else is allowed. An HTML comment on the line
just above a block changes how it runs:

    <!-- example: server PORT -->   run it in the background (it serves), wait until
                                    http://127.0.0.1:PORT/ answers, keep it up for the
                                    page's later blocks, stop it at the end of the page
    <!-- example: expect REGEX -->  its output must match REGEX
    <!-- example: skip REASON -->   not run, for the reason given (kept to a handful)

Blocks of one page run in order in one scratch folder, so a later block can use
what an earlier one wrote (an export, an adapter).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.paths import REPO

RUNS = ("python", "bash", "js")
NOT_CODE = ("text",)
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
DIRECTIVE = re.compile(r"<!--\s*example:\s*(server|expect|skip)\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Example:
    page: str  # path relative to the repository
    line: int  # the fence's line, 1-based
    language: str
    code: str
    directive: str | None = None  # server / expect / skip
    argument: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md, npm/README.md and every page of docs/."""
    return [REPO / "README.md", REPO / "npm" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def examples(page: Path) -> list[Example]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[:match.start()].rstrip("\n").rpartition("\n")[2]
        directive = DIRECTIVE.search(before)
        found.append(Example(_name(page), line, match.group(1), match.group(2),
                             directive.group(1) if directive else None, directive.group(2) if directive else ""))
    return found


def _name(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else str(page)
