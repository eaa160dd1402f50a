"""Operator catalog: one short description per built-in operator type, next to its implementation.

Each op module calls `describe_op` at import time with the params it reads (as the Parser writes them), the
dtypes it accepts and produces, and its integer method in one line; the full integer computation is in
docs/integer-semantics.md and docs/semantics/. `render_operators_markdown` turns the catalog plus the registries
(forward / quantize registered?) into docs/operators.md, and a test keeps that file current.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Union

from ..graph.optype import OpType
from ..registry import OP_FORWARD, OP_QUANTIZE


@dataclass(frozen=True)
class OpDoc:
    optype: str
    params: str
    """The layer params (and constants) the op reads, e.g. `method=ADD|SUB, with_activation`."""
    dtypes: str
    """Float and quantized dtypes, e.g. `float32 → int8/uint8/int16/uint16`."""
    integer: str
    """The integer method in one line, e.g. `LUT over the input range` or `passthrough (data movement only)`."""
    semantics: str
    """Where the full integer semantics are documented (a docs/ path with an optional #anchor)."""


OP_DOCS: Dict[str, OpDoc] = {}

ACTIVATION_DTYPES = "float32 → int8/uint8 (8 bits) or int16/uint16 (16 bits)"
PASSTHROUGH_DTYPES = "any; quantized output keeps the input's dtype, scale and zero point"


def describe_op(optypes: Union[str, Iterable[str]], *, params: str, integer: str,
                dtypes: str = ACTIVATION_DTYPES, semantics: str = "docs/integer-semantics.md") -> None:
    """Record the catalog entry of one or more operator types (the last description of a type wins)."""
    names = [optypes] if isinstance(optypes, str) else list(optypes)
    for name in names:
        if str(name) not in OpType:
            raise ValueError(f"describe_op: unknown operator type '{name}'")
        OP_DOCS[str(name)] = OpDoc(str(name), params, dtypes, integer, semantics)


def builtin_optypes_with_both() -> List[str]:
    """Operator types that have both a forward and a quantize registration."""
    return sorted(set(OP_FORWARD.keys()) & set(OP_QUANTIZE.keys()))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_operators_markdown() -> str:
    """docs/operators.md: every operator with a forward registration, sorted by name."""
    names = sorted(set(OP_FORWARD.keys()) | set(OP_QUANTIZE.keys()))
    both = set(builtin_optypes_with_both())
    lines = [
        "# Operators",
        "",
        "Generated from the operator registries and `quantopt/ops/catalog.py` by",
        "`python -m quantopt.ops.catalog > docs/operators.md`; a test fails when this file is out of date.",
        "",
        f"{len(both)} operator types have both a float/integer forward and a quantize function.",
        "Params are the layer keys as the Compass Parser writes them; the integer method links to its full",
        "definition.",
        "",
        "| Operator | Forward | Quantize | Params | Dtypes | Integer method |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        doc = OP_DOCS.get(name)
        fwd = "yes" if name in OP_FORWARD.keys() else "no"
        qnt = "yes" if name in OP_QUANTIZE.keys() else "no"
        if doc is None:
            lines.append(f"| {name} | {fwd} | {qnt} | | | |")
            continue
        link = doc.semantics if doc.semantics.startswith("docs/") else "docs/" + doc.semantics
        rel = link[len("docs/"):]
        lines.append(f"| {name} | {fwd} | {qnt} | {_cell(doc.params)} | {_cell(doc.dtypes)} | "
                     f"[{_cell(doc.integer)}]({rel}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - documentation generator
    # Run as a script this file is `__main__`, a second module object: render from the imported catalog, which
    # is the one the operator modules fill.
    from quantopt import ops  # noqa: F401  (registers the built-in operators)
    from quantopt.ops import catalog

    print(catalog.render_operators_markdown(), end="")
