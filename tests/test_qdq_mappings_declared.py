"""An operator is one declaration in one file: each built-in ONNX QDQ mapping is declared with `@SPEC.export` in the
ops module that declares its type (docs/onnx-export.md, "Where the mappings live"), and the operators load without
the optional `onnx` package."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantopt.exporters.onnx_qdq import supported_layer_types
from quantopt.registry import OP_EXPORT, OP_SPECS, Registration, Version

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "quantopt"


def _builtin_types() -> list:
    return [t for t in supported_layer_types() if OP_EXPORT.get(t).builtin]


def mappings_away_from_their_declaration() -> list:
    """One line per built-in type whose export function is defined in another file than its `declare_op`."""
    elsewhere = []
    for optype in _builtin_types():
        spec = OP_SPECS.get(optype)
        fn = OP_EXPORT.get(optype).obj
        where = os.path.realpath(inspect.getsourcefile(fn))
        if spec is None or os.path.realpath(spec.source) != where:
            elsewhere.append(f"{optype}: declared in {spec.source if spec else 'nowhere'}, exported by "
                             f"{fn.__name__} in {where}")
    return elsewhere


def test_every_builtin_mapping_sits_beside_its_declaration() -> None:
    types = _builtin_types()
    assert "Convolution" in types and "Activation" in types and len(types) >= 80
    elsewhere = mappings_away_from_their_declaration()
    assert not elsewhere, "mappings away from their declaration:\n" + "\n".join(elsewhere)


def _convolution_elsewhere(g: object, node: object) -> None:
    """A mapping of Convolution defined here, not in ops/conv.py (for the control below)."""


def test_a_mapping_elsewhere_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: a built-in type exported by a function of another file is reported."""
    monkeypatch.setitem(OP_EXPORT.active, "Convolution",
                        Registration(_convolution_elsewhere, Version.parse("9"), __file__, True))
    found = mappings_away_from_their_declaration()
    assert len(found) == 1 and found[0].startswith("Convolution: declared in") and "_convolution_elsewhere" in found[0]


def test_the_exporter_keeps_only_the_driver() -> None:
    """No mapping is registered anywhere but in a declaration: quantopt/exporters holds the driver alone."""
    assert sorted(p.name for p in (PACKAGE / "exporters").glob("*.py")) == [
        "__init__.py", "agreement.py", "cli.py", "onnx_qdq.py", "options.py"]
    ops = os.path.realpath(PACKAGE / "ops") + os.sep
    assert all(os.path.realpath(OP_SPECS[t].source).startswith(ops) for t in _builtin_types())


def test_importing_the_operators_does_not_import_onnx() -> None:
    code = "import sys, quantopt.ops; print('onnx' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
