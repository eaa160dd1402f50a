"""quantopt: post-training quantization with an exact simulated integer NPU backend.

Public API for plugins (operators, datasets, metrics) — everything a plugin file needs is importable from here.
The names that need torch are imported on first use (module `__getattr__`), so that `import quantopt.cli`, and
with it `quantopt --version`, `--help`, `--field` and cfg errors, load no torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

from .errors import ConfigError, DataError, IRError, PluginError, QuantOptError, UnsupportedError
from .log import OPT_DEBUG, OPT_ERROR, OPT_INFO, OPT_WARN
from .version import __version__

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from .graph.graph import PyGraph, QuantizeGraph
    from .graph.node import PyNode
    from .graph.tensor import PyTensor, TensorStatistics
    from .quant.dtype import Dtype
    from .registry import OptBaseMetric, PluginType, op_register, quant_register, register_plugin
    from .registry.optype import OpType, register_optype

_LAZY = {
    "PyGraph": ".graph.graph", "QuantizeGraph": ".graph.graph", "PyNode": ".graph.node",
    "OpType": ".registry.optype", "register_optype": ".registry.optype",
    "PyTensor": ".graph.tensor", "TensorStatistics": ".graph.tensor", "Dtype": ".quant.dtype",
    "OptBaseMetric": ".registry", "PluginType": ".registry", "op_register": ".registry",
    "quant_register": ".registry", "register_plugin": ".registry",
}
"""Public name -> the module defining it, imported on first access."""

__all__ = [
    "ConfigError", "DataError", "IRError", "PluginError", "QuantOptError", "UnsupportedError",
    "PyGraph", "QuantizeGraph", "PyNode", "OpType", "register_optype", "PyTensor", "TensorStatistics", "Dtype",
    "OPT_DEBUG", "OPT_ERROR", "OPT_INFO", "OPT_WARN", "OptBaseMetric", "PluginType", "op_register",
    "quant_register", "register_plugin", "__version__",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (`from quantopt import op_register` works as before)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
