"""Verification: which drafts a target keeps, so that the output is distributed exactly as without speculation.

Leviathan et al. (2023), the rule vLLM's rejection sampler follows, per position i with target distribution p
(the sampler's steps 0-8 on the target's row: mask, bias, penalties, temperature, top-k/p, min-p) and draft
distribution q that proposed d_i:
- greedy requests: keep d_i if it is the target's argmax (of the processed row); else the argmax is the token;
- sampled requests: keep d_i with probability min(1, p(d_i) / q(d_i)); else draw from the residual
  max(0, p - q) / sum. Either way the token at i has distribution p, and positions after the first rejection
  are dropped.
When q is one-hot (prompt lookup; a draft model drafting greedily) the rule is: draw the target's own token with
the sampler's usual one uniform, keep d_i if they are equal. That is the same law (keep with probability p(d_i),
else p without d_i, renormalized) and it draws exactly the uniforms the loop without speculation draws, so a
seeded run gives the same tokens with or without speculation. Only a draft model sampling from its own q takes
`accept_sampled` here (its uniforms come from the draft's own stream). Stdlib only (ring 0).
"""
from __future__ import annotations

from typing import Sequence

from py_engine.sampling import Logits, Mask, SamplingParams, token_probabilities


def accept_sampled(target: Logits, params: SamplingParams, draft: int, q: dict[int, float], r: float, u: float,
                   output_ids: Sequence[int] = (), prompt_ids: Sequence[int] = (),
                   mask: Mask | None = None) -> tuple[int, bool]:
    """(token, kept) at one position: kept is True when the token is the draft (probability min(1, p/q)).

    q: the distribution the draft was drawn from (token -> probability, q[draft] > 0); r, u in [0, 1): the
    acceptance test's uniform and the residual draw's."""
    p = token_probabilities(target, params, output_ids, prompt_ids, mask)
    pd, qd = p.get(draft, 0.0), q.get(draft, 0.0)
    if qd <= 0.0:
        raise ValueError(f"the draft token {draft} has probability 0 under its own draft distribution")
    if r * qd < pd:  # r < p / q, without dividing
        return draft, True
    return residual_draw(p, q, u), False


def residual_draw(p: dict[int, float], q: dict[int, float], u: float) -> int:
    """A token from max(0, p - q) normalized, by inverse CDF over ascending ids; from p when p <= q everywhere
    (then p == q where it has mass: rounding left no residual, and p itself is the right law)."""
    residual = [(t, pt - q.get(t, 0.0)) for t, pt in sorted(p.items())]
    residual = [(t, w) for t, w in residual if w > 0.0]
    if not residual:
        residual = [(t, w) for t, w in sorted(p.items()) if w > 0.0]
    total = sum(w for _, w in residual)
    target, running = u * total, 0.0
    for token, w in residual:
        running += w
        if running > target:
            return token
    return residual[-1][0]
