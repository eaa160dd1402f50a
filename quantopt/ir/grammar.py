"""The value grammar of IR `key=value` lines: nested lists, ints, floats, bools, dtype names, None, strings
(docs/ir-format.md, section 2).

`parse_value(format_value(v)) == v` holds for every value the reader produces, so a read/write round trip
keeps every parameter.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, List, Tuple

import numpy as np

from ..quant.dtype import Dtype, dtype_from_name

_INT_RE = re.compile(r"^[+-]?\d+$")
_FLOAT_RE = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$|^[+-]?(inf|infinity|nan)$", re.IGNORECASE)


class GrammarError(ValueError):
    """A value that is not well formed (unbalanced brackets, text after a closing bracket)."""


MAX_DEPTH = 32
"""Deepest list nesting a value may have (shapes nest 2 levels, list-valued constant shapes 3): deeper text is an
error rather than a recursion that runs out of stack."""


def parse_scalar(text: str) -> Any:
    s = text.strip()
    if _INT_RE.match(s):
        return int(s)
    if _FLOAT_RE.match(s):
        return float(s)
    low = s.lower()
    if low == "true":
        return True
    if low == "false":
        return False
    if s == "None":
        return None
    dt = dtype_from_name(s)
    if dt is not None and (low == dt.value or low.startswith("dtype.")):
        return dt
    return s


def parse_value(text: str) -> Any:
    s = text.strip()
    if s.startswith("["):
        value, end = _parse_list(s, 0, parse_scalar)
        if s[end:].strip():
            raise GrammarError(f"unexpected text '{s[end:].strip()}' after ']'")
        return value
    if "]" in s and "[" not in s:
        raise GrammarError("unbalanced ']'")
    return parse_scalar(s)


def format_value(value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, Dtype):
        return value.value
    if value is None:
        return "None"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        f = float(value)
        if math.isnan(f):
            return "nan"
        if math.isinf(f):
            return "inf" if f > 0 else "-inf"
        return repr(f)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, np.ndarray):
        return format_value(value.tolist())
    return str(value)


def parse_names(text: str) -> Any:
    """Like parse_value, but every scalar stays the literal string (tensor and layer names such as `int8` or `1`)."""
    s = text.strip()
    if not s.startswith("["):
        if "[" in s or "]" in s:
            raise GrammarError("unbalanced brackets in a name list")
        return s
    value, end = _parse_list(s, 0, str.strip)
    if s[end:].strip():
        raise GrammarError(f"unexpected text '{s[end:].strip()}' after ']'")
    return value


def _parse_list(text: str, pos: int, convert: Callable[[str], Any], depth: int = 1) -> Tuple[List[Any], int]:
    """Parse the list starting at text[pos] == '[' (elements converted by `convert`); return it and the index
    after its ']'."""
    if depth > MAX_DEPTH:
        raise GrammarError(f"lists nested more than {MAX_DEPTH} levels deep")
    items: List[Any] = []
    pos += 1
    token_start = pos
    after_nested = False
    while pos < len(text):
        ch = text[pos]
        if ch == "[":
            if text[token_start:pos].strip():
                raise GrammarError(f"unexpected '[' after '{text[token_start:pos].strip()}'")
            sub, pos = _parse_list(text, pos, convert, depth + 1)
            items.append(sub)
            while pos < len(text) and text[pos] == " ":
                pos += 1
            if pos < len(text) and text[pos] not in ",]":
                raise GrammarError(f"unexpected '{text[pos]}' after a nested list")
            token_start = pos
            after_nested = True
            continue
        if ch in ",]":
            token = text[token_start:pos].strip()
            if token:
                items.append(convert(token))
            elif not after_nested and (ch == "," or items):
                raise GrammarError("empty list element")
            if ch == "]":
                return items, pos + 1
            token_start = pos + 1
            after_nested = False
        pos += 1
    raise GrammarError("unbalanced '[': missing ']'")
