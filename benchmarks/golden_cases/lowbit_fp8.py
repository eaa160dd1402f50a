"""Golden cases of upstream's quant types with fp8 activations (docs/low-bit.md): two FullyConnected layers with
shape ops between them, and a Convolution / DepthwiseConv / Convolution stack (upstream fails on an integer
layer that reads an fp8 tensor, so each graph ends in fp8)."""
from __future__ import annotations

from typing import Dict

import numpy as np

from golden_cases import IrCase
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph

SAMPLES = 8


def _fc_stack() -> PyGraph:
    rng = np.random.default_rng(20)
    b = GraphBuilder("case")
    x = b.input("x", [1, 16])
    h = b.layer("FullyConnected", [x], [[1, 12]], name="fc1", params={"num_output": 12, "with_activation": "NONE"},
                constants={"weights": rng.standard_normal((12, 16)).astype(np.float32) * 0.4,
                           "biases": rng.standard_normal(12).astype(np.float32) * 0.1})
    h = b.layer("Reshape", [h], [[1, 3, 4]], name="reshape", params={"shape": [1, 3, 4]})
    h = b.layer("Reshape", [h], [[1, 12]], name="flat", params={"shape": [1, 12]})
    h = b.layer("FullyConnected", [h], [[1, 6]], name="fc2", params={"num_output": 6, "with_activation": "NONE"},
                constants={"weights": rng.standard_normal((6, 12)).astype(np.float32) * 0.4,
                           "biases": rng.standard_normal(6).astype(np.float32) * 0.1})
    return b.build([h])


GEO = dict(kernel_x=3, kernel_y=3, stride_x=1, stride_y=1, pad_left=1, pad_right=1, pad_top=1, pad_bottom=1,
           dilation_x=1, dilation_y=1)


def _conv_stack() -> PyGraph:
    """Convolution (RELU) -> DepthwiseConv -> Convolution, all fp8 under the wfp8* types (upstream fails on a grouped
    Convolution with per-tensor weights under an fp8 type: its per-group scales do not broadcast)."""
    rng = np.random.default_rng(21)
    b = GraphBuilder("case")
    x = b.input("x", [1, 6, 6, 3])
    h = b.layer("Convolution", [x], [[1, 6, 6, 4]], name="conv", params=dict(num_output=4, group=1,
                                                                              with_activation="RELU", **GEO),
                constants={"weights": rng.normal(0, 0.4, [4, 3, 3, 3]).astype(np.float32),
                           "biases": rng.normal(0, 0.1, [4]).astype(np.float32)})
    h = b.layer("DepthwiseConv", [h], [[1, 6, 6, 4]], name="dw", params=dict(num_output=4, group=4, multiplier=1,
                                                                              with_activation="NONE", **GEO),
                constants={"weights": rng.normal(0, 0.4, [4, 3, 3, 1]).astype(np.float32),
                           "biases": rng.normal(0, 0.1, [4]).astype(np.float32)})
    h = b.layer("Convolution", [h], [[1, 6, 6, 4]], name="conv2", params=dict(num_output=4, group=1,
                                                                               with_activation="NONE", **GEO),
                constants={"weights": rng.normal(0, 0.4, [4, 3, 3, 4]).astype(np.float32),
                           "biases": rng.normal(0, 0.1, [4]).astype(np.float32)})
    return b.build([h])


def _image(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"x": rng.standard_normal((SAMPLES, 6, 6, 3)).astype(np.float32)}


def _normal(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"x": rng.standard_normal((SAMPLES, 16)).astype(np.float32)}


def _case(quant_type: str) -> IrCase:
    return IrCase(_fc_stack, _normal, (f"quant_type = {quant_type}",))


CASES: Dict[str, IrCase] = {
    "op_fp8_fc_e4m3": _case("wfp8e4m3afp8e4m3"),
    "op_fp8_fc_w4e4m3": _case("w4afp8e4m3"),
    "op_fp8_conv_e5m2": IrCase(_conv_stack, _image, ("quant_type = wfp8e5m2afp8e5m2",)),
}
