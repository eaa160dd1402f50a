"""Outputs do not depend on the thread count (docs/architecture.md, "Float reference"; quantopt/threads.py).

`quantopt --cfg` runs in fresh interpreters with OMP_NUM_THREADS / MKL_NUM_THREADS and torch's intra-op threads at 1
and at 2, on the bundled digits example, on a cfg with global calibration methods (and a moments-based activation
strategy) and on small ONNX models imported through `graph = model.onnx` (one built here, and
tests/data/onnx_small/mobilenetv3_block.onnx when present): every written file is byte-identical
(the report JSON without its timings and file paths; the log and the HTML report hold timings and are left out).
In process, the float and integer forwards of operators whose kernels split work across threads, and the sums that
calibration and the precision analysis make, give bitwise-identical results at 1 and 2 threads. Nothing here pins
the thread count for the rest of the session: every change is undone in a `finally`.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch

from quantopt.analysis.similarity import cosine, mse
from quantopt.calibration.statistics import StatisticsConfig, update_statistics
from quantopt.config.layer_settings import LayerSettings
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.graph.tables import TensorStatistics
from quantopt.pipeline import quantize_model, run_quantized

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
THREADS = (1, 2)

RUNNER = """
import sys
import torch
torch.set_num_threads(int(sys.argv[1]))
from quantopt.cli import main
for cfg in sys.argv[2:]:
    rc = main(["--cfg", cfg])
    if rc != 0:
        sys.exit(f"quantopt --cfg {cfg} exited with {rc}")
"""
"""Runs each cfg given after the thread count, in this order, in one interpreter."""

GLOBAL_CFG = """[Common]
graph = {digits}/model/digits.txt
bin = {digits}/model/digits.bin
model_name = digits_global
dataset = NumpyDataset
calibration_data = {digits}/data/calib.npy
calibration_batch_size = 64
calibration_strategy_for_activation = 3std
global_calibration = bias_correction[1] & easy_quant[1,1,0.5,2,4,0] & adaround[1,1,16,0.01] & gptq_zy[1] & \
svd_quant[1] & adaquant_zy[1,1,16]
output_dir = out_global
"""
"""Digits with one calibration batch of 64 (layer outputs of 65536 values: torch splits their full sums across
threads) and methods that sum, factorize (gptq_zy, svd_quant), take FFTs (svd_quant) and learn (adaround,
adaquant_zy)."""

ONNX_CFG = """[Common]
graph = {graph}
model_name = {name}
dataset = NumpyDataset
calibration_data = calib.npy
calibration_batch_size = 8
output_dir = out_{name}
"""
MOBILENET = REPO / "tests" / "data" / "onnx_small" / "mobilenetv3_block.onnx"
"""A small ONNX export of the repository's test data (input [1, 3, 32, 32]), run when present."""

VOLATILE_KEYS = ("steps", "files")
"""Report JSON keys that hold timings or absolute paths (with every key naming a time or seconds)."""


# ------------------------------------------------------------------------------------------------ helpers
def at_each_thread_count(fn: Callable[[], Any]) -> List[Any]:
    """fn() run at 1 and at 2 torch threads; the previous count is restored afterwards."""
    previous = torch.get_num_threads()
    results = []
    try:
        for n in THREADS:
            torch.set_num_threads(n)
            results.append(fn())
    finally:
        torch.set_num_threads(previous)
    return results


def _flat(value: Any) -> List[torch.Tensor]:
    """Every tensor of a nested result, as CPU tensors (floats as tensors too)."""
    if isinstance(value, torch.Tensor):
        return [value.detach().cpu()]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in _flat(value[k])]
    if value is None:
        return []
    return [torch.tensor(value, dtype=torch.float64)]


def assert_bitwise_equal(a: Any, b: Any, what: str) -> None:
    ta, tb = _flat(a), _flat(b)
    assert len(ta) == len(tb), what
    for i, (x, y) in enumerate(zip(ta, tb)):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: result {i}"
        same = torch.equal(x, y) or (x.is_floating_point() and torch.equal(x.isnan(), y.isnan())
                                     and torch.equal(x.nan_to_num(), y.nan_to_num()))
        assert same, f"{what}: result {i} differs between 1 and 2 threads in {int((x != y).sum())} element(s)"


def _normalized_report(path: Path) -> Any:
    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items()
                    if k not in VOLATILE_KEYS and "time" not in k and "seconds" not in k}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v

    return strip(json.loads(path.read_text()))


# ------------------------------------------------------------------------------------------------ workflows
def _small_onnx(folder: Path) -> None:
    """model.onnx: conv(RELU) -> depthwise conv(RELU) -> add -> mean over H, W -> Gemm -> Softmax on a [1, 3, 32, 32]
    input; calib.npy: 16 calibration samples (which the mobilenetv3_block model takes too)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    r = np.random.default_rng(5)

    def init(name: str, value: np.ndarray) -> Any:
        return numpy_helper.from_array(value.astype(np.float32), name)

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], group=16),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Add", ["r1", "r2"], ["s"]),
             helper.make_node("ReduceMean", ["s"], ["m"], axes=[2, 3], keepdims=0),
             helper.make_node("Gemm", ["m", "w3", "b3"], ["g"], transB=1),
             helper.make_node("Softmax", ["g"], ["y"], axis=-1)]
    inits = [init("w1", r.normal(0, 0.3, (16, 3, 3, 3))), init("b1", r.normal(0, 0.1, 16)),
             init("w2", r.normal(0, 0.3, (16, 1, 3, 3))), init("b2", r.normal(0, 0.1, 16)),
             init("w3", r.normal(0, 0.3, (10, 16))), init("b3", r.normal(0, 0.1, 10))]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(folder / "model.onnx"))
    np.save(folder / "calib.npy", r.normal(0.2, 1.0, (16, 3, 32, 32)).astype(np.float32))


def _prepare(folder: Path) -> Dict[str, Tuple[str, str]]:
    """The cfgs of one run in `folder`: workflow -> (cfg path, output folder)."""
    folder.mkdir()
    shutil.copytree(DIGITS, folder / "digits", ignore=shutil.ignore_patterns("opt_log*", "*.py", "*.md"))
    cfg, found = re.subn(r"^output_dir\s*=.*$", "output_dir = ./out", (folder / "digits" / "opt.cfg").read_text(),
                         flags=re.MULTILINE)
    assert found == 1, "examples/digits/opt.cfg has no output_dir line"
    (folder / "digits" / "opt.cfg").write_text(cfg)
    (folder / "global.cfg").write_text(GLOBAL_CFG.format(digits=(folder / "digits").as_posix()))
    cfgs = {"digits": ("digits/opt.cfg", "digits/out"), "global calibration": ("global.cfg", "out_global")}
    if importlib.util.find_spec("onnx") is not None:
        _small_onnx(folder)
        (folder / "onnx.cfg").write_text(ONNX_CFG.format(graph="model.onnx", name="small_onnx"))
        cfgs["onnx"] = ("onnx.cfg", "out_small_onnx")
        if MOBILENET.is_file():
            (folder / "mobilenet.cfg").write_text(ONNX_CFG.format(graph=MOBILENET.as_posix(), name="mobilenet"))
            cfgs["onnx mobilenetv3_block"] = ("mobilenet.cfg", "out_mobilenet")
    return cfgs


@pytest.fixture(scope="module")
def workflow_runs(tmp_path_factory) -> Iterator[Tuple[Dict[str, Tuple[str, str]], Dict[int, Path]]]:
    """Every workflow run once per thread count, each thread count in its own interpreter and folder."""
    base = tmp_path_factory.mktemp("threads")
    folders = {n: base / f"threads_{n}" for n in THREADS}
    cfgs: Dict[str, Tuple[str, str]] = {}
    for n, folder in folders.items():
        cfgs = _prepare(folder)
        # a passive OpenMP wait changes no result, only keeps idle threads from spinning on busy shared cores
        env = dict(os.environ, OMP_NUM_THREADS=str(n), MKL_NUM_THREADS=str(n), QUANTOPT_PROGRESS="0",
                   OMP_WAIT_POLICY="PASSIVE")
        done = subprocess.run([sys.executable, "-c", RUNNER, str(n)] + [c for c, _ in cfgs.values()], cwd=folder,
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{n} thread(s):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    yield cfgs, folders


@pytest.mark.parametrize("workflow", ["digits", "global calibration", "onnx", "onnx mobilenetv3_block"])
def test_written_files_are_identical_at_1_and_2_threads(workflow_runs, workflow: str) -> None:
    cfgs, folders = workflow_runs
    if workflow not in cfgs:
        pytest.skip(f"the optional dependency 'onnx' is not installed or {MOBILENET} is absent")
    outs = [folders[n] / cfgs[workflow][1] for n in THREADS]
    names = [sorted(p.name for p in out.iterdir()) for out in outs]
    assert names[0] == names[1]
    compared = []
    for name in names[0]:
        if name.endswith((".log", ".html")):
            continue
        a, b = (out / name for out in outs)
        if name.endswith("_report.json"):
            assert _normalized_report(a) == _normalized_report(b), f"{workflow}: {name}"
        else:
            assert a.read_bytes() == b.read_bytes(), f"{workflow}: {name} differs between 1 and 2 threads"
        compared.append(name)
    assert any(n.endswith("_o.txt") for n in compared) and any(n.endswith("_o.bin") for n in compared)
    assert any(n.endswith("_opt_template.json") for n in compared) and any(n.endswith("_report.json") for n in compared)


# ------------------------------------------------------------------------------------------------ operators
GEO = dict(kernel_x=3, kernel_y=3, stride_x=1, stride_y=1, pad_left=1, pad_right=1, pad_top=1, pad_bottom=1,
           dilation_x=1, dilation_y=1)
Case = Tuple[PyGraph, List[List[int]]]
"""A one-layer graph and the shapes of the inputs it is run on."""


def _f32(r: np.random.Generator, shape: Sequence[int], loc: float = 0.0, std: float = 1.0) -> np.ndarray:
    return r.normal(loc, std, size=list(shape)).astype(np.float32)


def _conv(depthwise: bool) -> Case:
    r = np.random.default_rng(1)
    c_in, c_out = (128, 128) if depthwise else (32, 32)
    g = GraphBuilder("conv")
    x = g.input("x", [1, 64, 64, c_in])
    y = g.layer("DepthwiseConv" if depthwise else "Convolution", [x], [[1, 64, 64, c_out]], name="op",
                params=dict(num_output=c_out, group=c_in if depthwise else 1, with_activation="NONE", **GEO),
                constants={"weights": _f32(r, [c_out, 3, 3, 1 if depthwise else c_in], std=0.1),
                           "biases": _f32(r, [c_out], std=0.1)})
    return g.build([y]), [[2, 64, 64, c_in]]


def _pointwise() -> Case:
    """A wide 1x1 convolution: oneDNN's float32 kernel splits its sums by the thread count at this size."""
    r = np.random.default_rng(5)
    g = GraphBuilder("pointwise")
    x = g.input("x", [1, 12, 80, 240])
    y = g.layer("Convolution", [x], [[1, 12, 80, 240]], name="op",
                params=dict(num_output=240, group=1, kernel_y=1, kernel_x=1, with_activation="NONE"),
                constants={"weights": _f32(r, [240, 1, 1, 240], std=0.05), "biases": _f32(r, [240], std=0.1)})
    return g.build([y]), [[2, 12, 80, 240]]


def _fc() -> Case:
    r = np.random.default_rng(2)
    g = GraphBuilder("fc")
    x = g.input("x", [1, 64, 256])
    y = g.layer("FullyConnected", [x], [[1, 64, 128]], name="op", params=dict(num_output=128, with_activation="NONE"),
                constants={"weights": _f32(r, [128, 256], std=0.05), "biases": _f32(r, [128], std=0.1)})
    return g.build([y]), [[4, 64, 256]]


def _matmul() -> Case:
    g = GraphBuilder("matmul")
    a, b = g.input("a", [1, 128, 256]), g.input("b", [1, 256, 128])
    return g.build([g.layer("MatMul", [a, b], [[1, 128, 128]], name="op", params={})]), [[4, 128, 256],
                                                                                          [4, 256, 128]]


def _one(optype: str, params: Dict[str, Any], shape: List[int], out_shape: List[int], batch: int,
         constants: Optional[Dict[str, np.ndarray]] = None) -> Case:
    g = GraphBuilder(optype.lower())
    x = g.input("x", [1] + shape[1:])
    y = g.layer(optype, [x], [out_shape], name="op", params=params, constants=constants or {})
    return g.build([y]), [[batch] + shape[1:]]


def _affine(n: int) -> Dict[str, np.ndarray]:
    r = np.random.default_rng(3)
    return {"weights": _f32(r, [n], loc=1.0, std=0.1), "biases": _f32(r, [n], std=0.1)}


def _recurrent(optype: str) -> Case:
    """A BasicLSTM or GRUv3 cell (tests/ops/test_recurrent.py): its integer steps run on numpy arrays."""
    ops_tests = str(Path(__file__).resolve().parent / "ops")
    if ops_tests not in sys.path:
        sys.path.insert(0, ops_tests)
    from test_recurrent import IN, C, T, build, gru_weights, lstm_weights

    _, w, b = lstm_weights(0) if optype == "BasicLSTM" else gru_weights(0, "GRUV3")
    shapes = [[3, T, IN], [1, C]] + ([[1, C]] if optype == "BasicLSTM" else [])
    return build(optype, {}, w, b), shapes


CASES: Dict[str, Callable[[], Case]] = {
    "BasicLSTM": lambda: _recurrent("BasicLSTM"),
    "GRUv3": lambda: _recurrent("GRUv3"),
    "Convolution": lambda: _conv(False),
    "Convolution 1x1 wide": _pointwise,
    "DepthwiseConv": lambda: _conv(True),
    "FullyConnected": _fc,
    "MatMul": _matmul,
    "Reduce MEAN per channel": lambda: _one("Reduce", dict(method="MEAN", axis=[1, 2], keepdims=True),
                                            [1, 64, 64, 128], [1, 1, 1, 128], 2),
    "Reduce SUM to one value": lambda: _one("Reduce", dict(method="SUM", axis=[1, 2, 3], keepdims=True),
                                            [1, 64, 64, 128], [1, 1, 1, 1], 1),
    "Reduce VARIANCE to one value": lambda: _one("Reduce", dict(method="VARIANCE", axis=[1, 2, 3], keepdims=True),
                                                 [1, 64, 64, 128], [1, 1, 1, 1], 1),
    "Softmax": lambda: _one("Softmax", dict(axis=-1), [1, 64, 4096], [1, 64, 4096], 2),
    "Softmax one row": lambda: _one("Softmax", dict(axis=-1), [1, 65536], [1, 65536], 1),
    "LayerNorm": lambda: _one("LayerNorm", dict(axis=[-1], epsilon=1e-5), [1, 64, 4096], [1, 64, 4096], 2,
                              _affine(4096)),
    "LayerNorm one row": lambda: _one("LayerNorm", dict(axis=[1, 2], epsilon=1e-5), [1, 256, 256], [1, 256, 256],
                                      1),
}


def _forwards(build: Callable[[], Case], fc_sum: str = "upstream", reference: str = "exact") -> Callable[[], tuple]:
    """A function computing, at the current thread count: the float outputs (and kept float64 values), then the
    integer outputs of the graph calibrated and quantized on the same inputs."""
    def run() -> tuple:
        graph, shapes = build()
        r = np.random.default_rng(4)
        xs = [torch.from_numpy(_f32(r, s, loc=0.2)) for s in shapes]
        for n in graph.nodes:
            n.settings = LayerSettings(fc_float_summation=fc_sum, float_reference=reference)
        with torch.no_grad():
            outs = [t.clone() for t in graph.forward(list(xs))]
        unrounded = [w for w in map(graph.wide_values.get, graph.output_tensors) if w is not None]
        q = quantize_model(graph, [xs], settings={"fc_float_summation": fc_sum, "float_reference": reference})
        return outs, unrounded, run_quantized(q, list(xs))

    return run


@pytest.mark.parametrize("case", list(CASES))
def test_operator_forwards_are_identical_at_1_and_2_threads(case: str) -> None:
    one, two = at_each_thread_count(_forwards(CASES[case]))
    assert_bitwise_equal(one, two, case)


def test_fully_connected_float64_summation_is_identical_at_1_and_2_threads() -> None:
    one, two = at_each_thread_count(_forwards(_fc, fc_sum="float64"))
    assert_bitwise_equal(one, two, "FullyConnected, fc_float_summation = float64")


@pytest.mark.parametrize("case", ["Convolution", "Convolution 1x1 wide", "DepthwiseConv", "FullyConnected"])
def test_native_float_reference_is_identical_at_1_and_2_threads(case: str) -> None:
    """`float_reference = native` runs torch's float32 kernels, some of which (oneDNN's convolutions) split their
    sums by the thread count: they run on one thread (ops/conv.py, ops/linear.py)."""
    one, two = at_each_thread_count(_forwards(CASES[case], reference="native"))
    assert_bitwise_equal(one, two, f"{case}, float_reference = native")


# ------------------------------------------------------------------------------------------------ sums
def test_similarity_statistics_and_svd_sums_are_identical_at_1_and_2_threads() -> None:
    """The precision analysis' cosine/MSE, the per-tensor moments of the statistics pass and svd_quant's denoised
    range (an eigendecomposition), on 2^18 values."""
    r = np.random.default_rng(6)
    a = torch.from_numpy(_f32(r, [4, 64, 64, 16], loc=0.3))
    b = a + torch.from_numpy(_f32(r, [4, 64, 64, 16], std=0.01))
    svd_quant = importlib.import_module("quantopt.tuning.global_methods.svd_quant")

    def sums() -> tuple:
        stats = TensorStatistics()
        cfg = StatisticsConfig(momentum=0.9, histc_bins=2048, need_histogram=False, need_moments=True, key_axis=3)
        update_statistics(stats, a, cfg, 0)
        moments = [getattr(stats, name) for name in sorted(vars(stats)) if "mean" in name or "std" in name
                   or "mad" in name]
        return cosine(a, b), mse(a, b), moments, svd_quant._denoised_range(a, 0.09)

    one, two = at_each_thread_count(sums)
    assert_bitwise_equal(one, two, "cosine, mse, moments and denoised range")


def _mac_model() -> PyGraph:
    """conv(RELU) -> conv -> FC over the channels: conv outputs of 36864 values for a batch of 9."""
    r = np.random.default_rng(7)
    g = GraphBuilder("mac")
    x = g.input("x", [1, 16, 16, 8])
    a = g.layer("Convolution", [x], [[1, 16, 16, 16]], name="c1", params=dict(num_output=16, group=1,
                with_activation="RELU", **GEO), constants={"weights": _f32(r, [16, 3, 3, 8], std=0.3),
                                                           "biases": _f32(r, [16], std=0.1)})
    b = g.layer("Convolution", [a], [[1, 16, 16, 16]], name="c2", params=dict(num_output=16, group=1,
                with_activation="NONE", **GEO), constants={"weights": _f32(r, [16, 3, 3, 16], std=0.2),
                                                           "biases": _f32(r, [16], std=0.1)})
    y = g.layer("FullyConnected", [b], [[1, 16, 16, 8]], name="fc", params=dict(num_output=8, with_activation="NONE"),
                constants={"weights": _f32(r, [8, 16], std=0.3), "biases": _f32(r, [8], std=0.1)})
    return g.build([y])


def test_global_calibration_is_identical_at_1_and_2_threads() -> None:
    """Methods that factorize (gptq_zy), take FFTs (svd_quant) and compare cosines (easy_quant) on full sums."""
    r = np.random.default_rng(8)
    data = [torch.from_numpy(_f32(r, [9, 16, 16, 8], loc=0.5))]
    spec = "gptq_zy[1] & svd_quant[1] & easy_quant[1,1,0.5,2,2,0]"

    def run() -> tuple:
        g = _mac_model()
        q = quantize_model(g, data, settings={"q_bits_weight": 4}, global_calibration=spec)
        consts = {(n.name, k): t.betensor for n in q.nodes for k, t in n.constants.items()}
        ranges = [(q.ranges.get(t).min, q.ranges.get(t).max, q.quant.get(t).scale, q.quant.get(t).zerop)
                  for n in q.nodes for t in n.outputs]
        return consts, ranges, run_quantized(q, data[0])

    one, two = at_each_thread_count(run)
    assert_bitwise_equal(one, two, spec)
