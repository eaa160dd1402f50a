"""Real ONNX models through the importer: float forward against onnxruntime (max abs error ≤ 1e-4 of the output range)
and `quantopt --cfg` with `graph = model.onnx` end to end, for the PP-OCR models of `rapidocr_onnxruntime`, Silero
VAD from `silero_vad` (skipped when those packages are missing: pip install --no-deps -r requirements-models.txt)
and four models exported from torch here (ResNet-like, MobileNetV2-like with depthwise/hardswish/SE, a transformer
encoder, a UNet-like with ConvTranspose/Resize). Also the LSTM/GRU converters and If folding on small models.

The model definitions and input makers live in examples/onnx_models/ (cases.py, run.py), shared with the example.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Dict

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the optional dependency 'onnx' is not installed (pip install onnx)")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install onnxruntime)")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import quantopt.ops  # noqa: E402,F401
from quantopt.errors import UnsupportedError  # noqa: E402
from quantopt.frontends.onnx import import_onnx  # noqa: E402
from quantopt.ir.reader import read_ir  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "onnx_models"
RTOL = 1e-4
QUANT_DET_SIZE, QUANT_REC_WIDTH = 96, 96
"""The float checks use the example's shapes (PP-OCR det 320 × 320, rec 48 × 320); the end-to-end runs use smaller
PP-OCR inputs (multiples of 32 / 8) to keep the tests fast."""
CALIB, VAL = 2, 2
MIN_LAYER_COSINE = 0.8
"""Floor for every layer's isolated cosine (its own error, float inputs) in the run's report: a broken converter or
quantizer shows here (measured ≥ 0.88 for all models, docs/onnx-models.md)."""
MIN_COSINE = {"ppocr_det": None, "ppocr_rec": None, "ppocr_cls": None, "silero_vad": 0.9, "resnet_like": 0.99,
              "mobilenetv2_like": 0.99, "transformer_encoder": 0.97, "unet_like": 0.99, "crnn_like": 0.99}
FLOAT_ONLY = {"silero_vad_op15", "silero_vad_ifless"}
"""Other exports of the same VAD network shipped in the package: float check only."""
"""Floors for the dequantized int8 outputs against onnxruntime on held-out inputs. None for the PP-OCR models: on
synthetic text images their output cosine swings with the input size and samples (0.1-0.96 for the detector,
docs/onnx-models.md explains why), so only the per-layer floor applies to them."""


def _load_run_module():
    name = "onnx_models_run"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE / "run.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


RUN = _load_run_module()
CASES = RUN.cases.all_cases()
QUANT_CASES = RUN.cases.all_cases(QUANT_DET_SIZE, QUANT_REC_WIDTH)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The models are small: one intra-op thread is faster than several fighting over busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_PREPARED: Dict[str, tuple] = {}


def _prepare(name: str, tmp_path_factory) -> tuple:
    """(folder, .onnx path) of a model: exported / pinned / located once per test session."""
    case = CASES[name]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    if name not in _PREPARED:
        folder = str(tmp_path_factory.mktemp(name))
        _PREPARED[name] = (folder, case.make_onnx(folder))
    return _PREPARED[name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_float_forward_matches_onnxruntime(name, tmp_path_factory):
    _, path = _prepare(name, tmp_path_factory)
    case = CASES[name]
    val = case.make_feeds(path, np.random.default_rng(1), VAL)
    graph = import_onnx(path, case.shapes)
    err, span = RUN.relative_error(RUN.float_outputs(graph, val), RUN.reference_outputs(path, val))
    assert span > 0, f"{name}: constant outputs make the comparison meaningless"
    assert err <= RTOL, f"{name}: max abs error {err:.2e} of the output range {span:.3g}"


@pytest.mark.parametrize("name", sorted(set(CASES) - FLOAT_ONLY))
def test_quantizes_end_to_end_through_cfg(name, tmp_path_factory):
    from quantopt.cli import main
    folder, path = _prepare(name, tmp_path_factory)
    case = QUANT_CASES[name]
    feeds = case.make_feeds(path, np.random.default_rng(0), CALIB + VAL)
    calib, val = feeds[:CALIB], feeds[CALIB:]
    graph = import_onnx(path, case.shapes)
    cfg = RUN.write_cfg(case, path, RUN.write_calibration(graph, calib, folder), folder)
    assert f"graph = {path}" in Path(cfg).read_text()
    assert main(["--cfg", cfg]) == 0
    qtxt = os.path.join(folder, "out", f"{name}_o.txt")
    assert os.path.isfile(qtxt)
    worst, layer = RUN.worst_isolated_layer(os.path.join(folder, "out", f"{name}_report.json"))
    assert worst >= MIN_LAYER_COSINE, f"{name}: layer {layer} alone has cosine {worst:.4f}"
    cos = RUN.quantized_cosines(qtxt, val, RUN.reference_outputs(path, val))
    assert len(cos) == len(graph.output_tensors)
    if MIN_COSINE[name] is not None:
        assert min(cos) >= MIN_COSINE[name], f"{name}: quantized output cosines {cos}"
    _check_qdq_export(name, qtxt, val)


def _check_qdq_export(name: str, qtxt: str, val) -> None:
    """The written quantized IR exported as ONNX QDQ: onnxruntime computes quantopt's integers (docs/onnx-export.md),
    Silero VAD's LSTM included. Samples are stacked on dim 0 of every input (its LSTM state two layers deep each)."""
    from quantopt.exporters.agreement import measure_agreement

    qgraph = read_ir(qtxt)
    result = measure_agreement(qgraph, [np.concatenate([f[k] for f in val]) for k in val[0]])
    assert result.identical == 1.0 and result.max_steps == 0.0, f"{name}: {result}"


def test_packaged_models_are_found_without_importing_their_packages():
    for package, rel in RUN.cases.PACKAGED.values():
        was_loaded = package in sys.modules
        path = RUN.cases.packaged_file(package, rel)
        if path is None:
            continue
        assert path.endswith(rel.split("/")[-1]) and os.path.isfile(path)
        assert was_loaded or package not in sys.modules, f"locating the model imported {package}"
    assert RUN.cases.packaged_file("no_such_package_here", "x.onnx") is None


# ------------------------------------------------------------------------------------------ recurrent converters
def _rnn_model(op: str, attrs: Dict, steps: int, batch: int, inp: int, hidden: int, layout: int, initial: bool,
               outputs: int, rng: np.random.Generator):
    gates = 4 if op == "LSTM" else 3
    dirs = 2 if attrs.get("direction") == "bidirectional" else 1
    inits = [numpy_helper.from_array(rng.normal(0, 0.7, (dirs, gates * hidden, inp)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.normal(0, 0.7, (dirs, gates * hidden, hidden)).astype(np.float32), "R"),
             numpy_helper.from_array(rng.normal(0, 0.5, (dirs, 2 * gates * hidden)).astype(np.float32), "B")]
    xs = [steps, batch, inp] if layout == 0 else [batch, steps, inp]
    hs = [dirs, batch, hidden] if layout == 0 else [batch, dirs, hidden]
    states = ["h0", "c0"] if op == "LSTM" else ["h0"]
    ins = ["x", "W", "R", "B", ""] + [s if initial else "" for s in states]
    outs = (["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"])[:outputs]
    node = helper.make_node(op, ins, outs, name="rnn", hidden_size=hidden, layout=layout, **attrs)
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs)]
    feeds = {"x": rng.normal(0, 1, xs).astype(np.float32)}
    if initial:
        for s in states:
            graph_inputs.append(helper.make_tensor_value_info(s, TensorProto.FLOAT, hs))
            feeds[s] = rng.normal(0, 0.5, hs).astype(np.float32)
    g = helper.make_graph([node], "rnn", graph_inputs,
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model, feeds


RNN_CASES = [
    ("LSTM", {}, 0, True, 3),
    ("LSTM", {"direction": "reverse"}, 0, True, 3),
    ("LSTM", {"clip": 0.5}, 0, True, 2),
    ("LSTM", {}, 0, False, 1),
    ("LSTM", {"direction": "reverse"}, 1, True, 3),
    ("GRU", {}, 0, True, 2),
    ("GRU", {"linear_before_reset": 1}, 0, False, 2),
    ("GRU", {"direction": "reverse", "clip": 0.7}, 0, True, 1),
    ("GRU", {}, 1, True, 2),
    ("LSTM", {"direction": "bidirectional"}, 0, True, 3),
    ("LSTM", {"direction": "bidirectional"}, 1, True, 3),
    ("LSTM", {"direction": "bidirectional", "clip": 0.5}, 0, False, 1),
    ("GRU", {"direction": "bidirectional"}, 0, True, 2),
    ("GRU", {"direction": "bidirectional", "linear_before_reset": 1}, 1, True, 2),
]


@pytest.mark.parametrize("op,attrs,layout,initial,outputs", RNN_CASES)
def test_recurrent_converters_match_reference(tmp_path, op, attrs, layout, initial, outputs):
    model, feeds = _rnn_model(op, attrs, 5, 2, 3, 4, layout, initial, outputs, np.random.default_rng(3))
    path = str(tmp_path / "rnn.onnx")
    onnx.save(model, path)
    graph = import_onnx(path)
    kinds = {str(n.type) for n in graph.nodes}
    expected = "BasicLSTM" if op == "LSTM" else "GRUv1" if attrs.get("linear_before_reset") else "GRUv3"
    assert expected in kinds  # GRUv1: the Parser's layer type for linear_before_reset=1
    got = graph.forward([torch.from_numpy(feeds[t.name[:-2]]) for t in graph.input_tensors])
    if layout == 0:
        ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    else:  # onnxruntime runs only layout 0; the onnx reference evaluator runs both
        from onnx.reference import ReferenceEvaluator
        ref = ReferenceEvaluator(model).run(None, feeds)
    assert len(got) == len(ref) == outputs
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(g.numpy(), r, atol=2e-6)


@pytest.mark.parametrize("op,layout", [("LSTM", 0), ("LSTM", 1), ("GRU", 1)])
def test_bidirectional_layers_with_constant_initial_states(tmp_path, op, layout):
    """A bidirectional node whose initial states are initializers: one Constant per direction's state, both
    directions' layers, their outputs joined as the ONNX outputs hold them."""
    model, feeds = _rnn_model(op, {"direction": "bidirectional"}, 4, 2, 3, 5, layout, True, 3 if op == "LSTM" else 2,
                              np.random.default_rng(7))
    states = [i for i in model.graph.input if i.name != "x"]
    for i in states:
        model.graph.initializer.append(numpy_helper.from_array(feeds.pop(i.name), i.name))
        model.graph.input.remove(i)
    path = str(tmp_path / "bi_const.onnx")
    onnx.save(model, path)
    graph = import_onnx(path)
    layers = [n for n in graph.nodes if str(n.type) in ("BasicLSTM", "GRUv3")]
    assert [n.params["direction"] for n in layers] == ["forward", "reverse"]
    got = graph.forward([torch.from_numpy(feeds["x"])])
    from onnx.reference import ReferenceEvaluator
    ref = ReferenceEvaluator(model).run(None, feeds)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(g.numpy(), r, atol=2e-6)


def test_recurrent_variants_without_an_ir_form_are_refused(tmp_path):
    model, _ = _rnn_model("LSTM", {"input_forget": 1}, 3, 1, 2, 2, 0, False, 1, np.random.default_rng(0))
    path = str(tmp_path / "coupled.onnx")
    onnx.save(model, path)
    with pytest.raises(UnsupportedError, match="'rnn' \\(LSTM, opset 14\\): input_forget=1 is not supported"):
        import_onnx(path)


# ------------------------------------------------------------------------------------------ If folding
def _if_model(cond_from: str):
    """y = If(cond, then: x * 2 (via a Constant node inside the branch), else: Relu(x)) + 1, where cond is
    `sr == 16000` (an input, `pinned` gives it a value) or `Shape(x)[1] == 4` (fixed by the input shape)."""
    then_g = helper.make_graph(
        [helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.array(2, np.float32))),
         helper.make_node("Mul", ["x", "two"], ["t_out"], name="then_mul")],
        "then", [], [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Relu", ["x"], ["e_out"], name="else_relu")], "else", [],
                               [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, None)])
    nodes, inputs = [], [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])]
    inits = [numpy_helper.from_array(np.array(1, np.float32), "one")]
    if cond_from == "input":
        inputs.append(helper.make_tensor_value_info("sr", TensorProto.INT64, []))
        inits.append(numpy_helper.from_array(np.array(16000, np.int64), "rate"))
        nodes.append(helper.make_node("Equal", ["sr", "rate"], ["cond"], name="eq"))
    else:
        inits += [numpy_helper.from_array(np.array(1, np.int64), "i1"),
                  numpy_helper.from_array(np.array(4, np.int64), "four")]
        nodes += [helper.make_node("Shape", ["x"], ["shp"], name="shape"),
                  helper.make_node("Gather", ["shp", "i1"], ["dim"], name="gather", axis=0),
                  helper.make_node("Equal", ["dim", "four"], ["cond"], name="eq")]
    nodes += [helper.make_node("If", ["cond"], ["branch"], name="if", then_branch=then_g, else_branch=else_g),
              helper.make_node("Identity", ["branch"], ["ident"], name="ident"),
              helper.make_node("Add", ["ident", "one"], ["y"], name="add")]
    g = helper.make_graph(nodes, "if", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("cond_from", ["input", "shape"])
def test_if_with_a_constant_condition_is_folded(tmp_path, cond_from):
    path = str(tmp_path / "if.onnx")
    onnx.save(_if_model(cond_from), path)
    x = np.array([[-1.0, 0.5, 2.0, -3.0]], np.float32)
    if cond_from == "input":
        with pytest.raises(UnsupportedError, match="'if' \\(If, opset 16\\): the condition 'cond' is computed at run"):
            import_onnx(path, {"x": [1, 4]})
        path = RUN.cases.pin_input(path, str(tmp_path / "pinned.onnx"), "sr", np.array(16000, np.int64))
    graph = import_onnx(path, {"x": [1, 4]})
    assert "If" not in {str(n.type) for n in graph.nodes}
    assert "then_mul" in [n.name for n in graph.nodes]
    got = graph.forward([torch.from_numpy(x)])[0].numpy()
    np.testing.assert_allclose(got, x * 2 + 1)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ref)


def test_loops_are_refused_with_a_clear_error(tmp_path):
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Relu", ["v_in"], ["v_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1, 2])])
    g = helper.make_graph([helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=body)], "loop",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
                          initializer=[numpy_helper.from_array(np.array(3, np.int64), "n")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    path = str(tmp_path / "loop.onnx")
    onnx.save(model, path)
    with pytest.raises(UnsupportedError, match="'loop' \\(Loop, opset 16\\): loops are not supported"):
        import_onnx(path)


def test_input_value_pins_an_input_in_import_and_cfg(tmp_path):
    """`input_value` (cfg) / `--input-value` (quantopt import) fix an input to a constant, so an If on it folds."""
    from quantopt.cli import main
    path = str(tmp_path / "if.onnx")
    onnx.save(_if_model("input"), path)
    x = np.array([[-1.0, 0.5, 2.0, -3.0]], np.float32)
    graph = import_onnx(path, {"x": [1, 4]}, input_values={"sr": [16000]})
    assert "If" not in {str(n.type) for n in graph.nodes}
    np.testing.assert_allclose(graph.forward([torch.from_numpy(x)])[0].numpy(), x * 2 + 1)
    assert main(["import", path, "-o", str(tmp_path / "ir"), "--input-shape", "x:1,4",
                 "--input-value", "sr:16000"]) == 0
    assert (tmp_path / "ir" / "if.txt").is_file()
    assert main(["import", path, "-o", str(tmp_path / "bad"), "--input-value", "nope:1"]) == 2
    assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").iterdir())


def test_silero_vad_quantizes_from_the_packaged_file_with_input_value(tmp_path):
    from quantopt.cli import main
    case = CASES["silero_vad"]
    reason = case.available()
    if reason:
        pytest.skip(reason)
    package, rel = RUN.cases.PACKAGED["silero_vad"]
    packaged = str(RUN.cases.packaged_file(package, rel))
    pinned = case.make_onnx(str(tmp_path))
    feeds = case.make_feeds(pinned, np.random.default_rng(0), 4)
    graph = import_onnx(packaged, case.shapes, input_values={"sr": [RUN.cases.VAD_RATE]})
    cfg = RUN.write_cfg(case, packaged, RUN.write_calibration(graph, feeds, str(tmp_path)), str(tmp_path))
    Path(cfg).write_text(Path(cfg).read_text() + f"input_value = sr:{RUN.cases.VAD_RATE}\n")
    assert main(["--cfg", cfg]) == 0
    assert (tmp_path / "out" / "silero_vad_o.txt").is_file()
