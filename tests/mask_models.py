"""Attention-mask test graphs shared by tests/test_inf_mask.py and tests/test_finite_mask.py: scores plus a padding
mask made from keep flags, into a Softmax, and their feeds."""
from __future__ import annotations

from typing import List

import numpy as np
import torch

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph

SEQ = 8


def padding_mask_model(fill: float, form: str = "Where", heads: int = 4, subtract: str = "") -> PyGraph:
    """scores [1,heads,8,8] + mask [1,1,1,8] -> Softmax; the mask is Where(keep, 0, fill) (`form` "Where"),
    (1 - keep) * fill ("Mul") or the Parser's BatchNorm fold of that product, keep * -fill + fill ("BatchNorm").
    `subtract` "Sub" or "Eltwise": scores - mask instead (a positive `fill`, as Funnel's and XLNet's
    `scores - 1e6 * (1 - keep)`), by a Sub layer or an Eltwise SUB."""
    g = GraphBuilder("masked")
    scores = g.input("scores", [1, heads, SEQ, SEQ])
    keep = g.input("keep", [1, 1, 1, SEQ])
    shape = [1, 1, 1, SEQ]
    if form == "Where":
        zero = g.layer("Constant", [], [shape], name="zero", constants={"weights": np.zeros(shape, np.float32)})
        neg = g.layer("Constant", [], [shape], name="neg", constants={"weights": np.full(shape, fill, np.float32)})
        mask = g.layer("Where", [keep, zero, neg], [shape], name="mask")
    elif form == "BatchNorm":
        mask = g.layer("BatchNorm", [keep], [shape], name="mask", params={"axis": -1, "with_activation": "NONE"},
                       constants={"weights": np.full(SEQ, -fill, np.float32), "biases": np.full(SEQ, fill, np.float32)})
    else:
        one = g.layer("Constant", [], [shape], name="one", constants={"weights": np.ones(shape, np.float32)})
        inv = g.layer("Eltwise", [one, keep], [shape], name="inv", params={"method": "SUB", "with_activation": "NONE"})
        neg = g.layer("Constant", [], [shape], name="neg", constants={"weights": np.full(shape, fill, np.float32)})
        mask = g.layer("Mul", [inv, neg], [shape], name="mask", params={"with_activation": "NONE"})
    if subtract == "Sub":
        add = g.layer("Sub", [scores, mask], [[1, heads, SEQ, SEQ]], name="add")
    elif subtract:
        add = g.layer("Eltwise", [scores, mask], [[1, heads, SEQ, SEQ]], name="add",
                      params={"method": "SUB", "with_activation": "NONE"})
    else:
        add = g.layer("Add", [scores, mask], [[1, heads, SEQ, SEQ]], name="add", params={"with_activation": "NONE"})
    out = g.layer("Softmax", [add], [[1, heads, SEQ, SEQ]], name="softmax", params={"axis": -1})
    return g.build([out])


def padding_feeds(n: int, seed: int, heads: int = 4) -> List[List[torch.Tensor]]:
    """Scores of a few units, and masks keeping the first 3..8 positions."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        keep = np.zeros((1, 1, 1, SEQ), np.float32)
        keep[..., :3 + i % (SEQ - 2)] = 1.0
        out.append([torch.from_numpy(rng.normal(0, 2, (1, heads, SEQ, SEQ)).astype(np.float32)),
                    torch.from_numpy(keep)])
    return out
