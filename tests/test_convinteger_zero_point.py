"""ConvInteger fed by a requantizing Cast (golden op_convinteger's shape; docs/semantics/integer-models.md): the Cast
keeps zero point 0, so its integers are the model's int8 values (upstream labels it -x_zero_point, which makes its
Cast store X + x_zero_point), and the ConvInteger's integer outputs are ONNX's conv(X - x_zero_point,
w - w_zero_point) + b, checked against plain numpy loops."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model
from quantopt.quant.dtype import Dtype

XZP, WZP = 4, -3
PARAMS = {"kernel_x": 2, "kernel_y": 3, "stride_x": 1, "stride_y": 2, "pad_left": 0, "pad_right": 1, "pad_top": 1,
          "pad_bottom": 1, "dilation_x": 1, "dilation_y": 1, "group": 1, "num_output": 4,
          "x_zero_point": XZP, "w_zero_point": WZP}


def _graph(w: np.ndarray, bias: np.ndarray):
    b = GraphBuilder("convi")
    x = b.input("x", [1, 6, 7, 3], layer_name="x")
    c = b.layer("Cast", [x], [[1, 6, 7, 3]], name="cast", outputs=["cast"], params={"to_dtype": Dtype.INT8},
                output_dtypes=[Dtype.INT8])
    y = b.layer("ConvInteger", [c], [[1, 3, 7, 4]], name="conv", outputs=["y"], params=PARAMS,
                constants={"weights": w, "biases": bias},
                constant_dtypes={"weights": Dtype.INT8, "biases": Dtype.INT32}, output_dtypes=[Dtype.INT32])
    return b.build([y])


def _reference(xi: np.ndarray, w: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """conv(X - XZP padded with 0, w - WZP) + b: NHWC/OHWI loops, pads (1, 1) on H and (0, 1) on W, stride (2, 1)."""
    xs = np.pad(xi.astype(np.int64) - XZP, ((0, 0), (1, 1), (0, 1), (0, 0)))
    ws = w.astype(np.int64) - WZP
    oh, ow = (xs.shape[1] - 3) // 2 + 1, xs.shape[2] - 2 + 1
    y = np.zeros((xs.shape[0], oh, ow, 4), dtype=np.int64)
    for o in range(4):
        for i in range(oh):
            for j in range(ow):
                y[:, i, j, o] = (xs[:, 2 * i:2 * i + 3, j:j + 2, :] * ws[o]).reshape(xs.shape[0], -1).sum(1) + bias[o]
    return y


def test_cast_keeps_zero_point_and_integers_are_onnx(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    w = rng.integers(-128, 128, size=(4, 3, 2, 3))
    bias = rng.integers(-2000, 2000, size=4)
    xs = [rng.uniform(-90.0, 90.0, size=(1, 6, 7, 3)).astype(np.float32) for _ in range(4)]
    g = _graph(w, bias)
    q = quantize_model(g, [[torch.from_numpy(x)] for x in xs], settings={"q_strategy_activation": "extrema"})
    cast = q.node("cast").outputs[0]
    p = q.quant.get(cast)
    assert (cast.dtype, p.scale, p.zerop, p.qinvariant) == (Dtype.INT8, 1.0, 0, True)
    reread = read_ir(write_ir(q, str(tmp_path / "q.txt"))[0])
    for x in xs:
        feed = [torch.from_numpy(x)]
        g.forward(feed, keep_tensors=True)
        x_float = g.node("cast").outputs[0].betensor.numpy()  # trunc(x), ONNX's int8 values
        (y,) = q.forward(feed, keep_tensors=True)
        xi = cast.betensor.numpy()
        assert np.abs(xi - x_float).max() <= 1  # the requantized input's rounding, never a shift by XZP
        np.testing.assert_array_equal(y.numpy(), _reference(xi, w, bias))
        np.testing.assert_array_equal(reread.forward(feed)[0].numpy(), y.numpy())
