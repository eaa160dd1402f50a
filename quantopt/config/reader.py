"""Reads the `[Common]` INI file into a validated `Config`; every error names the file, line and field.

Reading imports neither torch nor numpy (tests/test_fast_start.py checks it): a cfg error is reported before any
model code loads.
"""
from __future__ import annotations

import difflib
import os
from typing import Any, Dict, Optional, Tuple

from ..errors import ConfigError
from .fields import FIELDS, UPSTREAM_FIELDS, Field
from .optypes import ACTIVATION_METHODS  # noqa: F401  (re-exported)
from .optypes import known_optype as _known_optype
from .perlayer import PerLayerSyntaxError, PerLayerValue, parse_per_layer
from .presets import preset_values
from .targets import target_defaults

SECTION = "common"


class Config:
    """Validated cfg values as attributes; per-layer fields are `PerLayerValue` (use `.get(node)`)."""

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path
        self.values: Dict[str, Any] = {f.name: f.default for f in FIELDS.values()}
        self.explicit: Dict[str, int] = {}
        for f in FIELDS.values():
            if f.per_layer:
                self.values[f.name] = PerLayerValue(f.default)

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("values")
        if values is not None and name in values:
            return values[name]
        raise AttributeError(f"no cfg field '{name}'")

    preset_fields: Dict[str, str] = {}
    """The fields the `preset` set (field -> value text), the others keep the cfg's value or the default."""
    target_fields: Dict[str, str] = {}
    """The fields `min_compatible_zhouyi_target` set (field -> value text), as `preset_fields`."""

    def is_set(self, name: str) -> bool:
        return name in self.explicit

    def error(self, name: str, message: str) -> ConfigError:
        return ConfigError(f"field '{name}': {message}", file=self.path, line=self.explicit.get(name))


def clip(text: str, limit: int = 120) -> str:
    """A user's text quoted in an error line, shortened: a pasted 10,000-character line is not echoed whole."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _parse_field(f: Field, text: str, base_dir: str) -> Any:
    if f.is_path:
        text = text.strip()
        if text and not os.path.isabs(os.path.expanduser(text)):
            text = os.path.normpath(os.path.join(base_dir, text))
        text = os.path.expanduser(text)
    if f.per_layer:
        return parse_per_layer(text, f.kind.parse, _known_optype)
    return f.kind.parse(text)


def _read_lines(path: str) -> Dict[str, Tuple[int, str]]:
    try:
        with open(path, encoding="utf-8-sig") as fh:  # a leading byte-order mark (Windows editors) is dropped
            lines = fh.read().splitlines()
    except FileNotFoundError:
        raise ConfigError("cfg file not found", file=path) from None
    except IsADirectoryError:
        raise ConfigError("cfg path is a folder, not a file", file=path) from None
    except UnicodeDecodeError:
        raise ConfigError("cfg file is not UTF-8 text", file=path) from None
    entries: Dict[str, Tuple[int, str]] = {}
    in_common = False
    seen_section = False
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#") or line.startswith(";"):
            continue
        if line.startswith("["):
            if not line.endswith("]"):
                raise ConfigError(f"malformed section header '{clip(line)}'", file=path, line=number)
            name = line[1:-1].strip()
            if name.lower() != SECTION:
                raise ConfigError(f"unknown section [{clip(name)}]: all options belong in [Common]", file=path,
                                  line=number)
            if seen_section:
                raise ConfigError("duplicate [Common] section", file=path, line=number)
            seen_section = in_common = True
            continue
        if not in_common:
            raise ConfigError("options must follow a [Common] section header", file=path, line=number)
        if "=" not in line:
            raise ConfigError(f"malformed line '{clip(line)}': expected key = value", file=path, line=number)
        key, value = line.split("=", 1)
        key = key.strip().lower()
        if not key:
            raise ConfigError(f"malformed line '{clip(line)}': empty key", file=path, line=number)
        if key in entries:
            raise ConfigError(f"duplicate key '{clip(key)}' (first set at line {entries[key][0]})", file=path,
                              line=number)
        entries[key] = (number, value.strip())
    if not seen_section:
        raise ConfigError("no [Common] section found", file=path)
    return entries


def read_cfg(path: str) -> Config:
    """Parse and validate a cfg file. Relative paths inside are resolved from the cfg file's folder."""
    entries = _read_lines(path)
    cfg = Config(path)
    base_dir = os.path.dirname(os.path.abspath(path))
    for key, (number, text) in entries.items():
        f = FIELDS.get(key)
        if f is None and key in UPSTREAM_FIELDS:
            raise ConfigError(f"field '{key}' of the Compass Optimizer is not implemented in quantopt yet; remove it "
                              f"from the cfg (quantopt --field lists the supported fields)", file=path, line=number)
        if f is None:
            close = difflib.get_close_matches(key, list(FIELDS), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else \
                "; run 'quantopt --field' to list all fields"
            raise ConfigError(f"unknown key '{clip(key)}'{hint}", file=path, line=number)
        cfg.explicit[key] = number
        if text == "":
            continue  # empty value: keep the default
        try:
            cfg.values[key] = _parse_field(f, text, base_dir)
        except PerLayerSyntaxError as e:
            raise ConfigError(f"field '{key}': invalid per-layer value '{clip(text)}': {e}", file=path,
                              line=number) from None
        except ValueError as e:
            raise ConfigError(f"field '{key}': invalid value '{clip(text)}' ({e}); expected {f.allowed()}",
                              file=path, line=number) from None
    _apply_preset(cfg, base_dir)
    _apply_target(cfg, base_dir)
    check_cross_fields(cfg)
    return cfg


def _apply_preset(cfg: Config, base_dir: str) -> None:
    """The preset's values for the fields the cfg leaves at their defaults (config/presets.py); the fields it set
    are listed in `cfg.preset_fields`, for the log."""
    cfg.preset_fields = {}
    for name, text in preset_values(cfg.preset).items():
        if cfg.is_set(name):
            continue
        cfg.values[name] = _parse_field(FIELDS[name], text, base_dir)
        cfg.preset_fields[name] = text


def _apply_target(cfg: Config, base_dir: str) -> None:
    """`min_compatible_zhouyi_target`'s defaults (config/targets.py) for the fields neither the cfg nor the preset
    set; listed in `cfg.target_fields` for the log."""
    cfg.target_fields = {}
    for name, text in target_defaults(cfg.min_compatible_zhouyi_target).items():
        if cfg.is_set(name) or name in cfg.preset_fields:
            continue
        cfg.values[name] = _parse_field(FIELDS[name], text, base_dir)
        cfg.target_fields[name] = text


def check_cross_fields(cfg: Config) -> None:
    """Rules that involve several fields, checked before anything runs."""
    if not cfg.graph:
        raise ConfigError("field 'graph' is required: the float IR .txt to optimize", file=cfg.path)
    if cfg.metric and not cfg.data:
        raise cfg.error("metric", "a metric needs validation 'data' (and usually 'label')")
    if cfg.metric and not cfg.dataset:
        raise cfg.error("metric", "a metric needs a 'dataset' plugin to read the validation data")
    for name in ("data", "label", "calibration_data"):
        if cfg.values[name] and not cfg.dataset:
            raise cfg.error(name, f"'{name}' is set but no 'dataset' plugin is given to read it")
    if cfg.label and not cfg.data:
        raise cfg.error("label", "'label' is set without 'data'")
    if cfg.float_reference == "native" and cfg.is_set("fc_float_summation"):
        raise cfg.error("fc_float_summation", "applies to float_reference = exact only; float_reference = native "
                        "sums FullyConnected with torch's float32 GEMM")
    _check_writable_folder(cfg, "output_dir")
    if cfg.dump:
        _check_writable_folder(cfg, "dump_dir")


def _check_writable_folder(cfg: Config, name: str) -> None:
    """An output folder that is a file, lies under a file, or cannot be created is reported now, naming the field,
    not as an OS error once the model has been quantized. Nothing is created here."""
    path = os.path.abspath(cfg.values[name])
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise cfg.error(name, f"'{path}' is a file, not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise cfg.error(name, f"the folder '{path}' is not writable")
        return
    parent = os.path.dirname(path)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise cfg.error(name, f"'{path}' cannot be created: '{parent}' is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise cfg.error(name, f"'{path}' cannot be created: '{parent}' is not writable")
