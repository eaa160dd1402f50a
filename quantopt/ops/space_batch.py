"""Layout ops that move whole blocks between the batch, depth and spatial axes: BatchToDepth, BatchToSpaceND and
DataStride, on channels-last (NHWC / NDHWC) activations.

They complete SpaceToDepth/DepthToSpace/SpaceToBatch/BatchToSpace (ops/geometry.py): pure data movement, so
quantized every output carries its input's scale/zero point/dtype and the integers move exactly as the floats do
(one code path for both). BatchToDepth and BatchToSpaceND mix the rows of dim 0, so they run once per IR-batch
group of a larger batch (quantopt.graph.batch: types without a rule run per group). The semantics are in
docs/semantics/space-batch.md.
"""
from __future__ import annotations

from typing import Any, List, Sequence

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..registry import PASSTHROUGH_DTYPES, declare_op
from ..registry.schema import Int, Ints, Param, Value
from ._quant import check_quantized_inputs, copy_params, params
from ._shared import int_param

SEMANTICS = "docs/semantics/space-batch.md"
_PASSTHROUGH = "passthrough (data movement only)"


def _rank(node: PyNode, x: torch.Tensor, rank: int, layout: str) -> None:
    if x.dim() != rank:
        raise node._error(f"input must be {rank}-D ({layout}), got shape {list(x.shape)}")


def _passthrough_quantize(node: PyNode) -> None:
    """Data movement: the output carries the input's params unchanged (per-tensor only: the channel axis moves)."""
    inp = node.inputs[0]
    check_quantized_inputs(node, [inp])
    q = params(node, inp)
    for what in ("scale", "zerop"):
        v = getattr(q, what)
        if isinstance(v, torch.Tensor) and v.numel() > 1:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): input '{inp.name}' has per-channel "
                                   "quantization; this op needs per-tensor scale and zero point")
    for out in node.outputs:
        copy_params(node, out, inp)


# ------------------------------------------------------------------------------------------------ BatchToDepth
BATCH_TO_DEPTH = declare_op(
    "BatchToDepth",
    params={"block_size": Param(Int(lo=1), "consecutive batch rows stacked into the channels", required=True)},
    dtypes=PASSTHROUGH_DTYPES, integer=_PASSTHROUGH, semantics=f"{SEMANTICS}#batchtodepth",
    summary="[n, h, w, c] -> [n / b, h, w, b * c]: rows n*b .. n*b+b-1 become the channel blocks of row n.")


@BATCH_TO_DEPTH.forward
def batchtodepth_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    _rank(self, x, 4, "NHWC")
    b = int_param(self, "block_size")
    n, h, w, c = x.shape
    if n % b:
        raise self._error(f"batch {n} is not a multiple of block_size {b}")
    y = x.reshape(n // b, b, h, w, c).permute(0, 2, 3, 1, 4)
    self.outputs[0].betensor = y.reshape(n // b, h, w, b * c).contiguous()


# ------------------------------------------------------------------------------------------------ BatchToSpaceND
BATCH_TO_SPACE_ND = declare_op(
    "BatchToSpaceND",
    params={"block_size": Param(Ints(lo=1, scalar_ok=False), "[b_z, b_y, b_x]: blocks along depth, height, width",
                                required=True),
            "crops": Param(Value("[[front, back], [top, bottom], [left, right]] (non-negative integers)"),
                           "cells cropped at both ends of depth, height and width of the result", required=True)},
    dtypes=PASSTHROUGH_DTYPES, integer=_PASSTHROUGH, semantics=f"{SEMANTICS}#batchtospacend",
    summary="NDHWC only (5-D input), as upstream.")


def _crops(node: PyNode) -> List[List[int]]:
    raw: Any = node.get_param("crops")
    ok = isinstance(raw, (list, tuple)) and len(raw) == 3 and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                             for v in p) for p in raw)
    if not ok:
        raise node._error(f"crops must be [[front, back], [top, bottom], [left, right]] of non-negative integers, "
                          f"got {raw!r}")
    return [[int(v) for v in p] for p in raw]


def _block3(node: PyNode) -> Sequence[int]:
    raw = node.get_param("block_size")
    if not isinstance(raw, (list, tuple)) or len(raw) != 3 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in raw):
        raise node._error(f"block_size must be [b_z, b_y, b_x] of positive integers, got {raw!r}")
    return [int(v) for v in raw]


@BATCH_TO_SPACE_ND.forward
def batchtospacend_forward(self: PyNode) -> None:
    x = self.inputs[0].betensor
    _rank(self, x, 5, "NDHWC")
    bz, by, bx = _block3(self)
    (cf, cb), (ct, cbo), (cl, cr) = _crops(self)
    n, d, h, w, c = x.shape
    blocks = bz * by * bx
    if n % blocks:
        raise self._error(f"batch {n} is not a multiple of b_z * b_y * b_x = {blocks}")
    no = n // blocks
    y = x.reshape(bz, by, bx, no, d, h, w, c).permute(3, 4, 0, 5, 1, 6, 2, 7)
    y = y.reshape(no, d * bz, h * by, w * bx, c)
    if cf + cb >= d * bz or ct + cbo >= h * by or cl + cr >= w * bx:
        raise self._error(f"crops {[[cf, cb], [ct, cbo], [cl, cr]]} remove the whole {d * bz}x{h * by}x{w * bx} "
                          "output")
    self.outputs[0].betensor = y[:, cf:d * bz - cb, ct:h * by - cbo, cl:w * bx - cr, :].contiguous()


# ------------------------------------------------------------------------------------------------ DataStride
DATA_STRIDE = declare_op(
    "DataStride",
    params={"kernel_x": Param(Int(lo=1), "patch width", required=True),
            "kernel_y": Param(Int(lo=1), "patch height", required=True),
            "stride_x": Param(Int(lo=1), "horizontal step between patches", required=True),
            "stride_y": Param(Int(lo=1), "vertical step between patches", required=True)},
    dtypes=PASSTHROUGH_DTYPES, integer=_PASSTHROUGH, semantics=f"{SEMANTICS}#datastride",
    summary="Extracts the kernel_y x kernel_x patches at the strides and lays them side by side: "
            "[n, h, w, c] -> [n, oh * kernel_y, ow * kernel_x, c].")


@DATA_STRIDE.forward
def datastride_forward(self: PyNode) -> None:
    """out[n, i*ky + a, j*kx + b, c] = in[n, i*sy + a, j*sx + b, c] for the oh x ow patch positions."""
    x = self.inputs[0].betensor
    _rank(self, x, 4, "NHWC")
    kx, ky = int_param(self, "kernel_x"), int_param(self, "kernel_y")
    sx, sy = int_param(self, "stride_x"), int_param(self, "stride_y")
    n, h, w, c = x.shape
    if ky > h or kx > w:
        raise self._error(f"kernel {ky}x{kx} is larger than the {h}x{w} input")
    patches = x.unfold(1, ky, sy).unfold(2, kx, sx)  # [n, oh, ow, c, ky, kx]
    oh, ow = patches.shape[1], patches.shape[2]
    y = patches.permute(0, 1, 4, 2, 5, 3).reshape(n, oh * ky, ow * kx, c)
    self.outputs[0].betensor = y.contiguous()


@BATCH_TO_DEPTH.quantize
@BATCH_TO_SPACE_ND.quantize
@DATA_STRIDE.quantize
def space_batch_quantize(self: PyNode) -> None:
    """Pure data movement: the output carries the input's params."""
    _passthrough_quantize(self)
