"""Typed parameter schemas of operator declarations: what a layer key may hold, checked when an IR is read.

Why: an operator's params used to be untyped look-ups validated again inside each forward, and declared only in
prose for the docs. A declaration (`quantopt.registry.declare_op`) now states each key's kind once; the IR reader
refuses a value of the wrong kind with an IR error naming the line, the operator documentation is generated from the
same declaration, and the operator code can rely on the kind it reads.

The kinds are small value objects with `problem(value)` (None when the value fits, else why not, for the error
line) and `describe()` (the text in docs/operators.md). IR values come from the grammar of docs/ir-format.md:
int, float, bool, None, a dtype, a string, or nested lists of those. This module imports nothing heavy.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

INT_LIMIT = 2 ** 31
"""Bound of integer params: larger ones cannot be real (and overflow torch's int32 arguments)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _has_nan(v: Any) -> bool:
    if isinstance(v, float):
        return math.isnan(v)
    return isinstance(v, list) and any(_has_nan(x) for x in v)


class Kind(abc.ABC):
    """What a parameter value may be."""

    @abc.abstractmethod
    def problem(self, value: Any) -> Optional[str]:
        """None when `value` fits, else why not (the text of the IR error)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The kind as docs/operators.md shows it."""


def _bounds(lo: Optional[float], hi: Optional[float]) -> str:
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f" >= {lo:g}"
    if lo is None:
        return f" <= {hi:g}"
    return f" in [{lo:g}, {hi:g}]"


@dataclass(frozen=True)
class Int(Kind):
    """An integer in (-2^31, 2^31), optionally within [lo, hi]."""
    lo: Optional[int] = None
    hi: Optional[int] = None

    def problem(self, value: Any) -> Optional[str]:
        if not _is_int(value) or abs(value) >= INT_LIMIT or \
                (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            return f"must be {self._what()}, got {value!r}"
        return None

    def _what(self) -> str:
        if self.hi is None and self.lo in (0, 1):
            return f"a {'non-negative' if self.lo == 0 else 'positive'} integer below 2^31"
        return "an integer" + (_bounds(self.lo, self.hi) or " below 2^31 in magnitude")

    def describe(self) -> str:
        return "int" + _bounds(self.lo, self.hi)


@dataclass(frozen=True)
class IntValued(Int):
    """An integer, also written as a float with an integral value: upstream writes the zero points of its fp8
    layers as 0.0 (docs/low-bit.md)."""

    def problem(self, value: Any) -> Optional[str]:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        return super().problem(value)


@dataclass(frozen=True)
class Float(Kind):
    """A number (integers accepted), not NaN; ±inf only where `infinite` allows it."""
    infinite: bool = False

    def problem(self, value: Any) -> Optional[str]:
        if not _is_number(value) or math.isnan(value) or (math.isinf(value) and not self.infinite):
            return f"must be a {'' if self.infinite else 'finite '}number, got {value!r}"
        return None

    def describe(self) -> str:
        return "float"


@dataclass(frozen=True)
class Bool(Kind):
    """true or false (the integers 0 and 1 too: upstream writes some flags as numbers)."""

    def problem(self, value: Any) -> Optional[str]:
        if isinstance(value, bool) or (_is_int(value) and value in (0, 1)):
            return None
        return f"must be true or false, got {value!r}"

    def describe(self) -> str:
        return "bool"


@dataclass(frozen=True)
class Text(Kind):
    """A word; with `choices`, one of them (compared without case)."""
    choices: Tuple[str, ...] = ()

    def problem(self, value: Any) -> Optional[str]:
        if not isinstance(value, str):
            return f"must be a word, got {value!r}"
        if self.choices and value.upper() not in {c.upper() for c in self.choices}:
            return f"must be one of {', '.join(self.choices)}, got {value!r}"
        return None

    def describe(self) -> str:
        return "|".join(self.choices) if self.choices else "str"


@dataclass(frozen=True)
class Ints(Kind):
    """A list of integers (a single integer counts as a list of one), each in (-2^31, 2^31) and [lo, hi]."""
    lo: Optional[int] = None
    hi: Optional[int] = None
    scalar_ok: bool = True

    def problem(self, value: Any) -> Optional[str]:
        items = [value] if (self.scalar_ok and _is_int(value)) else value
        if not isinstance(items, list) or not all(_is_int(x) and abs(x) < INT_LIMIT for x in items):
            return f"must be a list of integers like [1,2,3], got {value!r}"
        if any((self.lo is not None and x < self.lo) or (self.hi is not None and x > self.hi) for x in items):
            return f"must hold integers{_bounds(self.lo, self.hi)}, got {value!r}"
        return None

    def describe(self) -> str:
        return "int list" + _bounds(self.lo, self.hi)


@dataclass(frozen=True)
class Floats(Kind):
    """A list of numbers (a single number counts as a list of one; nested lists allowed), none NaN."""
    nested: bool = False

    def problem(self, value: Any) -> Optional[str]:
        def ok(v: Any, depth: int) -> bool:
            if _is_number(v):
                return not (isinstance(v, float) and math.isnan(v))
            return isinstance(v, list) and (depth == 0 or self.nested) and all(ok(x, depth + 1) for x in v)
        if not ok(value, 0):
            return f"must be a list of numbers, got {value!r}"
        return None

    def describe(self) -> str:
        return "float list"


@dataclass(frozen=True)
class Axis(Kind):
    """None, an integer or a list of integers (axes may be negative)."""

    def problem(self, value: Any) -> Optional[str]:
        if value is None:
            return None
        items = value if isinstance(value, list) else [value]
        if not all(_is_int(x) and abs(x) < INT_LIMIT for x in items):
            return f"must be an integer or a list of integers, got {value!r}"
        return None

    def describe(self) -> str:
        return "axis"


@dataclass(frozen=True)
class DtypeName(Kind):
    """A dtype name such as int8 or float32 (docs/ir-format.md)."""

    def problem(self, value: Any) -> Optional[str]:
        if isinstance(value, str) or type(value).__name__ == "Dtype":
            return None
        return f"must be a dtype name such as int8, got {value!r}"

    def describe(self) -> str:
        return "dtype"


@dataclass(frozen=True)
class Either(Kind):
    """Any of several kinds (e.g. a per-tensor multiplier or one per channel)."""
    kinds: Tuple[Kind, ...] = ()

    def problem(self, value: Any) -> Optional[str]:
        problems = [k.problem(value) for k in self.kinds]
        if all(p is not None for p in problems):
            return f"must be {' or '.join(k.describe() for k in self.kinds)}, got {value!r}"
        return None

    def describe(self) -> str:
        return " or ".join(k.describe() for k in self.kinds)


@dataclass(frozen=True)
class Value(Kind):
    """Any value but NaN: the operator checks it (structured values such as nested output sizes)."""
    what: str = "value"

    def problem(self, value: Any) -> Optional[str]:
        return "NaN is not a valid value" if _has_nan(value) else None

    def describe(self) -> str:
        return self.what


@dataclass(frozen=True)
class Param:
    """One layer key of an operator: its kind, what it means, and whether quantization writes it."""
    kind: Kind
    doc: str = ""
    quantized: bool = False
    """Written by quantization (a requantization multiplier, a table's offsets...), absent from float IRs."""
    default: Any = None
    """The value the operator uses when the key is absent (None: no default, or None itself)."""
    required: bool = False
    """A float IR layer without it is an IR error."""

    def describe(self) -> str:
        text = self.kind.describe()
        if self.default is not None:
            text += f", default {self.default}"
        if self.required:
            text += ", required"
        return text


def quantized(kind: Kind, doc: str = "") -> Param:
    """A key written by quantization."""
    return Param(kind, doc, quantized=True)


@dataclass(frozen=True)
class ParamSchema:
    """The keys of one operator type: params and constants (`weights`, `biases`, `lut`... with their derived
    `<name>_type/_offset/_size/_shape` and `_scale/_zp/_range` keys)."""
    params: Tuple[Tuple[str, Param], ...] = ()
    constants: Tuple[Tuple[str, str], ...] = field(default=())

    def keys(self) -> frozenset:
        return frozenset(k for k, _ in self.params) | frozenset(k for k, _ in self.constants)

    def param(self, key: str) -> Optional[Param]:
        return dict(self.params).get(key)

    def problem(self, key: str, value: Any) -> Optional[str]:
        """Why `value` cannot be the value of `key` (None when it can, or when `key` is not a declared param)."""
        if _has_nan(value):
            return "NaN is not a valid value"
        p = self.param(key)
        return None if p is None else p.kind.problem(value)
