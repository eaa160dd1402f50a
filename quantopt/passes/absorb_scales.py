"""Per-channel input scales absorbed into the float weights of the MAC layers that read them, before they are quantized.

A Convolution, DepthwiseConv, FullyConnected or BatchNorm reading an activation quantized per channel
(ops/_per_channel.py) multiplies integers x_q[.., i] = x[.., i] · s_in[i]; dividing each float weight by the scale of
the input channel it multiplies (w'[.., i] = w[.., i] / s_in[i]) lets the layer treat its input as one of scale 1 and
zero point 0 (docs/integer-semantics.md, "Per-channel activations"). The divided weights then get their statistics and
calibrated range again, with the layer's weight strategy, as if they had been the weights all along.

This is a rewrite of float values on the copy that is quantized, never on the float graph: `quantize_graph` runs it on
its clone for every layer right before the layer's quantize function, when the producer's output scales exist (they
are what the producer's quantize function set, so the weights hold exactly the scales the integer input has), and the
global methods run it on the single-layer copies they quantize. The quantize function itself only checks that it
happened (`ops._per_channel.input_scales_absorbed`) and never changes float weights or calls calibration.
"""
from __future__ import annotations

import dataclasses

import torch

from ..calibration.collect import recalibrate_weight
from ..config.layer_settings import LayerSettings
from ..graph.node import PyNode
from ..graph.tables import quant_of
from ..ops._per_channel import (
    ABSORBED_SCALES,
    ABSORBING_TYPES,
    UnabsorbedInputScales,
    absorbed_weights,
)
from ..ops._quant import layer_settings


def absorb_input_scales(node: PyNode) -> bool:
    """Divide the layer's float weights by its per-channel input's scales and calibrate their range again; the
    scales are recorded on the layer (`ABSORBED_SCALES`) for its quantize function's check. False (nothing done) for
    a per-tensor input or a layer that does not absorb; True when done, or already done with the same scales."""
    if str(node.type) not in ABSORBING_TYPES or not node.inputs:
        return False
    q = quant_of(node).get(node.inputs[0])  # the layer's table: its graph's, or a detached copy's own
    if not q.per_channel:
        return False
    scales = q.scale.to(torch.float32).reshape(-1)  # as ops/_per_channel.py channel_scales
    done = node.attrs.get(ABSORBED_SCALES)
    if done is not None:
        if torch.equal(done, scales):
            return True
        raise UnabsorbedInputScales(f"layer '{node.name}' ({node.type}): its weights already hold other input "
                                    "scales")
    settings = _weight_settings(node)
    w = node.get_constant("weights")
    w.betensor = absorbed_weights(node, w.betensor, scales)
    recalibrate_weight(node, w, settings)
    node.attrs[ABSORBED_SCALES] = scales.clone()
    return True


def _weight_settings(node: PyNode) -> LayerSettings:
    """The settings the layer's quantize function quantizes its weights with. A BatchNorm is first brought to the
    plain per-channel affine form its quantize function uses (mean/var folded in, 1-D weights; that function then
    finds nothing left to fold) and takes its weight bits (16 by default); other layers use their own settings."""
    s = layer_settings(node)
    if str(node.type) != "BatchNorm":
        return s
    from ..ops.batchnorm_pad import _prepare_affine, bn_weight_bits

    _prepare_affine(node)
    return dataclasses.replace(s, q_bits_weight=bn_weight_bits(node), remain_shift=None)
