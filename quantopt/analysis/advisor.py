"""Accuracy advisor: after quantization, name the layers that lost accuracy, say why, and which field fixes it.

The per-layer similarity tells *where* accuracy went; the statistics and the quantized graph usually tell *why*.
`advise` looks for causes a user can act on, one `Advice` (one line) each:

* `inf_mask`: statistics that saw ±inf or |x| >= 1e30 (an attention mask, handled by calibration/inf_mask.py)
  or, not handled, huge finite values (|x| >= 32767, e.g. a mask written as -1e9) that set a useless range, and
  finite attention masks (calibration/finite_mask.py: Swin's -100) taken as data without `detect_finite_masks`;
* `bias_saturation`: quantized biases clipped at their bit width (input scale × weight scale too large), worse with
  16-bit activations, whose scales are 256 times larger;
* `weight_channels`: per-tensor weights over output channels of very different ranges (the small channels get a few
  integer steps only) in a layer that lost accuracy;
* `low_sqnr`: a layer that lost accuracy whose outputs no range at its activation bits holds (the best expected
  SQNR on its histogram below `ADVICE_SQNR_DB`: a few channels or values carry most of the signal), which
  `min_activation_sqnr_db` would give 16 bits;
* `integer_form`: a layer at 16 bits in one of upstream's integer forms that are coarser there than at 8 bits (the
  LayerNorm, GroupNorm and InstanceNorm gain, Div's reciprocal table, Reduce L2's 32-bit sum of squares), where it
  lost accuracy (isolated cosine below `FORM_16_BIT_COSINE`);
* `norm_input`: a LayerNorm, GroupNorm, InstanceNorm or RMSNorm with an 8-bit input that lost accuracy (isolated
  cosine below 0.99): it divides each row (token, group) by its own spread, and one input range for all rows leaves
  a row of small spread a few integer steps (a token whose values hardly vary beside tokens that do, or the
  reverse: a few outlier tokens setting the range); 16 bits for the layer making its input;
* `collapsed`: a layer whose isolated cosine is below the threshold (its own quantization), NaN or infinite, or the
  first layer where the cumulative cosine falls below it while every layer's own error stays small (error piling
  up along the graph).

The advice is printed by a cfg run after the worst-layers table and written to the report (docs/report.md).
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ..calibration.finite_mask import finite_masks
from ..calibration.inf_mask import arithmetic_method, is_mask_tensor, mask_counts
from ..calibration.low_sqnr import layer_sqnr_db
from ..config.upstream_defects import MASK_AS_DATA
from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tables import quant_of, statistics_of
from .similarity import LayerSimilarity

COLLAPSE_COSINE = 0.9
"""A layer output below this cosine (isolated, or cumulative for the first such layer) has collapsed."""

SUSPECT_COSINE = 0.99
"""Below this isolated cosine a layer is examined for a cause (weight channel spread)."""

HUGE_VALUE = 32767.0
"""Finite activations this large in magnitude are almost surely a mask or an overflow, not data."""

CHANNEL_SPREAD = 32.0
"""Per-tensor weights whose largest channel range exceeds the median channel range by this factor."""

ADVICE_SQNR_DB = 30.0
"""Below this best expected SQNR at the layer's bits, 16-bit activations are advised (`preset = accurate`'s
`min_activation_sqnr_db`)."""

MAX_LINES = 20
"""At most this many advice lines are printed (all of them go to the report)."""


@dataclass
class Advice:
    """One piece of advice: the layer, the cause (a short code), what was seen and which field fixes it."""

    layer: str
    layer_type: str
    cause: str
    message: str
    field: str

    def line(self) -> str:
        fix = f"; fix: {self.field}" if self.field else ""
        return f"layer '{self.layer}' ({self.layer_type}): {self.cause}: {self.message}{fix}"

    def as_dict(self) -> Dict[str, str]:
        return asdict(self)


def _fmt(v: float) -> str:
    return "NaN" if math.isnan(v) else f"{v:.4f}"


def _inf_mask(node: PyNode) -> List[Advice]:
    out = []
    table = statistics_of(node)
    for t in node.outputs:
        st = table.get(t)
        low, high = mask_counts(st)
        if low or high:
            which = "±inf or |x| >= 1e30" if st.inf_mask_threshold is None else \
                f"|x| >= {float(st.inf_mask_threshold):g}: a finite attention mask"
            out.append(Advice(node.name, str(node.type), "inf_mask",
                              f"'{t.name}' holds {low + high} mask value(s) ({which}); left out of its "
                              "statistics, saturated to the integer minimum, probability 0 after Softmax",
                              "none needed (handled automatically)"))
        elif t.ir_dtype.is_float and st.extrema_min is not None and st.extrema_max is not None and \
                max(abs(float(st.extrema_min)), abs(float(st.extrema_max))) >= HUGE_VALUE:
            lo, hi = float(st.extrema_min), float(st.extrema_max)
            out.append(Advice(node.name, str(node.type), "inf_mask",
                              f"'{t.name}' has huge values in its statistics (range [{lo:.4g}, {hi:.4g}]): if they are "
                              "a mask, its range leaves the real values a few integer steps",
                              "enable_pass_detect_inf_mask_nodes = true (mask constants <= -32767), or "
                              "trim_infinity_before_statistic for this layer"))
    return out


def _finite_masks(graph: PyGraph) -> List[Advice]:
    """The finite attention masks (calibration/finite_mask.py) whose values were taken as data: each Add that adds
    one (or Sub that subtracts one), with the field that would make them masks."""
    out = []
    for mask in finite_masks(graph):
        st = statistics_of(mask.add).get(mask.add.outputs[0])
        if is_mask_tensor(st) or mask.add.settings is None or mask.add.settings.detect_finite_masks:
            continue
        if MASK_AS_DATA in mask.add.settings.upstream_defects:
            continue
        what = (f"subtracts a finite attention mask from scores that reach a Softmax (they get mask values of "
                f"{mask.value:g} and below)" if arithmetic_method(mask.add) == "SUB" else
                f"adds a finite attention mask (mask values of {mask.value:g} and below) to scores that reach a "
                "Softmax")
        out.append(Advice(mask.add.name, str(mask.add.type), "inf_mask",
                          what + ": the mask values set the range of the scores, which keep few integer steps",
                          "detect_finite_masks = true"))
    return out


def _bias_saturation(fnode: PyNode, qnode: PyNode) -> List[Advice]:
    fb = fnode.constants.get("biases")
    qb = qnode.constants.get("biases")
    q = quant_of(qnode).get(qb) if qb is not None else None
    if fb is None or q is None or q.scale is None or q.qbits is None or not fb.betensor.is_floating_point():
        return []
    scale = torch.as_tensor(q.scale, dtype=torch.float64).reshape(-1).cpu()
    b = fb.betensor.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    if scale.numel() not in (1, b.numel()):
        return []
    bits = int(q.qbits)
    clipped = int(((b * scale).abs() > 2.0 ** (bits - 1)).sum())
    if not clipped:
        return []
    s = qnode.settings
    act16 = s is not None and int(s.q_bits_activation) > 8
    fix = f"bias_bits = 48 (or <[{fnode.type}]:48>)" if bits < 48 else "weight_bits / activation_bits (smaller scales)"
    return [Advice(fnode.name, str(fnode.type), "bias_saturation",
                   f"{clipped} of {b.numel()} bias(es) clipped at {bits} bits (input scale x weight scale is large"
                   + ("; 16-bit activations make it 256 times larger" if act16 else "") + ")", fix)]


def _weight_channels(fnode: PyNode, qnode: PyNode) -> List[Advice]:
    s = qnode.settings
    if s is None or "per_channel" in str(s.q_mode_weight):
        return []
    w = fnode.constants.get("weights")
    st = statistics_of(fnode).get(w) if w is not None else None
    if st is None or st.extrema_min_key_axis is None or st.extrema_max_key_axis is None:
        return []
    rng = torch.maximum(st.extrema_max_key_axis.abs(), st.extrema_min_key_axis.abs()).reshape(-1)
    if rng.numel() < 2:
        return []
    median = float(rng.median())
    top = float(rng.max())
    if median <= 0.0 or top / median < CHANNEL_SPREAD:
        return []
    return [Advice(fnode.name, str(fnode.type), "weight_channels",
                   f"per-tensor weights over {rng.numel()} channels whose ranges differ up to {top / median:.0f}x "
                   "the median: small channels keep a few integer steps",
                   "quantize_method_for_weight = per_channel_symmetric_restricted_range")]


def _low_sqnr(fnode: PyNode, qnode: PyNode) -> List[Advice]:
    s = qnode.settings
    if fnode.settings is None or s is None or s.q_bits_activation >= 16:
        return []
    best = layer_sqnr_db(fnode, best_range=True)
    if best is None or best >= ADVICE_SQNR_DB:
        return []
    return [Advice(fnode.name, str(fnode.type), "low_sqnr",
                   f"no {s.q_bits_activation}-bit range holds its outputs (best expected SQNR {best:.1f} dB on the "
                   "calibration histogram: a few channels or values carry most of the signal)",
                   f"min_activation_sqnr_db = {ADVICE_SQNR_DB:g} (16 bits where needed; preset = accurate sets it)")]


_UPSTREAM_CELL_FIELD = {"BasicLSTM": ("lut_it", "lstm_integer_form"), "GRUv1": ("lut_rt", "gru_integer_form"),
                        "GRUv3": ("lut_rt", "gru_integer_form")}
"""Recurrent types with two integer forms: the constant that marks upstream's form, and the field choosing it."""


def _recurrent_form(fnode: PyNode, qnode: PyNode) -> List[Advice]:
    marker = _UPSTREAM_CELL_FIELD.get(str(qnode.type))
    if marker is None or marker[0] not in qnode.constants:
        return []
    return [Advice(fnode.name, str(fnode.type), "recurrent_form",
                   "the cell runs in upstream's integer form (tables and multipliers from the observed ranges of its "
                   "inner tensors; coarse where the gates do not saturate, docs/semantics/recurrent.md)",
                   f"{marker[1]} = q15 (quantopt's cell; preset = accurate sets it)")]


_NORM_FORM = ("layernorm_integer_form", "its gain keeps a few significant bits there",
              "docs/semantics/normalization.md")
_FORMS_COARSE_AT_16_BITS = {
    "LayerNorm": _NORM_FORM, "GroupNorm": _NORM_FORM, "InstanceNorm": _NORM_FORM,
    "Div": ("div_integer_form", "one 16-bit table of 65535 / divisor code and one multiplier",
            "docs/semantics/binary.md#div"),
    "Reduce": ("reduce_l2_integer_form", "its sum of squares is kept in 32 bits and cut to 16",
               "docs/semantics/reduce.md#reduce"),
}
"""Types whose upstream integer form (the default) is coarser at 16 bits than at 8: (the field choosing the exact
form, why, the semantics section). Reduce only with method L2."""

FORM_16_BIT_COSINE = 0.9999
"""Below this isolated cosine a 16-bit layer in one of those forms gets the `integer_form` advice (an AST encoder,
random weights, 16 bits: the exact form's LayerNorms 1.00000, upstream's 0.9959-0.9962; Swin2SR's cosine-attention
Div layers 1.00000 against 0.9805-0.9852; at 8 bits both forms 0.998-0.99995)."""


def _integer_form(fnode: PyNode, qnode: PyNode, isolated: Optional[float]) -> List[Advice]:
    """A 16-bit layer in an upstream integer form coarser at 16 bits that lost accuracy (`isolated`: its isolated
    cosine; None without similarity): the field of the exact form."""
    kind, s = str(qnode.type), qnode.settings
    form = _FORMS_COARSE_AT_16_BITS.get(kind)
    if form is None or s is None or getattr(s, form[0], None) != "upstream":
        return []
    if kind == "Reduce" and str(qnode.params.get("method", "")).upper() != "L2":
        return []
    if isolated is not None and math.isfinite(isolated) and isolated >= FORM_16_BIT_COSINE:
        return []
    table = quant_of(qnode)
    bits = [table.get(t).qbits for t in list(qnode.inputs) + list(qnode.outputs) if table.get(t) is not None]
    if not bits or max(int(b) for b in bits) < 16:
        return []
    where = "" if isolated is None else f" (isolated cosine {_fmt(isolated)})"
    return [Advice(fnode.name, str(fnode.type), "integer_form",
                   f"runs in upstream's integer form at 16 bits{where}: {form[1]}, less accurate than at 8 bits "
                   f"({form[2]})", f"{form[0]} = exact (preset = accurate sets it)")]


_ROW_NORM_TYPES = ("LayerNorm", "GroupNorm", "InstanceNorm", "RMSNorm")
"""Types that divide each row (token, group) by its own spread."""

_MOVING_TYPES = ("Reshape", "Transpose", "Permute", "Squeeze", "Unsqueeze", "Flatten")
"""Layers that only move values: the layer making a normalization's input is found past them."""


def _norm_input(fnode: PyNode, qnode: PyNode) -> List[Advice]:
    """A row normalization with an input below 16 bits that lost accuracy: 16 bits for the layer making its input
    (past layers that only move values), named by a per-layer rule."""
    if str(qnode.type) not in _ROW_NORM_TYPES or not qnode.inputs:
        return []
    q = quant_of(qnode).get(qnode.inputs[0])
    if q is None or int(q.qbits) >= 16:
        return []
    maker = fnode.inputs[0].pnode
    while maker is not None and str(maker.type) in _MOVING_TYPES and maker.inputs:
        maker = maker.inputs[0].pnode
    if maker is None:
        return []
    upstream_form = str(qnode.type) in _FORMS_COARSE_AT_16_BITS and qnode.settings is not None \
        and qnode.settings.layernorm_integer_form == "upstream"
    form = ("; with layernorm_integer_form = exact for it (upstream's form needs input and output on one side of 8 "
            "bits)") if upstream_form else ""
    return [Advice(fnode.name, str(fnode.type), "norm_input",
                   f"divides each row by its own spread, and its {int(q.qbits)}-bit input has one range for all rows: "
                   "a row (token, group) of small spread keeps a few integer steps",
                   f"activation_bits = {int(q.qbits)} & <{{{re.escape(maker.name)}$}}:16> (16 bits for "
                   f"'{maker.name}', which makes its input){form}")]


def _collapsed(sims: Sequence[LayerSimilarity], threshold: float) -> List[Advice]:
    out = []
    first_cumulative: Optional[LayerSimilarity] = None
    for r in sims:
        if not math.isfinite(r.isolated_cos):
            out.append(Advice(r.name, r.type, "collapsed", f"isolated cosine {_fmt(r.isolated_cos)} of '{r.tensor}'"
                              + (f" ({r.note})" if r.note else ""),
                              "trigger_float_op for this layer, or find the NaN/inf source upstream"))
        elif r.isolated_cos < threshold:
            out.append(Advice(r.name, r.type, "collapsed",
                              f"isolated cosine {_fmt(r.isolated_cos)} of '{r.tensor}': its own quantization loses "
                              "the values",
                              f"activation_bits = 8 & <[{r.type}]:16> (with lut_items_in_bits = 10), or "
                              "calibration_strategy_for_activation, or trigger_float_op for this layer"))
        elif first_cumulative is None and math.isfinite(r.cumulative_cos) and r.cumulative_cos < threshold:
            first_cumulative = r
    if first_cumulative is not None and not out:
        r = first_cumulative
        out.append(Advice(r.name, r.type, "collapsed",
                          f"cumulative cosine {_fmt(r.cumulative_cos)} (isolated {_fmt(r.isolated_cos)}): small "
                          "errors of the layers above pile up here",
                          "mixed_precision_auto_search, or 16-bit activation_bits for the layers above"))
    return out


def advise(float_graph: PyGraph, quant_graph: Optional[PyGraph] = None,
           similarities: Sequence[LayerSimilarity] = (), threshold: float = COLLAPSE_COSINE) -> List[Advice]:
    """Advice for a quantized model, in graph order within each cause: inf masks, bias saturation, weight channel
    spread (layers with an isolated cosine below 0.99, or all layers without similarity), outputs no 8-bit range
    holds, recurrent cells in upstream's coarse form and row normalizations of 8-bit inputs (layers below 0.99),
    16-bit layers in upstream's forms that are coarse at 16 bits (below FORM_16_BIT_COSINE), collapsed layers."""
    qnodes = {n.name: n for n in quant_graph.nodes} if quant_graph is not None else {}
    suspect = {r.name for r in similarities if not math.isfinite(r.isolated_cos) or r.isolated_cos < SUSPECT_COSINE}
    advice: List[Advice] = []
    for n in float_graph.nodes:
        advice += _inf_mask(n)
    advice += _finite_masks(float_graph)
    for n in float_graph.nodes:
        q = qnodes.get(n.name)
        if q is not None and q.quantized:
            advice += _bias_saturation(n, q)
    for n in float_graph.nodes:
        q = qnodes.get(n.name)
        if q is not None and q.quantized and (not similarities or n.name in suspect):
            advice += _weight_channels(n, q)
    for n in float_graph.nodes:
        q = qnodes.get(n.name)
        if q is not None and q.quantized and n.name in suspect:
            advice += _low_sqnr(n, q)
            advice += _recurrent_form(n, q)
            advice += _norm_input(n, q)
    isolated = {r.name: r.isolated_cos for r in similarities}
    for n in float_graph.nodes:
        q = qnodes.get(n.name)
        if q is not None and q.quantized and (not similarities or n.name in isolated):
            advice += _integer_form(n, q, isolated.get(n.name))
    advice += _collapsed(similarities, threshold)
    return advice


def advice_lines(advice: Sequence[Advice], limit: int = MAX_LINES) -> List[str]:
    """The console lines: one per advice, at most `limit`, then how many more the report holds."""
    lines = [a.line() for a in advice[:limit]]
    if len(advice) > limit:
        lines.append(f"... and {len(advice) - limit} more in the report")
    return lines
