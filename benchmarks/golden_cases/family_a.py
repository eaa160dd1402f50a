"""One-operator golden cases of operator family A (plumbing, block layout, counting, moments, colour conversion,
morphology, Col2Im): types the upstream Parser writes from framework ops quantopt has no ONNX form of. Each float
graph is written by quantopt's IR writer, params spelled as upstream's IR spells them (docs/semantics/plumbing.md,
space-batch.md, counting.md, moments.md, colorspace.md, morphology.md)."""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import numpy as np

from golden_cases import IrCase
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.quant.dtype import Dtype

SAMPLES = 8


def _normal(shapes: Dict[str, Sequence[int]], scale: float = 1.0, shift: float = 0.0):
    def sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
        return {k: (rng.standard_normal((SAMPLES, *s[1:])) * scale + shift).astype(np.float32)
                for k, s in shapes.items()}
    return sample


def _one(optype: str, in_shape: List[int], out_shapes: List[List[int]], params: Dict,
         pre: Callable[[GraphBuilder, str], str] = lambda b, x: x) -> Callable[[], PyGraph]:
    """Input x -> (pre) -> the op; every output of the op is a graph output."""
    def build() -> PyGraph:
        b = GraphBuilder("case")
        x = pre(b, b.input("x", in_shape))
        outs = b.layer(optype, [x], out_shapes, name=optype.lower(), params=params)
        return b.build(outs if isinstance(outs, list) else [outs])
    return build


def _reshape(shape: List[int]) -> Callable[[GraphBuilder, str], str]:
    def pre(b: GraphBuilder, x: str) -> str:
        return b.layer("Reshape", [x], [shape], name="reshape", params={"shape": shape})
    return pre


def _sparse_zeros(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """Half the values exactly 0, the others at least 0.25 away from it (so none quantizes to 0)."""
    x = rng.standard_normal((SAMPLES, 4, 6, 3))
    x = np.sign(x) * (np.abs(x) + 0.25) * (rng.random(x.shape) < 0.5)
    return {"x": x.astype(np.float32)}


def _meshgrid() -> PyGraph:
    """Meshgrid of integer vectors (upstream quantizes it for integer inputs only); the float inputs are cast to int8
    first because the multi-input numpy dataset hands samples on as float32."""
    b = GraphBuilder("case")
    vecs = []
    for name, n in (("x", 3), ("y", 4)):
        t = b.input(name, [1, n])
        t = b.layer("Cast", [t], [[1, n]], name=f"cast_{name}", params={"to_dtype": Dtype.INT8},
                    output_dtypes=[Dtype.INT8])
        vecs.append(b.layer("Reshape", [t], [[n]], name=f"flat_{name}", params={"shape": [n]},
                            output_dtypes=[Dtype.INT8]))
    outs = b.layer("Meshgrid", vecs, [[4, 3], [4, 3]], name="meshgrid",
                   params={"indexing": "xy", "sparse": False, "copy": True}, output_dtypes=[Dtype.INT8] * 2)
    return b.build(outs)


def _integers(shapes: Dict[str, Sequence[int]]):
    def sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
        return {k: rng.integers(-20, 20, (SAMPLES, *s[1:])).astype(np.float32) for k, s in shapes.items()}
    return sample


BT709 = {"RgbToYuv": [0, 0, 0, 0, 128, 128, 0.2126, 0.7152, 0.0722, -0.114572, -0.385428, 0.5, 0.5, -0.454153,
                      -0.045847],
         "YuvToRgb": [0, 128, 128, 0, 0, 0, 1.0, 0.0, 1.5748, 1.0, -0.187324, -0.468124, 1.0, 1.8556, 0.0]}
"""The Parser's BT709 coefficients (its float IR: coefficient_shift 0, coefficient_dtype float32)."""


def _colour(optype: str, in_shape: List[int], out_shape: List[int]) -> Callable[[], PyGraph]:
    """Pixels in float32 cast to uint8 (the multi-input numpy dataset hands samples on as float32; the conversion
    reads integer pixels), then the conversion as the Parser writes it."""
    def build() -> PyGraph:
        b = GraphBuilder("case")
        x = b.input("x", in_shape)
        x = b.layer("Cast", [x], [in_shape], name="cast", params={"to_dtype": Dtype.UINT8},
                    output_dtypes=[Dtype.UINT8])
        y = b.layer(optype, [x], [out_shape], name=optype.lower(), output_dtypes=[Dtype.UINT8],
                    params={"format": "I420", "bits": 8, "conversion": "BT709", "coefficient": BT709[optype],
                            "coefficient_dtype": "float32", "coefficient_shift": 0})
        return b.build([y])
    return build


def _pixels(shape: List[int]):
    def sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
        return {"x": rng.integers(0, 256, (SAMPLES, *shape[1:])).astype(np.float32)}
    return sample


def _sufficient_statistics() -> PyGraph:
    b = GraphBuilder("case")
    x = b.input("x", [1, 4, 6, 3])
    shift = b.input("shift", [1, 1, 1, 3])
    outs = b.layer("SufficientStatistics", [x, shift], [[1, 1, 1, 3], [1, 1, 1, 3]], name="sufficientstatistics",
                   params={"axis": [1, 2]})
    return b.build(outs)


def _normalized_moments() -> PyGraph:
    b = GraphBuilder("case")
    ins = [b.input(n, [1, 4, 3]) for n in ("mean_ss", "variance_ss", "shift")]
    outs = b.layer("NormalizedMoments", ins, [[1, 4, 3], [1, 4, 3]], name="normalizedmoments",
                   params={"counts": 24.0})
    return b.build(outs)


def _sums(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """The sums TensorFlow's sufficient_statistics gives for 24 values per position around a shift."""
    shift = rng.normal(0.5, 0.4, size=(SAMPLES, 4, 3))
    x = rng.normal(0.7, 1.1, size=(SAMPLES, 24, 4, 3))
    d = x - shift[:, None]
    return {"mean_ss": d.sum(1).astype(np.float32), "variance_ss": (d * d).sum(1).astype(np.float32),
            "shift": shift.astype(np.float32)}


def _morphology(optype: str) -> Callable[[], PyGraph]:
    def build() -> PyGraph:
        b = GraphBuilder("case")
        x = b.input("x", [1, 6, 7, 3])
        w = np.random.default_rng(5).normal(0.0, 0.4, size=(3, 2, 3, 1)).astype(np.float32)
        y = b.layer(optype, [x], [[1, 6, 3, 3]], name=optype.lower(), constants={"weights": w},
                    params={"kernel_x": 3, "kernel_y": 2, "stride_x": 2, "stride_y": 1, "dilation_x": 1,
                            "dilation_y": 1, "pad_left": 0, "pad_right": 1, "pad_top": 1, "pad_bottom": 0})
        return b.build([y])
    return build


def _col2im() -> PyGraph:
    """ONNX Col2Im as the Parser writes it: the image and block shapes are int32 Constant layers."""
    b = GraphBuilder("case")
    x = b.input("x", [1, 8, 15])
    shapes = [b.layer("Constant", [], [[2]], name=name, constants={"weights": np.array(v, dtype=np.int32)},
                      constant_dtypes={"weights": Dtype.INT32}, output_dtypes=[Dtype.INT32])
              for name, v in (("image_shape", [5, 6]), ("block_shape", [2, 2]))]
    y = b.layer("Col2Im", [x, *shapes], [[1, 2, 5, 6]], name="col2im",
                params={"stride_x": 2, "stride_y": 1, "dilation_x": 1, "dilation_y": 1, "pad_left": 1,
                        "pad_right": 0, "pad_top": 0, "pad_bottom": 1})
    return b.build([y])


def _dummy() -> PyGraph:
    b = GraphBuilder("case")
    x = b.input("x", [1, 4, 6, 3])
    y = b.input("y", [1, 10])
    outs = b.layer("Dummy", [x, y], [[1, 4, 6, 3], [1, 10]], name="dummy")
    return b.build(outs)


CASES: Dict[str, IrCase] = {
    "op_noop": IrCase(_one("NoOp", [1, 4, 6, 3], [[1, 4, 6, 3]], {}), _normal({"x": [1, 4, 6, 3]})),
    "op_dummy": IrCase(_dummy, _normal({"x": [1, 4, 6, 3], "y": [1, 10]})),
    "op_batchtodepth": IrCase(_one("BatchToDepth", [1, 8, 5, 3], [[1, 4, 5, 6]], {"block_size": 2},
                                   pre=_reshape([2, 4, 5, 3])), _normal({"x": [1, 8, 5, 3]})),
    "op_batchtospacend": IrCase(_one("BatchToSpaceND", [1, 16, 3, 6], [[1, 4, 5, 5, 2]],
                                     {"block_size": [2, 2, 2], "crops": [[0, 0], [1, 0], [0, 1]]},
                                     pre=_reshape([8, 2, 3, 3, 2])), _normal({"x": [1, 16, 3, 6]})),
    "op_datastride": IrCase(_one("DataStride", [1, 7, 8, 3], [[1, 6, 6, 3]],
                                 {"kernel_x": 2, "kernel_y": 2, "stride_x": 3, "stride_y": 2}),
                            _normal({"x": [1, 7, 8, 3]})),
    "op_meshgrid": IrCase(_meshgrid, _integers({"x": [1, 3], "y": [1, 4]})),
    "op_count": IrCase(_one("Count", [1, 40], [[1, 8]], {"nbins": 8, "min": -2.0, "max": 2.0, "discrete": True}),
                       _normal({"x": [1, 40]})),
    "op_count_reversed": IrCase(_one("Count", [1, 40], [[1, 6]], {"nbins": 6, "min": 1.5, "max": -1.5}),
                                _normal({"x": [1, 40]})),
    "op_zerofraction": IrCase(_one("ZeroFraction", [1, 4, 6, 3], [[1]], {}), _sparse_zeros),
    "op_moments": IrCase(_one("Moments", [1, 4, 6, 3], [[1, 1, 1, 3], [1, 1, 1, 3]], {"axis": [1, 2],
                                                                                        "keepdims": True}),
                         _normal({"x": [1, 4, 6, 3]}, scale=1.5, shift=0.3)),
    "op_rgbtoyuv": IrCase(_colour("RgbToYuv", [1, 4, 6, 3], [1, 36]), _pixels([1, 4, 6, 3])),
    "op_yuvtorgb": IrCase(_colour("YuvToRgb", [1, 36], [1, 4, 6, 3]), _pixels([1, 36])),
    "op_sufficientstatistics": IrCase(_sufficient_statistics,
                                      _normal({"x": [1, 4, 6, 3], "shift": [1, 1, 1, 3]}, scale=1.2, shift=0.2)),
    "op_normalizedmoments": IrCase(_normalized_moments, _sums),
    "op_dilation": IrCase(_morphology("Dilation"), _normal({"x": [1, 6, 7, 3]})),
    "op_erosion": IrCase(_morphology("Erosion"), _normal({"x": [1, 6, 7, 3]})),
    "op_col2im": IrCase(_col2im, _normal({"x": [1, 8, 15]})),
}
"""Folder name -> case (benchmarks/golden_cases/__init__.py)."""
