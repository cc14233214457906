"""The Python API: load a model once, then generate with SamplingParams, streaming or not.

    from py_engine import LLM, SamplingParams
    llm = LLM("tiny-shakespeare")
    print(llm.generate("ROMEO:", SamplingParams(max_tokens=40, seed=0)).text)
    for chunk in llm.stream("JULIET:", SamplingParams(max_tokens=40)):
        print(chunk.text, end="", flush=True)
    LLM("tiny-shakespeare", quantization="int4")         # or a QuantConfig: quantized at load time
    LLM("tiny-shakespeare", kv_cache_dtype="int4", kv_hot_tokens=128)  # two-tier KV cache (kv_quant.py)
    llm = LLM("tiny-shakespeare", lora={"sonnets": "path/to/peft-adapter"})
    llm.generate("ROMEO:", lora="sonnets")               # that adapter; lora=None (default) is the base

`TorchBackend` is the forward pass of one sequence over a dense KV cache; the
loop itself (sampling, detokenizing, stops) is py_engine.generate's, shared
with every other backend.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from py_engine.adapters.config import DEFAULT_MAX_RANK
from py_engine.chat import ChatConfig, load_chat_config, render_chat
from py_engine.config import GenerationConfig, ModelConfig, longrope_recomputes
from py_engine.generate import Completion, GenerationChunk, complete, eos_token_ids, start_ids, stream
from py_engine.hub import resolve_model
from py_engine.models import CausalLM, DenseKVCache, longrope_switch_length
from py_engine.models.kv_quant import DEFAULT_HOT_TOKENS, KVQuantConfig, dense_kv_config
from py_engine.models.memory import trim_heap
from py_engine.cpu.transforms import kernel_step, model_kernels, optimize_for_cpu, row_invariance_problem
from py_engine.quant.config import QuantConfig
from py_engine.quant.load import as_quant_config, load_quantized
from py_engine.sampling_params import SamplingParams
from py_engine.speculative import SpecStats, Speculation, SpeculativeConfig
from py_engine.tokenizer import Tokenizer

_CACHE_STEP = 256  # KV capacity grows in steps of this many positions


def pick_device(device: str = "auto") -> str:
    """'auto' is CUDA when present, then Metal (MPS), then CPU."""
    if device != "auto":
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for but CUDA is not available here")
        if device == "mps" and not torch.backends.mps.is_available():
            raise ValueError("device 'mps' was asked for but Metal is not available here")
        return device
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


class TorchBackend:
    """One sequence through the torch model, its KV cache grown as the sequence grows."""

    def __init__(self, model: CausalLM, config: ModelConfig, max_context: int, lora: str | None = None,
                 kv_quant: KVQuantConfig | None = None, *, logits: bool = True, mirror: Any = None) -> None:
        """config: the one the KV cache is sized from (a sharded model's local_config). logits=False runs the
        layers only (a tensor-parallel worker: rank 0 computes the logits); mirror: rank 0's channel to the
        workers (py_engine.parallel.backend.SequenceMirror), which replay each prefill and decode."""
        self.model, self.config, self.max_context = model, config, max_context
        self.logits, self.mirror = logits, mirror
        self.kv_quant = kv_quant
        manager = getattr(model, "lora", None)  # py_engine.adapters.LoraManager, when adapters are loaded
        if lora is not None and manager is None:
            raise ValueError(f"adapter {lora!r} was asked for but this model has no LoRA adapters loaded")
        self.lora, self._lora_manager = lora, manager
        if manager is not None:
            manager.slot(lora)  # an unknown name fails here, before any work
        weight = next(model.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        self.kv: DenseKVCache | None = None
        self.length = 0
        self.tokens: list[int] = []
        # Phi-3 LongRoPE switches from short to long factors past this length; transformers then
        # recomputes the whole cache with the long factors, and so do we.
        self.switch_length = longrope_switch_length(config)
        self.kernels = model_kernels(model)  # set when optimize_for_cpu swapped in the CPU kernels

    def _step(self) -> Any:
        """With the CPU kernels, torch runs single-threaded beside their pool (see py_engine.cpu.transforms)."""
        return kernel_step(self.kernels) if self.kernels is not None else nullcontext()

    def _adapter(self) -> Any:
        """This sequence's adapter (or the base) for the forward: the mix is the model's, set per call."""
        return self._lora_manager.using(self.lora) if self._lora_manager is not None else nullcontext()

    def _reserve(self, length: int) -> None:
        """Make room for `length` positions, copying the filled prefix into a larger cache."""
        if self.kv is not None and self.kv.max_len >= length:
            return
        capacity = min(self.max_context, -(-length // _CACHE_STEP) * _CACHE_STEP)
        # X-LoRA (py_engine.adapters.xlora) keeps its scaling pass's cache beside the model's: kv_layers = 2 x layers
        layers = getattr(self.model, "kv_layers", None)
        fresh = DenseKVCache.allocate(self.config, 1, capacity, self.dtype, self.device, layers=layers,
                                      quant=self.kv_quant)
        if self.kv is not None:
            for old, new in zip(self.kv.keys + self.kv.values, fresh.keys + fresh.values):
                new[:, :, : self.length].copy_(old[:, :, : self.length])
            if hasattr(fresh, "settled"):  # the copied prefix keeps its cold blocks
                fresh.take_cold(self.kv)
        self.kv = fresh

    @torch.inference_mode()
    def _forward(self, token_ids: Sequence[int], every_row: bool = False) -> torch.Tensor:
        """Logits after the last token [V], or after each of them [n, V] (every_row)."""
        n = len(token_ids)
        self._reserve(self.length + n)
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        positions = torch.arange(self.length, self.length + n, device=self.device)[None]  # [1, n]
        with self._step(), self._adapter():
            logits = self._run(ids, positions, every_row)  # [1, 1 or n, V]
        self.length += n
        return None if logits is None else logits[0] if every_row else logits[0, -1]  # float32

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, every_row: bool = False) -> torch.Tensor | None:
        if not self.logits:  # a tensor-parallel worker: the layers and their all-reduces, no LM head
            self.model.model(ids, positions, self.kv)
            return None
        return self.model(ids, positions, self.kv, last_only=not every_row)

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        if self.mirror is not None:
            return self.mirror.run("prefill", list(token_ids), self._prefill)
        return self._prefill(token_ids)

    def decode(self, token_id: int) -> torch.Tensor:
        if self.mirror is not None:
            return self.mirror.run("decode", int(token_id), self._decode)
        return self._decode(token_id)

    def _prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        self.length = 0
        if hasattr(self.kv, "settled"):  # a fresh sequence in the same buffers: nothing is cold yet
            self.kv.settled = 0
        self.tokens = list(token_ids)
        return self._forward(token_ids)

    def _decode(self, token_id: int) -> torch.Tensor:
        self.tokens.append(token_id)
        if longrope_recomputes(self.switch_length, len(self.tokens)):
            return self._prefill(self.tokens)
        return self._forward([token_id])

    def verify(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append several tokens in one forward; the logits after each [n, V] (speculative decoding). Each
        row is what decode would give after that token: the CPU kernels compute a row the same way however
        many come with it (speculation_problem says where that does not hold)."""
        self.tokens.extend(token_ids)
        return self._forward(token_ids, every_row=True)

    def rollback(self, n: int) -> None:
        """Forget the last n tokens (rejected drafts): the next call writes over their cache slots."""
        if not 0 <= n <= self.length - 1:
            raise ValueError(f"cannot roll back {n} of {self.length} tokens")
        if n:
            self.length -= n
            del self.tokens[-n:]

    def speculation_problem(self) -> str | None:
        """Why speculative decoding could change this backend's greedy output (None: it cannot)."""
        if self.kernels is None or self.device.type != "cpu":
            return (f"on {self.device.type} without the CPU kernels, a k + 1 row verify pass is not computed "
                    "the way decode computes a row (only the CPU kernels guarantee that)")
        problem = row_invariance_problem(self.model)
        if problem is not None:
            return problem
        if self.kv_quant is not None and self.kv_quant.enabled:
            return "the int8/int4 two-tier KV cache attends prompt chunks in torch (not as decode does)"
        if self.switch_length is not None:
            return "a LongRoPE model recomputes its cache at its switch length"
        if self._lora_manager is not None or getattr(self.model, "kv_layers", None) is not None:
            return "LoRA adapters add their deltas in torch for several rows (not as the decode step does)"
        return None

    def mask_logits(self, logits: torch.Tensor, mask: Any) -> torch.Tensor:
        """Structured outputs' step 0 in torch: -inf where the mask (a guided TokenMask) forbids."""
        bits = torch.frombuffer(bytearray(mask.bitmap()), dtype=torch.uint8)  # [tokenizer vocab]
        allowed = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        n = min(len(bits), logits.shape[-1])
        allowed[:n] = bits[:n].bool()
        return logits.masked_fill(~allowed, -torch.inf)

    def argmax(self, logits: torch.Tensor) -> int:
        if (self.kernels is not None and logits.dtype == torch.float32 and logits.is_cpu
                and logits.is_contiguous() and logits.numel()):
            return self.kernels.argmax(logits)  # torch's took ~0.35 ms of 151,936 logits
        with self._step():
            return int(torch.argmax(logits))  # first index of the max, like the reference sampler


class LLM:
    """A loaded model with its tokenizer, chat template and generation defaults."""

    def __init__(self, model: str = "tiny-shakespeare", *, dtype: str = "auto", device: str = "auto",
                 cache_dir: str | None = None, max_context: int | None = None, backend: str = "torch",
                 optimize: bool = True, quantization: str | QuantConfig | None = None,
                 lora: Mapping[str, str | Path] | None = None, max_lora_rank: int = DEFAULT_MAX_RANK,
                 xlora: str | Path | None = None, xlora_non_granular: int | None = None,
                 kv_cache_dtype: str = "auto", kv_hot_tokens: int = DEFAULT_HOT_TOKENS,
                 tensor_parallel_size: int = 1,
                 speculative: "str | Mapping[str, Any] | SpeculativeConfig | None" = None) -> None:
        """lora: adapter name -> peft adapter folder, loaded unmerged (pick one per call with lora=NAME).
        xlora: a peft X-LoRA folder, applied to every call (py_engine.adapters.xlora); xlora_non_granular=k
        computes its scalings for the first k forward calls of a generation only.
        kv_cache_dtype "int8" or "int4": the two-tier KV cache (the most recent kv_hot_tokens tokens
        in the model's dtype, older blocks quantized; py_engine/models/kv_quant.py), as the server's.
        tensor_parallel_size N > 1: the model sharded over N processes (this one and N - 1 it spawns, gloo on
        the CPU, NCCL on CUDA; py_engine/parallel); close() or the end of the program stops them.
        speculative: speculative decoding, which changes no output: "ngram" (prompt lookup), a draft model's
        name, or a SpeculativeConfig / mapping with vLLM's field names (py_engine/speculative); a request
        opts out with SamplingParams(speculative=False)."""
        kv_quant = dense_kv_config(kv_cache_dtype, kv_hot_tokens)  # bad values fail before the model loads
        spec_config = SpeculativeConfig.parse(speculative)  # bad values fail before the model loads too
        self._parallel = None  # py_engine.parallel.backend.ParallelLLM with tensor_parallel_size > 1
        if tensor_parallel_size != 1 and backend != "torch":
            raise ValueError("tensor_parallel_size applies to the torch backend")
        if tensor_parallel_size != 1 and spec_config is not None:
            raise ValueError("speculative decoding runs without tensor parallelism (its shards' sums would be "
                             "ordered otherwise for several rows)")
        if backend == "onnx" and kv_quant.enabled:
            raise ValueError("kv_cache_dtype applies to the torch backend")
        self.path: Path = resolve_model(model, cache_dir)
        self.backend = backend
        self.quantization = as_quant_config(quantization)
        self.quant_report = None
        if xlora is not None and (backend != "torch" or lora):
            raise ValueError("X-LoRA runs on the torch backend and applies to every call: it cannot be combined "
                             "with --lora adapters or the onnx backend")
        if backend == "onnx" and lora:
            raise ValueError("LoRA adapters apply to the torch backend; for ONNX merge the adapter when exporting "
                             "(ruvllm export MODEL --lora PATH)")
        if backend == "onnx" and self.quantization.enabled:
            raise ValueError("quantization applies to the torch backend; an ONNX export is quantized when exported "
                             "(ruvllm export --quantization ...)")
        if backend == "onnx":  # an export folder; dtype picks its graph (auto, fp32, fp16, int8, int4)
            from py_engine.backends.onnx import OnnxModel
            precision = {"float32": "fp32", "float16": "fp16"}.get(dtype, dtype)
            self.model, self.device = OnnxModel(self.path, precision=precision, device=device), "onnx"
            self.config = self.model.config
        elif backend == "torch" and tensor_parallel_size != 1:
            if xlora is not None:
                raise ValueError("X-LoRA cannot be combined with tensor_parallel_size > 1")
            from py_engine.parallel.backend import ParallelLLM
            from py_engine.parallel.layout import check_world
            self.device = pick_device(device)
            self._parallel, self.model, self.config, self.quant_report = ParallelLLM.start(
                check_world(tensor_parallel_size), torch.device(self.device), self.path, self.quantization, dtype,
                optimize, lora and dict(lora), max_lora_rank, max_context, kv_quant, TorchBackend)
        elif backend == "torch":
            self.device = pick_device(device)
            self.model, self.config, self.quant_report = load_quantized(
                self.path, self.quantization, dtype=dtype, device=self.device)
            if optimize:  # on CPU: fused projections and native GEMV kernels (no-op elsewhere)
                optimize_for_cpu(self.model)
            if lora:
                self._load_loras(lora, max_lora_rank)
            if xlora is not None:
                from py_engine.adapters.xlora import load_xlora
                self.model = load_xlora(self.model, xlora, xlora_non_granular, max_lora_rank)
        else:
            raise ValueError(f"unknown backend {backend!r}; use torch or onnx")
        self.tokenizer = Tokenizer.from_pretrained(self.path)
        trim_heap()  # what parsing tokenizer.json freed (~11 MB for Qwen2.5's): not resident beside the model
        self.generation_config = GenerationConfig.from_model_dir(self.path)
        self.max_context = min(max_context or self.config.max_position_embeddings,
                               self.config.max_position_embeddings)
        self.eos_token_ids = eos_token_ids(self.generation_config, self.config, self.tokenizer)
        self.kv_quant = kv_quant.check(self.max_context)
        self._chat_config: ChatConfig | None = None
        self.speculation = None if spec_config is None else self._speculation(spec_config, dtype, device, cache_dir)

    def _speculation(self, config: SpeculativeConfig, dtype: str, device: str, cache_dir: str | None) -> Speculation:
        """The drafting side of speculative decoding; refuses a model whose greedy output it could change."""
        if self.backend != "torch":
            raise ValueError("speculative decoding runs on the torch backend (the page and npm runtimes have their own)")
        problem = self._new_backend().speculation_problem()
        if problem is not None:
            raise ValueError(f"speculative decoding would change this model's output here: {problem}")
        if config.method == "ngram":
            return Speculation(config)
        draft = LLM(config.model, dtype=dtype, device=device, cache_dir=cache_dir, max_context=self.max_context,
                    quantization=config.quantization)
        check_same_vocabulary(self, draft, config.model)
        return Speculation(config, draft._new_backend)
    def _load_loras(self, lora: Mapping[str, str | Path], max_rank: int) -> None:
        from py_engine.adapters import LoraManager

        manager = LoraManager(self.model, max_rank=max_rank)
        for name, path in lora.items():
            manager.add(name, path)

    @property
    def xlora(self) -> Any:
        """The X-LoRA model (py_engine.adapters.xlora.XLoraModel) when loaded with xlora=, else None."""
        from py_engine.adapters.xlora import XLoraModel
        return self.model if isinstance(self.model, XLoraModel) else None

    @property
    def loras(self) -> list[str]:
        """Names of the loaded LoRA adapters."""
        manager = getattr(self.model, "lora", None)
        return sorted(manager.slots) if manager is not None else []

    def encode(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return start_ids(self.tokenizer, prompt, add_special_tokens)
        return list(prompt)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               *, add_special_tokens: bool = True, lora: str | None = None) -> Iterator[GenerationChunk]:
        """Yield text chunks as they are generated; the last one has a finish_reason."""
        backend = self._new_backend(lora)
        ids = self.encode(prompt, add_special_tokens)
        return stream(backend, self.tokenizer, ids, params or SamplingParams(), self.eos_token_ids,
                      self._speculation_for(lora))

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 *, add_special_tokens: bool = True, lora: str | None = None) -> Completion:
        backend = self._new_backend(lora)
        ids = self.encode(prompt, add_special_tokens)
        before = None if self.speculation is None else self.speculation.stats.to_dict()
        done = complete(backend, self.tokenizer, ids, params or SamplingParams(), self.eos_token_ids,
                        self._speculation_for(lora))
        if before is not None:
            done.speculative = SpecStats.since(before, self.speculation.stats).to_dict()
        return done

    def _speculation_for(self, lora: str | None) -> Speculation | None:
        if self.speculation is not None and lora is not None:
            raise ValueError("speculative decoding runs without LoRA adapters (their deltas are added in torch for "
                             "several rows, not as decode adds them)")
        return self.speculation

    def _new_backend(self, lora: str | None = None):
        if self.backend == "onnx":
            if lora is not None:
                raise ValueError("LoRA adapters apply to the torch backend")
            return self.model.backend(self.max_context)
        if self._parallel is not None:  # the cache of this rank's KV heads; each call replayed on the workers
            return TorchBackend(self.model, self.model.tensor_parallel.local_config, self.max_context, lora,
                                self.kv_quant, mirror=self._parallel.open(lora))
        return TorchBackend(self.model, self.config, self.max_context, lora, self.kv_quant)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do otherwise); the LLM cannot generate after."""
        if self._parallel is not None:
            self._parallel.stop()

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> str:
        """The model's chat template applied to messages, ending with the assistant's turn."""
        if self._chat_config is None:  # read once; a model without a template fails here, not at load
            self._chat_config = load_chat_config(self.path)
        return render_chat(messages, self._chat_config, add_generation_prompt=True, **template_kwargs)

    def chat(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
             lora: str | None = None, **template_kwargs: Any) -> Iterator[GenerationChunk]:
        """Stream the assistant's reply; the template adds its own special tokens."""
        return self.stream(self.chat_prompt(messages, **template_kwargs), params, add_special_tokens=False, lora=lora)


def check_same_vocabulary(target: LLM, draft: LLM, name: str) -> None:
    """A draft proposes token ids: its vocabulary must be the target's, id for id (one clear error if not)."""
    a, b = target.tokenizer, draft.tokenizer
    if target.config.vocab_size != draft.config.vocab_size or a.vocab_size != b.vocab_size or any(
            a.id_to_token(i) != b.id_to_token(i) for i in range(a.vocab_size)):
        raise ValueError(f"the draft model {name!r} has another vocabulary than the target ({draft.config.vocab_size} "
                         f"vs {target.config.vocab_size} ids, or other tokens at the same ids): a draft must share the "
                         "target's tokenizer")
