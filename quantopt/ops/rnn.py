"""RNN: the plain (Elman) recurrent layer h_t = act(x_t Wx + h_{t-1} Wh + b), batch-major, one direction.

Float forward: upstream's cell with its activations (TANH, SIGMOID, RELU, CLIP, SIGN_BIT, NONE) and weight layout
(`weights` [C, I + C]: the input then the hidden columns). Quantized (docs/semantics/rnn.md): exact int64
MACs over (x codes + zero point) and the hidden codes, both parts requantized to one common accumulator scale
(15-bit multipliers, round half to even), the bias added there, then requantized to a table input (TANH/SIGMOID
lookup tables whose output is the hidden state's code) or to the output (RELU/CLIP/NONE).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..errors import UnsupportedError
from ..graph.memo import layer_key, memo
from ..graph.node import PyNode
from ..graph.tables import quant_of, ranges_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype
from ..quant.hardware import AIFF_MULTIPLIER_BITS
from ..quant.int_matmul import exact_int_matmul
from ..quant.lut import PreparedLut, build_lut
from ..quant.params import QuantMode, integer_range, linear_quant_params, quantize
from ..quant.requant import Requantizer, range_dtype, requantize_int, scale_shift
from ..registry import declare_op
from ..registry.schema import DtypeName, Float, Floats, Int, Ints, Param, Text, quantized
from ._int8_gemm import IntMatmul
from ._quant import (
    activation_mode,
    check_quantized_inputs,
    int_value,
    layer_settings,
    out_range,
    refuse_per_channel,
    set_constant,
    set_params,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
    values_absmax,
)

SEMANTICS = "docs/semantics/rnn.md"

ACTIVATIONS = ("TANH", "SIGMOID", "RELU", "CLIP", "SIGN_BIT", "NONE")
TABLE_CLAMP = {8: {"SIGMOID": 4.564205, "TANH": 2.6293793}, 16: {"SIGMOID": 10.0, "TANH": 6.0}}
"""Upstream's clamp of a table's input range by activation bits: beyond it the function is flat to within a code."""
MULT_BITS = AIFF_MULTIPLIER_BITS
"""Every multiplier has 15 bits (upstream uses the activation bits: 8-bit multipliers for 8-bit layers)."""
SHIFT_MAX = 62

RNN = declare_op(
    "RNN",
    params={
        "activations": Param(Text(choices=ACTIVATIONS), "the cell's activation", default="TANH"),
        "input_size": Param(Int(lo=1), "input features I per step", required=True),
        "cell_size": Param(Int(lo=1), "hidden size C", required=True),
        "direction": Param(Text(choices=("forward", "reverse")), "forward or reverse", default="forward"),
        "time_steps": Param(Int(lo=1), "sequence length T (checked against the input when given)"),
        "threshold": Param(Float(), "clamp of the pre-activation to [-threshold, threshold], positive (absent: none)"),
        "clip_min": Param(Float(), "CLIP: lower bound (quantized IR: in accumulator codes, truncated, as upstream)"),
        "clip_max": Param(Float(), "CLIP: upper bound (quantized IR: in accumulator codes)"),
        "weights_scale": quantized(Floats(), "scales of the input and the hidden weight columns"),
        "weights_zp": quantized(Ints(), "zero points of the weights (0, 0)"),
        "biases_scale": quantized(Float(), "scale of the biases (the accumulator scale)"),
        "biases_zp": quantized(Int(), "zero point of the biases, 0"),
        "scale_value": quantized(Ints(lo=0), "multipliers: input MAC, hidden MAC, pre-activation"),
        "scale_type": quantized(DtypeName(), "dtype of scale_value"),
        "shift_value": quantized(Ints(), "shifts: input MAC, hidden MAC, pre-activation"),
        "shift_type": quantized(DtypeName(), "dtype of shift_value"),
        "init_h_scale_value": quantized(Int(lo=0), "multiplier of the initial state to the hidden state's scale"),
        "init_h_shift_value": quantized(Int(), "shift of the initial state to the hidden state's scale"),
        "threshold_value": quantized(Int(lo=0), "threshold in accumulator codes"),
    },
    constants={"weights": "[C, I + C]: input columns then hidden columns (quantized: int codes)",
               "biases": "[C] (quantized: int32/int48 at the accumulator scale)",
               "lut": "TANH/SIGMOID table (quantized): table input codes to hidden-state codes"},
    integer="int64 MACs, both parts requantized to one accumulator scale, bias added, requantized to a table "
            "(TANH/SIGMOID) or the output; hidden state fed back as output codes",
    dtypes="x [N, T, I], h0 [N0, C] → Y [N, T, C], H [N, C] (signed, symmetric; SIGN_BIT: 0/1 integers)",
    semantics=SEMANTICS,
    summary="Plain recurrent layer h_t = act(x_t Wx + h_{t-1} Wh + b) over a batch-major sequence; outputs the "
            "state of every step and the last state. h0's row b % N0 starts sequence b.")


def _spec(node: PyNode) -> Tuple[str, int, int, bool]:
    """(activation, I, C, reverse), checked against the inputs."""
    if len(node.inputs) != 2 or len(node.outputs) != 2:
        raise node._error("expects 2 inputs (x [N, T, I], initial state [N0, C]) and 2 outputs (Y, H)")
    act = str(node.get_param("activations", optional=True, default_value="TANH")).upper()
    if act not in ACTIVATIONS:
        raise node._error(f"activations must be one of {', '.join(ACTIVATIONS)}, got {act!r}")
    i_size, c_size = int(node.get_param("input_size")), int(node.get_param("cell_size"))
    x, h0 = node.inputs[0].betensor, node.inputs[1].betensor
    if x.dim() != 3 or int(x.shape[2]) != i_size:
        raise node._error(f"input must be [N, T, input_size={i_size}], got {list(x.shape)}")
    steps = node.get_param("time_steps", optional=True, default_value=None)
    if steps is not None and int(steps) != int(x.shape[1]):
        raise node._error(f"time_steps is {steps} but the input has {int(x.shape[1])} steps")
    if h0.dim() != 2 or int(h0.shape[1]) != c_size or int(h0.shape[0]) < 1:
        raise node._error(f"initial state must be [N0, cell_size={c_size}], got {list(h0.shape)}")
    w = node.get_constant("weights", optional=True)
    b = node.get_constant("biases", optional=True)
    if w is None or b is None:
        raise node._error("needs the constants 'weights' [C, I + C] and 'biases' [C]")
    if list(w.betensor.shape) != [c_size, i_size + c_size] or b.betensor.numel() != c_size:
        raise node._error(f"weights must be [{c_size}, {i_size + c_size}] and biases [{c_size}], got "
                          f"{list(w.betensor.shape)} and {list(b.betensor.shape)}")
    if act == "CLIP":
        lo, hi = node.get_param("clip_min", optional=True), node.get_param("clip_max", optional=True)
        if lo is None or hi is None or float(lo) > float(hi):
            raise node._error("CLIP needs clip_min <= clip_max")
    direction = str(node.get_param("direction", optional=True, default_value="forward")).lower()
    return act, i_size, c_size, direction == "reverse"


def _initial(h0: torch.Tensor, batch: int) -> torch.Tensor:
    return h0[torch.arange(batch, device=h0.device) % h0.shape[0]]


def _set_placeholders(node: PyNode, values: List[torch.Tensor]) -> None:
    """Upstream's statistics: `<layer>/h_state` (every step's state) and `<layer>/lut_in` (pre-activations)."""
    names = [f"{node.name}/h_state", f"{node.name}/lut_in"]
    if [t.name for t in node.placeholders] != names:
        node.placeholders = [PyTensor(nm, v.detach().to(torch.float32)) for nm, v in zip(names, values)]
        return
    for t, v in zip(node.placeholders, values):
        t.betensor = v.detach().to(torch.float32)


def _float_act(node: PyNode, act: str, v: torch.Tensor) -> torch.Tensor:
    if act == "TANH":
        return torch.tanh(v)
    if act == "SIGMOID":
        return torch.sigmoid(v)
    if act == "RELU":
        return torch.relu(v)
    if act == "CLIP":
        return torch.clamp(v, float(node.get_param("clip_min")), float(node.get_param("clip_max")))
    if act == "SIGN_BIT":
        return (v < 0).to(v.dtype)
    return v


def _float_forward(node: PyNode, act: str, i_size: int, reverse: bool) -> None:
    x = node.inputs[0].betensor.to(torch.float32)
    if reverse:
        x = torch.flip(x, [1])
    w = node.constants["weights"].betensor.to(torch.float32)
    wx, wh = w[:, :i_size].t(), w[:, i_size:].t()
    b = node.constants["biases"].betensor.to(torch.float32).reshape(1, -1)
    thr = node.get_param("threshold", optional=True, default_value=None)
    h = _initial(node.inputs[1].betensor.to(torch.float32), int(x.shape[0]))
    states, pres = [], []
    for t in range(int(x.shape[1])):
        pre = x[:, t] @ wx + h @ wh + b
        if thr is not None:
            pre = torch.clamp(pre, -float(thr), float(thr))
        h = _float_act(node, act, pre)
        states.append(h)
        pres.append(pre)
    y = torch.stack(states, dim=1)
    _set_placeholders(node, [y, torch.stack(pres, dim=1)])
    node.outputs[0].betensor = torch.flip(y, [1]) if reverse else y
    node.outputs[1].betensor = h


def _mult(ratio: float) -> Tuple[int, int]:
    m, n, _, _ = scale_shift(torch.tensor(ratio, dtype=torch.float32), MULT_BITS, shift_limit=SHIFT_MAX)
    return int(m), int(n)


def _absmax(t: PyTensor, what: str, node: PyNode) -> Tuple[float, float]:
    r = ranges_of(node).get(t)
    if r.min is None or r.max is None:
        raise node._error(f"{what} '{t.name}' has no calibrated range: the layer's float forward must run during "
                          "calibration")
    return float(r.min), float(r.max)


def _placeholder(node: PyNode, index: int, name: str) -> PyTensor:
    t = node.placeholders[index] if index < len(node.placeholders) else None
    if t is None or t.name != f"{node.name}/{name}":
        raise node._error(f"placeholder '{node.name}/{name}' is missing: the layer's float forward must run during "
                          "calibration")
    return t


@RNN.forward
def rnn_forward(self: PyNode) -> None:
    """Float: the cell over the sequence (and the placeholders' values). Integer: _int_forward."""
    act, i_size, _, reverse = _spec(self)
    if self.quantized:
        _int_forward(self, act, i_size, reverse)
    else:
        _float_forward(self, act, i_size, reverse)


@RNN.quantize
def rnn_quantize(self: PyNode) -> None:
    """Weights per tensor (input and hidden columns apart), outputs symmetric from the h_state placeholder, bias at
    the accumulator scale min(s_x s_wx, s_h s_wh), multipliers, and the table of TANH/SIGMOID."""
    act, i_size, c_size, _ = _spec(self)
    check_quantized_inputs(self, self.inputs)
    x_t, h0_t = self.inputs
    for t in (x_t, h0_t):
        refuse_per_channel(self, t)
    settings = layer_settings(self)
    bits = int(settings.q_bits_activation)
    if bits not in (8, 16):
        raise UnsupportedError(f"layer '{self.name}' (RNN): {bits}-bit activations are not supported (8 or 16)")
    mode = activation_mode(self, bits)
    if mode.is_per_channel:
        raise UnsupportedError(f"layer '{self.name}' (RNN): per-channel activation quantization is not supported; "
                               "use a per_tensor mode for this layer", field="quantize_method_for_activation",
                               layer=self.name)
    sym = mode.to_symmetric()
    # outputs: the state's calibrated range, symmetric signed (SIGN_BIT: 0/1 integers)
    if act == "SIGN_BIT":
        for o in self.outputs:
            set_qinvariant(self, o, bits, True)
        s_h = 1.0
    else:
        lo, hi = _absmax(_placeholder(self, 0, "h_state"), "placeholder", self)
        p = linear_quant_params(lo, hi, bits, sym, True)
        for o in self.outputs:
            set_params(self, o, p, bits)
        s_h = float(p.scale)
    # weights: input and hidden columns per tensor, symmetric signed
    w_t = self.constants["weights"]
    w = w_t.betensor.to(torch.float32)
    w_bits = int(settings.q_bits_weight)
    wlo, whi = integer_range(w_bits, True)
    codes, scales = [], []
    for part in (w[:, :i_size], w[:, i_size:]):
        m = float(part.abs().max())
        s = float(linear_quant_params(-m, m, w_bits, QuantMode.PER_TENSOR_SYMMETRIC_RESTRICTED_RANGE, True).scale)
        scales.append(s)
        codes.append(quantize(part, s, 0, wlo, whi))
    set_constant(self, "weights", torch.cat(codes, dim=1).to(torch.float32), Dtype.INT8 if w_bits <= 8 else
                 Dtype.INT16)
    s_x = tensor_scale(self, x_t)
    s_xw, s_hw = s_x * scales[0], s_h * scales[1]
    s_acc = min(s_xw, s_hw)
    b_bits = int(settings.q_bits_bias)
    blo, bhi = integer_range(b_bits, True)
    b = self.constants["biases"].betensor.to(torch.float32).reshape(-1)
    set_constant(self, "biases", quantize(b, s_acc, 0, blo, bhi).to(torch.float32),
                 Dtype.INT32 if b_bits <= 32 else Dtype.INT64)
    p = self.params
    p["weights_scale"], p["weights_zp"] = [float(s) for s in scales], [0, 0]
    p["biases_scale"], p["biases_zp"] = float(s_acc), 0
    if act in ("TANH", "SIGMOID"):
        ph = _placeholder(self, 1, "lut_in")
        lo, hi = _absmax(ph, "placeholder", self)
        bound = TABLE_CLAMP[bits][act]
        t_par = linear_quant_params(max(lo, -bound), min(hi, bound), bits, sym, True)
        s_t = float(t_par.scale)
        tlo, thi = integer_range(bits, True)
        olo, ohi = out_range(self, self.outputs[0])
        fn = torch.tanh if act == "TANH" else torch.sigmoid
        table = build_lut(fn, s_t, 0, tlo, thi, bits, s_h, 0, olo, ohi, min(bits, int(settings.lut_items_in_bits)))
        set_constant(self, "lut", table.to(torch.float32), Dtype.INT8 if bits <= 8 else Dtype.INT16)
        out_ratio = s_t / s_acc
    else:
        out_ratio = s_h / s_acc
    if act == "CLIP":
        p["clip_min"] = int(float(self.get_param("clip_min")) * s_acc)
        p["clip_max"] = int(float(self.get_param("clip_max")) * s_acc)
    thr = self.get_param("threshold", optional=True, default_value=None)
    if thr is not None:
        p["threshold_value"] = int(min(round(float(thr) * s_acc), 2 ** 62))
    mults = [_mult(s_acc / s_xw), _mult(s_acc / s_hw), _mult(out_ratio)]
    p["scale_value"] = [m for m, _ in mults]
    p["scale_type"] = Dtype.UINT16
    p["shift_value"] = [n for _, n in mults]
    p["shift_type"] = range_dtype(min(n for _, n in mults), max(n for _, n in mults), force_signed=True)
    p["init_h_scale_value"], p["init_h_shift_value"] = _mult(s_h / tensor_scale(self, h0_t))


@dataclass
class _RnnPlan:
    """What the integer forward derives from the layer alone, prepared once per layer and device (graph/memo.py):
    the weights, the hidden product, the requantizations (each given the bound its inputs keep: |h| within the
    output range, the weights' column sums) and the table."""

    wx: torch.Tensor
    hidden: IntMatmul
    bias: torch.Tensor
    rq_hidden: Requantizer
    """the hidden part's requantization, its range the bound of its results (it never clamps below 2^62)"""
    hidden_bound: int
    hidden_out: int
    rq_code: Requantizer
    rq_out: Requantizer
    table: Optional[PreparedLut]
    table_in_range: bool
    h_max: int


def _rnn_plan(node: PyNode, act: str, i_size: int, device: torch.device) -> _RnnPlan:
    def build() -> _RnnPlan:
        w = int_value(node.constants["weights"]).to(device)
        ms, ns = node.get_param("scale_value"), node.get_param("shift_value")
        olo, ohi = out_range(node, node.outputs[0])
        bits = int(quant_of(node).get(node.outputs[0]).qbits)
        tlo, thi = integer_range(bits, True)
        hidden = IntMatmul(w[:, i_size:].t().contiguous())
        h_max = max(-olo, ohi)
        hidden_bound = h_max * hidden.col_absmax
        scaled = hidden_bound * abs(int(ms[1]))
        shift = int(ns[1])
        hidden_out = min(-(-scaled >> shift) if shift >= 0 else scaled << -shift, _SATURATED)
        rq_code = Requantizer(ms[2], ns[2], 0, tlo, thi, device)
        table = PreparedLut(node.constants["lut"].betensor, tlo, bits, bits, True, device=device) \
            if act in ("TANH", "SIGMOID") else None
        return _RnnPlan(w[:, :i_size].t(), hidden, int_value(node.constants["biases"]).reshape(1, -1).to(device),
                        Requantizer(ms[1], ns[1], 0, -hidden_out, hidden_out, device), hidden_bound, hidden_out,
                        rq_code, Requantizer(ms[2], ns[2], 0, olo, ohi, device), table,
                        table is not None and table.covers(tlo, thi), h_max)

    return memo(node, "rnn_plan", (layer_key(node), act, i_size, str(device)), build)


_SATURATED = 2 ** 62
"""The input and hidden parts' requantizations clamp at ±2^62 (upstream's int64 saturation)."""


def _int_forward(node: PyNode, act: str, i_size: int, reverse: bool) -> None:
    x_t, h0_t = node.inputs
    x = int_value(x_t) + tensor_zp(node, x_t)
    if reverse:
        x = torch.flip(x, [1])
    ms, ns = node.get_param("scale_value"), node.get_param("shift_value")
    y_t = node.outputs[0]
    olo, ohi = out_range(node, y_t)
    plan = _rnn_plan(node, act, i_size, x.device)
    h = requantize_int(_initial(int_value(h0_t) + tensor_zp(node, h0_t), int(x.shape[0])),
                       int(node.get_param("init_h_scale_value")), int(node.get_param("init_h_shift_value")), 0,
                       olo, ohi)
    thr: Optional[int] = node.get_param("threshold_value", optional=True, default_value=None)
    # the input part of every step at once (element-wise requantization: the values of step by step); each step's
    # requantizations given the bounds their inputs keep (|h| within the output range: no look at the values)
    x_part = requantize_int(exact_int_matmul(x, plan.wx), ms[0], ns[0], 0, -_SATURATED, _SATURATED) + plan.bias
    acc_bound = values_absmax(x_part) + plan.hidden_out
    if thr is not None:
        acc_bound = min(acc_bound, abs(int(thr)))
    table, rq_code, rq_out = plan.table, plan.rq_code, plan.rq_out
    states = []
    for t in range(int(x.shape[1])):
        acc = x_part[:, t] + plan.rq_hidden(plan.hidden(h, plan.h_max), plan.hidden_bound)
        if thr is not None:
            acc = torch.clamp(acc, -int(thr), int(thr))
        if table is not None:
            h = torch.clamp(table(rq_code(acc, acc_bound), plan.table_in_range), olo, ohi)
        elif act == "SIGN_BIT":
            h = (acc < 0).to(torch.int64)
        else:
            if act == "RELU":
                acc = torch.clamp(acc, min=0)
            elif act == "CLIP":
                acc = torch.clamp(acc, int(node.get_param("clip_min")), int(node.get_param("clip_max")))
            h = rq_out(acc, acc_bound)
        states.append(h)
    y = torch.stack(states, dim=1)
    node.outputs[0].betensor = torch.flip(y, [1]) if reverse else y
    node.outputs[1].betensor = h
