"""Speculative decoding in the server's engine: drafts as extra tokens of a decode step, verified in the batch.

Before each step `propose` gives every running sequence that decodes (its prompt computed, one pending token)
up to k drafts (py_engine.speculative: prompt lookup, or a draft model following the sequence), unless the
request opted out (SamplingParams.speculative), its acceptance or the draft length's costs say no
(py_engine.speculative.DraftLength), more sequences run than `disable_by_batch_size` (DEFAULT_BATCH_LIMIT
when unset), or requests wait in the queue (the batch is about to grow, and they would wait behind verify rows;
acceptance_floor 0 turns this off with the other automatic switches). A step that drafts for no sequence costs
nothing here. The scheduler then computes the pending token and the drafts together, as vLLM v1 does
(num_computed_tokens catching up with num_tokens + drafts), the CPU kernels computing each row as decode would.
`verify` samples all of a sequence's 1 + k rows in the batch's one sampling call, each row with the history it
would have if the drafts before it were kept (penalties, the grammar's mask), then keeps drafts while they equal
the sampled token: the tokens are exactly the ones plain decoding would sample. The uniforms: drawn for every row,
then the sequence's stream is rewound and advanced by the tokens kept, so a seeded request draws what it would
without speculation (prompt lookup's drafts are one-hot: py_engine/speculative/accept.py says why that is exact).
A draft model drafts greedily here (q one-hot, the same rule, for every request). The scheduler drops the
rejected drafts' positions and frees their blocks (Scheduler.update, BlockManager.trim).
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable

from native_server.engine.sampler import SamplingRow
from native_server.engine.sequence import Sequence
from py_engine.speculative import SpecStats, Speculation, SpeculativeConfig
from py_engine.sampling_params import SamplingParams

# Without disable_by_batch_size: drafts only while at most this many sequences run. On the CPU kernels (the only
# ones the server verifies drafts on) each extra row of a step costs about a third of a decode step
# (benchmarks/spec_decode.py), which one stream's accepted drafts repay and a fuller batch's do not.
# acceptance_floor 0 turns this off with the other automatic switches (py_engine/speculative/config.py).
DEFAULT_BATCH_LIMIT = 2


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 draft_backend: Callable[[], Any] | None = None) -> None:
        self.config, self.max_model_len = config, max_model_len
        self.speculation = Speculation(config, draft_backend)
        self.stats = self.speculation.stats  # every finished sequence's counts (SpecStats)
        self.live = SpecStats()  # counts of steps taken, for /metrics as they happen
        self._sessions: dict[int, tuple[Sequence, Any]] = {}  # seq_id -> (the sequence, its SequenceSpeculation)
        self._alone: tuple[float, Any, int] | None = None  # (start, session, drafts) of a step that ran one sequence
        self._drafted = False  # whether the last propose may have left drafts on a sequence

    def propose(self, running: list[Sequence], waiting: int = 0) -> None:
        """Set spec_token_ids on the running sequences that draft this step (`waiting`: requests queued)."""
        now = time.perf_counter()
        if self._alone is not None:  # the last step ran one sequence only: its time is that sequence's step cost
            started, session, drafted = self._alone
            session.timed(drafted, now - started)
            self._alone = None
        for seq_id in [i for i, (seq, _) in self._sessions.items() if seq.status.is_finished]:
            self._sessions.pop(seq_id)[1].finish()
        limit, auto = self.config.disable_by_batch_size, self.config.acceptance_floor > 0
        if limit is None and auto:
            limit = DEFAULT_BATCH_LIMIT
        if (waiting and auto) or (limit is not None and len(running) > limit):
            if self._drafted:  # drafts left on a sequence the last step did not schedule
                for seq in running:
                    seq.spec_token_ids = []
                self._drafted = False
            return
        self._drafted = True
        for seq in running:
            seq.spec_token_ids = []
            if not seq.params.speculative or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            session = self._session(seq)
            left = self.max_model_len - seq.num_tokens
            if seq.params.max_tokens is not None:
                left = min(left, seq.params.max_tokens - len(seq.output_token_ids))
            seq.spec_token_ids = session.propose(left)
            if len(running) == 1:
                self._alone = (now, session, len(seq.spec_token_ids))

    def _session(self, seq: Sequence) -> Any:
        """The sequence's drafting state, brought up to the tokens it kept (prompt lookup indexes them)."""
        session = self._sessions.get(seq.seq_id, (None, None))[1]
        if session is None:
            params = seq.params if self.config.method == "ngram" else SamplingParams.greedy()  # drafts one-hot
            session = self.speculation.start(seq.prompt_token_ids, params)
            session.keep(seq.output_token_ids)
            self._sessions[seq.seq_id] = (seq, session)
        elif len(session.context) < seq.num_tokens:
            session.keep(seq.token_ids(len(session.context), seq.num_tokens))
        return session

    def rows(self, seq: Sequence, base: SamplingRow, guide: Any, mask_tensor: Callable[[Any], Any],
             draw: Callable[[], float | None]) -> list[SamplingRow]:
        """The sequence's 1 + k sampling rows: row j as if the first j drafts were kept (its output history and
        its grammar's mask), each with its own uniform from `draw`."""
        rows, drafts = [base], seq.spec_token_ids
        guide = copy.copy(guide) if guide is not None else None
        for j, token in enumerate(drafts):
            mask = None
            if guide is not None:
                guide.advance(token)
                found = guide.mask()
                mask = None if found is None else mask_tensor(found)
            rows.append(SamplingRow(base.params, draw(), base.prompt_token_ids,
                                    [*base.output_token_ids, *drafts[:j + 1]], mask))
        return rows

    def kept(self, seq: Sequence, sampled: list[Any]) -> list[Any]:
        """The samples of the tokens the sequence keeps: the drafts equal to the target's token, then one more."""
        drafts, keep = seq.spec_token_ids, []
        for j, sample in enumerate(sampled):
            keep.append(sample)
            if j >= len(drafts) or sample.token_id != drafts[j]:
                break
        if drafts:
            accepted = len(keep) - 1
            self._sessions[seq.seq_id][1].record(len(drafts), accepted)
            self.live.record(len(drafts), accepted)
        return keep
