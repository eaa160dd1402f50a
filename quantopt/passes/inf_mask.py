"""`enable_pass_detect_inf_mask_nodes` (upstream's default, off): before the statistics, Constant layers' float values
at or below -32767 (masks written as -1e9, -65504, -32768) become -FLT_MAX, so that the mask rules of
calibration/inf_mask.py treat them as mask values too (docs/statistics-and-dump.md, "Masks with infinite values").
A BatchNorm built as a mask (`y = keep · w + b` with w + b summing to 0 and every bias below -65536: the Parser's
fold of `(1 - keep) · -1e9`) gets weights 32767 and biases -32767, as upstream's pass writes it.

With `upstream_defects = mask_as_data` the mask rules are off, and Constant values below -32767 become -32768 (data),
as upstream's pass writes them (docs/golden-differences.md, "Reproducing upstream's defects").
"""
from __future__ import annotations

from typing import List

import torch

from ..calibration.inf_mask import FLT_MAX, MASK_SOURCE_THRESHOLD
from ..config.upstream_defects import MASK_AS_DATA
from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..log import OPT_INFO

UPSTREAM_MASK_VALUE = -32768.0
"""With `mask_as_data`: what upstream's pass writes for Constant values below -MASK_SOURCE_THRESHOLD."""

UPSTREAM_BN_MASK_BIAS = -65536.0
"""A BatchNorm whose biases all lie below this (and whose weights cancel them) is a mask."""


def detect_inf_mask_nodes(graph: PyGraph) -> List[str]:
    """`enable_pass_detect_inf_mask_nodes` for the layers whose settings enable it: Constant values <= -32767
    become -FLT_MAX (mask values), or -32768 where `mask_as_data` is asked for; mask BatchNorms get upstream's
    weights and biases. Returns the rewritten layers' names."""
    done = []
    for n in graph.nodes:
        if n.settings is None or not getattr(n.settings, "detect_inf_mask_nodes", False):
            continue
        if str(n.type) == "BatchNorm":
            rewritten = _batchnorm_rewrite(n)
        elif MASK_AS_DATA in n.settings.upstream_defects:
            rewritten = _upstream_constant_rewrite(n)
        else:
            rewritten = _mask_constant_rewrite(n)
        if rewritten:
            done.append(n.name)
    if done:
        OPT_INFO(f"enable_pass_detect_inf_mask_nodes: values <= -{MASK_SOURCE_THRESHOLD:g} of {len(done)} layer(s) "
                 f"rewritten: {', '.join(done)}")
    return done


def _mask_constant_rewrite(n: PyNode) -> bool:
    """quantopt's form: a Constant's float values <= -32767 become -FLT_MAX."""
    w = n.constants.get("weights") if str(n.type) == "Constant" else None
    if w is None or not w.betensor.is_floating_point():
        return False
    low = w.betensor <= -MASK_SOURCE_THRESHOLD
    if bool(low.any()) and not bool((w.betensor[low] <= -FLT_MAX).all()):
        w.betensor = torch.where(low, torch.full_like(w.betensor, -FLT_MAX), w.betensor)
        return True
    return False


def _upstream_constant_rewrite(n: PyNode) -> bool:
    """Upstream's form (`mask_as_data`): a Constant's values below -32767 become -32768."""
    w = n.constants.get("weights") if str(n.type) == "Constant" else None
    if w is None or w.betensor.numel() == 0:
        return False
    low = w.betensor < -MASK_SOURCE_THRESHOLD
    if not bool(low.any()):
        return False
    w.betensor = torch.where(low, torch.full_like(w.betensor, UPSTREAM_MASK_VALUE), w.betensor)
    return True


def _batchnorm_rewrite(n: PyNode) -> bool:
    """A mask BatchNorm (weights + biases summing to 0, every bias below -65536) gets weights 32767 and biases
    -32767, as upstream's pass writes it; any other BatchNorm is left alone."""
    w, b = n.constants.get("weights"), n.constants.get("biases")
    if w is None or b is None or b.betensor.numel() == 0 or w.betensor.shape != b.betensor.shape:
        return False
    # upstream's test, in the constants' own float type
    if float((w.betensor + b.betensor).sum()) != 0.0 or not float(b.betensor.max()) < UPSTREAM_BN_MASK_BIAS:
        return False
    w.betensor = torch.full_like(w.betensor, MASK_SOURCE_THRESHOLD)
    b.betensor = torch.full_like(b.betensor, -MASK_SOURCE_THRESHOLD)
    return True
