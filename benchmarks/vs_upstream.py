"""Benchmark: the whole `quantopt --cfg` run against the upstream Compass Optimizer on the same float IR, cfg and
calibration data, in CPU seconds of each process, at 1 and 2 threads.

    python benchmarks/vs_upstream.py [--models a,b] [--threads 1,2] [--repeat 1] [--variant A] [--wait-policy passive]
                                     [--quick]

Models: the shared Parser IRs in ../shared/models ($QUANTOPT_SHARED_MODELS) with their golden/<variant>/opt.cfg and
calib.npy, and a Parser IR of PP-OCRv4 rec at 1x3x48x320 (made once with ../shared/upstream/run-parser.sh into
--cache, calibrated on 8 seeded text-line images). Each tool runs as its own process with OMP_NUM_THREADS /
MKL_NUM_THREADS (which set torch's thread count too) at each thread count; its CPU time is the
resource.getrusage(RUSAGE_CHILDREN) delta around the run (user + system), the least of --repeat runs. Printed per
model and thread count: both CPU times, wall times and quantopt / upstream (target <= 0.5). Imports dominate the
small models, so each tool's startup alone is measured too (quantopt's workflow imported with its plugins;
optimizer_main.py --help) and the ratio net of it printed. A tool failing on a model is one line; the exit code is 1
then. Figures: docs/performance.md.

The upstream tools are a yardstick only: quantopt never imports or depends on ../shared/upstream. This script runs
them as separate programs and exits with code 2 and a message when they or their venvs are absent (another folder:
$QUANTOPT_UPSTREAM; set them up with ../shared/upstream/setup.sh opt and ../shared/upstream/setup.sh parser; the
parser is needed only for the PP-OCRv4 rec IR). Upstream reads calibration data in its own dataset formats, so the
data is written for it into a scratch folder, never next to the models.
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import (  # noqa: E402  (the benchmarks folder is not a package)
    DEFAULT_CACHE,
    PPOCR_REC,
    SHARED_IR_NAMES,
    SHARED_MODELS,
    UPSTREAM,
    packaged_file,
    ppocr_rec_input,
)

OPT_MAIN = UPSTREAM / "Compass_Optimizer" / "AIPUBuilder" / "Optimizer" / "tools" / "optimizer_main.py"
OPT_VENV = Path(os.environ.get("UPSTREAM_OPT_VENV", "/tmp/upstream-opt-venv"))
PARSER_VENV = Path(os.environ.get("UPSTREAM_PARSER_VENV", "/tmp/upstream-parser-venv"))
MODELS = [*SHARED_IR_NAMES, "ppocr_rec"]
REC_SHAPE = [1, 3, 48, 320]
REC_CALIB = 8
PATH_FIELDS = ("graph", "bin", "calibration_data", "data", "label", "opt_config")
TARGET = 0.5


class Skip(Exception):
    """A model whose inputs cannot be made here: reported, not a failure."""


@dataclass
class Case:
    """One model: its cfg fields (absolute paths; calibration data still in quantopt's form)."""
    name: str
    fields: Dict[str, str]
    layers: int


# ------------------------------------------------------------------------------------------------ cfg handling
def read_cfg(path: Path) -> Dict[str, str]:
    """The [Common] key = value pairs, relative paths made absolute from the cfg's folder (both tools would resolve
    them from there; the rewritten cfgs live elsewhere)."""
    fields: Dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z_][\w]*)\s*=\s*(.*?)\s*$", line)
        if not m:
            continue
        key, value = m.groups()
        if key in PATH_FIELDS and value and not os.path.isabs(value):
            value = str((path.parent / value).resolve())
        fields[key] = value
    return fields


def write_cfg(fields: Dict[str, str], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[Common]\n" + "".join(f"{k} = {v}\n" for k, v in fields.items()))
    return path


def layer_count(txt: str) -> int:
    m = re.search(r"^\s*layer_number\s*=\s*(\d+)", Path(txt).read_text(), re.M)
    return int(m.group(1)) if m else 0


def calibration_for_upstream(src: str, scratch: Path) -> Tuple[str, str]:
    """Calibration data in the form upstream's dataset plugins read, written into `scratch`; returns (dataset name,
    path). One array becomes a plain float32 .npy for `numpydataset`; an .npz of named inputs becomes the pickled
    dict `numpymultiinputdataset` loads (a form quantopt refuses to load, hence a copy for upstream only)."""
    scratch.mkdir(parents=True, exist_ok=True)
    if src.endswith(".npz"):
        with np.load(src) as z:
            data = {k: np.ascontiguousarray(z[k]) for k in z.files}
        out = scratch / (Path(src).stem + "_upstream.npy")
        np.save(out, data, allow_pickle=True)
        return "numpymultiinputdataset", str(out)
    out = scratch / (Path(src).stem + "_upstream.npy")
    np.save(out, np.ascontiguousarray(np.load(src)))
    return "numpydataset", str(out)


# ------------------------------------------------------------------------------------------------ models
def shared_case(name: str, variant: str) -> Case:
    cfg = SHARED_MODELS / name / "golden" / variant / "opt.cfg"
    if not cfg.is_file():
        raise Skip(f"{cfg} absent")
    fields = read_cfg(cfg)
    return Case(name, fields, layer_count(fields["graph"]))


def rec_parser_ir(cache: Path) -> Path:
    """PP-OCRv4 rec as an upstream Parser IR, made once into `cache` (the Parser takes about a minute)."""
    out = cache / "ppocr_rec_parser"
    txt = out / "ppocr_rec.txt"
    if txt.is_file() and (out / "ppocr_rec.bin").is_file():
        return txt
    onnx_path = packaged_file(*PPOCR_REC)
    if onnx_path is None:
        raise Skip("package rapidocr_onnxruntime not installed (see benchmarks/requirements.txt)")
    if not (PARSER_VENV / "bin" / "python").exists():
        raise Skip(f"no upstream Parser venv at {PARSER_VENV} (run {UPSTREAM / 'setup.sh'} parser)")
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cfg = Path(tmp) / "parser.cfg"
        cfg.write_text("[Common]\nmodel_type = onnx\nmodel_name = ppocr_rec\nmodel_domain = image_classification\n"
                       f"input_model = {onnx_path}\ninput = x\ninput_shape = [{','.join(map(str, REC_SHAPE))}]\n"
                       f"output_dir = {tmp}/ir\n")
        print(f"ppocr_rec: making the Parser IR into {out} (once)", flush=True)
        proc = subprocess.run([str(UPSTREAM / "run-parser.sh"), str(cfg)], capture_output=True, text=True)
        made = Path(tmp) / "ir" / "ppocr_rec.txt"
        if proc.returncode != 0 or not made.is_file():
            raise RuntimeError(f"upstream Parser failed on PP-OCRv4 rec: {last_line(proc.stdout + proc.stderr)}")
        out.mkdir(parents=True, exist_ok=True)
        shutil.move(str(made.with_suffix(".bin")), out / "ppocr_rec.bin")
        shutil.move(str(made), txt)
    return txt


def rec_case(cache: Path) -> Case:
    txt = rec_parser_ir(cache)
    calib = txt.parent / "calib.npy"
    if not calib.is_file():
        rng = np.random.default_rng(0)
        np.save(calib, np.concatenate([ppocr_rec_input(rng, REC_SHAPE[3]) for _ in range(REC_CALIB)]))
    # the shared goldens' variant A settings, so this row is comparable with the others
    fields = {"graph": str(txt), "bin": str(txt.with_suffix(".bin")), "model_name": "ppocr_rec",
              "dataset": "numpydataset", "calibration_data": str(calib), "calibration_batch_size": "1",
              "quantize_method_for_weight": "per_tensor_symmetric_restricted_range",
              "quantize_method_for_activation": "per_tensor_symmetric_full_range"}
    return Case("ppocr_rec", fields, layer_count(str(txt)))


# ------------------------------------------------------------------------------------------------ running
def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"error|\[E\]|Traceback|Exception", ln, re.I)]
    return (errors or lines or ["(no output)"])[-1][:300]


def thread_env(threads: int, wait_policy: Optional[str]) -> Dict[str, str]:
    """The same thread settings for both tools; OMP_WAIT_POLICY only with --wait-policy (on a busy machine
    OpenMP's default spin-waiting of idle threads counts as CPU time of the run)."""
    n = str(threads)
    env = dict(os.environ, OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n, CUDA_VISIBLE_DEVICES="")
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy.upper()
    return env


def quantopt_command(cfg: Path) -> List[str]:
    script = Path(sys.executable).parent / "quantopt"
    if script.exists():
        return [str(script), "--cfg", str(cfg)]
    return [sys.executable, "-c", "import sys; from quantopt.cli import main; sys.exit(main())", "--cfg", str(cfg)]


def upstream_command(cfg: Path) -> List[str]:
    return [str(OPT_VENV / "bin" / "python"), str(OPT_MAIN), "--cfg", str(cfg)]


def timed_run(cmd: List[str], cfg: Path, env: Dict[str, str]) -> Tuple[float, float, Optional[str]]:
    """(CPU seconds of the child and its children, wall seconds, error line or None)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cfg.parent, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        return cpu, wall, f"exit {proc.returncode}: {last_line(proc.stdout + proc.stderr)}"
    return cpu, wall, None


def run_case(case: Case, threads: int, repeat: int, scratch: Path, wait_policy: Optional[str]) -> Dict[str, object]:
    """Both tools on one model at one thread count, alternating so that load from others hits both alike."""
    work = scratch / f"{case.name}_t{threads}"
    dataset, upstream_calib = calibration_for_upstream(case.fields["calibration_data"], work)
    tools = {
        "quantopt": (dict(case.fields, output_dir=str(work / "quantopt_out")), quantopt_command),
        "upstream": (dict(case.fields, dataset=dataset, calibration_data=upstream_calib,
                          output_dir=str(work / "upstream_out")), upstream_command),
    }
    env = thread_env(threads, wait_policy)
    upstream_env = dict(env, PYTHONPATH=os.pathsep.join([str(UPSTREAM / "Compass_Optimizer"),
                                                         str(UPSTREAM / "stubs")]))
    best: Dict[str, Tuple[float, float]] = {}
    for _ in range(repeat):
        for tool, (fields, command) in tools.items():
            cfg = write_cfg(fields, work / f"{tool}.cfg")
            shutil.rmtree(fields["output_dir"], ignore_errors=True)
            cpu, wall, error = timed_run(command(cfg), cfg, upstream_env if tool == "upstream" else env)
            if error is None and not (Path(fields["output_dir"]) / f"{case.fields['model_name']}_o.txt").is_file():
                error = "finished without writing the quantized IR"
            if error is not None:
                return {"error": f"{tool}: {error}"}
            if tool not in best or cpu < best[tool][0]:
                best[tool] = (cpu, wall)
    return {"quantopt": best["quantopt"], "upstream": best["upstream"]}


def startup(threads: int, repeat: int, wait_policy: Optional[str]) -> Dict[str, Tuple[float, float]]:
    """CPU seconds of each tool loading itself without working: quantopt's workflow module and plugins imported,
    optimizer_main.py --help (which imports the whole tool first). It dominates the small models' rows."""
    env = thread_env(threads, wait_policy)
    upstream_env = dict(env, PYTHONPATH=os.pathsep.join([str(UPSTREAM / "Compass_Optimizer"),
                                                         str(UPSTREAM / "stubs")]))
    quantopt_cmd = [sys.executable, "-c", "import quantopt.master, quantopt.registry as r; r.discover_plugins()"]
    commands = {"quantopt": (quantopt_cmd, env),
                "upstream": ([str(OPT_VENV / "bin" / "python"), str(OPT_MAIN), "--help"], upstream_env)}
    best: Dict[str, Tuple[float, float]] = {}
    for _ in range(repeat):
        for tool, (cmd, tool_env) in commands.items():
            cpu, wall, error = timed_run(cmd, UPSTREAM / "README.md", tool_env)
            if error is not None:
                print(f"startup of {tool} failed ({error}): its row is not meaningful", flush=True)
            if tool not in best or cpu < best[tool][0]:
                best[tool] = (cpu, wall)
    return best


def table(rows: List[Dict[str, object]], base: Dict[int, Dict[str, Tuple[float, float]]]) -> str:
    head = ["model", "layers", "threads", "quantopt CPU s", "upstream CPU s", f"quantopt/upstream (≤{TARGET})",
            "ratio net of startup", "quantopt wall s", "upstream wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t, b in sorted(base.items()):
        (qc, qw), (uc, uw) = b["quantopt"], b["upstream"]
        lines.append(f"| (startup only) | | {t} | {qc:.1f} | {uc:.1f} | {qc / uc:.2f} | | {qw:.1f} | {uw:.1f} |")
    for r in rows:
        (qc, qw), (uc, uw) = r["quantopt"], r["upstream"]  # type: ignore[misc]
        ratio = qc / uc
        net = ""
        if r["threads"] in base:
            q0, u0 = base[r["threads"]]["quantopt"][0], base[r["threads"]]["upstream"][0]  # type: ignore[index]
            net = f"{(qc - q0) / (uc - u0):.2f}" if uc - u0 > 0.05 else "n/a"
        lines.append(f"| {r['model']} | {r['layers']} | {r['threads']} | {qc:.1f} | {uc:.1f} | "
                     f"{ratio:.2f}{'' if ratio <= TARGET else ' ✗'} | {net} | {qw:.1f} | {uw:.1f} |")
    return "\n".join(lines)


def parse(argv: List[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list (default: {', '.join(MODELS)})")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts (default 1,2)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per tool; the least CPU time counts")
    ap.add_argument("--variant", default="A", help="which golden cfg of the shared models (A, B or C)")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="folder for the PP-OCRv4 rec Parser IR")
    ap.add_argument("--wait-policy", choices=["active", "passive"], default=None,
                    help="set OMP_WAIT_POLICY for both tools (default: unset, OpenMP's own)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (cfgs, data, both tools' outputs)")
    ap.add_argument("--quick", action="store_true", help="smoke run: syn_resnet and mtcnn_onet at 1 thread, once")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m.strip() and m.strip() not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)} (known: {', '.join(MODELS)})")
    if args.quick:
        args.models, args.threads, args.repeat = "syn_resnet,mtcnn_onet", "1", 1
    return args


def main(argv: List[str]) -> int:
    args = parse(argv)
    missing = [str(p) for p in (OPT_MAIN, OPT_VENV / "bin" / "python") if not p.exists()]
    if missing:
        print(f"upstream Compass Optimizer not available ({', '.join(missing)} absent): set it up with "
              f"{UPSTREAM / 'setup.sh'} opt (and parser), or point UPSTREAM_OPT_VENV at its venv", file=sys.stderr)
        return 2
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    print(f"quantopt --cfg vs upstream optimizer_main.py --cfg; cfg variant {args.variant} (PP-OCRv4 rec: A's "
          f"settings); threads {threads}; OMP_WAIT_POLICY {args.wait_policy or 'unset'}; least CPU time of "
          f"{args.repeat} run(s)", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="vs_upstream_"))
    rows: List[Dict[str, object]] = []
    failed: List[str] = []
    base = {t: startup(t, args.repeat, args.wait_policy) for t in threads}
    for t, b in base.items():
        print(f"startup only ({t} thread(s)): quantopt {b['quantopt'][0]:.1f} s, upstream {b['upstream'][0]:.1f} s CPU",
              flush=True)
    try:
        for name in names:
            try:
                if name == "ppocr_rec":
                    case = rec_case(cache)
                elif name in SHARED_IR_NAMES:
                    case = shared_case(name, args.variant)
                else:
                    raise Skip(f"unknown model (known: {', '.join(MODELS)})")
            except Skip as e:
                print(f"{name}: skipped: {e}", flush=True)
                continue
            except Exception as e:  # noqa: BLE001  (one model's failure is reported, the others still run)
                failed.append(f"{name}: FAILED: {type(e).__name__}: {' '.join(str(e).split())}")
                print(failed[-1], flush=True)
                continue
            for t in threads:
                r = run_case(case, t, args.repeat, scratch, args.wait_policy)
                if "error" in r:
                    failed.append(f"{name} ({t} thread(s)): FAILED: {r['error']}")
                    print(failed[-1], flush=True)
                    continue
                rows.append(dict(r, model=name, layers=case.layers, threads=t))
                (qc, _), (uc, _) = r["quantopt"], r["upstream"]  # type: ignore[misc]
                print(f"{name} ({t} thread(s)): quantopt {qc:.1f} s, upstream {uc:.1f} s CPU, ratio {qc / uc:.2f}",
                      flush=True)
    finally:
        if args.keep:
            print(f"scratch kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    if rows:
        print("\nCPU seconds of the whole run (user + system):\n" + table(rows, base))
    for line in failed:
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
