"""ops/_lut_int.py `take_codes`: per-code tables read by integer codes, None for a code outside the table."""
from __future__ import annotations

import torch

from quantopt.ops import _lut_int as lut_int
from quantopt.ops._lut_int import take_codes


def test_codes_in_range_read_their_entries_in_the_codes_shape() -> None:
    values = torch.arange(256, dtype=torch.int64) * 3 - 7  # the results of codes -128..127
    codes = torch.tensor([[-128, 0], [127, -1]])
    got = take_codes(values, codes, -128)
    assert got is not None and got.shape == codes.shape
    assert torch.equal(got, (codes + 128) * 3 - 7)


def test_a_code_below_or_above_the_table_gives_none() -> None:
    values = torch.arange(256, dtype=torch.int64)
    for bad in (-129, 128, 1000):
        assert take_codes(values, torch.tensor([0, bad, 5]), -128) is None


def test_no_codes_give_an_empty_result() -> None:
    got = take_codes(torch.arange(4), torch.zeros(0, 3, dtype=torch.int64), 0)
    assert got is not None and got.shape == (0, 3)


def test_one_table_per_channel_of_the_last_axis_is_interleaved() -> None:
    values = torch.arange(4 * 3, dtype=torch.int64) * 10  # codes 0..3, channels 0..2: entry code * 3 + channel
    codes = torch.tensor([[0, 1, 2], [3, 3, 0]])
    got = take_codes(values, codes, 0, channels=3)
    assert got is not None and torch.equal(got, (codes * 3 + torch.arange(3)) * 10)
    assert take_codes(values, torch.tensor([[0, 4, 1]]), 0, channels=3) is None  # above the last code
    assert take_codes(values, torch.tensor([[0, 1, -1]]), 0, channels=3) is None  # below the first


def test_large_codes_are_read_in_bands(monkeypatch) -> None:
    """Codes of more than two bands go band by band through one index buffer (`_take_in_bands`): with bands of 5
    the same entries in the codes' shape, any integer dtype of codes, and None when a code of any band, the short
    last one included, lies outside the table."""
    monkeypatch.setattr(lut_int, "TAKE_BAND_ELEMENTS", 5)
    values = torch.arange(256, dtype=torch.int64) * 7 - 300
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (3, 4, 6), generator=g)
    want = (codes + 128) * 7 - 300
    for dtype in (torch.int64, torch.int32, torch.int16):
        got = take_codes(values, codes.to(dtype), -128)
        assert got is not None and got.shape == codes.shape and torch.equal(got, want)
    for position in (0, 37, 71):  # the first band, a middle one, the last (short) one
        bad = codes.clone()
        bad.view(-1)[position] = 128
        assert take_codes(values, bad, -128) is None
