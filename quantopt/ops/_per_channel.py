"""Per-channel activation quantization (`quantize_method_for_activation = per_channel_symmetric_*`).

An activation quantized per channel has one scale per channel of its last axis (channels-last IR) and zero point
0. Which layers take part (docs/integer-semantics.md, "Per-channel activations"):

* producers: Convolution, DepthwiseConv, FullyConnected and BatchNorm, whose requantization is per output channel
  anyway (s_out[c] / (s_in · s_w[c])), Eltwise/Add/Sub/Mul, which then align their inputs channel by channel, and
  the table activations, with one table per channel;
* consumers: the same layers; the MAC layers read float weights into which the input scales were absorbed before
  their quantize function ran (w'[.., i] = w[.., i] / s_in[i], input scale 1; passes/absorb_scales.py does it on the
  quantized copy, here are the pure helpers and the check), the element-wise ones align per channel; MAX/AVG pooling,
  which works per channel and passes the scales on; Concat on the channel axis, which passes the integers through and
  joins the scales. Any other consumer is refused with an error naming both layers.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import quant_of
from ..graph.tensor import PyTensor

TABLE_ACTIVATIONS = ("Activation", "Sigmoid", "Tanh", "Hardswish", "HardSigmoid", "ELU", "SELU", "CELU", "GELU",
                     "Silu", "Swish", "MISH", "Softplus", "Softsign", "SHRINK", "THRESHOLDEDRELU", "BNLL")
"""Activation layer types that may take per-channel inputs with one table per channel (their table methods only;
the multiplier methods of `Activation` refuse them)."""
PER_CHANNEL_PRODUCERS = ("Convolution", "DepthwiseConv", "FullyConnected", "BatchNorm", "Eltwise", "Add", "Sub",
                         "Mul") + TABLE_ACTIVATIONS
PER_CHANNEL_CONSUMERS = PER_CHANNEL_PRODUCERS + ("Pooling", "GlobalPool", "Concat")


def is_per_channel(node: PyNode, t: PyTensor) -> bool:
    """Whether `t`, a tensor of `node`, has one scale per channel."""
    return quant_of(node).get(t).per_channel


def channel_scales(node: PyNode, t: PyTensor) -> Optional[torch.Tensor]:
    """The float32 scales along the last axis of `t`, a per-channel activation of `node`, else None."""
    q = quant_of(node).get(t)
    return q.scale.to(torch.float32).reshape(-1) if q.per_channel else None


MULTIPLIER_METHODS = ("NONE", "RELU", "RELU6", "CLIP", "LEAKYRELU", "PRELU", "CRELU")
"""`Activation` methods computed with one multiplier (not a table): per-tensor inputs only."""


def reads_per_channel(node: PyNode) -> bool:
    """Whether the layer can read a per-channel quantized input."""
    if str(node.type) == "Activation":
        return str(node.params.get("method", "")).upper() not in MULTIPLIER_METHODS
    return str(node.type) in PER_CHANNEL_CONSUMERS


def check_per_channel_inputs(node: PyNode) -> None:
    """Refuse a layer that cannot read a per-channel quantized input, naming the producer's tensor."""
    if reads_per_channel(node):
        return
    for t in node.inputs:
        if is_per_channel(node, t):
            raise UnsupportedError(
                f"layer '{node.name}' ({node.type}) reads '{t.name}', quantized per channel; per-channel "
                f"activations feed only {', '.join(PER_CHANNEL_CONSUMERS)} layers and graph outputs: give the "
                "producer a per_tensor activation mode")


def input_channel_index(node: PyNode, weights: torch.Tensor) -> torch.Tensor:
    """For every weight element, the input channel it multiplies (int64, the weights' shape).

    Convolution OHWI [O, kh, kw, I/g]: channel (o // (O/g)) · (I/g) + i; DepthwiseConv [I·m, kh, kw, 1]: o // m;
    FullyConnected [O, I]: i; BatchNorm [C]: c."""
    kind = str(node.type)
    shape = list(weights.shape)
    if kind == "BatchNorm":
        rank = len(node.inputs[0].ir_shape)
        axis = int(node.params.get("axis", -1))
        if axis % max(rank, 1) != rank - 1:
            raise UnsupportedError(f"layer '{node.name}' (BatchNorm): a per-channel input needs the BatchNorm on the "
                                   f"last axis (the activation's channel axis), not axis {axis}")
        return torch.arange(weights.numel()).reshape(shape)
    if kind == "FullyConnected":
        return torch.arange(shape[-1]).expand(shape)
    in_c = int(node.inputs[0].ir_shape[-1])
    out_c, per_group = shape[0], shape[-1]
    groups = in_c // per_group if per_group else 1
    out_per_group = max(out_c // max(groups, 1), 1)
    first = (torch.arange(out_c) // out_per_group) * per_group
    index = first.reshape([out_c] + [1] * (len(shape) - 1)) + torch.arange(per_group)
    return index.expand(shape)


ABSORBING_TYPES = ("Convolution", "DepthwiseConv", "FullyConnected", "BatchNorm")
"""The per-channel consumers that take the input scales into their float weights (the MAC layers)."""

ABSORBED_SCALES = "absorbed_input_scales"
"""`node.attrs` key: the float32 input scales a layer's float weights were divided by (passes/absorb_scales.py)."""


class UnabsorbedInputScales(AssertionError):
    """Internal error: a MAC layer is quantized with weights that do not hold its per-channel input's scales."""


def absorbed_weights(node: PyNode, weights: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float weights with the input scales absorbed (each weight divided by the scale of the input channel it
    multiplies, in float64, rounded once to the weights' dtype); `weights` is left as it is."""
    index = input_channel_index(node, weights)
    if int(index.max()) >= scales.numel():
        raise node._error(f"per-channel input '{node.inputs[0].name}' has {scales.numel()} scales but the weights "
                          f"read {int(index.max()) + 1} input channels")
    return (weights.to(torch.float64) / scales.to(device=weights.device, dtype=torch.float64)[
        index.to(weights.device)]).to(weights.dtype)


def input_scales_absorbed(node: PyNode) -> bool:
    """Whether the layer's input scales are in its float weights (then the input counts with scale 1, zero point 0).

    True for a per-channel input whose scales, bit for bit, are those the weights were divided by; False for a
    per-tensor input whose scales nothing absorbed. Anything else means the absorption step before quantization
    did not run or ran with other scales: an internal error (UnabsorbedInputScales)."""
    scales = channel_scales(node, node.inputs[0])
    absorbed = node.attrs.get(ABSORBED_SCALES)
    if scales is None and absorbed is None:
        return False
    if scales is None or absorbed is None or not torch.equal(absorbed.cpu(), scales.cpu()):
        got = "none" if scales is None else f"{scales.numel()} per-channel scales"
        raise UnabsorbedInputScales(
            f"layer '{node.name}' ({node.type}): input '{node.inputs[0].name}' has {got} but the weights "
            f"{'hold no input scales' if absorbed is None else 'hold other input scales'}; the per-channel "
            "absorption (passes/absorb_scales.py) must run on the layer right before it is quantized")
    return True
