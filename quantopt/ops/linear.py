"""FullyConnected and MatMul: float forward, quantization and exact integer forward."""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..graph.memo import Same, memo
from ..graph.node import PyNode
from ..quant.dtype import Dtype
from ..quant.requant import INT32_MAX, INT32_MIN, requantize_float_in_bands
from ..quant.rounding import FLOAT64_EXACT, below_float64_exact, round_shift
from ..registry import declare_op
from ..registry.schema import Bool, Float, Int, Param, Value, quantized
from ..threads import one_thread
from . import _fp8
from ._eltwise_int import offset_absmax
from ._fc_order import OrderedWeights, linear_float32
from ._int8_gemm import INT8_MAX_TERMS, int8_accumulate, int8_gemm, int8_gemm_used, split_int8
from ._quant import (
    FLOAT32_EXACT,
    check_fused_activation_quantizable,
    check_quantized_inputs,
    fused_activation_clamp,
    fused_output_signed,
    int_value,
    integer_output_bits,
    is_signed,
    layer_settings,
    mac_bound,
    mac_finish,
    mac_input,
    mac_weights,
    mac_weights_int8,
    out_range,
    params,
    quant_of,
    quantize_activation,
    quantize_mac,
    requant_of,
    requant_scale_shift,
    set_qinvariant,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import (
    FUSED_ACTIVATION_CONSTANTS,
    FUSED_ACTIVATION_PARAMS,
    MAC_QUANTIZED_PARAMS,
    apply_fused_activation,
    bool_param,
    float_biases,
)
from .onnx_build import exact as onnx_exact
from .onnx_build.mac import (
    bias_value,
    fully_connected_double,
    integer_kernel,
    mac_weight_value,
    qdq_fused_activation,
    quantize_mac_output,
    weight_onnx_scale,
)
from .onnx_build.perms import operand_perm
from .onnx_build.qdq_graph import QDQGraph, node_error, requant_ratio

MAC_FLOAT_DTYPE = torch.float64
"""Accumulation type of the float FullyConnected forward for inputs other than float32 (the result is rounded back
to the input's float type)."""
FLOAT32_FC_ORDER = "upstream"
"""How the float forward sums a float32 FullyConnected: "upstream", in upstream's fixed float32 order (_fc_order.py),
or "torch", with torch's own float32 kernel, whose order follows the machine (a diagnostic switch for
benchmarks/golden_ranges.py)."""
SATURATED = 2 ** 40
"""Any |value| beyond this saturates every output range (qmin/qmax/zp are at most 32-bit), so it may be capped."""


_UPSTREAM_SCALES = {f"scale{i}": quantized(Value(), "written by some upstream versions; not read") for i in (1, 2, 3)}
_REQUANT_CONSTANTS = {"scale": "per-channel requantization multipliers (quantized)",
                      "shift": "per-channel requantization shifts (quantized)"}


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.float32


# ------------------------------------------------------------------------------------------------ FullyConnected
FULLY_CONNECTED = declare_op(
    "FullyConnected",
    params={"num_output": Param(Int(lo=0), "output features; must match the weights"),
            **FUSED_ACTIVATION_PARAMS,
            **MAC_QUANTIZED_PARAMS,
            **_UPSTREAM_SCALES},
    constants={"weights": "[O,I]", "biases": "[O], absent means zero", **_REQUANT_CONSTANTS,
               **FUSED_ACTIVATION_CONSTANTS},
    integer="int32/int48 MAC accumulation + multiplier and shift",
    semantics="integer-semantics.md#convolution-depthwiseconv-fullyconnected")


@FULLY_CONNECTED.forward
def fully_connected_forward(self: PyNode) -> None:
    """y = x @ W^T + b over the last axis; weights [out, in], biases [out] (absent means zero)."""
    if _fp8.fp8_layer(self):  # fp8 activations (quant_type w*afp8*, ops/_fp8.py)
        _fp8.mac_forward(self, lambda x, w, b: _checked_linear(self, x, w, b))
        return
    if self.quantized:
        x, _ = mac_input(self)
        _check_fc_shapes(self, x, self.get_constant("weights").betensor)
        # zero point folded into the biases: acc = x_q·w + b_q' (no padding in a dense layer); the weights in a
        # float dtype are made (and kept) only where the int8 GEMMs do not apply
        bounded = _fc_int8(self, x)
        if bounded is None:
            w, dtype = mac_weights(self)
            bounded = F.linear(x.to(dtype), w).to(torch.float64), mac_bound(self)
        acc, bound = bounded
        self.outputs[0].betensor = mac_finish(self, acc, owned=True, bound=bound)  # acc: a new tensor either way
        return
    x = self.inputs[0].betensor
    dtype = _compute_dtype(x)
    weights = self.get_constant("weights").betensor
    biases = self.get_constant("biases", optional=True)
    # float32 inputs are summed in upstream's fixed float32 order (cfg fc_float_summation = upstream); otherwise,
    # and for gradient-based calibration that differentiates through the layer, the float64 sum rounded once
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad
                                              or (biases is not None and biases.betensor.requires_grad))
    # (a several-row sample beyond GEMM_ORDER_MAX_MACS: torch's float32 GEMM one sample at a time, as upstream)
    group_rows = _sample_rows(self, int(weights.shape[0]), _rows_of(x))
    settings = layer_settings(self)
    native = settings.float_reference == "native"  # torch's GEMM in the input's float type
    upstream_order = (dtype == torch.float32 and settings.fc_float_summation == "upstream" and not needs_grad
                      and not native)
    acc = dtype if native else torch.float32 if upstream_order else MAC_FLOAT_DTYPE
    w, b = _float_constants(self, x.device, acc, needs_grad)
    _check_fc_shapes(self, x, w)
    x = x.to(acc)
    if native:  # the BLAS GEMM on one thread: its bits then do not depend on the thread count
        with one_thread():
            y = F.linear(x, w, b)
    elif not upstream_order:
        y = F.linear(x, w, b).to(dtype)
    elif FLOAT32_FC_ORDER != "upstream":
        y = F.linear(x, w, b)
    elif group_rows is None:
        y = linear_per_sample(x, w, b, _ir_sample_rows(self))
    else:
        y = linear_float32(x, w, b, _ordered_weights(self, weights), group_rows=group_rows)
    self.outputs[0].betensor = apply_fused_activation(self, y)


def _fc_int8(node: PyNode, x: torch.Tensor) -> Optional[Tuple[torch.Tensor, int]]:
    """x_q · (w_q + zp_w) by int8 GEMMs with int32 sums (one, two for 16-bit inputs), as float64 (the integer
    forward's accumulator), with a bound on its magnitude (max |x| · max sum |w| over the outputs), or None where
    that is not exact or possible: the conditions of `conv._conv_int8`."""
    k = int(x.shape[-1]) if x.dim() else 0
    if x.device.type != "cpu" or not k or k > INT8_MAX_TERMS or not int8_gemm_used():
        return None
    weights = mac_weights_int8(node)
    operand = split_int8(x) if weights is not None else None
    if weights is None or operand is None:
        return None
    w8, w_sums, w_abs_rows = weights
    acc = int8_accumulate(operand, w_sums, lambda part, _: int8_gemm(part.reshape(-1, k), w8.t()))
    return acc.reshape(*x.shape[:-1], int(w8.shape[0])), operand.absmax * w_abs_rows


def _float_constants(node: PyNode, device: torch.device, dtype: torch.dtype,
                     needs_grad: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weights, biases or None) as `dtype` on `device`, memoized per layer while the weight and bias tensors are the
    same objects at the same version (graph/memo.py): converting a large weight matrix to float64 on every forward
    costs as much as a tenth of its GEMM. Not kept for a forward that autograd differentiates."""
    wt = node.get_constant("weights")
    bt = node.get_constant("biases", optional=True)

    def build() -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        w = wt.betensor.to(device=device, dtype=dtype)
        return w, float_biases(node, int(w.shape[0]), w)

    if needs_grad:
        return build()
    key = (Same(wt.betensor), None if bt is None else Same(bt.betensor), str(device), dtype)
    return memo(node, "fc_float_constants", key, build)


GEMM_ORDER_MAX_MACS = 1 << 20
"""Largest sample of several rows (rows x inputs x outputs multiply-adds) summed in the emulated order of MKL's
several-row kernels; larger ones take torch's float32 GEMM one sample at a time (`linear_per_sample`;
docs/golden-differences.md, "Upstream's float forward")."""


def _sample_rows(node: PyNode, n_out: int, given: int) -> Optional[int]:
    """Rows of one IR sample of the layer's input when its fixed float32 order is emulated (ops/_fc_order.py), else
    None: upstream calibrates one sample at a time, so its GEMM sums these rows together, whatever batch quantopt
    runs. The several-row order emulates a fused multiply-add per product, 20-30x the cost of a BLAS kernel even in
    cache-sized tiles, so a sample of several rows beyond GEMM_ORDER_MAX_MACS multiply-adds gets None and runs
    through torch's own float32 GEMM per sample (`linear_per_sample`). One row is always summed in upstream's one-row
    order. An input whose `given` rows are not a whole number of IR samples (a batch smaller than an IR batch of
    several, with `modify_batch_dim`) is one sample of all its rows, as `linear_per_sample` takes it."""
    rows = _ir_sample_rows(node)
    if given % rows:
        rows = given
    if rows == 1:
        return 1
    k = int(node.inputs[0].ir_shape[-1]) if node.inputs[0].ir_shape else 1
    return rows if rows * k * n_out <= GEMM_ORDER_MAX_MACS else None


def _ir_sample_rows(node: PyNode) -> int:
    """Rows of one IR sample of the layer's input (all axes but the last of its IR shape)."""
    shape = [int(d) for d in node.inputs[0].ir_shape]
    return max(1, int(np.prod(shape[:-1], dtype=np.int64))) if len(shape) >= 2 else 1


def _rows_of(x: torch.Tensor) -> int:
    """Rows of `x` as the layer multiplies it (all axes but the last)."""
    return int(x.numel() // int(x.shape[-1])) if x.dim() and int(x.shape[-1]) else 0


def linear_per_sample(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], rows: int) -> torch.Tensor:
    """y = x @ w.T + b in float32 with torch's kernel, one GEMM per sample of `rows` rows on one thread: what
    upstream's float32 GEMM computes for a batch of one on the same machine. A large GEMM's float32 order is the
    BLAS library's and no cheaper emulation of it exists (GEMM_ORDER_MAX_MACS), but on one thread that order does
    not depend on the number of rows beyond one sample, while on several threads a GEMM of few rows and many inputs
    may split its sums between threads (docs/golden-differences.md, "Upstream's float forward"). Unlike the fixed
    orders of _fc_order.py, the bits follow the machine's BLAS, as upstream's own do."""
    lead = tuple(x.shape[:-1])
    flat = x.reshape(-1, int(x.shape[-1]))
    total = int(flat.shape[0])
    if total == 0 or total % rows:
        rows = max(total, 1)  # a shape other than the IR's (a dynamic dimension): the whole input is one sample
    with one_thread():
        parts = [F.linear(flat[i:i + rows], w, b) for i in range(0, max(total, 1), rows)]
    y = torch.cat(parts) if len(parts) != 1 else parts[0]
    return y.reshape(*lead, int(w.shape[0]))


def _ordered_weights(node: PyNode, t: torch.Tensor) -> OrderedWeights:
    """The layer's weights in the fixed order's layout, kept while the weight tensor is the same and unmodified
    (a global method that rewrites the weights in place bumps the tensor's version)."""
    cached = node.attrs.get("_fc_order_weights")
    if cached is not None and cached[0] is t and cached[1] == t._version:
        return cached[2]
    prepared = OrderedWeights(t)
    node.attrs["_fc_order_weights"] = (t, t._version, prepared)
    return prepared


@FULLY_CONNECTED.quantize
def fully_connected_quantize(self: PyNode) -> None:
    per_channel = layer_settings(self).q_mode_weight.startswith("per_channel")
    if not _fp8.quantize_mac(self, per_channel=per_channel):
        quantize_mac(self, per_channel=per_channel)


def _checked_linear(self: PyNode, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    _check_fc_shapes(self, x, w)
    return F.linear(x, w, b)


def _check_fc_shapes(self: PyNode, x: torch.Tensor, w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise self._error(f"weights must be 2-D [out, in], got shape {list(w.shape)}")
    out_f, in_f = int(w.shape[0]), int(w.shape[1])
    if x.dim() < 1 or int(x.shape[-1]) != in_f:
        raise self._error(f"input shape {list(x.shape)} does not end in the {in_f} input features of weights "
                          f"{list(w.shape)}")
    num_output = self.get_param("num_output", optional=True, default_value=out_f)
    if isinstance(num_output, bool) or num_output != out_f:
        raise self._error(f"parameter num_output={num_output} does not match weights shape {list(w.shape)}")


# ------------------------------------------------------------------------------------------------ MatMul
MATMUL = declare_op(
    "MatMul",
    params={"trans_a": Param(Bool(), "swap the last two axes of the first input", default=False),
            "trans_b": Param(Bool(), "swap the last two axes of the second input", default=False),
            **FUSED_ACTIVATION_PARAMS,
            "fused_multiplier": Param(Float(), "a folded constant factor of the output (passes/merge_matmul_mul.py); "
                                               "quantization moves it into the multiplier"),
            "remain_shift": quantized(Int(), "shift applied before the 32-bit hand-over of wide accumulators"),
            **_UPSTREAM_SCALES},
    constants=_REQUANT_CONSTANTS,
    integer="exact product of (a + zp_a)(b + zp_b) sums + multiplier and shift",
    semantics="integer-semantics.md#matmul",
    summary="Two activation inputs.")


def _maybe_transpose(node: PyNode, t: torch.Tensor, key: str) -> torch.Tensor:
    if not bool_param(node, key, False):
        return t
    if t.dim() < 2:
        raise node._error(f"{key}=true needs an operand of rank >= 2, got shape {list(t.shape)}")
    return t.transpose(-1, -2)


def _matmul_operands(node: PyNode, a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return _maybe_transpose(node, a, "trans_a"), _maybe_transpose(node, b, "trans_b")


def _matmul(node: PyNode, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    try:
        return torch.matmul(a, b)
    except RuntimeError as e:
        raise node._error(f"operand shapes {list(a.shape)} and {list(b.shape)} (after trans_a/trans_b) "
                          f"cannot be multiplied: {e}") from None


@MATMUL.forward
def matmul_forward(self: PyNode) -> None:
    """Batched matmul of two activations with torch.matmul broadcasting; trans_a/trans_b swap the last two axes."""
    if len(self.inputs) != 2:
        raise self._error(f"MatMul needs exactly 2 inputs, got {len(self.inputs)}")
    if _fp8.fp8_layer(self):  # fp8 activations (quant_type w*afp8*, ops/_fp8.py)
        _fp8.matmul_forward(self, lambda a, b: _matmul(self, *_matmul_operands(self, a, b)))
        return
    if self.quantized:
        self.outputs[0].betensor = _matmul_int(self)
        return
    a, b = self.inputs[0].betensor, self.inputs[1].betensor
    dtype = torch.promote_types(_compute_dtype(a), _compute_dtype(b))
    a, b = _matmul_operands(self, a.to(dtype), b.to(dtype))
    y = apply_fused_activation(self, _matmul(self, a, b))
    factor = self.params.get("fused_multiplier")
    if factor is not None:  # a folded constant factor (passes/merge_matmul_mul.py): one rounding, as the Mul did
        y = y * torch.tensor(float(factor), dtype=y.dtype)
    self.outputs[0].betensor = y


def _matmul_acc(node: PyNode) -> Tuple[torch.Tensor, int]:
    """(acc = (a_q + zp_a) @ (b_q + zp_b) exactly, a bound on |acc| from the ranges): float32 or float64 when the
    bound K·max|a|·max|b| proves every partial sum exact there (then a float tensor of integers), otherwise an
    int64 matmul on the CPU."""
    ta, tb = node.inputs
    a, b = _matmul_operands(node, int_value(ta), int_value(tb))
    k = int(a.shape[-1]) if a.dim() else 1
    bound = k * offset_absmax(node, ta) * offset_absmax(node, tb)
    if bound < FLOAT64_EXACT:
        dtype = torch.float32 if bound < FLOAT32_EXACT else torch.float64
        return _matmul(node, _plus_zero_point(a, tensor_zp(node, ta), dtype),
                       _plus_zero_point(b, tensor_zp(node, tb), dtype)), bound
    device = a.device
    a, b = a.cpu() + tensor_zp(node, ta), b.cpu() + tensor_zp(node, tb)
    return _matmul(node, a, b).to(device), bound


def _plus_zero_point(t: torch.Tensor, zp: int, dtype: torch.dtype) -> torch.Tensor:
    """t + zp in `dtype` (exact: |t + zp| is below the caller's bound), the sum in place on the converted copy."""
    x = t.to(dtype)
    if not zp:
        return x
    return x.add_(zp) if x is not t else x + zp


def requantize_exact(acc: torch.Tensor, mult: int, shift: int) -> torch.Tensor:
    """Exact round_half_even(acc · M · 2^-shift) for an int64 accumulator and a per-tensor (M, shift), int64.

    Magnitudes beyond 2^40 saturate any output range and are capped first. For shift > 0, acc = hi·2^s + lo
    (0 <= lo < 2^s) gives acc·M·2^-s = hi·M + lo·M·2^-s, so only lo·M (< 2^(s+16)) is rounded; the tie goes to
    the even total. For shift <= 0 the product is scaled by 2^-shift in float64, which is exact.
    """
    if 0 < shift < 63 and below_float64_exact(acc, mult):
        # acc · M · 2^-shift is exact in float64 below 2^53, and torch.round rounds half to even
        return torch.round(acc.to(torch.float64) * (int(mult) * 2.0 ** -shift)).to(torch.int64)
    if shift <= 0:
        t = torch.clamp(acc, -SATURATED, SATURATED) * int(mult)
        t = torch.clamp(t, -SATURATED, SATURATED).to(torch.float64) * 2.0 ** (-shift)
        return torch.clamp(t, -SATURATED, SATURATED).to(torch.int64)
    if shift + 42 < 63:
        acc = torch.clamp(acc, -(1 << (shift + 41)), 1 << (shift + 41))
    hi = acc >> shift
    lo = acc - (hi << shift)
    r = lo * int(mult)
    q2 = r >> shift
    rem = r - (q2 << shift)
    base = hi * int(mult) + q2
    half = 1 << (shift - 1)
    return base + ((rem > half) | ((rem == half) & (base % 2 == 1))).to(torch.int64)


def _wide_matmul(node: PyNode) -> bool:
    table = quant_of(node)
    return any((table.get(t).qbits or 8) > 8 for t in node.inputs)


def _matmul_int(node: PyNode) -> torch.Tensor:
    """acc = (a+zp_a)@(b+zp_b); optional remain_shift hand-over (pre-shift by shift - remain_shift with
    round-half-even, clip to int32); y = clamp(round_half_even(acc·M·2^-shift) - zp_out, qmin, qmax); then the
    fused RELU6/CLIP bounds."""
    out = node.outputs[0]
    mult, shift = requant_of(node)
    if isinstance(mult, torch.Tensor):
        raise node._error("a quantized MatMul has a per-tensor scale_value/shift_value, not per-channel constants")
    acc, bound = _matmul_acc(node)
    remain: Optional[int] = node.params.get("remain_shift")
    handover = remain is not None and _wide_matmul(node)
    qmin, qmax = out_range(node, out)
    if acc.is_floating_point() and not handover and 0 < shift < 63 and bound * abs(int(mult)) < FLOAT64_EXACT:
        # round_half_even(acc·M·2^-shift) in float64: M·2^-shift is exact, and so is its product with acc (below
        # 2^53 over M); the int64 accumulator and its conversions were most of a small MatMul's time. In place, by
        # the addition of 1.5·2^52 where every shift is at least 3 (no rounding pass, no conversion of the result)
        y = requantize_float_in_bands(acc, int(mult), shift, tensor_zp(node, out), qmin, qmax)
        return fused_activation_clamp(node, y)
    acc = acc.to(torch.int64)
    if handover:
        assert remain is not None
        if shift > int(remain):
            acc = torch.clamp(round_shift(acc, shift - int(remain)), INT32_MIN, INT32_MAX)
            shift = int(remain)
        else:
            acc = torch.clamp(acc, INT32_MIN, INT32_MAX)
    y = torch.clamp(requantize_exact(acc, mult, shift) - tensor_zp(node, out), qmin, qmax)
    return fused_activation_clamp(node, y)


@MATMUL.quantize
def matmul_quantize(self: PyNode) -> None:
    """Output params from the calibrated output range, signed iff an input is signed and no RELU-like fused
    activation makes it non-negative; requant ratio s_out / (s_a · s_b) as scale_value/shift_value.
    Two integer (qinvariant) inputs give an integer output (scale 1, zp 0, multiplier 1, shift 0). A folded factor
    (`fused_multiplier`, passes/merge_matmul_mul.py) multiplies s_out in float32 first and leaves the IR: the output
    already holds the scaled value, so the multiplier carries it."""
    check_fused_activation_quantizable(self)
    if len(self.inputs) != 2:
        raise self._error(f"MatMul needs exactly 2 inputs, got {len(self.inputs)}")
    check_quantized_inputs(self, self.inputs)
    if _fp8.quantize_matmul(self):  # fp8 activations (quant_type w*afp8*, ops/_fp8.py)
        return
    ta, tb = self.inputs
    out = self.outputs[0]
    signed = (is_signed(self, ta) or is_signed(self, tb)) and fused_output_signed(self)
    s = layer_settings(self)
    factor = self.params.pop("fused_multiplier", None)
    fused = torch.tensor(1.0 if factor is None else float(factor), dtype=torch.float32)
    if params(self, ta).qinvariant and params(self, tb).qinvariant:
        set_qinvariant(self, out, integer_output_bits(self, signed or s.force_dtype_int), signed or s.force_dtype_int)
        if factor is None:
            store_requant(self, 1, 0, Dtype.UINT8, Dtype.INT8)
        else:
            store_requant(self, *requant_scale_shift(self, fused))
    else:
        quantize_activation(self, out, signed)
        s_a = torch.tensor(tensor_scale(self, ta), dtype=torch.float32)
        s_b = torch.tensor(tensor_scale(self, tb), dtype=torch.float32)
        ratio = torch.tensor(tensor_scale(self, out), dtype=torch.float32) * fused / (s_a * s_b)
        store_requant(self, *requant_scale_shift(self, ratio))
    if s.remain_shift is not None:
        self.params["remain_shift"] = int(s.remain_shift)


# ------------------------------------------------------------------------------------------------ ONNX QDQ export
@FULLY_CONNECTED.export
def convert_fully_connected(g: QDQGraph, node: PyNode) -> None:
    """Gemm (transB) for 2-D inputs, MatMul + Add over the last axis otherwise."""
    x, y = node.inputs[0], node.outputs[0]
    if fully_connected_double(g, node):
        return
    unit = g.unit_domain
    if unit:  # MatMulInteger (or float64): onnxruntime's QGemm fusion is not certain for every FC
        if integer_kernel(g, node, 1) or fully_connected_double(g, node, force=True):
            return
        g.float_layers.setdefault(node.name, None)
    scale = weight_onnx_scale(g, node, x, y, unit)
    b = bias_value(g, node, x, scale, unit=unit)
    xf = g.float_value(x, unit=unit)
    if g.rank(x) == 2:
        out = g.add("Gemm", [xf, mac_weight_value(g, node, scale, axis=0), b], transB=1)
    else:
        mm = g.add("MatMul", [xf, mac_weight_value(g, node, scale, axis=1, perm=(1, 0))])
        out = g.add("Add", [mm, b])
    quantize_mac_output(g, node, out, None, unit)


@MATMUL.export
def convert_matmul(g: QDQGraph, node: PyNode) -> None:
    """Two activations; trans_a/trans_b become layouts of the inputs (integer Transposes, shared)."""
    if len(node.inputs) != 2:
        raise node_error(node, f"needs 2 inputs, got {len(node.inputs)}")
    perms = [operand_perm(g.rank(t), bool_param(node, key, False))
             for t, key in zip(node.inputs, ("trans_a", "trans_b"))]
    if onnx_exact.matmul(g, node, perms):
        return
    values = [g.float_value(t, perm) for t, perm in zip(node.inputs, perms)]
    a, b = node.inputs
    s_out = tensor_scale(node, node.outputs[0])
    factor = float(requant_ratio(node)[0]) * tensor_scale(node, a) * tensor_scale(node, b) / s_out
    out = g.rescale(g.add("MatMul", values), factor)
    g.quantize(node.outputs[0], qdq_fused_activation(g, node, out))
