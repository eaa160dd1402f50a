"""LUT construction and lookup (docs/integer-semantics.md, Lookup-table methods), with upstream's sigmoid example."""
from __future__ import annotations

import pytest
import torch

from quantopt.quant.lut import build_lut, lookup_lut, lut_sample_points, lut_size


def test_example_sigmoid_lut() -> None:
    """uint8 in (s=66.1239, zp=0) → uint8 out (s=260.5147, zp=0): 130, 131, 132, ... 255."""
    lut = build_lut(torch.sigmoid, 66.1239, 0, 0, 255, 8, 260.5147, 0, 0, 255)
    assert lut.shape == (256,)
    assert lut[:3].tolist() == [130, 131, 132] and int(lut[-1]) == 255
    i = torch.arange(256, dtype=torch.float64)
    closed_form = torch.clamp(torch.round(torch.sigmoid(i / 66.1239) * 260.5147), 0, 255).long()
    assert torch.equal(lut, closed_form)
    # the forward is a direct lookup: output = lut[x_q]
    x = torch.tensor([0, 1, 77, 255])
    assert torch.equal(lookup_lut(x, lut, 0, 8, 8, out_signed=False), lut[x])


@pytest.mark.parametrize("in_bits,items,expected", [(8, 8, 256), (16, 8, 256), (16, 10, 1024), (4, 8, 16)])
def test_lut_size(in_bits: int, items: int, expected: int) -> None:
    assert lut_size(in_bits, items) == expected


def test_sample_points() -> None:
    assert lut_sample_points(0, 255, 256).tolist() == list(range(256))
    assert lut_sample_points(-128, 127, 256).tolist() == list(range(-128, 128))
    # signed restricted range: 255 points over [-127, 127] with -127 prepended, 256 entries in all
    pts = lut_sample_points(-127, 127, 256)
    assert pts.numel() == 256 and pts[:2].tolist() == [-127.0, -127.0] and pts[-1] == 127
    # 16-bit input, 2^10 table: float32 linspace, not integers
    pts = lut_sample_points(-32768, 32767, 1024)
    assert pts[0] == -32768 and pts[-1] == 32767 and not bool((pts == pts.round()).all())


def test_restricted_signed_table_and_lookup_agree() -> None:
    """The prepended entry makes index x - (qmin - 1) address the sample of x."""
    lut = build_lut(torch.tanh, 40.0, 0, -127, 127, 8, 127.0, 0, -127, 127)
    assert int(lut[0]) == int(lut[1]) == -127
    x = torch.arange(-127, 128)
    y = lookup_lut(x, lut, -127, 8, 8, out_signed=True, in_restricted=True)
    expected = torch.clamp(torch.round(torch.tanh(x.float() / 40.0) * 127.0), -127, 127).long()
    assert torch.equal(y, expected)


def test_asymmetric_input_and_output() -> None:
    lut = build_lut(torch.sigmoid, 20.0, -10, -128, 127, 8, 255.0, -128, -128, 127)
    x = torch.arange(-128, 128)
    xf = (x.float() - 10) * (1.0 / 20.0)
    expected = torch.clamp(torch.round(torch.sigmoid(xf) * 255.0 + 128), -128, 127).long()
    assert torch.equal(lookup_lut(x, lut, -128, 8, 8, out_signed=True), expected)


def test_mirror_offset() -> None:
    """f - offset is quantized (so the symmetric output range is used around the offset), then
    round(offset * s_out) is added back, outside the clamp (upstream's RNN sigmoid)."""
    mirrored = build_lut(torch.sigmoid, 30.0, 0, -128, 127, 8, 254.0, 0, -127, 127, mirror_offset=0.5)
    x = torch.arange(-128, 128).float() * (1.0 / 30.0)
    centred = torch.clamp(torch.round((torch.sigmoid(x) - 0.5) * 254.0), -127, 127).long()
    assert torch.equal(mirrored, centred + 127)
    assert int(mirrored.max()) == 250 and int(mirrored.min()) == 4


def _sixteen_bit_sigmoid():
    s_in, s_out = 4096.0, 65535.0
    lut = build_lut(torch.sigmoid, s_in, 0, -32768, 32767, 16, s_out, 0, 0, 65535, lut_items_in_bits=10)
    x = torch.arange(-32768, 32768)
    y = lookup_lut(x, lut, -32768, 16, 16, out_signed=False)
    return s_in, s_out, lut, x, y


def test_interpolation_16_bit_within_one_lsb_of_float_interpolation() -> None:
    """int16 input, 2^10 table: high 10 bits index, low 6 bits interpolate, floored: the result is within
    [ref - 1, ref] of the exact (rational) linear interpolation of the same table."""
    _, _, lut, x, y = _sixteen_bit_sigmoid()
    assert lut.numel() == 1024
    pos = (x + 32768).double() / 64
    lo = pos.floor().long()
    table = torch.cat([lut, lut[-1:]]).double()
    ref = table[lo] + (table[lo + 1] - table[lo]) * (pos - lo)
    diff = ref - y.double()
    assert float(diff.min()) >= 0.0 and float(diff.max()) < 1.0
    # exact on the table nodes
    nodes = x[(x + 32768) % 64 == 0]
    assert torch.equal(lookup_lut(nodes, lut, -32768, 16, 16), lut)


def test_interpolation_16_bit_vs_float_function() -> None:
    """Against the float function the error stays within ~1.6 LSB once the table's own sample grid is used: entry
    i holds f at code qmin + i·65535/1023 while the lookup reads it at qmin + 64·i (upstream does the same; in the
    middle of the range the two grids are 32 codes apart, ~128 LSB of this sigmoid)."""
    s_in, s_out, _, x, y = _sixteen_bit_sigmoid()
    pos = (x + 32768).double() / 64
    table_grid = -32768 + pos * 65535 / 1023
    err = y.double() - torch.sigmoid(table_grid / s_in) * s_out
    assert float(err.abs().max()) < 1.6
    skew = y.double() - torch.sigmoid(x.double() / s_in) * s_out
    assert 100 < float(skew.abs().max()) < 130


def test_lookup_clamps_to_the_table_dtype_and_input_range() -> None:
    lut = torch.tensor([-300, 0, 300, 1000])
    assert lookup_lut(torch.tensor([0, 1, 2, 3]), lut, 0, 2, 8, out_signed=True).tolist() == [-128, 0, 127, 127]
    assert lookup_lut(torch.tensor([-5, 9]), lut, 0, 2, 16, out_signed=True).tolist() == [-300, 1000]


def test_interpolation_floors_negative_slopes() -> None:
    lut = torch.tensor([10, 7])  # 1-bit table, 3-bit input: 2 fraction bits
    y = lookup_lut(torch.arange(8), lut, 0, 3, 8, out_signed=True)
    # (7 - 10) * lo >> 2 with an arithmetic shift: -3*1>>2 = -1, -3*2>>2 = -2, -3*3>>2 = -3
    assert y.tolist() == [10, 9, 8, 7, 7, 7, 7, 7]


def test_table_must_have_power_of_two_entries() -> None:
    with pytest.raises(ValueError):
        lookup_lut(torch.tensor([0]), torch.tensor([1, 2, 3]), 0, 8, 8)
