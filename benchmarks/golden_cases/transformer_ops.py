"""One-operator golden cases of the transformer, integer-model and control-flow operators
(quantopt/ops/transformer_ops.py, integer_ops.py, control_flow.py): each graph is the operator fed by model inputs
and constants, with params as upstream's IR spells them."""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.quant.dtype import Dtype

from . import IrCase

SAMPLES = 8


def _normal(**shapes: tuple) -> Callable[[np.random.Generator], Dict[str, np.ndarray]]:
    def sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
        return {name: rng.normal(0.2, 1.3, size=(SAMPLES,) + shape).astype(np.float32)
                for name, shape in shapes.items()}
    return sample


def _caches(positions: int, half: int) -> tuple:
    inv = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float64) / half))
    angles = np.arange(positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rope(interleaved: bool, three_d: bool) -> Callable[[], PyGraph]:
    def build() -> PyGraph:
        b = GraphBuilder("rope")
        shape = [1, 5, 16] if three_d else [1, 2, 5, 8]
        x = b.input("x", shape)
        cos, sin = _caches(7, 3)
        c = b.layer("Constant", [], [[7, 3]], name="cos_cache", constants={"weights": cos})
        s = b.layer("Constant", [], [[7, 3]], name="sin_cache", constants={"weights": sin})
        params = {"rotary_embedding_dim": 6, "interleaved": interleaved}
        if three_d:
            params["num_heads"] = 2
        y = b.layer("RotaryEmbedding", [x, c, s], [shape], name="rope", params=params)
        return b.build([y])
    return build


def _matmul_integer() -> PyGraph:
    b = GraphBuilder("mmi")
    x = b.input("x", [1, 3, 4])
    # an integer operand from a Cast (integer model inputs cannot be fed from the corpus' .npz data)
    a = b.layer("Cast", [x], [[1, 3, 4]], name="cast", params={"to_dtype": "int8"}, output_dtypes=[Dtype.INT8])
    # the second operand is a Cast of a model input too: upstream's float forward multiplies the tensors as they
    # come and fails on mixed dtypes ("expected m1 and m2 to have the same dtype") beside a constant
    k = b.input("w", [1, 4, 5])
    c = b.layer("Cast", [k], [[1, 4, 5]], name="cast_b", params={"to_dtype": "int8"}, output_dtypes=[Dtype.INT8])
    y = b.layer("MatMulInteger", [a, c], [[1, 3, 5]], name="matmul_integer",
                params={"a_zero_point": 3, "b_zero_point": -2}, output_dtypes=[Dtype.INT32])
    return b.build([y])


def _integers(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"x": np.round(rng.normal(0.0, 20.0, size=(SAMPLES, 3, 4))).astype(np.float32),
            "w": np.round(rng.normal(0.0, 9.0, size=(SAMPLES, 4, 5))).astype(np.float32)}


def _conv_integer() -> PyGraph:
    b = GraphBuilder("convi")
    x = b.input("x", [1, 6, 7, 3])
    a = b.layer("Cast", [x], [[1, 6, 7, 3]], name="cast", params={"to_dtype": "int8"}, output_dtypes=[Dtype.INT8])
    w = np.random.default_rng(3).integers(-20, 21, size=(4, 3, 2, 3)).astype(np.int8)
    bias = np.array([5, -7, 0, 11], dtype=np.int32)
    y = b.layer("ConvInteger", [a], [[1, 3, 7, 4]], name="conv_integer",
                params={"kernel_x": 2, "kernel_y": 3, "stride_x": 1, "stride_y": 2, "pad_left": 0, "pad_right": 1,
                        "pad_top": 1, "pad_bottom": 1, "dilation_x": 1, "dilation_y": 1, "group": 1,
                        "num_output": 4, "x_zero_point": 4, "w_zero_point": -3},
                constants={"weights": w, "biases": bias},
                constant_dtypes={"weights": Dtype.INT8, "biases": Dtype.INT32},
                output_dtypes=[Dtype.INT32])
    return b.build([y])


def _image_integers(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"x": np.round(rng.normal(0.0, 30.0, size=(SAMPLES, 6, 7, 3))).astype(np.float32)}


def _fake_quant() -> PyGraph:
    b = GraphBuilder("fq")
    x = b.input("x", [1, 4, 6])
    y = b.layer("FakeQuantWithMinMaxVars", [x], [[1, 4, 6]], name="fake_quant",
                params={"min": -1.3, "max": 2.1, "num_bits": 8, "narrow_range": False})
    return b.build([y])


def _cache_update(positions: list, rows: int) -> Callable[[], PyGraph]:
    def build() -> PyGraph:
        b = GraphBuilder("cache")
        buf = b.input("buffer", [1, 1, 6, 8])
        entries = b.input("entries", [1, 2, len(positions), 4])
        p = b.layer("Constant", [], [[1, len(positions)]], name="positions",
                    constants={"weights": np.array([positions], dtype=np.float32)})
        y = b.layer("CacheUpdate", [buf, p, entries], [[1, 2, rows, 4], [1, 1, 6, 8]], name="cache_update",
                    params={"block_index": 0}, outputs=["cached", "new_buffer"])
        return b.build(y)
    return build


def _cache_data(n: int) -> Callable[[np.random.Generator], Dict[str, np.ndarray]]:
    def sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
        return {"buffer": rng.normal(0.0, 1.0, size=(SAMPLES, 1, 6, 8)).astype(np.float32),
                "entries": rng.normal(0.3, 1.6, size=(SAMPLES, 2, n, 4)).astype(np.float32)}
    return sample


def _index(b: GraphBuilder, name: str, values: list) -> str:
    """An index vector as a float constant holding integers (both tools make it an integer tensor)."""
    return b.layer("Constant", [], [[len(values)]], name=name,
                   constants={"weights": np.array(values, dtype=np.float32)})


def _slot_update() -> PyGraph:
    b = GraphBuilder("slot")
    x = b.input("x", [1, 2, 3, 4])
    i0 = _index(b, "slot0", [0, 2, 4])
    i1 = _index(b, "slot1", [2, 3])
    y = b.layer("SlotUpdate", [x, i0, i1], [[1, 5, 4]], name="slot_update")
    return b.build([y])


def _query_rebatch() -> PyGraph:
    b = GraphBuilder("rebatch")
    x = b.input("x", [1, 6, 4])
    i0 = _index(b, "query0", [0, 2, 5])
    i1 = _index(b, "query1", [1, 3])
    y = b.layer("QueryRebatch", [x, i0, i1], [[1, 2, 3, 4]], name="query_rebatch")
    return b.build([y])


def _switch() -> PyGraph:
    b = GraphBuilder("switch")
    x = b.input("x", [1, 4, 6])
    a = b.layer("Abs", [x], [[1, 4, 6]], name="abs")
    y = b.layer("Switch", [x, a], [[1, 4, 6]], name="switch")
    return b.build([y])


CASES: Dict[str, IrCase] = {
    "op_rotaryembedding": IrCase(_rope(False, False), _normal(x=(2, 5, 8))),
    "op_rotaryembedding_interleaved": IrCase(_rope(True, True), _normal(x=(5, 16))),
    "op_matmulinteger": IrCase(_matmul_integer, _integers),
    "op_convinteger": IrCase(_conv_integer, _image_integers),
    "op_cacheupdate": IrCase(_cache_update([3], 4), _cache_data(1)),
    "op_cacheupdate_prefill": IrCase(_cache_update([1, 2, 4], 3), _cache_data(3)),
    "op_slotupdate": IrCase(_slot_update, _normal(x=(2, 3, 4))),
    "op_queryrebatch": IrCase(_query_rebatch, _normal(x=(6, 4))),
    "op_switch": IrCase(_switch, _normal(x=(4, 6))),
    "op_fakequantwithminmaxvars": IrCase(_fake_quant, _normal(x=(4, 6))),
}
