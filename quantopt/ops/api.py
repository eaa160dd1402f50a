"""The public helper API of operator plugins: what a plugin operator needs to declare itself and to write its float
forward, its quantize function and its exact integer forward, without importing quantopt's private modules.

Every name is re-exported from where quantopt's own operators take it (the built-ins call the very same
functions), so a plugin quantizes exactly as a built-in does. docs/plugins.md, "Writing an operator", shows a
complete operator written with this module only::

    from quantopt.ops.api import Float, Param, declare_op, quantize_activation, requant_scale_shift, ...

Conventions (docs/integer-semantics.md): a quantized tensor `t` of a layer `node` holds int64 integers `q` in
`[p.qmin, p.qmax]` with `q = round_half_even(x * p.scale - p.zerop)`, i.e. `x = (q + p.zerop) / p.scale`, where
`p = quant_of(node).get(t)`: the parameters are not on the tensor but in the table of the layer's graph (keyed by
tensor name, so every helper below that reads or sets them takes the layer first). The integer forward of a layer
reads only what the quantized IR stores (tensor scale/zero point/range/dtype, the layer's params and constants), so
a re-read quantized IR computes the same integers.

Declaring an operator (also importable from `quantopt` itself, except `quantized` and `OpSpec`):

=====================  ===========================================================================================
`declare_op`           one declaration per operator: its typed layer keys (the IR reader checks them), constants,
                       docs; returns an `OpSpec` whose decorators `forward`, `quantize`, `export` attach functions
`OpSpec`               the declaration `declare_op` returns (`SPEC.only("A").forward` serves one of its types)
`Param`                one layer key: its kind, doc, `default`, `required`, `quantized`
`quantized`            `quantized(kind, doc)`: a key written by the quantize function (absent from float IRs)
`Int` `Float` `Bool`   the kinds of a value: integer (optional bounds), finite number, true/false,
`Text` `Ints`          a word (optional `choices`), a list of integers (optional bounds),
`Floats` `Axis`        a list of numbers, None/an integer/a list of integers,
`DtypeName` `Either`   a dtype name such as int8, any of several kinds,
`Value`                any value but NaN (the operator checks it)
=====================  ===========================================================================================

Helpers of a quantize function (called once per layer, in graph order, after calibration):

========================  =========================================================================================
`layer_settings`          `layer_settings(node)`: the layer's `LayerSettings` (bits, quantization modes,
                          `multiplier_bits`, ... as the cfg and the per-layer JSON set them)
`quantize_activation`     `quantize_activation(node, t, signed, bits=None)`: scale, zero point, range and dtype of
                          an output tensor from its calibrated range, with the layer's activation mode and bits
`copy_params`             `copy_params(node, dst, src)`: the output carries the input's quantization unchanged
                          (data movement: transpose, gather, max-pool...; the integer forward then moves integers
                          only)
`set_qinvariant`          `set_qinvariant(node, t, bits, signed)`: an integer output used as is (scale 1, zero point
                          0: indices, counts, shapes)
`quantize_weights`        `quantize_weights(node, per_channel, key="weights")`: quantizes a calibrated weight
                          constant in place (the layer's weight mode and bits); returns its `QuantParams`
`bias_quantize`           `bias_quantize(bias, s_in, s_w, bits)`: `(round(bias * s_in * s_w) clipped to bits
                          signed bits, bias scale)`, the biases of a multiply-accumulate
`requant_scale_shift`     `requant_scale_shift(node, ratio)`: a float ratio (typically `s_out / s_in`) as an
                          integer multiplier M and shift N with `M * 2**-N ~ ratio`, with the layer's multiplier
                          bits; returns `(M, N, M dtype, N dtype)`
`store_requant`           `store_requant(node, M, N, M dtype, N dtype)`: writes them as the layer's
                          `scale_value`/`shift_value` (per channel: `scale`/`shift` constants)
`ranges_of`               `ranges_of(node)`: the table of calibrated ranges the layer's tensors have
                          (`.get(t)` the per-tensor `TensorRange(min, max, axis)`, `.channels(t)` the per-channel
                          one, `.set(t, lo, hi)` to narrow an output's range before `quantize_activation`)
`statistics_of`           `statistics_of(node)`: the table of the statistics the calibration collected
                          (`.get(t)`: the `TensorStatistics` of `t`, read-only)
`quant_of`                `quant_of(node)`: the table of quantization parameters the layer's tensors have:
                          `.get(t)` the `TensorQuant` of `t` to read (read-only; the defaults, scale 1 and not
                          quantized, when it has none), `.of(t)` its entry to set in place (created when missing)
`TensorQuant`             the parameters of one tensor: `scale`, `zerop`, `qbits`, `qmin`, `qmax`, `qinvariant`
                          (an integer used as is), `axis` (None per tensor, else the channel axis), `per_channel`
========================  =========================================================================================

Helpers of an integer forward (`node.quantized` is true):

========================  =========================================================================================
`int_value`               `int_value(t)`: a tensor's integers as int64
`tensor_scale`            `tensor_scale(node, t)`, `tensor_zp(node, t)`: the per-tensor scale (float) and zero point
`tensor_zp`               (int) of `t`, a tensor of `node`
`out_range`               `out_range(node, t)`: `(qmin, qmax)` of a quantized tensor
`params`                  `params(node, t)`: all of `t`'s parameters, the `TensorQuant` `quant_of(node).get(t)`
`requant_of`              `requant_of(node)`: the `(M, N)` stored by `store_requant`
`requantize_int`          `requantize_int(acc, M, N, zp_out, qmin, qmax)`: exact
                          `clamp(round_half_even(acc * M * 2**-N) - zp_out, qmin, qmax)` of an int64 tensor
`quantize`                `quantize(x, scale, zp, qmin, qmax)`: `clamp(round_half_even(x * scale - zp), qmin,
                          qmax)` as int64 (float32 arithmetic; `compute_dtype=torch.float64` for a bound that
                          must round exactly)
`dequantize`              `dequantize(q, scale, zp)`: `(q + zp) * (1 / scale)` in float32
========================  =========================================================================================

Reading params (a declared kind is already checked when the IR is read; these also check values in graphs built
by hand and turn a bad value into an IR error naming the layer's line):

========================  =========================================================================================
`axis_param`              `axis_param(node, axis, rank)`: an axis as a non-negative dim of a rank-`rank` tensor
`int_param`               `int_param(node, key, default, minimum=1)`: an integer param checked against `minimum`
`bool_param`              `bool_param(node, key, default)`: a true/false param (0/1 and "true"/"false" too)
========================  =========================================================================================

Everything else a plugin needs comes from `quantopt` itself: `PyNode`, `PyTensor`, `Dtype`, the errors
(`raise node._error(message)` is an IR error naming the layer) and the log functions. The ONNX export function
of `@SPEC.export` receives a `quantopt.ops.onnx_build.qdq_graph.QDQGraph` (docs/onnx-export.md, "Operators
of plugins").
"""
from __future__ import annotations

from ..graph.tables import TensorQuant, quant_of, ranges_of, statistics_of
from ..quant.params import dequantize, quantize
from ..quant.requant import bias_quantize, requantize_int
from ..registry import OpSpec, declare_op
from ..registry.schema import Axis, Bool, DtypeName, Either, Float, Floats, Int, Ints, Param, Text, Value, quantized
from ._quant import (
    copy_params,
    int_value,
    layer_settings,
    out_range,
    params,
    quantize_activation,
    quantize_weights,
    requant_of,
    requant_scale_shift,
    set_qinvariant,
    store_requant,
    tensor_scale,
    tensor_zp,
)
from ._shared import axis_param, bool_param, int_param

__all__ = [
    # declaring an operator
    "declare_op", "OpSpec", "Param", "quantized",
    "Int", "Float", "Bool", "Text", "Ints", "Floats", "Axis", "DtypeName", "Either", "Value",
    # quantize functions
    "layer_settings", "quantize_activation", "copy_params", "set_qinvariant", "quantize_weights", "bias_quantize",
    "requant_scale_shift", "store_requant", "ranges_of", "statistics_of", "quant_of", "TensorQuant",
    # integer forwards
    "int_value", "tensor_scale", "tensor_zp", "out_range", "params", "requant_of", "requantize_int", "quantize",
    "dequantize",
    # reading params
    "axis_param", "int_param", "bool_param",
]
