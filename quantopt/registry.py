"""Versioned registries for operator forward/quantize functions and dataset/metric plugins, and plugin discovery.

Rules: versions compare as versions (`1.10` > `1.9`); the highest registered version is active; on a tie the
first registration stays (so a plugin overrides a built-in only with a strictly higher version). Registries are
the only global state of quantopt.
"""
from __future__ import annotations

import abc
import enum
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from .errors import PluginError
from .graph.optype import OpType, OpTypeName
from .log import OPT_DEBUG, OPT_WARN

PLUGIN_PREFIX = "aipubt_"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class PluginType(enum.Enum):
    Dataset = 0x110
    Metric = 0x120


@dataclass(frozen=True, order=True)
class Version:
    parts: Tuple[int, ...]
    text: str = field(compare=False)

    @classmethod
    def parse(cls, value: Union[str, int, float]) -> Version:
        text = str(value).strip()
        try:
            parts = tuple(int(p) for p in text.split("."))
        except ValueError:
            raise PluginError(f"invalid version '{value}': expected dotted integers such as 1.0 or 2.1.3") from None
        if not parts or any(p < 0 for p in parts):
            raise PluginError(f"invalid version '{value}'")
        trimmed = list(parts)
        while len(trimmed) > 1 and trimmed[-1] == 0:
            trimmed.pop()
        return cls(tuple(trimmed), text)

    def __str__(self) -> str:
        return self.text


@dataclass
class Registration:
    obj: Any
    version: Version
    source: str
    builtin: bool


class VersionedRegistry:
    """key → {version → Registration}, plus which one is active."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.all: Dict[str, Dict[Version, Registration]] = {}
        self.active: Dict[str, Registration] = {}

    def register(self, key: str, obj: Any, version: Union[str, int, float], source: str) -> bool:
        v = Version.parse(version)
        reg = Registration(obj, v, source, _is_builtin(source))
        versions = self.all.setdefault(key, {})
        if v in versions:
            OPT_WARN(f"{self.what} '{key}' version {v} from {source} ignored: version {v} is already registered "
                     f"by {versions[v].source} (use a higher version to override)")
            return False
        versions[v] = reg
        current = self.active.get(key)
        if current is None or v > current.version:
            if current is not None:
                OPT_DEBUG(f"{self.what} '{key}': version {v} from {source} replaces version {current.version} "
                          f"from {current.source}")
            self.active[key] = reg
            return True
        OPT_DEBUG(f"{self.what} '{key}': version {v} from {source} is registered but version "
                  f"{current.version} stays active")
        return False

    def get(self, key: str) -> Optional[Registration]:
        return self.active.get(key)

    def keys(self) -> List[str]:
        return sorted(self.active)


OP_FORWARD = VersionedRegistry("forward of operator")
OP_QUANTIZE = VersionedRegistry("quantize of operator")
DATASETS = VersionedRegistry("dataset plugin")
METRICS = VersionedRegistry("metric plugin")


def _is_builtin(source: str) -> bool:
    path = os.path.abspath(source)
    return path.startswith(_PACKAGE_DIR + os.sep) or path.startswith(builtin_plugin_dir() + os.sep)


def _caller_file(obj: Any) -> str:
    try:
        return inspect.getsourcefile(obj) or inspect.getfile(obj)
    except TypeError:
        return "<unknown>"


def _optypes(optype_or_list: Union[OpTypeName, str, Iterable[Union[OpTypeName, str]]]) -> List[OpTypeName]:
    items = [optype_or_list] if isinstance(optype_or_list, str) else list(optype_or_list)
    out = []
    for item in items:
        if str(item) not in OpType:
            raise PluginError(f"unknown operator type '{item}': call register_optype('{item}') first")
        out.append(OpType.lookup(str(item)))
    return out


def op_register(optype_or_list: Union[str, Iterable[str]], version: Union[str, int, float] = "1.0") -> Callable:
    """Decorator: `fn(node)` computes the node's outputs (float, or integer when `node.quantized`)."""
    def decorator(fn: Callable) -> Callable:
        for t in _optypes(optype_or_list):
            OP_FORWARD.register(str(t), fn, version, _caller_file(fn))
        return fn
    return decorator


def quant_register(optype_or_list: Union[str, Iterable[str]], version: Union[str, int, float] = "1.0") -> Callable:
    """Decorator: `fn(node)` chooses the node's quantization parameters and quantizes its constants."""
    def decorator(fn: Callable) -> Callable:
        for t in _optypes(optype_or_list):
            OP_QUANTIZE.register(str(t), fn, version, _caller_file(fn))
        return fn
    return decorator


def forward_function(optype: str) -> Optional[Callable]:
    reg = OP_FORWARD.get(str(optype))
    return reg.obj if reg else None


def quantize_function(optype: str) -> Optional[Callable]:
    reg = OP_QUANTIZE.get(str(optype))
    return reg.obj if reg else None


class OptBaseMetric(abc.ABC):
    """Base class of metric plugins: constructed with the cfg's string arguments, fed batch by batch.

    `pred` is the list of model outputs in `output_tensors` order (dequantized for a quantized model),
    `target` the collated label of the batch.
    """

    def __init__(self, *args: str) -> None:
        self.args = args

    @abc.abstractmethod
    def __call__(self, pred: List[Any], target: Any) -> None:
        """Accumulate one batch."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget everything accumulated (called before each evaluation)."""

    @abc.abstractmethod
    def compute(self) -> float:
        """The score over all batches since the last reset."""

    def report(self) -> str:
        return f"{type(self).__name__}: {self.compute()}"


def register_plugin(plugin_type: PluginType, version: Union[str, int, float] = "1.0") -> Callable:
    """Class decorator for Dataset (a torch Dataset) and Metric (an OptBaseMetric) plugins.

    The cfg refers to a plugin by its class name, case-insensitively.
    """
    if not isinstance(plugin_type, PluginType):
        raise PluginError(f"register_plugin needs a PluginType, got {plugin_type!r}")

    def decorator(cls: type) -> type:
        source = _caller_file(cls)
        if plugin_type is PluginType.Metric:
            if not (isinstance(cls, type) and issubclass(cls, OptBaseMetric)):
                raise PluginError(f"metric plugin {getattr(cls, '__name__', cls)} in {source} must subclass "
                                  f"OptBaseMetric")
            METRICS.register(cls.__name__.lower(), cls, version, source)
        else:
            import torch.utils.data

            if not (isinstance(cls, type) and issubclass(cls, torch.utils.data.Dataset)):
                raise PluginError(f"dataset plugin {getattr(cls, '__name__', cls)} in {source} must subclass "
                                  f"torch.utils.data.Dataset")
            DATASETS.register(cls.__name__.lower(), cls, version, source)
        return cls
    return decorator


def get_plugin(plugin_type: PluginType, name: str) -> type:
    table = DATASETS if plugin_type is PluginType.Dataset else METRICS
    reg = table.get(name.strip().lower())
    if reg is None:
        known = ", ".join(sorted(r.obj.__name__ for r in table.active.values())) or "none"
        raise PluginError(f"no {plugin_type.name.lower()} plugin named '{name}' (registered: {known})")
    return reg.obj


# --------------------------------------------------------------------------------------------- discovery
@dataclass
class PluginLoad:
    path: str
    ok: bool
    error: str = ""


LOADED: List[PluginLoad] = []
_loaded_paths: Dict[str, PluginLoad] = {}


def builtin_plugin_dir() -> str:
    """The shipped `plugins/` folder (package `quantopt.builtin_plugins`), wherever quantopt is installed."""
    spec = importlib.util.find_spec("quantopt.builtin_plugins")
    if spec is not None and spec.submodule_search_locations:
        return os.path.abspath(list(spec.submodule_search_locations)[0])
    return os.path.abspath(os.path.join(_PACKAGE_DIR, os.pardir, "plugins"))


def plugin_search_dirs() -> List[str]:
    """User plugin folders in load order: each entry of AIPUPLUGIN_PATH, then ./plugin."""
    dirs = [d for d in os.environ.get("AIPUPLUGIN_PATH", "").split(os.pathsep) if d]
    dirs.append(os.path.join(os.getcwd(), "plugin"))
    return dirs


def _import_file(path: str) -> PluginLoad:
    path = os.path.abspath(path)
    if path in _loaded_paths:
        return _loaded_paths[path]
    name = os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) != path:
        result = PluginLoad(path, False, f"a plugin module named '{name}' was already loaded from "
                                         f"{getattr(sys.modules[name], '__file__', '?')}")
        OPT_WARN(f"plugin file {path} skipped: {result.error}")
    else:
        folder = os.path.dirname(path)
        if folder not in sys.path:
            sys.path.append(folder)
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            result = PluginLoad(path, True)
        except Exception as e:  # a broken plugin must not stop the others
            sys.modules.pop(name, None)
            tb = traceback.extract_tb(e.__traceback__)
            line = next((f.lineno for f in reversed(tb) if os.path.abspath(f.filename) == path), None)
            where = f"{path}:{line}" if line else path
            result = PluginLoad(path, False, f"{type(e).__name__}: {e}")
            OPT_WARN(f"plugin file {where} failed to import and was skipped: {type(e).__name__}: {e}")
    _loaded_paths[path] = result
    LOADED.append(result)
    return result


def load_plugin_dir(folder: str) -> List[PluginLoad]:
    if not os.path.isdir(folder):
        return []
    files = sorted(f for f in os.listdir(folder) if f.startswith(PLUGIN_PREFIX) and f.endswith(".py"))
    return [_import_file(os.path.join(folder, f)) for f in files]


_discovered = False


def discover_plugins(force: bool = False) -> List[PluginLoad]:
    """Load built-in operators and plugins, then user plugins. Idempotent unless `force`."""
    global _discovered
    if _discovered and not force:
        return list(LOADED)
    import quantopt.ops  # noqa: F401  (registers the built-in operators)

    results = load_plugin_dir(builtin_plugin_dir())
    for folder in plugin_search_dirs():
        results += load_plugin_dir(folder)
    _discovered = True
    return results
