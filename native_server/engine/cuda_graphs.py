"""CUDA graphs for decode steps: the whole forward pass replayed as one launch for common batch sizes.

A decode step of a small model is hundreds of short kernels, and launching them
from Python costs more than running them (vLLM and nano-vllm capture graphs
for the same reason). At start-up the engine captures one graph per size in
CAPTURE_SIZES up to max_num_seqs, largest first, sharing one memory pool. A
step whose sequences all decode one token is padded up to the next captured
size and replayed; anything else (prompt chunks, more sequences) runs eagerly.

Every input a graph reads lives in one static device buffer, refilled from a
pinned host copy with one transfer per step: token ids, positions, slots,
context lengths, block tables [B, W] (W blocks cover max_model_len). Padding
rows have slot -1 (store_kv skips them) and context length 0 (the decode
kernel writes zeros for them); their logits are dropped. The decode kernel's
split-KV count is fixed per size and each sequence divides its own tiles among
the splits, so one graph serves every context length. Only the Triton backend
can be captured: the torch oracle's shapes follow the longest context. With
int8/int4 KV each row's count of cold blocks is one more input (padding: 0):
the captured kernel reads the cold pool through it (attend_cold), and the
demotions a step needs run before the replay, outside the graph.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from native_server.engine.kv_cache import PagedKVCache
from native_server.engine.attention import PagedMetadata
from native_server.engine.attention.triton import TritonPagedAttention, TritonStep
from py_engine.gpu.paged_attention import choose_splits
from py_engine.models import CausalLM

logger = logging.getLogger("ruvllm.server")

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graph_problem(model: CausalLM, kv: PagedKVCache) -> str | None:
    """Why decode steps of this model cannot be captured, or None."""
    if kv.keys[0].device.type != "cuda":
        return "not on CUDA"
    if not isinstance(kv.backend, TritonPagedAttention):
        return f"the {kv.backend.name} attention backend (graphs need the Triton kernels)"
    if model.config.num_local_experts:
        return "a mixture-of-experts model (its routing has data-dependent shapes)"
    if model.model.rotary_emb.switch_length is not None:
        return "rope that changes with the sequence length (dynamic / longrope)"
    return None


class DecodeGraphs:
    """Captured decode forwards for batch sizes up to max_batch; `run` replays the smallest that fits."""

    def __init__(self, model: CausalLM, kv: PagedKVCache, max_batch: int, max_model_len: int,
                 capture: bool = True) -> None:
        """capture=False (tests without a GPU): `run` fills the same buffers and runs the forward eagerly."""
        self.model, self.kv = model, kv
        device = kv.keys[0].device
        self.sizes = sorted({s for s in CAPTURE_SIZES if s < max_batch} | {max_batch})
        b, self.width = self.sizes[-1], -(-max_model_len // kv.block_size)
        self.max_batch = b
        # [ids | positions | slots | context lengths | cold blocks | tables], B each and B * W: one copy a step
        self.host = torch.zeros(b * (5 + self.width), dtype=torch.long)
        if device.type == "cuda":
            self.host = self.host.pin_memory()
        self.device_buf = torch.zeros_like(self.host, device=device)
        self.ids, self.positions, self.slots, self.lengths, self.cold = self.device_buf[:5 * b].view(5, b)
        self.tables = self.device_buf[5 * b:].view(b, self.width)
        self.arange = torch.arange(b, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        if not capture:
            return
        start = time.perf_counter()
        self._capture_all(device)
        logger.info("CUDA graphs: decode batches of %s captured in %.1f s", self.sizes, time.perf_counter() - start)

    def _meta(self, b: int, device: torch.device) -> PagedMetadata:
        """Metadata of a b-sequence decode step whose tensors are views of the static buffer."""
        ar = self.arange[:b]
        blocks = torch.stack([ar, ar, self.lengths[:b] - 1, (self.lengths[:b] > 0).long()], 1).int()  # [b, 4]
        splits = choose_splits(b, self.kv.keys[0].shape[2], self.width * self.kv.block_size, device)
        two_tier = self.kv.quant is not None
        return PagedMetadata(
            slot_mapping=self.slots[:b], positions=self.positions[:b], query_start=list(range(b + 1)),
            context_lens=[], block_tables=self.tables[:b], decode_seqs=self.arange[:b],
            decode_tokens=self.arange[:b], decode_kv_positions=self.arange.new_zeros(b, 0), prefill_seqs=[],
            kernel_inputs=TritonStep(blocks, 0, [], splits, cold_counts=self.cold[:b].int() if two_tier else None,
                                     captured=two_tier))

    def _forward(self, b: int, device: torch.device) -> Tensor:
        meta = self._meta(b, device)
        logits = self.model(self.ids[None, :b], self.positions[None, :b], self.kv.step(meta),
                            logit_indices=self.arange[:b])  # [1, b, V]
        return logits[0]

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        self.slots.fill_(-1)  # nothing is written while capturing
        pool = None
        for b in reversed(self.sizes):
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up off the capture: compiles the kernels, sizes workspaces
                self._forward(b, device)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(b, device)
            pool = graph.pool()
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize(device)

    def run(self, ids: list[int], positions: list[int], tables: list[list[int]],
            cold_blocks: list[int] | None = None) -> Tensor | None:
        """Logits [n, V] of a decode step of n sequences (their last token ids, its positions, their block
        tables, how many leading ids of each are cold with int8/int4 KV); None when no captured size holds n."""
        n = len(ids)
        size = next((s for s in self.sizes if s >= n), None)
        if size is None or n == 0:
            return None
        b, bs, host = self.max_batch, self.kv.block_size, self.host
        head = host[:5 * b].view(5, b)
        head[0, :n] = torch.tensor(ids)
        head[1, :n] = torch.tensor(positions)
        head[2, :n] = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions)])
        head[3, :n] = torch.tensor(positions) + 1
        head[4, :n] = torch.tensor(cold_blocks) if cold_blocks is not None else 0
        head[2, n:size], head[3, n:size], head[4, n:size] = -1, 0, 0  # padding rows: no write, empty context
        table = host[5 * b:].view(b, self.width)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t)
        self.device_buf.copy_(host, non_blocking=True)
        if size not in self.graphs:  # capture=False
            return self._forward(size, self.device_buf.device)[:n]
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]
