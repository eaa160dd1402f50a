"""ONNX graph preparation: Constant nodes and initializers as arrays, shape inference for every tensor, constant
folding (Shape/Gather/Concat/Cast/Unsqueeze chains that feed Reshape, and any other node whose inputs are all
constant), Identity/Dropout removal.

The result is an `OGraph`: plain nodes over named tensors with a known shape for every activation tensor, which the
converters translate layer by layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...errors import IRError
from ...log import OPT_DEBUG
from .control import inline_if, rename_inputs

FOLD_MAX_ELEMENTS = 1 << 24
"""Largest constant a folded node may produce (bigger results stay as layers so the .bin does not explode)."""
FOLD_MAX_FILL_ELEMENTS = 1 << 28
"""Largest ConstantOfShape folded: no layer computes one, so a bigger fill than FOLD_MAX_ELEMENTS (files that carry
their weights as fills, such as the onnx package's `light` model zoo copies) is folded all the same, up to 1 GiB
of float32, instead of failing the import."""
NON_FOLDABLE = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                "Bernoulli", "If", "Loop", "Scan"}
PASSTHROUGH = {"Identity", "Dropout"}
MAX_FOLD_ROUNDS = 32
"""Rounds of shape inference + folding (each nested If whose condition depends on shapes needs one more)."""
INFERENCE_VALUE_ELEMENTS = 1 << 10
"""Constants up to this many elements reach shape inference with their values (the shapes, axes, sizes and scales
that decide output shapes are all far smaller); larger ones as typed inputs of their shape."""


@dataclass
class ONode:
    """One ONNX node: name (the ONNX name, or `<OpType>_<k>` when empty), op type, tensor names, attributes."""
    name: str
    op: str
    inputs: List[str]
    outputs: List[str]
    attrs: Dict[str, Any]
    domain: str = ""
    fused: Dict[str, Any] = field(default_factory=dict)
    """Extras set by fusion: with_activation/clip bounds, folded BatchNorm, a bias added to a MatMul."""


@dataclass
class OGraph:
    name: str
    opset: int
    nodes: List[ONode]
    inputs: List[str]
    outputs: List[str]
    consts: Dict[str, np.ndarray]
    shapes: Dict[str, Tuple[int, ...]]
    dtypes: Dict[str, np.dtype]
    const_sources: Dict[str, str] = field(default_factory=dict)
    """Constant tensor → name of the Constant node or folded node that made it (a Constant layer's name, as the
    Parser names it); initializers are named after themselves."""

    def consumers(self, tensor: str) -> List[ONode]:
        return [n for n in self.nodes if tensor in n.inputs]


def clean_name(name: str) -> str:
    """A node name as an IR layer name: characters outside [A-Za-z0-9_/.:-] become '_' (as the Parser does)."""
    return "".join(c if c.isalnum() or c in "_/.:-" else "_" for c in name)


def _text(value: bytes, node: Any, attr: str, path: Optional[str]) -> str:
    """A string attribute as text; IRError naming the node and attribute for bytes that are not UTF-8."""
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise IRError(f"not a valid ONNX model: attribute '{attr}' of node {node.name!r} ({node.op_type}) is not "
                      f"UTF-8 text ({value[:40]!r})", file=path) from None


def _attrs(onnx: Any, node: Any, path: Optional[str] = None) -> Dict[str, Any]:
    from onnx import numpy_helper
    out: Dict[str, Any] = {}
    for a in node.attribute:
        if a.type == onnx.AttributeProto.TENSOR:
            out[a.name] = numpy_helper.to_array(a.t)
        elif a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            out[a.name] = a  # subgraph: only the unsupported-op report looks at it
        else:
            v = onnx.helper.get_attribute_value(a)
            if isinstance(v, bytes):
                v = _text(v, node, a.name, path)
            elif isinstance(v, float):
                v = float(str(np.float32(v)))  # float32 attribute → its shortest decimal (0.2, not 0.2000000029)
            elif isinstance(v, list) and v and isinstance(v[0], float):
                v = [float(str(np.float32(x))) for x in v]
            elif isinstance(v, list) and v and isinstance(v[0], bytes):
                v = [_text(x, node, a.name, path) for x in v]
            out[a.name] = v
    return out


def _constant_node_value(onnx: Any, node: Any, path: Optional[str] = None) -> np.ndarray:
    from onnx import numpy_helper
    for a in node.attribute:
        if a.name == "value":
            try:
                return numpy_helper.to_array(a.t)
            except (KeyError, ValueError, TypeError) as e:  # an unknown data type, data of another size than dims
                raise IRError(f"Constant node '{node.name}': its value (dims {list(a.t.dims)}, data type "
                              f"{a.t.data_type}) cannot be read: {type(e).__name__}: {e}", file=path) from None
        if a.name == "value_float":
            return np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), dtype=np.float32)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
    raise IRError(f"Constant node '{node.name}' has no supported value attribute (sparse/string values are not "
                  "supported)", file=path)


def _infer(onnx: Any, model: Any) -> Any:
    """`model` with ONNX's inferred shapes, or `model` unchanged when inference refuses it (an inconsistent or
    invalid graph, or one over protobuf's 2 GB): safe, because tensors left without a shape get one from
    `_fallback_shapes`, and a converter that still lacks one reports it with the node."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, ValueError, RuntimeError) as e:
        OPT_DEBUG(f"ONNX shape inference failed, shapes come from the fallback run: {type(e).__name__}: {e}")
        return model


def _shape_of(vi: Any) -> Optional[Tuple[int, ...]]:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    dims = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value") or d.dim_value < 0:
            return None
        dims.append(int(d.dim_value))
    return tuple(dims)


def _np_dtype(onnx: Any, elem_type: int) -> Optional[np.dtype]:
    """The numpy dtype of an ONNX element type; None for UNDEFINED (0, a tensor of unknown type) and element types
    this onnx version does not map (KeyError), or maps to no numpy dtype (TypeError)."""
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError):
        return None


def _eval_node(onnx: Any, node: Any, opset: int, inputs: List[Optional[np.ndarray]]) -> List[np.ndarray]:
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator
    # a one-node model, so that the evaluator picks the operator version of this opset
    inits = [numpy_helper.from_array(np.asarray(v), name=n) for n, v in zip(node.input, inputs) if n]
    outs = [helper.make_empty_tensor_value_info(o) for o in node.output if o]
    g = helper.make_graph([node], "fold", [], outs, initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    return [np.asarray(v) for v in ReferenceEvaluator(m).run(None, {})]


def build_ograph(model: Any, path: str) -> OGraph:
    """Fold constants and infer shapes until nothing changes; every activation tensor then has a static shape."""
    import onnx
    from onnx import numpy_helper

    from .loader import default_opset
    opset = default_opset(model)
    consts: Dict[str, np.ndarray] = {}
    for init in model.graph.initializer:
        try:
            consts[init.name] = numpy_helper.to_array(init)
        except (KeyError, ValueError, TypeError) as e:  # an unknown data type, data of another size than its dims
            raise IRError(f"initializer '{init.name}' (dims {list(init.dims)}, data type {init.data_type}) cannot "
                          f"be read: {type(e).__name__}: {e}", file=path) from None
    graph_inputs = [i.name for i in model.graph.input if i.name not in consts]
    graph_outputs = [o.name for o in model.graph.output]
    alias: Dict[str, str] = {}
    sources: Dict[str, str] = {}
    nodes: List[Any] = []
    counters: Dict[str, int] = {}
    names: set = set()
    for node in model.graph.node:
        k = counters.get(node.op_type, 0)
        counters[node.op_type] = k + 1
        if not node.name:
            node.name = f"{node.op_type}_{k}"
        node.name = clean_name(node.name)
        while node.name in names:  # ONNX does not require unique node names, the IR does
            node.name = f"{node.name}_{k}"
        names.add(node.name)
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            consts[node.output[0]] = _constant_node_value(onnx, node, path)
            sources[node.output[0]] = node.name
            continue
        nodes.append(node)

    shapes: Dict[str, Tuple[int, ...]] = {}
    dtypes: Dict[str, np.dtype] = {}
    for _ in range(MAX_FOLD_ROUNDS):
        # a model made of the remaining nodes with constants as initializers, for shape inference
        valued, typed = _inference_constants(onnx, consts)
        g = onnx.helper.make_graph(
            nodes, model.graph.name or "model",
            [i for i in model.graph.input if i.name not in consts] + typed,
            list(model.graph.output),
            initializer=[numpy_helper.from_array(np.asarray(consts[k]), name=k) for k in valued])
        m = onnx.helper.make_model(g, opset_imports=list(model.opset_import), ir_version=model.ir_version)
        inferred = _infer(onnx, m)
        for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
            s = _shape_of(vi)
            if s is not None:
                shapes[vi.name] = s
            dt = _np_dtype(onnx, vi.type.tensor_type.elem_type)
            if dt is not None:
                dtypes[vi.name] = dt
        changed = False
        kept = []
        for node in nodes:
            if node.op_type in PASSTHROUGH and node.domain in ("", "ai.onnx") and \
                    _is_plain_passthrough(node, consts, shapes):
                src = node.input[0]
                if src in consts:
                    consts[node.output[0]] = consts[src]
                else:
                    alias[node.output[0]] = alias.get(src, src)
                changed = True
                continue
            inlined = inline_if(node, consts, names, lambda n: _constant_node_value(onnx, n, path), clean_name)
            if inlined is not None:  # an If with a constant condition: the taken branch's nodes replace it
                kept.extend(inlined)
                changed = True
                continue
            folded = _try_fold(onnx, node, opset, consts, shapes)
            if folded is not None:
                for name, value in zip(node.output, folded):
                    consts[name] = value
                    if len(node.output) == 1:
                        sources[name] = node.name
                changed = True
                continue
            kept.append(node)
        if alias:
            for node in kept:
                rename_inputs(node, alias)
        nodes = kept
        if not changed:
            break

    onodes = [ONode(n.name, n.op_type, list(n.input), list(n.output), _attrs(onnx, n, path), n.domain) for n in nodes]
    outs = []
    for o in graph_outputs:
        while o in alias:  # chains appear when an inlined If branch ends in another If's output
            o = alias[o]
        outs.append(o)
    for c, v in consts.items():
        shapes[c] = tuple(int(d) for d in np.shape(v))
    missing = [t for n in onodes for t in n.outputs if t and t not in shapes]
    missing += [t for t in graph_inputs if t not in shapes]
    if missing:
        _fallback_shapes(onnx, model, missing, shapes, dtypes, path)
    return OGraph(model.graph.name or "model", opset, onodes, graph_inputs, outs, consts, shapes, dtypes, sources)


def _inference_constants(onnx: Any, consts: Dict[str, np.ndarray]) -> Tuple[List[str], List[Any]]:
    """How shape inference sees the constants: (names given with their values, typed inputs standing for the
    others). Only small constants carry values (shapes, axes, indices: what data propagation reads); a weight is a
    typed input of its shape. Every round of inference copies its model through protobuf several times, and with
    every weight inside it importing VGG-19 peaked at 7x the weights' size."""
    valued: List[str] = []
    typed: List[Any] = []
    for name, value in consts.items():
        v = np.asarray(value)
        elem = _tensor_type(onnx, v.dtype) if v.size > INFERENCE_VALUE_ELEMENTS else None
        if elem is None:
            valued.append(name)
        else:
            typed.append(onnx.helper.make_tensor_value_info(name, elem, list(v.shape)))
    return valued, typed


def _tensor_type(onnx: Any, dtype: np.dtype) -> Optional[int]:
    """The ONNX element type of a numeric numpy dtype; None for others (strings, objects), kept as values."""
    if dtype.kind not in "biufc":
        return None
    try:
        return int(onnx.helper.np_dtype_to_tensor_dtype(dtype))
    except (KeyError, TypeError, ValueError):
        return None


def _is_plain_passthrough(node: Any, consts: Dict[str, np.ndarray], shapes: Dict[str, Tuple[int, ...]]) -> bool:
    """Identity always; Dropout when it is known not to drop (no training_mode input, a constant false one, or a
    constant ratio 0). Its mask output then becomes a constant all-true tensor (once the input shape is known).
    Any other Dropout stays a node, which the converters reject (random training-mode dropout)."""
    if node.op_type == "Identity":
        return True
    training = node.input[2] if len(node.input) > 2 and node.input[2] else None
    ratio = node.input[1] if len(node.input) > 1 and node.input[1] else None
    if training is not None:
        if training not in consts:
            return False
        if bool(np.asarray(consts[training]).reshape(-1)[0]):
            if ratio is None or ratio not in consts or float(np.asarray(consts[ratio]).reshape(-1)[0]) != 0.0:
                return False
    if len(node.output) < 2 or not node.output[1]:
        return True
    src = node.input[0]
    shape = np.shape(consts[src]) if src in consts else shapes.get(src)
    if shape is None:
        return False
    consts[node.output[1]] = np.ones(shape, dtype=bool)
    return True


def _gather_elements(node: Any, inputs: List[Optional[np.ndarray]]) -> List[np.ndarray]:
    """GatherElements with numpy (onnx's reference evaluator fails when the indices are shorter than the data
    along the gathered axis, as in BERT's token_type_ids buffer)."""
    data, idx = np.asarray(inputs[0]), np.asarray(inputs[1]).astype(np.int64)
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    axis = axis + data.ndim if axis < 0 else axis
    idx = np.where(idx < 0, idx + data.shape[axis], idx)
    data = data[tuple(slice(None) if d == axis else slice(0, s) for d, s in enumerate(idx.shape))]
    return [np.take_along_axis(data, idx, axis=axis)]


NUMPY_FOLDERS = {"GatherElements": _gather_elements}
"""ONNX operators folded with numpy instead of onnx's reference evaluator."""


def _try_fold(onnx: Any, node: Any, opset: int, consts: Dict[str, np.ndarray],
              shapes: Dict[str, Tuple[int, ...]]) -> Optional[List[np.ndarray]]:
    if node.domain not in ("", "ai.onnx") or node.op_type in NON_FOLDABLE:
        return None
    if node.op_type in ("Shape", "Size") and node.input[0] in shapes:
        shape = np.array(shapes[node.input[0]], dtype=np.int64)
        if node.op_type == "Size":
            return [np.array(int(np.prod(shape)), dtype=np.int64)]
        attrs = {a.name: a.i for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", None)
        return [shape[start:end] if end is not None else shape[start:]]
    limit = FOLD_MAX_FILL_ELEMENTS if node.op_type == "ConstantOfShape" else FOLD_MAX_ELEMENTS
    if node.op_type == "ConstantOfShape" and node.input[0] in consts:
        dims = np.asarray(consts[node.input[0]])
        if dims.dtype.kind not in "iu" or int(np.prod(dims)) > limit:  # a shape of another type is not folded:
            return None  # its converter reports it
    if not all((not i) or i in consts for i in node.input):
        return None
    if node.op_type in ("Shape", "Size") and not node.input:
        return None
    try:
        folder = NUMPY_FOLDERS.get(node.op_type)
        inputs = [consts.get(i) if i else None for i in node.input]
        out = folder(node, inputs) if folder is not None else _eval_node(onnx, node, opset, inputs)
    except Exception as e:  # the reference evaluator runs arbitrary operator code: any exception means "not foldable"
        # safe: the node stays a layer, and its converter computes it or reports it as unsupported
        OPT_DEBUG(f"ONNX node '{node.name}' ({node.op_type}) not constant-folded: {type(e).__name__}: {e}")
        return None
    if any(o.size > limit for o in out):
        return None
    return out


def _fallback_shapes(onnx: Any, model: Any, missing: List[str], shapes: Dict[str, Tuple[int, ...]],
                     dtypes: Dict[str, np.dtype], path: str) -> None:
    """Shapes ONNX inference could not give: run the model once on zero inputs (onnxruntime if installed, else
    the onnx reference evaluator) and read them off."""
    feeds = {}
    init = {i.name for i in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in init:
            continue
        s = _shape_of(inp)
        dt = _np_dtype(onnx, inp.type.tensor_type.elem_type) or np.dtype(np.float32)
        if s is None:
            raise IRError(f"input '{inp.name}' has no static shape", file=path)
        feeds[inp.name] = np.zeros(s, dtype=dt)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    for name in missing:
        m.graph.output.add().name = name
    try:
        try:
            import onnxruntime as ort
            sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            values = sess.run(missing, feeds)
        except ImportError:
            from onnx.reference import ReferenceEvaluator
            values = ReferenceEvaluator(m).run(missing, feeds)
    except Exception as e:  # onnxruntime's own exception classes or any error of the reference evaluator
        # safe: the shapes stay unknown and the converter of each affected node reports "no known shape" with it
        OPT_DEBUG(f"ONNX fallback shape run failed, {len(missing)} tensor shape(s) stay unknown: "
                  f"{type(e).__name__}: {e}")
        return
    for name, v in zip(missing, values):
        shapes[name] = tuple(int(d) for d in np.shape(v))
        dtypes.setdefault(name, np.asarray(v).dtype)
