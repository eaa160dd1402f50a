"""The float forward of BasicLSTM and GRU layers writes each step's results into buffers made once per sequence
(ops/recurrent.py): every output and placeholder must keep the bits of the step as upstream writes it, one new
tensor per operation, whatever the sizes (cell sizes that do not fill a vector register included), the batch, the
direction, the clamps and the activations."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch

import quantopt.ops.recurrent  # noqa: F401  (registers the ops)
from quantopt.graph.builder import GraphBuilder

ACT = {"SIGMOID": torch.sigmoid, "TANH": torch.tanh}


def _clamp(v: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    return v if bound is None else torch.clamp(v, -bound, bound)


def lstm_steps(x, h0, c0, w, b, acts, reverse, threshold, cell_clip, forget_bias) -> Dict[str, Any]:
    """Upstream's float64 LSTM step by step: [x_t, h] @ W^T + b, gates one by one, c = f*c + i*g, h = o*act(c)."""
    a_gate, a_cand, a_cell = (ACT[a] for a in acts)
    xs = (torch.flip(x, [1]) if reverse else x).double()
    w, b = w.double(), b.double()
    h, c = h0.double(), c0.double()
    out: Dict[str, List[torch.Tensor]] = {k: [] for k in ("y", "c", "zi", "zg", "zf", "zo", "i", "g", "f", "o", "ac")}
    for t in range(x.shape[1]):
        z = torch.cat([xs[:, t], h], dim=1) @ w.t() + b
        zi, zg, zf, zo = z.chunk(4, dim=1)
        zi, zg, zf, zo = (_clamp(v, threshold) for v in (zi, zg, zf + forget_bias, zo))
        i, g, f, o = a_gate(zi), a_cand(zg), a_gate(zf), a_gate(zo)
        c = _clamp(f * c + i * g, cell_clip)
        ac = a_cell(c)
        h = o * ac
        for k, v in zip(out, (h, c, zi, zg, zf, zo, i, g, f, o, ac)):
            out[k].append(v)
    return {k: torch.stack(v, 1) for k, v in out.items()}


def gru_steps(x, h0, w, b, acts, reverse, threshold, linear_before_reset) -> Dict[str, Any]:
    """Upstream's float32 GRU step by step (GRUV3, or GRUV1 with the reset after the hidden product)."""
    a_gate, a_cand = (ACT[a] for a in acts)
    cs, isz = h0.shape[1], x.shape[2]
    w, b = w.float(), b.float()
    wg, wc, bg, bc = w[:2 * cs], w[2 * cs:3 * cs], b[:2 * cs], b[2 * cs:3 * cs]
    xs = torch.flip(x, [1]) if reverse else x
    h = h0
    out: Dict[str, List[torch.Tensor]] = {k: [] for k in ("y", "zrz", "rz", "pre", "n", "hn")}
    for t in range(x.shape[1]):
        xt = xs[:, t]
        if linear_before_reset:
            zrz = _clamp((xt @ wg[:, :isz].t() + bg) + h @ wg[:, isz:].t(), threshold)
        else:
            zrz = _clamp(torch.cat([xt, h], dim=1) @ wg.t() + bg, threshold)
        rz = a_gate(zrz)
        r, z = rz.chunk(2, dim=1)
        if linear_before_reset:
            hn = h @ wc[:, isz:].t() + b[3 * cs:4 * cs]
            pre = xt @ wc[:, :isz].t() + bc + r * hn
        else:
            hn = torch.zeros_like(h)
            pre = torch.cat([xt, r * h], dim=1) @ wc.t() + bc
        pre = _clamp(pre, threshold)
        n = a_cand(pre)
        h = (1.0 - z) * n + z * h
        for k, v in zip(out, (h, zrz, rz, pre, n, hn)):
            out[k].append(v)
    return {k: torch.stack(v, 1) for k, v in out.items()}


def _graph(optype: str, batch: int, steps: int, isz: int, cs: int, params: Dict[str, Any], seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = 4 * cs if optype == "BasicLSTM" else 3 * cs
    blocks = 4 if optype == "BasicLSTM" or params.get("version") == "GRUV1" else 3
    w = (torch.randn(rows, isz + cs, generator=gen) / (isz + cs) ** 0.5).float()
    b = (torch.randn(blocks * cs, generator=gen) * 0.3).float()
    bld = GraphBuilder("rnn")
    ins = [bld.input("x", [batch, steps, isz]), bld.input("h", [batch, cs])]
    if optype == "BasicLSTM":
        ins.append(bld.input("c", [batch, cs]))
    seq = ["Y", "H", "C"] if optype == "BasicLSTM" else ["H", "Hn"]
    shapes = [[batch, steps, cs] if s in ("Y", "H") else [batch, cs] for s in seq]
    p = dict(time_steps=steps, input_size=isz, cell_size=cs, out_sequence=seq)
    p.update(params)
    outs = bld.layer(optype, ins, shapes, name="op", params=p, constants=dict(weights=w.numpy(), biases=b.numpy()))
    feeds = [(torch.randn(batch, steps, isz, generator=gen) * 2).float(), torch.randn(batch, cs, generator=gen)]
    if optype == "BasicLSTM":
        feeds.append(torch.randn(batch, cs, generator=gen))
    return bld.build(outs), feeds, w, b


def _placeholder(graph, name: str) -> torch.Tensor:
    node = graph.node("op")
    return next(t.betensor for t in node.placeholders if t.name == f"op/{name}")


LSTM_CASES = [
    dict(batch=1, steps=7, isz=12, cs=16, params={}),
    dict(batch=1, steps=5, isz=9, cs=13, params={"direction": "reverse"}),
    dict(batch=3, steps=6, isz=5, cs=20, params={"threshold": 1.5, "cell_clip": 0.7, "forget_bias": 1.0}),
    dict(batch=2, steps=4, isz=7, cs=11, params={"activations": ["TANH", "SIGMOID", "TANH"]}),
    dict(batch=1, steps=3, isz=4, cs=6, params={"activations": ["SIGMOID", "SIGMOID", "SIGMOID"],
                                                "direction": "reverse", "forget_bias": -0.5}),
]


@pytest.mark.parametrize("case", LSTM_CASES)
def test_lstm_float_loop_keeps_the_bits_of_the_step_as_written(case: Dict[str, Any]) -> None:
    graph, feeds, w, b = _graph("BasicLSTM", case["batch"], case["steps"], case["isz"], case["cs"], case["params"],
                                seed=case["cs"])
    y, hn, cn = graph.forward(feeds, keep_tensors=True)
    p = case["params"]
    ref = lstm_steps(feeds[0], feeds[1], feeds[2], w, b, p.get("activations", ["SIGMOID", "TANH", "TANH"]),
                     p.get("direction") == "reverse", p.get("threshold"), p.get("cell_clip"), p.get("forget_bias", 0.0))
    ys = torch.flip(ref["y"], [1]) if p.get("direction") == "reverse" else ref["y"]
    node = graph.node("op")
    table = graph.wide_values
    assert torch.equal(table.get(node.outputs[0]), ys) and torch.equal(y, ys.float())
    assert torch.equal(table.get(node.outputs[1]), ref["y"][:, -1]) and torch.equal(hn, ref["y"][:, -1].float())
    assert torch.equal(table.get(node.outputs[2]), ref["c"][:, -1]) and torch.equal(cn, ref["c"][:, -1].float())
    assert torch.equal(_placeholder(graph, "h_batch"), ref["y"].float())
    acts = p.get("activations", ["SIGMOID", "TANH", "TANH"])
    tables = [[torch.cat([ref["zi"], ref["zf"], ref["zo"]], 2), torch.cat([ref["i"], ref["f"], ref["o"]], 2)],
              [ref["zg"], ref["g"]], [ref["c"], ref["ac"]]]
    for a, c in ((0, 1), (0, 2), (1, 2)):
        if acts[a] == acts[c]:
            tables[a] = tables[c] = [torch.cat([tables[a][j], tables[c][j]], dim=-1) for j in range(2)]
    for k, name in enumerate(("f", "g", "h")):
        assert torch.equal(_placeholder(graph, f"{name}_lut_in"), tables[k][0].float()), name
        assert torch.equal(_placeholder(graph, f"{name}_lut_out"), tables[k][1].float()), name
    for t in range(case["steps"]):
        assert torch.equal(_placeholder(graph, f"c_state_{t}"), ref["c"][:, t].float())


def test_lstm_float_differentiable_path_gives_the_same_values() -> None:
    """A gradient-based method's forward (a differentiable input) takes the step as written, new tensors each: the
    same values as the buffered loop, and a gradient."""
    case = LSTM_CASES[2]
    graph, feeds, _, _ = _graph("BasicLSTM", case["batch"], case["steps"], case["isz"], case["cs"], case["params"],
                                seed=3)
    with torch.no_grad():
        buffered = [v.clone() for v in graph.forward(feeds)]
    x = feeds[0].clone().requires_grad_(True)
    with torch.enable_grad():
        got = graph.forward([x] + feeds[1:])
        got[0].sum().backward()
    assert all(torch.equal(a.detach(), b) for a, b in zip(got, buffered))
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


GRU_CASES = [
    dict(batch=1, steps=7, isz=12, cs=16, params={}),
    dict(batch=2, steps=5, isz=9, cs=13, params={"direction": "reverse", "threshold": 0.8}),
    dict(batch=1, steps=6, isz=5, cs=20, params={"version": "GRUV1"}),
    dict(batch=3, steps=4, isz=7, cs=11, params={"version": "GRUV1", "direction": "reverse",
                                                 "activations": ["TANH", "SIGMOID"]}),
]


@pytest.mark.parametrize("case", GRU_CASES)
def test_gru_float_loop_keeps_the_bits_of_the_step_as_written(case: Dict[str, Any]) -> None:
    graph, feeds, w, b = _graph("GRUv3", case["batch"], case["steps"], case["isz"], case["cs"], case["params"],
                                seed=case["cs"] + 1)
    y, hn = graph.forward(feeds, keep_tensors=True)
    p = case["params"]
    ref = gru_steps(feeds[0], feeds[1], w, b, p.get("activations", ["SIGMOID", "TANH"]),
                    p.get("direction") == "reverse", p.get("threshold"), p.get("version") == "GRUV1")
    ys = torch.flip(ref["y"], [1]) if p.get("direction") == "reverse" else ref["y"]
    assert torch.equal(y, ys) and torch.equal(hn, ref["y"][:, -1])
    assert torch.equal(_placeholder(graph, "state_batch"), ref["y"])
    for key, name in zip(("zrz", "rz", "pre", "n", "hn"), ("f_lut_in", "f_lut_out", "g_lut_in", "g_lut_out",
                                                           "hidden_gate_out")):
        assert torch.equal(_placeholder(graph, name), ref[key]), name


def test_reference_steps_match_torch_modules() -> None:
    """The references above are the cells torch.nn.LSTM and torch.nn.GRU compute (to float rounding)."""
    torch.manual_seed(0)
    m = torch.nn.LSTM(5, 6, batch_first=True)
    perm = [0, 2, 1, 3]  # torch's i, f, g, o blocks as i, g, f, o
    wi, wh = m.weight_ih_l0.detach(), m.weight_hh_l0.detach()
    bsum = (m.bias_ih_l0 + m.bias_hh_l0).detach()
    w = torch.cat([torch.cat([wi[k * 6:(k + 1) * 6], wh[k * 6:(k + 1) * 6]], 1) for k in perm], 0)
    b = torch.cat([bsum[k * 6:(k + 1) * 6] for k in perm])
    x, h0, c0 = torch.randn(2, 4, 5), torch.randn(2, 6), torch.randn(2, 6)
    ref, _ = m(x, (h0[None], c0[None]))
    got = lstm_steps(x, h0, c0, w, b, ["SIGMOID", "TANH", "TANH"], False, None, None, 0.0)["y"]
    np.testing.assert_allclose(got.numpy(), ref.detach().numpy(), atol=1e-6)
    g = torch.nn.GRU(5, 6, batch_first=True)
    wg = torch.cat([g.weight_ih_l0.detach(), g.weight_hh_l0.detach()], 1)
    bi, bh = g.bias_ih_l0.detach(), g.bias_hh_l0.detach()
    bv = torch.cat([bi[:12] + bh[:12], bi[12:], bh[12:]])
    ref_g, _ = g(x, h0[None])
    got_g = gru_steps(x, h0, wg, bv, ["SIGMOID", "TANH"], False, None, True)["y"]
    np.testing.assert_allclose(got_g.numpy(), ref_g.detach().numpy(), atol=1e-6)
