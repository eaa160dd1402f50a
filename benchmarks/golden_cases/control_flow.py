"""Golden cases of the control-flow layers with subgraphs, If and Loop (quantopt/ops/control_flow.py): each graph is
the float IR upstream's Parser writes for a small ONNX model (an If choosing between two one-layer branches on a
condition computed from the input; a Loop of a constant 3 iterations with a loop-carried value and a scan output),
rebuilt layer for layer with the same names, subgraphs attached with `set_subgraphs` (written by quantopt's IR writer
as subgraph sections, docs/ir-format.md). Upstream's optimizer runs both in float16 with their subgraphs
(docs/semantics/control-flow.md)."""
from __future__ import annotations

from typing import Dict

import numpy as np

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.graph.subgraphs import set_subgraphs
from quantopt.quant.dtype import Dtype

from . import IrCase

SAMPLES = 8


def _const(b: GraphBuilder, name: str, values: list, shape: list, dtype: Dtype = Dtype.FP32) -> str:
    data = np.array(values, dtype=dtype.storage).reshape(shape)
    return b.layer("Constant", [], [shape], name=name, outputs=[f"{name}_0"], output_dtypes=[dtype],
                   constants={"weights": data}, constant_dtypes={"weights": dtype})


def _condition(b: GraphBuilder, x: str, method: str, threshold: float, reduce: str) -> str:
    """The Parser's form of `Greater(Reduce(x), threshold)` as a scalar: Reduce, Reshape [1], Logical, Reshape []."""
    thr = _const(b, "lo" if reduce == "MAX" else "zero", [threshold], [1])
    r = b.layer("Reduce", [x], [[1, 1]], name="mx" if reduce == "MAX" else "mean",
                outputs=["mx_0" if reduce == "MAX" else "mean_0"], params={"axis": [0, 1], "method": reduce})
    r = b.layer("Reshape", [r], [[1]], name="cond_pre_reshape_0", outputs=["cond_pre_reshape_0_0"],
                params={"shape": [1]})
    c = b.layer("Logical", [r, thr], [[1]], name="cond", outputs=["cond_0"], params={"method": method},
                output_dtypes=[Dtype.UINT8])
    return b.layer("Reshape", [c], [[]], name="cond_post_reshape_0", outputs=["cond_post_reshape_0_0"],
                   params={"shape": []}, output_dtypes=[Dtype.UINT8])


def _branch(name: str, layer: str, method: str, values: list) -> PyGraph:
    b = GraphBuilder(name)
    c = _const(b, "c2" if method == "MUL" else "c1", values, [1, 4])
    x = b.input("x_0", [1, 4], layer_name="x")
    y = b.layer("Eltwise", [x, c], [[1, 4]], name=layer, outputs=[f"{layer}_0"],
                params={"with_activation": "NONE", "method": method})
    g = b.build([y], graph_cls=PyGraph)
    g.header.update({"precision": "float32", "compat_quantized_model": False})
    return g


def _if() -> PyGraph:
    b = GraphBuilder("if")
    c0 = _const(b, "c0", [1.0, 2.0, 0.5, 1.5], [1, 4])
    xin = b.input("xin_0", [1, 4], layer_name="xin")
    x = b.layer("Eltwise", [xin, c0], [[1, 4]], name="x", outputs=["x_0"],
                params={"with_activation": "NONE", "method": "MUL"})
    cond = _condition(b, xin, "GREATER", 0.0, "MEAN")
    y0 = b.layer("If", [cond, x, x], [[1, 4]], name="y0", outputs=["y0_0"],
                 params={"then_branch_inputs_num": 1, "else_branch_inputs_num": 1})
    y = b.layer("Activation", [y0], [[1, 4]], name="y", outputs=["y_0"], params={"method": "SIGMOID"})
    g = b.build([y])
    set_subgraphs(g.node("y0"), {
        "then_branch": _branch("y0_then_branch_subgraph", "t_out", "MUL", [2.0, 0.5, -1.0, 3.0]),
        "else_branch": _branch("y0_else_branch_subgraph", "e_out", "ADD", [1.0, -1.0, 0.5, 0.25])})
    return g


def _body() -> PyGraph:
    b = GraphBuilder("vf_body_subgraph")
    cond_in = b.input("cond_in_0", [], Dtype.UINT8, layer_name="cond_in")
    it = b.input("iter_0", [], Dtype.INT32, layer_name="iter")
    it_f = b.layer("Cast", [it], [[]], name="iter_f", outputs=["iter_f_0"],
                   params={"to_dtype": Dtype.FP32, "clip_mode": "TRUNCATION", "ignore_scale_zp": True})
    k = _const(b, "k", [1.5, 0.5, -1.0, 1.0], [1, 4])
    v = b.input("v_0", [1, 4], layer_name="v")
    vm = b.layer("Eltwise", [v, k], [[1, 4]], name="vm", outputs=["vm_0"],
                 params={"with_activation": "NONE", "method": "MUL"})
    v_out = b.layer("Add", [vm, it_f], [[1, 4]], name="v_out", outputs=["v_out_0"],
                    params={"with_activation": "NONE"})
    scan = b.layer("Dummy", [v_out, cond_in], [[1, 4], []], name="scan_post_dummy",
                   outputs=["scan_post_dummy_0", "scan_post_dummy_1"], output_dtypes=[Dtype.FP32, Dtype.UINT8])
    cond_out = b.layer("Dummy", [scan[1]], [[]], name="cond_out", outputs=["cond_out_0"],
                       output_dtypes=[Dtype.UINT8])
    b._inputs = [it, cond_in, v]  # the Parser's input order: iteration, condition, carried value
    g = b.build([cond_out, v_out, scan[0]], graph_cls=PyGraph)
    g.header.update({"precision": "float32", "compat_quantized_model": False})
    return g


def _loop() -> PyGraph:
    b = GraphBuilder("loop")
    m = _const(b, "M", [3], [], Dtype.INT32)
    c0 = _const(b, "c0", [1.0, 2.0, 0.5, 1.5], [1, 4])
    v00 = b.input("v00_0", [1, 4], layer_name="v00")
    v0 = b.layer("Eltwise", [v00, c0], [[1, 4]], name="v0", outputs=["v0_0"],
                 params={"with_activation": "NONE", "method": "MUL"})
    cond = _condition(b, v00, "GREATER", -100.0, "MAX")
    vf = b.layer("Loop", [m, cond, v0], [[1, 4], [100, 4]], name="vf", outputs=["vf_0", "vf_1"],
                 params={"dependency_inputs_num": 1, "scan_outputs_num": 1, "body": "vf_body_subgraph",
                         "loop_default_count": 100})
    g = b.build(vf)
    set_subgraphs(g.node("vf"), {"body": _body()})
    return g


def _normal(name: str) -> IrCase:
    def sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
        return {name: rng.normal(0.2, 1.0, size=(SAMPLES, 4)).astype(np.float32)}
    return sample


CASES: Dict[str, IrCase] = {
    "op_if": IrCase(_if, _normal("xin_0")),
    "op_loop": IrCase(_loop, _normal("v00_0")),
}
