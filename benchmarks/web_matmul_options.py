"""Quantized matmuls in onnxruntime-web's wasm backend, option by option (issue 30).

    python benchmarks/web_matmul_options.py [--threads 2] [--ort DIR ...]

For SmolLM2-135M's decode shapes (one row of activations: q/k/v 576->960, o 576->576, gate/up 576->3072,
down 1536->576, the tied head 576->49152) each option is a graph of REPEAT copies of one projection (its own
random weights, one shared input, every output returned, so a run's fixed cost is spread), timed in Node by
benchmarks/web/matmul_options.mjs with onnxruntime-web's wasm backend at `threads` threads:

    fp32         MatMul over float weights (what the web graph folds its codes into today)
    nbits4/acc0  MatMulNBits 4-bit, block 32, accuracy_level 0 (float activations)
    nbits4/acc4  MatMulNBits 4-bit, block 32, accuracy_level 4 (int8 activations)
    nbits8/acc4  MatMulNBits 8-bit, block 32, accuracy_level 4
    dqmm8        DynamicQuantizeMatMul (int8 weights per column, activations quantized per call)
    mmint8       DynamicQuantizeLinear + MatMulInteger + scale (standard ONNX ops)

and, for the same shapes, the project's own kernel (web/kernels, C compiled to wasm SIMD128 with zig) as
`rk-q4` / `rk-q8`. Prints ms per decode token (30 layers of the four projections plus the head) and writes
benchmarks/results/web_matmul_options.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / ".cache" / "web-matmul"
RESULTS = REPO / "benchmarks" / "results" / "web_matmul_options.json"
RUNNER = REPO / "benchmarks" / "web" / "matmul_options.mjs"
REPEAT = 8
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gu": (576, 3072), "down": (1536, 576), "head": (576, 49152)}
VARIANTS = ("fp32", "nbits4acc0", "nbits4acc4", "nbits8acc4", "dqmm8", "mmint8")


def graph(name: str, k: int, n: int, variant: str, rng) -> Path:
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh
    import onnx

    path = WORK / f"{name}_{variant}.onnx"
    if path.exists():
        return path
    nodes, inits, outs = [], [], []
    if variant == "mmint8":
        nodes.append(h.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]))
    for r in range(1 if name == "head" else REPEAT):
        y = f"y{r}"
        if variant == "fp32":
            inits.append(nh.from_array((rng.standard_normal((k, n)) * 0.02).astype(np.float32), f"w{r}"))
            nodes.append(h.make_node("MatMul", ["x", f"w{r}"], [y]))
        elif variant.startswith("nbits"):
            bits, acc = int(variant[5]), int(variant[-1])
            inits += [nh.from_array(rng.integers(0, 256, (n, k // 32, 32 * bits // 8), dtype=np.uint8), f"b{r}"),
                      nh.from_array((rng.random((n, k // 32)) * 0.01).astype(np.float32), f"s{r}")]
            nodes.append(h.make_node("MatMulNBits", ["x", f"b{r}", f"s{r}"], [y], domain="com.microsoft", K=k, N=n,
                                     bits=bits, block_size=32, accuracy_level=acc))
        elif variant == "dqmm8":
            inits += [nh.from_array(rng.integers(-127, 128, (k, n), dtype=np.int8), f"b{r}"),
                      nh.from_array((rng.random(n) * 0.01).astype(np.float32), f"s{r}"),
                      nh.from_array(np.zeros(n, np.int8), f"z{r}")]
            nodes.append(h.make_node("DynamicQuantizeMatMul", ["x", f"b{r}", f"s{r}", f"z{r}"], [y],
                                     domain="com.microsoft"))
        else:  # mmint8
            inits += [nh.from_array(rng.integers(0, 256, (k, n), dtype=np.uint8), f"b{r}"),
                      nh.from_array(np.full(n, 128, np.uint8), f"z{r}"),
                      nh.from_array((rng.random(n) * 0.01).astype(np.float32), f"s{r}")]
            nodes += [h.make_node("MatMulInteger", ["xq", f"b{r}", "xz", f"z{r}"], [f"i{r}"]),
                      h.make_node("Cast", [f"i{r}"], [f"f{r}"], to=T.FLOAT),
                      h.make_node("Mul", [f"f{r}", "xs"], [f"g{r}"]), h.make_node("Mul", [f"g{r}", f"s{r}"], [y])]
        outs.append(h.make_tensor_value_info(y, T.FLOAT, [1, n]))
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [1, k])], outs, inits)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)], ir_version=10)
    onnx.save(model, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ort", nargs="+", default=[str(REPO / "npm")],
                        help="npm project folders holding an onnxruntime-web to compare (e.g. a 1.31.0-dev)")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for variant in VARIANTS:
        for name, (k, n) in SHAPES.items():
            graph(name, k, n, variant, rng)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads, "load_before": os.getloadavg(),
              "node": subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip(), "runs": {}}
    for folder in args.ort:
        done = subprocess.run(["node", str(RUNNER), "ort", str(Path(folder).resolve()), str(WORK), str(args.threads), ",".join(VARIANTS)],
                              capture_output=True, text=True, timeout=3600)
        assert done.returncode == 0, done.stderr[-2000:]
        result["runs"].update(json.loads(done.stdout.strip().splitlines()[-1]))
    done = subprocess.run(["node", str(RUNNER), "kernels", str(REPO / "npm" / "src"), "", str(args.threads)],
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    result["runs"].update(json.loads(done.stdout.strip().splitlines()[-1]))
    result["load_after"] = os.getloadavg()
    print(f"\n{'option':40} {'ms / decode token':>18}")
    for name, run in result["runs"].items():
        print(f"{name:40} {run['decode_token_ms']:>18.1f}")
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
