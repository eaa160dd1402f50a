"""`enable_pass_decompose_nonmonotonic_activations` (upstream's default, off; per layer): a large non-monotonic
Activation becomes x times a monotonic gate of x, before statistics (docs/user-guide.md, "Graph passes").

Why: a non-monotonic function of a wide input needs a large table for an accurate integer form; a monotonic gate
quantizes well with a small table, and the product is an integer multiplication.

What qualifies, as upstream: an Activation layer (not the standalone operator types) with method SILU, SWISH,
HARDSWISH, GELU or MISH whose output has at least 2^21 elements (batch included), where the field is true for the
layer. quantopt writes the gate as an operator it has:

* SILU, and SWISH with alpha 1: `x * sigmoid(x)`, the gate an Activation SIGMOID;
* HARDSWISH: `x * hardsigmoid(x)`, the gate an Activation HARDSIGMOID with the layer's alpha/beta (1/6, 0.5) and
  the clamp [0, 1].

The gate is the layer `<name>/nonmonotonic` (output `<name>/nonmonotonic_0`), the product the Mul `<name>/Mul`
writing the layer's output under its name; both keep the layer id, so per-layer rules by id keep applying. The float
outputs are those of the original layer up to float32 rounding of the product. Upstream writes the gate as an
Activation of method UNKNOWN holding a Python function (a table of it once quantized, with 2^8 entries); quantopt
has no such operator, so GELU (gate Phi(x)), MISH (gate tanh(softplus(x))) and SWISH with another alpha (gate
sigmoid(alpha*x)) are refused with an error naming the field. The gates here take the layer's lut_items_in_bits.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..errors import ConfigError
from ..graph.graph import PyGraph
from ..graph.names import unique_name as _unique
from ..graph.node import PyNode
from ..log import OPT_INFO
from ..registry.optype import OpType

FIELD = "enable_pass_decompose_nonmonotonic_activations"
MIN_ELEMENTS = 2 * 1024 * 1024
"""Upstream decomposes feature maps of at least 2M elements."""
NONMONOTONIC = ("GELU", "SILU", "HARDSWISH", "SWISH", "MISH")
HARDSWISH_ALPHA, HARDSWISH_BETA = 1.0 / 6.0, 0.5


def _enabled(value: Any, node: PyNode) -> bool:
    if hasattr(value, "get") and not isinstance(value, (str, dict)):
        value = value.get(node)
    return bool(value)


def _gate(node: PyNode, method: str) -> Tuple[str, dict]:
    """(gate method, gate params) of a qualifying layer; ConfigError when the gate is no quantopt operator."""
    if method == "SILU" or (method == "SWISH" and float(node.params.get("alpha", 1.0)) == 1.0):
        return "SIGMOID", {}
    if method == "HARDSWISH":
        return "HARDSIGMOID", {"alpha": float(node.params.get("alpha", HARDSWISH_ALPHA)),
                               "beta": float(node.params.get("beta", HARDSWISH_BETA)),
                               "clip_min": 0.0, "clip_max": 1.0}
    gate = {"GELU": "Phi(x)", "MISH": "tanh(softplus(x))", "SWISH": "sigmoid(alpha*x) with alpha != 1"}[method]
    raise ConfigError(f"{FIELD}: layer '{node.name}' (Activation {method}, {node.outputs[0].ir_numel} elements) would "
                      f"become x * {gate}, a table of an arbitrary function (upstream's Activation UNKNOWN), which "
                      "quantopt does not implement; set the field false for this layer (e.g. "
                      f"`true & <{{{node.name}}}:false>`)", field=FIELD)



def _qualifies(node: PyNode, value: Any) -> Optional[str]:
    if str(node.type) != "Activation" or len(node.inputs) != 1 or len(node.outputs) != 1:
        return None
    method = str(node.params.get("method", "")).upper()
    if method not in NONMONOTONIC or not _enabled(value, node) or node.outputs[0].ir_numel < MIN_ELEMENTS:
        return None
    return method


def decompose_nonmonotonic_activations(graph: PyGraph, value: Any) -> List[Tuple[str, str]]:
    """Decompose the qualifying layers (module doc); returns (layer, gate method) per decomposed layer."""
    taken = {n.name for n in graph.nodes} | set(graph.tensors())
    done: List[Tuple[str, str]] = []
    replaced: Dict[int, Tuple[PyNode, PyNode]] = {}
    for node in graph.nodes:
        method = _qualifies(node, value)
        if method is None:
            continue
        gate_method, gate_params = _gate(node, method)
        inp, out = node.inputs[0], node.outputs[0]
        gate = PyNode(_unique(f"{node.name}/nonmonotonic", taken), OpType.Activation, node.layer_id)
        gate.params["method"] = gate_method
        gate.params.update(gate_params)
        gate.source, gate.attrs = node.source, dict(node.attrs)
        gate.inputs = [inp]
        g_out = out.clone(_unique(f"{gate.name}_0", taken))
        g_out.pnode = gate
        gate.outputs = [g_out]
        mul = PyNode(_unique(f"{node.name}/Mul", taken), OpType.lookup("Mul"), node.layer_id)
        mul.source, mul.attrs = node.source, dict(node.attrs)
        mul.inputs = [inp, g_out]
        mul.outputs = [out]
        out.pnode = mul
        replaced[id(node)] = (gate, mul)
        done.append((node.name, gate_method))
    if not done:
        return done
    nodes: List[PyNode] = []
    for n in graph.nodes:
        nodes.extend(replaced.get(id(n), (n,)))
    graph.nodes = []
    for n in nodes:
        graph.add_node(n)
    graph.finalize(graph.source_file)
    graph.set_io([t.name for t in graph.input_tensors], [t.name for t in graph.output_tensors])
    OPT_INFO(f"{FIELD}: " + ", ".join(f"'{name}' -> x * {gate}" for name, gate in done))
    return done
