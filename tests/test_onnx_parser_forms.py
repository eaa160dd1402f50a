"""ONNX importer: the layer forms the Parser writes for PP-OCRv6, ViT, LSTM and GRU exports
(tests/data/parser_histograms checks the counts on the whole models; each form is pinned here on a tiny graph, its
float forward against onnxruntime):

- ReduceMean over H and W of an NCHW tensor → a global average Pooling (plus a Reshape when the axes are dropped);
- a channels-last → channels-first Transpose of a 4-D tensor held in its ONNX layout → no layer;
- an Add/Sub of zeros → no layer, but Mul by a constant + Add of zeros → one BatchNorm;
- LSTM/GRU initial states given as constants → one shared Constant named after what made it, the output Reshape
  chain collapsed; GRU with linear_before_reset → the Parser's GRUv1 layer (quantized and exported exactly);
- a quantized graph's header drops the float IR's `precision` / `compat_quantized_model` lines.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the optional dependency 'onnx' is not installed (pip install onnx)")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install onnxruntime)")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import quantopt.ops  # noqa: E402,F401
from quantopt.frontends.onnx import import_onnx  # noqa: E402


def _save(tmp_path: Path, name: str, nodes: List, inputs: Dict[str, List[int]], outputs: List[str],
          consts: Dict[str, np.ndarray], opset: int = 13) -> str:
    g = helper.make_graph(nodes, name,
                          [helper.make_tensor_value_info(k, TensorProto.FLOAT, s) for k, s in inputs.items()],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                          initializer=[numpy_helper.from_array(np.asarray(v, np.float32), k)
                                       for k, v in consts.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    path = str(tmp_path / f"{name}.onnx")
    onnx.save(model, path)
    return path


def _check(path: str, shapes: Dict[str, List[int]]):
    graph = import_onnx(path)
    rng = np.random.default_rng(0)
    feeds = {k: rng.normal(0, 1, s).astype(np.float32) for k, s in shapes.items()}
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = graph.forward([torch.from_numpy(feeds[t.name[:-2]]) for t in graph.input_tensors])
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-4, atol=1e-5)
    return graph


def _types(graph) -> Counter:
    return Counter(str(n.type) for n in graph.nodes)


@pytest.mark.parametrize("keepdims", [1, 0])
def test_spatial_mean_is_global_pooling(tmp_path, keepdims):
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("ReduceMean", ["c"], ["y"], name="mean", axes=[2, 3], keepdims=keepdims),
             helper.make_node("ReduceMean", ["c"], ["z"], name="channel_mean", axes=[1], keepdims=1)]
    w = np.random.default_rng(1).normal(0, 0.3, (6, 3, 3, 3))
    path = _save(tmp_path, f"mean{keepdims}", nodes, {"x": [1, 3, 5, 7]}, ["y", "z"], {"w": w})
    graph = _check(path, {"x": [1, 3, 5, 7]})
    mean = graph.node("mean")
    assert str(mean.type) == "Pooling" and mean.params["method"] == "AVG"
    assert (mean.params["kernel_y"], mean.params["kernel_x"]) == (5, 7)
    assert list(mean.outputs[0].ir_shape) == [1, 1, 1, 6]
    assert str(graph.node("channel_mean").type) == "Reduce"  # not over H and W: stays a Reduce
    assert ("mean_post_reshape" in {n.name for n in graph.nodes}) == (keepdims == 0)


def test_channels_last_to_first_transpose_is_no_layer(tmp_path):
    """[1,1,W,C] → Transpose(0,3,1,2) → [1,C,1,W] added to a conv output: the held tensor is already the sum's
    channels-last layout (PP-OCRv6's neck), so neither it nor the conv output is transposed."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
             helper.make_node("Transpose", ["r"], ["t"], name="to_nchw", perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["img", "w"], ["c"], name="conv"),
             helper.make_node("Add", ["t", "c"], ["y"], name="add")]
    consts = {"shape": np.array([1, 1, 5, 4]), "w": np.random.default_rng(2).normal(0, 0.3, (4, 2, 1, 1))}
    g = helper.make_graph(nodes, "nchw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 4]),
                                          helper.make_tensor_value_info("img", TensorProto.FLOAT, [1, 2, 1, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(consts["shape"].astype(np.int64), "shape"),
                                       numpy_helper.from_array(consts["w"].astype(np.float32), "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = str(tmp_path / "nchw.onnx")
    onnx.save(model, path)
    graph = _check(path, {"x": [5, 4], "img": [1, 2, 1, 5]})
    assert "to_nchw" not in {n.name for n in graph.nodes}
    add = graph.node("add")
    assert list(add.outputs[0].ir_shape) == [1, 1, 5, 4]
    # img to channels-last and the output back to its ONNX layout; nothing for the ONNX Transpose or the conv output
    assert sorted(n.name for n in graph.nodes if str(n.type) == "Transpose") == ["add_post_transpose",
                                                                                 "img_post_transpose"]


def test_add_of_zeros_is_no_layer_but_mul_add_zeros_is_batchnorm(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="fc"),
             helper.make_node("Div", ["m", "k"], ["d"], name="scale"),
             helper.make_node("Add", ["d", "zero"], ["a"], name="add_zero"),
             helper.make_node("Sub", ["a", "zeros8"], ["s"], name="sub_zero"),
             helper.make_node("Softmax", ["s"], ["y"], name="softmax", axis=-1),
             helper.make_node("Mul", ["x2", "k"], ["mx"], name="mul"),
             helper.make_node("Add", ["mx", "zero"], ["z"], name="mul_add_zero")]
    consts = {"w": np.random.default_rng(3).normal(0, 0.3, (8, 8)), "k": 2.5, "zero": 0.0, "zeros8": np.zeros(8)}
    path = _save(tmp_path, "zeros", nodes, {"x": [1, 4, 8], "x2": [1, 4, 8]}, ["y", "z"], consts)
    graph = _check(path, {"x": [1, 4, 8], "x2": [1, 4, 8]})
    names = {n.name: str(n.type) for n in graph.nodes}
    assert "add_zero" not in names and "sub_zero" not in names
    assert names["mul"] == "BatchNorm"  # Mul + Add of a constant: the Parser's BatchNorm, the Add absorbed
    assert "mul_add_zero" not in names


def _recurrent(tmp_path: Path, op: str, lbr: int = 0) -> str:
    rng = np.random.default_rng(4)
    h, i, t = 5, 3, 4
    gates = 4 if op == "LSTM" else 3
    consts = {"W": rng.normal(0, 0.5, (1, gates * h, i)), "R": rng.normal(0, 0.5, (1, gates * h, h)),
              "B": rng.normal(0, 0.2, (1, 2 * gates * h)), "state": np.zeros((1, 1, h))}
    ins = ["x", "W", "R", "B", "", "state"] + (["state"] if op == "LSTM" else [])
    attrs = {"hidden_size": h}
    if op == "GRU":
        attrs["linear_before_reset"] = lbr
    nodes = [helper.make_node(op, ins, ["Y"], name="rnn", **attrs),
             helper.make_node("Squeeze", ["Y", "one"], ["sq"], name="squeeze"),
             helper.make_node("Transpose", ["sq"], ["y"], name="batch_first", perm=[1, 0, 2])]
    consts["one"] = np.array([1])
    g = helper.make_graph(nodes, op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [t, 1, i])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(np.asarray(v, np.int64 if k == "one" else np.float32), k)
                                       for k, v in consts.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    path = str(tmp_path / f"{op}{lbr}.onnx")
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("op,lbr,layer", [("LSTM", 0, "BasicLSTM"), ("GRU", 0, "GRUv3"), ("GRU", 1, "GRUv1")])
def test_recurrent_layers_as_the_parser_writes_them(tmp_path, op, lbr, layer):
    graph = _check(_recurrent(tmp_path, op, lbr), {"x": [4, 1, 3]})
    node = graph.node("rnn")
    assert str(node.type) == layer
    assert ("version" in node.params) == (layer == "GRUv3")
    consts = [n for n in graph.nodes if str(n.type) == "Constant"]
    assert [n.name for n in consts] == ["state"]  # h0 and c0: one Constant, named after the initializer
    assert all(i.name == "state_0" for i in node.inputs[1:])
    assert _types(graph)["Reshape"] == 1 and "Transpose" not in _types(graph)  # Y → [B, T, H] in one Reshape


def test_gruv1_quantizes_and_exports_exactly(tmp_path):
    from quantopt.exporters.agreement import measure_agreement
    from quantopt.pipeline import quantize_model

    graph = import_onnx(_recurrent(tmp_path, "GRU", 1))
    rng = np.random.default_rng(5)
    calib = [torch.from_numpy(rng.normal(0, 1, (4, 1, 3)).astype(np.float32)) for _ in range(3)]
    qgraph = quantize_model(graph, calib, {"gru_integer_form": "q15"})  # the form the exporter writes
    assert str(qgraph.node("rnn").type) == "GRUv1"
    result = measure_agreement(qgraph, [rng.normal(0, 1, (4, 1, 3)).astype(np.float32)])
    assert result.identical == 1.0


def test_quantized_header_has_no_float_ir_lines(tmp_path):
    from quantopt.ir.writer import write_ir
    from quantopt.pipeline import quantize_model

    path = _recurrent(tmp_path, "LSTM")
    graph = import_onnx(path)
    assert graph.header.get("compat_quantized_model") is False and "precision" in graph.header
    calib = [torch.from_numpy(np.random.default_rng(k).normal(0, 1, (4, 1, 3)).astype(np.float32)) for k in range(2)]
    qgraph = quantize_model(graph, calib)
    txt, _ = write_ir(qgraph, str(tmp_path / "q.txt"))
    head = Path(txt).read_text().split("\n\n")[0]
    assert "precision=" not in head and "compat_quantized_model=" not in head
    assert "precision" in graph.header  # the float graph keeps its header
