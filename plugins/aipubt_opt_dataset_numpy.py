"""Built-in dataset plugins for NumPy files (.npy, .npz): the upstream `Numpy*Dataset` family.

| plugin | data file | one sample |
|---|---|---|
| NumpyDataset | .npy (N, ...) | one float32 input (an integer or bool array keeps its dtype) |
| NumpyNHWC2NCHWDataset / NumpyNCHW2NHWCDataset | .npy (N, H, W, C) / (N, C, H, W) | one float32 input, transposed |
| NUMPYNHWCRGB2BGR | .npy (N, H, W, 3) | one float32 input, channels reversed |
| NumpyNHWCRGB2NCBGRHWDataset | .npy (N, H, W, 3) | channels reversed, then (C, H, W) |
| NumpyMultiInputDataset | .npz, or a .npy with named fields | one float32 input per array (or its integer dtype) |
| NumpyMIMONCHWDataset | like NumpyMultiInputDataset, (N, H, W, C) arrays | each input transposed to (C, H, W) |
| NumpyMultiInputWithoutBatchDimDataset | like NumpyMultiInputDataset | the whole file: one sample, dtypes kept |
| NumpyZippedDataset / OpTestNumpyZippedDataset | .npz with `shape_*` entries | one input per array, dtypes kept |

Unlike upstream, pickled data is never loaded (`allow_pickle=False`): a .npy/.npz file can then only hold plain
numeric arrays, and a file that would need unpickling is refused with a `DataError` instead of executing code.
The dict-of-arrays .npy files upstream reads (saved with `np.save(f, {...})`) are pickles; the same arrays saved
with `np.savez(f, **arrays)`, or as one structured array with a field per input, are read instead.
Every problem with a file is reported as a `DataError` naming that file, so the CLI prints one clear line.
"""
from __future__ import annotations

import zipfile
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.utils.data

from quantopt import DataError, PluginType, register_plugin
from quantopt.data_files import read_head

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_NUMERIC_KINDS = "biuf"  # bool, signed, unsigned, float
_PICKLE_HINT = ("only plain numeric arrays are accepted (pickle is never loaded); save several arrays with "
                "np.savez(file, name0=array0, name1=array1, ...) instead of np.save(file, dict)")

Loaded = Union[np.ndarray, "OrderedArrays"]


class OrderedArrays:
    """Named arrays in file order: the arrays of an .npz (the order given to `np.savez`) or the fields of a
    structured .npy (the dtype's field order)."""

    def __init__(self, keys: List[str], arrays: List[np.ndarray], source: str = "npz") -> None:
        self.keys = keys
        self.arrays = arrays
        self.source = source  # "npz" or "fields"


def _sniff(path: str) -> str:
    """'npy', 'npz' or 'pickle' from the first bytes, so a wrong file gets a precise message, not numpy's guess."""
    head = read_head(path, 6, "a .npy or .npz file")
    if head.startswith(_NPY_MAGIC):
        return "npy"
    if head[:4] in _ZIP_MAGICS:
        return "npz"
    if head[:1] == b"\x80":
        raise DataError("holds pickled Python data; only plain .npy/.npz arrays are accepted (pickle is not "
                        "loaded for safety)", file=path)
    raise DataError("unreadable: not a NumPy .npy or .npz file", file=path)


def _check_array(path: str, what: str, array: np.ndarray, allow_scalar: bool = False) -> np.ndarray:
    if array.dtype.kind not in _NUMERIC_KINDS:
        raise DataError(f"{what} has dtype {array.dtype}; only bool, integer and float arrays are accepted",
                        file=path)
    if array.ndim == 0 and not allow_scalar:
        raise DataError(f"{what} is a scalar; expected an array whose first axis counts the samples", file=path)
    return array


def _fields(path: str, array: np.ndarray, allow_scalar: bool) -> OrderedArrays:
    """A structured .npy: one named field per array (the pickle-free form of upstream's dict .npy)."""
    if array.ndim != 1:
        raise DataError(f"the structured array has shape {list(array.shape)}; expected one record per sample "
                        f"(a 1-D array whose fields are the inputs)", file=path)
    keys = list(array.dtype.names or ())
    return OrderedArrays(keys, [_check_array(path, f"field '{k}'", array[k], allow_scalar) for k in keys],
                         source="fields")


def _load(path: str, mmap: bool, allow_scalar: bool = False) -> Loaded:
    """A .npy array (memory-mapped when `mmap`), the fields of a structured .npy or the arrays of a .npz; never
    unpickles anything."""
    kind = _sniff(path)
    try:
        if kind == "npy":
            array = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
            if array.dtype.names:
                return _fields(path, array, allow_scalar)
            return _check_array(path, "the array", array, allow_scalar)
        keys: List[str] = []
        arrays: List[np.ndarray] = []
        with np.load(path, allow_pickle=False) as npz:
            for key in npz.files:
                keys.append(key)
                arrays.append(_check_array(path, f"array '{key}'", npz[key], allow_scalar))
        if not keys:
            raise DataError("the .npz archive holds no arrays", file=path)
        return OrderedArrays(keys, arrays)
    except DataError:
        raise
    except ValueError as e:
        text = str(e).lower()
        if "pickle" in text or "python objects" in text:
            raise DataError(f"holds an object (pickled) array, e.g. a dict saved with np.save; {_PICKLE_HINT}",
                            file=path) from None
        raise DataError(f"unreadable: {e}", file=path) from None
    except (OSError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise DataError(f"unreadable: {e}", file=path) from None


def _load_npy(path: str, cls_name: str) -> np.ndarray:
    data = _load(path, mmap=True)
    if isinstance(data, OrderedArrays):
        what = "is an .npz archive" if data.source == "npz" else "holds a structured array (named fields)"
        raise DataError(f"{what}; {cls_name} needs a single plain .npy array (use NumpyMultiInputDataset for "
                        f"one input per array or field)", file=path)
    return data


def _load_multi(path: str, cls_name: str) -> OrderedArrays:
    data = _load(path, mmap=False)
    if isinstance(data, np.ndarray):
        raise DataError(f"is a single .npy array; {cls_name} needs an .npz archive with one array per model input "
                        f"(use NumpyDataset for a single input)", file=path)
    return data


def _load_labels(label_file: Optional[str], count: int, data_file: str) -> Optional[Tuple[List[np.ndarray], bool]]:
    """Label arrays (one per model output), each checked to hold one row per data sample; and whether the file
    held named arrays (a list of labels per sample) rather than one plain array."""
    if label_file is None:
        return None
    label_file = str(label_file)
    labels = _load(label_file, mmap=True)
    arrays = [("the label array", labels)] if isinstance(labels, np.ndarray) else \
        [(f"label array '{k}'", a) for k, a in zip(labels.keys, labels.arrays)]
    for what, a in arrays:
        if a.shape[0] != count:
            raise DataError(f"{what} has {a.shape[0]} samples but the data file {data_file} has {count}",
                            file=label_file)
    return [a for _, a in arrays], isinstance(labels, OrderedArrays)


def _non_finite(array: np.ndarray) -> Optional[str]:
    if array.dtype.kind != "f" or np.isfinite(array).all():
        return None
    return "NaN" if np.isnan(array).any() else "inf"


def _finite_input(path: str, what: str, index: int, row: np.ndarray) -> torch.Tensor:
    """A float32 copy of one sample, or of an integer or bool array's sample in its own dtype (token ids, masks:
    the IR's integer input takes them; float32 would refuse or round them); NaN/inf are refused here (checking
    lazily keeps large files mmap'd)."""
    if np.asarray(row).dtype.kind in "iub":
        return _typed_input(path, what, row, f" at sample {index}")
    out = np.array(row, dtype=np.float32)
    bad = _non_finite(out)
    if bad:
        raise DataError(f"{what} contains {bad} at sample {index}", file=path)
    return torch.from_numpy(out)


def _typed_input(path: str, what: str, row: np.ndarray, where: str) -> torch.Tensor:
    """A copy of `row` in its own dtype (torch has no uint16/32/64: those become int64); NaN/inf refused."""
    out = np.array(row)
    bad = _non_finite(out)
    if bad:
        raise DataError(f"{what} contains {bad}{where}", file=path)
    if out.dtype.kind == "u" and out.dtype.itemsize > 1:
        if out.dtype.itemsize == 8 and out.size and int(out.max()) > np.iinfo(np.int64).max:
            raise DataError(f"{what} holds uint64 values above the int64 range{where}", file=path)
        out = out.astype(np.int64)
    return torch.from_numpy(out)


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing `array`'s memory, copied first if not C-contiguous (np.ascontiguousarray would turn a
    0-D sample into 1-D)."""
    return torch.from_numpy(array if array.flags.c_contiguous else array.copy())


def _label_row(array: np.ndarray, index: int) -> torch.Tensor:
    return torch.from_numpy(np.array(array[index]))


def _no_label() -> torch.Tensor:
    return torch.tensor(float("-inf"), dtype=torch.float32)


def _index(index: Any, count: int) -> int:
    i = int(index)
    if i < 0:
        i += count
    if not 0 <= i < count:
        raise IndexError(f"sample index {index} out of range for {count} samples")
    return i


def _require_rank(path: str, what: str, shape: Tuple[int, ...], rank: int, layout: str) -> None:
    if len(shape) != rank:
        raise DataError(f"{what} has shape {list(shape)}; expected {rank}-D {layout} data", file=path)


def _require_channels(path: str, what: str, channels: int) -> None:
    if channels != 3:
        raise DataError(f"{what} has {channels} channels in its last axis; RGB→BGR needs 3", file=path)


@register_plugin(PluginType.Dataset, "1.0")
class NumpyDataset(torch.utils.data.Dataset):
    """One .npy array (N, ...) → N single-input samples `[input, label]`; the array stays memory-mapped."""

    def __init__(self, data_file: str, label_file: Optional[str] = None) -> None:
        self.data_file = str(data_file)
        self.label_file = str(label_file) if label_file is not None else None
        self.data = _load_npy(self.data_file, type(self).__name__)
        self._check_data()
        loaded = _load_labels(self.label_file, len(self), self.data_file)
        labels = loaded[0] if loaded is not None else None
        if labels is not None and len(labels) != 1:
            raise DataError(f"holds {len(labels)} label arrays; {type(self).__name__} expects one label array "
                            f"(a .npy file or an .npz with a single array)", file=self.label_file)
        self.label = labels[0] if labels is not None else None

    def _check_data(self) -> None:
        """Hook for subclasses: validate the shape of `self.data` before any sample is read."""

    def _transform(self, sample: np.ndarray) -> np.ndarray:
        """Hook for subclasses: rearrange one float32 sample (the array without its sample axis)."""
        return sample

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def __getitem__(self, index: int) -> List[Any]:
        i = _index(index, len(self))
        sample = _finite_input(self.data_file, "the data", i, self.data[i])
        sample = _tensor(self._transform(sample.numpy()))
        label = _label_row(self.label, i) if self.label is not None else _no_label()
        return [sample, label]


@register_plugin(PluginType.Dataset, "1.0")
class NumpyNHWC2NCHWDataset(NumpyDataset):
    """An NHWC .npy (N, H, W, C) for an IR that takes NCHW: each sample is transposed to (C, H, W)."""

    def _check_data(self) -> None:
        _require_rank(self.data_file, "the array", self.data.shape, 4, "(N, H, W, C)")

    def _transform(self, sample: np.ndarray) -> np.ndarray:
        return sample.transpose(2, 0, 1)


@register_plugin(PluginType.Dataset, "1.0")
class NumpyNCHW2NHWCDataset(NumpyDataset):
    """An NCHW .npy (N, C, H, W) for an IR that takes NHWC: each sample is transposed to (H, W, C)."""

    def _check_data(self) -> None:
        _require_rank(self.data_file, "the array", self.data.shape, 4, "(N, C, H, W)")

    def _transform(self, sample: np.ndarray) -> np.ndarray:
        return sample.transpose(1, 2, 0)


@register_plugin(PluginType.Dataset, "1.0")
class NUMPYNHWCRGB2BGR(NumpyDataset):
    """An NHWC RGB .npy (N, H, W, 3) for an IR trained on BGR: the channel order is reversed, layout kept."""

    def _check_data(self) -> None:
        _require_rank(self.data_file, "the array", self.data.shape, 4, "(N, H, W, C)")
        _require_channels(self.data_file, "the array", self.data.shape[-1])

    def _transform(self, sample: np.ndarray) -> np.ndarray:
        return sample[..., ::-1]


@register_plugin(PluginType.Dataset, "1.0")
class NumpyNHWCRGB2NCBGRHWDataset(NUMPYNHWCRGB2BGR):
    """An NHWC RGB .npy (N, H, W, 3) for an NCHW BGR IR: channels reversed, then each sample is (3, H, W)."""

    def _transform(self, sample: np.ndarray) -> np.ndarray:
        return sample[..., ::-1].transpose(2, 0, 1)


@register_plugin(PluginType.Dataset, "1.0")
class NumpyMultiInputDataset(torch.utils.data.Dataset):
    """An .npz with one (N, ...) array per model input, in input order → samples `[[in0, in1, ...], label]`.

    A structured .npy (one record per sample, one field per input, fields in input order) is read the same way.
    Labels: a .npy array (one output), or an .npz / structured .npy whose arrays are the per-output labels in
    output order (then the label of a sample is a list).
    """

    def __init__(self, data_file: str, label_file: Optional[str] = None) -> None:
        self.data_file = str(data_file)
        self.label_file = str(label_file) if label_file is not None else None
        data = _load_multi(self.data_file, type(self).__name__)
        self.keys = data.keys
        self.inputs = data.arrays
        counts: List[Tuple[str, int]] = [(k, int(a.shape[0])) for k, a in zip(self.keys, self.inputs)]
        if len({c for _, c in counts}) != 1:
            listed = ", ".join(f"'{k}': {c}" for k, c in counts)
            raise DataError(f"the input arrays have different sample counts ({listed})", file=self.data_file)
        self.count = counts[0][1]
        self._check_data()
        loaded = _load_labels(self.label_file, self.count, self.data_file)
        self.labels = loaded[0] if loaded is not None else None
        self.label_is_list = bool(loaded and loaded[1])

    def _check_data(self) -> None:
        """Hook for subclasses: validate the input arrays before any sample is read."""

    def _transform(self, sample: np.ndarray) -> np.ndarray:
        """Hook for subclasses: rearrange one float32 sample of one input."""
        return sample

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> List[Any]:
        i = _index(index, self.count)
        inputs = [_finite_input(self.data_file, f"array '{k}'", i, a[i]) for k, a in zip(self.keys, self.inputs)]
        inputs = [_tensor(self._transform(x.numpy())) for x in inputs]
        if self.labels is None:
            label: Any = _no_label()
        elif self.label_is_list:
            label = [_label_row(a, i) for a in self.labels]
        else:
            label = _label_row(self.labels[0], i)
        return [inputs, label]


@register_plugin(PluginType.Dataset, "1.0")
class NumpyMIMONCHWDataset(NumpyMultiInputDataset):
    """Like NumpyMultiInputDataset with NHWC (N, H, W, C) arrays; each input sample is transposed to (C, H, W)."""

    def _check_data(self) -> None:
        for k, a in zip(self.keys, self.inputs):
            _require_rank(self.data_file, f"array '{k}'", a.shape, 4, "(N, H, W, C)")

    def _transform(self, sample: np.ndarray) -> np.ndarray:
        return sample.transpose(2, 0, 1)


def _split_shapes(path: str, data: OrderedArrays) -> Tuple[List[str], List[np.ndarray], Dict[str, np.ndarray]]:
    """Separate the `shape*` entries (IR shapes written by op test generators) from the data arrays."""
    keys: List[str] = []
    arrays: List[np.ndarray] = []
    shapes: Dict[str, np.ndarray] = {}
    for k, a in zip(data.keys, data.arrays):
        if k.startswith("shape"):
            shapes[k] = np.asarray(a)
        else:
            keys.append(k)
            arrays.append(a)
    if not keys:
        raise DataError("holds only 'shape*' entries and no data arrays", file=path)
    return keys, arrays, shapes


@register_plugin(PluginType.Dataset, "1.0")
class NumpyMultiInputWithoutBatchDimDataset(torch.utils.data.Dataset):
    """For IRs whose inputs have no batch dimension (cfg `without_batch_dim = true`): the whole file is ONE
    sample; each array (in file order, `shape*` entries skipped) is one input with exactly the IR input shape.

    Data: an .npz or a structured .npy. Labels (optional): the same, each array a whole output. Integer and bool
    dtypes are kept (floats are checked for NaN/inf), so integer model inputs such as token ids work.
    """

    def __init__(self, data_file: str, label_file: Optional[str] = None) -> None:
        self.data_file = str(data_file)
        self.label_file = str(label_file) if label_file is not None else None
        data = _load(self.data_file, mmap=False, allow_scalar=True)
        if isinstance(data, np.ndarray):
            data = OrderedArrays(["0"], [data])
        self.keys, self.inputs, _ = _split_shapes(self.data_file, data)
        self.labels: Optional[List[np.ndarray]] = None
        if self.label_file is not None:
            labels = _load(self.label_file, mmap=False, allow_scalar=True)
            if isinstance(labels, np.ndarray):
                labels = OrderedArrays(["0"], [labels])
            self.label_keys, self.labels, _ = _split_shapes(self.label_file, labels)

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> List[Any]:
        _index(index, 1)
        inputs = [_typed_input(self.data_file, f"array '{k}'", a, "") for k, a in zip(self.keys, self.inputs)]
        label: Any = _no_label() if self.labels is None else \
            [torch.from_numpy(np.array(a)) for a in self.labels]
        return [inputs[0] if len(inputs) == 1 else inputs, label]


@register_plugin(PluginType.Dataset, "1.0")
class NumpyZippedDataset(torch.utils.data.Dataset):
    """The op-test format: an .npz whose arrays `'0', '1', ...` (file order) are the inputs, each (N, ...), plus
    optional `shape_<key>` entries holding IR shapes (kept in `input_shapes`, not used for reading).

    Dtypes are kept (uint16/32/64 become int64). Labels (optional): an .npz likewise, the label of a sample is a
    list with one entry per output; an output whose `shape_<key>` entry is empty (a scalar output) gets its whole
    label array for every sample, the others row `i`.
    """

    def __init__(self, data_file: str, label_file: Optional[str] = None) -> None:
        self.data_file = str(data_file)
        self.label_file = str(label_file) if label_file is not None else None
        data = _load_multi(self.data_file, type(self).__name__)
        self.keys, self.inputs, shapes = _split_shapes(self.data_file, data)
        self.input_shapes = [shapes[k] for k in shapes]
        counts = [(k, int(a.shape[0])) for k, a in zip(self.keys, self.inputs)]
        if len({c for _, c in counts}) != 1:
            listed = ", ".join(f"'{k}': {c}" for k, c in counts)
            raise DataError(f"the input arrays have different sample counts ({listed})", file=self.data_file)
        self.count = counts[0][1]
        self.labels: Optional[List[np.ndarray]] = None
        self.per_sample: List[bool] = []
        self.output_shapes: List[np.ndarray] = []
        if self.label_file is not None:
            self._load_labels()

    def _load_labels(self) -> None:
        path = str(self.label_file)
        labels = _load(path, mmap=False, allow_scalar=True)
        if isinstance(labels, np.ndarray):
            labels = OrderedArrays(["0"], [labels])
        keys, arrays, shapes = _split_shapes(path, labels)
        self.output_shapes = [shapes[k] for k in shapes]
        positional = len(shapes) == len(keys)
        self.per_sample = []
        for j, (k, a) in enumerate(zip(keys, arrays)):
            shape = shapes.get(f"shape_{k}", self.output_shapes[j] if positional else None)
            per_sample = shape is None or shape.size > 0
            if per_sample and (a.ndim == 0 or a.shape[0] != self.count):
                rows = "a scalar" if a.ndim == 0 else f"{a.shape[0]} samples"
                raise DataError(f"label array '{k}' has {rows} but the data file {self.data_file} has "
                                f"{self.count}", file=path)
            self.per_sample.append(per_sample)
        self.label_keys = keys
        self.labels = arrays

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> List[Any]:
        i = _index(index, self.count)
        where = f" at sample {i}"
        inputs = [_typed_input(self.data_file, f"array '{k}'", a[i], where) for k, a in zip(self.keys, self.inputs)]
        if self.labels is None:
            return [inputs, _no_label()]
        label = [_typed_input(str(self.label_file), f"label array '{k}'", a[i] if per else a, where)
                 for k, a, per in zip(self.label_keys, self.labels, self.per_sample)]
        return [inputs, label]


@register_plugin(PluginType.Dataset, "1.0")
class OpTestNumpyZippedDataset(NumpyZippedDataset):
    """The same reader as NumpyZippedDataset, under the name upstream's op tests use."""
