"""Ring 2: export any model ruvllm loads to ONNX, and describe the result.

    from export.exporter import export_model
    from export.options import ExportOptions
    export_model("path/to/hf-model", "out/", ExportOptions(precision="int4"))

Modules: contract (the I/O names, shapes and format version, once),
options (what may be asked, refusals), decoder / blocks / attention / linear
(the graph, node by node), packing (MatMulNBits byte layout), web_weights
(the web target's codes and scales in one data file), web_engine (where the page's kernels find them), rope_tables, graph
(builder + external data), exporter (the folder layout), manifest (which
graph each runtime loads, in ruvllm_contract.json), genai_config, cli
(`ruvllm export`). Nothing here imports onnx at package import, so the
CLI can register `export` without loading it.
"""


def add_parser(subparsers) -> None:
    """Register `ruvllm export` on the command line's subparsers (ruvllm_cli)."""
    from .cli import add_export_parser

    add_export_parser(subparsers)
