"""Convolution and FullyConnected layers with a fused LEAKYRELU or PRELU (as the Parser writes a convolution
followed by LeakyRelu or PRelu): the IR keys the Parser writes are read, quantization writes the integer slope
(LEAKYRELU: `negative_slope_value` = round(slope · 2^out_bits) and its `negative_slope_type`; PRELU: the int16
`negative_slope` constant at `negative_slope_shift` 12), and the integer forward is checked against a reference in
Python integers written here (docs/integer-semantics.md, "LEAKYRELU and PRELU")."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.ops._quant import requant_of, tensor_zp
from quantopt.pipeline import quantize_model

H, W, CIN, COUT = 4, 5, 6, 8
SLOPE = 0.1


def _graph(act: str, layer: str, seed: int = 0) -> Tuple[PyGraph, np.ndarray]:
    rng = np.random.default_rng(seed)
    slopes = rng.uniform(0.05, 0.6, COUT).astype(np.float32)
    b = GraphBuilder("slopes")
    x = b.input("x", [1, H, W, CIN])
    params = {"with_activation": act}
    constants: Dict[str, torch.Tensor] = {"biases": torch.from_numpy(rng.standard_normal(COUT).astype(np.float32))}
    if act == "LEAKYRELU":
        params.update(negative_slope_type="float32", negative_slope_value=SLOPE)
    else:
        constants["negative_slope"] = torch.from_numpy(slopes)
    if layer == "Convolution":
        params.update(kernel_y=1, kernel_x=1, stride_y=1, stride_x=1, pad_left=0, pad_right=0, pad_top=0,
                      pad_bottom=0, group=1, num_output=COUT)
        constants["weights"] = torch.from_numpy(rng.standard_normal((COUT, 1, 1, CIN)).astype(np.float32))
        y = b.layer("Convolution", [x], [[1, H, W, COUT]], name="mac", params=params, constants=constants)
    else:
        params.update(num_output=COUT)
        constants["weights"] = torch.from_numpy(rng.standard_normal((COUT, CIN)).astype(np.float32))
        y = b.layer("FullyConnected", [x], [[1, H, W, COUT]], name="mac", params=params, constants=constants)
    return b.build([y]), slopes


def _data(n: int = 6) -> List[torch.Tensor]:
    rng = np.random.default_rng(7)
    return [torch.from_numpy(rng.standard_normal((1, H, W, CIN)).astype(np.float32)) for _ in range(n)]


def _rhe(num: int, shift: int) -> int:
    """round_half_even(num / 2^shift) in Python integers."""
    if shift <= 0:
        return num << -shift
    q, r = divmod(num, 1 << shift)
    half = 1 << (shift - 1)
    return q + (1 if r > half or (r == half and q % 2 == 1) else 0)


def _reference(node, x_q: np.ndarray) -> np.ndarray:
    """The layer's integers from its quantized constants, element by element in Python ints."""
    w = node.constants["weights"].betensor.to(torch.int64).reshape(COUT, CIN).numpy().astype(object)
    b = node.constants["biases"].betensor.to(torch.int64).numpy().astype(object)
    mult, shift = requant_of(node)
    mult = [int(m) for m in torch.as_tensor(mult).reshape(-1).expand(COUT)]
    shift = [int(s) for s in torch.as_tensor(shift).reshape(-1).expand(COUT)]
    zp_out = tensor_zp(node, node.outputs[0])
    bits = node.outputs[0].dtype.bits
    qmin, qmax = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    if node.params["with_activation"] == "LEAKYRELU":
        slopes, s_shift = [int(node.params["negative_slope_value"])] * COUT, bits
    else:
        slopes = [int(v) for v in node.constants["negative_slope"].betensor.reshape(-1)]
        s_shift = int(node.params["negative_slope_shift"])
    rows = x_q.reshape(-1, CIN).astype(object)
    out = np.zeros((rows.shape[0], COUT), dtype=np.int64)
    for r, row in enumerate(rows):
        for o in range(COUT):
            acc = int(sum(row * w[o])) + int(b[o])
            y = max(acc, 0) + _rhe(min(acc, 0) * slopes[o], s_shift)
            out[r, o] = min(max(_rhe(y * mult[o], shift[o]) - zp_out, qmin), qmax)
    return out.reshape(1, H, W, COUT)


@pytest.mark.parametrize("layer", ["Convolution", "FullyConnected"])
@pytest.mark.parametrize("act", ["LEAKYRELU", "PRELU"])
def test_fused_slope_quantized_forward(act: str, layer: str) -> None:
    graph, slopes = _graph(act, layer)
    q = quantize_model(graph, _data())
    node = q.node("mac")
    if act == "LEAKYRELU":
        assert node.params["negative_slope_value"] == round(SLOPE * 2 ** 8) == 26
        assert str(node.params["negative_slope_type"]).lower() == "uint8"
        assert "negative_slope_shift" not in node.params  # the integer forward shifts by the output bits
    else:
        codes = node.constants["negative_slope"]
        assert str(codes.dtype).lower().endswith("int16") and node.params["negative_slope_shift"] == 12
        np.testing.assert_array_equal(codes.betensor.numpy(), np.round(slopes.astype(np.float64) * 4096))
    negative = 0
    for x in _data(3):
        q.forward([x], keep_tensors=True)
        x_q = node.inputs[0].betensor.numpy()
        got = node.outputs[0].betensor.numpy()
        np.testing.assert_array_equal(got, _reference(node, x_q))
        negative += int((got < tensor_zp(node, node.outputs[0]) * -1).sum())
    assert negative > 0, "the data must reach the negative slope"


def test_parser_keys_of_a_fused_leakyrelu_are_read(tmp_path: Path) -> None:
    """The Parser writes `negative_slope_type=float32` beside `negative_slope_value` on a layer with a fused
    LEAKYRELU; the IR reads back and a quantized IR written from it reads back too."""
    graph, _ = _graph("LEAKYRELU", "Convolution")
    write_ir(graph, str(tmp_path / "f.txt"), str(tmp_path / "f.bin"))
    text = (tmp_path / "f.txt").read_text()
    assert "negative_slope_type=float32" in text
    again = read_ir(str(tmp_path / "f.txt"), str(tmp_path / "f.bin"))
    q = quantize_model(again, _data())
    write_ir(q, str(tmp_path / "q.txt"), str(tmp_path / "q.bin"))
    back = read_ir(str(tmp_path / "q.txt"), str(tmp_path / "q.bin"))
    assert int(back.node("mac").params["negative_slope_value"]) == 26
