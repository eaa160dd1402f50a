"""`enable_pass_detect_inf_mask_nodes` (upstream's default, off): before the statistics, Constant layers' float values
at or below -32767 (masks written as -1e9, -65504, -32768) become -FLT_MAX, so that the mask rules of
calibration/inf_mask.py treat them as mask values too (docs/statistics-and-dump.md, "Masks with infinite values").
"""
from __future__ import annotations

from typing import List

import torch

from ..calibration.inf_mask import FLT_MAX, MASK_SOURCE_THRESHOLD
from ..graph.graph import PyGraph
from ..log import OPT_INFO


def detect_inf_mask_nodes(graph: PyGraph) -> List[str]:
    """`enable_pass_detect_inf_mask_nodes`: float values <= -32767 of Constant layers whose settings enable it
    become -FLT_MAX before the statistics (so they are mask values). Returns the rewritten layers' names."""
    done = []
    for n in graph.nodes:
        if str(n.type) != "Constant" or n.settings is None or not getattr(n.settings, "detect_inf_mask_nodes", False):
            continue
        w = n.constants.get("weights")
        if w is None or not w.betensor.is_floating_point():
            continue
        low = w.betensor <= -MASK_SOURCE_THRESHOLD
        if bool(low.any()) and not bool((w.betensor[low] <= -FLT_MAX).all()):
            w.betensor = torch.where(low, torch.full_like(w.betensor, -FLT_MAX), w.betensor)
            done.append(n.name)
    if done:
        OPT_INFO(f"enable_pass_detect_inf_mask_nodes: values <= -{MASK_SOURCE_THRESHOLD:g} of {len(done)} Constant "
                 f"layer(s) taken as mask values (-FLT_MAX): {', '.join(done)}")
    return done
