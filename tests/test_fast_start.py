"""The commands that compute nothing answer without loading torch (numpy, networkx, onnx, onnxruntime):
`--version`, `--help` and the subcommands' `--help`, `--field`, and cfg errors found before any model work.

Each command runs in a fresh interpreter with a clean environment, through `quantopt.cli.main`; the interpreter
then reports the exit code and which heavy modules are in `sys.modules`. Wall time is not asserted here (it depends
on the machine); docs/user-guide.md gives the measured figure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple

import pytest

import quantopt
from quantopt.cli import print_fields
from quantopt.config.fields import FIELDS
from quantopt.version import __version__

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numpy", "networkx", "onnx", "onnxruntime")

DRIVER = """
import json, sys
report, argv = sys.argv[1], sys.argv[2:]
from quantopt.cli import main
try:
    rc = main(argv)
except SystemExit as e:  # argparse ends --help and usage errors with SystemExit
    rc = e.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
with open(report, "w") as fh:
    json.dump({"rc": rc, "heavy": heavy}, fh)
""".replace("HEAVY", repr(HEAVY))


class Result(NamedTuple):
    rc: int
    heavy: List[str]
    out: str
    err: str


def clean_env() -> Dict[str, str]:
    """Only what an interpreter needs: no PYTHON* settings, plugin path or log level inherited from the test run."""
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"}
    for key in ("HOME", "SYSTEMROOT", "TMPDIR", "TEMP", "TMP"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def run_cli(args: List[str], cwd: Path) -> Result:
    report = cwd / "fast_start_report.json"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(report), *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert report.is_file(), f"the driver did not finish: {proc.stderr}"
    data = json.loads(report.read_text())
    report.unlink()
    return Result(data["rc"], data["heavy"], proc.stdout, proc.stderr)


def write_cfg(folder: Path, lines: str, name: str = "opt.cfg") -> Path:
    (folder / "model.txt").write_text("")  # an existing graph path: the cfg checks only that the file exists
    path = folder / name
    path.write_text("[Common]\n" + lines)
    return path


# ------------------------------------------------------------------------------------------------ listings
def test_version_loads_no_torch(tmp_path):
    r = run_cli(["--version"], tmp_path)
    assert (r.rc, r.heavy) == (0, [])
    assert r.out == f"quantopt {__version__}\n"


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["import", "--help"], ["export", "--help"]],
                         ids=["main", "run", "import", "export"])
def test_help_loads_no_torch(tmp_path, args):
    r = run_cli(args, tmp_path)
    assert (r.rc, r.heavy) == (0, [])
    prog = " ".join(["quantopt"] + args[:-1])
    assert r.out.startswith(f"usage: {prog} ")
    assert "--debug" in r.out


@pytest.mark.parametrize("args", [["run"], ["export", "m.txt"], ["import", "m.onnx"], []],
                         ids=["run", "export", "import", "nothing-to-do"])
def test_usage_errors_load_no_torch(tmp_path, args):
    r = run_cli(args, tmp_path)
    assert (r.rc, r.heavy) == (2, [])
    assert "usage: quantopt" in r.err


def test_field_listing_loads_no_torch_and_is_unchanged(tmp_path, capsys):
    r = run_cli(["--field"], tmp_path)
    assert (r.rc, r.heavy) == (0, [])
    # The same text as in this process, where torch, the calibration code and every plugin are loaded.
    print_fields()
    assert r.out == capsys.readouterr().out
    for name in FIELDS:
        assert f"  {name}\n" in r.out
    from quantopt.calibration.strategies import STRATEGY_FORMS
    from quantopt.tuning.global_methods import METHODS
    from quantopt.tuning.unify_scales import ALLOWED_TEXT
    assert "allowed: one of " + ", ".join(STRATEGY_FORMS) + "\n" in r.out
    assert "methods: " + ", ".join(k for k, v in METHODS.items() if v.implemented) + "\n" in r.out
    assert f"allowed: {ALLOWED_TEXT}\n" in r.out


def test_the_check_sees_torch_when_it_is_loaded(tmp_path):
    """Control: `--plugin` imports the operators, and the report shows it."""
    r = run_cli(["--plugin"], tmp_path)
    assert r.rc == 0 and "torch" in r.heavy and "NumpyDataset" in r.out


# ------------------------------------------------------------------------------------------------ cfg errors
CFG_ERRORS = {
    "unknown-key": ("graph = model.txt\nfrobnicate = 1\n", 2,
                    "config error: opt.cfg:3: unknown key 'frobnicate'; run 'quantopt --field' to list all fields"),
    "duplicate-key": ("graph = model.txt\ngraph = model.txt\n", 2,
                      "config error: opt.cfg:3: duplicate key 'graph' (first set at line 2)"),
    "bad-value": ("graph = model.txt\nweight_bits = 99\n", 2,
                  "config error: opt.cfg:3: field 'weight_bits': invalid per-layer value '99': value '99': out of "
                  "range"),
    "missing-graph": ("graph = nowhere/model.txt\n", 2,
                      "config error: opt.cfg:2: field 'graph': invalid value 'nowhere/model.txt' (no such file); "
                      "expected the path of an existing file"),
    "cross-field": ("graph = model.txt\nmetric = TopKMetric\n", 2,
                    "config error: opt.cfg:3: field 'metric': a metric needs validation 'data' (and usually "
                    "'label')"),
    "no-graph": ("model_name = m\n", 2,
                 "config error: opt.cfg: field 'graph' is required: the float IR .txt to optimize"),
    "bad-strategy": ("graph = model.txt\ncalibration_strategy_for_activation = 3std & <[Convolution]:foo>\n", 2,
                     "config error: opt.cfg:3: field 'calibration_strategy_for_activation': invalid per-layer value "
                     "'3std & <[Convolution]:foo>': value 'foo': unknown calibration strategy 'foo'; valid forms: "),
    "auto-weighted-strategy": ("graph = model.txt\ncalibration_strategy_for_weight = weighted_scale_param[2,1,1,1]\n",
                               6, "unsupported: calibration strategy 'weighted_scale_param[2,1,1,1]': "),
    "bad-trim": ("graph = model.txt\ntrim_infinity_before_statistic = clip(1, 2)\n", 2,
                 "config error: opt.cfg:3: field 'trim_infinity_before_statistic': invalid per-layer value "
                 "'clip(1, 2)': value 'clip(1, 2)': invalid trim_infinity_before_statistic 'clip(1, 2)': need "
                 "lo <= 0 <= hi"),
    "bad-global-calibration": ("graph = model.txt\nglobal_calibration = easy_quant[1][Convolution] & adaroundx\n", 2,
                               "config error: opt.cfg:3: field 'global_calibration': invalid value "
                               "'easy_quant[1][Convolution] & adaroundx' (unknown method 'adaroundx'; did you mean "
                               "adaround?); expected none, or methods joined by '&'"),
    "bad-unify-rule": ("graph = model.txt\nunify_scales_for_multi_inputs_operators = [(Concat, 1, 1.0, maxx)]\n", 2,
                       "config error: opt.cfg:3: field 'unify_scales_for_multi_inputs_operators': invalid per-layer "
                       "value '[(Concat, 1, 1.0, maxx)]': value '[(Concat, 1, 1.0, maxx)]': method 'maxx' of Concat "
                       "is not one of max, min, avg, out, skip"),
}


@pytest.mark.parametrize("case", list(CFG_ERRORS))
def test_cfg_errors_load_no_torch(tmp_path, case):
    lines, code, message = CFG_ERRORS[case]
    write_cfg(tmp_path, lines)
    r = run_cli(["--cfg", "opt.cfg"], tmp_path)
    assert (r.rc, r.heavy) == (code, [])
    errors = [line for line in r.err.splitlines() if line.startswith("[ERROR]")]
    assert len(errors) == 1 and errors[0].startswith(f"[ERROR] {message}"), r.err


def test_missing_cfg_file_loads_no_torch(tmp_path):
    r = run_cli(["--cfg", "absent.cfg"], tmp_path)
    assert (r.rc, r.heavy) == (2, [])
    assert "[ERROR] config error: absent.cfg: cfg file not found" in r.err


def test_operator_type_of_a_plugin_is_still_accepted(tmp_path):
    """A selector naming a type that only a plugin registers loads the plugins while the cfg is read (as the
    plugins were loaded before reading until now), so the cfg reaches its next check."""
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "aipubt_opt_fast_start_type.py").write_text(
        "from quantopt import register_optype\n\nregister_optype('FastStartPluginOp')\n")
    write_cfg(tmp_path, "graph = model.txt\nweight_bits = 8 & <[FastStartPluginOp]:16>\nmetric = TopKMetric\n")
    r = run_cli(["--cfg", "opt.cfg"], tmp_path)
    assert r.rc == 2 and "field 'metric': a metric needs validation 'data'" in r.err, r.err
    write_cfg(tmp_path, "graph = model.txt\nweight_bits = 8 & <[NoSuchPluginOp]:16>\n")
    r = run_cli(["--cfg", "opt.cfg"], tmp_path)
    assert r.rc == 2 and "unknown operator type(s) NoSuchPluginOp in [NoSuchPluginOp]" in r.err, r.err


# ------------------------------------------------------------------------------------------------ the package API
def test_public_api_resolves_lazily():
    """`from quantopt import op_register` and every name of `__all__` work as when they were imported eagerly."""
    from quantopt import op_register
    from quantopt.registry import op_register as registered

    assert op_register is registered
    for name in quantopt.__all__:
        assert getattr(quantopt, name) is not None
        assert name in dir(quantopt)
    with pytest.raises(AttributeError):
        quantopt.no_such_name  # noqa: B018


def test_calibration_grammar_is_shared_with_the_calibration_modules():
    """The torch-free grammar is the one the calibration code applies (re-exported, not copied)."""
    from quantopt.calibration import statistics, strategies
    from quantopt.config import calibration_values, global_calibration
    from quantopt.tuning import unify_scales
    from quantopt.tuning.global_methods import spec

    assert strategies.parse_strategy is calibration_values.parse_strategy
    assert strategies.Strategy is calibration_values.Strategy
    assert statistics.parse_trim is calibration_values.parse_trim
    assert unify_scales.parse_unify_rules is calibration_values.parse_unify_rules
    assert unify_scales.UnifyRule is calibration_values.UnifyRule
    assert spec.parse_global_calibration is global_calibration.parse_global_calibration
    assert spec.GlobalMethodSpec is global_calibration.GlobalMethodSpec


def test_python_dash_m_quantopt_is_the_command(tmp_path: Path) -> None:
    """`python -m quantopt` runs the same command line (and, like it, answers --version without torch)."""
    probe = ("import runpy, sys, json\nsys.argv = ['quantopt', '--version']\ntry:\n"
             "    runpy.run_module('quantopt', run_name='__main__')\nexcept SystemExit as e:\n    rc = e.code\n"
             "heavy = sorted(m for m in sys.modules if m.split('.')[0] in HEAVY)\n"
             "print(json.dumps({'rc': rc, 'heavy': heavy}))\n").replace("HEAVY", repr(HEAVY))
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stderr
    assert __version__ in lines[0]
    assert json.loads(lines[-1]) == {"rc": 0, "heavy": []}
    bad = subprocess.run([sys.executable, "-m", "quantopt", "--cfg", str(tmp_path / "missing.cfg")], cwd=tmp_path,
                         env=clean_env(), capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "missing.cfg" in bad.stderr
