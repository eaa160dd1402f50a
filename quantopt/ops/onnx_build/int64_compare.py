"""int64 Max, Min, Clip and Sign of an exported model as Less/Greater and Where, which every runtime computes right.

onnxruntime 1.30's CPU kernels of Max, Min, Clip and Sign give wrong int64 results for some values outside the
int32 range (measured: about a quarter of random pairs between 2^31 and 2^33, none below 2^31), while its int64
Less, Greater and Where are exact at every magnitude; 1.32 computes all of them right. The exact export's int64
paths (Reduce L2 and the integer norms, for example) reach such values, so a model exported with the plain operators
gave other integers than quantopt on 1.30. Rewriting the four operators on int64 into comparisons and selections
gives the same integers on every runtime version (docs/onnx-export.md, "int64 arithmetic").
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

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


def rewrite_int64_comparisons(model: Any) -> int:
    """Replace, in place, every Max, Min, Clip and Sign node of `model` (shape-inferred) whose output is int64 by
    the same function built from Less, Greater and Where; the output names stay. Returns the nodes rewritten."""
    from onnx import helper, numpy_helper

    types = elem_types(model)
    graph = model.graph
    taken = {*types, *(o for n in graph.node for o in n.output)}
    nodes: List[Any] = []
    rewritten = 0

    for node in graph.node:
        if node.op_type not in REWRITTEN or types.get(node.output[0]) != INT64:
            nodes.append(node)
            continue
        rewritten += 1
        count = [0]

        def fresh(what: str, node: Any = node, count: List[int] = count) -> str:
            while True:
                count[0] += 1
                name = f"{node.output[0]}/int64_{what}_{count[0]}"
                if name not in taken:
                    taken.add(name)
                    return name

        def emit(op: str, inputs: List[str], output: str = "", **attrs: Any) -> str:
            out = output or fresh(op.lower())
            nodes.append(helper.make_node(op, inputs, [out], name=fresh(f"{op.lower()}_node"), **attrs))
            return out

        def larger(a: str, b: str, output: str = "") -> str:  # max(a, b): b where a < b, else a
            return emit("Where", [emit("Less", [a, b]), b, a], output)

        def smaller(a: str, b: str, output: str = "") -> str:  # min(a, b): b where b < a, else a
            return emit("Where", [emit("Less", [b, a]), b, a], output)

        inputs, out = [i for i in node.input], node.output[0]
        if node.op_type in ("Max", "Min"):
            pick: Callable[..., str] = larger if node.op_type == "Max" else smaller
            value = inputs[0]
            if len(inputs) == 1:
                emit("Identity", [value], out)
            for k, other in enumerate(inputs[1:], start=2):
                value = pick(value, other, out if k == len(inputs) else "")
        elif node.op_type == "Clip":
            value, low, high = inputs[0], *(inputs[1:] + ["", ""])[:2]
            if not low and not high:
                emit("Identity", [value], out)
            if low:
                value = larger(value, low, "" if high else out)
            if high:
                smaller(value, high, out)
        else:  # Sign: (x > 0) - (x < 0)
            zero = fresh("zero")
            graph.initializer.append(numpy_helper.from_array(np.zeros((), np.int64), zero))
            positive = emit("Cast", [emit("Greater", [inputs[0], zero])], to=INT64)
            negative = emit("Cast", [emit("Less", [inputs[0], zero])], to=INT64)
            emit("Sub", [positive, negative], out)
    del graph.node[:]
    graph.node.extend(nodes)
    return rewritten
