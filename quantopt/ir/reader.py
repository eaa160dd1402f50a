"""Compass IR reader: `.txt` sections + mmap'd `.bin` constants → a finalized graph.

Every error names the file and line. Float32 constants are zero-copy views of a copy-on-write mapping of the
.bin, so a large model is not held in memory twice.
"""
from __future__ import annotations

import math
import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple, Type

import numpy as np
import torch

from ..errors import IRError
from ..graph.graph import PyGraph, QuantizeGraph
from ..graph.node import PyNode
from ..graph.tables import quant_of
from ..graph.tensor import MAX_RANK, PyTensor
from ..log import OPT_WARN
from ..quant.dtype import Dtype, decode_storage, dtype_from_name
from ..registry import load_builtin_operators
from ..registry.known_keys import (
    INT_LIMIT,
    STRUCTURAL_KEYS,
    TOP_INFO_KEYS,
    is_builtin,
    is_known,
    known_keys,
    param_problem,
    schema_of,
    suggestion,
)
from ..registry.optype import OpType, register_optype
from .grammar import GrammarError, parse_names, parse_value

CONSTANT_SUFFIXES = ("_type", "_offset", "_size", "_shape")
MAX_ELEMENTS = 2 ** 40
"""Bound of a tensor's element count (4 TiB of float32): a larger IR shape is a corrupted one."""
__all__ = ["read_ir", "attach_subgraphs", "SUBGRAPH_KEYS", "STRUCTURAL_KEYS", "TOP_INFO_KEYS", "CONSTANT_SUFFIXES"]


@dataclass
class Line:
    number: int
    key: str
    raw: str


Section = "OrderedDict[str, Line]"


def _split_sections(text: str, path: str) -> List[OrderedDict[str, Line]]:
    sections: List[OrderedDict[str, Line]] = []
    current: Optional[OrderedDict[str, Line]] = None
    for number, raw_line in enumerate(text.split("\n"), start=1):  # \n only: line numbers as editors count
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
            if len(s) > MAX_RANK:
                raise self.error(key, f"'{key}' holds a tensor of {len(s)} dims {s}; at most {MAX_RANK} are supported")
            if any(d >= INT_LIMIT for d in s) or math.prod(s) >= MAX_ELEMENTS:
                raise self.error(key, f"'{key}' holds an impossible tensor shape {s} (dimensions must be below 2^31 "
                                      f"and tensors hold fewer than 2^40 elements)")
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
        self._mm: Any = b""
        try:
            self.size = os.path.getsize(path)
            if self.size:
                with open(path, "rb") as f:
                    self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:  # unreadable, or changed size while being mapped
            raise IRError(f"cannot read the binary file: {e.__class__.__name__}: {e}", file=path) from None

    def array(self, offset: int, count: int, dtype: Dtype) -> np.ndarray:
        return np.frombuffer(self._mm, dtype=dtype.storage, count=count, offset=offset)

    def nonfinite_float32(self, offset: int, count: int, nan_only: bool = False) -> Tuple[int, int]:
        """(number of NaN/inf values, or NaN only, flat index of the first) of a float32 constant, read through a
        plain file in small chunks rather than the mapping: the check must not fault the whole model into this
        process's memory (the mapping stays lazy, docs/ir-format.md section 7)."""
        bad, first, done = 0, -1, 0
        buf = np.empty(min(count, _CHECK_CHUNK), dtype="<f4")
        with open(self.path, "rb") as f:
            f.seek(offset)
            while done < count:
                n = min(count - done, _CHECK_CHUNK)
                chunk = buf[:n]
                if f.readinto(chunk.view(np.uint8)) != n * 4:
                    raise IRError(f"the binary file is shorter than {offset + (done + n) * 4} bytes (did it change "
                                  f"while being read?)", file=self.path)
                finite = ~np.isnan(chunk) if nan_only else np.isfinite(chunk)
                if not finite.all():
                    hits = n - int(finite.sum())
                    if first < 0:
                        first = done + int(np.argmin(finite))
                    bad += hits
                done += n
        return bad, first


_CHECK_CHUNK = 1 << 18
"""float32 values per read of the NaN/inf check (1 MiB)."""


@dataclass
class _Layout:
    """Every constant's byte span, to check alignment once the whole file is read: upstream packs constants with
    no padding (an int32 after 3 int8 weights sits at offset 3), so a misaligned offset is accepted only where it
    directly follows another constant; anywhere else it is a typo or a corrupted offset."""

    ends: Set[int] = field(default_factory=lambda: {0})
    misaligned: List[Tuple[int, IRError]] = field(default_factory=list)


def _constant_stems(section: OrderedDict[str, Line], sr: _SectionReader) -> List[str]:
    """Stems with all four of `X_type/_offset/_size/_shape`; a stem with `X_offset`, or two of the others, but not
    all four is an error (upstream would silently read its keys as parameters and drop the constant)."""
    stems = []
    seen = set()
    for key in section:
        for suffix in CONSTANT_SUFFIXES:
            if key.endswith(suffix) and len(key) > len(suffix):
                stem = key[: -len(suffix)]
                if stem in seen:
                    continue
                seen.add(stem)
                present = [x for x in CONSTANT_SUFFIXES if stem + x in section]
                if len(present) == len(CONSTANT_SUFFIXES):
                    stems.append(stem)
                elif "_offset" in present or len(present) >= 2 and "_size" in present:
                    missing = [stem + x for x in CONSTANT_SUFFIXES if x not in present]
                    raise sr.error(stem + present[0], f"constant '{stem}' misses "
                                                      f"{' and '.join(repr(m) for m in missing)} (a constant needs "
                                                      f"{stem}_type, _offset, _size and _shape)")
    return stems


def _load_constants(sr: _SectionReader, stem: str, bin_file: _BinFile, layer_name: str, layout: _Layout,
                    allow_inf: bool = False) -> List[Tuple[str, PyTensor, int]]:
    """(node key, tensor, offset) for the constant(s) described by `stem_type/_offset/_size/_shape`. NaN is always
    refused; ±inf only where `allow_inf` is false (a Constant layer may hold an attention mask of -inf)."""
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
        if not types:
            raise sr.error(stem + "_type", f"constant '{stem}': list-valued _type is empty")
        entries = [(f"{stem}_{i}", types[i], offsets[i], sizes[i], shapes[i]) for i in range(len(types))]
    else:
        entries = [(stem, types, offsets, sizes, shapes)]
    out = []
    for key, dt, off, size, shape in entries:
        dtype = dt if isinstance(dt, Dtype) else dtype_from_name(str(dt)) if isinstance(dt, str) else None
        if dtype is None:
            raise sr.error(stem + "_type", f"unknown dtype '{dt}' for constant '{stem}'")
        for nm, v in ((stem + "_offset", off), (stem + "_size", size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise sr.error(nm, f"'{nm}' must be a non-negative integer, got '{v}'")
        if not isinstance(shape, list) or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise sr.error(stem + "_shape", f"'{stem}_shape' must be a list of non-negative integers, got {shape}")
        numel = math.prod(shape)  # Python integers: a huge shape cannot wrap around
        itemsize = dtype.itemsize
        if size % itemsize:
            raise sr.error(stem + "_size", f"constant '{stem}': size {size} bytes is not a multiple of the "
                                           f"{itemsize}-byte {dtype.value}")
        expected = numel * itemsize
        if expected != size:
            raise sr.error(stem + "_size", f"constant '{stem}': size {size} bytes does not match shape {shape} of "
                                           f"{dtype.value} ({expected} bytes)")
        if off + size > bin_file.size:
            raise sr.error(stem + "_offset", f"constant '{stem}' spans bytes [{off}, {off + size}) but "
                                             f"{bin_file.path} has only {bin_file.size} bytes")
        if off % itemsize:
            layout.misaligned.append((off, sr.error(
                stem + "_offset", f"constant '{stem}': offset {off} is not a multiple of the {itemsize}-byte "
                                  f"{dtype.value} and does not follow another constant (a corrupted offset?)")))
        layout.ends.add(off + size)
        raw = bin_file.array(off, numel, dtype).reshape(shape)
        values = decode_storage(raw, dtype)
        if dtype.is_float and numel:
            if dtype is Dtype.FP32:  # a view of the mapping: checked without touching it
                count, first = bin_file.nonfinite_float32(off, numel, nan_only=allow_inf)
            else:  # decoded into a new tensor already
                bad = (torch.isnan(values) if allow_inf else ~torch.isfinite(values)).reshape(-1)
                count = int(bad.sum())
                first = int(bad.nonzero()[0]) if count else -1
            if count:
                what = "NaN" if allow_inf else "NaN/inf"
                raise sr.error(stem + "_offset", f"constant '{key}' holds {count} {what} value(s) (first at flat "
                                                 f"index {first}) in {bin_file.path}")
        tensor = PyTensor(layer_name + key, values, dtype, shape)
        out.append((key, tensor, off))
    return out


def _header_value(header: _SectionReader, key: str, names: bool) -> Any:
    ln = header.section[key]
    try:
        return parse_names(ln.raw) if names else parse_value(ln.raw)
    except GrammarError as e:
        raise IRError(f"header: bad value for '{key}': {e}", file=header.path, line=ln.number) from None


def read_ir(txt_path: str, bin_path: Optional[str] = None, graph_cls: Type[PyGraph] = QuantizeGraph,
            allow_unknown_keys: bool = False) -> PyGraph:
    """Parse a Compass IR. `bin_path` defaults to the header's `model_bin`, else `<txt stem>.bin`.

    A layer key its operator type does not know (quantopt/registry/known_keys.py) is an error unless
    `allow_unknown_keys` (the cfg field `allow_unknown_ir_keys`, `quantopt run --allow-unknown-ir-keys`)."""
    txt_path = str(txt_path)
    if not os.path.isfile(txt_path):
        raise IRError("graph file not found", file=txt_path)
    load_builtin_operators()  # their declarations say which keys each type's layers may carry
    try:
        with open(txt_path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise IRError(f"not a text IR file (undecodable byte at offset {e.start})", file=txt_path) from None
    except OSError as e:
        raise IRError(f"cannot read the graph file: {e.__class__.__name__}: {e.strerror or e}", file=txt_path) \
            from None
    sections = _split_sections(text, txt_path)
    if not sections:
        raise IRError("empty IR file", file=txt_path)
    header = _SectionReader(sections[0], txt_path, "header")
    if header.has("layer_type") or header.has("layer_id"):
        raise header.error(None, "the first section must be the header (model_name, input_tensors, ...), "
                                 "not a layer")
    sections, subgraph_sections = _split_subgraphs(sections, txt_path)
    if bin_path is None:
        base = os.path.dirname(os.path.abspath(txt_path))
        if header.has("model_bin"):
            bin_path = os.path.join(base, header.section["model_bin"].raw)
        else:
            bin_path = os.path.splitext(txt_path)[0] + ".bin"
    bin_file = _BinFile(str(bin_path))

    model_name = _header_value(header, "model_name", names=True) if header.has("model_name") else "model"
    if not isinstance(model_name, str) or not model_name:
        raise header.error("model_name", "'model_name' must be a non-empty name")
    graph = graph_cls(model_name)
    graph.source_file = txt_path
    graph._storage = bin_file
    for key, ln in header.section.items():
        if key in ("input_tensors", "output_tensors", "model_name"):
            graph.header[key] = _header_value(header, key, names=True) if ln.raw.startswith("[") else ln.raw
        else:
            graph.header[key] = _header_value(header, key, names=False)
    layers = sections[1:]
    if header.has("layer_number"):
        declared = header.integer("layer_number")
        if declared != len(layers):
            raise header.error("layer_number", f"layer_number={declared} but the file has {len(layers)} layer "
                                               f"section(s)")
    layout = _Layout()
    _add_layers(graph, layers, txt_path, bin_file, layout, allow_unknown_keys)
    subgraphs = [_read_subgraph(head, body, txt_path, bin_file, layout, allow_unknown_keys)
                 for head, body in subgraph_sections]
    for offset, error in layout.misaligned:
        if offset not in layout.ends:
            raise error
    _finish_graph(graph, header, txt_path)
    if subgraphs:
        attach_subgraphs(graph, subgraphs, txt_path)
    return graph


def _add_layers(graph: PyGraph, layers: List[OrderedDict[str, Line]], txt_path: str, bin_file: _BinFile,
                layout: _Layout, allow_unknown_keys: bool) -> None:
    ids: Dict[int, PyNode] = {}
    for sec in layers:
        node = _read_layer(sec, txt_path, bin_file, layout, allow_unknown_keys)
        if node.layer_id in ids:
            first = ids[node.layer_id]
            raise IRError(f"layer '{node.name}': layer_id {node.layer_id} is already used by layer '{first.name}' "
                          f"at line {first.source[1] if first.source else '?'}", file=txt_path,
                          line=node.source[1] if node.source else None)
        ids[node.layer_id] = node
        graph.add_node(node)


def _finish_graph(graph: PyGraph, header: _SectionReader, txt_path: str) -> None:
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


def _split_subgraphs(sections: List[OrderedDict[str, Line]], path: str) -> Tuple[
        List[OrderedDict[str, Line]], List[Tuple[OrderedDict[str, Line], List[OrderedDict[str, Line]]]]]:
    """(the root graph's sections, [(subgraph header, its layer sections)]): a section with `subgraph_name` starts
    a subgraph (an If branch, a Loop body) whose `layer_number` following sections are its layers
    (docs/ir-format.md, "Subgraph sections")."""
    root: List[OrderedDict[str, Line]] = []
    subs: List[Tuple[OrderedDict[str, Line], List[OrderedDict[str, Line]]]] = []
    i = 0
    while i < len(sections):
        sec = sections[i]
        if "subgraph_name" not in sec:
            root.append(sec)
            i += 1
            continue
        name = sec["subgraph_name"].raw
        sr = _SectionReader(sec, path, f"subgraph header '{name}'")
        if not name:
            raise sr.error("subgraph_name", "'subgraph_name' is empty")
        if i == 0:
            raise sr.error("subgraph_name", "the file starts with a subgraph; the root graph's header comes first")
        for key in ("layer_type", "layer_id"):
            if sr.has(key):
                raise sr.error("subgraph_name", f"a subgraph header holds '{key}' (a layer's key): a blank line is "
                                                f"missing between the header and its first layer?")
        for key in ("layer_number", "input_tensors", "output_tensors"):
            sr.require(key)
        count = sr.integer("layer_number")
        if count < 1 or i + count >= len(sections):
            raise sr.error("layer_number", f"layer_number={count} but {len(sections) - i - 1} section(s) follow "
                                           f"the subgraph header")
        body = sections[i + 1: i + 1 + count]
        for b in body:
            if "subgraph_name" in b:
                raise IRError(f"subgraph '{name}' declares layer_number={count} but another subgraph starts "
                              f"among its layers", file=path, line=b["subgraph_name"].number)
            if "layer_type" not in b:
                raise IRError(f"subgraph '{name}': a section without layer_type among its {count} layer(s) "
                              f"(layer_number too large?)", file=path, line=next(iter(b.values())).number)
        subs.append((sec, body))
        i += 1 + count
    return root, subs


def _read_subgraph(head: OrderedDict[str, Line], body: List[OrderedDict[str, Line]], path: str, bin_file: _BinFile,
                   layout: _Layout, allow_unknown_keys: bool) -> PyGraph:
    """One subgraph as a PyGraph of its own (its names are its own: a subgraph may reuse the root's tensor names)."""
    sr = _SectionReader(head, path, f"subgraph header '{head['subgraph_name'].raw}'")
    sub = PyGraph(head["subgraph_name"].raw)
    sub.source_file = path
    sub._storage = bin_file
    sub.header["subgraph_name"] = sub.name
    for key in head:
        if key != "subgraph_name":
            sub.header[key] = _header_value(sr, key, names=key in ("input_tensors", "output_tensors"))
    _add_layers(sub, body, path, bin_file, layout, allow_unknown_keys)
    _finish_graph(sub, sr, path)
    sub.ir_line = head["subgraph_name"].number  # type: ignore[attr-defined]  # the writer keeps the file's order
    return sub


SUBGRAPH_KEYS = ("then_branch", "else_branch", "body")
"""Layer parameters that name a subgraph (If: then_branch/else_branch, Loop: body)."""


def attach_subgraphs(graph: PyGraph, subgraphs: List[PyGraph], path: Optional[str] = None) -> None:
    """Attach every subgraph to the layer(s) naming it (`node.attrs["subgraphs"]`: parameter -> PyGraph); a
    subgraph's own layers may name others (nested control flow). A name that no subgraph has, a subgraph no layer
    uses, or a subgraph that (through its layers) contains itself is an IRError."""
    by_name: Dict[str, PyGraph] = {}
    for sub in subgraphs:
        if sub.name in by_name:
            raise IRError(f"two subgraphs are named '{sub.name}'", file=path, line=getattr(sub, "ir_line", None))
        by_name[sub.name] = sub
    used: Set[str] = set()
    for g in [graph] + subgraphs:
        for n in g.nodes:
            found = OrderedDict()
            for key in SUBGRAPH_KEYS:
                if key not in n.params:
                    continue
                value = n.params[key]
                if not isinstance(value, str) or value not in by_name:
                    raise n._error(f"parameter '{key}={value}' names no subgraph of this IR (subgraphs: "
                                   f"{sorted(by_name) or 'none'})")
                found[key] = by_name[value]
                used.add(value)
            if found:
                n.attrs["subgraphs"] = found
    for sub in subgraphs:
        if sub.name not in used:
            raise IRError(f"subgraph '{sub.name}' is used by no layer (no then_branch/else_branch/body names it)",
                          file=path, line=getattr(sub, "ir_line", None))
    _check_no_recursion(subgraphs, path)


def _check_no_recursion(subgraphs: List[PyGraph], path: Optional[str]) -> None:
    children = {s.name: {c.name for n in s.nodes for c in n.attrs.get("subgraphs", {}).values()} for s in subgraphs}
    for start in children:
        stack, seen = list(children[start]), set()
        while stack:
            name = stack.pop()
            if name == start:
                sub = next(s for s in subgraphs if s.name == start)
                raise IRError(f"subgraph '{start}' contains itself through its layers' then_branch/else_branch/body",
                              file=path, line=getattr(sub, "ir_line", None))
            if name not in seen:
                seen.add(name)
                stack.extend(children.get(name, ()))


_warned_unknown: Set[Tuple[str, str]] = set()


def _check_keys(sr: _SectionReader, optype: str, stems: List[str], allow_unknown: bool) -> None:
    """Every key of the layer must be known to its operator type (known_keys.py); types that declare no keys are
    not checked. With `allow_unknown` an unknown key is kept as a parameter, with one warning per type and key."""
    known = known_keys(optype)
    if known is None:
        return
    stem_of = {stem + x: stem for stem in stems for x in CONSTANT_SUFFIXES}
    for key in sr.section:
        name = stem_of.get(key, key)
        if is_known(name, known, stems):
            continue
        what = "constant" if key in stem_of else "key"
        if allow_unknown:
            if (optype, name) not in _warned_unknown:
                _warned_unknown.add((optype, name))
                OPT_WARN(f"{sr.path}:{sr.line(key)}: {sr.what}: {what} '{name}' is unknown to {optype} layers; "
                         f"kept unused (allow_unknown_ir_keys)")
            continue
        why = "an IR of a newer Parser?" if is_builtin(optype) else "its plugin declares the keys it reads with " \
                                                                   "declare_op or register_op_keys;"
        raise sr.error(key, f"unknown {what} '{name}' for a {optype} layer{suggestion(name, known)} ({why} "
                            f"allow_unknown_ir_keys = true in the cfg, or quantopt run --allow-unknown-ir-keys, "
                            f"accepts it)")
    schema = schema_of(optype)  # after the unknown keys: a misspelt required key gets its did-you-mean first
    for key, param in schema.params if schema is not None else ():
        if param.required and key not in sr.section:
            raise sr.error(None, f"a {optype} layer needs parameter '{key}' ({param.describe()})")


def _read_layer(sec: OrderedDict[str, Line], path: str, bin_file: _BinFile, layout: _Layout,
                allow_unknown: bool) -> PyNode:
    first = next(iter(sec.values())).number
    probe = _SectionReader(sec, path, f"layer section at line {first}")
    name = probe.require("layer_name").raw
    if not name:
        raise probe.error("layer_name", "'layer_name' is empty")
    sr = _SectionReader(sec, path, f"layer '{name}'")
    layer_id = sr.integer("layer_id")
    type_name = sr.require("layer_type").raw
    try:
        optype = OpType.lookup(type_name)
    except KeyError:
        try:
            optype = register_optype(type_name)
        except ValueError:
            raise sr.error("layer_type", f"invalid layer_type '{_clip(type_name)}'") from None
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

    order: List[str] = []
    stems = _constant_stems(sec, sr)
    _check_keys(sr, str(optype), stems, allow_unknown)
    constants: List[Tuple[str, PyTensor, int, str]] = []
    for stem in stems:
        for key, tensor, off in _load_constants(sr, stem, bin_file, name, layout,
                                                allow_inf=str(optype) == "Constant"):
            constants.append((key, tensor, off, stem))
    raw_params: Dict[str, str] = {}
    stem_first_line = {stem: min(sec[stem + s].number for s in CONSTANT_SUFFIXES) for stem in stems}
    stem_of = {stem + x: stem for stem in stems for x in CONSTANT_SUFFIXES}
    for key, ln in sec.items():
        if key in STRUCTURAL_KEYS:
            continue
        stem = stem_of.get(key)
        if stem is not None:
            if stem_first_line[stem] == ln.number:
                order.append(stem)
            continue
        order.append(key)
        if key in TOP_INFO_KEYS:
            _apply_top_info(sr, node, key)
            continue
        value = sr.value(key)
        problem = param_problem(str(optype), key, value)
        if problem:
            raise sr.error(key, f"parameter '{key}': {problem}")
        node.params[key] = value
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


def _number(v: Any) -> bool:
    """A finite float, or an integer that fits int64 (what scales, zero points and ranges are computed in)."""
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return -2 ** 63 <= v < 2 ** 63
    return isinstance(v, float) and math.isfinite(v)


def _apply_top_info(sr: _SectionReader, node: PyNode, key: str) -> None:
    v = sr.value(key)
    if not isinstance(v, list) or len(v) != len(node.outputs):
        raise sr.error(key, f"'{key}' must list one entry per output ({len(node.outputs)})")
    for t, item in zip(node.outputs, v):
        if key == "layer_top_range":
            if not (isinstance(item, list) and len(item) == 2 and all(_number(x) for x in item)):
                raise sr.error(key, f"'{key}' entries must be [min,max] pairs of finite numbers, got {item}")
            t.ir_range = item
        elif not _number(item):
            raise sr.error(key, f"'{key}' entries must be finite numbers, got {item}")
        elif key == "layer_top_scale":
            quant_of(node).of(t).scale = item  # the layer's own table until `add_node` (graph/tables.py)
        else:
            quant_of(node).of(t).zerop = item


def _apply_top_constant(sr: _SectionReader, node: PyNode, stem: str, tensor: PyTensor) -> None:
    if len(node.outputs) != 1:
        raise sr.error(stem + "_offset", f"bin-stored '{stem}' is only supported for single-output layers")
    out = node.outputs[0]
    if stem == "layer_top_scale":
        quant_of(node).of(out).scale = tensor.betensor  # the layer's own table until `add_node` (graph/tables.py)
    elif stem == "layer_top_zp":
        quant_of(node).of(out).zerop = tensor.betensor
    else:
        if tensor.betensor.numel() != 2:
            raise sr.error(stem + "_offset", f"bin-stored '{stem}' must hold two values [min,max], got shape "
                                             f"{list(tensor.betensor.shape)}")
        out.ir_range = tensor.betensor.reshape(-1).tolist()
    node.attrs.setdefault("ir_top_constant_dtypes", {})[stem] = tensor.dtype


def _mark_quantized(graph: PyGraph) -> None:
    """Layers of a quantized IR (integer outputs with `layer_top_scale`, not `unquantifiable`) run their integer
    forward: their outputs get qmin/qmax from `layer_top_range` and qbits from the dtype, and a bin-stored scale of
    several values is per channel along the last axis (as `quantize_activation` sets it, ops/_quant.py)."""
    table = graph.quant
    for n in graph.nodes:
        if "layer_top_scale" not in n.attrs.get("ir_top_keys", []) or n.params.get("unquantifiable") is True:
            continue
        if not n.outputs or any(t.dtype.is_float and not t.dtype.is_minifloat for t in n.outputs):
            continue  # (fp8 outputs are quantized: fp8 activations, ops/_fp8.py)
        n.quantized = True
        for t in n.outputs:
            rng = t.ir_range if t.ir_range is not None else \
                [0, 1] if t.dtype is Dtype.BOOL else list(t.dtype.int_range())
            if not (isinstance(rng, list) and len(rng) == 2 and all(_number(x) for x in rng)):
                raise n._error(f"layer_top_range of output '{t.name}' must be one [min,max] pair, got {rng}")
            q = table.of(t)
            q.qmin, q.qmax = int(rng[0]), int(rng[1])
            q.qbits = t.dtype.bits
            q.qinvariant = not isinstance(q.scale, torch.Tensor) and float(q.scale) == 1.0 and _is_zero(q.zerop)
            q.axis = -1 if q.per_channel else None
        for t in n.constants.values():
            if not t.dtype.is_float:
                table.of(t).qbits = t.dtype.bits


def _is_zero(zp: Any) -> bool:
    """A scalar zero point of 0 (a bin-stored one of several values is per channel, so never invariant)."""
    if isinstance(zp, torch.Tensor):
        return zp.numel() == 1 and float(zp) == 0.0
    return float(zp) == 0.0


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
