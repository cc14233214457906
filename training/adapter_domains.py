"""The three domains the shipped LoRA adapters specialise in: comedies, tragedies, Milton.

Shakespeare's plays are sorted as the First Folio (1623) sorts them; its histories
are left out. Each domain holds out one whole work, the modern-spelling edition only,
as its test text:

    comedies   held out: Twelfth Night      (also held out from the base model)
    tragedies  held out: Julius Caesar      (also held out from the base model)
    milton     held out: Paradise Regained  (the base model trained on it: no Milton
                                             work was held out when it was made)

Every edition of a held-out work stays out of that domain's adapter training. The
Milton domain is his English verse (Paradise Lost, Comus, the shorter poems);
Areopagitica (prose) and the Latin Poemata are no one's domain.
"""
from __future__ import annotations

import dataclasses

from training.corpus import Document, load_corpus

__all__ = ["DOMAINS", "Domain", "domain_texts"]


@dataclasses.dataclass(frozen=True)
class Domain:
    """A domain: the works it trains on and the one it is tested on."""

    name: str
    works: tuple[str, ...]
    held_out: str


DOMAINS = (
    Domain("comedies", ("tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor", "measure_for_measure",
                        "comedy_of_errors", "much_ado_about_nothing", "loves_labours_lost", "midsummer_nights_dream",
                        "merchant_of_venice", "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well",
                        "winters_tale"), held_out="twelfth_night"),
    Domain("tragedies", ("troilus_and_cressida", "coriolanus", "titus_andronicus", "romeo_and_juliet",
                         "timon_of_athens", "macbeth", "hamlet", "lear", "othello", "antony_and_cleopatra",
                         "cymbeline"), held_out="julius_caesar"),
    Domain("milton", ("paradise_lost_(no_introduction)", "comus", "allegro", "poems"), held_out="paradise_regained"),
)


def domain_texts(domain: Domain, docs: list[Document] | None = None) -> tuple[list[str], str]:
    """(training documents, held-out text) of one domain; every edition of its works trains."""
    if docs is None:
        train, validation = load_corpus()
        docs = train + validation
    by_work: dict[str, list[Document]] = {}
    for doc in docs:
        by_work.setdefault(doc.work, []).append(doc)
    missing = [w for w in (*domain.works, domain.held_out) if w not in by_work]
    if missing:
        raise SystemExit(f"domain {domain.name}: works missing from the corpus: {missing}")
    train = [doc.text for work in domain.works for doc in sorted(by_work[work], key=lambda d: d.name)]
    held = sorted(by_work[domain.held_out], key=lambda d: d.name)  # "x_gut" sorts before the Folio's "x_gut_f"
    return train, held[0].text
