"""Benchmark: how closely quantopt reproduces the upstream optimizer's goldens, layer by layer and range by range.

    python benchmarks/golden_ranges.py [model ...] [--goldens A,B,C] [--models-dir DIR] [--torch-float32 fc|mac]
                                       [--set FIELD=VALUE ...]

For each shared model and golden (`golden/{A,B,C}/opt.cfg`), runs `quantopt --cfg` with the golden's cfg and prints
two figures:
- identical layers: the share of layers whose written parameters and constants equal the golden IR's
  (`quantopt.analysis.ir_compare`, scales within 1e-6 relative; the biases upstream wraps around at int32 are left
  out, as in tests/test_golden_conformance.py);
- identical ranges: how many calibrated tensors have the golden template's `fmin` and `fmax` bit for bit.

`--set FIELD=VALUE` adds a cfg field to every golden's cfg (e.g. `--set fc_float_summation=float64`).
`--torch-float32 fc` computes the float forward of FullyConnected with torch's float32 kernel instead of quantopt's
fixed float32 order (ops/_fc_order.py); `--torch-float32 mac` also runs Convolution/DepthwiseConv in torch's float32
instead of quantopt's float64. Those kernels sum in an
order that depends on the machine and on the MKL/oneDNN settings (`MKL_ENABLE_INSTRUCTIONS`, `MKL_CBWR`,
`ONEDNN_MAX_CPU_ISA`), which is how docs/golden-differences.md finds the float forward upstream's goldens come from.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
from _bench_common import REPO as _REPO
from _bench_common import SHARED_MODELS

sys.path.insert(0, str(_REPO / "tests"))  # the golden cfg helper shared with the tests
from golden_helpers import golden_cfg  # noqa: E402

import quantopt.ops.conv as conv_ops
import quantopt.ops.linear as linear_ops
from quantopt.analysis.ir_compare import (
    compare_quantized_irs,
    forgive_upstream_bias_wrap,
    identical_fraction,
    template_ranges,
)
from quantopt.cli import main as quantopt_main
from quantopt.ir.reader import read_ir

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS_DIR = SHARED_MODELS
DEFAULT_MODELS = ["syn_resnet", "syn_mobilenet", "ppocr_cls", "mtcnn_onet"]
SCALE_RTOL = 1e-6


def measure(models_dir: Path, model: str, letter: str, work: Path,
            extra: Sequence[str] = ()) -> Tuple[float, int, int, int]:
    """(identical-layer share, layers, tensors with identical ranges, tensors compared) for one golden."""
    folder = models_dir / model / "golden" / letter
    out = work / f"{model}_{letter}" / "out"
    out.mkdir(parents=True)
    cfg = golden_cfg(folder, out, out.parent / "golden.cfg", extra)
    if quantopt_main(["--cfg", str(cfg), "--log-level", "ERROR"]) != 0:
        raise SystemExit(f"quantopt failed on {folder / 'opt.cfg'}")
    mine, golden = read_ir(str(out / f"{model}_o.txt")), read_ir(str(folder / f"{model}_o.txt"))
    diffs = compare_quantized_irs(mine, golden, rtol=SCALE_RTOL)
    forgive_upstream_bias_wrap(diffs, mine, golden)
    ours = template_ranges(out / f"{model}_opt_template.json")
    theirs = template_ranges(folder / f"{model}_opt_template.json")
    shared = [t for t in ours if t in theirs]
    same = sum(ours[t] == theirs[t] for t in shared)
    return identical_fraction(diffs), len(diffs), same, len(shared)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    parser.add_argument("--goldens", default="A,B,C", help="comma-separated golden letters (default A,B,C)")
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    parser.add_argument("--torch-float32", choices=("none", "fc", "mac"), default="none",
                        help="layers whose float forward runs torch's float32 kernel instead of quantopt's own sums: "
                             "none, FullyConnected (fc), or FullyConnected and convolutions (mac)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a cfg field added to every golden's cfg (repeatable)")
    args = parser.parse_args(argv)
    extra = []
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            parser.error(f"--set expects FIELD=VALUE, got {item!r}")
        extra.append(f"{key.strip()} = {value.strip()}")
    # diagnostic switches of this script only (quantopt itself never uses torch's float32 kernels here)
    if args.torch_float32 in ("fc", "mac"):
        linear_ops.FLOAT32_FC_ORDER = "torch"
    if args.torch_float32 == "mac":
        conv_ops.MAC_FLOAT_DTYPE = torch.float32
    print(f"torch float32 kernels for: {args.torch_float32}; torch {torch.__version__}")
    print(f"{'golden':<18} {'identical layers':>18} {'identical ranges':>18}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for letter in args.goldens.split(","):
                if not (args.models_dir / model / "golden" / letter / "opt.cfg").is_file():
                    print(f"{model}/{letter}: no golden here, skipped")
                    continue
                share, layers, same, compared = measure(args.models_dir, model, letter, Path(tmp), extra)
                print(f"{model + '/' + letter:<18} {share:>8.1%} of {layers:<6} {same:>8} of {compared:<6}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
