"""int64 Max, Min, Clip and Sign of an exported model as Less/Greater and Where, which every runtime computes right.

onnxruntime 1.30's CPU kernels of Max, Min, Clip and Sign give wrong int64 results for some values outside the
int32 range (measured: about a quarter of random pairs between 2^31 and 2^33, none below 2^31), while its int64
Less, Greater and Where are exact at every magnitude; 1.32 computes all of them right. The exact export's int64
paths (Reduce L2 and the integer norms, for example) reach such values, so a model exported with the plain
operators gave other integers than quantopt on 1.30. Rewriting the four operators on int64 into comparisons and
selections gives the same integers on every runtime version (docs/onnx-export.md, "int64 arithmetic").
"""
from __future__ import annotations

from typing import Any, Dict, List, Set

import numpy as np

INT64 = 7
"""onnx.TensorProto.INT64."""
REWRITTEN = ("Max", "Min", "Clip", "Sign")


def elem_types(model: Any) -> Dict[str, int]:
    """Element type of every named value of a shape-inferred model (inputs, initializers, intermediates, outputs)."""
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    types.update({t.name: t.data_type for t in graph.initializer})
    return types


class _Rewriter:
    """The replacement nodes of one model, named after the output they compute and unique in the model."""

    def __init__(self, model: Any, taken: Set[str]) -> None:
        from onnx import helper, numpy_helper

        self._helper, self._numpy_helper = helper, numpy_helper
        self.model = model
        self.taken = taken
        self.nodes: List[Any] = []
        self.base = ""
        self._count = 0

    def fresh(self, what: str) -> str:
        while True:
            self._count += 1
            name = f"{self.base}/int64_{what}_{self._count}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def emit(self, op: str, inputs: List[str], output: str = "", **attrs: Any) -> str:
        out = output or self.fresh(op.lower())
        self.nodes.append(self._helper.make_node(op, inputs, [out], name=self.fresh(f"{op.lower()}_node"), **attrs))
        return out

    def larger(self, a: str, b: str, output: str = "") -> str:  # max(a, b): b where a < b, else a
        return self.emit("Where", [self.emit("Less", [a, b]), b, a], output)

    def smaller(self, a: str, b: str, output: str = "") -> str:  # min(a, b): b where b < a, else a
        return self.emit("Where", [self.emit("Less", [b, a]), b, a], output)

    def replace(self, node: Any) -> None:
        """The nodes computing `node`'s output (same name) without Max, Min, Clip or Sign."""
        inputs, out = list(node.input), node.output[0]
        self.base = out
        if node.op_type in ("Max", "Min"):
            pick = self.larger if node.op_type == "Max" else self.smaller
            value = inputs[0]
            if len(inputs) == 1:
                self.emit("Identity", [value], out)
            for k, other in enumerate(inputs[1:], start=2):
                value = pick(value, other, out if k == len(inputs) else "")
        elif node.op_type == "Clip":
            value, low, high = inputs[0], *(inputs[1:] + ["", ""])[:2]
            if not low and not high:
                self.emit("Identity", [value], out)
            if low:
                value = self.larger(value, low, "" if high else out)
            if high:
                self.smaller(value, high, out)
        else:  # Sign: (x > 0) - (x < 0)
            zero = self.fresh("zero")
            self.model.graph.initializer.append(self._numpy_helper.from_array(np.zeros((), np.int64), zero))
            positive = self.emit("Cast", [self.emit("Greater", [inputs[0], zero])], to=INT64)
            negative = self.emit("Cast", [self.emit("Less", [inputs[0], zero])], to=INT64)
            self.emit("Sub", [positive, negative], out)


def rewrite_int64_comparisons(model: Any) -> int:
    """Replace, in place, every Max, Min, Clip and Sign node of `model` (shape-inferred) whose output is int64 by
    the same function built from Less, Greater and Where; the output names stay. Returns the nodes rewritten."""
    types = elem_types(model)
    graph = model.graph
    rewriter = _Rewriter(model, {*types, *(o for n in graph.node for o in n.output)})
    rewritten = 0
    for node in graph.node:
        if node.op_type in REWRITTEN and types.get(node.output[0]) == INT64:
            rewriter.replace(node)
            rewritten += 1
        else:
            rewriter.nodes.append(node)
    del graph.node[:]
    graph.node.extend(rewriter.nodes)
    return rewritten
