"""Requantization of convolution accumulators from a per-layer plan, with `mac_finish`'s bits.

Why: `mac_finish` (ops/_quant.py) derives on every forward the multipliers and shifts, the float64 biases, the factor
M·2^-shift and the fused activation's integer bounds; on a small input that costs more than the convolution itself
(docs/performance.md, "Small models"). `finish_mac` keeps them in a memo (graph/memo.py, rebuilt whenever a param,
a constant or a quantization param changes) and runs the same in-place float64 passes as `mac_finish`'s exact path:
(acc + b)·(M·2^-shift), rounded half to even, minus the output zero point, clamped, converted to int64, clamped to
the fused bounds. Whatever that path would not take (a `remain_shift` hand-over, shifts beyond ±900, an accumulator
whose products may leave float64's exact range, NaN) is left to `mac_finish` itself.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch

from ..graph.memo import layer_key, memo
from ..graph.node import PyNode
from ..quant.requant import MAGIC_SCALED_BOUND, broadcasts_into, exact_int64_, requantize_scaled_
from ..quant.rounding import FLOAT64_EXACT
from ._quant import fused_activation, fused_activation_bounds, mac_finish, out_range, requant_of, tensor_zp

Plan = Tuple[torch.Tensor, torch.Tensor, float, float, int, int, Any, Any, bool]


def _plan(node: PyNode, device: torch.device) -> Optional[Plan]:
    """(float64 biases, M·2^-shift, max |M|, output zero point, qmin, qmax, fused bounds or None, whether
    `requantize_scaled_` applies: every shift >= 3 and the output range small) of the layer."""
    def build() -> Optional[Plan]:
        if node.params.get("remain_shift") is not None:
            return None
        out = node.outputs[0]
        mult, shift = requant_of(node)
        b = node.get_constant("biases").betensor.to(torch.float64).reshape(-1)
        m = torch.as_tensor(mult, dtype=torch.float64, device=device)
        s = torch.as_tensor(shift, dtype=torch.float64, device=device)
        if not -900 < float(s.min()) <= float(s.max()) < 900:
            return None
        qmin, qmax = out_range(out)
        lo: Any = None
        hi: Any = None
        if fused_activation(node) in ("RELU", "RELU6", "CLIP"):
            lo, hi = fused_activation_bounds(node)
            if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):  # per-channel output
                lo = torch.as_tensor(lo, dtype=torch.int64, device=device)
                hi = torch.as_tensor(hi, dtype=torch.int64, device=device)
        scaled = float(s.min()) >= 3 and max(abs(qmin), abs(qmax)) + abs(tensor_zp(out)) < MAGIC_SCALED_BOUND
        return b, m * torch.pow(2.0, -s), float(m.abs().max()), float(tensor_zp(out)), qmin, qmax, lo, hi, scaled

    return memo(node, "mac_finish", (layer_key(node), device), build)


def finish_mac(node: PyNode, acc: torch.Tensor, owned: bool = False) -> torch.Tensor:
    """`mac_finish(node, acc)`, bit for bit, at a fraction of its fixed cost (the module docstring). `owned`: `acc`
    is the caller's temporary, overwritten here (no new float64 map; the bound is then checked on acc and max|b|,
    which only sends more accumulators to `mac_finish`, whose result is the same)."""
    plan = _plan(node, acc.device) if acc.dtype == torch.float64 and acc.numel() else None
    if plan is None:
        return mac_finish(node, acc)
    b, factor, m_absmax, zp_out, qmin, qmax, lo, hi, scaled = plan
    if owned and broadcasts_into(b.shape, acc.shape):
        a_lo, a_hi = (float(v) for v in torch.aminmax(acc))
        b_absmax = float(b.abs().max()) if b.numel() else 0.0
        if not (math.isfinite(a_lo) and math.isfinite(a_hi) and math.isfinite(b_absmax)) \
                or (max(-a_lo, a_hi) + b_absmax) * m_absmax >= FLOAT64_EXACT:
            return mac_finish(node, acc)
        y = acc.add_(b)
    else:
        y = acc + b
        y_lo, y_hi = (float(v) for v in torch.aminmax(y))
        if not (math.isfinite(y_lo) and math.isfinite(y_hi)) or max(-y_lo, y_hi) * m_absmax >= FLOAT64_EXACT:
            return mac_finish(node, acc)
    if scaled:  # |y * M| < 2^53 (checked above) and every shift >= 3: |y * factor| < 2^50
        y = requantize_scaled_(y, factor, int(zp_out), qmin, qmax)
    else:
        y = exact_int64_(y.mul_(factor).round_().sub_(zp_out).clamp_(float(qmin), float(qmax)), qmin, qmax)
    if lo is None:
        return y
    return torch.clamp(y, lo, hi)
