"""Built-in dataset plugins for NumPy files: `NumpyDataset` (.npy, one input) and `NumpyMultiInputDataset` (.npz).

Unlike upstream, pickled data is never loaded (`allow_pickle=False`): a .npy/.npz file can then only hold plain
numeric arrays, and a file that would need unpickling is refused with a `DataError` instead of executing code.
Every problem with a file is reported as a `DataError` naming that file, so the CLI prints one clear line.
"""
from __future__ import annotations

import os
import zipfile
from typing import Any, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.utils.data

from quantopt import DataError, PluginType, register_plugin

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_NUMERIC_KINDS = "biuf"  # bool, signed, unsigned, float

Loaded = Union[np.ndarray, "OrderedArrays"]


class OrderedArrays:
    """The arrays of one .npz in archive order (which is the order the arrays were passed to `np.savez`)."""

    def __init__(self, keys: List[str], arrays: List[np.ndarray]) -> None:
        self.keys = keys
        self.arrays = arrays


def _sniff(path: str) -> str:
    """'npy', 'npz' or 'pickle' from the first bytes, so a wrong file gets a precise message, not numpy's guess."""
    if not os.path.exists(path):
        raise DataError("file not found", file=path)
    if os.path.isdir(path):
        raise DataError("is a directory, expected a .npy or .npz file", file=path)
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise DataError(f"cannot read the file: {e.strerror or e}", file=path) from None
    if head.startswith(_NPY_MAGIC):
        return "npy"
    if head[:4] in _ZIP_MAGICS:
        return "npz"
    if head[:1] == b"\x80":
        raise DataError("holds pickled Python data; only plain .npy/.npz arrays are accepted (pickle is not "
                        "loaded for safety)", file=path)
    raise DataError("unreadable: not a NumPy .npy or .npz file", file=path)


def _check_array(path: str, what: str, array: np.ndarray) -> np.ndarray:
    if array.dtype.kind not in _NUMERIC_KINDS:
        raise DataError(f"{what} has dtype {array.dtype}; only bool, integer and float arrays are accepted",
                        file=path)
    if array.ndim == 0:
        raise DataError(f"{what} is a scalar; expected an array whose first axis counts the samples", file=path)
    return array


def _load(path: str, mmap: bool) -> Loaded:
    """A .npy array (memory-mapped when `mmap`) or the arrays of a .npz; never unpickles anything."""
    kind = _sniff(path)
    try:
        if kind == "npy":
            array = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
            return _check_array(path, "the array", array)
        keys: List[str] = []
        arrays: List[np.ndarray] = []
        with np.load(path, allow_pickle=False) as npz:
            for key in npz.files:
                keys.append(key)
                arrays.append(_check_array(path, f"array '{key}'", npz[key]))
        if not keys:
            raise DataError("the .npz archive holds no arrays", file=path)
        return OrderedArrays(keys, arrays)
    except DataError:
        raise
    except ValueError as e:
        text = str(e).lower()
        if "pickle" in text or "python objects" in text:
            raise DataError("holds an object (pickled) array; only plain numeric arrays are accepted",
                            file=path) from None
        raise DataError(f"unreadable: {e}", file=path) from None
    except (OSError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise DataError(f"unreadable: {e}", file=path) from None


def _load_npy(path: str, cls_name: str) -> np.ndarray:
    data = _load(path, mmap=True)
    if isinstance(data, OrderedArrays):
        raise DataError(f"is an .npz archive; {cls_name} needs a single .npy array (use NumpyMultiInputDataset "
                        f"for .npz files)", file=path)
    return data


def _load_labels(label_file: Optional[str], count: int, data_file: str) -> Optional[List[np.ndarray]]:
    """Label arrays (one per model output), each checked to hold one row per data sample."""
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
    return [a for _, a in arrays]


def _finite_input(path: str, what: str, index: int, row: np.ndarray) -> torch.Tensor:
    """A float32 copy of one sample; NaN/inf are refused here (checking lazily keeps large files mmap'd)."""
    out = np.array(row, dtype=np.float32)
    if not np.isfinite(out).all():
        bad = "NaN" if np.isnan(out).any() else "inf"
        raise DataError(f"{what} contains {bad} at sample {index}", file=path)
    return torch.from_numpy(out)


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


@register_plugin(PluginType.Dataset, "1.0")
class NumpyDataset(torch.utils.data.Dataset):
    """One .npy array (N, ...) → N single-input samples `[input, label]`; the array stays memory-mapped."""

    def __init__(self, data_file: str, label_file: Optional[str] = None) -> None:
        self.data_file = str(data_file)
        self.label_file = str(label_file) if label_file is not None else None
        self.data = _load_npy(self.data_file, type(self).__name__)
        labels = _load_labels(self.label_file, len(self), self.data_file)
        if labels is not None and len(labels) != 1:
            raise DataError(f"holds {len(labels)} label arrays; {type(self).__name__} expects one label array "
                            f"(a .npy file or an .npz with a single array)", file=self.label_file)
        self.label = labels[0] if labels is not None else None

    def __len__(self) -> int:
        return int(self.data.shape[0])

    def __getitem__(self, index: int) -> List[Any]:
        i = _index(index, len(self))
        sample = _finite_input(self.data_file, "the data", i, self.data[i])
        label = _label_row(self.label, i) if self.label is not None else _no_label()
        return [sample, label]


@register_plugin(PluginType.Dataset, "1.0")
class NumpyMultiInputDataset(torch.utils.data.Dataset):
    """An .npz with one (N, ...) array per model input, in input order → samples `[[in0, in1, ...], label]`.

    Labels: a .npy array (one output), or an .npz whose arrays are the per-output labels in output order.
    """

    def __init__(self, data_file: str, label_file: Optional[str] = None) -> None:
        self.data_file = str(data_file)
        self.label_file = str(label_file) if label_file is not None else None
        data = _load(self.data_file, mmap=False)
        if isinstance(data, np.ndarray):
            raise DataError(f"is a single .npy array; {type(self).__name__} needs an .npz archive with one array "
                            f"per model input (use NumpyDataset for a single input)", file=self.data_file)
        self.keys = data.keys
        self.inputs = data.arrays
        counts: List[Tuple[str, int]] = [(k, int(a.shape[0])) for k, a in zip(self.keys, self.inputs)]
        if len({c for _, c in counts}) != 1:
            listed = ", ".join(f"'{k}': {c}" for k, c in counts)
            raise DataError(f"the input arrays have different sample counts ({listed})", file=self.data_file)
        self.count = counts[0][1]
        labels = _load_labels(self.label_file, self.count, self.data_file)
        self.labels = labels
        self.label_is_list = self.label_file is not None and _sniff(self.label_file) == "npz"

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> List[Any]:
        i = _index(index, self.count)
        inputs = [_finite_input(self.data_file, f"array '{k}'", i, a[i]) for k, a in zip(self.keys, self.inputs)]
        if self.labels is None:
            label: Any = _no_label()
        elif self.label_is_list:
            label = [_label_row(a, i) for a in self.labels]
        else:
            label = _label_row(self.labels[0], i)
        return [inputs, label]
