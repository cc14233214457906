"""What speculation did: drafts proposed and accepted, in total and per position (vLLM's spec_decode counters).

`SpecStats` counts one sequence's or one engine's steps; `add` merges. `Throttle` is the per-sequence switch
behind `acceptance_floor`: it keeps a moving average of the share of drafts accepted and, when it falls below
the floor, stops drafting for a number of steps that doubles each time it happens again (and resets once the
share recovers), then tries once more. Speculation changes no token, so this only trades speed. Stdlib only.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0  # verify steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    def record(self, drafted: int, accepted: int) -> None:
        """One verify step: `drafted` tokens proposed, the first `accepted` of them kept."""
        if drafted < 1:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def add(self, other: "SpecStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        if len(self.accepted_per_position) < len(other.accepted_per_position):
            self.accepted_per_position.extend([0] * (len(other.accepted_per_position) - len(self.accepted_per_position)))
        for i, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += n

    @classmethod
    def since(cls, before: dict, now: "SpecStats") -> "SpecStats":
        """The counts `now` gained after `before` (a to_dict() taken earlier)."""
        old = before["accepted_per_position"]
        return cls(now.num_drafts - before["num_drafts"], now.num_draft_tokens - before["num_draft_tokens"],
                   now.num_accepted_tokens - before["num_accepted_tokens"],
                   [n - (old[i] if i < len(old) else 0) for i, n in enumerate(now.accepted_per_position)])

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens each verify step yields on average: 1 (the target's own) + accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length}


class Throttle:
    """Whether a sequence drafts this step, from its recent acceptance (see the module docstring)."""

    WEIGHT = 0.25  # of the newest step in the moving average
    PRIOR = 0.5  # the average a sequence starts from (and restarts from after a pause): ~4 bad steps to pause
    FIRST_PAUSE = 8  # steps without drafts the first time acceptance falls below the floor

    def __init__(self, floor: float) -> None:
        self.floor = floor
        self.average = self.PRIOR
        self.pause = 0  # steps left without drafting
        self.next_pause = self.FIRST_PAUSE

    def allows(self) -> bool:
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        if drafted < 1 or self.floor <= 0.0:
            return
        self.average += self.WEIGHT * (accepted / drafted - self.average)
        if self.average < self.floor:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, 256)
            self.average = self.PRIOR  # judged afresh after the pause
        elif self.average >= 2 * self.floor:
            self.next_pause = self.FIRST_PAUSE
