"""`enable_pass_merge_matmul_mul` (on by default, as upstream), first step: a Mul by a scalar Constant that is not an
integer becomes a BatchNorm over the last axis (docs/user-guide.md, "Graph passes").

Why: upstream's field rewrites these Muls so, before its MatMul folding; quantized, a scalar factor is then a
per-channel multiply-accumulate (weights at the layer's `weight_bits`, a multiplier/shift pair) instead of an
Eltwise multiply by a quantized Constant, and quantopt's IR has the layers and scales upstream's has
(docs/golden-differences.md). A BatchNorm with one positive weight and zero biases right after a MatMul is then
folded into the MatMul by passes/merge_matmul_mul.py, as the Mul was before.

What qualifies: a `Mul` layer (not Eltwise MUL) with two inputs, one of them the output of a Constant layer that
has no other reader and is no graph output, holding one finite value that is not an integer, while the Mul's output
has the other input's shape (no broadcast to more elements, so the float values stay the same). The Mul keeps its
name, settings and `with_activation`; it reads only the other input, gets `axis` = last, `epsilon` = 0, the weights
`[C]` (C = the last dimension) all equal to the value and zero biases; the Constant is removed. The BatchNorm keeps
the weight bits a Mul would have had (`with_operator_defaults` reads `MUL_AS_BATCHNORM`), as upstream's does.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import torch

from ..config.layer_settings import MUL_AS_BATCHNORM
from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..log import OPT_DEBUG, OPT_INFO
from ..quant.dtype import Dtype
from ..registry.optype import OpType
from .merge_matmul_mul import readers_by_tensor


def _scalar_factor(const: PyNode) -> Optional[float]:
    """The one value of a Constant layer when it is finite and not an integer (as a float32 value), else None."""
    w = const.constants.get("weights")
    if w is None or not w.betensor.is_floating_point() or w.betensor.numel() != 1:
        return None
    value = w.betensor.detach().reshape(-1)[0].to(torch.float32)
    if not bool(torch.isfinite(value)) or float(value) == float(torch.round(value)):
        return None
    return float(value)


def _candidate(node: PyNode, readers: Dict[int, List[PyNode]],
               io: Set[int]) -> Optional[Tuple[PyNode, PyTensor, float]]:
    """(the Constant layer, the data input, the factor) when `node` qualifies (module doc), else None."""
    if str(node.type) != "Mul" or len(node.inputs) != 2 or len(node.outputs) != 1:
        return None
    for k in (0, 1):
        const, data = node.inputs[k].pnode, node.inputs[1 - k]
        if const is None or str(const.type) != "Constant" or node.inputs[0] is node.inputs[1]:
            continue
        t = node.inputs[k]
        if len(readers.get(id(t), [])) != 1 or id(t) in io or len(const.outputs) != 1:
            continue
        if tuple(node.outputs[0].ir_shape) != tuple(data.ir_shape) or not data.ir_shape:
            continue
        factor = _scalar_factor(const)
        if factor is not None:
            return const, data, factor
    return None


def _as_batchnorm(node: PyNode, data: PyTensor, factor: float) -> None:
    """The Mul becomes the BatchNorm of the module doc (its params other than the fused activation stay)."""
    channels = int(data.ir_shape[-1])
    node.type = OpType.BatchNorm
    node.inputs = [data]
    node.params["axis"] = len(data.ir_shape) - 1
    node.params["epsilon"] = 0
    weights = torch.full((channels,), factor, dtype=torch.float32)
    node.constants["weights"] = PyTensor(node.name + "_weight", weights, Dtype.FP32, [channels])
    node.constants["biases"] = PyTensor(node.name + "_bias", torch.zeros(channels), Dtype.FP32, [channels])
    node.attrs[MUL_AS_BATCHNORM] = True


def mul_to_batchnorm(graph: PyGraph) -> List[Tuple[str, float]]:
    """Rewrite each qualifying Mul into a BatchNorm (module doc); returns (layer, factor) per rewrite."""
    io = {id(t) for t in graph.input_tensors + graph.output_tensors}
    readers = readers_by_tensor(graph)
    done: List[Tuple[str, float]] = []
    removed: Set[int] = set()
    for node in list(graph.nodes):
        found = _candidate(node, readers, io)
        if found is None:
            continue
        const, data, factor = found
        removed.add(id(const))
        _as_batchnorm(node, data, factor)
        OPT_DEBUG(f"merge_matmul_mul: Mul '{node.name}' by the Constant '{const.name}' ({factor!r}) is now a BatchNorm")
        done.append((node.name, factor))
    if done:
        graph.nodes = [n for n in graph.nodes if id(n) not in removed]
        graph.finalize(graph.source_file)
        graph.set_io([t.name for t in graph.input_tensors], [t.name for t in graph.output_tensors])
        OPT_INFO(f"merge_matmul_mul: {len(done)} Mul layer(s) by a non-integer scalar Constant rewritten as "
                 f"BatchNorm: " + ", ".join(f"{n} x {f:g}" for n, f in done))
    return done
