"""Benchmark: cost of the statistics pass and of the integer forward relative to the float forward.

    python benchmarks/quantize_speed.py [model_dir] [--batches N] [--batch-size B] [--strategy mean]

model_dir holds <name>.txt/.bin and calib.npy (default: tests/data/shared_models/syn_mobilenet). Prints the time of the
float forward, of the statistics pass and of the integer forward over the same batches (best of --repeat runs)
and the ratios against the float forward. Targets: statistics ÷ float <= 1.5, integer ÷ float <= 3.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, List

import numpy as np
import torch

from quantopt.calibration.collect import collect_activation_statistics
from quantopt.ir.reader import read_ir
from quantopt.pipeline import quantize_model
from quantopt.registry import discover_plugins

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "tests" / "data" / "shared_models" / "syn_mobilenet"


def best_of(repeat: int, fn: Callable[[], None]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", default=str(DEFAULT_MODEL))
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--strategy", default="mean", help="activation calibration strategy (decides the statistics)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    discover_plugins()
    folder = Path(args.model_dir)
    txt = next(p for p in folder.glob("*.txt") if (folder / (p.stem + ".bin")).exists())
    graph = read_ir(str(txt))
    calib = np.load(folder / "calib.npy")
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(calib), size=(args.batches, args.batch_size))
    batches = [[torch.from_numpy(np.ascontiguousarray(calib[i]))] for i in idx]

    qgraph = quantize_model(graph, batches[:2], {"q_strategy_activation": args.strategy})

    def float_pass() -> None:
        with torch.no_grad():
            for b in batches:
                graph.forward(b)

    def stats_pass() -> None:
        collect_activation_statistics(graph, batches)

    def int_pass() -> None:
        with torch.no_grad():
            for b in batches:
                qgraph.forward(b)

    float_pass()  # warm-up
    t_float = best_of(args.repeat, float_pass)
    t_stats = best_of(args.repeat, stats_pass)
    t_int = best_of(args.repeat, int_pass)
    print(f"model {txt.stem}: {len(graph.nodes)} layers, {args.batches} batches of {args.batch_size}, "
          f"strategy {args.strategy}, torch threads {torch.get_num_threads()}")
    print(f"float forward      {t_float * 1000:9.1f} ms")
    print(f"statistics pass    {t_stats * 1000:9.1f} ms   ratio {t_stats / t_float:5.2f}  (target <= 1.5)")
    print(f"integer forward    {t_int * 1000:9.1f} ms   ratio {t_int / t_float:5.2f}  (target <= 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
