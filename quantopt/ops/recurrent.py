"""Recurrent layers: BasicLSTM and GRUv3 (batch-major sequences, one direction per layer).

Float forward: the TF/Compass cell equations with the weight layouts the Parser writes (LSTM gate blocks i, g, f, o;
GRU gate blocks r, z, then the candidate). Quantized (docs/semantics/recurrent.md): exact int64 MACs over
[x_t, h_{t-1}] with the input zero point folded into the biases, per-channel requantization of every gate
pre-activation to a fixed gate scale, sigmoid/tanh through int16 Q15 lookup tables, the LSTM cell state in int32
fixed point with a fraction width that provably cannot overflow, and the hidden state fed back in a fixed
power-of-two format; the outputs are requantized from the exact Q30 products to their calibrated params (the "q15"
form). BasicLSTM's default form is upstream's instead (`lstm_integer_form`): 256-entry tables and per-step
multipliers from the calibrated ranges of the cell's inner tensors, which the float forward keeps as the layer's
placeholders (calibration/collect.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..errors import UnsupportedError
from ..graph.memo import Same, layer_key, memo
from ..graph.node import PyNode
from ..graph.tables import TensorRange, quant_of, ranges_of
from ..graph.tensor import PyTensor
from ..graph.wide_values import wide_values_of
from ..quant.dtype import Dtype
from ..quant.hardware import AIFF_MULTIPLIER_BITS
from ..quant.int_matmul import exact_int_matmul
from ..quant.lut import PreparedLut, build_lut
from ..quant.params import QuantMode, integer_range, linear_quant_params, quantize
from ..quant.requant import (
    IntLike,
    Requantizer,
    bias_quantize,
    fold_input_zero_point,
    range_dtype,
    requantize_int,
    scale_shift,
)
from ..quant.rounding import FLOAT64_EXACT, INT64_SAFE, SMALL_CONVERSION, round_shift
from ..registry import declare_op
from ..registry.schema import Bool, DtypeName, Float, Floats, Int, Ints, Param, Text, Value, quantized
from ._int8_gemm import IntMatmul
from ._quant import (
    activation_mode,
    check_quantized_inputs,
    effective_weights,
    int_value,
    layer_settings,
    out_range,
    quantize_weights,
    set_constant,
    set_params,
    tensor_scale,
    tensor_zp,
    values_absmax,
)
from ._recurrent_steps import gru_steps, lstm_steps, q15_gru_steps, q15_lstm_steps
from ._shared import unrounded_input
from .onnx_build.exact import DOUBLE, INT64, codes
from .onnx_build.qdq_graph import FLOAT, QDQGraph, node_error
from .onnx_build.recurrent import CellOps

SIGMOID_INPUT_RANGE = 8.0
"""Gate pre-activations feeding a SIGMOID table are quantized symmetrically over [-8, 8] (sigmoid(8) = 0.99966)."""

TANH_INPUT_RANGE = 4.0
"""Gate pre-activations feeding a TANH table are quantized symmetrically over [-4, 4] (tanh(4) = 0.99933)."""

GATE_FRAC_BITS = 15
"""Gate outputs (table values) are Q15: int16 in [-32767, 32767], 1.0 = 2^15."""

PRODUCT_FRAC_BITS = 2 * GATE_FRAC_BITS
"""Products of two gate outputs (o * tanh(c) of the LSTM, the GRU state update) are Q30."""

CELL_MAX_FRAC_BITS = 30
"""The LSTM cell state is int32 with F <= 30 fraction bits, F chosen so that |c| * 2^F <= 2^30."""

CELL_INT_MAX = 2 ** 31 - 1
"""Saturation bound of the int32 cell state (never reached when F follows from the bound of the docs)."""

OUTPUT_MODE = QuantMode.PER_TENSOR_SYMMETRIC_RESTRICTED_RANGE
"""Every recurrent output's mode, whatever quantize_method_for_activation says (upstream's rule)."""

RNN_MULTIPLIER_BITS = AIFF_MULTIPLIER_BITS
"""Every multiplier of a recurrent layer has 15 bits (the AIFF maximum), independent of `multiplier_bits`."""

RNN_SHIFT_MAX = 62
"""Largest right shift of a recurrent requantization: every shift is an exact int64 round-half-even shift, so the
AIFF's 31-bit ceiling is not imposed (the Q30 products need shifts above 31 for 8-bit outputs)."""

RNN_ACTIVATIONS: Dict[str, Tuple[Callable[[torch.Tensor], torch.Tensor], float]] = {
    "SIGMOID": (torch.sigmoid, SIGMOID_INPUT_RANGE),
    "TANH": (torch.tanh, TANH_INPUT_RANGE),
}
"""Cell activations: float function and the fixed input range of its table."""

LSTM_DEFAULT_ACTIVATIONS = ["SIGMOID", "TANH", "TANH"]
GRU_DEFAULT_ACTIVATIONS = ["SIGMOID", "TANH"]
LSTM_OUTPUTS = ("Y", "H", "C")
GRU_OUT_SEQUENCES = (["H"], ["Hn"], ["H", "Hn"])


# ------------------------------------------------------------------------------------------------ declarations
_NOT_READ_BY_GRU = "; not read by GRUs"

_RNN_PARAMS: Dict[str, Param] = {
    "time_steps": Param(Int(lo=1), "sequence length T", required=True),
    "input_size": Param(Int(lo=1), "input features I per step", required=True),
    "cell_size": Param(Int(lo=1), "hidden (and cell) size C", required=True),
    "direction": Param(Text(choices=("forward", "reverse", "bidirectional")),
                       "forward or reverse (bidirectional is not supported: split it into two layers)",
                       default="forward"),
    "threshold": Param(Float(infinite=True), "clamp of the gate pre-activations to [-threshold, threshold], positive "
                       "(absent or inf: none)"),
    "weights_scale": quantized(Floats(), "scale of the weights (a constant when per-channel)"),
    "weights_zp": quantized(Int(), "zero point of the weights (a constant when per-channel)"),
    "biases_scale": quantized(Float(), "BasicLSTM: scale of the biases s_x * s_w (a constant when per-channel)"),
    "biases_zp": quantized(Int(), "BasicLSTM: zero point of the biases, 0 (a constant when per-channel)"),
    "gate_bits": quantized(Int(lo=8, hi=16), "8 or 16: the bits of the gate table inputs and the hidden state"),
    "hidden_frac_bits": quantized(Int(lo=0), "fraction bits of the fixed-point hidden state fed back"),
    "gate_clamp_value": quantized(Ints(lo=0), "threshold as codes of the gate and the candidate table inputs"),
    "hidden_scale_value": quantized(Int(lo=0), "multiplier of the hidden part of the MACs"),
    "hidden_shift_value": quantized(Int(), "shift of the hidden part of the MACs"),
    "init_h_scale_value": quantized(Int(lo=0), "multiplier of the initial hidden state to its fixed point"),
    "init_h_shift_value": quantized(Int(), "shift of the initial hidden state to its fixed point"),
    "out_scale_value": quantized(Ints(lo=0), "multiplier of each output"),
    "out_shift_value": quantized(Ints(), "shift of each output"),
}
"""The keys every recurrent type reads the same way."""


def _cell_params(suffix: str) -> Dict[str, Param]:
    """The LSTM cell-state keys (GRU IRs may carry them too: `suffix` says that GRUs do not read them)."""
    return {
        "cell_clip": Param(Float(infinite=True), f"clamp of the cell state, positive (absent or inf: none){suffix}"),
        "cell_frac_bits": quantized(Int(lo=0, hi=CELL_MAX_FRAC_BITS), f"fraction bits of the int32 cell state{suffix}"),
        "cell_clip_value": quantized(Int(lo=0), f"cell_clip in cell state units{suffix}"),
        "init_c_scale_value": quantized(Int(lo=0), f"multiplier of the initial cell state to its fixed point{suffix}"),
        "init_c_shift_value": quantized(Int(), f"shift of the initial cell state to its fixed point{suffix}"),
        "cell_scale_value": quantized(Int(lo=0), f"multiplier of the cell state to the cell table input{suffix}"),
        "cell_shift_value": quantized(Int(), f"shift of the cell state to the cell table input{suffix}"),
    }


_RNN_CONSTANTS: Dict[str, str] = {
    "weights_scale": "per-row weight scales (per-channel weights, quantized)",
    "weights_zp": "per-row weight zero points (per-channel weights, quantized)",
    "biases_scale": "BasicLSTM: per-row bias scales s_x * s_w[r] (per-channel weights); GRU upstream form: the "
                    "gate and candidate bias scales (quantized)",
    "biases_zp": "BasicLSTM: bias zero point 0 (per-channel weights); GRU upstream form: one 0 per bias scale "
                 "(quantized)",
    "gate_scale": "per-row multipliers of the gate pre-activations (quantized)",
    "gate_shift": "per-row shifts of the gate pre-activations (quantized)",
    "lut_gate": "Q15 table of the gate activation (quantized)",
    "lut_cand": "Q15 table of the candidate activation (quantized)",
    "scale": "upstream's requantization multipliers; not read",
    "shift": "upstream's requantization shifts; not read",
}
_RNN_DTYPES = "float32 → int8 (8 bits) or int16 (16 bits), signed"

BASICLSTM = declare_op(
    "BasicLSTM",
    params={
        **_RNN_PARAMS,
        "out_sequence": Param(Value("output names"), "distinct outputs among Y, H, C, in output order",
                              default=["Y", "H", "C"]),
        "activations": Param(Value("activation names"), "SIGMOID or TANH for the gates, the candidate and the cell "
                             "output", default=LSTM_DEFAULT_ACTIVATIONS),
        "forget_bias": Param(Float(), "added to the forget gate pre-activation", default=0.0),
        **_cell_params(""),
        "activation_alpha": Param(Floats(), "alpha of the activations; not read"),
        "activation_beta": Param(Floats(), "beta of the activations; not read"),
        "version": Param(Value("version name"), "not read by BasicLSTM"),
        "basiclstm_for_qat": Param(Bool(), "upstream's QAT variant; not read"),
        "lut_shift_value": quantized(Int(), "upstream form: the shift the 16-bit gate sums are brought to before "
                                     "their multipliers (0 at 8 bits)"),
        "lut_shift_type": quantized(DtypeName(), "upstream form: dtype of lut_shift_value (int8)"),
    },
    constants={
        "weights": "[4C, I+C] (gates i, g, f, o)", "biases": "[4C]", **_RNN_CONSTANTS,
        "lut_cell": "q15 form: Q15 table of the cell output activation (quantized)",
        "scale": "upstream form: multipliers, 5 then 2 per time step (per-channel weights: 1, 4C, C, 1, 1, then 2 "
                 "per step) (quantized)",
        "shift": "upstream form: the shifts of `scale` (quantized)",
        "diff_shifts": "upstream form: per-step shift moved from the cell products to the cell state (16 bits; 0 at "
                       "8 bits) (quantized)",
        "zerop": "upstream's QAT zero points; not read",
        "lut_it": "upstream form: 256-entry table of the input gate (activation 0) (quantized)",
        "lut_ft": "upstream form: the forget gate's table, as lut_it (quantized)",
        "lut_ot": "upstream form: the output gate's table, as lut_it (quantized)",
        "lut_ct": "upstream form: 256-entry table of the candidate (activation 1) (quantized)",
        "lut_h": "upstream form: 256-entry table of the cell output (activation 2) (quantized)",
    },
    integer="upstream form (default): int64 MAC, per-gate multiplier/shift to 256-entry tables from the calibrated "
            "ranges of the cell's inner tensors, per-step requantization of the cell state; q15 form "
            "(lstm_integer_form = q15): fixed gate scales, Q15 tables, int32 fixed-point cell state",
    dtypes=_RNN_DTYPES, semantics="docs/semantics/recurrent.md#basiclstm")


def _gru_params(version: str) -> Dict[str, Param]:
    """The keys of GRUv3 and GRUv1, which differ in the default of `version` only."""
    return {
        **_RNN_PARAMS,
        "out_sequence": Param(Value("output names"), "[H], [Hn] or [H,Hn]", default=["H"]),
        "activations": Param(Value("activation names"), "SIGMOID or TANH for the gates and the candidate",
                             default=GRU_DEFAULT_ACTIVATIONS),
        "activation_alpha": Param(Floats(), "alpha of the activations: 1.0 only"),
        "activation_beta": Param(Floats(), "beta of the activations: 0.0 only"),
        "version": Param(Text(choices=("GRUV3", "GRUV1")), "GRUV3: the reset gate applied before the hidden MatMul; "
                         "GRUV1: after it (biases [4C], with the hidden candidate bias)", default=version),
        "forget_bias": Param(Float(), "not read by GRUs"),
        **_cell_params(_NOT_READ_BY_GRU),
        "remain_shift": quantized(Int(), "upstream form, 16 bits: the shift the multiplier steps keep (default 10; "
                                  "the rest of each shift is applied to the product first)"),
        "hidden_scale_type": quantized(DtypeName(), "upstream form: dtype of hidden_scale_value"),
        "hidden_shift_type": quantized(DtypeName(), "upstream form: dtype of hidden_shift_value"),
    }


def _gru_constants(biases: str) -> Dict[str, str]:
    return {"weights": "[3C, I+C] (gates r, z, candidate)", "biases": biases, **_RNN_CONSTANTS,
            "scale": "upstream form, per-channel weights: the six multipliers, the first four per row (quantized)",
            "shift": "upstream form, per-channel weights: the shifts of `scale` (quantized)",
            "hidden_scale": "upstream form, GRUV1 with per-channel weights: per-row multipliers of the hidden "
                            "candidate product (quantized)",
            "hidden_shift": "upstream form: the shifts of `hidden_scale` (quantized)",
            "lut_cell": "not used by GRUs",
            "lut_rt": "upstream form: 256-entry table of the reset and update gates (quantized)",
            "lut_zt": "upstream form: a copy of lut_rt (quantized)",
            "lut_ht": "upstream form: 256-entry table of the candidate (quantized)"}


GRUV3 = declare_op(
    "GRUv3", params=_gru_params("GRUV3"), constants=_gru_constants("[3C] (GRUV1: [4C])"),
    integer="upstream form (default): four weight blocks, int64 MAC, six multiplier/shift pairs to 256-entry "
            "tables from the calibrated ranges of the cell's inner tensors; q15 form (gru_integer_form = q15): "
            "per-gate requant to fixed gate scales, Q15 sigmoid/tanh tables, Q30 state update requantized to the "
            "outputs",
    dtypes=_RNN_DTYPES, semantics="docs/semantics/recurrent.md#gruv3")

GRUV1 = declare_op(
    "GRUv1", params=_gru_params("GRUV1"), constants=_gru_constants("[4C]"),
    summary="As GRUv3 with version GRUV1 (the reset gate applied after the hidden MatMul).",
    integer="as GRUv3", dtypes=_RNN_DTYPES, semantics="docs/semantics/recurrent.md#gruv3")


@dataclass
class RnnSpec:
    """Validated params of one recurrent layer."""

    kind: str  # "LSTM" or "GRU"
    time_steps: int
    input_size: int
    cell_size: int
    reverse: bool
    out_sequence: List[str]
    activations: List[str]
    threshold: Optional[float]
    cell_clip: Optional[float]
    forget_bias: float
    linear_before_reset: bool

    @property
    def gate_rows(self) -> int:
        return (4 if self.kind == "LSTM" else 3) * self.cell_size

    @property
    def bias_len(self) -> int:
        return self.gate_rows + (self.cell_size if self.linear_before_reset else 0)


def _positive_int(node: PyNode, key: str) -> int:
    value = node.get_param(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or int(value) < 1:
        raise node._error(f"parameter '{key}' must be a positive integer, got {value!r}")
    return int(value)


def _optional_bound(node: PyNode, key: str) -> Optional[float]:
    """threshold / cell_clip: absent or infinite means no clamp; otherwise a positive number."""
    value = node.get_param(key, optional=True, default_value=None)
    if value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise node._error(f"parameter '{key}' must be a number, got {value!r}") from None
    if math.isnan(f) or f <= 0:
        raise node._error(f"parameter '{key}' must be positive, got {value!r}")
    return None if math.isinf(f) else f


def rnn_spec(node: PyNode) -> RnnSpec:
    """Read and check the layer's params (IR errors name the layer; unsupported variants say so)."""
    kind = "LSTM" if str(node.type) == "BasicLSTM" else "GRU"
    time_steps = _positive_int(node, "time_steps")
    input_size = _positive_int(node, "input_size")
    cell_size = _positive_int(node, "cell_size")
    direction = str(node.get_param("direction", optional=True, default_value="forward")).lower()
    if direction not in ("forward", "reverse"):
        if direction == "bidirectional":
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): direction=bidirectional is not supported "
                                   "(split it into a forward and a reverse layer)")
        raise node._error(f"parameter 'direction' must be forward or reverse, got {direction!r}")
    default_seq = ["Y", "H", "C"] if kind == "LSTM" else ["H"]
    seq = node.get_param("out_sequence", optional=True, default_value=default_seq)
    seq = [str(s) for s in (seq if isinstance(seq, (list, tuple)) else [seq])]
    if kind == "LSTM":
        if not seq or any(s not in LSTM_OUTPUTS for s in seq) or len(set(seq)) != len(seq):
            raise node._error(f"out_sequence must list distinct outputs among Y, H, C, got {seq}")
    elif seq not in GRU_OUT_SEQUENCES:
        raise node._error(f"out_sequence must be [H], [Hn] or [H,Hn], got {seq}")
    if len(seq) != len(node.outputs):
        raise node._error(f"out_sequence {seq} names {len(seq)} outputs but the layer has {len(node.outputs)}")
    default_act = LSTM_DEFAULT_ACTIVATIONS if kind == "LSTM" else GRU_DEFAULT_ACTIVATIONS
    acts = node.get_param("activations", optional=True, default_value=default_act)
    acts = [str(a).upper() for a in (acts if isinstance(acts, (list, tuple)) else [acts])]
    if len(acts) != len(default_act):
        raise node._error(f"activations must list {len(default_act)} functions, got {acts}")
    for a in acts:
        if a not in RNN_ACTIVATIONS:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): activation {a} is not supported "
                                   f"(supported: {', '.join(RNN_ACTIVATIONS)})")
    if kind == "GRU":
        for key, default in (("activation_alpha", 1.0), ("activation_beta", 0.0)):
            values = node.get_param(key, optional=True, default_value=None)
            if values is not None and any(float(v) != default for v in
                                          (values if isinstance(values, (list, tuple)) else [values])):
                raise UnsupportedError(f"layer '{node.name}' ({node.type}): {key}={values} is not supported "
                                       f"(only {default})")
    # GRUv1 is the Parser's layer type for a GRU that resets after the hidden MatMul (GRUv3 with version GRUV1)
    default_version = "GRUV1" if str(node.type) == "GRUv1" else "GRUV3"
    version = str(node.get_param("version", optional=True, default_value=default_version)).upper()
    if kind == "GRU" and version not in ("GRUV3", "GRUV1"):
        raise node._error(f"parameter 'version' must be GRUV3 or GRUV1, got {version!r}")
    forget_bias = float(node.get_param("forget_bias", optional=True, default_value=0.0)) if kind == "LSTM" else 0.0
    spec = RnnSpec(kind, time_steps, input_size, cell_size, direction == "reverse", seq, acts,
                   _optional_bound(node, "threshold"), _optional_bound(node, "cell_clip") if kind == "LSTM" else None,
                   forget_bias, kind == "GRU" and version == "GRUV1")
    w = node.get_constant("weights").betensor
    if list(w.shape) != [spec.gate_rows, input_size + cell_size]:
        raise node._error(f"weights must have shape [{spec.gate_rows}, {input_size + cell_size}] "
                          f"(gate rows, input_size + cell_size), got {list(w.shape)}")
    b = node.get_constant("biases").betensor
    if b.numel() != spec.bias_len:
        raise node._error(f"biases must hold {spec.bias_len} values, got {b.numel()}")
    expected_inputs = 3 if kind == "LSTM" else 2
    if len(node.inputs) != expected_inputs:
        raise node._error(f"expects {expected_inputs} inputs (sequence, initial state{'s' if kind == 'LSTM' else ''})"
                          f", got {len(node.inputs)}")
    return spec


def _check_sequence(node: PyNode, spec: RnnSpec, x: torch.Tensor) -> None:
    if x.dim() != 3 or x.shape[1] != spec.time_steps or x.shape[2] != spec.input_size:
        raise node._error(f"input sequence must be [batch, {spec.time_steps}, {spec.input_size}], "
                          f"got {list(x.shape)}")


def _initial_state(node: PyNode, spec: RnnSpec, state: torch.Tensor, batch: int) -> torch.Tensor:
    """Initial state rows for a batch: row b uses row b mod (rows of the state input)."""
    if state.numel() % spec.cell_size != 0 or state.numel() == 0:
        raise node._error(f"initial state of shape {list(state.shape)} does not hold rows of {spec.cell_size}")
    s = state.reshape(-1, spec.cell_size)
    if s.shape[0] == batch:
        return s
    return s[torch.arange(batch, device=s.device) % s.shape[0]]


# ------------------------------------------------------------------------------------------------ float forward
def _act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return RNN_ACTIVATIONS[name][0]


def _clamp_opt(x: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    return x if bound is None else torch.clamp(x, -bound, bound)


def lstm_float(node: PyNode, spec: RnnSpec, x: torch.Tensor, h0: torch.Tensor,
               c0: torch.Tensor) -> Dict[str, torch.Tensor]:
    """z = [x_t, h] @ W^T + b split into i, g, f, o; c = f*c + i*g; h = o * act2(c), all in float64 as upstream's
    float forward computes it (the calibrated ranges match upstream's only so: docs/semantics/recurrent.md); the
    results are float64, the placeholders float32.

    Each step makes upstream's operations on the same operands (one GEMM of the row [x_t, h] by W^T, then the bias,
    the activations of the four gate blocks one by one, ...), but writes every result into a buffer made once for
    the whole sequence: the next step's [x_t, h] row is filled by the product that makes h, the pre-activations and
    activations of every step stay where the placeholders are gathered from after the loop. A step was two dozen
    small calls (the row concatenated, every result a new tensor, the tables joined per step); it is now about a
    dozen, with the same bits (tests/ops/test_recurrent_float_loop.py checks them against the step as written
    above)."""
    wc, bc = node.get_constant("weights").betensor, node.get_constant("biases").betensor
    if torch.is_grad_enabled() and any(v.requires_grad for v in (x, h0, c0, wc, bc)):
        return _lstm_float_differentiable(node, spec, x, h0, c0)
    w = memo(node, "lstm_float_weights", (Same(wc),), lambda: wc.to(torch.float64))
    b = bc.to(torch.float64).reshape(-1)
    a_gate, a_cand, a_cell = (_act(a) for a in spec.activations)
    xs = torch.flip(x, [1]) if spec.reverse else x
    batch, steps, isz, cs = int(x.shape[0]), spec.time_steps, spec.input_size, spec.cell_size
    f64 = dict(dtype=torch.float64, device=x.device)
    rows = torch.empty(steps + 1, batch, isz + cs, **f64)  # row t: [x_t, h_(t-1)]; row T's h part: the last h
    rows[:steps, :, :isz] = xs.transpose(0, 1)
    rows[0, :, isz:] = h0
    z = torch.empty(steps, batch, 4 * cs, **f64)  # pre-activations i, g, f, o (forget bias added, clamped)
    act = torch.empty(steps, batch, 4 * cs, **f64)  # their activations
    cells = torch.empty(steps, batch, cs, **f64)
    cell_out = torch.empty(steps, batch, cs, **f64)
    ig = torch.empty(batch, cs, **f64)
    wt, th, clip = w.t(), spec.threshold, spec.cell_clip
    one_row = batch == 1
    # every step's views made at once (one unbind per buffer, not a dozen slicing calls per step)
    row_t, h_t = rows.unbind(0), rows[:, :, isz:].unbind(0)
    z_t, cell_t, cell_out_t = z.unbind(0), cells.unbind(0), cell_out.unbind(0)
    zk = [z[:, :, k * cs:(k + 1) * cs].unbind(0) for k in range(4)]
    ak = [act[:, :, k * cs:(k + 1) * cs].unbind(0) for k in range(4)]
    fns = (a_gate, a_cand, a_gate, a_gate)
    adds = (None, None, spec.forget_bias, None)
    c = c0
    for t in range(steps):
        zt, ct = z_t[t], cell_t[t]
        torch.matmul(row_t[t], wt, out=zt)
        zt.add_(b)
        for k in range(4):
            _activate(fns[k], zk[k][t], ak[k][t], adds[k], th, one_row)
        i, g, f, o = ak[0][t], ak[1][t], ak[2][t], ak[3][t]
        torch.mul(f, c, out=ct)
        ct.add_(torch.mul(i, g, out=ig))
        if clip is not None:
            ct.clamp_(-clip, clip)
        a_cell(ct, out=cell_out_t[t])
        torch.mul(o, cell_out_t[t], out=h_t[t + 1])
        c = ct
    y = rows[1:, :, isz:].transpose(0, 1).contiguous()

    def by_batch(v: torch.Tensor) -> torch.Tensor:  # [T, B, n] -> [B, T, n]
        return v.transpose(0, 1).contiguous()

    def gates(v: torch.Tensor) -> torch.Tensor:  # i, f, o of [T, B, 4C] -> [B, T, 3C]
        return torch.cat([v[:, :, :cs], v[:, :, 2 * cs:]], dim=2).transpose(0, 1).contiguous()

    tables = [[gates(z), gates(act)], [by_batch(z[:, :, cs:2 * cs]), by_batch(act[:, :, cs:2 * cs])],
              [by_batch(cells), by_batch(cell_out)]]
    _merge_shared_tables(spec.activations, tables)
    _set_placeholders(node, [("h_batch", y)] + [(f"{name}_lut_{io}", tables[k][j])
                                                for k, name in enumerate(("f", "g", "h"))
                                                for j, io in enumerate(("in", "out"))]
                      + [(f"c_state_{t}", c_t) for t, c_t in enumerate(cells.to(torch.float32).unbind(0))])
    return {"Y": torch.flip(y, [1]) if spec.reverse else y, "H": y[:, -1].clone(), "C": cells[-1].clone()}


def _activate(fn: Callable[..., torch.Tensor], z: torch.Tensor, out: torch.Tensor, add: Optional[float],
              bound: Optional[float], one_row: bool) -> None:
    """out <- fn(clamp(z + add)) with z, out views of a step's buffers, z left holding clamp(z + add) (`add` None:
    nothing added, as `bound` None: no clamp), with upstream's bits.

    torch runs a transcendental function (sigmoid, tanh) over a tensor in vector chunks and its last elements one
    by one, and the two may differ in the last bit; which elements go which way depends on the tensor's layout.
    Upstream's addition and clamp make new contiguous tensors, so where they apply to several rows the function
    runs on such a tensor here too; one row is one contiguous run in every layout."""
    if one_row or (add is None and bound is None):
        if add is not None:
            z.add_(add)
        if bound is not None:
            z.clamp_(-bound, bound)
        fn(z, out=out)
        return
    v = z + add if add is not None else z
    if bound is not None:
        v = torch.clamp(v, -bound, bound)
    z.copy_(v)
    out.copy_(fn(v))


def _lstm_float_differentiable(node: PyNode, spec: RnnSpec, x: torch.Tensor, h0: torch.Tensor,
                               c0: torch.Tensor) -> Dict[str, torch.Tensor]:
    """`lstm_float` for a gradient-based method (a differentiable input or constant): the same operations, each
    result a new tensor, as autograd needs (it refuses results written into buffers)."""
    w = node.get_constant("weights").betensor.to(torch.float64)
    b = node.get_constant("biases").betensor.to(torch.float64).reshape(-1)
    a_gate, a_cand, a_cell = (_act(a) for a in spec.activations)
    xs = (torch.flip(x, [1]) if spec.reverse else x).to(torch.float64)
    h, c = h0.to(torch.float64), c0.to(torch.float64)
    ys, cs, gate_in, gate_out, cand_in, cand_out, cell_out = [], [], [], [], [], [], []
    for t in range(spec.time_steps):
        z = torch.cat([xs[:, t], h], dim=1) @ w.t() + b
        zi, zg, zf, zo = z.chunk(4, dim=1)
        th = spec.threshold
        zi, zg, zf, zo = (_clamp_opt(v, th) for v in (zi, zg, zf + spec.forget_bias, zo))
        i, g, f, o = a_gate(zi), a_cand(zg), a_gate(zf), a_gate(zo)
        c = _clamp_opt(f * c + i * g, spec.cell_clip)
        ac = a_cell(c)
        h = o * ac
        ys.append(h)
        cs.append(c)
        gate_in.append(torch.cat([zi, zf, zo], dim=1))
        gate_out.append(torch.cat([i, f, o], dim=1))
        cand_in.append(zg)
        cand_out.append(g)
        cell_out.append(ac)
    y = torch.stack(ys, dim=1)
    tables = [[torch.stack(gate_in, 1), torch.stack(gate_out, 1)], [torch.stack(cand_in, 1), torch.stack(cand_out, 1)],
              [torch.stack(cs, 1), torch.stack(cell_out, 1)]]
    _merge_shared_tables(spec.activations, tables)
    _set_placeholders(node, [("h_batch", y)] + [(f"{name}_lut_{io}", tables[k][j])
                                                for k, name in enumerate(("f", "g", "h"))
                                                for j, io in enumerate(("in", "out"))]
                      + [(f"c_state_{t}", c_t) for t, c_t in enumerate(cs)])
    return {"Y": torch.flip(y, [1]) if spec.reverse else y, "H": h, "C": c}


LSTM_PLACEHOLDERS = 7
"""BasicLSTM placeholders before the per-step cell states: h_batch, then the input and output of the gate (f),
candidate (g) and cell (h) tables; `c_state_<t>` follow, one per time step."""


GRU_PLACEHOLDERS = ("f_lut_in", "f_lut_out", "g_lut_in", "g_lut_out", "hidden_gate_out")
"""GRU placeholders after `state_batch`: the gate (r, z) and candidate table inputs and outputs, and GRUV1's hidden
candidate product h W_ch + b_h (zeros for GRUV3), as upstream keeps them; no GRU form reads them yet."""


def _merge_shared_tables(acts: List[str], tables: List[List[torch.Tensor]]) -> None:
    """Activations that share a function share one table, so their placeholders hold the values of both (joined
    along the last axis, in upstream's order of pairs: (0, 1), (0, 2), (1, 2))."""
    for a, b in ((0, 1), (0, 2), (1, 2)):
        if acts[a] == acts[b]:
            joined = [torch.cat([tables[a][j], tables[b][j]], dim=-1) for j in range(2)]
            tables[a] = tables[b] = joined


def _set_placeholders(node: PyNode, values: List[Tuple[str, torch.Tensor]]) -> None:
    """The cell's inner tensors as the layer's placeholders `<layer>/<name>` (their statistics and ranges feed
    upstream's quantization, docs/statistics-and-dump.md): existing ones of the same names are filled in place
    (keeping their statistics), otherwise they are created."""
    names = [f"{node.name}/{n}" for n, _ in values]
    if [t.name for t in node.placeholders] != names:
        node.placeholders = [PyTensor(n, v.detach().to(torch.float32)) for n, (_, v) in zip(names, values)]
        return
    for t, (_, v) in zip(node.placeholders, values):
        t.betensor = v.detach().to(torch.float32)


def gru_float(node: PyNode, spec: RnnSpec, x: torch.Tensor, h0: torch.Tensor) -> Dict[str, torch.Tensor]:
    """r, z = act0([x_t, h] @ Wg^T + bg); n = act1([x_t, r*h] @ Wc^T + bc) (GRUV1: act1(x Wcx^T + bc + r*(h Wch^T
    + bh))); h = (1 - z) * n + z * h.

    As `lstm_float`: upstream's operations step by step on the same operands, their results written into buffers
    made once per sequence (the rows [x_t, h] and [x_t, r*h] filled in place), the placeholders gathered after the
    loop; the same bits as the step written with a new tensor per operation (tests/ops/test_recurrent_float_loop.py).
    The pre-activations and activations are whole contiguous rows of those buffers, as upstream's are new tensors,
    so torch's transcendental loops split them alike."""
    cs, isz = spec.cell_size, spec.input_size
    wt, bt = node.get_constant("weights").betensor, node.get_constant("biases").betensor
    if torch.is_grad_enabled() and any(v.requires_grad for v in (x, h0, wt, bt)):
        return _gru_float_differentiable(node, spec, x, h0)
    w = wt.to(torch.float32)
    b = bt.to(torch.float32).reshape(-1)
    wg, wc = w[:2 * cs], w[2 * cs:3 * cs]
    bg, bc = b[:2 * cs], b[2 * cs:3 * cs]
    a_gate, a_cand = (_act(a) for a in spec.activations)
    xs = torch.flip(x, [1]) if spec.reverse else x
    batch, steps, th = int(x.shape[0]), spec.time_steps, spec.threshold
    f32 = dict(dtype=torch.float32, device=x.device)
    zrz = torch.empty(steps, batch, 2 * cs, **f32)
    rz = torch.empty(steps, batch, 2 * cs, **f32)
    pre = torch.empty(steps, batch, cs, **f32)
    cand = torch.empty(steps, batch, cs, **f32)
    hn = torch.zeros(steps, batch, cs, **f32)  # GRUV1's hidden candidate product; zeros for GRUV3
    states = torch.empty(steps + 1, batch, cs, **f32)  # h before step 0, then after each step
    states[0] = h0
    one, zh = torch.empty(batch, cs, **f32), torch.empty(batch, cs, **f32)
    if spec.linear_before_reset:
        wgx, wgh, wcx, wch, bh = wg[:, :isz].t(), wg[:, isz:].t(), wc[:, :isz].t(), wc[:, isz:].t(), b[3 * cs:4 * cs]
        gh = torch.empty(batch, 2 * cs, **f32)
    else:
        gate_rows = torch.empty(steps, batch, isz + cs, **f32)  # [x_t, h]
        cand_rows = torch.empty(steps, batch, isz + cs, **f32)  # [x_t, r*h]
        gate_rows[:, :, :isz] = xs.transpose(0, 1)
        cand_rows[:, :, :isz] = xs.transpose(0, 1)
        wgt, wct = wg.t(), wc.t()
    state_t, zrz_t, rz_t, pre_t, cand_t, hn_t = (v.unbind(0) for v in (states, zrz, rz, pre, cand, hn))
    r_t, z_t = rz[:, :, :cs].unbind(0), rz[:, :, cs:].unbind(0)
    x_t = xs.unbind(1)
    if not spec.linear_before_reset:
        gate_t, gate_h = gate_rows.unbind(0), gate_rows[:, :, isz:].unbind(0)
        cand_row_t, cand_h = cand_rows.unbind(0), cand_rows[:, :, isz:].unbind(0)
    for t in range(steps):
        h, zt, pt, r, z = state_t[t], zrz_t[t], pre_t[t], r_t[t], z_t[t]
        if spec.linear_before_reset:  # as upstream sums a GRUV1's gates: (x Wgx^T + bg) + h Wgh^T
            xt = x_t[t]
            torch.matmul(xt, wgx, out=zt)
            zt.add_(bg).add_(torch.matmul(h, wgh, out=gh))
        else:
            gate_h[t].copy_(h)
            torch.matmul(gate_t[t], wgt, out=zt)
            zt.add_(bg)
        if th is not None:
            zt.clamp_(-th, th)
        a_gate(zt, out=rz_t[t])
        if spec.linear_before_reset:
            torch.matmul(h, wch, out=hn_t[t]).add_(bh)
            torch.matmul(xt, wcx, out=pt)
            pt.add_(bc).add_(torch.mul(r, hn_t[t], out=zh))
        else:
            torch.mul(r, h, out=cand_h[t])
            torch.matmul(cand_row_t[t], wct, out=pt)
            pt.add_(bc)
        if th is not None:
            pt.clamp_(-th, th)
        a_cand(pt, out=cand_t[t])
        torch.mul(torch.rsub(z, 1.0), cand_t[t], out=one)
        torch.add(one, torch.mul(z, h, out=zh), out=state_t[t + 1])

    def by_batch(v: torch.Tensor) -> torch.Tensor:  # [T, B, n] -> [B, T, n]
        return v.transpose(0, 1).contiguous()

    y = by_batch(states[1:])
    _set_placeholders(node, [("state_batch", y)] + [(name, by_batch(v)) for v, name in
                                                    zip((zrz, rz, pre, cand, hn), GRU_PLACEHOLDERS)])
    return {"H": torch.flip(y, [1]) if spec.reverse else y, "Hn": states[-1].clone()}


def _gru_float_differentiable(node: PyNode, spec: RnnSpec, x: torch.Tensor,
                              h0: torch.Tensor) -> Dict[str, torch.Tensor]:
    """`gru_float` for a gradient-based method (a differentiable input or constant): the same operations, each
    result a new tensor, as autograd needs."""
    cs, isz = spec.cell_size, spec.input_size
    w = node.get_constant("weights").betensor.to(torch.float32)
    b = node.get_constant("biases").betensor.to(torch.float32).reshape(-1)
    wg, wc = w[:2 * cs], w[2 * cs:3 * cs]
    bg, bc = b[:2 * cs], b[2 * cs:3 * cs]
    a_gate, a_cand = (_act(a) for a in spec.activations)
    xs = torch.flip(x, [1]) if spec.reverse else x
    h = h0
    ys, inner = [], []
    for t in range(spec.time_steps):
        xt = xs[:, t]
        if spec.linear_before_reset:  # as upstream sums a GRUV1's gates: (x Wgx^T + bg) + h Wgh^T
            zrz = _clamp_opt((xt @ wg[:, :isz].t() + bg) + h @ wg[:, isz:].t(), spec.threshold)
        else:
            zrz = _clamp_opt(torch.cat([xt, h], dim=1) @ wg.t() + bg, spec.threshold)
        rz = a_gate(zrz)
        r, z = rz.chunk(2, dim=1)
        if spec.linear_before_reset:
            hn = h @ wc[:, isz:].t() + b[3 * cs:4 * cs]
            pre = xt @ wc[:, :isz].t() + bc + r * hn
        else:
            hn = torch.zeros_like(h)
            pre = torch.cat([xt, r * h], dim=1) @ wc.t() + bc
        pre = _clamp_opt(pre, spec.threshold)
        n = a_cand(pre)
        h = (1.0 - z) * n + z * h
        ys.append(h)
        inner.append((zrz, rz, pre, n, hn))
    y = torch.stack(ys, dim=1)
    _set_placeholders(node, [("state_batch", y)] + [(name, torch.stack([v[k] for v in inner], 1)) for k, name in
                                                    enumerate(GRU_PLACEHOLDERS)])
    return {"H": torch.flip(y, [1]) if spec.reverse else y, "Hn": h}


# ------------------------------------------------------------------------------------------------ quantization
def _gate_bits(node: PyNode) -> int:
    bits = int(layer_settings(node).q_bits_activation)
    if bits not in (8, 16):
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): {bits}-bit activations are not supported "
                               "(8 or 16)")
    return bits


def gate_input_scale(act: str, bits: int) -> float:
    """Fixed scale of a table's input: (2^(bits-1) - 1) / range of the activation, float32."""
    qmax = 2 ** (bits - 1) - 1
    return float(torch.tensor(qmax, dtype=torch.float32) / torch.tensor(RNN_ACTIVATIONS[act][1],
                                                                        dtype=torch.float32))


def _ratio(num: float, den: float) -> torch.Tensor:
    return torch.tensor(num, dtype=torch.float32) / torch.tensor(den, dtype=torch.float32)


def _mult_shift(ratio) -> Tuple[int, int]:
    m, n, _, _ = scale_shift(ratio, RNN_MULTIPLIER_BITS, shift_limit=RNN_SHIFT_MAX)
    return int(m), int(n)


def _absmax(node: PyNode, t: PyTensor) -> float:
    r = ranges_of(node).get(t)
    lo = 0.0 if r.min is None else float(r.min)
    hi = 0.0 if r.max is None else float(r.max)
    return max(abs(lo), abs(hi))


def _ceil_log2_real(v: float) -> int:
    """Smallest k >= 0 with v <= 2^k."""
    k = 0
    while float(2 ** k) < v:
        k += 1
    return k


def _store_weights(node: PyNode) -> torch.Tensor:
    """Quantize `weights` per output row (per-channel modes) or per tensor; returns s_w per row (float32 [rows])."""
    s = layer_settings(node)
    mode = QuantMode.from_name(s.q_mode_weight)
    wp = quantize_weights(node, per_channel=mode.is_per_channel)
    rows = node.get_constant("weights").betensor.shape[0]
    if isinstance(wp.scale, torch.Tensor):
        set_constant(node, "weights_scale", wp.scale.to(torch.float32), Dtype.FP32)
        set_constant(node, "weights_zp", wp.zerop.to(torch.int64), Dtype.INT32)
        return wp.scale.cpu().to(torch.float32).reshape(-1)  # on the CPU, where the multipliers are derived
    node.params["weights_scale"] = float(wp.scale)
    node.params["weights_zp"] = int(wp.zerop)
    return torch.full((rows,), float(wp.scale), dtype=torch.float32)


def _store_biases(node: PyNode, spec: RnnSpec, s_x: float, zp_x: int, s_w: torch.Tensor, s_hid: float) -> None:
    """Gate biases at scale s_x * s_w[row] with zp_x * sum(Wx[row]) folded in; the GRUV1 hidden bias at
    s_hid * s_w[candidate row]. Float32 products and round-half-even as the MAC ops."""
    s = layer_settings(node)
    bias_bits = int(s.q_bits_bias)
    lo, hi = integer_range(bias_bits, True)
    b = node.get_constant("biases")
    bf = b.betensor.to(torch.float32).reshape(-1).clone()
    cs, rows = spec.cell_size, spec.gate_rows
    if spec.kind == "LSTM" and spec.forget_bias:
        bf[2 * cs:3 * cs] = bf[2 * cs:3 * cs] + torch.tensor(spec.forget_bias, dtype=torch.float32)
    w_eff = effective_weights(node)
    gate_q, gate_scale = bias_quantize(bf[:rows], s_x, s_w, bias_bits)
    if spec.kind == "LSTM":
        _store_bias_scale(node, gate_scale)
    gate_q = fold_input_zero_point(gate_q, w_eff[:, :spec.input_size], zp_x, qmin=lo, qmax=hi)
    parts = [gate_q]
    if spec.linear_before_reset:
        hid_q, _ = bias_quantize(bf[rows:], s_hid, s_w[2 * cs:3 * cs], bias_bits)
        parts.append(hid_q)
    b.betensor = torch.cat(parts)
    b.dtype = Dtype.INT32 if bias_bits <= 32 else Dtype.INT64
    qb = quant_of(node).of(b)
    qb.scale, qb.zerop, qb.qbits = 1.0, 0, bias_bits


def _store_bias_scale(node: PyNode, scale: torch.Tensor) -> None:
    """The LSTM's bias scale s_x * s_w[r] (float32) and zero point 0 in the IR, as upstream writes them: params when
    every row has the same weight scale (per-tensor weights), else constants `biases_scale` [4C] and `biases_zp` [1].
    GRUs in the q15 form write none: a GRUV1's hidden bias has another scale than its gate biases."""
    if "weights_scale" in node.constants:
        set_constant(node, "biases_scale", scale.to(torch.float32).reshape(-1), Dtype.FP32)
        set_constant(node, "biases_zp", torch.zeros(1, dtype=torch.int64), Dtype.INT64)
        return
    node.params["biases_scale"] = float(scale.reshape(-1)[0])
    node.params["biases_zp"] = 0


def _build_table(node: PyNode, key: str, act: str, bits: int) -> None:
    qmax = 2 ** (bits - 1) - 1
    one = 2 ** GATE_FRAC_BITS - 1
    table = build_lut(_act(act), gate_input_scale(act, bits), 0, -qmax, qmax, bits, float(2 ** GATE_FRAC_BITS), 0,
                      -one, one, lut_items_in_bits=int(layer_settings(node).lut_items_in_bits))
    set_constant(node, key, table, Dtype.INT16)


def _clamp_code(bound: Optional[float], scale: float, limit: int) -> int:
    if bound is None:
        return limit
    return max(0, min(limit, int(round(bound * scale))))


def _quantize_output(node: PyNode, t: PyTensor, bits: int) -> None:
    """A cell output: symmetric restricted range (scale (2^(b-1) - 1) / max|x|, zero point 0) whatever the activation
    mode, as upstream quantizes recurrent outputs (docs/semantics/recurrent.md): the cell's values are centred on 0.
    Per-channel modes stay refused."""
    if activation_mode(node, bits).is_per_channel:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): per-channel activation quantization "
                               f"({layer_settings(node).q_mode_activation}) is not supported for recurrent outputs; "
                               "use a per_tensor mode for this layer", field="quantize_method_for_activation",
                               layer=node.name)
    r = ranges_of(node).get(t)
    if r.min is None or r.max is None:
        raise node._error(f"tensor '{t.name}' has no calibrated range; run calibration before quantization")
    set_params(node, t, linear_quant_params(r.min, r.max, bits, OUTPUT_MODE, True), bits)


@BASICLSTM.quantize
@GRUV1.quantize
@GRUV3.quantize
def rnn_quantize(self: PyNode) -> None:
    """Weights per row, biases with the input zero point folded in, gate multipliers, Q15 tables, state formats and
    output multipliers; everything the integer forward reads is stored in the layer (see the module doc)."""
    spec = rnn_spec(self)
    check_quantized_inputs(self, self.inputs)
    if spec.kind == "LSTM" and _upstream_form(self):
        lstm_upstream_quantize(self, spec)
        return
    if spec.kind == "GRU" and _gru_upstream_form(self):
        gru_upstream_quantize(self, spec)
        return
    bits = _gate_bits(self)
    hq = 2 ** (bits - 1) - 1
    x, h0 = self.inputs[0], self.inputs[1]
    s_x, zp_x = tensor_scale(self, x), tensor_zp(self, x)
    for out in self.outputs:
        _quantize_output(self, out, bits)
    # hidden state fed back: fixed point with Hf fraction bits, enough integer bits for the initial state
    k = _ceil_log2_real(_absmax(self, h0))
    hid_frac = bits - 1 - k
    if hid_frac < 1:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): the initial hidden state reaches "
                               f"{_absmax(self, h0):g}, too large for the {bits}-bit fixed-point hidden state")
    s_hid = float(2 ** hid_frac)
    s_w = _store_weights(self)
    _store_biases(self, spec, s_x, zp_x, s_w, s_hid)
    cs = spec.cell_size
    acts = spec.activations
    gate_act = ([acts[0], acts[1], acts[0], acts[0]] if spec.kind == "LSTM" else [acts[0], acts[0], acts[1]])
    s_gate = torch.cat([torch.full((cs,), gate_input_scale(a, bits), dtype=torch.float32) for a in gate_act])
    m, n, _, _ = scale_shift(s_gate / (torch.tensor(s_x, dtype=torch.float32) * s_w), RNN_MULTIPLIER_BITS,
                            shift_limit=RNN_SHIFT_MAX)
    set_constant(self, "gate_scale", torch.as_tensor(m, dtype=torch.int64), Dtype.UINT16)
    n = torch.as_tensor(n, dtype=torch.int64)
    set_constant(self, "gate_shift", n, range_dtype(float(n.min()), float(n.max()), force_signed=True))
    _build_table(self, "lut_gate", acts[0], bits)
    _build_table(self, "lut_cand", acts[1], bits)
    p = self.params
    p["gate_bits"] = bits
    p["hidden_frac_bits"] = hid_frac
    p["gate_clamp_value"] = [_clamp_code(spec.threshold, gate_input_scale(acts[0], bits), hq),
                             _clamp_code(spec.threshold, gate_input_scale(acts[1], bits), hq)]
    p["hidden_scale_value"], p["hidden_shift_value"] = _mult_shift(_ratio(s_x, s_hid))
    p["init_h_scale_value"], p["init_h_shift_value"] = _mult_shift(_ratio(s_hid, tensor_scale(self, h0)))
    out_frac = {}
    if spec.kind == "LSTM":
        c0 = self.inputs[2]
        c0_max = _absmax(self, c0)
        bound = max(c0_max, spec.cell_clip) if spec.cell_clip is not None else c0_max + spec.time_steps
        cell_frac = CELL_MAX_FRAC_BITS - _ceil_log2_real(bound)
        if cell_frac < 0:
            raise UnsupportedError(f"layer '{self.name}' ({self.type}): the cell state bound {bound:g} does not fit "
                                   "the int32 cell state")
        _build_table(self, "lut_cell", acts[2], bits)
        p["cell_frac_bits"] = cell_frac
        p["init_c_scale_value"], p["init_c_shift_value"] = _mult_shift(_ratio(float(2 ** cell_frac),
                                                                             tensor_scale(self, c0)))
        p["cell_scale_value"], p["cell_shift_value"] = _mult_shift(_ratio(gate_input_scale(acts[2], bits),
                                                                         float(2 ** cell_frac)))
        if spec.cell_clip is not None:
            p["cell_clip_value"] = min(CELL_INT_MAX, int(round(spec.cell_clip * 2 ** cell_frac)))
        out_frac = {"Y": PRODUCT_FRAC_BITS, "H": PRODUCT_FRAC_BITS, "C": cell_frac}
    else:
        out_frac = {"H": PRODUCT_FRAC_BITS, "Hn": PRODUCT_FRAC_BITS}
    pairs = [_mult_shift(_ratio(tensor_scale(self, out), float(2 ** out_frac[name])))
             for name, out in zip(spec.out_sequence, self.outputs)]
    p["out_scale_value"] = [m for m, _ in pairs]
    p["out_shift_value"] = [s for _, s in pairs]


# ------------------------------------------------------------------------------------------------ integer forward
def _lut(node: PyNode, key: str, bits: int, device: torch.device) -> PreparedLut:
    """The q15 form's lookup in table constant `key` (restricted signed `bits`-bit codes in, 16-bit values out),
    prepared for a cell's steps."""
    qmax = 2 ** (bits - 1) - 1
    return PreparedLut(node.get_constant(key).betensor, -qmax, bits, 16, True, in_restricted=True, device=device)


def _ip(node: PyNode, key: str) -> int:
    value = node.get_param(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise node._error(f"parameter '{key}' must be an integer, got {value!r}")
    return value


def _requant_out(node: PyNode, idx: int, v: torch.Tensor) -> torch.Tensor:
    out = node.outputs[idx]
    qmin, qmax = out_range(node, out)
    m = node.get_param("out_scale_value")
    s = node.get_param("out_shift_value")
    if not isinstance(m, list) or not isinstance(s, list) or len(m) != len(node.outputs) or len(s) != len(m):
        raise node._error("out_scale_value/out_shift_value must list one integer per output")
    return torch.clamp(round_shift(v * int(m[idx]), int(s[idx])) - tensor_zp(node, out), qmin, qmax)


def _check_bound(node: PyNode, spec: RnnSpec, w: torch.Tensor, b: torch.Tensor, bits: int) -> None:
    """Refuse (rather than wrap) a layer whose worst-case intermediate reaches 2^62: the hidden-part MAC times its
    multiplier (or times a Q15 gate for GRUV1) and the gate accumulator times its gate multiplier."""
    lo, hi = out_range(node, node.inputs[0])
    xmax, hmax = max(abs(lo), abs(hi)), 2 ** (bits - 1)
    wx = int(w[:, :spec.input_size].abs().sum(dim=1).max())
    wh = int(w[:, spec.input_size:].abs().sum(dim=1).max())
    rows = spec.gate_rows
    hidden = wh * hmax + (int(b[rows:].abs().max()) if b.numel() > rows else 0)
    mh, nh = _ip(node, "hidden_scale_value"), _ip(node, "hidden_shift_value")
    rescaled = (hidden * mh >> nh) + 1 if nh >= 0 else hidden * mh << -nh
    acc = wx * xmax + int(b[:rows].abs().max()) + rescaled
    gm = int(node.get_constant("gate_scale").betensor.max())
    worst = max(hidden * max(mh, 2 ** GATE_FRAC_BITS), rescaled, acc * gm)
    if worst >= INT64_SAFE:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the worst-case gate accumulator ({worst}) does not "
                               "fit the exact int64 integer forward; use narrower inputs or weights")


class _GateIn:
    """clamp(round_half_even(acc · M / 2^shift), -clamp, clamp) per row of the gate block (q15 form), prepared once:
    the requantization to the widest clamp first (`Requantizer`: the same rounding) changes nothing the per-row
    clamp keeps."""

    def __init__(self, mult: torch.Tensor, shift: torch.Tensor, clamp: torch.Tensor) -> None:
        widest = int(clamp.abs().max()) if clamp.numel() else 0
        self.requant = Requantizer(mult, shift, 0, -widest, widest, clamp.device)
        self.clamp, self.low = clamp, -clamp
        self._shifted: Dict[Any, Tuple[Any, torch.Tensor, torch.Tensor]] = {}  # clamps less a `minus`, kept

    def __call__(self, acc: torch.Tensor, bound: Optional[int] = None,
                 minus: Union[int, torch.Tensor] = 0) -> torch.Tensor:
        """The clamped gate inputs of `acc`, less `minus` (a table lookup's index offset, `_CodeLookup`: the
        clamp's bounds are shifted alike); `bound`: a max |acc| the caller has proven (`Requantizer`)."""
        if not isinstance(minus, torch.Tensor) and not minus:
            return torch.clamp(self.requant(acc, bound), self.low, self.clamp)
        key = id(minus) if isinstance(minus, torch.Tensor) else minus
        kept = self._shifted.get(key)
        if kept is None or (isinstance(minus, torch.Tensor) and kept[0] is not minus):
            kept = self._shifted[key] = (minus, self.low - minus, self.clamp - minus)
        return torch.clamp(self.requant(acc, bound, minus=minus), kept[1], kept[2])


@dataclass
class _Q15Plan:
    """What the q15 form's forward derives from the layer alone, checked and prepared once per layer and device
    (graph/memo.py): the input weights and biases, the hidden products, gate requantizations and tables."""

    wx: torch.Tensor
    b: torch.Tensor
    hidden: List[IntMatmul]
    """LSTM: the hidden weights; GRU: those of the reset/update gates, then of the candidate"""
    gate_in: List[_GateIn]
    """LSTM: all four gate blocks; GRU: the reset/update gates, then the candidate"""
    luts: List[PreparedLut]
    """LSTM: gate, candidate and cell tables; GRU: gate and candidate tables"""
    numpy_forms: Dict[tuple, Any] = field(default_factory=dict)
    """the steps' numpy forms by their bounds (ops/_recurrent_steps.py)"""


def _q15_plan(node: PyNode, spec: RnnSpec, bits: int, device: torch.device) -> _Q15Plan:
    def build() -> _Q15Plan:
        cs, isz = spec.cell_size, spec.input_size
        w = effective_weights(node)
        b = node.get_constant("biases").betensor.to(torch.int64).reshape(-1)
        _check_bound(node, spec, w, b, bits)
        wx, wh = w[:, :isz].t().contiguous(), w[:, isz:].t().contiguous()
        gm = node.get_constant("gate_scale").betensor.to(torch.int64).reshape(-1)
        gs = node.get_constant("gate_shift").betensor.to(torch.int64).reshape(-1)
        clamp_vals = node.get_param("gate_clamp_value")
        if not isinstance(clamp_vals, list) or len(clamp_vals) != 2:
            raise node._error("gate_clamp_value must list two integers")
        rows = spec.gate_rows
        if gm.numel() != rows or gs.numel() != rows:
            raise node._error(f"gate_scale/gate_shift must hold {rows} values")
        if spec.kind == "LSTM":
            clamp = torch.tensor([clamp_vals[0]] * cs + [clamp_vals[1]] * cs + [clamp_vals[0]] * 2 * cs, device=device)
            return _Q15Plan(wx.to(device), b.to(device), [IntMatmul(wh.to(device))], [_GateIn(gm, gs, clamp)],
                            [_lut(node, key, bits, device) for key in ("lut_gate", "lut_cand", "lut_cell")])
        clamp_g, clamp_c = (torch.tensor([v] * n, device=device)
                            for v, n in ((clamp_vals[0], 2 * cs), (clamp_vals[1], cs)))
        return _Q15Plan(wx.to(device), b.to(device),
                        [IntMatmul(wh[:, :2 * cs].to(device)), IntMatmul(wh[:, 2 * cs:].to(device))],
                        [_GateIn(gm[:2 * cs], gs[:2 * cs], clamp_g), _GateIn(gm[2 * cs:], gs[2 * cs:], clamp_c)],
                        [_lut(node, key, bits, device) for key in ("lut_gate", "lut_cand")])

    return memo(node, "q15_plan", (layer_key(node), str(device)), build)


@dataclass
class _Q15LstmSteps:
    """What the q15 form's LSTM steps need beyond `_Q15Plan`, prepared once per layer and device: each rounding
    shift as a `Requantizer` (the same rounding, half to even; a clamp where the form clamps, elsewhere a range the
    step's bounds prove it never leaves) and the gate and candidate tables stacked over the four gate blocks (one
    lookup a step instead of four)."""

    hidden: Requantizer
    """round(hidden product · hidden_scale / 2^hidden_shift), never beyond `hidden_out`"""
    hidden_bound: int
    """max |hidden product|: |h| <= hq times the hidden weights' largest column sum"""
    hidden_out: int
    gate_luts: Optional[PreparedLut]
    """the i, g, f, o tables over the four blocks (None: the gate and candidate tables differ in size)"""
    gates_in_range: bool
    cell: Requantizer
    """the cell update (f·c·2^15 + i·g·2^cell_frac) / 2^30, clamped to ±cell_clip, on the accumulator taken
    2^k smaller (k = min(15, cell_frac): the same rounding of fewer bits)"""
    cell_shifts: Tuple[int, int]
    """the shifts of f·c and i·g in that accumulator"""
    cell_in: Requantizer
    cell_in_range: bool
    out_h: Requantizer


def _ceil_scaled(bound: int, mult: int, shift: int) -> int:
    """ceil(bound · |mult| / 2^shift) (a left shift for shift < 0): no rounding of a value within `bound` goes
    beyond it."""
    scaled = bound * abs(mult)
    return -(-scaled >> shift) if shift >= 0 else scaled << -shift


def _unclamped(mult: int, shift: int, bound: int, device: torch.device) -> Tuple[Requantizer, int]:
    """round_half_even(v · mult / 2^shift) of values |v| <= `bound` as a `Requantizer` whose range is the bound of
    its results (so it never clamps: `round_shift`'s values), and that bound."""
    out = _ceil_scaled(bound, mult, shift)
    return Requantizer(mult, shift, 0, -out, out, device), out


@dataclass
class _Q15GruSteps:
    """What the q15 form's GRU steps need beyond `_Q15Plan`, prepared once per layer and device: each rounding shift
    as a `Requantizer` given the bound its inputs keep (|h| <= hq, the tables' entries, the weights' column sums),
    the candidate's biases added to its input projection once."""

    gates_hidden: Requantizer
    gates_hidden_bound: int
    gates_hidden_out: int
    reset: Requantizer
    """round(r·hn / 2^15) (linear before reset) or round(r·h / 2^15)"""
    reset_bound: int
    reset_out: int
    cand_hidden: Requantizer
    cand_hidden_bound: int
    cand_hidden_out: int
    out_h: Requantizer
    prod_bound: int
    gates_in_range: bool
    cand_in_range: bool


def _q15_gru_steps(node: PyNode, spec: RnnSpec, bits: int, plan: _Q15Plan, device: torch.device) -> _Q15GruSteps:
    def build() -> _Q15GruSteps:
        cs, hq = spec.cell_size, 2 ** (bits - 1) - 1
        gate_in, cand_in = plan.gate_in
        gates_matmul, cand_matmul = plan.hidden
        lut_gate, lut_cand = plan.luts
        mh, nh = _ip(node, "hidden_scale_value"), _ip(node, "hidden_shift_value")
        hid_frac = _ip(node, "hidden_frac_bits")
        gates_bound = hq * gates_matmul.col_absmax
        gates_hidden, gates_out = _unclamped(mh, nh, gates_bound, device)
        gate_max = lut_gate.absmax
        if spec.linear_before_reset:
            b_reset = values_absmax(plan.b[3 * cs:4 * cs])
            reset_bound = gate_max * (hq * cand_matmul.col_absmax + b_reset)
            reset, reset_out = _unclamped(1, GATE_FRAC_BITS, reset_bound, device)
            cand_bound = reset_out
        else:
            reset_bound = gate_max * hq
            reset, reset_out = _unclamped(1, GATE_FRAC_BITS, reset_bound, device)
            cand_bound = reset_out * cand_matmul.col_absmax
        cand_hidden, cand_out = _unclamped(mh, nh, cand_bound, device)
        align = GATE_FRAC_BITS - hid_frac
        prod_bound = (2 ** GATE_FRAC_BITS + gate_max) * lut_cand.absmax + (gate_max * hq << align)
        return _Q15GruSteps(
            gates_hidden, gates_bound, gates_out, reset, reset_bound, reset_out, cand_hidden, cand_bound, cand_out,
            Requantizer(1, PRODUCT_FRAC_BITS - hid_frac, 0, -hq, hq, device), prod_bound,
            _codes_in_table(lut_gate, gate_in.requant), _codes_in_table(lut_cand, cand_in.requant))

    return memo(node, "q15_gru_steps", (layer_key(node), str(device)), build)


def _q15_lstm_steps(node: PyNode, bits: int, plan: _Q15Plan, device: torch.device) -> _Q15LstmSteps:
    def build() -> _Q15LstmSteps:
        hq = 2 ** (bits - 1) - 1
        (gate_in,), (hidden_matmul,) = plan.gate_in, plan.hidden
        lut_gate, lut_cand, lut_cell = plan.luts
        mh, nh = _ip(node, "hidden_scale_value"), _ip(node, "hidden_shift_value")
        hidden_bound = hq * hidden_matmul.col_absmax
        hidden, hidden_out = _unclamped(mh, nh, hidden_bound, device)
        tables = [node.get_constant(key).betensor.reshape(-1) for key in ("lut_gate", "lut_cand")]
        gate_luts = None
        if tables[0].numel() == tables[1].numel():
            qmax = 2 ** (bits - 1) - 1
            gate_luts = PreparedLut(torch.stack([tables[0], tables[1], tables[0], tables[0]]), -qmax, bits, 16, True,
                                    in_restricted=True, device=device)
        cell_frac = _ip(node, "cell_frac_bits")
        clip = int(node.get_param("cell_clip_value", optional=True, default_value=CELL_INT_MAX))
        k = min(GATE_FRAC_BITS, cell_frac)
        hid_frac = _ip(node, "hidden_frac_bits")
        return _Q15LstmSteps(
            hidden, hidden_bound, hidden_out, gate_luts,
            gate_luts is not None and _codes_in_table(gate_luts, gate_in.requant),
            Requantizer(1, PRODUCT_FRAC_BITS - k, 0, -clip, clip, device), (GATE_FRAC_BITS - k, cell_frac - k),
            Requantizer(_ip(node, "cell_scale_value"), _ip(node, "cell_shift_value"), 0, -hq, hq, device),
            lut_cell.covers(-hq, hq),
            Requantizer(1, PRODUCT_FRAC_BITS - hid_frac, 0, -hq, hq, device))

    return memo(node, "q15_lstm_steps", (layer_key(node), str(device)), build)


def rnn_integer_forward(node: PyNode) -> List[torch.Tensor]:
    """Integer forward of a quantized BasicLSTM / GRUv3 (docs/semantics/recurrent.md), int64 outputs."""
    spec = rnn_spec(node)
    if spec.kind == "LSTM" and "lut_it" in node.constants:
        return lstm_upstream_forward(node, spec)
    if spec.kind == "GRU" and "lut_rt" in node.constants:
        return gru_upstream_forward(node, spec)
    cs = spec.cell_size
    bits = _ip(node, "gate_bits")
    if bits not in (8, 16):
        raise node._error(f"gate_bits must be 8 or 16, got {bits}")
    hq = 2 ** (bits - 1) - 1
    hid_frac = _ip(node, "hidden_frac_bits")
    if not 0 <= hid_frac <= bits - 1:
        raise node._error(f"hidden_frac_bits must lie in [0, {bits - 1}], got {hid_frac}")
    x = int_value(node.inputs[0])
    _check_sequence(node, spec, x)
    batch = x.shape[0]
    plan = _q15_plan(node, spec, bits, x.device)
    wx, b = plan.wx, plan.b
    # initial hidden state to the fixed-point hidden format
    h_in = node.inputs[1]
    h = _initial_state(node, spec, int_value(h_in) + tensor_zp(node, h_in), batch)
    h = torch.clamp(round_shift(h * _ip(node, "init_h_scale_value"), _ip(node, "init_h_shift_value")), -hq, hq)
    xs = torch.flip(x, [1]) if spec.reverse else x
    align = GATE_FRAC_BITS - hid_frac
    products: List[torch.Tensor] = []
    if spec.kind == "LSTM":
        cell_frac = _ip(node, "cell_frac_bits")
        if not 0 <= cell_frac <= CELL_MAX_FRAC_BITS:
            raise node._error(f"cell_frac_bits must lie in [0, {CELL_MAX_FRAC_BITS}], got {cell_frac}")
        c_in = node.inputs[2]
        c = _initial_state(node, spec, int_value(c_in) + tensor_zp(node, c_in), batch)
        c = torch.clamp(round_shift(c * _ip(node, "init_c_scale_value"), _ip(node, "init_c_shift_value")),
                        -CELL_INT_MAX, CELL_INT_MAX)
        steps = _q15_lstm_steps(node, bits, plan, x.device)
        (gate_in,), (hidden_matmul,) = plan.gate_in, plan.hidden
        lut_gate, lut_cand, lut_cell = plan.luts
        x_part = exact_int_matmul(xs, wx) + b  # every step's input projection at once (exact: the same values)
        # the bounds each step's values keep: |h| <= hq, the tables' entries, the clip; the rest looked at once
        acc_bound = values_absmax(x_part) + steps.hidden_out
        gate_max = max(lut_gate.absmax, lut_cand.absmax)
        c_max, (fc_shift, ig_shift) = values_absmax(c), steps.cell_shifts
        gate_lookup = None if steps.gate_luts is None else \
            _CodeLookup(steps.gate_luts, steps.gates_in_range, batch, 4 * cs, x.device)
        cell_lookup = _CodeLookup(lut_cell, steps.cell_in_range, batch, cs, x.device)
        # small CPU steps hold every value of a step in float64 (exact integers: the widest, the cell update, is
        # checked below 2^53 for any state the clip allows), as the upstream forms' do
        c_worst = max(c_max, steps.cell.output_bound(2 ** 62))
        floats = _small_steps(x.device, batch, 4 * cs) and hidden_matmul.w8 is None \
            and gate_lookup is not None and min(fc_shift, ig_shift) >= 0 \
            and (gate_max * c_worst << fc_shift) + (gate_max * gate_max << ig_shift) < FLOAT64_EXACT
        held = torch.float64 if floats else torch.int64
        x_part = x_part.to(held)
        fc_scale, ig_scale = float(2 ** max(fc_shift, 0)), float(2 ** max(ig_shift, 0))
        stepped = q15_lstm_steps(plan, steps, x_part, h, c, hq, acc_bound)  # small CPU steps: numpy
        if stepped is not None:
            return _q15_outputs(node, spec, stepped[0], {"H": stepped[0][:, -1].contiguous(), "C": stepped[1]})
        for t in range(spec.time_steps):
            hw = hidden_matmul(h, hq, as_float64=floats)
            acc = x_part[:, t] + steps.hidden(hw, steps.hidden_bound, as_float64=floats)
            if gate_lookup is not None:
                i, g, f, o = gate_lookup(gate_in, acc, acc_bound, held).chunk(4, dim=1)
            else:
                gin = gate_in(acc, acc_bound)
                i, g = lut_gate(gin[:, :cs]), lut_cand(gin[:, cs:2 * cs])
                f, o = lut_gate(gin[:, 2 * cs:3 * cs]), lut_gate(gin[:, 3 * cs:])
            cell_bound = (gate_max * c_max << fc_shift) + (gate_max * gate_max << ig_shift)
            if floats:
                c = steps.cell(torch.add(f * c * fc_scale, i * g * ig_scale), cell_bound, as_float64=True)
            else:
                c = steps.cell(torch.add(f * c << fc_shift, i * g << ig_shift), cell_bound)
            c_max = steps.cell.output_bound(cell_bound)
            prod = o * cell_lookup(steps.cell_in, c, c_max, held)
            h = steps.out_h(prod, gate_max * lut_cell.absmax, as_float64=floats)
            products.append(prod)
        finals = {"H": products[-1].to(torch.int64), "C": c.to(torch.int64)}
    else:
        gate_in, cand_in = plan.gate_in
        gates_matmul, cand_matmul = plan.hidden
        lut_gate, lut_cand = plan.luts
        steps = _q15_gru_steps(node, spec, bits, plan, x.device)
        # every step's input projections at once (exact: the same values), the candidate's biases added once
        x_gates = exact_int_matmul(xs, wx[:, :2 * cs]) + b[:2 * cs]
        x_cand = exact_int_matmul(xs, wx[:, 2 * cs:]) + b[2 * cs:3 * cs]
        gates_acc_bound = values_absmax(x_gates) + steps.gates_hidden_out
        cand_acc_bound = values_absmax(x_cand) + steps.cand_hidden_out
        gate_lookup = _CodeLookup(lut_gate, steps.gates_in_range, batch, 2 * cs, x.device)
        cand_lookup = _CodeLookup(lut_cand, steps.cand_in_range, batch, cs, x.device)
        # small CPU steps keep the hidden state and the products in float64 (exact integers: every product below
        # 2^53) for the float64 weight products that read them
        floats = _small_steps(x.device, batch, 2 * cs) and gates_matmul.w8 is None \
            and cand_matmul.w8 is None and align >= 0 and steps.prod_bound < FLOAT64_EXACT
        stepped_gru = q15_gru_steps(plan, steps, x_gates, x_cand, h, hq, align, spec.linear_before_reset,
                                    gates_acc_bound, cand_acc_bound)  # small CPU steps: numpy
        if stepped_gru is not None:
            return _q15_outputs(node, spec, stepped_gru, {"Hn": stepped_gru[:, -1].contiguous()})
        for t in range(spec.time_steps):
            hw = gates_matmul(h, hq, as_float64=floats)
            acc = x_gates[:, t] + steps.gates_hidden(hw, steps.gates_hidden_bound)
            rz = gate_lookup(gate_in, acc, gates_acc_bound)
            r, z = rz[:, :cs], rz[:, cs:]
            if spec.linear_before_reset:
                hpart = steps.reset(r * (cand_matmul(h, hq, as_float64=floats) + b[3 * cs:4 * cs]), steps.reset_bound)
            else:
                hpart = cand_matmul(steps.reset(r * h, steps.reset_bound), steps.reset_out)
            acc = x_cand[:, t] + steps.cand_hidden(hpart, steps.cand_hidden_bound)
            n = cand_lookup(cand_in, acc, cand_acc_bound)
            zh = z * h
            prod = (2 ** GATE_FRAC_BITS - z) * n + (zh * float(2 ** align) if floats else zh << align)
            h = steps.out_h(prod, steps.prod_bound, as_float64=floats)
            products.append(prod)
        finals = {"Hn": products[-1].to(torch.int64)}
    return _q15_outputs(node, spec, torch.stack(products, dim=1).to(torch.int64), finals)


def _q15_outputs(node: PyNode, spec: RnnSpec, stacked: torch.Tensor, finals: Dict[str, torch.Tensor]
                 ) -> List[torch.Tensor]:
    """The q15 forms' outputs requantized from their Q30 products: `stacked` every step's [B, T, C] in processing
    order, `finals` the last state(s)."""
    seq_name = "Y" if spec.kind == "LSTM" else "H"
    results = []
    for idx, name in enumerate(spec.out_sequence):
        if name == seq_name:
            v = torch.flip(stacked, [1]) if spec.reverse else stacked
        else:
            v = finals[name]
        results.append(_requant_out(node, idx, v))
    return results


@BASICLSTM.forward
@GRUV1.forward
@GRUV3.forward
def rnn_forward(self: PyNode) -> None:
    """Sequence input [batch, time_steps, input_size], initial state(s) [batch or 1, cell_size]."""
    if self.quantized:
        for t, v in zip(self.outputs, rnn_integer_forward(self)):
            t.betensor = v
        return
    spec = rnn_spec(self)
    if spec.kind == "LSTM":
        _lstm_float_forward(self, spec)
        return
    x = self.inputs[0].betensor.to(torch.float32)
    _check_sequence(self, spec, x)
    h0 = _initial_state(self, spec, self.inputs[1].betensor.to(torch.float32), x.shape[0])
    res = gru_float(self, spec, x, h0)
    for t, name in zip(self.outputs, spec.out_sequence):
        t.betensor = res[name]


def _lstm_float_forward(node: PyNode, spec: RnnSpec) -> None:
    """BasicLSTM's float forward as upstream's: its inputs read in float64 (unrounded where their producer kept a
    float64 value), the cell computed in float64; each output is that result rounded to float32, the float64 value
    kept beside it for the layers that read unrounded values (ops/_shared.py, docs/architecture.md "Float
    reference"). GRUs compute in float32, as upstream's do."""
    x = unrounded_input(node, 0).to(torch.float64)
    _check_sequence(node, spec, x)
    h0 = _initial_state(node, spec, unrounded_input(node, 1).to(torch.float64), x.shape[0])
    c0 = _initial_state(node, spec, unrounded_input(node, 2).to(torch.float64), x.shape[0])
    res = lstm_float(node, spec, x, h0, c0)
    table = wide_values_of(node)
    for t, name in zip(node.outputs, spec.out_sequence):
        t.betensor = res[name].to(torch.float32)
        if table is not None:
            table.keep(t, res[name])



# ------------------------------------------------------------------------------------------------ upstream form
LSTM_TABLE_CLAMP: Dict[int, Dict[str, float]] = {8: {"SIGMOID": 4.564205, "TANH": 2.6293793},
                                                 16: {"SIGMOID": 10.0, "TANH": 6.0}}
"""Upstream form: the largest |input| each BasicLSTM table is quantized for, by activation bits."""

TABLE_ENTRIES_BITS = 8
"""Upstream form: every table has 2^8 entries, whatever `lut_items_in_bits` says."""

LSTM_TABLE_KEYS = (("lut_it", "lut_ft", "lut_ot"), ("lut_ct",), ("lut_h",))
"""Upstream form: the table constants of activations 0, 1, 2 (gates, candidate, cell)."""

INT8_TABLE_INPUT_GAIN = 256
"""Upstream form, 8 bits: the table input scales are 256 times the placeholder scales, 8 bits shifted back."""

SYM = QuantMode.PER_TENSOR_SYMMETRIC_RESTRICTED_RANGE
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def _f32(v) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float32)


def _placeholder(node: PyNode, index: int, name: str) -> Tuple[PyTensor, TensorRange]:
    """Placeholder `index` of the layer with its calibrated range, or an error saying how to get it."""
    full = f"{node.name}/{name}"
    if index >= len(node.placeholders) or node.placeholders[index].name != full:
        raise node._error(f"placeholder '{full}' is missing: the layer's float forward must run before quantization "
                          "(statistic files written before quantopt collected placeholders lack it: collect again)")
    t = node.placeholders[index]
    r = ranges_of(node).get(t)
    if r.min is None or r.max is None:
        raise node._error(f"placeholder '{full}' has no calibrated range (statistic files written before quantopt "
                          "collected placeholders lack it: collect the statistics again)")
    return t, r


def _sym_scale(lo, hi, bits: int) -> float:
    return float(linear_quant_params(lo, hi, bits, SYM, True).scale)


TableClamp = Dict[int, Dict[str, float]]
"""Largest |input| a table is quantized for, by activation bits and activation."""


def _upstream_table(node: PyNode, k: int, act: str, bits: int,
                    clamp: Optional[TableClamp] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input scale, output scale and table of activation `k` from its placeholders (docs/semantics/recurrent.md,
    upstream form): the input range clamped to the table's bound, the table sampled over that range."""
    names = ("f", "g", "h")[k]
    ph_in, r_in = _placeholder(node, 1 + 2 * k, f"{names}_lut_in")
    _, r_out = _placeholder(node, 2 + 2 * k, f"{names}_lut_out")
    bound = (LSTM_TABLE_CLAMP if clamp is None else clamp)[bits][act]
    lo = float(r_in.min) if float(r_in.min) >= -bound else -bound
    hi = float(r_in.max) if float(r_in.max) <= bound else bound
    in_scale = _f32(_sym_scale(lo, hi, bits))
    out_scale = _f32(_sym_scale(r_out.min, r_out.max, bits))
    length = 1
    for d in ph_in.ir_shape:
        length *= int(d)
    sampled = _act(act)(torch.linspace(lo, hi, steps=length))
    table_scale = _sym_scale(float(sampled.min()), float(sampled.max()), bits)
    qmax = 2 ** (bits - 1) - 1
    offset = 0.5 if act == "SIGMOID" else 0.0
    table = build_lut(_act(act), float(in_scale), 0, -qmax, qmax, bits, table_scale, 0, -qmax, qmax,
                      lut_items_in_bits=TABLE_ENTRIES_BITS, mirror_offset=offset)
    if bits == 8:
        in_scale = in_scale * INT8_TABLE_INPUT_GAIN
        table[0] = table[1]
    # the sigmoid's offset is added after the clip: entries can pass the table dtype, which stores them saturated
    return in_scale, out_scale, torch.clamp(table, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def _approx(node: PyNode, ratio: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    m, n, _, _ = scale_shift(ratio, bits, force_shift_positive=bool(layer_settings(node).force_shift_positive))
    return (torch.as_tensor(m, dtype=torch.int64).reshape(-1).cpu(),  # on the CPU, where scale_shift derived them
            torch.as_tensor(n, dtype=torch.int64).reshape(-1).cpu())


def _compress_bits(b: torch.Tensor, effective_bits: int, pre_shift: int) -> torch.Tensor:
    """Upstream form: clear the low bits of one bias block: k = bits the block exceeds `effective_bits` by, at least
    `pre_shift`; b = (b >> k) << k (floor)."""
    lmin, lmax = -(2 ** (effective_bits - 1)), 2 ** (effective_bits - 1) - 1
    bmin = min(int(b.min()), -1)
    bmax = max(int(b.max()), 1)
    k = math.ceil(max(math.log2(bmax / lmax), math.log2(bmin / lmin)))
    k = k if k > pre_shift else pre_shift
    if k <= 0:
        return b << -k if k < 0 else b
    return (b >> k) << k


def _upstream_form(node: PyNode) -> bool:
    """BasicLSTM takes upstream's integer form unless its `lstm_integer_form` is q15."""
    return str(layer_settings(node).lstm_integer_form) == "upstream"


def lstm_upstream_quantize(node: PyNode, spec: RnnSpec) -> None:
    """BasicLSTM in upstream's integer form (docs/semantics/recurrent.md, "BasicLSTM, upstream form")."""
    s = layer_settings(node)
    bits = _gate_bits(node)
    cs, steps = spec.cell_size, spec.time_steps
    x = node.inputs[0]
    for out in node.outputs:
        _quantize_output(node, out, bits)
    in_scales, out_scales = [], []
    for k, act in enumerate(spec.activations):
        in_scale, out_scale, table = _upstream_table(node, k, act, bits)
        for key in LSTM_TABLE_KEYS[k]:
            set_constant(node, key, table, Dtype.INT8 if bits == 8 else Dtype.INT16)
        in_scales.append(in_scale)
        out_scales.append(out_scale)
    (f_in, g_in, h_in), (f_out, g_out, h_out) = in_scales, out_scales
    s_w = _store_weights(node)
    per_channel = "weights_scale" in node.constants
    xw = _f32(tensor_scale(node, x)) * (s_w if per_channel else s_w[:1])
    _, h_all = _placeholder(node, 0, "h_batch")
    h_scale = _f32(_sym_scale(h_all.min, h_all.max, bits))
    hw_m, hw_n = _approx(node, _f32(tensor_scale(node, x)) / h_scale, bits)
    sig_m, sig_n = _approx(node, f_in / xw, bits)
    tanh_m, tanh_n = _approx(node, g_in / xw, bits)
    ct_m, ct_n = _approx(node, h_in / f_out / g_out, bits)
    lut_shift = 0
    if bits == 8:
        sig_n, tanh_n, ct_n = sig_n + 8, tanh_n + 8, ct_n + 8
    else:
        lut_shift = int(torch.cat([hw_n, sig_n, torch.tensor([15])]).min())
    ho_m, ho_n = _approx(node, h_scale / f_out / h_out, bits)
    if per_channel:
        tanh_m, tanh_n = tanh_m[cs:2 * cs], tanh_n[cs:2 * cs]
    scales = [hw_m, sig_m, tanh_m, ct_m, ho_m]
    shifts = [hw_n, sig_n, tanh_n, ct_n, ho_n]
    c_scale = _f32(tensor_scale(node, node.inputs[2]))
    diff_shifts = []
    for t in range(steps):
        _, c_t = _placeholder(node, LSTM_PLACEHOLDERS + t, f"c_state_{t}")
        c_t_scale = _f32(_sym_scale(c_t.min, c_t.max, bits))
        cp_m, cp_n = _approx(node, g_out / c_scale, bits)
        co_m, co_n = _approx(node, c_t_scale / f_out / g_out, bits)
        diff = 0
        if bits == 16 and int(cp_n) < 15:
            diff = min(15 - int(cp_n), int(co_n), int(ct_n))
        diff_shifts.append(diff)
        scales += [cp_m, co_m]
        shifts += [cp_n, co_n]
        c_scale = c_t_scale
    scale = torch.cat(scales)
    shift = torch.cat(shifts)
    shift_dtype = range_dtype(float(shift.min()), float(shift.max()), force_signed=True)
    set_constant(node, "scale", scale, range_dtype(0, float(scale.max())))
    set_constant(node, "shift", shift, shift_dtype)
    set_constant(node, "diff_shifts", torch.tensor(diff_shifts, dtype=torch.int64), shift_dtype)
    node.params["lut_shift_value"] = lut_shift
    node.params["lut_shift_type"] = Dtype.INT8
    # biases at s_x * s_w with the input zero point folded in, then their low bits cleared (per-tensor weights)
    bias_bits = int(s.q_bits_bias)
    lo, hi = integer_range(bias_bits, True)
    b = node.get_constant("biases")
    bf = b.betensor.to(torch.float32).reshape(-1).clone()
    if spec.forget_bias:
        bf[2 * cs:3 * cs] = bf[2 * cs:3 * cs] + _f32(spec.forget_bias)
    bq, bias_scale = bias_quantize(bf, tensor_scale(node, x), s_w, bias_bits)
    _store_bias_scale(node, torch.as_tensor(bias_scale))
    bq = fold_input_zero_point(bq, effective_weights(node)[:, :spec.input_size], tensor_zp(node, x), qmin=lo, qmax=hi)
    if not per_channel:
        pre = 0 if bits == 8 else int(sig_n[0]) - lut_shift
        eff = int(s.effective_bias_bits)
        bi, bg, bfo = bq[:cs], bq[cs:2 * cs], bq[2 * cs:]
        ifo = _compress_bits(torch.cat([bi, bfo]), eff, pre)
        bg = _compress_bits(bg, eff, pre)
        bq = torch.cat([ifo[:cs], bg, ifo[cs:]])
    b.betensor = bq
    b.dtype = Dtype.INT32 if bias_bits <= 32 else Dtype.INT64
    qb = quant_of(node).of(b)
    qb.scale, qb.zerop, qb.qbits = 1.0, 0, bias_bits


def _prepared_lookup(node: PyNode, keys: Sequence[str], bits: int, device: torch.device) -> PreparedLut:
    """The upstream form's lookup in table constant(s) `keys` (signed `bits`-bit codes in and out), prepared for a
    cell's steps; several tables apply to as many equal blocks of the codes' last axis (the gate blocks)."""
    tables = []
    for key in keys:
        table = node.get_constant(key).betensor
        if table.numel() != 2 ** TABLE_ENTRIES_BITS:
            raise node._error(f"constant '{key}' must hold {2 ** TABLE_ENTRIES_BITS} entries, got {table.numel()}")
        tables.append(table.reshape(-1))
    return PreparedLut(tables[0] if len(tables) == 1 else torch.stack(tables), -(2 ** (bits - 1)), bits, bits, True,
                       device=device)


INT32_BOUND = 2 ** 31
"""The largest |value| of an int32-clamped intermediate."""


def _rq(v: torch.Tensor, m, n, lo: int, hi: int) -> torch.Tensor:
    return requantize_int(v, m, n, 0, lo, hi)


def _codes_in_table(lut: PreparedLut, codes: Requantizer) -> bool:
    """Whether every output of the requantization `codes` (within its [qmin, qmax]) is within the table's input
    range: its lookups then need no clamp of the index."""
    _, _, _, qmin, qmax = codes.args
    return lut.covers(int(qmin), int(qmax))


def _small_steps(device: torch.device, rows: int, columns: int) -> bool:
    """Whether a cell's steps are small CPU tensors (at most SMALL_CONVERSION values each), where each kernel call,
    not the arithmetic, decides: they then take the one-call requantizations, table positions and float64 values."""
    return device.type == "cpu" and rows * columns <= SMALL_CONVERSION


class _CodeLookup:
    """A cell's table lookup of the codes a requantization gives, for its steps: where a step is a small CPU tensor
    and the codes provably lie in a direct table (`PreparedLut.direct`, `covers`), the requantization gives table
    positions straight away (its `minus`) and the lookup is one gather instead of three kernel calls; otherwise the
    codes, then their lookup. The same values either way."""

    def __init__(self, lut: PreparedLut, in_range: bool, rows: int, columns: int, device: torch.device) -> None:
        self.lut, self.in_range = lut, in_range
        small = _small_steps(device, rows, columns)
        self.minus = lut.index_offset(columns, device) if small and in_range and lut.direct else None

    def __call__(self, codes: Callable[..., torch.Tensor], acc: torch.Tensor, bound: int,
                 dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """The looked-up values of `codes(acc, bound)` (a `Requantizer` or a `_GateIn`), as `dtype`."""
        if self.minus is not None:
            return self.lut.take_indexed(codes(acc, bound, minus=self.minus), dtype)
        return self.lut(codes(acc, bound), self.in_range).to(dtype)


def _gate_requantizer(pairs: Sequence[Tuple[IntLike, IntLike]], cs: int, qmin: int, qmax: int,
                      device: torch.device) -> Requantizer:
    """One requantization of the four gate blocks side by side ([batch, 4·cs]): each block's multiplier and shift
    (one value or one per row of the block) spread over its columns. Element-wise, so the values of requantizing
    each block with its own pair, in one pass instead of four."""
    def columns(v: IntLike) -> torch.Tensor:
        t = torch.as_tensor(v, dtype=torch.int64).reshape(-1).cpu()
        return t.expand(cs) if t.numel() == 1 else t

    return Requantizer(torch.cat([columns(m) for m, _ in pairs]), torch.cat([columns(n) for _, n in pairs]), 0,
                       qmin, qmax, device)


@dataclass
class _LstmPlan:
    """What the upstream form's LSTM forward derives from the layer alone, prepared once per layer and device
    (graph/memo.py): weights, the requantizations and tables of the steps, the per-step params."""

    bits: int
    wx: IntMatmul
    wh: IntMatmul
    x_requant: Optional[Requantizer]
    """16 bits: the input projection's shift to the gate scale (8 bits: none)"""
    x_bias: torch.Tensor
    """the biases as added to the input projection"""
    hidden: List[Requantizer]
    """the hidden projection's requantization(s), in order"""
    gates: Requantizer
    gate_luts: PreparedLut
    """the i, g, f, o gate tables over the four gate blocks"""
    cell_lut: PreparedLut
    out_h: Requantizer
    steps: List[Tuple[Requantizer, Requantizer, Requantizer, Requantizer]]
    """per step: the requantizations of i·g, f·c, the cell input and the cell state (their shifts move with the
    step's diff_shifts)"""
    numpy_forms: Dict[tuple, Any] = field(default_factory=dict)
    """the steps' numpy forms by their bounds (ops/_recurrent_steps.py)"""


def _lstm_upstream_plan(node: PyNode, spec: RnnSpec, device: torch.device) -> _LstmPlan:
    def build() -> _LstmPlan:
        cs, isz, steps = spec.cell_size, spec.input_size, spec.time_steps
        bits = int(quant_of(node).get(node.outputs[0]).qbits or 0)
        if bits not in (8, 16):
            raise node._error(f"outputs must be 8 or 16 bits, got {bits}")
        qmin, qmax = integer_range(bits, True)
        w = effective_weights(node)
        b = node.get_constant("biases").betensor.to(torch.int64).reshape(-1)
        scale = node.get_constant("scale").betensor.to(torch.int64).reshape(-1)
        shift = node.get_constant("shift").betensor.to(torch.int64).reshape(-1)
        diffs = node.get_constant("diff_shifts").betensor.to(torch.int64).reshape(-1)
        head = [1, 4 * cs, cs, 1, 1] if "weights_scale" in node.constants else [1, 1, 1, 1, 1]
        if scale.numel() != sum(head) + 2 * steps or shift.numel() != scale.numel() or diffs.numel() != steps:
            raise node._error(f"constants scale/shift must hold {sum(head) + 2 * steps} values and diff_shifts "
                              f"{steps}")
        sc, sh = list(torch.split(scale[:sum(head)], head)), list(torch.split(shift[:sum(head)], head))
        step_m, step_n = scale[sum(head):].reshape(steps, 2), shift[sum(head):].reshape(steps, 2)
        gate_m, gate_n = sc[1], sh[1]
        # per row multiplier/shift of the i, f, o blocks (the gate pair) and of the g block (the candidate pair)
        mi, mf, mo = (gate_m if gate_m.numel() == 1 else gate_m[j * cs:(j + 1) * cs] for j in (0, 2, 3))
        ni, nf, no = (gate_n if gate_n.numel() == 1 else gate_n[j * cs:(j + 1) * cs] for j in (0, 2, 3))
        mg, ng = sc[2], sh[2]
        lut_shift = int(node.get_param("lut_shift_value", optional=True, default_value=0))
        if bits == 8:
            x_requant, x_bias = None, b
            hidden = [Requantizer(sc[0], sh[0], 0, INT32_MIN, INT32_MAX, device)]
            gates = _gate_requantizer(((mi, ni), (mg, ng), (mf, nf), (mo, no)), cs, qmin, qmax, device)
        else:
            x_requant = Requantizer(1, gate_n - lut_shift, 0, INT32_MIN, INT32_MAX, device)
            x_bias = _rq(b.unsqueeze(0), 1, gate_n - lut_shift, INT32_MIN, INT32_MAX)
            hidden = [Requantizer(1, sh[0] - lut_shift, 0, INT32_MIN, INT32_MAX, device),
                      Requantizer(sc[0], gate_n, 0, INT32_MIN, INT32_MAX, device)]
            gates = _gate_requantizer(((mi, lut_shift), (mg, ng - ni + lut_shift), (mf, lut_shift),
                                       (mo, lut_shift)), cs, qmin, qmax, device)
        cell_m, cell_n = int(sc[3]), int(sh[3])
        per_step = [(Requantizer(1, d, 0, INT32_MIN, INT32_MAX, device),
                     Requantizer(m[0], n[0] + d, 0, INT32_MIN, INT32_MAX, device),
                     Requantizer(cell_m, cell_n - d, 0, qmin + 1, qmax, device),
                     Requantizer(m[1], n[1] - d, 0, qmin + 1, qmax, device))
                    for m, n, d in zip(step_m.tolist(), step_n.tolist(), diffs.tolist())]
        return _LstmPlan(
            bits, IntMatmul(w[:, :isz].t().contiguous().to(device)), IntMatmul(w[:, isz:].t().contiguous().to(device)),
            x_requant, x_bias.to(device), hidden, gates,
            _prepared_lookup(node, ("lut_it", "lut_ct", "lut_ft", "lut_ot"), bits, device),
            _prepared_lookup(node, ("lut_h",), bits, device), Requantizer(sc[4], sh[4], 0, qmin + 1, qmax, device),
            per_step)

    return memo(node, "lstm_upstream_plan", (layer_key(node), str(device)), build)


def lstm_upstream_forward(node: PyNode, spec: RnnSpec) -> List[torch.Tensor]:
    """Integer forward of a BasicLSTM in upstream's form (docs/semantics/recurrent.md), int64 outputs.

    What does not depend on the recurrent state (the input projection, its requantization, the biases) is computed
    for every step at once, and the layer's requantizations and tables come prepared (`_lstm_upstream_plan`):
    exact integer and element-wise arithmetic, so the values of computing each step alone. Each requantization is
    given the bound its input's ranges prove (clamps, table entries, weight sums; the initial states and the input
    projection looked at once), so no step looks at its values for it."""
    x = int_value(node.inputs[0])
    _check_sequence(node, spec, x)
    plan = _lstm_upstream_plan(node, spec, x.device)
    batch = x.shape[0]
    h = _initial_state(node, spec, int_value(node.inputs[1]), batch)
    c = _initial_state(node, spec, int_value(node.inputs[2]), batch)
    xs = torch.flip(x, [1]) if spec.reverse else x
    x_part = plan.wx(xs)
    x_part = x_part + plan.x_bias if plan.x_requant is None else plan.x_requant(x_part) + plan.x_bias
    qmin, qmax = integer_range(plan.bits, True)
    state_max = max(-(qmin + 1), qmax)  # h and c after a step: requantized into [qmin + 1, qmax]
    h_max, c_max = values_absmax(h), values_absmax(c)
    acc_max = values_absmax(x_part) + INT32_BOUND if plan.bits == 8 else INT32_BOUND  # 16 bits: clamped to int32
    # small CPU steps: numpy (their per-step forms are made for a states' bound of the whole code range, so that
    # new initial states within it make none again)
    stepped = lstm_steps(plan, x_part, h, c, max(h_max, c_max, -qmin), acc_max)
    if stepped is not None:
        y, c_last = stepped
        finals = {"Y": torch.flip(y, [1]) if spec.reverse else y, "H": y[:, -1].contiguous(), "C": c_last}
        return [finals[name] for name in spec.out_sequence]
    gate_max = plan.gate_luts.absmax
    gates_in_range = _codes_in_table(plan.gate_luts, plan.gates)
    cell_in_range = all(_codes_in_table(plan.cell_lut, step[2]) for step in plan.steps)
    cs = spec.cell_size
    # small steps on the CPU (each kernel call, not the arithmetic, decides): the gate and cell codes come out of
    # their requantizations as table positions (one kernel call per lookup instead of three), and every value of
    # a step is held in float64 (exact integers, all below 2^53: the int32 clamps, the tables' entries and their
    # products), so no kernel converts or mixes types; the outputs are converted to int64 once, after the steps
    gate_lookup = _CodeLookup(plan.gate_luts, gates_in_range, batch, 4 * cs, x.device)
    cell_lookup = _CodeLookup(plan.cell_lut, cell_in_range, batch, cs, x.device)
    floats = _small_steps(x.device, batch, 4 * cs) and plan.wh.w8 is None
    held = torch.float64 if floats else torch.int64
    x_part = x_part.to(held)
    hs, cs_seq = [], []
    for t in range(spec.time_steps):
        bound = h_max * plan.wh.col_absmax
        hw = plan.wh(h, h_max, as_float64=floats)
        for rq in plan.hidden:
            hw, bound = rq(hw, bound, as_float64=floats), INT32_BOUND
        acc = x_part[:, t] + hw
        if plan.bits > 8:
            acc = torch.clamp(acc, INT32_MIN, INT32_MAX)
        i, g, f, o = gate_lookup(plan.gates, acc, acc_max, held).chunk(4, dim=1)
        rq_ig, rq_fc, rq_cell_in, rq_c = plan.steps[t]
        c_tmp = rq_ig(i * g, gate_max * gate_max, as_float64=floats) + \
            rq_fc(f * c, gate_max * c_max, as_float64=floats)
        c_bound = rq_ig.output_bound(gate_max * gate_max) + rq_fc.output_bound(gate_max * c_max)
        if c_bound > INT32_MAX:
            c_tmp, c_bound = torch.clamp(c_tmp, INT32_MIN, INT32_MAX), INT32_BOUND
        h = plan.out_h(o * cell_lookup(rq_cell_in, c_tmp, c_bound, held), gate_max * plan.cell_lut.absmax,
                       as_float64=floats)
        c = rq_c(c_tmp, c_bound, as_float64=floats)
        h_max = c_max = state_max
        hs.append(h)
        cs_seq.append(c)
    y = torch.stack(hs, dim=1).to(torch.int64)
    finals = {"Y": torch.flip(y, [1]) if spec.reverse else y, "H": y[:, -1].contiguous(),
              "C": cs_seq[-1].to(torch.int64)}
    return [finals[name] for name in spec.out_sequence]


GRU_TABLE_CLAMP: Dict[str, TableClamp] = {
    "GRUv1": {8: {"SIGMOID": 4.564202, "TANH": 2.629377}, 16: {"SIGMOID": 10.0, "TANH": 6.0}},
    "GRUv3": {8: {"SIGMOID": 4.8, "TANH": 2.8}, 16: {"SIGMOID": 10.0, "TANH": 6.0}},
}
"""Upstream form: the largest |input| each GRU table is quantized for, by layer type and activation bits."""

GRU_TABLE_KEYS = (("lut_rt", "lut_zt"), ("lut_ht",))
"""Upstream form: the table constants of activations 0 (reset and update gates) and 1 (candidate)."""

GRU_REMAIN_SHIFT = 10
"""Upstream form, 16 bits: the shift kept for the multiplier step when `remain_shift` is absent."""

GRU_BIAS_REMAIN_SHIFT = 15
"""Upstream form, 16 bits: the `remain_shift` default of the bias low-bit clearing (another default than above)."""


def _gru_upstream_form(node: PyNode) -> bool:
    """GRUv1/GRUv3 take upstream's integer form unless its `gru_integer_form` is q15."""
    return str(layer_settings(node).gru_integer_form) == "upstream"


def _gru_blocks(spec: RnnSpec) -> List[Tuple[slice, slice]]:
    """(rows, columns) of the four weight blocks upstream quantizes apart: x and h parts of the gates, then of the
    candidate."""
    cs, isz = spec.cell_size, spec.input_size
    gates, cand = slice(0, 2 * cs), slice(2 * cs, 3 * cs)
    xs, hs = slice(0, isz), slice(isz, isz + cs)
    return [(gates, xs), (gates, hs), (cand, xs), (cand, hs)]


def _gru_block_weights(node: PyNode, spec: RnnSpec) -> Tuple[List[torch.Tensor], bool]:
    """Quantize each weight block with its own scale (per tensor: one per block; per channel: one per row of each
    block) and write `weights_scale`/`weights_zp` as upstream does (the four blocks' values, in block order).
    Returns each block's scale (float32, [1] or [rows]) and whether the weights are per channel."""
    s = layer_settings(node)
    mode = QuantMode.from_name(s.q_mode_weight)
    if mode.is_per_block:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): per-block weights are not supported by the "
                               "upstream GRU form", field="quantize_method_for_weight", layer=node.name)
    bits = int(s.q_bits_weight)
    w = node.get_constant("weights")
    wf = w.betensor.to(torch.float32)
    wq = torch.zeros(wf.shape, dtype=torch.int64, device=wf.device)
    scales, zps = [], []
    for rows, cols in _gru_blocks(spec):
        block = wf[rows, cols]
        if mode.is_per_channel:
            lo, hi = torch.aminmax(block, dim=1)
            p = linear_quant_params(lo, hi, bits, mode, True)
        else:
            p = linear_quant_params(block.min(), block.max(), bits, mode, True)
        wq[rows, cols] = quantize(block, p.scale, p.zerop, p.qmin, p.qmax,
                                  axis=0 if mode.is_per_channel else None)
        scales.append(_f32(p.scale).reshape(-1))
        zps.append(torch.as_tensor(p.zerop, dtype=torch.int64).reshape(-1))
        qmin, qmax = p.qmin, p.qmax
    w.betensor = wq
    qw = set_params(node, w, linear_quant_params(wf.min(), wf.max(), bits, mode.to_per_tensor(), True), bits)
    qw.qmin, qw.qmax = qmin, qmax
    set_constant(node, "weights_scale", torch.cat(scales), Dtype.FP32)
    set_constant(node, "weights_zp", torch.cat(zps), Dtype.INT32)
    return scales, mode.is_per_channel


def _gru_effective_weights(node: PyNode, spec: RnnSpec) -> torch.Tensor:
    """w_q + zp of the upstream form, int64 [3C, I+C]: `weights_zp` holds one zero point per block (per-tensor
    weights) or per row of each block (per-channel weights)."""
    w = node.get_constant("weights").betensor.to(torch.int64).clone()
    zp = node.get_constant("weights_zp").betensor.to(device=w.device, dtype=torch.int64).reshape(-1) \
        if "weights_zp" in node.constants else torch.zeros(4, dtype=torch.int64, device=w.device)
    blocks = _gru_blocks(spec)
    sizes = [r.stop - r.start for r, _ in blocks]
    if zp.numel() not in (4, sum(sizes)):
        raise node._error(f"constant 'weights_zp' must hold 4 or {sum(sizes)} values (one per weight block or per "
                          f"row of each block), got {zp.numel()}")
    per_row = zp.numel() != 4
    start = 0
    for k, (rows, cols) in enumerate(blocks):
        z = zp[start:start + sizes[k]].reshape(-1, 1) if per_row else zp[k]
        start += sizes[k]
        w[rows, cols] = w[rows, cols] + z
    return w


def gru_upstream_quantize(node: PyNode, spec: RnnSpec) -> None:
    """GRUv1/GRUv3 in upstream's integer form (docs/semantics/recurrent.md, "GRU, upstream form")."""
    s = layer_settings(node)
    bits = _gate_bits(node)
    cs = spec.cell_size
    x = node.inputs[0]
    for out in node.outputs:
        _quantize_output(node, out, bits)
    clamp = GRU_TABLE_CLAMP["GRUv1" if str(node.type) == "GRUv1" else "GRUv3"]
    (f_in, f_out, rz_table), (g_in, g_out, c_table) = (
        _upstream_table(node, k, act, bits, clamp) for k, act in enumerate(spec.activations))
    for key, table in (("lut_rt", rz_table), ("lut_zt", rz_table), ("lut_ht", c_table)):
        set_constant(node, key, table, Dtype.INT8 if bits == 8 else Dtype.INT16)
    _, h_all = _placeholder(node, 0, "state_batch")
    h_scale = _f32(_sym_scale(h_all.min, h_all.max, bits))
    (sx_gk, sh_gk, sx_ck, sh_ck), per_channel = _gru_block_weights(node, spec)
    s_x = _f32(tensor_scale(node, x))
    gb_scale = s_x * sx_gk
    cb_scale = s_x * sx_ck
    bias_bits = int(s.q_bits_bias)
    lo, hi = integer_range(bias_bits, True)
    b = node.get_constant("biases")
    bf = b.betensor.to(torch.float32).reshape(-1)
    gates_q, _ = bias_quantize(bf[:2 * cs], 1.0, gb_scale, bias_bits)
    cand_q, _ = bias_quantize(bf[2 * cs:3 * cs], 1.0, cb_scale, bias_bits)
    parts = [gates_q, cand_q]
    p = node.params
    if spec.linear_before_reset:
        factor = 1.0
        _, ph = _placeholder(node, 5, "hidden_gate_out")
        hidden_out_scale = _f32(_sym_scale(ph.min, ph.max, bits))
        hm, hn, hm_type, hn_type = scale_shift(hidden_out_scale / (h_scale * sh_ck), bits,
                                               force_shift_positive=bool(s.force_shift_positive))
        if per_channel:
            set_constant(node, "hidden_scale", torch.as_tensor(hm, dtype=torch.int64), hm_type)
            set_constant(node, "hidden_shift", torch.as_tensor(hn, dtype=torch.int64), hn_type)
        else:
            p["hidden_shift_value"], p["hidden_shift_type"] = int(hn), hn_type
            p["hidden_scale_value"], p["hidden_scale_type"] = int(hm), hm_type
        hidden_q, _ = bias_quantize(bf[3 * cs:], 1.0, h_scale * sh_ck, bias_bits)
        parts.append(hidden_q)
        # upstream divides by the hidden multiplier itself (an integer), not by the hidden gate's scale
        hwc_scale = _f32(torch.as_tensor(hm, dtype=torch.float32)) * f_out
    else:
        factor = float(2 ** bits)
        hwc_scale = h_scale * f_out * sh_ck
    hwg_m, hwg_n = _approx(node, gb_scale / (h_scale * sh_gk), bits)
    sig_m, sig_n = _approx(node, f_in / gb_scale, bits)
    hwc_m, hwc_n = _approx(node, factor * cb_scale / hwc_scale, bits)
    tanh_m, tanh_n = _approx(node, g_in / cb_scale, bits)
    if bits == 8:
        sig_n, tanh_n = sig_n + 8, tanh_n + 8
    c1mu_m, c1mu_n = _approx(node, h_scale / g_out, bits)
    hm1_m, hm1_n = _approx(node, 1.0 / f_out, bits)
    scale = torch.cat([hwg_m, sig_m, hwc_m, tanh_m, c1mu_m, hm1_m])
    shift = torch.cat([hwg_n, sig_n, hwc_n, tanh_n, c1mu_n, hm1_n])
    scale_dtype = range_dtype(0, float(scale.max()))
    shift_dtype = range_dtype(float(shift.min()), float(shift.max()), force_signed=True)
    if per_channel:
        set_constant(node, "scale", scale, scale_dtype)
        set_constant(node, "shift", shift, shift_dtype)
    else:
        p["shift_value"], p["shift_type"] = [int(v) for v in shift], [shift_dtype] * 6
        p["scale_value"], p["scale_type"] = [int(v) for v in scale], [scale_dtype] * 6
    if s.remain_shift is not None:
        p["remain_shift"] = int(s.remain_shift)
    bq = torch.cat(parts)
    gate_rows = 3 * cs
    bq[:gate_rows] = fold_input_zero_point(bq[:gate_rows], _gru_effective_weights(node, spec)[:, :spec.input_size],
                                           tensor_zp(node, x), qmin=lo, qmax=hi)
    bq = torch.clamp(bq, lo, hi)
    if not per_channel:
        pre = [0, 0, 0]
        if bits > 8:
            rem = int(s.remain_shift) if s.remain_shift is not None else GRU_BIAS_REMAIN_SHIFT
            pre = [max(int(sig_n[0]) - rem, 0), max(int(tanh_n[0]) - rem, 0), max(int(hwc_n[0]) - rem, 0)]
        eff = int(s.effective_bias_bits)
        pieces = [bq[:2 * cs], bq[2 * cs:3 * cs]] + ([bq[3 * cs:]] if spec.linear_before_reset else [])
        bq = torch.cat([_compress_bits(piece, eff, pre[k]) for k, piece in enumerate(pieces)])
    b.betensor = bq
    b.dtype = Dtype.INT32 if bias_bits <= 32 else Dtype.INT64
    qb = quant_of(node).of(b)
    qb.scale, qb.zerop, qb.qbits = 1.0, 0, bias_bits
    bias_scale = torch.cat([gb_scale.reshape(-1), cb_scale.reshape(-1)])
    set_constant(node, "biases_scale", bias_scale, Dtype.FP32)
    set_constant(node, "biases_zp", torch.zeros(bias_scale.numel()), Dtype.FP32)


def _gru_requant_pairs(node: PyNode, spec: RnnSpec) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The six multiplier/shift pairs of the upstream form (per channel: the first four per row)."""
    cs = spec.cell_size
    if "scale" in node.constants:
        scale = node.get_constant("scale").betensor.to(torch.int64).reshape(-1)
        shift = node.get_constant("shift").betensor.to(torch.int64).reshape(-1)
        sizes = [2 * cs, 2 * cs, cs, cs, 1, 1]
        if scale.numel() != sum(sizes) or shift.numel() != sum(sizes):
            raise node._error(f"constants scale/shift must hold {sum(sizes)} values")
        return list(torch.split(scale, sizes)), list(torch.split(shift, sizes))
    m, n = node.get_param("scale_value"), node.get_param("shift_value")
    if not isinstance(m, list) or not isinstance(n, list) or len(m) != 6 or len(n) != 6:
        raise node._error("scale_value/shift_value must list six integers")
    return [torch.tensor([int(v)]) for v in m], [torch.tensor([int(v)]) for v in n]


def _gru_hidden_pair(node: PyNode) -> Tuple[torch.Tensor, torch.Tensor]:
    if "hidden_scale" in node.constants:
        return (node.get_constant("hidden_scale").betensor.to(torch.int64).reshape(-1),
                node.get_constant("hidden_shift").betensor.to(torch.int64).reshape(-1))
    return torch.tensor([_ip(node, "hidden_scale_value")]), torch.tensor([_ip(node, "hidden_shift_value")])


@dataclass
class _GruPlan:
    """What the upstream form's GRU forward derives from the layer alone, prepared once per layer and device
    (graph/memo.py): weights, biases, the requantizations and tables of the steps."""

    bits: int
    wx_g: IntMatmul
    wh_g: IntMatmul
    wx_c: IntMatmul
    wh_c: IntMatmul
    bg: torch.Tensor
    bc: torch.Tensor
    bh: torch.Tensor
    x_requant: Optional[Tuple[Requantizer, Requantizer]]
    """16 bits: the input projections' shifts (gates, candidate); 8 bits: none"""
    hg: List[Requantizer]
    z: Requantizer
    hc: List[Requantizer]
    z2: Requantizer
    cu: Requantizer
    h: Requantizer
    hidden: Optional[Requantizer]
    """linear_before_reset: the hidden candidate's requantization"""
    lut_rz: PreparedLut
    lut_c: PreparedLut
    numpy_forms: Dict[tuple, Any] = field(default_factory=dict)
    """the steps' numpy forms by their bounds (ops/_recurrent_steps.py)"""


def _gru_upstream_plan(node: PyNode, spec: RnnSpec, device: torch.device) -> _GruPlan:
    def build() -> _GruPlan:
        cs, isz = spec.cell_size, spec.input_size
        bits = int(quant_of(node).get(node.outputs[0]).qbits or 0)
        if bits not in (8, 16):
            raise node._error(f"outputs must be 8 or 16 bits, got {bits}")
        qmin, qmax = integer_range(bits, True)
        w = _gru_effective_weights(node, spec)
        b = node.get_constant("biases").betensor.to(torch.int64).reshape(-1)
        bg, bc, bh = b[:2 * cs], b[2 * cs:3 * cs], b[3 * cs:]
        m, n = _gru_requant_pairs(node, spec)
        hm, hn = _gru_hidden_pair(node) if spec.linear_before_reset else (None, None)
        x_requant: Optional[Tuple[Requantizer, Requantizer]] = None

        def rq(mult: IntLike, shift: IntLike, lo: int = INT32_MIN, hi: int = INT32_MAX) -> Requantizer:
            return Requantizer(mult, shift, 0, lo, hi, device)

        if bits > 8:
            # 16 bits: each product is first shifted by what its shift exceeds remain_shift by (the biases with it,
            # once), the multiplier step keeps the rest
            rem = int(node.get_param("remain_shift", optional=True, default_value=GRU_REMAIN_SHIFT))
            zero = torch.zeros(1, dtype=torch.int64, device=n[0].device)
            pre_rz_h, pre_rz_x = torch.maximum(n[0] - rem, zero), torch.maximum(n[1] - rem, zero)
            pre_c_h, pre_c_x = torch.maximum(n[2] - rem, zero), torch.maximum(n[3] - rem, zero)
            post_rz_h, post_rz = torch.minimum(n[0], zero + rem) + pre_rz_x, torch.minimum(n[1], zero + rem)
            post_c_h, post_c = torch.minimum(n[2], zero + rem) + pre_c_x, torch.minimum(n[3], zero + rem)
            bg = _rq(bg, 1, pre_rz_x, INT32_MIN, INT32_MAX)
            bc = _rq(bc, 1, pre_c_x, INT32_MIN, INT32_MAX)
            if spec.linear_before_reset:
                bh = _rq(bh, 1, pre_c_h, INT32_MIN, INT32_MAX)
            x_requant = (rq(1, pre_rz_x), rq(1, pre_c_x))
            hg, z = [rq(1, pre_rz_h), rq(m[0], post_rz_h)], rq(m[1], post_rz, qmin, qmax)
            hc, z2 = [rq(1, pre_c_h), rq(m[2], post_c_h)], rq(m[3], post_c, qmin, qmax)
        else:
            hg, z = [rq(m[0], n[0])], rq(m[1], n[1], qmin, qmax)
            hc, z2 = [rq(m[2], n[2])], rq(m[3], n[3], qmin, qmax)
        return _GruPlan(
            bits, *(IntMatmul(part.t().contiguous().to(device)) for part in (w[:2 * cs, :isz], w[:2 * cs, isz:],
                                                                              w[2 * cs:, :isz], w[2 * cs:, isz:])),
            bg.to(device), bc.to(device), bh.to(device), x_requant, hg, z, hc, z2, rq(m[4], n[4]),
            rq(m[5], n[5], qmin + 1, qmax), rq(hm, hn, qmin, qmax) if spec.linear_before_reset else None,
            _prepared_lookup(node, ("lut_rt",), bits, device), _prepared_lookup(node, ("lut_ht",), bits, device))

    return memo(node, "gru_upstream_plan", (layer_key(node), str(device)), build)


def gru_upstream_forward(node: PyNode, spec: RnnSpec) -> List[torch.Tensor]:
    """Integer forward of a GRUv1/GRUv3 in upstream's form (docs/semantics/recurrent.md), int64 outputs.

    The input projections of every step are computed at once and the layer's requantizations and tables come
    prepared (`_gru_upstream_plan`): exact integer and element-wise arithmetic, the values of step by step. Each
    requantization is given the bound its input's ranges prove (as in `lstm_upstream_forward`)."""
    cs = spec.cell_size
    x = int_value(node.inputs[0])
    _check_sequence(node, spec, x)
    plan = _gru_upstream_plan(node, spec, x.device)
    qmin, qmax = integer_range(plan.bits, True)
    h = _initial_state(node, spec, int_value(node.inputs[1]), x.shape[0])
    xs = torch.flip(x, [1]) if spec.reverse else x
    xg_all, xc_all = plan.wx_g(xs), plan.wx_c(xs)
    if plan.x_requant is not None:
        xg_all, xc_all = plan.x_requant[0](xg_all), plan.x_requant[1](xc_all)
    h_max, state_max = values_absmax(h), max(-(qmin + 1), qmax)  # h after a step: in [qmin + 1, qmax]
    z_max = values_absmax(xg_all) + INT32_BOUND + values_absmax(plan.bg)
    z2_max = values_absmax(xc_all) + INT32_BOUND + values_absmax(plan.bc)
    bh_max, rz_max, c_max = values_absmax(plan.bh), plan.lut_rz.absmax, plan.lut_c.absmax
    stepped = gru_steps(plan, xg_all, xc_all, h, max(h_max, -qmin), z_max, z2_max)  # small CPU steps (as the LSTM's)
    if stepped is not None:
        finals = {"H": torch.flip(stepped, [1]) if spec.reverse else stepped, "Hn": stepped[:, -1].contiguous()}
        return [finals[name] for name in spec.out_sequence]
    rz_in_range, c_in_range = _codes_in_table(plan.lut_rz, plan.z), _codes_in_table(plan.lut_c, plan.z2)
    rz_lookup = _CodeLookup(plan.lut_rz, rz_in_range, int(x.shape[0]), 2 * cs, x.device)
    c_lookup = _CodeLookup(plan.lut_c, c_in_range, int(x.shape[0]), cs, x.device)
    # small CPU steps hold every value of a step in float64 (exact integers, all below 2^53: the int32 clamps,
    # the tables' entries and their products), as the LSTM's do: no kernel converts or mixes types
    floats = _small_steps(x.device, int(x.shape[0]), 2 * cs) \
        and plan.wh_g.w8 is None and plan.wh_c.w8 is None
    held = torch.float64 if floats else torch.int64
    xg_all, xc_all, bg, bc, bh = (v.to(held) for v in (xg_all, xc_all, plan.bg, plan.bc, plan.bh))
    hs = []
    for t in range(spec.time_steps):
        bound = h_max * plan.wh_g.col_absmax
        hg = plan.wh_g(h, h_max, as_float64=floats)
        for rq in plan.hg:
            hg, bound = rq(hg, bound, as_float64=floats), INT32_BOUND
        rz = rz_lookup(plan.z, xg_all[:, t] + hg + bg, z_max, held)
        r, u = rz[:, :cs], rz[:, cs:]
        if plan.hidden is not None:
            hc = r * plan.hidden(plan.wh_c(h, h_max, as_float64=floats) + bh, h_max * plan.wh_c.col_absmax + bh_max,
                                 as_float64=floats)
            bound = rz_max * max(-qmin, qmax)
        else:
            hc = plan.wh_c(_round_div((r * h).to(torch.int64), 2 ** plan.bits))
            bound = ((rz_max * h_max >> plan.bits) + 1) * plan.wh_c.col_absmax
        for rq in plan.hc:
            hc, bound = rq(hc, bound, as_float64=floats), INT32_BOUND
        c = c_lookup(plan.z2, xc_all[:, t] + hc + bc, z2_max, held)
        cu = plan.cu((qmax - u) * c, (qmax + rz_max) * c_max, as_float64=floats)
        h = plan.h(cu + u * h, INT32_BOUND + rz_max * h_max, as_float64=floats)
        h_max = state_max
        hs.append(h)
    y = torch.stack(hs, dim=1).to(torch.int64)
    finals = {"H": torch.flip(y, [1]) if spec.reverse else y, "Hn": y[:, -1].contiguous()}
    return [finals[name] for name in spec.out_sequence]


def _round_div(v: torch.Tensor, d: int) -> torch.Tensor:
    """round(v / d) half to even, exact in int64 (d a power of two)."""
    return round_shift(v, int(math.log2(d)))


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
def _int_param(node: PyNode, key: str) -> int:
    return int(node.get_param(key))


@dataclass
class _Cell:
    """What both cells read from the quantized layer."""

    spec: RnnSpec
    op: CellOps
    bits: int
    hq: int
    hid_frac: int
    weights: np.ndarray       # [rows, I + C], w + zp_w, float64
    biases: np.ndarray        # int64
    gate_mult: np.ndarray     # gate_scale per row
    gate_shift: np.ndarray
    gate_clamp: List[int]
    hidden_mult: int
    hidden_shift: int
    x: str                    # the input integers (the zero point is in the biases), float64 [N, T, I]


def _exact_mode_only(g: QDQGraph, node: PyNode) -> None:
    """Recurrent cells have an integer QDQ form only: refused, naming the layer, in the float scale modes."""
    if not g.unit_domain:
        raise node_error(node, "recurrent layers are exported in the exact mode only (--scales exact)")


def _cell(g: QDQGraph, node: PyNode, states: int) -> _Cell:
    _exact_mode_only(g, node)
    spec = rnn_spec(node)
    x_t = node.inputs[0]
    for t in node.inputs[1:1 + states]:
        rows = int(np.prod(t.ir_shape)) // spec.cell_size
        if rows not in (1, int(x_t.ir_shape[0])):
            raise node_error(node, f"initial state '{t.name}' has {rows} rows for a batch of {x_t.ir_shape[0]}")
    op = CellOps(g, node)
    bits = _int_param(node, "gate_bits")

    def ints(key: str) -> np.ndarray:
        return node.get_constant(key).betensor.cpu().to(torch.int64).reshape(-1).numpy()

    x = g.add("Sub", [codes(g, x_t), op.f64(float(tensor_zp(node, x_t)))])
    return _Cell(spec, op, bits, 2 ** (bits - 1) - 1, _int_param(node, "hidden_frac_bits"),
                 effective_weights(node).cpu().numpy().astype(np.float64), ints("biases"), ints("gate_scale"),
                 ints("gate_shift"), list(node.get_param("gate_clamp_value")),
                 _int_param(node, "hidden_scale_value"), _int_param(node, "hidden_shift_value"), x)


def _onnx_initial_state(g: QDQGraph, node: PyNode, cell: _Cell, t: PyTensor, key: str, bound: int) -> str:
    """clamp(rs((state + zp) · init_<key>_scale_value, init_<key>_shift_value), ±bound) as int64 rows of C."""
    rows = g.add("Reshape", [codes(g, t), cell.op.i64([-1, cell.spec.cell_size])])
    ratio = _int_param(node, f"init_{key}_scale_value") * 2.0 ** -_int_param(node, f"init_{key}_shift_value")
    rounded = g.add("Round", [g.add("Mul", [rows, cell.op.f64(ratio)])])
    return cell.op.clamp(g.add("Cast", [rounded], to=INT64), bound)


def _rq_args(rq: Requantizer) -> Tuple[Any, Any, int, int, int]:
    """(multiplier, shift: an int or an int64 array per column; zero point, qmin, qmax) of a step's requantization."""
    def values(v: IntLike) -> Any:
        a = torch.as_tensor(v, dtype=torch.int64).cpu().reshape(-1).numpy()
        return int(a[0]) if a.size == 1 else a

    m, n, zp, lo, hi = rq.args
    return values(m), values(n), int(zp), int(lo), int(hi)


def _onnx_rq(op: CellOps, value: str, rq: Requantizer) -> str:
    return op.requant(value, *_rq_args(rq))


def _onnx_code_table(op: CellOps, lut: PreparedLut, bits: int, columns: int) -> Tuple[str, Any]:
    """(every code's looked-up value as one flat int64 constant, block after block; what to add to codes of
    `columns` columns for their position in it): the upstream forms' direct or interpolated tables as one Gather."""
    qmin = -(2 ** (bits - 1))
    codes_all = torch.arange(qmin, -qmin, dtype=torch.int64)
    values = lut(codes_all[:, None].expand(-1, lut.blocks).contiguous())  # [2^bits, blocks]: block k in column k
    starts = np.arange(lut.blocks, dtype=np.int64) * (2 ** bits) - qmin
    offsets = np.repeat(starts, columns // lut.blocks) if lut.blocks > 1 else int(starts[0])
    return op.i64(values.t().reshape(-1).numpy()), offsets


def _onnx_state_rows(g: QDQGraph, op: CellOps, node: PyNode, spec: RnnSpec, t: PyTensor) -> str:
    """An initial state's integers as int64 rows of C (one row, or one per sequence of the batch)."""
    rows = int(np.prod(t.ir_shape)) // spec.cell_size
    if rows not in (1, int(node.inputs[0].ir_shape[0])):
        raise node_error(node, f"initial state '{t.name}' has {rows} rows for a batch of {node.inputs[0].ir_shape[0]}")
    value = g.add("Sub", [codes(g, t), op.f64(float(tensor_zp(node, t)))])
    return g.add("Cast", [g.add("Reshape", [value, op.i64([-1, spec.cell_size])])], to=INT64)


def _onnx_upstream_outputs(g: QDQGraph, node: PyNode, op: CellOps, spec: RnnSpec, states: List[str],
                           finals: Dict[str, str], sequence: str) -> None:
    """The upstream forms' outputs: the states' integers themselves (no output requantization), the sequence
    stacked in input time order."""
    for name, out in zip(spec.out_sequence, node.outputs):
        if name == sequence:
            seq = list(reversed(states)) if spec.reverse else states
            value = g.add("Concat", [g.add("Unsqueeze", [s, op.i64([1])]) for s in seq], axis=1)
        else:
            value = finals[name]
        zp = tensor_zp(node, out)
        value = g.add("Cast", [g.add("Add", [value, op.i64(zp)]) if zp else value], to=FLOAT)
        shape = [0] + [int(d) for d in out.ir_shape[1:]] if g.dynamic_batch else [int(d) for d in out.ir_shape]
        g.quantize(out, g.add("Reshape", [value, op.i64(shape)]), unit=True)


def _convert_lstm_upstream(g: QDQGraph, node: PyNode) -> None:
    """BasicLSTM in upstream's integer form (`lstm_upstream_forward`), unrolled over the time steps: the same
    prepared plan, every requantization a rounding division in int64, the gate and cell tables as Gathers over
    every code."""
    _exact_mode_only(g, node)
    spec = rnn_spec(node)
    plan = _lstm_upstream_plan(node, spec, torch.device("cpu"))
    op = CellOps(g, node)
    cs = spec.cell_size
    x = g.add("Sub", [codes(g, node.inputs[0]), op.f64(float(tensor_zp(node, node.inputs[0])))])
    x_part = op.matmul(x, plan.wx.w.cpu().numpy().astype(np.float64))
    if plan.x_requant is not None:
        x_part = _onnx_rq(op, x_part, plan.x_requant)
    x_part = g.add("Add", [x_part, op.i64(plan.x_bias.cpu().numpy())])
    h = _onnx_state_rows(g, op, node, spec, node.inputs[1])
    c = _onnx_state_rows(g, op, node, spec, node.inputs[2])
    wh = plan.wh.w.cpu().numpy().astype(np.float64)
    gate_table, gate_offsets = _onnx_code_table(op, plan.gate_luts, plan.bits, 4 * cs)
    cell_table, cell_offsets = _onnx_code_table(op, plan.cell_lut, plan.bits, cs)
    states: List[str] = []
    order = reversed(range(spec.time_steps)) if spec.reverse else range(spec.time_steps)
    for (rq_ig, rq_fc, rq_cell_in, rq_c), t in zip(plan.steps, order):
        hw = op.matmul(g.add("Cast", [h], to=DOUBLE), wh)
        for rq in plan.hidden:
            hw = _onnx_rq(op, hw, rq)
        acc = g.add("Add", [g.add("Gather", [x_part, op.i64(t)], axis=1), hw])
        if plan.bits > 8:
            acc = op.requant(acc, 1, 0, 0, INT32_MIN, INT32_MAX)
        gates = op.look_codes(gate_table, _onnx_rq(op, acc, plan.gates), gate_offsets)
        i, gg, f, o = (op.columns(gates, k * cs, (k + 1) * cs) for k in range(4))
        c_tmp = g.add("Add", [_onnx_rq(op, g.add("Mul", [i, gg]), rq_ig), _onnx_rq(op, g.add("Mul", [f, c]), rq_fc)])
        c_tmp = op.requant(c_tmp, 1, 0, 0, INT32_MIN, INT32_MAX)
        cell = op.look_codes(cell_table, _onnx_rq(op, c_tmp, rq_cell_in), cell_offsets)
        h = _onnx_rq(op, g.add("Mul", [o, cell]), plan.out_h)
        c = _onnx_rq(op, c_tmp, rq_c)
        states.append(h)
    _onnx_upstream_outputs(g, node, op, spec, states, {"H": states[-1], "C": c}, "Y")


def _convert_gru_upstream(g: QDQGraph, node: PyNode) -> None:
    """GRUv1/GRUv3 in upstream's integer form (`gru_upstream_forward`), unrolled over the time steps as the
    BasicLSTM's (`_convert_lstm_upstream`)."""
    _exact_mode_only(g, node)
    spec = rnn_spec(node)
    plan = _gru_upstream_plan(node, spec, torch.device("cpu"))
    op = CellOps(g, node)
    cs = spec.cell_size
    qmax = integer_range(plan.bits, True)[1]

    def weights(m: IntMatmul) -> np.ndarray:
        return m.w.cpu().numpy().astype(np.float64)

    x = g.add("Sub", [codes(g, node.inputs[0]), op.f64(float(tensor_zp(node, node.inputs[0])))])
    xg_all, xc_all = op.matmul(x, weights(plan.wx_g)), op.matmul(x, weights(plan.wx_c))
    if plan.x_requant is not None:
        xg_all, xc_all = _onnx_rq(op, xg_all, plan.x_requant[0]), _onnx_rq(op, xc_all, plan.x_requant[1])
    xg_all = g.add("Add", [xg_all, op.i64(plan.bg.cpu().numpy())])
    xc_all = g.add("Add", [xc_all, op.i64(plan.bc.cpu().numpy())])
    h = _onnx_state_rows(g, op, node, spec, node.inputs[1])
    wh_g, wh_c = weights(plan.wh_g), weights(plan.wh_c)
    bh = op.i64(plan.bh.cpu().numpy()) if plan.hidden is not None else None
    rz_table, rz_offsets = _onnx_code_table(op, plan.lut_rz, plan.bits, 2 * cs)
    c_table, c_offsets = _onnx_code_table(op, plan.lut_c, plan.bits, cs)
    states: List[str] = []
    for t in (reversed(range(spec.time_steps)) if spec.reverse else range(spec.time_steps)):
        hd = g.add("Cast", [h], to=DOUBLE)
        hg = op.matmul(hd, wh_g)
        for rq in plan.hg:
            hg = _onnx_rq(op, hg, rq)
        acc = g.add("Add", [g.add("Gather", [xg_all, op.i64(t)], axis=1), hg])
        rz = op.look_codes(rz_table, _onnx_rq(op, acc, plan.z), rz_offsets)
        r, u = op.columns(rz, 0, cs), op.columns(rz, cs, 2 * cs)
        if plan.hidden is not None and bh is not None:
            hc = g.add("Mul", [r, _onnx_rq(op, g.add("Add", [op.matmul(hd, wh_c), bh]), plan.hidden)])
        else:
            reset = op.rshift(g.add("Mul", [r, h]), plan.bits)
            hc = op.matmul(g.add("Cast", [reset], to=DOUBLE), wh_c)
        for rq in plan.hc:
            hc = _onnx_rq(op, hc, rq)
        acc = g.add("Add", [g.add("Gather", [xc_all, op.i64(t)], axis=1), hc])
        cand = op.look_codes(c_table, _onnx_rq(op, acc, plan.z2), c_offsets)
        cu = _onnx_rq(op, g.add("Mul", [g.add("Sub", [op.i64(qmax), u]), cand]), plan.cu)
        h = _onnx_rq(op, g.add("Add", [cu, g.add("Mul", [u, h])]), plan.h)
        states.append(h)
    _onnx_upstream_outputs(g, node, op, spec, states, {"Hn": states[-1]}, "H")


@BASICLSTM.export
def convert_lstm(g: QDQGraph, node: PyNode) -> None:
    if "lut_it" in node.constants:
        _convert_lstm_upstream(g, node)
        return
    cell = _cell(g, node, states=2)
    spec, op, bits, hq, hid_frac, w = cell.spec, cell.op, cell.bits, cell.hq, cell.hid_frac, cell.weights
    cs, isz, steps = spec.cell_size, spec.input_size, spec.time_steps
    cell_frac = _int_param(node, "cell_frac_bits")
    gm, gs, mh, nh, x = cell.gate_mult, cell.gate_shift, cell.hidden_mult, cell.hidden_shift, cell.x
    clamp_vals = cell.gate_clamp
    clamp_rows = np.array([clamp_vals[0]] * cs + [clamp_vals[1]] * cs + [clamp_vals[0]] * 2 * cs, dtype=np.int64)
    mc, nc = _int_param(node, "cell_scale_value"), _int_param(node, "cell_shift_value")
    clip = int(node.get_param("cell_clip_value", optional=True, default_value=CELL_INT_MAX))
    h = g.add("Cast", [_onnx_initial_state(g, node, cell, node.inputs[1], "h", hq)], to=DOUBLE)
    c = _onnx_initial_state(g, node, cell, node.inputs[2], "c", CELL_INT_MAX)
    bias = op.i64(cell.biases)
    gate_table, cand_table, cell_table = (op.table(k, bits) for k in ("lut_gate", "lut_cand", "lut_cell"))
    products: List[str] = []
    for t in (reversed(range(steps)) if spec.reverse else range(steps)):
        xt = g.add("Gather", [x, op.i64(t)], axis=1)
        hidden = op.rshift(g.add("Mul", [op.matmul(h, w[:, isz:].T), op.i64(mh)]), nh)
        acc = g.add("Add", [g.add("Add", [op.matmul(xt, w[:, :isz].T), bias]), hidden])
        gin = op.gates(acc, gm, gs, clamp_rows)
        i, gg, f, o = (op.look(table, op.columns(gin, k * cs, (k + 1) * cs), hq)
                       for k, table in enumerate((gate_table, cand_table, gate_table, gate_table)))
        update = g.add("Add", [g.add("Mul", [g.add("Mul", [f, c]), op.i64(1 << GATE_FRAC_BITS)]),
                               g.add("Mul", [g.add("Mul", [i, gg]), op.i64(1 << cell_frac)])])
        c = op.clamp(op.rshift(update, PRODUCT_FRAC_BITS), clip)
        cin = op.clamp(op.rshift(g.add("Mul", [c, op.i64(mc)]), nc), hq)
        prod = g.add("Mul", [o, op.look(cell_table, cin, hq)])
        h = g.add("Cast", [op.clamp(op.rshift(prod, PRODUCT_FRAC_BITS - hid_frac), hq)], to=DOUBLE)
        products.append(prod)
    _write_outputs(g, node, op, spec, products, {"H": products[-1], "C": c}, "Y")


def _write_outputs(g: QDQGraph, node: PyNode, op: CellOps, spec: RnnSpec, products: List[str], finals: Dict[str, str],
                   sequence: str) -> None:
    """Every output requantized from its Q30 product (the sequence stacked in input time order) or final state:
    rs(v · M, N) in float64 (v · M below 2^47), then QuantizeLinear with scale 1."""
    m_out, s_out = node.get_param("out_scale_value"), node.get_param("out_shift_value")
    for idx, (name, out) in enumerate(zip(spec.out_sequence, node.outputs)):
        if name == sequence:
            seq = list(reversed(products)) if spec.reverse else products
            value = g.add("Concat", [g.add("Unsqueeze", [p, op.i64([1])]) for p in seq], axis=1)
        else:
            value = finals[name]
        scaled = g.add("Mul", [g.add("Cast", [value], to=DOUBLE), op.f64(int(m_out[idx]) * 2.0 ** -int(s_out[idx]))])
        rounded = g.add("Cast", [g.add("Round", [scaled])], to=FLOAT)
        shape = [0] + [int(d) for d in out.ir_shape[1:]] if g.dynamic_batch else [int(d) for d in out.ir_shape]
        g.quantize(out, g.add("Reshape", [rounded, op.i64(shape)]), unit=True)


@GRUV1.export
@GRUV3.export
def convert_gru(g: QDQGraph, node: PyNode) -> None:
    """GRUv3 (GRUV3: reset before the hidden MatMul; GRUV1: after it), quantopt's integer cell unrolled."""
    if "lut_rt" in node.constants:
        _convert_gru_upstream(g, node)
        return
    cell = _cell(g, node, states=1)
    spec, op, bits, hq, hid_frac, w = cell.spec, cell.op, cell.bits, cell.hq, cell.hid_frac, cell.weights
    cs, isz, steps = spec.cell_size, spec.input_size, spec.time_steps
    gm, gs, mh, nh, x, b = cell.gate_mult, cell.gate_shift, cell.hidden_mult, cell.hidden_shift, cell.x, cell.biases
    clamp_vals = cell.gate_clamp
    wx, wh = w[:, :isz].T, w[:, isz:].T  # [I, 3C], [C, 3C]
    h = _onnx_initial_state(g, node, cell, node.inputs[1], "h", hq)
    gate_table, cand_table = op.table("lut_gate", bits), op.table("lut_cand", bits)
    one = op.i64(1 << GATE_FRAC_BITS)
    products: List[str] = []
    for t in (reversed(range(steps)) if spec.reverse else range(steps)):
        xt = g.add("Gather", [x, op.i64(t)], axis=1)
        hd = g.add("Cast", [h], to=DOUBLE)
        hidden = op.rshift(g.add("Mul", [op.matmul(hd, wh[:, :2 * cs]), op.i64(mh)]), nh)
        acc = g.add("Add", [g.add("Add", [op.matmul(xt, wx[:, :2 * cs]), op.i64(b[:2 * cs])]), hidden])
        rz = op.look(gate_table, op.gates(acc, gm[:2 * cs], gs[:2 * cs], np.int64(clamp_vals[0])), hq)
        r, z = op.columns(rz, 0, cs), op.columns(rz, cs, 2 * cs)
        if spec.linear_before_reset:
            hn = g.add("Add", [op.matmul(hd, wh[:, 2 * cs:]), op.i64(b[3 * cs:4 * cs])])
            hpart = op.rshift(g.add("Mul", [r, hn]), GATE_FRAC_BITS)
        else:
            reset = g.add("Cast", [op.rshift(g.add("Mul", [r, h]), GATE_FRAC_BITS)], to=DOUBLE)
            hpart = op.matmul(reset, wh[:, 2 * cs:])
        acc = g.add("Add", [g.add("Add", [op.matmul(xt, wx[:, 2 * cs:]), op.i64(b[2 * cs:3 * cs])]),
                            op.rshift(g.add("Mul", [hpart, op.i64(mh)]), nh)])
        n = op.look(cand_table, op.gates(acc, gm[2 * cs:], gs[2 * cs:], np.int64(clamp_vals[1])), hq)
        prod = g.add("Add", [g.add("Mul", [g.add("Sub", [one, z]), n]),
                             g.add("Mul", [g.add("Mul", [z, h]), op.i64(1 << (GATE_FRAC_BITS - hid_frac))])])
        h = op.clamp(op.rshift(prod, PRODUCT_FRAC_BITS - hid_frac), hq)
        products.append(prod)
    _write_outputs(g, node, op, spec, products, {"Hn": products[-1]}, "H")
