"""The integer forward's int8 GEMMs (ops/_int8_gemm.py; Convolution and FullyConnected in ops/conv.py,
ops/linear.py): the probe that decides whether this process's int8 kernel is exact, the plumbing around it (int8
operands, the uint8 offset and its correction, padding, bands) against the float kernels' exact integers, and, in a
process with the CPU's own kernels, the real kernel against them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable, List

import numpy as np
import pytest
import torch

import quantopt.ops  # noqa: F401  (registers the operators)
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.ops import _conv_nhwc, _int8_gemm, _recurrent_steps, conv, linear
from quantopt.pipeline import quantize_model

MODES = [("per_tensor_symmetric_restricted_range", "per_tensor_symmetric_full_range"),
         ("per_channel_symmetric_restricted_range", "per_tensor_asymmetric"),  # uint8 inputs: the offset of 128
         ("per_tensor_asymmetric", "per_tensor_asymmetric")]  # weight zero points: w_q + zp_w may leave int8


def reference_gemm(calls: List[int]) -> Callable[..., torch.Tensor]:
    """An int8 GEMM computed in int64 (exact everywhere), counting its calls."""
    def gemm(a: torch.Tensor, b: torch.Tensor, out=None) -> torch.Tensor:
        assert a.dtype == b.dtype == torch.int8
        calls.append(1)
        y = (a.to(torch.int64) @ b.to(torch.int64)).to(torch.int32)
        return y if out is None else out.copy_(y)
    return gemm


def saturating_gemm(a: torch.Tensor, b: torch.Tensor, out=None) -> torch.Tensor:
    """The AVX2 form that is not exact: a + 128 as uint8 times b, adjacent products summed into saturated int16
    lanes, then widened; the offset is corrected in int32."""
    ua, sb = a.to(torch.int64) + 128, b.to(torch.int64)
    k = int(a.shape[1])
    if k % 2:
        ua, sb = torch.nn.functional.pad(ua, (0, 1)), torch.nn.functional.pad(sb, (0, 0, 0, 1))
    prods = ua[:, :, None] * sb[None, :, :]  # [M, K, N]
    pairs = (prods[:, 0::2] + prods[:, 1::2]).clamp(-32768, 32767)
    return (pairs.sum(dim=1) - 128 * sb.sum(dim=0)).to(torch.int32)


def test_probe_finds_saturating_kernels(monkeypatch) -> None:
    monkeypatch.setattr(_int8_gemm, "int8_gemm", reference_gemm([]))
    assert _int8_gemm.int8_gemm_exact.__wrapped__()
    monkeypatch.setattr(_int8_gemm, "int8_gemm", saturating_gemm)
    assert not _int8_gemm.int8_gemm_exact.__wrapped__()


def test_speed_probe_keeps_a_slow_kernel_out(monkeypatch) -> None:
    """An exact int8 GEMM slower than the float32 GEMM (torch's kernel on an AVX2-only CPU) is not used; a faster
    one is, and an inexact one never."""
    result = torch.zeros(256, 256, dtype=torch.int32)

    def slow(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return result

    monkeypatch.setattr(_int8_gemm, "int8_gemm", slow)
    assert not _int8_gemm.int8_gemm_fast.__wrapped__()
    monkeypatch.setattr(_int8_gemm, "int8_gemm", lambda a, b: result)
    assert _int8_gemm.int8_gemm_fast.__wrapped__()
    monkeypatch.setattr(_int8_gemm, "int8_gemm_fast", lambda: True)
    monkeypatch.setattr(_int8_gemm, "int8_gemm_exact", lambda: False)
    assert not _int8_gemm.int8_gemm_used()
    monkeypatch.setattr(_int8_gemm, "int8_gemm_exact", lambda: True)
    assert _int8_gemm.int8_gemm_used()


@pytest.mark.parametrize("m,k,n", [(5, 1, 3), (1, 7, 1), (3, 4, 1), (1, 1, 1), (6, 9, 4)])
def test_int8_gemm_reads_any_layout(m: int, k: int, n: int) -> None:
    """Transposed weights of one input ([1, N] views with strides (1, 1)), sliced and transposed operands give the
    exact product. Values below 8 in magnitude: exact even on a saturating kernel, so this runs everywhere (the
    kernel that misread such strides is the CPU's own one: the subprocess test below checks it with full-range
    values)."""
    gen = torch.Generator().manual_seed(m * 100 + k * 10 + n)
    a = torch.randint(-8, 8, (m, 2 * k), dtype=torch.int8, generator=gen)[:, ::2]  # a strided slice
    w = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    want = a.to(torch.int64) @ w.t().to(torch.int64)
    for b in (w.t(), w.t().contiguous(), w.t().clone()):
        assert torch.equal(_int8_gemm.int8_gemm(a, b).to(torch.int64), want)


def _conv_graph(seed: int, pads, stride, dilation, cin: int = 6, cout: int = 8, size=(11, 9), group: int = 1,
                k: int = 3) -> PyGraph:
    r = np.random.default_rng(seed)
    g = GraphBuilder("conv")
    x = g.input("x", [1, size[0], size[1], cin])
    kh = kw = k
    ho = (size[0] + pads[2] + pads[3] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (size[1] + pads[0] + pads[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    params = dict(num_output=cout, kernel_y=kh, kernel_x=kw, stride_y=stride[0], stride_x=stride[1],
                  pad_left=pads[0], pad_right=pads[1], pad_top=pads[2], pad_bottom=pads[3], dilation_y=dilation[0],
                  dilation_x=dilation[1], group=group, with_activation="NONE")
    y = g.layer("Convolution", [x], [[1, ho, wo, cout]], name="conv", params=params,
                constants={"weights": r.normal(0, 0.5, (cout, kh, kw, cin // group)).astype(np.float32),
                           "biases": r.normal(0, 0.3, cout).astype(np.float32)})
    return g.build([y])


def _fc_graph(seed: int) -> PyGraph:
    r = np.random.default_rng(seed)
    g = GraphBuilder("fc")
    x = g.input("x", [1, 6, 40])
    y = g.layer("FullyConnected", [x], [[1, 6, 9]], name="fc", params=dict(num_output=9),
                constants={"weights": r.normal(0, 0.4, (9, 40)).astype(np.float32),
                           "biases": r.normal(0, 0.2, 9).astype(np.float32)})
    return g.build([y])


def _data(shape, seed: int, n: int, positive: bool = False) -> List[torch.Tensor]:
    """Normal samples; `positive`: their magnitudes, which the symmetric modes quantize as unsigned (uint8) values,
    the int8 GEMM's operands after the offset of 128."""
    r = np.random.default_rng(seed)
    values = [r.normal(0.3, 1.0, shape).astype(np.float32) for _ in range(n)]
    return [torch.from_numpy(np.abs(v) if positive else v) for v in values]


def _both_ways(monkeypatch, graph: PyGraph, shape, wmode: str, amode: str, positive: bool = False):
    """The quantized graph's output with the int8 GEMM (the int64 reference in its place) and with the float
    kernels, and how many int8 GEMMs ran."""
    q = quantize_model(graph, _data(shape, 1, 2, positive), {"q_mode_weight": wmode, "q_mode_activation": amode})
    x = _data([2, *shape[1:]], 2, 1, positive)[0]
    calls: List[int] = []
    gemm = reference_gemm(calls)
    for module in (conv, linear):
        monkeypatch.setattr(module, "int8_gemm_used", lambda: True)
    monkeypatch.setattr(_conv_nhwc, "int8_gemm", gemm)
    monkeypatch.setattr(linear, "int8_gemm", gemm)
    with_int8 = q.forward([x])[0].clone()
    for module in (conv, linear):
        monkeypatch.setattr(module, "int8_gemm_used", lambda: False)
    return with_int8, q.forward([x])[0], len(calls)


@pytest.mark.parametrize("positive", [False, True])
@pytest.mark.parametrize("wmode,amode", MODES)
@pytest.mark.parametrize("pads,stride,dilation", [((1, 1, 1, 1), (1, 1), (1, 1)), ((0, 2, 1, 0), (2, 1), (1, 2)),
                                                  ((0, 0, 0, 0), (1, 1), (1, 1))])
def test_convolution_int8_path_gives_the_same_integers(monkeypatch, wmode, amode, pads, stride, dilation,
                                                       positive) -> None:
    graph = _conv_graph(3, pads, stride, dilation)
    monkeypatch.setattr(_conv_nhwc, "INT8_PATCH_ELEMENTS", 400)  # bands of a few rows
    got, want, calls = _both_ways(monkeypatch, graph, [1, 11, 9, 6], wmode, amode, positive)
    assert torch.equal(got, want)
    if wmode != "per_tensor_asymmetric":  # w_q + zp_w may leave int8 there: then the float kernels ran
        assert calls


@pytest.mark.parametrize("group,cout,k", [(2, 8, 3), (6, 12, 1), (3, 6, 3)])
def test_grouped_convolution_takes_one_gemm_per_group(monkeypatch, group: int, cout: int, k: int) -> None:
    """Grouped convolutions (one input channel per group with two outputs each, for one) run a GEMM per group
    (from ONEDNN_MIN_GROUPS groups on, where oneDNN cannot take them: tests/ops/test_conv_int_onednn.py)."""
    if group >= conv.ONEDNN_MIN_GROUPS:
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    graph = _conv_graph(8, (1, 0, 1, 1), (1, 2), (1, 1), cout=cout, group=group, k=k)
    got, want, calls = _both_ways(monkeypatch, graph, [1, 11, 9, 6], *MODES[1], positive=True)
    assert torch.equal(got, want) and calls == group


def test_one_by_one_convolution_is_one_gemm(monkeypatch) -> None:
    r = np.random.default_rng(4)
    g = GraphBuilder("pw")
    x = g.input("x", [1, 7, 5, 16])
    y = g.layer("Convolution", [x], [[1, 7, 5, 12]], name="conv",
                params=dict(num_output=12, kernel_y=1, kernel_x=1, group=1, with_activation="RELU"),
                constants={"weights": r.normal(0, 0.5, (12, 1, 1, 16)).astype(np.float32)})
    got, want, calls = _both_ways(monkeypatch, g.build([y]), [1, 7, 5, 16], *MODES[1])
    assert torch.equal(got, want) and calls == 1


@pytest.mark.parametrize("positive", [False, True])
@pytest.mark.parametrize("wmode,amode", MODES)
def test_fully_connected_int8_path_gives_the_same_integers(monkeypatch, wmode, amode, positive) -> None:
    got, want, calls = _both_ways(monkeypatch, _fc_graph(5), [1, 6, 40], wmode, amode, positive)
    assert torch.equal(got, want)
    if wmode != "per_tensor_asymmetric":
        assert calls == 1


def test_fully_connected_int8_path_keeps_no_float_weights(monkeypatch) -> None:
    """Where the int8 GEMM runs, no float copy of the weights is made and kept (for a VGG-size layer it was four
    times the int8 weights); where it does not, the float weights are made then and the integers are the same."""
    graph = _fc_graph(5)
    q = quantize_model(graph, _data([1, 6, 40], 1, 2), {"q_mode_weight": MODES[1][0], "q_mode_activation": MODES[1][1]})
    x = _data([2, 6, 40], 2, 1)[0]
    calls: List[int] = []
    monkeypatch.setattr(linear, "int8_gemm", reference_gemm(calls))  # the int64 product: exact on any CPU
    monkeypatch.setattr(linear, "int8_gemm_used", lambda: True)
    with_int8 = q.forward([x])[0].clone()
    assert calls and "_mac_weights" not in q.node("fc").attrs and "_mac_weights_int8" in q.node("fc").attrs
    monkeypatch.setattr(linear, "int8_gemm_used", lambda: False)
    assert torch.equal(q.forward([x])[0], with_int8) and "_mac_weights" in q.node("fc").attrs


@pytest.mark.parametrize("block", [1, 7, 40, 1 << 20])
def test_row_abs_sums_in_blocks(monkeypatch, block: int) -> None:
    from quantopt.ops import _quant
    monkeypatch.setattr(_quant, "ROW_SUM_BLOCK_ELEMENTS", block)
    w = torch.randint(-300, 300, (13, 9), generator=torch.Generator().manual_seed(block))
    assert torch.equal(_quant.row_abs_sums(w), w.abs().sum(dim=1))


@pytest.mark.parametrize("positive", [False, True])
def test_sixteen_bit_activations_take_two_int8_gemms(monkeypatch, positive) -> None:
    """16-bit activations are split into a high and a low byte (uint16 ones after an offset of 32768): two int8
    GEMMs per layer, the float kernels' integers."""
    graph = _conv_graph(6, (1, 1, 1, 1), (1, 1), (1, 1))
    q = quantize_model(graph, _data([1, 11, 9, 6], 1, 2, positive), {"q_bits_activation": 16})
    x = _data([2, 11, 9, 6], 2, 1, positive)[0]
    calls: List[int] = []
    monkeypatch.setattr(conv, "int8_gemm_used", lambda: True)
    monkeypatch.setattr(_conv_nhwc, "int8_gemm", reference_gemm(calls))
    fast = q.forward([x])[0].clone()
    assert len(calls) == 2
    monkeypatch.setattr(conv, "int8_gemm_used", lambda: False)
    assert torch.equal(fast, q.forward([x])[0])


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("positive", [False, True])
@pytest.mark.parametrize("layer", ["conv", "fc"])
def test_int8_accumulators_come_with_a_bound_that_holds(monkeypatch, layer: str, positive: bool, bits: int) -> None:
    """The int8 paths hand `mac_finish` a bound on |accumulator| (max |x or padding| · max sum |w|) instead of its
    extrema, the float kernels the stored range's (`mac_bound`): every accumulator is within either, and the two
    paths give the same outputs."""
    from quantopt.ops import _quant

    graph, shape = (_conv_graph(9, (1, 2, 0, 1), (1, 1), (1, 1)), [1, 11, 9, 6]) if layer == "conv" \
        else (_fc_graph(9), [1, 6, 40])
    q = quantize_model(graph, _data(shape, 1, 2, positive), {"q_bits_activation": bits})
    x = _data([2, *shape[1:]], 2, 1, positive)[0] * 3.0  # beyond the calibrated range: clamped inputs
    seen: List[tuple] = []
    planned = _quant._planned_finish

    int8_paths = [True]

    def recording(node, acc, owned, bound=None):
        seen.append((float(acc.abs().max()), bound))
        w = _quant.effective_weights(node)
        w_sum = int(w.reshape(w.shape[0], -1).abs().sum(dim=1).max())
        x, zp = _quant.mac_input(node)
        if int8_paths[0]:  # the bound by its definition: max |x or padding value| * max over outputs sum |w|
            x_absmax = max(int(x.abs().max()), abs(zp) if node.type == "Convolution" else 0)
        else:  # the stored range's: max(|qmin|, |qmax|, |zp|) of the input
            x_absmax = max(*(abs(v) for v in _quant.out_range(node, node.inputs[0])), abs(zp))
        assert bound == x_absmax * w_sum
        return planned(node, acc, owned, bound)

    monkeypatch.setattr(_quant, "_planned_finish", recording)
    for module in (conv, linear):
        monkeypatch.setattr(module, "int8_gemm_used", lambda: True)
    calls: List[int] = []
    monkeypatch.setattr(_conv_nhwc, "int8_gemm", reference_gemm(calls))
    monkeypatch.setattr(linear, "int8_gemm", reference_gemm(calls))
    fast = q.forward([x])[0].clone()
    assert calls
    assert seen and all(bound is not None and 0 < acc_max <= bound for acc_max, bound in seen), seen
    for module in (conv, linear):
        monkeypatch.setattr(module, "int8_gemm_used", lambda: False)
    seen.clear()
    int8_paths[0] = False
    assert torch.equal(fast, q.forward([x])[0])  # the float kernels, with the stored range's bound (mac_bound)
    assert seen and all(bound is not None and 0 < acc_max <= bound for acc_max, bound in seen), seen


@pytest.mark.parametrize("lo,hi", [(-128, 127), (0, 255), (-32768, 32767), (0, 65535), (-300, 200), (1, 40000),
                                   (-40000, 0), (0, 70000)])
def test_split_int8_rebuilds_the_values_and_the_padding(lo: int, hi: int) -> None:
    """Values as they are or less 128 / 32768 (unsigned ones) must fit int8 / int16; a range such as
    [-40000, 0] fits neither and is refused (the float kernels take it)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([torch.tensor([lo, hi]), torch.randint(lo, hi + 1, (500,), generator=gen)])
    pad = lo
    split = _int8_gemm.split_int8(x, pad)
    fits8 = (lo >= -128 and hi <= 127) or (lo >= 0 and hi <= 255)
    fits16 = (lo >= -32768 and hi <= 32767) or (lo >= 0 and hi <= 65535)
    if not fits16:
        assert split is None
        return
    assert split is not None and all(p.dtype == torch.int8 for p, _, _ in split.parts)
    assert len(split.parts) == (1 if fits8 else 2)
    rebuilt = sum(p.to(torch.int64) * f for p, f, _ in split.parts) + split.offset
    assert torch.equal(rebuilt, x)
    assert sum(v * f for _, f, v in split.parts) + split.offset == pad
    assert split.absmax == max(abs(lo), abs(hi), abs(pad))
    assert all(-128 <= v <= 127 for _, _, v in split.parts)


SCRIPT = r"""
import json, sys
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
import test_int8_gemm as t
from quantopt.ops import _int8_gemm, conv, linear
if not _int8_gemm.int8_gemm_exact():
    print(json.dumps({"exact": False}))
    sys.exit(0)
results = []
for graph, shape in ((t._conv_graph(7, (1, 1, 1, 1), (1, 1), (1, 1), cin=32, cout=24, size=(20, 18)),
                      [1, 20, 18, 32]), (t._fc_graph(8), [1, 6, 40]),
                     (t._conv_graph(9, (0, 0, 0, 0), (1, 1), (1, 1), cin=8, cout=16, size=(6, 6), group=8, k=1),
                      [1, 6, 6, 8])):
    settings = [{"q_mode_weight": w, "q_mode_activation": a} for w, a in t.MODES] + [{"q_bits_activation": 16}]
    for setting in settings:
        q = t.quantize_model(graph, t._data(shape, 1, 2), setting)
        x = t._data([3, *shape[1:]], 2, 1)[0]
        conv.int8_gemm_used = linear.int8_gemm_used = lambda: True  # the kernel, even where it is not the faster
        fast = q.forward([x])[0].clone()
        conv.int8_gemm_used = linear.int8_gemm_used = lambda: False
        slow = q.forward([x])[0]
        results.append(bool(torch.equal(fast, slow)))
gen = torch.Generator().manual_seed(3)
for m, k, n in ((5, 1, 3), (1, 7, 1), (3, 4, 1), (6, 9, 4)):  # the layouts of test_int8_gemm_reads_any_layout
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    for a in (torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen),
              torch.randint(-128, 128, (m, 2 * k), dtype=torch.int8, generator=gen)[:, ::2]):
        results.append(bool(torch.equal(_int8_gemm.int8_gemm(a, w.t()).long(), a.long() @ w.t().long())))
print(json.dumps({"exact": True, "equal": results}))
"""


def test_the_cpus_own_int8_kernel_gives_the_same_integers() -> None:
    """In a process with the CPU's own kernels (the suite caps torch and oneDNN at AVX2, whose int8 GEMM
    saturates), the int8 GEMM, where the probe accepts it, gives the float kernels' integers."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA")}
    run = subprocess.run([sys.executable, "-c", SCRIPT, os.path.dirname(__file__)], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if not result["exact"]:
        pytest.skip("this CPU's int8 GEMM saturates: the integer forward keeps its float kernels here")
    assert result["equal"] == [True] * 20  # 3 graphs x 4 settings, 8 operand layouts


@pytest.mark.parametrize("lo,hi", [(-128, 128), (0, 256), (-32768, 32768), (0, 65536)])
def test_int_matmul_gives_the_exact_products(monkeypatch, lo: int, hi: int) -> None:
    """`IntMatmul` (a recurrent cell's weight products): int8 and uint8 operands in one int8 GEMM, int16 and uint16
    ones in two, every result the int64 product's."""
    calls: List[int] = []
    monkeypatch.setattr(_int8_gemm, "int8_gemm_used", lambda: True)
    monkeypatch.setattr(_int8_gemm, "int8_gemm", reference_gemm(calls))
    gen = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (96, 96), generator=gen)
    a = torch.randint(lo, hi, (3, 4, 96), generator=gen)
    got = _int8_gemm.IntMatmul(w)(a)
    assert got.dtype == torch.int64 and torch.equal(got, a @ w)
    assert len(calls) == (1 if hi <= 256 else 2)
    # a caller's bound that shows the operand fits int8: one GEMM without looking at its values
    small = a.clamp(-127, 127)
    assert torch.equal(_int8_gemm.IntMatmul(w)(small, bound=127), small @ w)


def test_int_matmul_keeps_the_int64_product_where_int8_does_not_apply(monkeypatch) -> None:
    """Weights beyond int8 (a weight zero point), an operand beyond 16 bits, a small matrix, or an int8 GEMM this
    process does not use: the exact product without it, the same values."""
    calls: List[int] = []
    monkeypatch.setattr(_int8_gemm, "int8_gemm_used", lambda: True)
    monkeypatch.setattr(_int8_gemm, "int8_gemm", reference_gemm(calls))
    gen = torch.Generator().manual_seed(6)
    w8 = torch.randint(-128, 128, (96, 96), generator=gen)
    cases = [(torch.randint(-255, 256, (96, 96), generator=gen), torch.randint(-128, 128, (2, 96), generator=gen)),
             (w8, torch.randint(-(2 ** 20), 2 ** 20, (2, 96), generator=gen)),
             (w8[:8, :8], torch.randint(-128, 128, (2, 8), generator=gen))]
    for w, a in cases:
        assert torch.equal(_int8_gemm.IntMatmul(w)(a), a @ w)
    assert not calls
    monkeypatch.setattr(_int8_gemm, "int8_gemm_used", lambda: False)
    a = torch.randint(-128, 128, (2, 96), generator=gen)
    assert torch.equal(_int8_gemm.IntMatmul(w8)(a), a @ w8) and not calls


@pytest.mark.parametrize("int8_used", [False, True])
def test_int_matmul_as_float64_gives_the_same_integers(monkeypatch, int8_used: bool) -> None:
    """`as_float64`: an operand holding its integers as float64 or int64 gives the product as float64 integers where
    the float64 GEMM computes it, int64 where the int8 GEMM does or no bound proves float64 exact; the same values."""
    monkeypatch.setattr(_int8_gemm, "int8_gemm_used", lambda: int8_used)
    monkeypatch.setattr(_int8_gemm, "int8_gemm", reference_gemm([]))
    gen = torch.Generator().manual_seed(7)
    w = torch.randint(-128, 128, (96, 96), generator=gen)
    a = torch.randint(-32768, 32768, (2, 96), generator=gen)
    for operand in (a, a.to(torch.float64)):
        got = _int8_gemm.IntMatmul(w)(operand, 32768, as_float64=True)
        assert got.dtype == (torch.int64 if int8_used else torch.float64)
        assert torch.equal(got.to(torch.int64), a @ w)
        wide = _int8_gemm.IntMatmul(w)(operand, 2 ** 60, as_float64=True)  # no float64 proof: the int64 product
        assert wide.dtype == torch.int64 and torch.equal(wide, a @ w)


@pytest.mark.parametrize("form", ["upstream", "q15"])
@pytest.mark.parametrize("model", ["lstm_model", "gru_model"])
def test_recurrent_layers_give_the_same_integers_through_int8_gemms(monkeypatch, model: str, form: str) -> None:
    """An imported LSTM / GRU, quantized in either integer form: the same outputs with the cell's weight products
    through the int8 GEMM (the int64 reference in its place) as through the int64 product."""
    from quantopt.frontends.onnx import import_onnx

    path = os.path.join(os.path.dirname(__file__), "..", "data", "onnx_small", f"{model}.onnx")
    graph = import_onnx(path, {"x": [1, 10, 12]})
    q = quantize_model(graph, _data([1, 10, 12], 1, 2), {"lstm_integer_form": form, "gru_integer_form": form})
    x = _data([1, 10, 12], 2, 1)[0]
    want = q.forward([x])[0].clone()
    calls: List[int] = []
    monkeypatch.setattr(_int8_gemm, "INT8_MATMUL_MIN_WEIGHTS", 1)  # the models' small cells take it too
    monkeypatch.setattr(_recurrent_steps, "NUMPY_STEP_VALUES", 0)  # the torch steps (the numpy ones take no GEMM)
    monkeypatch.setattr(_int8_gemm, "int8_gemm_used", lambda: True)
    monkeypatch.setattr(_int8_gemm, "int8_gemm", reference_gemm(calls))
    for n in q.nodes:  # plans memoized without the int8 GEMM are made again
        for key in [k for k in n.attrs if k.startswith("_memo_")]:
            del n.attrs[key]
    assert torch.equal(q.forward([x])[0], want)
    assert calls


def test_int_matmul_without_int8_takes_a_float64_product_within_its_bound(monkeypatch) -> None:
    """Where the int8 GEMM is not used, products whose max|a| · max column sum of |w| stays below 2^53 are float64
    GEMMs on a weight copy made once; beyond the bound the int64 product. The int64 values either way."""
    monkeypatch.setattr(_int8_gemm, "int8_gemm_used", lambda: False)
    gen = torch.Generator().manual_seed(7)
    w = torch.randint(-32768, 32768, (96, 64), generator=gen)
    small = torch.randint(-32768, 32768, (3, 96), generator=gen)
    matmul = _int8_gemm.IntMatmul(w)
    assert torch.equal(matmul(small), small @ w) and matmul.w64 is not None
    assert torch.equal(matmul(small, bound=32768), small @ w)
    big = _int8_gemm.IntMatmul(w)
    wide = torch.randint(-(2 ** 40), 2 ** 40, (3, 96), generator=gen)
    assert torch.equal(big(wide), wide @ w) and big.w64 is None


@pytest.mark.parametrize("k,extreme", [(96, False), (96, True), (1024, True)])
def test_sixteen_bit_parts_combine_exactly_in_int32_or_float64(monkeypatch, k: int, extreme: bool) -> None:
    """A 16-bit operand's high- and low-byte products are combined in int32 where their extrema prove every partial
    sum within int32 (one float64 conversion), else in float64; the exact product either way (against int64)."""
    from quantopt.ops import _int8_gemm

    g = torch.Generator().manual_seed(k)
    x = torch.randint(-32768, 32768, (37, k), generator=g)
    w = torch.randint(-127, 128, (k, 11), generator=g)
    if extreme:  # every product at its largest: the int32 bound fails for the long reduction
        x[:, :] = -32768
        w[:, :] = -127
    operand = _int8_gemm.split_int8(x)
    assert operand is not None and len(operand.parts) == 2
    combined: List[int] = []
    int32_path = _int8_gemm._combined_int32
    monkeypatch.setattr(_int8_gemm, "_combined_int32", lambda *a: combined.append(1) or int32_path(*a))
    got = _int8_gemm.int8_accumulate(operand, w.sum(dim=0), lambda part, pad: (part.to(torch.int64) @ w)
                                     .to(torch.int32))
    want = (x @ w).to(torch.float64)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert combined  # tried first; its bound decides
    assert (int(want.abs().max()) < 2 ** 31) or k == 1024
