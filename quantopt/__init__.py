"""quantopt: post-training quantization with an exact simulated integer NPU backend.

Public API for plugins (operators, datasets, metrics) — everything a plugin file needs is importable from here.
"""
from .errors import ConfigError, DataError, IRError, PluginError, QuantOptError, UnsupportedError
from .graph.graph import PyGraph, QuantizeGraph
from .graph.node import PyNode
from .graph.optype import OpType, register_optype
from .graph.tensor import PyTensor, TensorStatistics
from .ir.dtype import Dtype
from .log import OPT_DEBUG, OPT_ERROR, OPT_INFO, OPT_WARN
from .registry import OptBaseMetric, PluginType, op_register, quant_register, register_plugin
from .version import __version__

__all__ = [
    "ConfigError", "DataError", "IRError", "PluginError", "QuantOptError", "UnsupportedError",
    "PyGraph", "QuantizeGraph", "PyNode", "OpType", "register_optype", "PyTensor", "TensorStatistics", "Dtype",
    "OPT_DEBUG", "OPT_ERROR", "OPT_INFO", "OPT_WARN", "OptBaseMetric", "PluginType", "op_register",
    "quant_register", "register_plugin", "__version__",
]
