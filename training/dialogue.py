"""Chat-formatted training documents cut from the plays' own dialogue.

The built-in model is a plain language model, but `ruvllm chat` wraps prompts in
the ChatML template. Without a few ChatML examples the model would never have seen
`<|im_start|>`/`<|im_end|>` (their embeddings would stay random) and would never
stop a reply. So a small, seeded sample of consecutive speeches from the
modern-spelling plays becomes conversations: one speech is the user's turn, the
next speech is the assistant's reply, and so on.

Only the modern editions are used (`Speaker.` alone on a line, the speech below,
a blank line after), and only training documents are passed in.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence

from training.corpus import Document

__all__ = ["CHAT_TEMPLATE", "chat_documents", "render_chatml", "speeches"]

# ChatML, with the document separator first because every training document starts
# after one; rendering matches transformers' apply_chat_template with this template.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_SPEAKER = re.compile(r"^[A-Z][A-Za-z'. -]{0,40}\.$")
_STAGE_DIRECTION = re.compile(r"^\s*\[.*\]\s*$")
MAX_SPEECH_CHARS = 600


def render_chatml(messages: Sequence[tuple[str, str]]) -> str:
    """The template's output (without the leading bos) for (role, content) pairs."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)


def speeches(text: str) -> list[str]:
    """The speeches of a modern-edition play, in order, without speakers or stage
    directions; a paragraph that is not a speech breaks the run with an empty string."""
    out = []
    for paragraph in text.split("\n\n"):
        lines = [ln for ln in paragraph.strip("\n").split("\n") if not _STAGE_DIRECTION.match(ln)]
        if len(lines) >= 2 and _SPEAKER.match(lines[0].strip()):
            out.append("\n".join(ln.strip() for ln in lines[1:]))
        elif out and out[-1]:
            out.append("")  # a scene heading or stage direction: the exchange ends here
    return out


def chat_documents(docs: Sequence[Document], fraction: float, seed: int) -> list[str]:
    """Conversations of 2 or 4 consecutive speeches, about `fraction` of the characters
    of `docs`, chosen with a seeded RNG so the corpus is reproducible."""
    rng = random.Random(seed)
    plays = [speeches(d.text) for d in docs if d.name.endswith("_gut") and not d.name.endswith("_gut_f")]
    plays = [s for s in plays if len(s) > 10]
    budget = fraction * sum(len(d.text) for d in docs)
    out: list[str] = []
    for _ in range(100_000):  # bounded: a window of empty speeches is skipped, not retried forever
        if not plays or budget <= 0:
            break
        play = rng.choice(plays)
        turns = rng.choice((2, 4))
        start = rng.randrange(len(play) - turns)
        window = play[start: start + turns]
        if not all(0 < len(s) <= MAX_SPEECH_CHARS for s in window):
            continue
        roles = ("user", "assistant") * (turns // 2)
        text = render_chatml(list(zip(roles, window)))
        out.append(text)
        budget -= len(text)
    return out
