"""`quantopt run`: run a float or quantized IR on `.npy`/`.npz` inputs and save its outputs as `.npy` files.

It is what a user validating an IR outside a cfg run needs: the exact outputs quantopt computes for given inputs,
as the integer backend would produce them (a quantized IR gets the integer inputs the backend would receive, or
floats quantized with the input tensors' own params on request), with an `outputs.json` index holding what is
needed to read them back (shape, dtype, scale, zero point, range).

Every input is checked against the IR (count, shape with a free batch dimension, dtype, value range, NaN/inf)
before anything runs, and the output folder is filled only once the whole forward succeeded: files go to a
temporary folder beside OUTDIR that is renamed into place at the end, so a failed run leaves no OUTDIR content.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .analysis.dump import jsonable, safe_stem
from .errors import ConfigError, DataError, IRError, UnsupportedError
from .graph.graph import PyGraph
from .graph.node import PyNode
from .graph.tables import QuantTable, TensorQuant
from .graph.tensor import PyTensor
from .graph.values import to_float, to_quantized
from .log import OPT_INFO, OPT_WARN, setup_console
from .progress import progress
from .quant.dtype import Dtype
from .version import __version__

RUN_FORMAT = "quantopt-run"
"""Value of outputs.json's `format` key; it also marks a folder an earlier run wrote (which a new run replaces)."""

RUN_FORMAT_VERSION = 1
"""Version of the outputs.json layout."""

INDEX_FILE = "outputs.json"
"""The index written beside the output files."""

LAYERS_DIR = "layers"
"""Sub-folder of OUTDIR holding every layer's outputs with --dump-all."""

_INT64_MAX = 2 ** 63 - 1
_FLAT_LIST = re.compile(r"\[[^\[\]{}]*\]")

__all__ = ["INDEX_FILE", "LAYERS_DIR", "RUN_FORMAT", "RUN_FORMAT_VERSION", "InputSpec", "check_inputs",
           "load_input_files", "run_graph", "run_files", "run_main"]


# ------------------------------------------------------------------------------------------------------ inputs
@dataclass
class InputSpec:
    """One IR input with its data and how the data becomes the tensor the graph is fed.

    `kind`: 'float' (float IR dtype), 'bool', 'int' (integers used as is), 'quantize' (floats quantized with the
    tensor's scale/zp by --quantize-inputs).
    """

    tensor: PyTensor
    source: str
    array: np.ndarray
    kind: str

    @property
    def batched(self) -> bool:
        return self.array.ndim > 0


def _read_array_file(path: str) -> Any:
    """The array of a .npy (memory-mapped) or the arrays of a .npz, never unpickling anything."""
    if not os.path.exists(path):
        raise DataError("input file does not exist", file=path)
    if not os.path.isfile(path):
        raise DataError("input path is not a file", file=path)
    try:
        loaded = np.load(path, mmap_mode="r", allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                return {key: loaded[key] for key in loaded.files}
        return loaded
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot read as .npy/.npz without pickle: {detail}", file=path) from None


def load_input_files(paths: Sequence[str], graph: PyGraph) -> List[Tuple[str, np.ndarray]]:
    """(source label, array) per IR input in IR input order: one .npy per input, or one .npz with an array per
    input, named after the input tensors or their Input layers (an imported ONNX model's input names), or saved
    positionally as arr_0, arr_1, ..."""
    names = [t.name for t in graph.input_tensors]
    loaded = [(p, _read_array_file(p)) for p in paths]
    archives = [p for p, obj in loaded if isinstance(obj, dict)]
    if archives:
        if len(paths) != 1:
            raise DataError(f"an .npz input must be the only -i file ({len(paths)} were given)", file=archives[0])
        path, arrays = loaded[0]
        keys = list(arrays)
        positional = [f"arr_{i}" for i in range(len(names))]
        layers = [t.pnode.name if t.pnode is not None else t.name for t in graph.input_tensors]
        if set(keys) == set(names):
            order = names
        elif set(keys) == set(layers) and len(set(layers)) == len(layers):  # named after the Input layers
            order = layers
        elif keys == positional and not set(keys) & set(names):
            order = positional
        else:
            shown = names if layers == names else [f"{t} (layer {layer})" for t, layer in zip(names, layers)]
            raise DataError(f"the .npz holds arrays {keys} but the IR inputs are {shown}: name the arrays after the "
                            f"inputs or their layers, or save them positionally (arr_0, arr_1, ...)", file=path)
        return [(f"{path}[{key}]", arrays[key]) for key in order]
    if len(paths) != len(names):
        raise DataError(f"the IR has {len(names)} input(s) {names} but {len(paths)} input file(s) were given "
                        f"(one -i per input, in IR input order)")
    return [(p, obj) for p, obj in loaded]


def _shape(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def _nonfinite_error(arr: np.ndarray, name: str, source: str) -> None:
    finite = np.isfinite(arr)
    if not bool(finite.all()):
        nan = int(np.isnan(arr).sum())
        inf = int(arr.size - finite.sum()) - nan
        raise DataError(f"input '{name}' has {nan} NaN and {inf} infinite value(s)", file=source)


def _int_bounds(arr: np.ndarray) -> Tuple[int, int]:
    return (int(arr.min()), int(arr.max())) if arr.size else (0, 0)


def _describe_q(t: PyTensor, q: TensorQuant) -> str:
    scale = q.scale.tolist() if isinstance(q.scale, torch.Tensor) else q.scale
    zerop = q.zerop.tolist() if isinstance(q.zerop, torch.Tensor) else q.zerop
    return f"{t.dtype}, scale {scale}, zp {zerop}"


def _check_one(t: PyTensor, q: TensorQuant, source: str, arr: np.ndarray, quantize_inputs: bool) -> InputSpec:
    """The checks of one input (its params `q`); returns how its data is fed."""
    name, kind = t.name, arr.dtype.kind
    ir_shape = tuple(int(d) for d in t.ir_shape)
    if arr.ndim != len(ir_shape) or tuple(arr.shape[1:]) != ir_shape[1:]:
        raise DataError(f"input '{name}' has shape {_shape(arr.shape)} but the IR expects {_shape(ir_shape)} "
                        f"(only the first, batch dimension may differ)", file=source)
    if arr.ndim > 0 and arr.shape[0] == 0:
        raise DataError(f"input '{name}' has an empty batch (shape {_shape(arr.shape)})", file=source)
    if kind not in "biuf":
        raise DataError(f"input '{name}' has dtype {arr.dtype}, which is not a number type", file=source)
    quantized_input = t.pnode is not None and t.pnode.quantized and not t.dtype.is_float
    if t.dtype.is_float:
        if kind != "f":
            raise DataError(f"input '{name}' is {t.dtype} in the IR but the file holds {arr.dtype} data",
                            file=source)
        _nonfinite_error(arr, name, source)
        return InputSpec(t, source, arr, "float")
    if t.dtype is Dtype.BOOL:
        if kind != "b":
            raise DataError(f"input '{name}' is bool in the IR but the file holds {arr.dtype} data", file=source)
        return InputSpec(t, source, arr, "bool")
    if quantized_input:
        lo, hi = int(q.qmin), int(q.qmax)
        if kind == "f":
            if not quantize_inputs:
                raise DataError(f"input '{name}' is quantized ({_describe_q(t, q)}) and takes integers in "
                                f"[{lo}, {hi}], but the file holds {arr.dtype} data: pass --quantize-inputs to "
                                f"quantize float data with the input's scale/zp", file=source)
            _nonfinite_error(arr, name, source)
            return InputSpec(t, source, arr, "quantize")
        if kind != "b" and quantize_inputs and not q.qinvariant:
            raise DataError(f"input '{name}': --quantize-inputs quantizes float data but the file holds {arr.dtype} "
                            f"integers; give floats, or integers in [{lo}, {hi}] without --quantize-inputs",
                            file=source)
        what = f"the quantized input's range [{lo}, {hi}] ({t.dtype})"
    else:
        lo, hi = t.dtype.int_range()
        hi = min(hi, _INT64_MAX)
        what = f"the range of its IR dtype {t.dtype} [{lo}, {hi}]"
    if kind not in "iu":
        raise DataError(f"input '{name}' is {t.dtype} in the IR but the file holds {arr.dtype} data", file=source)
    amin, amax = _int_bounds(arr)
    if amin < lo or amax > hi:
        raise DataError(f"input '{name}' holds values in [{amin}, {amax}] outside {what}", file=source)
    return InputSpec(t, source, arr, "int")


def check_inputs(graph: PyGraph, data: Sequence[Tuple[str, np.ndarray]], quantize_inputs: bool = False
                 ) -> List[InputSpec]:
    """Check every input (shape, dtype, range, NaN/inf, one batch size for all) before anything runs."""
    if len(data) != len(graph.input_tensors):
        names = [t.name for t in graph.input_tensors]
        raise DataError(f"the IR has {len(names)} input(s) {names} but {len(data)} array(s) were given")
    specs = [_check_one(t, graph.quant.get(t), source, arr, quantize_inputs)
             for t, (source, arr) in zip(graph.input_tensors, data)]
    batched = [s for s in specs if s.batched]
    for s in batched[1:]:
        if s.array.shape[0] != batched[0].array.shape[0]:
            raise DataError(f"inputs disagree on the batch size: '{batched[0].tensor.name}' has "
                            f"{batched[0].array.shape[0]} ({batched[0].source}), '{s.tensor.name}' has "
                            f"{s.array.shape[0]}", file=s.source)
    return specs


def _feed(spec: InputSpec, lo: int, hi: int, table: QuantTable) -> torch.Tensor:
    """The tensor fed for samples [lo, hi) of an input (a copy: the file stays untouched); `table`: the graph's
    params."""
    arr = spec.array[lo:hi] if spec.batched else spec.array
    if spec.kind == "float":
        compute = spec.tensor.dtype.torch_dtype
        return torch.from_numpy(np.array(arr, dtype=np.float64 if compute == torch.float64 else np.float32))
    if spec.kind == "bool":
        return torch.from_numpy(np.array(arr, dtype=np.bool_))
    if spec.kind == "quantize":
        return to_quantized(torch.from_numpy(np.array(arr, dtype=np.float32)), spec.tensor, table)
    return torch.from_numpy(np.array(arr, dtype=np.int64))


@contextlib.contextmanager
def _integer_fed(specs: Sequence[InputSpec]) -> Iterator[None]:
    """Quantized Input layers take the integers they are fed as they are (the backend's view): their own quantize
    step, which the host does before the NPU, is skipped while the graph runs."""
    nodes = [s.tensor.pnode for s in specs if s.kind in ("int", "quantize") and s.tensor.pnode is not None
             and s.tensor.pnode.quantized and str(s.tensor.pnode.type) == "Input"]
    for n in nodes:
        n.quantized = False
    try:
        yield
    finally:
        for n in nodes:
            n.quantized = True


# ------------------------------------------------------------------------------------------------------ outputs
def _values(t: PyTensor) -> np.ndarray:
    """A tensor's current values: floats as computed, integers in their IR dtype (what the backend stores)."""
    x = t.betensor.detach().cpu()
    arr = x.numpy()
    if x.is_floating_point() or x.dtype == torch.bool or t.dtype.is_float or t.dtype is Dtype.BOOL:
        return arr
    target = t.dtype.storage.newbyteorder("=")
    lo, hi = _int_bounds(arr)
    info = np.iinfo(target)
    if lo < info.min or hi > info.max:
        layer = t.pnode.name if t.pnode is not None else "?"
        raise IRError(f"layer '{layer}': output '{t.name}' holds values in [{lo}, {hi}] that do not fit its IR dtype "
                      f"{t.dtype}")
    return arr.astype(target)


def _has_dequant(table: QuantTable, t: PyTensor) -> bool:
    return table.get(t).qmin is not None and not t.dtype.is_float and t.dtype is not Dtype.BOOL


class _Sink:
    """Writes arrays into a folder: whole, or batch by batch into .npy files sized for all samples (so memory
    stays that of one batch), keeping each file's shape, dtype and extrema.

    A batch of n samples holds n / (IR batch) IR batches of every tensor concatenated along dim 0
    (quantopt.graph.batch), so a tensor whose IR dim 0 is d has n * d / (IR batch) rows: d per IR batch (a
    batch-major output has d = IR batch, i.e. one row per sample; an imported model's output may hold the batch
    folded into dim 0, e.g. [seq, 1])."""

    def __init__(self, folder: str, total: int, batched: bool, ir_batch: int = 1) -> None:
        self.folder, self.total, self.batched, self.ir_batch = folder, total, batched, max(int(ir_batch), 1)
        self.info: Dict[str, Dict[str, Any]] = {}
        self._maps: Dict[str, np.memmap] = {}

    def put(self, file: str, arr: np.ndarray, start: int, rows: int, what: str, ir0: Optional[int] = None,
            shared: bool = False) -> None:
        """Write `arr`, the values of samples [start, start + rows); a `shared` tensor (one that does not depend on
        the inputs, e.g. a Constant layer's) is the same for every batch and is written once."""
        path = os.path.join(self.folder, file)
        if shared and file in self.info:
            return
        if not self.batched or shared:
            np.save(path, arr, allow_pickle=False)
            shape: Tuple[int, ...] = tuple(arr.shape)
        else:
            per = self.ir_batch if ir0 is None else int(ir0)  # rows per IR batch
            if arr.ndim == 0 or arr.shape[0] * self.ir_batch != rows * per:
                raise UnsupportedError(f"{what} has shape {_shape(arr.shape)}, whose first dimension does not grow "
                                       f"with the batch of {rows}: run without --batch-size")
            mm = self._maps.get(file)
            if mm is None:
                shape = (self.total * per // self.ir_batch,) + tuple(arr.shape[1:])
                mm = np.lib.format.open_memmap(path, mode="w+", dtype=arr.dtype, shape=shape)
                self._maps[file] = mm
            elif mm.shape[1:] != arr.shape[1:] or mm.dtype != arr.dtype:
                raise UnsupportedError(f"{what} changes from {_shape(mm.shape[1:])} {mm.dtype} to "
                                       f"{_shape(arr.shape[1:])} {arr.dtype} between batches: run without "
                                       f"--batch-size")
            first = start * per // self.ir_batch
            mm[first:first + arr.shape[0]] = arr
            shape = tuple(mm.shape)
        self._update(file, arr, shape)

    def _update(self, file: str, arr: np.ndarray, shape: Tuple[int, ...]) -> None:
        entry = self.info.setdefault(file, {"shape": [int(d) for d in shape], "dtype": str(arr.dtype), "min": None,
                                            "max": None, "nonfinite": 0})
        if arr.size == 0:
            return
        values = arr
        if arr.dtype.kind == "f":
            finite = np.isfinite(arr)
            bad = int(arr.size - finite.sum())
            entry["nonfinite"] += bad
            if bad == arr.size:
                return
            values = arr[finite] if bad else arr
        lo, hi = values.min().item(), values.max().item()
        if arr.dtype.kind == "b":
            lo, hi = int(lo), int(hi)
        entry["min"] = lo if entry["min"] is None else min(entry["min"], lo)
        entry["max"] = hi if entry["max"] is None else max(entry["max"], hi)

    def close(self) -> None:
        for mm in self._maps.values():
            mm.flush()
        self._maps.clear()


def _output_files(table: QuantTable, tensors: Sequence[PyTensor], dequantize: bool
                  ) -> Dict[str, Tuple[str, Optional[str]]]:
    """tensor name -> (file, dequant file or None): `<safe name>.npy`, made unique (ignoring case) with `_2`,
    `_3`... in output order; `table`: the graph's params."""
    used = {INDEX_FILE.lower(), LAYERS_DIR.lower()}
    files: Dict[str, Tuple[str, Optional[str]]] = {}
    for t in tensors:
        base = safe_stem(t.name)
        stem, k = base, 1
        while True:
            names = [stem + ".npy"] + ([stem + ".dequant.npy"] if dequantize and _has_dequant(table, t) else [])
            if not any(n.lower() in used for n in names):
                break
            k += 1
            stem = f"{base}_{k}"
        used.update(n.lower() for n in names)
        files[t.name] = (names[0], names[1] if len(names) > 1 else None)
    return files


def _layer_files(graph: PyGraph, dequantize: bool) -> Dict[str, Tuple[str, Optional[str]]]:
    """tensor name -> files under layers/: `<index>_<safe name>.npy`, the index in execution order."""
    tensors = [t for n in graph.nodes for t in n.outputs]
    width = max(4, len(str(max(len(tensors) - 1, 0))))
    files: Dict[str, Tuple[str, Optional[str]]] = {}
    for i, t in enumerate(tensors):
        stem = f"{LAYERS_DIR}/{i:0{width}d}_{safe_stem(t.name)}"
        dequant = dequantize and _has_dequant(graph.quant, t)
        files[t.name] = (stem + ".npy", stem + ".dequant.npy" if dequant else None)
    return files


def _entry(t: PyTensor, q: TensorQuant, files: Tuple[str, Optional[str]], sink: _Sink) -> Dict[str, Any]:
    """The index entry of a written tensor `t` (its params `q`)."""
    info = sink.info[files[0]]
    quantized = q.qmin is not None and not t.dtype.is_float
    entry: Dict[str, Any] = {
        "file": files[0], "shape": info["shape"], "dtype": info["dtype"], "ir_dtype": str(t.dtype),
        "layer": t.pnode.name if t.pnode is not None else None,
        "layer_type": str(t.pnode.type) if t.pnode is not None else None,
        "quantized": quantized,
        "scale": jsonable(q.scale) if quantized else None, "zp": jsonable(q.zerop) if quantized else None,
        "axis": q.axis if quantized else None,
        "range": [int(q.qmin), int(q.qmax)] if quantized else None,
        "min": jsonable(info["min"]), "max": jsonable(info["max"]),
    }
    if info["nonfinite"]:
        entry["nonfinite"] = info["nonfinite"]
    if files[1] is not None:
        deq = sink.info[files[1]]
        entry["dequant_file"] = files[1]
        entry["dequant_min"], entry["dequant_max"] = jsonable(deq["min"]), jsonable(deq["max"])
    return entry


def _unique(tensors: Sequence[PyTensor]) -> List[PyTensor]:
    seen, out = set(), []
    for t in tensors:
        if t.name not in seen:
            seen.add(t.name)
            out.append(t)
    return out


def _data_dependent(graph: PyGraph) -> set:
    """Names of the tensors computed from the graph inputs (the others, e.g. Constant layers' outputs, are the same
    for every batch)."""
    names = {t.name for t in graph.input_tensors}
    for n in graph.nodes:
        if any(t.name in names for t in n.inputs):
            names.update(t.name for t in n.outputs)
    return names


def run_graph(graph: PyGraph, specs: Sequence[InputSpec], folder: str, batch_size: Optional[int] = None,
              dequantize: bool = False, dump_all: bool = False) -> Dict[str, Any]:
    """Run `graph` on checked inputs, writing the outputs (and with `dump_all` every layer output) into `folder`;
    returns the index (what outputs.json holds, without writing it)."""
    batched = [s for s in specs if s.batched]
    total = int(batched[0].array.shape[0]) if batched else 1
    step = total if not batch_size or not batched else min(batch_size, total)
    chunks = [(lo, min(lo + step, total)) for lo in range(0, total, step)]
    ir_batch = int(graph.input_tensors[0].ir_shape[0]) if graph.input_tensors and graph.input_tensors[0].ir_shape \
        else 1
    sink = _Sink(folder, total, len(chunks) > 1, ir_batch)
    data_dependent = _data_dependent(graph)
    outputs = _unique(graph.output_tensors)
    table = graph.quant
    out_files = _output_files(table, outputs, dequantize)
    layer_files = _layer_files(graph, dequantize) if dump_all else {}
    if dump_all:
        os.makedirs(os.path.join(folder, LAYERS_DIR), exist_ok=True)

    def save(t: PyTensor, files: Tuple[str, Optional[str]], lo: int, hi: int) -> None:
        what = f"output '{t.name}' of layer '{t.pnode.name if t.pnode is not None else '?'}'"
        ir0 = int(t.ir_shape[0]) if t.ir_shape else None
        shared = t.name not in data_dependent
        sink.put(files[0], _values(t), lo, hi - lo, what, ir0, shared)
        if files[1] is not None:
            sink.put(files[1], to_float(t, table).cpu().numpy(), lo, hi - lo, what, ir0, shared)

    span = [0, 0]

    def dump_layer(node: PyNode) -> None:
        for t in node.outputs:
            save(t, layer_files[t.name], span[0], span[1])

    try:
        with torch.no_grad(), _integer_fed(specs):
            for lo, hi in progress(chunks, "run"):
                span[:] = [lo, hi]
                graph.forward([_feed(s, lo, hi, table) for s in specs], after_node=dump_layer if dump_all else None)
                for t in outputs:
                    save(t, out_files[t.name], lo, hi)
    finally:
        sink.close()
    index: Dict[str, Any] = {
        "format": RUN_FORMAT, "format_version": RUN_FORMAT_VERSION, "quantopt_version": __version__,
        "model": graph.name, "ir": graph.source_file,
        "quantized": any(n.quantized for n in graph.nodes),
        "samples": total, "batches": len(chunks),
        "dequantize": "x = (q + zp) / scale",
        "inputs": {s.tensor.name: {"file": s.source, "shape": [int(d) for d in s.array.shape],
                                   "dtype": str(s.array.dtype), "quantized_by_run": s.kind == "quantize"}
                   for s in specs},
        "outputs": {t.name: _entry(t, table.get(t), out_files[t.name], sink) for t in outputs},
    }
    if dump_all:
        index["layers"] = {n: _entry(t, table.get(t), layer_files[n], sink) for n, t in
                           ((t.name, t) for node in graph.nodes for t in node.outputs)}
    return index


def index_text(index: Dict[str, Any]) -> str:
    """outputs.json text: indented, with lists of plain values (shapes, ranges, scales) kept on one line."""
    text = json.dumps(index, ensure_ascii=False, indent=1, allow_nan=False)
    # only whitespace between tokens goes (JSON strings hold no raw newline), so the result stays valid JSON
    return _FLAT_LIST.sub(lambda m: re.sub(r"\n\s*", "", m.group(0)), text) + "\n"


# ------------------------------------------------------------------------------------------------- the folder
def _is_run_folder(path: str) -> bool:
    """Whether `path` holds an earlier `quantopt run` output (its outputs.json says so)."""
    try:
        with open(os.path.join(path, INDEX_FILE), encoding="utf-8") as f:
            return json.load(f).get("format") == RUN_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _check_out_dir(out_dir: str) -> None:
    """OUTDIR must be new, empty, or an earlier run's output (which is replaced)."""
    if os.path.islink(out_dir):
        raise ConfigError("the output folder is a symbolic link; give the folder it points to", file=out_dir)
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise ConfigError("the output path exists and is not a folder", file=out_dir)
    if os.listdir(out_dir) and not _is_run_folder(out_dir):
        raise ConfigError(f"the output folder is not empty and holds no earlier `quantopt run` output ({INDEX_FILE}); "
                          f"give a new or empty folder", file=out_dir)


def _commit(tmp: str, out_dir: str) -> None:
    """Move the finished temp folder to OUTDIR, replacing an empty folder or an earlier run's output."""
    _check_out_dir(out_dir)
    if not os.path.isdir(out_dir):
        os.rename(tmp, out_dir)
        return
    if not os.listdir(out_dir):
        os.rmdir(out_dir)
        os.rename(tmp, out_dir)
        return
    old = tmp + ".old"
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _missing_parents(path: str) -> Optional[str]:
    """The outermost folder of `path`'s parents that does not exist yet (removed again if the run fails)."""
    top = None
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        top = parent
        parent = os.path.dirname(parent)
    return top


def _remove_created(folder: str, created: Optional[str]) -> None:
    """Remove the empty folders from `folder` up to `created` (those this run made), nothing above."""
    if created is None:
        return
    while True:
        with contextlib.suppress(OSError):
            os.rmdir(folder)
        if folder == created or len(folder) <= len(created):
            return
        folder = os.path.dirname(folder)


def run_files(model: str, inputs: Sequence[str], out_dir: str, bin_path: Optional[str] = None,
              dequantize: bool = False, quantize_inputs: bool = False, batch_size: Optional[int] = None,
              dump_all: bool = False, allow_unknown_ir_keys: bool = False, device: str = "cpu") -> Dict[str, Any]:
    """Load the IR and the input files, check them, run (on `device`: cpu, cuda, cuda:N or auto; the integers
    are the same on every device), and write OUTDIR atomically; returns the index."""
    from .device import exact_arithmetic, resolve_device
    from .graph.graph import QuantizeGraph
    from .ir.reader import read_ir
    from .registry import discover_plugins

    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1 (got {batch_size})")
    out_dir = os.path.abspath(out_dir)
    _check_out_dir(out_dir)
    where = resolve_device(device)
    discover_plugins()
    graph = read_ir(model, bin_path, QuantizeGraph, allow_unknown_keys=allow_unknown_ir_keys)
    if graph.header.get("compat_quantized_model") is True:
        raise UnsupportedError("IRs of pre-quantized models (compat_quantized_model=true) are not supported",
                               file=model)
    quantized = any(n.quantized for n in graph.nodes)
    if dequantize and not quantized:
        OPT_WARN("--dequantize: the IR is a float IR; its outputs are saved as computed")
    has_q_inputs = any(t.pnode is not None and t.pnode.quantized and not t.dtype.is_float
                       for t in graph.input_tensors)
    if quantize_inputs and not has_q_inputs:
        OPT_WARN("--quantize-inputs: the IR has no quantized inputs; inputs are used as they are")
    specs = check_inputs(graph, load_input_files(inputs, graph), quantize_inputs)
    created = _missing_parents(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", suffix=".tmp", dir=os.path.dirname(out_dir))
    try:
        with exact_arithmetic(where):
            index = run_graph(graph.to(where), specs, tmp, batch_size, dequantize and quantized, dump_all)
        with open(os.path.join(tmp, INDEX_FILE), "w", encoding="utf-8") as f:
            f.write(index_text(index))
        _commit(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(os.path.dirname(out_dir), created)
        raise
    return index


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def print_summary(index: Dict[str, Any], out_dir: str) -> None:
    """Per output: shape, dtype, min/max (and of the dequantized values), and the file."""
    kind = "quantized" if index["quantized"] else "float"
    print(f"{index['model']} ({kind} IR): {index['samples']} sample(s) in {index['batches']} batch(es) -> {out_dir}")
    for name, e in index["outputs"].items():
        line = (f"  {name}: {_shape(e['shape'])} {e['dtype']} min {_fmt(e['min'])} max {_fmt(e['max'])}")
        if "dequant_file" in e:
            line += f" (dequantized {_fmt(e['dequant_min'])} .. {_fmt(e['dequant_max'])})"
        print(line + f" -> {e['file']}")
        if e.get("nonfinite"):
            OPT_WARN(f"output '{name}' holds {e['nonfinite']} NaN/infinite value(s)")


# --------------------------------------------------------------------------------------------------------- CLI
def run_main(argv: List[str]) -> int:
    """`quantopt run MODEL.txt -i IN.npy [-i ...] -o OUTDIR [...]`; returns the exit code."""
    from .cli_support import guarded, run_parser  # torch-free, shared with the cli (`quantopt run --help`)

    args = run_parser().parse_args(argv)
    try:
        setup_console(args.log_level)
    except ValueError as e:
        print(f"quantopt run: {e}", file=sys.stderr)
        return 2

    def run() -> int:
        index = run_files(args.model, args.input, args.output_dir, args.bin, args.dequantize, args.quantize_inputs,
                          args.batch_size, args.dump_all, args.allow_unknown_ir_keys, args.device)
        print_summary(index, args.output_dir)
        OPT_INFO(f"wrote {len(index['outputs'])} output(s) and {INDEX_FILE} to {args.output_dir}")
        return 0
    return guarded(run, args.debug)
