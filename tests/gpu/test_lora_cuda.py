"""LoRA on CUDA: the unmerged adapter (py_engine/adapters, plain torch ops) on a CUDA model equals peft on the CPU,
and the server engine on CUDA gives a batch mixing adapters and the base each request's solo tokens (CUDA graphs
are skipped for steps that run an adapter). Skips with "GPU: " where there is no CUDA device."""
from __future__ import annotations

import pytest

from tests.adapters.lora_cases import save_peft_adapter, target_sets
from tests.model_cases import FAMILIES, positions, prompt, save_hf_model

torch = pytest.importorskip("torch")
pytest.importorskip("peft", reason="peft is in the [test] extra: pip install -e '.[test]'")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU: LoRA on CUDA needs a CUDA device")


def test_lora_on_cuda_matches_peft_on_cpu(tmp_path):
    from py_engine.adapters import LoraManager
    from py_engine.models import load_model

    hf = save_hf_model(FAMILIES["qwen2"], tmp_path / "base")
    peft_model = save_peft_adapter(hf, tmp_path / "a", r=8, lora_alpha=16,
                                   target_modules=target_sets("qwen2")["all"])
    model, _ = load_model(tmp_path / "base", dtype="float32", device="cuda")
    manager = LoraManager(model)
    manager.add("a", tmp_path / "a")
    ids = prompt(33)
    with torch.no_grad():
        expected = peft_model(ids).logits
        with manager.using("a"):
            got = model(ids.cuda(), positions(0, 33).cuda()).cpu()
    assert (got - expected).abs().max().item() < 1e-4  # TF32-free fp32 matmuls on CUDA, summed in another order


def test_server_engine_on_cuda_mixes_adapters_and_base(tmp_path):
    from native_server.engine.llm_engine import LLMEngine
    from py_engine.sampling_params import SamplingParams
    from tests.paths import BUILTIN
    from tests.server.lora_adapters import build_adapters

    loras = build_adapters(tmp_path)
    eng = LLMEngine(str(BUILTIN), device="cuda", dtype="float32", lora_modules={k: str(v) for k, v in loras.items()})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = eng.tokenizer.encode("ROMEO:")
    requests = [(f"r{i}", m) for i, m in enumerate([None, *loras, None])]

    def run(batch):
        for request_id, lora in batch:
            eng.add_request(request_id, ids, params, lora)
        out = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                for c in o.outputs:
                    out.setdefault(o.request_id, []).extend(c.token_ids)
        return out

    solo = {}
    for request in requests:
        solo.update(run([request]))
    assert run(requests) == solo
