"""The methods the accuracy benchmark compares on one model: float (onnxruntime fp32), onnxruntime's quantize_static
(MinMax, Percentile, Entropy), NNCF, and quantopt recipes evaluated with quantopt's own integer forward.

Each method gets the same calibration feeds and is scored on the same evaluation feeds by the model's task
(`Task.score`). Times are CPU seconds of this process (time.process_time): the machine is shared, and the driver
pins the process to one core, so every runtime computes on one thread.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from quantopt.config.presets import preset_settings

Feeds = Dict[str, np.ndarray]
Outputs = List[np.ndarray]
Scorer = Callable[[List[Outputs], List[Outputs]], Dict[str, float]]


@dataclass
class Task:
    """One model with its data. `score(outputs, float_outputs)` gives the metrics of one method from its outputs on
    the evaluation feeds (and the float model's, for metrics measured against float); `metric` names the headline
    metric among them and `higher_is_better` its direction."""
    name: str
    onnx_path: Path
    shapes: Dict[str, List[int]]
    calib: List[Feeds]
    eval: List[Feeds]
    score: Scorer
    metric: str
    higher_is_better: bool
    extra: Dict[str, str] = field(default_factory=dict)
    nncf_model_type: Optional[str] = None
    ort_exclude: List[str] = field(default_factory=list)
    recipes: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    """quantopt recipes of this model only (as QUANTOPT_RECIPES), run after the common ones."""


@dataclass
class Row:
    """One line of the result table."""
    model: str
    method: str
    metrics: Dict[str, float] = field(default_factory=dict)
    headline: Optional[float] = None
    gap: Optional[float] = None
    quantize_s: Optional[float] = None
    eval_ms: Optional[float] = None
    note: str = ""


class Unavailable(Exception):
    """A method or model whose optional package is missing: reported as a row with the reason, not a failure."""


PER_CHANNEL = {"q_mode_weight": "per_channel_symmetric_restricted_range"}
QUANTOPT_RECIPES: Dict[str, Dict[str, Any]] = {
    "default": {},
    "preset = accurate": preset_settings("accurate"),
    "per-channel w": PER_CHANNEL,
    "per-channel w + extrema": {**PER_CHANNEL, "q_strategy_activation": "extrema"},
    "per-channel w + kld": {**PER_CHANNEL, "q_strategy_activation": "kld"},
    "per-channel w + mse": {**PER_CHANNEL, "q_strategy_activation": "mse"},
    "per-channel w + quantile": {**PER_CHANNEL, "q_strategy_activation": "quantile[99.99]"},
    "per-channel w + 16-bit act": {**PER_CHANNEL, "q_bits_activation": 16, "lut_items_in_bits": 10},
}
"""quantopt settings shown side by side, as LayerSettings fields (the per-layer JSON's names: q_mode_weight is the
cfg's quantize_method_for_weight, q_strategy_activation calibration_strategy_for_activation, q_bits_activation
activation_bits; docs/user-guide.md). The key
PER_TYPE holds overrides per operator type (`{"Sqrt": {"activation_bits": 16}}`), what the cfg's per-layer syntax
`activation_bits = 8 & <[Sqrt]:16>` does."""
PER_TYPE = "per operator type"

ORT_METHODS = ["MinMax", "Percentile", "Entropy"]


# ------------------------------------------------------------------------------------------------------ onnxruntime
def ort_session(path: Path | str) -> Any:
    """A one-thread onnxruntime session, so its times compare with quantopt's single-thread forward."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_ort(path: Path | str, feeds: Sequence[Feeds]) -> tuple:
    """(outputs per feed, CPU ms per feed) of an ONNX file, after one warm-up run."""
    sess = ort_session(path)
    names = {i.name for i in sess.get_inputs()}
    sess.run(None, {k: v for k, v in feeds[0].items() if k in names})
    start = time.process_time()
    outs = [sess.run(None, {k: v for k, v in f.items() if k in names}) for f in feeds]
    return outs, (time.process_time() - start) / len(feeds) * 1e3


class _Reader:
    """onnxruntime's CalibrationDataReader over a list of feeds, with the `set_range` that `CalibStridedMinMax` uses
    to calibrate chunk by chunk (the histogram calibrators merge each chunk's histograms)."""

    def __init__(self, feeds: Sequence[Feeds], names: Sequence[str]) -> None:
        self.feeds = [{k: v for k, v in f.items() if k in names} for f in feeds]
        self.start, self.end, self.pos = 0, len(self.feeds), 0

    def __len__(self) -> int:
        return len(self.feeds)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.start, self.end, self.pos = start_index, end_index, start_index

    def get_next(self) -> Optional[Feeds]:
        if self.pos >= self.end:
            return None
        self.pos += 1
        return self.feeds[self.pos - 1]

    def rewind(self) -> None:
        self.pos = self.start


def chunk_size(n: int, most: int) -> int:
    """The largest divisor of n that is at most `most`: onnxruntime requires the stride to divide the data."""
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def prepare_for_ort(task: Task, folder: Path) -> Path:
    """The float model as onnxruntime's quantizer wants it: opset >= 13 (per-channel QDQ) and pre-processed by
    quant_pre_process (symbolic shape inference skipped: it fails on PP-OCRv4 rec and BERT exports)."""
    import onnx
    from onnx import version_converter
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out = folder / f"{task.name}.ortprep.onnx"
    if out.is_file():
        return out
    model = onnx.load(str(task.onnx_path))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    src = task.onnx_path
    if opset < 13:
        model = version_converter.convert_version(model, 13)
        src = folder / f"{task.name}.opset13.onnx"
        onnx.save(model, str(src))
    quant_pre_process(str(src), str(out), skip_symbolic_shape=True)
    return out


def quantize_ort(task: Task, method: str, folder: Path, chunk: int) -> Path:
    """onnxruntime quantize_static, QDQ, uint8 asymmetric activations and int8 per-channel symmetric weights (its
    advice for x86 CPUs), calibrated on the task's calibration feeds in chunks of at most `chunk` samples."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    src = prepare_for_ort(task, folder)
    names = [i.name for i in ort_session(src).get_inputs()]
    out = folder / f"{task.name}.ort_{method.lower()}.onnx"
    extra: Dict[str, Any] = {"CalibStridedMinMax": chunk_size(len(task.calib), chunk)}
    if method == "Percentile":
        extra["CalibPercentile"] = 99.999
    quantize_static(str(src), str(out), _Reader(task.calib, names), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=getattr(CalibrationMethod, method), nodes_to_exclude=task.ort_exclude or None,
                    extra_options=extra)
    return out


# ------------------------------------------------------------------------------------------------------ NNCF
def quantize_nncf(task: Task, folder: Path) -> Path:
    """nncf.quantize on the ONNX model with its defaults (the transformer model type where the task names it)."""
    try:
        import nncf
        import onnx
        from nncf.common.logging.logger import set_log_level
    except ImportError as e:
        raise Unavailable(f"nncf is not installed ({e}); pip install -c constraints.txt nncf") from e
    set_log_level(logging.WARNING)
    src = prepare_for_ort(task, folder)
    model = onnx.load(str(src))
    names = {i.name for i in model.graph.input}
    data = nncf.Dataset([{k: v for k, v in f.items() if k in names} for f in task.calib])
    kwargs: Dict[str, Any] = {"subset_size": len(task.calib)}
    if task.nncf_model_type:
        kwargs["model_type"] = getattr(nncf.ModelType, task.nncf_model_type)
    quantized = nncf.quantize(model, data, **kwargs)
    out = folder / f"{task.name}.nncf.onnx"
    onnx.save(quantized, str(out))
    return out


# ------------------------------------------------------------------------------------------------------ quantopt
def import_quantopt(task: Task) -> Any:
    """The float graph made by quantopt's own ONNX importer (docs/onnx.md)."""
    import quantopt.ops  # noqa: F401  (registers the operators)
    from quantopt.frontends.onnx import import_onnx

    return import_onnx(str(task.onnx_path), task.shapes)


def _batch(graph: Any, feed: Feeds) -> list:
    import torch

    return [torch.from_numpy(np.ascontiguousarray(feed[t.name[:-2]])) for t in graph.input_tensors]


def quantize_quantopt(graph: Any, task: Task, recipe: Dict[str, Any]) -> Any:
    """quantopt.pipeline.quantize_model on a clone of the float graph (the float graph is reused by every recipe;
    copy.deepcopy would not do: see docs/accuracy.md)."""
    from quantopt.pipeline import quantize_model

    work = graph.clone()
    settings = {k: v for k, v in recipe.items() if k != PER_TYPE}
    by_type = {k.lower(): v for k, v in recipe.get(PER_TYPE, {}).items()}
    per_layer = {n.name: by_type[str(n.type).lower()] for n in work.nodes if str(n.type).lower() in by_type}
    return quantize_model(work, [_batch(work, f) for f in task.calib], settings=settings, per_layer=per_layer)


def run_quantopt(qgraph: Any, feeds: Sequence[Feeds]) -> tuple:
    """(dequantized outputs per feed, CPU ms per feed) of quantopt's exact integer forward, batch 1."""
    import torch

    from quantopt.pipeline import run_quantized

    outs = []
    start = time.process_time()
    with torch.no_grad():
        for f in feeds:
            got = run_quantized(qgraph, _batch(qgraph, f))
            outs.append([o.detach().cpu().numpy().astype(np.float32).copy() for o in got])
    return outs, (time.process_time() - start) / len(feeds) * 1e3


# ------------------------------------------------------------------------------------------------------ one model
def headline(task: Task, metrics: Dict[str, float], base: Optional[float]) -> tuple:
    value = metrics.get(task.metric)
    if value is None or base is None or not math.isfinite(value):
        return value, None
    return value, value - base


def evaluate(task: Task, methods: Sequence[str], recipes: Sequence[str], folder: Path, chunk: int,
             log: Callable[[str], None]) -> List[Row]:
    """Every requested method on one task: the float row first (the reference of every gap), then the peers, then
    quantopt's recipes. A failing method is one row with its error; the others still run."""
    folder.mkdir(parents=True, exist_ok=True)
    rows: List[Row] = []
    float_outs, float_ms = run_ort(task.onnx_path, task.eval)
    float_metrics = task.score(float_outs, float_outs)
    base = float_metrics.get(task.metric)
    rows.append(Row(task.name, "float (onnxruntime fp32)", float_metrics, base, 0.0, 0.0, float_ms))
    log(_line(rows[-1]))

    def record(method: str, quantize: Callable[[], Any], run: Callable[[Any], tuple]) -> None:
        try:
            start = time.process_time()
            made = quantize()
            q_s = time.process_time() - start
            outs, ms = run(made)
            metrics = task.score(outs, float_outs)
            value, gap = headline(task, metrics, base)
            rows.append(Row(task.name, method, metrics, value, gap, q_s, ms))
        except Unavailable as e:
            rows.append(Row(task.name, method, note=f"skipped: {e}"))
        except Exception as e:  # noqa: BLE001  (one failing method is reported; the others still run)
            rows.append(Row(task.name, method, note=f"FAILED: {type(e).__name__}: {' '.join(str(e).split())[:300]}"))
        log(_line(rows[-1]))

    for m in methods:
        if m in ORT_METHODS:
            record(f"onnxruntime {m}", lambda m=m: quantize_ort(task, m, folder, chunk),
                   lambda path: run_ort(path, task.eval))
        elif m == "nncf":
            record("NNCF", lambda: quantize_nncf(task, folder), lambda path: run_ort(path, task.eval))
    if recipes:
        start = time.process_time()
        try:
            graph = import_quantopt(task)
        except Exception as e:  # noqa: BLE001  (an import failure is reported as one row)
            rows.append(Row(task.name, "quantopt import", note=f"FAILED: {type(e).__name__}: {e}"))
            log(_line(rows[-1]))
            return rows
        import_s = time.process_time() - start
        log(f"  quantopt import: {import_s:.1f} s CPU, {len(graph.nodes)} layers")
        chosen = {**{r: QUANTOPT_RECIPES[r] for r in recipes}, **task.recipes}
        for r, recipe in chosen.items():
            record(f"quantopt {r}", lambda recipe=recipe: quantize_quantopt(graph, task, recipe),
                   lambda qgraph: run_quantopt(qgraph, task.eval))
    return rows


def _line(row: Row) -> str:
    if row.note:
        return f"  {row.method}: {row.note}"
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in row.metrics.items())
    return f"  {row.method}: {metrics} (quantize {row.quantize_s:.1f} s, {row.eval_ms:.1f} ms/sample)"
