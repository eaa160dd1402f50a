"""Loading an ONNX file: lazy `onnx` import, external data, opset and input-shape checks.

Every failure here is an `IRError` naming the file, so a malformed model or a missing external-data file gives
one clear line on the command line.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ...errors import ConfigError, IRError, UnsupportedError
from ...ir.reader import MAX_ELEMENTS

MIN_OPSET = 11
"""Oldest default-domain opset the importer converts from; older models are first upgraded to it with
onnx.version_converter (`upgrade_opset`)."""
MAX_OPSET = 21
"""Newest default-domain opset of the supported range; newer opsets are imported with a warning (the operators
the converters handle kept their semantics there; the conformance run covers them)."""


def require_onnx() -> Any:
    """The `onnx` module, or a clear error telling how to install the optional dependency."""
    try:
        import onnx
    except ImportError:
        raise UnsupportedError("importing ONNX models needs the optional dependency 'onnx' "
                               "(pip install 'quantopt[onnx]' or pip install onnx)") from None
    return onnx


def load_model(path: str) -> Any:
    """Read `path` with its external data; malformed files and missing data files are one IRError naming them."""
    onnx = require_onnx()
    if not os.path.isfile(path):
        raise IRError("ONNX file not found", file=path)
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends
        raise IRError(f"not a readable ONNX model ({type(e).__name__}: {e})", file=path) from None
    if not model.graph.node and not model.graph.output:
        raise IRError("not a readable ONNX model (empty graph)", file=path)
    check_structure(model, path)  # before the external data: the checker refuses protobufs over 2 GB
    base = os.path.dirname(os.path.abspath(path))
    missing = []
    for init in _all_initializers(model):
        if init.data_location == onnx.TensorProto.EXTERNAL:
            loc = {e.key: e.value for e in init.external_data}.get("location", "")
            if not os.path.isfile(os.path.join(base, loc)):
                missing.append(f"'{loc}' (initializer '{init.name}')")
    if missing:
        raise IRError(f"external data file(s) not found next to the model: {', '.join(sorted(set(missing)))}",
                      file=path)
    try:
        from onnx.external_data_helper import load_external_data_for_model
        load_external_data_for_model(model, base)
    except Exception as e:
        raise IRError(f"cannot read external data ({type(e).__name__}: {e})", file=path) from None
    version = default_opset(model)
    model, why = upgrade_opset(model)
    if why:
        raise UnsupportedError(f"ONNX opset {version} is older than the supported range {MIN_OPSET}-{MAX_OPSET}, "
                               f"and {why}", file=path)
    if default_opset(model) != version:
        from ...log import OPT_INFO
        OPT_INFO(f"{path}: ONNX opset {version} upgraded to opset {MIN_OPSET} with onnx.version_converter")
    check_opset(model, path)
    return model


def check_structure(model: Any, path: str) -> None:
    """The model as ONNX defines a valid one (`onnx.checker`: every node input made before it is read, attribute
    types and counts of each operator's schema, initializer data of their declared size): a broken model is one
    IRError naming what the checker found, before the importer relies on any of it. Checked without its external
    data (the checker refuses protobufs over 2 GB and would look for the data files from the working directory;
    `load_model` and `build_ograph` check those files and sizes), and with two rules the importer does not need
    relaxed on a copy: IR versions before 4 listed every initializer as a graph input too, and a graph input or
    output may have an unknown rank (shape inference or --input-shape gives it). A model of an opset newer than the
    installed onnx knows is not checked (the checker has no schemas for it; such a model imported before)."""
    onnx = require_onnx()
    external = [t for t in _all_initializers(model) if t.data_location == onnx.TensorProto.EXTERNAL]
    shapeless = [v for v in list(model.graph.input) + list(model.graph.output)
                 if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")]
    checked = model
    if model.ir_version < 4 or shapeless or external:
        checked = onnx.ModelProto()
        checked.CopyFrom(model)
        checked.ir_version = max(4, model.ir_version)
        for v in list(checked.graph.input) + list(checked.graph.output):
            if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape"):
                v.type.tensor_type.shape.SetInParent()
        _without_external_data(onnx, checked)
    known = onnx.defs.onnx_opset_version()
    if default_opset(model) > known:  # the installed onnx has no schemas for it; `check_opset` warns about it
        from ...log import OPT_DEBUG
        OPT_DEBUG(f"{path}: opset {default_opset(model)} is newer than the installed onnx knows ({known}): only the "
                  "input and output counts of its nodes are checked, against the newest schemas")
        _check_arity(onnx, model, known, path)
    else:
        try:
            onnx.checker.check_model(checked)
        except Exception as e:  # onnx.checker.ValidationError, and C++ errors of other types for broken protobufs
            text = " ".join(str(e).split())
            if "is deprecated in domain_version" not in text:
                raise IRError(f"not a valid ONNX model: {text[:300]}", file=path) from None
            # an operator version a later opset replaced (GroupNormalization of opset 18): valid in its own opset,
            # which the converters read; the checker refuses it all the same, so the node counts are checked
            from ...log import OPT_DEBUG
            OPT_DEBUG(f"{path}: {text[:200]}: a valid operator of its opset; only node input and output counts "
                      "are checked")
            _check_arity(onnx, model, default_opset(model), path)
    for node in model.graph.node:  # protobuf gives a string field that is not UTF-8 as bytes
        for name in [node.name, node.op_type, node.domain, *node.input, *node.output]:
            if not isinstance(name, str):
                raise IRError(f"not a valid ONNX model: node {node.name!r} holds a name that is not UTF-8 text "
                              f"({name!r})", file=path)
        problem = _crashing_attribute(node)
        if problem:
            raise IRError(f"not a valid ONNX model: node {node.name!r} ({node.op_type}) {problem}", file=path)
    graph = model.graph
    for kind, name in [("graph's name", graph.name)] + [
            (kind, v.name) for kind, values in (("graph input", graph.input), ("graph output", graph.output),
                                                ("initializer", graph.initializer), ("value info", graph.value_info))
            for v in values]:
        if not isinstance(name, str):
            raise IRError(f"not a valid ONNX model: the {kind} {name!r} is not UTF-8 text", file=path)


def _crashing_attribute(node: Any) -> Optional[str]:
    """What is wrong with an attribute value the checker lets through and onnx's C++ shape inference crashes the
    process on (a segmentation fault, an assertion), or None."""
    for attr in node.attribute:
        if node.op_type == "GatherND" and attr.name == "batch_dims" and attr.i < 0:
            return f"has batch_dims {attr.i}; it must be non-negative"
        if node.op_type == "Split" and attr.name == "num_outputs" and attr.i != len(node.output):
            return f"has num_outputs {attr.i} but {len(node.output)} output(s); they must be equal"
    return None


def _check_arity(onnx: Any, model: Any, opset: int, path: str) -> None:
    """Each default-domain node of the main graph has as many inputs and outputs as its operator's schema at
    `opset` allows, and attributes of the schema's types (an operator without a schema is left to its converter,
    which reports it)."""
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            continue
        inputs, outputs = len(node.input), len(node.output)
        if not schema.min_input <= inputs <= schema.max_input or not schema.min_output <= outputs <= schema.max_output:
            raise IRError(f"not a valid ONNX model: node '{node.name}' ({node.op_type}) has {inputs} input(s) and "
                          f"{outputs} output(s); its schema takes {schema.min_input}-{schema.max_input} and "
                          f"{schema.min_output}-{schema.max_output}", file=path)
        for attr in node.attribute:
            spec = schema.attributes.get(attr.name)
            if spec is not None and attr.type != spec.type.value:
                raise IRError(f"not a valid ONNX model: attribute '{attr.name}' of node '{node.name}' "
                              f"({node.op_type}) is of type {onnx.AttributeProto.AttributeType.Name(attr.type)}; "
                              f"its schema says {spec.type.name}", file=path)


def _without_external_data(onnx: Any, model: Any) -> None:
    """`model` (a copy) with each external initializer turned into a graph input of its type and dims, and each
    external Constant value into an empty tensor: what the checker reads of them is then in the protobuf."""
    names = {i.name for i in model.graph.input}
    kept = []
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            kept.append(t)
        elif t.name not in names:
            model.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.HasField("t") and attr.t.data_location == onnx.TensorProto.EXTERNAL:
                attr.t.CopyFrom(onnx.helper.make_tensor(attr.t.name, onnx.TensorProto.FLOAT, [0], []))


def _all_initializers(model: Any) -> List[Any]:
    out = list(model.graph.initializer)
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                out.append(attr.t)
    return out


def default_opset(model: Any) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 0


def upgrade_opset(model: Any) -> Tuple[Any, str]:
    """A model older than MIN_OPSET upgraded to it with onnx.version_converter (model zoos still ship opset 7-9
    files, and the converters here read opset 11+ semantics): (model, '') or (model, why it cannot be upgraded). A
    model without a default-domain opset is returned as it is (`check_opset` names the domain)."""
    version = default_opset(model)
    if version >= MIN_OPSET or version == 0:
        return model, ""
    from onnx import version_converter
    try:
        return version_converter.convert_version(model, MIN_OPSET), ""
    except Exception as e:  # the converter raises C++ errors of several types; each is reported, none is kept
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first.rsplit(": ", 1)[-1]  # drop the C++ source location
        return model, f"onnx.version_converter cannot upgrade opset {version} to {MIN_OPSET} ({first[:100]})"


def check_opset(model: Any, path: str) -> None:
    version = default_opset(model)
    if version > MAX_OPSET:
        from ...log import OPT_WARN
        OPT_WARN(f"{path}: ONNX opset {version} is newer than the supported range {MIN_OPSET}-{MAX_OPSET}; "
                 "importing it as if it were opset 21")
        return
    if not MIN_OPSET <= version <= MAX_OPSET:
        raise UnsupportedError(f"ONNX opset {version} is not supported (opsets {MIN_OPSET}-{MAX_OPSET} are; "
                               "convert the model with onnx.version_converter)", file=path)


def parse_input_shapes(specs: Optional[Sequence[str]]) -> Dict[str, List[int]]:
    """`name:1,3,224,224` strings (CLI / cfg) → {name: [1, 3, 224, 224]}; a lone `1,3,224,224` applies to the
    only input and is stored under the empty name."""
    shapes: Dict[str, List[int]] = {}
    for spec in specs or []:
        for part in str(spec).split(";"):
            part = part.strip()
            if not part:
                continue
            name, _, dims = part.rpartition(":")
            try:
                values = [int(d) for d in dims.replace("x", ",").split(",") if d.strip()]
            except ValueError:
                raise ConfigError(f"input shape '{part}' must be name:d0,d1,... with integer dims") from None
            if not values or any(v < 1 for v in values):
                raise ConfigError(f"input shape '{part}' must list positive integer dims")
            shapes[name.strip()] = values
    return shapes


def parse_input_values(specs: Optional[Sequence[str]]) -> Dict[str, List[float]]:
    """`name:v0,v1,...` strings (CLI / cfg `input_value`) → {name: [v0, v1, ...]}: inputs fixed to constants."""
    values: Dict[str, List[float]] = {}
    for spec in specs or []:
        for part in str(spec).split(";"):
            part = part.strip()
            if not part:
                continue
            name, sep, items = part.rpartition(":")
            try:
                numbers = [float(v) for v in items.split(",") if v.strip()]
            except ValueError:
                raise ConfigError(f"input value '{part}' must be name:v0,v1,... with numbers",
                                  field="input_value") from None
            if not sep or not name.strip() or not numbers:
                raise ConfigError(f"input value '{part}' must be name:v0,v1,...", field="input_value")
            values[name.strip()] = numbers
    return values


def pin_input_values(model: Any, values: Mapping[str, Sequence[float]], path: str) -> None:
    """Turn the named graph inputs into constants (initializers of their declared type and shape), so what depends
    on them folds away, e.g. an If on a sample-rate input."""
    if not values:
        return
    onnx = require_onnx()
    from onnx import numpy_helper

    init_names = {i.name for i in model.graph.initializer}
    inputs = {i.name: i for i in model.graph.input if i.name not in init_names}
    for name, numbers in values.items():
        if name not in inputs:
            raise ConfigError(f"input_value names '{name}', which is not an input of the model (inputs: "
                              f"{sorted(inputs)})", file=path)
        tt = inputs[name].type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
        np_dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        arr = np.asarray(numbers, dtype=np_dtype)
        count = int(np.prod(dims)) if dims and all(d > 0 for d in dims) else None
        if not dims:
            if arr.size != 1:
                raise ConfigError(f"input_value for scalar input '{name}' needs one value, got {arr.size}", file=path)
            arr = arr.reshape(())
        elif count is not None and arr.size == count:
            arr = arr.reshape(dims)
        elif len(dims) == 1:
            arr = arr.reshape(-1)
        else:
            raise ConfigError(f"input_value for '{name}' has {arr.size} value(s) but the input's shape is {dims}",
                              file=path)
        model.graph.initializer.append(numpy_helper.from_array(arr, name=name))
    kept = [i for i in model.graph.input if i.name not in values]
    del model.graph.input[:]
    model.graph.input.extend(kept)


def fix_input_shapes(model: Any, shapes: Mapping[str, Sequence[int]], path: str) -> None:
    """Write fixed shapes into the graph inputs; every remaining dynamic dim is an error naming the input."""
    init_names = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in init_names]
    shapes = dict(shapes)
    if "" in shapes:
        if len(inputs) != 1:
            raise ConfigError(f"an input shape without a name needs a model with one input, this one has "
                              f"{[i.name for i in inputs]}")
        shapes[inputs[0].name] = shapes.pop("")
    unknown = sorted(set(shapes) - {i.name for i in inputs})
    if unknown:
        raise ConfigError(f"input shape given for unknown input(s) {unknown}; the model's inputs are "
                          f"{[i.name for i in inputs]}")
    problems = []
    for inp in inputs:
        tt = inp.type.tensor_type
        dims = tt.shape.dim
        if inp.name in shapes:
            want = shapes[inp.name]
            if tt.HasField("shape") and len(dims) != len(want):
                raise ConfigError(f"input '{inp.name}' has rank {len(dims)}, the given shape {list(want)} has "
                                  f"rank {len(want)}")
            for d, v in zip(dims, want):
                if d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != v:
                    raise ConfigError(f"input '{inp.name}': given shape {list(want)} contradicts the model's "
                                      f"dim {d.dim_value}")
            del dims[:]
            for v in want:
                dims.add().dim_value = int(v)
            continue
        if not tt.HasField("shape"):
            problems.append(f"'{inp.name}' (unknown rank)")
        elif any(not (d.HasField("dim_value") and d.dim_value > 0) for d in dims):
            shown = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or "?")
                     for d in dims]
            problems.append(f"'{inp.name}' {shown}")
    if problems:
        raise ConfigError(f"dynamic input shape(s) {', '.join(problems)}: give fixed shapes with "
                          "--input-shape name:d0,d1,... (or the cfg's input_shape)", file=path)
    for inp in inputs:
        shape = [int(d.dim_value) for d in inp.type.tensor_type.shape.dim]
        if math.prod(shape) >= MAX_ELEMENTS:
            raise UnsupportedError(f"input '{inp.name}' of shape {shape} holds {math.prod(shape)} values; quantopt "
                                   f"takes tensors of fewer than 2^{MAX_ELEMENTS.bit_length() - 1} (as the IR reader)",
                                   file=path)
