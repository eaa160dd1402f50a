"""The cfg field `float_reference` (ops/conv.py, ops/linear.py, docs/performance.md "Native float reference"):
`exact` keeps upstream's float64 convolution sums; `native` computes Convolution, DepthwiseConv and FullyConnected
with torch's float32 kernels, which agree with the exact sums to float32 rounding and calibrate nearly the same
ranges; the integer forward is the same in both."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from golden_helpers import run_golden_cfg

import quantopt.ops  # noqa: F401  (registers the operators)
from quantopt.config.layer_settings import LayerSettings
from quantopt.config.reader import read_cfg
from quantopt.errors import ConfigError
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.graph.tables import quant_of
from quantopt.ir.reader import read_ir
from quantopt.pipeline import quantize_model

SHARED = Path(__file__).resolve().parent / "data" / "shared_models"


def _one_layer(optype: str, x: torch.Tensor, out_shape: Sequence[int], params: Dict, constants: Dict) -> PyGraph:
    b = GraphBuilder("t")
    i = b.input("x", list(x.shape))
    out = b.layer(optype, [i], [list(out_shape)], name="layer", params=params, constants=constants)
    return b.build([out])


def _run(graph: PyGraph, x: torch.Tensor, reference: str) -> torch.Tensor:
    for n in graph.nodes:
        n.settings = dataclasses.replace(LayerSettings(), float_reference=reference)
    with torch.no_grad():
        return graph.forward([x])[0]


def _conv_params(k, stride, pads, dilation, group, act="NONE"):
    return {"kernel_y": k[0], "kernel_x": k[1], "stride_y": stride[0], "stride_x": stride[1], "pad_left": pads[0],
            "pad_right": pads[1], "pad_top": pads[2], "pad_bottom": pads[3], "dilation_y": dilation[0],
            "dilation_x": dilation[1], "group": group, "with_activation": act}


def _torch_conv(x, w, bias, stride, pads, dilation, group):
    """torch's own float32 convolution of the NHWC input (contiguous NCHW copy, explicit pads): the independent
    reference."""
    y = F.conv2d(F.pad(x.permute(0, 3, 1, 2).contiguous(), pads), w.permute(0, 3, 1, 2).contiguous(), bias,
                 stride=stride, dilation=dilation, groups=group)
    return y.permute(0, 2, 3, 1)


CASES = [
    # optype, cin, cout, kernel, stride, pads (l, r, t, b), dilation, group, fused activation
    ("Convolution", 8, 16, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1, "NONE"),
    ("Convolution", 6, 9, (3, 3), (2, 1), (1, 2, 0, 1), (1, 2), 3, "RELU"),
    ("Convolution", 16, 32, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1, "RELU6"),
    ("DepthwiseConv", 12, 12, (5, 5), (1, 1), (2, 2, 2, 2), (1, 1), 12, "NONE"),
    ("DepthwiseConv", 8, 16, (3, 3), (2, 2), (0, 1, 0, 1), (1, 1), 8, "NONE"),  # multiplier 2, asymmetric pads
]


@pytest.mark.parametrize("optype,cin,cout,k,stride,pads,dilation,group,act", CASES)
def test_native_convolution_is_torch_float32_and_close_to_exact(optype, cin, cout, k, stride, pads, dilation, group,
                                                                act) -> None:
    torch.manual_seed(3)
    x = torch.randn(2, 11, 13, cin)
    w = torch.randn(cout, k[0], k[1], cin // group)
    bias = torch.randn(cout)
    ref = _torch_conv(x, w, bias, stride, pads, dilation, group)
    ref = {"RELU": F.relu, "RELU6": lambda t: t.clamp(0, 6)}.get(act, lambda t: t)(ref)
    params = _conv_params(k, stride, pads, dilation, group, act)
    if optype == "DepthwiseConv":
        params["multiplier"] = cout // cin
    graph = _one_layer(optype, x, [1, *ref.shape[1:]], params, {"weights": w, "biases": bias})
    native = _run(graph, x, "native")
    assert native.dtype == torch.float32 and native.is_contiguous()
    torch.testing.assert_close(native, ref, atol=2e-5, rtol=1e-5)
    assert not graph.wide_values.get(graph.output_tensors[0])  # nothing kept unrounded for the readers
    exact = _run(graph, x, "exact")
    torch.testing.assert_close(native, exact, atol=2e-5, rtol=1e-5)
    assert not torch.equal(native, exact)  # the two really are two sums: they differ in last bits somewhere


def test_native_fully_connected_is_torch_linear() -> None:
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((16, 200)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((10, 200)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal(10).astype(np.float32))
    graph = _one_layer("FullyConnected", x, [16, 10], {"num_output": 10}, {"weights": w, "biases": b})
    assert torch.equal(_run(graph, x, "native"), F.linear(x, w, b))
    torch.testing.assert_close(_run(graph, x, "exact"), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_field_is_read_and_checked(tmp_path: Path) -> None:
    (tmp_path / "m.txt").write_text("")
    base = "[Common]\ngraph = m.txt\ncalibrate_with_zero_inputs = true\n"
    cfg = tmp_path / "opt.cfg"
    cfg.write_text(base)
    assert read_cfg(str(cfg)).float_reference == "exact"
    cfg.write_text(base + "float_reference = native\n")
    assert read_cfg(str(cfg)).float_reference == "native"
    cfg.write_text(base + "float_reference = fast\n")
    with pytest.raises(ConfigError, match="float_reference"):
        read_cfg(str(cfg))
    # fc_float_summation chooses among exact sums: with native it would do nothing, so it is refused
    cfg.write_text(base + "float_reference = native\nfc_float_summation = float64\n")
    with pytest.raises(ConfigError, match=r"opt.cfg:5: field 'fc_float_summation': applies to float_reference = exact"):
        read_cfg(str(cfg))


def _scales(ir: Path) -> Dict[str, float]:
    graph = read_ir(str(ir))
    return {t.name: float(quant_of(n).get(t).scale) for n in graph.nodes for t in n.outputs
            if quant_of(n).get(t).qbits is not None}


def test_native_run_calibrates_nearly_upstreams_ranges(tmp_path: Path) -> None:
    """`quantopt --cfg` on a shared Parser IR with float_reference = native writes the same layers as the exact
    run, every activation scale within 1e-4 of it (the float32 sums move ranges by ulps, not more)."""
    folder = SHARED / "syn_mobilenet" / "golden" / "A"
    exact = _scales(run_golden_cfg(folder, "syn_mobilenet", tmp_path / "exact", quiet=True))
    native = _scales(run_golden_cfg(folder, "syn_mobilenet", tmp_path / "native", quiet=True,
                                    extra=["float_reference = native"]))
    assert native.keys() == exact.keys() and len(native) > 30
    for name, scale in exact.items():
        assert native[name] == pytest.approx(scale, rel=1e-4), name


def test_python_api_takes_the_setting() -> None:
    """quantize_model(settings={"float_reference": "native"}) calibrates on the native forward: the statistics
    hold its extrema, which here differ from the exact sums' in their last bits."""
    from quantopt.graph.tables import statistics_of

    torch.manual_seed(4)
    x = torch.randn(2, 24, 24, 16)
    w = torch.randn(16, 3, 3, 16)
    bias = torch.randn(16)
    graph = _one_layer("Convolution", x, [1, 24, 24, 16], _conv_params((3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
                       {"weights": w, "biases": bias})
    conv = graph.node("layer")
    out = conv.outputs[0]
    native, exact = _run(graph, x, "native"), _run(graph, x, "exact")
    extrema = {"native": (native.amin(), native.amax()), "exact": (exact.amin(), exact.amax())}
    assert extrema["native"] != extrema["exact"]
    for reference in ("native", "exact"):
        quantize_model(graph, [[x]], settings={"float_reference": reference})
        assert all(n.settings.float_reference == reference for n in graph.nodes)
        stats = statistics_of(conv).get(out)
        assert (float(stats.extrema_min), float(stats.extrema_max)) == tuple(float(v) for v in extrema[reference])
