"""The per-layer value grammar `global & <[(i,j),...]:v> <[OpType,...]:v> <{regex}:v>` and its resolution.

Priority for a layer (docs/user-guide.md, Per-layer values): the first matching layer-id range rule, then the first
matching operator-type rule (an Activation layer also matches its `method`), then the first matching name regex
(`re.match`, prefix-anchored), else the global value. Layer ids are those of the input float IR.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple, Union


class PerLayerSyntaxError(ValueError):
    """The text is not valid per-layer syntax; the message says where."""


@dataclass
class IdRangeSelector:
    ranges: List[Tuple[int, int]]

    def matches(self, layer_id: int, optype: str, method: Optional[str], name: str) -> bool:
        return any(lo <= layer_id <= hi for lo, hi in self.ranges)

    def __str__(self) -> str:
        return "[" + ",".join(f"({a},{b})" for a, b in self.ranges) + "]"


@dataclass
class OpTypeSelector:
    names: List[str]

    def matches(self, layer_id: int, optype: str, method: Optional[str], name: str) -> bool:
        folded = {n.lower() for n in self.names}
        return optype.lower() in folded or (method is not None and method.lower() in folded)

    def __str__(self) -> str:
        return "[" + ",".join(self.names) + "]"


@dataclass
class RegexSelector:
    pattern: str
    compiled: Any = field(repr=False, default=None)

    def matches(self, layer_id: int, optype: str, method: Optional[str], name: str) -> bool:
        return self.compiled.match(name) is not None

    def __str__(self) -> str:
        return "{" + self.pattern + "}"


Selector = Union[IdRangeSelector, OpTypeSelector, RegexSelector]


@dataclass
class PerLayerValue:
    """A field value with per-layer overrides; `get(node)` resolves it for one layer."""

    global_value: Any
    rules: List[Tuple[Selector, Any]] = field(default_factory=list)

    def resolve(self, layer_id: int, optype: str, name: str, method: Optional[str] = None) -> Any:
        for kind in (IdRangeSelector, OpTypeSelector, RegexSelector):
            for sel, value in self.rules:
                if isinstance(sel, kind) and sel.matches(layer_id, str(optype), method, name):
                    return value
        return self.global_value

    def get(self, node: Any = None) -> Any:
        if node is None:
            return self.global_value
        method = node.params.get("method") if str(node.type) == "Activation" else None
        return self.resolve(node.layer_id, str(node.type), node.name, str(method) if method is not None else None)

    def overridden(self, node: Any) -> bool:
        """Whether a per-layer rule (not the global value) decides this layer's value."""
        method = node.params.get("method") if str(node.type) == "Activation" else None
        method = str(method) if method is not None else None
        return any(sel.matches(node.layer_id, str(node.type), method, node.name) for sel, _ in self.rules)

    def __str__(self) -> str:
        if not self.rules:
            return str(self.global_value)
        return f"{self.global_value} & " + " ".join(f"<{s}:{v}>" for s, v in self.rules)


_CLOSE = {"[": "]", "(": ")", "{": "}", "<": ">"}


def _find_closing(text: str, start: int) -> int:
    """Index of the bracket closing text[start], counting nesting of all bracket kinds."""
    stack = [_CLOSE[text[start]]]
    i = start + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\" and stack[-1] == "}":
            i += 2
            continue
        if stack[-1] == "}" and ch not in "{}":
            i += 1  # inside a regex only braces nest
            continue
        if ch in _CLOSE and not (stack[-1] == ">" and ch == "<"):
            stack.append(_CLOSE[ch])
        elif ch == stack[-1]:
            stack.pop()
            if not stack:
                return i
        i += 1
    raise PerLayerSyntaxError(f"missing '{_CLOSE[text[start]]}' for '{text[start]}' at position {start + 1}")


def _parse_selector(key: str, known_optype: Callable[[str], bool]) -> Selector:
    key = key.strip()
    if key.startswith("{") and key.endswith("}"):
        pattern = key[1:-1]
        try:
            return RegexSelector(pattern, re.compile(pattern))
        except re.error as e:
            raise PerLayerSyntaxError(f"invalid regex {{{pattern}}}: {e}") from None
    if not (key.startswith("[") and key.endswith("]")):
        raise PerLayerSyntaxError(f"selector '{key}' must be [(i,j),...], [OpType,...] or {{regex}}")
    body = key[1:-1].strip()
    if not body:
        raise PerLayerSyntaxError("empty selector []")
    if body.startswith("("):
        ranges = []
        for m in re.finditer(r"\(\s*(\d+)\s*,\s*(\d+)\s*\)|([^\s,]+)", body):
            if m.group(3):
                raise PerLayerSyntaxError(f"'{m.group(3)}' in {key}: layer-id ranges are written (first,last)")
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise PerLayerSyntaxError(f"range ({lo},{hi}) in {key} is empty (first > last)")
            ranges.append((lo, hi))
        return IdRangeSelector(ranges)
    names = [n.strip() for n in body.split(",")]
    if any(not n for n in names):
        raise PerLayerSyntaxError(f"empty operator type name in {key}")
    unknown = [n for n in names if not known_optype(n)]
    if unknown:
        raise PerLayerSyntaxError(f"unknown operator type(s) {', '.join(unknown)} in {key}")
    return OpTypeSelector(names)


def split_per_layer(text: str) -> Tuple[str, List[Tuple[str, str]]]:
    """Split into the global text and (selector text, value text) pairs, without interpreting them."""
    depth_text = text.strip()
    amp = _top_level_ampersand(depth_text)
    if amp < 0:
        return depth_text, []
    global_text = depth_text[:amp].strip()
    rest = depth_text[amp + 1:].strip()
    if not rest:
        raise PerLayerSyntaxError("nothing after '&': expected <selector:value> groups")
    pairs = []
    i = 0
    while i < len(rest):
        if rest[i].isspace():
            i += 1
            continue
        if rest[i] != "<":
            raise PerLayerSyntaxError(f"expected '<' at '{rest[i:i + 20]}'")
        end = _find_closing(rest, i)
        group = rest[i + 1:end]
        if not group or group[0] not in "[{":
            raise PerLayerSyntaxError(f"group <{group}> must start with [ or {{")
        key_end = _find_closing(group, 0)
        after = group[key_end + 1:].lstrip()
        if not after.startswith(":"):
            raise PerLayerSyntaxError(f"expected ':' after selector in <{group}>")
        value = after[1:].strip()
        if not value:
            raise PerLayerSyntaxError(f"empty value in <{group}>")
        pairs.append((group[:key_end + 1], value))
        i = end + 1
    return global_text, pairs


def _top_level_ampersand(text: str) -> int:
    depth = 0
    for i, ch in enumerate(text):
        if ch in "[({<":
            depth += 1
        elif ch in "])}>":
            depth -= 1
        elif ch == "&" and depth == 0:
            return i
    return -1


def parse_per_layer(text: str, parse_value: Callable[[str], Any],
                    known_optype: Callable[[str], bool] = lambda name: True) -> PerLayerValue:
    """Parse per-layer syntax; `parse_value` converts each value text (raising ValueError when invalid)."""
    global_text, pairs = split_per_layer(text)
    if not global_text:
        raise PerLayerSyntaxError("missing global value before '&'")
    result = PerLayerValue(_value(parse_value, global_text))
    for key, value_text in pairs:
        result.rules.append((_parse_selector(key, known_optype), _value(parse_value, value_text)))
    return result


def _value(parse_value: Callable[[str], Any], text: str) -> Any:
    try:
        return parse_value(text)
    except ValueError as e:
        raise PerLayerSyntaxError(f"value '{text}': {e}") from None

