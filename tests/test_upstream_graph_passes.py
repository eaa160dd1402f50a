"""Upstream's remaining `enable_pass_*` fields (docs/user-guide.md, "Graph passes"): split_qkv_fc_in_transformer,
decompose_nonmonotonic_activations, tune_op_softmax, tune_op_complicated_activations, deeply_set_unquantifiable,
and the refused convert_resize_to_convolution (scaled_dot_product_attention: tests/test_sdpa_pass.py). For each: a
graph where it applies, one where it must not, the float outputs, the quantized effect, and a cfg run through
`quantopt.cli.main`."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import pytest
import torch

from quantopt.cli import main
from quantopt.config.fields import FIELDS, UPSTREAM_FIELDS
from quantopt.config.kinds_passes import TuneOpValue, parse_tune_op
from quantopt.config.perlayer import parse_per_layer
from quantopt.errors import ConfigError
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import QuantizeGraph
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.passes.decompose_activations import MIN_ELEMENTS, decompose_nonmonotonic_activations
from quantopt.passes.deep_float import deeply_set_unquantifiable
from quantopt.passes.split_qkv_fc import split_qkv_fc
from quantopt.passes.tune_op import tune_op_complicated_activations, tune_op_softmax
from quantopt.pipeline import (
    calibrate,
    collect_statistics,
    finish_settings,
    graph_passes,
    quantize_calibrated,
    quantize_model,
    run_quantized,
    settings_from_arguments,
)

NEW_FIELDS = {"enable_pass_tune_op_softmax": TuneOpValue(((0.0,), (0.0,))),
              "enable_pass_tune_op_complicated_activations": TuneOpValue(((0.0,), (0.0,))),
              "enable_pass_split_qkv_fc_in_transformer": False,
              "enable_pass_scaled_dot_product_attention": False,
              "enable_pass_convert_resize_to_convolution": False,
              "enable_pass_decompose_nonmonotonic_activations": False,
              "enable_pass_deeply_set_unquantifiable": True}  # upstream runs it whatever its cfg says


def _types(graph: QuantizeGraph) -> Dict[str, str]:
    return {n.name: str(n.type) for n in graph.nodes}


def _outputs(graph: QuantizeGraph, batch: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    graph.forward(list(batch))
    return [t.betensor.clone() for t in graph.output_tensors]


def test_fields_declared_with_upstream_defaults() -> None:
    for name, default in NEW_FIELDS.items():
        assert name in FIELDS and name not in UPSTREAM_FIELDS
        assert FIELDS[name].default == default, name
    assert str(FIELDS["enable_pass_tune_op_softmax"].default) == "[0][0]"
    assert FIELDS["enable_pass_tune_op_softmax"].per_layer
    assert FIELDS["enable_pass_decompose_nonmonotonic_activations"].per_layer
    assert not FIELDS["enable_pass_split_qkv_fc_in_transformer"].per_layer


def test_tune_op_value_grammar() -> None:
    v = parse_tune_op(" [1, 8] [0,1.5]")
    assert v.extra == (1.0, 8.0) and v.approx == (0.0, 1.5) and str(v) == "[1,8][0,1.5]"
    assert parse_tune_op("[0][1,1][0][1,1][0][1,1]").groups[2] == (0.0,)
    for bad in ("", "0", "[a][0]", "[0.5][0]", "[0][0]x", "[][0]"):
        with pytest.raises(ValueError):
            parse_tune_op(bad)


# --------------------------------------------------------------------------------------------- split_qkv_fc
def _qkv(axis: int = -1, extra_reader: bool = False, seed: int = 0) -> QuantizeGraph:
    """x[2,16] -> FC(48, fused RELU off) -> Split into q, k, v of 16; k's weights 4x, v's 0.25x larger than q's."""
    r = np.random.default_rng(seed)
    w = r.normal(0, 0.3, (48, 16)).astype(np.float32)
    w[16:32] *= 4.0
    w[32:] *= 0.25
    b = GraphBuilder("qkv")
    b.input("x", [2, 16])
    b.layer("FullyConnected", ["x"], [[2, 48]], name="qkv", params={"num_output": 48, "with_activation": "NONE"},
            constants={"weights": w, "biases": r.normal(0, 0.1, 48).astype(np.float32)})
    shapes = [[2, 16]] * 3 if axis == -1 else [[1, 48], [1, 48]]
    outs = b.layer("Split", ["qkv"], shapes, name="split", outputs=["q", "k", "v"][:len(shapes)],
                   params={"axis": axis, "splits": [16, 16, 16] if axis == -1 else [1, 1]})
    outs = list(outs)
    if extra_reader:
        b.layer("Activation", ["qkv"], [[2, 48]], name="relu", params={"method": "RELU"})
        outs.append("relu")
    return b.build(outs)


def _x(seed: int = 1, n: int = 3) -> List[List[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(2, 16, generator=g)] for _ in range(n)]


def test_split_qkv_fc_splits_and_keeps_the_float_outputs() -> None:
    g = _qkv()
    before = _outputs(g, _x()[0])
    done = split_qkv_fc(g)
    assert done == [("qkv", ["qkv0", "qkv1", "qkv2"])]
    assert _types(g) == {"x": "Input", "qkv0": "FullyConnected", "qkv1": "FullyConnected", "qkv2": "FullyConnected"}
    w = _qkv().node("qkv").constants["weights"].betensor
    for i in range(3):
        part = g.node(f"qkv{i}")
        assert part.params["num_output"] == 16 and part.outputs[0].name == ["q", "k", "v"][i]
        assert torch.equal(part.constants["weights"].betensor, w[16 * i:16 * (i + 1)])
    after = _outputs(g, _x()[0])
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("case", ["axis0", "extra_reader"])
def test_split_qkv_fc_leaves_other_pairs(case: str) -> None:
    g = _qkv(axis=0) if case == "axis0" else _qkv(extra_reader=True)
    names = _types(g)
    assert split_qkv_fc(g) == [] and _types(g) == names


def test_split_qkv_fc_gives_each_part_its_scale() -> None:
    """One FullyConnected has one output scale for q, k and v; split, each part is calibrated on its own range."""
    joint = quantize_model(_qkv(), _x())
    g = _qkv()
    graph_passes(g, split_qkv_fc_in_transformer=True)
    split = quantize_model(g, _x())
    scales = [float(split.quant.get(t).scale) for t in split.output_tensors]
    assert len({float(joint.quant.get(t).scale) for t in joint.output_tensors}) == 1
    assert scales[1] < scales[0] / 2 and scales[2] > scales[0] * 2  # k has the widest range, v the narrowest
    batch = _x()[0]  # a calibration batch: no clipping, only rounding
    ref = _outputs(_qkv(), batch)
    err_joint = [float((a - b).abs().max()) for a, b in zip(run_quantized(joint, batch), ref)]
    err_split = [float((a - b).abs().max()) for a, b in zip(run_quantized(split, batch), ref)]
    assert err_split[2] < err_joint[2] / 4  # v, the narrowest part, gains most


# --------------------------------------------------------------------------------------------- decompose
BIG = [1, 1024, 2048]


def _act(method: str, shape: Sequence[int] = BIG, **params: float) -> QuantizeGraph:
    b = GraphBuilder("act")
    b.input("x", list(shape))
    b.layer("Activation", ["x"], [list(shape)], name="act", params={"method": method, **params})
    return b.build(["act"])


def _big_input(shape: Sequence[int] = BIG, seed: int = 2) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("method,gate,params", [("SILU", "SIGMOID", {}), ("SWISH", "SIGMOID", {"alpha": 1.0}),
                                                ("HARDSWISH", "HARDSIGMOID", {})])
def test_decompose_large_nonmonotonic_activation(method: str, gate: str, params: Dict[str, float]) -> None:
    assert int(np.prod(BIG)) == MIN_ELEMENTS
    g = _act(method, **params)
    x = _big_input()
    before = _outputs(g, [x])[0]
    assert decompose_nonmonotonic_activations(g, True) == [("act", gate)]
    assert _types(g) == {"x": "Input", "act/nonmonotonic": "Activation", "act/Mul": "Mul"}
    assert g.node("act/nonmonotonic").params["method"] == gate
    assert g.output_tensors[0].name == "act" and g.output_tensors[0].pnode.name == "act/Mul"
    after = _outputs(g, [x])[0]
    assert torch.allclose(before, after, rtol=0, atol=2e-6)


def test_decomposed_silu_quantizes_close_to_float() -> None:
    """The gate and the product quantize and run as integers; the product adds one rounding (measured: RMS error
    0.0411 undecomposed, 0.0416 decomposed on this input, docs/user-guide.md). The gate is calibrated on its own
    output: a sigmoid's range [0, 1] at 8 bits unsigned is scale about 255 (it once shared the product's statistics)."""
    x = _big_input()
    ref = _outputs(_act("SILU"), [x])[0]
    g = _act("SILU")
    graph_passes(g, decompose_nonmonotonic_activations=True)
    q = quantize_model(g, [[x]])
    assert [str(n.type) for n in q.nodes] == ["Input", "Activation", "Mul"]
    gate = q.quant.get(q.node("act/nonmonotonic").outputs[0])
    assert abs(float(gate.scale) - 255.0) < 0.01  # the range [0, max sigmoid], not the product's (scale 18.1)
    err = run_quantized(q, [x])[0] - ref
    assert float(err.pow(2).mean().sqrt()) < 0.045 and float(err.abs().max()) < 0.15


def test_decompose_leaves_small_or_disabled_layers() -> None:
    small = _act("SILU", [1, 1024, 2047])
    assert decompose_nonmonotonic_activations(small, True) == [] and "act" in _types(small)
    big = _act("SILU")
    off = parse_per_layer("true & <{act}:false>", lambda t: t.strip() == "true")
    assert decompose_nonmonotonic_activations(big, off) == [] and "act" in _types(big)
    assert decompose_nonmonotonic_activations(_act("SIGMOID"), True) == []


@pytest.mark.parametrize("method,params", [("GELU", {}), ("MISH", {}), ("SWISH", {"alpha": 2.0})])
def test_decompose_refuses_gates_quantopt_lacks(method: str, params: Dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="enable_pass_decompose_nonmonotonic_activations.*'act'"):
        decompose_nonmonotonic_activations(_act(method, **params), True)


# --------------------------------------------------------------------------------------------- tune_op
def _softmaxes() -> QuantizeGraph:
    """x[1,4,16] -> Softmax sm1 -> Reshape -> Softmax sm2 (graph output: LUT when automatic)."""
    b = GraphBuilder("sm")
    b.input("x", [1, 4, 16])
    b.layer("Softmax", ["x"], [[1, 4, 16]], name="sm1", params={"axis": -1})
    b.layer("Reshape", ["sm1"], [[1, 4, 16]], name="rs", params={"shape": [1, 4, 16]})
    b.layer("Softmax", ["rs"], [[1, 4, 16]], name="sm2", params={"axis": -1})
    return b.build(["sm2"])


def _sm_batches(n: int = 3) -> List[List[torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [[torch.randn(1, 4, 16, generator=g) * 3] for _ in range(n)]


def _methods(q: QuantizeGraph) -> Dict[str, tuple]:
    return {n.name: (n.params.get("quantize_method"), n.params.get("adjust_q")) for n in q.nodes
            if str(n.type) == "Softmax"}


def test_tune_op_softmax_default_keeps_the_automatic_choice() -> None:
    g = _softmaxes()
    assert tune_op_softmax(g, FIELDS["enable_pass_tune_op_softmax"].default) == []
    assert _methods(quantize_model(g, _sm_batches())) == {"sm1": ("FAST_EXP", 8), "sm2": ("LUT", None)}


@pytest.mark.parametrize("text,expected", [
    ("[1][0]", {"sm1": ("FAST_EXP", 1), "sm2": ("FAST_EXP", 1)}),
    ("[1,9]", {"sm1": ("FAST_EXP", 9), "sm2": ("FAST_EXP", 9)}),
    ("[2,20][0]", {"sm1": ("LUT", None), "sm2": ("LUT", None)}),
    ("[0][0] & <{sm2}:[1,0][1]>", {"sm1": ("FAST_EXP", 8), "sm2": ("FAST_EXP", 0)}),
])
def test_tune_op_softmax_fixes_the_method(text: str, expected: Dict[str, tuple]) -> None:
    value = parse_per_layer(text, parse_tune_op)
    g = _softmaxes()
    batch = _sm_batches(1)[0]
    before = _outputs(g, batch)[0]
    tune_op_softmax(g, value)
    assert torch.equal(before, _outputs(g, batch)[0])  # the float model does not change
    q = quantize_model(g, _sm_batches())
    assert _methods(q) == expected
    got = run_quantized(q, batch)[0]
    assert float((got - before).abs().max()) < 0.15  # power-of-two FAST_EXP (adjust_q 0/1) is coarse


@pytest.mark.parametrize("text,match", [
    ("[2][0]", "28-bit values"),  # upstream's default width for a 16-long axis: max(16, 32 - 4)
    ("[2,16]", "16-bit values"),
    ("[3][0]", "quant_method must be 0"),
    ("[1,4][0]", "adjust_q must be 0, 1 or 8..15"),
    ("[0][2]", "approx_method must be 0 or 1"),
])
def test_tune_op_softmax_refuses_what_quantopt_cannot_do(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=f"enable_pass_tune_op_softmax = .*'sm1'.*{match}"):
        tune_op_softmax(_softmaxes(), parse_tune_op(text))


def test_tune_op_complicated_activations_checks_values() -> None:
    g = _act("SIGMOID", [1, 4, 8])
    assert tune_op_complicated_activations(g, parse_tune_op("[0][0]")) == []
    assert tune_op_complicated_activations(g, parse_tune_op("[0][1,1]")) == ["act"]  # X3-only: noted, no change
    assert "lut" not in g.node("act").params and g.node("act").params["method"] == "SIGMOID"
    with pytest.raises(ConfigError, match="enable_pass_tune_op_complicated_activations.*quant_method must be 0"):
        tune_op_complicated_activations(g, parse_tune_op("[1][0]"))
    with pytest.raises(ConfigError, match="approx_method must be 0 or 1"):
        tune_op_complicated_activations(g, parse_tune_op("[0][3]"))
    relu = _act("RELU", [1, 4, 8])
    assert tune_op_complicated_activations(relu, parse_tune_op("[5][5]")) == []  # not a complicated activation


# --------------------------------------------------------------------------------------------- deep float
def _float_chain() -> QuantizeGraph:
    """x -> sig (float16 by the test's settings) -> Reshape -> Transpose -> Add(x') -> out; plus a Reshape of x."""
    b = GraphBuilder("chain")
    b.input("x", [1, 4, 8])
    b.layer("Activation", ["x"], [[1, 4, 8]], name="sig", params={"method": "SIGMOID"})
    b.layer("Reshape", ["sig"], [[1, 8, 4]], name="rs", params={"shape": [1, 8, 4]})
    b.layer("Transpose", ["rs"], [[1, 4, 8]], name="tr", params={"perm": [0, 2, 1]})
    b.layer("Reshape", ["x"], [[1, 4, 8]], name="rx", params={"shape": [1, 4, 8]})
    b.layer("Add", ["tr", "rx"], [[1, 4, 8]], name="add", params={"with_activation": "NONE"})
    return b.build(["add"])


def _quantize_chain(deep: bool) -> QuantizeGraph:
    g = _float_chain()
    settings_from_arguments(g, per_layer={"sig": {"trigger_float_op": "float16_preferred"}})
    finish_settings(g, deeply_set_unquantifiable=deep)
    g2 = torch.Generator().manual_seed(3)
    collect_statistics(g, [[torch.randn(1, 4, 8, generator=g2)] for _ in range(3)])
    calibrate(g)
    return quantize_calibrated(g)


def test_deeply_set_unquantifiable_marks_shape_chains() -> None:
    g = _float_chain()
    settings_from_arguments(g, per_layer={"sig": {"trigger_float_op": "float16_preferred!"}})
    assert deeply_set_unquantifiable(g) == ["rs", "tr"]
    assert g.node("tr").settings.trigger_float_op == "float16_preferred!"
    assert g.node("rx").settings.trigger_float_op == "disable" and g.node("add").settings.trigger_float_op == "disable"


def test_deeply_set_unquantifiable_warns_when_it_overrides_a_layers_own_value(caplog) -> None:
    """A shape-only layer set to disable for itself (an opt_config edit) is still made float, as upstream's pass
    does, but with a warning naming it (found by benchmarks/fuzz_cfg_runs.py --layer-edits)."""
    g = _float_chain()
    settings_from_arguments(g, per_layer={"sig": {"trigger_float_op": "float16_preferred"},
                                          "tr": {"trigger_float_op": "disable"}})
    with caplog.at_level("WARNING", logger="quantopt"):
        assert deeply_set_unquantifiable(g) == ["rs", "tr"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "layer 'tr' (Transpose) runs in float after float layer 'rs', though " \
        "trigger_float_op = disable is set for it" in warned[0], warned


def test_deeply_set_unquantifiable_moves_the_quantize_layer() -> None:
    plain, deep = _quantize_chain(False), _quantize_chain(True)
    unq = {n.name for n in deep.nodes if n.params.get("unquantifiable")}
    assert {"sig", "rs", "tr"} <= unq and "rx" not in unq and "add" not in unq
    assert {n.name for n in plain.nodes if n.params.get("unquantifiable") and not n.additional} == {"sig"}
    q_reads = {str(n.type): n.inputs[0].pnode.name for n in deep.nodes if n.additional}
    assert q_reads.get("Quantize") == "tr"
    batch = [torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(8))]
    ref = _outputs(_float_chain(), batch)[0]
    assert float((run_quantized(deep, batch)[0] - ref).abs().max()) < 0.05


# --------------------------------------------------------------------------------------------- refused passes
def _attention() -> QuantizeGraph:
    b = GraphBuilder("attn")
    b.input("q", [1, 4, 8])
    b.input("k", [1, 8, 4])
    b.input("v", [1, 4, 8])
    b.layer("MatMul", ["q", "k"], [[1, 4, 4]], name="qk", params={"trans_a": False, "trans_b": False})
    b.layer("Softmax", ["qk"], [[1, 4, 4]], name="sm", params={"axis": -1})
    b.layer("MatMul", ["sm", "v"], [[1, 4, 8]], name="pv", params={"trans_a": False, "trans_b": False})
    return b.build(["pv"])


def test_scaled_dot_product_attention_leaves_unscaled_chains() -> None:
    """Upstream fuses only a chain whose Q·K MatMul has a folded constant scale; this one has none."""
    g = _attention()
    graph_passes(g, scaled_dot_product_attention=True, merge_matmul_mul_pass=False)
    assert _types(g) == _types(_attention())
    g = _softmaxes()
    graph_passes(g, scaled_dot_product_attention=True)  # nothing to fuse: nothing changes
    assert _types(g) == _types(_softmaxes())


def test_convert_resize_to_convolution_is_refused() -> None:
    with pytest.raises(ConfigError, match="enable_pass_convert_resize_to_convolution.*compat_quantized_model"):
        graph_passes(_softmaxes(), convert_resize_to_convolution=True)


# --------------------------------------------------------------------------------------------- through the CLI
def _run_cfg(tmp_path: Path, graph: QuantizeGraph, data: np.ndarray, lines: Sequence[str],
             name: str = "m") -> tuple:
    write_ir(graph, str(tmp_path / f"{name}.txt"))
    np.save(tmp_path / "calib.npy", data)
    cfg = tmp_path / "opt.cfg"
    cfg.write_text("[Common]\n" + "".join(f"{line}\n" for line in [
        f"graph = {tmp_path / f'{name}.txt'}", f"model_name = {name}", "dataset = NumpyDataset",
        f"calibration_data = {tmp_path / 'calib.npy'}", f"output_dir = {tmp_path / 'out'}", *lines]))
    code = main(["--cfg", str(cfg), "--log-level", "ERROR"])
    log = (tmp_path / "out" / f"{name}_opt.log")
    out_ir = tmp_path / "out" / f"{name}_o.txt"
    return code, (log.read_text() if log.exists() else ""), (read_ir(str(out_ir)) if code == 0 else None)


def _np(batches: List[List[torch.Tensor]]) -> np.ndarray:
    return np.concatenate([b[0].numpy() for b in batches])


def test_cli_split_qkv_fc(tmp_path: Path) -> None:
    code, log, q = _run_cfg(tmp_path, _qkv(), _np(_x(n=4)), ["enable_pass_split_qkv_fc_in_transformer = true",
                                                             "calibration_batch_size = 2"])
    assert code == 0, log
    assert [n.name for n in q.nodes if str(n.type) == "FullyConnected"] == ["qkv0", "qkv1", "qkv2"]
    assert "split" not in _types(q)


def test_cli_tune_op_softmax_and_deep_float(tmp_path: Path) -> None:
    data = _np(_sm_batches(4))
    code, log, q = _run_cfg(tmp_path, _softmaxes(), data, [
        "enable_pass_tune_op_softmax = [0][0] & <[Softmax]:[1,8]>",
        "enable_pass_tune_op_complicated_activations = [0][1,1]",
        "trigger_float_op = disable & <{sm1}:float16_preferred>",
        "enable_pass_deeply_set_unquantifiable = true"])
    assert code == 0, log
    assert _methods(q)["sm2"] == ("FAST_EXP", 8)
    unq = {n.name for n in q.nodes if n.params.get("unquantifiable")}
    assert {"sm1", "rs"} <= unq and "sm2" not in unq


@pytest.mark.parametrize("line,match", [
    ("enable_pass_convert_resize_to_convolution = true", "compat_quantized_model"),
    ("enable_pass_tune_op_softmax = [2,16]", "16-bit values"),
    ("enable_pass_tune_op_softmax = [0]x", "enable_pass_tune_op_softmax"),
    ("enable_pass_decompose_nonmonotonic_activations = maybe", "enable_pass_decompose_nonmonotonic_activations"),
])
def test_cli_refusals(tmp_path: Path, line: str, match: str, capsys: pytest.CaptureFixture) -> None:
    code, log, _ = _run_cfg(tmp_path, _attention_with_softmax_output(), np.zeros((2, 4, 8), np.float32),
                            [line, "calibrate_with_zero_inputs = true"], name="a")
    assert code != 0
    text = log + capsys.readouterr().err
    assert match in text


def _attention_with_softmax_output() -> QuantizeGraph:
    """One input: x -> MatMul(x, x^T) -> Softmax -> MatMul(.., x)."""
    b = GraphBuilder("a")
    b.input("x", [1, 4, 8])
    b.layer("Transpose", ["x"], [[1, 8, 4]], name="xt", params={"perm": [0, 2, 1]})
    b.layer("MatMul", ["x", "xt"], [[1, 4, 4]], name="qk", params={"trans_a": False, "trans_b": False})
    b.layer("Softmax", ["qk"], [[1, 4, 4]], name="sm", params={"axis": -1})
    b.layer("MatMul", ["sm", "x"], [[1, 4, 8]], name="pv", params={"trans_a": False, "trans_b": False})
    return b.build(["pv"])


def test_cli_decompose(tmp_path: Path) -> None:
    data = _big_input().numpy()
    code, log, q = _run_cfg(tmp_path, _act("SILU"), data, ["enable_pass_decompose_nonmonotonic_activations = true"])
    assert code == 0, log
    assert _types(q) == {"x": "Input", "act/nonmonotonic": "Activation", "act/Mul": "Mul"}
