"""One forward pass per step: the scheduled tokens of every sequence flattened into one row.

Like vLLM, the batch is B = 1 and T = all scheduled tokens: a decode step
contributes one token, a prompt chunk many, and no padding is run through the
model. Logits are computed only at each sequence's last scheduled token, and
only for sequences whose KV has then caught up with all their tokens (those
sample a token this step; a prompt chunk in the middle does not).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from native_server.engine.kv_cache import PagedKVCache
from native_server.engine.attention import PagedMetadata, decode_kv_positions
from native_server.engine.scheduler import SchedulerOutput
from py_engine.models import CausalLM
from py_engine.cpu.transforms import kernel_step, model_kernels


@dataclass(frozen=True)
class PlannedSeq:
    """What the forward needs of one sequence (a Sequence's numbers, picklable: tensor-parallel ranks get it)."""

    num_computed_tokens: int
    num_tokens: int
    new_ids: tuple[int, ...]  # the tokens this step computes, from num_computed_tokens on
    lora: str | None
    spec_token_ids: tuple[int, ...] = ()  # speculative drafts riding on this step (their rows follow new_ids')

    def token_ids(self, start: int, end: int) -> list[int]:
        if start != self.num_computed_tokens or end - start > len(self.new_ids):
            raise ValueError(f"a planned step holds tokens [{self.num_computed_tokens}, "
                             f"{self.num_computed_tokens + len(self.new_ids)}), not [{start}, {end})")
        return list(self.new_ids[:end - start])


@dataclass(frozen=True)
class StepPlan:
    """One step as plain ints and lists: what rank 0 broadcasts to tensor-parallel workers (engine/parallel.py),
    and what prepare_inputs reads (it has `seqs` and `num_new_tokens`, as a SchedulerOutput)."""

    seqs: list[PlannedSeq]
    num_new_tokens: list[int]
    block_tables: list[list[int]]
    cold_blocks: list[int] | None
    block_copies: list[tuple[int, int]]
    demotions: list[tuple[int, int]]

    @classmethod
    def of(cls, out: SchedulerOutput, block_tables: list[list[int]], cold_blocks: list[int] | None) -> "StepPlan":
        seqs = [PlannedSeq(s.num_computed_tokens, s.num_tokens,
                           tuple(s.token_ids(s.num_computed_tokens, s.num_computed_tokens + n)), s.lora,
                           tuple(s.spec_token_ids))
                for s, n in zip(out.seqs, out.num_new_tokens)]
        return cls(seqs, list(out.num_new_tokens), block_tables, cold_blocks, list(out.block_copies),
                   list(out.demotions))


@dataclass
class StepInputs:
    input_ids: Tensor  # [1, N]
    positions: Tensor  # [1, N]
    meta: PagedMetadata
    logit_indices: Tensor  # [R]: the last token of each sampling sequence (and its speculative drafts, in order)
    sampling: list[int]  # indices into the step's sequences of those that sample


def prepare_inputs(out: SchedulerOutput, block_tables: list[list[int]], block_size: int,
                   device: torch.device, cold_blocks: list[int] | None = None) -> StepInputs:
    """Token ids, positions, slots and per-sequence metadata of one step, built with tensor ops, not per token."""
    ids: list[int] = []
    starts = [seq.num_computed_tokens for seq in out.seqs]
    for seq, start, n in zip(out.seqs, starts, out.num_new_tokens):
        ids.extend(seq.token_ids(start, start + n))
    query_start = [0, *accumulate(out.num_new_tokens)]
    context_lens = [start + n for start, n in zip(starts, out.num_new_tokens)]
    # a sequence samples once it catches up: with speculative drafts, at its pending token and at each draft
    sampling = [i for i, seq in enumerate(out.seqs) if context_lens[i] == seq.num_tokens + len(seq.spec_token_ids)]

    num_new = torch.tensor(out.num_new_tokens)
    seq_of_token = torch.repeat_interleave(torch.arange(len(out.seqs)), num_new)  # [N]
    offsets = torch.tensor(starts) - torch.tensor(query_start[:-1])  # [S]: position minus batch index
    positions = torch.arange(len(ids)) + offsets[seq_of_token]  # [N]
    width = max(map(len, block_tables))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables])  # [S, max_blocks]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size  # [N]
    decode = [i for i, n in enumerate(out.num_new_tokens) if n == 1]
    lens = torch.tensor(context_lens)
    meta = PagedMetadata(
        slot_mapping=slots.to(device), positions=positions.to(device), query_start=query_start,
        context_lens=context_lens, block_tables=tables.to(device),
        decode_seqs=torch.tensor(decode, dtype=torch.long, device=device),
        decode_tokens=torch.tensor([query_start[i] for i in decode], dtype=torch.long, device=device),
        decode_kv_positions=decode_kv_positions(lens[decode], block_size).to(device),
        prefill_seqs=[i for i, n in enumerate(out.num_new_tokens) if n > 1], cold_blocks=cold_blocks)
    logit_indices = torch.tensor([j for i in sampling for j in range(query_start[i + 1] - 1 - len(out.seqs[i].spec_token_ids),
                                                                     query_start[i + 1])], dtype=torch.long, device=device)
    return StepInputs(torch.tensor([ids], device=device), positions[None].to(device), meta, logit_indices,
                      sampling)


class ModelRunner:
    """The model and its paged KV cache; `graphs` (cuda_graphs.DecodeGraphs) replays decode steps.

    With tensor parallelism (engine/parallel.py) each rank has one over its shard and its share of
    the cache: rank 0's `broadcast` sends each step's plan to the workers before it runs it, and the
    workers' runners (logits=False) run the layers only."""

    def __init__(self, model: CausalLM, kv: PagedKVCache, graphs: Any = None, adapters: Any = None, *,
                 logits: bool = True, broadcast: Callable[[StepPlan], None] | None = None) -> None:
        """adapters: native_server.engine.lora.EngineAdapters when LoRA is on: each token gets its sequence's adapter."""
        self.model, self.kv, self.graphs, self.adapters = model, kv, graphs, adapters
        self.logits, self.broadcast = logits, broadcast
        self.device = kv.keys[0].device
        self.kernels = model_kernels(model)  # set when optimize_for_cpu put the CPU kernels under the model
        self._threaded = False  # inside threads()

    @contextmanager
    def threads(self) -> Iterator[None]:
        """A step's thread settings (kernel_step: torch on one thread, the CPU kernels' pool on torch's count),
        re-entrant. The engine holds it over a whole step, so that building the inputs and sampling run their
        small torch ops single-threaded too: on a busy machine a 2-thread OpenMP region there (the argmax of
        16 rows of a 150k vocabulary, a repeat_interleave) waited ~8 ms a step for its second thread."""
        if self.kernels is None or self._threaded:
            yield
            return
        self._threaded = True
        try:
            with kernel_step(self.kernels):
                yield
        finally:
            self._threaded = False

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]],
                cold_blocks: list[int] | None = None) -> tuple[Tensor, list[int]]:
        """Logits [R, V] (float32) for the sequences that sample, and their indices in out.seqs: one row each, or
        with speculative drafts (seq.spec_token_ids) 1 + k rows, the pending token's then each draft's;
        cold_blocks: how many leading ids of each table are in the cold pool (int8/int4 KV)."""
        plan = StepPlan.of(out, block_tables, cold_blocks)
        adapted = self.adapters is not None and any(s.lora is not None for s in out.seqs)
        if self.graphs is not None and not adapted and all(n == 1 and s.num_computed_tokens + 1 == s.num_tokens
                                                           for s, n in zip(out.seqs, out.num_new_tokens)):
            self._move_blocks(plan)  # before the replay, outside the graph
            plan = replace(plan, block_copies=[], demotions=[])
            positions = [s.num_computed_tokens for s in out.seqs]  # every sequence decodes its last token
            ids = [s.token_ids(p, p + 1)[0] for s, p in zip(out.seqs, positions)]
            logits = self.graphs.run(ids, positions, block_tables, cold_blocks)
            if logits is not None:
                return logits, list(range(len(out.seqs)))
        if self.broadcast is not None:
            self.broadcast(plan)
        return self.run(plan)

    def _move_blocks(self, plan: StepPlan) -> None:
        if plan.demotions:  # first: the hot blocks they free may be written or copied into below
            self.kv.demote(plan.demotions)
        self.kv.copy_blocks(plan.block_copies)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[Tensor, list[int]]:
        """One step of a plan (execute's, or rank 0's on a tensor-parallel worker)."""
        self._move_blocks(plan)
        with self.threads():
            inputs = prepare_inputs(plan, plan.block_tables, self.kv.block_size, self.device, plan.cold_blocks)
            if self.adapters is not None:
                self.adapters.set_mix([s.lora for s in plan.seqs], plan.num_new_tokens, inputs.sampling)
            if not inputs.sampling or not self.logits:  # prompt chunks only, or a worker: the KV, no LM head
                self.model.model(inputs.input_ids, inputs.positions, self.kv.step(inputs.meta))
                return torch.empty(0, self.model.config.vocab_size), []
            logits = self.model(inputs.input_ids, inputs.positions, self.kv.step(inputs.meta),
                                logit_indices=inputs.logit_indices)  # [1, R, V]
        return logits[0], inputs.sampling
