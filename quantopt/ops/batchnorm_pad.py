"""BatchNorm (per-channel affine) and Pad (float forward)."""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.optype import OpType
from ..registry import op_register
from ._shared import apply_fused_activation


def _int_value(node: PyNode, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise node._error(f"parameter '{key}' must hold integers, got {value!r}")
    return int(value)


# --------------------------------------------------------------------------------------------- BatchNorm
def _channel_vector(node: PyNode, key: str, channels: int, like: torch.Tensor, required: bool):
    t = node.get_constant(key, optional=not required)
    if t is None:
        return None
    v = t.betensor.to(device=like.device, dtype=like.dtype)
    if v.numel() != channels:
        raise node._error(f"constant '{key}' must have {channels} elements (one per channel of the BatchNorm axis), "
                          f"got shape {list(v.shape)}")
    return v.reshape(channels)


def _bn_axis(node: PyNode, rank: int) -> int:
    axis = _int_value(node, "axis", node.get_param("axis", optional=True, default_value=-1))
    if not -rank <= axis < rank:
        raise node._error(f"axis={axis} is out of range for a rank-{rank} input")
    return axis % rank


@op_register(OpType.BatchNorm)
def batchnorm_forward(self: PyNode) -> None:
    """y = x * weights + biases along `axis` (default last), the folded form the Parser writes; its `epsilon`
    is informative there. If `mean` and `var` constants are present they are applied first:
    (x - mean) / sqrt(var + epsilon)."""
    if self.quantized:
        raise UnsupportedError(f"layer '{self.name}' ({self.type}): the integer forward is not implemented yet")
    x = self.inputs[0].betensor
    x = x.to(x.dtype if x.is_floating_point() else torch.float32)
    if x.dim() < 1:
        raise self._error("BatchNorm needs an input of rank >= 1")
    axis = _bn_axis(self, x.dim())
    channels = int(x.shape[axis])
    view = [channels] + [1] * (x.dim() - 1 - axis)
    w = _channel_vector(self, "weights", channels, x, True).reshape(view)
    b = _channel_vector(self, "biases", channels, x, False)
    mean = _channel_vector(self, "mean", channels, x, False)
    var = _channel_vector(self, "var", channels, x, False)
    if (mean is None) != (var is None):
        raise self._error("constants 'mean' and 'var' must be given together")
    if mean is not None:
        eps = float(self.get_param("epsilon"))
        x = (x - mean.reshape(view)) / torch.sqrt(var.reshape(view) + eps)
    y = x * w
    if b is not None:
        y = y + b.reshape(view)
    self.outputs[0].betensor = apply_fused_activation(self, y)


# --------------------------------------------------------------------------------------------- Pad
PAD_MODES = ("CONSTANT", "REFLECT", "SYMMETRIC", "EDGE")


def pad_pairs(node: PyNode, pads: Any, rank: int) -> List[Tuple[int, int]]:
    """`pads` as one (before, after) pair per input axis.

    Accepts the Parser's nested layout [[b0, e0], [b1, e1], ...] (NHWC axis order) and the flat ONNX layout
    [b0, b1, ..., e0, e1, ...]; either must cover every axis of the input."""
    if not isinstance(pads, (list, tuple)):
        raise node._error(f"parameter 'pads' must be a list, got {pads!r}")
    if pads and all(isinstance(p, (list, tuple)) for p in pads):
        if len(pads) != rank or any(len(p) != 2 for p in pads):
            raise node._error(f"pads {pads} must hold {rank} [before, after] pairs for a rank-{rank} input")
        pairs = [(_int_value(node, "pads", p[0]), _int_value(node, "pads", p[1])) for p in pads]
    elif len(pads) == 2 * rank:
        flat = [_int_value(node, "pads", p) for p in pads]
        pairs = list(zip(flat[:rank], flat[rank:]))
    else:
        raise node._error(f"pads {pads} fit neither [[before, after]] * {rank} nor the flat ONNX layout of "
                          f"{2 * rank} values for a rank-{rank} input")
    if any(b < 0 or e < 0 for b, e in pairs):
        raise node._error(f"negative pads (cropping) are not supported: {pads}")
    return pairs


def _source_index(mode: str, size: int, before: int, after: int, device: torch.device) -> torch.Tensor:
    """Index into the unpadded axis for every position of the padded axis (numpy.pad semantics)."""
    i = torch.arange(-before, size + after, device=device)
    if mode == "EDGE" or size == 1:
        return i.clamp(0, size - 1)
    if mode == "REFLECT":
        period = 2 * (size - 1)
        i = i.remainder(period)
        return torch.where(i >= size, period - i, i)
    period = 2 * size  # SYMMETRIC
    i = i.remainder(period)
    return torch.where(i >= size, period - 1 - i, i)


def pad_tensor(x: torch.Tensor, pairs: Sequence[Tuple[int, int]], mode: str, value: float) -> torch.Tensor:
    if mode == "CONSTANT":
        flat: List[int] = []
        for b, e in reversed(pairs):
            flat += [b, e]
        return F.pad(x, flat, mode="constant", value=value)
    for axis, (b, e) in enumerate(pairs):
        if b or e:
            x = x.index_select(axis, _source_index(mode, int(x.shape[axis]), b, e, x.device))
    return x


@op_register(OpType.Pad)
def pad_forward(self: PyNode) -> None:
    """Pad keeps the input dtype; `constant_value` only matters in CONSTANT mode (the Parser writes it always)."""
    x = self.inputs[0].betensor
    mode = str(self.get_param("mode", optional=True, default_value="CONSTANT")).upper()
    if mode not in PAD_MODES:
        raise self._error(f"unsupported pad mode '{mode}' (supported: {', '.join(PAD_MODES)})")
    pairs = pad_pairs(self, self.get_param("pads"), x.dim())
    value = self.get_param("constant_value", optional=True, default_value=0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise self._error(f"parameter 'constant_value' must be a number, got {value!r}")
    if mode != "CONSTANT" and any(int(x.shape[a]) == 0 for a, (b, e) in enumerate(pairs) if b or e):
        raise self._error(f"mode {mode} cannot pad an empty axis")
    self.outputs[0].betensor = pad_tensor(x, pairs, mode, float(value))
