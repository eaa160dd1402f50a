"""How closely onnxruntime running an exported QDQ model follows quantopt's integer forward.

Two views (docs/onnx-export.md):
* outputs: the share of graph output elements where onnxruntime's float output is within one output quantization
  step of quantopt's dequantized integer output, both running the whole model on the same inputs;
* layers (per_layer=True): each layer of quantopt run on the integers onnxruntime computed for its inputs and
  compared with onnxruntime's integers for its outputs, so every layer is judged on identical inputs. Differences
  that one layer introduces and later layers amplify show in the first view only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from ..analysis.similarity import to_float
from ..errors import DataError, UnsupportedError
from ..graph.graph import PyGraph
from ..graph.tensor import PyTensor
from .convert_layout import takes_float
from .onnx_qdq import DEFAULT_SCALES, convert_graph, require_onnx
from .qdq_graph import inverse, scalar

STEP_TOLERANCE = 1e-3
"""A difference of up to 1 + this many steps counts as one step (float32 rounding of the dequantized values)."""


@dataclass
class Agreement:
    share: float                     # output elements within one step, all outputs together
    max_steps: float                 # largest output difference, in output steps
    elements: int
    identical: float = 0.0           # output elements equal to quantopt's (dequantized, to float32 precision)
    outputs: Dict[str, float] = field(default_factory=dict)   # share per output tensor
    layers: Dict[str, float] = field(default_factory=dict)    # per layer: isolated share within one step

    @property
    def worst_layer(self) -> Optional[str]:
        return min(self.layers, key=lambda k: self.layers[k]) if self.layers else None


def require_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise UnsupportedError("measuring the agreement needs the optional dependency 'onnxruntime' "
                               "(pip install 'quantopt[onnx]' or pip install onnxruntime)") from None
    return onnxruntime


def _step(t: PyTensor) -> float:
    return 1.0 if t.qinvariant else 1.0 / scalar(t.scale, "scales", t)


def _feeds(graph: PyGraph, inputs: Sequence[Any]) -> Dict[str, np.ndarray]:
    if len(inputs) != len(graph.input_tensors):
        raise DataError(f"the model has {len(graph.input_tensors)} input(s) but {len(inputs)} were given")
    feeds = {}
    for t, x in zip(graph.input_tensors, inputs):
        a = x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        feeds[t.name] = a.astype(np.float32) if takes_float(t) else a.astype(t.ir_dtype.storage.newbyteorder("="))
    return feeds


def measure_agreement(graph: PyGraph, inputs: Sequence[Any], scales: str = DEFAULT_SCALES,
                      per_layer: bool = False, optimize: bool = True, opset: Optional[int] = None) -> Agreement:
    """Export `graph` (a quantized graph), run it with onnxruntime (CPU; `optimize` keeps the default graph
    optimizations, which fuse QDQ groups into integer kernels) and compare with quantopt's integer forward.

    `inputs`: one array per graph input (float data for float inputs), batch first. With `per_layer`, the
    quantized graph's tensors hold onnxruntime's values afterwards (run a forward to refill them)."""
    onnx = require_onnx()
    ort = require_onnxruntime()
    model, qdq = convert_graph(graph, opset, scales)
    views: Dict[str, Any] = {}
    if per_layer:
        outputs = {o.name for o in model.graph.output}
        initializers = {i.name for i in model.graph.initializer}
        tensors = {t.name: t for n in graph.nodes for t in n.outputs}
        for name, layouts in qdq.views.items():
            perm, value = next(iter(layouts.items()))
            if value in initializers or value in {i.name for i in model.graph.input}:
                continue
            views[name] = (perm, value, qdq.qparams(tensors[name]).offset)
            if value not in outputs:
                model.graph.output.append(onnx.helper.make_empty_tensor_value_info(value))
                outputs.add(value)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # measuring, not serving: no thread pool spinning on a busy machine
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = _feeds(graph, inputs)
    names = [o.name for o in session.get_outputs()]
    results = dict(zip(names, session.run(None, feeds)))
    with torch.no_grad():
        graph.forward([torch.from_numpy(feeds[t.name]) for t in graph.input_tensors])
    shares: Dict[str, float] = {}
    within, same, total, worst = 0, 0, 0, 0.0
    for t in graph.output_tensors:
        ref = to_float(t).numpy().astype(np.float64)
        got = results[t.name].astype(np.float64)
        if got.shape != ref.shape:
            raise UnsupportedError(f"output '{t.name}': onnxruntime gives shape {list(got.shape)}, quantopt "
                                   f"{list(ref.shape)}")
        steps = np.abs(got - ref) / _step(t)
        ok = int(np.count_nonzero(steps <= 1.0 + STEP_TOLERANCE))
        shares[t.name] = ok / max(steps.size, 1)
        within, total = within + ok, total + steps.size
        same += int(np.count_nonzero(steps <= STEP_TOLERANCE))
        worst = max(worst, float(steps.max()) if steps.size else 0.0)
    result = Agreement(within / max(total, 1), worst, total, same / max(total, 1), shares)
    if per_layer:
        result.layers = _isolated_layers(graph, views, results)
    return result


def _isolated_layers(graph: PyGraph, views: Dict[str, Any], results: Dict[str, np.ndarray]) -> Dict[str, float]:
    """Each layer run by quantopt on onnxruntime's integers for its inputs, compared with onnxruntime's outputs."""
    def ort_value(t: PyTensor) -> Optional[torch.Tensor]:
        if t.name not in views:
            return None
        perm, value, offset = views[t.name]
        ir_values = results[value].astype(np.int64).transpose(inverse(perm)) - offset
        return torch.from_numpy(np.ascontiguousarray(ir_values))

    shares: Dict[str, float] = {}
    with torch.no_grad():
        for node in graph.nodes:
            if str(node.type) == "Input":
                continue  # the fed data is still on its output
            for t in node.inputs:
                v = ort_value(t)
                if v is not None:
                    t.betensor = v
            node.forward()
            counts: List[int] = [0, 0]
            for t in node.outputs:
                v = ort_value(t)
                if v is None:
                    continue
                d = (v - t.betensor.to(torch.int64)).abs()
                counts[0] += int((d <= 1).sum())
                counts[1] += d.numel()
            if counts[1]:
                shares[node.name] = counts[0] / counts[1]
    return shares


SENSITIVITY_TYPES = ("Convolution", "DepthwiseConv", "FullyConnected")


def rounding_sensitivity(graph: PyGraph, inputs: Sequence[Any], rate: float = 1e-4, seed: int = 0) -> float:
    """quantopt against itself: the share of output elements within one step when a `rate` share of the outputs
    of every Convolution/DepthwiseConv/FullyConnected moves by one step (seeded signs and positions), the way
    rare ties rounded the other way by a float runtime move them. Below 99.9%, whole-model agreement within one
    step cannot be expected from a runtime that is not bit-exact."""
    feeds = [torch.as_tensor(x) for x in inputs]
    with torch.no_grad():
        graph.forward(feeds)
        ref = [to_float(t).clone() for t in graph.output_tensors]
        gen = torch.Generator().manual_seed(seed)

        def nudge(node: Any) -> None:
            if str(node.type) not in SENSITIVITY_TYPES:
                return
            for t in node.outputs:
                flat = t.betensor.reshape(-1)
                count = max(1, int(round(flat.numel() * rate)))
                idx = torch.randint(0, flat.numel(), (count,), generator=gen)
                sign = torch.randint(0, 2, (count,), generator=gen) * 2 - 1
                flat[idx] = torch.clamp(flat[idx] + sign, int(t.qmin), int(t.qmax))
                t.betensor = flat.reshape(t.betensor.shape)

        graph.forward(feeds, after_node=nudge)
        within, total = 0, 0
        for t, r in zip(graph.output_tensors, ref):
            steps = (to_float(t) - r).abs() / _step(t)
            within += int((steps <= 1.0 + STEP_TOLERANCE).sum())
            total += steps.numel()
    return within / max(total, 1)
