"""Golden cases of `enable_pass_scaled_dot_product_attention` (quantopt/passes/sdp_attention.py): an attention chain
`MatMul(Q, Kᵀ) → Mul by 1/sqrt(d) → [Add mask] → Softmax → MatMul(·, V)` that both tools fuse into one SDPAttention
layer. K reaches the MatMul through a Transpose layer (`trans_b = false`), the form upstream's run completes: with
`trans_b = true` its SDPAttention quantize fails (docs/user-guide.md, "Graph passes")."""
from __future__ import annotations

from typing import Dict

import numpy as np

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph

from . import IrCase

SAMPLES = 8
HEADS, M, N, D = 4, 5, 7, 8
CFG = ("enable_pass_scaled_dot_product_attention = true",)


def _chain(with_mask: bool):
    def build() -> PyGraph:
        b = GraphBuilder("sdpa_pass")
        q = b.input("q", [1, HEADS, M, D])
        k = b.input("k", [1, HEADS, N, D])
        v = b.input("v", [1, HEADS, N, D])
        kt = b.layer("Transpose", [k], [[1, HEADS, D, N]], name="k_transpose", params={"perm": [0, 1, 3, 2]})
        qk = b.layer("MatMul", [q, kt], [[1, HEADS, M, N]], name="qk", params={"trans_a": False, "trans_b": False})
        c = b.layer("Constant", [], [[]], name="scale", constants={"weights": np.asarray(np.float32(D ** -0.5))})
        s = b.layer("Mul", [qk, c], [[1, HEADS, M, N]], name="scaled", params={"with_activation": "NONE"})
        if with_mask:
            mask = b.input("mask", [1, 1, M, N])
            s = b.layer("Add", [s, mask], [[1, HEADS, M, N]], name="masked", params={"with_activation": "NONE"})
        p = b.layer("Softmax", [s], [[1, HEADS, M, N]], name="softmax", params={"axis": 3})
        y = b.layer("MatMul", [p, v], [[1, HEADS, M, D]], name="pv", params={"trans_a": False, "trans_b": False})
        return b.build([y])
    return build


def _data(with_mask: bool):
    def sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
        shapes = {"q": (HEADS, M, D), "k": (HEADS, N, D), "v": (HEADS, N, D)}
        data = {name: rng.normal(0.1, 1.5, size=(SAMPLES,) + shape).astype(np.float32)
                for name, shape in shapes.items()}
        if with_mask:
            causal = np.arange(N)[None, :] > np.arange(M)[:, None] + 2
            data["mask"] = np.tile(np.where(causal, -30.0, 0.0).astype(np.float32), (SAMPLES, 1, 1, 1))
        return data
    return sample


CASES: Dict[str, IrCase] = {
    "op_sdpa_pass": IrCase(_chain(False), _data(False), CFG),
    "op_sdpa_pass_mask": IrCase(_chain(True), _data(True), CFG),
}
