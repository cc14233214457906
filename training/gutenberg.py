"""Strip Project Gutenberg boilerplate from an etext, keeping only the work itself.

Gutenberg files wrap the text in a header (title card, "*** START OF ..." or the
1990s "*END*THE SMALL PRINT!" licence), a footer ("*** END OF ..." and the full
licence) and, in the 1990s Shakespeare etexts, "<<THIS ELECTRONIC VERSION ...>>"
copyright notices between scenes. Transcribers also add notes of their own. None of
it is the author's, and a small model trained on it would happily recite licences.

Pure text functions, stdlib only, so the rules are unit-tested on inline samples.
"""
from __future__ import annotations

import re

__all__ = ["clean_text", "strip_gutenberg"]

# Lines that end the header; the text starts after the last one found.
_HEADER_END = re.compile(
    r"^[ \t]*\*{3}[ \t]*START OF (THE|THIS) PROJECT GUTENBERG.*$"
    r"|^[ \t]*\*END\*?[ \t]*THE SMALL PRINT!.*$",
    re.IGNORECASE | re.MULTILINE,
)
# Lines that start the footer; the text ends before the first one found.
_FOOTER_START = re.compile(
    r"^[ \t]*\*{3}[ \t]*END OF (THE|THIS) PROJECT GUTENBERG.*$"
    r"|^[ \t]*End of (the |this )?Project Gutenberg.*$"
    r"|^[ \t]*End of (the |this )?(e-?text|ebook).*$",
    re.IGNORECASE | re.MULTILINE,
)
# "<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS ... COPYRIGHT 1990-1993 ...>>"
_COPYRIGHT_BLOCK = re.compile(r"<<[^<>]*(ELECTRONIC VERSION|COPYRIGHT)[^<>]*>>(?:[ \t]*\n)*", re.IGNORECASE)
# A paragraph (up to a blank line) that is a transcriber's or producer's note.
# Bracketed notes may span paragraphs, so they run to the closing bracket instead.
# Each removal takes the blank lines after it too, so no gap is left behind.
_BRACKETED_NOTE = re.compile(r"^\[(Transcriber|Editor)'?s'? Note[^\]]*\](?:[ \t]*\n)*", re.IGNORECASE | re.MULTILINE)
_NOTE_PARAGRAPH = re.compile(
    r"^(Transcriber'?s'? Note|Produced by|E-?text prepared by|This (e-?text|ebook) was (produced|prepared))"
    r".*?(\n[ \t]*\n|\Z)(?:[ \t]*\n)*",
    re.IGNORECASE | re.MULTILINE | re.DOTALL,
)
# Verse editions print a line number in the right margin every ten lines:
# "attir'd wth starres wee shall for ever sit                  20".
_MARGIN_LINE_NUMBER = re.compile(r"[ \t]{4,}\d{1,4}[ \t]*$", re.MULTILINE)


def strip_gutenberg(text: str) -> str:
    """The text between Gutenberg's header and footer, without its notices and notes.

    Files without a header or footer (already stripped) are kept whole, so the
    function is idempotent.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    headers = list(_HEADER_END.finditer(text))
    if headers:
        text = text[headers[-1].end():]
    footer = _FOOTER_START.search(text)
    if footer:
        text = text[: footer.start()]
    text = _COPYRIGHT_BLOCK.sub("", text)
    text = _BRACKETED_NOTE.sub("", text)
    return _NOTE_PARAGRAPH.sub("", text)


def clean_text(text: str) -> str:
    """strip_gutenberg, then tidy whitespace: no trailing spaces, margin numbers or
    runs of more than two blank lines; one final newline."""
    text = strip_gutenberg(text)
    text = _MARGIN_LINE_NUMBER.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n") + "\n"
