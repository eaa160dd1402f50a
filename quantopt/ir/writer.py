"""Compass IR writer: deterministic text, sequential .bin layout, atomic replace of both files.

A float IR read by `reader.read_ir` is written back with the same keys in the same order and byte-identical
constants; layer ids are renumbered 0..N-1 in topological order (as upstream does).
"""
from __future__ import annotations

import io
import os
import secrets
import tempfile
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from ..errors import IRError
from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.subgraphs import all_subgraphs
from ..graph.tables import quant_of
from ..graph.tensor import PyTensor
from ..quant.dtype import Dtype, encode_storage
from .grammar import GrammarError, format_value, parse_value
from .reader import TOP_INFO_KEYS


class _BinBuilder:
    def __init__(self) -> None:
        self.buf = io.BytesIO()

    def add(self, array: np.ndarray) -> Tuple[int, int]:
        offset = self.buf.tell()
        data = np.ascontiguousarray(array).tobytes()
        self.buf.write(data)
        return offset, len(data)


def _kv(lines: List[str], key: str, value: Any) -> None:
    lines.append(f"{key}={format_value(value)}")


def _const_lines(lines: List[str], stem: str, tensors: List[PyTensor], bin_out: _BinBuilder,
                 as_list: bool = False) -> None:
    types, offsets, sizes, shapes = [], [], [], []
    for t in tensors:
        data = t.betensor.reshape(t.ir_shape) if t.betensor.numel() == t.ir_numel else t.betensor
        try:
            storage = encode_storage(data, t.dtype)
        except OverflowError as e:
            raise IRError(f"cannot write constant '{t.name}': {e}") from None
        off, size = bin_out.add(storage)
        types.append(t.dtype)
        offsets.append(off)
        sizes.append(size)
        shapes.append(list(data.shape))
    pick = (lambda v: v[0]) if not as_list else (lambda v: v)
    _kv(lines, stem + "_type", pick(types))
    _kv(lines, stem + "_offset", pick(offsets))
    _kv(lines, stem + "_size", pick(sizes))
    _kv(lines, stem + "_shape", pick(shapes))


def _param_line(lines: List[str], node: PyNode, key: str) -> None:
    """Write a param, keeping the source text (e.g. `0.200000`) when the value is unchanged."""
    value = node.params[key]
    raw = node.attrs.get("ir_raw_params", {}).get(key)
    if raw is not None:
        try:
            parsed = parse_value(raw)
            same = parsed == value and type(parsed) is type(value)
        except GrammarError:
            same = False
        if same:
            lines.append(f"{key}={raw}")
            return
    _kv(lines, key, value)


_TOP_ATTR = {"layer_top_scale": "scale", "layer_top_zp": "zerop"}
"""The TensorQuant field each top info key writes."""


def _top_info_value(node: PyNode, key: str) -> Any:
    values = []
    table = quant_of(node)
    for t in node.outputs:
        q = table.get(t)
        if key == "layer_top_range":
            v = t.ir_range if t.ir_range is not None else ([q.qmin, q.qmax] if q.qmin is not None else None)
        else:
            v = getattr(q, _TOP_ATTR[key])
        if isinstance(v, torch.Tensor):
            v = v.tolist() if v.numel() > 1 else v.item()
        values.append(v)
    return values


def _is_per_channel(node: PyNode, key: str) -> bool:
    attr = _TOP_ATTR.get(key)
    if attr is None or len(node.outputs) != 1:
        return False
    v = getattr(quant_of(node).get(node.outputs[0]), attr)
    return isinstance(v, torch.Tensor) and v.numel() > 1


def _layer_lines(node: PyNode, index: int, bin_out: _BinBuilder) -> List[str]:
    lines: List[str] = []
    _kv(lines, "layer_id", index)
    _kv(lines, "layer_name", node.name)
    _kv(lines, "layer_type", str(node.type))
    _kv(lines, "layer_bottom", [t.name for t in node.inputs])
    _kv(lines, "layer_bottom_shape", [list(t.ir_shape) for t in node.inputs])
    _kv(lines, "layer_bottom_type", [t.dtype for t in node.inputs])
    _kv(lines, "layer_top", [t.name for t in node.outputs])
    _kv(lines, "layer_top_shape", [list(t.ir_shape) for t in node.outputs])
    _kv(lines, "layer_top_type", [t.dtype for t in node.outputs])

    groups = node.attrs.get("ir_constant_groups", {})
    grouped = {k for keys in groups.values() for k in keys}
    top_keys = list(node.attrs.get("ir_top_keys", []))
    if node.quantized:
        top_keys = list(TOP_INFO_KEYS)
    order = list(node.attrs.get("ir_key_order", []))
    # items not in the recorded order: top info first (after structural keys), then constants, then params
    missing_top = [k for k in top_keys if k not in order]
    order = missing_top + order
    seen = set()
    written_constants = set()
    for key in order:
        seen.add(key)
        if key in TOP_INFO_KEYS:
            if key not in top_keys:
                continue
            if _is_per_channel(node, key):
                attr = _TOP_ATTR[key]
                v = getattr(quant_of(node).get(node.outputs[0]), attr)
                dt = node.attrs.get("ir_top_constant_dtypes", {}).get(key, Dtype.FP32 if attr == "scale"
                                                                          else Dtype.INT32)
                t = PyTensor(node.name + key, v.detach().reshape(-1), dt, [v.numel()])
                _const_lines(lines, key, [t], bin_out)
            else:
                _kv(lines, key, _top_info_value(node, key))
            continue
        if key in groups:
            _const_lines(lines, key, [node.constants[k] for k in groups[key] if k in node.constants], bin_out,
                         as_list=True)
            written_constants.update(groups[key])
            continue
        if key in node.constants and key not in grouped:
            _const_lines(lines, key, [node.constants[key]], bin_out)
            written_constants.add(key)
            continue
        if key in node.params:
            _param_line(lines, node, key)
    for key, t in node.constants.items():
        if key not in written_constants and key not in grouped:
            _const_lines(lines, key, [t], bin_out)
    for key in node.params:
        if key not in seen:
            _param_line(lines, node, key)
    return lines


def serialize_ir(graph: PyGraph, bin_name: str) -> Tuple[str, bytes]:
    """(text, bin bytes) of the graph; `bin_name` is written as the header's model_bin."""
    bin_out = _BinBuilder()
    header = dict(graph.header) if graph.header else {}
    header["model_name"] = graph.name
    header["layer_number"] = len(graph.nodes)
    header["input_tensors"] = [t.name for t in graph.input_tensors]
    header["output_tensors"] = [t.name for t in graph.output_tensors]
    if "model_bin" in header:
        header["model_bin"] = "./" + bin_name
    ordered_keys = list(graph.header.keys()) if graph.header else []
    for k in ("model_name", "layer_number", "input_tensors", "output_tensors"):
        if k not in ordered_keys:
            ordered_keys.append(k)
    lines: List[str] = []
    for k in ordered_keys:
        _kv(lines, k, header[k])
    sections = ["\n".join(lines)]
    for i, node in enumerate(graph.nodes):
        sections.append("\n".join(_layer_lines(node, i, bin_out)))
    for sub in all_subgraphs(graph):  # after the root's layers, each led by an empty line more (as upstream)
        sections.append("\n" + "\n".join(_subgraph_header(sub)))
        for i, node in enumerate(sub.nodes):
            sections.append("\n".join(_layer_lines(node, i, bin_out)))
    return "\n\n".join(sections) + "\n", bin_out.buf.getvalue()


def _subgraph_header(sub: PyGraph) -> List[str]:
    """`subgraph_name`, `layer_number`, the subgraph header's other keys as read, then its inputs and outputs."""
    lines: List[str] = []
    lines.append(f"subgraph_name={sub.name}")
    _kv(lines, "layer_number", len(sub.nodes))
    for k, v in sub.header.items():
        if k not in ("subgraph_name", "layer_number", "input_tensors", "output_tensors", "model_bin"):
            _kv(lines, k, v)
    _kv(lines, "input_tensors", [t.name for t in sub.input_tensors])
    _kv(lines, "output_tensors", [t.name for t in sub.output_tensors])
    return lines


def _create_temp(path: str) -> Tuple[int, str]:
    """A new, uniquely named hidden file next to `path`, open for writing: (fd, name). Created with mode 0666 so that
    the kernel applies the process umask (and a folder's default ACL) and the file gets the permissions any file the
    user creates gets; `tempfile.mkstemp` would make it 0600, and fixing that afterwards needs the umask, which can
    only be read by setting it, a process-wide change other threads would see."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(tempfile.TMP_MAX):
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temporary file name next to {path}")


def _atomic_write(path: str, data: bytes) -> str:
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def write_ir(graph: PyGraph, txt_path: str, bin_path: Optional[str] = None) -> Tuple[str, str]:
    """Write `<txt_path>` and its .bin. Both are built in memory and replaced atomically; returns the paths."""
    txt_path = str(txt_path)
    bin_path = str(bin_path) if bin_path else os.path.splitext(txt_path)[0] + ".bin"
    text, data = serialize_ir(graph, os.path.basename(bin_path))
    os.makedirs(os.path.dirname(os.path.abspath(txt_path)), exist_ok=True)
    pending = {}  # destination -> temp file not yet renamed into place (removed if anything fails)
    try:
        pending[bin_path] = _atomic_write(bin_path, data)
        pending[txt_path] = _atomic_write(txt_path, text.encode("utf-8"))
        for dest in (bin_path, txt_path):
            os.replace(pending[dest], dest)
            del pending[dest]
    finally:
        for tmp in pending.values():
            os.unlink(tmp)
    return txt_path, bin_path


def atomic_write(path: str, data: bytes) -> str:
    """Write one file atomically (temp file in the same folder, then rename); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = _atomic_write(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
