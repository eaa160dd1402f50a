"""Compass IR reader: `.txt` sections + mmap'd `.bin` constants → a finalized graph.

Every error names the file and line. Float32 constants are zero-copy views of a copy-on-write mapping of the
.bin, so a large model is not held in memory twice.
"""
from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Type

import numpy as np
import torch

from ..errors import IRError, UnsupportedError
from ..graph.graph import PyGraph, QuantizeGraph
from ..graph.node import PyNode
from ..graph.optype import OpType, register_optype
from ..graph.tensor import PyTensor
from ..log import OPT_WARN
from .dtype import Dtype, decode_storage, dtype_from_name
from .grammar import GrammarError, parse_names, parse_value

STRUCTURAL_KEYS = ("layer_id", "layer_name", "layer_type", "layer_bottom", "layer_bottom_shape", "layer_bottom_type",
                   "layer_top", "layer_top_shape", "layer_top_type")
TOP_INFO_KEYS = ("layer_top_range", "layer_top_scale", "layer_top_zp")
CONSTANT_SUFFIXES = ("_type", "_offset", "_size", "_shape")


@dataclass
class Line:
    number: int
    key: str
    raw: str


Section = "OrderedDict[str, Line]"


def _split_sections(text: str, path: str) -> List[OrderedDict[str, Line]]:
    sections: List[OrderedDict[str, Line]] = []
    current: Optional[OrderedDict[str, Line]] = None
    for number, raw_line in enumerate(text.splitlines(), start=1):
        line = raw_line.strip()
        if not line:
            current = None
            continue
        if line.startswith("#"):
            continue
        if "=" not in line:
            raise IRError(f"malformed line '{_clip(line)}': expected key=value", file=path, line=number)
        key, value = line.split("=", 1)
        key = key.strip()
        if not key or not all(c.isalnum() or c in "_./:-" for c in key):
            raise IRError(f"malformed key '{_clip(key)}' in line '{_clip(line)}'", file=path, line=number)
        if current is None:
            current = OrderedDict()
            sections.append(current)
        if key in current:
            raise IRError(f"duplicate key '{key}' in one section (first at line {current[key].number})",
                          file=path, line=number)
        current[key] = Line(number, key, value.strip())
    return sections


def _clip(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


class _SectionReader:
    """Typed access to one section's lines with file:line errors."""

    def __init__(self, section: OrderedDict[str, Line], path: str, what: str) -> None:
        self.section = section
        self.path = path
        self.what = what
        self.first_line = next(iter(section.values())).number if section else 0

    def has(self, key: str) -> bool:
        return key in self.section

    def line(self, key: str) -> int:
        return self.section[key].number if key in self.section else self.first_line

    def error(self, key: Optional[str], message: str) -> IRError:
        return IRError(f"{self.what}: {message}", file=self.path, line=self.line(key) if key else self.first_line)

    def require(self, key: str) -> Line:
        if key not in self.section:
            raise self.error(None, f"missing required key '{key}'")
        return self.section[key]

    def value(self, key: str) -> Any:
        ln = self.require(key)
        try:
            return parse_value(ln.raw)
        except GrammarError as e:
            raise IRError(f"{self.what}: bad value for '{key}': {e}", file=self.path, line=ln.number) from None

    def names(self, key: str, required: bool = True) -> List[str]:
        if key not in self.section and not required:
            return []
        ln = self.require(key)
        try:
            v = parse_names(ln.raw)
        except GrammarError as e:
            raise IRError(f"{self.what}: bad name list for '{key}': {e}", file=self.path, line=ln.number) from None
        if isinstance(v, str):
            return [v] if v else []
        if any(not isinstance(x, str) for x in v):
            raise self.error(key, f"'{key}' must be a flat list of names")
        return v

    def integer(self, key: str) -> int:
        v = self.value(key)
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.error(key, f"'{key}' must be an integer, got '{self.section[key].raw}'")
        return v

    def shapes(self, key: str, count: int) -> List[Tuple[int, ...]]:
        v = self.value(key) if key in self.section else []
        if not isinstance(v, list) or any(not isinstance(s, list) for s in v):
            raise self.error(key, f"'{key}' must be a list of shapes like [[1,224,224,3]]")
        for s in v:
            if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in s):
                raise self.error(key, f"'{key}' has a non-integer or negative dimension in {s}")
        if len(v) != count:
            raise self.error(key, f"'{key}' lists {len(v)} shape(s) but the layer has {count} tensor(s)")
        return [tuple(s) for s in v]

    def dtypes(self, key: str, count: int) -> List[Dtype]:
        raw = self.names(key, required=True) if key in self.section else []
        out = []
        for name in raw:
            d = dtype_from_name(name)
            if d is None:
                raise self.error(key, f"unknown dtype '{name}' in '{key}'")
            out.append(d)
        if len(out) != count:
            raise self.error(key, f"'{key}' lists {len(out)} dtype(s) but the layer has {count} tensor(s)")
        return out


class _BinFile:
    """The .bin mapped copy-on-write: constants are views, nothing is read until touched."""

    def __init__(self, path: str) -> None:
        self.path = path
        if not os.path.isfile(path):
            raise IRError("binary file not found", file=path)
        self.size = os.path.getsize(path)
        self._mm: Any = b""
        if self.size:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def array(self, offset: int, count: int, dtype: Dtype) -> np.ndarray:
        return np.frombuffer(self._mm, dtype=dtype.storage, count=count, offset=offset)


def _constant_stems(section: OrderedDict[str, Line]) -> List[str]:
    stems = []
    for key in section:
        if key.endswith("_offset"):
            stem = key[: -len("_offset")]
            if all(stem + s in section for s in CONSTANT_SUFFIXES):
                stems.append(stem)
    return stems


def _load_constants(sr: _SectionReader, stem: str, bin_file: _BinFile, layer_name: str
                    ) -> List[Tuple[str, PyTensor, int]]:
    """(node key, tensor, offset) for the constant(s) described by `stem_type/_offset/_size/_shape`."""
    types = sr.value(stem + "_type")
    offsets = sr.value(stem + "_offset")
    sizes = sr.value(stem + "_size")
    shapes = sr.value(stem + "_shape")
    multi = isinstance(types, list)
    if multi:
        if not (isinstance(offsets, list) and isinstance(sizes, list) and isinstance(shapes, list)
                and len(types) == len(offsets) == len(sizes) == len(shapes)):
            raise sr.error(stem + "_type", f"constant '{stem}': list-valued _type needs equally long "
                                           f"_offset/_size/_shape lists")
        entries = [(f"{stem}_{i}", types[i], offsets[i], sizes[i], shapes[i]) for i in range(len(types))]
    else:
        entries = [(stem, types, offsets, sizes, shapes)]
    out = []
    for key, dt, off, size, shape in entries:
        dtype = dt if isinstance(dt, Dtype) else dtype_from_name(str(dt))
        if dtype is None:
            raise sr.error(stem + "_type", f"unknown dtype '{dt}' for constant '{stem}'")
        for nm, v in ((stem + "_offset", off), (stem + "_size", size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise sr.error(nm, f"'{nm}' must be a non-negative integer, got '{v}'")
        if not isinstance(shape, list) or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise sr.error(stem + "_shape", f"'{stem}_shape' must be a list of non-negative integers, got {shape}")
        numel = int(np.prod(shape)) if shape else 1
        expected = numel * dtype.itemsize
        if expected != size:
            raise sr.error(stem + "_size", f"constant '{stem}': size {size} bytes does not match shape {shape} of "
                                           f"{dtype.value} ({expected} bytes)")
        if off + size > bin_file.size:
            raise sr.error(stem + "_offset", f"constant '{stem}' spans bytes [{off}, {off + size}) but "
                                             f"{bin_file.path} has only {bin_file.size} bytes")
        raw = bin_file.array(off, numel, dtype).reshape(shape)
        tensor = PyTensor(layer_name + key, decode_storage(raw, dtype), dtype, shape)
        out.append((key, tensor, off))
    return out


def read_ir(txt_path: str, bin_path: Optional[str] = None, graph_cls: Type[PyGraph] = QuantizeGraph) -> PyGraph:
    """Parse a Compass IR. `bin_path` defaults to the header's `model_bin`, else `<txt stem>.bin`."""
    txt_path = str(txt_path)
    if not os.path.isfile(txt_path):
        raise IRError("graph file not found", file=txt_path)
    try:
        with open(txt_path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise IRError(f"not a text IR file (undecodable byte at offset {e.start})", file=txt_path) from None
    sections = _split_sections(text, txt_path)
    if not sections:
        raise IRError("empty IR file", file=txt_path)
    header = _SectionReader(sections[0], txt_path, "header")
    if header.has("layer_type") or header.has("layer_id"):
        raise header.error(None, "the first section must be the header (model_name, input_tensors, ...), "
                                 "not a layer")
    for sec in sections:
        if "subgraph_name" in sec:
            raise UnsupportedError("subgraph sections (subgraph_name=..., used by If/Loop bodies) are not "
                                   "supported yet", file=txt_path, line=sec["subgraph_name"].number)
    if bin_path is None:
        base = os.path.dirname(os.path.abspath(txt_path))
        if header.has("model_bin"):
            bin_path = os.path.join(base, header.section["model_bin"].raw)
        else:
            bin_path = os.path.splitext(txt_path)[0] + ".bin"
    bin_file = _BinFile(str(bin_path))

    graph = graph_cls(str(parse_names(header.section["model_name"].raw)) if header.has("model_name") else "model")
    graph.source_file = txt_path
    graph._storage = bin_file
    for key, ln in header.section.items():
        if key in ("input_tensors", "output_tensors", "model_name"):
            graph.header[key] = parse_names(ln.raw) if ln.raw.startswith("[") else ln.raw
        else:
            try:
                graph.header[key] = parse_value(ln.raw)
            except GrammarError as e:
                raise IRError(f"header: bad value for '{key}': {e}", file=txt_path, line=ln.number) from None
    layers = sections[1:]
    if header.has("layer_number"):
        declared = header.integer("layer_number")
        if declared != len(layers):
            raise header.error("layer_number", f"layer_number={declared} but the file has {len(layers)} layer "
                                               f"section(s)")
    for sec in layers:
        graph.add_node(_read_layer(sec, txt_path, bin_file))
    graph.finalize(file=txt_path)
    _check_bottom_shapes(graph, txt_path)
    _mark_quantized(graph)
    inputs, outputs = _io_names(graph, header)
    produced = graph.tensors()
    for key, names in (("input_tensors", inputs), ("output_tensors", outputs)):
        unknown = [nm for nm in names if nm not in produced]
        if unknown:
            raise IRError(f"{key} names tensor '{unknown[0]}' that no layer produces", file=txt_path,
                          line=header.line(key) if header.has(key) else None)
    graph.set_io(inputs, outputs, file=txt_path)
    return graph


def _read_layer(sec: OrderedDict[str, Line], path: str, bin_file: _BinFile) -> PyNode:
    first = next(iter(sec.values())).number
    probe = _SectionReader(sec, path, f"layer section at line {first}")
    name = probe.require("layer_name").raw
    sr = _SectionReader(sec, path, f"layer '{name}'")
    layer_id = sr.integer("layer_id")
    type_name = sr.require("layer_type").raw
    try:
        optype = OpType.lookup(type_name)
    except KeyError:
        try:
            optype = register_optype(type_name)
        except ValueError:
            raise sr.error("layer_type", f"invalid layer_type '{type_name}'") from None
    node = PyNode(name, optype, layer_id)
    node.source = (path, sr.line("layer_id"))
    bottoms = sr.names("layer_bottom")
    tops = sr.names("layer_top")
    if not tops:
        raise sr.error("layer_top", "a layer must produce at least one tensor (layer_top is empty)")
    top_shapes = sr.shapes("layer_top_shape", len(tops))
    top_types = sr.dtypes("layer_top_type", len(tops))
    bottom_shapes = sr.shapes("layer_bottom_shape", len(bottoms)) if sr.has("layer_bottom_shape") else None
    bottom_types = sr.dtypes("layer_bottom_type", len(bottoms)) if sr.has("layer_bottom_type") else None
    node.attrs["ir_bottom_shapes"] = bottom_shapes
    node.attrs["ir_bottom_types"] = bottom_types
    node.inputs = [PyTensor(b) for b in bottoms]
    node.outputs = [PyTensor(t, dtype=dt, shape=s) for t, s, dt in zip(tops, top_shapes, top_types)]

    consumed = set(STRUCTURAL_KEYS)
    order: List[str] = []
    stems = _constant_stems(sec)
    constants: List[Tuple[str, PyTensor, int, str]] = []
    for stem in stems:
        consumed.update(stem + s for s in CONSTANT_SUFFIXES)
        for key, tensor, off in _load_constants(sr, stem, bin_file, name):
            constants.append((key, tensor, off, stem))
    raw_params: Dict[str, str] = {}
    stem_first_line = {stem: min(sec[stem + s].number for s in CONSTANT_SUFFIXES) for stem in stems}
    for key, ln in sec.items():
        if key in STRUCTURAL_KEYS:
            continue
        stem = next((s for s in stems if key in (s + x for x in CONSTANT_SUFFIXES)), None)
        if stem is not None:
            if stem_first_line[stem] == ln.number:
                order.append(stem)
            continue
        order.append(key)
        if key in TOP_INFO_KEYS:
            _apply_top_info(sr, node, key)
            continue
        node.params[key] = sr.value(key)
        raw_params[key] = ln.raw
    # constants in bin-offset order (the writer lays them out sequentially in this order)
    groups: Dict[str, List[str]] = {}
    for key, tensor, _offset, stem in sorted(constants, key=lambda c: c[2]):
        if stem in TOP_INFO_KEYS:
            _apply_top_constant(sr, node, stem, tensor)
            continue
        node.constants[key] = tensor
        if key != stem:
            groups.setdefault(stem, []).append(key)
        rng = node.params.get(stem + "_range")
        if isinstance(rng, list) and len(rng) == 2:
            tensor.ir_range = rng
    node.attrs["ir_key_order"] = order
    node.attrs["ir_raw_params"] = raw_params
    node.attrs["ir_constant_groups"] = groups
    node.attrs["ir_top_keys"] = [k for k in TOP_INFO_KEYS if k in order]
    return node


def _apply_top_info(sr: _SectionReader, node: PyNode, key: str) -> None:
    v = sr.value(key)
    if not isinstance(v, list) or len(v) != len(node.outputs):
        raise sr.error(key, f"'{key}' must list one entry per output ({len(node.outputs)})")
    for t, item in zip(node.outputs, v):
        if key == "layer_top_range":
            if not (isinstance(item, list) and len(item) == 2):
                raise sr.error(key, f"'{key}' entries must be [min,max] pairs")
            t.ir_range = item
        elif key == "layer_top_scale":
            t.scale = item
        else:
            t.zerop = item


def _apply_top_constant(sr: _SectionReader, node: PyNode, stem: str, tensor: PyTensor) -> None:
    if len(node.outputs) != 1:
        raise sr.error(stem + "_offset", f"bin-stored '{stem}' is only supported for single-output layers")
    out = node.outputs[0]
    if stem == "layer_top_scale":
        out.scale = tensor.betensor
    elif stem == "layer_top_zp":
        out.zerop = tensor.betensor
    else:
        out.ir_range = tensor.betensor.tolist()
    node.attrs.setdefault("ir_top_constant_dtypes", {})[stem] = tensor.dtype


def _mark_quantized(graph: PyGraph) -> None:
    """Layers of a quantized IR (integer outputs with `layer_top_scale`, not `unquantifiable`) run their integer
    forward: their outputs get qmin/qmax from `layer_top_range` and qbits from the dtype."""
    for n in graph.nodes:
        if "layer_top_scale" not in n.attrs.get("ir_top_keys", []) or n.params.get("unquantifiable") is True:
            continue
        if not n.outputs or any(t.dtype.is_float for t in n.outputs):
            continue
        n.quantized = True
        for t in n.outputs:
            rng = t.ir_range if t.ir_range is not None else list(t.dtype.int_range())
            t.qmin, t.qmax = int(rng[0]), int(rng[1])
            t.qbits = t.dtype.bits
            t.qinvariant = not isinstance(t.scale, torch.Tensor) and float(t.scale) == 1.0 and float(t.zerop) == 0.0
        for t in n.constants.values():
            if not t.dtype.is_float:
                t.qbits = t.dtype.bits


def _check_bottom_shapes(graph: PyGraph, path: str) -> None:
    for n in graph.nodes:
        shapes = n.attrs.get("ir_bottom_shapes")
        if shapes is None:
            continue
        for t, s in zip(n.inputs, shapes):
            if tuple(t.ir_shape) != tuple(s):
                raise IRError(f"layer '{n.name}': layer_bottom_shape {list(s)} of '{t.name}' differs from the "
                              f"producer's layer_top_shape {list(t.ir_shape)}", file=path,
                              line=n.source[1] if n.source else None)


def _io_names(graph: PyGraph, header: _SectionReader) -> Tuple[List[str], List[str]]:
    if header.has("input_tensors"):
        inputs = header.names("input_tensors")
    else:
        inputs = [t.name for n in graph.nodes if n.type == "Input" for t in n.outputs]
        OPT_WARN(f"{header.path}: header has no input_tensors; using the Input layers' outputs {inputs}")
    if header.has("output_tensors"):
        outputs = header.names("output_tensors")
    else:
        consumed = {t.name for n in graph.nodes for t in n.inputs}
        outputs = [t.name for n in graph.nodes for t in n.outputs if t.name not in consumed]
        OPT_WARN(f"{header.path}: header has no output_tensors; using the unconsumed tensors {outputs}")
    return inputs, outputs
