"""`quant_type` (upstream's named precision recipes) and per-block weight-only weights (`weight_block_size` with a
per_block weight mode): the recipes' settings, the per-block integers against an independent numpy computation,
a re-read IR computing the same outputs, and the refusal of per-block weights in an integer layer (fp8 activations:
tests/test_fp8_activations.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli import example_cfg

from quantopt.cli import main
from quantopt.config.layer_settings import settings_from_cfg
from quantopt.config.reader import read_cfg
from quantopt.graph.node import PyNode
from quantopt.ir.reader import read_ir
from quantopt.pipeline import run_quantized
from quantopt.registry.optype import OpType

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits"
FC_BLOCKS = ("quant_type = disable & <[FullyConnected]:{qt}>\n"
             "quantize_method_for_weight = per_tensor_symmetric_restricted_range & "
             "<[FullyConnected]:per_block_symmetric_restricted_range>\nweight_block_size = 16\n")


def _settings(tmp_path: Path, text: str, optype: str = "Convolution"):
    (tmp_path / "m.txt").write_text("")
    path = tmp_path / "q.cfg"
    path.write_text("[Common]\ngraph = m.txt\ncalibrate_with_zero_inputs = true\n" + text)
    node = PyNode("x", getattr(OpType, optype), 3)
    return settings_from_cfg(read_cfg(str(path)), node)


@pytest.mark.parametrize("name, expected", [
    ("w8a8", (8, 8, 32, 8, "disable")),
    ("W16A16", (16, 16, 48, 10, "disable")),
    ("w4afp16", (16, 4, 32, 10, "float16_act_int_wht")),
    ("w8abfp16", (16, 8, 32, 10, "bfloat16_act_int_wht")),
    ("wfp4afp32", (16, 4, 32, 10, "float32_act_fp4e2m1fn_wht")),
    ("bf16", (16, 16, 32, 8, "bfloat16_preferred")),
])
def test_recipes_override_the_layer_settings(tmp_path: Path, name: str, expected: tuple) -> None:
    s = _settings(tmp_path, f"quant_type = {name}\nweight_bits = 6\nactivation_bits = 12\n")
    assert (s.q_bits_activation, s.q_bits_weight, s.q_bits_bias, s.lut_items_in_bits, s.trigger_float_op) == expected


def test_disable_keeps_the_cfg_and_per_layer_rules_apply(tmp_path: Path) -> None:
    s = _settings(tmp_path, "quant_type = disable & <[FullyConnected]:w16a16>\nweight_bits = 6\n")
    assert s.q_bits_weight == 6 and s.trigger_float_op == "disable"
    s = _settings(tmp_path, "quant_type = disable & <[FullyConnected]:w16a16>\n", "FullyConnected")
    assert s.q_bits_weight == 16


def test_fp8_activation_types_only_record_the_type(tmp_path: Path) -> None:
    """fp8 types decide bits per layer type when the layer is quantized (tests/test_fp8_activations.py)."""
    s = _settings(tmp_path, "quant_type = wfp8afp8\nweight_bits = 6\nactivation_bits = 12\n")
    assert (s.quant_type, s.q_bits_activation, s.q_bits_weight, s.trigger_float_op) == ("wfp8afp8", 12, 6, "disable")


def _run(tmp_path: Path, extra: str) -> Path:
    cfg = example_cfg(tmp_path, extra, metric=None, data=None, label=None)
    assert main(["--cfg", str(cfg)]) == 0
    return tmp_path / "out" / "digits_o.txt"


def test_w4afp16_with_blocks_quantizes_each_block_alone(tmp_path: Path) -> None:
    txt = _run(tmp_path, FC_BLOCKS.format(qt="w4afp16"))
    graph = read_ir(str(txt))
    fc = next(n for n in graph.nodes if str(n.type) == "FullyConnected")
    assert int(fc.params["weight_block_size"]) == 16 and fc.outputs[0].ir_dtype.value == "float16"
    q = fc.constants["weights"].betensor.to(torch.int64)
    scale = fc.constants["weights_scale"].betensor.to(torch.float32)
    assert q.shape == (10, 64) and scale.shape == (40,) and int(q.abs().max()) <= 7
    # independent: each block of 16 weights, symmetric restricted 4 bits from the block's extrema
    from quantopt.ir.reader import read_ir as read_float

    float_w = next(n for n in read_float(str(EXAMPLE / "model" / "digits.txt")).nodes
                   if str(n.type) == "FullyConnected").constants["weights"].betensor.to(torch.float32)
    blocks = float_w.reshape(-1, 16).numpy()
    absmax = np.abs(blocks).max(axis=1).astype(np.float32)
    ref_scale = (np.float32(14.0) / (absmax * np.float32(2.0))).astype(np.float32)
    assert np.array_equal(scale.numpy(), ref_scale)
    ref_q = np.clip(np.round(blocks * ref_scale[:, None]), -7, 7)
    assert np.array_equal(q.reshape(-1, 16).numpy(), ref_q)
    data = torch.from_numpy(np.load(EXAMPLE / "data" / "val.npy")[:8]).to(torch.float32)
    quantized = read_ir(str(txt))
    assert torch.equal(run_quantized(graph, [data])[0], run_quantized(quantized, [data])[0])  # re-read: same


def test_wfp4afp16_blocks_hold_fp4_values(tmp_path: Path) -> None:
    graph = read_ir(str(_run(tmp_path, FC_BLOCKS.format(qt="wfp4afp16"))))
    fc = next(n for n in graph.nodes if str(n.type) == "FullyConnected")
    values = fc.constants["weights"].betensor.to(torch.float32)
    grid = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    assert set(values.abs().unique().tolist()) <= grid and float(values.abs().max()) == 6.0
    assert fc.constants["weights_scale"].betensor.numel() == 40


def test_per_block_weights_in_an_integer_layer_are_refused(tmp_path: Path, capsys) -> None:
    cfg = example_cfg(tmp_path, "quantize_method_for_weight = per_block_symmetric_restricted_range\n", metric=None,
                      data=None, label=None)
    assert main(["--cfg", str(cfg)]) != 0
    assert "per-block weights (per_block_symmetric_restricted_range) are for weight-only layers" in \
        capsys.readouterr().err


def test_a_block_size_that_does_not_divide_the_rows_is_refused(tmp_path: Path, capsys) -> None:
    cfg = example_cfg(tmp_path, FC_BLOCKS.format(qt="w4afp16").replace("= 16", "= 24"), metric=None, data=None,
                      label=None)
    assert main(["--cfg", str(cfg)]) != 0
    assert "weight_block_size = 24 does not divide the weights' last axis ([10, 64])" in capsys.readouterr().err
