"""Layer-by-layer comparison of two quantized IRs (e.g. quantopt's output against another optimizer's): the
quantization parameters and quantized constants that decide the integer computation."""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tables import quant_of
from ..quant.requant import INT32_MAX, INT32_MIN

COMPARED_PARAMS = ("scale_value", "shift_value", "scale_type", "shift_type", "weights_scale", "weights_zp",
                   "biases_scale", "biases_zp", "quantize_method")
"""IR params compared when the reference layer has them (floats compared as float32)."""

COMPARED_CONSTANTS = ("weights", "biases", "lut", "lut_exp", "scale", "shift", "weights_scale", "weights_zp",
                      "biases_scale", "negative_slope")
"""Constants compared (values and dtype) when the reference layer has them."""


@dataclass
class LayerDiff:
    name: str
    type: str
    differences: List[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.differences


def _f32(v: Any) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        v = v.detach().numpy()
    return np.asarray(v, dtype=np.float32)


def _same(a: Any, b: Any, rtol: float = 0.0) -> bool:
    if isinstance(a, (float, torch.Tensor)) or isinstance(b, (float, torch.Tensor)):
        if a is None or b is None:
            return False
        x, y = _f32(a), _f32(b)
        if x.shape != y.shape:
            return False
        return bool(np.array_equal(x, y)) if rtol == 0.0 else bool(np.allclose(x, y, rtol=rtol, atol=0.0))
    return a == b


FLOAT_PARAMS = ("weights_scale", "biases_scale")
"""Float params that derive from calibrated scales (compared with the scale tolerance)."""


def _compare_node(mine: PyNode, ref: PyNode, rtol: float) -> List[str]:
    diffs: List[str] = []
    mine_q, ref_q = quant_of(mine), quant_of(ref)  # each IR's own params
    for i, (t, r) in enumerate(zip(mine.outputs, ref.outputs)):
        if t.dtype != r.dtype:
            diffs.append(f"output {i} dtype {t.dtype.value} != {r.dtype.value}")
        if not r.dtype.is_float:
            tq, rq = mine_q.get(t), ref_q.get(r)
            if not _same(tq.scale, rq.scale, rtol):
                diffs.append(f"output {i} scale {_f32(tq.scale).tolist()} != {_f32(rq.scale).tolist()}")
            if not _same(tq.zerop, rq.zerop):
                diffs.append(f"output {i} zp {tq.zerop} != {rq.zerop}")
    for key in COMPARED_PARAMS:
        tol = rtol if key in FLOAT_PARAMS else 0.0
        if key in ref.params and not _same(mine.params.get(key), ref.params[key], tol):
            diffs.append(f"{key} {mine.params.get(key)} != {ref.params[key]}")
    for key in COMPARED_CONSTANTS:
        if key not in ref.constants:
            continue
        c = mine.constants.get(key)
        rc = ref.constants[key]
        if c is None:
            diffs.append(f"constant {key} missing")
            continue
        if c.dtype != rc.dtype:
            diffs.append(f"constant {key} dtype {c.dtype.value} != {rc.dtype.value}")
        a, b = c.betensor.reshape(-1), rc.betensor.reshape(-1)
        if a.numel() != b.numel():
            diffs.append(f"constant {key} has {a.numel()} values, reference {b.numel()}")
        elif key in FLOAT_PARAMS and rtol and _same(a, b, rtol):
            continue
        elif not torch.equal(a.to(torch.float64), b.to(torch.float64)):
            n = int((a.to(torch.float64) != b.to(torch.float64)).sum())
            diffs.append(f"constant {key}: {n} of {a.numel()} values differ")
    return diffs


def compare_quantized_irs(mine: PyGraph, reference: PyGraph, rtol: float = 0.0) -> List[LayerDiff]:
    """One LayerDiff per reference layer, matched by layer name (a layer missing from `mine` is a difference).

    Scales (layer_top_scale, weights_scale, biases_scale) are compared as float32 within `rtol` (0: exactly);
    everything else exactly.
    """
    by_name = {n.name: n for n in mine.nodes}
    result = []
    for ref in reference.nodes:
        m = by_name.get(ref.name)
        diff = LayerDiff(ref.name, str(ref.type))
        if m is None:
            diff.differences.append("layer missing")
        elif str(m.type) != str(ref.type):
            diff.differences.append(f"type {m.type} != {ref.type}")
        else:
            diff.differences.extend(_compare_node(m, ref, rtol))
        result.append(diff)
    return result


def identical_fraction(diffs: Sequence[LayerDiff]) -> float:
    return sum(d.identical for d in diffs) / len(diffs) if diffs else 1.0


def upstream_bias_wrap(mine: PyGraph, reference: PyGraph, name: str) -> bool:
    """Whether layer `name` shows upstream's int32 bias defect (docs/golden-differences.md) where quantopt saturated
    correctly: upstream clamps a bias at +2^31-1 in float32, where it becomes 2^31 and is written as -2^31 (and the
    bias compression drops one more bit for the whole layer). A BasicLSTM clears its biases' low bits after the
    saturation, so quantopt holds `2^31 - 2^k` where upstream wrote -2^31."""
    try:
        m, ref = mine.node(name), reference.node(name)
    except KeyError:
        return False
    if "biases" not in m.constants or "biases" not in ref.constants:
        return False
    theirs, ours = ref.constants["biases"].betensor, m.constants["biases"].betensor
    wrapped = theirs == INT32_MIN
    if not bool(wrapped.any()):
        return False
    if bool((ours >= INT32_MAX - 1).any()):
        return True
    if ours.shape != theirs.shape:
        return False
    differ = wrapped & (ours != theirs)  # a negative saturation is -2^31 in both
    return bool(differ.any()) and _cleared_maxima(ours[differ])


def _cleared_maxima(values: torch.Tensor) -> bool:
    """Every value is the int32 maximum with its low k bits cleared (2^31 - 2^k, 0 <= k < 31): a saturated bias
    after a bias compression."""
    gap = (INT32_MAX + 1) - values.to(torch.int64)
    return bool(((gap > 0) & (gap < 2 ** 31) & ((gap & (gap - 1)) == 0)).all())


def forgive_upstream_bias_wrap(diffs: Sequence[LayerDiff], mine: PyGraph, reference: PyGraph) -> None:
    """Drops the bias differences of the layers where `upstream_bias_wrap` holds: quantopt does not reproduce that
    defect on purpose, so conformance figures leave those biases out."""
    for d in diffs:
        if d.differences and upstream_bias_wrap(mine, reference, d.name):
            d.differences = [x for x in d.differences if not x.startswith("constant biases")]


def _range_bound(value: Any) -> Optional[float]:
    """A range bound as the templates write it: a number (quantopt) or the text of a one-element list (upstream);
    None for per-channel ranges, which are not compared."""
    if isinstance(value, str):
        value = ast.literal_eval(value)
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            return None
        value = value[0]
    return None if value is None else float(np.float32(value))


def template_ranges(path: Path) -> Dict[str, Tuple[float, float]]:
    """tensor name -> calibrated (fmin, fmax) as float32 values, from the display section of a per-layer JSON
    template, quantopt's or upstream's (whose `quantization_info` is the text of a Python dict)."""
    ranges: Dict[str, Tuple[float, float]] = {}
    for settings in json.loads(Path(path).read_text()).values():
        info = settings.get("just_for_display", {}).get("quantization_info") if isinstance(settings, dict) else None
        if isinstance(info, str):
            info = ast.literal_eval(info)
        for tensor, q in (info or {}).items():
            lo, hi = _range_bound(q.get("fmin")), _range_bound(q.get("fmax"))
            if lo is not None and hi is not None:
                ranges[tensor] = (lo, hi)
    return ranges
