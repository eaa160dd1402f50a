"""The integer steps of small recurrent cells (BasicLSTM and GRU, both integer forms) on numpy float64 arrays.

Why: a cell of a few hundred gate values per step costs its kernel calls, not its arithmetic. The torch form of a
step (ops/recurrent.py) is some forty torch calls of about a microsecond each plus the bookkeeping of its
requantizations; the same step as numpy calls on small float64 arrays costs about a third of that (a numpy
element-wise call on 256 values takes 0.3-0.6 µs here, torch's 0.7-1.3 µs). A model of small LSTM or GRU cells (a
voice-activity detector, a CRNN head) then runs its integer forward in about its float forward's time instead of
three times it.

The values are the torch form's, bit for bit: every value of a step is an integer held exactly in float64 (the
int32 clamps, the tables' entries and their products, each below 2^53 by the bounds the steps prove: the same bounds
as the torch form's), products of integers by weights are float64 GEMMs whose partial sums are exact integers (so
any summation order gives them: numpy's GEMM for small products, torch's for larger ones), and every
requantization is `Requantizer`'s rounding by addition: acc · M·2^-shift (exact) plus 1.5·2^52 rounds half to even
in one float64 addition (`Requantizer.float64_form`). Where a bound does not prove that, or a code could fall outside
its table, the step runs in torch as before (the step functions return None). Interpolating tables (16-bit codes
into 256 entries) are read as `PreparedLut` reads them, and the q15 form's per-row gate clamp is a clamp of the
table positions. `tests/ops/test_lstm_upstream.py`, `test_gru_upstream.py` and `test_recurrent.py` check every form
against independent Python-integer references, `test_recurrent_numpy_steps.py` against the torch steps.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from ..quant.lut import PreparedLut
from ..quant.requant import Requantizer
from ..quant.rounding import _MAGIC, _MAGIC_BITS, FLOAT64_EXACT
from ._int8_gemm import IntMatmul

NUMPY_STEP_VALUES = 4096
"""Most values a step's widest tensor (rows x gate columns) may hold for the numpy steps; larger steps (a batch of
many rows) are worth torch's kernels and the int8 GEMM. 0 turns the numpy steps off (tests compare both forms)."""

NUMPY_STEP_WEIGHTS = 1 << 18
"""Most hidden-state weights (all of a cell's hidden products together) for which the numpy steps' float64 products
replace torch's int8 GEMM: measured on one core, a cell of 256 units is faster in numpy (an LSTM's steps 7.4 against
10.5 ms for 50 steps, a GRU's 4.9 against 12.4 ms), one of 384 or 512 is not (its 1.2-2 M float64 weights read per
step cost more than the kernel calls saved). Where no int8 GEMM runs the torch steps take a float64 product too."""

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
INT32_BOUND = 2 ** 31

RESET_RANGE = 2 ** 49
"""The GRU reset product's clamp (none in effect: |r · h| / 2^bits < 2^45 wherever the numpy steps apply)."""

FORMS_KEPT = 16
"""Sets of step forms (by their bounds) a layer's plan keeps. The plans are ops/recurrent.py's `_LstmPlan`,
`_GruPlan` and `_Q15Plan` (typed `Any` here: that module imports this one)."""


@dataclass(frozen=True)
class StepRequant:
    """clamp(round_half_even(acc · factor) - zp, qmin, qmax) of float64 integers with |acc| <= `bound`: a
    `Requantizer` prepared for numpy arrays (`Requantizer.float64_form`)."""

    factor: Union[float, np.ndarray]
    lo: float
    """qmin + zp + 1.5·2^52: the clamp on the biased sum"""
    hi: float
    clamp: bool
    sub: float
    """1.5·2^52 + zp: what leaves the value"""
    bits_sub: Union[int, np.ndarray]
    """1.5·2^52's bit pattern + zp + the table offsets: what leaves a table position from the biased sum's bits"""
    bound: int
    row_clamp: Optional[Tuple[np.ndarray, np.ndarray]] = None
    """a further clamp of the positions per column (the q15 form's per-row gate clamp, less the table offsets)"""

    def _biased(self, acc: np.ndarray) -> np.ndarray:
        y = np.multiply(acc, self.factor)
        y += _MAGIC
        if self.clamp:
            np.maximum(y, self.lo, out=y)
            np.minimum(y, self.hi, out=y)
        return y

    def values(self, acc: np.ndarray) -> np.ndarray:
        """The requantized integers, as float64."""
        y = self._biased(acc)
        y -= self.sub
        return y

    def positions(self, acc: np.ndarray) -> np.ndarray:
        """The requantized codes less the table offsets given to `step_requant` (int64 table positions)."""
        positions = self._biased(acc).view(np.int64) - self.bits_sub
        if self.row_clamp is not None:
            np.maximum(positions, self.row_clamp[0], out=positions)
            np.minimum(positions, self.row_clamp[1], out=positions)
        return positions


def step_requant(rq: Requantizer, bound: int, columns: int, offsets: Union[int, np.ndarray] = 0
                 ) -> Optional[StepRequant]:
    """`rq` prepared for numpy accumulators of `columns` columns with |acc| <= `bound`, its positions less
    `offsets`; None where its rounding by addition does not apply."""
    form = rq.float64_form(bound, columns)
    if form is None:
        return None
    factor, clamp = form
    _, _, zerop_out, qmin, qmax = rq.args
    zp = int(zerop_out)
    return StepRequant(factor, float(int(qmin) + zp) + _MAGIC, float(int(qmax) + zp) + _MAGIC, clamp, _MAGIC + zp,
                       _MAGIC_BITS + zp + offsets, bound)


@dataclass(frozen=True)
class StepLookup:
    """The table lookup (`PreparedLut`) of the codes a `StepRequant` gives, all within the table's input range: one
    gather where the table is direct, else the interpolation between two entries (floored, as `PreparedLut`)."""

    table: np.ndarray
    """the padded table(s), float64 (exact: table entries are small integers)"""
    clamp: Optional[Tuple[float, float]]
    shift: int
    """input bits beyond the table's (0: direct)"""
    base: Union[int, np.ndarray]
    """interpolated: where each column's table starts in the padded stack"""

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        if not self.shift:
            value = self.table.take(positions)
        else:  # positions are the codes less the input offset: table entry hi, and lo of 2^shift steps to the next
            hi = positions >> self.shift
            lo = (positions & ((1 << self.shift) - 1)).astype(np.float64)
            hi += self.base
            value = self.table.take(hi)
            step = self.table.take(hi + 1)
            step -= value
            step *= lo
            step *= 2.0 ** -self.shift
            value += np.floor(step, out=step)
        if self.clamp is not None:
            np.maximum(value, self.clamp[0], out=value)
            np.minimum(value, self.clamp[1], out=value)
        return value


def table_step(lut: PreparedLut, rq: Requantizer, bound: int, columns: int, row_clamp: Optional[torch.Tensor] = None
               ) -> Optional[Tuple[StepRequant, StepLookup]]:
    """The requantization `rq` of accumulators of `columns` columns (|acc| <= `bound`) straight to positions in
    `lut` (or, for an interpolating table, to codes less its input offset), and the lookup there; None unless the
    table covers every code `rq` can give. `row_clamp`: per column, a clamp of the codes to ±clamp after `rq`."""
    _, _, _, qmin, qmax = rq.args
    if not lut.covers(int(qmin), int(qmax)):
        return None
    offsets = lut.index_offset(columns, torch.device("cpu"))
    offsets = offsets.numpy().astype(np.int64) if isinstance(offsets, torch.Tensor) else int(offsets)
    base: Union[int, np.ndarray] = 0
    shift = 0 if lut.direct else lut.in_bits - lut.table_bits
    if shift:  # index_offset is the input offset less each column's table start
        base, offsets = lut.offset - offsets, lut.offset
    codes = step_requant(rq, bound, columns, offsets)
    if codes is None:
        return None
    if row_clamp is not None:
        limit = row_clamp.detach().cpu().to(torch.int64).numpy().reshape(-1)
        if limit.size not in (1, columns):
            return None
        codes = replace(codes, row_clamp=(-limit - offsets, limit - offsets))
    clamp = (float(lut.out_range[0]), float(lut.out_range[1])) if lut.clamped else None
    return codes, StepLookup(lut.padded.cpu().to(torch.float64).numpy(), clamp, shift, base)


NUMPY_PRODUCT_TERMS = 1 << 18
"""Most multiply-adds (rows x weights) of a step's weight product made by numpy's GEMM; larger ones go to torch's
(on the same float64 values), which keeps to torch's thread count where numpy's BLAS would start threads of its
own (it did from about 2^20 here)."""


class StepWeights:
    """A weight matrix [K, N] as float64 for products with float64 integers |a| <= a bound for which every partial
    sum is an exact integer (so any summation order, numpy's or torch's, gives the same values)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.tensor = w.detach().cpu().to(torch.float64).contiguous()
        self.array = self.tensor.numpy()

    def times(self, a: np.ndarray) -> np.ndarray:
        """a @ w."""
        if a.shape[0] * self.array.size <= NUMPY_PRODUCT_TERMS:
            return a @ self.array
        return torch.mm(torch.from_numpy(np.ascontiguousarray(a)), self.tensor).numpy()


def _weights(w: torch.Tensor, bound: int, col_absmax: int) -> Optional[StepWeights]:
    """`w` [K, N] for products with operands |a| <= `bound` where every partial sum is an exact integer (bound · max
    column sum of |w| < 2^53); else None."""
    if bound * col_absmax >= FLOAT64_EXACT:
        return None
    return StepWeights(w)


def _applies(rows: int, columns: int, device: torch.device, *products: IntMatmul) -> bool:
    """Whether the numpy steps run: on the CPU, for steps of at most NUMPY_STEP_VALUES values, and hidden products
    of at most NUMPY_STEP_WEIGHTS weights where the torch steps would take the int8 GEMM."""
    int8 = any(p.w8 is not None for p in products)
    weights = sum(int(p.w.numel()) for p in products)
    return device.type == "cpu" and 0 < rows * columns <= NUMPY_STEP_VALUES and \
        (not int8 or weights <= NUMPY_STEP_WEIGHTS)


def _kept(cache: Dict[tuple, object], key: tuple, build: Callable[[], object]) -> object:
    if key not in cache:
        if len(cache) >= FORMS_KEPT:
            cache.clear()
        cache[key] = build()
    return cache[key]


def _clamp32(v: np.ndarray) -> np.ndarray:
    np.maximum(v, INT32_MIN, out=v)
    np.minimum(v, INT32_MAX, out=v)
    return v


def _numpy(v: torch.Tensor) -> np.ndarray:
    return v.detach().cpu().to(torch.float64).numpy()


# ---------------------------------------------------------------------------------------------------------- BasicLSTM
@dataclass(frozen=True)
class _LstmForms:
    wh: StepWeights
    hidden: List[StepRequant]
    clamp_acc: bool
    steps: List[Tuple[StepRequant, StepRequant, bool, StepRequant, StepRequant, StepRequant]]
    """per step: i·g, f·c, whether c_tmp is clamped to int32, the cell input (positions), h, c"""
    cell_lookup: StepLookup


def _lstm_forms(plan: Any, state_bound: int) -> Optional[_LstmForms]:
    """The numpy forms of an upstream-form LSTM plan's steps for states |h|, |c| <= `state_bound` (the torch form's
    bounds, with the first step's taken as wide as the others'), but the gates' requantization, whose bound comes
    from each forward's input projection (`lstm_steps` makes it)."""
    cs4 = int(plan.wh.w.shape[1])
    cs = cs4 // 4
    wh = _weights(plan.wh.w, state_bound, plan.wh.col_absmax)
    if wh is None:
        return None
    hidden, bound = [], state_bound * plan.wh.col_absmax
    for rq in plan.hidden:
        form = step_requant(rq, bound, cs4)
        if form is None:
            return None
        hidden.append(form)
        bound = INT32_BOUND
    gate_max, cell_max = plan.gate_luts.absmax, plan.cell_lut.absmax
    steps = []
    cell_lookup: Optional[StepLookup] = None
    for rq_ig, rq_fc, rq_cell_in, rq_c in plan.steps:
        ig = step_requant(rq_ig, gate_max * gate_max, cs)
        fc = step_requant(rq_fc, gate_max * state_bound, cs)
        c_bound = rq_ig.output_bound(gate_max * gate_max) + rq_fc.output_bound(gate_max * state_bound)
        clamp_c = c_bound > INT32_MAX
        if clamp_c:
            c_bound = INT32_BOUND
        cell = table_step(plan.cell_lut, rq_cell_in, c_bound, cs)
        out_h = step_requant(plan.out_h, gate_max * cell_max, cs)
        new_c = step_requant(rq_c, c_bound, cs)
        if ig is None or fc is None or cell is None or out_h is None or new_c is None \
                or gate_max * gate_max >= FLOAT64_EXACT or gate_max * state_bound >= FLOAT64_EXACT:
            return None
        steps.append((ig, fc, clamp_c, cell[0], out_h, new_c))
        cell_lookup = cell[1]
    if cell_lookup is None:
        return None
    return _LstmForms(wh, hidden, plan.bits > 8, steps, cell_lookup)


def lstm_steps(plan: Any, x_part: torch.Tensor, h: torch.Tensor, c: torch.Tensor, state_bound: int, acc_max: int
               ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The upstream-form LSTM's steps (ops/recurrent.py `lstm_upstream_forward`, whose plan, input projection
    `x_part` [B, T, 4C] and initial states it takes) on numpy arrays: (every step's h [B, T, C], the last c [B, C])
    as int64, or None where they do not apply. `state_bound`: a bound of |h| and |c| over all steps (the initial
    states' and the steps' clamp); `acc_max`: of the gate accumulators."""
    rows, steps, cs4 = (int(s) for s in x_part.shape)
    if not _applies(rows, cs4, x_part.device, plan.wh) or len(plan.steps) != steps:
        return None
    forms = _kept(plan.numpy_forms, ("lstm", state_bound), lambda: _lstm_forms(plan, state_bound))
    gate_forms = table_step(plan.gate_luts, plan.gates, acc_max, cs4) if forms is not None else None
    if forms is None or gate_forms is None:
        return None
    assert isinstance(forms, _LstmForms)
    cs = cs4 // 4
    xp, hn, cn = _numpy(x_part), _numpy(h), _numpy(c)
    ys = np.empty((rows, steps, cs), dtype=np.float64)
    wh, hidden, cell_lookup = forms.wh, forms.hidden, forms.cell_lookup
    gates, gate_lookup = gate_forms
    for t, (ig, fc, clamp_c, cell_in, out_h, new_c) in enumerate(forms.steps):
        hw = wh.times(hn)
        for rq in hidden:
            hw = rq.values(hw)
        acc = np.add(xp[:, t], hw)
        if forms.clamp_acc:
            _clamp32(acc)
        gate = gate_lookup(gates.positions(acc))
        i, g, f, o = gate[:, :cs], gate[:, cs:2 * cs], gate[:, 2 * cs:3 * cs], gate[:, 3 * cs:]
        c_tmp = ig.values(i * g)
        c_tmp += fc.values(f * cn)
        if clamp_c:
            _clamp32(c_tmp)
        hn = out_h.values(o * cell_lookup(cell_in.positions(c_tmp)))
        cn = new_c.values(c_tmp)
        ys[:, t] = hn
    return torch.from_numpy(ys).to(torch.int64), torch.from_numpy(cn).to(torch.int64)


# ---------------------------------------------------------------------------------------------------------------- GRU
@dataclass(frozen=True)
class _GruForms:
    wh_g: StepWeights
    wh_c: StepWeights
    hg: List[StepRequant]
    hidden: Optional[StepRequant]
    """linear_before_reset: the hidden candidate's requantization"""
    reset: Optional[StepRequant]
    """otherwise: round(r · h / 2^bits), half to even"""
    hc: List[StepRequant]
    cu: StepRequant
    h: StepRequant


def _gru_forms(plan: Any, state_bound: int, bh_max: int) -> Optional[_GruForms]:
    """The numpy forms of an upstream-form GRU plan's steps for a hidden state |h| <= `state_bound` (all steps)
    and the torch form's other bounds, but the gate and candidate requantizations, whose bounds come from each
    forward's input projections (`gru_steps` makes them)."""
    cs = int(plan.wh_c.w.shape[1])
    qmin, qmax = -(2 ** (plan.bits - 1)), 2 ** (plan.bits - 1) - 1
    rz_max, c_max = plan.lut_rz.absmax, plan.lut_c.absmax
    wh_g = _weights(plan.wh_g.w, state_bound, plan.wh_g.col_absmax)
    hg, bound = [], state_bound * plan.wh_g.col_absmax
    for rq in plan.hg:
        hg.append(step_requant(rq, bound, 2 * cs))
        bound = INT32_BOUND
    if plan.hidden is not None:
        wh_c = _weights(plan.wh_c.w, state_bound, plan.wh_c.col_absmax)
        hidden = step_requant(plan.hidden, state_bound * plan.wh_c.col_absmax + bh_max, cs)
        reset = None
        bound = rz_max * max(-qmin, qmax)
        if hidden is None:
            return None
    else:
        hidden = None
        reset_bound = rz_max * state_bound
        # round_half_even(r · h / 2^bits): a requantization by 1 and a shift of `bits`, its clamp wider than any value
        reset = step_requant(Requantizer(1, plan.bits, 0, -RESET_RANGE, RESET_RANGE, torch.device("cpu")), reset_bound,
                             cs)
        bound = ((reset_bound >> plan.bits) + 1) * plan.wh_c.col_absmax
        wh_c = _weights(plan.wh_c.w, (reset_bound >> plan.bits) + 1, plan.wh_c.col_absmax)
        if reset is None:
            return None
    hc = []
    for rq in plan.hc:
        hc.append(step_requant(rq, bound, cs))
        bound = INT32_BOUND
    cu = step_requant(plan.cu, (qmax + rz_max) * c_max, cs)
    h = step_requant(plan.h, INT32_BOUND + rz_max * state_bound, cs)
    if wh_g is None or wh_c is None or cu is None or h is None \
            or any(f is None for f in hg + hc) or rz_max * state_bound >= FLOAT64_EXACT:
        return None
    return _GruForms(wh_g, wh_c, hg, hidden, reset, hc, cu, h)


def gru_steps(plan: Any, xg_all: torch.Tensor, xc_all: torch.Tensor, h: torch.Tensor, state_bound: int, z_max: int,
              z2_max: int) -> Optional[torch.Tensor]:
    """The upstream-form GRU's steps (ops/recurrent.py `gru_upstream_forward`, whose plan, input projections
    [B, T, 2C] and [B, T, C] and initial state it takes) on numpy arrays: every step's h [B, T, C] as int64, or None
    where they do not apply. `state_bound`: a bound of |h| over all steps; `z_max`, `z2_max`: of the gate and
    candidate accumulators."""
    rows, steps, cs2 = (int(s) for s in xg_all.shape)
    if not _applies(rows, cs2, xg_all.device, plan.wh_g, plan.wh_c):
        return None
    bh_max = int(plan.bh.abs().max()) if plan.bh.numel() else 0
    forms = _kept(plan.numpy_forms, ("gru", state_bound, bh_max), lambda: _gru_forms(plan, state_bound, bh_max))
    cs = cs2 // 2
    gates = table_step(plan.lut_rz, plan.z, z_max, 2 * cs) if forms is not None else None
    cand = table_step(plan.lut_c, plan.z2, z2_max, cs) if gates is not None else None
    if forms is None or gates is None or cand is None:
        return None
    assert isinstance(forms, _GruForms)
    qmax = float(2 ** (plan.bits - 1) - 1)
    xg, xc, hn = _numpy(xg_all), _numpy(xc_all), _numpy(h)
    bg, bc, bh = _numpy(plan.bg), _numpy(plan.bc), _numpy(plan.bh)
    ys = np.empty((rows, steps, cs), dtype=np.float64)
    for t in range(steps):
        hg = forms.wh_g.times(hn)
        for rq in forms.hg:
            hg = rq.values(hg)
        acc = np.add(xg[:, t], hg)
        acc += bg
        rz = gates[1](gates[0].positions(acc))
        r, u = rz[:, :cs], rz[:, cs:]
        if forms.hidden is not None:
            hc = forms.wh_c.times(hn)
            hc += bh
            hc = r * forms.hidden.values(hc)
        else:
            assert forms.reset is not None
            hc = forms.wh_c.times(forms.reset.values(r * hn))
        for rq in forms.hc:
            hc = rq.values(hc)
        acc = np.add(xc[:, t], hc)
        acc += bc
        c = cand[1](cand[0].positions(acc))
        cu = forms.cu.values((qmax - u) * c)
        cu += u * hn
        hn = forms.h.values(cu)
        ys[:, t] = hn
    return torch.from_numpy(ys).to(torch.int64)


# ------------------------------------------------------------------------------------------------------ the q15 forms
@dataclass(frozen=True)
class _Q15LstmForms:
    wh: StepWeights
    hidden: StepRequant
    cell_scales: Tuple[float, float]
    """2^(the shifts of f·c and i·g in the cell accumulator)"""
    cell: StepRequant
    cell_in: StepRequant
    cell_lookup: StepLookup
    out_h: StepRequant


def q15_lstm_steps(plan: Any, steps: Any, x_part: torch.Tensor, h: torch.Tensor, c: torch.Tensor, hq: int,
                   acc_bound: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The q15-form LSTM's steps (ops/recurrent.py `rnn_integer_forward`, whose plan and step plan, input
    projection `x_part` [B, T, 4C] and initial states in the hidden and cell formats it takes) on numpy arrays:
    (every step's Q30 product o·tanh(c) [B, T, C], the last c [B, C]) as int64, or None where they do not apply.
    `hq`: the bound of |h|; `acc_bound`: of the gate accumulators."""
    rows, count, cs4 = (int(s) for s in x_part.shape)
    (gate_in,), (hidden_matmul,) = plan.gate_in, plan.hidden
    if steps.gate_luts is None or not _applies(rows, cs4, x_part.device, hidden_matmul):
        return None
    fc_shift, ig_shift = steps.cell_shifts
    # the cell clip bounds every state after a step; an initial state beyond it widens the bound to a power of two,
    # so that new initial states make few new forms
    c0_max, clip = int(c.abs().max()) if c.numel() else 0, steps.cell.output_bound(2 ** 62)
    c_bound = clip if c0_max <= clip else max(clip, 1 << c0_max.bit_length())
    forms = _kept(plan.numpy_forms, ("lstm", c_bound), lambda: _q15_lstm_forms(plan, steps, hidden_matmul, hq, c_bound))
    gate_forms = table_step(steps.gate_luts, gate_in.requant, acc_bound, cs4, gate_in.clamp) \
        if forms is not None else None
    if forms is None or gate_forms is None:
        return None
    assert isinstance(forms, _Q15LstmForms)
    gates, gate_lookup = gate_forms
    cs = cs4 // 4
    xp, hn, cn = _numpy(x_part), _numpy(h), _numpy(c)
    products = np.empty((rows, count, cs), dtype=np.float64)
    fc_scale, ig_scale = forms.cell_scales
    for t in range(count):
        acc = np.add(xp[:, t], forms.hidden.values(forms.wh.times(hn)))
        gate = gate_lookup(gates.positions(acc))
        i, g, f, o = gate[:, :cs], gate[:, cs:2 * cs], gate[:, 2 * cs:3 * cs], gate[:, 3 * cs:]
        update = f * cn
        update *= fc_scale
        ig = i * g
        ig *= ig_scale
        update += ig
        cn = forms.cell.values(update)
        prod = o * forms.cell_lookup(forms.cell_in.positions(cn))
        hn = forms.out_h.values(prod)
        products[:, t] = prod
    return torch.from_numpy(products).to(torch.int64), torch.from_numpy(cn).to(torch.int64)


def _q15_lstm_forms(plan: Any, steps: Any, hidden_matmul: IntMatmul, hq: int, c_bound: int) -> Optional[_Q15LstmForms]:
    """The numpy forms of a q15-form LSTM's steps for cell states |c| <= `c_bound`, but the gates' requantization
    (its bound comes from each forward's input projection: `q15_lstm_steps` makes it)."""
    cs4 = int(hidden_matmul.w.shape[1])
    cs = cs4 // 4
    lut_gate, lut_cand, lut_cell = plan.luts
    fc_shift, ig_shift = steps.cell_shifts
    gate_max = max(lut_gate.absmax, lut_cand.absmax)
    cell_bound = (gate_max * c_bound << fc_shift) + (gate_max * gate_max << ig_shift)
    if min(fc_shift, ig_shift) < 0 or cell_bound >= FLOAT64_EXACT:
        return None
    wh = _weights(hidden_matmul.w, hq, hidden_matmul.col_absmax)
    hidden = step_requant(steps.hidden, steps.hidden_bound, cs4)
    cell = step_requant(steps.cell, cell_bound, cs)
    cell_in = table_step(lut_cell, steps.cell_in, steps.cell.output_bound(cell_bound), cs)
    out_h = step_requant(steps.out_h, gate_max * lut_cell.absmax, cs)
    if wh is None or hidden is None or cell is None or cell_in is None or out_h is None:
        return None
    return _Q15LstmForms(wh, hidden, (float(2 ** fc_shift), float(2 ** ig_shift)), cell, cell_in[0], cell_in[1],
                         out_h)


@dataclass(frozen=True)
class _Q15GruForms:
    wh_g: StepWeights
    wh_c: StepWeights
    gates_hidden: StepRequant
    reset: StepRequant
    cand_hidden: StepRequant
    out_h: StepRequant


def q15_gru_steps(plan: Any, steps: Any, x_gates: torch.Tensor, x_cand: torch.Tensor, h: torch.Tensor, hq: int,
                  align: int, linear_before_reset: bool, gates_acc_bound: int, cand_acc_bound: int
                  ) -> Optional[torch.Tensor]:
    """The q15-form GRU's steps (ops/recurrent.py `rnn_integer_forward`, whose plan and step plan, input
    projections [B, T, 2C] and [B, T, C] (the candidate's biases added) and initial hidden state it takes) on numpy
    arrays: every step's Q30 product [B, T, C] as int64, or None where they do not apply. `hq`: the bound of |h|;
    `align`: the shift of z·h into Q30."""
    rows, count, cs2 = (int(s) for s in x_gates.shape)
    gates_matmul, cand_matmul = plan.hidden
    if align < 0 or steps.prod_bound >= FLOAT64_EXACT or \
            not _applies(rows, cs2, x_gates.device, gates_matmul, cand_matmul):
        return None
    forms = _kept(plan.numpy_forms, ("gru", linear_before_reset),
                  lambda: _q15_gru_forms(plan, steps, hq, linear_before_reset))
    cs = cs2 // 2
    (gate_in, cand_in), (lut_gate, lut_cand) = plan.gate_in, plan.luts
    gates = table_step(lut_gate, gate_in.requant, gates_acc_bound, 2 * cs, gate_in.clamp) if forms is not None \
        else None
    cand = table_step(lut_cand, cand_in.requant, cand_acc_bound, cs, cand_in.clamp) if gates is not None else None
    if forms is None or gates is None or cand is None:
        return None
    assert isinstance(forms, _Q15GruForms)
    xg, xc, hn = _numpy(x_gates), _numpy(x_cand), _numpy(h)
    b_reset = _numpy(plan.b[3 * cs:4 * cs])
    one, scale = float(2 ** 15), float(2 ** align)
    products = np.empty((rows, count, cs), dtype=np.float64)
    for t in range(count):
        acc = np.add(xg[:, t], forms.gates_hidden.values(forms.wh_g.times(hn)))
        rz = gates[1](gates[0].positions(acc))
        r, z = rz[:, :cs], rz[:, cs:]
        if linear_before_reset:
            hc = forms.wh_c.times(hn)
            hc += b_reset
            hpart = forms.reset.values(r * hc)
        else:
            hpart = forms.wh_c.times(forms.reset.values(r * hn))
        acc = np.add(xc[:, t], forms.cand_hidden.values(hpart))
        n = cand[1](cand[0].positions(acc))
        prod = (one - z) * n
        zh = z * hn
        zh *= scale
        prod += zh
        hn = forms.out_h.values(prod)
        products[:, t] = prod
    return torch.from_numpy(products).to(torch.int64)


def _q15_gru_forms(plan: Any, steps: Any, hq: int, linear_before_reset: bool) -> Optional[_Q15GruForms]:
    """The numpy forms of a q15-form GRU's steps, but the gate and candidate requantizations (their bounds come
    from each forward's input projections: `q15_gru_steps` makes them)."""
    gates_matmul, cand_matmul = plan.hidden
    cs = int(cand_matmul.w.shape[1])
    wh_g = _weights(gates_matmul.w, hq, gates_matmul.col_absmax)
    wh_c = _weights(cand_matmul.w, hq if linear_before_reset else steps.reset_out, cand_matmul.col_absmax)
    gates_hidden = step_requant(steps.gates_hidden, steps.gates_hidden_bound, 2 * cs)
    reset = step_requant(steps.reset, steps.reset_bound, cs)
    cand_hidden = step_requant(steps.cand_hidden, steps.cand_hidden_bound, cs)
    out_h = step_requant(steps.out_h, steps.prod_bound, cs)
    if wh_g is None or wh_c is None or gates_hidden is None or reset is None or cand_hidden is None \
            or out_h is None or steps.reset_bound >= FLOAT64_EXACT:
        return None
    return _Q15GruForms(wh_g, wh_c, gates_hidden, reset, cand_hidden, out_h)
