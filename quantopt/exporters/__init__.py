"""Exporters of quantized graphs to other formats (optional dependencies, imported lazily)."""
from __future__ import annotations

from .onnx_qdq import build_onnx_qdq, export_onnx_qdq, supported_layer_types

__all__ = ["build_onnx_qdq", "export_onnx_qdq", "supported_layer_types"]
