"""ONNX LSTM / GRU → the Parser's BasicLSTM / GRUv3 / GRUv1 layers (one direction per layer, batch-major sequences),
and clear refusals for the control-flow operators that remain after If folding (see control.py).

ONNX keeps W [dirs, G·H, I], R [dirs, G·H, H] and B [dirs, 2·G·H] with gate blocks i, o, f, c (LSTM) or z, r, h
(GRU); the IR layers take one matrix [G·H, I + H] over [x_t, h] with blocks i, g, f, o (BasicLSTM) or r, z,
candidate (GRUv3), and one bias vector (the ONNX input and recurrence biases added; GRU with linear_before_reset
keeps the recurrence bias of the candidate apart: the Parser's GRUv1 layer, a GRUv3 with version GRUV1).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from .context import Context, ConvertError
from .converters import converter
from .pattern import new_const
from .simplify import ONode

LSTM_ORDER = [0, 3, 2, 1]
"""ONNX LSTM blocks (i, o, f, c) taken in BasicLSTM order (i, g = c, f, o)."""
GRU_ORDER = [1, 0, 2]
"""ONNX GRU blocks (z, r, h) taken in GRUv3 order (r, z, candidate)."""
ACTIVATIONS = {"sigmoid": "SIGMOID", "tanh": "TANH"}


def _opt(node: ONode, pos: int) -> Optional[str]:
    return node.inputs[pos] if len(node.inputs) > pos and node.inputs[pos] else None


def _blocks(m: np.ndarray, order: List[int], size: int) -> np.ndarray:
    return np.concatenate([m[k * size:(k + 1) * size] for k in order], axis=0)


def _activations(node: ONode, defaults: List[str]) -> List[str]:
    names = node.attrs.get("activations")
    if names is None:
        return list(defaults)
    if len(names) != len(defaults):
        raise ConvertError(f"activations {names}: one direction takes {len(defaults)} functions")
    out = []
    for a in names:
        if str(a).lower() not in ACTIVATIONS:
            raise ConvertError(f"activation {a} is not supported (Sigmoid and Tanh are)")
        out.append(ACTIVATIONS[str(a).lower()])
    if node.attrs.get("activation_alpha") or node.attrs.get("activation_beta"):
        raise ConvertError("activation_alpha / activation_beta are not supported")
    return out


def _common(ctx: Context, node: ONode, gates: int) -> Dict[str, Any]:
    """Checks shared by LSTM and GRU; returns the sizes, direction and layout."""
    direction = str(node.attrs.get("direction", "forward")).lower()
    if direction not in ("forward", "reverse"):
        raise ConvertError(f"direction={direction} is not supported (forward and reverse are; export each "
                           "direction as its own layer)")
    w = ctx.const(node.inputs[1]).astype(np.float64)
    r = ctx.const(node.inputs[2]).astype(np.float64)
    if w.ndim != 3 or w.shape[0] != 1 or r.ndim != 3:
        raise ConvertError(f"W of shape {list(w.shape)}: one direction is supported")
    hidden = int(node.attrs.get("hidden_size", w.shape[1] // gates))
    layout = int(node.attrs.get("layout", 0))
    shape = ctx.shape(node.inputs[0])
    steps, batch = (shape[0], shape[1]) if layout == 0 else (shape[1], shape[0])
    seq_lens = _opt(node, 4)
    if seq_lens is not None:
        if not ctx.is_const(seq_lens):
            raise ConvertError("sequence_lens computed at run time is not supported")
        if np.any(ctx.const(seq_lens).astype(np.int64) != steps):
            raise ConvertError("sequence_lens shorter than the sequence are not supported")
    clip = node.attrs.get("clip")
    return {"w": w[0], "r": r[0], "hidden": hidden, "layout": layout, "steps": int(steps), "batch": int(batch),
            "input_size": int(shape[2]), "direction": direction, "clip": None if clip is None else float(clip)}


def _state(ctx: Context, node: ONode, pos: int, info: Dict[str, Any], what: str) -> str:
    """Initial state [1, B, H] (layout 0) or [B, 1, H] (layout 1) as an IR tensor [B, H]; zeros when absent."""
    name = _opt(node, pos)
    hidden, batch = info["hidden"], info["batch"]
    if name is None:
        return ctx.add("Constant", [], [(1, hidden)], f"{node.name}_{what}", {},
                       {"weights": np.zeros((1, hidden), np.float32)})[0]
    if ctx.is_const(name):  # one Constant per distinct value, named after what made it (as the Parser shares them)
        state = new_const(ctx.g, f"{name}_state", ctx.const(name).astype(np.float32).reshape(-1, hidden))
        ctx.g.const_sources[state] = ctx.g.const_sources.get(name, name)
        return ctx.constant_layer(state)
    src = ctx.source_for_reshape(name)
    return ctx.add("Reshape", [src], [(batch, hidden)], f"{node.name}_{what}", {"shape": [batch, hidden]})[0]


def _emit(ctx: Context, node: ONode, optype: str, info: Dict[str, Any], names: List[str], params: Dict[str, Any],
          weights: np.ndarray, biases: np.ndarray, states: List[str]) -> None:
    """The layer, then each used ONNX output bound to it: Y [T, 1, B, H] held as [B, T, 1, H] (layout 0), the
    final states [1, B, H] as Reshapes of the [B, H] layer outputs."""
    x = node.inputs[0]
    seq = ctx.value(x, (1, 0, 2)) if info["layout"] == 0 else ctx.value(x)
    used = [(k, o) for k, o in enumerate(node.outputs[:len(names)]) if o]
    if not used:
        raise ConvertError("none of the outputs is used")
    b, t, h = info["batch"], info["steps"], info["hidden"]
    shapes = [(b, t, h) if k == 0 else (b, h) for k, _ in used]
    params = dict(params, out_sequence=[names[k] for k, _ in used])
    irs = ctx.add(optype, [seq] + states, shapes, node.name, params,
                  {"weights": weights.astype(np.float32), "biases": biases.astype(np.float32)})
    for (k, onnx_out), ir in zip(used, irs):
        if k == 0:
            # views (ctx.reshape), so that the Squeeze / Transpose / Reshape chain after the layer collapses
            held = ctx.reshape(ir, (b, t, 1, h), f"{node.name}_Y")
            ctx.bind(onnx_out, held, (2, 0, 1, 3) if info["layout"] == 0 else None)
        else:
            ctx.bind(onnx_out, ctx.reshape(ir, ctx.shape(onnx_out), f"{node.name}_{names[k]}"), None)


def _base_params(info: Dict[str, Any], acts: List[str]) -> Dict[str, Any]:
    p: Dict[str, Any] = {"time_steps": info["steps"], "input_size": info["input_size"], "cell_size": info["hidden"],
                         "direction": info["direction"], "activations": acts}
    if info["clip"] is not None:
        p["threshold"] = info["clip"]
    return p


@converter("LSTM")
def lstm(ctx: Context, node: ONode) -> None:
    info = _common(ctx, node, 4)
    if int(node.attrs.get("input_forget", 0)):
        raise ConvertError("input_forget=1 is not supported")
    peep = _opt(node, 7)
    if peep is not None and (not ctx.is_const(peep) or np.any(ctx.const(peep) != 0)):
        raise ConvertError("peephole weights (input P) are not supported")
    h = info["hidden"]
    bias = ctx.const(_opt(node, 3)).astype(np.float64)[0] if _opt(node, 3) else np.zeros(8 * h)
    weights = _blocks(np.concatenate([info["w"], info["r"]], axis=1), LSTM_ORDER, h)
    biases = _blocks(bias[:4 * h] + bias[4 * h:], LSTM_ORDER, h)
    states = [_state(ctx, node, 5, info, "h0"), _state(ctx, node, 6, info, "c0")]
    _emit(ctx, node, "BasicLSTM", info, ["Y", "H", "C"], _base_params(info, _activations(node, ["SIGMOID", "TANH",
                                                                                               "TANH"])),
          weights, biases, states)


@converter("GRU")
def gru(ctx: Context, node: ONode) -> None:
    info = _common(ctx, node, 3)
    h = info["hidden"]
    bias = ctx.const(_opt(node, 3)).astype(np.float64)[0] if _opt(node, 3) else np.zeros(6 * h)
    wb, rb = bias[:3 * h], bias[3 * h:]
    weights = _blocks(np.concatenate([info["w"], info["r"]], axis=1), GRU_ORDER, h)
    lbr = bool(int(node.attrs.get("linear_before_reset", 0)))
    gates = _blocks(wb[:2 * h] + rb[:2 * h], GRU_ORDER[:2], h)
    if lbr:
        biases = np.concatenate([gates, wb[2 * h:], rb[2 * h:]])
    else:
        biases = np.concatenate([gates, wb[2 * h:] + rb[2 * h:]])
    params = _base_params(info, _activations(node, ["SIGMOID", "TANH"]))
    if not lbr:
        params["version"] = "GRUV3"
    _emit(ctx, node, "GRUv1" if lbr else "GRUv3", info, ["H", "Hn"], params, weights, biases,
          [_state(ctx, node, 5, info, "h0")])


@converter("If")
def if_node(ctx: Context, node: ONode) -> None:
    raise ConvertError(f"the condition '{node.inputs[0]}' is computed at run time; only an If whose condition "
                       "folds to a constant (from constants, fixed input shapes, or inputs given a value by an "
                       "initializer) is supported")


@converter("Loop", "Scan")
def loop_node(ctx: Context, node: ONode) -> None:
    raise ConvertError("loops are not supported (export the model with the loop unrolled)")
