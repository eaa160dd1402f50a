"""Benchmark: onnxruntime inference time of the ONNX QDQ export, exact mode against effective mode.

    python benchmarks/onnx_qdq_speed.py [name ...] [--runs N] [--size S]

For the real ONNX models of examples/onnx_models (default: ppocr_det at S×S, resnet_like, mobilenetv2_like;
those whose package is missing are skipped), quantized on 2 seeded samples: median time of one inference (over at
least N runs and one second, as the cores may be shared) with one onnxruntime thread for the `exact` export
(bit-exact with quantopt) and the `effective` export (float QDQ), and for the float ONNX model itself; the ratio
exact / effective is the price of exactness (docs/onnx-export.md).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

from quantopt.exporters.agreement import require_onnxruntime, runtime_description
from quantopt.exporters.onnx_qdq import build_onnx_qdq
from quantopt.frontends.onnx import import_onnx
from quantopt.pipeline import quantize_model
from quantopt.registry import discover_plugins

REPO = Path(__file__).resolve().parents[1]
DEFAULT_NAMES = ["ppocr_det", "resnet_like", "mobilenetv2_like"]
MIN_SECONDS = 1.0


def _cases() -> Any:
    spec = importlib.util.spec_from_file_location("onnx_model_cases", REPO / "examples" / "onnx_models" / "cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["onnx_model_cases"] = module
    spec.loader.exec_module(module)
    return module


def _time(session: Any, feeds: Dict[str, np.ndarray], runs: int) -> float:
    """Median ms of one inference over at least `runs` runs and MIN_SECONDS: a sub-millisecond model needs many
    runs, and the median ignores the runs another process on the same cores slowed down."""
    session.run(None, feeds)  # warm-up
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < runs or time.perf_counter() - start < MIN_SECONDS:
        begin = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - begin)
    return float(np.median(times)) * 1000.0


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=DEFAULT_NAMES)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--size", type=int, default=320, help="PP-OCR det input size")
    args = ap.parse_args(argv)
    ort = require_onnxruntime()
    discover_plugins()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    print(runtime_description())
    print(f"{'model':<20} {'exact ms':>9} {'effective ms':>13} {'float ms':>9} {'exact/effective':>16}")
    cases = _cases().all_cases(args.size, args.size)
    for name in args.names:
        case = cases[name]
        if case.available() is not None:
            continue
        with tempfile.TemporaryDirectory() as folder:
            path = case.make_onnx(folder)
            graph = import_onnx(path, case.shapes)
            feeds = case.make_feeds(path, np.random.default_rng(0), 3)
            tensors = [[torch.from_numpy(np.asarray(v)) for v in f.values()] for f in feeds]
            qgraph = quantize_model(graph, tensors[:2])
            run_feeds = {t.name: tensors[2][i].numpy() for i, t in enumerate(graph.input_tensors)}
            times = []
            for scales in ("exact", "effective"):
                model = build_onnx_qdq(qgraph, scales=scales)
                times.append(_time(ort.InferenceSession(model.SerializeToString(), options,
                                                        providers=["CPUExecutionProvider"]), run_feeds, args.runs))
            float_session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            float_feeds = {i.name: v for i, v in zip(float_session.get_inputs(), run_feeds.values())}
            times.append(_time(float_session, float_feeds, args.runs))
        print(f"{name:<20} {times[0]:>9.2f} {times[1]:>13.2f} {times[2]:>9.2f} {times[0] / times[1]:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
