"""The numpy forms of a requantization and a table lookup (ops/_recurrent_steps.py) against the torch ones they
stand in for (`Requantizer`, `PreparedLut`): the same integers on random accumulators within the bound they are made
for, per-tensor and per-column multipliers, zero points, clamps that act and clamps proven idle, direct and
interpolating tables over several column blocks, the q15 form's per-row clamp; and no form where the bound leaves
float64's exact range."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quantopt.ops._recurrent_steps import step_requant, table_step
from quantopt.quant.lut import PreparedLut
from quantopt.quant.requant import Requantizer

CPU = torch.device("cpu")


def _acc(seed: int, rows: int, columns: int, bound: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    acc = torch.randint(-bound, bound + 1, (rows, columns), generator=g, dtype=torch.int64)
    acc[0, 0], acc[-1, -1] = bound, -bound  # the bound itself, both signs
    return acc


@pytest.mark.parametrize("mult,shift,zp,lo,hi,bound", [
    (23456, 20, 0, -128, 127, 2 ** 20),          # a clamp that acts
    (23456, 24, 3, -128, 127, 2 ** 10),           # one proven idle, a zero point
    (1, 8, 0, -(2 ** 31), 2 ** 31 - 1, 2 ** 40),  # a rounding shift of int32-clamped values
    (32767, -2, 0, -32768, 32767, 2 ** 12),       # a left shift
    ("columns", "columns", 0, -127, 127, 2 ** 24),  # one multiplier and shift per column
])
def test_requantization_gives_the_requantizers_integers(mult, shift, zp, lo, hi, bound) -> None:
    columns = 12
    if mult == "columns":
        g = torch.Generator().manual_seed(1)
        mult = torch.randint(1, 2 ** 15, (columns,), generator=g)
        shift = torch.randint(12, 30, (columns,), generator=g)
    rq = Requantizer(mult, shift, zp, lo, hi, CPU)
    form = step_requant(rq, bound, columns)
    assert form is not None
    acc = _acc(2, 5, columns, bound)
    want = rq(acc)
    got = form.values(acc.numpy().astype(np.float64))
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, want.numpy())


def test_no_form_beyond_the_exact_range() -> None:
    """|acc · M| must stay below 2^53 and |acc · M · 2^-shift| below 2^50 for the bound the form is made for."""
    assert step_requant(Requantizer(2 ** 15, 20, 0, -128, 127, CPU), 2 ** 38, 4) is None  # acc · M reaches 2^53
    assert step_requant(Requantizer(1, 2, 0, -(2 ** 40), 2 ** 40, CPU), 2 ** 52, 4) is None  # acc · 2^-2 reaches 2^50
    assert step_requant(Requantizer(1, 3, 0, -(2 ** 40), 2 ** 40, CPU), 2 ** 52, 4) is not None  # below 2^50
    assert step_requant(Requantizer(2 ** 15, 20, 0, -128, 127, CPU), 2 ** 37 - 1, 4) is not None


@pytest.mark.parametrize("bits,blocks,row_clamp", [(8, 4, None), (16, 4, None), (8, 1, None), (16, 2, 20000),
                                                   (8, 4, 90)])
def test_lookup_gives_the_prepared_tables_values(bits: int, blocks: int, row_clamp) -> None:
    """Codes requantized straight to table positions, then looked up: a direct table (8-bit codes into 256 entries)
    or an interpolating one (16-bit codes into 256 entries, the floored interpolation), one table per block of
    columns; the q15 form's clamp of the codes to ±clamp per column before the lookup."""
    g = torch.Generator().manual_seed(3)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    tables = torch.randint(-(2 ** 15), 2 ** 15, (blocks, 256), generator=g)
    lut = PreparedLut(tables if blocks > 1 else tables[0], qmin, bits, bits, True)
    columns = 3 * blocks
    rq = Requantizer(30000, 14, 0, qmin, qmax, CPU)
    clamp = None if row_clamp is None else torch.full((columns,), row_clamp, dtype=torch.int64)
    made = table_step(lut, rq, 2 ** 22, columns, clamp)
    assert made is not None
    codes_form, lookup = made
    acc = _acc(4, 7, columns, 2 ** 22)
    codes = rq(acc)
    if clamp is not None:
        codes = torch.clamp(codes, -clamp, clamp)
    want = lut(codes, in_range=True)
    got = lookup(codes_form.positions(acc.numpy().astype(np.float64)))
    np.testing.assert_array_equal(got, want.numpy())
