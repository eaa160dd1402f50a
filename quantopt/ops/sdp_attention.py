"""SDPAttention: scaled dot-product attention softmax(Q Kᵀ · scale_factor + mask) V in one layer (the form
upstream's merge of Softmax between two MatMuls writes).

Float forward: exact attention (keys smoothed by their mean over the sequence first, as upstream: softmax does not
change). Quantized (docs/semantics/transformer.md#sdpattention): exact int64 Q·K products requantized to 12-bit
logit codes, the mask requantized to the same scale, exp through a 16-bit table of the distance to the row maximum,
probabilities as 8-bit codes round(255 · e / Σe), then an exact P·V product requantized to the output.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import ranges_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.hardware import AIFF_MULTIPLIER_BITS
from ..quant.int_matmul import exact_int_matmul
from ..quant.lut import build_lut, lookup_lut
from ..quant.params import linear_quant_params
from ..quant.requant import requantize_int, scale_shift
from ..quant.rounding import div_round_half_even
from ..registry import declare_op
from ..registry.schema import Bool, Float, Int, Param, quantized
from ._quant import (
    activation_mode,
    check_quantized_inputs,
    int_value,
    is_signed,
    layer_settings,
    out_range,
    refuse_per_channel,
    set_constant,
    set_params,
    tensor_scale,
    tensor_zp,
)

SEMANTICS = "docs/semantics/transformer.md#sdpattention"

QXK_BITS = 12
"""Logit codes: a row's distances to its maximum index a table over [0, 2^12 - 1] (upstream's qxk_bits)."""
EXP_BITS = 16
"""Table values round(65535 · exp(-distance)) (upstream's exp_val_bits)."""
P_CODES = 255
"""Probabilities are 8-bit codes: 255 means 1."""
LUT_ENTRIES_BITS = 8
"""The exp table has 256 entries whatever lut_items_in_bits says (as upstream)."""
MIN_WINDOW = 12.0
"""The table spans at least 12 logit units (65535 · exp(-12) < 0.5): farther entries are exactly 0."""
MULT_BITS = AIFF_MULTIPLIER_BITS
SHIFT_MAX = 62

SDP_ATTENTION = declare_op(
    "SDPAttention",
    params={
        "trans_q": Param(Bool(), "Q is given as [..., D, M] (transposed before use)", default=False),
        "trans_k": Param(Bool(), "K is given as [..., N, D] (transposed to [..., D, N] before use)", default=False),
        "trans_v": Param(Bool(), "V is given as [..., D, N] (transposed before use)", default=False),
        "enable_gqa": Param(Bool(), "repeat K and V heads (axis -3) to Q's head count", default=False),
        "scale_factor": Param(Float(), "multiplier of Q Kᵀ", default=1.0),
        "with_mask": Param(Bool(), "a fourth input is added to the scaled logits", default=False),
        "qxk_bits": quantized(Int(lo=2, hi=16), "bits of the logit codes (12)"),
        "logit_scale_value": quantized(Int(lo=0), "multiplier of Q·K to logit codes"),
        "logit_shift_value": quantized(Int(), "shift of Q·K to logit codes"),
        "mask_scale_value": quantized(Int(lo=0), "multiplier of the mask to logit codes"),
        "mask_shift_value": quantized(Int(), "shift of the mask to logit codes"),
        "out_scale_value": quantized(Int(lo=0), "multiplier of P·V to the output"),
        "out_shift_value": quantized(Int(), "shift of P·V to the output"),
    },
    constants={"lut": "exp table (quantized): 256 uint16 values over the 2^12 logit distances"},
    integer="int64 Q·K to 12-bit logits (+ mask at the same scale), uint16 exp table of the distance to the row "
            "maximum, 8-bit probabilities round(255 e / Σe), int64 P·V requantized (round half to even)",
    dtypes="Q, K, V (and mask) → output symmetric, signed as V",
    semantics=SEMANTICS,
    summary="Scaled dot-product attention softmax(Q Kᵀ · scale_factor + mask) V over the last two axes; "
            "trans_q/k/v transpose an input's last two axes first; enable_gqa repeats K and V heads.")


def _operands(node: PyNode, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """(q [..., M, D], k [..., D, N], v [..., N, Dv]) after the transposes and GQA, checked."""
    if bool(node.get_param("trans_q", optional=True, default_value=False)):
        q = q.transpose(-1, -2)
    if bool(node.get_param("trans_k", optional=True, default_value=False)):
        k = k.transpose(-1, -2)
    if bool(node.get_param("trans_v", optional=True, default_value=False)):
        v = v.transpose(-1, -2)
    if bool(node.get_param("enable_gqa", optional=True, default_value=False)):
        if q.dim() < 3 or k.dim() < 3 or v.dim() < 3:
            raise node._error("enable_gqa needs inputs with a head axis (-3)")
        hq, hk, hv = int(q.shape[-3]), int(k.shape[-3]), int(v.shape[-3])
        if hk < 1 or hv < 1 or hq % hk or hq % hv:
            raise node._error(f"enable_gqa: Q's {hq} heads are not a multiple of K's {hk} and V's {hv}")
        k = k.repeat_interleave(hq // hk, -3)
        v = v.repeat_interleave(hq // hv, -3)
    if q.dim() < 2 or int(q.shape[-1]) != int(k.shape[-2]) or int(k.shape[-1]) != int(v.shape[-2]):
        raise node._error(f"Q [..., M, D], K [..., D, N] and V [..., N, Dv] (after trans_*) do not match: "
                          f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    return q, k, v


def _check(node: PyNode) -> bool:
    with_mask = bool(node.get_param("with_mask", optional=True, default_value=False))
    want = 4 if with_mask else 3
    if len(node.inputs) != want or len(node.outputs) != 1:
        raise node._error(f"expects {want} inputs (Q, K, V{', mask' if with_mask else ''}) and 1 output")
    return with_mask


def _set_placeholders(node: PyNode, smoothed_k: torch.Tensor, qk: torch.Tensor) -> None:
    """Upstream's statistics: `<layer>/smoothed_k` and `<layer>/qxk_normed` (Q Kᵀ · scale_factor, before the
    mask)."""
    names = [f"{node.name}/smoothed_k", f"{node.name}/qxk_normed"]
    values = [smoothed_k.detach().to(torch.float32), qk.detach().to(torch.float32)]
    if [t.name for t in node.placeholders] != names:
        node.placeholders = [PyTensor(nm, v) for nm, v in zip(names, values)]
        return
    for t, v in zip(node.placeholders, values):
        t.betensor = v


def _float_forward(node: PyNode, with_mask: bool) -> None:
    q, k, v = _operands(node, *(t.betensor.to(torch.float32) for t in node.inputs[:3]))
    k = k - k.mean(dim=-1, keepdim=True)
    qk = torch.matmul(q, k) * float(node.get_param("scale_factor", optional=True, default_value=1.0))
    _set_placeholders(node, k, qk)
    logits = qk + node.inputs[3].betensor.to(torch.float32) if with_mask else qk
    node.outputs[0].betensor = torch.matmul(torch.softmax(logits, dim=-1), v)


def _mult(ratio: float) -> Tuple[int, int]:
    m, n, _, _ = scale_shift(torch.tensor(ratio, dtype=torch.float32), MULT_BITS, shift_limit=SHIFT_MAX)
    return int(m), int(n)


def _int_forward(node: PyNode, with_mask: bool) -> None:
    q, k, v = _operands(node, *(int_value(t) + tensor_zp(node, t) for t in node.inputs[:3]))
    p = node.params
    big = 2 ** 62
    z = requantize_int(exact_int_matmul(q, k), int(p["logit_scale_value"]), int(p["logit_shift_value"]), 0, -big, big)
    if with_mask:
        m_t = node.inputs[3]
        z = z + requantize_int(int_value(m_t) + tensor_zp(node, m_t), int(p["mask_scale_value"]),
                               int(p["mask_shift_value"]), 0, -big, big)
    top = 2 ** int(p.get("qxk_bits", QXK_BITS)) - 1
    u = z - z.amax(dim=-1, keepdim=True) + top
    e = lookup_lut(torch.clamp(u, 0, top), node.constants["lut"].betensor, 0, QXK_BITS, EXP_BITS, False)
    e = torch.where(u < 0, torch.zeros_like(e), e)
    total = e.sum(dim=-1, keepdim=True)
    prob = torch.clamp(div_round_half_even(e * P_CODES, total), 0, P_CODES)
    o = node.outputs[0]
    qmin, qmax = out_range(node, o)
    node.outputs[0].betensor = requantize_int(exact_int_matmul(prob, v), int(p["out_scale_value"]),
                                              int(p["out_shift_value"]), int(tensor_zp(node, o)), qmin, qmax)


@SDP_ATTENTION.forward
def sdp_attention_forward(self: PyNode) -> None:
    """Float: exact attention (and the placeholders). Integer: _int_forward."""
    with_mask = _check(self)
    if self.quantized:
        _int_forward(self, with_mask)
    else:
        _float_forward(self, with_mask)


@SDP_ATTENTION.quantize
def sdp_attention_quantize(self: PyNode) -> None:
    """Output symmetric (signed as V) from its calibrated range; logit scale from the qxk_normed placeholder at 12
    bits (at most 4095 / 12 codes per unit); the exp table; the three requantizations."""
    with_mask = _check(self)
    check_quantized_inputs(self, self.inputs)
    for t in self.inputs:
        refuse_per_channel(self, t)
    bits = int(layer_settings(self).q_bits_activation)
    mode = activation_mode(self, bits)
    if mode.is_per_channel:
        raise UnsupportedError(f"layer '{self.name}' (SDPAttention): per-channel activation quantization is not "
                               "supported; use a per_tensor mode for this layer",
                               field="quantize_method_for_activation", layer=self.name)
    o = self.outputs[0]
    table = ranges_of(self)
    r = table.get(o)
    if r.min is None or r.max is None:
        raise self._error(f"output '{o.name}' has no calibrated range; run calibration before quantization")
    p_out = linear_quant_params(r.min, r.max, bits, mode.to_symmetric(), is_signed(self, self.inputs[2]))
    set_params(self, o, p_out, bits).qinvariant = False
    ph = self.placeholders[1] if len(self.placeholders) > 1 else None
    r = table.get(ph) if ph is not None else None
    if ph is None or ph.name != f"{self.name}/qxk_normed" or r.min is None or r.max is None:
        raise self._error(f"placeholder '{self.name}/qxk_normed' has no calibrated range: the layer's float "
                          "forward must run during calibration")
    top = 2 ** QXK_BITS - 1
    s_l = min(float(linear_quant_params(r.min, r.max, QXK_BITS, mode.to_symmetric(), True).scale),
              top / MIN_WINDOW)
    q_t, k_t, v_t = self.inputs[:3]
    sf = float(self.get_param("scale_factor", optional=True, default_value=1.0))
    if sf <= 0:
        raise self._error(f"scale_factor must be positive to be quantized, got {sf}")
    p = self.params
    p["qxk_bits"] = QXK_BITS
    s_qk = tensor_scale(self, q_t) * tensor_scale(self, k_t)
    p["logit_scale_value"], p["logit_shift_value"] = _mult(s_l * sf / s_qk)
    if with_mask:
        p["mask_scale_value"], p["mask_shift_value"] = _mult(s_l / tensor_scale(self, self.inputs[3]))
    p["out_scale_value"], p["out_shift_value"] = _mult(tensor_scale(self, o) / (P_CODES * tensor_scale(self, v_t)))
    emax = float(2 ** EXP_BITS - 1)
    log_max = torch.log(torch.tensor(emax, dtype=torch.float32))
    table = build_lut(lambda x: torch.exp(x + log_max), s_l, -top, 0, top, QXK_BITS, 1.0, 0, 0, int(emax),
                      LUT_ENTRIES_BITS)
    set_constant(self, "lut", table.to(torch.float32), Dtype.UINT16)
