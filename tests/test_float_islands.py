"""trigger_float_op (float islands with inserted Quantize/DeQuantize/Cast), the Quantize/DeQuantize integer
semantics against an independent reference, weight-only modes, the IR round trip of mixed models, and
fake-quant debugging."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli import EXAMPLE, example_cfg

from quantopt.analysis.similarity import cosine, to_float
from quantopt.cli import main
from quantopt.config.kinds_accuracy import parse_trigger_float
from quantopt.config.layer_settings import LayerSettings
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import QuantizeGraph
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.passes.fake_quant import apply_fake_quant
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

RNG = np.random.default_rng(7)


def _mlp() -> QuantizeGraph:
    """Input -> FC -> Sigmoid -> FC -> Softmax, seeded weights."""
    b = GraphBuilder("mlp")
    b.input("x", [1, 16])
    b.layer("FullyConnected", ["x"], [[1, 24]], name="fc1", params={"num_output": 24, "with_activation": "NONE"},
            constants={"weights": RNG.normal(0, 0.3, (24, 16)).astype(np.float32),
                       "biases": RNG.normal(0, 0.1, 24).astype(np.float32)})
    b.layer("Activation", ["fc1"], [[1, 24]], name="act", params={"method": "SIGMOID"})
    b.layer("FullyConnected", ["act"], [[1, 10]], name="fc2", params={"num_output": 10, "with_activation": "NONE"},
            constants={"weights": RNG.normal(0, 0.5, (10, 24)).astype(np.float32),
                       "biases": RNG.normal(0, 0.1, 10).astype(np.float32)})
    b.layer("Softmax", ["fc2"], [[1, 10]], name="softmax", params={"axis": -1})
    return b.build(["softmax"])


def _data(n: int = 4):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


def _quantized(per_layer):
    g = _mlp()
    q = quantize_model(g, _data(), per_layer=per_layer)
    return g, q


def _layer_types(graph):
    return [(n.name, str(n.type)) for n in graph.nodes]


def test_trigger_values_parse_and_reject():
    assert parse_trigger_float("disable") is None and parse_trigger_float("disable!") is None
    c = parse_trigger_float("Float16_Preferred!")
    assert (c.act_type, c.weight_format, c.forced) == ("float16", None, True)
    c = parse_trigger_float("bfloat16_act_fp8e4m3fn_wht")
    assert (c.act_type, c.weight_format) == ("bfloat16", "fp8e4m3fn")
    with pytest.raises(ValueError):
        parse_trigger_float("float8_preferred")


def test_boundaries_are_inserted_where_precision_changes():
    g, q = _quantized({"act": {"trigger_float_op": "float16_preferred"},
                       "fc2": {"trigger_float_op": "float32_preferred"}})
    names = [n for n, _ in _layer_types(q)]
    types = dict(_layer_types(q))
    assert types["fc1_dequantize"] == "DeQuantize"
    assert types["fc2_quantize"] == "Quantize"
    assert not [n for n in names if "cast" in n]  # float16 -> float32 needs no Cast
    assert names.index("fc1") < names.index("fc1_dequantize") < names.index("act")
    assert names.index("fc2") < names.index("fc2_quantize") < names.index("softmax")
    assert q.node("act").params["unquantifiable"] is True and not q.node("act").quantized
    assert q.node("softmax").quantized and q.node("fc1").quantized


def test_cast_inserted_into_narrower_float_layer():
    g, q = _quantized({"act": {"trigger_float_op": "float32_preferred"},
                       "fc2": {"trigger_float_op": "float16_preferred"}})
    cast = q.node("act_cast_float16")
    assert str(cast.type) == "Cast" and cast.outputs[0].dtype.value == "float16"
    x = _data(1)[0]
    run_quantized(q, x)
    y = q.node("fc2").outputs[0].betensor
    assert torch.equal(y, y.to(torch.float16).to(torch.float32))


def test_float16_island_outputs_are_float16_values_and_close_to_float():
    g, q = _quantized({"act": {"trigger_float_op": "float16_preferred"},
                       "fc2": {"trigger_float_op": "float16_preferred"}})
    x = _data(1)[0]
    yq = run_quantized(q, x)[0]
    yf = g.forward([x])[0]
    fc2 = q.node("fc2").outputs[0].betensor
    assert torch.equal(fc2, fc2.to(torch.float16).to(torch.float32))
    assert q.node("fc2").constants["weights"].dtype.value == "float16"
    assert cosine(yf, yq) > 0.999


def test_all_float32_graph_equals_float_forward():
    settings = LayerSettings(trigger_float_op="float32_preferred")
    g = _mlp()
    q = quantize_model(g, _data(), settings=settings)
    assert all(not n.quantized for n in q.nodes)
    assert not [n for n in q.nodes if n.additional]
    x = _data(1)[0]
    assert torch.equal(run_quantized(q, x)[0], g.forward([x])[0])


def test_quantize_and_dequantize_match_independent_reference():
    g, q = _quantized({"act": {"trigger_float_op": "float32_preferred"}})
    x = _data(1)[0]
    q.forward([x], keep_tensors=True)
    quant = q.node("act_quantize")
    scale, zp = quant.params["quantize_scale"], quant.params["quantize_zp"]
    out = quant.outputs[0]
    p = q.quant.get(out)
    act = quant.inputs[0].betensor.numpy().astype(np.float32)
    ref = np.clip(np.round((act * np.float32(scale)).astype(np.float32) - np.float32(zp)), p.qmin, p.qmax)
    assert np.array_equal(out.betensor.numpy(), ref.astype(np.int64))
    deq = q.node("fc1_dequantize")
    qin = deq.inputs[0].betensor.numpy()
    ref = (qin.astype(np.float32) + np.float32(deq.params["quantize_zp"])) * (np.float32(1.0) /
                                                                             np.float32(deq.params["quantize_scale"]))
    assert np.array_equal(deq.outputs[0].betensor.numpy(), ref.astype(np.float32))


@pytest.mark.parametrize("float_type", ["float16_preferred", "bfloat16_preferred", "float32_preferred"])
def test_a_float_constant_of_indices_stays_exact_for_the_layer_reading_it(float_type: str) -> None:
    """InTopK reads exact integers: a float-island Constant of class indices crosses its border as integers of
    scale 1, as the Constant quantized in integers would (its border Quantize had quantized them from their range,
    which InTopK refused; found by benchmarks/fuzz_cfg_runs.py --layer-edits, docs/robustness.md)."""
    b = GraphBuilder("topk")
    b.input("x", [1, 8])
    b.layer("Constant", [], [[1]], name="target", constants={"weights": np.array([5], np.float32)})
    b.layer("InTopK", ["x", "target"], [[1]], name="intopk", params={"k": 3}, output_dtypes=[Dtype.UINT8])
    g = b.build(["intopk"])
    gen = torch.Generator().manual_seed(5)
    data = [torch.randn(1, 8, generator=gen) for _ in range(6)]
    q = quantize_model(g, data, per_layer={"target": {"trigger_float_op": float_type}})
    border = q.node("target_quantize")
    assert q.quant.get(border.outputs[0]).qinvariant and border.params["quantize_scale"] == 1.0
    for x in data:
        want = g.forward([x])[0]
        assert torch.equal(run_quantized(q, x)[0].to(want.dtype), want)


def test_an_integer_tensor_of_a_float_layer_crosses_into_integer_layers_as_it_is(tmp_path) -> None:
    """A float-island Reshape of an int32 mask read by a quantized Cast: no Quantize layer (it refused its integer
    input, "must be float"); the mask crosses as exact integers (scale 1, zero point 0), the result equals the float
    graph's, and the written IR reads back to the same forward (found by benchmarks/fuzz_cfg_runs.py
    --layer-edits, docs/robustness.md)."""
    b = GraphBuilder("mask")
    b.input("x", [1, 6])
    b.input("mask", [1, 6], dtype=Dtype.INT32)
    b.layer("Reshape", ["mask"], [[1, 1, 6]], name="unsqueeze", params={"shape": [1, 1, 6]},
            output_dtypes=[Dtype.INT32])
    b.layer("Cast", ["unsqueeze"], [[1, 1, 6]], name="cast", params={"to_dtype": "float32"})
    b.layer("Reshape", ["x"], [[1, 1, 6]], name="x3", params={"shape": [1, 1, 6]})
    b.layer("Mul", ["x3", "cast"], [[1, 1, 6]], name="masked")
    g = b.build(["masked"])
    gen = torch.Generator().manual_seed(2)
    data = [[torch.randn(1, 6, generator=gen), torch.randint(0, 2, (1, 6), generator=gen).to(torch.int32)]
            for _ in range(4)]
    q = quantize_model(g, data, per_layer={"unsqueeze": {"trigger_float_op": "float32_preferred"}})
    assert not any(str(n.type) == "Quantize" for n in q.nodes)
    p = q.quant.get(q.node("unsqueeze").outputs[0])
    assert p.qinvariant and p.scale == 1.0 and p.zerop == 0
    txt, _ = write_ir(q, str(tmp_path / "mask.txt"))
    r = read_ir(txt)
    for x in data:
        want = g.forward(x)[0]
        got = run_quantized(q, x)[0]
        assert cosine(got, want) > 0.99
        assert torch.equal(run_quantized(r, x)[0], got)


@pytest.mark.parametrize("mode, min_cos", [("float32_act_int_wht", 0.999), ("float16_act_fp8e4m3fn_wht", 0.995),
                                           ("float32_act_fp4e2m1fn_wht", 0.95)])
def test_weight_only_modes(tmp_path, mode, min_cos):
    g, q = _quantized({"fc1": {"trigger_float_op": mode, "q_mode_weight": "per_channel_symmetric_restricted_range"}})
    fc1 = q.node("fc1")
    w = fc1.constants["weights"]
    if "int" in mode:
        assert not w.betensor.is_floating_point() and w.dtype.value == "int8"
        assert "weights_scale" in fc1.constants
    else:
        assert w.dtype.value.startswith("float8" if "fp8" in mode else "float4")
    x = _data(1)[0]
    yq = run_quantized(q, x)
    yf = g.forward([x])
    assert cosine(g.node("fc1").outputs[0].betensor, q.node("fc1").outputs[0].betensor) > min_cos
    txt, _ = write_ir(q, str(tmp_path / "m.txt"))
    r = read_ir(txt)
    assert torch.equal(run_quantized(r, x)[0], yq[0])
    assert cosine(yf[0], yq[0]) > 0.9


def test_mixed_ir_round_trip_is_bit_identical(tmp_path):
    g, q = _quantized({"act": {"trigger_float_op": "bfloat16_preferred"},
                       "fc2": {"trigger_float_op": "float16_act_int_wht"}})
    txt, _ = write_ir(q, str(tmp_path / "mixed.txt"))
    text = Path(txt).read_text()
    assert "layer_type=Quantize" in text and "layer_type=DeQuantize" in text and "unquantifiable=true" in text
    r = read_ir(txt)
    assert _layer_types(r) == _layer_types(q)
    for x in _data(2):
        a = run_quantized(q, x)[0]
        b = run_quantized(r, x)[0]
        assert torch.equal(a, b)


def test_fake_quant_runs_chosen_layers_in_float():
    g, q = _quantized({})
    x = _data(1)[0]
    q.forward([x], keep_tensors=True)
    before = to_float(q.node("act").outputs[0]).clone()
    chosen = apply_fake_quant(g, q, [], ["Activation"])
    assert chosen == ["act"]
    q.forward([x], keep_tensors=True)
    g.forward([x], keep_tensors=True)
    qt = q.node("act").outputs[0]
    after = to_float(qt)
    # the float sigmoid of the dequantized input, quantized with the layer's own output params
    expected = torch.sigmoid(to_float(q.node("fc1").outputs[0]))
    from quantopt.analysis.similarity import to_quantized
    assert torch.equal(qt.betensor, to_quantized(expected, qt))
    assert not torch.equal(before, after) or torch.equal(before, to_float(qt))
    # the float graph's own values are untouched by the debug forward
    assert torch.allclose(g.node("act").outputs[0].betensor, torch.sigmoid(g.node("fc1").outputs[0].betensor))


def test_cli_trigger_float_op_and_template(tmp_path, capsys):
    cfg = example_cfg(tmp_path, trigger_float_op="disable & <[(3,4)]:float16_preferred> "
                                                  "<[FullyConnected]:float32_act_int_wht>")
    assert main(["--cfg", str(cfg)]) == 0
    out = tmp_path / "out"
    text = (out / "digits_o.txt").read_text()
    assert text.count("layer_type=DeQuantize") == 2 and text.count("layer_type=Quantize") == 2
    template = json.loads((out / "digits_opt_template.json").read_text())
    assert template["/conv2/Conv"]["trigger_float_op"] == "float16_preferred"
    assert template["/fc/Gemm"]["trigger_float_op"] == "float32_act_int_wht"
    assert not [k for k in template if k.endswith(("_quantize", "_dequantize"))]
    report = json.loads((out / "digits_report.json").read_text())
    metric = report["metrics"][0]
    assert metric["quant"] >= metric["float"] - 0.02
    # the template fed back reproduces the IR
    (tmp_path / "b").mkdir()
    cfg2 = example_cfg(tmp_path / "b", opt_config=str(out / "digits_opt_template.json"))
    assert main(["--cfg", str(cfg2)]) == 0
    assert (tmp_path / "b" / "out" / "digits_o.txt").read_text() == text


def test_cli_fake_quant_leaves_ir_unchanged(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg = example_cfg(tmp_path / "a")
    assert main(["--cfg", str(cfg)]) == 0
    cfg = example_cfg(tmp_path / "b", fake_quant_operators_for_debug="[Convolution]",
                      fake_quant_scopes_for_debug="[(8,9)]")
    assert main(["--cfg", str(cfg)]) == 0
    a = (tmp_path / "a" / "out" / "digits_o.txt").read_text()
    b = (tmp_path / "b" / "out" / "digits_o.txt").read_text()
    assert a == b


@pytest.mark.parametrize("field, value", [("trigger_float_op", "float8_preferred"),
                                          ("fake_quant_scopes_for_debug", "[(3,1)]"),
                                          ("fake_quant_operators_for_debug", "[NotAnOp]"),
                                          ("mixed_precision_auto_search", "1,0.1,X")])
def test_bad_values_name_the_field(tmp_path, capsys, field, value):
    cfg = example_cfg(tmp_path, **{field: value})
    assert main(["--cfg", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert field in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*_o.txt"))


def test_example_dir_exists():
    assert (EXAMPLE / "opt.cfg").is_file()


def test_float_layer_weights_carry_scale_one_and_zero_point_zero(tmp_path: Path) -> None:
    """A float layer's float weights are written with `weights_scale = 1.0` and `weights_zp = 0`, as upstream writes
    every float layer with weights (an RMSNorm under the X2 target's float16 default); its forward is unchanged
    (the weights are not weight-only quantized) and the IR reads back the same."""
    g, q = _quantized({"fc2": {"trigger_float_op": "float16_preferred!"}})
    fc2 = q.node("fc2")
    assert fc2.params["weights_scale"] == 1.0 and fc2.params["weights_zp"] == 0
    assert fc2.constants["weights"].betensor.is_floating_point()
    before = run_quantized(q, _data(1)[0])[0]
    write_ir(q, str(tmp_path / "q.txt"), str(tmp_path / "q.bin"))
    again = read_ir(str(tmp_path / "q.txt"), str(tmp_path / "q.bin"))
    assert again.node("fc2").params["weights_scale"] == 1.0
    assert torch.equal(run_quantized(again, _data(1)[0])[0], before)
    assert cosine(g.forward([_data(1)[0]])[0], before) > 0.99
