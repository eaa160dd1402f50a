"""ops/_permute.py: the blocked 2-D transposes give exactly `x.permute(*perm).contiguous()`."""
from __future__ import annotations

import itertools

import pytest
import torch

from quantopt.ops import _permute
from quantopt.ops._permute import permuted_copy, rotation


@pytest.mark.parametrize("perm, want", [
    ((0, 3, 1, 2), (1, 3)),   # NHWC -> NCHW: the last axis in front of H, W
    ((0, 2, 3, 1), (1, 2)),   # NCHW -> NHWC
    ((1, 0), (0, 1)),         # a plain 2-D transpose
    ((0, 2, 1), (1, 2)),      # a batch of them
    ((2, 0, 1), (0, 2)),
    ((0, 1, 4, 2, 3), (2, 4)),
])
def test_rotation_finds_the_matrices(perm, want):
    assert rotation(perm) == want


@pytest.mark.parametrize("perm", [(0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2), (3, 2, 1, 0), (0, 3, 2, 1), (0,)])
def test_other_permutations_are_not_rotations(perm):
    assert rotation(perm) is None


@pytest.fixture
def small_thresholds(monkeypatch):
    """Thresholds low enough that small tensors take the blocked path."""
    monkeypatch.setattr(_permute, "BLOCKED_MIN_BYTES", 1)
    monkeypatch.setattr(_permute, "BLOCKED_MIN_COLUMNS", 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int8, torch.bool])
def test_every_permutation_of_4_axes_matches_the_ordinary_copy(small_thresholds, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, 7, 3, generator=g) * 50).to(dtype)
    for perm in itertools.permutations(range(4)):
        got = permuted_copy(x, perm)
        want = x.permute(*perm).contiguous()
        assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
        assert torch.equal(got, want), perm


def test_large_nhwc_to_nchw_takes_the_blocked_copy_with_the_same_values(monkeypatch):
    calls = []
    real = torch.Tensor.copy_

    def counting_copy(self, src, *args, **kwargs):
        calls.append(tuple(src.shape))
        return real(self, src, *args, **kwargs)

    x = torch.randn(2, 128, 80, 64, generator=torch.Generator().manual_seed(1))  # [10240, 64] float32 per sample
    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    got = permuted_copy(x, [0, 3, 1, 2])
    monkeypatch.undo()
    assert calls == [(64, 10240), (64, 10240)]  # one blocked 2-D transpose per sample
    assert torch.equal(got, x.permute(0, 3, 1, 2).contiguous())


def test_small_views_and_differentiable_inputs_take_the_ordinary_copy(small_thresholds):
    x = torch.randn(4, 6, 8)
    view = x[:, ::2]  # not contiguous
    assert torch.equal(permuted_copy(view, [0, 2, 1]), view.permute(0, 2, 1).contiguous())
    w = torch.randn(3, 40, 30, requires_grad=True)
    y = permuted_copy(w, [0, 2, 1])
    y.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_many_matrices_take_the_ordinary_copy(small_thresholds):
    x = torch.randn(_permute.BLOCKED_MAX_MATRICES + 1, 3, 4)
    assert torch.equal(permuted_copy(x, [0, 2, 1]), x.permute(0, 2, 1).contiguous())
