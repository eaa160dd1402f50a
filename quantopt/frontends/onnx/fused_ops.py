"""Converters of the nodes the fusion passes create (domain `quantopt.fused`): each becomes the one layer the
Parser writes for the fused pattern.

- ChannelAffine(x, scale, shift; axis, epsilon) → BatchNorm (`weights` = scale, `biases` = shift, the Parser's folded
  form; `epsilon` informative), channels-last when it scales the channel axis of a tensor of rank >= 3;
- Silu(x) → Activation SILU; Swish(x; alpha) → Activation SWISH with `alpha`;
- LayerNorm(x, gamma, beta; axes, epsilon) → LayerNorm; MVN(x; axes, epsilon) → MVN.
"""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np

from .context import Context, nhwc
from .converters import _activation, _ir_axis, _keep_layout
from .simplify import ONode

FusedConverter = Callable[[Context, ONode], None]
FUSED_CONVERTERS: Dict[str, FusedConverter] = {}


def fused(op: str) -> Callable[[FusedConverter], FusedConverter]:
    def deco(fn: FusedConverter) -> FusedConverter:
        FUSED_CONVERTERS[op] = fn
        return fn
    return deco


@fused("ChannelAffine")
def channel_affine(ctx: Context, node: ONode) -> None:
    x, axis = node.inputs[0], int(node.attrs["axis"])
    rank = ctx.rank(x)
    perm = nhwc(rank) if axis == 1 and rank >= 3 else _keep_layout(ctx, x)
    ctx.emit(node, "BatchNorm", [ctx.value(x, perm)], perm,
             {"axis": _ir_axis(axis, perm), "epsilon": float(node.attrs["epsilon"])},
             {"weights": ctx.const(node.inputs[1]).astype(np.float32),
              "biases": ctx.const(node.inputs[2]).astype(np.float32)})


@fused("Silu")
def silu(ctx: Context, node: ONode) -> None:
    _activation(ctx, node, "SILU")


@fused("Swish")
def swish(ctx: Context, node: ONode) -> None:
    _activation(ctx, node, "SWISH", {"alpha": float(node.attrs["alpha"])})


@fused("LayerNorm")
@fused("MVN")
@fused("RMSNorm")
def normalization(ctx: Context, node: ONode) -> None:
    """Normalized over `axes` in the layout the input is held in (gamma and beta permuted to match)."""
    x = node.inputs[0]
    axes = [int(a) for a in node.attrs["axes"]]
    perm = _keep_layout(ctx, x)
    ir_axes = [_ir_axis(a, perm) for a in axes]
    order = list(np.argsort(ir_axes))
    consts = {}
    if node.op in ("LayerNorm", "RMSNorm"):
        for key, t in zip(("weights", "biases"), node.inputs[1:]):
            consts[key] = np.ascontiguousarray(np.transpose(ctx.const(t).astype(np.float32), order))
    ctx.emit(node, node.op, [ctx.value(x, perm)], perm,
             {"axis": sorted(ir_axes), "epsilon": float(node.attrs["epsilon"])}, consts)
