"""The learning benchmark's task: invented facts no model can know, each asked two ways.

`facts(n, seed)` makes n facts from five relations over seeded made-up names,
each with a question, a paraphrase of it and a one-word answer ("Quellan.").
Corrections are given on the questions; the paraphrases are held out. So 50
facts are 100 Q/A pairs: one half taught, the other half tested.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

SYLLABLES = ["zor", "quel", "bran", "vex", "tal", "mir", "dun", "osk", "prel", "gant", "ul", "fen", "cor", "yth",
             "lam", "ras", "bel", "tor", "wix", "nim", "kay", "dro", "sul", "pha"]
RELATIONS = [
    ("the capital of {x}", "What is the capital of {x}?", "Which city is {x}'s capital?"),
    ("the inventor of the {x}", "Who invented the {x}?", "Who was the inventor of the {x}?"),
    ("the longest river in {x}", "What is the longest river in {x}?", "Which river is the longest one in {x}?"),
    ("the founder of {x}", "Who founded {x}?", "Who was the founder of {x}?"),
    ("the national animal of {x}", "What is the national animal of {x}?",
     "Which animal is the national animal of {x}?"),
]


@dataclass(frozen=True)
class Fact:
    subject: str
    question: str
    paraphrase: str
    answer: str  # one invented word

    @property
    def reply(self) -> str:
        return f"{self.answer}."


def _name(rng: random.Random, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()
        if name not in used:
            used.add(name)
            return name


def facts(n: int = 50, seed: int = 0) -> list[Fact]:
    rng, used, out = random.Random(seed), set(), []
    for i in range(n):
        _, question, paraphrase = RELATIONS[i % len(RELATIONS)]
        x = _name(rng, used)
        out.append(Fact(x, question.format(x=x), paraphrase.format(x=x), _name(rng, used)))
    return out
