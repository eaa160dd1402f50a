"""Save the calibration statistics of a graph to a file and load them back, so the statistics pass can be skipped.

The file is a compressed numpy `.npz` archive (a zip of `.npy` arrays) holding only numeric arrays,
read with `np.load(..., allow_pickle=False)`: loading a file can never run code. One member, `header`, is the
UTF-8 JSON header stored as a uint8 array; every other member is one statistics array. The format is documented
in docs/statistics-and-dump.md; its version is `FORMAT_VERSION`, and a file of a newer version is refused.

The header names the graph the statistics were collected on by a fingerprint (SHA-256 over every layer's name,
type and output tensors' names and IR shapes, independent of layer order) and a CRC-32 of every weight constant's
bytes. Loading a file onto a graph whose fingerprint differs is refused with the first difference named (a missing
or extra layer, a changed type or output shape), as is a file whose weights differ from the graph's.

Version 2 adds the statistics of layers' placeholders (tensors inside a layer that its float forward sets, e.g. a
recurrent cell's gate activations): entries of kind `placeholder`, keyed by the placeholder's index in the layer,
with its name and shape, so loading can create the placeholders of a layer that has not run yet. A file without
placeholder entries is still written as version 1 (its layout is unchanged), and version 1 files stay readable.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zlib
from dataclasses import fields
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..errors import DataError
from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tables import TensorStatistics
from ..graph.tensor import PyTensor
from ..log import OPT_WARN
from ..version import __version__
from .collect import weight_constants
from .missing_statistics import fill_missing
from .strategies import statistics_needs

FORMAT_NAME = "quantopt-statistics"
"""Value of the header's `format` key: tells a statistic file from any other npz archive."""

FORMAT_VERSION = 2
"""Newest file layout `save_statistics` writes (version 1 where the file holds no placeholder entries);
`load_statistics` reads versions 1..FORMAT_VERSION."""

PLACEHOLDER_VERSION = 2
"""The first version with `placeholder` entries."""

HEADER_KEY = "header"
"""Name of the archive member holding the JSON header (uint8 bytes)."""

STAT_FIELDS: Tuple[str, ...] = tuple(f.name for f in fields(TensorStatistics) if f.name != "batches")
"""The array slots of TensorStatistics, in declaration order (`batches` is stored in the header)."""

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "STAT_FIELDS", "graph_fingerprint", "load_statistics", "save_statistics",
           "statistic_file_name"]


def statistic_file_name(model_name: str) -> str:
    """The file name `save_statistic_info` writes in output_dir."""
    return f"{model_name}_statistic_info.npz"


# ------------------------------------------------------------------------------------------------- graph identity
def _layer_record(node: PyNode) -> Dict[str, Any]:
    return {"name": node.name, "type": str(node.type),
            "outputs": [[t.name, [int(d) for d in t.ir_shape]] for t in node.outputs]}


def _layer_records(graph: PyGraph) -> List[Dict[str, Any]]:
    return [_layer_record(n) for n in graph.nodes]


def _fingerprint(records: List[Dict[str, Any]]) -> str:
    canon = json.dumps(sorted(records, key=lambda r: r["name"]), sort_keys=True, separators=(",", ":"),
                       ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canon.encode("ascii")).hexdigest()


def graph_fingerprint(graph: PyGraph) -> str:
    """SHA-256 over every layer's name, type, output tensor names and IR shapes (independent of layer order)."""
    return _fingerprint(_layer_records(graph))


def _first_difference(saved: List[Dict[str, Any]], current: List[Dict[str, Any]]) -> str:
    """Describe the first structural difference between the saved layer records and the graph's."""
    old = {r["name"]: r for r in saved}
    new = {r["name"]: r for r in current}
    for r in current:
        if r["name"] not in old:
            return f"layer '{r['name']}' ({r['type']}) of the graph is not in the file"
    for r in saved:
        if r["name"] not in new:
            return f"the file has layer '{r['name']}' ({r['type']}) that the graph lacks"
    for r in current:
        o = old[r["name"]]
        if o["type"] != r["type"]:
            return f"layer '{r['name']}' is {r['type']} in the graph but {o['type']} in the file"
        if len(o["outputs"]) != len(r["outputs"]):
            return (f"layer '{r['name']}' has {len(r['outputs'])} output(s) in the graph but {len(o['outputs'])} "
                    "in the file")
        for (tn, ts), (on, os_) in zip(r["outputs"], o["outputs"]):
            if tn != on:
                return f"layer '{r['name']}' outputs tensor '{tn}' in the graph but '{on}' in the file"
            if list(ts) != list(os_):
                return (f"tensor '{tn}' of layer '{r['name']}' has shape {list(ts)} in the graph but {list(os_)} "
                        "in the file")
    return "the layer records differ"


def _crc32(t: PyTensor) -> int:
    arr = np.ascontiguousarray(t.betensor.detach().cpu().numpy())
    return zlib.crc32(arr.tobytes()) & 0xFFFFFFFF


def _tensors(graph: PyGraph) -> List[Tuple[PyNode, str, Any, PyTensor]]:
    """(layer, kind, key, tensor) of every tensor that carries statistics: outputs (key: output index) and weight
    constants (key: constant name), in topological order."""
    out: List[Tuple[PyNode, str, Any, PyTensor]] = []
    for n in graph.nodes:
        out += [(n, "output", i, t) for i, t in enumerate(n.outputs)]
        keys = {id(t): k for k, t in n.constants.items()}
        out += [(n, "constant", keys[id(t)], t) for t in weight_constants(n)]
    return out


def _placeholders(graph: PyGraph) -> List[Tuple[PyNode, str, Any, PyTensor]]:
    """(layer, "placeholder", index, tensor) of every layer's placeholders, in topological order."""
    return [(n, "placeholder", i, t) for n in graph.nodes for i, t in enumerate(n.placeholders)]


# ------------------------------------------------------------------------------------------------- save
def save_statistics(graph: PyGraph, path: str) -> str:
    """Write every output's, weight constant's and placeholder's statistics to `path` (written whole, then renamed
    into place).

    Returns `path`. Tensors without statistics get an entry without arrays (loading gives them empty statistics).
    """
    arrays: Dict[str, np.ndarray] = {}
    entries: List[Dict[str, Any]] = []
    placeholders = _placeholders(graph)
    for i, (node, kind, key, t) in enumerate(_tensors(graph) + placeholders):
        stats = graph.statistics.get(t)
        entry: Dict[str, Any] = {"layer": node.name, "kind": kind, "key": key, "tensor": t.name,
                                 "batches": int(stats.batches), "arrays": {}}
        if kind == "constant":
            entry["shape"] = [int(d) for d in t.betensor.shape]
            entry["crc32"] = _crc32(t)
        elif kind == "placeholder":
            entry["shape"] = [int(d) for d in (t.betensor.shape if t.betensor.numel() else t.ir_shape)]
        for name in STAT_FIELDS:
            value = getattr(stats, name)
            if value is None:
                continue
            member = f"e{i}.{name}"
            arrays[member] = np.array(torch.as_tensor(value).detach().cpu().numpy(), order="C")  # keeps 0-d arrays 0-d
            entry["arrays"][name] = member
        entries.append(entry)
    records = _layer_records(graph)
    version = PLACEHOLDER_VERSION if placeholders else 1
    header = {"format": FORMAT_NAME, "format_version": version, "quantopt_version": __version__,
              "model": graph.name, "fingerprint": _fingerprint(records), "layers": records, "entries": entries}
    arrays[HEADER_KEY] = np.frombuffer(json.dumps(header, ensure_ascii=False).encode("utf-8"), dtype=np.uint8)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".statistics-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


# ------------------------------------------------------------------------------------------------- load
class _Reader:
    """The validated content of one statistic file; every problem is a one-line DataError naming the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, message: str) -> DataError:
        return DataError(" ".join(message.split()), file=self.path)

    def read(self) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
        if not os.path.isfile(self.path):
            raise self.fail("no such statistic file")
        with open(self.path, "rb") as f:
            magic = f.read(6)
        if magic.startswith(b"\x93NUMPY"):
            raise self.fail("a single .npy array, not a statistic file (an upstream statistic file is a pickle, which "
                            "quantopt never loads: collect the statistics again with save_statistic_info)")
        if not magic.startswith((b"PK\x03\x04", b"PK\x05\x06")):
            raise self.fail("not a statistic file (empty)" if not magic else
                            "not a statistic file (not an .npz archive)")
        try:
            with np.load(self.path, allow_pickle=False) as data:
                names = list(data.files)
                if HEADER_KEY not in names:
                    raise self.fail("not a statistic file (no 'header' member)")
                header = self._header(data[HEADER_KEY])
                arrays = {k: data[k] for k in names if k != HEADER_KEY}
        except DataError:
            raise
        except Exception as e:  # whatever a damaged archive makes numpy or zipfile raise
            what = "pickled data, which is never loaded" if "pickle" in str(e).lower() else f"{type(e).__name__}: {e}"
            raise self.fail(f"not a readable statistic file (truncated or corrupt? {what})") from None
        return header, arrays

    def _header(self, raw: np.ndarray) -> Dict[str, Any]:
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raise self.fail("not a statistic file (the header is not UTF-8 bytes)")
        try:
            header = json.loads(raw.tobytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self.fail(f"corrupt statistic file header ({e})") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
            raise self.fail(f"not a statistic file (header format is not '{FORMAT_NAME}')")
        version = header.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise self.fail(f"corrupt statistic file header (format_version {version!r})")
        if version > FORMAT_VERSION:
            raise self.fail(f"statistic file format version {version} (written by quantopt "
                            f"{header.get('quantopt_version', '?')}) is newer than this quantopt {__version__} reads "
                            f"(up to {FORMAT_VERSION}); use a newer quantopt or collect the statistics again")
        for key, typ in (("fingerprint", str), ("layers", list), ("entries", list)):
            if not isinstance(header.get(key), typ):
                raise self.fail(f"corrupt statistic file header (missing or invalid '{key}')")
        return header


def _check_entry_arrays(reader: _Reader, where: str, entry: Dict[str, Any],
                        arrays: Dict[str, np.ndarray]) -> TensorStatistics:
    """A new TensorStatistics from the entry's arrays, after checking names, dtypes and shapes."""
    stats = TensorStatistics()
    members = entry.get("arrays")
    batches = entry.get("batches")
    if not isinstance(members, dict) or not isinstance(batches, int) or batches < 0:
        raise reader.fail(f"corrupt entry for {where}")
    channels: Optional[int] = None
    for name, member in members.items():
        if name not in STAT_FIELDS:
            raise reader.fail(f"unknown statistic '{name}' for {where}")
        arr = arrays.get(member) if isinstance(member, str) else None
        if arr is None:
            raise reader.fail(f"array '{member}' ({name} of {where}) is missing from the file")
        if arr.dtype.kind != "f":
            raise reader.fail(f"{name} of {where} has dtype {arr.dtype}, expected a float array")
        per_channel = name.endswith("_key_axis")
        histogram = name.startswith("running_histc")
        want_dim = (1 if histogram else 0) + (1 if per_channel else 0)
        if arr.ndim != want_dim:
            raise reader.fail(f"{name} of {where} has shape {list(arr.shape)}, expected {want_dim} dimension(s)")
        if per_channel:
            if channels is None:
                channels = int(arr.shape[0])
            elif int(arr.shape[0]) != channels:
                raise reader.fail(f"{name} of {where} has {arr.shape[0]} channels, other statistics {channels}")
        if not histogram and bool(np.isnan(arr).any()):
            raise reader.fail(f"{name} of {where} holds NaN")
        setattr(stats, name, torch.from_numpy(arr.copy()))
    if (stats.extrema_min is None) != (stats.extrema_max is None):
        raise reader.fail(f"{where} has only one of extrema_min / extrema_max")
    stats.batches = batches if stats.extrema_min is not None else 0
    return stats


def _check_needs(reader: _Reader, node: PyNode, kind: str, where: str, stats: TensorStatistics) -> None:
    """The statistics the layer's calibration strategy will read must be in the file."""
    settings = node.settings
    if settings is None or stats.extrema_min is None:
        return
    strategy = settings.q_strategy_weight if kind == "constant" else settings.q_strategy_activation
    need_histogram, need_moments = statistics_needs(strategy)
    missing = []
    if need_histogram and stats.running_histc is None:
        missing.append("histogram")
    if need_moments and (stats.running_mean is None or stats.running_std is None or stats.running_mad is None):
        missing.append("mean/std/mad")
    if missing:
        raise reader.fail(f"the file has no {' and '.join(missing)} for {where}, which calibration strategy "
                          f"'{strategy}' needs: collect the statistics again with this strategy")


def load_statistics(graph: PyGraph, path: str, check_strategies: bool = True, ignore_missing: bool = False) -> int:
    """Replace every output's, weight constant's and placeholder's statistics of `graph` by those saved in `path`.

    The file must have been made for this graph: same layers (names, types, output tensor names and IR shapes) and
    the same weights. With `check_strategies` (and layer settings assigned), the statistics each layer's
    calibration strategy needs (histogram, moments) must be present. Nothing is changed unless the whole file is
    valid. Returns the number of tensors whose statistics were loaded. Raises DataError (one line, naming the file).

    With `ignore_missing` (`ignore_missing_statistic`) the file may be made for another graph: tensors it has no
    matching statistics for (absent, another tensor name, other weights or shape) get them from their weights or
    their neighbours (calibration/missing_statistics.py), listed in one warning; a corrupt file still fails.

    Placeholders: a layer that has none yet gets those the file lists for it (name and shape; values come with its
    next float forward); a placeholder of the graph the file has no statistics for (a version 1 file, another name)
    is left without statistics, so the quantize function that needs its range says so.
    """
    reader = _Reader(path)
    header, arrays = reader.read()
    records = _layer_records(graph)
    saved = header["layers"]
    if not all(isinstance(r, dict) and isinstance(r.get("name"), str) and isinstance(r.get("outputs"), list)
               for r in saved):
        raise reader.fail("corrupt statistic file header (invalid 'layers')")
    if header["fingerprint"] != _fingerprint(records) and not ignore_missing:
        raise reader.fail(f"made for a different graph (model '{header.get('model', '?')}'): "
                          f"{_first_difference(saved, records)}")
    saved_shapes = {str(o[0]): o[1] for r in saved for o in r["outputs"] if isinstance(o, list) and len(o) == 2}
    by_key: Dict[Tuple[str, str, Any], Dict[str, Any]] = {}
    kinds = ("output", "constant", "placeholder") if header["format_version"] >= PLACEHOLDER_VERSION \
        else ("output", "constant")
    for entry in header["entries"]:
        if not isinstance(entry, dict) or entry.get("kind") not in kinds:
            raise reader.fail("corrupt statistic file header (invalid entry)")
        by_key[(str(entry.get("layer")), entry["kind"], entry.get("key"))] = entry
    staged: List[Tuple[PyTensor, TensorStatistics]] = []
    missing: List[Tuple[PyNode, str, PyTensor]] = []
    for node, kind, key, t in _tensors(graph):
        what = "tensor" if kind == "output" else "constant"
        where = f"{what} '{t.name if kind == 'output' else key}' of layer '{node.name}'"
        entry = by_key.get((node.name, kind, key))
        problem = _entry_problem(entry, node, kind, key, t, where, saved_shapes)
        if problem is None:
            stats = _check_entry_arrays(reader, where, entry, arrays)
            problem = _channel_problem(stats, kind, t, where)
        if problem is not None:
            if not ignore_missing:
                raise reader.fail(problem)
            missing.append((node, kind, t))
            continue
        if check_strategies:
            _check_needs(reader, node, kind, where, stats)
        staged.append((t, stats))
    created, unmatched = _stage_placeholders(reader, graph, by_key, arrays, staged, check_strategies)
    filled: Dict[int, TensorStatistics] = {}
    if missing:
        filled, unfilled = fill_missing(graph, missing, {t.name: st for t, st in staged})
        if unfilled:
            raise reader.fail(f"no statistics for tensor '{unfilled[0]}' and none for any tensor around it "
                              f"({len(unfilled)} such tensor(s)): collect the statistics again")
        names = [t.name if kind == "output" else f"{node.name}.{_constant_key(node, t)}" for node, kind, t in missing]
        OPT_WARN(f"ignore_missing_statistic: {len(missing)} tensor(s) have no usable statistics in {path} and take "
                 f"them from their weights or neighbours: {', '.join(names[:20])}"
                 + (f", ... ({len(names) - 20} more)" if len(names) > 20 else ""))
    table = graph.statistics
    for t, stats in staged:
        table.set(t, stats)
    for _node, _, t in missing:
        table.set(t, filled[id(t)])
    for node, tensors in created:
        node.placeholders = tensors
    for t in unmatched:
        table.set(t, TensorStatistics())
    return len(staged)


def _placeholder_entries(reader: _Reader, node: PyNode, by_key: Dict[Tuple[str, str, Any], Dict[str, Any]]
                         ) -> List[Dict[str, Any]]:
    """The file's placeholder entries of `node`, by index 0, 1, ... (stops at the first index it lacks)."""
    out = []
    while (node.name, "placeholder", len(out)) in by_key:
        entry = by_key[(node.name, "placeholder", len(out))]
        shape = entry.get("shape")
        if not isinstance(entry.get("tensor"), str) or not isinstance(shape, list) \
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise reader.fail(f"corrupt entry for placeholder {len(out)} of layer '{node.name}'")
        out.append(entry)
    return out


def _stage_placeholders(reader: _Reader, graph: PyGraph, by_key: Dict[Tuple[str, str, Any], Dict[str, Any]],
                        arrays: Dict[str, np.ndarray], staged: List[Tuple[PyTensor, TensorStatistics]],
                        check_strategies: bool) -> Tuple[List[Tuple[PyNode, List[PyTensor]]], List[PyTensor]]:
    """Stage the placeholders' statistics (appended to `staged`); returns the placeholders to create (layers that
    have none yet) and the graph's placeholders the file has no statistics for. Changes nothing in the graph."""
    created: List[Tuple[PyNode, List[PyTensor]]] = []
    unmatched: List[PyTensor] = []
    for node in graph.nodes:
        entries = _placeholder_entries(reader, node, by_key)
        tensors = node.placeholders
        if not tensors and entries:
            tensors = [PyTensor(e["tensor"], shape=e["shape"]) for e in entries]
            created.append((node, tensors))
        for i, t in enumerate(tensors):
            entry = entries[i] if i < len(entries) else None
            if entry is None or entry["tensor"] != t.name:
                unmatched.append(t)
                continue
            where = f"placeholder '{t.name}' of layer '{node.name}'"
            stats = _check_entry_arrays(reader, where, entry, arrays)
            if check_strategies:
                _check_needs(reader, node, "placeholder", where, stats)
            staged.append((t, stats))
    return created, unmatched


def _constant_key(node: PyNode, t: PyTensor) -> str:
    return next((k for k, c in node.constants.items() if c is t), t.name)


def _entry_problem(entry: Optional[Dict[str, Any]], node: PyNode, kind: str, key: Any, t: PyTensor,
                   where: str, saved_shapes: Dict[str, Any]) -> Optional[str]:
    """Why the file's entry does not fit the tensor (None: it fits)."""
    if entry is None:
        return f"the file has no statistics for {where}"
    if kind == "output" and entry.get("tensor") != t.name:
        return f"output {key} of layer '{node.name}' is '{entry.get('tensor')}' in the file but '{t.name}' in the graph"
    if kind == "output" and saved_shapes.get(t.name) != [int(d) for d in t.ir_shape]:
        return f"{where} has shape {list(t.ir_shape)} in the graph but {saved_shapes.get(t.name)} in the file"
    if kind == "constant":
        shape = [int(d) for d in t.betensor.shape]
        if entry.get("shape") != shape:
            return f"{where} has shape {shape} in the graph but {entry.get('shape')} in the file"
        if entry.get("crc32") != _crc32(t):
            return f"{where} holds different values than the weights the file was made for"
    return None


def _channel_problem(stats: TensorStatistics, kind: str, t: PyTensor, where: str) -> Optional[str]:
    if stats.extrema_min_key_axis is not None and kind == "constant" and t.betensor.dim() > 0 \
            and int(stats.extrema_min_key_axis.shape[0]) != int(t.betensor.shape[0]):
        return (f"per-channel statistics of {where} have {stats.extrema_min_key_axis.shape[0]} channels, the "
                f"constant has {t.betensor.shape[0]}")
    if stats.extrema_min_key_axis is not None and kind == "output" and t.ir_shape \
            and int(stats.extrema_min_key_axis.shape[0]) != int(t.ir_shape[-1]):
        return (f"per-channel statistics of {where} have {stats.extrema_min_key_axis.shape[0]} channels, the "
                f"tensor has {t.ir_shape[-1]}")
    return None
