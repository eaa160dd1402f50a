"""Upstream conformance: quantopt run with each golden cfg (A: defaults; B: per-channel weights, asymmetric
activations, extrema; C: 16 bits, lut_items_in_bits=10) on the shared models must reproduce, for at least 95% of
the layers, the golden IR's output scales/zero points/dtypes, multipliers/shifts and quantized constants.
Deliberate differences are listed in docs/golden-differences.md."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
from conftest import shared_model_dir
from golden_helpers import run_golden_cfg
from quant_helpers import params_of

from quantopt.analysis.ir_compare import (
    compare_quantized_irs,
    forgive_upstream_bias_wrap,
    identical_fraction,
    template_ranges,
)
from quantopt.ir.reader import read_ir

MODELS = ("syn_resnet", "syn_mobilenet", "ppocr_cls", "mtcnn_onet")
GOLDENS = ("A", "B", "C")
REQUIRED = 0.95
SCALE_RTOL = 1e-6
RANGES_ALLOWED_TO_DIFFER = 2
"""Calibrated (fmin, fmax) pairs per golden that may differ from upstream's template bit for bit: the float forward
follows upstream's (docs/architecture.md, "Float reference"), and on syn_mobilenet B two ranges still sit one ulp
away without changing any written value (docs/golden-differences.md)."""
"""Scales agree to float32 precision: two float32 forwards that sum in different orders (upstream's convolution
kernels versus torch's on this machine) give calibrated ranges a few float32 ulps apart."""


def run_golden(model: str, letter: str, out: Path) -> Path:
    """The golden cfg with paths made absolute and output redirected to `out`; returns the written IR."""
    return run_golden_cfg(shared_model_dir(model) / "golden" / letter, model, out)


@pytest.mark.parametrize("letter", GOLDENS)
@pytest.mark.parametrize("model", MODELS)
def test_golden_layers_match(model: str, letter: str, tmp_path: Path) -> None:
    ours = read_ir(str(run_golden(model, letter, tmp_path / "out")))
    golden_dir = shared_model_dir(model) / "golden" / letter
    golden = read_ir(str(golden_dir / f"{model}_o.txt"))
    diffs = compare_quantized_irs(ours, golden, rtol=SCALE_RTOL)
    forgive_upstream_bias_wrap(diffs, ours, golden)
    fraction = identical_fraction(diffs)
    report: Dict[str, List[str]] = {d.name: d.differences for d in diffs if not d.identical}
    print(f"{model}/{letter}: {fraction:.1%} of {len(diffs)} layers identical; differences: {report}")
    assert fraction >= REQUIRED, f"{model}/{letter}: only {fraction:.1%} identical: {report}"
    unexplained = {name: d for name, d in report.items() if not _ulp_consequence(ours, golden, name, d)}
    assert not unexplained, f"{model}/{letter}: differences not explained by float32 scale rounding: {unexplained}"
    mine = template_ranges(tmp_path / "out" / f"{model}_opt_template.json")
    theirs = template_ranges(golden_dir / f"{model}_opt_template.json")
    different = sorted(t for t in theirs if mine.get(t) != theirs[t])
    assert len(different) <= RANGES_ALLOWED_TO_DIFFER, f"{model}/{letter}: calibrated ranges differ: {different}"


def _multiplier_step(difference: str) -> bool:
    """`scale_value 21722 != 21721` (or lists of multipliers): multipliers at most one step apart, as a ratio of
    scales a few ulps apart gives when it sits next to a rounding tie."""
    key, _, rest = difference.partition(" ")
    if key != "scale_value" or " != " not in rest:
        return False
    try:
        a, b = (ast.literal_eval(side.strip()) for side in rest.split(" != "))
    except (ValueError, SyntaxError):
        return False
    a, b = (list(v) if isinstance(v, (list, tuple)) else [v] for v in (a, b))
    return len(a) == len(b) and all(isinstance(x, int) and isinstance(y, int) and abs(x - y) <= 1
                                    for x, y in zip(a, b))


def _ulp_consequence(ours, golden, name: str, differences: List[str]) -> bool:
    """A difference is explained when it is only in constants derived from calibrated scales (biases, LUTs) and
    one of the layer's input or output scales differs from the golden's by a few float32 ulps (within SCALE_RTOL
    but not equal): a float forward summing in another order than upstream's moves calibrated ranges by ulps, and
    at 16 bits (bias scales ~1e9) or near rounding ties one ulp moves a bias or table entry. Every golden matches
    on all layers today (docs/golden-differences.md); this keeps any future difference to that kind."""
    if not all(d.startswith(("constant biases", "constant lut")) or _multiplier_step(d) for d in differences):
        return False
    mine, ref = ours.node(name), golden.node(name)
    pairs = list(zip(mine.inputs, ref.inputs)) + list(zip(mine.outputs, ref.outputs))
    for t, r in pairs:
        a, b = float(np.float32(params_of(mine, t).scale)), float(np.float32(params_of(ref, r).scale))
        if a != b and abs(a - b) <= SCALE_RTOL * abs(b):
            return True
    return False
