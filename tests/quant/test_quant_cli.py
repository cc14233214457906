"""The --quantization flags on every command that loads a model, their clear errors, and a quantized run.

Parsing is checked on generate, chat, serve, benchmark, export and eval ppl (and quantize's own
--method flags); bad combinations exit 2 (argparse: not a choice) or 1 with one `error:` line that
says what is allowed, before any weight is read.
"""
from __future__ import annotations

import json

import pytest

from ruvllm_cli.main import build_parser, main
from py_engine.quant.config import QuantConfig, quant_config_from_args

COMMANDS = {
    "generate": ["generate", "hi"],
    "chat": ["chat"],
    "serve": ["serve"],
    "benchmark": ["benchmark"],
    "export": ["export", "tiny-shakespeare", "--out", "x"],
    "eval": ["eval", "ppl"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_flags_parse_on_every_command(command):
    parser = build_parser()
    args = parser.parse_args(COMMANDS[command] + ["--quantization", "gptq", "--bits", "3", "--group-size", "64",
                                                  "--calibration-samples", "16"])
    assert quant_config_from_args(args) == QuantConfig.from_options("gptq", bits=3, group_size=64,
                                                                    calibration_samples=16)
    assert quant_config_from_args(parser.parse_args(COMMANDS[command])).method == "none"
    assert quant_config_from_args(parser.parse_args(COMMANDS[command] + ["-q", "int8"])).describe() == \
        "int8 8-bit per-channel sym"


@pytest.mark.parametrize("flag, bits", [("8", 8), ("4", 4), ("none", None)])
def test_lm_head_bits_flag(flag, bits):
    args = build_parser().parse_args(["generate", "-q", "int4", "--lm-head-bits", flag, "hi"])
    config = quant_config_from_args(args)
    assert config.lm_head_bits == bits
    assert config.describe().endswith({8: "asym", 4: "head=4-bit", None: "head=float"}[bits])


def test_a_4_bit_head_is_quantized_in_groups(capsys):
    pytest.importorskip("torch")
    from py_engine import LLM
    from py_engine.quant.linear import QuantLinear

    llm = LLM(quantization=QuantConfig.from_options("int4", lm_head_bits=4))
    head = llm.model.lm_head
    assert isinstance(head, QuantLinear) and head.bits == 4 and head.qweight.block_size == 128
    assert not isinstance(LLM(quantization=QuantConfig.from_options("int4", lm_head_bits=None)).model.lm_head,
                          QuantLinear)
    assert main(["generate", "-q", "int4", "--lm-head-bits", "4", "--max-tokens", "4", "--temperature", "0",
                 "--json", "ROMEO:"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4


def test_quantize_command_flags():
    from ruvllm_cli.quantize import quant_config
    args = build_parser().parse_args(["quantize", "m", "--method", "gptq", "--act-order", "--group-size", "32",
                                      "--out", "o"])
    assert quant_config(args) == QuantConfig.from_options("gptq", group_size=32, act_order=True)


@pytest.mark.parametrize("argv", [
    ["generate", "--quantization", "int3", "hi"],
    ["eval", "ppl", "-q", "fp8"],
    ["quantize", "m", "--out", "o"],  # --method is required
    ["quantize", "m", "--method", "none", "--out", "o"],
    ["export", "m", "--out", "o", "--bits", "four"],
])
def test_argparse_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["generate", "-q", "int4", "--bits", "3", "hi"], "int4 supports bits 4, 8, not 3"),
    (["generate", "-q", "int8", "--group-size", "64", "hi"], "int8 quantizes per output channel; --group-size"),
    (["generate", "-q", "int4", "--group-size", "48", "hi"], "group size must be a power of two >= 16"),
    (["generate", "-q", "awq", "--bits", "8", "hi"], "awq supports bits 2, 3, 4, not 8"),
    (["generate", "-q", "gptq", "--calibration-file", "/nonexistent.txt", "hi"], "does not exist"),
    (["generate", "-q", "int4", "--calibration-samples", "0", "hi"], "calibration needs at least 1 sample"),
    (["generate", "--backend", "onnx", "-q", "int4", "hi"], "quantization applies to the torch backend"),
    (["chat", "-q", "smoothquant", "--bits", "4"], "smoothquant supports bits 8, not 4"),
    (["serve", "-q", "gptq", "--bits", "5"], "gptq supports bits 2, 3, 4, 8, not 5"),
    (["benchmark", "--url", "http://127.0.0.1:9", "-q", "int4"], "--quantization applies to the in-process engine"),
    (["eval", "ppl", "-q", "int8", "--bits", "4"], "int8 supports bits 8, not 4"),
    (["quantize", "tiny-shakespeare", "--method", "awq", "--act-order", "--out", "o"], "--act-order is a GPTQ option"),
    (["quantize", "tiny-shakespeare", "--method", "int4", "--group-size", "100", "--out", "o"], "power of two"),
])
def test_invalid_combinations_exit_1_with_the_reason(argv, message, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_generate_int8_runs_on_the_builtin_model(capsys):
    assert main(["generate", "--quantization", "int8", "--max-tokens", "8", "--temperature", "0", "--json",
                 "ROMEO:"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length" and out["text"].strip()


def test_llm_api_accepts_a_name_or_a_config():
    pytest.importorskip("torch")
    from py_engine import LLM, SamplingParams
    from py_engine.quant.linear import QuantLinear

    for quantization in ("int4", QuantConfig.from_options("int4", group_size=32)):
        llm = LLM(quantization=quantization)
        assert any(isinstance(m, QuantLinear) for m in llm.model.modules())
        assert llm.quant_report.layers == 43  # 42 block linears and the LM head
        assert len(llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=4)).token_ids) == 4


def test_server_engine_quantizes_at_load():
    pytest.importorskip("torch")
    from native_server.engine.llm_engine import LLMEngine
    from py_engine.quant.linear import QuantLinear
    from py_engine.sampling_params import SamplingParams

    engine = LLMEngine("tiny-shakespeare", device="cpu", quantization="int4", kv_cache_memory=8 << 20)
    assert sum(isinstance(m, QuantLinear) for m in engine.model.modules()) == 43
    engine.add_request("r", [0, 5, 9, 11], SamplingParams(temperature=0, max_tokens=6))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += [t for c in out.outputs for t in c.token_ids]
    assert 1 <= len(tokens) <= 6
