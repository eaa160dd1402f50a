"""RELU, RELU6 and CLIP of integers (a Cast to an integer type, an index) by whole-number bounds keep them integers
when quantized (ops/activation.py `_quantize_linear`): a data-dependent index made by Cast and Clip (a bucket
computed from activations, then clamped to the table) stays exact for the GatherElements that reads it, and the
exact ONNX export computes the same integers. A CLIP by fractional bounds gives non-integers and is quantized as an
activation, as before."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnx")
import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from quantopt.errors import UnsupportedError  # noqa: E402
from quantopt.exporters.agreement import measure_agreement  # noqa: E402
from quantopt.frontends.onnx import import_onnx  # noqa: E402
from quantopt.graph.tables import quant_of  # noqa: E402
from quantopt.pipeline import quantize_model  # noqa: E402


def _bucket_model(path: str, clip_max: float, relu: bool) -> None:
    """y = GatherElements(table, Clip(Cast_int32(x * 3), -inf, clip_max) [then Relu]) along the last axis."""
    nodes = [
        helper.make_node("Mul", ["x", "three"], ["scaled"]),
        helper.make_node("Cast", ["scaled"], ["as_int"], to=TensorProto.INT32),
        helper.make_node("Clip", ["as_int", "", "hi"], ["clipped"]),
    ]
    last = "clipped"
    if relu:
        nodes.append(helper.make_node("Relu", ["clipped"], ["rectified"]))
        last = "rectified"
    nodes.append(helper.make_node("GatherElements", ["table", last], ["y"], axis=2))
    hi_type = TensorProto.INT32 if float(clip_max).is_integer() else TensorProto.FLOAT
    if hi_type == TensorProto.FLOAT:  # ONNX wants the bound in the input's type: the Cast output stays float here
        nodes[1] = helper.make_node("Floor", ["scaled"], ["as_int"])
    inits = [helper.make_tensor("three", TensorProto.FLOAT, [], [3.0]),
             helper.make_tensor("hi", hi_type, [], [clip_max])]
    graph = helper.make_graph(nodes, "bucket", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 10]),
        helper.make_tensor_value_info("table", TensorProto.FLOAT, [1, 4, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)


def _feeds(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(1, 4, 10, generator=gen) * 4.0 - 0.5, torch.randn(1, 4, 10, generator=gen)]


@pytest.mark.parametrize("relu", [False, True])
def test_integer_clip_keeps_the_index_exact(tmp_path, relu: bool) -> None:
    path = str(tmp_path / "bucket.onnx")
    _bucket_model(path, 9.0, relu)
    graph = import_onnx(path)
    calib = [_feeds(s) for s in range(3)]
    qgraph = quantize_model(graph, calib, settings={})
    clips = [n for n in qgraph.nodes if n.type == "Activation"]
    assert [str(n.get_param("method")) for n in clips] == (["CLIP", "RELU"] if relu else ["CLIP"])
    table = quant_of(clips[0])
    for n in clips:
        q = table.get(n.outputs[0])
        assert q.qinvariant and q.scale == 1.0 and q.zerop == 0
    for seed in (10, 11):
        feeds = _feeds(seed)
        want = graph.forward(feeds, keep_tensors=True)[0]
        got = qgraph.forward(feeds, keep_tensors=True)
        for fnode, qnode in zip([n for n in graph.nodes if n.type == "Activation"], clips):
            assert torch.equal(qnode.outputs[0].betensor.to(torch.int64),
                               fnode.outputs[0].betensor.to(torch.int64))  # the same indices, exactly
        gather = next(n for n in qgraph.nodes if n.type == "GatherElements")
        float_index = next(n for n in graph.nodes if n.type == "GatherElements").inputs[1].betensor.to(torch.int64)
        float_index = float_index % 10  # GatherElements reads a negative index from the end
        # the table's codes at the float graph's indices
        assert torch.equal(got[0], torch.gather(gather.inputs[0].betensor, 2, float_index))
        assert want.shape == got[0].shape
    result = measure_agreement(qgraph, calib[0], per_layer=True)  # the exact export: the same integers
    assert result.identical == 1.0 and result.max_steps == 0.0
    assert min(result.layers.values()) == 1.0, result.layers


def test_fractional_clip_of_integers_is_an_activation(tmp_path) -> None:
    """Clip by 8.5: the outputs are not all whole numbers, so the layer is quantized as an activation and the
    GatherElements refuses its quantized index with a clear error."""
    path = str(tmp_path / "bucket_frac.onnx")
    _bucket_model(path, 8.5, False)
    graph = import_onnx(path)
    with pytest.raises(UnsupportedError, match="indices must be exact integers"):
        quantize_model(graph, [_feeds(s) for s in range(2)], settings={})
