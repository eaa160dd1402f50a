"""QDQ export of BasicLSTM and GRUv3 ("exact" mode only): quantopt's integer cells (docs/semantics/recurrent.md)
unrolled over their time steps in ONNX float64/int64 arithmetic. A BasicLSTM or GRU in upstream's integer form
(`lstm_integer_form` / `gru_integer_form = upstream`, the defaults) is refused by name.

Per step: the gate accumulator in float64 (input and hidden MatMuls, every sum below 2^53), the per-row gate
multiplier and shift as an int64 rounding division, the Q15 tables as Gathers over every gate input integer, the
cell update and the hidden state in int64, and the outputs requantized in float64. A float QDQ form would not be
close: the integer cell keeps its own fixed-point formats.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import numpy as np
import torch

from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..ops._quant import effective_weights, tensor_zp
from ..ops.recurrent import CELL_INT_MAX, GATE_FRAC_BITS, PRODUCT_FRAC_BITS, RnnSpec, rnn_spec
from ..quant.lut import lookup_lut
from .convert_exact import DOUBLE, FLOAT, INT64, codes, round_div_int64
from .qdq_graph import QDQGraph, converter, node_error


class _Ops:
    """Small builders bound to one layer (constant names carry the layer and a counter)."""

    def __init__(self, g: QDQGraph, node: PyNode) -> None:
        self.g, self.node, self.count = g, node, 0

    def const(self, value: object, dtype: object) -> str:
        self.count += 1
        return self.g.const(f"{self.node.name}/c{self.count}", np.asarray(value, dtype=dtype))

    def i64(self, value: object) -> str:
        return self.const(value, np.int64)

    def f64(self, value: object) -> str:
        return self.const(value, np.float64)

    def clamp(self, value: str, bound: object) -> str:
        """clamp(value, -bound, bound) for int64 values (bound a number or one per column)."""
        bound = np.asarray(bound, dtype=np.int64)
        return self.g.add("Max", [self.g.add("Min", [value, self.i64(bound)]), self.i64(-bound)])

    def rshift(self, value: str, shift: object) -> str:
        """round_half_even(value / 2^shift) for int64 values; shifts <= 0 multiply (per column where a vector)."""
        s = np.asarray(shift, dtype=np.int64)
        if np.any(s < 0):
            value = self.g.add("Mul", [value, self.i64(np.left_shift(1, np.maximum(-s, 0)))])
        if np.all(s <= 0):
            return value
        return round_div_int64(self.g, self.node, value, self.i64(np.left_shift(1, np.maximum(s, 0))))

    def table(self, key: str, bits: int) -> str:
        """quantopt's Q15 lookup of `key` for every gate input integer in [-hq, hq] (index = input + hq)."""
        hq = 2 ** (bits - 1) - 1
        values = lookup_lut(torch.arange(-hq, hq + 1), self.node.get_constant(key).betensor, -hq, bits, 16, True,
                            in_restricted=True)
        return self.i64(values.numpy())

    def look(self, table: str, gate_in: str, hq: int) -> str:
        return self.g.add("Gather", [table, self.g.add("Add", [gate_in, self.i64(hq)])], axis=0)

    def columns(self, value: str, start: int, end: int) -> str:
        return self.g.add("Slice", [value, self.i64([start]), self.i64([end]), self.i64([-1])])

    def matmul(self, value: str, weights: np.ndarray) -> str:
        """value @ weights with integers in float64 (exact: the sums stay below 2^53), as int64."""
        return self.g.add("Cast", [self.g.add("MatMul", [value, self.f64(weights)])], to=INT64)

    def gates(self, acc: str, mult: np.ndarray, shift: np.ndarray, bound: np.ndarray) -> str:
        """clamp(rs(acc · gate_scale, gate_shift), ±gate_clamp) per row, int64."""
        scaled = self.g.add("Mul", [acc, self.i64(mult * np.left_shift(1, np.maximum(-shift, 0)))])
        return self.clamp(round_div_int64(self.g, self.node, scaled,
                                          self.i64(np.left_shift(1, np.maximum(shift, 0)))), bound)


def _int_param(node: PyNode, key: str) -> int:
    return int(node.get_param(key))


@dataclass
class _Cell:
    """What both cells read from the quantized layer."""

    spec: RnnSpec
    op: _Ops
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


def _cell(g: QDQGraph, node: PyNode, states: int) -> _Cell:
    if not g.unit_domain:
        raise node_error(node, "recurrent layers are exported in the exact mode only (--scales exact)")
    spec = rnn_spec(node)
    x_t = node.inputs[0]
    for t in node.inputs[1:1 + states]:
        rows = int(np.prod(t.ir_shape)) // spec.cell_size
        if rows not in (1, int(x_t.ir_shape[0])):
            raise node_error(node, f"initial state '{t.name}' has {rows} rows for a batch of {x_t.ir_shape[0]}")
    op = _Ops(g, node)
    bits = _int_param(node, "gate_bits")

    def ints(key: str) -> np.ndarray:
        return node.get_constant(key).betensor.to(torch.int64).reshape(-1).numpy()

    x = g.add("Sub", [codes(g, x_t), op.f64(float(tensor_zp(x_t)))])
    return _Cell(spec, op, bits, 2 ** (bits - 1) - 1, _int_param(node, "hidden_frac_bits"),
                 effective_weights(node).numpy().astype(np.float64), ints("biases"), ints("gate_scale"),
                 ints("gate_shift"), list(node.get_param("gate_clamp_value")),
                 _int_param(node, "hidden_scale_value"), _int_param(node, "hidden_shift_value"), x)


def _initial_state(g: QDQGraph, node: PyNode, cell: _Cell, t: PyTensor, key: str, bound: int) -> str:
    """clamp(rs((state + zp) · init_<key>_scale_value, init_<key>_shift_value), ±bound) as int64 rows of C."""
    rows = g.add("Reshape", [codes(g, t), cell.op.i64([-1, cell.spec.cell_size])])
    ratio = _int_param(node, f"init_{key}_scale_value") * 2.0 ** -_int_param(node, f"init_{key}_shift_value")
    rounded = g.add("Round", [g.add("Mul", [rows, cell.op.f64(ratio)])])
    return cell.op.clamp(g.add("Cast", [rounded], to=INT64), bound)


@converter("BasicLSTM")
def convert_lstm(g: QDQGraph, node: PyNode) -> None:
    if "lut_it" in node.constants:
        raise node_error(node, "a BasicLSTM in upstream's integer form is not exported; quantize it with "
                               "lstm_integer_form = q15 (docs/semantics/recurrent.md)")
    cell = _cell(g, node, states=2)
    spec, op, bits, hq, hid_frac, w = cell.spec, cell.op, cell.bits, cell.hq, cell.hid_frac, cell.weights
    cs, isz, steps = spec.cell_size, spec.input_size, spec.time_steps
    cell_frac = _int_param(node, "cell_frac_bits")
    gm, gs, mh, nh, x = cell.gate_mult, cell.gate_shift, cell.hidden_mult, cell.hidden_shift, cell.x
    clamp_vals = cell.gate_clamp
    clamp_rows = np.array([clamp_vals[0]] * cs + [clamp_vals[1]] * cs + [clamp_vals[0]] * 2 * cs, dtype=np.int64)
    mc, nc = _int_param(node, "cell_scale_value"), _int_param(node, "cell_shift_value")
    clip = int(node.get_param("cell_clip_value", optional=True, default_value=CELL_INT_MAX))
    h = g.add("Cast", [_initial_state(g, node, cell, node.inputs[1], "h", hq)], to=DOUBLE)
    c = _initial_state(g, node, cell, node.inputs[2], "c", CELL_INT_MAX)
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


def _write_outputs(g: QDQGraph, node: PyNode, op: _Ops, spec: RnnSpec, products: List[str], finals: Dict[str, str],
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


@converter("GRUv1", "GRUv3")
def convert_gru(g: QDQGraph, node: PyNode) -> None:
    """GRUv3 (GRUV3: reset before the hidden MatMul; GRUV1: after it), quantopt's integer cell unrolled."""
    if "lut_rt" in node.constants:
        raise node_error(node, f"a {node.type} in upstream's integer form is not exported; quantize it with "
                               "gru_integer_form = q15 (docs/semantics/recurrent.md)")
    cell = _cell(g, node, states=1)
    spec, op, bits, hq, hid_frac, w = cell.spec, cell.op, cell.bits, cell.hq, cell.hid_frac, cell.weights
    cs, isz, steps = spec.cell_size, spec.input_size, spec.time_steps
    gm, gs, mh, nh, x, b = cell.gate_mult, cell.gate_shift, cell.hidden_mult, cell.hidden_shift, cell.x, cell.biases
    clamp_vals = cell.gate_clamp
    wx, wh = w[:, :isz].T, w[:, isz:].T  # [I, 3C], [C, 3C]
    h = _initial_state(g, node, cell, node.inputs[1], "h", hq)
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
