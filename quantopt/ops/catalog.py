"""Operator catalog: docs/operators.md rendered from the operator declarations.

Each operator module declares its types with `quantopt.registry.declare_op`: typed params and constants, the dtypes
it accepts and produces, and its integer method in one line (the full integer computation is in
docs/integer-semantics.md and docs/semantics/). `render_operators_markdown` turns the declarations plus the
registries (forward / quantize registered?) into docs/operators.md, and a test keeps that file current.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Union

from ..registry import ACTIVATION_DTYPES, OP_FORWARD, OP_QUANTIZE, OP_SPECS, PASSTHROUGH_DTYPES, OpSpec
from ..registry.optype import OpType


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

__all__ = ["ACTIVATION_DTYPES", "PASSTHROUGH_DTYPES", "describe_op", "operator_doc", "render_operators_markdown",
           "spec_params_text"]


def describe_op(optypes: Union[str, Iterable[str]], *, params: str, integer: str,
                dtypes: str = ACTIVATION_DTYPES, semantics: str = "docs/integer-semantics.md") -> None:
    """Record the catalog entry of one or more operator types (the last description of a type wins)."""
    names = [optypes] if isinstance(optypes, str) else list(optypes)
    for name in names:
        if str(name) not in OpType:
            raise ValueError(f"describe_op: unknown operator type '{name}'")
        OP_DOCS[str(name)] = OpDoc(str(name), params, dtypes, integer, semantics)


def operator_doc(name: str) -> Optional[OpDoc]:
    """The documentation of operator type `name`: from its declaration, else from a `describe_op` entry."""
    spec = OP_SPECS.get(str(name))
    if spec is None:
        return OP_DOCS.get(str(name))
    return OpDoc(str(name), spec_params_text(spec), spec.dtypes, spec.integer, spec.semantics)


def builtin_optypes_with_both() -> List[str]:
    """Operator types that have both a forward and a quantize registration."""
    return sorted(set(OP_FORWARD.keys()) & set(OP_QUANTIZE.keys()))


def spec_params_text(spec: OpSpec) -> str:
    """The Params cell of a declared operator: each key with its kind (quantized-only keys marked), the constants,
    then the declaration's summary."""
    plain = [f"{k} ({p.describe()})" for k, p in spec.schema.params if not p.quantized]
    quant = [k for k, p in spec.schema.params if p.quantized]
    parts = [", ".join(plain) if plain else "(none)"]
    if spec.schema.constants:
        parts.append("constants " + ", ".join(f"{k} ({d})" if d else k for k, d in spec.schema.constants))
    if quant:
        parts.append("written when quantized: " + ", ".join(quant))
    text = "; ".join(parts)
    return text + (". " + spec.summary if spec.summary else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_operators_markdown() -> str:
    """docs/operators.md: every operator with a forward registration, sorted by name."""
    names = sorted(set(OP_FORWARD.keys()) | set(OP_QUANTIZE.keys()))
    both = set(builtin_optypes_with_both())
    lines = [
        "# Operators",
        "",
        "Generated from the operator declarations (`declare_op` in each `quantopt/ops/` module) by",
        "`python -m quantopt.ops.catalog > docs/operators.md`; a test fails when this file is out of date.",
        "",
        f"{len(both)} operator types have both a float/integer forward and a quantize function.",
        "Params are the layer keys as the Compass Parser writes them, each with the kind the IR reader checks; the",
        "integer method links to its full definition.",
        "",
        "| Operator | Forward | Quantize | Params | Dtypes | Integer method |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        doc = operator_doc(name)
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
