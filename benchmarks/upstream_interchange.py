"""Interchange with the upstream Compass Optimizer: does it load and run the IRs quantopt writes?

    python benchmarks/upstream_interchange.py [--models vit_tiny,unet] [--upstream DIR] [--work DIR] [--calib 4]
                                              [--bits 16] [--trace] [--without-softmax-mask]

For each model of benchmarks/make_parser_histograms.py whose file is available here, quantopt imports the ONNX file
(float IR), quantizes it at 8 bits with the default settings on `--calib` seeded random inputs and writes both IRs
(`--bits 16`: 16-bit activations and weights, 48-bit biases).
The upstream optimizer (run as a separate program with its own venv, `run-opt.sh`'s environment: one thread, no
GPU) then loads each IR with its forward tool's loader and runs one more seeded input through it: the float IR as a
float graph, the quantized IR with quantopt's quantized input integers. The table compares its outputs with
quantopt's: for the float IR the largest difference relative to the output range, for the quantized IR the share
of output integers equal to quantopt's and the largest difference in quantization steps. The same quantized graph
is also exported as ONNX QDQ (`--scales exact`) and run by onnxruntime: the `qdq export` column is the share of
output integers equal to quantopt's, or the export's refusal.

Upstream location: `--upstream`, else $QUANTOPT_UPSTREAM, else ../shared/upstream (its opt venv at
$UPSTREAM_OPT_VENV, default /tmp/upstream-opt-venv). quantopt itself never imports or calls upstream; this script
runs outside CI. Scratch files go to `--work` (default: a new temporary folder).

`--trace` has upstream's forward tool dump every tensor of the quantized run and prints, in topological order, the
first layers whose integers differ from quantopt's (share identical, largest difference in steps).
`--without-softmax-mask` writes the Softmax layers fed by an attention mask without quantopt's
`mask_saturated_input` key (docs/integer-semantics.md), so both tools compute the masked Softmax upstream's way.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_parser_histograms as histograms  # noqa: E402
from _bench_common import seeded_inputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1200

DRIVER = r'''
import json, sys, traceback
import numpy as np
from AIPUBuilder.Optimizer.tools.optimizer_forward import OptForward

txt, bin_path, feeds, out, quantized = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"
dump_dir = sys.argv[6] if len(sys.argv) > 6 else None
status = {"loaded": False, "ran": False, "error": ""}
try:
    handler = OptForward(txt, bin_path)
    status["loaded"] = True
    data = np.load(feeds)
    inputs = [data[f"arr_{i}"] for i in range(len(data.files))]
    if quantized:
        outs = handler.forward_with_quantized_data(inputs, dump_dir=dump_dir)
    else:
        outs = handler.forward(inputs)
    np.savez(out, *[np.asarray(o) for o in outs])
    status["ran"] = True
except Exception as e:
    status["error"] = (type(e).__name__ + ": " + str(e)).splitlines()[0][:300]
    traceback.print_exc()
print("INTERCHANGE_STATUS " + json.dumps(status))
'''
"""Runs inside the upstream venv: load one IR with the upstream forward tool, run the given inputs, save outputs."""


@dataclass
class Row:
    model: str
    layers: int = 0
    float_ir: str = ""
    quant_ir: str = ""
    qdq: str = ""
    notes: List[str] = field(default_factory=list)


def run_upstream(upstream: Path, txt: str, bin_path: str, feeds: Sequence[np.ndarray], out: str,
                 quantized: bool, work: str, dump_dir: Optional[str] = None) -> Dict:
    """Load and run one IR with the upstream optimizer's forward tool in its venv; its status and outputs."""
    venv = Path(os.environ.get("UPSTREAM_OPT_VENV", "/tmp/upstream-opt-venv"))
    driver = os.path.join(work, "upstream_forward.py")
    Path(driver).write_text(DRIVER)
    feeds_path = out[:-4] + "_inputs.npz"
    np.savez(feeds_path, *feeds)
    env = dict(os.environ, PYTHONPATH=f"{upstream / 'Compass_Optimizer'}:{upstream / 'stubs'}", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    log = out[:-4] + ".log"
    with open(log, "w") as f:
        command = [str(venv / "bin" / "python"), driver, txt, bin_path, feeds_path, out, "1" if quantized else "0"]
        proc = subprocess.run(command + ([dump_dir] if dump_dir else []), stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=TIMEOUT_S, cwd=work)
    text = Path(log).read_text(errors="replace")
    errors = [ln.split("]: ", 1)[-1].strip() for ln in text.splitlines() if ln.startswith("[E]")]
    # upstream exits on its first logged error: that error says why
    status = {"loaded": False, "ran": False,
              "error": errors[0][:300] if errors else f"exit code {proc.returncode}, see {log}"}
    for line in text.splitlines():
        if line.startswith("INTERCHANGE_STATUS "):
            status = json.loads(line.split(" ", 1)[1])
    if errors and not status["error"]:
        status["error"] = errors[0][:300]
    status["log"] = log
    if status["ran"]:
        data = np.load(out)
        status["outputs"] = [data[f"arr_{i}"] for i in range(len(data.files))]
    return status


def _float_cell(status: Dict, ours: Sequence[torch.Tensor]) -> str:
    if not status["loaded"]:
        return f"load fails: {status['error']}"
    if not status["ran"]:
        return f"loads; run fails: {status['error']}"
    worst = 0.0
    for got, ref in zip(status["outputs"], ours):
        ref = ref.detach().double().numpy()
        span = max(float(ref.max() - ref.min()), 1e-12)
        worst = max(worst, float(np.abs(got.astype(np.float64).reshape(ref.shape) - ref).max()) / span)
    return f"loads, runs (max err {worst:.1e} of range)" + (f"; {status['error']}" if status["error"] else "")


def _quant_cell(status: Dict, ours: Sequence[torch.Tensor]) -> str:
    if not status["loaded"]:
        return f"load fails: {status['error']}"
    if not status["ran"]:
        return f"loads; run fails: {status['error']}"
    equal = total = 0
    steps = 0.0
    for got, ref in zip(status["outputs"], ours):
        ref = ref.detach().double().numpy()
        diff = np.abs(got.astype(np.float64).reshape(ref.shape) - ref)
        equal, total, steps = equal + int((diff == 0).sum()), total + diff.size, max(steps, float(diff.max()))
    return f"loads, runs ({equal / max(total, 1):.2%} identical, max {steps:g} steps)" + \
        (f"; {status['error']}" if status["error"] else "")


def model_inputs(name: str, graph, rng: np.random.Generator) -> List[torch.Tensor]:
    """One seeded input per graph input; for MiniLM token ids between [CLS] and [SEP], padding and token types 0
    (real_model_speed.minilm_feed: the embedding tables do not take seeded_inputs' ids)."""
    if name != "minilm_l6":
        return seeded_inputs(graph, rng)
    from real_model_speed import minilm_feed

    names = [t.name[:-2] for t in graph.input_tensors]  # the Input layer of ONNX input `n` writes `n_0`
    return [torch.from_numpy(v) for v in minilm_feed(rng, names).values()]


NP_DTYPES = {"int8": np.int8, "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16, "int32": np.int32,
             "uint32": np.uint32, "int64": np.int64, "float16": np.float16, "float32": np.float32}
TRACE_LAYERS = 12


def trace_layers(qgraph, dump_dir: str) -> List[str]:
    """The first TRACE_LAYERS layer outputs (topological order) whose integers in upstream's dump differ from
    quantopt's; upstream names each dumped file `<layer_id>_[<layer>]_<tensor>.bin` with '/' and ':' as '_'."""
    lines = []
    for n in qgraph.nodes:
        for t in n.outputs:
            path = os.path.join(dump_dir, f"{n.layer_id}_[{n.name}]_{t.name}".replace("/", "_").replace(":", "_")
                                + ".bin")
            dtype = NP_DTYPES.get(t.dtype.value)
            if dtype is None or not os.path.isfile(path):
                continue
            ours = t.betensor.detach().cpu().numpy().astype(np.float64)
            theirs = np.fromfile(path, dtype=dtype).astype(np.float64)
            if theirs.size != ours.size:
                lines.append(f"{n.name} ({n.type}): upstream wrote {theirs.size} values, quantopt has {ours.size}")
                continue
            diff = np.abs(theirs - ours.reshape(-1))
            if diff.max() > 0:
                lines.append(f"{n.name} ({n.type}, {t.dtype.value}): {np.mean(diff == 0):.4%} identical, "
                             f"max {diff.max():g} steps")
            if len(lines) >= TRACE_LAYERS:
                return lines
    return lines


def check_model(name: str, upstream: Path, work: str, calib: int, bits: int = 8, trace: bool = False,
                without_softmax_mask: bool = False) -> Row:
    from quantopt.exporters.agreement import measure_agreement
    from quantopt.frontends.onnx import import_onnx
    from quantopt.ir.writer import write_ir
    from quantopt.pipeline import quantize_model

    spec = histograms.MODELS[name]
    row = Row(name)
    path = histograms.model_path(spec)
    if path is None:
        row.float_ir = row.quant_ir = row.qdq = "model not available"
        return row
    folder = os.path.join(work, name)
    os.makedirs(folder, exist_ok=True)
    graph = import_onnx(path, spec["inputs"], input_values=spec.get("values") or None)
    row.layers = len(graph.nodes)
    rng = np.random.default_rng(0)
    batches = [model_inputs(name, graph, rng) for _ in range(calib)]
    test = model_inputs(name, graph, rng)
    float_txt, float_bin = write_ir(graph, os.path.join(folder, f"{name}.txt"))
    with torch.no_grad():
        float_out = [o.clone() for o in graph.forward(test)]
    status = run_upstream(upstream, float_txt, float_bin, [t.numpy() for t in test],
                          os.path.join(folder, "float_out.npz"), False, folder)
    row.float_ir = _float_cell(status, float_out)

    settings = {} if bits == 8 else dict(q_bits_activation=bits, q_bits_weight=bits, q_bits_bias=48)
    qgraph = quantize_model(graph, batches, settings)
    if without_softmax_mask:
        from quantopt.calibration.inf_mask import SOFTMAX_MASK_PARAM

        for n in qgraph.nodes:
            if n.params.get(SOFTMAX_MASK_PARAM):
                n.params[SOFTMAX_MASK_PARAM] = False
    q_txt, q_bin = write_ir(qgraph, os.path.join(folder, f"{name}_o.txt"))
    with torch.no_grad():
        q_out = [o.clone() for o in qgraph.forward(test, keep_tensors=True)]
        q_in = [t.betensor.clone() for t in qgraph.input_tensors]
    dump_dir = os.path.join(folder, "upstream_dump") if trace else None
    status = run_upstream(upstream, q_txt, q_bin, [t.numpy() for t in q_in], os.path.join(folder, "quant_out.npz"),
                          True, folder, dump_dir)
    row.quant_ir = _quant_cell(status, q_out)
    if dump_dir and status["ran"]:
        row.notes.extend(trace_layers(qgraph, dump_dir) or ["trace: every dumped layer output identical"])
    try:
        r = measure_agreement(qgraph, [t.numpy() for t in test])
        row.qdq = f"{r.identical:.2%} identical, max {r.max_steps:g} steps"
    except Exception as e:  # noqa: BLE001 - a refusal or failure of the export is the result being reported
        row.qdq = f"refused: {str(e).splitlines()[0][:300]}"
    return row


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(histograms.MODELS),
                    help="comma-separated subset of: " + ", ".join(histograms.MODELS))
    ap.add_argument("--upstream", default=os.environ.get("QUANTOPT_UPSTREAM", str(ROOT.parent / "shared" / "upstream")),
                    help="the upstream folder (default: %(default)s)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a new temporary folder)")
    ap.add_argument("--calib", type=int, default=4, help="calibration inputs per model (default: %(default)s)")
    ap.add_argument("--bits", type=int, choices=(8, 16), default=8,
                    help="activation and weight bits of the quantized IR (16: 48-bit biases; default: %(default)s)")
    ap.add_argument("--trace", action="store_true",
                    help="dump upstream's tensors and list the first layers whose integers differ from quantopt's")
    ap.add_argument("--without-softmax-mask", action="store_true",
                    help="write masked Softmax layers without quantopt's mask_saturated_input key")
    args = ap.parse_args(argv)
    upstream = Path(args.upstream)
    if not (upstream / "Compass_Optimizer").is_dir():
        print(f"the upstream optimizer is not at {upstream} (set --upstream or QUANTOPT_UPSTREAM)", file=sys.stderr)
        return 2
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in histograms.MODELS]
    if unknown:
        print(f"unknown models: {', '.join(unknown)}", file=sys.stderr)
        return 2
    work = args.work or tempfile.mkdtemp(prefix="upstream_interchange_")
    warnings.simplefilter("ignore")
    rows = []
    for name in names:
        try:
            row = check_model(name, upstream, work, args.calib, args.bits, args.trace, args.without_softmax_mask)
        except Exception as e:  # noqa: BLE001 - one model's failure is reported in its row, the others still run
            traceback.print_exc()
            row = Row(name, notes=[f"quantopt failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"])
        rows.append(row)
        print(f"{name}: float IR: {row.float_ir} | quantized IR: {row.quant_ir} | qdq: {row.qdq}", flush=True)
        for note in row.notes:
            print(f"    {note}", flush=True)
    print(f"\n| model | layers | upstream: float IR | upstream: quantized IR (int{args.bits}) "
          "| ONNX QDQ export (exact) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.model} | {r.layers} | {r.float_ir or '; '.join(r.notes)} | {r.quant_ir} | {r.qdq} |")
    print(f"\nscratch files: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
