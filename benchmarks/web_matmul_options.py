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
