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

from ..errors import DataError, UnsupportedError
from ..graph.graph import PyGraph
from ..graph.tables import TensorQuant
from ..graph.tensor import PyTensor
from ..graph.values import to_float
from ..ops.io import takes_float
from ..ops.onnx_build.perms import inverse
from ..ops.onnx_build.qdq_graph import scalar
from .onnx_qdq import DEFAULT_SCALES, convert_graph, require_onnx

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


INT8_CPU_FEATURES = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx_vnni_int8", "amx_int8")
"""x86 features that choose onnxruntime's 8-bit GEMM kernels (docs/onnx-export.md, "How closely ...")."""


def runtime_description() -> str:
    """"onnxruntime <version>, CPU: <features>": what a measurement ran on. The exact export gives the same
    integers on every CPU, but figures of the float modes depend on these features (u8·s8 saturation)."""
    ort = require_onnxruntime()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
        flags = set(line.split(":", 1)[1].split()) if ":" in line else set()
        features = ", ".join(x for x in INT8_CPU_FEATURES if x in flags) or "none of " + "/".join(INT8_CPU_FEATURES)
        if flags and not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
            features += " (no VNNI)"
    except OSError:
        features = "unknown"
    return f"onnxruntime {ort.__version__}, CPU: {features}"


def _step(t: PyTensor, q: TensorQuant) -> Any:
    """One quantization step of an output (its params `q`): a float, or one per channel of the last axis."""
    if q.qinvariant:
        return 1.0
    if q.per_channel:  # float32 scales along the last axis (ops/onnx_build/qdq_graph.py per_channel_scales)
        return 1.0 / q.scale.to(torch.float32).reshape(-1).numpy().astype(np.float64)
    return 1.0 / scalar(q.scale, "scales", t)


def _feeds(graph: PyGraph, inputs: Sequence[Any]) -> Dict[str, np.ndarray]:
    if len(inputs) != len(graph.input_tensors):
        raise DataError(f"the model has {len(graph.input_tensors)} input(s) but {len(inputs)} were given")
    feeds = {}
    for t, x in zip(graph.input_tensors, inputs):
        a = x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        float_feed = takes_float(t.pnode, t)  # t.pnode: the Input layer
        feeds[t.name] = a.astype(np.float32) if float_feed else a.astype(t.ir_dtype.storage.newbyteorder("="))
        feeds[t.name] = a.astype(np.float32) if float_feed else a.astype(t.ir_dtype.storage.newbyteorder("="))
    return feeds


def measure_agreement(graph: PyGraph, inputs: Sequence[Any], scales: str = DEFAULT_SCALES,
                      per_layer: bool = False, optimize: bool = True, opset: Optional[int] = None) -> Agreement:
    """Export `graph` (a quantized graph), run it with onnxruntime (CPU; `optimize` keeps the default graph
    optimizations, which fuse QDQ groups into integer kernels) and compare with quantopt's integer forward.

    `inputs`: one array per graph input (float data for float inputs), batch first; a model exported with its IR
    batch (`onnx_qdq.batch_is_leading`) runs on consecutive chunks of that size. With `per_layer`, the quantized
    graph's tensors hold onnxruntime's values afterwards (run a forward to refill them)."""
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
    tally = _Tally({t.name: 0 for t in graph.output_tensors})
    for chunk in _chunks(feeds, None if qdq.dynamic_batch else _ir_batches(graph)):
        names = [o.name for o in session.get_outputs()]
        results = dict(zip(names, session.run(None, chunk)))
        with torch.no_grad():
            graph.forward([torch.from_numpy(chunk[t.name]) for t in graph.input_tensors])
        for t in graph.output_tensors:
            ref = to_float(t, graph.quant).numpy().astype(np.float64)
            got = results[t.name].astype(np.float64)
            if got.shape != ref.shape:
                raise UnsupportedError(f"output '{t.name}': onnxruntime gives shape {list(got.shape)}, quantopt "
                                       f"{list(ref.shape)}")
            tally.add_output(t.name, np.abs(got - ref) / _step(t, graph.quant.get(t)))
        if per_layer:
            for name, counts in _isolated_layers(graph, views, results).items():
                tally.add_layer(name, counts)
    return tally.result()


@dataclass
class _Tally:
    """Counts over every chunk of the data."""

    outputs_within: Dict[str, int]
    output_sizes: Dict[str, int] = field(default_factory=dict)
    same: int = 0
    worst: float = 0.0
    layers: Dict[str, List[int]] = field(default_factory=dict)

    def add_output(self, name: str, steps: np.ndarray) -> None:
        self.outputs_within[name] += int(np.count_nonzero(steps <= 1.0 + STEP_TOLERANCE))
        self.output_sizes[name] = self.output_sizes.get(name, 0) + steps.size
        self.same += int(np.count_nonzero(steps <= STEP_TOLERANCE))
        self.worst = max(self.worst, float(steps.max()) if steps.size else 0.0)

    def add_layer(self, name: str, counts: List[int]) -> None:
        have = self.layers.setdefault(name, [0, 0])
        have[0], have[1] = have[0] + counts[0], have[1] + counts[1]

    def result(self) -> Agreement:
        total = sum(self.output_sizes.values())
        within = sum(self.outputs_within.values())
        shares = {k: v / max(self.output_sizes.get(k, 0), 1) for k, v in self.outputs_within.items()}
        layers = {k: c[0] / c[1] for k, c in self.layers.items() if c[1]}
        return Agreement(within / max(total, 1), self.worst, total, self.same / max(total, 1), shares, layers)


def _ir_batches(graph: PyGraph) -> Dict[str, int]:
    return {t.name: int(t.ir_shape[0]) if t.ir_shape else 1 for t in graph.input_tensors}


def _chunks(feeds: Dict[str, np.ndarray], sizes: Optional[Dict[str, int]]) -> List[Dict[str, np.ndarray]]:
    """The feeds whole, or (a model with its IR batch) each input split along dim 0 into pieces of its IR dim 0:
    several samples of every input stacked on dim 0, e.g. LSTM states [layers, 1, C] two samples deep."""
    if sizes is None:
        return [feeds]
    counts = {k: (v.shape[0] // sizes[k] if v.ndim and sizes[k] > 0 else 1) for k, v in feeds.items()}
    for k, v in feeds.items():
        if v.ndim and sizes[k] > 0 and v.shape[0] % sizes[k]:
            raise DataError(f"input '{k}': {v.shape[0]} rows are not a multiple of the exported model's "
                            f"{sizes[k]}")
    if len(set(counts.values())) != 1:
        raise DataError(f"the inputs hold different numbers of samples: {counts}")
    count = next(iter(counts.values()), 1)
    if count <= 1:
        return [feeds]
    return [{k: v[i * sizes[k]:(i + 1) * sizes[k]] if v.ndim else v for k, v in feeds.items()}
            for i in range(count)]


def _isolated_layers(graph: PyGraph, views: Dict[str, Any], results: Dict[str, np.ndarray]
                     ) -> Dict[str, List[int]]:
    """Each layer run by quantopt on onnxruntime's integers for its inputs, compared with onnxruntime's outputs:
    [elements within one step, elements] per layer."""
    def ort_value(t: PyTensor) -> Optional[torch.Tensor]:
        if t.name not in views:
            return None
        perm, value, offset = views[t.name]
        ir_values = results[value].astype(np.int64).transpose(inverse(perm)) - offset
        return torch.from_numpy(np.ascontiguousarray(ir_values))

    counts: Dict[str, List[int]] = {}
    with torch.no_grad():
        for node in graph.nodes:
            if str(node.type) == "Input":
                continue  # the fed data is still on its output
            for t in node.inputs:
                v = ort_value(t)
                if v is not None:
                    t.betensor = v
            node.forward()
            layer: List[int] = [0, 0]
            for t in node.outputs:
                v = ort_value(t)
                if v is None:
                    continue
                d = (v - t.betensor.to(torch.int64)).abs()
                layer[0] += int((d <= 1).sum())
                layer[1] += d.numel()
            if layer[1]:
                counts[node.name] = layer
    return counts


SENSITIVITY_TYPES = ("Convolution", "DepthwiseConv", "FullyConnected")


def rounding_sensitivity(graph: PyGraph, inputs: Sequence[Any], rate: float = 1e-4, seed: int = 0) -> float:
    """quantopt against itself: the share of output elements within one step when a `rate` share of the outputs
    of every Convolution/DepthwiseConv/FullyConnected moves by one step (seeded signs and positions), the way
    rare ties rounded the other way by a float runtime move them. Below 99.9%, whole-model agreement within one
    step cannot be expected from a runtime that is not bit-exact."""
    feeds = [torch.as_tensor(x) for x in inputs]
    with torch.no_grad():
        graph.forward(feeds)
        table = graph.quant
        ref = [to_float(t, table).clone() for t in graph.output_tensors]
        gen = torch.Generator().manual_seed(seed)

        def nudge(node: Any) -> None:
            if str(node.type) not in SENSITIVITY_TYPES:
                return
            for t in node.outputs:
                flat = t.betensor.reshape(-1)
                count = max(1, int(round(flat.numel() * rate)))
                idx = torch.randint(0, flat.numel(), (count,), generator=gen)
                sign = torch.randint(0, 2, (count,), generator=gen) * 2 - 1
                q = table.get(t)
                flat[idx] = torch.clamp(flat[idx] + sign, int(q.qmin), int(q.qmax))
                t.betensor = flat.reshape(t.betensor.shape)

        graph.forward(feeds, after_node=nudge)
        within, total = 0, 0
        for t, r in zip(graph.output_tensors, ref):
            steps = (to_float(t, table) - r).abs() / _step(t, table.get(t))
            within += int((steps <= 1.0 + STEP_TOLERANCE).sum())
            total += steps.numel()
    return within / max(total, 1)
