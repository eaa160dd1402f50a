"""ops/_lut_int.py `take_codes`: per-code tables read by integer codes, None for a code outside the table."""
from __future__ import annotations

import torch

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
