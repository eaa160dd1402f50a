"""Value kinds of the accuracy-tool fields: `trigger_float_op`, `mixed_precision_auto_search` and the fake-quant
debug scopes (docs/mixed-precision.md)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from .kinds import ValueKind
from .optypes import optype_names

FLOAT_ACT_TYPES = ("float16", "bfloat16", "float32")
WEIGHT_ONLY_FORMATS = ("int", "fp8e4m3fn", "fp4e2m1fn")
TRIGGER_FLOAT_VALUES = ("disable",) + tuple(f"{t}_preferred" for t in FLOAT_ACT_TYPES) + tuple(
    f"{t}_act_{w}_wht" for t in FLOAT_ACT_TYPES for w in WEIGHT_ONLY_FORMATS)


@dataclass(frozen=True)
class FloatChoice:
    """A resolved `trigger_float_op` value: activations in `act_type`; weights float (`weight_format` None) or
    quantized weight-only as `int`, `fp8e4m3fn` or `fp4e2m1fn`; `forced` is the trailing `!`."""

    act_type: str
    weight_format: Optional[str]
    forced: bool

    def __str__(self) -> str:
        body = f"{self.act_type}_preferred" if self.weight_format is None else \
            f"{self.act_type}_act_{self.weight_format}_wht"
        return body + ("!" if self.forced else "")


def parse_trigger_float(text: str) -> Optional[FloatChoice]:
    """None for `disable` (with or without `!`); otherwise the FloatChoice. ValueError when not a known value."""
    t = str(text).strip().lower()
    forced = t.endswith("!")
    body = t[:-1].strip() if forced else t
    if body == "disable":
        return None
    m = re.fullmatch(r"(float16|bfloat16|float32)_(?:(preferred)|act_(int|fp8e4m3fn|fp4e2m1fn)_wht)", body)
    if m is None:
        raise ValueError("not a trigger_float_op value")
    return FloatChoice(m.group(1), m.group(3), forced)


class TriggerFloatKind(ValueKind):
    """One `trigger_float_op` value, kept as its canonical text (the per-layer JSON stores it as written)."""

    def parse(self, text: str) -> str:
        choice = parse_trigger_float(text)
        return "disable" if choice is None else str(choice)

    def allowed(self) -> str:
        return "one of " + ", ".join(TRIGGER_FLOAT_VALUES) + ", each optionally followed by '!'"


@dataclass(frozen=True, repr=False)
class AutoSearch:
    """`mixed_precision_auto_search = batches, threshold, L|G`: search when batches >= 1; the metric drop
    (float − quantized) must end <= threshold (L) or >= threshold (G)."""

    batches: int
    threshold: float
    mode: str

    @property
    def enabled(self) -> bool:
        return self.batches >= 1

    def satisfied(self, drop: float) -> bool:
        return drop <= self.threshold if self.mode == "L" else drop >= self.threshold

    def __str__(self) -> str:
        return f"{self.batches},{self.threshold:g},{self.mode}"

    def __repr__(self) -> str:
        return repr(str(self))


class AutoSearchKind(ValueKind):
    def parse(self, text: str) -> AutoSearch:
        parts = [p.strip() for p in str(text).split(",")]
        if len(parts) != 3:
            raise ValueError("expected batches,threshold,L|G")
        if not re.fullmatch(r"[+-]?\d+", parts[0]):
            raise ValueError("batches is not an integer")
        try:
            threshold = float(parts[1])
        except ValueError:
            raise ValueError("threshold is not a number") from None
        if threshold != threshold:
            raise ValueError("threshold is NaN")
        mode = parts[2].upper()
        if mode not in ("L", "G"):
            raise ValueError("the third item must be L or G")
        return AutoSearch(int(parts[0]), threshold, mode)

    def allowed(self) -> str:
        return "batches,threshold,L|G (batches < 1 disables; L: drop <= threshold, G: drop >= threshold)"


class LayerRangesKind(ValueKind):
    """`[(i,j),(k,l)]`: inclusive layer-id ranges (empty: none)."""

    def parse(self, text: str) -> List[Tuple[int, int]]:
        t = str(text).strip()
        if not t:
            return []
        if not (t.startswith("[") and t.endswith("]")):
            raise ValueError("expected [(i,j),...]")
        body = t[1:-1].strip()
        if not body:
            return []
        ranges = []
        for m in re.finditer(r"\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*(,|$)", body):
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise ValueError(f"range ({lo},{hi}) is empty")
            ranges.append((lo, hi))
        if re.sub(r"\(\s*\d+\s*,\s*\d+\s*\)\s*(,|$)", "", body).strip():
            raise ValueError("expected [(i,j),...] with non-negative layer ids")
        return ranges

    def allowed(self) -> str:
        return "[(i,j),...] inclusive layer-id ranges, or empty"


class OpTypeListKind(ValueKind):
    """`[Convolution, Eltwise]` or `Convolution,Eltwise`: operator type names (checked against the known types)."""

    def parse(self, text: str) -> List[str]:
        t = str(text).strip().strip("[]").strip()
        if not t:
            return []
        items = [s.strip() for s in t.split(",")]
        known = {n.lower(): n for n in optype_names(include_plugins=False)}
        if any(item.lower() not in known for item in items):  # a plugin's type: known once plugins are loaded
            known = {n.lower(): n for n in optype_names(include_plugins=True)}
        names = []
        for item in items:
            if item.lower() not in known:
                raise ValueError(f"unknown operator type '{item}'")
            names.append(known[item.lower()])
        return names

    def allowed(self) -> str:
        return "operator type names, e.g. [Convolution, Eltwise], or empty"
