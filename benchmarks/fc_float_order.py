"""Benchmark: the float FullyConnected in upstream's fixed float32 order against torch's own kernels.

    python benchmarks/fc_float_order.py [--repeat 5]

For a few layer shapes (rows x in -> out), prints the best of `--repeat` runs of quantopt's ordered float32 sum
(`quantopt/ops/_fc_order.py`, the float forward's FullyConnected) with every row alone ("rows alone", a batch of
one-row samples) and with all rows as one sample ("one sample", MKL's several-row kernels), torch's float32 linear
and torch's float64 linear, and the ordered sums' times as multiples of torch's float32 (docs/architecture.md,
"Float reference").
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from quantopt.ops._fc_order import linear_float32

SHAPES = [(1, 32, 10), (1, 1152, 256), (16, 32, 32), (16, 512, 512), (64, 768, 3072), (8, 4096, 4096)]


def best_time(fn: Callable[..., torch.Tensor], args: tuple, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'rows x in -> out':<22} {'rows alone':>11} {'one sample':>11} {'torch f32':>10} {'torch f64':>10} "
          f"{'alone / f32':>12} {'sample / f32':>13}")
    for rows, k, n in SHAPES:
        x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
        alone = best_time(linear_float32, (x, w, b), args.repeat)
        sample = best_time(linear_float32, (x, w, b, None, rows), args.repeat)
        f32 = best_time(F.linear, (x, w, b), args.repeat)
        f64 = best_time(F.linear, (x.double(), w.double(), b.double()), args.repeat)
        print(f"{f'{rows} x {k} -> {n}':<22} {alone * 1e3:>8.2f} ms {sample * 1e3:>8.2f} ms {f32 * 1e3:>7.2f} ms "
              f"{f64 * 1e3:>7.2f} ms {alone / f32:>11.1f}x {sample / f32:>12.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
