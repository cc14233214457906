"""GPU check of the Triton matmul over GGUF blocks (py_engine/gpu/ggml_matmul.py) on real CUDA, in one short run.

    .venv/bin/python scripts/gpu_check_kquants.py          # exits 1 if any check fails
    .venv/bin/python scripts/gpu_check_kquants.py --cpu    # the same checks under Triton's interpreter (slow)

For Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K blocks (K-quants made by tests/importers/kquants.py, after
llama.cpp's reference quantizer; Q5_x by gguf's), for 1, 3, 37 and 128 rows of x in fp32, fp16 and bf16,
split-K chosen and forced: the kernel's y against x @ W^T with W gguf.quants.dequantize of the same bytes
(float64 on the CPU). Then QuantLinear on CUDA takes the Triton path, and a Llama-3.2-1B MLP shape
(8192 x 2048, 2048 x 8192) is timed for 1 and 128 rows against the dequantized bf16 matmul, informational.
Nothing is downloaded; prints a table and a PASS/FAIL line.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from py_engine.quant.ggml import TYPES, GGMLWeight  # noqa: E402
from tests.importers.kquants import quantize  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative Frobenius error


def blocks(name: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, 3] *= 8.0
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[name]) if name in ("Q5_0", "Q5_1") else quantize(w, name)
    ref = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]), np.float32)
    return raw, torch.from_numpy(ref)


def main() -> int:
    cpu = "--cpu" in sys.argv  # a dry run of this script on the CPU: Triton's interpreter, fewer cases
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    device = "cpu" if cpu else "cuda"
    from py_engine.gpu.ggml_matmul import ggml_matmul
    from py_engine.quant.linear import QuantLinear

    torch.manual_seed(0)
    failures, rows_out = [], []
    n, k = (40, 512) if cpu else (300, 1024)
    for name in TYPES:
        raw, ref = blocks(name, n, k)
        weight = GGMLWeight(name, torch.from_numpy(raw.copy()), k).to(device)
        for m in (1, 37) if cpu else (1, 3, 37, 128):
            x = torch.randn(m, k)
            want = (x.double() @ ref.double().T)
            for dtype in (torch.float32,) if cpu else (torch.float32, torch.float16, torch.bfloat16):
                for split_k in (None, 5):
                    got = ggml_matmul(x.to(device, dtype), weight, split_k=split_k).double().cpu()
                    err = ((got - want).norm() / want.norm()).item()
                    ok = err < TOLERANCE[dtype] and got.shape == want.shape
                    rows_out.append((name, m, str(dtype).replace("torch.", ""), split_k, err, ok))
                    if not ok:
                        failures.append(rows_out[-1])
        if cpu:
            continue
        layer = QuantLinear(GGMLWeight(name, torch.from_numpy(raw.copy()), k)).to("cuda")
        y = layer(torch.randn(4, k, device="cuda", dtype=torch.bfloat16))
        if layer._device_weight is None or layer._device_weight[0] != "triton" or y.shape != (4, n):
            failures.append((name, "QuantLinear did not take the Triton path", layer._device_weight))
    print(f"{'type':6} {'rows':>5} {'dtype':9} {'split':>5} {'rel err':>9}")
    for name, m, dtype, split_k, err, ok in rows_out:
        print(f"{name:6} {m:5d} {dtype:9} {str(split_k):>5} {err:9.2e} {'' if ok else 'FAIL'}")
    print(f"device: {'CPU, Triton interpreter' if cpu else torch.cuda.get_device_name()}")
    for name in () if cpu else ("Q4_K", "Q6_K"):  # timing, informational
        for shape in ((8192, 2048), (2048, 8192)):
            raw, ref = blocks(name, *shape)
            weight = GGMLWeight(name, torch.from_numpy(raw.copy()), shape[1]).to("cuda")
            dense = ref.to("cuda", torch.bfloat16)
            for m in (1, 128):
                x = torch.randn(m, shape[1], device="cuda", dtype=torch.bfloat16)
                times = {}
                for label, fn in (("ggml", lambda: ggml_matmul(x, weight)), ("bf16 dense", lambda: x @ dense.T)):
                    fn()
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(50):
                        fn()
                    torch.cuda.synchronize()
                    times[label] = (time.perf_counter() - t) / 50 * 1e3
                print(f"time {name} {shape[0]}x{shape[1]} rows {m}: ggml {times['ggml']:.3f} ms, "
                      f"bf16 dense {times['bf16 dense']:.3f} ms")
    print("PASS" if not failures else f"FAIL: {failures[:5]}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
