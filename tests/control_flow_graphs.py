"""Subgraphs shared by the If/Loop tests (tests/ops/test_if_loop.py, tests/test_loop_integer_inputs.py)."""
from __future__ import annotations

import numpy as np

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.quant.dtype import Dtype


def loop_body(k: np.ndarray) -> PyGraph:
    """A Loop body (i, cond, v) -> (cond, v * k + i, v * k + i), k a [1, 4] float32 constant."""
    b = GraphBuilder("body_g")
    cond_in = b.input("cond_in_0", [], Dtype.UINT8, layer_name="cond_in")
    it = b.input("iter_0", [], Dtype.INT32, layer_name="iter")
    v = b.input("v_0", [1, 4], layer_name="v")
    it_f = b.layer("Cast", [it], [[]], name="iter_f", outputs=["iter_f_0"],
                   params={"to_dtype": Dtype.FP32, "clip_mode": "TRUNCATION", "ignore_scale_zp": True})
    c = b.layer("Constant", [], [[1, 4]], name="k", outputs=["k_0"], constants={"weights": k})
    vm = b.layer("Eltwise", [v, c], [[1, 4]], name="vm", outputs=["vm_0"],
                 params={"with_activation": "NONE", "method": "MUL"})
    v_out = b.layer("Add", [vm, it_f], [[1, 4]], name="v_out", outputs=["v_out_0"], params={"with_activation": "NONE"})
    cond_out = b.layer("Dummy", [cond_in], [[]], name="cond_out", outputs=["cond_out_0"], output_dtypes=[Dtype.UINT8])
    b._inputs = [it, cond_in, v]
    return b.build([cond_out, v_out, v_out], graph_cls=PyGraph)
