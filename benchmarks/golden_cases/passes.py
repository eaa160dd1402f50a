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


def _normal(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"x": (rng.standard_normal((SAMPLES, 8, 32)) * 2.0).astype(np.float32)}


CASES: Dict[str, IrCase] = {
    "op_softmax_tune_fastexp": IrCase(_softmax, _normal, ("enable_pass_tune_op_softmax = [1,1][0]",)),
    "op_softmax_tune_lut": IrCase(_softmax, _normal, ("enable_pass_tune_op_softmax = [2,20][0]",)),
    "op_deep_float": IrCase(_float_chain, _normal, ("trigger_float_op = disable & <[(1,1)]:float16_preferred!>",
                                                    "enable_pass_deeply_set_unquantifiable = true")),
}
