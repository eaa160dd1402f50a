"""The choices of `quantopt export` that its argument parser needs, apart from onnx_qdq.py (which loads torch and
the operators) so that `quantopt export --help` and argument errors answer at once."""
from __future__ import annotations

SCALE_MODES = ("exact", "effective", "ir")
""""ir": weight DequantizeLinear scales are the IR's weights_scale and nothing else is added, a plain QDQ model.
"effective": weight scales are what the integer multiplier/shift effectively applies (M · 2^-N · s_in / s_out), and
layers requantizing with a multiplier get a Mul by the multiplier's rounding ratio (≈ 1) before QuantizeLinear, so
onnxruntime follows quantopt's integer forward closely; activations keep the IR's scales.
"exact" (the default): "effective", plus MAC layers in integer units (scale-1 activations around them, the
multiplier as weight scale), int8 activations as uint8, tables as Gathers and the other requantizing layers in
float64 arithmetic (ops/onnx_build/exact.py), so that onnxruntime computes quantopt's integers."""
DEFAULT_SCALES = "exact"
