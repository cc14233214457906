"""Short names for the web target's intermediate values: bytes every page load would download.

A web graph carries a few nodes per quantized weight (scale casts, minimums' terms), and each node output is
named after its place in the model ("model.layers.11.mlp.gate_up_proj/dq/Reshape_output_0").
Those names only connect nodes; renaming them to "v0", "v1", ... and dropping node names
changes no arithmetic. The graph's inputs and outputs (the export contract) and the
initializers (readable weight names) keep their names. On tiny-shakespeare's int4 web graph
this is what made it larger than the native MatMulNBits graph with identical weights.
"""
from __future__ import annotations

from onnx import GraphProto


def compact_names(graph: GraphProto) -> int:
    """Rename intermediate values in place; return how many were renamed."""
    keep = {v.name for v in graph.input} | {v.name for v in graph.output} | {t.name for t in graph.initializer}
    prefix = "v"
    while any(name.startswith(prefix) and name[len(prefix):].isdigit() for name in keep):
        prefix = "_" + prefix  # never collide with a kept name
    mapping: dict[str, str] = {}

    def short(name: str) -> str:
        if not name or name in keep:
            return name
        return mapping.setdefault(name, f"{prefix}{len(mapping)}")

    for node in graph.node:
        if any(a.g.node or a.graphs for a in node.attribute):
            raise ValueError(f"compact_names does not handle subgraphs ({node.op_type} {node.name})")
        node.input[:] = [short(n) for n in node.input]
        node.output[:] = [short(n) for n in node.output]
        node.name = ""
    for info in graph.value_info:
        info.name = short(info.name)
    return len(mapping)
