"""ONNX LSTM / GRU → the Parser's BasicLSTM / GRUv3 / GRUv1 layers (one direction per layer, batch-major sequences),
and clear refusals for the control-flow operators that remain after If folding (see control.py).

A bidirectional node becomes two layers, a forward and a reverse one over the same input, each with its
direction's weights, biases and initial states (a Split of a computed state), their outputs joined by Concat
layers along the ONNX outputs' direction axis.

ONNX keeps W [dirs, G·H, I], R [dirs, G·H, H] and B [dirs, 2·G·H] with gate blocks i, o, f, c (LSTM) or z, r, h
(GRU); the IR layers take one matrix [G·H, I + H] over [x_t, h] with blocks i, g, f, o (BasicLSTM) or r, z,
candidate (GRUv3), and one bias vector (the ONNX input and recurrence biases added; GRU with linear_before_reset
keeps the recurrence bias of the candidate apart: the Parser's GRUv1 layer, a GRUv3 with version GRUV1).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

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
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ConvertError(f"direction={direction} is not supported (forward, reverse and bidirectional are)")
    directions = ["forward", "reverse"] if direction == "bidirectional" else [direction]
    w = ctx.const(node.inputs[1]).astype(np.float64)
    r = ctx.const(node.inputs[2]).astype(np.float64)
    if w.ndim != 3 or w.shape[0] != len(directions) or r.ndim != 3 or r.shape[0] != len(directions):
        raise ConvertError(f"W of shape {list(w.shape)} and R of shape {list(r.shape)}: direction={direction} "
                           f"needs {len(directions)} along the first axis")
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
    return {"w": w, "r": r, "hidden": hidden, "layout": layout, "steps": int(steps), "batch": int(batch),
            "input_size": int(shape[2]), "directions": directions, "clip": None if clip is None else float(clip)}


def _states(ctx: Context, node: ONode, pos: int, info: Dict[str, Any], what: str) -> List[str]:
    """Initial state [D, B, H] (layout 0) or [B, D, H] (layout 1) as one IR tensor [B, H] per direction; zeros
    when absent."""
    name = _opt(node, pos)
    hidden, batch, dirs = info["hidden"], info["batch"], len(info["directions"])
    suffixes = [""] if dirs == 1 else ["", "_reverse"]
    if name is None:
        return [ctx.add("Constant", [], [(1, hidden)], f"{node.name}_{what}{suffix}", {},
                        {"weights": np.zeros((1, hidden), np.float32)})[0] for suffix in suffixes]
    if ctx.is_const(name):  # one Constant per distinct value, named after what made it (as the Parser shares them)
        value = ctx.const(name).astype(np.float32)
        value = value if info["layout"] == 0 else value.transpose(1, 0, 2)
        out = []
        for k, suffix in enumerate(suffixes):
            state = new_const(ctx.g, f"{name}_state{suffix}", value[k].reshape(-1, hidden))
            ctx.g.const_sources[state] = ctx.g.const_sources.get(name, name)
            out.append(ctx.constant_layer(state))
        return out
    src = ctx.source_for_reshape(name)
    if dirs == 1:
        return [ctx.add("Reshape", [src], [(batch, hidden)], f"{node.name}_{what}", {"shape": [batch, hidden]})[0]]
    axis = 0 if info["layout"] == 0 else 1
    part = (1, batch, hidden) if axis == 0 else (batch, 1, hidden)
    held = ctx.value(name)
    parts = ctx.add("Split", [held], [part, part], f"{node.name}_{what}_split", {"axis": axis, "splits": [1, 1]})
    return [ctx.add("Reshape", [p], [(batch, hidden)], f"{node.name}_{what}{suffix}", {"shape": [batch, hidden]})[0]
            for p, suffix in zip(parts, suffixes)]


def _emit(ctx: Context, node: ONode, optype: str, info: Dict[str, Any], names: List[str], params: Dict[str, Any],
          layers: List[Tuple[np.ndarray, np.ndarray, List[str]]]) -> None:
    """One layer per direction (its weights, biases and initial states in `layers`), then each used ONNX output
    bound to them: Y [T, D, B, H] held as [B, T, D, H] (layout 0), the final states [D, B, H] from the [B, H] layer
    outputs; two directions joined by a Concat along the direction axis."""
    x = node.inputs[0]
    seq = ctx.value(x, (1, 0, 2)) if info["layout"] == 0 else ctx.value(x)
    used = [(k, o) for k, o in enumerate(node.outputs[:len(names)]) if o]
    if not used:
        raise ConvertError("none of the outputs is used")
    b, t, h = info["batch"], info["steps"], info["hidden"]
    shapes = [(b, t, h) if k == 0 else (b, h) for k, _ in used]
    dirs = info["directions"]
    outputs = []
    for direction, (weights, biases, states) in zip(dirs, layers):
        name = node.name if direction == dirs[0] else f"{node.name}_reverse"
        layer_params = dict(params, direction=direction, out_sequence=[names[k] for k, _ in used])
        outputs.append(ctx.add(optype, [seq] + states, shapes, name, layer_params,
                               {"weights": weights.astype(np.float32), "biases": biases.astype(np.float32)}))
    state_axis = 0 if info["layout"] == 0 else 1
    for i, (k, onnx_out) in enumerate(used):
        if len(outputs) > 1 and not ctx.g.consumers(onnx_out) and onnx_out not in ctx.g.outputs:
            continue  # a named output nothing reads: no Concat for it (single Reshape views are pruned anyway)
        if k == 0:
            # views (ctx.reshape), so that the Squeeze / Transpose / Reshape chain after the layer collapses
            held = [ctx.reshape(irs[i], (b, t, 1, h), f"{node.name}_Y{'' if d == 0 else '_reverse'}")
                    for d, irs in enumerate(outputs)]
            joined = held[0] if len(held) == 1 else \
                ctx.add("Concat", held, [(b, t, 2, h)], f"{node.name}_Y_concat", {"axis": 2})[0]
            ctx.bind(onnx_out, joined, (2, 0, 1, 3) if info["layout"] == 0 else None)
        elif len(outputs) == 1:
            ctx.bind(onnx_out, ctx.reshape(outputs[0][i], ctx.shape(onnx_out), f"{node.name}_{names[k]}"), None)
        else:
            part = (1, b, h) if state_axis == 0 else (b, 1, h)
            held = [ctx.reshape(irs[i], part, f"{node.name}_{names[k]}{'' if d == 0 else '_reverse'}")
                    for d, irs in enumerate(outputs)]
            ctx.bind(onnx_out, ctx.add("Concat", held, [ctx.shape(onnx_out)], f"{node.name}_{names[k]}_concat",
                                       {"axis": state_axis})[0], None)


def _base_params(info: Dict[str, Any], acts: List[str]) -> Dict[str, Any]:
    p: Dict[str, Any] = {"time_steps": info["steps"], "input_size": info["input_size"], "cell_size": info["hidden"],
                         "direction": info["directions"][0], "activations": acts}
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
    h, dirs = info["hidden"], len(info["directions"])
    bias = ctx.const(_opt(node, 3)).astype(np.float64) if _opt(node, 3) else np.zeros((dirs, 8 * h))
    h0, c0 = _states(ctx, node, 5, info, "h0"), _states(ctx, node, 6, info, "c0")
    layers = [(_blocks(np.concatenate([info["w"][d], info["r"][d]], axis=1), LSTM_ORDER, h),
               _blocks(bias[d][:4 * h] + bias[d][4 * h:], LSTM_ORDER, h), [h0[d], c0[d]]) for d in range(dirs)]
    _emit(ctx, node, "BasicLSTM", info, ["Y", "H", "C"], _base_params(info, _activations(node, ["SIGMOID", "TANH",
                                                                                               "TANH"])), layers)


@converter("GRU")
def gru(ctx: Context, node: ONode) -> None:
    info = _common(ctx, node, 3)
    h, dirs = info["hidden"], len(info["directions"])
    bias = ctx.const(_opt(node, 3)).astype(np.float64) if _opt(node, 3) else np.zeros((dirs, 6 * h))
    lbr = bool(int(node.attrs.get("linear_before_reset", 0)))
    h0 = _states(ctx, node, 5, info, "h0")
    layers = []
    for d in range(dirs):
        wb, rb = bias[d][:3 * h], bias[d][3 * h:]
        gates = _blocks(wb[:2 * h] + rb[:2 * h], GRU_ORDER[:2], h)
        biases = np.concatenate([gates, wb[2 * h:], rb[2 * h:]]) if lbr else \
            np.concatenate([gates, wb[2 * h:] + rb[2 * h:]])
        layers.append((_blocks(np.concatenate([info["w"][d], info["r"][d]], axis=1), GRU_ORDER, h), biases, [h0[d]]))
    params = _base_params(info, _activations(node, ["SIGMOID", "TANH"]))
    if not lbr:
        params["version"] = "GRUV3"
    _emit(ctx, node, "GRUv1" if lbr else "GRUv3", info, ["H", "Hn"], params, layers)


@converter("If")
def if_node(ctx: Context, node: ONode) -> None:
    raise ConvertError(f"the condition '{node.inputs[0]}' is computed at run time; only an If whose condition "
                       "folds to a constant (from constants, fixed input shapes, or inputs given a value by an "
                       "initializer) is supported")


@converter("Loop", "Scan")
def loop_node(ctx: Context, node: ONode) -> None:
    raise ConvertError("loops are not supported (export the model with the loop unrolled)")
