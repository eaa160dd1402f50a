"""Golden cases of upstream's graph-pass fields (docs/user-guide.md, "Graph passes"): the same small graphs with a
field switched on in every variant's cfg (IrCase.cfg_lines)."""
from __future__ import annotations

from typing import Dict

import numpy as np

from golden_cases import IrCase
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph

SAMPLES = 8


def _softmax() -> PyGraph:
    b = GraphBuilder("case")
    x = b.input("x", [1, 8, 32])
    return b.build([b.layer("Softmax", [x], [[1, 8, 32]], name="softmax", params={"axis": 2})])


def _float_chain() -> PyGraph:
    """tanh (kept float by the cfg) -> Reshape -> Transpose -> sigmoid: the shape-only layers follow the float layer
    into float with enable_pass_deeply_set_unquantifiable."""
    b = GraphBuilder("case")
    x = b.input("x", [1, 8, 32])
    t = b.layer("Activation", [x], [[1, 8, 32]], name="tanh", params={"method": "TANH"})
    r = b.layer("Reshape", [t], [[1, 8, 4, 8]], name="reshape", params={"shape": [1, 8, 4, 8]})
    p = b.layer("Transpose", [r], [[1, 4, 8, 8]], name="transpose", params={"perm": [0, 2, 1, 3]})
    return b.build([b.layer("Activation", [p], [[1, 4, 8, 8]], name="sigmoid", params={"method": "SIGMOID"})])


def _finite_masks() -> PyGraph:
    """Scores plus two masks written with a finite -1e9, each before a Softmax: a Constant (0 kept, -1e9 dropped) and
    a BatchNorm of a 0/1 keep input (weights 1e9, biases -1e9), the forms enable_pass_detect_inf_mask_nodes rewrites."""
    b = GraphBuilder("case")
    x = b.input("x", [1, 8, 16])
    keep = b.input("keep", [1, 8, 16])
    values = np.zeros((1, 1, 16), np.float32)
    values[..., 12:] = -1e9
    const = b.layer("Constant", [], [[1, 1, 16]], name="mask_const", constants={"weights": values})
    bn = b.layer("BatchNorm", [keep], [[1, 8, 16]], name="mask_bn", params={"axis": 2, "with_activation": "NONE"},
                 constants={"weights": np.full(16, 1e9, np.float32), "biases": np.full(16, -1e9, np.float32)})
    outs = []
    for i, mask in enumerate((const, bn)):
        add = b.layer("Add", [x, mask], [[1, 8, 16]], name=f"add{i}", params={"with_activation": "NONE"})
        outs.append(b.layer("Softmax", [add], [[1, 8, 16]], name=f"softmax{i}", params={"axis": 2}))
    return b.build(outs)


def _scores_and_keep(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    keep = np.zeros((SAMPLES, 8, 16), np.float32)
    for i, n in enumerate(rng.integers(6, 17, SAMPLES)):
        keep[i, :, :n] = 1.0
    return {"x": (rng.standard_normal((SAMPLES, 8, 16)) * 2.0).astype(np.float32), "keep": keep}


def _normal(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"x": (rng.standard_normal((SAMPLES, 8, 32)) * 2.0).astype(np.float32)}


CASES: Dict[str, IrCase] = {
    "op_softmax_tune_fastexp": IrCase(_softmax, _normal, ("enable_pass_tune_op_softmax = [1,1][0]",)),
    "op_softmax_tune_lut": IrCase(_softmax, _normal, ("enable_pass_tune_op_softmax = [2,20][0]",)),
    "op_deep_float": IrCase(_float_chain, _normal, ("trigger_float_op = disable & <[(1,1)]:float16_preferred!>",
                                                    "enable_pass_deeply_set_unquantifiable = true")),
    "op_detect_inf_mask": IrCase(_finite_masks, _scores_and_keep, ("enable_pass_detect_inf_mask_nodes = true",)),
}
