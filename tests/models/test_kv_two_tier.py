"""The two-tier dense KV cache of `LLM` (py_engine/models/kv_quant.py, TwoTierDenseKVCache).

- the block quantizer against a NumPy transcription of KIVI's rule (keys per channel over the block's
  tokens, values per token over the head's channels, asymmetric, round half to even);
- within the hot window, logits equal the full-precision cache's bit for bit, on the C decode path and
  on the torch path; past it they do not (the cold blocks are really read quantized);
- the per-query rule: a prompt in one call gives the logits token-by-token decoding gives (the torch
  path, and the C kernels' path, which reads the int8/int4 codes), so `eval ppl` measures what
  generation gets;
- bad settings are refused before the model loads.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from py_engine.backends.torch import LLM, TorchBackend  # noqa: E402
from py_engine.models import DenseKVCache  # noqa: E402
from py_engine.models.kv_quant import KVQuantConfig, fake_quantize_blocks, pack, quantize, unpack  # noqa: E402
from py_engine.tokenizer import Tokenizer  # noqa: E402
from tests.paths import BUILTIN  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(BUILTIN), dtype="float32")


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(str(BUILTIN), dtype="float32", optimize=False)


@pytest.fixture(scope="module")
def ids() -> list[int]:
    text = (BUILTIN / "validation.txt").read_text(encoding="utf-8")[:3000]
    return Tokenizer.from_pretrained(BUILTIN).encode(text, add_special_tokens=True)[:240]


def kivi_reference(x: np.ndarray, axis: int, bits: int) -> np.ndarray:
    """Dequantized x: min/max over `axis`, scale (max - min) / (2^bits - 1), codes rounded half to even."""
    low, high = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    scale = (high - low) / np.float32(2**bits - 1)
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    codes = np.clip(np.round((x - low) / scale), 0, 2**bits - 1)
    return (codes.astype(np.float32) * scale + low).astype(np.float32)


@pytest.mark.parametrize("bits", [8, 4])
def test_block_quantizer_is_kivis_rule(bits: int) -> None:
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 5, 16, 32, generator=gen) * torch.linspace(0.1, 8, 32)  # outlier channels
    values = torch.randn(2, 3, 5, 16, 32, generator=gen)
    keys[0, 0, 0] = 1.5  # a constant block: dequantizes to itself
    k, v = fake_quantize_blocks(keys, values, bits)
    np.testing.assert_array_equal(k.numpy(), kivi_reference(keys.numpy(), -2, bits))  # per channel
    np.testing.assert_array_equal(v.numpy(), kivi_reference(values.numpy(), -1, bits))  # per token
    assert torch.equal(k[0, 0, 0], keys[0, 0, 0])
    step = (values.amax(-1) - values.amin(-1)) / (2**bits - 1)
    assert ((v - values).abs() <= step[..., None] / 2 + 1e-6).all()
    codes, _, _ = quantize(values, -1, bits)
    packed = pack(codes, bits)
    assert packed.shape[-1] == 32 * bits // 8 and torch.equal(unpack(packed, bits), codes)


def run(llm: LLM, ids: list[int], quant: KVQuantConfig | None, prompt: int) -> list[torch.Tensor]:
    """Logits after the prompt ids[:prompt], then after each further token, one decode step each."""
    backend = TorchBackend(llm.model, llm.config, llm.max_context, kv_quant=quant)
    out = [backend.prefill(ids[:prompt]).clone()]
    out += [backend.decode(t).clone() for t in ids[prompt:]]
    return out


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_logits_within_the_hot_window_are_the_full_precision_caches(llm: LLM, plain: LLM, ids: list[int],
                                                                   dtype: str) -> None:
    quant = KVQuantConfig(dtype, hot_tokens=128)
    # positions up to 142: 142 + 1 - 128 < 16, no block is cold yet; 143 reads block 0 cold
    for model in (llm, plain):
        full, two_tier = run(model, ids[:150], None, 100), run(model, ids[:150], quant, 100)
        for i in range(43):  # logits after positions 99..141, each predicting the next
            assert torch.equal(full[i], two_tier[i]), f"position {99 + i}"
        assert not torch.equal(full[-1], two_tier[-1])  # position 148 reads block 0 quantized


def prompt_logits(llm: LLM, ids: list[int], quant: KVQuantConfig) -> torch.Tensor:
    """Logits [T, V] of every position of ids, the whole prompt in one call over a two-tier cache."""
    kv = DenseKVCache.allocate(llm.config, 1, len(ids), torch.float32, "cpu", quant=quant)
    with torch.inference_mode():
        return llm.model(torch.tensor([ids]), torch.arange(len(ids))[None], kv)[0]


def test_a_prompt_in_one_call_is_token_by_token_decoding(llm: LLM, plain: LLM, ids: list[int]) -> None:
    quant = KVQuantConfig("int4", hot_tokens=32)
    whole = prompt_logits(plain, ids, quant)  # [T, V]
    full = prompt_logits(plain, ids, KVQuantConfig())
    # torch reads the dequantized buffers; the C decode step the codes: (q * scale) . code + q . zero for
    # q . (code * scale + zero), a reassociation
    for model, tolerance in ((plain, 2e-4), (llm, 1e-3)):
        steps = torch.stack(run(model, ids, quant, 1))  # position 0, then one token at a time
        assert (steps - whole).abs().max() < tolerance
        assert (whole - full).abs().max() > 1e-2  # int4 blocks are read past 32 + 16 tokens
    chunked = TorchBackend(plain.model, plain.config, plain.max_context, kv_quant=quant)
    chunked.prefill(ids[:70])
    with torch.inference_mode():  # a second chunk over cold and settled blocks
        tail = chunked._forward(ids[70:])
    assert (tail - whole[-1]).abs().max() < 2e-4


def test_greedy_text_is_the_same_on_the_c_path_and_the_torch_path(llm: LLM, plain: LLM) -> None:
    from py_engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    for dtype in ("int8", "int4"):
        llm.kv_quant = plain.kv_quant = KVQuantConfig(dtype, 16)
        try:
            assert llm.generate("ROMEO:", params).token_ids == plain.generate("ROMEO:", params).token_ids
        finally:
            llm.kv_quant = plain.kv_quant = KVQuantConfig()


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8' is not one of auto, int8, int4"),
    ({"kv_cache_dtype": "int4", "kv_hot_tokens": 8}, "kv_hot_tokens is 8 but must be at least one block"),
    ({"kv_cache_dtype": "int8", "kv_hot_tokens": 257}, "at most the context (256 tokens)"),
])
def test_bad_kv_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(str(BUILTIN), **kwargs)


@pytest.mark.parametrize("stack", [True, False])
def test_the_c_decode_step_reads_the_codes_not_the_buffers(llm: LLM, ids: list[int], stack: bool) -> None:
    """Past the hot window the kernels read int8/int4 codes: NaN in the buffers' cold part changes nothing."""
    quant = KVQuantConfig("int8", hot_tokens=32)
    decoder = llm.model.model
    decoder.stack_enabled = stack
    try:
        outs = []
        for poison in (False, True):
            backend = TorchBackend(llm.model, llm.config, llm.max_context, kv_quant=quant)
            backend.prefill(ids[:150])
            backend.decode(ids[150])
            if poison:
                with torch.inference_mode():
                    for buffer in backend.kv.keys + backend.kv.values:
                        buffer[:, :, :backend.kv.settled] = float("nan")
            outs.append(torch.stack([backend.decode(t).clone() for t in ids[151:170]]))
        assert backend.kv.settled >= 96
        assert torch.equal(outs[0], outs[1])
    finally:
        decoder.stack_enabled = True
