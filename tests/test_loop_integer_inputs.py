"""Integer inputs of If/Loop layers in a quantized model (passes/float_islands.py, docs/semantics/control-flow.md):
the trip count and the condition reach the float16 layer as the model's integers, without a DeQuantize; an integer
Constant read only by If/Loop layers keeps its IR dtype (int32), one also read by an integer layer keeps the
narrowest type; the outputs are those of an independent float16 computation, also after writing and re-reading."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from control_flow_graphs import loop_body
from quant_helpers import params_of, set_quant

from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.graph.subgraphs import set_subgraphs
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.passes.float_islands import check_integer_inputs
from quantopt.pipeline import quantize_model
from quantopt.quant.dtype import Dtype

K = np.array([[0.5, -0.25, 1.0, 0.125]], dtype=np.float32)


def loop_graph(m: int, m_as_input: bool = False, m_also_read: bool = False) -> PyGraph:
    """M (an int32 Constant, or an int32 graph input), cond = (max(x) > -99.5) computed by integer layers, v = x;
    Loop(body) -> (final v, scans). `m_also_read`: an integer Mul also reads the Constant M."""
    b = GraphBuilder("loopg")
    x = b.input("x_0", [1, 4], layer_name="x")
    if m_as_input:
        mt = b.input("M_0", [], Dtype.INT32, layer_name="M")
    else:
        mt = b.layer("Constant", [], [[]], name="M", outputs=["M_0"], constants={"weights": np.array(m)},
                     constant_dtypes={"weights": Dtype.INT32}, output_dtypes=[Dtype.INT32])
    mx = b.layer("Reduce", [x], [[1, 1]], name="mx", outputs=["mx_0"], params={"axis": [0, 1], "method": "MAX"})
    lo = b.layer("Constant", [], [[1, 1]], name="lo", outputs=["lo_0"],
                 constants={"weights": np.array([[-99.5]], dtype=np.float32)})
    cond = b.layer("Logical", [mx, lo], [[1, 1]], name="cond", outputs=["cond_0"], params={"method": "GREATER"},
                   output_dtypes=[Dtype.UINT8])
    cond_s = b.layer("Reshape", [cond], [[]], name="cond_s", outputs=["cond_s_0"], params={"shape": []},
                     output_dtypes=[Dtype.UINT8])
    outs = b.layer("Loop", [mt, cond_s, x], [[1, 4], [m, 4]], name="vf", outputs=["vf_0", "vf_1"],
                   params={"dependency_inputs_num": 1, "scan_outputs_num": 1, "loop_default_count": m})
    final = list(outs)
    if m_also_read:
        final.append(b.layer("Eltwise", [x, mt], [[1, 4]], name="xm", outputs=["xm_0"],
                             params={"with_activation": "NONE", "method": "MUL"}))
    g = b.build(final)
    set_subgraphs(g.node("vf"), {"body": loop_body(K)})
    return g


def _feeds(m_as_input: bool, m: int, count: int = 4) -> list:
    rng = np.random.default_rng(7)
    xs = [rng.uniform(-1.0, 1.0, size=(1, 4)).astype(np.float32) for _ in range(count)]
    return [[torch.from_numpy(x)] + ([torch.tensor(m, dtype=torch.int32)] if m_as_input else []) for x in xs]


def _quantize(g: PyGraph, feeds: list) -> PyGraph:
    return quantize_model(g, feeds, settings={"q_strategy_activation": "extrema"})


def _reference(v0: np.ndarray, m: int) -> np.ndarray:
    """The body's float16 arithmetic, independently: v = f16(f16(v · K) + i), i = 0 .. m-1; the scans."""
    v = v0.astype(np.float16)
    rows = []
    for i in range(m):
        v = (v * K.astype(np.float16)).astype(np.float16) + np.float16(i)
        rows.append(v)
    return np.concatenate(rows).astype(np.float32)


def _dequantize_layers(q: PyGraph) -> list:
    return [n.name for n in q.nodes if str(n.type) == "DeQuantize"]


@pytest.mark.parametrize("m_as_input", [False, True])
def test_integer_inputs_reach_the_loop_unchanged(tmp_path: Path, m_as_input: bool) -> None:
    g = loop_graph(3, m_as_input=m_as_input)
    feeds = _feeds(m_as_input, 3)
    q = _quantize(g, feeds)
    loop = q.node("vf")
    m_t, cond_t, v_t = loop.inputs
    assert _dequantize_layers(q) == ["x_0_dequantize"]  # only the float activation v gets one
    assert m_t.pnode.name == "M" and cond_t.pnode.name == "cond_s"
    m_q, cond_q = params_of(loop, m_t), params_of(loop, cond_t)
    assert (m_t.dtype, m_q.scale, m_q.zerop, m_q.qinvariant) == (Dtype.INT32, 1.0, 0, True)
    assert (cond_t.dtype, cond_q.scale, cond_q.zerop, cond_q.qinvariant) == (Dtype.UINT8, 1.0, 0, True)
    if not m_as_input:
        w = q.node("M").constants["weights"]
        assert w.dtype is Dtype.INT32 and int(w.betensor) == 3 and not w.betensor.is_floating_point()
        assert (q.node("M").params["weights_scale"], q.node("M").params["weights_zp"]) == (1.0, 0)
    for feed in feeds[:2]:
        q.forward(feed, keep_tensors=True)
        assert not m_t.betensor.is_floating_point() and int(m_t.betensor) == 3  # the integer itself
        assert int(cond_t.betensor) == 1
        want = _reference(v_t.betensor.numpy(), 3)
        np.testing.assert_array_equal(loop.outputs[1].betensor.numpy(), want)
        np.testing.assert_array_equal(loop.outputs[0].betensor.numpy(), want[-1:])
    txt = write_ir(q, str(tmp_path / "q.txt"))[0]
    text = Path(txt).read_text()
    assert "layer_bottom_type=[int32,uint8,float16]" in text
    r = read_ir(txt)
    for feed in feeds[:2]:
        for a, b in zip(r.forward(feed), q.forward(feed)):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_trip_count_beyond_float16_integers_is_exact() -> None:
    """2051 is not a float16 value (it would round to 2052): the loop runs 2051 times, as the float model."""
    m = 2051
    g = loop_graph(m, m_as_input=True)
    feeds = _feeds(True, m, count=2)
    q = _quantize(g, feeds)
    (_, scans_float) = g.forward(feeds[0])
    q.forward(feeds[0], keep_tensors=True)
    scans = q.node("vf").outputs[1].betensor
    assert scans.shape[0] == scans_float.shape[0] == m


def test_constant_also_read_by_an_integer_layer_keeps_the_narrow_type() -> None:
    g = loop_graph(3, m_also_read=True)
    q = _quantize(g, _feeds(False, 3))
    m_t = q.node("vf").inputs[0]
    invariant = params_of(q.node("vf"), m_t).qinvariant
    assert m_t.pnode.name == "M" and m_t.dtype is Dtype.UINT8 and invariant  # as before: narrowest type
    assert "M_0_dequantize" not in _dequantize_layers(q)  # the Loop still reads the integers as they are
    q.forward(_feeds(False, 3)[0], keep_tensors=True)
    assert q.node("vf").outputs[1].betensor.shape[0] == 3


def test_a_quantized_integer_input_is_refused() -> None:
    """Guard: an integer input that is not an exact integer (scale 1, zero point 0) would be misread."""
    q = _quantize(loop_graph(3), _feeds(False, 3))
    loop = q.node("vf")
    check_integer_inputs(loop)  # as quantized: fine
    loop.inputs[0].pnode.quantized = True
    set_quant(loop, loop.inputs[0], scale=0.5)
    with pytest.raises(IRError, match="reads its integer inputs as they are"):
        check_integer_inputs(loop)
