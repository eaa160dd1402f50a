"""Benchmark: `preset = accurate` against upstream's defaults on the shared Parser IRs, in one run.

    python benchmarks/preset_shared_models.py [model ...] [--models-dir DIR] [--rendered N] [--seed S]

For each shared model (default: syn_resnet, syn_mobilenet, ppocr_cls, mtcnn_onet; tests/data/shared_models or
$QUANTOPT_SHARED_MODELS), quantized on its calib.npy with the defaults and with the preset (config/presets.py),
prints on its val.npy the lowest output cosine against the float model (over the whole batch, and the worst of the
samples run one at a time), so that "the preset is no worse than the defaults" can be checked on models other than
the ones the preset was chosen on (docs/accuracy.md).

val.npy holds 8 samples, too few for ppocr_cls: its output is a two-class softmax, so the lowest cosine is that of
the one line nearest the decision boundary, and any small change of any layer moves it either way. With
`--rendered N` (default 200; 0 turns it off) ppocr_cls is also scored on N text lines rendered by the accuracy
benchmark (benchmarks/accuracy/text.py, seeded, every other line turned 180 degrees, its preprocessing at 48x192):
how often the quantized model picks the float model's direction, and the mean and lowest output cosine.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from _bench_common import SHARED_IR_NAMES, SHARED_MODELS

from quantopt.analysis.similarity import cosine
from quantopt.config.presets import preset_settings
from quantopt.ir.reader import read_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.registry import discover_plugins

sys.path.insert(0, str(Path(__file__).resolve().parent / "accuracy"))
CLS_WIDTH = 192
RENDERED_MODELS = ("ppocr_cls",)
"""Shared models with a rendered evaluation set (the text direction classifier)."""


def rendered_cls_inputs(count: int, seed: int) -> Optional[torch.Tensor]:
    """`count` rendered text lines as ppocr_cls inputs [count, 3, 48, 192], odd ones turned 180 degrees before the
    preprocessing (as an upside-down crop reaches the classifier); None when Pillow or the DejaVu fonts are missing."""
    from text import find_fonts, rec_input, render_line, text_lines

    fonts = find_fonts()
    try:
        import PIL  # noqa: F401
    except ImportError:
        return None
    if not fonts:
        return None
    lines = text_lines(max_chars=12)
    order = np.random.default_rng(seed).permutation(len(lines))
    out = []
    for j in range(count):
        gray = render_line(lines[int(order[j % len(lines)])], seed * 100_003 + 70_000 + j, fonts)
        if j % 2:
            gray = np.ascontiguousarray(gray[::-1, ::-1])
        out.append(rec_input(gray, CLS_WIDTH))
    return torch.from_numpy(np.concatenate(out))


def rendered_scores(want: torch.Tensor, got: torch.Tensor) -> Dict[str, float]:
    """Direction agreement with float (same arg max) and the mean and lowest per-line cosine of the outputs."""
    cos = torch.nn.functional.cosine_similarity(want.double().flatten(1), got.double().flatten(1), dim=1)
    same = (want.argmax(-1) == got.argmax(-1)).double().mean()
    return {"agree": float(same), "mean": float(cos.mean()), "min": float(cos.min())}


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("models", nargs="*", default=SHARED_IR_NAMES)
    ap.add_argument("--models-dir", default=str(SHARED_MODELS))
    ap.add_argument("--rendered", type=int, default=200, help="rendered lines for ppocr_cls (0: none)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the rendered lines")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    discover_plugins()
    print(f"{'model':<14} {'cos default':>12} {'cos preset':>11}   {'worst sample default':>20} "
          f"{'worst sample preset':>20}")
    extra: List[str] = []
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
        rendered = None
        if name in RENDERED_MODELS and args.rendered > 0:
            rendered = rendered_cls_inputs(args.rendered, args.seed)
            if rendered is None:
                extra.append(f"{name}: rendered lines skipped (pip install pillow; apt-get install fonts-dejavu-core)")
            else:
                rendered_want = graph.forward([rendered])[0].clone()
        cos, worst = [], []
        for label, settings in (("default", {}), ("preset", preset_settings("accurate"))):
            qgraph = quantize_model(graph, batches, settings)
            got = run_quantized(qgraph, [val])
            cos.append(min(float(cosine(w, g)) for w, g in zip(want, got)))
            worst.append(min(float(cosine(w, g)) for i, ref in enumerate(samples)
                             for w, g in zip(ref, run_quantized(qgraph, [val[i:i + 1]]))))
            if rendered is not None:
                r = rendered_scores(rendered_want, run_quantized(qgraph, [rendered])[0])
                extra.append(f"{name} {label:<8} on {len(rendered)} rendered lines: direction as float "
                             f"{r['agree']:.4f}, mean cosine {r['mean']:.5f}, lowest cosine {r['min']:.5f}")
        print(f"{name:<14} {cos[0]:>12.5f} {cos[1]:>11.5f}   {worst[0]:>20.5f} {worst[1]:>20.5f}", flush=True)
    for line in extra:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
