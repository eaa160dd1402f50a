"""Upstream graph passes that need what quantopt does not have: `enable_pass_convert_resize_to_convolution` (off by
default). Set true, it is a clear error, never a silent no-op (docs/user-guide.md, "Graph passes").
"""
from __future__ import annotations

from ..errors import ConfigError

RESIZE_FIELD = "enable_pass_convert_resize_to_convolution"


def refuse_convert_resize_to_convolution() -> None:
    """`enable_pass_convert_resize_to_convolution = true`: always an error (see the message)."""
    raise ConfigError(f"{RESIZE_FIELD}: upstream applies this rewrite (bilinear Resize as Convolution, DepthToSpace "
                      "and friends) only in its compat_quantized_model flow, where it is always on whatever this "
                      "field says, and ignores the field otherwise; quantopt's compat flow keeps Resize layers as they "
                      "are (docs/compat-quantized.md). Remove the field or set it false", field=RESIZE_FIELD)
