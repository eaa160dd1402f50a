"""If and Loop (quantopt/ops/control_flow.py) with their subgraphs: IR subgraph sections read and written
(docs/ir-format.md, "Subgraph sections"), the float forward against plain numpy, the quantized model (If/Loop and
their subgraphs in float16 behind Dummy layers, passes/control_op_preprocess.py) against numpy float16, and bad
subgraph IRs (docs/semantics/control-flow.md)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from control_flow_graphs import loop_body
from quant_helpers import params_of

from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.graph.subgraphs import set_subgraphs
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model
from quantopt.quant.dtype import Dtype

C_THEN = np.array([[2.0, 0.5, -1.0, 3.0]], dtype=np.float32)
C_ELSE = np.array([[1.0, -1.0, 0.5, 0.25]], dtype=np.float32)
K = np.array([[1.5, 0.5, -1.0, 1.0]], dtype=np.float32)


def _branch(name: str, method: str, c: np.ndarray) -> PyGraph:
    b = GraphBuilder(name)
    k = b.layer("Constant", [], [[1, 4]], name="c", outputs=["c_0"], constants={"weights": c})
    x = b.input("x_0", [1, 4], layer_name="x")
    y = b.layer("Eltwise", [x, k], [[1, 4]], name="y", outputs=["y_0"],
                params={"with_activation": "NONE", "method": method})
    return b.build([y], graph_cls=PyGraph)


def if_graph() -> PyGraph:
    """cond (uint8 scalar), x -> If(then: x*C_THEN, else: x+C_ELSE) -> Sigmoid; the branches read x_0 as their
    own input, as the Parser writes them."""
    b = GraphBuilder("ifg")
    cond = b.input("cond_0", [1], Dtype.UINT8, layer_name="cond")
    x = b.input("x_0", [1, 4], layer_name="xin")
    y0 = b.layer("If", [cond, x, x], [[1, 4]], name="y0", outputs=["y0_0"],
                 params={"then_branch_inputs_num": 1, "else_branch_inputs_num": 1})
    y = b.layer("Activation", [y0], [[1, 4]], name="y", outputs=["y_0"], params={"method": "SIGMOID"})
    g = b.build([y])
    set_subgraphs(g.node("y0"), {"then_branch": _branch("then_g", "MUL", C_THEN),
                                 "else_branch": _branch("else_g", "ADD", C_ELSE)})
    return g


def loop_graph() -> PyGraph:
    """M (int32 scalar), cond (uint8 scalar), v -> Loop(body: v*K + i, scan of the new v) -> (final v, scans)."""
    b = GraphBuilder("loopg")
    m = b.input("M_0", [], Dtype.INT32, layer_name="M")
    cond = b.input("cond_0", [], Dtype.UINT8, layer_name="cond")
    v = b.input("v_0", [1, 4], layer_name="v0")
    outs = b.layer("Loop", [m, cond, v], [[1, 4], [100, 4]], name="vf", outputs=["vf_0", "vf_1"],
                   params={"dependency_inputs_num": 1, "scan_outputs_num": 1, "loop_default_count": 100})
    g = b.build(outs)
    set_subgraphs(g.node("vf"), {"body": loop_body(K)})
    return g


# ------------------------------------------------------------------------------------------------ IR round trip
def test_subgraph_sections_round_trip(tmp_path: Path) -> None:
    for make in (if_graph, loop_graph):
        g = make()
        txt, binf = write_ir(g, str(tmp_path / "a.txt"))
        text = Path(txt).read_text()
        for sub in g.nodes[-1 if make is loop_graph else 2].attrs["subgraphs"].values():
            assert f"\n\n\nsubgraph_name={sub.name}\nlayer_number={len(sub.nodes)}\ninput_tensors=" in text
        r = read_ir(txt)
        owner = next(n for n in r.nodes if str(n.type) in ("If", "Loop"))
        subs = owner.attrs["subgraphs"]
        assert list(subs) == (["then_branch", "else_branch"] if make is if_graph else ["body"])
        assert all(isinstance(s, PyGraph) for s in subs.values())
        # the subgraph's own names: a branch reads x_0 although the root has a tensor x_0 too
        write_ir(r, str(tmp_path / "b.txt"))
        assert (tmp_path / "b.txt").read_text() == text.replace("./a.bin", "./b.bin")
        assert (tmp_path / "b.bin").read_bytes() == Path(binf).read_bytes()
    assert re.search(r"then_branch=then_g\nelse_branch=else_g", if_graph_text(tmp_path))


def if_graph_text(tmp_path: Path) -> str:
    txt, _ = write_ir(if_graph(), str(tmp_path / "if.txt"))
    return Path(txt).read_text()


def test_subgraph_constants_share_the_bin(tmp_path: Path) -> None:
    txt, binf = write_ir(if_graph(), str(tmp_path / "if.txt"))
    data = Path(binf).read_bytes()
    assert len(data) == 32  # the two branches' [1,4] float32 constants, one after the other
    got = sorted([np.frombuffer(data[:16], "<f4").tolist(), np.frombuffer(data[16:], "<f4").tolist()])
    assert got == sorted([C_THEN.ravel().tolist(), C_ELSE.ravel().tolist()])
    r = read_ir(txt)
    subs = r.node("y0").attrs["subgraphs"]
    np.testing.assert_array_equal(subs["then_branch"].node("c").constants["weights"].betensor.numpy(), C_THEN)


# ------------------------------------------------------------------------------------------------ float forward
def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


@pytest.mark.parametrize("cond", [0, 1, 7])
def test_if_float_forward(cond: int) -> None:
    rng = np.random.default_rng(cond)
    x = rng.normal(size=(1, 4)).astype(np.float32)
    g = if_graph()
    (y,) = g.forward([torch.tensor([cond], dtype=torch.uint8), torch.from_numpy(x)])
    ref = _sigmoid(x * C_THEN if cond else x + C_ELSE)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-6, atol=1e-7)


def _np_loop(m: int, cond: int, v: np.ndarray) -> tuple:
    scans = []
    i = 0
    while i < m and cond:
        v = v * K + np.float32(i)
        scans.append(v)
        i += 1
    return v, (np.concatenate(scans, axis=0) if scans else np.zeros((0, 4), np.float32))


@pytest.mark.parametrize("m,cond", [(3, 1), (1, 1), (5, 1), (4, 0), (0, 1)])
def test_loop_float_forward(m: int, cond: int) -> None:
    v = np.random.default_rng(m).normal(size=(1, 4)).astype(np.float32)
    g = loop_graph()
    final, scans = g.forward([torch.tensor(m, dtype=torch.int32), torch.tensor(cond, dtype=torch.uint8),
                              torch.from_numpy(v)])
    ref_final, ref_scans = _np_loop(m, cond, v)
    np.testing.assert_allclose(final.numpy(), ref_final, rtol=1e-6)
    assert tuple(scans.shape) == ref_scans.shape
    np.testing.assert_allclose(scans.numpy(), ref_scans, rtol=1e-6)


def test_loop_scalar_scan_output_is_stacked() -> None:
    """A scalar scan value is taken as shape [1] and stacked with vstack, as upstream: the scan output is
    [iterations, 1]."""
    b = GraphBuilder("body_s")
    cond_in = b.input("c_in", [], Dtype.UINT8)
    it = b.input("it", [], Dtype.INT32)
    s = b.input("s", [])
    it_f = b.layer("Cast", [it], [[]], name="itf", params={"to_dtype": Dtype.FP32, "clip_mode": "TRUNCATION",
                                                           "ignore_scale_zp": True})
    s2 = b.layer("Add", [s, it_f], [[]], name="s2", params={"with_activation": "NONE"})
    c = b.layer("Dummy", [cond_in], [[]], name="c_out", output_dtypes=[Dtype.UINT8])
    b._inputs = [it, cond_in, s]
    body = b.build([c, s2, s2], graph_cls=PyGraph)
    r = GraphBuilder("root")
    m = r.input("m", [], Dtype.INT32)
    cc = r.input("c", [], Dtype.UINT8)
    s0 = r.input("s0", [])
    outs = r.layer("Loop", [m, cc, s0], [[], [100]], name="lp", outputs=["fin", "scan"],
                   params={"dependency_inputs_num": 1, "scan_outputs_num": 1})
    g = r.build(outs)
    set_subgraphs(g.node("lp"), {"body": body})
    fin, scan = g.forward([torch.tensor(4, dtype=torch.int32), torch.tensor(1, dtype=torch.uint8),
                           torch.tensor(0.5)])
    assert scan.tolist() == [[0.5], [1.5], [3.5], [6.5]] and float(fin) == 6.5


# ------------------------------------------------------------------------------------------------ quantized
def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def _quantize(g: PyGraph, feeds: list) -> PyGraph:
    """Extrema ranges: a calibrated sample is not clipped anywhere."""
    return quantize_model(g, feeds, settings={"q_strategy_activation": "extrema"})


def test_if_quantized_runs_in_float16_behind_a_dummy(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(1, 4)).astype(np.float32) for _ in range(6)]
    feeds = [[torch.tensor([i % 2], dtype=torch.uint8), torch.from_numpy(x)] for i, x in enumerate(xs)]
    g = if_graph()
    q = _quantize(g, feeds)
    types = [(n.name, str(n.type)) for n in q.nodes]
    node = q.node("y0")
    assert node.params["unquantifiable"] is True and node.outputs[0].dtype is Dtype.FP16
    dummy = next(n for n in q.nodes if str(n.type) == "Dummy")
    assert dummy.inputs[0] is node.outputs[0] and dummy.outputs[0].dtype is Dtype.FP16, types
    quant = next(n for n in q.nodes if str(n.type) == "Quantize")
    assert quant.inputs[0] is dummy.outputs[0] and q.node("y").inputs[0] is quant.outputs[0]
    for sub in node.attrs["float_subgraphs"].values():
        for n in sub.nodes:
            assert n.params["unquantifiable"] is True and all(t.dtype is Dtype.FP16 for t in n.outputs)
    # the float graph keeps float32 subgraphs
    assert all(t.dtype is Dtype.FP32 for s in g.node("y0").attrs["subgraphs"].values() for n in s.nodes
               for t in n.outputs)
    for cond, x in ((0, xs[0]), (1, xs[1])):  # calibrated pairs: no clipping at the Quantize
        q.forward([torch.tensor([cond], dtype=torch.uint8), torch.from_numpy(x)], keep_tensors=True)
        x_in = node.inputs[1 if cond else 2].betensor.numpy()
        assert np.array_equal(x_in, _f16(x_in).astype(np.float32))  # the DeQuantize's float16 values
        ref = _f16(x_in) * _f16(C_THEN) if cond else _f16(x_in) + _f16(C_ELSE)
        np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref.astype(np.float32))
        s, zp = float(quant.params["quantize_scale"]), int(quant.params["quantize_zp"])
        qp = params_of(quant, quant.outputs[0])
        q_ref = np.clip(np.round(ref.astype(np.float32) * np.float32(s) - zp), qp.qmin, qp.qmax)
        np.testing.assert_array_equal(quant.outputs[0].betensor.numpy(), q_ref)
        (y,) = g.forward([torch.tensor([cond], dtype=torch.uint8), torch.from_numpy(x)])
        yp = params_of(q.nodes[-1], q.output_tensors[0])
        yq = (q.output_tensors[0].betensor.double() + yp.zerop) / yp.scale
        assert float((yq - y.double()).abs().max()) < 0.02
    # written and read back, the quantized IR runs the same
    txt, _ = write_ir(q, str(tmp_path / "q.txt"))
    text = Path(txt).read_text()
    assert "layer_type=Dummy" in text and text.count("subgraph_name=") == 2
    sub_text = text[text.index("subgraph_name="):]
    assert "float32" not in sub_text and "precision" not in sub_text and "unquantifiable=true" in sub_text
    r = read_ir(txt)
    feed = [torch.tensor([1], dtype=torch.uint8), torch.from_numpy(xs[2])]
    np.testing.assert_array_equal(r.forward(feed)[0].numpy(), q.forward(feed)[0].numpy())


def test_loop_quantized_body_in_float16() -> None:
    rng = np.random.default_rng(1)
    vs = [rng.normal(size=(1, 4)).astype(np.float32) for _ in range(4)]
    feeds = [[torch.tensor(3, dtype=torch.int32), torch.tensor(1, dtype=torch.uint8), torch.from_numpy(v)]
             for v in vs]
    g = loop_graph()
    q = _quantize(g, feeds)
    node = q.node("vf")
    assert node.params["unquantifiable"] is True and [t.dtype for t in node.outputs] == [Dtype.FP16, Dtype.FP16]
    q.forward(feeds[0], keep_tensors=True)
    v = _f16(node.inputs[2].betensor.numpy())
    scans = []
    for i in range(3):
        v = _f16(v * _f16(K)) + np.float16(i)
        scans.append(v)
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), v.astype(np.float32))
    np.testing.assert_array_equal(node.outputs[1].betensor.numpy(), np.concatenate(scans).astype(np.float32))


def test_integer_if_is_refused() -> None:
    g = if_graph()
    with pytest.raises(IRError, match="runs in float"):
        g.node("y0").quantize()


# ------------------------------------------------------------------------------------------------ bad IRs
def _bad(tmp_path: Path, edit) -> IRError:
    txt, _ = write_ir(if_graph(), str(tmp_path / "if.txt"))
    text = Path(txt).read_text()
    Path(txt).write_text(edit(text))
    with pytest.raises(IRError) as e:
        read_ir(txt)
    return e.value


def _line_of(text: str, needle: str) -> int:
    """Line of the first occurrence of `needle` (the last one with a `LAST:` prefix)."""
    if needle.startswith("LAST:"):
        return text[:text.rindex(needle[5:])].count("\n") + 1
    return text[:text.index(needle)].count("\n") + 1


@pytest.mark.parametrize("edit,message,needle", [
    (lambda t: t.replace("subgraph_name=else_g\nlayer_number=3\n", "subgraph_name=else_g\n"),
     "missing required key 'layer_number'", "subgraph_name=else_g"),
    (lambda t: t.replace("subgraph_name=then_g\nlayer_number=3", "subgraph_name=then_g\nlayer_number=9"),
     "layer_number=9 but 3 section", "layer_number=9"),
    (lambda t: t.replace("subgraph_name=else_g\nlayer_number=3", "subgraph_name=else_g\nlayer_number=4"),
     "another subgraph starts", "subgraph_name=then_g"),
    (lambda t: t.replace("subgraph_name=then_g\nlayer_number=3", "subgraph_name=then_g\nlayer_number=0"),
     "layer_number=0", "layer_number=0"),
    (lambda t: t.replace("then_branch=then_g", "then_branch=nothing"), "names no subgraph",
     "layer_id=2\nlayer_name=y0"),
    (lambda t: t.replace("else_branch=else_g", "else_branch=then_g"), "used by no layer", "subgraph_name=else_g"),
    (lambda t: t.replace("subgraph_name=else_g", "subgraph_name=then_g"), "two subgraphs are named",
     "LAST:subgraph_name=then_g"),
    (lambda t: t.replace("subgraph_name=then_g\nlayer_number=3\ninput_tensors=[x_0]\noutput_tensors=[y_0]\n",
                         "subgraph_name=then_g\nlayer_number=3\ninput_tensors=[x_0]\n"),
     "missing required key 'output_tensors'", "subgraph_name=then_g"),
    (lambda t: t.replace("subgraph_name=then_g\nlayer_number=3\ninput_tensors=[x_0]\noutput_tensors=[y_0]",
                         "subgraph_name=then_g\nlayer_number=3\ninput_tensors=[x_0]\noutput_tensors=[zz_0]"),
     "output_tensors names tensor 'zz_0'", "output_tensors=[zz_0]"),
])
def test_bad_subgraph_sections(tmp_path: Path, edit, message: str, needle: str) -> None:
    txt, _ = write_ir(if_graph(), str(tmp_path / "if.txt"))
    edited = edit(Path(txt).read_text())
    err = _bad(tmp_path, edit)
    assert message in str(err), str(err)
    assert err.line == _line_of(edited, needle), str(err)


def test_subgraph_containing_itself(tmp_path: Path) -> None:
    """A layer inside a branch naming that branch again would recurse for ever: an IR error."""
    g = if_graph()
    then = g.node("y0").attrs["subgraphs"]["then_branch"]
    inner = then.node("y")
    inner.params.update({"then_branch": "then_g", "else_branch": "else_g"})
    txt, _ = write_ir(g, str(tmp_path / "rec.txt"))
    with pytest.raises(IRError, match="contains itself|unknown key"):
        read_ir(txt)


def test_missing_subgraph_attachment_is_an_error() -> None:
    g = if_graph()
    del g.node("y0").attrs["subgraphs"]
    with pytest.raises(IRError, match="has no subgraph 'then_branch'"):
        g.forward([torch.tensor([1], dtype=torch.uint8), torch.zeros(1, 4)])


def test_if_input_count_mismatch() -> None:
    g = if_graph()
    g.node("y0").params["then_branch_inputs_num"] = 2
    with pytest.raises(IRError, match="make 4"):
        g.forward([torch.tensor([1], dtype=torch.uint8), torch.zeros(1, 4)])
