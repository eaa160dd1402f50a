"""Benchmark: output cosine against the float model with per-tensor and with per-channel activations.

    python benchmarks/per_channel_activations.py [model ...] [--models-dir DIR] [--strategy extrema]

For each shared model (default: syn_resnet, syn_mobilenet, ppocr_cls, mtcnn_onet), quantized on calib.npy with
per-channel symmetric weights and 8 bits: once with per-tensor activations, once with
`per_channel_symmetric_full_range` on every Convolution/DepthwiseConv/Eltwise/Add/BatchNorm whose readers all take
per-channel activations (ops/_per_channel.py) and which is not a graph output; and once more with only those whose
readers are no MAC layers (which fold the scales into their weights). Prints the lowest output cosine on val.npy
and how many layers went per channel (docs/integer-semantics.md, "Per-channel activations").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
from _bench_common import SHARED_MODELS

from quantopt.analysis.similarity import cosine
from quantopt.graph.graph import PyGraph
from quantopt.ir.reader import read_ir
from quantopt.ops._per_channel import reads_per_channel
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.registry import discover_plugins

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS_DIR = SHARED_MODELS
DEFAULT_MODELS = ["syn_resnet", "syn_mobilenet", "ppocr_cls", "mtcnn_onet"]
CANDIDATES = ("Convolution", "DepthwiseConv", "Eltwise", "Add", "BatchNorm")
MODE = "per_channel_symmetric_full_range"


PASS_ON = ("Pooling", "GlobalPool", "Concat")
"""Readers whose output carries the per-channel scales on: their own readers must take them too."""


MAC_READERS = ("Convolution", "DepthwiseConv", "FullyConnected", "BatchNorm")
"""Readers that fold per-channel input scales into their weights."""


def eligible(graph: PyGraph, mac_readers: bool = True) -> Dict[str, Dict[str, str]]:
    """Layers that may go per channel: a candidate type, not a graph output, every reader (through pooling and
    Concat) a per-channel consumer; without `mac_readers`, none of those readers a MAC layer."""
    outputs = {t.name for t in graph.output_tensors}

    def readers(name: str) -> List:
        return [c for c in graph.nodes if any(t.name == name for t in c.inputs)]

    def accepts(name: str) -> bool:
        found = readers(name)
        return bool(found) and name not in outputs and all(
            reads_per_channel(c) and (mac_readers or str(c.type) not in MAC_READERS)
            and (str(c.type) not in PASS_ON or accepts(c.outputs[0].name)) for c in found)

    return {n.name: {"q_mode_activation": MODE} for n in graph.nodes
            if str(n.type) in CANDIDATES and accepts(n.outputs[0].name)}


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--models-dir", default=str(DEFAULT_MODELS_DIR))
    ap.add_argument("--strategy", default="mean", help="activation calibration strategy (default: mean)")
    args = ap.parse_args(argv)
    discover_plugins()
    print(f"{'model':<14} {'per tensor':>11} {'per channel':>12} {'layers':>7} {'no MAC readers':>15} {'layers':>7}")
    for name in args.models:
        folder = Path(args.models_dir) / name
        graph = read_ir(str(folder / f"{name}.txt"))
        calib = torch.from_numpy(np.load(folder / "calib.npy"))
        val = torch.from_numpy(np.load(folder / "val.npy"))
        batches = [calib[i:i + 2] for i in range(0, len(calib), 2)]
        settings = dict(q_mode_weight="per_channel_symmetric_restricted_range", q_strategy_activation=args.strategy)
        layers, gentle = eligible(graph), eligible(graph, mac_readers=False)
        results = []
        for per_layer in ({}, layers, gentle):
            qgraph = quantize_model(graph, batches, settings, per_layer=per_layer)
            want = [t.clone() for t in graph.forward([val])]
            results.append(min(cosine(w, g) for w, g in zip(want, run_quantized(qgraph, [val]))))
        print(f"{name:<14} {results[0]:>11.5f} {results[1]:>12.5f} {len(layers):>7} {results[2]:>15.5f} "
              f"{len(gentle):>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
