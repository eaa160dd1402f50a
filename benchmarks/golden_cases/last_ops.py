"""One-operator golden cases of the last upstream operator types quantopt added: GenerateProposals
(quantopt/ops/generate_proposals.py), RNN (quantopt/ops/rnn.py) and SDPAttention (quantopt/ops/sdp_attention.py):
each graph is the operator fed by model inputs and constants, with params as upstream's IR spells them."""
from __future__ import annotations

from typing import Dict

import numpy as np

from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.quant.dtype import Dtype

from . import IrCase

SAMPLES = 8


# ------------------------------------------------------------------------------------------------ GenerateProposals
GP_GRID, GP_ANCHORS, GP_TOPN = 4, 3, 8
"""A 4 x 4 feature map (square: upstream enumerates the grid column-major, identical only then) of a 64 x 64 image,
3 base anchors per position, 8 proposals kept."""


def _generate_proposals() -> PyGraph:
    b = GraphBuilder("generate_proposals")
    s = b.input("scores", [1, GP_GRID, GP_GRID, GP_ANCHORS])
    d = b.input("deltas", [1, GP_GRID, GP_GRID, 4 * GP_ANCHORS])
    im = b.input("im_info", [1, 3])
    base = np.array([[-8.0, -8.0, 23.0, 23.0], [-20.0, -10.0, 35.0, 25.0], [-5.0, -16.0, 20.0, 31.0]],
                    dtype=np.float32)
    y = b.layer("GenerateProposals", [s, d, im], [[1, GP_TOPN], [1, GP_TOPN, 4], [1, GP_TOPN, 1], [1, 1]],
                name="generate_proposals",
                params={"pre_nms_topn": 30, "post_nms_topn": GP_TOPN, "image_height": 64, "image_width": 64,
                        "min_size": 4.0, "iou_threshold": 0.6},
                constants={"weights": base}, outputs=["rois_scores", "rois", "batch_index", "rois_count"],
                output_dtypes=[Dtype.FP32, Dtype.FP32, Dtype.FP32, Dtype.FP32])
    return b.build(y)


def _generate_proposals_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    g, a = GP_GRID, GP_ANCHORS
    return {"scores": rng.uniform(0.0, 1.0, size=(SAMPLES, g, g, a)).astype(np.float32),
            "deltas": rng.normal(0.0, 0.3, size=(SAMPLES, g, g, 4 * a)).astype(np.float32),
            "im_info": np.tile(np.array([[64.0, 64.0, 1.0]], dtype=np.float32), (SAMPLES, 1))}


# ------------------------------------------------------------------------------------------------ RNN
RNN_STEPS, RNN_INPUT, RNN_CELL = 5, 4, 6


def _rnn(activation: str):
    def build() -> PyGraph:
        rng = np.random.default_rng(11)
        b = GraphBuilder("rnn")
        x = b.input("x", [1, RNN_STEPS, RNN_INPUT])
        h0 = b.input("h0", [1, RNN_CELL])
        w = rng.normal(0.0, 0.5, size=(RNN_CELL, RNN_INPUT + RNN_CELL)).astype(np.float32)
        bias = rng.normal(0.0, 0.2, size=(RNN_CELL,)).astype(np.float32)
        y = b.layer("RNN", [x, h0], [[1, RNN_STEPS, RNN_CELL], [1, RNN_CELL]], name="rnn",
                    params={"activations": activation, "input_size": RNN_INPUT, "cell_size": RNN_CELL,
                            "direction": "forward", "time_steps": RNN_STEPS},
                    constants={"weights": w, "biases": bias}, outputs=["y", "h"])
        return b.build(y)
    return build


def _rnn_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"x": rng.normal(0.2, 1.0, size=(SAMPLES, RNN_STEPS, RNN_INPUT)).astype(np.float32),
            "h0": rng.normal(0.0, 0.3, size=(SAMPLES, RNN_CELL)).astype(np.float32)}


# ------------------------------------------------------------------------------------------------ SDPAttention
SDP_HEADS, SDP_KV_HEADS, SDP_M, SDP_N, SDP_D = 4, 2, 5, 7, 8
SDP_TRANS_K = False
"""K is given as [.., D, N]: upstream's quantize fails with trans_k (it transposes a per-tensor scale)."""


def _sdp_attention(with_mask: bool):
    def build() -> PyGraph:
        b = GraphBuilder("sdp_attention")
        q = b.input("q", [1, SDP_HEADS, SDP_M, SDP_D])
        k = b.input("k", [1, SDP_KV_HEADS, SDP_N, SDP_D] if SDP_TRANS_K else [1, SDP_KV_HEADS, SDP_D, SDP_N])
        v = b.input("v", [1, SDP_KV_HEADS, SDP_N, SDP_D])
        inputs = [q, k, v]
        if with_mask:
            inputs.append(b.input("mask", [1, 1, SDP_M, SDP_N]))
        y = b.layer("SDPAttention", inputs, [[1, SDP_HEADS, SDP_M, SDP_D]], name="sdp_attention",
                    params={"trans_q": False, "trans_k": SDP_TRANS_K, "trans_v": False, "enable_gqa": True,
                            "scale_factor": float(SDP_D ** -0.5), "with_mask": with_mask})
        return b.build([y])
    return build


def _sdp_attention_data(with_mask: bool):
    def sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
        k_shape = (SDP_KV_HEADS, SDP_N, SDP_D) if SDP_TRANS_K else (SDP_KV_HEADS, SDP_D, SDP_N)
        shapes = {"q": (SDP_HEADS, SDP_M, SDP_D), "k": k_shape, "v": (SDP_KV_HEADS, SDP_N, SDP_D)}
        data = {name: rng.normal(0.1, 1.5, size=(SAMPLES,) + shape).astype(np.float32)
                for name, shape in shapes.items()}
        if with_mask:
            causal = np.arange(SDP_N)[None, :] > np.arange(SDP_M)[:, None] + 2
            data["mask"] = np.tile(np.where(causal, -30.0, 0.0).astype(np.float32), (SAMPLES, 1, 1, 1))
        return data
    return sample


CASES: Dict[str, IrCase] = {
    "op_generateproposals": IrCase(_generate_proposals, _generate_proposals_data),
    "op_rnn": IrCase(_rnn("TANH"), _rnn_data),
    "op_sdpattention": IrCase(_sdp_attention(False), _sdp_attention_data(False)),
    "op_sdpattention_mask": IrCase(_sdp_attention(True), _sdp_attention_data(True)),
}
