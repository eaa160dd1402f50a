"""NoOp, Dummy, Meshgrid (ops/trivial.py) and BatchToDepth, BatchToSpaceND, DataStride (ops/space_batch.py):
float forward against independent numpy re-implementations (index formulas of docs/semantics/plumbing.md and
space-batch.md), quantization (outputs carry the input's params), the integer forward (the same numpy formula applied
to the input integers, exactly), a written quantized IR re-read bit-identically, the IR reader's schema check, and
clear errors for bad params."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np
import pytest
import torch
from quant_helpers import params_of, set_quant

import quantopt.ops.space_batch  # noqa: F401  (registers the family even when imported alone)
import quantopt.ops.trivial  # noqa: F401
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model
from quantopt.quant.dtype import Dtype

MODES = [(8, "per_tensor_asymmetric"), (8, "per_tensor_symmetric_full_range"), (16, "per_tensor_symmetric_full_range")]


def settings(bits: int, mode: str) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_strategy_activation="extrema")


def one(optype: str, params: Dict[str, Any], in_shape: Sequence[int], out_shapes: List[List[int]]):
    b = GraphBuilder("t")
    x = b.input("x", list(in_shape))
    y = b.layer(optype, [x], out_shapes, name="op", params=dict(params))
    return b.build(y if isinstance(y, list) else [y])


def data(shape: Sequence[int], seed: int, count: int = 3) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    return [torch.from_numpy(r.normal(0.2, 1.5, size=list(shape)).astype(np.float32)) for _ in range(count)]


# --- independent numpy references (loops over output indices, written from the docs) -------------------------------
def np_batchtodepth(x: np.ndarray, b: int) -> np.ndarray:
    n, h, w, c = x.shape
    y = np.empty((n // b, h, w, b * c), x.dtype)
    for o in range(n // b):
        for j in range(b):
            y[o, :, :, j * c:(j + 1) * c] = x[o * b + j]
    return y


def np_batchtospacend(x: np.ndarray, block: Sequence[int], crops: Sequence[Sequence[int]]) -> np.ndarray:
    bz, by, bx = block
    n, d, h, w, c = x.shape
    no = n // (bz * by * bx)
    full = np.empty((no, d * bz, h * by, w * bx, c), x.dtype)
    for i in range(n):
        k, o = divmod(i, no)  # i = ((iz * by + iy) * bx + ix) * no + o
        iz, rest = divmod(k, by * bx)
        iy, ix = divmod(rest, bx)
        full[o, iz::bz, iy::by, ix::bx, :] = x[i]
    (f, bk), (t, bt), (lf, rt) = crops
    return full[:, f:d * bz - bk, t:h * by - bt, lf:w * bx - rt, :]


def np_datastride(x: np.ndarray, kx: int, ky: int, sx: int, sy: int) -> np.ndarray:
    n, h, w, c = x.shape
    oh, ow = (h - ky) // sy + 1, (w - kx) // sx + 1
    y = np.empty((n, oh * ky, ow * kx, c), x.dtype)
    for i in range(oh):
        for j in range(ow):
            y[:, i * ky:(i + 1) * ky, j * kx:(j + 1) * kx, :] = x[:, i * sy:i * sy + ky, j * sx:j * sx + kx, :]
    return y


CASES = [
    ("BatchToDepth", {"block_size": 2}, [4, 3, 5, 2], [[2, 3, 5, 4]], lambda x: np_batchtodepth(x, 2)),
    ("BatchToDepth", {"block_size": 3}, [3, 2, 2, 3], [[1, 2, 2, 9]], lambda x: np_batchtodepth(x, 3)),
    ("BatchToSpaceND", {"block_size": [2, 1, 2], "crops": [[0, 1], [0, 0], [1, 1]]}, [8, 2, 3, 3, 2],
     [[2, 3, 3, 4, 2]], lambda x: np_batchtospacend(x, [2, 1, 2], [[0, 1], [0, 0], [1, 1]])),
    ("BatchToSpaceND", {"block_size": [2, 2, 2], "crops": [[0, 0], [0, 0], [0, 0]]}, [8, 1, 2, 2, 3],
     [[1, 2, 4, 4, 3]], lambda x: np_batchtospacend(x, [2, 2, 2], [[0, 0], [0, 0], [0, 0]])),
    ("DataStride", {"kernel_x": 2, "kernel_y": 2, "stride_x": 3, "stride_y": 2}, [1, 7, 8, 3], [[1, 6, 6, 3]],
     lambda x: np_datastride(x, 2, 2, 3, 2)),
    ("DataStride", {"kernel_x": 3, "kernel_y": 2, "stride_x": 1, "stride_y": 3}, [2, 8, 5, 2], [[2, 6, 9, 2]],
     lambda x: np_datastride(x, 3, 2, 1, 3)),
    ("NoOp", {}, [1, 3, 4, 2], [[1, 3, 4, 2]], lambda x: x),
]


@pytest.mark.parametrize("optype,params,in_shape,out_shapes,ref", CASES, ids=[f"{i}-{c[0]}" for i, c in
                                                                              enumerate(CASES)])
def test_float_forward_matches_numpy(optype, params, in_shape, out_shapes, ref) -> None:
    g = one(optype, params, in_shape, out_shapes)
    x = data(in_shape, 1, 1)[0]
    (y,) = g.forward([x])
    np.testing.assert_array_equal(y.numpy(), ref(x.numpy()))
    assert list(y.shape) == out_shapes[0]


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("optype,params,in_shape,out_shapes,ref", CASES, ids=[f"{i}-{c[0]}" for i, c in
                                                                              enumerate(CASES)])
def test_integer_forward_moves_integers_exactly(optype, params, in_shape, out_shapes, ref, bits, mode) -> None:
    g = one(optype, params, in_shape, out_shapes)
    qg = quantize_model(g, data(in_shape, 2), settings(bits, mode))
    q_in, q_out = qg.input_tensors[0], qg.output_tensors[0]
    p_in, p_out = (params_of(qg.node("op"), t) for t in (q_in, q_out))
    for key in ("scale", "zerop", "qmin", "qmax", "qbits"):
        assert getattr(p_out, key) == getattr(p_in, key), key
    assert q_out.dtype == q_in.dtype
    (y,) = qg.forward([data(in_shape, 3, 1)[0]])
    assert y.dtype == torch.int64
    np.testing.assert_array_equal(y.numpy(), ref(q_in.betensor.numpy()))


def test_dummy_copies_each_input() -> None:
    b = GraphBuilder("t")
    x, z = b.input("x", [1, 4, 3]), b.input("z", [1, 5])
    outs = b.layer("Dummy", [x, z], [[1, 4, 3], [1, 5]], name="op")
    g = b.build(outs)
    xs, zs = data([1, 4, 3], 4, 3), data([1, 5], 5, 3)
    a, c = g.forward([xs[0], zs[0]])
    assert torch.equal(a, xs[0]) and torch.equal(c, zs[0])
    qg = quantize_model(g, list(zip(xs, zs)), settings(8, "per_tensor_asymmetric"))
    a, c = qg.forward([xs[1], zs[1]])
    node = qg.node("op")
    for q_in, q_out in zip(qg.input_tensors, qg.output_tensors):
        p_in, p_out = params_of(node, q_in), params_of(node, q_out)
        assert (p_out.scale, p_out.zerop, q_out.dtype) == (p_in.scale, p_in.zerop, q_in.dtype)
        assert torch.equal(q_out.betensor, q_in.betensor)


def meshgrid_graph(indexing: str, sparse: bool, shapes: List[List[int]], dtype: Dtype = Dtype.FP32):
    b = GraphBuilder("t")
    x, y = b.input("x", [3], dtype=dtype), b.input("y", [4], dtype=dtype)
    outs = b.layer("Meshgrid", [x, y], shapes, name="op", params={"indexing": indexing, "sparse": sparse},
                   output_dtypes=[dtype, dtype])
    return b.build(outs)


MESH = [("xy", False, [[4, 3], [4, 3]]), ("ij", False, [[3, 4], [3, 4]]), ("xy", True, [[1, 3], [4, 1]]),
        ("ij", True, [[3, 1], [1, 4]])]


@pytest.mark.parametrize("indexing,sparse,shapes", MESH)
def test_meshgrid_float_and_integer(indexing: str, sparse: bool, shapes) -> None:
    g = meshgrid_graph(indexing, sparse, shapes)
    xv, yv = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([3.0, 0.25, -0.5, 1.0])
    a, b = g.forward([xv, yv])
    ra, rb = np.meshgrid(xv.numpy(), yv.numpy(), indexing=indexing, sparse=sparse)
    np.testing.assert_array_equal(a.numpy(), ra)
    np.testing.assert_array_equal(b.numpy(), rb)
    qg = quantize_model(g, [(xv, yv), (xv * 2, yv * 2)], settings(8, "per_tensor_asymmetric"))
    a, b = qg.forward([xv, yv])
    qx, qy = (t.betensor.numpy() for t in qg.input_tensors)
    ra, rb = np.meshgrid(qx, qy, indexing=indexing, sparse=sparse)
    np.testing.assert_array_equal(a.numpy(), ra)
    np.testing.assert_array_equal(b.numpy(), rb)
    node = qg.node("op")
    assert params_of(node, qg.output_tensors[0]).scale == params_of(node, qg.input_tensors[0]).scale
    assert params_of(node, qg.output_tensors[1]).scale == params_of(node, qg.input_tensors[1]).scale


def test_meshgrid_integer_inputs_stay_integer() -> None:
    g = meshgrid_graph("xy", False, [[4, 3], [4, 3]], Dtype.INT8)
    xv, yv = torch.tensor([1, -7, 3], dtype=torch.int64), torch.tensor([2, 0, 5, -1], dtype=torch.int64)
    qg = quantize_model(g, [(xv, yv)], settings(8, "per_tensor_symmetric_full_range"))
    a, b = qg.forward([xv, yv])
    assert all(params_of(qg.node("op"), t).qinvariant for t in qg.output_tensors)
    ra, rb = np.meshgrid(xv.numpy(), yv.numpy())
    np.testing.assert_array_equal(a.numpy(), ra)
    np.testing.assert_array_equal(b.numpy(), rb)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=["BatchToDepth", "BatchToSpaceND", "DataStride"])
def test_written_ir_reloads_bit_identical(tmp_path, case) -> None:
    optype, params, in_shape, out_shapes, _ = case
    qg = quantize_model(one(optype, params, in_shape, out_shapes), data(in_shape, 6), settings(8, MODES[0][1]))
    x = data(in_shape, 7, 1)
    before = [t.clone() for t in qg.forward(x)]
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    after = read_ir(txt).forward(x)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("optype,params,key", [
    ("BatchToDepth", {"block_size": 0}, "block_size"),
    ("DataStride", {"kernel_x": 2, "kernel_y": 2, "stride_x": 1.5, "stride_y": 1}, "stride_x"),
    ("BatchToSpaceND", {"block_size": 2, "crops": [[0, 0], [0, 0], [0, 0]]}, "block_size"),
    ("Meshgrid", {"indexing": "yx"}, "indexing"),
])
def test_ir_reader_checks_declared_kinds(tmp_path, optype, params, key) -> None:
    g = one(optype, {}, [4, 4, 4, 2], [[4, 4, 4, 2]])
    g.nodes[-1].params.update(params)
    txt, _ = write_ir(g, str(tmp_path / "f.txt"))
    with pytest.raises(IRError, match=key):
        read_ir(txt)


BAD = [
    ("BatchToDepth", {"block_size": 3}, [4, 2, 2, 1], IRError, "multiple of block_size"),
    ("BatchToDepth", {"block_size": 2}, [4, 2, 2], IRError, "4-D"),
    ("BatchToSpaceND", {"block_size": [2, 2, 2], "crops": [[0, 0], [0, 0], [0, 0]]}, [4, 1, 1, 1, 1], IRError,
     "multiple"),
    ("BatchToSpaceND", {"block_size": [2, 2], "crops": [[0, 0], [0, 0], [0, 0]]}, [8, 1, 1, 1, 1], IRError,
     "b_z, b_y, b_x"),
    ("BatchToSpaceND", {"block_size": [1, 1, 1], "crops": [[0, 0], [0, 0]]}, [1, 1, 1, 1, 1], IRError, "crops"),
    ("BatchToSpaceND", {"block_size": [1, 1, 1], "crops": [[1, 0], [0, 0], [0, 0]]}, [1, 1, 2, 2, 1], IRError,
     "whole"),
    ("BatchToSpaceND", {"block_size": [1, 1, 1], "crops": [[0, 0], [0, 0], [0, 0]]}, [1, 2, 2, 1], IRError, "5-D"),
    ("DataStride", {"kernel_x": 5, "kernel_y": 2, "stride_x": 1, "stride_y": 1}, [1, 4, 4, 1], IRError, "larger"),
    ("DataStride", {"kernel_x": 2, "kernel_y": 2, "stride_x": 0, "stride_y": 1}, [1, 4, 4, 1], IRError, ">= 1"),
    ("DataStride", {"kernel_x": 2, "kernel_y": 2, "stride_y": 1}, [1, 4, 4, 1], IRError, "stride_x"),
]


@pytest.mark.parametrize("optype,params,in_shape,error,match", BAD, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD)])
def test_bad_params_raise_clear_errors(optype, params, in_shape, error, match) -> None:
    g = one(optype, params, in_shape, [list(in_shape)])
    with pytest.raises(error, match=match) as info:
        g.forward([torch.zeros(in_shape)])
    assert "'op'" in str(info.value)


def test_meshgrid_needs_vectors() -> None:
    b = GraphBuilder("t")
    x, y = b.input("x", [1, 3]), b.input("y", [4])
    outs = b.layer("Meshgrid", [x, y], [[4, 3], [4, 3]], name="op", params={"indexing": "xy"})
    with pytest.raises(IRError, match="1-D"):
        b.build(outs).forward([torch.zeros(1, 3), torch.zeros(4)])


def test_per_channel_input_is_refused() -> None:
    g = one("DataStride", {"kernel_x": 2, "kernel_y": 2, "stride_x": 2, "stride_y": 2}, [1, 4, 4, 2],
            [[1, 4, 4, 2]])
    set_quant(g.nodes[-1], g.input_tensors[0], scale=torch.tensor([1.0, 2.0]), zerop=torch.tensor([0, 0]), qmin=-128,
              qmax=127)
    with pytest.raises(UnsupportedError, match="per-channel"):
        quantopt.ops.space_batch.space_batch_quantize(g.nodes[-1])
