"""Dump the float and quantized tensors of one batch (every layer output and constant) to a folder of `.npy` files.

Each tensor gets a running index in the order of the float graph's layers (outputs, then constants, of each layer;
layers only the quantized graph has come after), and its files are named
`<index>_<safe name>.float.npy` / `<index>_<safe name>.quant.npy`: the index keeps names unique and sorted in
execution order whatever the layer and tensor names are, the safe name keeps them readable. `index.json` maps every
tensor to its files with what is needed to read the quantized values (scale, zero point, range, dtype). The layout
is documented in docs/statistics-and-dump.md.
"""
from __future__ import annotations

import json
import math
import os
import re
import unicodedata
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tables import TensorQuant, quant_of
from ..graph.tensor import PyTensor
from ..version import __version__

DUMP_FORMAT = "quantopt-dump"
"""Value of index.json's `format` key."""

DUMP_FORMAT_VERSION = 1
"""Version of the index.json layout."""

INDEX_FILE = "index.json"
"""Name of the index written beside the tensor files."""

MAX_STEM = 80
"""Longest safe name (characters, all ASCII) in a file name: with the index and suffix it stays far below the 255
bytes file systems allow."""

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")

__all__ = ["DUMP_FORMAT", "DUMP_FORMAT_VERSION", "INDEX_FILE", "dump_tensors", "safe_stem"]


def safe_stem(name: str, max_len: int = MAX_STEM) -> str:
    """A file-name-safe ASCII form of a layer or tensor name.

    Accents are dropped (NFKD), every run of other characters outside [A-Za-z0-9._-] becomes one '_', leading dots and
    dashes are removed (no hidden files, no '..', no option-like names), the result is cut to `max_len`; an empty
    result becomes 'tensor'. Different names may give the same stem: the index prefix keeps files unique.
    """
    text = "".join(c for c in unicodedata.normalize("NFKD", str(name)) if not unicodedata.combining(c))
    text = _UNSAFE.sub("_", text).lstrip(".-")[:max_len].rstrip(".")
    return text or "tensor"


Key = Tuple[str, str, Union[int, str]]  # (layer name, 'output' | 'constant', output index | constant key)


def _items(node: PyNode) -> List[Tuple[Key, PyTensor]]:
    out: List[Tuple[Key, PyTensor]] = [((node.name, "output", i), t) for i, t in enumerate(node.outputs)]
    out += [((node.name, "constant", k), t) for k, t in node.constants.items()]
    return out


def _plan(float_graph: PyGraph, quant_graph: Optional[PyGraph]) -> OrderedDict[Key, Dict[str, Any]]:
    """Every tensor to dump, in a deterministic order, with its file stem."""
    plan: OrderedDict[Key, Dict[str, Any]] = OrderedDict()
    graphs = [float_graph] + ([quant_graph] if quant_graph is not None else [])
    for g in graphs:
        for n in g.nodes:
            for key, t in _items(n):
                if key not in plan:
                    label = t.name if key[1] == "output" else f"{n.name}.{key[2]}"
                    plan[key] = {"layer": n.name, "layer_type": str(n.type), "kind": key[1], "key": key[2],
                                 "tensor": t.name, "label": label}
    width = max(4, len(str(max(len(plan) - 1, 0))))
    for i, entry in enumerate(plan.values()):
        entry["index"] = i
        entry["stem"] = f"{i:0{width}d}_{safe_stem(entry['label'])}"
    return plan


def _int_dtype(lo: int, hi: int) -> np.dtype:
    """The smallest numpy integer dtype holding [lo, hi]."""
    for dt in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32):
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return np.dtype(dt)
    return np.dtype(np.int64)


def _quant_array(t: PyTensor, q: TensorQuant) -> np.ndarray:
    """The integer values in the narrowest dtype their declared range (`q`, its params) allows (int64 when no range
    is known)."""
    arr = t.betensor.detach().cpu().numpy()
    if t.betensor.is_floating_point() or t.betensor.dtype == torch.bool:
        return arr
    if q.qmin is not None and q.qmax is not None:
        dt = _int_dtype(int(q.qmin), int(q.qmax))
    elif not t.dtype.is_float and t.dtype.storage.kind in "iu" and t.dtype.itemsize < 8:
        dt = t.dtype.storage.newbyteorder("=")
    else:
        dt = np.dtype(np.int64)
    if arr.size and (int(arr.min()) < np.iinfo(dt).min or int(arr.max()) > np.iinfo(dt).max):
        dt = np.dtype(np.int64)
    return arr.astype(dt)


def jsonable(v: Any) -> Any:
    """A JSON-ready copy of tensors, arrays and numpy scalars (non-finite floats become null)."""
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu().tolist()
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, (np.floating, np.integer, np.bool_)):
        v = v.item()
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    return v


def _write(folder: str, file: str, arr: np.ndarray) -> Dict[str, Any]:
    np.save(os.path.join(folder, file), arr, allow_pickle=False)
    return {"file": file, "dtype": str(arr.dtype), "shape": [int(d) for d in arr.shape]}


def dump_tensors(float_graph: PyGraph, quant_graph: Optional[PyGraph],
                 inputs: Union[torch.Tensor, Sequence[torch.Tensor]], dump_dir: str,
                 model_name: Optional[str] = None) -> str:
    """Run one batch through the float graph (and the quantized graph when given), writing every layer output and
    constant as `.npy` files in `dump_dir` (created if missing), and `index.json`. Returns the index path.

    Files are written while the graphs run (each layer's outputs right after it), so memory stays that of a plain
    forward. Float values are saved as computed (float32); quantized values in the narrowest integer dtype holding
    [qmin, qmax]; read them back as float with `x = (q + zerop) / scale` (per channel along `axis` when scale is a
    list). Files of an earlier dump with other names are left in place: index.json lists this dump's files.
    """
    os.makedirs(dump_dir, exist_ok=True)
    plan = _plan(float_graph, quant_graph)
    batch = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)

    def hook_for(side: str):
        def hook(node: PyNode) -> None:
            for key, t in _items(node):
                entry = plan[key]
                if side == "float":
                    entry["float"] = _write(dump_dir, f"{entry['stem']}.float.npy",
                                            t.betensor.detach().cpu().numpy())
                else:
                    q = quant_of(node).get(t)
                    info = _write(dump_dir, f"{entry['stem']}.quant.npy", _quant_array(t, q))
                    info.update({"ir_dtype": str(t.dtype), "scale": jsonable(q.scale), "zerop": jsonable(q.zerop),
                                 "axis": q.axis, "qmin": q.qmin, "qmax": q.qmax, "qbits": q.qbits,
                                 "qinvariant": bool(q.qinvariant)})
                    entry["quant"] = info
        return hook

    with torch.no_grad():
        float_graph.forward(batch, after_node=hook_for("float"))
        if quant_graph is not None:
            quant_graph.forward(batch, after_node=hook_for("quant"))
    tensors = []
    for entry in plan.values():
        tensors.append({k: entry.get(k) for k in ("index", "layer", "layer_type", "kind", "key", "tensor", "float",
                                                   "quant")})
    index = {"format": DUMP_FORMAT, "format_version": DUMP_FORMAT_VERSION, "quantopt_version": __version__,
             "model": model_name or float_graph.name,
             "batch_size": int(batch[0].shape[0]) if batch and batch[0].dim() > 0 else 1,
             "dequantize": "x = (q + zerop) / scale", "tensors": tensors}
    path = os.path.join(dump_dir, INDEX_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(index, f, ensure_ascii=False, indent=1, allow_nan=False)
        f.write("\n")
    return path
