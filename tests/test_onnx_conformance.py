"""ONNX conformance regression guard: the onnx wheel's backend test cases (node, pytorch-converted,
pytorch-operator) through import + float forward, against tests/data/onnx_conformance_baseline.json.

The quick test runs a deterministic slice (every pytorch case, a few baseline passes of every node op type);
QUANTOPT_ONNX_CONFORMANCE=full runs every case here, as `python -m quantopt.frontends.onnx.conformance --check`
does. Refresh the baseline with `... conformance --write-baseline` after an intended change.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the optional dependency 'onnx' is not installed (pip install onnx)")

from quantopt.frontends.onnx import conformance as conf  # noqa: E402

FULL = os.environ.get("QUANTOPT_ONNX_CONFORMANCE", "").lower() == "full"


@pytest.fixture(scope="module")
def baseline():
    if not os.path.isfile(conf.BASELINE):
        pytest.skip(f"baseline {conf.BASELINE} is not present")
    return conf.load_baseline()


def _report(results) -> None:
    per_suite = conf.counts(results)
    for suite in conf.SUITES:
        print(f"\n{suite}\n" + conf.table(per_suite.get(suite, {})))


def _check(results, baseline, expected=None) -> None:
    _report(results)
    bad = conf.regressions(results, baseline, expected)
    if bad and onnx.__version__ != baseline["onnx_version"]:
        pytest.skip(f"{len(bad)} differences, but the baseline was recorded with onnx {baseline['onnx_version']}, "
                    f"this is onnx {onnx.__version__}; rerun --write-baseline")
    assert not bad, f"{len(bad)} regression(s) against the baseline:\n" + "\n".join(bad)


def test_baseline_file_is_consistent(baseline):
    """Counts, totals and the passing-name lists describe the same run; nothing failed when it was recorded."""
    assert set(baseline["counts"]) == set(conf.SUITES)
    for suite, per_op in baseline["counts"].items():
        passed = baseline["passed"].get(suite, {})
        assert conf.totals(per_op) == baseline["totals"][suite]
        for op, c in per_op.items():
            assert c["pass"] == len(passed.get(op, [])), (suite, op)
        assert baseline["totals"][suite]["fail"] == 0, suite
    assert baseline["totals"]["node"]["pass"] >= 850
    assert baseline["totals"]["pytorch-converted"]["pass"] >= 60
    assert baseline["totals"]["pytorch-operator"]["pass"] >= 30


@pytest.mark.skipif(FULL, reason="the full run below covers it")
def test_quick_slice_has_no_regressions(baseline):
    select = conf.quick_selection(baseline)
    assert len(select["node"]) >= 300
    results = conf.run_all(conf.SUITES, select=select, light=True)
    ops = {r.op for r in results if r.status == "pass"}
    assert len(ops) >= 150
    expected = conf.expected_passes(baseline)
    expected["node"] &= select["node"]
    _check(results, baseline, expected)
    assert not [r for r in results if r.status == "fail"]
    # every layer type the importer made has an ONNX QDQ mapping, so a quantized import can be exported
    assert len({t for r in results for t in r.layer_types}) >= 60
    assert not conf.unexported_types(results)


@pytest.mark.skipif(not FULL, reason="set QUANTOPT_ONNX_CONFORMANCE=full (or run "
                    "python -m quantopt.frontends.onnx.conformance --check)")
def test_full_run_has_no_regressions(baseline):
    results = conf.run_all()
    _check(results, baseline)
    assert not [f"{r.suite}/{r.name}: {r.detail}" for r in results if r.status == "fail"]
    assert not conf.unexported_types(results)


def test_unexported_types_names_the_cases():
    results = [conf.Result("node", "test_a", "Foo", "pass", "", ("Convolution", "NoSuchLayer")),
               conf.Result("node", "test_b", "Foo", "skip", "x")]
    assert conf.unexported_types(results) == {"NoSuchLayer": ["node/test_a"]}


# ------------------------------------------------------------------------------------------ the runner itself
def _fake_baseline():
    return {"onnx_version": onnx.__version__, "passed": {"node": {"Relu": ["test_a", "test_b"], "Abs": ["test_c"]},
                                                         "pytorch-operator": {"Exp": ["test_d"]}}}


def test_regressions_flag_fail_skip_and_missing_cases():
    base = _fake_baseline()
    R = conf.Result
    results = [R("node", "test_a", "Relu", "pass", ""), R("node", "test_b", "Relu", "skip", "no"),
               R("node", "test_c", "Abs", "fail", "max error"), R("node", "test_new", "Abs", "fail", "x")]
    bad = conf.regressions(results, base)
    assert len(bad) == 3
    assert any("test_b" in b and "now skip" in b for b in bad)
    assert any("test_c" in b and "now fail" in b for b in bad)
    assert any("pytorch-operator/test_d" in b and "not run" in b for b in bad)
    only_node = conf.regressions(results, base, conf.expected_passes(base, ["node"], {"Relu"}))
    assert only_node == [b for b in bad if "test_b" in b]
    assert conf.regressions([R("node", n, "Relu", "pass", "") for n in ("test_a", "test_b")], base,
                            {"node": {"test_a", "test_b"}}) == []


def test_compare_tolerances():
    ref = np.linspace(-2, 2, 12, dtype=np.float32)
    assert conf._compare(ref + 1e-5, ref) == ""
    assert "max error" in conf._compare(ref + 1e-3, ref)
    assert conf._compare((ref + 1e-3).astype(np.float16), ref.astype(np.float16)) == ""  # 16-bit expected values
    assert conf._compare(np.array([1, 2]), np.array([1, 3], np.int64)) == "integer/bool output differs"
    assert conf._compare(np.array([np.nan, 1.0]), np.array([0.0, 1.0])) == "NaN pattern differs"
    assert conf._compare(np.array([np.inf]), np.array([-np.inf])) == "inf values differ"
    assert conf._compare(np.zeros(4), np.zeros((2, 2))) == ""
    assert "shape" in conf._compare(np.zeros(3), np.zeros((2, 2)))


def test_old_opset_is_upgraded_and_tensor_protos_are_read():
    """An opset-6 model is upgraded as docs/onnx.md tells users to; TensorProto test values are converted."""
    from onnx import TensorProto, helper, numpy_helper
    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)])
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    status, detail = conf.run_case(model, [numpy_helper.from_array(x)], [numpy_helper.from_array(np.maximum(x, 0))])
    assert (status, detail) == ("pass", "")
    status, _ = conf.run_case(model, [x], [np.minimum(x, 0)])
    assert status == "fail"


def test_cli_writes_and_checks_a_baseline(tmp_path, capsys):
    path = tmp_path / "b.json"
    assert conf.main(["--suite", "pytorch-operator", f"--write-baseline={path}"]) == 0
    data = json.loads(path.read_text())
    assert data["totals"]["pytorch-operator"]["pass"] >= 30
    assert "| Conv | 1 | 0 | 0 |" in capsys.readouterr().out
    assert conf.main(["--suite", "pytorch-operator", f"--check={path}"]) == 0
    data["passed"]["pytorch-operator"]["Exp"].append("test_not_there")
    path.write_text(json.dumps(data))
    assert conf.main(["--suite", "pytorch-operator", "Exp", f"--check={path}"]) == 1
    assert "REGRESSION pytorch-operator/test_not_there" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        conf.main(["--suite", "pytorch-operator", "--write-baseline"])  # a partial run never overwrites the default
