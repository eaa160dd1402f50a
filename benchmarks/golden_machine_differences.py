"""Record which corpus goldens upstream's own optimizer writes otherwise on this machine's kind of CPU.

    python benchmarks/golden_machine_differences.py [model/letter ...] [--corpus DIR] [--upstream DIR] [--write]

The golden corpus (tests/data/golden_corpus) was made by the upstream optimizer on an AMD CPU. Its float forward is
torch's CPU kernels, and on an Intel CPU MKL takes other float32 GEMM and vector-math kernels (checked: with MKL
limited to its SSE4.2 kernels, a several-row GEMM still rounds otherwise there), so upstream run on an Intel machine
writes a few calibrated ranges one float32 ulp apart, and the LUTs and biases that follow from them. quantopt calls
the same kernels, so it writes what upstream writes on the machine it runs on, and the golden tests would fail there
for a reason that is not quantopt's.

For each case (default: every model/variant whose quantopt result here differs from its floor in
tests/data/golden_corpus/floors.json), this script runs upstream's optimizer on this machine with the golden's cfg
(torch and oneDNN asked for their AVX2 kernels, as the test suite does) and quantopt with the same cfg, and prints:
quantopt against upstream here, quantopt against the committed golden, upstream here against the committed golden.
A case is recorded only where quantopt here writes every layer as upstream here does, the floor's known differences
aside; the layers recorded are those upstream here writes otherwise than the committed golden. `--write` stores them
under this CPU's vendor in `machine_differences.json`, which tests/test_golden_corpus.py and
tests/test_upstream_defects.py read (tests/golden_helpers.py `machine_layers`): on that kind of CPU such a layer
must differ exactly as upstream's does, or not at all.

Needs the upstream tools (../shared/upstream or $QUANTOPT_UPSTREAM, `setup.sh opt` done once); exits with code 2 and
says so when they are absent. The project never uses them otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Tuple

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")  # the suite's pins (tests/conftest.py), before torch loads
os.environ.setdefault("DNNL_MAX_CPU_ISA", "AVX2")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the comparison helpers shared with the tests

from golden_helpers import (  # noqa: E402
    FAILED_NOTE,
    MACHINE_DIFFERENCES,
    QuantoptFailed,
    compare_with_golden,
    cpu_vendor,
    layer_kinds,
    run_golden_cfg,
)

DEFAULT_CORPUS = REPO / "tests" / "data" / "golden_corpus"
DEFAULT_UPSTREAM = Path(os.environ.get("QUANTOPT_UPSTREAM", REPO.parent / "shared" / "upstream"))
ABOUT = ("Per CPU vendor: the layers of corpus goldens that upstream's own optimizer writes otherwise on that kind of "
         "CPU than on the AMD CPU the goldens were made on, where quantopt there writes them as upstream there does. "
         "Written by `python benchmarks/golden_machine_differences.py --write` on such a machine; read by "
         "tests/test_golden_corpus.py and tests/test_upstream_defects.py (docs/golden-differences.md, 'Machines').")


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX-512, from /proc/cpuinfo."""
    name, flags = "", ""
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line
    return f"{name}, {'AVX-512' if ' avx512f' in flags else 'no AVX-512'}"


def _differing(result: Any) -> Dict[str, List[str]]:
    return {name: layer_kinds(d) for name, d in result.differing.items()}


def cases_off_their_floor(corpus: Path, work: Path) -> List[Tuple[str, str]]:
    """The model/letter pairs whose quantopt result here differs from the floor's differing layers."""
    floors = json.loads((corpus / "floors.json").read_text())["models"]
    off = []
    for model in sorted(floors):
        for letter, floor in sorted(floors[model].items()):
            folder = corpus / model / "golden" / letter
            if "quantopt_failed" in floor or (folder / FAILED_NOTE).is_file():
                continue
            ours = run_golden_cfg(folder, model, work / "scan" / f"{model}_{letter}", quiet=True)
            if sorted(_differing(compare_with_golden(ours, folder / f"{model}_o.txt"))) != sorted(floor["differing"]):
                off.append((model, letter))
    return off


def run_upstream(upstream: Path, corpus: Path, model: str, letter: str, work: Path) -> Path:
    """Upstream's quantized IR of the golden's cfg, made on this machine in a copy of the model's folder."""
    copy = work / "upstream" / model
    if not copy.exists():
        shutil.copytree(corpus / model, copy, ignore=shutil.ignore_patterns("*_o.txt", "*_o.bin", "*template.json"))
    folder = copy / "golden" / letter
    run = subprocess.run([str(upstream / "run-opt.sh"), str(folder / "opt.cfg")], capture_output=True, text=True,
                         timeout=1800)
    out = folder / "out" / f"{model}_o.txt"
    if run.returncode or not out.is_file():
        raise RuntimeError(f"upstream failed on {model}/{letter}: {run.stderr.strip()[-300:]}")
    return out


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", help="model/letter pairs (default: those off their floor here)")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--upstream", type=Path, default=DEFAULT_UPSTREAM)
    ap.add_argument("--write", action="store_true", help=f"store the result in the corpus's {MACHINE_DIFFERENCES}")
    args = ap.parse_args(argv)
    if not (args.upstream / "run-opt.sh").is_file():
        print(f"no upstream optimizer at {args.upstream} (set QUANTOPT_UPSTREAM or --upstream)", file=sys.stderr)
        return 2
    vendor = cpu_vendor()
    if not vendor:
        print("this machine names no CPU vendor in /proc/cpuinfo", file=sys.stderr)
        return 2
    from quantopt.registry import discover_plugins

    discover_plugins()
    floors = json.loads((args.corpus / "floors.json").read_text())["models"]
    recorded: Dict[str, Dict[str, List[str]]] = {}
    ok = True
    with tempfile.TemporaryDirectory(prefix="golden-machine-") as tmp:
        work = Path(tmp)
        cases = [tuple(c.split("/")) for c in args.cases] or cases_off_their_floor(args.corpus, work)
        print(f"{vendor}, {cpu_name()}: {len(cases)} cases")
        for model, letter in cases:
            golden = args.corpus / model / "golden" / letter / f"{model}_o.txt"
            try:
                ours = run_golden_cfg(golden.parent, model, work / "ours" / f"{model}_{letter}", quiet=True)
            except QuantoptFailed as e:
                print(f"{model}/{letter}: quantopt failed: {e}")
                ok = False
                continue
            up = run_upstream(args.upstream, args.corpus, model, letter, work)
            known = set(floors[model][letter]["differing"])
            vs_up = {k: v for k, v in _differing(compare_with_golden(ours, up)).items() if k not in known}
            up_vs_golden = _differing(compare_with_golden(up, golden))
            vs_golden = _differing(compare_with_golden(ours, golden))
            print(f"{model}/{letter}: quantopt vs upstream here differ in {vs_up or 'none'} (floor's aside); "
                  f"quantopt vs golden {vs_golden or 'none'}; upstream here vs golden {up_vs_golden or 'none'}")
            if vs_up:
                ok = False
            elif up_vs_golden:
                recorded[f"{model}/{letter}"] = up_vs_golden
    if args.write:
        path = args.corpus / MACHINE_DIFFERENCES
        data = json.loads(path.read_text()) if path.is_file() else {"about": ABOUT, "machines": {}}
        import torch

        data["machines"][vendor] = {"cpu": cpu_name(), "torch": torch.__version__,
                                    "cases": dict(sorted(recorded.items()))}
        path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
        print(f"wrote {len(recorded)} cases for {vendor} to {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
