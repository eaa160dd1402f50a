"""Control flow: Switch, If and Loop.

Switch passes on the first of its inputs that holds data (a TensorFlow-style merge of the branches of a cond: the
branch not taken hands over an empty tensor). Quantized, output i carries input i's params as upstream; the
selected input's integers are re-expressed exactly in output 0's quantization when they come from another input
quantized differently. If runs one of two subgraphs (then_branch/else_branch) chosen by a condition; Loop runs its
body subgraph up to M times with loop-carried values and stacked scan outputs. As upstream, If and Loop and their
subgraphs run in float in a quantized model (passes/control_op_preprocess.py). The semantics are in
docs/semantics/control-flow.md.
"""
from __future__ import annotations

import math
from typing import List

import torch

from ..errors import UnsupportedError
from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.subgraphs import node_subgraphs
from ..graph.tensor import PyTensor
from ..quant.rounding import div_round_half_even
from ..registry import PASSTHROUGH_DTYPES, declare_op
from ..registry.schema import Int, Param, Text
from ._quant import (
    copy_params,
    int_value,
    layer_settings,
    out_range,
    params,
    quantize_activation,
    set_qinvariant,
    tensor_scale,
    tensor_zp,
)

SEMANTICS = "docs/semantics/control-flow.md"

INT64_BOUND = 1 << 62

SWITCH = declare_op(
    "Switch", params={}, dtypes=PASSTHROUGH_DTYPES,
    integer="passthrough of the first non-empty input (re-expressed exactly in output 0's scale when it differs)",
    semantics=f"{SEMANTICS}#switch",
    summary="Output 0 is the first input with at least one element (input 0 when all are empty).")


def _selected(node: PyNode) -> int:
    if not node.inputs:
        raise node._error("needs at least one input")
    for i, t in enumerate(node.inputs):
        if t.betensor.numel() > 0:
            return i
    return 0


def _rescale(node: PyNode, src: PyTensor, dst: PyTensor) -> torch.Tensor:
    """round_half_even((q + zp_src) · s_dst / s_src) - zp_dst clamped to dst's range, the float32 scales taken as
    exact rationals (the identity for equal params)."""
    q = int_value(src)
    qmin, qmax = out_range(node, dst)
    s_src = float(torch.tensor(tensor_scale(node, src), dtype=torch.float32))
    s_dst = float(torch.tensor(tensor_scale(node, dst), dtype=torch.float32))
    zp_src, zp_dst = tensor_zp(node, src), tensor_zp(node, dst)
    if s_src == s_dst:
        return torch.clamp(q + zp_src - zp_dst, qmin, qmax)
    (n_dst, d_dst), (n_src, d_src) = s_dst.as_integer_ratio(), s_src.as_integer_ratio()
    num, den = n_dst * d_src, n_src * d_dst
    g = math.gcd(num, den)
    num, den = num // g, den // g
    lo, hi = out_range(node, src)
    if max(abs(lo + zp_src), abs(hi + zp_src)) * num >= INT64_BOUND or 2 * den >= INT64_BOUND:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the scales of '{src.name}' ({s_src}) and "
                               f"'{dst.name}' ({s_dst}) are too far apart to re-express the integers exactly")
    return torch.clamp(div_round_half_even((q + zp_src) * num, den) - zp_dst, qmin, qmax)


@SWITCH.forward
def switch_forward(self: PyNode) -> None:
    """Output 0 = the first non-empty input; quantized, in output 0's quantization."""
    if len(self.outputs) != 1:
        raise self._error(f"has {len(self.outputs)} outputs; Switch has one")
    k = _selected(self)
    src = self.inputs[k]
    if self.quantized and src.betensor.numel() > 0:
        self.outputs[0].betensor = _rescale(self, src, self.outputs[0])
    else:
        self.outputs[0].betensor = src.betensor


@SWITCH.quantize
def switch_quantize(self: PyNode) -> None:
    """Output i carries input i's params (upstream); an input without params gives, as upstream, a float one its
    calibrated range (signed, the layer's activation bits and mode), an integer one scale 1 with its own dtype."""
    if len(self.outputs) != 1:
        raise self._error(f"has {len(self.outputs)} outputs; Switch has one")
    inp, out = self.inputs[0], self.outputs[0]
    if params(self, inp).qmin is not None:
        copy_params(self, out, inp)
    elif inp.ir_dtype.is_float:
        quantize_activation(self, out, True, int(layer_settings(self).q_bits_activation))
    else:
        set_qinvariant(self, out, inp.ir_dtype.bits, inp.ir_dtype.is_signed)


# ------------------------------------------------------------------------------------------------ If / Loop
IF = declare_op(
    "If", params={
        "then_branch": Param(Text(), "name of the subgraph run when the condition is true", required=True),
        "else_branch": Param(Text(), "name of the subgraph run when the condition is false", required=True),
        "then_branch_inputs_num": Param(Int(lo=0), "inputs 1..n feed then_branch", required=True),
        "else_branch_inputs_num": Param(Int(lo=0), "the inputs after those feed else_branch", required=True)},
    dtypes=PASSTHROUGH_DTYPES, integer="runs in float (float16 by default) with its subgraphs, as upstream",
    semantics=f"{SEMANTICS}#if-and-loop",
    summary="Runs then_branch on inputs 1..n when the one-element input 0 is non-zero, else else_branch on the "
            "remaining inputs; the outputs are the branch's outputs.")

LOOP = declare_op(
    "Loop", params={
        "body": Param(Text(), "name of the subgraph run at each iteration", required=True),
        "dependency_inputs_num": Param(Int(lo=0), "number of loop-carried values N", required=True),
        "scan_outputs_num": Param(Int(lo=0), "number of scan outputs K", required=True),
        "loop_default_count": Param(Int(lo=0), "the Parser's trip count for the IR shape of the scan outputs "
                                               "when M is not a constant (not used by the forward)")},
    dtypes=PASSTHROUGH_DTYPES, integer="runs in float (float16 by default) with its body, as upstream",
    semantics=f"{SEMANTICS}#if-and-loop",
    summary="Runs body while i < M (input 0) and the condition (input 1, then the body's output 0) is non-zero: "
            "outputs the N loop-carried values and the K scan outputs stacked over the iterations.")


def _subgraph(node: PyNode, key: str) -> PyGraph:
    sub = node_subgraphs(node).get(key)
    if sub is None:
        raise node._error(f"has no subgraph '{key}' attached (parameter {key}={node.params.get(key)}; an IR without "
                          f"its subgraph sections, or a graph built without set_subgraphs?)")
    return sub


def _scalar(node: PyNode, t: PyTensor, what: str) -> torch.Tensor:
    v = t.betensor
    if v.numel() != 1:
        raise node._error(f"{what} '{t.name}' must hold one value, got shape {list(v.shape)}")
    return v


def _run(node: PyNode, sub: PyGraph, feeds: List[torch.Tensor]) -> List[torch.Tensor]:
    if len(feeds) != len(sub.input_tensors):
        raise node._error(f"subgraph '{sub.name}' has {len(sub.input_tensors)} input(s) but is fed {len(feeds)}")
    if feeds and sub.device != feeds[0].device:  # the subgraph's constants follow the model (PyGraph.to)
        sub.to(feeds[0].device)
    return [o.clone() for o in sub.forward([f.clone() for f in feeds])]


@IF.forward
def if_forward(self: PyNode) -> None:
    """The chosen branch's outputs (upstream: `if cond` on the one-element condition)."""
    n_then = int(self.get_param("then_branch_inputs_num"))
    n_else = int(self.get_param("else_branch_inputs_num"))
    if len(self.inputs) != 1 + n_then + n_else:
        raise self._error(f"has {len(self.inputs)} inputs; the condition, then_branch_inputs_num={n_then} and "
                          f"else_branch_inputs_num={n_else} make {1 + n_then + n_else}")
    cond = _scalar(self, self.inputs[0], "the condition")
    take_then = bool(cond.reshape(-1)[0] != 0)
    sub = _subgraph(self, "then_branch" if take_then else "else_branch")
    feeds = self.inputs[1:1 + n_then] if take_then else self.inputs[1 + n_then:]
    outs = _run(self, sub, [t.betensor for t in feeds])
    if len(outs) != len(self.outputs):
        raise self._error(f"has {len(self.outputs)} outputs but subgraph '{sub.name}' has {len(outs)}")
    for t, v in zip(self.outputs, outs):
        t.betensor = v


@LOOP.forward
def loop_forward(self: PyNode) -> None:
    """Upstream's loop: feeds (i, cond, carried..., other inputs...) to the body while i < M and cond; the body's
    output 0 is the next condition, outputs 1..N the next carried values, the K after them are stacked
    (`torch.vstack`, a scalar taken as one element) into the scan outputs."""
    n = int(self.get_param("dependency_inputs_num"))
    k = int(self.get_param("scan_outputs_num"))
    if len(self.inputs) < 2 + n:
        raise self._error(f"has {len(self.inputs)} inputs; M, the condition and dependency_inputs_num={n} "
                          f"loop-carried values need {2 + n}")
    if len(self.outputs) != n + k:
        raise self._error(f"has {len(self.outputs)} outputs; dependency_inputs_num={n} and scan_outputs_num={k} "
                          f"make {n + k}")
    body = _subgraph(self, "body")
    if len(body.output_tensors) != 1 + n + k:
        raise self._error(f"body '{body.name}' has {len(body.output_tensors)} outputs; the condition, {n} "
                          f"carried value(s) and {k} scan output(s) make {1 + n + k}")
    trip = _scalar(self, self.inputs[0], "the trip count M")
    cond = _scalar(self, self.inputs[1], "the condition")
    feeds = [t.betensor for t in self.inputs]
    carried = feeds[2:2 + n]
    scans: List[List[torch.Tensor]] = [[] for _ in range(k)]
    i = 0
    while bool(i < trip.reshape(-1)[0]) and bool(cond.reshape(-1)[0] != 0):
        feeds[0] = torch.zeros_like(trip) + i
        feeds[1] = cond
        feeds[2:2 + n] = carried
        outs = _run(self, body, feeds)
        cond = _scalar(self, body.output_tensors[0], "the body's condition output")
        carried = outs[1:1 + n]
        for j in range(k):
            v = outs[1 + n + j]
            scans[j].append(v.unsqueeze(0) if v.dim() < 1 else v)
        i += 1
    for t, v in zip(self.outputs[:n], carried):
        t.betensor = v.clone()
    for t, rows in zip(self.outputs[n:], scans):
        # no iteration (upstream fails here): an empty scan output with the IR shape's trailing dimensions
        t.betensor = torch.vstack(rows) if rows else torch.zeros([0] + list(t.ir_shape)[1:],
                                                                 device=self.inputs[0].betensor.device)


def _refuse_integer(self: PyNode) -> None:
    raise self._error("an If/Loop layer runs in float in a quantized model, with its subgraphs (as upstream): the "
                      "stage-1 pass control_op_preprocess sets its trigger_float_op; an integer If/Loop is not "
                      "supported")


IF.quantize(_refuse_integer)
LOOP.quantize(_refuse_integer)
