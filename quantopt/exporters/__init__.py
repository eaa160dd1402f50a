"""Exporters of quantized graphs to other formats (optional dependencies, imported lazily).

The package names resolve on first use, so that `quantopt export --help` (exporters/cli.py) loads no torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .onnx_qdq import build_onnx_qdq, export_onnx_qdq, supported_layer_types

__all__ = ["build_onnx_qdq", "export_onnx_qdq", "supported_layer_types"]


def __getattr__(name: str) -> Any:
    """`from quantopt.exporters import export_onnx_qdq` imports onnx_qdq on first use."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".onnx_qdq", __name__), name)
    globals()[name] = value
    return value
