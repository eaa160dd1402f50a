"""16 bits for the activation tensors no 8-bit range can hold (`min_activation_sqnr_db`).

Why: in transformer encoders a few hidden dimensions of the residual stream (the FFN output projections, the residual
adds) carry values tens of times larger than the rest, at nearly every token. An 8-bit range that keeps them leaves
the other dimensions a handful of codes; one that clips them destroys the dimensions that carry most of the signal.
No 8-bit range works, and the layer's output cosine collapses (0.3 on MiniLM's first FFN output). Such tensors are
recognised from the histogram the statistics pass already holds: the expected signal-to-quantization-noise ratio
of the best 8-bit range (the least-error one, `histogram_search.mse_range`, judged by
`histogram_search.expected_sqnr_db`) is far below that of ordinary tensors (docs/accuracy.md: 10-30 dB for them,
26-45 dB for the activations of the convolutional networks measured). A layer whose outputs no range at its bits
quantizes with the threshold's SQNR gets 16-bit activations, the mse range at 16 bits and tables of at least 2^10
entries; every other layer keeps its bits and its calibrated range, and so do Input layers (the model's input
dtype is its interface). It needs no labels and no quantized forward, and
runs after local calibration, before scale unification and the global methods.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tables import ranges_of, statistics_of
from ..log import OPT_INFO
from ..quant.params import QuantMode
from .collect import calibrate_layer
from .histogram_search import expected_sqnr_db, mse_range
from .inf_mask import is_mask_tensor
from .statistics import histogram_range

PROMOTED_BITS = 16
PROMOTED_STRATEGY = "mse"
PROMOTED_LUT_BITS = 10
"""Tables of a promoted layer hold at least 2^10 entries (docs/user-guide.md: 10+ advised for 16 bits)."""
PROMOTED_BIAS_BITS = 48
"""Biases of a layer that reads or makes 16-bit activations: the input scale is 2^8 times finer, so an int32 bias
of the same float value would saturate (upstream's 16-bit configuration uses 48-bit biases too)."""


@dataclass(frozen=True)
class Promotion:
    """One layer given 16-bit activations: the lowest expected SQNR the best range at its former bits reaches, and
    the SQNR of its 16-bit range."""
    layer: str
    sqnr_db: float
    promoted_sqnr_db: float


def layer_sqnr_db(n: PyNode, best_range: bool = False) -> Optional[float]:
    """The lowest expected SQNR (dB) of the layer's activation outputs at its activation bits, over their calibrated
    ranges (`best_range`: over the least-error ranges at those bits); None when none can be judged (no histogram,
    integer or mask outputs)."""
    s = n.settings
    symmetric = not QuantMode.from_name(s.q_mode_activation).is_asymmetric
    worst: Optional[float] = None
    table = statistics_of(n)
    for t in n.outputs:
        st = table.get(t)
        h = st.running_histc
        r = ranges_of(n).get(t)
        if h is None or r.min is None or r.max is None or not t.ir_dtype.is_float or is_mask_tensor(st):
            continue
        lo, hi = (float(v) for v in histogram_range(st))
        a, b = mse_range(h, lo, hi, s.q_bits_activation, symmetric) if best_range else (float(r.min), float(r.max))
        a, b = _grid(a, b, symmetric)
        db = expected_sqnr_db(h, lo, hi, a, b, s.q_bits_activation)
        if db is not None and (worst is None or db < worst):
            worst = db
    return worst


def _grid(lo: float, hi: float, symmetric: bool) -> tuple:
    """The span the quantizer's grid covers for a calibrated range: symmetric modes centre it on 0 (all of it on
    one side for a range that does not cross 0, unsigned), asymmetric ones take the range as it is."""
    if not symmetric or lo >= 0.0 or hi <= 0.0:
        return lo, hi
    m = max(-lo, hi)
    return -m, m


def _widen_biases(n: PyNode) -> None:
    """48-bit biases for a layer with biases that makes or reads a 16-bit activation (unless set for the layer)."""
    s = n.settings
    if s is None or "biases" not in n.constants or s.q_bits_bias >= PROMOTED_BIAS_BITS or "q_bits_bias" in s.explicit:
        return
    n.settings = dataclasses.replace(s, q_bits_bias=PROMOTED_BIAS_BITS)


def _eligible(n: PyNode) -> bool:
    s = n.settings
    if str(n.type) == "Input":  # the model's input dtype is its interface: only a rule for the layer changes it
        return False
    if s is None or s.min_activation_sqnr_db <= 0.0 or s.q_bits_activation >= PROMOTED_BITS or s.qinvariant:
        return False
    if QuantMode.from_name(s.q_mode_activation).is_per_channel:  # per-channel ranges keep their own strategy
        return False
    table = statistics_of(n)
    return not any(is_mask_tensor(table.get(t)) for t in n.outputs)


def promote_low_sqnr_activations(graph: PyGraph) -> List[Promotion]:
    """Every layer whose outputs no range at its activation bits quantizes with an expected SQNR of at least its
    `min_activation_sqnr_db` gets 16-bit activations (mse range, tables of at least 2^10 entries) and its ranges
    calibrated again. Returns the promotions, in graph order, after logging them in one line."""
    done: List[Promotion] = []
    readers = {}
    for m in graph.nodes:
        for t in m.inputs:
            readers.setdefault(id(t), []).append(m)
    for n in graph.nodes:
        if not _eligible(n):
            continue
        best = layer_sqnr_db(n, best_range=True)
        if best is None or best >= n.settings.min_activation_sqnr_db:
            continue
        s = n.settings
        n.settings = dataclasses.replace(s, q_bits_activation=PROMOTED_BITS, q_strategy_activation=PROMOTED_STRATEGY,
                                         lut_items_in_bits=max(s.lut_items_in_bits, PROMOTED_LUT_BITS))
        calibrate_layer(n)
        after = layer_sqnr_db(n)
        done.append(Promotion(n.name, best, after if after is not None else best))
        for layer in [n] + [m for t in n.outputs for m in readers.get(id(t), [])]:
            _widen_biases(layer)
    if done:
        shown = ", ".join(f"{p.layer} ({p.sqnr_db:.1f} -> {p.promoted_sqnr_db:.1f} dB)" for p in done[:12])
        more = f" and {len(done) - 12} more" if len(done) > 12 else ""
        OPT_INFO(f"min_activation_sqnr_db: {len(done)} layer(s) whose outputs no 8-bit range holds get 16-bit "
                 f"activations: {shown}{more}")
    return done
