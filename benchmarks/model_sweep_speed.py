"""Benchmark: the speed ratios of benchmarks/real_model_speed.py over every model the repository holds, so that a
layer type that is slow somewhere shows up without a model of its own.

    python benchmarks/model_sweep_speed.py [--models lstm,gru,...] [--repeat 3] [--baseline-tree DIR]
                                           [--setting lstm_integer_form=q15 ...]

Models: the golden corpus IRs (tests/data/golden_corpus/<name>/<name>.txt, 119 models from single-operator
graphs to CRNN, BiLSTM, VAD-like, transformer and detection heads), the torch exports of tests/data/onnx_small
(LSTM, GRU, BERT, GPT-2-like, ViT, U-Net, ...) and recurrent layers of realistic width, exported with torch when
measured (`rnn:lstm_96` ... `rnn:bigru_256`: one LSTM or GRU layer, one or two directions, of that many hidden
units over 40 steps of as many inputs, and a FullyConnected head; seeded weights); by name only, the real models
of examples/onnx_models (`case:silero_vad`, `case:ppocr_rec`, ...: PP-OCR at 96x96 and 48x96, on their own
inputs; a model whose package is not installed is reported and skipped). Each runs at batch 1 on four
seeded inputs (`seeded_inputs`), on one thread, and is quantized with the default settings on two of them. Per
model, in CPU seconds (the least of --repeat runs), it prints the float forward in ms per sample and the ratios the
real-model targets name: statistics pass / float forward (target <= 1.5), integer forward / float forward (<= 2)
and the precision analysis (on the float outputs the statistics pass recorded, as a cfg run does) / (float +
integer forward); then the median and the worst of each ratio. Most models are small, a few layers: their ratios
measure the fixed cost per layer of each pass more than its arithmetic (docs/performance.md, "Model sweep").

--setting NAME=VALUE (repeatable) quantizes with that layer setting (a `LayerSettings` field, e.g.
`lstm_integer_form=q15`) instead of its default.

--baseline-tree DIR measures every model a second time with the `quantopt` package of another checkout (a git
worktree of an earlier commit, say), in a child process with PYTHONPATH=DIR, alternating the two per model, and
prints the speed-up of each pass (baseline CPU time / this tree's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "data" / "golden_corpus"
ONNX_SMALL = REPO / "tests" / "data" / "onnx_small"
RESULT = "RESULT "
PASSES = ("float", "stats", "int", "analysis")


RNN_MODELS = {f"rnn:{bi}{kind}_{width}": (kind, width, bool(bi)) for bi in ("", "bi") for kind in ("lstm", "gru")
              for width in (96, 256)}
"""Recurrent models exported when measured: (layer kind, hidden units = inputs, bidirectional)."""
RNN_STEPS = 40


def model_names() -> List[str]:
    """Every corpus IR by folder name, every small ONNX export as `onnx:<name>`, then the recurrent models."""
    corpus = sorted(p.name for p in CORPUS.iterdir() if (p / f"{p.name}.txt").is_file())
    return corpus + [f"onnx:{n}" for n in sorted(_onnx_shapes())] + list(RNN_MODELS)


def _export_rnn(kind: str, width: int, bidirectional: bool, path: str) -> None:
    """One seeded LSTM/GRU layer (`width` inputs and hidden units, batch first, one or two directions) with a
    FullyConnected head, as ONNX."""
    import torch

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = (torch.nn.LSTM if kind == "lstm" else torch.nn.GRU)(width, width, batch_first=True,
                                                                           bidirectional=bidirectional)
            self.head = torch.nn.Linear(width * (2 if bidirectional else 1), 40)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0])

    torch.manual_seed(0)
    torch.onnx.export(Model().eval(), (torch.zeros(1, RNN_STEPS, width),), path, input_names=["x"],
                      output_names=["y"], opset_version=17, dynamo=False)


def _onnx_shapes() -> Dict[str, Dict[str, List[int]]]:
    """Import shapes of tests/data/onnx_small's models, as benchmarks/make_parser_histograms.py imports them."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import make_parser_histograms as histograms

    return {Path(spec["file"]).stem: spec["inputs"] for spec in histograms.MODELS.values()
            if spec.get("file", "").startswith("tests/data/onnx_small/")}


def _case_names() -> List[str]:
    """The real models of examples/onnx_models, as `case:<name>`."""
    sys.path.insert(0, str(REPO / "examples" / "onnx_models"))
    import cases

    return [f"case:{n}" for n in cases.all_cases(96, 96)]


def _load_case(name: str) -> Tuple[Any, List[List[Any]]]:
    """(graph, four samples) of an examples/onnx_models case, its model made in a temporary folder."""
    import tempfile

    import torch

    from quantopt.frontends.onnx import import_onnx

    sys.path.insert(0, str(REPO / "examples" / "onnx_models"))
    import cases

    case = cases.all_cases(96, 96)[name.split(":", 1)[1]]
    reason = case.available()
    if reason:
        raise RuntimeError(f"skipped: {reason}")
    with tempfile.TemporaryDirectory() as folder:
        path = case.make_onnx(folder)
        feeds = case.make_feeds(path, np.random.default_rng(0), 4)
        graph = import_onnx(path, case.shapes)
    return graph, [[torch.from_numpy(np.ascontiguousarray(f[k])) for k in case.shapes] for f in feeds]


def _load(name: str) -> Any:
    if name in RNN_MODELS:
        import tempfile

        from quantopt.frontends.onnx import import_onnx

        kind, width, bidirectional = RNN_MODELS[name]
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "model.onnx")
            _export_rnn(kind, width, bidirectional, path)
            return import_onnx(path, {"x": [1, RNN_STEPS, width]})
    if name.startswith("onnx:"):
        from quantopt.frontends.onnx import import_onnx

        stem = name.split(":", 1)[1]
        return import_onnx(str(ONNX_SMALL / f"{stem}.onnx"), _onnx_shapes()[stem])
    from quantopt.ir.reader import read_ir

    return read_ir(str(CORPUS / name / f"{name}.txt"))


def measure(name: str, repeat: int, settings: Dict[str, str]) -> Dict[str, Any]:
    """ms per sample of the four passes of one model (one thread, four samples at batch 1), quantized with
    `settings` (LayerSettings fields) over the defaults."""
    import torch

    from quantopt.analysis.report import HISTOGRAM_LAYERS
    from quantopt.analysis.similarity import FirstBatch, layer_similarity
    from quantopt.calibration.collect import collect_activation_statistics
    from quantopt.graph.recorded import ForwardRecord
    from quantopt.pipeline import quantize_model
    from quantopt.registry import discover_plugins

    sys.path.insert(0, str(REPO / "benchmarks"))
    from _bench_common import least_cpu, seeded_inputs

    torch.set_num_threads(1)
    discover_plugins()
    if name.startswith("case:"):
        graph, batches = _load_case(name)
    else:
        graph = _load(name)
        rng = np.random.default_rng(0)
        batches = [seeded_inputs(graph, rng) for _ in range(4)]
    with torch.no_grad():
        t_float = least_cpu(repeat, lambda: [graph.forward(b) for b in batches])
        qgraph = quantize_model(graph, batches[:2], _typed(settings))
        t_stats = least_cpu(repeat, lambda: collect_activation_statistics(graph, batches))
        t_int = least_cpu(repeat, lambda: [qgraph.forward(b) for b in batches])
        record = ForwardRecord(len(batches), budget_bytes=1 << 40)
        collect_activation_statistics(graph, batches, record)
        t_analysis = least_cpu(repeat, lambda: layer_similarity(graph, qgraph, record.batches,
                                                                first_batch=FirstBatch(HISTOGRAM_LAYERS)))
        record.drop()
    n = len(batches)
    return {"model": name, "layers": len(graph.nodes), "float": t_float / n * 1e3, "stats": t_stats / n * 1e3,
            "int": t_int / n * 1e3, "analysis": t_analysis / n * 1e3}


def _typed(settings: Dict[str, str]) -> Dict[str, Any]:
    """`settings` with each value in its LayerSettings field's type (int, float, bool or text)."""
    import dataclasses

    from quantopt.config.layer_settings import LayerSettings

    fields = {f.name: f for f in dataclasses.fields(LayerSettings)}
    out: Dict[str, Any] = {}
    for key, value in settings.items():
        if key not in fields:
            raise ValueError(f"--setting {key}: not a LayerSettings field")
        default = fields[key].default
        kind = type(default) if default is not None and default is not dataclasses.MISSING else str
        out[key] = value.lower() in ("1", "true") if kind is bool else kind(value)
    return out


def run_child(name: str, repeat: int, tree: Optional[str], settings: List[str]) -> Dict[str, Any]:
    """`measure` in a fresh process (with `tree`'s quantopt first on the path when given): one model's import and
    caches never affect another's figures."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    extra = [arg for setting in settings for arg in ("--setting", setting)]
    proc = subprocess.run([sys.executable, __file__, "--child", name, "--repeat", str(repeat)] + extra, env=env,
                          capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"model": name, "error": tail}


def ratios(row: Dict[str, Any]) -> Tuple[float, float, float]:
    """(stats/float, int/float, analysis/(float+int)) of a measured row."""
    return (row["stats"] / row["float"], row["int"] / row["float"], row["analysis"] / (row["float"] + row["int"]))


def mark(value: float, target: Optional[float]) -> str:
    return f"{value:.2f}" + (" ✗" if target is not None and value > target else "")


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="comma list of names (default: all; ONNX exports as onnx:<name>)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each pass; the least CPU time counts")
    ap.add_argument("--baseline-tree", help="a checkout whose quantopt package is measured alongside")
    ap.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                    help="a LayerSettings field to quantize with (repeatable)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    bad = [item for item in args.setting if "=" not in item]
    if bad:
        print(f"--setting {bad[0]}: expected NAME=VALUE", file=sys.stderr)
        return 2
    settings = dict(item.split("=", 1) for item in args.setting)
    try:
        _typed(settings)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    if args.child:
        try:
            out: Dict[str, Any] = measure(args.child, args.repeat, settings)
        except Exception as e:  # noqa: BLE001  (one model's failure is reported; the sweep goes on)
            out = {"model": args.child, "error": " ".join(f"{type(e).__name__}: {e}".split())}  # one line
        print(RESULT + json.dumps(out), flush=True)
        return 0
    names = args.models.split(",") if args.models else model_names()
    unknown = sorted(set(names) - set(model_names()) - set(_case_names()))
    if unknown:
        print(f"unknown model(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.baseline_tree and not (Path(args.baseline_tree) / "quantopt" / "__init__.py").is_file():
        print(f"--baseline-tree {args.baseline_tree}: no quantopt package there", file=sys.stderr)
        return 2
    print(f"one thread, 4 samples at batch 1, least CPU time of {args.repeat} runs; ms per sample")
    head = f"{'model':<34} {'layers':>6} {'float ms':>9} {'stats/float':>11} {'int/float':>9} {'analysis/(f+i)':>14}"
    print(head + ("   speed-up vs baseline: float stats int analysis" if args.baseline_tree else ""))
    rows, speedups = [], []
    for name in names:
        base = run_child(name, args.repeat, args.baseline_tree, args.setting) if args.baseline_tree else None
        row = run_child(name, args.repeat, None, args.setting)
        if "error" in row:
            print(f"{name:<34} failed: {row['error']}")
            continue
        rows.append(row)
        s, i, a = ratios(row)
        line = f"{name:<34} {row['layers']:>6} {row['float']:>9.3f} {mark(s, 1.5):>11} {mark(i, 2.0):>9} {a:>14.2f}"
        if base is not None and "error" not in base:
            ups = [base[p] / row[p] for p in PASSES]
            speedups.append(ups)
            line += "   " + " ".join(f"{u:5.2f}" for u in ups)
        elif base is not None:
            line += f"   baseline failed: {base['error']}"
        print(line, flush=True)
    if not rows:
        return 1
    print()
    for label, index, target in (("stats/float", 0, 1.5), ("int/float", 1, 2.0), ("analysis/(float+int)", 2, None)):
        values = [ratios(r)[index] for r in rows]
        worst = max(rows, key=lambda r: ratios(r)[index])
        over = "" if target is None else f", above {target}: {sum(v > target for v in values)} of {len(values)}"
        print(f"{label:<22} median {statistics.median(values):.2f}, worst {max(values):.2f} ({worst['model']}){over}")
    if speedups:
        for k, p in enumerate(PASSES):
            values = [u[k] for u in speedups]
            print(f"speed-up of the {p} pass: median {statistics.median(values):.2f}, "
                  f"least {min(values):.2f}, most {max(values):.2f} over {len(values)} models")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
