"""ONNX → Compass-style float IR (optional dependency `onnx`, imported lazily).

    graph = import_onnx("model.onnx", {"x": [1, 3, 224, 224]})     # a PyGraph, ready for OptMaster
    txt, bin = import_onnx_to_ir("model.onnx", "out_dir")           # the same graph written as .txt/.bin

The layout follows the Compass Parser: model inputs stay as in ONNX (NCHW) and a Transpose to NHWC follows them;
convolutions, pooling and the like run channels-last with OHWI weights; outputs are transposed back to the ONNX
layout when they would otherwise leave channels-last. See docs/onnx.md.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ...errors import UnsupportedError
from ...graph.builder import GraphBuilder
from ...graph.graph import PyGraph, QuantizeGraph
from ...graph.tensor import MAX_RANK
from .context import Context, ConvertError, ir_dtype
from .converters import CONVERTERS, unsupported_attr
from .converters_more import topk as _topk  # noqa: F401  (registers GatherND, TopK, the norms, Swish)
from .decompose import REWRITES, decompose
from .fused_ops import FUSED_CONVERTERS
from .fusion import run_fusions
from .loader import fix_input_shapes, load_model, parse_input_shapes, parse_input_values, pin_input_values, require_onnx
from .pattern import FUSED_DOMAIN
from .recurrent import lstm as _lstm  # noqa: F401  (registers the LSTM/GRU/If/Loop converters)
from .simplify import OGraph, ONode, build_ograph

__all__ = ["import_onnx", "import_onnx_to_ir", "parse_input_shapes", "parse_input_values", "supported_onnx_ops"]


def supported_onnx_ops() -> List[str]:
    """ONNX operator types the importer converts (besides Constant, Identity, Dropout and foldable ops), those it
    rewrites as others (decompose.py) included."""
    return sorted(set(CONVERTERS) | set(REWRITES) | {"Constant", "Identity", "Dropout"})


def _model_name(path: str, name: Optional[str]) -> str:
    if name:
        return name
    stem = os.path.splitext(os.path.basename(path))[0]
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in stem) or "model"


def prepare_onnx(path: str, input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
                 input_values: Optional[Mapping[str, Sequence[float]]] = None) -> OGraph:
    """Load, pin constant inputs, fix input shapes, fold constants, infer shapes and fuse: the graph the converters
    see."""
    require_onnx()
    model = load_model(path)
    pin_input_values(model, dict(input_values or {}), path)
    fix_input_shapes(model, dict(input_shapes or {}), path)
    g = build_ograph(model, path)
    decompose(g)
    run_fusions(g)
    return g


def import_onnx(path: str, input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
                name: Optional[str] = None, graph_cls: type = QuantizeGraph,
                input_values: Optional[Mapping[str, Sequence[float]]] = None,
                tensor_map: Optional[Dict[str, str]] = None) -> PyGraph:
    """Convert an ONNX file to a float graph; all unsupported nodes are reported in one UnsupportedError.
    `input_values` fixes inputs to constants (e.g. Silero VAD's sample rate), which then fold away; `tensor_map`,
    when given, receives each ONNX tensor's IR tensor name (frontends/onnx_qdq.py)."""
    path = str(path)
    g = prepare_onnx(path, input_shapes, input_values)
    builder = GraphBuilder(_model_name(path, name))
    ctx = Context(g, builder)
    for inp in g.inputs:
        shape = g.shapes.get(inp)
        if shape is None:
            raise UnsupportedError(f"input '{inp}' has no static shape", file=path)
        if len(shape) > MAX_RANK:
            raise UnsupportedError(f"input '{inp}' has {len(shape)} dims; tensors of at most {MAX_RANK} dims are "
                                   "supported", file=path)
        try:
            dtype = ir_dtype(g.dtypes.get(inp))
        except ConvertError as e:
            raise UnsupportedError(f"input '{inp}': {e}", file=path) from None
        ctx.unique_layer(inp)
        ir = f"{inp}_0"
        builder.input(ir, list(shape), dtype, layer_name=inp)
        ctx._tensors.add(ir)
        ctx.ir_shapes[ir] = tuple(shape)
        ctx.ir_dtypes[ir] = dtype
        ctx.bind(inp, ir, None)

    problems: List[str] = []
    failed: set = set()  # outputs of nodes that could not be converted: their consumers are not reported again
    for node in g.nodes:
        if any(t in failed for t in node.inputs):
            failed.update(node.outputs)
            continue
        where = f"node '{node.name}' ({node.op}, opset {g.opset})"
        fn = CONVERTERS.get(node.op) if node.domain in ("", "ai.onnx") else \
            FUSED_CONVERTERS.get(node.op) if node.domain == FUSED_DOMAIN else None
        reason = unsupported_attr(node) or _too_many_dims(g, node)
        problem = None
        if fn is None or reason:
            problem = reason or "operator not supported"
        else:
            try:
                fn(ctx, node)
            except ConvertError as e:
                problem = str(e)
            except (KeyError, ValueError, IndexError, TypeError) as e:
                problem = f"cannot convert ({type(e).__name__}: {e})"
        if problem is not None:
            problems.append(f"{where}: {problem}")
            failed.update(node.outputs)
    if problems:
        head = f"{len(problems)} ONNX node(s) cannot be imported:\n  " + "\n  ".join(problems)
        raise UnsupportedError(head, file=path)

    outputs = []
    for out in g.outputs:
        try:
            if out in g.consts and out not in ctx.tmap:
                outputs.append(ctx.constant_layer(out))
                continue
            ir, perm = ctx.tmap[out]
            outputs.append(ctx.value(out, None) if perm is not None else ir)
        except (ConvertError, KeyError) as e:
            raise UnsupportedError(f"graph output '{out}' cannot be produced ({e})", file=path) from None
    ctx.flush(outputs)
    if tensor_map is not None:
        tensor_map.update({k: v[0] for k, v in ctx.tmap.items()})
    graph = builder.build(outputs, graph_cls=graph_cls)
    graph.header = OrderedDict([("model_name", builder.name), ("layer_number", len(graph.nodes)),
                                ("precision", "float32"), ("compat_quantized_model", False),
                                ("model_bin", f"./{builder.name}.bin"),
                                ("input_tensors", [t.name for t in graph.input_tensors]),
                                ("output_tensors", [t.name for t in graph.output_tensors])])
    graph.source_file = path
    return graph


def _too_many_dims(g: OGraph, node: ONode) -> Optional[str]:
    """Why a node's output cannot be a layer output: more dims than a tensor may have (graph/tensor.py)."""
    for t in node.outputs:
        shape = g.shapes.get(t)
        if shape is not None and len(shape) > MAX_RANK:
            return f"output '{t}' has {len(shape)} dims {list(shape)}; tensors of at most {MAX_RANK} dims are supported"
    return None


def import_onnx_to_ir(path: str, out_dir: str, input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
                      name: Optional[str] = None,
                      input_values: Optional[Mapping[str, Sequence[float]]] = None) -> Tuple[str, str]:
    """Convert and write `<out_dir>/<name>.txt` and `.bin`; returns their paths."""
    from ...ir.writer import write_ir
    graph = import_onnx(path, input_shapes, name, input_values=input_values)
    return write_ir(graph, os.path.join(out_dir, graph.name + ".txt"))
