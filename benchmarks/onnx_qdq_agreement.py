"""Benchmark: how closely onnxruntime running the ONNX QDQ export follows quantopt's integer forward.

    python benchmarks/onnx_qdq_agreement.py [model ...] [--models-dir DIR] [--bits 16] [--scales MODE ...]

Models: `digits` (examples/digits) and the folders of ../shared/models (syn_resnet, syn_mobilenet, ppocr_cls,
mtcnn_onet by default). Each is quantized with the default settings on its calib.npy (two samples a batch; the
digits example: 16) and evaluated on calib.npy + val.npy (the digits example: its 597 validation digits).
`--bits 16` quantizes with 16-bit activations and 48-bit biases instead.

Per model and scale mode (exact, effective, ir) it prints:
  outputs   share of output elements within one output quantization step (whole model, onnxruntime with its
            default graph optimizations), and the largest difference in steps;
  identical share of output elements equal to quantopt's;
  layers    the lowest per-layer share when every layer gets the same integer inputs (quantopt run on
            onnxruntime's integers);
and once per model `sensitivity`: quantopt against itself, the share of output elements within one step when 0.01%
of the outputs of every Convolution/DepthwiseConv/FullyConnected move by one step. A model below 99.9% there cannot
be expected to meet the whole-model criterion with a runtime that is not bit-exact (docs/onnx-export.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import torch

from quantopt.exporters.agreement import measure_agreement, rounding_sensitivity
from quantopt.exporters.onnx_qdq import SCALE_MODES
from quantopt.graph.graph import PyGraph, QuantizeGraph
from quantopt.pipeline import quantize_model
from quantopt.registry import discover_plugins

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS_DIR = REPO.parent / "shared" / "models"
DEFAULT_MODELS = ["digits", "syn_resnet", "syn_mobilenet", "ppocr_cls", "mtcnn_onet"]


def load(name: str, models_dir: Path, bits: int = 8) -> Tuple[PyGraph, torch.Tensor]:
    settings: Dict[str, object] = {} if bits == 8 else dict(q_bits_activation=bits, q_bits_bias=48)
    if name == "digits":
        folder = REPO / "examples" / "digits"
        graph = QuantizeGraph.parse(str(folder / "model" / "digits.txt"))
        calib = torch.from_numpy(np.load(folder / "data" / "calib.npy"))
        data = torch.from_numpy(np.load(folder / "data" / "val.npy"))
        return quantize_model(graph, [calib[i:i + 16] for i in range(0, len(calib), 16)], settings), data
    folder = models_dir / name
    graph = QuantizeGraph.parse(str(folder / f"{name}.txt"))
    calib = torch.from_numpy(np.load(folder / "calib.npy"))
    data = torch.cat([calib, torch.from_numpy(np.load(folder / "val.npy"))])
    return quantize_model(graph, [calib[i:i + 2] for i in range(0, len(calib), 2)], settings), data


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--models-dir", default=str(DEFAULT_MODELS_DIR))
    ap.add_argument("--bits", type=int, choices=(8, 16), default=8, help="activation bits (16: 48-bit biases)")
    ap.add_argument("--scales", nargs="+", choices=SCALE_MODES, default=list(SCALE_MODES))
    args = ap.parse_args(argv)
    discover_plugins()
    print(f"{'model':<14} {'scales':<10} {'outputs':>9} {'identical':>10} {'elements':>9} {'max steps':>10} "
          f"{'layers (min)':>13}")
    for name in args.models:
        qgraph, data = load(name, Path(args.models_dir), args.bits)
        for scales in args.scales:
            r = measure_agreement(qgraph, [data], scales=scales, per_layer=True)
            print(f"{name:<14} {scales:<10} {r.share:>9.2%} {r.identical:>10.2%} {r.elements:>9} "
                  f"{r.max_steps:>10.1f} {min(r.layers.values()):>13.2%}")
        print(f"{name:<14} sensitivity: {rounding_sensitivity(qgraph, [data]):.2%} of the outputs stay within one "
              "step when 0.01% of every MAC layer's outputs move by one step")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
