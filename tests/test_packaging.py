"""Packaging facts that a release depends on."""
from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    with open(REPO / "pyproject.toml", "rb") as fh:
        listed = set(tomllib.load(fh)["tool"]["setuptools"]["packages"])
    on_disk = {"quantopt"} | {
        "quantopt." + ".".join(p.parent.relative_to(REPO / "quantopt").parts)
        for p in (REPO / "quantopt").rglob("__init__.py") if p.parent != REPO / "quantopt"
    }
    assert on_disk <= listed, f"missing from pyproject packages: {sorted(on_disk - listed)}"
    listed_without_plugins = listed - {"quantopt.builtin_plugins"}
    assert listed_without_plugins <= on_disk, f"listed but not on disk: {sorted(listed_without_plugins - on_disk)}"
    assert "quantopt.builtin_plugins" in listed


def test_readme_has_exactly_two_setup_commands():
    text = (REPO / "README.md").read_text()
    assert text.count("<!-- example-command -->") == 1 and text.count("<!-- test-command -->") == 1
    assert "constraints.txt" in text


def test_torch_range_open_and_cpu_pin_in_constraints():
    assert '"torch>=2.1"' in (REPO / "pyproject.toml").read_text()
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text()
