"""Quantized graph → ONNX model with QuantizeLinear/DequantizeLinear pairs (optional dependency `onnx`).

    path = export_onnx_qdq(qgraph, "model.qdq.onnx")          # opset 19, or 21 when 16-bit tensors need it

Every quantized activation is an integer ONNX value (int8/uint8, int16/uint16 from opset 21) with the ONNX
parameters scale = 1 / scale_ir and zero point = -zp_ir; each layer dequantizes its inputs, runs the float ONNX
op and quantizes its output. Weights are integer initializers behind a (per-channel) DequantizeLinear, biases
int32. Graph inputs are float (quantized by the first QuantizeLinear), outputs are dequantized floats with the IR
tensor names. docs/onnx-export.md has the mapping table and how closely onnxruntime follows the integer forward.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

from ..errors import ConfigError, IRError, UnsupportedError
from ..graph.graph import PyGraph
from ..log import OPT_WARN
from ..ops.onnx_build.int64_compare import rewrite_int64_comparisons
from ..ops.onnx_build.qdq_graph import QDQGraph
from ..quant.dtype import Dtype
from ..registry import OP_EXPORT, export_function
from ..version import __version__
from .options import DEFAULT_SCALES, SCALE_MODES  # torch-free for `quantopt export --help`

DEFAULT_OPSET = 19
WIDE_OPSET = 21
"""QuantizeLinear/DequantizeLinear of int16/uint16 exist from opset 21."""
WIDE_DTYPES = (Dtype.INT16, Dtype.UINT16)


def require_onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise UnsupportedError("exporting ONNX needs the optional dependency 'onnx' (pip install 'quantopt[onnx]' or "
                               "pip install onnx)") from None
    return onnx


def supported_layer_types() -> List[str]:
    """IR layer types with a QDQ mapping: those declared with an operator (`@SPEC.export`, built-in or plugin)."""
    return OP_EXPORT.keys()


def _quantized(graph: PyGraph) -> PyGraph:
    """The integer graph: `graph` itself, or the quantized copy a float QuantizeGraph holds after quantization."""
    inner = getattr(graph, "quantgraph", None)
    if inner is not None and not all(n.quantized for n in graph.nodes):
        return inner
    return graph


def choose_opset(graph: PyGraph, opset: Optional[int] = None) -> int:
    """19, or 21 when a 16-bit activation needs int16 QuantizeLinear; an explicit `opset` is checked."""
    onnx = require_onnx()
    wide = any(t.dtype in WIDE_DTYPES for n in graph.nodes for t in n.outputs)
    need = WIDE_OPSET if wide else DEFAULT_OPSET
    if opset is None:
        return need
    newest = int(onnx.defs.onnx_opset_version())
    if not DEFAULT_OPSET <= int(opset) <= newest:
        raise ConfigError(f"opset {opset} is outside the exportable range {DEFAULT_OPSET}..{newest}", field="opset")
    if int(opset) < need:
        raise ConfigError(f"opset {opset} cannot hold this graph: its 16-bit activations need opset {WIDE_OPSET}",
                          field="opset")
    return int(opset)


def batch_is_leading(graph: PyGraph) -> bool:
    """Whether dim 0 of every tensor is the batch: all have the graph inputs' IR batch there and no layer moves it
    or works along it (a perm not starting with 0, an `axis` naming dim 0, a GatherND or a scatter). Only then can
    the export take a symbolic batch; otherwise the IR batch is kept (LSTM states stacked on dim 0, attention heads
    reshaped into it, ...)."""
    batches = {int(t.ir_shape[0]) for t in graph.input_tensors if len(t.ir_shape)}
    if len(batches) != 1:
        return False
    batch = batches.pop()
    for node in graph.nodes:
        tensors = list(node.inputs) + list(node.outputs)
        if any(not len(t.ir_shape) or int(t.ir_shape[0]) != batch for t in tensors):
            return False
        perm = node.params.get("perm")
        if str(node.type) in ("Transpose", "Permute") and (not isinstance(perm, (list, tuple)) or int(perm[0]) != 0):
            return False
        if str(node.type) in ("GatherND", "ScatterND", "ScatterElements"):  # constant indices address dim 0 too
            return False
        axis = node.params.get("axis")
        rank = len(node.inputs[0].ir_shape) if node.inputs else 0
        axes = axis if isinstance(axis, (list, tuple)) else [axis]
        if rank and any(isinstance(a, (int, str)) and str(a).lstrip("-").isdigit() and int(a) % rank == 0
                        for a in axes if a is not None):
            return False
    return True


def build_onnx_qdq(graph: PyGraph, opset: Optional[int] = None, scales: str = DEFAULT_SCALES,
                   dynamic_batch: bool = True, int64_inputs: bool = False) -> Any:
    """The ONNX ModelProto of a quantized graph; every layer without a QDQ mapping is listed in one
    UnsupportedError. `dynamic_batch` makes dim 0 of inputs and outputs symbolic where every tensor's dim 0 is the
    batch (`batch_is_leading`). `int64_inputs` declares the integer inputs int64, as the source ONNX model of an
    imported transformer has its token ids and masks (the IR holds them as int32)."""
    return convert_graph(graph, opset, scales, dynamic_batch, int64_inputs)[0]


def convert_graph(graph: PyGraph, opset: Optional[int] = None, scales: str = DEFAULT_SCALES,
                  dynamic_batch: bool = True, int64_inputs: bool = False) -> Tuple[Any, QDQGraph]:
    """(ModelProto, the QDQGraph it was built from: its `views` name every IR tensor's integer ONNX value)."""
    onnx = require_onnx()
    if scales not in SCALE_MODES:
        raise ConfigError(f"scales must be one of {', '.join(SCALE_MODES)}, got {scales!r}", field="scales")
    graph = _quantized(graph)
    if graph.device.type != "cpu":  # the builders read constants with numpy
        graph = graph.clone().to("cpu")
    opset = choose_opset(graph, opset)
    g = QDQGraph(opset, graph.quant, scales, dynamic_batch and batch_is_leading(graph), int64_inputs)
    for t in list(graph.input_tensors) + list(graph.output_tensors):
        g.reserve(t.name)
    problems: List[str] = []
    failed: set = set()
    for node in graph.nodes:
        if any(t.name in failed for t in node.inputs):
            failed.update(t.name for t in node.outputs)  # reported at its source already
            continue
        g.layer = node.name
        convert = export_function(str(node.type))
        try:
            if not node.quantized:
                raise UnsupportedError(f"layer '{node.name}' ({node.type}) is not quantized (float layers have no "
                                       "QDQ form)")
            if convert is None:
                raise UnsupportedError(f"layer '{node.name}' ({node.type}): no QDQ mapping for this layer type")
            convert(g, node)
        except (UnsupportedError, IRError) as e:
            # every problem names its layer (a tensor-level refusal from deeper down does not)
            named = e.message.startswith(f"layer '{node.name}'")
            problems.append(e.message if named else f"layer '{node.name}' ({node.type}): {e.message}")
            failed.update(t.name for t in node.outputs)
    if problems:
        raise UnsupportedError(f"{len(problems)} layer(s) cannot be exported as ONNX QDQ: " + "; ".join(problems))
    if g.float_layers:
        names = list(g.float_layers)
        OPT_WARN(f"ONNX QDQ export: {len(names)} layer(s) keep the float QDQ form (float32 arithmetic, not "
                 f"bit-exact): {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}")
    g.layer = "output"
    for t in graph.output_tensors:
        g.add("DequantizeLinear", [g.int_value(t), *g.qparam_inputs(t)], output=t.name, axis=g.channel_axis(t, None))
        g.outputs.append(g.value_info(t.name, "FLOAT", g.io_shape(t)))
    helper = onnx.helper
    model = helper.make_model_gen_version(
        helper.make_graph(g.nodes, graph.name, g.inputs, g.outputs, g.initializers,
                          doc_string="quantized by quantopt; QuantizeLinear/DequantizeLinear in ONNX convention"),
        opset_imports=[helper.make_opsetid("", opset)], producer_name="quantopt", producer_version=__version__)
    _check_and_infer(onnx, model)
    if rewrite_int64_comparisons(model):
        _check_and_infer(onnx, model)
    return model, g


CHECK_VALUE_ELEMENTS = 1 << 10
"""Initializers up to this many elements reach the checker and shape inference with their values (shapes, axes,
pads: what inference reads); larger ones (weights) as typed inputs of their shape."""


def _check_and_infer(onnx: Any, model: Any) -> None:
    """`onnx.checker.check_model` and strict shape inference of `model`, its value_info replaced by the inferred
    one. Both run on a copy whose weights are typed inputs: each serializes the whole model, which for a
    VGG-size export cost a second of a three-second export. The weights are this module's own initializers,
    made from numpy arrays of their declared shape."""
    graph, helper = model.graph, onnx.helper
    weights = [init for init in graph.initializer if math.prod(int(d) for d in init.dims) > CHECK_VALUE_ELEMENTS]
    if not weights:
        onnx.checker.check_model(model)
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    else:
        names = {init.name for init in weights}
        skeleton = helper.make_model_gen_version(
            helper.make_graph(list(graph.node), graph.name, [*graph.input, *(helper.make_tensor_value_info(
                init.name, init.data_type, list(init.dims)) for init in weights)], list(graph.output),
                [init for init in graph.initializer if init.name not in names], value_info=list(graph.value_info)),
            opset_imports=list(model.opset_import), producer_name=model.producer_name,
            producer_version=model.producer_version)
        onnx.checker.check_model(skeleton)
        inferred = onnx.shape_inference.infer_shapes(skeleton, check_type=True, strict_mode=True)
    del graph.value_info[:]
    graph.value_info.extend(inferred.graph.value_info)



def export_onnx_qdq(graph: PyGraph, path: str, opset: Optional[int] = None, scales: str = DEFAULT_SCALES,
                    dynamic_batch: bool = True, int64_inputs: bool = False) -> str:
    """Write the QDQ model of a quantized graph to `path` atomically; returns the path."""
    from ..ir.writer import atomic_write

    model = build_onnx_qdq(graph, opset, scales, dynamic_batch, int64_inputs)
    return atomic_write(str(path), model.SerializeToString())
