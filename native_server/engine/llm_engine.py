"""The server's engine: many requests in one forward pass per step, over a paged KV cache.

    engine = LLMEngine("tiny-shakespeare", device="cpu")
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=16, n=2, seed=0))
    while engine.has_unfinished_requests():
        for out in engine.step():          # schedule -> run -> postprocess
            ...                            # RequestOutput deltas

A request with n samples is prefilled once; at its first token it forks into
n sequences sharing the prompt's KV blocks (copy-on-write). Sample i draws
from random.Random(seed + i), so it yields what an n=1 request with seed + i
would. `AsyncEngine` (async_engine.py) runs `step()` in a thread of its own.
"""
from __future__ import annotations

import copy
import itertools
import logging
import time
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from native_server.engine.block_manager import BlockManager
from native_server.engine.config import EngineConfig
from native_server.engine.kv_cache import allocate_kv_cache
from native_server.engine.model_runner import ModelRunner
from native_server.engine.lora import EngineAdapters
from native_server.engine.outputs import (AdapterNotFoundError, CompletionOutput, EngineError, EngineStats, Histogram,
                                   PromptTooLongError, QueueFullError, RequestOutput, SampleStream)
from native_server.engine.attention import backend_for
from native_server.engine.sampler import MaskTensors, SamplingRow, sample
from native_server.engine.speculative import SpecDecoder
from native_server.engine.scheduler import Scheduler
from native_server.engine.sequence import Sequence, SequenceStatus
from py_engine.adapters import AdapterError, LoraAdapter
from py_engine.config import GenerationConfig
from py_engine.backends.torch import pick_device
from py_engine.generate import eos_token_ids
from py_engine.hub import resolve_model
from py_engine.models.memory import trim_heap
from py_engine.models import longrope_switch_length
from py_engine.models.kv_quant import KVQuantConfig
from py_engine.cpu.transforms import optimize_for_cpu, row_invariance_problem
from py_engine.quant.load import load_quantized
from py_engine.sampling import SampleOutput
from py_engine.sampling_params import SamplingParams
from py_engine.speculative import SpeculativeConfig
from py_engine.tokenizer import Tokenizer

logger = logging.getLogger("ruvllm.server")


# Tokens per step unless given. On CPU a step's activations should stay in the cores' L2: at 2048 rows
# x alone [2048, 896] fp32 is 7 MB, read again for every 1 MB panel of dequantized weights, and the
# elementwise ops stream from L3; 512 rows (llama.cpp's default micro-batch, vLLM's first chunked-prefill
# default) cost ~7-10% less CPU per prompt token on Qwen2.5-0.5B Q4_0, and decode rows ride along with the
# prompt chunks (benchmarks/server_profile.py).
DEFAULT_BATCHED_TOKENS = {"cpu": 512}
DEFAULT_BATCHED_TOKENS_OTHER = 2048


def default_batched_tokens(device: torch.device) -> int:
    return DEFAULT_BATCHED_TOKENS.get(device.type, DEFAULT_BATCHED_TOKENS_OTHER)


def _quantization(config: EngineConfig, path: Path) -> str:
    """What the served weights are, in words: the in-situ method asked for, else what the model's files hold
    (a GGUF's block types, a GPTQ/AWQ checkpoint), else "none"."""
    from py_engine.hub.resolve import describe
    from py_engine.quant.load import as_quant_config

    asked = as_quant_config(config.quantization)
    if asked.enabled:
        return asked.describe()
    try:
        return describe(str(path)).get("quantization") or "none"
    except Exception:  # noqa: BLE001 - a description for the log; the model itself loaded
        return "unknown"


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    streams: list[SampleStream]  # one per sample, made up front so each seed is fixed from the start
    seqs: list[Sequence] = field(default_factory=list)  # grows to n at the fork
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.streams)


class LLMEngine:
    def __init__(self, config: EngineConfig | str, **options: Any) -> None:
        """config: an EngineConfig, or a model name with EngineConfig's fields as keywords
        (`LLMEngine("tiny-shakespeare", device="cpu", max_num_seqs=8)`). Everything it derives (the device,
        the context limit, the KV cache's size) is computed here, never written back into the config.
        tensor_parallel_size N > 1: the model sharded over this process and N - 1 it starts
        (engine/parallel.py); close() stops them. config.speculative_config: speculative decoding
        (engine/speculative.py), which changes no output."""
        if not isinstance(config, EngineConfig):
            config = EngineConfig(model=config, **options)
        elif options:
            config = config.with_options(**options)
        self.config = config
        kv_quant = KVQuantConfig(config.kv_cache_dtype, config.kv_hot_tokens, config.block_size)  # fail early
        path: Path = resolve_model(config.model, config.cache_dir)
        self.model_name = config.name
        self.device = torch.device(pick_device(config.device))
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_batched_tokens(self.device)
        self.parallel = None  # engine/parallel.EngineParallel with tensor_parallel_size > 1
        self.adapters: EngineAdapters | None = None
        cuda_graphs = config.cuda_graphs
        if config.tensor_parallel_size != 1:
            from native_server.engine.parallel import EngineParallel, ShardOptions
            from py_engine.parallel.layout import check_world
            shard = ShardOptions(str(path), config.quantization, config.dtype, config.optimize,
                                 dict(config.lora_modules), config.enable_lora, config.max_loras, config.max_lora_rank,
                                 config.attention_backend)
            self.parallel, self.model, self.model_config, self.quant_report, self.adapters = EngineParallel.start(
                check_world(config.tensor_parallel_size), self.device, shard)
            cuda_graphs = False  # the all-reduces run outside any captured graph
        else:  # in-situ quantization (none by default) before the KV cache is sized from what is left
            self.model, self.model_config, self.quant_report = load_quantized(path, config.quantization,
                                                                              dtype=config.dtype, device=self.device)
            if config.optimize:  # on CPU: fused projections, the native GEMV/GEMM kernels and norms (no-op elsewhere)
                optimize_for_cpu(self.model)
            if config.lora_modules or config.enable_lora:
                self.adapters = EngineAdapters(self.model, config.max_loras, config.max_lora_rank)
                for name, lora_path in config.lora_modules.items():
                    self.adapters.add(name, lora_path)
        self.quantization = _quantization(config, path)
        try:
            self._finish_init(path, kv_quant, cuda_graphs)
        except BaseException:
            self.close()
            raise

    def _finish_init(self, path: Path, kv_quant: KVQuantConfig, cuda_graphs: bool) -> None:
        config = self.config
        if config.xlora is not None:  # per-token scalings from each row's own hidden state: batches mix freely
            from py_engine.adapters.xlora import load_xlora
            self.model = load_xlora(self.model, config.xlora)
        self.kv_layers = getattr(self.model, "kv_layers", None)  # X-LoRA: its scaling pass's layers too
        self.tokenizer = Tokenizer.from_pretrained(path)
        trim_heap()  # what parsing tokenizer.json freed (~11 MB for Qwen2.5's): not resident beside the model
        model_config = self.model_config
        self.eos_token_ids = eos_token_ids(GenerationConfig.from_model_dir(path), model_config, self.tokenizer)
        self.max_model_len = self._context_limit(config.max_model_len)
        self.kv_quant = kv_quant.check(self.max_model_len)
        self.max_queue, self.max_num_seqs = config.max_queue, config.max_num_seqs
        backend = backend_for(self.device, config.attention_backend)  # before the memory is sized: it may refuse
        sharded = getattr(self.model, "tensor_parallel", None)  # this rank's KV heads
        self.kv = allocate_kv_cache(config, sharded.local_config if sharded is not None else model_config, self.model,
                                    self.device, self.max_model_len, self.max_num_batched_tokens, backend,
                                    self.kv_quant, self.kv_layers)
        self.block_manager = BlockManager(self.kv.num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.kv.num_cold_blocks, kv_quant.hot_tokens if kv_quant.enabled else None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens)
        if self.parallel is not None:
            self.parallel.share_cache(self.kv)
        self.runner = ModelRunner(self.model, self.kv, self._decode_graphs(cuda_graphs, config.max_num_seqs),
                                  self.adapters,
                                  broadcast=self.parallel.broadcast_step if self.parallel is not None else None)
        self.mask_tensors = MaskTensors(model_config.vocab_size, self.device)  # structured outputs' token masks
        spec_config = config.speculative_config
        self.spec = None if spec_config is None else self._spec_decoder(spec_config, config)
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self.prompt_tokens = self.generation_tokens = 0
        self.ttft, self.inter_token_latency = Histogram(), Histogram()
        logger.info("engine: %s on %s, max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d",
                    self.model_name, self.device, self.max_model_len, config.max_num_seqs,
                    self.max_num_batched_tokens)

    def _spec_decoder(self, config: SpeculativeConfig, engine_config: EngineConfig) -> SpecDecoder:
        """Speculative decoding where it cannot change a token: the CPU kernels under the whole model (each
        row of a step computed as decode computes it), every row attended in C, no adapters or cold blocks."""
        problem = row_invariance_problem(self.model)
        if self.device.type != "cpu" or self.kv.backend.name != "cpu":
            problem = f"it needs the CPU kernels and the cpu attention backend (here {self.device.type}, " \
                      f"{self.kv.backend.name} attention)"
        elif self.kv.quant is not None:
            problem = "the int8/int4 two-tier KV cache attends prompt chunks in torch"
        elif self.adapters is not None or self.kv_layers is not None:
            problem = "LoRA adapters add their deltas in torch for several rows"
        elif self.parallel is not None:
            problem = "a tensor-parallel model sums its shards' products in another order for several rows"
        if problem is not None:
            raise ValueError(f"speculative decoding would change this server's output: {problem}")
        if config.method == "ngram":
            return SpecDecoder(config, self.max_model_len)
        from py_engine.backends.torch import TorchBackend

        path = resolve_model(config.model, engine_config.cache_dir)
        model, model_config, _ = load_quantized(path, config.quantization, dtype=engine_config.dtype,
                                                device=self.device)
        optimize_for_cpu(model)
        draft_tok = Tokenizer.from_pretrained(path)
        if model_config.vocab_size != self.model_config.vocab_size or draft_tok.vocab_size != self.tokenizer.vocab_size \
                or any(draft_tok.id_to_token(i) != self.tokenizer.id_to_token(i) for i in range(draft_tok.vocab_size)):
            raise ValueError(f"the draft model {config.model!r} has another vocabulary than the served model: a "
                             "draft must share its tokenizer")
        return SpecDecoder(config, self.max_model_len,
                           lambda: TorchBackend(model, model_config, self.max_model_len))

    def _context_limit(self, max_model_len: int | None) -> int:
        config = self.model_config
        limit = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        switch = longrope_switch_length(config)
        if switch is not None and limit > switch:
            # Past the switch every sequence of the flattened batch would get the long factors, and
            # keys cached with the short ones would need recomputing (transformers does it per sequence).
            logger.warning("LongRoPE model: max_model_len lowered from %d to %d, where it switches factors",
                           limit, switch)
            limit = switch
        return limit

    def _decode_graphs(self, enabled: bool, max_num_seqs: int) -> object | None:
        """CUDA graphs of decode steps (cuda_graphs.py) where they can be captured, else None."""
        if not enabled or self.device.type != "cuda":
            return None
        if self.kv_layers is not None:
            logger.info("CUDA graphs off: X-LoRA runs two passes with data-dependent scalings")
            return None
        from native_server.engine.cuda_graphs import DecodeGraphs, graph_problem

        problem = graph_problem(self.model, self.kv)
        if problem is not None:
            logger.info("CUDA graphs off: %s", problem)
            return None
        return DecodeGraphs(self.model, self.kv, max_num_seqs, self.max_model_len)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step after)."""
        if self.parallel is not None:
            self.parallel.stop()

    # --- requests ---------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, lora: str | None = None) -> None:
        """Raise PromptTooLongError, AdapterNotFoundError or ValueError for a request that can never run."""
        if lora is not None and (self.adapters is None or lora not in self.adapters.by_name):
            raise AdapterNotFoundError(f"no LoRA adapter named {lora!r} is loaded")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) > self.max_model_len - 1:
            raise PromptTooLongError(f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is "
                                     f"{self.max_model_len}: at most {self.max_model_len - 1} leave room to generate")
        vocab = self.model_config.vocab_size
        bad = [t for t in (*prompt_token_ids, *params.logit_bias) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n is {params.n} but the engine runs at most {self.max_num_seqs} sequences")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora: str | None = None) -> None:
        """lora: the name of a loaded adapter to run the request with (None: the base model)."""
        self.check_request(prompt_token_ids, params, lora)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if len(self.scheduler.waiting) >= self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests)")
        prompt = list(prompt_token_ids)
        room = self.max_model_len - len(prompt)
        streams = [SampleStream(self.tokenizer, params, i, self.eos_token_ids, room) for i in range(params.n)]
        req = _Request(request_id, prompt, params, time.monotonic(), streams)
        seq = Sequence(next(self._seq_ids), request_id, 0, prompt, params)
        if lora is not None:
            loaded = self.adapters.get(lora)
            seq.lora, seq.lora_load_id = loaded.key, loaded.load_id
        req.seqs.append(seq)
        self.scheduler.add(req.seqs[0])
        self._requests[request_id] = req
        self.prompt_tokens += len(prompt)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its last output (finish_reason "abort"), or None
        if the request is unknown or already finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.status.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        for stream in req.streams:
            stream.abort()
        self._release_adapters()
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # --- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, detokenize; the outputs of requests that moved.

        The forward pass is the whole batch's: if it raises, so does step() (the engine is then
        unusable). Anything after it is one request's: a request whose sampling or detokenizing
        raises is aborted, its blocks freed, and it ends with an output carrying `error`; the
        others go on.
        """
        try:
            with self.runner.threads():
                return self._step()
        finally:
            self._release_adapters()

    def _release_adapters(self) -> None:
        """Unloaded adapters leave the model once no request uses them (lora.py)."""
        if self.adapters is not None and self.adapters.retiring:
            self.adapters.release(s.lora for req in self._requests.values() for s in req.seqs)

    def _step(self) -> list[RequestOutput]:
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, len(self.scheduler.waiting))
        out = self.scheduler.schedule()
        if not out.seqs:
            return []
        bm = self.block_manager
        cold = [bm.num_cold(s.seq_id) for s in out.seqs] if self.kv.quant is not None else None
        logits, sampling = self.runner.execute(out, [bm.block_table(s.seq_id) for s in out.seqs], cold)
        seqs = [out.seqs[i] for i in sampling]
        if not seqs:  # only prompt chunks ran
            self.scheduler.update(out, {})
            return []
        children = self._new_children(seqs)
        first = list(accumulate((1 + len(s.spec_token_ids) for s in seqs), initial=0))  # each one's first row
        parent_row = {seq.seq_id: first[i] for i, seq in enumerate(seqs)}
        index = [*range(first[-1]), *(parent_row[parent.seq_id] for parent, _ in children)]  # a child samples
        if index != list(range(len(logits))):  # from its parent's logits row; else no 10 MB copy
            logits = logits[index]
        rows, owners, rewind = self._rows(seqs)
        rows += [self._row(child) for _, child in children]
        samples, failed = self._sample(logits, rows, owners + [child for _, child in children])
        kept = {}
        for i, seq in enumerate(seqs):
            mine = samples[first[i]:first[i + 1]]
            if any(x is None for x in mine):
                continue
            kept[seq.seq_id] = self.spec.kept(seq, mine) if seq.spec_token_ids else mine
            if seq.seq_id in rewind:  # a seeded stream draws what it would have without the drafts
                stream = self._requests[seq.request_id].streams[seq.index]
                stream.rng.setstate(rewind[seq.seq_id])
                for _ in kept[seq.seq_id]:
                    stream.rng.random()
        self.scheduler.update(out, {seq_id: [x.token_id for x in xs] for seq_id, xs in kept.items()})
        for (parent, child), x in zip(children, samples[first[-1]:]):
            if x is not None:
                child.output_token_ids.append(x.token_id)
                self.scheduler.fork(parent, child)
                self._requests[parent.request_id].seqs.append(child)
        # (sequence, sample, how many output tokens it has with this one): several with kept drafts
        sampled = [(s, x, len(s.output_token_ids) - len(xs) + i + 1) for s in seqs
                   for xs in [kept.get(s.seq_id, ())] for i, x in enumerate(xs)]
        sampled += [(child, x, 1) for (_, child), x in zip(children, samples[first[-1]:]) if x is not None]
        outputs = self._postprocess(sampled, failed)
        return outputs + [self._fail(request_id, error) for request_id, error in failed.items()]

    def _rows(self, seqs: list[Sequence]) -> tuple[list[SamplingRow], list[Sequence], dict[int, Any]]:
        """Each sequence's sampling rows (1 + k with speculative drafts), their owners, and the random state of
        each drafting sampled sequence before its draws (to rewind to what it keeps)."""
        rows, owners, rewind = [], [], {}
        for seq in seqs:
            if not seq.spec_token_ids:
                rows.append(self._row(seq))
                owners.append(seq)
                continue
            stream = self._requests[seq.request_id].streams[seq.index]
            if not seq.params.is_greedy:
                rewind[seq.seq_id] = stream.rng.getstate()
            draw = (lambda: None) if seq.params.is_greedy else stream.rng.random
            mine = self.spec.rows(seq, self._row(seq), stream.guide, self.mask_tensors.get, draw)
            rows += mine
            owners += [seq] * len(mine)
        return rows, owners, rewind

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], seqs: list[Sequence]
                ) -> tuple[list[SampleOutput | None], dict[str, Exception]]:
        """One sample per row of logits [R, V] (rows[i] of seqs[i]); when the batch raises, row by row, to
        find the requests at fault (None for each of their rows). Each row's uniform draw is taken once,
        so the rows that succeed sample what they would have in the batch."""
        try:
            return list(sample(logits, rows)), {}
        except Exception:
            logger.warning("batched sampling failed; sampling row by row to find the request at fault")
        samples: list[SampleOutput | None] = []
        failed: dict[str, Exception] = {}
        for i, (seq, row) in enumerate(zip(seqs, rows)):
            try:
                samples.append(None if seq.request_id in failed else sample(logits[i:i + 1], [row])[0])
            except Exception as error:
                failed[seq.request_id] = error
                samples.append(None)
        return [None if s.request_id in failed else x for s, x in zip(seqs, samples)], failed

    def _new_children(self, seqs: list[Sequence]) -> list[tuple[Sequence, Sequence]]:
        """The n - 1 samples of each request whose prompt has just been computed."""
        pairs = []
        for parent in seqs:
            if parent.index == 0 and parent.params.n > 1 and not parent.output_token_ids:
                for i in range(1, parent.params.n):
                    pairs.append((parent, Sequence(next(self._seq_ids), parent.request_id, i,
                                                   parent.prompt_token_ids, parent.params, lora=parent.lora,
                                                   lora_load_id=parent.lora_load_id)))
        return pairs

    def _row(self, seq: Sequence) -> SamplingRow:
        stream = self._requests[seq.request_id].streams[seq.index]
        u = None if seq.params.is_greedy else stream.rng.random()  # one draw per token, as the reference
        mask = stream.guide.mask() if stream.guide is not None else None
        return SamplingRow(seq.params, u, seq.prompt_token_ids, seq.output_token_ids,
                           None if mask is None else self.mask_tensors.get(mask))

    def _postprocess(self, sampled: list[tuple[Sequence, SampleOutput, int]],
                     failed: dict[str, Exception]) -> list[RequestOutput]:
        """Detokenize and check stops; a request whose text side raises joins `failed`."""
        now = time.monotonic()
        moved: dict[str, _Request] = {}
        for seq, x, count in sampled:
            req = self._requests[seq.request_id]
            try:
                self._advance(req, seq, x, now, count)
            except Exception as error:
                failed.setdefault(req.request_id, error)
                continue
            moved[req.request_id] = req
        outputs = [self._output(req) for req in moved.values() if req.request_id not in failed]
        for req in moved.values():
            if req.finished and req.request_id not in failed:
                del self._requests[req.request_id]
        return outputs

    def _advance(self, req: _Request, seq: Sequence, x: SampleOutput, now: float, count: int) -> None:
        """x is the sample's count-th output token."""
        stream = req.streams[seq.index]
        if stream.finish_reason is not None:  # a kept draft after the token that ended the sample
            return
        if req.first_token_time is None:
            req.first_token_time = now
            self.ttft.observe(now - req.arrival_time)
        if stream.last_token_time is not None:
            self.inter_token_latency.observe(now - stream.last_token_time)
        stream.last_token_time = now
        self.generation_tokens += 1
        reason = stream.append(x, count)
        if reason is not None:
            self.scheduler.finish(seq, SequenceStatus.finished_by(reason))

    def _fail(self, request_id: str, error: Exception) -> RequestOutput:
        """End a request that raised: abort its sequences, free its blocks, report the error."""
        logger.error("request %s failed; the engine goes on without it", request_id, exc_info=error)
        req = self._requests.pop(request_id)
        for seq in req.seqs:
            if not seq.status.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        for stream in req.streams:
            stream.abort()
        return RequestOutput(request_id, req.prompt_token_ids, [], True, req.seqs[0].num_cached_tokens or 0,
                             error=f"{type(error).__name__}: {error}")

    def _output(self, req: _Request) -> RequestOutput:
        deltas = [d for d in (s.take() for s in req.streams) if d is not None]
        return RequestOutput(req.request_id, req.prompt_token_ids, deltas, req.finished,
                             req.seqs[0].num_cached_tokens or 0)

    # --- adapters (engine thread) ------------------------------------------------------------------
    def load_lora(self, name: str, adapter: LoraAdapter | str | Path) -> None:
        """Load an adapter under a name (AdapterError if it does not fit the model or the limits)."""
        if self.adapters is None:
            raise AdapterError("this engine was started without LoRA support (enable_lora / --enable-runtime-lora)")
        self.adapters.add(name, adapter)

    def unload_lora(self, name: str) -> None:
        """New requests for `name` are refused from now; running ones finish with it (see lora.py)."""
        if self.adapters is None:
            raise AdapterNotFoundError(f"no LoRA adapter named {name!r} is loaded")
        try:
            self.adapters.retire(name)
        except AdapterError as e:
            raise AdapterNotFoundError(str(e)) from None
        self._release_adapters()

    def replace_lora(self, name: str, adapter: LoraAdapter | None) -> None:
        """Load `adapter` as `name` in one call, retiring the one loaded under that name (its running
        requests finish with it; new ones get the new one); None only retires. The learning loops' hot
        swap (learner.py): between two steps, so no request sees the name missing."""
        if self.adapters is None:
            raise AdapterError("this engine was started without LoRA support (enable_lora / --enable-runtime-lora)")
        if name in self.adapters.by_name:
            self.adapters.retire(name)
        if adapter is not None:
            self.adapters.add(name, adapter)
        self._release_adapters()

    def lora_names(self) -> list[str]:
        return sorted(self.adapters.by_name) if self.adapters is not None else []

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks, kv_blocks_used=bm.num_used_blocks,
            kv_blocks_cached=bm.num_cached_blocks, kv_blocks_free=bm.num_free_blocks, block_size=bm.block_size,
            prefix_cache_hits=bm.prefix_hits, prefix_cache_queries=bm.prefix_queries,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            ttft=self.ttft.snapshot(), inter_token_latency=self.inter_token_latency.snapshot(),
            kv_cold_blocks_total=bm.num_cold_blocks, kv_cold_blocks_used=bm.num_used_cold_blocks,
            kv_hot_bytes_per_token=self.kv.hot_bytes_per_token, kv_cold_bytes_per_token=self.kv.cold_bytes_per_token,
            kv_capacity_tokens=(bm.num_blocks + bm.num_cold_blocks) * bm.block_size,
            kv_demoted_blocks=bm.num_demoted, spec_decode=None if self.spec is None else copy.deepcopy(self.spec.live))


__all__ = ["CompletionOutput", "EngineError", "EngineStats", "LLMEngine", "PromptTooLongError", "QueueFullError",
           "RequestOutput"]
