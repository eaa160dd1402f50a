"""Attention masks holding -inf or -FLT_MAX: found from the statistics, quantized so that masking survives.

BERT-style models add a mask of 0 (keep) and -inf / -3.4e38 (drop) to the attention scores before Softmax. Taken as
data, those values give the scores a scale of about 6e-8 and destroy attention. Here (docs/statistics-and-dump.md,
"Masks with infinite values"):

* the statistics leave values with |x| >= `INF_MASK_THRESHOLD` out and count them (calibration/statistics.py); a
  tensor with such counts is a *mask tensor*, calibrated on its other values;
* `apply_inf_mask_ranges`, right after local calibration, makes the integer code of a mask value reach the Softmax:
  a mask value quantizes to the tensor's qmin (saturation), and the range of each mask tensor feeding a layer
  whose output is a mask tensor is widened (only below) so that its qmin still lands on the output's qmin: below
  `2 · (min(out) - Σ max|other input|)` for Add / Eltwise ADD (and the first input of a Sub), `2 · min(out) /
  max|other input|` for Mul / Eltwise MUL, `min(out)` for any other layer (Where, Reshape, Cast...). A mask
  *subtracted* from the scores (XLNet's `scores - 1e30 * mask`; Funnel's 1e6 with finite_mask.py) holds positive
  mask values: they quantize to qmax, and its range is widened above, to `2 · (Σ max|other input| - min(out))` for
  the Sub and by the mirrored rules (max(out) for min(out)) up the layers making it. A mask tensor read by a Softmax
  keeps 1/64 of its span below its calibrated minimum, so that only mask values reach qmin;
* a Softmax whose input is a mask tensor is written with `mask_saturated_input=true`: its integer forward gives
  the inputs equal to the input's qmin a zero exponential term (in rows holding any other code), so a masked
  position gets probability 0 exactly, as in float (ops/softmax.py, docs/integer-semantics.md).

Models without such values are untouched: nothing here changes a tensor without mask counts.

The cfg field `enable_pass_detect_inf_mask_nodes` (passes/inf_mask.py) turns Constant values <= -32767 into
-FLT_MAX before the statistics, so that the rules above treat them as mask values too.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tables import RangeTable, TensorRange, TensorStatistics
from ..graph.tensor import PyTensor
from ..log import OPT_WARN

MASK_SOURCE_THRESHOLD = 32767.0
"""`enable_pass_detect_inf_mask_nodes`: Constant values at or below -this are mask values (upstream's bound)."""

FLT_MAX = float(torch.finfo(torch.float32).max)

SOFTMAX_MASK_PARAM = "mask_saturated_input"
"""Softmax IR key: true when inputs equal to the input's qmin are masked (zero exponential term)."""

ADDITIVE = ("Add",)
SUBTRACTIVE = ("Sub",)
MULTIPLICATIVE = ("Mul",)
SOFTMAX_CODE_MARGIN = 1.0 / 64
"""Part of a Softmax-input mask tensor's span kept below its calibrated minimum, so data does not reach qmin."""


def mask_counts(st: TensorStatistics) -> tuple:
    """(values below -threshold, values above +threshold) left out of a tensor's statistics `st`."""
    low = 0 if st.inf_mask_low is None else int(float(st.inf_mask_low))
    high = 0 if st.inf_mask_high is None else int(float(st.inf_mask_high))
    return low, high


def is_mask_tensor(st: TensorStatistics) -> bool:
    """Whether a tensor's statistics `st` saw mask values (±inf or |x| >= INF_MASK_THRESHOLD)."""
    return any(mask_counts(st))


def has_low_mask(st: TensorStatistics) -> bool:
    """Whether a tensor's statistics `st` saw negative mask values (what an attention mask adds)."""
    return mask_counts(st)[0] > 0


def has_high_mask(st: TensorStatistics) -> bool:
    """Whether a tensor's statistics `st` saw positive mask values (what a subtracted attention mask holds)."""
    return mask_counts(st)[1] > 0


def arithmetic_method(node: PyNode) -> str:
    """ADD, SUB, MUL, ... for an Eltwise layer (its method) or an Add/Mul layer; any other layer's type."""
    t = str(node.type)
    if t == "Eltwise":
        return str(node.params.get("method", "")).upper()
    if t in ADDITIVE:
        return "ADD"
    if t in SUBTRACTIVE:
        return "SUB"
    if t in MULTIPLICATIVE:
        return "MUL"
    return t


def _magnitude(ranges: RangeTable, t: PyTensor) -> float:
    r = ranges.get(t)
    return max(abs(float(r.min or 0.0)), abs(float(r.max or 0.0)))


def _others(ranges: RangeTable, node: PyNode, inp: PyTensor) -> Tuple[float, float]:
    """(sum, product) of the largest magnitudes of `node`'s inputs other than `inp` (each factor at least 1e-6): how
    far the other operands of an Add/Sub or a Mul can move a mask value."""
    magnitudes = [_magnitude(ranges, t) for t in node.inputs if t is not inp]
    return sum(magnitudes), math.prod(max(m, 1e-6) for m in magnitudes)


def _required_min(ranges: RangeTable, node: PyNode, out: PyTensor, inp: PyTensor) -> Optional[float]:
    """The calibrated minimum the mask input `inp` needs so that its qmin gives `out`'s qmin; None: no rule."""
    rest, scale = _others(ranges, node, inp)
    out_min = float(ranges.get(out).min)
    method = arithmetic_method(node)
    if method == "ADD" or (method == "SUB" and node.inputs[0] is inp):
        return 2.0 * (out_min - rest)
    if method == "SUB":
        return None
    if method == "MUL":
        return 2.0 * out_min / scale
    return out_min


def _required_max(ranges: RangeTable, node: PyNode, out: PyTensor, inp: PyTensor, out_low: bool) -> Optional[float]:
    """The calibrated maximum the positive-mask input `inp` needs so that its qmax gives `out`'s qmin (`out_low`: a
    mask subtracted from the scores) or `out`'s qmax (a positive mask made up the chain); None: no rule."""
    rest, scale = _others(ranges, node, inp)
    r = ranges.get(out)
    method = arithmetic_method(node)
    if out_low:  # only a subtracted positive mask makes a negative one
        if method == "SUB" and len(node.inputs) == 2 and node.inputs[1] is inp and node.inputs[0] is not inp:
            return 2.0 * (rest - float(r.min))
        return None
    if method == "ADD" or (method == "SUB" and node.inputs[0] is inp):
        return 2.0 * (float(r.max) + rest)
    if method == "SUB":
        return None
    if method == "MUL":
        return 2.0 * float(r.max) / scale
    return float(r.max)


def _room_for_masks(ranges: RangeTable, out: PyTensor, low: bool, high: bool) -> TensorRange:
    """A mask tensor's range given an end on the side of its mask values: one whose other values are all 0 (a
    `Where(keep, 0, -inf)` read only by comparisons and selections) calibrates to [0, 0], whose scale of 1 maps the
    code of a mask value from a finer-scaled input back to 0, and the mask is lost (found on Longformer, whose mask
    constant several Where layers share). That end is set to the size of the other one, at least 1: a mask value
    keeps a code of its own sign, distinct from every other value. Returns the range now in force."""
    r = ranges.get(out)
    size = max(abs(float(r.min)), abs(float(r.max)), 1.0)
    if low and float(r.min) >= 0.0:
        ranges.set(out, -size, r.max)
    if high and float(ranges.get(out).max) <= 0.0:
        ranges.set(out, ranges.get(out).min, size)
    return ranges.get(out)


def apply_inf_mask_ranges(graph: PyGraph, log: bool = True) -> List[str]:
    """Widen the calibrated ranges of mask tensors (module docstring); returns the names of the layers whose
    outputs are mask tensors, logged as one warning line when `log`. Runs after local calibration."""
    stats, ranges = graph.statistics, graph.ranges
    masked = [n for n in graph.nodes if any(is_mask_tensor(stats.get(t)) for t in n.outputs)]
    if not masked:
        return []
    consumers: Dict[int, List[PyNode]] = {}
    for n in graph.nodes:
        for t in n.inputs:
            consumers.setdefault(id(t), []).append(n)
    for n in reversed(graph.nodes):
        for out in n.outputs:
            r = ranges.get(out)
            out_low, out_high = has_low_mask(stats.get(out)), has_high_mask(stats.get(out))
            if not (out_low or out_high) or r.min is None:
                continue
            r = _room_for_masks(ranges, out, out_low, out_high)
            if out_low and any(str(c.type) == "Softmax" for c in consumers.get(id(out), [])):
                span = float(r.max) - float(r.min)
                ranges.set(out, min(float(r.min) - span * SOFTMAX_CODE_MARGIN, -span * SOFTMAX_CODE_MARGIN), r.max)
            for inp in n.inputs:
                r_in = ranges.get(inp)
                if r_in.min is None:
                    continue
                if out_low and has_low_mask(stats.get(inp)):
                    need = _required_min(ranges, n, out, inp)
                    if need is not None and need < float(r_in.min):
                        ranges.set(inp, need, r_in.max)
                        r_in = ranges.get(inp)
                if has_high_mask(stats.get(inp)):
                    sides = [low for low, holds in ((True, out_low), (False, out_high)) if holds]
                    needs = [h for h in (_required_max(ranges, n, out, inp, low) for low in sides) if h is not None]
                    need = max(needs, default=None)
                    if need is not None and need > float(r_in.max):
                        ranges.set(inp, r_in.min, need)
    names = [n.name for n in masked]
    if log:
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        OPT_WARN(f"inf mask detected: {len(names)} layer output(s) hold attention-mask values (±inf, |x| >= 1e30, or "
                 "those of a finite mask such as -100 or -1e4): "
                 f"{shown}; their statistics leave those values out, they saturate to the integer minimum and the "
                 "Softmax they reach gives them probability 0 (docs/statistics-and-dump.md)")
    return names
