"""What speculation did: drafts proposed and accepted, in total and per position (vLLM's spec_decode counters).

`SpecStats` counts one sequence's or one engine's steps; `add` merges. `DraftLength` picks each step's number
of drafts from the sequence's recent acceptance and the engine's measured step costs (`StepCosts`): drafting
only as far as it pays, none when it does not (then probing now and then). Speculation changes no token, so
this only trades speed. Stdlib only.
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


class StepCosts:
    """Seconds one generation step takes with k drafts (proposing them and verifying the k + 1 rows), k = 0..K:
    moving averages of the steps timed, shared by an engine's sequences (the hardware's cost, not the text's).
    cost(k) reads a line a + b k fitted (least squares) through the timed lengths' averages, so every timed
    step informs every length's estimate: alone, one length's average is noisy (on a shared machine one slow
    step made a long draft look dear for a hundred steps, and the lengths never timed were guessed from it).
    With one length timed, the others are estimated from it as if each extra row cost PRIOR_ROW of a decode
    (optimistic, so a second length gets tried and timed); with nothing timed, in units of a decode."""

    WEIGHT = 0.1  # of the newest step
    PRIOR_ROW = 0.1

    def __init__(self, k_max: int) -> None:
        self.seconds: list[float | None] = [None] * (k_max + 1)

    def record(self, k: int, seconds: float) -> None:
        if 0 <= k < len(self.seconds) and seconds > 0:
            old = self.seconds[k]
            self.seconds[k] = seconds if old is None else old + self.WEIGHT * (seconds - old)

    def cost(self, k: int) -> float:
        known = [(j, t) for j, t in enumerate(self.seconds) if t is not None]
        if not known:
            return 1 + self.PRIOR_ROW * k
        if len(known) == 1:
            j, t = known[0]
            return t * (1 + self.PRIOR_ROW * k) / (1 + self.PRIOR_ROW * j)
        mean_k = sum(j for j, _ in known) / len(known)
        mean_t = sum(t for _, t in known) / len(known)
        slope = sum((j - mean_k) * (t - mean_t) for j, t in known) / sum((j - mean_k) ** 2 for j, _ in known)
        slope = max(slope, 0.0)  # a row more never makes a step cheaper: noise if the points say so
        return max(mean_t + slope * (k - mean_k), min(t for _, t in known) / 2)


class DraftLength:
    """How many drafts a sequence proposes this step: the k in 0..K with the most tokens per second.

    A step with k drafts yields 1 + p + ... + p^k tokens on average, p being the chance a draft is accepted
    when the one before it was (estimated per sequence from its recent steps: accepted drafts over accepted
    + first rejected, decayed by DECAY a step, starting from PRIOR); it costs StepCosts.cost(k). Prompt lookup
    keeps one estimate per length of the n-gram matched (`key`): a 4-gram's continuation is accepted far more
    often than a 2-gram's (SmolLM2 grounded answers, 8 drafts: 6 of 8 kept after a 6-gram, 3.5 after a 2-gram,
    0.8 after a 1-gram), so a long match drafts far and a short one little. k = 0 is plain decoding, timed once
    before anything else is estimated against it. An estimate below `floor` drafts nothing. A sequence that
    stopped drafting tries one step of drafts again after PROBE steps, the wait doubling while the tries fail
    (up to MAX_PROBE) and reset when one pays. floor 0 turns all of this off: always K drafts. Speculation
    changes no output, so this trades only speed."""

    DECAY = 0.8
    PRIOR = (1.0, 2.0)  # (accepted, trials): p = 0.5
    PROBE, MAX_PROBE = 8, 256

    def __init__(self, floor: float, k_max: int, costs: StepCosts) -> None:
        self.floor, self.k_max, self.costs = floor, k_max, costs
        self.estimates: dict[object, list[float]] = {}  # key -> [accepted, trials], decayed
        self.idle = 0  # steps since the last one that drafted
        self.wait = self.PROBE

    def _estimate(self, key: object) -> list[float]:
        if key not in self.estimates:
            self.estimates[key] = list(self.PRIOR)
        return self.estimates[key]

    @property
    def accepted(self) -> float:
        return self._estimate(None)[0]

    @property
    def trials(self) -> float:
        return self._estimate(None)[1]

    @property
    def p(self) -> float:
        return self.p_of(None)

    def p_of(self, key: object) -> float:
        accepted, trials = self._estimate(key)
        return accepted / trials

    def choose(self, room: int, key: object = None) -> int:
        """Drafts to propose this step (at most `room`; `key`: what the drafts' estimate is kept under)."""
        k_max = min(self.k_max, room)
        if k_max < 1:
            return 0
        if self.floor <= 0.0:
            return k_max
        if self.costs.seconds[0] is None and any(t is not None for t in self.costs.seconds):
            return 0  # time one plain step: drafting's costs are known, the cost it must beat is not
        best = self._best(k_max, self.p_of(key))
        if best == 0 and self.idle >= self.wait:  # a probe: draft once to see whether the text changed
            best = max(1, self._best(k_max, p=self.PRIOR[0] / self.PRIOR[1] + 0.3))
            self.wait = min(2 * self.wait, self.MAX_PROBE)
        self.idle = 0 if best else self.idle + 1
        return best

    def _best(self, k_max: int, p: float) -> int:
        if p < self.floor:
            return 0
        cost0 = self.costs.cost(0)
        best, best_rate, tokens, power = 0, 1.0 / cost0, 1.0, 1.0
        for k in range(1, k_max + 1):
            power *= p
            tokens += power
            rate = tokens / self.costs.cost(k)
            if rate > best_rate * 1.02:  # a longer step must pay clearly: timings are noisy
                best, best_rate = k, rate
        return best

    def record(self, drafted: int, accepted: int, key: object = None) -> None:
        if drafted < 1:
            return
        estimate = self._estimate(key)
        estimate[0] = self.DECAY * estimate[0] + accepted
        estimate[1] = self.DECAY * estimate[1] + accepted + (1 if accepted < drafted else 0)
        if accepted >= 1:
            self.wait = self.PROBE
