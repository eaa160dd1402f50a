"""int64 Max/Min/Clip/Sign of exported models become Less/Greater/Where (quantopt/ops/onnx_build/int64_compare.py):
the rewritten model computes numpy's values at every magnitude, float nodes stay, and an exact export of a graph
whose int64 paths pass 2^31 (Reduce L2, InstanceNorm) keeps none of the four operators on int64."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

from quantopt.ops.onnx_build.int64_compare import INT64, REWRITTEN, elem_types, rewrite_int64_comparisons  # noqa: E402


def _model() -> onnx.ModelProto:
    i64 = [helper.make_tensor_value_info(n, TensorProto.INT64, [64]) for n in ("a", "b", "c")]
    f32 = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [64]) for n in ("fa", "fb")]
    lo = helper.make_tensor("lo", TensorProto.INT64, [], [-(1 << 31) - 12345])
    hi = helper.make_tensor("hi", TensorProto.INT64, [], [(1 << 32) + 777])
    nodes = [
        helper.make_node("Max", ["a", "b"], ["max2"]),
        helper.make_node("Max", ["a", "b", "c"], ["max3"]),
        helper.make_node("Min", ["a", "b"], ["min2"]),
        helper.make_node("Min", ["a", "b", "c"], ["min3"]),
        helper.make_node("Clip", ["a", "lo", "hi"], ["clip"]),
        helper.make_node("Clip", ["a", "lo"], ["clip_low"]),
        helper.make_node("Clip", ["a", "", "hi"], ["clip_high"]),
        helper.make_node("Sign", ["a"], ["sign"]),
        helper.make_node("Max", ["fa", "fb"], ["fmax"]),
    ]
    outs = [helper.make_tensor_value_info(n, TensorProto.INT64, [64])
            for n in ("max2", "max3", "min2", "min3", "clip", "clip_low", "clip_high", "sign")]
    outs.append(helper.make_tensor_value_info("fmax", TensorProto.FLOAT, [64]))
    graph = helper.make_graph(nodes, "g", i64 + f32, outs, [lo, hi])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return onnx.shape_inference.infer_shapes(model)


def _feeds(rng: np.random.Generator) -> dict:
    def values() -> np.ndarray:  # int32-range values, 2^31..2^33 (where onnxruntime 1.30's kernels erred), huge
        bits = rng.choice([8, 31, 32, 33, 40, 62], size=64)
        v = np.array([rng.integers(-(1 << int(b)), 1 << int(b)) for b in bits], np.int64)
        v[:4] = [0, -1, 1 << 31, -(1 << 31)]
        return v
    feeds = {n: values() for n in ("a", "b", "c")}
    feeds["b"][::5] = feeds["a"][::5]  # ties
    feeds.update(fa=rng.normal(size=64).astype(np.float32), fb=rng.normal(size=64).astype(np.float32))
    return feeds


def test_rewritten_operators_compute_numpys_values() -> None:
    model = _model()
    assert rewrite_int64_comparisons(model) == 8
    onnx.checker.check_model(model)
    model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    types = elem_types(model)
    left = [(n.op_type, n.output[0]) for n in model.graph.node if n.op_type in REWRITTEN]
    assert left == [("Max", "fmax")]  # only the float Max stays
    assert all(types[n] == INT64 for n in ("max2", "clip", "sign"))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    lo, hi = -(1 << 31) - 12345, (1 << 32) + 777
    for seed in range(3):
        f = _feeds(np.random.default_rng(seed))
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, f)))
        a, b, c = f["a"], f["b"], f["c"]
        want = {"max2": np.maximum(a, b), "max3": np.maximum(np.maximum(a, b), c), "min2": np.minimum(a, b),
                "min3": np.minimum(np.minimum(a, b), c), "clip": np.clip(a, lo, hi), "clip_low": np.maximum(a, lo),
                "clip_high": np.minimum(a, hi), "sign": np.sign(a), "fmax": np.maximum(f["fa"], f["fb"])}
        for name, value in want.items():
            assert got[name].dtype == value.dtype, name
            np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_a_model_without_int64_comparisons_is_left_alone() -> None:
    graph = helper.make_graph([helper.make_node("Max", ["x", "y"], ["z"])], "g",
                              [helper.make_tensor_value_info(n, TensorProto.INT32, [3]) for n in ("x", "y")],
                              [helper.make_tensor_value_info("z", TensorProto.INT32, [3])])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph))
    before = model.SerializeToString()
    assert rewrite_int64_comparisons(model) == 0
    assert model.SerializeToString() == before


def test_exact_export_has_no_int64_max_min_clip() -> None:
    """The layout graph's Reduce L2 and InstanceNorm run int64 paths past 2^31 in the exact export."""
    from test_onnx_export import EXPORTABLE, _data, g_layout

    from quantopt.exporters.onnx_qdq import build_onnx_qdq
    from quantopt.pipeline import quantize_model

    graph = g_layout(wide=False)
    qgraph = quantize_model(graph, [_data(graph, s, 2) for s in range(3)],
                            {**EXPORTABLE, "layernorm_integer_form": "exact"})
    model = build_onnx_qdq(qgraph)
    types = elem_types(model)
    assert not [n.name for n in model.graph.node if n.op_type in REWRITTEN and types.get(n.output[0]) == INT64]
    assert any(n.op_type == "Where" for n in model.graph.node)
