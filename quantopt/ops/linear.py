"""FullyConnected (float, quantize, integer forward) and MatMul (float forward)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.optype import OpType
from ..registry import op_register, quant_register
from ._quant import (
    effective_weights,
    exact_float_dtype,
    input_absmax,
    layer_settings,
    mac_finish,
    mac_input,
    quantize_mac,
)
from ._shared import apply_fused_activation, bool_param


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.float32


def _check_float(node: PyNode) -> None:
    if node.quantized:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the integer forward is not implemented yet")


@op_register(OpType.FullyConnected)
def fully_connected_forward(self: PyNode) -> None:
    """y = x @ W^T + b over the last axis; weights [out, in], biases [out] (absent means zero)."""
    if self.quantized:
        x, _ = mac_input(self)
        w = effective_weights(self)
        dtype = exact_float_dtype(input_absmax(self.inputs[0]), w)
        _check_fc_shapes(self, x, w)
        # zero point folded into the biases: acc = x_q·w + b_q' (no padding in a dense layer)
        acc = F.linear(x.to(dtype), w.to(dtype)).to(torch.float64)
        self.outputs[0].betensor = mac_finish(self, acc)
        return
    x = self.inputs[0].betensor
    dtype = _compute_dtype(x)
    x = x.to(dtype)
    w = self.get_constant("weights").betensor.to(device=x.device, dtype=dtype)
    _check_fc_shapes(self, x, w)
    out_f = int(w.shape[0])
    b_t = self.get_constant("biases", optional=True)
    b = None
    if b_t is not None:
        b = b_t.betensor.to(device=x.device, dtype=dtype)
        if b.numel() != out_f:
            raise self._error(f"biases must have {out_f} elements, got shape {list(b.shape)}")
        b = b.reshape(out_f)
    self.outputs[0].betensor = apply_fused_activation(self, F.linear(x, w, b))


@quant_register(OpType.FullyConnected)
def fully_connected_quantize(self: PyNode) -> None:
    quantize_mac(self, per_channel=layer_settings(self).q_mode_weight.startswith("per_channel"))


def _check_fc_shapes(self: PyNode, x: torch.Tensor, w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise self._error(f"weights must be 2-D [out, in], got shape {list(w.shape)}")
    out_f, in_f = int(w.shape[0]), int(w.shape[1])
    if x.dim() < 1 or int(x.shape[-1]) != in_f:
        raise self._error(f"input shape {list(x.shape)} does not end in the {in_f} input features of weights "
                          f"{list(w.shape)}")
    num_output = self.get_param("num_output", optional=True, default_value=out_f)
    if isinstance(num_output, bool) or num_output != out_f:
        raise self._error(f"parameter num_output={num_output} does not match weights shape {list(w.shape)}")


def _maybe_transpose(node: PyNode, t: torch.Tensor, key: str) -> torch.Tensor:
    if not bool_param(node, key, False):
        return t
    if t.dim() < 2:
        raise node._error(f"{key}=true needs an operand of rank >= 2, got shape {list(t.shape)}")
    return t.transpose(-1, -2)


@op_register(OpType.MatMul)
def matmul_forward(self: PyNode) -> None:
    """Batched matmul of two activations with torch.matmul broadcasting; trans_a/trans_b swap the last two axes."""
    _check_float(self)
    if len(self.inputs) != 2:
        raise self._error(f"MatMul needs exactly 2 inputs, got {len(self.inputs)}")
    a, b = self.inputs[0].betensor, self.inputs[1].betensor
    dtype = torch.promote_types(_compute_dtype(a), _compute_dtype(b))
    a = _maybe_transpose(self, a.to(dtype), "trans_a")
    b = _maybe_transpose(self, b.to(dtype), "trans_b")
    try:
        y = torch.matmul(a, b)
    except RuntimeError as e:
        raise self._error(f"operand shapes {list(a.shape)} and {list(b.shape)} (after trans_a/trans_b) "
                          f"cannot be multiplied: {e}") from None
    self.outputs[0].betensor = apply_fused_activation(self, y)
