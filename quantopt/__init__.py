"""quantopt: post-training quantization with an exact simulated integer NPU backend.

Public API for plugins (operators, datasets, metrics) — everything a plugin file needs is importable from here:
the graph objects, the registries' decorators, and an operator's declaration (`declare_op`, `Param` and the
parameter kinds `Int`, `Float`, `Bool`, `Text`, `Ints`, `Floats`, `Axis`, `DtypeName`, `Either`, `Value`).
The helpers an operator's quantize and integer forward functions call (output params from the calibrated range,
requantization multiplier/shift, exact integer requantization, weights, biases, ...) are the module
`quantopt.ops.api` (`from quantopt.ops.api import requant_scale_shift, ...`; docs/plugins.md, "Writing an
operator"): the same functions the built-in operators use.

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
    from .graph.tables import TensorStatistics
    from .graph.tensor import PyTensor
    from .quant.dtype import Dtype
    from .registry import OptBaseMetric, PluginType, declare_op, op_register, quant_register, register_plugin
    from .registry.optype import OpType, register_optype
    from .registry.schema import Axis, Bool, DtypeName, Either, Float, Floats, Int, Ints, Param, Text, Value

_LAZY = {
    "PyGraph": ".graph.graph", "QuantizeGraph": ".graph.graph", "PyNode": ".graph.node",
    "OpType": ".registry.optype", "register_optype": ".registry.optype",
    "PyTensor": ".graph.tensor", "TensorStatistics": ".graph.tables", "Dtype": ".quant.dtype",
    "OptBaseMetric": ".registry", "OptBaseQConfig": ".registry", "PluginType": ".registry", "op_register": ".registry",
    "quant_register": ".registry", "register_plugin": ".registry", "declare_op": ".registry",
    **{name: ".registry.schema" for name in ("Param", "Int", "Float", "Bool", "Text", "Ints", "Floats", "Axis",
                                              "DtypeName", "Either", "Value")},
}
"""Public name -> the module defining it, imported on first access."""

__all__ = [
    "ConfigError", "DataError", "IRError", "PluginError", "QuantOptError", "UnsupportedError",
    "PyGraph", "QuantizeGraph", "PyNode", "OpType", "register_optype", "PyTensor", "TensorStatistics", "Dtype",
    "OPT_DEBUG", "OPT_ERROR", "OPT_INFO", "OPT_WARN", "OptBaseMetric", "OptBaseQConfig", "PluginType", "op_register",
    "quant_register", "register_plugin", "declare_op", "Param", "Int", "Float", "Bool", "Text", "Ints", "Floats",
    "Axis", "DtypeName", "Either", "Value", "__version__",
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
