"""Value kinds of cfg fields: each parses the text of a value and describes what it accepts.

Nothing here imports torch or numpy (the calibration grammars come from calibration_values.py), so that cfg errors
and `quantopt --field` answer at once.
"""
from __future__ import annotations

import abc
import os
import re
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from ..device import DEVICE_NAMES, parse_device
from .calibration_values import STRATEGY_FORMS, UNIFY_ALLOWED_TEXT, parse_strategy, parse_trim, parse_unify_rules


class ValueKind(abc.ABC):
    """Parses one cfg value; raises ValueError with a short reason when the text is not acceptable."""

    @abc.abstractmethod
    def parse(self, text: str) -> Any:
        """The typed value of `text`."""

    @abc.abstractmethod
    def allowed(self) -> str:
        """What the field accepts, for error messages and `quantopt --field`."""


def _check_range(value: Any, minimum: Any, maximum: Any) -> Any:
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError("out of range")
    return value


def _range_text(what: str, minimum: Any, maximum: Any) -> str:
    if minimum is not None and maximum is not None:
        return f"{what} in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"{what} >= {minimum}"
    if maximum is not None:
        return f"{what} <= {maximum}"
    return what


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


INT_LIMIT = 2**31 - 1
"""No integer field means anything beyond int32: a larger value is a typo, not a request."""

MAX_BATCH = 1 << 20
"""Largest batch size: far beyond memory for any model, small enough for every index type."""


@dataclass
class IntKind(ValueKind):
    minimum: Optional[int] = None
    maximum: Optional[int] = None

    def parse(self, text: str) -> int:
        t = text.strip()
        if not re.fullmatch(r"[+-]?\d+", t):
            raise ValueError("not an integer")
        value = int(t)
        if self.maximum is None and abs(value) > INT_LIMIT:
            raise ValueError(f"out of range: beyond {INT_LIMIT}")
        return _check_range(value, self.minimum, self.maximum)

    def allowed(self) -> str:
        return _range_text("an integer", self.minimum, self.maximum)


@dataclass
class FloatKind(ValueKind):
    minimum: Optional[float] = None
    maximum: Optional[float] = None

    def parse(self, text: str) -> float:
        try:
            v = float(text.strip())
        except ValueError:
            raise ValueError("not a number") from None
        if v != v:
            raise ValueError("not a number")
        return _check_range(v, self.minimum, self.maximum)

    def allowed(self) -> str:
        return _range_text("a number", self.minimum, self.maximum)


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


class DeviceKind(ValueKind):
    """Where tensors live: `auto`, `cpu`, `cuda` or `cuda:N` (checked against the machine when the run starts, not
    here, so that reading a cfg never needs torch)."""

    def parse(self, text: str) -> str:
        try:
            return parse_device(text)
        except ValueError:
            raise ValueError("not a device") from None

    def allowed(self) -> str:
        return DEVICE_NAMES


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


MAX_NAME_BYTES = 200
"""Longest name in output file names: with quantopt's suffixes (`_opt_template.json`...) it stays below the 255
bytes most file systems allow."""


class NameKind(ValueKind):
    """A non-empty name used in output file names (no path separators)."""

    def parse(self, text: str) -> str:
        t = text.strip()
        if not t or "/" in t or "\\" in t or t in (".", ".."):
            raise ValueError("not a plain name")
        if len(t.encode("utf-8")) > MAX_NAME_BYTES:
            raise ValueError(f"{len(t)} characters long")
        return t

    def allowed(self) -> str:
        return f"a non-empty name without path separators, at most {MAX_NAME_BYTES} bytes (output file names add " \
               "suffixes to it)"


class QuantTypeKind(ValueKind):
    """`quant_type`: `disable` or one of upstream's recipe names (config/quant_types.py)."""

    def parse(self, text: str) -> str:
        from .quant_types import QUANT_TYPE_NAMES, quant_type_settings

        name = text.strip().lower()
        if name not in QUANT_TYPE_NAMES:
            raise ValueError("not a quant_type name")
        quant_type_settings(name)
        return name

    def allowed(self) -> str:
        from .quant_types import QUANT_TYPE_NAMES

        return "disable or one of " + ", ".join(QUANT_TYPE_NAMES[1:])


class TargetKind(ValueKind):
    """`min_compatible_zhouyi_target`: an NPU generation whose integer forms quantopt simulates (config/targets.py)."""

    def parse(self, text: str) -> str:
        from .targets import target_defaults, target_name

        name = target_name(text)
        target_defaults(name)  # refuses the targets quantopt does not simulate
        return name

    def allowed(self) -> str:
        return "Z1, Z2, Z3, X1 or X2 (any case; a '_' suffix such as X2_1204 is ignored)"


@dataclass
class PluginNameKind(ValueKind):
    """A plugin's class name (checked against the registry when the run starts)."""

    what: str = "dataset"

    def parse(self, text: str) -> str:
        t = text.strip()
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t):
            raise ValueError("not a plugin class name")
        return t

    def allowed(self) -> str:
        return f"the class name of a registered {self.what} plugin (quantopt --plugin lists them)"


class GlobalCalibrationKind(ValueKind):
    """`global_calibration`: parsed by config/global_calibration.py (imported lazily: that module's kind derives
    from ValueKind, defined here)."""

    def parse(self, text: str) -> Any:
        from .global_calibration import GlobalCalibrationKind as Spec

        return Spec().parse(text)

    def allowed(self) -> str:
        from .global_calibration import GlobalCalibrationKind as Spec

        return Spec().allowed()


class InputShapesKind(ValueKind):
    """`x:1,3,224,224; mask:1,128`: fixed shapes for an imported ONNX model's inputs (kept as text; the importer
    parses it and names the input it cannot place)."""

    def parse(self, text: str) -> str:
        t = text.strip()
        for part in (p.strip() for p in t.split(";") if p.strip()):
            dims = part.rpartition(":")[2]
            if not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", dims):
                raise ValueError(f"'{part}' is not name:d0,d1,... with positive integer dims")
        return t

    def allowed(self) -> str:
        return "name:d0,d1,... per input, inputs separated by ';' (a single-input model may omit the name)"


class InputValuesKind(ValueKind):
    """`sr:16000; scale:0.5,0.5`: constant values for an imported ONNX model's inputs (kept as text; the importer
    parses it and names the input it cannot place)."""

    def parse(self, text: str) -> str:
        t = text.strip()
        for part in (p.strip() for p in t.split(";") if p.strip()):
            name, sep, values = part.rpartition(":")
            if not sep or not name.strip():
                raise ValueError(f"'{part}' is not name:v0,v1,...")
            for v in values.split(","):
                try:
                    float(v)
                except ValueError:
                    raise ValueError(f"'{part}': '{v.strip()}' is not a number") from None
        return t

    def allowed(self) -> str:
        return "name:v0,v1,... per input, inputs separated by ';'"


class KeywordArgsKind(ValueKind):
    """`resize=224x224; mean=0.485,0.456,0.406`: keyword arguments (strings) for a plugin's constructor."""

    def parse(self, text: str) -> dict:
        args: dict = {}
        for part in (p.strip() for p in text.split(";")):
            if not part:
                continue
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"'{part}' is not key=value")
            if not value:
                raise ValueError(f"'{key}' has an empty value")
            if key in ("data_file", "label_file"):
                raise ValueError(f"'{key}' comes from the data/label fields, not from here")
            if key in args:
                raise ValueError(f"'{key}' is given twice")
            args[key] = value
        return args

    def allowed(self) -> str:
        return "key=value pairs separated by ';' (the dataset plugin's constructor keywords, as strings)"


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


@dataclass
@dataclass
class OptionalIntKind(IntKind):
    """An integer, or an empty value meaning "derived from other fields" (parsed as None); `off_words` are other
    spellings of the empty value (upstream writes `false` for an integer field that is off)."""

    off_words: Tuple[str, ...] = ()

    def parse(self, text: str) -> Optional[int]:  # type: ignore[override]
        if not text.strip() or text.strip().lower() in self.off_words:
            return None
        return super().parse(text)

    def allowed(self) -> str:
        if self.off_words:
            return super().allowed() + f" (empty or {'/'.join(self.off_words)}: off)"
        return super().allowed() + " (empty: derived from other fields)"


class StrategyKind(ValueKind):
    """A local calibration strategy name (`mean`, `extrema`, `3std`, `kld`, `0.99percentile`, ...)."""

    def parse(self, text: str) -> str:
        return str(parse_strategy(text))

    def allowed(self) -> str:
        return "one of " + ", ".join(STRATEGY_FORMS)


class TrimKind(ValueKind):
    """`clip(lo, hi)` or `second(lo, hi)` applied to tensors before statistics; empty for none."""

    def parse(self, text: str) -> str:
        trim = parse_trim(text)
        return "" if trim is None else f"{trim.method}({trim.lo:g},{trim.hi:g})"

    def allowed(self) -> str:
        return "clip(lo, hi) or second(lo, hi) with lo <= 0 <= hi (numbers or -inf/inf)"


class IntListKind(ValueKind):
    """Comma-separated non-negative integers, e.g. layer ids `0,2`; brackets optional."""

    def parse(self, text: str) -> List[int]:
        t = text.strip().strip("[]").strip()
        if not t:
            return []
        items = [s.strip() for s in t.split(",")]
        if any(not re.fullmatch(r"\d+", s) for s in items):
            raise ValueError("not a list of non-negative integers")
        return [int(s) for s in items]

    def allowed(self) -> str:
        return "comma-separated layer ids, e.g. 0,2"


class UnifyScalesKind(ValueKind):
    """`[(OpType, depth, threshold, max|min|avg|out|skip), ...]`, the grammar of config/calibration_values.py
    (applied by tuning/unify_scales.py)."""

    def parse(self, text: str) -> Any:
        return parse_unify_rules(text)

    def allowed(self) -> str:
        return UNIFY_ALLOWED_TEXT
