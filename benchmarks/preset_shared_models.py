"""Benchmark: `preset = accurate` against upstream's defaults on the shared Parser IRs, in one run.

    python benchmarks/preset_shared_models.py [model ...] [--models-dir DIR]

For each shared model (default: syn_resnet, syn_mobilenet, ppocr_cls, mtcnn_onet; tests/data/shared_models or
$QUANTOPT_SHARED_MODELS), quantized on its calib.npy with the defaults and with the preset (config/presets.py),
prints on its val.npy the lowest output cosine against the float model (over the whole batch, and the worst of the
samples run one at a time), so that "the preset is no worse than the defaults" can be checked on models other than
the ones the preset was chosen on (docs/accuracy.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List

import numpy as np
import torch
from _bench_common import SHARED_IR_NAMES, SHARED_MODELS

from quantopt.analysis.similarity import cosine
from quantopt.config.presets import preset_settings
from quantopt.ir.reader import read_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.registry import discover_plugins


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("models", nargs="*", default=SHARED_IR_NAMES)
    ap.add_argument("--models-dir", default=str(SHARED_MODELS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    discover_plugins()
    print(f"{'model':<14} {'cos default':>12} {'cos preset':>11}   {'worst sample default':>20} "
          f"{'worst sample preset':>20}")
    for name in args.models:
        folder = Path(args.models_dir) / name
        if not folder.is_dir():
            print(f"{name:<14} skipped: {folder} not found")
            continue
        graph = read_ir(str(folder / f"{name}.txt"))
        calib = torch.from_numpy(np.load(folder / "calib.npy"))
        val = torch.from_numpy(np.load(folder / "val.npy"))
        batches = [calib[i:i + 2] for i in range(0, len(calib), 2)]
        want = [t.clone() for t in graph.forward([val])]
        samples = [[t.clone() for t in graph.forward([val[i:i + 1]])] for i in range(len(val))]
        cos, worst = [], []
        for settings in ({}, preset_settings("accurate")):
            qgraph = quantize_model(graph, batches, settings)
            got = run_quantized(qgraph, [val])
            cos.append(min(float(cosine(w, g)) for w, g in zip(want, got)))
            worst.append(min(float(cosine(w, g)) for i, ref in enumerate(samples)
                             for w, g in zip(ref, run_quantized(qgraph, [val[i:i + 1]]))))
        print(f"{name:<14} {cos[0]:>12.5f} {cos[1]:>11.5f}   {worst[0]:>20.5f} {worst[1]:>20.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
