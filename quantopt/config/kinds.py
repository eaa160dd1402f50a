"""Value kinds of cfg fields: each parses the text of a value and describes what it accepts."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple


class ValueKind:
    """Parses one cfg value; raises ValueError with a short reason when the text is not acceptable."""

    def parse(self, text: str) -> Any:
        raise NotImplementedError

    def allowed(self) -> str:
        raise NotImplementedError


class BoolKind(ValueKind):
    def parse(self, text: str) -> bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ValueError("not a boolean")

    def allowed(self) -> str:
        return "true or false"


@dataclass
class IntKind(ValueKind):
    minimum: Optional[int] = None
    maximum: Optional[int] = None

    def parse(self, text: str) -> int:
        t = text.strip()
        if not re.fullmatch(r"[+-]?\d+", t):
            raise ValueError("not an integer")
        v = int(t)
        if (self.minimum is not None and v < self.minimum) or (self.maximum is not None and v > self.maximum):
            raise ValueError("out of range")
        return v

    def allowed(self) -> str:
        if self.minimum is not None and self.maximum is not None:
            return f"an integer in [{self.minimum}, {self.maximum}]"
        if self.minimum is not None:
            return f"an integer >= {self.minimum}"
        return "an integer"


@dataclass
class FloatKind(ValueKind):
    minimum: Optional[float] = None
    maximum: Optional[float] = None

    def parse(self, text: str) -> float:
        try:
            v = float(text.strip())
        except ValueError:
            raise ValueError("not a number") from None
        if v != v or (self.minimum is not None and v < self.minimum) or (self.maximum is not None and v > self.maximum):
            raise ValueError("out of range")
        return v

    def allowed(self) -> str:
        if self.minimum is not None and self.maximum is not None:
            return f"a number in [{self.minimum}, {self.maximum}]"
        if self.minimum is not None:
            return f"a number >= {self.minimum}"
        return "a number"


@dataclass
class ChoiceKind(ValueKind):
    choices: Sequence[str]

    def parse(self, text: str) -> str:
        low = text.strip().lower()
        for c in self.choices:
            if c.lower() == low:
                return c
        raise ValueError("not one of the allowed values")

    def allowed(self) -> str:
        return "one of " + ", ".join(self.choices)


@dataclass
class PathKind(ValueKind):
    """A file or folder path; relative paths are resolved against the cfg file's folder by the reader."""

    must_exist: bool = True
    directory: bool = False

    def parse(self, text: str) -> str:
        path = text.strip()
        if not path:
            raise ValueError("empty path")
        if self.must_exist:
            if self.directory and not os.path.isdir(path):
                raise ValueError("no such folder")
            if not self.directory and not os.path.isfile(path):
                raise ValueError("no such file")
        return path

    def allowed(self) -> str:
        what = "folder" if self.directory else "file"
        return f"the path of an existing {what}" if self.must_exist else f"a {what} path"


class NameKind(ValueKind):
    """A non-empty name used in output file names (no path separators)."""

    def parse(self, text: str) -> str:
        t = text.strip()
        if not t or "/" in t or "\\" in t or t in (".", ".."):
            raise ValueError("not a plain name")
        return t

    def allowed(self) -> str:
        return "a non-empty name without path separators"


class PluginNameKind(ValueKind):
    """A dataset plugin name (checked against the registry when the run starts)."""

    def parse(self, text: str) -> str:
        t = text.strip()
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t):
            raise ValueError("not a plugin class name")
        return t

    def allowed(self) -> str:
        return "the class name of a registered dataset plugin (quantopt --plugin lists them)"


_METRIC_ITEM = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\(([^()]*)\))?\s*")


class MetricListKind(ValueKind):
    """`TopKMetric,TopKMetric(5),Custom(a,b)`: metric plugin names with string arguments; duplicates dropped."""

    def parse(self, text: str) -> List[Tuple[str, Tuple[str, ...]]]:
        items: List[Tuple[str, Tuple[str, ...]]] = []
        pos = 0
        t = text.strip()
        while pos < len(t):
            m = _METRIC_ITEM.match(t, pos)
            if not m or m.end() == pos:
                raise ValueError(f"cannot parse metric at '{t[pos:]}'")
            args = tuple(a.strip() for a in m.group(2).split(",")) if m.group(2) and m.group(2).strip() else ()
            if any(not a for a in args):
                raise ValueError(f"empty argument in '{m.group(0).strip()}'")
            item = (m.group(1), args)
            if item not in items:
                items.append(item)
            pos = m.end()
            if pos < len(t):
                if t[pos] != ",":
                    raise ValueError(f"expected ',' between metrics at '{t[pos:]}'")
                pos += 1
                if pos >= len(t):
                    raise ValueError("trailing ','")
        if not items:
            raise ValueError("empty metric list")
        return items

    def allowed(self) -> str:
        return "comma-separated metric plugins, each Name or Name(arg1,arg2) (quantopt --plugin lists them)"
