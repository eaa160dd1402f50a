"""Benchmark: how closely onnxruntime running the ONNX QDQ export follows quantopt's integer forward.

    python benchmarks/onnx_qdq_agreement.py [model ...] [--models-dir DIR] [--bits 16] [--scales MODE ...]
    python benchmarks/onnx_qdq_agreement.py --onnx-models [name ...] [--bits 16]
    python benchmarks/onnx_qdq_agreement.py --onnx-small [name ...] [--bits 16]
    python benchmarks/onnx_qdq_agreement.py --hf-archs [name ...] [--bits 16]

Models: `digits` (examples/digits) and the folders of tests/data/shared_models (syn_resnet, syn_mobilenet, ppocr_cls,
mtcnn_onet by default). Each is quantized with the default settings on its calib.npy (two samples a batch; the
digits example: 16) and evaluated on calib.npy + val.npy (the digits example: its 597 validation digits).
`--bits 16` quantizes with 16-bit activations and 48-bit biases instead. `--onnx-models` takes the real ONNX
models of examples/onnx_models instead (PP-OCR det 96×96, rec 48×96, cls, Silero VAD, the torch exports; those
whose package is missing are skipped): imported, quantized on 2 seeded samples and measured on 2 others, exact mode.
`--onnx-small` takes the torch exports of tests/data/onnx_small (bert_encoder, transformer_tanh, gpt2_like, vit_tiny,
...; the import shapes of benchmarks/make_parser_histograms.py) and all-MiniLM-L6-v2 (`minilm`, the export of
benchmarks/real_model_speed.py; skipped without its package): each quantized on 4 seeded inputs (token ids, masks
with padding; MiniLM: 4 of the calibration sentences of benchmarks/minilm_mask_accuracy.py, padded to 64 tokens) and
measured on 4 others (MiniLM: 8 other sentences), exact mode, also layer by layer. `--hf-archs` does the same for
the 25 transformers architectures of benchmarks/_hf_archs.py (random seeded weights; needs transformers).

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
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import torch
from _bench_common import SHARED_MODELS, seeded_inputs

from quantopt.exporters.agreement import measure_agreement, rounding_sensitivity, runtime_description
from quantopt.exporters.onnx_qdq import SCALE_MODES
from quantopt.graph.graph import PyGraph
from quantopt.ir.reader import read_ir
from quantopt.pipeline import quantize_model
from quantopt.registry import discover_plugins

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS_DIR = SHARED_MODELS
DEFAULT_MODELS = ["digits", "syn_resnet", "syn_mobilenet", "ppocr_cls", "mtcnn_onet"]


def load(name: str, models_dir: Path, bits: int = 8) -> Tuple[PyGraph, torch.Tensor]:
    settings: Dict[str, object] = {} if bits == 8 else dict(q_bits_activation=bits, q_bits_bias=48)
    if name == "digits":
        folder = REPO / "examples" / "digits"
        graph = read_ir(str(folder / "model" / "digits.txt"))
        calib = torch.from_numpy(np.load(folder / "data" / "calib.npy"))
        data = torch.from_numpy(np.load(folder / "data" / "val.npy"))
        return quantize_model(graph, [calib[i:i + 16] for i in range(0, len(calib), 16)], settings), data
    folder = models_dir / name
    graph = read_ir(str(folder / f"{name}.txt"))
    calib = torch.from_numpy(np.load(folder / "calib.npy"))
    data = torch.cat([calib, torch.from_numpy(np.load(folder / "val.npy"))])
    return quantize_model(graph, [calib[i:i + 2] for i in range(0, len(calib), 2)], settings), data


def onnx_model_rows(names: List[str], bits: int) -> None:
    """Real ONNX models (examples/onnx_models): import, quantize, export in exact mode, measure."""
    import importlib.util

    from quantopt.exporters.onnx_qdq import convert_graph
    from quantopt.frontends.onnx import import_onnx

    spec = importlib.util.spec_from_file_location("onnx_model_cases", REPO / "examples" / "onnx_models" / "cases.py")
    cases = importlib.util.module_from_spec(spec)
    sys.modules["onnx_model_cases"] = cases
    spec.loader.exec_module(cases)
    settings: Dict[str, object] = {} if bits == 8 else dict(q_bits_activation=bits, q_bits_weight=bits,
                                                                 q_bits_bias=48)
    print(f"{'model':<20} {'identical':>10} {'elements':>9} {'max steps':>10}  float-form layers")
    for name, case in cases.all_cases(96, 96).items():
        if (names and name not in names) or case.available() is not None:
            continue
        with tempfile.TemporaryDirectory() as folder:
            path = case.make_onnx(folder)
            graph = import_onnx(path, case.shapes)
            feeds = case.make_feeds(path, np.random.default_rng(0), 4)
            tensors = [[torch.from_numpy(np.asarray(v)) for v in f.values()] for f in feeds]
            qgraph = quantize_model(graph, tensors[:2], settings)
            data = [torch.cat([f[i] for f in tensors[2:]]) for i in range(len(tensors[0]))]
            floats = list(convert_graph(qgraph)[1].float_layers)
            r = measure_agreement(qgraph, data)
            print(f"{name:<20} {r.identical:>10.2%} {r.elements:>9} {r.max_steps:>10.1f}  {len(floats)}")


def _minilm(bits_settings: Dict[str, object]) -> Tuple[PyGraph, List[torch.Tensor]]:
    """all-MiniLM-L6-v2 (benchmarks/real_model_speed.py's export), quantized on 4 sentences, and 8 others."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import onnx
    from _bench_common import DEFAULT_CACHE
    from minilm_mask_accuracy import CALIBRATION, EVALUATION, tokenize
    from real_model_speed import export_minilm

    from quantopt.frontends.onnx import import_onnx

    path = export_minilm(Path(DEFAULT_CACHE))
    names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
    graph = import_onnx(str(path), None)
    calib, evals = tokenize(CALIBRATION[:4], names), tokenize(EVALUATION[:8], names)
    qgraph = quantize_model(graph, [[torch.from_numpy(f[n]) for n in names] for f in calib],
                            {"fc_float_summation": "float64", **bits_settings})
    return qgraph, [torch.cat([torch.from_numpy(f[n]) for f in evals]) for n in names]


def onnx_small_rows(names: List[str], bits: int) -> None:
    """tests/data/onnx_small and MiniLM: import, quantize, export in exact mode, measure (also per layer)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import make_parser_histograms as histograms
    from real_model_speed import Skip

    from quantopt.exporters.onnx_qdq import convert_graph
    from quantopt.frontends.onnx import import_onnx

    settings: Dict[str, object] = {} if bits == 8 else dict(q_bits_activation=bits, q_bits_bias=48)
    small = [n for n, spec in histograms.MODELS.items() if spec.get("file", "").startswith("tests/data/onnx_small/")]
    print(f"{'model':<20} {'identical':>10} {'elements':>9} {'max steps':>10} {'layers (min)':>13}  float-form layers")
    for name in small + ["minilm"]:
        if names and name not in names:
            continue
        if name == "minilm":
            try:
                qgraph, data = _minilm(settings)
            except Skip as e:
                print(f"{name:<20} skipped: {e}")
                continue
        else:
            spec = histograms.MODELS[name]
            graph = import_onnx(str(REPO / spec["file"]), spec["inputs"])
            rng = np.random.default_rng(0)
            qgraph = quantize_model(graph, [seeded_inputs(graph, rng) for _ in range(4)], settings)
            data = [torch.cat(t) for t in zip(*[seeded_inputs(graph, rng) for _ in range(4)])]
        floats = list(convert_graph(qgraph)[1].float_layers)
        r = measure_agreement(qgraph, data, per_layer=True)
        print(f"{name:<20} {r.identical:>10.2%} {r.elements:>9} {r.max_steps:>10.1f} "
              f"{min(r.layers.values()):>13.2%}  {len(floats)}")


def hf_arch_rows(names: List[str], bits: int) -> None:
    """The transformers architectures of benchmarks/_hf_archs.py (random seeded weights, exported once into the
    benchmark cache): import, quantize on 4 samples, export in exact mode, measure on 4 others (also per layer)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import _hf_archs
    from _bench_common import DEFAULT_CACHE

    from quantopt.exporters.onnx_qdq import convert_graph
    from quantopt.frontends.onnx import import_onnx

    settings: Dict[str, object] = {} if bits == 8 else dict(q_bits_activation=bits, q_bits_bias=48)
    print(f"{'model':<20} {'identical':>10} {'elements':>9} {'max steps':>10} {'layers (min)':>13}  float-form layers")
    for name in names or _hf_archs.NAMES:
        path = _hf_archs.export(name, Path(DEFAULT_CACHE) / "hf_archs" / f"{name}.onnx", 0) \
            if not (Path(DEFAULT_CACHE) / "hf_archs" / f"{name}.onnx").is_file() \
            else Path(DEFAULT_CACHE) / "hf_archs" / f"{name}.onnx"
        if path is None:
            print(f"{name:<20} skipped: transformers is not installed")
            continue
        graph = import_onnx(str(path), {k: list(v) for k, v in _hf_archs.input_shapes(name).items()})
        image = lambda rng, shape: rng.uniform(-1, 1, (8, *shape[1:])).astype(np.float32)  # noqa: E731
        feeds = _hf_archs.sampler(name, 8, image)(np.random.default_rng(0))
        order = [t.name[:-2] if t.name.endswith("_0") and t.name[:-2] in feeds else t.name
                 for t in graph.input_tensors]
        samples = [[torch.from_numpy(feeds[k][i:i + 1]) for k in order] for i in range(8)]
        qgraph = quantize_model(graph, samples[:4], settings)
        floats = list(convert_graph(qgraph)[1].float_layers)
        r = measure_agreement(qgraph, [torch.cat(t) for t in zip(*samples[4:])], per_layer=True)
        print(f"{name:<20} {r.identical:>10.2%} {r.elements:>9} {r.max_steps:>10.1f} "
              f"{min(r.layers.values()):>13.2%}  {len(floats)}", flush=True)


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help=f"default: {' '.join(DEFAULT_MODELS)} (all, with --onnx-models)")
    ap.add_argument("--models-dir", default=str(DEFAULT_MODELS_DIR))
    ap.add_argument("--bits", type=int, choices=(8, 16), default=8, help="activation bits (16: 48-bit biases)")
    ap.add_argument("--scales", nargs="+", choices=SCALE_MODES, default=list(SCALE_MODES))
    ap.add_argument("--onnx-models", action="store_true", help="the real ONNX models of examples/onnx_models")
    ap.add_argument("--onnx-small", action="store_true", help="tests/data/onnx_small and MiniLM (minilm)")
    ap.add_argument("--hf-archs", action="store_true",
                    help="the transformers architectures of benchmarks/_hf_archs.py (needs transformers)")
    args = ap.parse_args(argv)
    discover_plugins()
    print(runtime_description())
    if args.onnx_models:
        onnx_model_rows(args.models, args.bits)
        return 0
    if args.onnx_small:
        onnx_small_rows(args.models, args.bits)
        return 0
    if args.hf_archs:
        hf_arch_rows(args.models, args.bits)
        return 0
    print(f"{'model':<14} {'scales':<10} {'outputs':>9} {'identical':>10} {'elements':>9} {'max steps':>10} "
          f"{'layers (min)':>13}")
    for name in args.models or DEFAULT_MODELS:
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
