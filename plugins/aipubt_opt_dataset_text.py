"""Built-in dataset plugin `TokenDataset`: token ids for transformer models → fixed-length integer tensors.

Tokenising is left to the user's own tokenizer: the data file holds token ids already (a .txt line of numbers, a
.jsonl line `[ids]` or `{"input_ids": [...], "attention_mask": [...], "token_type_ids": [...]}`, an (N, L)
.npy, or an .npz of such arrays). Each sample is truncated or padded to one length, and gives the model inputs
named in `inputs` (default `input_ids,attention_mask`), int64 or int32. The cfg names the plugin only
(`dataset = TokenDataset`), so the other arguments are constructor keywords with defaults; a model needing other
values registers a small subclass (docs/datasets.md). Every bad file, line or value is a `DataError` naming the
file and the line or sample.
"""
from __future__ import annotations

import json
import zipfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.utils.data

from quantopt import DataError, PluginError, PluginType, register_plugin
from quantopt.data_files import read_head, text_lines

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
_DTYPES = {"int64": np.int64, "int32": np.int32}


class _Sample:
    """One sequence before padding: ids, mask and type ids of equal length, and where it came from."""

    def __init__(self, ids: np.ndarray, mask: Optional[np.ndarray], types: Optional[np.ndarray],
                 line: Optional[int]) -> None:
        self.ids = ids
        self.mask = mask
        self.types = types
        self.line = line


def _error(what: str, value: Any, expected: str) -> PluginError:
    return PluginError(f"TokenDataset: {what} must be {expected}, got {value!r}")


def _optional_int(what: str, value: Any, minimum: int) -> Optional[int]:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    try:
        n = int(str(value).strip())
    except ValueError:
        raise _error(what, value, f"an integer >= {minimum}") from None
    if n < minimum:
        raise _error(what, value, f"an integer >= {minimum}")
    return n


def _choice(what: str, value: Any, choices: Sequence[str]) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise _error(what, value, "one of " + ", ".join(choices))
    return text


def _where(sample: int, line: Optional[int]) -> str:
    return f"sample {sample}" + (f" (line {line})" if line is not None else "")


def _sniff(path: str) -> str:
    """'npy', 'npz', 'jsonl' or 'txt': NumPy files by their magic bytes, JSON lines by extension or first char."""
    head = read_head(path, 64, "a token file (.txt, .jsonl, .npy or .npz)")
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "npz"
    if path.lower().endswith((".jsonl", ".json")) or head.lstrip()[:1] in (b"[", b"{"):
        return "jsonl"
    return "txt"


def _int_list(path: str, line: int, what: str, values: Any) -> np.ndarray:
    """A JSON list of integers (no bools, no floats) → int64 array."""
    if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise DataError(f"{what} must be a list of integers", file=path, line=line)
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        raise DataError(f"{what} holds a value outside the int64 range", file=path, line=line) from None


def _read_txt(path: str) -> List[_Sample]:
    out = []
    for n, line in text_lines(path):
        ids = []
        for w in line.replace(",", " ").split():
            try:
                ids.append(int(w))
            except ValueError:
                raise DataError(f"'{w}' is not an integer token id", file=path, line=n) from None
        try:
            out.append(_Sample(np.array(ids, dtype=np.int64), None, None, n))
        except OverflowError:
            raise DataError("a token id is outside the int64 range", file=path, line=n) from None
    return out


def _read_jsonl(path: str) -> List[_Sample]:
    out = []
    for n, line in text_lines(path):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"not valid JSON: {e.msg} (column {e.colno})", file=path, line=n) from None
        if isinstance(item, list):
            out.append(_Sample(_int_list(path, n, "the token list", item), None, None, n))
            continue
        if not isinstance(item, dict) or "input_ids" not in item:
            raise DataError("expected a list of token ids or an object with 'input_ids'", file=path, line=n)
        ids = _int_list(path, n, "'input_ids'", item["input_ids"])
        mask = _int_list(path, n, "'attention_mask'", item["attention_mask"]) if "attention_mask" in item else None
        types = _int_list(path, n, "'token_type_ids'", item["token_type_ids"]) if "token_type_ids" in item else None
        out.append(_Sample(ids, mask, types, n))
    return out


def _integer_rows(path: str, what: str, a: np.ndarray) -> np.ndarray:
    """A 2-D (N, L) integer array; a float array is accepted only when every value is a finite integer."""
    if a.dtype.kind not in "buif":
        raise DataError(f"{what} has dtype {a.dtype}; token ids must be integers", file=path)
    if a.ndim != 2:
        raise DataError(f"{what} has shape {list(a.shape)}; expected (samples, sequence length)", file=path)
    if a.dtype.kind == "f":
        finite = np.isfinite(a)
        if not finite.all():
            i = int(np.argwhere(~finite)[0][0])
            bad = "NaN" if np.isnan(a[i]).any() else "inf"
            raise DataError(f"{what} contains {bad} at sample {i}", file=path)
        whole = a == np.round(a)
        if not whole.all():
            i = int(np.argwhere(~whole)[0][0])
            raise DataError(f"{what} holds a non-integer value at sample {i}; token ids must be integers", file=path)
    if a.dtype.kind == "u" and a.dtype.itemsize == 8 and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise DataError(f"{what} holds values above the int64 range", file=path)
    return a.astype(np.int64)


def _load_numpy(path: str, kind: str) -> Dict[str, np.ndarray]:
    try:
        if kind == "npy":
            return {"input_ids": np.load(path, allow_pickle=False)}
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except ValueError as e:
        if "pickle" in str(e).lower():
            raise DataError("holds an object (pickled) array; pickle is never loaded: save ragged token lists as "
                            ".txt or .jsonl, or pad them into one integer (N, L) array", file=path) from None
        raise DataError(f"unreadable: {e}", file=path) from None
    except (OSError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise DataError(f"unreadable: {e}", file=path) from None


def _read_numpy(path: str, kind: str) -> List[_Sample]:
    arrays = _load_numpy(path, kind)
    unknown = [k for k in arrays if k not in INPUT_NAMES]
    if unknown:
        raise DataError(f"unknown array '{unknown[0]}' (expected {', '.join(INPUT_NAMES)})", file=path)
    if "input_ids" not in arrays:
        raise DataError("the .npz archive has no 'input_ids' array", file=path)
    rows = {k: _integer_rows(path, "the array" if kind == "npy" else f"array '{k}'", a) for k, a in arrays.items()}
    for k, a in rows.items():
        if a.shape != rows["input_ids"].shape:
            raise DataError(f"array '{k}' has shape {list(a.shape)} but 'input_ids' has "
                            f"{list(rows['input_ids'].shape)}", file=path)
    ids = rows["input_ids"]
    mask, types = rows.get("attention_mask"), rows.get("token_type_ids")
    return [_Sample(ids[i], None if mask is None else mask[i], None if types is None else types[i], None)
            for i in range(ids.shape[0])]


def _number_row(path: str, line: int, text: str) -> np.ndarray:
    words = text.replace(",", " ").split()
    if not words:
        raise DataError(f"expected numbers, got '{text}'", file=path, line=line)
    try:
        if all(w.lstrip("+-").isdigit() for w in words):
            return np.array([int(w) for w in words], dtype=np.int64)
        return np.array([float(w) for w in words], dtype=np.float32)
    except (ValueError, OverflowError):
        raise DataError(f"expected numbers, got '{text}'", file=path, line=line) from None


def _read_labels(path: str, count: int, data_file: str) -> List[torch.Tensor]:
    """One label per sample: an .npy (N, ...), a .txt line of numbers, or a .jsonl number/list/{"label": ...}."""
    kind = _sniff(path)
    rows: List[Tuple[Optional[int], np.ndarray]] = []
    if kind == "npy":
        a = _load_numpy(path, "npy")["input_ids"]
        if a.dtype.kind not in "buif" or a.ndim == 0:
            raise DataError(f"the label array must be a numeric (N, ...) array, got {a.dtype} {list(a.shape)}",
                            file=path)
        rows = [(None, a[i]) for i in range(a.shape[0])]
    elif kind == "npz":
        raise DataError("labels must be a .npy, .txt or .jsonl file", file=path)
    elif kind == "jsonl":
        for n, line in text_lines(path):
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"not valid JSON: {e.msg} (column {e.colno})", file=path, line=n) from None
            if isinstance(item, dict):
                if "label" not in item:
                    raise DataError("the object has no 'label'", file=path, line=n)
                item = item["label"]
            try:
                value = np.array(item)
            except (ValueError, OverflowError):
                raise DataError("the label must be a number or a list of numbers", file=path, line=n) from None
            if value.dtype.kind not in "iuf" or value.ndim > 1:
                raise DataError("the label must be a number or a list of numbers", file=path, line=n)
            rows.append((n, value.astype(np.int64 if value.dtype.kind in "iu" else np.float32)))
    else:
        rows = [(n, _number_row(path, n, line)) for n, line in text_lines(path)]
    if len(rows) != count:
        raise DataError(f"holds {len(rows)} labels but the data file {data_file} has {count} samples", file=path)
    out = []
    for i, (n, row) in enumerate(rows):
        if row.dtype.kind == "f" and not np.isfinite(row).all():
            raise DataError(f"the label of sample {i} contains NaN or inf", file=path, line=n)
        if i and row.shape != rows[0][1].shape:
            raise DataError(f"the label of sample {i} has {row.size} values but the first has {rows[0][1].size}",
                            file=path, line=n)
        out.append(torch.from_numpy(np.array(row)))
    return out


@register_plugin(PluginType.Dataset, "1.0")
class TokenDataset(torch.utils.data.Dataset):
    """Token ids (.txt, .jsonl, .npy, .npz) → `[inputs, label]`, each input a fixed-length int64/int32 tensor."""

    def __init__(self, data_file: str, label_file: Optional[str] = None, max_length: Any = None, pad_id: Any = 0,
                 inputs: Any = "input_ids,attention_mask", dtype: str = "int64", padding_side: str = "right",
                 truncation_side: str = "right", vocab_size: Any = None) -> None:
        self.data_file = str(data_file)
        self.label_file = str(label_file) if label_file is not None else None
        self.max_length = _optional_int("max_length", max_length, 1)
        pad = _optional_int("pad_id", pad_id, 0)
        if pad is None:
            raise _error("pad_id", pad_id, "an integer >= 0")
        self.pad_id = pad
        names = [t.strip() for t in inputs.split(",")] if isinstance(inputs, str) else [str(t) for t in inputs]
        if not names or any(n not in INPUT_NAMES for n in names) or len(set(names)) != len(names):
            raise _error("inputs", inputs, f"distinct names among {', '.join(INPUT_NAMES)}")
        self.inputs = names
        self.dtype_name = _choice("dtype", dtype, tuple(_DTYPES))
        self.dtype = _DTYPES[self.dtype_name]
        self.padding_side = _choice("padding_side", padding_side, ("right", "left"))
        self.truncation_side = _choice("truncation_side", truncation_side, ("right", "left"))
        self.vocab_size = _optional_int("vocab_size", vocab_size, 1)
        if self.vocab_size is not None and self.pad_id >= self.vocab_size:
            raise PluginError(f"TokenDataset: pad_id {self.pad_id} is not below vocab_size {self.vocab_size}")

        kind = _sniff(self.data_file)
        if kind in ("npy", "npz"):
            samples = _read_numpy(self.data_file, kind)
        elif kind == "jsonl":
            samples = _read_jsonl(self.data_file)
        else:
            samples = _read_txt(self.data_file)
        if not samples:
            raise DataError("holds no samples", file=self.data_file)
        self._check(samples)
        self.length = self.max_length or max(s.ids.size for s in samples)
        self.tensors = {name: np.empty((len(samples), self.length), dtype=self.dtype) for name in INPUT_NAMES}
        for i, s in enumerate(samples):
            for name, row in zip(INPUT_NAMES, self._fixed(s)):
                self.tensors[name][i] = row
        self.labels = _read_labels(self.label_file, len(samples), self.data_file) if self.label_file else None

    def _check(self, samples: List[_Sample]) -> None:
        """Lengths, ranges and mask values of every sample, reported with its sample index and line."""
        type_top = int(np.iinfo(self.dtype).max) + 1
        top = min(self.vocab_size, type_top) if self.vocab_size is not None else type_top
        for i, s in enumerate(samples):
            where = _where(i, s.line)
            if s.ids.size == 0:
                raise DataError(f"{where} has no tokens", file=self.data_file, line=s.line)
            bad = np.flatnonzero((s.ids < 0) | (s.ids >= top))
            if bad.size:
                limit = f"vocab_size {self.vocab_size}" if top != type_top else self.dtype_name
                raise DataError(f"{where}: token id {int(s.ids[bad[0]])} at position {int(bad[0])} is negative or "
                                f"not below {limit}", file=self.data_file, line=s.line)
            for what, extra in (("attention_mask", s.mask), ("token_type_ids", s.types)):
                if extra is None:
                    continue
                if extra.size != s.ids.size:
                    raise DataError(f"{where}: {what} has {extra.size} values but input_ids has {s.ids.size}",
                                    file=self.data_file, line=s.line)
                allowed = (extra == 0) | (extra == 1) if what == "attention_mask" else \
                    (extra >= 0) & (extra <= np.iinfo(self.dtype).max)
                if not allowed.all():
                    pos = int(np.flatnonzero(~allowed)[0])
                    expected = "0 or 1" if what == "attention_mask" else f"a non-negative {self.dtype_name}"
                    raise DataError(f"{where}: {what} value {int(extra[pos])} at position {pos} is not {expected}",
                                    file=self.data_file, line=s.line)

    def _fixed(self, s: _Sample) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, mask, types) truncated and padded to `self.length` (padding: pad_id, mask 0, type 0)."""
        ids = s.ids
        mask = s.mask if s.mask is not None else np.ones_like(ids)
        types = s.types if s.types is not None else np.zeros_like(ids)
        rows = []
        for row, fill in ((ids, self.pad_id), (mask, 0), (types, 0)):
            row = row[:self.length] if self.truncation_side == "right" else row[max(0, row.size - self.length):]
            pad = np.full(self.length - row.size, fill, dtype=np.int64)
            rows.append(np.concatenate([row, pad] if self.padding_side == "right" else [pad, row]))
        return rows[0], rows[1], rows[2]

    def __len__(self) -> int:
        return int(self.tensors["input_ids"].shape[0])

    def __getitem__(self, index: int) -> List[Any]:
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        inputs = [torch.from_numpy(self.tensors[name][i].copy()) for name in self.inputs]
        label = self.labels[i] if self.labels is not None else torch.tensor(float("-inf"), dtype=torch.float32)
        return [inputs[0] if len(inputs) == 1 else inputs, label]
