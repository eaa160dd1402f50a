"""`enable_pass_scaled_dot_product_attention` (passes/sdp_attention.py): which attention chains become one
SDPAttention layer and with which params, the chains left alone, the float outputs (equal up to float rounding),
the quantized model against the float one, the field false, and the cfg field on the corpus encoder."""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch
from golden_helpers import golden_cfg

from quantopt.cli import main
from quantopt.config.fields import FIELDS, UPSTREAM_FIELDS
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import QuantizeGraph
from quantopt.ir.reader import read_ir
from quantopt.passes.sdp_attention import apply_sdpa_settings, scaled_dot_product_attention
from quantopt.pipeline import graph_passes, quantize_model, run_quantized, settings_from_arguments

B, H, M, N, D, DV = 1, 2, 6, 5, 8, 4
SCALE = np.float32(1.0 / math.sqrt(D))
CORPUS = Path(__file__).resolve().parent / "data" / "golden_corpus"


def _swap(shape: Sequence[int], flag: bool) -> List[int]:
    s = list(shape)
    if flag:
        s[-1], s[-2] = s[-2], s[-1]
    return s


def _attention(scale: Optional[str] = "mul", mask: Optional[str] = None, trans_q: bool = False,
               trans_k: bool = False, trans_v: bool = False, k_transpose_layer: bool = False,
               softmax_axis: int = -1, pv_order: str = "pv", between: bool = False, qk_act: str = "NONE",
               softmax_output: bool = False, k_heads: int = H) -> QuantizeGraph:
    """q [B,H,M,D] · k [B,H,D,N] -> scale -> [Add mask] -> Softmax -> · v [B,H,N,DV], each input in the layout its
    trans_* flag asks for.

    scale: "mul" (a Mul by a Constant 1/sqrt(D)), "div" (a Div by sqrt(D)), "bn" (a scaling BatchNorm), None;
    mask: "second" (Add(logits, mask)), "first" (Add(mask, logits)), None; k_transpose_layer: K comes as
    [B,H,N,D] through a Transpose layer; pv_order "vp": MatMul(V', P) instead (not an attention); between: a Reshape
    between the Q·K MatMul and the scale; softmax_output: the Softmax output is also a graph output."""
    b = GraphBuilder("sdpa")
    b.input("q", _swap([B, H, M, D], trans_q))
    if k_transpose_layer:
        b.input("k_raw", [B, k_heads, N, D])
        b.layer("Transpose", ["k_raw"], [[B, k_heads, D, N]], name="kt", params={"perm": [0, 1, 3, 2]})
        k = "kt"
    else:
        b.input("k", _swap([B, k_heads, D, N], trans_k))
        k = "k"
    b.input("v", _swap([B, k_heads, N, DV], trans_v))
    if mask:
        b.input("mask", [B, 1, M, N])
    logits = [B, H, M, N]
    b.layer("MatMul", ["q", k], [logits], name="qk",
            params={"trans_a": trans_q, "trans_b": trans_k, "with_activation": qk_act})
    last = "qk"
    if between:
        b.layer("Reshape", [last], [logits], name="rs", params={"shape": logits})
        last = "rs"
    if scale == "mul":
        b.layer("Constant", [], [[]], name="c", constants={"weights": np.asarray(SCALE)})
        b.layer("Mul", [last, "c"], [logits], name="s", params={"with_activation": "NONE"})
        last = "s"
    elif scale == "div":
        b.layer("Constant", [], [[]], name="c", constants={"weights": np.asarray(np.float32(math.sqrt(D)))})
        b.layer("Div", [last, "c"], [logits], name="s")
        last = "s"
    elif scale == "bn":
        b.layer("BatchNorm", [last], [logits], name="s", params={"axis": 3, "epsilon": 0.0},
                constants={"weights": np.full(N, SCALE, np.float32), "biases": np.zeros(N, np.float32)})
        last = "s"
    if mask:
        ins = [last, "mask"] if mask == "second" else ["mask", last]
        b.layer("Add", ins, [logits], name="add", params={"with_activation": "NONE"})
        last = "add"
    b.layer("Softmax", [last], [logits], name="sm", params={"axis": softmax_axis})
    if pv_order == "pv":
        b.layer("MatMul", ["sm", "v"], [[B, H, M, DV]], name="pv", params={"trans_a": False, "trans_b": trans_v})
    else:  # V'[B,H,DV,M] · P: a product with the probabilities on the right
        b.layer("MatMul", ["v", "sm"], [[B, H, DV, N]], name="pv", params={"trans_a": True, "trans_b": False})
    outputs = ["pv"] + (["sm"] if softmax_output else [])
    return b.build(outputs)


def _batch(g: QuantizeGraph, seed: int) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in g.input_tensors:
        x = torch.randn(*t.ir_shape, generator=gen) * 2.0
        if t.name == "mask":  # a causal-like mask: large negative values above the diagonal
            x = torch.triu(torch.full(tuple(t.ir_shape), -30.0), diagonal=1)
        out.append(x)
    return out


def _outputs(g: QuantizeGraph, batch: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    g.forward(list(batch))
    return [t.betensor.clone() for t in g.output_tensors]


def _types(g: QuantizeGraph) -> Dict[str, str]:
    return {n.name: str(n.type) for n in g.nodes}


FUSED = [
    dict(scale="mul"),
    dict(scale="mul", mask="second"),
    dict(scale="bn", mask="second"),
    dict(scale="mul", trans_k=True),
    dict(scale="mul", mask="second", trans_q=True, trans_k=True, trans_v=True),
    dict(scale="mul", k_transpose_layer=True),
    dict(scale="mul", k_heads=1),
]


@pytest.mark.parametrize("kw", FUSED, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_chain_is_fused_with_upstreams_params(kw: dict) -> None:
    g = _attention(**kw)
    inputs = {t.name: t for t in g.input_tensors}
    done = scaled_dot_product_attention(g)
    cut = ["qk", "s", "add", "sm"] if kw.get("mask") else ["qk", "s", "sm"]
    assert done == [("pv", cut + (["c"] if kw["scale"] == "mul" else []))]
    sd = g.node("pv")
    assert str(sd.type) == "SDPAttention"
    kept = {"Input"} | ({"Transpose"} if kw.get("k_transpose_layer") else set())
    assert {str(n.type) for n in g.nodes} == kept | {"SDPAttention"}
    p = sd.params
    assert list(p) == ["trans_v", "trans_k", "trans_q", "enable_gqa", "scale_factor", "with_mask"]
    assert (p["trans_q"], p["trans_k"], p["trans_v"]) == (kw.get("trans_q", False), kw.get("trans_k", False),
                                                          kw.get("trans_v", False))
    assert p["scale_factor"] == float(SCALE) and p["enable_gqa"] is True
    assert p["with_mask"] is bool(kw.get("mask"))
    k_name = "kt" if kw.get("k_transpose_layer") else "k"
    names = ["q_q", f"k_{k_name}", "v_v"] + (["mask"] if kw.get("mask") else [])
    assert [t.name for t in sd.inputs] == names
    if kw.get("mask"):
        assert sd.inputs[3] is inputs["mask"]
    assert [t.name for t in g.output_tensors] == ["pv"]


@pytest.mark.parametrize("kw", FUSED, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_float_outputs_equal_up_to_rounding(kw: dict) -> None:
    g = _attention(**kw)
    batch = _batch(g, 3)
    before = _outputs(g, batch)[0]
    graph_passes(g, scaled_dot_product_attention=True)
    assert "SDPAttention" in _types(g).values()
    after = _outputs(g, batch)[0]
    assert after.shape == before.shape
    assert float((after - before).abs().max()) < 2e-5 * max(1.0, float(before.abs().max()))


LEFT_ALONE = {
    "no scale": dict(scale=None),
    "div scale": dict(scale="div"),
    "mask first": dict(scale="mul", mask="first"),
    "softmax not on the last axis": dict(scale="mul", softmax_axis=2),
    "probabilities on the right": dict(scale="mul", pv_order="vp"),
    "reshape between Q.K and the scale": dict(scale="mul", between=True),
    "Q.K with a fused RELU": dict(scale="mul", qk_act="RELU"),
    "softmax output is a graph output": dict(scale="mul", softmax_output=True),
}


@pytest.mark.parametrize("name", list(LEFT_ALONE))
def test_chain_left_alone(name: str) -> None:
    g = _attention(**LEFT_ALONE[name])
    types = _types(g)
    assert scaled_dot_product_attention(g) == []
    assert _types(g) == types
    assert [t.name for n in g.nodes for t in n.inputs] == [t.name for n in _attention(**LEFT_ALONE[name]).nodes
                                                           for t in n.inputs]


def test_field_false_changes_nothing() -> None:
    g = _attention(scale="mul", mask="second")
    batch = _batch(g, 4)
    before = _outputs(g, batch)[0]
    graph_passes(g, merge_matmul_mul_pass=False)
    assert _types(g) == _types(_attention(scale="mul", mask="second"))
    assert torch.equal(_outputs(g, batch)[0], before)


@pytest.mark.parametrize("kw", [dict(scale="mul", mask="second"), dict(scale="mul", trans_k=True, trans_v=True),
                                dict(scale="bn")], ids=["mask", "trans", "bn"])
def test_quantized_model_runs_close_to_float(kw: dict) -> None:
    """One SDPAttention layer; its dequantized outputs are as close to the float chain's as the unfused quantized
    chain's are (the logits and probabilities are no longer 8-bit tensors)."""
    reference = _attention(**kw)
    batches = [_batch(reference, s) for s in range(6)]
    error = []
    for fuse in (True, False):
        g = _attention(**kw)
        graph_passes(g, scaled_dot_product_attention=fuse, merge_matmul_mul_pass=False)
        q = quantize_model(g, batches)
        assert [str(n.type) for n in q.nodes].count("SDPAttention") == int(fuse)
        if fuse:
            assert q.node("pv").quantized and "lut" in q.node("pv").constants
        got = torch.cat([run_quantized(q, b)[0] for b in batches[:3]])
        want = torch.cat([_outputs(reference, b)[0] for b in batches[:3]])
        error.append(float((got - want).abs().mean()))
    scale = float(want.abs().max())
    assert error[0] < 0.03 * scale and error[0] <= 1.25 * error[1], (error, scale)


def _chain_graph():
    """An attention chain whose Q is the input and whose K and V come through an activation and shape-only layers."""
    b = GraphBuilder("ops")
    b.input("x", [1, 2, 6, 8])
    b.layer("Activation", ["x"], [[1, 2, 6, 8]], name="act", params={"method": "TANH"})
    b.layer("Reshape", ["act"], [[1, 2, 6, 8]], name="rs", params={"shape": [1, 2, 6, 8]})
    b.layer("Transpose", ["rs"], [[1, 2, 8, 6]], name="kt", params={"perm": [0, 1, 3, 2]})
    b.layer("MatMul", ["x", "kt"], [[1, 2, 6, 6]], name="qk", params={"trans_a": False, "trans_b": False})
    b.layer("Constant", [], [[]], name="c", constants={"weights": np.asarray(SCALE)})
    b.layer("Mul", ["qk", "c"], [[1, 2, 6, 6]], name="s", params={"with_activation": "NONE"})
    b.layer("Softmax", ["s"], [[1, 2, 6, 6]], name="sm", params={"axis": 3})
    b.layer("MatMul", ["sm", "act"], [[1, 2, 6, 8]], name="pv", params={"trans_a": False, "trans_b": False})
    b.layer("Activation", ["pv"], [[1, 2, 6, 8]], name="out", params={"method": "SIGMOID"})
    return b.build(["out"])


def test_settings_of_the_fused_layer_and_its_operands() -> None:
    """As upstream: the fused layer (8 bits) and the producers of Q, K and V, back through shape-only layers, get
    per_tensor_symmetric_restricted_range activations whatever the cfg said; other layers keep theirs."""
    g = _chain_graph()
    graph_passes(g, scaled_dot_product_attention=True, merge_matmul_mul_pass=False)
    assert [str(n.type) for n in g.nodes].count("SDPAttention") == 1
    settings_from_arguments(g, {"q_mode_activation": "per_tensor_asymmetric", "q_bits_activation": 16})
    assert sorted(apply_sdpa_settings(g)) == ["act", "kt", "pv", "rs", "x"]
    for n in g.nodes:
        changed = n.name in ("act", "kt", "pv", "rs", "x")
        want = "per_tensor_symmetric_restricted_range" if changed else "per_tensor_asymmetric"
        assert n.settings.q_mode_activation == want, n.name
        assert n.settings.q_bits_activation == (8 if n.name == "pv" else 16), n.name


def test_values_set_for_a_layer_are_not_replaced_silently(caplog) -> None:
    """A mode set for one of those layers in particular (opt_config, a per-layer rule) still gives way to upstream's,
    but the log names the layer, the key and both values; values from the cfg's global fields are replaced quietly."""
    g = _chain_graph()
    graph_passes(g, scaled_dot_product_attention=True, merge_matmul_mul_pass=False)
    settings_from_arguments(g, {"q_mode_activation": "per_tensor_asymmetric"},
                            per_layer={"act": {"q_mode_activation": "per_channel_symmetric_restricted_range"},
                                       "out": {"q_mode_activation": "per_channel_symmetric_restricted_range"}})
    logger = logging.getLogger("quantopt")  # the CLI tests turn propagation off: attach the capture directly
    logger.addHandler(caplog.handler)
    try:
        apply_sdpa_settings(g)
    finally:
        logger.removeHandler(caplog.handler)
    warnings = sorted({r.getMessage() for r in caplog.records if r.levelno == logging.WARNING})  # once or twice
    assert len(warnings) == 1
    want = "'act' q_mode_activation 'per_channel_symmetric_restricted_range' -> 'per_tensor_symmetric_restricted_range'"
    assert want in warnings[0]
    assert "'out'" not in warnings[0] and "'rs'" not in warnings[0]  # not a fused layer's operand; not set for it
    assert g.node("act").settings.q_mode_activation == "per_tensor_symmetric_restricted_range"


def test_two_chains_fuse_each() -> None:
    """Two attentions one after the other (the second reads the first's output as Q): both become layers."""
    b = GraphBuilder("two")
    b.input("q", [1, 4, 8])
    b.input("k", [1, 8, 4])
    b.input("v", [1, 4, 8])
    for i, q in enumerate(["q", "pv0"]):
        b.layer("MatMul", [q, "k"], [[1, 4, 4]], name=f"qk{i}", params={"trans_a": False, "trans_b": False})
        b.layer("Constant", [], [[]], name=f"c{i}", constants={"weights": np.asarray(np.float32(0.5))})
        b.layer("Mul", [f"qk{i}", f"c{i}"], [[1, 4, 4]], name=f"s{i}", params={"with_activation": "NONE"})
        b.layer("Softmax", [f"s{i}"], [[1, 4, 4]], name=f"sm{i}", params={"axis": 2})
        b.layer("MatMul", [f"sm{i}", "v"], [[1, 4, 8]], name=f"pv{i}", params={"trans_a": False, "trans_b": False})
    g = b.build(["pv1"])
    batch = _batch(g, 5)
    before = _outputs(g, batch)[0]
    assert [name for name, _ in scaled_dot_product_attention(g)] == ["pv0", "pv1"]
    assert _types(g) == {"q": "Input", "k": "Input", "v": "Input", "pv0": "SDPAttention", "pv1": "SDPAttention"}
    assert g.node("pv1").inputs[0].name == "q_pv0"
    assert float((_outputs(g, batch)[0] - before).abs().max()) < 1e-5


@pytest.mark.parametrize("enabled", [True, False])
def test_cfg_field_on_the_corpus_encoder(enabled: bool, tmp_path: Path) -> None:
    """The encoder's attention (K transposed by a Transpose layer, 1/sqrt(d) Mul, mask Add) becomes one layer, as in
    upstream's run with the field on; its output scale then is upstream's (243.32794)."""
    name = "enable_pass_scaled_dot_product_attention"
    assert FIELDS[name].default is False and name not in UPSTREAM_FIELDS
    folder = CORPUS / "transformer_encoder" / "golden" / "A"
    out = tmp_path / "out"
    cfg = golden_cfg(folder, out, tmp_path / "enc.cfg", [f"{name} = {'true' if enabled else 'false'}"])
    assert main(["--cfg", str(cfg), "--log-level", "ERROR"]) == 0
    q = read_ir(str(out / "transformer_encoder_o.txt"))
    types = _types(q)
    if enabled:
        assert types["/attn/MatMul_1"] == "SDPAttention"
        assert not {"/attn/MatMul", "/attn/Mul", "/attn/Add", "/attn/Softmax", "/attn/Constant_3"} & set(types)
        sd = q.node("/attn/MatMul_1")
        assert [t.name for t in sd.inputs] == ["q_/attn/Transpose_0", "k_/attn/Transpose_2_0",
                                               "v_/attn/Transpose_1_0", "mask_0"]
        assert (sd.params["trans_q"], sd.params["trans_k"], sd.params["trans_v"]) == (False, False, False)
        assert sd.params["scale_factor"] == pytest.approx(0.3535533845424652, rel=0, abs=0)
        assert float(q.quant.get(sd.outputs[0]).scale) == pytest.approx(243.32794189453125, rel=1e-6)
        # upstream's run: the Q/K/V projections (and the layers after them) symmetric with the restricted range
        for layer, scale in (("/attn/q/MatMul", 64.46920776367188), ("/attn/k/MatMul", 66.12952423095703),
                             ("/attn/v/MatMul", 63.58147430419922), ("/attn/Transpose_2", 66.12952423095703)):
            t = q.quant.get(q.node(layer).outputs[0])
            assert (int(t.qmin), int(t.qmax)) == (-127, 127)
            assert float(t.scale) == pytest.approx(scale, rel=1e-6)
        post = q.quant.get(q.node("x_post_reshape_1").outputs[0])
        assert (int(post.qmin), float(post.scale)) == (-128, pytest.approx(39.16410446166992, rel=1e-6))
    else:
        assert types["/attn/MatMul_1"] == "MatMul" and types["/attn/Softmax"] == "Softmax"
