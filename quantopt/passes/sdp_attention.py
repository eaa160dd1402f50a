"""`enable_pass_scaled_dot_product_attention` (upstream's default, off): each attention chain
`MatMul(Q, K) → scale → [Add mask] → Softmax → MatMul(·, V)` becomes one SDPAttention layer before statistics
(docs/user-guide.md, "Graph passes"; the operator: docs/semantics/transformer.md#sdpattention).

Why: the logits and probabilities are then never quantized as tensors of their own; the layer requantizes Q·K to
12-bit logit codes and computes the softmax through its own exp table.

What qualifies, as upstream's pass finds it (a Softmax, then the MatMul above it that carries a folded constant
factor, every layer between them cut), restricted to the chains whose fused form computes the same function:
* a Softmax along its last axis whose output is read only by a MatMul `PV` as its first input, `PV` with
  `trans_a = false` and no fused activation (its second input is V);
* above the Softmax either the scale layer `S` directly, or an Add (or Eltwise ADD) without activation reading `S`
  as its FIRST input and the mask as its second, whose output has the logits' shape (upstream finds the mask only
  in that slot and leaves the other order alone);
* `S` a Mul (or Eltwise MUL) by a constant factor with one distinct value > 0 (the rule of
  passes/merge_matmul_mul.py) or a BatchNorm that only scales by one positive value, reading a MatMul `QK`
  directly (upstream also cuts shape-only layers between them; quantopt leaves such chains alone, since
  dropping a layer that moves values would change the result); a Div, or no scale at all, is not fused (upstream
  finds no folded factor then);
* `QK` without fused activation; every layer of the chain has its output read by the next one only (no graph
  output among them); the shapes of Q, K, V and the mask give the chain's own logits and output shapes.

The chain becomes the layer `PV` (its name and output) of type SDPAttention with inputs Q, K, V (and the mask):
`trans_q`/`trans_k` from `QK`'s `trans_a`/`trans_b`, `trans_v` from `PV`'s `trans_b`, `scale_factor` the factor
(float32 value), `with_mask`, and `enable_gqa` true (as upstream) when Q, K and V all have a head axis whose
counts it can repeat, else false (the operator needs one). Q's, K's and V's tensors are renamed `q_<name>`,
`k_<name>`, `v_<name>` as upstream does. The other layers and the factor's Constant layers go.

Settings, as upstream: the fused layer and the layers producing Q, K and V (each producer, and on through its
input's producer while the layer is shape-only) get symmetric activations with the restricted range ([-127, 127]
at 8 bits), and the fused layer 8-bit activations, whatever the cfg gives them. Upstream asks for per-channel
symmetric modes there, but its stage 1 then clears every activation's channel axis, so they quantize per tensor;
quantopt sets `per_tensor_symmetric_restricted_range` (`apply_sdpa_settings`, run once the settings are
assigned; a value set for such a layer in particular is replaced too, with a warning naming it). Upstream's
quantize of SDPAttention fails whenever `trans_q`, `trans_k` or `trans_v` is set ("Dimension out of range": its
merge sets `trans_k` for `MatMul(Q, K, trans_b = true)`); quantopt's operator handles them.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..log import OPT_DEBUG, OPT_INFO, OPT_WARN
from ..registry.optype import OpType
from .merge_matmul_mul import SHAPE_ONLY, _factor_subgraph, _is_mul, _scaling_batchnorm, only_reader, readers_by_tensor

FIELD = "enable_pass_scaled_dot_product_attention"
SETTINGS_KEY = "sdpa_settings"
"""attrs key of the layers whose settings `apply_sdpa_settings` changes: "fused" or "operand"."""
SDPA_ACTIVATION_MODE = "per_tensor_symmetric_restricted_range"


def _only_reader(node: PyNode, readers: Dict[int, List[PyNode]], io: Set[int]) -> Optional[PyNode]:
    """The one layer reading `node`'s single output (one slot, not a graph output), else None."""
    return only_reader(node, readers, io) if len(node.outputs) == 1 else None


def _activation(node: PyNode) -> str:
    return str(node.params.get("with_activation", "NONE")).upper()


def _flag(node: PyNode, key: str) -> bool:
    value = node.params.get(key, False)
    return value.strip().lower() == "true" if isinstance(value, str) else bool(value)


def _is_add(node: PyNode) -> bool:
    kind = str(node.type)
    if kind == "Eltwise":
        return str(node.params.get("method", "")).upper() == "ADD" and _activation(node) == "NONE"
    return kind == "Add" and _activation(node) == "NONE"


def _swap(shape: Sequence[int], flag: bool) -> List[int]:
    s = [int(d) for d in shape]
    if flag and len(s) >= 2:
        s[-1], s[-2] = s[-2], s[-1]
    return s


def _fused_shapes(q: Sequence[int], k: Sequence[int], v: Sequence[int], gqa: bool
                  ) -> Optional[Tuple[List[int], List[int]]]:
    """(logits shape, output shape) the fused layer computes from Q [.., M, D], K [.., D, N], V [.., N, Dv] (after
    the transposes), or None when they do not fit."""
    q, k, v = list(q), list(k), list(v)
    if min(len(q), len(k), len(v)) < 2 or q[-1] != k[-2] or k[-1] != v[-2]:
        return None
    if gqa:
        k[-3] = v[-3] = q[-3]
    try:
        logits = [int(d) for d in np.broadcast_shapes(tuple(q[:-2]), tuple(k[:-2]))] + [q[-2], k[-1]]
        out = [int(d) for d in np.broadcast_shapes(tuple(logits[:-2]), tuple(v[:-2]))] + [q[-2], v[-1]]
    except ValueError:
        return None
    return logits, out


def _gqa(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> bool:
    """Upstream sets enable_gqa; quantopt's operator repeats heads (axis -3) only when they divide Q's."""
    if min(len(q), len(k), len(v)) < 3:
        return False
    hq, hk, hv = int(q[-3]), int(k[-3]), int(v[-3])
    return hk > 0 and hv > 0 and hq % hk == 0 and hq % hv == 0 and hk in (1, hq) and hv in (1, hq)


class _Chain:
    """One qualifying chain (module doc)."""

    def __init__(self, qk: PyNode, scale: PyNode, add: Optional[PyNode], softmax: PyNode, pv: PyNode,
                 factor: float, factor_layers: List[PyNode]) -> None:
        self.qk, self.scale, self.add, self.softmax, self.pv = qk, scale, add, softmax, pv
        self.factor, self.factor_layers = factor, factor_layers

    @property
    def cut(self) -> List[PyNode]:
        return [n for n in (self.qk, self.scale, self.add, self.softmax) if n is not None] + self.factor_layers


def _match(graph: PyGraph, sm: PyNode, readers: Dict[int, List[PyNode]], io: Set[int]) -> Optional[_Chain]:
    if str(sm.type) != "Softmax" or len(sm.inputs) != 1 or len(sm.outputs) != 1:
        return None
    rank = len(sm.inputs[0].ir_shape)
    if rank == 0 or int(sm.params.get("axis", -1)) not in (-1, rank - 1):
        return None
    pv = _only_reader(sm, readers, io)
    if pv is None or str(pv.type) != "MatMul" or len(pv.inputs) != 2 or len(pv.outputs) != 1:
        return None
    if pv.inputs[0] is not sm.outputs[0] or pv.inputs[1] is sm.outputs[0] or _flag(pv, "trans_a"):
        return None
    if _activation(pv) != "NONE":
        return None
    above = sm.inputs[0].pnode
    add: Optional[PyNode] = None
    if above is not None and _is_add(above) and len(above.inputs) == 2:
        if _only_reader(above, readers, io) is not sm or above.inputs[0].pnode is None:
            return None
        add, above = above, above.inputs[0].pnode
    if above is None or _only_reader(above, readers, io) is not (add or sm) or not above.inputs:
        return None
    qk_out = next((t for t in above.inputs if t.pnode is not None and str(t.pnode.type) == "MatMul"), None)
    if qk_out is None:
        return None
    qk = qk_out.pnode
    if len(qk.inputs) != 2 or _activation(qk) != "NONE" or _only_reader(qk, readers, io) is not above:
        return None
    if add is not None and add.inputs[1] is qk_out:
        return None
    factor_layers: List[PyNode] = []
    if _is_mul(above):
        found = _factor_subgraph(graph, above, qk_out, readers, io)
        if found is None:
            return None
        factor_layers, factor = found
    else:
        if len(above.inputs) != 1:
            return None
        bn = _scaling_batchnorm(above)
        if bn is None:
            return None
        factor = bn
    if list(above.outputs[0].ir_shape) != list(qk_out.ir_shape):
        return None
    q, k, v = qk.inputs[0], qk.inputs[1], pv.inputs[1]
    qs, ks = _swap(q.ir_shape, _flag(qk, "trans_a")), _swap(k.ir_shape, _flag(qk, "trans_b"))
    vs = _swap(v.ir_shape, _flag(pv, "trans_b"))
    shapes = _fused_shapes(qs, ks, vs, _gqa(qs, ks, vs))
    if shapes is None or shapes[0] != list(qk_out.ir_shape) or shapes[1] != list(pv.outputs[0].ir_shape):
        return None
    if add is not None:
        mask = add.inputs[1]
        if mask is add.inputs[0] or list(add.outputs[0].ir_shape) != shapes[0]:
            return None
        try:
            if [int(d) for d in np.broadcast_shapes(tuple(shapes[0]), tuple(mask.ir_shape))] != shapes[0]:
                return None
        except ValueError:
            return None
    return _Chain(qk, above, add, sm, pv, float(factor), factor_layers)


def _rename(t: PyTensor, prefix: str, taken: Set[str]) -> None:
    name, i = prefix + t.name, 1
    while name in taken:
        name, i = f"{prefix}{t.name}_{i}", i + 1
    taken.add(name)
    t.name = name


def _fuse(chain: _Chain, taken: Set[str]) -> None:
    qk, pv = chain.qk, chain.pv
    q, k, v = qk.inputs[0], qk.inputs[1], pv.inputs[1]
    qs, ks = _swap(q.ir_shape, _flag(qk, "trans_a")), _swap(k.ir_shape, _flag(qk, "trans_b"))
    vs = _swap(v.ir_shape, _flag(pv, "trans_b"))
    trans_v = _flag(pv, "trans_b")
    pv.type = OpType.SDPAttention
    pv.params.clear()
    pv.params["trans_v"] = trans_v
    pv.params["trans_k"] = _flag(qk, "trans_b")
    pv.params["trans_q"] = _flag(qk, "trans_a")
    pv.params["enable_gqa"] = _gqa(qs, ks, vs)
    pv.params["scale_factor"] = chain.factor
    pv.params["with_mask"] = chain.add is not None
    pv.inputs = [q, k, v] + ([chain.add.inputs[1]] if chain.add is not None else [])
    pv.constants.clear()
    pv.placeholders = []
    pv.attrs[SETTINGS_KEY] = "fused"
    for t, prefix in ((q, "q_"), (k, "k_"), (v, "v_")):
        _rename(t, prefix, taken)
        node = t.pnode
        while node is not None:
            node.attrs.setdefault(SETTINGS_KEY, "operand")
            if str(node.type) not in SHAPE_ONLY or not node.inputs:
                break
            node = node.inputs[0].pnode


def apply_sdpa_settings(graph: PyGraph) -> List[str]:
    """After the layers' settings are assigned: the fused layers and their operands' producers get upstream's
    modes (module doc). Returns the layers changed."""
    changed, overridden = [], []
    for n in graph.nodes:
        role = n.attrs.get(SETTINGS_KEY)
        if role is None or n.settings is None:
            continue
        new = {"q_mode_activation": SDPA_ACTIVATION_MODE}
        if role == "fused":
            new["q_bits_activation"] = 8
        # a value set for this layer in particular (opt_config, a per-layer cfg rule) is not replaced silently
        overridden += [f"'{n.name}' {key} {getattr(n.settings, key)!r} -> {value!r}" for key, value in new.items()
                       if key in n.settings.explicit and getattr(n.settings, key) != value]
        n.settings = dataclasses.replace(n.settings, **new, explicit=n.settings.explicit | frozenset(new))
        changed.append(n.name)
    if changed:
        OPT_DEBUG(f"{FIELD}: {SDPA_ACTIVATION_MODE} activations for {changed}")
    if overridden:
        OPT_WARN(f"{FIELD}: the fused attention's layers take upstream's modes, replacing values set for them: "
                 + "; ".join(overridden))
    return changed


def scaled_dot_product_attention(graph: PyGraph) -> List[Tuple[str, List[str]]]:
    """Fuse every qualifying attention chain (module doc); returns (fused layer, cut layers) per chain."""
    done: List[Tuple[str, List[str]]] = []
    taken = set(graph.tensors())
    for sm in list(graph.nodes):
        readers = readers_by_tensor(graph)
        io = {id(t) for t in graph.input_tensors + graph.output_tensors}
        if str(sm.type) != "Softmax" or not any(n is sm for n in graph.nodes):
            continue
        chain = _match(graph, sm, readers, io)
        if chain is None:
            continue
        cut = {id(n) for n in chain.cut}
        names = [n.name for n in chain.cut]
        OPT_DEBUG(f"{FIELD}: '{chain.pv.name}' becomes SDPAttention; cut {names}")
        _fuse(chain, taken)
        graph.nodes = [n for n in graph.nodes if id(n) not in cut]
        graph.finalize(graph.source_file)
        graph.set_io([t.name for t in graph.input_tensors], [t.name for t in graph.output_tensors])
        done.append((chain.pv.name, names))
    if done:
        OPT_INFO(f"{FIELD}: fused {len(done)} attention chain(s) into SDPAttention layers: "
                 + ", ".join(name for name, _ in done))
    else:
        OPT_INFO(f"{FIELD}: no attention chain to fuse")
    return done
