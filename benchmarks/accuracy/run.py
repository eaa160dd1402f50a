"""Accuracy benchmark: real models quantized by quantopt and by peer quantizers on the same calibration data, each
scored by its task metric.

    python benchmarks/accuracy/run.py [--models rec,minilm,mtcnn,vad] [--calib N] [--eval N] [--seed S]
                                      [--methods MinMax,Percentile,Entropy,nncf] [--recipes ...] [--markdown FILE]

Per model: float (onnxruntime fp32, the reference of every gap), onnxruntime quantize_static (QDQ; MinMax,
Percentile, Entropy), NNCF (when installed) and quantopt's recipes (common.QUANTOPT_RECIPES), the quantized model
evaluated by quantopt's own integer forward. The process is pinned to one CPU core and every runtime uses one
thread, so times compare; times are CPU seconds. What each metric means and the figures: docs/accuracy.md. The
models and the extras they need: models.py and benchmarks/requirements.txt.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from _bench_common import DEFAULT_CACHE  # noqa: E402  (benchmarks is not a package)
from common import ORT_METHODS, QUANTOPT_RECIPES, Row, Unavailable, evaluate  # noqa: E402

MODELS = ["rec", "minilm", "mtcnn", "vad"]
METHODS = [*ORT_METHODS, "nncf"]


def pin_one_core() -> Optional[int]:
    """Pin this process (and the threads its runtimes start) to one core it may use: one thread each, whatever the
    runtime's own default, so CPU times compare across methods."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def cpu_name() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fmt(value: Optional[float], digits: int = 4) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def table(rows: List[Row], models: List[str], metrics: Dict[str, str]) -> str:
    """Markdown table: one line per model and method, the headline metric, its gap to float (quantized minus
    float), every metric of the task, quantization CPU seconds and evaluation CPU ms per sample."""
    head = ["model", "method", "metric", "value", "gap to float", "other metrics", "quantize s", "eval ms/sample"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in models:
        mine = [r for r in rows if r.model == model]
        if not mine:
            continue
        metric = metrics.get(model, "")
        for r in mine:
            if r.note:
                lines.append(f"| {model} | {r.method} | {metric} | | | {r.note} | | |")
                continue
            others = ", ".join(f"{k} {v:.4f}" for k, v in r.metrics.items() if k != metric)
            gap = "" if r.gap is None else f"{r.gap:+.4f}"
            lines.append(f"| {model} | {r.method} | {metric} | {fmt(r.headline)} | {gap} | {others} | "
                         f"{fmt(r.quantize_s, 1)} | {fmt(r.eval_ms, 1)} |")
    return "\n".join(lines)


def parse(argv: List[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--calib", type=int, default=32, help="calibration samples, the same for every method")
    ap.add_argument("--eval", type=int, default=100, help="evaluation samples (mtcnn: at most 200 - calib)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the data (rendering, splits, audio)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"peer methods, comma list of {', '.join(METHODS)} (empty: none)")
    ap.add_argument("--recipes", default=",".join(QUANTOPT_RECIPES),
                    help=f"quantopt recipes, comma list of: {'; '.join(QUANTOPT_RECIPES)} (empty: none)")
    ap.add_argument("--chunk", type=int, default=8,
                    help="onnxruntime calibrates in chunks of at most this many samples (Entropy and Percentile keep "
                         "every intermediate tensor of a chunk in memory)")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="folder for exported and quantized ONNX files")
    ap.add_argument("--markdown", help="also write the table, with the run's settings, to this markdown file")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the process to one core")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    for name, given, known in (("model", args.models, MODELS), ("method", args.methods, METHODS),
                               ("recipe", args.recipes, list(QUANTOPT_RECIPES))):
        bad = [g for g in given if g not in known]
        if bad:
            ap.error(f"unknown {name}(s) {', '.join(bad)} (known: {', '.join(known)})")
    if args.calib < 1 or args.eval < 1:
        ap.error("--calib and --eval must be at least 1")
    return args


def main(argv: List[str]) -> int:
    args = parse(argv)
    cpu = None if args.no_pin else pin_one_core()
    import torch

    torch.set_num_threads(1)
    from models import TASKS

    cache = Path(args.cache)
    header = (f"{datetime.date.today()}, {cpu_name()} ({os.cpu_count()} cores), "
              f"{'pinned to CPU ' + str(cpu) if cpu is not None else 'not pinned'}, one thread; calibration "
              f"{args.calib}, evaluation {args.eval}, seed {args.seed}")
    print(header, flush=True)
    rows: List[Row] = []
    metrics: Dict[str, str] = {}
    failed = 0
    for name in args.models:
        print(f"{name}:", flush=True)
        try:
            task = TASKS[name](args.calib, args.eval, args.seed, cache)
        except Unavailable as e:
            rows.append(Row(name, "(model)", note=f"skipped: {e}"))
            print(f"  skipped: {e}", flush=True)
            continue
        except Exception as e:  # noqa: BLE001  (a model whose data cannot be made is reported; the others run)
            rows.append(Row(name, "(model)", note=f"FAILED: {type(e).__name__}: {e}"))
            print(f"  FAILED: {type(e).__name__}: {e}", flush=True)
            failed += 1
            continue
        metrics[name] = task.metric
        print(f"  {len(task.calib)} calibration and {len(task.eval)} evaluation samples", flush=True)
        got = evaluate(task, args.methods, args.recipes, cache / "quantized", args.chunk,
                       lambda s: print(s, flush=True))
        # a peer that fails on a model (onnxruntime's Entropy on MiniLM's -3.4e38 mask) is a finding, shown in the
        # table; only quantopt's failures make the exit code 1
        failed += sum(r.note.startswith("FAILED") and r.method.startswith("quantopt") for r in got)
        rows += got
    text = table(rows, args.models, metrics)
    print("\n" + text)
    if args.markdown:
        command = "python benchmarks/accuracy/run.py " + " ".join(argv)
        Path(args.markdown).write_text(f"{header}\n\n`{command.strip()}`\n\n{text}\n")
        print(f"wrote {args.markdown}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
