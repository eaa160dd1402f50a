"""The integer forward's MAX pooling tap by tap on channels-last data (ops/pooling.py, `_max_pool_taps`) gives torch's
max_pool2d values: integers held in float64, -inf padding, strides, dilations, ceil mode, and a quantized layer run
both ways through the graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quant_helpers import params_of

import quantopt.ops.pooling as pooling
from quantopt.graph.builder import GraphBuilder
from quantopt.pipeline import quantize_model

CASES = [((2, 17, 23, 5), (2, 2), (1, 1), (1, 1), (0, 1, 0, 1)),
         ((1, 32, 32, 8), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1)),
         ((1, 19, 21, 4), (3, 2), (2, 1), (2, 1), (0, 0, 2, 1)),
         ((3, 9, 9, 16), (4, 4), (4, 4), (1, 1), (0, 0, 0, 0)),
         ((1, 1, 40, 6), (1, 5), (1, 3), (1, 1), (2, 2, 0, 0))]


def _integers(shape, seed):
    """Integer values in float64, as the integer forward pools them, with many ties."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, shape, generator=g).to(torch.float64)


@pytest.mark.parametrize("shape,k,s,d,pads", CASES)
def test_taps_equal_torch_max_pool(shape, k, s, d, pads) -> None:
    x = _integers(shape, sum(shape)).permute(0, 3, 1, 2)  # NCHW view of channels-last data, as the layer has it
    xp = F.pad(x, pads, value=float("-inf"))
    got = pooling._max_pool_taps(xp, k, s, d)
    want = F.max_pool2d(xp, k, s, padding=0, dilation=d)
    assert got is not None and got.shape == want.shape
    assert torch.equal(got, want)


def test_large_windows_and_gradients_go_to_torch() -> None:
    x = torch.randn(1, 3, 8, 8)
    assert pooling._max_pool_taps(x, (5, 5), (1, 1), (1, 1)) is None  # 25 taps
    with torch.enable_grad():
        assert pooling._max_pool_taps(x.requires_grad_(True), (2, 2), (2, 2), (1, 1)) is None


def test_a_max_pool_layer_is_the_same_both_ways(monkeypatch) -> None:
    """A quantized Pooling MAX layer (ceil mode, asymmetric pads) gives the same integers tap by tap as through
    torch's kernel."""
    def build():
        b = GraphBuilder("pool")
        x = b.input("x", [1, 15, 15, 6])
        y = b.layer("Pooling", [x], [[1, 8, 8, 6]], name="p",
                    params={"method": "MAX", "kernel_x": 3, "kernel_y": 3, "stride_x": 2, "stride_y": 2,
                            "pad_left": 1, "pad_right": 0, "pad_top": 1, "pad_bottom": 0, "ceil_mode": True})
        return b.build([y])

    data = [[torch.randn(1, 15, 15, 6, generator=torch.Generator().manual_seed(i))] for i in range(3)]

    def run():
        g = build()
        q = quantize_model(g, data[:2])
        with torch.no_grad():
            return g.forward(data[2])[0].clone(), q.forward(data[2])[0].clone()

    taps_float, taps_int = run()
    monkeypatch.setattr(pooling, "MAX_POOL_TAPS", 0)  # every window through torch's kernel
    torch_float, torch_int = run()
    assert torch.equal(taps_float, torch_float) and torch.equal(taps_int, torch_int)


def test_codes_beyond_float32_give_the_clamped_maximum() -> None:
    """The integer MAX pools 8- and 16-bit codes in float32; a hand-fed code beyond ±2^24 (not exact there) still
    gives the output the exact maximum clamped to the output range."""
    b = GraphBuilder("pool")
    x = b.input("x", [1, 6, 6, 4])
    y = b.layer("Pooling", [x], [[1, 3, 3, 4]], name="p",
                params={"method": "MAX", "kernel_x": 2, "kernel_y": 2, "stride_x": 2, "stride_y": 2})
    g = b.build([y])
    data = [[torch.randn(1, 6, 6, 4, generator=torch.Generator().manual_seed(i))] for i in range(3)]
    q = quantize_model(g, data)
    q.forward(data[0])
    node = q.node("p")
    codes = node.inputs[0].betensor.to(torch.int64).clone()
    codes[0, 0, 0, 0] = 2 ** 24 + 1
    codes[0, 2, 2, 1], codes[0, 2, 3, 1], codes[0, 3, 2, 1], codes[0, 3, 3, 1] = -(2 ** 30), -(2 ** 30) - 1, -5, -7
    codes[0, 4:, 4:, 2] = -(2 ** 40) - 3
    node.inputs[0].betensor = codes
    node.forward()
    want = F.max_pool2d(codes.permute(0, 3, 1, 2).to(torch.float64), 2, 2).permute(0, 2, 3, 1)
    out = params_of(node, node.outputs[0])
    assert torch.equal(node.outputs[0].betensor, want.clamp(out.qmin, out.qmax).to(torch.int64))
    assert int(node.outputs[0].betensor[0, 0, 0, 0]) == out.qmax  # the code beyond 2^24 won its window
