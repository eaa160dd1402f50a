"""Scale unification before quantization (unify_scales_for_concat, unify_scales_for_multi_inputs_operators): the
quantized Concat/Eltwise then needs no per-branch requantization, accuracy stays close to float, and the field
syntax is validated with one-line errors."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import pytest
import torch
from conftest import shared_model_dir
from quant_helpers import params_of

from quantopt.analysis.similarity import cosine, to_float
from quantopt.cli import main
from quantopt.config.fields import FIELDS, UPSTREAM_FIELDS
from quantopt.config.kinds import UnifyScalesKind
from quantopt.config.layer_settings import LayerSettings
from quantopt.config.perlayer import parse_per_layer
from quantopt.config.reader import read_cfg
from quantopt.errors import ConfigError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model
from quantopt.tuning.unify_scales import (
    UnifyRule,
    parse_unify_rules,
    unify_scales,
)

SHAPE = [1, 4, 4, 4]
GEO = dict(kernel_x=1, kernel_y=1, stride_x=1, stride_y=1, pad_left=0, pad_right=0, pad_top=0, pad_bottom=0,
           dilation_x=1, dilation_y=1, group=1)
POOL = dict(method="MAX", kernel_x=1, kernel_y=1, stride_x=1, stride_y=1, pad_left=0, pad_right=0, pad_top=0,
            pad_bottom=0)
ASYM = "per_tensor_asymmetric"


class Model:
    """A GraphBuilder with seeded 1x1 convolutions whose output ranges scale with `amp`."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.g = GraphBuilder("unify")
        self.x = self.g.input("x", SHAPE)

    def conv(self, x: str, name: str, amp: float, act: str = "RELU") -> str:
        w = self.rng.normal(0, amp, (4, 1, 1, 4)).astype(np.float32)
        return self.g.layer("Convolution", [x], [SHAPE], name=name, params=dict(num_output=4, with_activation=act,
                                                                                  **GEO),
                            constants={"weights": w, "biases": np.full(4, 0.05 * amp, np.float32)})

    def chain(self, x: str, ops: Sequence[str], prefix: str) -> str:
        for i, op in enumerate(ops):
            params = dict(shape=SHAPE) if op == "Reshape" else POOL
            x = self.g.layer(op, [x], [SHAPE], name=f"{prefix}{i}", params=params)
        return x

    def concat(self, xs: List[str], name: str = "cat") -> str:
        return self.g.layer("Concat", xs, [[1, 4, 4, 4 * len(xs)]], name=name, params={"axis": 3})


def data(n: int = 3) -> List[torch.Tensor]:
    return [torch.from_numpy(np.random.default_rng(10 + s).normal(0, 1, (4, *SHAPE[1:])).astype(np.float32))
            for s in range(n)]


def two_branch(mid: Sequence[str] = (), act1: str = "RELU", ratio: float = 5.0):
    m = Model()
    a = m.conv(m.x, "c0", 0.3, "RELU")
    b = m.chain(m.conv(m.x, "c1", 0.3 * ratio, act1), mid, "m")
    return m.g.build([m.concat([a, b])])


def quantized(graph, unify=None, mode: Optional[str] = None):
    settings = LayerSettings(q_mode_activation=mode) if mode else None
    return quantize_model(graph, data(), settings=settings, unify=unify)


def float_vs_quant(graph, qgraph) -> List[float]:
    x = data(4)[3]
    fs = [t.clone() for t in graph.forward([x])]
    qgraph.forward([x])
    return [cosine(f, to_float(q)) for f, q in zip(fs, qgraph.output_tensors)]


def assert_concat_passthrough(qgraph, name: str = "cat") -> None:
    """No per-branch requantization: no multipliers, and every branch carries the output's scale and zero point."""
    node = qgraph.node(name)
    assert "scale_value" not in node.params and "shift_value" not in node.params
    out = params_of(node, node.outputs[0])
    for t in node.inputs:
        p = params_of(node, t)
        assert p.scale == pytest.approx(out.scale, rel=1e-6) and int(p.zerop) == int(out.zerop), t.name


# ------------------------------------------------------------------------------------------------ field syntax
def test_rules_parse_to_canonical_entries() -> None:
    rules = parse_unify_rules(" [ (concat, 20, 1.05, MAX), (Eltwise,0,1,avg,) ,(Add, 3, 1., skip)] ")
    assert list(rules) == [UnifyRule("Concat", 20, 1.05, "max"), UnifyRule("Eltwise", 0, 1.0, "avg"),
                           UnifyRule("Add", 3, 1.0, "skip")]
    assert str(rules) == "[(Concat, 20, 1.05, max), (Eltwise, 0, 1, avg), (Add, 3, 1, skip)]"
    assert parse_unify_rules(str(rules)) == rules
    assert rules.rule_for("eltwise") == UnifyRule("Eltwise", 0, 1.0, "avg") and rules.rule_for("Conv") is None
    assert list(parse_unify_rules("")) == [] and list(parse_unify_rules("[]")) == []


@pytest.mark.parametrize("text, fragment", [
    ("(Concat, 20, 1.05, max)", "expected a list in brackets"),
    ("[(Concat, 20, 1.05)]", "needs 4 items"),
    ("[(Concat, 20, 1.05, max, 3)]", "needs 4 items"),
    ("[(Concatt, 20, 1.05, max)]", "unknown operator type 'Concatt'"),
    ("[(Concat, -1, 1.05, max)]", "depth '-1' of Concat"),
    ("[(Concat, 2.5, 1.05, max)]", "depth '2.5' of Concat"),
    ("[(Concat, 20, 0.9, max)]", "threshold 0.9 of Concat must be a finite number >= 1"),
    ("[(Concat, 20, abc, max)]", "threshold 'abc' of Concat is not a number"),
    ("[(Concat, 20, 1.05, median)]", "method 'median' of Concat is not one of max, min, avg, out, skip"),
    ("[(Concat, 20, 1.05, max), (concat, 1, 1, min)]", "listed twice"),
    ("[(Concat, 20, 1.05, max) x]", "expected '('"),
    ("[(Concat, 20, 1.05, max]", "missing ')'"),
])
def test_malformed_rules_are_rejected(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        UnifyScalesKind().parse(text)
    assert fragment in str(info.value)


def test_fields_are_real_entries() -> None:
    for name in ("unify_scales_for_concat", "unify_scales_for_concat_max_depth",
                 "unify_scales_for_multi_inputs_operators", "unify_scales_for_concat_threshold"):
        assert name in FIELDS and name not in UPSTREAM_FIELDS
    assert FIELDS["unify_scales_for_multi_inputs_operators"].per_layer
    assert FIELDS["unify_scales_for_concat"].default is False
    assert FIELDS["unify_scales_for_concat_max_depth"].default == 20


def write_cfg(tmp_path: Path, lines: str, graph: str = "g.txt") -> Path:
    (tmp_path / graph).write_text("model_name=m\n")
    path = tmp_path / "opt.cfg"
    path.write_text(f"[Common]\ngraph = {graph}\n" + lines)
    return path


def test_cfg_values_and_per_layer_syntax(tmp_path) -> None:
    cfg = read_cfg(str(write_cfg(tmp_path, "unify_scales_for_concat = true\nunify_scales_for_concat_max_depth = 3\n"
                                           "unify_scales_for_multi_inputs_operators = [(Eltwise, 4, 1.0, max)] & "
                                           "<{r2.*}:[(Eltwise, 0, 1, skip)]>\n")))
    assert cfg.unify_scales_for_concat is True and cfg.unify_scales_for_concat_max_depth == 3
    value = cfg.unify_scales_for_multi_inputs_operators
    assert list(value.resolve(1, "Eltwise", "r1_add")) == [UnifyRule("Eltwise", 4, 1.0, "max")]
    assert list(value.resolve(2, "Eltwise", "r2_add")) == [UnifyRule("Eltwise", 0, 1.0, "skip")]


@pytest.mark.parametrize("line, fragment", [
    ("unify_scales_for_multi_inputs_operators = [(Concat, 20, 1.05)]", "needs 4 items"),
    ("unify_scales_for_multi_inputs_operators = [(Concat, x, 1.05, max)]", "depth 'x' of Concat"),
    ("unify_scales_for_multi_inputs_operators = [(Concat, 2, 1, max)] & <{c}:[(Concat, 2, 1, best)]>",
     "method 'best' of Concat"),
    ("unify_scales_for_concat_max_depth = 0", "invalid value '0'"),
    ("unify_scales_for_concat = maybe", "not a boolean"),
])
def test_malformed_cfg_value_is_a_config_error_naming_the_field_and_line(tmp_path, line: str, fragment: str) -> None:
    path = write_cfg(tmp_path, "output_dir = out\n" + line + "\n")
    with pytest.raises(ConfigError) as info:
        read_cfg(str(path))
    message = str(info.value)
    key = line.split("=")[0].strip()
    assert f"{path}:4" in message and f"field '{key}'" in message and fragment in message and "\n" not in message


# ------------------------------------------------------------------------------------------------ the pass
def test_without_unification_the_concat_requantizes() -> None:
    q = quantized(two_branch())
    assert "scale_value" in q.node("cat").params


@pytest.mark.parametrize("method", ["out", "min", "max", "avg"])
def test_two_convs_share_one_scale_and_the_concat_writes_no_requant(method: str) -> None:
    plain = quantized(two_branch())
    s0, s1, s_out = (params_of(plain.node(n), plain.node(n).outputs[0]).scale for n in ("c0", "c1", "cat"))
    want = {"out": s_out, "min": min(s0, s1), "max": max(s0, s1), "avg": (s0 + s1) / 2}[method]
    g = two_branch()
    q = quantized(g, f"[(Concat, 20, 1.05, {method})]")
    assert_concat_passthrough(q)
    assert params_of(q.node("cat"), q.node("cat").outputs[0]).scale == pytest.approx(want, rel=1e-5)
    if method in ("out", "min"):  # the coarser scale covers both branches (max/avg clip the wider one by choice)
        assert float_vs_quant(g, q)[0] > 0.99


def test_report_lists_layers_and_ranges() -> None:
    g = two_branch()
    quantize_model(g, data())  # calibrated ranges and settings, then rewrite again explicitly
    before = {n: (g.ranges.get(g.node(n).outputs[0]).min, g.ranges.get(g.node(n).outputs[0]).max)
              for n in ("c0", "c1", "cat")}
    report = unify_scales(g, [UnifyRule("Concat", 20, 1.05, "out")])
    assert [grp.targets for grp in report.groups] == [["cat"]] and report.skipped == {}
    group = report.groups[0]
    changed = [(c.layer, c.layer_type) for c in group.changes]
    assert ("c0", "Convolution") in changed and set(changed) <= {("c0", "Convolution"), ("c1", "Convolution"),
                                                                 ("cat", "Concat")}
    qg = g.quantgraph
    assert group.scale == pytest.approx(params_of(qg.node("cat"), qg.node("cat").outputs[0]).scale, rel=1e-6)  # `out`
    for c in group.changes:
        r = g.ranges.get(g.node(c.layer).outputs[0])
        assert c.old_range == pytest.approx(before[c.layer]) and (r.min, r.max) == c.new_range != c.old_range
        assert c.new_range == pytest.approx((0.0, 255.0 / group.scale))  # unsigned ReLU outputs
        assert c.old_scale == pytest.approx(params_of(qg.node(c.layer), qg.node(c.layer).outputs[0]).scale)
    assert report.changed_layers == [c.layer for c in group.changes]
    assert report.group_of("cat") is group and report.group_of("c0") is None


def test_walks_through_shape_ops_and_max_pooling() -> None:
    g = two_branch(mid=("Reshape", "Pooling", "Reshape"))
    report_q = quantized(g, "[(Concat, 20, 1.05, out)]")
    assert_concat_passthrough(report_q)
    c1 = report_q.node("c1")
    for name in ("m0", "m1", "m2"):  # the shape ops carry the convolution's params unchanged
        m = report_q.node(name)
        assert params_of(m, m.outputs[0]).scale == params_of(c1, c1.outputs[0]).scale
    assert float_vs_quant(g, report_q)[0] > 0.99


def test_depth_limit_is_respected(caplog) -> None:
    g = two_branch(mid=("Reshape", "Reshape"))  # c1 is 2 layers above the Concat's input producer m1
    quantize_model(g, data())
    report = unify_scales(g, "[(Concat, 1, 1.05, out)]")
    assert report.groups == [] and "within depth 1" in report.skipped["cat"]
    q = quantized(two_branch(mid=("Reshape", "Reshape")), "[(Concat, 1, 1.05, out)]")
    assert "scale_value" in q.node("cat").params
    g2 = two_branch(mid=("Reshape", "Reshape"))
    q2 = quantized(g2, "[(Concat, 2, 1.05, out)]")
    assert_concat_passthrough(q2)
    assert float_vs_quant(g2, q2)[0] > 0.99


def test_threshold_is_respected() -> None:
    g = two_branch(ratio=1.3)
    quantize_model(g, data())
    scales = [params_of(g.quantgraph.node(n), g.quantgraph.node(n).outputs[0]).scale for n in ("c0", "c1")]
    ratio = max(scales) / min(scales)
    assert 1.1 < ratio < 1.9
    report = unify_scales(g, [UnifyRule("Concat", 0, ratio * 1.01, "out")])
    assert report.groups == [] and "within threshold" in report.skipped["cat"]
    report = unify_scales(g, [UnifyRule("Concat", 0, ratio * 0.99, "out")])
    assert [grp.targets for grp in report.groups] == [["cat"]]


def test_eltwise_add_listed_in_the_multi_inputs_field_uses_the_equal_scale_form() -> None:
    def build():
        m = Model(1)
        a = m.conv(m.x, "a", 0.3, "NONE")
        b = m.chain(m.conv(m.x, "b", 2.0, "RELU"), ("Pooling",), "p")
        y = m.g.layer("Eltwise", [a, b], [SHAPE], name="add", params={"method": "ADD", "with_activation": "NONE"})
        return m.g.build([y])

    plain = quantized(build())
    assert plain.node("add").params["scale_value"][1:] != [1, 1]
    g = build()
    q = quantized(g, "[(Eltwise, 0, 1.0, out)]")
    node = q.node("add")
    assert node.params["scale_value"][1:] == [1, 1]
    in0, in1 = params_of(node, node.inputs[0]), params_of(node, node.inputs[1])
    assert in0.scale == in1.scale and int(in0.zerop) == int(in1.zerop)
    assert in0.qmin < 0 <= in1.qmin  # a signed and an unsigned branch, one scale
    assert float_vs_quant(g, q)[0] > 0.99


@pytest.mark.parametrize("mode", [None, ASYM])
def test_mixed_signedness_and_asymmetric_activations(mode: Optional[str]) -> None:
    g = two_branch(act1="NONE")  # an unsigned (ReLU) and a signed branch
    q = quantized(g, "[(Concat, 20, 1.05, out)]", mode=mode)
    node = q.node("cat")
    assert "scale_value" not in node.params
    assert {int(params_of(node, t).zerop) for t in [*node.inputs, node.outputs[0]]} == {0}
    assert len({float(params_of(node, t).scale) for t in node.inputs}) == 1
    assert float_vs_quant(g, q)[0] > 0.99


def shared_graph():
    """cat1(a, b), cat2(b, c) share b; add(a, c); cat3(cat1, conv(add)) nests cat1."""
    m = Model(2)
    a, b, c = m.conv(m.x, "a", 0.3, "RELU"), m.conv(m.x, "b", 1.5, "NONE"), m.conv(m.x, "c", 0.8, "RELU")
    cat1, cat2 = m.concat([a, b], "cat1"), m.concat([b, c], "cat2")
    add = m.g.layer("Eltwise", [a, c], [SHAPE], name="add", params={"method": "ADD", "with_activation": "NONE"})
    d = m.conv(add, "d", 0.5, "NONE")
    cat3 = m.g.layer("Concat", [cat1, d], [[1, 4, 4, 12]], name="cat3", params={"axis": 3})
    return m.g.build([cat2, cat3])


def test_concats_sharing_layers_are_aligned_together() -> None:
    g = shared_graph()
    quantize_model(g, data())
    report = unify_scales(g, "[(Concat, 0, 1.05, out)]")
    assert [grp.targets for grp in report.groups] == [["cat1", "cat2", "cat3"]]
    q = quantized(shared_graph(), "[(Concat, 0, 1.05, out)]")
    for name in ("cat1", "cat2", "cat3"):
        assert_concat_passthrough(q, name)
    g2 = shared_graph()
    q2 = quantized(g2, "[(Concat, 0, 1.05, min)]")
    assert min(float_vs_quant(g2, q2)) > 0.99


def test_skip_and_per_layer_rules() -> None:
    g = shared_graph()
    quantize_model(g, data())
    value = parse_per_layer("[(Concat, 0, 1.05, out)] & <{cat2}:[(Concat, 0, 1.05, skip)]> "
                            "<{cat1}:[(Eltwise, 0, 1, max)]>", UnifyScalesKind().parse)
    report = unify_scales(g, value)
    assert [grp.targets for grp in report.groups] == [["cat3"]]


def test_nothing_listed_changes_nothing() -> None:
    g = two_branch()
    quantize_model(g, data())
    ranges = [(g.ranges.get(n.outputs[0]).min, g.ranges.get(n.outputs[0]).max) for n in g.nodes]
    for rules in (None, "", "[(Eltwise, 0, 1, max)]", [UnifyRule("Concat", 0, 1.0, "skip")]):
        assert unify_scales(g, rules).groups == []
    assert ranges == [(g.ranges.get(n.outputs[0]).min, g.ranges.get(n.outputs[0]).max) for n in g.nodes]


# ------------------------------------------------------------------------------------------------ through the CLI
def concat_ir(folder: Path) -> Path:
    g = two_branch(mid=("Reshape",))
    txt, _ = write_ir(g, str(folder / "cat.txt"))
    np.save(folder / "calib.npy", np.concatenate([d.numpy() for d in data()]))
    return Path(txt)


@pytest.mark.parametrize("unify", [False, True])
def test_cli_unify_scales_for_concat(tmp_path, unify: bool) -> None:
    txt = concat_ir(tmp_path)
    cfg = tmp_path / "opt.cfg"
    cfg.write_text(f"[Common]\ngraph = {txt.name}\nmodel_name = cat\ndataset = NumpyDataset\n"
                   f"calibration_data = calib.npy\ncalibration_batch_size = 4\noutput_dir = out\n"
                   f"unify_scales_for_concat = {str(unify).lower()}\nunify_scales_for_concat_max_depth = 2\n")
    assert main(["--cfg", str(cfg)]) == 0
    out = read_ir(str(tmp_path / "out" / "cat_o.txt"))
    assert ("scale_value" in out.node("cat").params) is not unify
    log = (tmp_path / "out" / "cat_opt.log").read_text()
    assert ("unify scales: 'cat' aligned to scale" in log) is unify
    if unify:
        assert "Convolution 'c0' output 'c0' range" in log


def test_cli_multi_inputs_field_on_a_shared_model(tmp_path) -> None:
    folder = shared_model_dir("syn_resnet")
    cfg = tmp_path / "opt.cfg"
    cfg.write_text(f"[Common]\ngraph = {folder / 'syn_resnet.txt'}\nmodel_name = syn_resnet\n"
                   f"dataset = NumpyDataset\ncalibration_data = {folder / 'calib.npy'}\ncalibration_batch_size = 2\n"
                   f"output_dir = {tmp_path / 'out'}\n"
                   "unify_scales_for_multi_inputs_operators = [(Eltwise, 10, 1.0, out)] & "
                   "<{/r2/.*}:[(Eltwise, 10, 1.0, skip)]>\n")
    assert main(["--cfg", str(cfg)]) == 0
    out = read_ir(str(tmp_path / "out" / "syn_resnet_o.txt"))
    r1, r2 = out.node("/r1/Add"), out.node("/r2/Add")
    assert r1.params["scale_value"][1:] == [1, 1]
    assert params_of(r1, r1.inputs[0]).scale == params_of(r1, r1.inputs[1]).scale
    assert r2.params["scale_value"][1:] != [1, 1]
    val = torch.from_numpy(np.load(folder / "val.npy"))
    ref = read_ir(str(folder / "syn_resnet.txt"))
    f = ref.forward([val])[0].clone()
    out.forward([val])
    assert cosine(f, to_float(out.output_tensors[0])) > 0.99


def test_cli_malformed_field_is_one_line_exit_2(tmp_path, capsys) -> None:
    txt = concat_ir(tmp_path)
    cfg = tmp_path / "opt.cfg"
    cfg.write_text(f"[Common]\ngraph = {txt.name}\ncalibration_data = calib.npy\ndataset = NumpyDataset\n"
                   "unify_scales_for_multi_inputs_operators = [(Concat, 20, 1.05, biggest)]\n")
    assert main(["--cfg", str(cfg)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[ERROR]")]
    assert len(err) == 1 and f"{cfg}:5" in err[0] and "unify_scales_for_multi_inputs_operators" in err[0]
    assert "method 'biggest' of Concat" in err[0]
