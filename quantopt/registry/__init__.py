"""Versioned registries for operator forward/quantize functions and dataset/metric plugins, and plugin discovery.

Rules: versions compare as versions (`1.10` > `1.9`); the highest registered version is active; on a tie the
first registration stays (so a plugin overrides a built-in only with a strictly higher version). Registries are
the only global state of quantopt.

What the registry hands out for a registration outside quantopt (a user plugin) is guarded: an exception other
than quantopt's own errors raised inside the plugin's code (an operator's forward or quantize function, a dataset's
`__init__`/`__len__`/`__getitem__`, a metric's `__init__`/`__call__`/`reset`/`compute`/`report`) becomes a
`PluginError` (exit code 5) naming the plugin file, the line in it and the plugin, instead of an internal error
blamed on quantopt. Built-ins are handed out as they are: their exceptions are quantopt's bugs.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import functools
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from ..errors import PluginError, QuantOptError
from ..log import OPT_DEBUG, OPT_WARN
from .known_keys import declare_keys, declare_schema
from .optype import OpType, OpTypeName, register_optype
from .schema import Kind, Param, ParamSchema

PLUGIN_PREFIX = "aipubt_"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PluginType(enum.Enum):
    Dataset = 0x110
    Metric = 0x120
    QConfig = 0x130


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
    guarded: Any = None
    """What the registry hands out for a plugin: `obj` wrapped so that its exceptions become PluginErrors (set
    on first use for operator functions, at registration for dataset and metric classes)."""

    def handed_out(self) -> Any:
        return self.obj if self.builtin or self.guarded is None else self.guarded


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
OP_EXPORT = VersionedRegistry("ONNX export of operator")
DATASETS = VersionedRegistry("dataset plugin")
METRICS = VersionedRegistry("metric plugin")
QCONFIGS = VersionedRegistry("qconfig plugin")


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


ACTIVATION_DTYPES = "float32 → int8/uint8 (8 bits) or int16/uint16 (16 bits)"
PASSTHROUGH_DTYPES = "any; quantized output keeps the input's dtype, scale and zero point"


@dataclass
class OpSpec:
    """One operator declaration: the types it covers, their typed layer keys, what the docs say of them, and the
    functions attached to it with its decorators (`forward`, `quantize`, `export`)."""
    optypes: Tuple[str, ...]
    schema: ParamSchema
    dtypes: str
    integer: str
    semantics: str
    summary: str
    version: str
    source: str

    def only(self, *optypes: str) -> OpSpec:
        """The same declaration restricted to some of its types, for a function that serves only those
        (`@SPEC.only("Permute").forward`)."""
        unknown = [str(t) for t in optypes if str(t) not in self.optypes]
        if unknown or not optypes:
            raise PluginError(f"OpSpec.only: {unknown or 'no type'} not among {list(self.optypes)}")
        return dataclasses.replace(self, optypes=tuple(str(t) for t in optypes))

    def forward(self, fn: Callable) -> Callable:
        """Decorator: `fn(node)` computes the outputs (float, or integer when `node.quantized`)."""
        return op_register(self.optypes, self.version)(fn)

    def quantize(self, fn: Callable) -> Callable:
        """Decorator: `fn(node)` chooses the quantization parameters and quantizes the constants."""
        return quant_register(self.optypes, self.version)(fn)

    def export(self, fn: Callable) -> Callable:
        """Decorator: `fn(g, node)` writes the quantized layer into the ONNX QDQ graph `g` under construction
        (docs/onnx-export.md, "Operators of plugins"). Every built-in mapping is declared this way, beside its
        operator; a plugin replaces one with a higher version, as it replaces a forward."""
        for t in self.optypes:
            OP_EXPORT.register(t, fn, self.version, _caller_file(fn))
        return fn


OP_SPECS: Dict[str, OpSpec] = {}
"""optype -> its declaration (the last declaration of a type wins, as its registrations' versions decide)."""


def declare_op(optypes: Union[str, Iterable[str]], *, params: Optional[Dict[str, Union[Param, Kind]]] = None,
               constants: Optional[Dict[str, str]] = None, integer: str, dtypes: str = ACTIVATION_DTYPES,
               semantics: str = "docs/integer-semantics.md", summary: str = "",
               version: Union[str, int, float] = "1.0") -> OpSpec:
    """Declare one operator (or a family sharing one implementation): its typed layer keys, which the IR reader
    checks (any other key, or a value of another kind, is an IR error naming the line), its constants, and its
    documentation; attach the functions with the returned spec's decorators. A type name quantopt does not know
    is registered as a new operator type. docs/plugins.md shows a complete operator written this way."""
    names = [optypes] if isinstance(optypes, str) else [str(t) for t in optypes]
    if not names:
        raise PluginError("declare_op: no operator type given")
    for name in names:
        if name not in OpType:
            register_optype(name)
    items: List[Tuple[str, Param]] = []
    for key, p in (params or {}).items():
        if isinstance(p, Kind):
            p = Param(p)
        if not isinstance(p, Param):
            raise PluginError(f"declare_op({names[0]}): parameter '{key}' must be a Param or a kind such as "
                              f"Int(), got {p!r}")
        items.append((str(key), p))
    frame = inspect.currentframe()
    source = frame.f_back.f_code.co_filename if frame is not None and frame.f_back is not None else "?"
    spec = OpSpec(tuple(names), ParamSchema(tuple(items), tuple((constants or {}).items())), dtypes, integer,
                  semantics, summary, str(version), source)
    for name in names:
        OP_SPECS[name] = spec
        declare_schema(name, spec.schema, builtin=_is_builtin(source))
    return spec


def export_function(optype: str) -> Optional[Callable]:
    """The ONNX export function declared with an operator (`OpSpec.export`), or None (the type has no QDQ
    mapping)."""
    reg = OP_EXPORT.get(str(optype))
    return None if reg is None else reg.obj


BUILTIN_OPERATORS = "quantopt.ops"
"""The package of the built-in operators. Discovery loads it by name, as it loads plugin folders by path: the
registry sits below the operators (docs/architecture.md, "Layers") and depends on none of them."""


def load_builtin_operators() -> None:
    """Import the built-in operator package (once): its declarations fill the registries and the key schemas the
    IR reader checks. Loaded by name, not imported: the registry sits below the operators."""
    importlib.import_module(BUILTIN_OPERATORS)


def register_op_keys(optype_or_list: Union[str, Iterable[str]], keys: Iterable[str]) -> None:
    """Declare the layer keys (parameters and constants) an operator type reads, so that the IR reader checks
    its layers: any other key is then an error with a did-you-mean hint (docs/plugins.md). A new type that
    declares nothing is not checked; on a built-in type the keys are added to the built-in ones (for an override
    that reads more)."""
    names = [keys] if isinstance(keys, str) else list(keys)
    for t in _optypes(optype_or_list):
        try:
            declare_keys(str(t), names)
        except ValueError as e:
            raise PluginError(f"register_op_keys: {e}") from None


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _line_in(error: BaseException, source: str) -> Optional[int]:
    """The line of the innermost traceback frame in `source` (the plugin file), if any."""
    path = os.path.abspath(source)
    frames = traceback.extract_tb(error.__traceback__)
    return next((f.lineno for f in reversed(frames) if os.path.abspath(f.filename) == path), None)


def plugin_failure(error: BaseException, reg: Registration, what: str) -> PluginError:
    """The PluginError for `error`, raised inside the plugin of `reg` while doing `what`."""
    return PluginError(f"{what} raised {type(error).__name__}: {_one_line(error) or '(no message)'}",
                       file=reg.source, line=_line_in(error, reg.source))


def _guard_operator(reg: Registration, role: str, optype: str) -> Callable:
    fn = reg.obj

    @functools.wraps(fn)
    def guarded(node: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(node, *args, **kwargs)
        except QuantOptError:
            raise
        except Exception as e:
            where = getattr(node, "where", lambda: "?")()
            raise plugin_failure(e, reg, f"operator plugin {getattr(fn, '__name__', fn)} ({role} of {optype}, "
                                         f"version {reg.version}) on layer '{getattr(node, 'name', '?')}' "
                                         f"({where})") from e
    return guarded


def _handed_out_function(table: VersionedRegistry, optype: str, role: str) -> Optional[Callable]:
    reg = table.get(str(optype))
    if reg is None:
        return None
    if not reg.builtin and reg.guarded is None:
        reg.guarded = _guard_operator(reg, role, str(optype))
    return reg.handed_out()


def forward_function(optype: str) -> Optional[Callable]:
    """The active forward function of `optype` (a plugin's guarded: its exceptions become PluginErrors)."""
    return _handed_out_function(OP_FORWARD, optype, "forward")


def quantize_function(optype: str) -> Optional[Callable]:
    """The active quantize function of `optype` (a plugin's guarded: its exceptions become PluginErrors)."""
    return _handed_out_function(OP_QUANTIZE, optype, "quantize")


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


class OptBaseQConfig(abc.ABC):
    """Base class of QConfig plugins (cfg field `qconfig`): per-layer quantization settings programmed in Python,
    for rules the cfg's per-layer syntax cannot say (a layer's shape, its weights, its neighbours...).

    Constructed without arguments once per run, after the cfg's rules and the `opt_config` JSON are applied;
    `configure` sees the float graph and returns the settings to change (docs/plugins.md, "QConfig plugins")."""

    @abc.abstractmethod
    def configure(self, graph: Any) -> Dict[str, Dict[str, Any]]:
        """layer name -> {setting key of the per-layer JSON template: value}; layers left out keep theirs."""


def register_plugin(plugin_type: PluginType, version: Union[str, int, float] = "1.0") -> Callable:
    """Class decorator for Dataset (a torch Dataset), Metric (an OptBaseMetric) and QConfig (an OptBaseQConfig)
    plugins.

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
            table, methods = METRICS, _METRIC_METHODS
        elif plugin_type is PluginType.QConfig:
            if not (isinstance(cls, type) and issubclass(cls, OptBaseQConfig)):
                raise PluginError(f"qconfig plugin {getattr(cls, '__name__', cls)} in {source} must subclass "
                                  f"OptBaseQConfig")
            table, methods = QCONFIGS, _QCONFIG_METHODS
        else:
            import torch.utils.data

            if not (isinstance(cls, type) and issubclass(cls, torch.utils.data.Dataset)):
                raise PluginError(f"dataset plugin {getattr(cls, '__name__', cls)} in {source} must subclass "
                                  f"torch.utils.data.Dataset")
            table, methods = DATASETS, _DATASET_METHODS
        table.register(cls.__name__.lower(), cls, version, source)
        reg = table.all[cls.__name__.lower()][Version.parse(version)]
        if reg.obj is cls and not reg.builtin:
            reg.guarded = _guard_class(reg, plugin_type.name.lower(), methods)
        return cls
    return decorator


_DATASET_METHODS = ("__init__", "__len__", "__getitem__")
_METRIC_METHODS = ("__init__", "__call__", "reset", "compute", "report")
_QCONFIG_METHODS = ("__init__", "configure")


def _guard_method(reg: Registration, kind: str, method: Callable, name: str) -> Callable:
    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = method(self, *args, **kwargs)
        except QuantOptError:
            raise
        except Exception as e:
            call = f"{name}({_one_line(repr(args[0]), 40)})" if name == "__getitem__" and args else name
            raise plugin_failure(e, reg, f"{kind} plugin {reg.obj.__name__}: {call}") from e
        if name == "compute" and not _is_score(result):  # the protocol: a score the report can print and compare
            code = getattr(method, "__code__", None)
            raise PluginError(f"{kind} plugin {reg.obj.__name__}: compute returned {_one_line(repr(result), 60)}, "
                              f"not a number", file=reg.source, line=code.co_firstlineno if code else None)
        return result
    return guarded


def _is_score(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several values
        return False
    return True


def _guard_class(reg: Registration, kind: str, methods: Tuple[str, ...]) -> type:
    """A subclass of the plugin class whose methods turn the plugin's exceptions into PluginErrors. It keeps the
    class's name and signature (`inspect.signature` follows the wrappers) and pickles by reference as an
    attribute of the plugin class, so DataLoader worker processes can rebuild it."""
    cls = reg.obj
    namespace: Dict[str, Any] = {"__module__": cls.__module__, "__doc__": cls.__doc__,
                                 "__qualname__": f"{cls.__qualname__}._quantopt_guarded"}
    for name in methods:
        method = getattr(cls, name, None)
        if callable(method) and not getattr(method, "__isabstractmethod__", False):
            namespace[name] = _guard_method(reg, kind, method, name)
    guarded = type(cls)(cls.__name__, (cls,), namespace)
    cls._quantopt_guarded = guarded  # type: ignore[attr-defined]  # the pickle reference (see __qualname__)
    return guarded


def get_plugin(plugin_type: PluginType, name: str) -> type:
    """The active dataset, metric or qconfig class named `name` (a user plugin's guarded subclass: its exceptions
    become PluginErrors naming the plugin file)."""
    table = {PluginType.Dataset: DATASETS, PluginType.Metric: METRICS, PluginType.QConfig: QCONFIGS}[plugin_type]
    reg = table.get(name.strip().lower())
    if reg is None:
        known = ", ".join(sorted(r.obj.__name__ for r in table.active.values())) or "none"
        raise PluginError(f"no {plugin_type.name.lower()} plugin named '{name}' (registered: {known})",
                          field=plugin_type.name.lower())
    return reg.handed_out()


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
    load_builtin_operators()

    results = load_plugin_dir(builtin_plugin_dir())
    for folder in plugin_search_dirs():
        results += load_plugin_dir(folder)
    _discovered = True
    return results
