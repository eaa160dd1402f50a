"""Float forward of Pooling (MAX / AVG) against torch pooling and a naive per-window reference."""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F

from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder

ATOL = 1e-5


def run_pool(x: torch.Tensor, out_shape: Sequence[int], params: Dict, ir_batch: Optional[int] = None) -> torch.Tensor:
    b = GraphBuilder("t")
    shape, oshape = list(x.shape), list(out_shape)
    if ir_batch is not None:
        shape[0] = oshape[0] = ir_batch
    out = b.layer("Pooling", [b.input("x", shape)], [oshape], name="pool", params=params)
    return b.build([out]).forward([x])[0]


def pool_params(method, k, s=(1, 1), pads=(0, 0, 0, 0), d=(1, 1), ceil=False, include=None):
    p = {"method": method, "kernel_y": k[0], "kernel_x": k[1], "stride_y": s[0], "stride_x": s[1],
         "pad_left": pads[0], "pad_right": pads[1], "pad_top": pads[2], "pad_bottom": pads[3],
         "dilation_y": d[0], "dilation_x": d[1], "ceil_mode": ceil}
    if include is not None:
        p["count_include_pad"] = include
    return p


def _nchw(x):
    return x.permute(0, 3, 1, 2)


def _nhwc(x):
    return x.permute(0, 2, 3, 1)


def _out_size(n, k, s, d, before, after, ceil):
    k_ext = d * (k - 1) + 1
    span = (n + before + after - k_ext) / s
    out = (math.ceil(span) if ceil else math.floor(span)) + 1
    if ceil and (out - 1) * s >= n + before:
        out -= 1
    return out


def naive_pool(x_nhwc, method, k, s, pads, d=(1, 1), ceil=False, include=False):
    """Window-by-window ONNX/PyTorch semantics: cells beyond the padded input never count."""
    n, h, w, c = x_nhwc.shape
    left, right, top, bottom = pads
    oh = _out_size(h, k[0], s[0], d[0], top, bottom, ceil)
    ow = _out_size(w, k[1], s[1], d[1], left, right, ceil)
    y = torch.empty(n, oh, ow, c)
    for i in range(oh):
        for j in range(ow):
            rows = [i * s[0] - top + a * d[0] for a in range(k[0])]
            cols = [j * s[1] - left + b * d[1] for b in range(k[1])]
            real = [(r, q) for r in rows for q in cols if 0 <= r < h and 0 <= q < w]
            vals = torch.stack([x_nhwc[:, r, q, :] for r, q in real])
            if method == "MAX":
                y[:, i, j, :] = vals.max(0).values
                continue
            inside = sum(1 for r in rows for q in cols if -top <= r < h + bottom and -left <= q < w + right)
            y[:, i, j, :] = vals.sum(0) / (inside if include else len(real))
    return y


# ------------------------------------------------------------------------------------------------ vs torch
TORCH_CASES = [
    # kernel, stride, symmetric pad (h, w), dilation, ceil_mode, H, W
    ((3, 3), (2, 2), (1, 1), (1, 1), False, 8, 9),
    ((3, 3), (2, 2), (1, 1), (1, 1), True, 8, 9),
    ((2, 2), (2, 2), (0, 0), (1, 1), True, 7, 7),
    ((3, 3), (2, 2), (0, 0), (1, 1), True, 46, 46),
    ((3, 2), (1, 2), (1, 0), (1, 1), True, 6, 9),
    ((2, 3), (3, 2), (1, 1), (1, 1), False, 10, 11),
]


@pytest.mark.parametrize("k,s,p,d,ceil,h,w", TORCH_CASES)
def test_max_pool_matches_torch(k, s, p, d, ceil, h, w):
    torch.manual_seed(0)
    x = torch.randn(3, h, w, 4)
    ref = _nhwc(F.max_pool2d(_nchw(x), k, s, padding=p, dilation=d, ceil_mode=ceil))
    y = run_pool(x, ref.shape, pool_params("MAX", k, s, (p[1], p[1], p[0], p[0]), d, ceil), ir_batch=1)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("k,s,p,d,ceil,h,w", TORCH_CASES)
def test_avg_pool_matches_torch(k, s, p, d, ceil, h, w, include):
    torch.manual_seed(1)
    x = torch.randn(2, h, w, 3)
    ref = _nhwc(F.avg_pool2d(_nchw(x), k, s, padding=p, ceil_mode=ceil, count_include_pad=include))
    y = run_pool(x, ref.shape, pool_params("AVG", k, s, (p[1], p[1], p[0], p[0]), d, ceil, include))
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


def test_max_pool_dilation_matches_torch():
    torch.manual_seed(2)
    x = torch.randn(2, 11, 10, 3)
    for ceil in (False, True):
        ref = _nhwc(F.max_pool2d(_nchw(x), (3, 2), (2, 1), padding=(1, 1), dilation=(2, 3), ceil_mode=ceil))
        y = run_pool(x, ref.shape, pool_params("MAX", (3, 2), (2, 1), (1, 1, 1, 1), (2, 3), ceil))
        torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ asymmetric pads
ASYM_PADS = [(0, 1, 1, 0), (2, 0, 0, 2), (1, 2, 0, 1)]


@pytest.mark.parametrize("pads", ASYM_PADS)
def test_asymmetric_pads_floor_mode_match_torch_on_padded_input(pads):
    torch.manual_seed(3)
    x = torch.randn(2, 7, 8, 3)
    k, s = (3, 3), (2, 2)
    xc = _nchw(x)
    ref_max = _nhwc(F.max_pool2d(F.pad(xc, pads, value=float("-inf")), k, s))
    ref_inc = _nhwc(F.avg_pool2d(F.pad(xc, pads), k, s))
    sums = F.avg_pool2d(F.pad(xc, pads), k, s, divisor_override=1)
    ref_exc = _nhwc(sums / F.avg_pool2d(F.pad(torch.ones_like(xc), pads), k, s, divisor_override=1))
    for method, include, ref in (("MAX", None, ref_max), ("AVG", True, ref_inc), ("AVG", False, ref_exc)):
        y = run_pool(x, ref.shape, pool_params(method, k, s, pads, include=include))
        torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("pads", ASYM_PADS)
@pytest.mark.parametrize("method,include", [("MAX", False), ("AVG", False), ("AVG", True)])
def test_asymmetric_pads_ceil_mode_match_naive(pads, method, include):
    torch.manual_seed(4)
    x = torch.randn(2, 8, 7, 3)
    ref = naive_pool(x, method, (3, 3), (2, 3), pads, ceil=True, include=include)
    y = run_pool(x, ref.shape, pool_params(method, (3, 3), (2, 3), pads, ceil=True, include=include))
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


def test_ceil_mode_drops_window_starting_in_right_padding():
    # W=5, k=2, s=2, pad_right=1: ceil((5+1-2)/2)+1 = 3 windows start at 0, 2, 4; all start inside the input.
    # W=4, k=2, s=2, pad_right=1: ceil((4+1-2)/2)+1 = 3, but the third would start at 4 (in the padding): dropped.
    x = torch.arange(4.0).reshape(1, 1, 4, 1)
    y = run_pool(x, (1, 1, 2, 1), pool_params("AVG", (1, 2), (1, 2), (0, 1, 0, 0), ceil=True, include=True))
    torch.testing.assert_close(y.flatten(), torch.tensor([0.5, 2.5]))


def test_avg_pool_dilation_matches_naive():
    torch.manual_seed(5)
    x = torch.randn(2, 9, 10, 2)
    for include in (False, True):
        ref = naive_pool(x, "AVG", (2, 3), (2, 1), (1, 0, 2, 1), d=(3, 2), ceil=True, include=include)
        y = run_pool(x, ref.shape, pool_params("AVG", (2, 3), (2, 1), (1, 0, 2, 1), (3, 2), True, include))
        torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ special forms
def test_global_average_and_max_pool():
    torch.manual_seed(6)
    x = torch.randn(4, 12, 96, 8)
    y = run_pool(x, (4, 1, 1, 8), pool_params("AVG", (12, 96), include=False), ir_batch=1)
    torch.testing.assert_close(y, x.mean(dim=(1, 2), keepdim=True), atol=ATOL, rtol=1e-5)
    y = run_pool(x, (4, 1, 1, 8), pool_params("MAX", (12, 96)))
    torch.testing.assert_close(y, x.amax(dim=(1, 2), keepdim=True))


def test_count_include_pad_defaults_to_false():
    torch.manual_seed(7)
    x = torch.randn(1, 5, 5, 2)
    ref = _nhwc(F.avg_pool2d(_nchw(x), 3, 2, padding=1, count_include_pad=False))
    y = run_pool(x, ref.shape, pool_params("AVG", (3, 3), (2, 2), (1, 1, 1, 1)))
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=1e-5)


def test_one_d_input_pools_along_width():
    torch.manual_seed(8)
    x = torch.randn(2, 9, 3)
    ref = F.max_pool1d(x.permute(0, 2, 1), 3, 2, padding=1, ceil_mode=True).permute(0, 2, 1)
    params = {"method": "MAX", "kernel_x": 3, "stride_x": 2, "pad_left": 1, "pad_right": 1, "ceil_mode": True}
    y = run_pool(x, ref.shape, params)
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("params,match", [
    ({"method": "LP3"}, "method 'LP3'"),
    ({"ceil_mode": "maybe"}, "ceil_mode"),
    ({"count_include_pad": 2, "method": "AVG"}, "count_include_pad"),
    ({"stride_x": 0}, "stride_x"),
    ({"kernel_x": 9}, "larger than the padded input"),
    ({"pad_left": 3}, "only padding"),
    ({"dilation_y": 1.5}, "dilation_y"),
])
def test_pooling_rejects_bad_params(params, match):
    base = pool_params("MAX", (2, 2), (2, 2))
    with pytest.raises(IRError, match=match):
        run_pool(torch.randn(1, 6, 6, 2), (1, 3, 3, 2), {**base, **params})


def test_pooling_requires_method():
    params = pool_params("MAX", (2, 2), (2, 2))
    del params["method"]
    with pytest.raises(IRError, match="layer 'pool'.*'method'"):
        run_pool(torch.randn(1, 6, 6, 2), (1, 3, 3, 2), params)


# ------------------------------------------------------------------------------------------------ shared IRs
@pytest.mark.parametrize("model", ["ppocr_cls", "syn_mobilenet", "mtcnn_onet", "syn_resnet"])
def test_shared_ir_pooling_layers(model):
    """Every Pooling layer of the shared Parser IRs gives the IR's output shape (on batch 2) and torch's values."""
    from conftest import shared_model_dir

    from quantopt.ir.reader import read_ir

    folder = shared_model_dir(model)
    graph = read_ir(str(folder / f"{model}.txt"), str(folder / f"{model}.bin"))
    torch.manual_seed(9)
    checked = 0
    for node in graph.nodes:
        if str(node.type) != "Pooling":
            continue
        p = node.params
        x = torch.randn(2, *node.inputs[0].ir_shape[1:])
        node.inputs[0].betensor = x
        y = node.forward()[0]
        assert tuple(y.shape) == (2, *node.outputs[0].ir_shape[1:]), node.name
        assert (p["pad_left"], p["pad_top"]) == (p["pad_right"], p["pad_bottom"])  # torch needs symmetric pads
        args = ((p["kernel_y"], p["kernel_x"]), (p["stride_y"], p["stride_x"]), (p["pad_top"], p["pad_left"]))
        if p["method"] == "MAX":
            ref = F.max_pool2d(_nchw(x), *args, ceil_mode=p["ceil_mode"])
        else:
            ref = F.avg_pool2d(_nchw(x), *args, ceil_mode=p["ceil_mode"], count_include_pad=p["count_include_pad"])
        torch.testing.assert_close(y, _nhwc(ref), atol=ATOL, rtol=1e-5)
        checked += 1
    assert checked > 0
