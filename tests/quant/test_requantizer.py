"""Prepared requantization and table lookups (quant/requant.py `Requantizer`, the one-multiplier path of
`requantize_int`; quant/lut.py `PreparedLut`): the values of Python's exact half-to-even reference and of the
unprepared functions, ties, per-channel params, the int64 fallback beyond 2^53 and shapes that broadcasting would
enlarge included."""
from __future__ import annotations

from fractions import Fraction
from typing import List, Sequence

import pytest
import torch

from quantopt.quant.lut import PreparedLut, lookup_lut
from quantopt.quant.requant import Requantizer, requantize_int, scalar_params
from quantopt.quant.rounding import round_shift


def _reference(acc: Sequence[int], mult: Sequence[int], shift: Sequence[int], zp: int, lo: int, hi: int) -> List[int]:
    """clamp(round_half_even(acc * M / 2^shift) - zp, lo, hi) in exact rational arithmetic (M, shift per element)."""
    out = []
    for a, m, s in zip(acc, mult, shift):
        exact = Fraction(int(a) * int(m)) * (Fraction(2) ** -int(s))
        out.append(min(max(round(exact) - zp, lo), hi))
    return out


def _accumulators(seed: int, bound: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(-bound, bound, (2, 300), generator=g, dtype=torch.int64)
    v[0, :64] = torch.arange(-32, 32, dtype=torch.int64) * 16 + 8  # exact halves for shifts of 4
    return v


@pytest.mark.parametrize("mult, shift, zp, lo, hi", [
    (1, 4, 0, -128, 127),        # a plain rounding shift with ties
    (21465, 31, 0, -32768, 32767),
    (173, 9, 3, -128, 127),      # an output zero point
    (3, 2, 0, -(2 ** 31), 2 ** 31 - 1),   # shift below 3: the unscaled float64 path
    (5, -3, 0, -(2 ** 31), 2 ** 31 - 1),  # a left shift
])
def test_scalar_params_match_the_exact_reference(mult: int, shift: int, zp: int, lo: int, hi: int) -> None:
    acc = _accumulators(1, 2 ** 20)
    flat = acc.reshape(-1).tolist()
    want = torch.tensor(_reference(flat, [mult] * len(flat), [shift] * len(flat), zp, lo, hi)).reshape(acc.shape)
    for m, s in ((mult, shift), (torch.tensor([mult]), torch.tensor([shift])), (torch.tensor(mult), shift)):
        assert torch.equal(requantize_int(acc, m, s, zp, lo, hi), want), (m, s)
        assert torch.equal(Requantizer(m, s, zp, lo, hi, acc.device)(acc), want), (m, s)


@pytest.mark.parametrize("mult, shift, zp, lo, hi", [
    (1, 4, 0, -128, 127), (173, 9, 3, -128, 127), (21465, 31, 0, -32768, 32767), (12345, 20, -5, -127, 127),
    (7, 3, 0, -(2 ** 31), 2 ** 31 - 1), (3, 1, 1, -128, 127), (5, -2, 0, -(2 ** 31), 2 ** 31 - 1),
    (1, 0, 0, -(2 ** 31), 2 ** 31 - 1)])  # shifts below 3 and left shifts: the bound shows |acc * factor| < 2^50
@pytest.mark.parametrize("bound", [2 ** 6, 2 ** 11, 2 ** 20])
def test_small_accumulators_with_a_bound_match_the_exact_reference(mult: int, shift: int, zp: int, lo: int,
                                                                    hi: int, bound: int) -> None:
    """A proven bound takes the one-call path of small CPU accumulators, without the clamp where the bound keeps
    every value in range (the largest |acc| included); `output_bound` bounds the outputs of such inputs."""
    g = torch.Generator().manual_seed(bound)
    acc = torch.randint(-bound, bound + 1, (3, 96), generator=g, dtype=torch.int64)
    acc[0, :2] = torch.tensor([-bound, bound])
    flat = acc.reshape(-1).tolist()
    want = torch.tensor(_reference(flat, [mult] * len(flat), [shift] * len(flat), zp, lo, hi)).reshape(acc.shape)
    prepared = Requantizer(mult, shift, zp, lo, hi, acc.device)
    assert torch.equal(prepared(acc, bound), want)
    assert int(want.abs().max()) <= prepared.output_bound(bound)
    per_row = Requantizer(torch.full((96,), mult), torch.full((96,), shift), zp, lo, hi, acc.device)
    assert torch.equal(per_row(acc, bound), want)


def test_output_bound_is_within_the_clamp() -> None:
    prepared = Requantizer(3, 1, 2, -128, 127, torch.device("cpu"))
    assert prepared.output_bound(10) == 15 + 2  # ceil(10 * 3 / 2) plus |zp|
    assert prepared.output_bound(10 ** 6) == 128


def test_per_channel_params_match_the_exact_reference() -> None:
    acc = _accumulators(2, 2 ** 24)
    g = torch.Generator().manual_seed(3)
    mult = torch.randint(1, 2 ** 15, (300,), generator=g, dtype=torch.int64)
    shift = torch.randint(4, 40, (300,), generator=g, dtype=torch.int64)
    want = [_reference(row, mult.tolist(), shift.tolist(), 0, -128, 127) for row in acc.tolist()]
    prepared = Requantizer(mult, shift, 0, -128, 127, acc.device)
    assert prepared(acc).tolist() == want
    assert requantize_int(acc, mult, shift, 0, -128, 127).tolist() == want
    # a shared shift given as one value next to per-channel multipliers
    one = Requantizer(mult, torch.tensor([20]), 0, -(2 ** 15), 2 ** 15 - 1, acc.device)(acc)
    assert torch.equal(one, requantize_int(acc, mult, torch.tensor([20]), 0, -(2 ** 15), 2 ** 15 - 1))


def test_products_beyond_2_53_take_the_int64_path() -> None:
    # |acc * M| reaches 2^59, beyond float64's exact integers: 35185177378817 * M is one above a tie (2^29 + 1
    # modulo 2^30) with an even quotient, which a float64 product would round to the tie and then down
    acc = torch.tensor([[35185177378817, -35185177378817, 2 ** 45 + 3, 7]], dtype=torch.int64)
    mult, shift = 2 ** 14 + 1, 30
    want = torch.clamp(round_shift(acc * mult, shift), -(2 ** 31), 2 ** 31 - 1)
    assert want.tolist() == [_reference(acc[0].tolist(), [mult] * 4, [shift] * 4, 0, -(2 ** 31), 2 ** 31 - 1)]
    assert torch.equal(requantize_int(acc, mult, shift, 0, -(2 ** 31), 2 ** 31 - 1), want)
    assert torch.equal(Requantizer(mult, shift, 0, -(2 ** 31), 2 ** 31 - 1, acc.device)(acc), want)


def test_shapes_are_those_of_broadcasting() -> None:
    scalar = torch.tensor(37, dtype=torch.int64)
    one = torch.tensor([1], dtype=torch.int64)
    # a one-element multiplier of more dimensions than the accumulator enlarges it, as torch broadcasting does
    assert requantize_int(scalar, one, torch.tensor([1]), 0, -128, 127).shape == (1,)
    assert Requantizer(one, torch.tensor([1]), 0, -128, 127, scalar.device)(scalar).shape == (1,)
    assert scalar_params(one, 1, 0) is None
    assert scalar_params(one, 1, 1) == (1, 1)
    assert scalar_params(torch.tensor([1.0]), 1, 1) is None  # a float multiplier is not an integer one
    assert scalar_params(True, 1, 1) is None
    assert Requantizer(5, 1, 0, -128, 127, scalar.device)(torch.empty(0, dtype=torch.int64)).shape == (0,)


def _lookup_reference(code: int, table: List[int], in_qmin: int, in_bits: int, out_bits: int,
                      restricted: bool) -> int:
    """The documented lookup of one signed code, in Python integers."""
    offset = in_qmin - 1 if restricted and in_qmin < 0 else in_qmin
    index = min(max(code - offset, 0), 2 ** in_bits - 1)
    b = in_bits - (len(table).bit_length() - 1)
    padded = table + table[-1:]
    if b > 0:
        hi, lo = index >> b, index & ((1 << b) - 1)
        value = padded[hi] + (((padded[hi + 1] - padded[hi]) * lo) >> b)
    else:
        value = padded[min(index, len(table) - 1)]
    return min(max(value, -(2 ** (out_bits - 1))), 2 ** (out_bits - 1) - 1)


def test_prepared_lookup_equals_the_lookup() -> None:
    g = torch.Generator().manual_seed(4)
    for in_bits, size, restricted in ((8, 256, False), (16, 256, True), (10, 1024, False), (16, 512, False)):
        table = torch.randint(-40000, 40000, (size,), generator=g, dtype=torch.int64)
        codes = torch.randint(-(2 ** (in_bits - 1)) - 3, 2 ** (in_bits - 1) + 3, (3, 200), generator=g)
        for out_bits in (16, 32):  # with and without the output clamp
            args = (-(2 ** (in_bits - 1)), in_bits, out_bits, True, restricted)
            prepared = PreparedLut(table, *args)
            direct = lookup_lut(codes, table, *args)
            assert torch.equal(prepared(codes), direct)
            entries = table.tolist()
            want = [_lookup_reference(c, entries, args[0], in_bits, out_bits, restricted) for c in codes[0].tolist()]
            assert prepared(codes)[0].tolist() == want
            assert torch.equal(prepared(codes.to(torch.float64)), direct)  # float codes are rounded first
    with pytest.raises(ValueError, match="2\\^N entries"):
        PreparedLut(torch.zeros(100, dtype=torch.int64), -128, 8, 8, True)


@pytest.mark.parametrize("in_bits, size, restricted", [(8, 256, False), (8, 256, True), (16, 256, False)])
def test_codes_proven_in_range_look_up_the_same_values(in_bits: int, size: int, restricted: bool) -> None:
    """`covers` says which code ranges need no index clamp; their lookups with `in_range` are the clamped ones."""
    g = torch.Generator().manual_seed(size + in_bits)
    table = torch.randint(-40000, 40000, (size,), generator=g, dtype=torch.int64)
    qmin, qmax = -(2 ** (in_bits - 1)), 2 ** (in_bits - 1) - 1
    prepared = PreparedLut(table, qmin, in_bits, 16, True, restricted)
    lo = qmin - 1 if restricted else qmin  # a restricted signed range's table has an entry below qmin
    assert prepared.covers(lo, lo + 2 ** in_bits - 1) and prepared.covers(qmin + 1, qmax - 1)
    assert not prepared.covers(lo - 1, qmax) and not prepared.covers(lo, lo + 2 ** in_bits)
    codes = torch.randint(lo, lo + 2 ** in_bits, (3, 200), generator=g)
    codes[0, :2] = torch.tensor([lo, lo + 2 ** in_bits - 1])
    assert torch.equal(prepared(codes, in_range=True), prepared(codes))


@pytest.mark.parametrize("in_bits", [8, 16])
def test_stacked_tables_look_up_each_block_in_its_own_table(in_bits: int) -> None:
    """K tables over K equal blocks of the last axis (a cell's gate blocks; one per channel when K is the channel
    count): each block's values are those of its own table's lookup."""
    g = torch.Generator().manual_seed(8)
    tables = torch.randint(-40000, 40000, (4, 256), generator=g, dtype=torch.int64)
    codes = torch.randint(-(2 ** (in_bits - 1)), 2 ** (in_bits - 1), (3, 4 * 6), generator=g)
    args = (-(2 ** (in_bits - 1)), in_bits, 16, True)
    got = PreparedLut(tables, *args)(codes)
    for k, block in enumerate(codes.chunk(4, dim=1)):
        assert torch.equal(got[:, 6 * k:6 * (k + 1)], lookup_lut(block, tables[k], *args))
    per_channel = lookup_lut(codes[:, :4], tables, *args)  # a table per channel: blocks of one column
    assert torch.equal(per_channel, torch.stack([lookup_lut(codes[:, c], tables[c], *args) for c in range(4)], 1))
    with pytest.raises(ValueError, match="multiple of 4 columns"):
        PreparedLut(tables, *args)(codes[:, :5])


@pytest.mark.parametrize("bound", [2 ** 11, None])  # the small path, and the general one
@pytest.mark.parametrize("zp", [0, 3])
def test_minus_and_float64_results_are_the_values_less_minus(bound, zp: int) -> None:
    """`minus` (an integer, or a tensor per column) is subtracted from the requantized values and `as_float64`
    gives them as float64 integers, on every path; float64 accumulators holding integers are read as int64 ones."""
    g = torch.Generator().manual_seed(21 + zp)
    acc = torch.randint(-2 ** 11, 2 ** 11 + 1, (2, 96), generator=g, dtype=torch.int64)
    per_column = torch.randint(-300, 300, (96,), generator=g, dtype=torch.int64)
    prepared = Requantizer(173, 9, zp, -128, 127, acc.device)
    want = prepared(acc, bound)
    for minus in (0, -129, per_column):
        for a in (acc, acc.to(torch.float64)):
            got = prepared(a, bound, minus=minus)
            assert got.dtype == torch.int64 and torch.equal(got, want - minus)
            got = prepared(a, bound, minus=minus, as_float64=True)
            assert got.dtype == torch.float64 and torch.equal(got, (want - minus).to(torch.float64))


@pytest.mark.parametrize("blocks", [1, 4])
def test_codes_less_the_index_offset_take_the_lookup_values(blocks: int) -> None:
    """A direct table's lookup of codes in range equals `take_indexed` of the codes less `index_offset`; a
    16-bit code into a 256-entry table interpolates, so it is not direct."""
    g = torch.Generator().manual_seed(9 + blocks)
    tables = torch.randint(-40000, 40000, (blocks, 256), generator=g, dtype=torch.int64).squeeze(0)
    for restricted in (False, True):
        prepared = PreparedLut(tables, -128, 8, 16, True, restricted)
        assert prepared.direct
        codes = torch.randint(-127, 128, (3, 4 * 6), generator=g)
        offset = prepared.index_offset(4 * 6, codes.device)
        assert offset is prepared.index_offset(4 * 6, codes.device) or isinstance(offset, int)
        assert torch.equal(prepared.take_indexed(codes - offset), prepared(codes, in_range=True))
        as_float = prepared.take_indexed(codes - offset, torch.float64)
        assert as_float.dtype == torch.float64 and torch.equal(as_float, prepared(codes).to(torch.float64))
    assert not PreparedLut(tables, -32768, 16, 16, True).direct


def test_small_call_decisions_are_kept_per_kind_of_call() -> None:
    """The small path's decisions are kept per shape, bound and `minus`: another `minus` tensor (even one of the
    same shape) gets its own, and bounds taken from the data do not grow the kept decisions without end."""
    from quantopt.quant import requant

    acc = torch.arange(-96, 96, dtype=torch.int64).reshape(2, 96) * 37
    prepared = Requantizer(173, 9, 0, -128, 127, acc.device)
    want = prepared(acc)
    first, second = torch.arange(96), torch.arange(96) * 2
    assert torch.equal(prepared(acc, 2 ** 12, minus=first), want - first)
    assert torch.equal(prepared(acc, 2 ** 12, minus=second), want - second)
    for bound in range(2 ** 12, 2 ** 12 + 3 * requant.SMALL_CALLS_KEPT):
        assert torch.equal(prepared(acc, bound), want)
    assert len(prepared._small_calls) <= requant.SMALL_CALLS_KEPT
