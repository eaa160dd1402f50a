"""Layout, shape and dtype ops (Transpose, Permute, Reshape, Squeeze, Split, Slice, StridedSlice, Shape,
ConstantOfShape, Cast): float forward against numpy, integer forward against simple python-int references written
from docs/semantics/indexing.md, float vs dequantized cosine, IR write → re-read bit identity, parameter errors."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.analysis.similarity import cosine
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

MODES = [
    (8, "per_tensor_symmetric_full_range"),
    (8, "per_tensor_asymmetric"),
    (16, "per_tensor_symmetric_full_range"),
]


def settings(bits: int, mode: str, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_bits_bias=48 if bits > 8 else 32, **extra)


def calib(shape: Sequence[int], seed: int, n: int = 3, std: float = 2.0) -> List[torch.Tensor]:
    r = np.random.default_rng(seed)
    return [torch.from_numpy(r.normal(0.3, std, size=shape).astype(np.float32)) for _ in range(n)]


def one_layer(optype: str, params: Dict[str, Any], in_shape: Sequence[int], out_shapes: Sequence[Sequence[int]],
              in_dtype: Dtype = Dtype.FP32):
    b = GraphBuilder("t")
    x = b.input("x", list(in_shape), dtype=in_dtype)
    y = b.layer(optype, [x], [list(s) for s in out_shapes], name="op", params=dict(params))
    return b.build(y if isinstance(y, list) else [y])


def roundtrip(tmp_path, qg, feeds) -> None:
    before = [t.clone() for t in qg.forward(feeds)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    assert all(n.quantized for n in re.nodes)
    after = re.forward(feeds)
    for a, b in zip(before, after):
        assert b.dtype == torch.int64 and torch.equal(a, b)


# --- references (numpy / python ints only) -------------------------------------------------------------------------
def ref_slice(a: np.ndarray, begin, end, strides, upper_bound: bool = False, begin_mask: int = 0, end_mask: int = 0,
              shrink: int = 0, ir_batch: int = 1) -> np.ndarray:
    """Docs: Python slicing per axis with the Parser's negative-end rule; axis 0 of an actual batch of G·B samples
    repeats the selection made on the IR batch B in every group."""
    out = a
    for i, (bg, en, st) in enumerate(zip(begin, end, strides)):
        n = ir_batch if i == 0 else a.shape[i]
        b_: Optional[int] = None if begin_mask >> i & 1 else bg
        e_: Optional[int] = None if end_mask >> i & 1 else en
        if e_ is not None and e_ < 0:
            e_ = e_ + (n if st > 0 else 0) + int(upper_bound)
            e_ = None if e_ < 0 else e_
        keep = list(range(n))[b_:e_:st]
        if i == 0:
            keep = [g * n + k for g in range(a.shape[0] // n) for k in keep]
        out = np.take(out, keep, axis=i)
    axes = tuple(i for i in range(len(begin)) if shrink >> i & 1)
    return out.squeeze(axis=axes) if axes else out


PASSTHROUGH_CASES = [
    ("Transpose", {"perm": [0, 2, 3, 1]}, [1, 3, 4, 5], [[1, 4, 5, 3]], lambda a: [a.transpose(0, 2, 3, 1)]),
    ("Permute", {"perm": [0, 3, 1, 2]}, [1, 3, 4, 5], [[1, 5, 3, 4]], lambda a: [a.transpose(0, 3, 1, 2)]),
    ("Permute", {}, [1, 3, 4, 5], [[5, 4, 3, 1]], lambda a: [a.transpose()]),
    ("Reshape", {"shape": [1, 12, 5]}, [1, 3, 4, 5], [[1, 12, 5]], lambda a: [a.reshape(a.shape[0], 12, 5)]),
    ("Squeeze", {"axis": [2]}, [1, 3, 1, 5], [[1, 3, 5]], lambda a: [a.squeeze(2)]),
    # squeezing the IR batch: at batch N the samples' [3, 5] results are concatenated along dim 0
    ("Squeeze", {}, [1, 3, 1, 5], [[3, 5]], lambda a: [a.reshape(a.shape[0] * 3, 5)]),
    ("Split", {"axis": 3, "splits": [2, 3]}, [1, 3, 4, 5], [[1, 3, 4, 2], [1, 3, 4, 3]],
     lambda a: np.split(a, [2], axis=3)),
    ("Split", {"axis": 1}, [1, 3, 4, 5], [[1, 1, 4, 5]] * 3, lambda a: np.split(a, 3, axis=1)),
    ("Slice", {"begin": [0, 1, 0, 4], "end": [1, 3, 4, -6], "strides": [1, 1, 2, -2]}, [1, 3, 4, 5],
     [[1, 2, 2, 3]], lambda a: [ref_slice(a, [0, 1, 0, 4], [1, 3, 4, -6], [1, 1, 2, -2])]),
    ("Slice", {"begin": [0, -2, 1], "end": [1, 3, -1], "strides": [1, 1, 1]}, [1, 3, 4, 5], [[1, 2, 2, 5]],
     lambda a: [ref_slice(a, [0, -2, 1], [1, 3, -1], [1, 1, 1])]),
    ("Slice", {"begin": [0, 0, 3], "end": [1, 3, -1], "strides": [1, 1, -1]}, [1, 3, 4, 5], [[1, 3, 4, 5]],
     lambda a: [ref_slice(a, [0, 0, 3], [1, 3, -1], [1, 1, -1])]),
    ("Slice", {"begin": [0, 0, 0], "end": [1, 3, -2], "strides": [1, 1, 1], "upper_bound": True}, [1, 3, 4, 5],
     [[1, 3, 3, 5]], lambda a: [ref_slice(a, [0, 0, 0], [1, 3, -2], [1, 1, 1], upper_bound=True)]),
    ("StridedSlice", {"begin": [0, 2, 1, 0], "end": [1, 0, 3, 5], "strides": [1, -1, 1, 2], "begin_mask": 2,
                      "end_mask": 2}, [1, 3, 4, 5], [[1, 3, 2, 3]],
     lambda a: [ref_slice(a, [0, 2, 1, 0], [1, 0, 3, 5], [1, -1, 1, 2], begin_mask=2, end_mask=2)]),
    ("StridedSlice", {"begin": [0, 1, 0, 0], "end": [1, 2, 4, 5], "strides": [1, 1, 1, 1], "shrink_axis_mask": 2},
     [1, 3, 4, 5], [[1, 4, 5]], lambda a: [ref_slice(a, [0, 1, 0, 0], [1, 2, 4, 5], [1, 1, 1, 1], shrink=2)]),
]


def _case_id(case) -> str:
    return case[0] + "-" + "-".join(f"{k}={v}" for k, v in case[1].items())


@pytest.mark.parametrize("case", PASSTHROUGH_CASES, ids=_case_id)
def test_passthrough_float_forward_matches_numpy(case) -> None:
    optype, params, shape, outs, ref = case
    g = one_layer(optype, params, shape, outs)
    x = calib([2, *shape[1:]], 1, 1)[0] if optype != "Permute" or "perm" in params else calib(shape, 1, 1)[0]
    got = g.forward([x])
    want = ref(x.numpy())
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b)


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("case", PASSTHROUGH_CASES, ids=_case_id)
def test_passthrough_integer_forward_and_params(case, bits: int, mode: str) -> None:
    optype, params, shape, outs, ref = case
    g = one_layer(optype, params, shape, outs)
    batch = 2 if optype != "Permute" or "perm" in params else 1
    data = calib([batch, *shape[1:]], 2)
    qg = quantize_model(g, data, settings(bits, mode, q_strategy_activation="extrema"))
    x = calib([batch, *shape[1:]], 3, 1, std=3.0)[0]
    got = qg.forward([x])
    node = qg.node("op")
    x_q = node.inputs[0].betensor.numpy()
    for out, a, b in zip(node.outputs, got, ref(x_q)):
        assert a.dtype == torch.int64
        np.testing.assert_array_equal(a.numpy(), b)
        src = node.inputs[0]
        oq, sq = params_of(node, out), params_of(node, src)
        assert (oq.scale, oq.zerop, oq.qmin, oq.qmax, out.dtype, oq.qbits) == \
            (sq.scale, sq.zerop, sq.qmin, sq.qmax, src.dtype, sq.qbits)
    ref_out = g.forward([data[0]])
    for a, b in zip(ref_out, run_quantized(qg, data[0])):
        assert cosine(a, b) > (0.99 if bits == 8 else 0.9999)


@pytest.mark.parametrize("case", [c for c in PASSTHROUGH_CASES if c[0] in ("Permute", "Squeeze", "Split", "Slice",
                                                                           "StridedSlice")], ids=_case_id)
def test_passthrough_ir_roundtrip(tmp_path, case) -> None:
    optype, params, shape, outs, _ = case
    g = one_layer(optype, params, shape, outs)
    batch = 2 if optype != "Permute" or "perm" in params else 1
    qg = quantize_model(g, calib([batch, *shape[1:]], 4), settings(8, "per_tensor_asymmetric"))
    roundtrip(tmp_path, qg, [calib([batch, *shape[1:]], 5, 1)[0]])


def test_slice_batch_larger_than_ir_batch_repeats_selection() -> None:
    """IR batch 2 sliced [1:2] on axis 0; an actual batch of 6 keeps samples 1, 3, 5."""
    g = one_layer("Slice", {"begin": [1, 0], "end": [2, 4], "strides": [1, 2]}, [2, 4], [[1, 2]])
    x = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    np.testing.assert_array_equal(g.forward([x])[0].numpy(), x.numpy()[1::2, 0:4:2])


# --- Shape, ConstantOfShape ---------------------------------------------------------------------------------------
def shape_chain(value: float):
    b = GraphBuilder("t")
    x = b.input("x", [1, 3, 4])
    s = b.layer("Shape", [x], [[3]], name="shape", output_dtypes=[Dtype.INT32])
    y = b.layer("ConstantOfShape", [s], [[1, 3, 4]], name="op", params={"value": value})
    return b.build([s, y])


@pytest.mark.parametrize("bits,mode", MODES)
@pytest.mark.parametrize("value", [0.0, 3.0, -2.0, 0.37, -1.25])
def test_shape_and_constant_of_shape(tmp_path, value: float, bits: int, mode: str) -> None:
    g = shape_chain(value)
    x = calib([2, 3, 4], 6, 1)[0]
    shp, const = g.forward([x])
    assert shp.tolist() == [2, 3, 4]
    np.testing.assert_array_equal(const.numpy(), np.full((2, 3, 4), value, dtype=np.float32))
    qg = quantize_model(g, calib([2, 3, 4], 7), settings(bits, mode))
    s_node, node = qg.node("shape"), qg.node("op")
    assert params_of(s_node, s_node.outputs[0]).qinvariant and s_node.outputs[0].dtype == Dtype.INT32
    out = node.outputs[0]
    oq = params_of(node, out)
    stored = node.params["value"]
    assert isinstance(stored, int)
    if value == round(value):
        assert oq.qinvariant and stored == int(value) and out.dtype.is_signed == (value < 0)
    else:  # docs: quantized from the range [min(v,0), max(v,0)]
        assert not oq.qinvariant
        assert stored == min(max(round(value * float(oq.scale) - float(oq.zerop)), oq.qmin), oq.qmax)
    q_shape, q_const = qg.forward([x])
    assert q_shape.tolist() == [2, 3, 4]
    assert torch.equal(q_const, torch.full((2, 3, 4), stored, dtype=torch.int64))
    deq = run_quantized(qg, x)[1]
    assert float((deq - value).abs().max()) <= 0.5 / float(oq.scale) + 1e-6
    roundtrip(tmp_path, qg, [x])


def test_constant_of_shape_needs_integer_shape() -> None:
    b = GraphBuilder("t")
    s = b.input("s", [3])
    y = b.layer("ConstantOfShape", [s], [[1, 3, 4]], name="op", params={"value": 1.0})
    g = b.build([y])
    with pytest.raises(UnsupportedError, match="exact integers"):
        quantize_model(g, [torch.tensor([1.0, 3.0, 4.0])], settings(8, "per_tensor_asymmetric"))


# --- Cast -----------------------------------------------------------------------------------------------------------
def ref_cast_float(a: np.ndarray, lo: int, hi: int, clip_mode: str) -> np.ndarray:
    v = np.trunc(a.astype(np.float64)).astype(np.int64)
    return np.clip(v, lo, hi) if clip_mode == "SATURATION" else (v - lo) % (hi - lo + 1) + lo


def ref_cast_int(node, q: np.ndarray) -> np.ndarray:
    """Docs: Cast integer computation, python ints."""
    inp, out = params_of(node, node.inputs[0]), params_of(node, node.outputs[0])
    zp_in, zp_out, qmin, qmax = int(inp.zerop), int(out.zerop), int(out.qmin), int(out.qmax)
    p = node.params
    clip = str(p.get("clip_mode", "SATURATION")).upper()

    def clip_fn(v: int) -> int:
        return min(max(v, qmin), qmax) if clip == "SATURATION" else (v - qmin) % (qmax - qmin + 1) + qmin

    res = np.empty(q.shape, dtype=np.int64)
    for idx in np.ndindex(q.shape):
        v = int(q[idx])
        if "scale_value" in p:
            prod = (v + zp_in) * int(p["scale_value"])
            n = int(p["shift_value"])
            if str(p.get("round_mode", "")).upper() == "TRUNC":
                mag = abs(prod) >> n if n >= 0 else abs(prod) << -n
                t = mag if prod >= 0 else -mag
            else:
                t = round(prod / 2 ** n) if n > 0 else prod << -n
            res[idx] = clip_fn(t - zp_out)
        else:
            res[idx] = clip_fn(v if p.get("ignore_scale_zp", True) else v + zp_in - zp_out)
    return res


@pytest.mark.parametrize("to_dtype,clip_mode", [("int8", "SATURATION"), ("int8", "TRUNCATION"),
                                                ("uint8", "SATURATION"), ("int16", "TRUNCATION"),
                                                ("int32", "SATURATION")])
@pytest.mark.parametrize("bits,mode", MODES)
def test_cast_float_to_int(tmp_path, to_dtype: str, clip_mode: str, bits: int, mode: str) -> None:
    g = one_layer("Cast", {"to_dtype": to_dtype, "clip_mode": clip_mode}, [1, 4, 8], [[1, 4, 8]])
    data = calib([2, 4, 8], 8, std=60.0)
    dt = Dtype(to_dtype)
    lo, hi = dt.int_range()
    x = calib([2, 4, 8], 9, 1, std=60.0)[0]
    np.testing.assert_array_equal(g.forward([x])[0].numpy(), ref_cast_float(x.numpy(), lo, hi, clip_mode))
    qg = quantize_model(g, data, settings(bits, mode))
    node = qg.node("op")
    assert params_of(node, node.outputs[0]).qinvariant and node.outputs[0].dtype == dt
    assert node.params["round_mode"] == "TRUNC" and node.params["ignore_scale_zp"] is False
    got = qg.forward([x])[0]
    np.testing.assert_array_equal(got.numpy(), ref_cast_int(node, node.inputs[0].betensor.numpy()))
    if clip_mode == "SATURATION":
        assert cosine(g.forward([x])[0], run_quantized(qg, x)[0]) > (0.99 if bits == 8 else 0.9999)
    roundtrip(tmp_path, qg, [x])


@pytest.mark.parametrize("to_dtype,clip_mode", [("int8", "TRUNCATION"), ("int8", "SATURATION"),
                                                ("uint16", "TRUNCATION"), ("int64", "SATURATION")])
def test_cast_int_to_int_is_exact(tmp_path, to_dtype: str, clip_mode: str) -> None:
    g = one_layer("Cast", {"to_dtype": to_dtype, "clip_mode": clip_mode}, [1, 16], [[1, 16]], in_dtype=Dtype.INT32)
    r = np.random.default_rng(10)
    feeds = [torch.from_numpy(r.integers(-70000, 70000, size=(3, 16)))]
    qg = quantize_model(g, [feeds[0]], settings(8, "per_tensor_asymmetric"))
    want = g.forward(feeds)[0]
    got = qg.forward(feeds)[0]
    assert torch.equal(got, want)
    bits = min(Dtype(to_dtype).bits, 32)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if Dtype(to_dtype).is_signed else (0, 2 ** bits - 1)
    np.testing.assert_array_equal(want.numpy(), ref_cast_float(feeds[0].numpy(), lo, hi, clip_mode))
    node = qg.node("op")
    np.testing.assert_array_equal(got.numpy(), ref_cast_int(node, feeds[0].numpy()))
    assert params_of(node, node.outputs[0]).qinvariant and node.params["to_dtype"] == node.outputs[0].dtype
    roundtrip(tmp_path, qg, feeds)


@pytest.mark.parametrize("in_dtype,to_dtype,kept", [(Dtype.UINT8, "int32", True), (Dtype.INT8, "int16", True),
                                                   (Dtype.INT16, "int8", False), (Dtype.INT8, "uint16", False)])
def test_cast_of_integers_that_fit_keeps_the_input_type(tmp_path, in_dtype: Dtype, to_dtype: str, kept: bool) -> None:
    """An integer Cast whose target holds every integer of the input's type keeps the input's type, as upstream
    writes it (a 0/1 mask cast to int32 stays uint8, so the integer layers after it stay narrow); a narrowing Cast
    keeps its own type and clip."""
    g = one_layer("Cast", {"to_dtype": to_dtype, "clip_mode": "SATURATION"}, [1, 16], [[1, 16]], in_dtype=in_dtype)
    lo, hi = in_dtype.int_range()
    feeds = [torch.from_numpy(np.random.default_rng(11).integers(lo, hi + 1, size=(3, 16)))]
    qg = quantize_model(g, [feeds[0]], settings(8, "per_tensor_asymmetric"))
    node = qg.node("op")
    out_dtype = node.outputs[0].dtype
    assert out_dtype == (in_dtype if kept else Dtype(to_dtype)) and node.params["to_dtype"] == out_dtype
    assert params_of(node, node.outputs[0]).qinvariant
    assert torch.equal(qg.forward(feeds)[0], g.forward(feeds)[0])
    roundtrip(tmp_path, qg, feeds)


def test_cast_to_float_is_passthrough(tmp_path) -> None:
    g = one_layer("Cast", {"to_dtype": "float16"}, [1, 8], [[1, 8]])
    x = calib([2, 8], 11, 1)[0]
    assert torch.equal(g.forward([x])[0], x)
    qg = quantize_model(g, calib([2, 8], 12), settings(8, "per_tensor_asymmetric"))
    node = qg.node("op")
    oq, iq = params_of(node, node.outputs[0]), params_of(node, node.inputs[0])
    assert (oq.scale, oq.zerop) == (iq.scale, iq.zerop)
    assert torch.equal(qg.forward([x])[0], node.inputs[0].betensor)
    roundtrip(tmp_path, qg, [x])


@pytest.mark.parametrize("to_dtype", ["int16", "uint8", "int8"])
def test_cast_only_for_quantized_requantizes(tmp_path, to_dtype: str) -> None:
    """Bit-width change between quantized tensors: new params from the calibrated range and a multiplier/shift."""
    g = one_layer("Cast", {"to_dtype": to_dtype, "only_for_quantized": True}, [1, 4, 8], [[1, 4, 8]])
    data = calib([2, 4, 8], 13)
    x = calib([2, 4, 8], 14, 1)[0]
    assert torch.equal(g.forward([x])[0], x)
    qg = quantize_model(g, data, settings(8, "per_tensor_symmetric_full_range"))
    node = qg.node("op")
    out = node.outputs[0]
    assert "only_for_quantized" not in node.params and out.dtype == Dtype(to_dtype)
    got = qg.forward([x])[0]
    if "scale_value" in node.params:
        assert node.params["ignore_scale_zp"] is False
    np.testing.assert_array_equal(got.numpy(), ref_cast_int(node, node.inputs[0].betensor.numpy()))
    assert cosine(x, run_quantized(qg, x)[0]) > 0.99
    roundtrip(tmp_path, qg, [x])


# --- errors ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optype,params,match", [
    ("Slice", {"begin": [0, 0], "end": [1, 4], "strides": [1, 0]}, "must not contain 0"),
    ("Slice", {"begin": [0, 0], "end": [1], "strides": [1, 1]}, "one entry per sliced axis"),
    ("Slice", {"begin": [0, "a"], "end": [1, 2]}, "list of integers"),
    ("Split", {"axis": 1, "splits": [1, 2]}, "sum to 3"),
    ("Split", {"axis": 5, "splits": [2, 2]}, "out of range"),
    ("Permute", {"perm": [0, 0]}, "not a permutation"),
    ("Cast", {"to_dtype": "int9"}, "not a supported dtype"),
    ("Cast", {"to_dtype": "int8", "clip_mode": "WRAP"}, "SATURATION or TRUNCATION"),
])
def test_bad_params_are_ir_errors(optype: str, params: Dict[str, Any], match: str) -> None:
    outs = [[1, 2], [1, 2]] if optype == "Split" else [[1, 4]]
    g = one_layer(optype, params, [1, 4], outs)
    with pytest.raises(IRError, match=match):
        g.forward([torch.zeros(1, 4)])


def test_strided_slice_ellipsis_is_unsupported() -> None:
    g = one_layer("StridedSlice", {"begin": [0], "end": [1], "strides": [1], "ellipsis_mask": 1}, [1, 4], [[1, 4]])
    with pytest.raises(UnsupportedError, match="ellipsis_mask"):
        g.forward([torch.zeros(1, 4)])


def test_cast_only_for_quantized_to_float_is_an_error() -> None:
    g = one_layer("Cast", {"to_dtype": "float16", "only_for_quantized": True}, [1, 4], [[1, 4]])
    with pytest.raises(IRError, match="integer to_dtype"):
        quantize_model(g, calib([2, 4], 15), settings(8, "per_tensor_asymmetric"))
