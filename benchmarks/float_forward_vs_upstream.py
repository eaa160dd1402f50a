"""Benchmark: quantopt's float forward against the upstream optimizer's, tensor by tensor, on float IRs.

    python benchmarks/float_forward_vs_upstream.py [model ...] [--corpus DIR] [--all] [--upstream DIR]

Calibrated ranges only show a tensor's extremes; this compares every value. For each corpus model (a folder with
`<name>.txt/.bin` and `calib.npy` or `calib.npz`, as benchmarks/make_golden_corpus.py writes them) the upstream
optimizer's forward tool, run as a separate program in its venv with its dtype fitting off (as during its
calibration), runs the calibration samples one at a time and saves every layer output with the torch dtype it was
computed in. quantopt runs the same samples through its own float forward. Printed per tensor: the producing layer's
type, upstream's dtype (float64 means upstream hands the unrounded value on), whether quantopt keeps a float64 value
for it (docs/architecture.md, "Float reference"), the number of elements whose float32 values differ, and, where
upstream holds float64, the number whose float64 values differ from quantopt's (a different float64 summation order
shows there without changing any float32 value). Only tensors with a difference are printed unless `--all`.

Run it with the same torch kernels upstream ran with: the committed corpus was made with torch's AVX2 kernels, so on
an AVX-512 machine export `ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2` first (docs/golden-differences.md,
"Machines"). The upstream tools are a yardstick only: quantopt never imports them; this script exits with code 2
when they or their venv are absent (`--upstream`, $QUANTOPT_UPSTREAM, default ../shared/upstream; venv
$UPSTREAM_OPT_VENV, default /tmp/upstream-opt-venv).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = ROOT / "tests" / "data" / "golden_corpus"
DEFAULT_UPSTREAM = Path(os.environ.get("QUANTOPT_UPSTREAM", ROOT.parent / "shared" / "upstream"))
OPT_VENV = Path(os.environ.get("UPSTREAM_OPT_VENV", "/tmp/upstream-opt-venv"))
TIMEOUT_S = 900

DRIVER = r'''
import json, sys
import numpy as np
from AIPUBuilder.Optimizer.tools.optimizer_forward import OptForward
txt, bin_path, feeds, out = sys.argv[1:5]
handler = OptForward(txt, bin_path)
data = np.load(feeds)
names = sorted(data.files, key=lambda s: int(s.split("_")[1]))
values, dtypes = {}, {}
for s in range(data[names[0]].shape[0]):
    handler.forward([data[k][s:s + 1] for k in names], keep_tensors=True, fit_dtype=False)
    for node in handler.optimizer.g.nodes:
        for t in node.outputs:
            dtypes[t.name] = str(t.betensor.dtype)
            if t.betensor.is_floating_point():
                values[f"{s}|{t.name}"] = t.betensor.detach().cpu().double().numpy()
np.savez(out + ".npz", **values)
json.dump(dtypes, open(out + ".json", "w"))
'''
"""Runs inside the upstream venv: every layer output of every sample, as float64, with the dtype it had."""


def calibration_arrays(folder: Path) -> List[np.ndarray]:
    """The model's calibration samples, one array per graph input."""
    if (folder / "calib.npy").is_file():
        return [np.load(folder / "calib.npy")]
    with np.load(folder / "calib.npz") as data:
        return [data[k] for k in data.files]


def run_upstream(upstream: Path, folder: Path, arrays: List[np.ndarray], work: Path) -> Tuple[Dict, Dict]:
    """(values by 'sample|tensor', dtype by tensor) of upstream's float forward."""
    folder = folder.resolve()
    name = folder.name
    feeds, out, driver = work / "feeds.npz", work / "upstream", work / "driver.py"
    np.savez(feeds, *arrays)
    driver.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=f"{upstream / 'Compass_Optimizer'}:{upstream / 'stubs'}", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    done = subprocess.run([str(OPT_VENV / "bin" / "python"), str(driver), str(folder / f"{name}.txt"),
                           str(folder / f"{name}.bin"), str(feeds), str(out)], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=work)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"upstream's forward failed on {name}: {last[0]}")
    with np.load(str(out) + ".npz") as data:
        values = {k: data[k] for k in data.files}
    return values, json.loads(Path(str(out) + ".json").read_text())


def run_quantopt(folder: Path, arrays: List[np.ndarray]) -> Tuple[Dict, Dict, Dict, List[str]]:
    """(float values, float64 values kept, layer types by tensor, tensor order) of quantopt's float forward."""
    from quantopt.ir.reader import read_ir
    from quantopt.registry import discover_plugins

    discover_plugins()
    graph = read_ir(str(folder / f"{folder.name}.txt"), str(folder / f"{folder.name}.bin"))
    values: Dict[str, np.ndarray] = {}
    wide: Dict[str, np.ndarray] = {}
    types: Dict[str, str] = {}
    order: List[str] = []
    sample = [0]

    def hook(node) -> None:
        for t in node.outputs:
            key = f"{sample[0]}|{t.name}"
            if sample[0] == 0:
                types[t.name] = str(node.type)
                order.append(t.name)
            values[key] = t.betensor.detach().double().numpy().copy()
            kept = graph.wide_values.get(t)
            if kept is not None:
                wide[key] = kept.detach().numpy().copy()

    with torch.no_grad():
        for s in range(arrays[0].shape[0]):
            sample[0] = s
            graph.forward([torch.from_numpy(a[s:s + 1]) for a in arrays], after_node=hook)
    return values, wide, types, order


def compare(folder: Path, upstream: Path, show_all: bool) -> int:
    """Print the per-tensor table of one model; returns the number of tensors whose float32 values differ."""
    arrays = calibration_arrays(folder)
    with tempfile.TemporaryDirectory(prefix="float_forward_") as work:
        up, dtypes = run_upstream(upstream, folder, arrays, Path(work))
    mine, wide, types, order = run_quantopt(folder, arrays)
    samples = arrays[0].shape[0]
    print(f"{folder.name}: {samples} samples")
    print(f"  {'tensor':48s} {'layer':16s} {'upstream':9s} {'kept':5s} {'f32 diff':>9s} {'f64 diff':>9s} {'of':>8s}")
    differing = 0
    for name in order:
        if f"0|{name}" not in up:
            continue
        d32 = d64 = total = 0
        for s in range(samples):
            u, q = up[f"{s}|{name}"], mine[f"{s}|{name}"]
            if u.size != q.size:
                d32 = -1
                break
            u = u.reshape(q.shape)
            total += u.size
            d32 += int((u.astype(np.float32) != q.astype(np.float32)).sum())
            if dtypes[name] == "torch.float64":
                d64 += int((u != wide.get(f"{s}|{name}", q)).sum())
        differing += int(d32 != 0)
        if show_all or d32 != 0:
            up_type = dtypes[name].replace("torch.", "")
            kept = "yes" if f"0|{name}" in wide else ""
            print(f"  {name[:48]:48s} {types[name][:16]:16s} {up_type:9s} {kept:5s} {d32:9d} {d64:9d} {total:8d}")
    print(f"  {differing} tensor(s) with float32 values different from upstream's")
    return differing


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="corpus models (default: every model with a Parser IR)")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--upstream", type=Path, default=DEFAULT_UPSTREAM)
    parser.add_argument("--all", action="store_true", help="print every tensor, not only those that differ")
    args = parser.parse_args(argv)
    if not (args.upstream / "Compass_Optimizer").is_dir() or not (OPT_VENV / "bin" / "python").is_file():
        print(f"float_forward_vs_upstream: needs the upstream optimizer in {args.upstream} and its venv in {OPT_VENV} "
              f"(see its README); quantopt itself never needs them", file=sys.stderr)
        return 2
    names = args.models or sorted(p.name for p in args.corpus.iterdir()
                                  if (p / f"{p.name}.onnx").is_file() and (p / f"{p.name}.txt").is_file())
    failed = 0
    for name in names:
        try:
            compare(args.corpus / name, args.upstream, args.all)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            print(f"{name}: {e}")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
