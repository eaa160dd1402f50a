"""Operator catalog: docs/operators.md rendered from the operator declarations.

Each operator module declares its types with `quantopt.registry.declare_op`: typed params and constants, the dtypes
it accepts and produces, and its integer method in one line (the full integer computation is in
docs/integer-semantics.md and docs/semantics/). `render_operators_markdown` turns the declarations plus the
registries (forward / quantize / ONNX QDQ export registered?) into docs/operators.md, and a test keeps that file
current.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

from ..registry import ACTIVATION_DTYPES, OP_EXPORT, OP_FORWARD, OP_QUANTIZE, OP_SPECS, PASSTHROUGH_DTYPES, OpSpec
from ..registry.known_keys import is_builtin


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


__all__ = ["ACTIVATION_DTYPES", "PASSTHROUGH_DTYPES", "operator_doc", "render_operators_markdown", "spec_params_text"]


def operator_doc(name: str) -> Optional[OpDoc]:
    """The documentation of operator type `name`, from its declaration (None for a type without one)."""
    spec = OP_SPECS.get(str(name))
    if spec is None:
        return None
    return OpDoc(str(name), spec_params_text(spec), spec.dtypes, spec.integer, spec.semantics)


def builtin_optypes_with_both() -> List[str]:
    """Operator types that have both a forward and a quantize registration."""
    return sorted(set(OP_FORWARD.keys()) & set(OP_QUANTIZE.keys()))


def spec_params_text(spec: OpSpec) -> str:
    """The Params cell of a declared operator: its float params, constants and quantized keys by name (their kinds
    and meaning are in the operator's parameter section)."""
    plain = [k for k, p in spec.schema.params if not p.quantized]
    quant = [k for k, p in spec.schema.params if p.quantized]
    parts = [", ".join(plain) if plain else "(none)"]
    if spec.schema.constants:
        parts.append("constants " + ", ".join(k for k, _ in spec.schema.constants))
    if quant:
        parts.append("written when quantized: " + ", ".join(quant))
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _heading(spec: OpSpec) -> str:
    return ", ".join(spec.optypes)


def _slug(heading: str) -> str:
    """The anchor a markdown renderer gives a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _builtin_specs() -> List[OpSpec]:
    """The built-in declarations, one per family (a declaration covering several types once), by heading."""
    unique = {id(s): s for s in OP_SPECS.values() if is_builtin(s.optypes[0])}
    return sorted(unique.values(), key=_heading)


def _spec_section(spec: OpSpec) -> List[str]:
    lines = [f"### {_heading(spec)}", ""]
    if spec.summary:
        lines += [spec.summary, ""]
    if not spec.schema.params and not spec.schema.constants:
        return lines + ["No parameters.", ""]
    lines += ["| key | kind | meaning |", "|---|---|---|"]
    for key, param in spec.schema.params:
        what = ("written when quantized. " if param.quantized else "") + param.doc
        lines.append(f"| `{key}` | {_cell(param.describe())} | {_cell(what)} |")
    for key, doc in spec.schema.constants:
        lines.append(f"| `{key}` | constant | {_cell(doc)} |")
    return lines + [""]


def render_operators_markdown() -> str:
    """docs/operators.md: every operator with a forward registration, sorted by name, then each built-in
    declaration's parameters."""
    names = sorted(set(OP_FORWARD.keys()) | set(OP_QUANTIZE.keys()))
    both = set(builtin_optypes_with_both())
    lines = [
        "# Operators",
        "",
        "Generated from the operator declarations (`declare_op` in each `quantopt/ops/` module) by",
        "`python -m quantopt.ops.catalog > docs/operators.md`; a test fails when this file is out of date.",
        "",
        f"{len(both)} operator types have both a float/integer forward and a quantize function.",
        "Params are the layer keys as the Compass Parser writes them; the IR reader checks each against the kind in",
        "the operator's parameter section below and refuses any other key. The integer method links to its full",
        "definition. ONNX QDQ says whether the declaration maps the quantized layer into an exported QDQ model",
        "(`@SPEC.export`, docs/onnx-export.md); a layer of a type without one is refused by the export.",
        "",
        "| Operator | Forward | Quantize | ONNX QDQ | Params | Dtypes | Integer method |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        doc = operator_doc(name)
        fwd = "yes" if name in OP_FORWARD.keys() else "no"
        qnt = "yes" if name in OP_QUANTIZE.keys() else "no"
        qdq = "yes" if OP_EXPORT.get(name) is not None else "no"
        if doc is None:
            lines.append(f"| {name} | {fwd} | {qnt} | {qdq} | | | |")
            continue
        link = doc.semantics if doc.semantics.startswith("docs/") else "docs/" + doc.semantics
        rel = link[len("docs/"):]
        params = f"[{_cell(doc.params)}](#{_slug(_heading(OP_SPECS[name]))})"
        lines.append(f"| {name} | {fwd} | {qnt} | {qdq} | {params} | {_cell(doc.dtypes)} | "
                     f"[{_cell(doc.integer)}]({rel}) |")
    lines += ["", "## Parameters", "",
              "Kinds: `int` an integer below 2^31 in magnitude (with its bounds), `float` a number (finite unless",
              "said), `bool` true/false (or 0/1), a `A|B` word one of those (any case), `int list`/`float list` a",
              "list (a single value counts as one element unless said), `axis` an integer, a list of them or None,",
              "`dtype` a dtype name; NaN is never valid. A constant is stored in the .bin with its",
              "`_type/_offset/_size/_shape` keys.", ""]
    for spec in _builtin_specs():
        lines += _spec_section(spec)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":  # pragma: no cover - documentation generator
    # Run as a script this file is `__main__`, a second module object: render from the imported catalog, which
    # is the one the operator modules fill.
    from quantopt import ops  # noqa: F401  (registers the built-in operators)
    from quantopt.ops import catalog

    print(catalog.render_operators_markdown(), end="")
