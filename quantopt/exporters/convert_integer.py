"""QDQ export of the integer-valued layers of attention-mask paths: Cast, Logical and Where.

Their integer forwards (docs/semantics/indexing.md "Cast", docs/semantics/binary.md "Logical" and "Where") are
integer arithmetic on `X = q + zp` with integer multipliers and shifts, not a float function between two
quantizations, so every scale mode writes the same integer form: the inputs as float64 integers (`codes`, exact
for int32 too), the multipliers and shifts as exact float64 products (every intermediate is below 2^53), `Round`
(half to even, as `rs`), the clip mode (Clip, or a two's-complement wrap in int64) and a `Cast` to the output's
ONNX integer type. onnxruntime then computes quantopt's integers exactly.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..ops._quant import out_range, tensor_zp
from ..ops._shared import bool_param
from ..quant.rounding import FLOAT64_EXACT
from .convert_exact import DOUBLE, codes, double, emit_integers
from .qdq_graph import Perm, QDQGraph, converter, node_error

LOGICAL_ONNX = {"EQUAL": "Equal", "GREATER": "Greater", "GREATER_EQUAL": "GreaterOrEqual", "LESS": "Less",
                "LESS_EQUAL": "LessOrEqual"}
"""Comparison methods with an ONNX op of their own (NOT_EQUAL is Not(Equal))."""
BOOLEAN_ONNX = {"AND": "And", "OR": "Or", "XOR": "Xor"}


def shared_perm(g: QDQGraph, tensors: Sequence[PyTensor], rank: int) -> Optional[Perm]:
    """A layout every input has when all share the output's rank (numpy broadcasting survives one common
    transpose), else None: the IR layout, where inputs of lower rank broadcast from the right."""
    if any(g.rank(t) != rank for t in tensors):
        return None
    return g.common_perm(list(tensors), rank)


def _scaled(g: QDQGraph, node: PyNode, value: str, multiplier: int, what: str) -> str:
    return value if multiplier == 1 else g.add("Mul", [value, double(g, node, what, float(multiplier))])


# ------------------------------------------------------------------------------------------------ Cast
@converter("Cast")
def convert_cast(g: QDQGraph, node: PyNode) -> None:
    """Integer Cast: `clip_mode(rs((q + zp_in) · M, N) - zp_out)` (TRUNC rounding: toward zero), or
    `clip_mode(q [+ zp_in - zp_out])` without a multiplier; the identity when the integers fit unchanged."""
    x, y = node.inputs[0], node.outputs[0]
    if y.dtype.is_float or x.qmin is None or y.qmin is None:
        raise node_error(node, "a Cast to a float type has no integer form (float layers have no QDQ form)")
    clip_mode = str(node.get_param("clip_mode", optional=True, default_value="SATURATION")).upper()
    rank = g.rank(x)
    perm = shared_perm(g, [x], rank)
    lo, hi = out_range(y)
    if "scale_value" in node.params:
        m, n = int(node.params["scale_value"]), int(node.get_param("shift_value"))
        if max(abs(int(x.qmin) + tensor_zp(x)), abs(int(x.qmax) + tensor_zp(x))) * abs(m) >= FLOAT64_EXACT:
            raise node_error(node, "(q + zp) · M leaves float64's exact integers; no exact form")
        v = g.add("Mul", [codes(g, x, perm), double(g, node, "multiplier", m * 2.0 ** -n)])
        if str(node.params.get("round_mode", "ROUND_TO_EVEN")).upper() == "TRUNC":
            v = g.add("Mul", [g.add("Sign", [v]), g.add("Floor", [g.add("Abs", [v])])])
        else:
            v = g.add("Round", [v])
        zp_out = tensor_zp(y)
        v = v if not zp_out else g.add("Sub", [v, double(g, node, "output_zero_point", float(zp_out))])
        emit_integers(g, node, y, v, perm, clip_mode)
        return
    shift = 0 if bool_param(node, "ignore_scale_zp", True) else tensor_zp(x) - tensor_zp(y)
    px, py = g.qparams(x), g.qparams(y)
    if lo <= int(x.qmin) + shift and int(x.qmax) + shift <= hi and px.dtype == py.dtype \
            and px.offset == py.offset + shift:  # ONNX x = IR x + offset_x must be IR y + offset_y
        g.set_int(y, g.int_value(x, perm), perm)  # the same ONNX integers
        return
    v = codes(g, x, perm)  # q + zp_in
    v = g.add("Sub", [v, double(g, node, "input_zero_point", float(tensor_zp(x) - shift))]) \
        if tensor_zp(x) != shift else v
    emit_integers(g, node, y, v, perm, clip_mode)


# ------------------------------------------------------------------------------------------------ Logical
@converter("Logical")
def convert_logical(g: QDQGraph, node: PyNode) -> None:
    """0/1 from comparisons of `X · M_a` and `Y · M_b` (exact in float64), or from `X != 0` (AND/OR/XOR; NOT:
    `X == 0`), as the output's integer type."""
    method = str(node.get_param("method")).upper()
    count = 1 if method == "NOT" else 2
    if len(node.inputs) != count:
        raise node_error(node, f"{method} needs {count} input(s), got {len(node.inputs)}")
    y = node.outputs[0]
    perm = shared_perm(g, node.inputs, g.rank(y))
    values: List[str] = [codes(g, t, perm) for t in node.inputs]
    if method == "NOT":
        truth = g.add("Equal", [values[0], double(g, node, "zero", 0.0)])
    elif method in BOOLEAN_ONNX:
        zero = double(g, node, "zero", 0.0)
        a, b = (g.add("Not", [g.add("Equal", [v, zero])]) for v in values)
        truth = g.add(BOOLEAN_ONNX[method], [a, b])
    elif method in LOGICAL_ONNX or method == "NOT_EQUAL":
        m_a, m_b = (int(v) for v in node.get_param("scale_value"))
        bound = max(max(abs(int(t.qmin) + tensor_zp(t)), abs(int(t.qmax) + tensor_zp(t))) * m
                    for t, m in zip(node.inputs, (m_a, m_b)))
        if bound >= FLOAT64_EXACT:
            raise node_error(node, "X · M leaves float64's exact integers; no exact form")
        a, b = _scaled(g, node, values[0], m_a, "input0_multiplier"), _scaled(g, node, values[1], m_b,
                                                                               "input1_multiplier")
        truth = g.add("Not", [g.add("Equal", [a, b])]) if method == "NOT_EQUAL" else g.add(LOGICAL_ONNX[method],
                                                                                            [a, b])
    else:
        raise node_error(node, f"Logical method {method} has no QDQ mapping")
    emit_integers(g, node, y, g.add("Cast", [truth], to=DOUBLE), perm)


# ------------------------------------------------------------------------------------------------ Where
@converter("Where")
def convert_where(g: QDQGraph, node: PyNode) -> None:
    """`clamp(rs(X · M_x, N_x) - zp_out)` where `C != 0`, else the same of `Y`, in float64 (exact: every product
    is below 2^53 and scaling by 2^-N is exact)."""
    if len(node.inputs) != 3:
        raise node_error(node, f"only the three-input form (condition, x, y) is exported, got {len(node.inputs)}")
    c, x, y = node.inputs
    out = node.outputs[0]
    ms = [int(v) for v in node.get_param("scale_value")]
    ns = [int(v) for v in node.get_param("shift_value")]
    for t, m in zip((x, y), ms):
        if max(abs(int(t.qmin) + tensor_zp(t)), abs(int(t.qmax) + tensor_zp(t))) * abs(m) >= FLOAT64_EXACT:
            raise node_error(node, f"(q + zp) · M of input '{t.name}' leaves float64's exact integers; no exact "
                                   "form")
    perm = shared_perm(g, node.inputs, g.rank(out))
    lo, hi = out_range(out)
    zp_out = tensor_zp(out)
    branches = []
    for i, (t, m, n) in enumerate(zip((x, y), ms, ns)):
        v = g.add("Round", [g.add("Mul", [codes(g, t, perm), double(g, node, f"input{i + 1}_multiplier",
                                                                      m * 2.0 ** -n)])])
        v = v if not zp_out else g.add("Sub", [v, double(g, node, f"input{i + 1}_zero_point", float(zp_out))])
        branches.append(g.add("Clip", [v, double(g, node, f"input{i + 1}_qmin", float(lo)),
                                       double(g, node, f"input{i + 1}_qmax", float(hi))]))
    condition = g.add("Not", [g.add("Equal", [codes(g, c, perm), double(g, node, "zero", 0.0)])])
    emit_integers(g, node, out, g.add("Where", [condition, *branches]), perm)
