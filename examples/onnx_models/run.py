"""Import, check and quantize real ONNX models end to end.

For every model of cases.py (skipping those whose optional package is missing):

1. produce the .onnx (export from torch, pin Silero's `sr` input, or locate the packaged file);
2. float check: the imported float graph against onnxruntime on the same seeded inputs, as the max abs error
   over all outputs and samples divided by the output's range (max - min over the samples);
3. write calibration data (.npy / .npz) and a cfg with `graph = <model>.onnx` and `input_shape`, and run
   `quantopt --cfg` on it;
4. quantized check: the written quantized IR run on held-out inputs, each output dequantized and compared with
   onnxruntime by cosine similarity; and the lowest per-layer isolated cosine of the run's report.

    python examples/onnx_models/run.py [-o DIR] [--calib N] [--val N] [--det-size S] [--rec-width W] [MODEL ...]

prints one Markdown table row per model (the table in docs/onnx-models.md).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_cases():
    if "onnx_model_cases" not in sys.modules:
        spec = importlib.util.spec_from_file_location("onnx_model_cases", os.path.join(HERE, "cases.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["onnx_model_cases"] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules["onnx_model_cases"]


cases = _load_cases()


@dataclass
class Result:
    name: str
    layers: int
    float_rel_err: float
    output_range: float
    quant_cosines: Optional[List[float]]
    worst_layer: Optional[Tuple[float, str]]
    seconds: float


def reference_outputs(path: str, feeds: Sequence[Dict[str, np.ndarray]]) -> List[List[np.ndarray]]:
    """onnxruntime outputs per feed."""
    import onnxruntime as ort
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return [sess.run(None, f) for f in feeds]


def _feed_list(graph, feed: Dict[str, np.ndarray]) -> list:
    import torch
    return [torch.from_numpy(np.ascontiguousarray(feed[t.name[:-2]])) for t in graph.input_tensors]


def relative_error(got: Sequence[Sequence[np.ndarray]], ref: Sequence[Sequence[np.ndarray]]) -> Tuple[float, float]:
    """(worst over outputs of max |got - ref| / range(ref), that output's range); per output, all samples."""
    worst, span_of_worst = 0.0, 0.0
    for k in range(len(ref[0])):
        r = np.concatenate([np.asarray(x[k], np.float64).reshape(-1) for x in ref])
        g = np.concatenate([np.asarray(x[k], np.float64).reshape(-1) for x in got])
        span = float(r.max() - r.min())
        err = float(np.abs(g - r).max()) / max(span, 1e-12)
        if err >= worst:
            worst, span_of_worst = err, span
    return worst, span_of_worst


def float_outputs(graph, feeds: Sequence[Dict[str, np.ndarray]]) -> List[List[np.ndarray]]:
    return [[t.numpy().copy() for t in graph.forward(_feed_list(graph, f))] for f in feeds]


def write_calibration(graph, feeds: Sequence[Dict[str, np.ndarray]], folder: str) -> Dict[str, str]:
    """Calibration file + the cfg lines that read it: one .npy for a single batch-first input, else an .npz with
    one array per input (each sample with the full input shape, `without_batch_dim = true`)."""
    names = [t.name[:-2] for t in graph.input_tensors]
    if len(names) == 1 and feeds[0][names[0]].shape[0] == 1:
        path = os.path.join(folder, "calib.npy")
        np.save(path, np.concatenate([f[names[0]] for f in feeds]))
        return {"dataset": "NumpyDataset", "calibration_data": path}
    path = os.path.join(folder, "calib.npz")
    np.savez(path, **{n: np.stack([f[n] for f in feeds]) for n in names})
    return {"dataset": "NumpyMultiInputDataset", "calibration_data": path, "without_batch_dim": "true"}


def write_cfg(case, onnx_path: str, data: Dict[str, str], folder: str) -> str:
    lines = ["[Common]", f"graph = {onnx_path}", f"input_shape = {case.shape_spec()}", f"model_name = {case.name}"]
    settings = dict(cases.COMMON_SETTINGS, **case.settings)
    lines += [f"{k} = {v}" for k, v in list(data.items()) + list(settings.items())]
    lines.append(f"output_dir = {os.path.join(folder, 'out')}")
    path = os.path.join(folder, "opt.cfg")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def quantized_cosines(qtxt: str, feeds: Sequence[Dict[str, np.ndarray]],
                      ref: Sequence[Sequence[np.ndarray]]) -> List[float]:
    """Per output: cosine between the quantized IR's dequantized outputs and onnxruntime, over all samples."""
    import torch

    from quantopt.analysis.similarity import cosine, to_float
    from quantopt.ir.reader import read_ir
    qgraph = read_ir(qtxt)
    outs: List[List[torch.Tensor]] = []
    for f in feeds:
        qgraph.forward(_feed_list(qgraph, f))
        outs.append([to_float(t, qgraph.quant).clone() for t in qgraph.output_tensors])
    result = []
    for k in range(len(ref[0])):
        a = torch.cat([o[k].reshape(-1).to(torch.float64) for o in outs])
        b = torch.cat([torch.from_numpy(np.asarray(r[k], np.float64)).reshape(-1) for r in ref])
        result.append(float(cosine(a, b)))
    return result


def worst_isolated_layer(report: str) -> Tuple[float, str]:
    """(lowest isolated cosine, that layer) from a run's report: each layer fed the float inputs, so a broken layer
    shows here even where the errors accumulated through a deep model dominate the output cosine."""
    import json
    with open(report) as f:
        rows = json.load(f)["similarity"]
    worst = min(rows, key=lambda r: r["isolated_cos"])
    return float(worst["isolated_cos"]), f"{worst['name']} ({worst['type']})"


def run_case(case, folder: str, calib: int = 16, val: int = 4, quantize: bool = True, seed: int = 0) -> Result:
    """Steps 1-4 for one case in `folder`."""
    import quantopt.ops  # noqa: F401  (registers the operators)
    from quantopt.cli import main as quantopt_main
    from quantopt.frontends.onnx import import_onnx
    start = time.time()
    os.makedirs(folder, exist_ok=True)
    path = case.make_onnx(folder)
    rng = np.random.default_rng(seed)
    feeds = case.make_feeds(path, rng, calib + val)
    calib_feeds, val_feeds = feeds[:calib], feeds[calib:]
    graph = import_onnx(path, case.shapes)
    ref = reference_outputs(path, val_feeds)
    err, span = relative_error(float_outputs(graph, val_feeds), ref)
    cos, worst = None, None
    if quantize:
        cfg = write_cfg(case, path, write_calibration(graph, calib_feeds, folder), folder)
        rc = quantopt_main(["--cfg", cfg])
        if rc != 0:
            raise RuntimeError(f"quantopt --cfg {cfg} failed with exit code {rc}")
        cos = quantized_cosines(os.path.join(folder, "out", f"{case.name}_o.txt"), val_feeds, ref)
        worst = worst_isolated_layer(os.path.join(folder, "out", f"{case.name}_report.json"))
    return Result(case.name, len(graph.nodes), err, span, cos, worst, time.time() - start)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", help="model names (default: all available)")
    p.add_argument("-o", "--output-dir", default=os.path.join(HERE, "opt_log"),
                   help="working folder (default: opt_log/ beside this script, ignored by git)")
    p.add_argument("--calib", type=int, default=16, help="calibration samples per model")
    p.add_argument("--val", type=int, default=4, help="held-out samples for the comparisons")
    p.add_argument("--det-size", type=int, default=320, help="PP-OCR detector input height and width")
    p.add_argument("--rec-width", type=int, default=320, help="PP-OCR recognizer input width")
    p.add_argument("--no-quantize", action="store_true", help="only the float check")
    args = p.parse_args(argv)
    all_cases = cases.all_cases(args.det_size, args.rec_width)
    unknown = sorted(set(args.models) - set(all_cases))
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {sorted(all_cases)}")
    print("| model | source | input shapes | IR layers | float max abs err / output range | output range "
          "| quantized output cosine (per output) | worst layer (isolated cosine) | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models or list(all_cases):
        case = all_cases[name]
        reason = case.available()
        if reason:
            print(f"| {name} | skipped: {reason} | | | | | | | |")
            continue
        r = run_case(case, os.path.join(args.output_dir, name), args.calib, args.val, not args.no_quantize)
        cos = "-" if r.quant_cosines is None else " / ".join(f"{c:.4f}" for c in r.quant_cosines)
        worst = "-" if r.worst_layer is None else f"{r.worst_layer[1]}: {r.worst_layer[0]:.4f}"
        print(f"| {name} | {case.origin} | `{case.shape_spec()}` | {r.layers} | {r.float_rel_err:.1e} "
              f"| {r.output_range:.3g} | {cos} | {worst} | {r.seconds:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
