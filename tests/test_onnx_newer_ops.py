"""ONNX operators newer exporters write (torch's dynamo exporter keeps Einsum and writes GatherND for indexing, opset
18+ has GroupNormalization, 23 RMSNormalization, 24 Swish): Einsum, LpNormalization, Mean, Trilu and the composite
Reduce* (and Col2Im of blocks that tile the image) rewritten as other operators (frontends/onnx/decompose.py), and
GatherND, TopK, GroupNormalization, MeanVarianceNormalization, RMSNormalization, Swish and GridSample converted to
one layer each (converters_more.py). Each tiny model is imported, its float forward compared with onnx's reference
evaluator (the operator's specification), then quantized and run in integers."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the optional dependency 'onnx' is not installed (pip install onnx)")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import quantopt.ops  # noqa: E402,F401
from quantopt.errors import QuantOptError, UnsupportedError  # noqa: E402
from quantopt.frontends.onnx import import_onnx, supported_onnx_ops  # noqa: E402
from quantopt.graph.tables import quant_of  # noqa: E402
from quantopt.graph.values import to_float  # noqa: E402
from quantopt.pipeline import quantize_model  # noqa: E402

F = TensorProto.FLOAT
Inputs = Sequence[Tuple[str, Sequence[int]]]


def _model(nodes: List, inputs: Inputs, outputs: Sequence[Tuple[str, int]], inits: Sequence = (),
            opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, list(s)) for n, s in inputs],
                              [helper.make_tensor_value_info(n, t, None) for n, t in outputs], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _feeds(inputs: Inputs, seed: int, count: int = 3) -> List[Dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{n: rng.standard_normal(tuple(s)).astype(np.float32) for n, s in inputs} for _ in range(count)]


def _imported(model: onnx.ModelProto, tmp_path, name: str = "m"):
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return import_onnx(str(path))


def _check(model: onnx.ModelProto, inputs: Inputs, tmp_path, seed: int = 0, atol: float = 1e-5,
           quantized: bool = True, feeds: Optional[List[Dict[str, np.ndarray]]] = None, reference: Any = None):
    """The imported float forward against `reference` (default: onnx's reference evaluator) on seeded inputs, then
    the quantized forward runs and its float outputs stay close to the float ones (cosine); returns the float
    graph."""
    graph = _imported(model, tmp_path)
    feeds = feeds or _feeds(inputs, seed)
    reference = reference or ReferenceEvaluator(model)
    batches = [[torch.from_numpy(f[n]) for n, _ in inputs] for f in feeds]
    for f, b in zip(feeds, batches):
        want = reference.run(None, f)
        with torch.no_grad():
            got = [t.clone() for t in graph.forward(b)]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert tuple(g.shape) == np.shape(w)
            np.testing.assert_allclose(g.double().numpy(), np.asarray(w, np.float64), rtol=1e-5, atol=atol)
    if quantized:
        qgraph = quantize_model(graph, batches)
        with torch.no_grad():
            want = [t.clone() for t in graph.forward(batches[0])]
            qgraph.forward(batches[0])
        for t, w in zip(qgraph.output_tensors, want):
            if not w.is_floating_point():
                assert torch.equal(t.betensor.to(w.dtype), w)
                continue
            y = to_float(t, quant_of(t.pnode)).double().reshape(-1)
            cos = torch.nn.functional.cosine_similarity(y, w.double().reshape(-1), dim=0)
            assert float(cos) > 0.98, (t.name, float(cos))
    return graph


def _types(graph) -> List[str]:
    return [str(n.type) for n in graph.nodes]


# ------------------------------------------------------------------------------------------------ Einsum
EINSUM_CASES = [
    ("bhqd,bhkd->bhqk", [[1, 4, 16, 8], [1, 4, 16, 8]]),  # attention scores: MatMul with trans_b
    ("bhqk,bhkd->bhqd", [[1, 4, 16, 16], [1, 4, 16, 8]]),
    ("ij->ji", [[5, 7]]),
    ("ijk->ki", [[3, 4, 5]]),  # a sum over j, then a transpose
    ("i,i->", [[6], [6]]),  # a dot product: a scalar
    ("i,j->ij", [[4], [5]]),  # an outer product
    ("...ij,...jk->...ik", [[2, 3, 4, 5], [2, 3, 5, 6]]),
    ("...ij,jk->...ik", [[2, 3, 4, 5], [5, 6]]),
    ("bij,bjk->bik", [[1, 4, 5], [3, 5, 6]]),  # a batch letter of size 1 against 3: broadcast
    ("ij,jk", [[3, 4], [4, 5]]),  # the implicit output: ik
    ("ij,jk,kl->il", [[3, 4], [4, 5], [5, 2]]),
    ("ijk,jl->il", [[3, 4, 5], [4, 2]]),  # k summed out of the first operand alone
    ("bn,anm,bm->ba", [[2, 3], [4, 3, 5], [2, 5]]),  # a bilinear form
    ("ij", [[3, 4]]),  # implicit: the same order
]


@pytest.mark.parametrize("equation,shapes", EINSUM_CASES, ids=[c[0] for c in EINSUM_CASES])
def test_einsum_matches_the_reference(equation, shapes, tmp_path):
    names = [f"x{i}" for i in range(len(shapes))]
    inputs = list(zip(names, shapes))
    model = _model([helper.make_node("Einsum", names, ["y"], equation=equation)], inputs, [("y", F)], opset=12)
    graph = _check(model, inputs, tmp_path, seed=len(equation), quantized=len(shapes) <= 2 and "->" in equation
                   and not equation.endswith("->"))
    assert "Einsum" not in _types(graph)


def test_einsum_by_a_weight_is_a_fully_connected_layer(tmp_path):
    """bsd,dh->bsh with a constant [d, h]: the product by a weight matrix a FullyConnected layer, as any MatMul by
    a constant is; the Parser's own graph for it is one MatMul by a [1, d, h] Constant."""
    w = numpy_helper.from_array(np.random.default_rng(3).standard_normal((64, 32)).astype(np.float32), "w")
    inputs = [("x", [1, 16, 64])]
    model = _model([helper.make_node("Einsum", ["x", "w"], ["y"], equation="bsd,dh->bsh")], inputs, [("y", F)], [w],
                   opset=12)
    graph = _check(model, inputs, tmp_path, atol=1e-4)
    assert "FullyConnected" in _types(graph) and "MatMul" not in _types(graph)


def test_einsum_scores_need_no_transpose_layer(tmp_path):
    """q·kᵀ: the transposed operand is read by the MatMul with trans_b (as the Parser writes it), no layer moves it."""
    inputs = [("q", [1, 4, 16, 8]), ("k", [1, 4, 16, 8])]
    model = _model([helper.make_node("Einsum", ["q", "k"], ["y"], equation="bhqd,bhkd->bhqk")], inputs, [("y", F)],
                   opset=12)
    graph = _check(model, inputs, tmp_path, quantized=False)
    assert _types(graph).count("MatMul") == 1 and "Transpose" not in _types(graph)
    matmul = next(n for n in graph.nodes if str(n.type) == "MatMul")
    assert matmul.params["trans_b"] is True


@pytest.mark.parametrize("equation,shapes,message", [
    ("ii->i", [[3, 3]], "subscript 'i' repeated within one operand"),
    ("ij,jk->iz", [[2, 3], [3, 4]], "output subscripts 'iz'"),
    ("ij,jk->ik", [[2, 3], [4, 5]], "subscript 'j' has sizes 3 and 4"),
])
def test_einsum_refusals_name_the_reason(equation, shapes, message, tmp_path):
    names = [f"x{i}" for i in range(len(shapes))]
    model = _model([helper.make_node("Einsum", names, ["y"], equation=equation)], list(zip(names, shapes)),
                   [("y", F)], opset=12)
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    with pytest.raises(UnsupportedError, match=message) as info:
        import_onnx(str(path))
    assert "(Einsum, opset 12)" in str(info.value)


# ------------------------------------------------------------------------------------------------ one-layer ops
def test_gather_nd_by_constant_indices(tmp_path):
    idx = numpy_helper.from_array(np.array([[[0, 1], [2, -1]], [[3, 0], [1, 4]]], np.int64), "idx")
    inputs = [("x", [4, 5, 6])]
    model = _model([helper.make_node("GatherND", ["x", "idx"], ["y"])], inputs, [("y", F)], [idx])
    graph = _check(model, inputs, tmp_path)
    assert "GatherND" in _types(graph)


def test_gather_nd_with_batch_dims(tmp_path):
    idx = numpy_helper.from_array(np.array([[[1], [0]], [[2], [2]]], np.int64), "idx")
    inputs = [("x", [2, 3, 4])]
    model = _model([helper.make_node("GatherND", ["x", "idx"], ["y"], batch_dims=1)], inputs, [("y", F)], [idx])
    _check(model, inputs, tmp_path)


@pytest.mark.parametrize("largest", [1, 0])
def test_topk_values_and_indices(largest, tmp_path):
    k = numpy_helper.from_array(np.array([4], np.int64), "k")
    inputs = [("x", [1, 6, 20])]
    model = _model([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=-1, largest=largest)], inputs,
                   [("v", F), ("i", TensorProto.INT64)], [k])
    graph = _check(model, inputs, tmp_path)
    topk = next(n for n in graph.nodes if str(n.type) == "TopK")
    assert topk.params["k"] == 4 and topk.params["select_index"] == "first"


def test_topk_ties_give_the_lower_index_first(tmp_path):
    k = numpy_helper.from_array(np.array([3], np.int64), "k")
    inputs = [("x", [2, 8])]
    model = _model([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1)], inputs,
                   [("v", F), ("i", TensorProto.INT64)], [k])
    tied = np.array([[1, 3, 3, 0, 3, 2, 2, 1], [5, 5, 5, 5, 5, 5, 5, 5]], np.float32)
    _check(model, inputs, tmp_path, feeds=[{"x": tied}], quantized=False)


def test_topk_of_a_computed_k_is_refused(tmp_path):
    inputs = [("x", [1, 8])]
    graph = helper.make_graph([helper.make_node("TopK", ["x", "k"], ["v", "i"])], "g",
                              [helper.make_tensor_value_info("x", F, [1, 8]),
                               helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("v", F, None),
                               helper.make_tensor_value_info("i", TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert inputs
    path = tmp_path / "k.onnx"
    onnx.save(model, str(path))
    with pytest.raises(UnsupportedError, match="a k computed at run time is not supported"):
        import_onnx(str(path))


@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize("after_conv", [False, True], ids=["nchw", "channels_last"])
def test_group_normalization(opset, after_conv, tmp_path):
    """Opset 18's scale and bias per group, 21's per channel; on the input as fed (held NCHW) and after a Conv (held
    channels-last): the layer works in the layout its input is held in."""
    rng = np.random.default_rng(opset)
    groups, channels = 4, 16
    per = groups if opset == 18 else channels
    inits = [numpy_helper.from_array(rng.standard_normal(per).astype(np.float32), "s"),
             numpy_helper.from_array(rng.standard_normal(per).astype(np.float32), "b")]
    nodes = [helper.make_node("GroupNormalization", ["h" if after_conv else "x", "s", "b"], ["y"],
                              num_groups=groups, epsilon=1e-4)]
    if after_conv:
        inits.append(numpy_helper.from_array(rng.standard_normal((channels, channels, 1, 1)).astype(np.float32),
                                             "w"))
        nodes.insert(0, helper.make_node("Conv", ["x", "w"], ["h"]))
    inputs = [("x", [1, channels, 6, 5])]
    graph = _check(_model(nodes, inputs, [("y", F)], inits, opset=opset), inputs, tmp_path, atol=1e-4)
    norm = next(n for n in graph.nodes if str(n.type) == "GroupNorm")
    assert norm.params["group"] == groups
    assert norm.params["axis"] == (3 if after_conv else 1)


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_gives_zero_for_a_zero_slice(p, tmp_path):
    """Against onnxruntime: onnx's reference evaluator sums x^p without |x| for p = 1 (not an L1 norm)."""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install onnxruntime)")
    inputs = [("x", [2, 3, 4])]
    model = _model([helper.make_node("LpNormalization", ["x"], ["y"], axis=1, p=p)], inputs, [("y", F)])
    x = np.random.default_rng(p).standard_normal((2, 3, 4)).astype(np.float32)
    x[1, :, 2] = 0
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    graph = _check(model, inputs, tmp_path, feeds=[{"x": x}] + _feeds(inputs, 5, 2), reference=session)
    with torch.no_grad():
        y = graph.forward([torch.from_numpy(x)])[0]
    assert torch.equal(y[1, :, 2], torch.zeros(3))
    assert ("Normalization" in _types(graph)) == (p == 2)


def test_mean_variance_normalization(tmp_path):
    inputs = [("x", [2, 4, 5, 6])]
    model = _model([helper.make_node("MeanVarianceNormalization", ["x"], ["y"], axes=[0, 2, 3])], inputs,
                   [("y", F)])
    graph = _check(model, inputs, tmp_path, atol=1e-4)
    assert "MVN" in _types(graph)


def test_rms_normalization(tmp_path):
    gamma = numpy_helper.from_array(np.random.default_rng(1).standard_normal(16).astype(np.float32), "g")
    inputs = [("x", [1, 8, 16])]
    model = _model([helper.make_node("RMSNormalization", ["x", "g"], ["y"], axis=-1, epsilon=1e-5)], inputs,
                   [("y", F)], [gamma], opset=23)
    graph = _check(model, inputs, tmp_path, atol=1e-4)
    assert "RMSNorm" in _types(graph)


def test_swish(tmp_path):
    inputs = [("x", [1, 4, 8])]
    model = _model([helper.make_node("Swish", ["x"], ["y"], alpha=1.5)], inputs, [("y", F)], opset=24)
    graph = _check(model, inputs, tmp_path)
    act = next(n for n in graph.nodes if str(n.type) == "Activation")
    assert act.params["method"] == "SWISH" and act.params["alpha"] == 1.5


@pytest.mark.parametrize("upper,k", [(1, 0), (0, 0), (1, 2), (0, -1), (1, -7)])
def test_trilu_of_an_activation(upper, k, tmp_path):
    """Trilu of a computed tensor (batched, non-square) keeps its triangle as a selection: a Where layer."""
    inputs = [("x", [2, 3, 4, 6])]
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Trilu", ["r", "k"], ["y"], upper=upper)]
    model = _model(nodes, inputs, [("y", F)], [numpy_helper.from_array(np.array(k, np.int64), "k")], opset=17)
    graph = _check(model, inputs, tmp_path)
    assert "Where" in _types(graph)


def test_trilu_of_a_computed_k_is_refused(tmp_path):
    inputs = [("x", [3, 3]), ("kf", [1])]
    nodes = [helper.make_node("Cast", ["kf"], ["k"], to=TensorProto.INT64),
             helper.make_node("Trilu", ["x", "k"], ["y"], name="tri")]
    model = _model(nodes, inputs, [("y", F)], opset=17)
    with pytest.raises(UnsupportedError, match="a k computed at run time is not supported"):
        _imported(model, tmp_path)


def test_trilu_of_a_float_k_is_refused(tmp_path):
    """k is an int64 scalar; a float one (NaN here, from a broken Constant) is refused by name, not converted."""
    inputs = [("x", [3, 3])]
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array([np.nan], np.float32))),
             helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Trilu", ["r", "k"], ["y"], name="tri")]
    model = _model(nodes, inputs, [("y", F)], opset=17)
    with pytest.raises(QuantOptError, match="k must be an integer"):
        _imported(model, tmp_path)


@pytest.mark.parametrize("group,auto_pad", [(1, "NOTSET"), (2, "NOTSET"), (4, "SAME_UPPER")])
def test_conv3d(group, auto_pad, tmp_path):
    """A 3-D Conv (strides, dilation, asymmetric pads or SAME_UPPER, groups) with a Relu: one Convolution3D layer on
    the channels-last input, against the reference evaluator, then quantized."""
    inputs = [("x", [1, 4, 5, 6, 7])]
    w = numpy_helper.from_array(np.random.default_rng(5).standard_normal((8, 4 // group, 2, 3, 3)).astype(np.float32),
                                "w")
    b = numpy_helper.from_array(np.random.default_rng(6).standard_normal(8).astype(np.float32), "b")
    attrs = dict(group=group, strides=[1, 2, 1], dilations=[2, 1, 1])
    if auto_pad == "NOTSET":
        attrs["pads"] = [1, 0, 1, 0, 1, 2]
    else:
        attrs.update(auto_pad=auto_pad, dilations=[1, 1, 1])
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], **attrs), helper.make_node("Relu", ["c"], ["y"])]
    model = _model(nodes, inputs, [("y", F)], [w, b])
    graph = _check(model, inputs, tmp_path, atol=1e-4)
    layer = next(n for n in graph.nodes if str(n.type) == "Convolution3D")
    assert layer.params["group"] == group and str(layer.params["with_activation"]).upper() == "RELU"
    assert "Activation" not in _types(graph)


CONVT3D_CASES = [(1, dict(strides=[1, 2, 2], output_padding=[0, 1, 0], pads=[0, 0, 1, 0, 0, 1])),
                 (2, dict(strides=[2, 1, 1], dilations=[1, 2, 1]))]


@pytest.mark.parametrize("group,attrs", CONVT3D_CASES)
def test_conv_transpose3d(group, attrs, tmp_path):
    """A 3-D ConvTranspose (strides, output padding, pads, dilation, groups): one ConvTranspose3D layer on the
    channels-last input, against onnxruntime, then quantized."""
    ort = pytest.importorskip("onnxruntime")
    inputs = [("x", [1, 4, 3, 4, 5])]
    w = numpy_helper.from_array(np.random.default_rng(8).standard_normal((4, 6 // group, 2, 3, 2)).astype(np.float32),
                                "w")
    b = numpy_helper.from_array(np.random.default_rng(9).standard_normal(6).astype(np.float32), "b")
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], group=group, **attrs)]
    model = _model(nodes, inputs, [("y", F)], [w, b])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    graph = _check(model, inputs, tmp_path, atol=1e-4, reference=session)
    assert "ConvTranspose3D" in _types(graph)


POOL3D_CASES = [
    ("MaxPool", dict(kernel_shape=[2, 3, 2], strides=[1, 2, 2], pads=[1, 0, 1, 0, 1, 0], dilations=[2, 1, 1])),
    ("MaxPool", dict(kernel_shape=[2, 2, 2], strides=[2, 2, 2], ceil_mode=1)),
    ("AveragePool", dict(kernel_shape=[3, 3, 3], pads=[1, 1, 1, 1, 1, 1], count_include_pad=0)),
    ("AveragePool", dict(kernel_shape=[2, 2, 3], strides=[2, 2, 2], pads=[0, 1, 1, 0, 0, 1], ceil_mode=1,
                         count_include_pad=1)),
]


@pytest.mark.parametrize("op,attrs", POOL3D_CASES)
def test_pool3d(op, attrs, tmp_path):
    """3-D MaxPool/AveragePool after a 3-D Conv: one Pooling3D layer on the channels-last input, against
    onnxruntime, then quantized."""
    ort = pytest.importorskip("onnxruntime")
    inputs = [("x", [1, 3, 5, 6, 7])]
    w = numpy_helper.from_array(np.random.default_rng(7).standard_normal((4, 3, 1, 1, 1)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node(op, ["c"], ["y"], **attrs)]
    model = _model(nodes, inputs, [("y", F)], [w])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    graph = _check(model, inputs, tmp_path, atol=1e-5, reference=session)
    assert "Pooling3D" in _types(graph)


GRID_CASES = [(16, "bilinear", "zeros", 0), (16, "nearest", "border", 1), (20, "linear", "reflection", 0),
              (20, "nearest", "zeros", 1), (16, "bilinear", "reflection", 1)]


@pytest.mark.parametrize("opset,mode,padding,align", GRID_CASES)
def test_grid_sample(opset, mode, padding, align, tmp_path):
    """A channels-last GridSample layer after a convolution, the grid an input of its own (coordinates reaching
    outside [-1, 1], so the padding modes matter)."""
    inputs = [("x", [1, 3, 6, 7]), ("grid", [1, 4, 5, 2])]
    w = numpy_helper.from_array(np.random.default_rng(3).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["grid", "k"], ["g"]),
             helper.make_node("GridSample", ["c", "g"], ["y"], mode=mode, padding_mode=padding, align_corners=align)]
    k = numpy_helper.from_array(np.array(0.6, dtype=np.float32), "k")
    model = _model(nodes, inputs, [("y", F)], [w, k], opset=opset)
    reference = None
    if mode == "bilinear":  # onnx's reference evaluator knows opset 20's names only: onnxruntime then
        ort = pytest.importorskip("onnxruntime")
        reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    graph = _check(model, inputs, tmp_path, atol=1e-4, reference=reference)
    layer = next(n for n in graph.nodes if str(n.type) == "GridSample")
    assert layer.params["padding_mode"] == padding.upper() and layer.params["align_corners"] == bool(align)
    assert list(layer.inputs[0].ir_shape) == [1, 6, 7, 4] and list(layer.outputs[0].ir_shape) == [1, 4, 5, 4]


@pytest.mark.parametrize("attrs,message", [({"mode": "bicubic"}, "mode bicubic is not supported"),
                                           ({"mode": "cubic"}, "mode cubic is not supported")])
def test_grid_sample_refusals_name_the_reason(attrs, message, tmp_path):
    inputs = [("x", [1, 2, 4, 4]), ("grid", [1, 3, 3, 2])]
    opset = 16 if attrs["mode"] == "bicubic" else 20
    model = _model([helper.make_node("GridSample", ["x", "grid"], ["y"], **attrs)], inputs, [("y", F)], opset=opset)
    with pytest.raises(UnsupportedError, match=message):
        _imported(model, tmp_path)


@pytest.mark.parametrize("reduction", ["none", "add", "max"])
def test_scatter_nd(reduction, tmp_path):
    idx = numpy_helper.from_array(np.array([[1], [3]], np.int64), "idx")
    inputs = [("x", [4, 5]), ("u", [2, 5])]
    model = _model([helper.make_node("ScatterND", ["x", "idx", "u"], ["y"], reduction=reduction)], inputs,
                   [("y", F)], [idx], opset=18)
    graph = _check(model, inputs, tmp_path)
    assert "ScatterND" in _types(graph)


def test_scatter_elements(tmp_path):
    rng = np.random.default_rng(4)
    idx = numpy_helper.from_array(np.stack([rng.permutation(40)[:10] for _ in range(6)]).astype(np.int64), "idx")
    inputs = [("x", [6, 40]), ("u", [6, 10])]
    model = _model([helper.make_node("ScatterElements", ["x", "idx", "u"], ["y"], axis=1)], inputs, [("y", F)],
                   [idx], opset=13)
    graph = _check(model, inputs, tmp_path)
    assert "ScatterElements" in _types(graph)


def test_one_hot_of_float_indices_truncates_them(tmp_path):
    """Float indices are cast to int64 first, as ONNX's operator text says (-1.7 is -1: the last class; 2.9 is 2),
    then one-hot. onnxruntime has no kernel for float indices with float values, and onnx's reference evaluator
    compares them uncast (2.9 matches no class); the reference here is the text's."""

    class SpecReference:
        def run(self, _names, feeds):
            idx = feeds["x"].astype(np.int64)
            idx = np.where(idx < 0, idx + 5, idx)
            hot = np.arange(5).reshape(1, 5, 1) == idx[:, None, :]
            return [np.where(hot, 3.0, -2.0).astype(np.float32)]

    inits = [numpy_helper.from_array(np.array(5, np.int64), "depth"),
             numpy_helper.from_array(np.array([-2.0, 3.0], np.float32), "values")]
    inputs = [("x", [2, 3])]
    model = _model([helper.make_node("OneHot", ["x", "depth", "values"], ["y"], axis=1)], inputs, [("y", F)], inits,
                   opset=11)
    x = np.array([[0.0, 2.9, -1.7], [4.2, 7.0, -5.0]], np.float32)
    graph = _check(model, inputs, tmp_path, feeds=[{"x": x}], quantized=False, reference=SpecReference())
    assert "OneHot" in _types(graph)
    with torch.no_grad():
        y = graph.forward([torch.from_numpy(x)])[0]
    assert y[0, :, 2].tolist() == [-2.0, -2.0, -2.0, -2.0, 3.0] and y[0, :, 1].tolist() == [-2.0, -2.0, 3.0, -2.0, -2.0]


# ------------------------------------------------------------------------------------------------ rewritten ops
def test_mean_of_three(tmp_path):
    inputs = [("a", [2, 5]), ("b", [2, 5]), ("c", [2, 5])]
    model = _model([helper.make_node("Mean", ["a", "b", "c"], ["y"])], inputs, [("y", F)])
    _check(model, inputs, tmp_path)


@pytest.mark.parametrize("op", ["ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_composite_reductions(op, keepdims, tmp_path):
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    inputs = [("x", [2, 6, 3])]
    model = _model([helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims)], inputs, [("y", F)], [axes],
                   opset=18)
    feeds = None
    if op == "ReduceLogSum":  # positive sums
        rng = np.random.default_rng(7)
        feeds = [{"x": (rng.random((2, 6, 3)) + 0.1).astype(np.float32)} for _ in range(3)]
    _check(model, inputs, tmp_path, atol=1e-5, feeds=feeds)


# ------------------------------------------------------------------------------------------------ Col2Im
@pytest.mark.parametrize("image,block", [([8, 8], [2, 2]), ([6, 9], [3, 3]), ([4, 6, 8], [2, 3, 2])])
def test_col2im_of_blocks_that_tile_the_image(image, block, tmp_path):
    """torch's fold of unfolded patches (MobileViT v2 writes it): blocks that tile the image without overlap are
    moved, not summed: Reshape, Transpose and Reshape, exact in float and in integers."""
    per_block = int(np.prod(block))
    count = int(np.prod([i // b for i, b in zip(image, block)]))
    inputs = [("x", [2, 3 * per_block, count])]
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Col2Im", ["r", "image", "block"], ["y"], strides=block)]
    inits = [numpy_helper.from_array(np.array(image, np.int64), "image"),
             numpy_helper.from_array(np.array(block, np.int64), "block")]
    graph = _check(_model(nodes, inputs, [("y", F)], inits, opset=18), inputs, tmp_path, atol=0.0)
    assert "Transpose" in _types(graph) and "Col2Im" not in _types(graph)


@pytest.mark.parametrize("attrs,image,block,message", [
    ({}, [8, 8], [2, 2], "only blocks that do not overlap"),  # stride 1: each block overlaps the next
    ({"strides": [2, 2], "pads": [1, 1, 1, 1]}, [6, 6], [2, 2], "pads"),
    ({"strides": [3, 3]}, [8, 8], [3, 3], "must tile image_shape"),
])
def test_col2im_refusals_name_the_reason(attrs, image, block, message, tmp_path):
    """Overlapping or padded blocks sum or drop values: refused by name (the ONNX test suite's Col2Im cases are
    all of that kind)."""
    inputs = [("x", [1, 12, 16])]
    nodes = [helper.make_node("Col2Im", ["x", "image", "block"], ["y"], name="fold", **attrs)]
    inits = [numpy_helper.from_array(np.array(image, np.int64), "image"),
             numpy_helper.from_array(np.array(block, np.int64), "block")]
    with pytest.raises(UnsupportedError, match=message):
        _imported(_model(nodes, inputs, [("y", F)], inits, opset=18), tmp_path)


def test_the_new_operators_are_listed_as_supported():
    listed = set(supported_onnx_ops())
    for op in ("Einsum", "GatherND", "TopK", "GroupNormalization", "LpNormalization", "MeanVarianceNormalization",
               "RMSNormalization", "Swish", "Mean", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp", "ScatterND",
               "ScatterElements", "OneHot", "GridSample", "Trilu", "Col2Im"):
        assert op in listed, op


# ------------------------------------------------------------------------------------------------ torch exports
TORCH_MODELS = {"dynamo_ops": ("GatherND", "DepthToSpace"), "dynamo_attention": ("MatMul", "RMSNorm"),
                "vision_ops": ("GridSample", "Where", "GatherElements", "Pow")}
MIN_COSINE = {"vision_ops": 0.95}
"""Least cosine of a quantized output against the float one (default 0.98): vision_ops cubes an 8-bit value."""


@pytest.mark.parametrize("name", sorted(TORCH_MODELS))
def test_torch_exports_import_run_and_quantize(name):
    """The committed torch exports of tests/data/onnx_small/make_models.py that hold the operators above (two made
    by the dynamo exporter): the float forward against onnxruntime, the layer types their forms map to, and a
    quantized run close to the float one in every output."""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install onnxruntime)")
    path = Path(__file__).resolve().parent / "data" / "onnx_small" / f"{name}.onnx"
    graph = import_onnx(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = [{i.name: np.random.default_rng(seed).standard_normal(i.shape).astype(np.float32)
              for i in session.get_inputs()} for seed in range(3)]
    batches = [[torch.from_numpy(v) for v in f.values()] for f in feeds]
    for f, b in zip(feeds, batches):
        with torch.no_grad():
            got = [t.clone() for t in graph.forward(b)]
        for g, w in zip(got, session.run(None, f)):
            np.testing.assert_allclose(g.double().numpy(), np.asarray(w, np.float64), rtol=1e-4, atol=1e-5)
    types = set(_types(graph))
    assert "Einsum" not in types and all(t in types for t in TORCH_MODELS[name]), types
    qgraph = quantize_model(graph, batches)
    with torch.no_grad():
        want = [t.clone() for t in graph.forward(batches[0])]
        qgraph.forward(batches[0])
    for t, w in zip(qgraph.output_tensors, want):
        if not w.is_floating_point():  # indices: exact
            assert torch.equal(t.betensor.to(w.dtype), w)
            continue
        y = to_float(t, quant_of(t.pnode)).double().reshape(-1)
        cos = float(torch.nn.functional.cosine_similarity(y, w.double().reshape(-1), dim=0))
        assert cos > MIN_COSINE.get(name, 0.98), (t.name, cos)


def _roll_model(shift: int, axis: int = 1, extra_reader: bool = False) -> onnx.ModelProto:
    """torch.roll(x, shift, axis) as the exporter writes it: Concat(x[-shift:], x[:-shift]) along `axis`; a shift of
    0 makes the first part the empty slice x[0:0]. With `extra_reader`, a Relu also reads that part."""
    i64 = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    n = 6
    inits = [i64("s0", [(n - shift) % n if shift else 0]), i64("e0", [n if shift else 0]), i64("s1", [0]),
             i64("e1", [(n - shift) % n if shift else n]), i64("ax", [axis])]
    nodes = [helper.make_node("Slice", ["x", "s0", "e0", "ax"], ["a"]),
             helper.make_node("Slice", ["x", "s1", "e1", "ax"], ["b"]),
             helper.make_node("Concat", ["a", "b"], ["rolled"], axis=axis),
             helper.make_node("Relu", ["rolled"], ["y"])]
    outputs = [("y", F)]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["a"], ["z"]))
        outputs.append(("z", F))
    return _model(nodes, [("x", [2, n, 4])], outputs, inits)


@pytest.mark.parametrize("shift", [0, 2])
def test_roll_by_zero_leaves_the_empty_slice_out(shift, tmp_path):
    """A roll by 0 (Video Swin's shifted windows where the window covers a whole axis) concatenates an empty slice:
    the Concat leaves it out, so the model imports; the values are the reference's."""
    graph = _check(_roll_model(shift), [("x", [2, 6, 4])], tmp_path)
    assert "Slice" not in _types(graph) if shift == 0 else "Slice" in _types(graph)


def test_empty_slice_read_by_another_layer_is_refused(tmp_path):
    with pytest.raises(UnsupportedError, match="an empty slice is not supported"):
        _imported(_roll_model(0, extra_reader=True), tmp_path)
