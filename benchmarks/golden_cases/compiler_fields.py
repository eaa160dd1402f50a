"""Golden cases of the compiler and library cfg fields (docs/user-guide.md, "Compiler and library fields";
quantopt/passes/compiler_fields.py): weight ranges doubled by optimize_wdc_for_x2, and the dynamic-shape keys that
enable_ds, ds_output_shape_constant and ds_parameter_constant write (tests/test_compiler_fields.py compares those
keys with the goldens)."""
from __future__ import annotations

from typing import Dict

import numpy as np

from golden_cases import IrCase
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph

SAMPLES = 8


def _wdc() -> PyGraph:
    """Three weight constants that compress differently: binary conv weights (3 doublings in 8 bits), uniform FC
    weights (2) and small FC weights with one outlier (already compressible: none)."""
    rng = np.random.default_rng(20)
    conv_w = np.where(rng.random((8, 3, 3, 8)) < 0.5, -1.0, 1.0).astype(np.float32)
    fc_w = rng.uniform(-1.0, 1.0, (16, 8)).astype(np.float32)
    sparse_w = (rng.standard_normal((16, 16)) * 0.05).astype(np.float32)
    sparse_w[3, 5] = 1.0
    b = GraphBuilder("case")
    x = b.input("x", [1, 8, 8, 8])
    c = b.layer("Convolution", [x], [[1, 8, 8, 8]], name="conv",
                params={"num_output": 8, "kernel_x": 3, "kernel_y": 3, "stride_x": 1, "stride_y": 1, "pad_left": 1,
                        "pad_right": 1, "pad_top": 1, "pad_bottom": 1, "dilation_x": 1, "dilation_y": 1,
                        "group": 1, "with_activation": "NONE"},
                constants={"weights": conv_w, "biases": rng.uniform(-0.5, 0.5, 8).astype(np.float32)})
    r = b.layer("Reshape", [c], [[1, 64, 8]], name="reshape", params={"shape": [1, 64, 8]})
    f = b.layer("FullyConnected", [r], [[1, 64, 16]], name="fc", params={"num_output": 16, "with_activation": "NONE"},
                constants={"weights": fc_w, "biases": rng.uniform(-0.1, 0.1, 16).astype(np.float32)})
    g = b.layer("FullyConnected", [f], [[1, 64, 16]], name="fc_sparse",
                params={"num_output": 16, "with_activation": "NONE"},
                constants={"weights": sparse_w, "biases": rng.uniform(-0.1, 0.1, 16).astype(np.float32)})
    return b.build([g])


def _ds() -> PyGraph:
    b = GraphBuilder("case")
    x = b.input("x", [1, 8, 16])
    r = b.layer("Reshape", [x], [[1, 8, 4, 4]], name="reshape", params={"shape": [1, 8, 4, 4]})
    c = b.layer("Crop", [r], [[1, 8, 4, 2]], name="crop", params={"crops": [[0, 1], [0, 8], [0, 4], [1, 3]]})
    s = b.layer("Split", [c], [[1, 8, 4, 1], [1, 8, 4, 1]], name="split", params={"axis": 3, "splits": [1, 1]})
    t = b.layer("Activation", [s[0]], [[1, 8, 4, 1]], name="tanh", params={"method": "TANH"})
    return b.build([t, s[1]])


def _image(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"x": rng.standard_normal((SAMPLES, 8, 8, 8)).astype(np.float32)}


def _rows(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"x": rng.standard_normal((SAMPLES, 8, 16)).astype(np.float32)}


CASES: Dict[str, IrCase] = {
    "op_wdc_x2": IrCase(_wdc, _image, ("optimize_wdc_for_x2 = true",)),
    "op_ds_keys": IrCase(_ds, _rows, ("enable_ds = true", "ds_parameter_constant = default",
                                      "ds_output_shape_constant = disable & <[Split] : [1,0]><[Crop,Input] : all>"
                                      "<[Activation] : [1,1]>")),
}
