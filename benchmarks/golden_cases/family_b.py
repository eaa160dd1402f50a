"""One-operator golden cases of the sequence-decoding, selection and resampling operators (quantopt/ops/
sequence_decode.py, selection.py, sampling.py): each graph is the operator fed by model inputs, with params and
integer input dtypes as upstream's IR spells them."""
from __future__ import annotations

from typing import Callable, Dict, Optional

import numpy as np

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.quant.dtype import Dtype

from . import IrCase

SAMPLES = 8


# ------------------------------------------------------------------------------------------------ sequence decoding
def _ctc() -> PyGraph:
    b = GraphBuilder("ctc")
    x = b.input("logits", [1, 16, 6])
    n = b.layer("Constant", [], [[1]], name="seq_len", constants={"weights": np.array([13.0], dtype=np.float32)})
    y = b.layer("CTCGreedyDecoder", [x, n], [[1, 16, 1, 1]], name="decoder", params={"merge_repeated": True},
                output_dtypes=[Dtype.INT32])
    return b.build([y])


def _ctc_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    logits = rng.normal(0.0, 1.5, size=(SAMPLES, 16, 6)).astype(np.float32)
    logits[..., 5] += 0.8  # the blank (last class) wins often, as in a trained head
    return {"logits": logits}


def _collapse() -> PyGraph:
    b = GraphBuilder("collapse")
    x = b.input("labels", [1, 12])
    n = b.layer("Constant", [], [[1]], name="lengths", constants={"weights": np.array([10.0], dtype=np.float32)})
    y = b.layer("CollapseRepeated", [x, n], [[1, 12], [1]], name="collapse", outputs=["collapsed", "new_len"],
                output_dtypes=[Dtype.FP32, Dtype.FP32])
    return b.build(y)


def _collapse_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    # labels as float values (a float label input is quantized; integer model inputs cannot be fed from .npz data)
    return {"labels": rng.choice([0.0, 1.0, 2.0, 3.0], size=(SAMPLES, 12)).astype(np.float32)}


# ------------------------------------------------------------------------------------------------ selection
def _const(b: GraphBuilder, name: str, values: list, shape: Optional[list] = None) -> str:
    """An index/condition tensor as a float constant holding integers (both tools make it an integer tensor;
    integer model inputs cannot be fed from the corpus' .npz data)."""
    data = np.array(values, dtype=np.float32).reshape(shape or [len(values)])
    return b.layer("Constant", [], [list(data.shape)], name=name, constants={"weights": data})


def _sparse(shape: tuple) -> Callable[[np.random.Generator], Dict[str, np.ndarray]]:
    def sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
        x = rng.normal(0.3, 1.5, size=(SAMPLES,) + shape).astype(np.float32)
        x[rng.random(x.shape) < 0.5] = 0.0
        return {"x": x}
    return sample


def _nonzero() -> PyGraph:
    b = GraphBuilder("nonzero")
    x = b.input("x", [1, 4, 5])
    y = b.layer("NonZero", [x], [[3, 20], [1]], name="nonzero", outputs=["coords", "count"],
                output_dtypes=[Dtype.INT32, Dtype.INT32])
    return b.build(y)


def _unique() -> PyGraph:
    b = GraphBuilder("unique")
    x = b.input("x", [1, 12])
    y = b.layer("Unique", [x], [[12]] * 4, name="unique", params={"sorted": True},
                outputs=["values", "indices", "inverse", "counts"],
                output_dtypes=[Dtype.FP32, Dtype.INT32, Dtype.INT32, Dtype.INT32])
    return b.build(y)


def _unique_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"x": rng.choice([-1.5, 0.0, 0.5, 2.0, 3.25], size=(SAMPLES, 12)).astype(np.float32)}


def _compress() -> PyGraph:
    b = GraphBuilder("compress")
    x = b.input("x", [1, 4, 6])
    c = _const(b, "condition", [1, 0, 1, 1, 0, 1])
    y = b.layer("Compress", [x, c], [[1, 4, 6]], name="compress", params={"axis": 2})
    return b.build([y])


def _filter() -> PyGraph:
    b = GraphBuilder("filter")
    x1 = b.input("x", [1, 6, 3])
    x2 = b.layer("Abs", [x1], [[1, 6, 3]], name="abs")
    s = _const(b, "selector", [0, 1, 1, 0, 1, 0])
    y = b.layer("Filter", [x1, x2, s], [[1, 6, 3], [1, 6, 3], []], name="filter", params={"num": 2, "axis": 1},
                outputs=["kept", "kept_abs", "count"], output_dtypes=[Dtype.FP32, Dtype.FP32, Dtype.INT32])
    return b.build(y)


def _intopk() -> PyGraph:
    b = GraphBuilder("intopk")
    x = b.input("x", [1, 8])
    t = _const(b, "target", [3])
    y = b.layer("InTopK", [x, t], [[1]], name="intopk", params={"k": 3}, output_dtypes=[Dtype.UINT8])
    return b.build([y])


def _segment() -> PyGraph:
    b = GraphBuilder("segment")
    x = b.input("x", [1, 6, 3])
    r = b.layer("Reshape", [x], [[6, 3]], name="rows", params={"shape": [6, 3]})
    ids = _const(b, "segment_ids", [0, 0, 1, 3, 3, 3])
    y = b.layer("SegmentReduce", [r, ids], [[6, 3]], name="segment_sum", params={"method": "SUM"})
    return b.build([y])


def _hits() -> PyGraph:
    b = GraphBuilder("hits")
    x = b.input("x", [1, 4, 6])
    a = b.layer("ArgMinMax", [x], [[1, 4, 1]], name="argmax",
                params={"method": "MAX", "axis": 2, "select_last_index": False}, output_dtypes=[Dtype.INT32])
    t = b.layer("Reshape", [a], [[1, 4]], name="true_classes", params={"shape": [1, 4]}, output_dtypes=[Dtype.INT32])
    c = _const(b, "candidates", [0, 2, 3, 5, 1, 2, 4, 5])
    y = b.layer("AccidentalHits", [t, c], [[32], [32], [1]], name="hits", outputs=["rows", "positions", "count"],
                output_dtypes=[Dtype.INT32] * 3)
    return b.build(y)


def _normal(shape: tuple) -> Callable[[np.random.Generator], Dict[str, np.ndarray]]:
    def sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
        return {"x": rng.normal(0.3, 1.5, size=(SAMPLES,) + shape).astype(np.float32)}
    return sample


# ------------------------------------------------------------------------------------------------ resampling
def _unpool() -> PyGraph:
    b = GraphBuilder("unpool")
    x = b.input("x", [1, 2, 3, 2])
    positions = np.random.default_rng(7).permutation(48)[:12]  # distinct NHWC positions in the [1, 4, 6, 2] output
    a = _const(b, "argmax", positions.tolist(), [1, 2, 3, 2])
    y = b.layer("UpsampleByIndex", [x, a], [[1, 4, 6, 2]], name="unpool", params={"flatten_dim": "NHWC"})
    return b.build([y])


def _overlap() -> PyGraph:
    b = GraphBuilder("overlap")
    x = b.input("x", [1, 2, 5, 4])
    y = b.layer("OverlapAdd", [x], [[1, 2, 12]], name="overlap_add", params={"frame_step": 2})
    return b.build([y])


def _affine() -> PyGraph:
    b = GraphBuilder("affine")
    theta = b.input("theta", [1, 2, 3])
    size = _const(b, "size", [1, 1, 6, 10])
    y = b.layer("AffineGrid", [theta, size], [[1, 6, 10, 2]], name="affine_grid", params={"align_corners": False})
    return b.build([y])


def _affine_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    theta = np.eye(2, 3)[None] * rng.uniform(0.7, 1.2, size=(SAMPLES, 1, 1)) + rng.normal(0, 0.2, size=(SAMPLES, 2, 3))
    return {"theta": theta.astype(np.float32)}


def _fractional(method: str, pseudo: bool, overlap: bool) -> Callable[[], PyGraph]:
    def build() -> PyGraph:
        b = GraphBuilder("fractional")
        x = b.input("x", [1, 10, 9, 3])
        y = b.layer("FractionalPool", [x], [[1, 7, 4, 3], [8], [5]], name="fractional_pool",
                    params={"method": method, "seed": 7, "pseudo": pseudo, "overlap": overlap},
                    outputs=["pooled", "rows", "cols"], output_dtypes=[Dtype.FP32, Dtype.INT32, Dtype.INT32])
        return b.build(y)
    return build


CASES: Dict[str, IrCase] = {
    "op_ctcgreedydecoder": IrCase(_ctc, _ctc_data),
    "op_collapserepeated": IrCase(_collapse, _collapse_data),
    "op_nonzero": IrCase(_nonzero, _sparse((4, 5))),
    "op_unique": IrCase(_unique, _unique_data),
    "op_compress": IrCase(_compress, _normal((4, 6))),
    "op_filter": IrCase(_filter, _normal((6, 3))),
    "op_intopk": IrCase(_intopk, _normal((8,))),
    "op_segmentreduce": IrCase(_segment, _normal((6, 3))),
    "op_accidentalhits": IrCase(_hits, _normal((4, 6))),
    "op_upsamplebyindex": IrCase(_unpool, _normal((2, 3, 2))),
    "op_affinegrid": IrCase(_affine, _affine_data),
    "op_fractionalpool": IrCase(_fractional("MAX", True, False), _normal((10, 9, 3))),
    "op_fractionalpool_avg": IrCase(_fractional("AVG", False, True), _normal((10, 9, 3))),
    "op_overlapadd": IrCase(_overlap, _normal((2, 5, 4))),
}
