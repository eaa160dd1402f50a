"""The import graph of the package against the layer order written in docs/architecture.md ("Layers").

Every `import` / `from ... import` in quantopt, at module level or inside a function, may name only modules of its
own unit or of a unit listed below it in that order: no cycles between packages, and the docs say how the package is
built. The `quantopt` package's own `__init__` (the lazy public API) is the top and may name anything.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "quantopt"
ARCHITECTURE = REPO / "docs" / "architecture.md"


def layer_order() -> List[str]:
    """The units in the ```layers block of docs/architecture.md, bottom first (one per line, text after the first
    word is commentary)."""
    text = ARCHITECTURE.read_text()
    match = re.search(r"```layers\n(.*?)```", text, re.S)
    assert match, "docs/architecture.md has no ```layers block"
    return [line.split()[0] for line in match.group(1).splitlines() if line.strip()]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _unit(module: str) -> str:
    """`quantopt.ops.conv` -> `ops`; `quantopt.cli` -> `cli`; the package itself -> `quantopt`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "quantopt"


def imports_of(path: Path, modules: Dict[str, Path], text: Optional[str] = None) -> List[Tuple[int, str]]:
    """(line, imported quantopt module) for every import in the file (or in `text`, read as that file),
    function-level ones included."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: List[Tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "quantopt":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((node.lineno, sub if sub in modules else target))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "quantopt")
    return out


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_every_unit_is_in_the_layer_order_and_exists() -> None:
    order = layer_order()
    assert len(order) == len(set(order)), "a unit is listed twice"
    on_disk = {_unit(m) for m in _modules()} - {"quantopt"}
    assert set(order) == on_disk, (f"not in the layers of docs/architecture.md: {sorted(on_disk - set(order))}; "
                                   f"listed but absent: {sorted(set(order) - on_disk)}")


def upward_imports(extra: Optional[Dict[Path, str]] = None) -> List[str]:
    """Every import against the layer order (`extra`: text appended to some files, for the control below)."""
    order = layer_order()
    rank = {u: i for i, u in enumerate(order)}
    rank["quantopt"] = len(order)
    modules = _modules()
    upward = []
    for module, path in sorted(modules.items()):
        here = _unit(module)
        text = path.read_text() + (extra or {}).get(path, "")
        for line, target in imports_of(path, modules, text):
            there = _unit(target)
            if there != here and (there == "quantopt" or rank[there] > rank[here]):
                upward.append(f"{path.relative_to(REPO)}:{line} imports {target} ({here} -> {there})")
    return upward


def test_imports_only_go_down() -> None:
    upward = upward_imports()
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


@pytest.mark.parametrize("source, expected", [
    ("from ...graph.node import PyNode\n", ["quantopt.graph.node"]),
    ("def f():\n    from ...ops import conv\n", ["quantopt.ops.conv"]),
    ("import quantopt.ops\n", ["quantopt.ops"]),
    ("from quantopt.registry import declare_op\n", ["quantopt.registry"]),
])
def test_the_scanner_sees_every_form(source: str, expected: List[str]) -> None:
    """Control: relative, function-level and absolute imports are all found (the check above cannot pass by missing
    them)."""
    probe = PACKAGE / "tuning" / "global_methods" / "x.py"
    assert [t for _, t in imports_of(probe, _modules(), source)] == expected


def test_an_upward_import_is_caught() -> None:
    """Control: a function-level import of a higher layer is reported."""
    target = PACKAGE / "quant" / "rounding.py"
    upward = upward_imports({target: "\n\ndef _probe():\n    from ..ops import conv\n"})
    expected = r"quantopt/quant/rounding.py:\d+ imports quantopt.ops.conv \(quant -> ops\)"
    assert len(upward) == 1 and re.fullmatch(expected, upward[0]), upward
