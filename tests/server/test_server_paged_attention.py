"""Paged attention against the dense reference cache, and the paged model against the dense model.

Ragged batches (decode tokens and prompt chunks in one flattened row),
scattered block ids, GQA, sliding windows and softcapping (the mistral and
gemma2 families). Every device backend available here runs the same checks;
CPU always does, CUDA and MPS when present.
"""
from __future__ import annotations

import random

import pytest
import torch

from native_server.engine.block_manager import BlockManager
from native_server.engine.kv_cache import PagedKVCache
from native_server.engine.model_runner import ModelRunner, prepare_inputs
from native_server.engine.attention import TorchPagedAttention, backend_for
from native_server.engine.scheduler import Scheduler
from native_server.engine.sequence import Sequence
from py_engine.config import ModelConfig
from py_engine.models import AttentionSpec, CausalLM, DenseKVCache
from py_engine.sampling_params import SamplingParams
from tests.model_cases import FAMILIES

torch.set_num_threads(1)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) + (
    ["mps"] if torch.backends.mps.is_available() else [])
BLOCK = 4


def dense_outputs(q, k, v, context, spec):
    """Through DenseKVCache: write the first `context` tokens, then attend with the new ones."""
    H, T, D = q.shape
    KV = k.shape[0]
    dense = DenseKVCache([torch.zeros(1, KV, T + context, D, dtype=q.dtype)],
                         [torch.zeros(1, KV, T + context, D, dtype=q.dtype)])
    if context:
        dense.attend(0, torch.zeros(1, H, context, D), k[None, :, :context], v[None, :, :context],
                     torch.arange(context)[None], spec)
    new = torch.arange(context, context + T)
    return dense.attend(0, q[None], k[None, :, context:], v[None, :, context:], new[None], spec)[0]  # [H, T, D]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", [AttentionSpec(0.25), AttentionSpec(0.25, sliding_window=5),
                                  AttentionSpec(0.3, sliding_window=6, softcap=2.0)],
                         ids=["full", "window", "window-softcap"])
def test_paged_attention_equals_dense_on_a_ragged_batch(device, spec):
    gen = torch.Generator().manual_seed(0)
    H, KV, D = 4, 2, 8
    # (context already cached, new tokens): decodes, chunks, a first chunk, a long context.
    shapes = [(0, 7), (9, 1), (3, 1), (13, 5), (0, 1), (21, 1), (6, 6)]
    blocks = list(range(40))
    random.Random(1).shuffle(blocks)  # scattered block ids
    backend = backend_for(device)
    key_cache = torch.zeros(40, BLOCK, KV, D, device=device)
    value_cache = torch.zeros_like(key_cache)
    q_all, tables, want, lens = [], [], [], []
    for context, new in shapes:
        total = context + new
        q = torch.randn(H, new, D, generator=gen)
        k, v = torch.randn(KV, total, D, generator=gen), torch.randn(KV, total, D, generator=gen)
        table = [blocks.pop() for _ in range(-(-total // BLOCK))]
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)], dtype=torch.long)
        if context:  # an earlier step wrote these
            backend.write(key_cache, value_cache, k[:, :context].transpose(0, 1).to(device),
                          v[:, :context].transpose(0, 1).to(device), slots.to(device))
        q_all.append(q)
        tables.append((table, k, v))
        want.append(dense_outputs(q, k, v, context, spec))
        lens.append(total)

    seqs = [Sequence(i, str(i), 0, [0] * total, SamplingParams()) for i, total in enumerate(lens)]
    for seq, (context, _) in zip(seqs, shapes):
        seq.num_computed_tokens = context
    out = _scheduled(seqs, [new for _, new in shapes])
    inputs = prepare_inputs(out, [t for t, _, _ in tables], BLOCK, torch.device(device))
    new_k = torch.cat([k[:, c:] for (_, k, _), (c, _) in zip(tables, shapes)], dim=1)  # [KV, N, D]
    new_v = torch.cat([v[:, c:] for (_, _, v), (c, _) in zip(tables, shapes)], dim=1)  # [KV, N, D]
    backend.write(key_cache, value_cache, new_k.transpose(0, 1).to(device), new_v.transpose(0, 1).to(device),
                  inputs.meta.slot_mapping)
    q = torch.cat(q_all, dim=1).transpose(0, 1).to(device)  # [N, H, D]
    got = backend.attend(q, key_cache, value_cache, inputs.meta, spec).transpose(0, 1).cpu()  # [H, N, D]
    torch.testing.assert_close(got, torch.cat(want, dim=1), atol=1e-5, rtol=1e-5)
    if not isinstance(backend, TorchPagedAttention):  # a fast backend also agrees with the oracle
        oracle = TorchPagedAttention().attend(q, key_cache, value_cache, inputs.meta, spec)
        torch.testing.assert_close(got, oracle.transpose(0, 1).cpu(), atol=1e-5, rtol=1e-5)


def _scheduled(seqs, num_new):
    from native_server.engine.scheduler import SchedulerOutput
    return SchedulerOutput(seqs=list(seqs), num_new_tokens=list(num_new))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama-yarn", "mistral", "gemma2", "qwen2"])
def test_paged_model_logits_equal_the_dense_model(device, family):
    """Teacher-forced sequences run through scheduler + runner with a small token budget (chunked
    prefill mixed with decodes) give the logits of one full dense forward, at every sampled position."""
    torch.manual_seed(0)
    config = ModelConfig.from_dict(FAMILIES[family])
    model = CausalLM(config).eval().to(device)
    gen = torch.Generator().manual_seed(2)
    lengths = [(5, 6), (19, 3), (33, 4), (2, 9), (12, 1)]  # (prompt, tokens then fed one by one)
    full = [torch.randint(0, config.vocab_size, (p + g,), generator=gen).tolist() for p, g in lengths]
    with torch.inference_mode():
        want = [model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device)[None])[0].cpu()
                for ids in full]
    bm = BlockManager(64, BLOCK)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16)
    runner = ModelRunner(model, PagedKVCache(config, 64, BLOCK, torch.float32, device))
    seqs = [Sequence(i, str(i), 0, ids[:p], SamplingParams()) for i, (ids, (p, _)) in enumerate(zip(full, lengths))]
    for seq in seqs:
        sched.add(seq)
    checked = 0
    while sched.has_unfinished():
        out = sched.schedule()
        logits, sampling = runner.execute(out, [bm.block_table(s.seq_id) for s in out.seqs])
        fed = {}
        for row, i in enumerate(sampling):
            seq = out.seqs[i]
            position = seq.num_tokens - 1
            torch.testing.assert_close(logits[row].cpu(), want[seq.seq_id][position], atol=2e-4, rtol=2e-4)
            checked += 1
            fed[seq.seq_id] = full[seq.seq_id][seq.num_tokens] if seq.num_tokens < len(full[seq.seq_id]) else 0
        sched.update(out, fed)
        for seq in list(sched.running):
            if seq.num_tokens == len(full[seq.seq_id]) + 1:
                sched.finish(seq, seq.status.finished_by("length"))
    assert checked == sum(g for _, g in lengths) + len(lengths)
    assert bm.num_used_blocks == 0
