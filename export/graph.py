"""A small ONNX graph builder: named nodes, deduplicated constants, streamed weights.

Weights are written as they are added: inline in the model for small graphs,
or appended to external data files (`model.onnx_data`, `model.onnx_data_1`,
... each under 2 GB, offsets aligned to 4 KiB so onnxruntime can map them)
for large ones, so exporting a model never holds a second copy of it in
memory and the protobuf stays under its 2 GB limit.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MS_DOMAIN = "com.microsoft"
OPSET = 21  # block-wise DequantizeLinear and 4-bit tensors need 21
OPSET_2BIT = 25  # 2-bit tensors (the web target's 2-bit weights) need 25, and IR version 13
IR_VERSION = {OPSET: 10, OPSET_2BIT: 13}
MAX_DATA_FILE = (2 << 30) - (64 << 20)  # below 2 GiB, with room for alignment
ALIGN = 4096
INLINE_BYTES = 1024  # tensors this small stay in the graph even with external data


class TensorStore:
    """Turns arrays into TensorProtos, inline or in external data files next to the model."""

    def __init__(self, folder: Path | None = None, stem: str = "model.onnx", inline_bytes: int = INLINE_BYTES,
                 align: int = ALIGN) -> None:
        self.folder, self.stem = folder, stem
        self.inline_bytes = inline_bytes  # the web target keeps every weight external (export.web_engine reads them)
        self.align = align  # the web target: 64 (nothing maps its file; every padding byte is downloaded)
        self.files: list[str] = []
        self._handle = None
        self._offset = 0
        self.bytes_written = 0

    @property
    def external(self) -> bool:
        return self.folder is not None

    def tensor(self, name: str, array: np.ndarray, inline: bool = False) -> TensorProto:
        array = np.asarray(array)
        if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn a scalar into [1])
            array = array.copy()
        if inline or not self.external or array.nbytes <= self.inline_bytes:
            return numpy_helper.from_array(array, name)
        proto = numpy_helper.from_array(np.zeros((0,), array.dtype), name)
        proto.ClearField("dims")
        proto.dims.extend(array.shape)
        proto.ClearField("raw_data")
        return self._external(proto, array.tobytes())

    def raw_tensor(self, name: str, data_type: int, dims: Sequence[int], data: bytes) -> TensorProto:
        """A tensor from its stored bytes, for types numpy lacks (4-bit: two values a byte, low first)."""
        proto = TensorProto(name=name, data_type=data_type, dims=list(dims))
        if not self.external or len(data) <= self.inline_bytes:
            proto.raw_data = data
            return proto
        return self._external(proto, data)

    def _external(self, proto: TensorProto, data: bytes) -> TensorProto:
        location, offset = self._write(data)
        proto.data_location = TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", offset), ("length", len(data))):
            proto.external_data.add(key=key, value=str(value))
        return proto

    def _write(self, data: bytes) -> tuple[str, int]:
        if self._handle is None or self._offset + len(data) > MAX_DATA_FILE and self._offset > 0:
            self._open_next()
        pad = -self._offset % self.align
        self._handle.write(b"\0" * pad)
        offset = self._offset + pad
        self._handle.write(data)
        self._offset = offset + len(data)
        self.bytes_written += len(data)
        return self.files[-1], offset

    def _open_next(self) -> None:
        self.close()
        name = f"{self.stem}_data" + (f"_{len(self.files)}" if self.files else "")
        self.files.append(name)
        self._handle = open(self.folder / name, "wb")
        self._offset = 0

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class GraphBuilder:
    """Accumulates nodes, inputs, outputs and initializers of one graph."""

    def __init__(self, store: TensorStore | None = None) -> None:
        self.store = store or TensorStore()
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[TensorProto] = []
        self._names: set[str] = set()
        self._consts: dict[tuple, str] = {}
        self._counter = itertools.count()
        self.uses_ms_domain = False
        self.opset = OPSET  # raised to OPSET_2BIT by a 2-bit tensor, so other graphs keep their bytes
        self.records: dict[str, dict] = {}  # projection / norm name -> its initializers (export.web_engine)

    def unique(self, base: str) -> str:
        name = base
        while name in self._names:
            name = f"{base}_{next(self._counter)}"
        self._names.add(name)
        return name

    def node(self, op: str, inputs: Sequence[str], name: str, outputs: int = 1,
             domain: str | None = None, **attrs: Any) -> Any:
        """Add a node; returns its output name (or a list of names when outputs > 1)."""
        name = self.unique(name)
        outs = [f"{name}/out{i}" for i in range(outputs)]
        if domain == MS_DOMAIN:
            self.uses_ms_domain = True
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=name, domain=domain or "", **attrs))
        return outs[0] if outputs == 1 else outs

    def initializer(self, name: str, array: np.ndarray, inline: bool = False) -> str:
        name = self.unique(name)
        self.initializers.append(self.store.tensor(name, array, inline))
        return name

    def raw_initializer(self, name: str, data_type: int, dims: Sequence[int], data: np.ndarray) -> str:
        """An initializer of `data_type` (4-bit, say) whose stored bytes are `data` (uint8)."""
        name = self.unique(name)
        self.initializers.append(self.store.raw_tensor(name, data_type, dims, np.ascontiguousarray(data).tobytes()))
        return name

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        """A small constant, shared by every node that asks for the same value."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            self._consts[key] = self.initializer(f"const/{array.dtype}/{'_'.join(map(str, array.ravel()[:4]))}",
                                                 array, inline=array.nbytes <= INLINE_BYTES)
        return self._consts[key]

    def add_input(self, name: str, elem_type: int, shape: Sequence[int | str]) -> str:
        self._names.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def add_output(self, source: str, name: str, elem_type: int, shape: Sequence[int | str]) -> None:
        """Expose `source` as graph output `name` (an Identity renames it)."""
        self.nodes.append(helper.make_node("Identity", [source], [name], name=self.unique(f"output/{name}")))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))

    def model(self, graph_name: str, metadata: dict[str, str]) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", self.opset)]
        if self.uses_ms_domain:
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="ruvllm")
        model.ir_version = IR_VERSION[self.opset]
        helper.set_model_props(model, metadata)
        return model
