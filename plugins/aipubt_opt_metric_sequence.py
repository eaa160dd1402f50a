"""Built-in sequence metrics: `WERMetric` (word error rate) and `CERMetric` (character error rate), with their own
edit distance (Levenshtein: insertions, deletions and substitutions all cost 1).

Predictions are token/character index sequences (output 0 as [B,T], or per-step scores [B,T,C] reduced by argmax
here); labels are index sequences [B,L] padded with the `EOF` id or negative values, or the pair
`[padded labels [B,L], lengths [B]]`. Rates are corpus-level (total edits / total reference tokens), accumulated
per batch as two integers.
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from quantopt import DataError, OptBaseMetric, PluginError, PluginType, register_plugin
from quantopt.metric_helpers import as_tensor_list, bool_arg, require_labels

Outputs = Union[torch.Tensor, Sequence[torch.Tensor]]
INVALID = np.iinfo(np.int64).min
"""Stands for a NaN/inf prediction: kept in the sequence, equal to no reference token."""






def _optional_id(metric: str, name: str, value: Any) -> Optional[int]:
    text = str(value).strip()
    if text == "" or text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise PluginError(f"{metric}: {name} must be an integer token id or empty, got '{value}'") from None


def edit_distance(ref: Sequence[Hashable], hyp: Sequence[Hashable]) -> int:
    """Levenshtein distance between two sequences (each insertion, deletion or substitution costs 1).

    One DP row at a time: substitutions/deletions are vectorised, insertions (a left-to-right dependency within
    the row) become a running minimum of `row[k] - k`.
    """
    if not ref or not hyp:
        return max(len(ref), len(hyp))
    ids: Dict[Hashable, int] = {}
    r = np.array([ids.setdefault(x, len(ids)) for x in ref], dtype=np.int64)
    h = np.array([ids.setdefault(x, len(ids)) for x in hyp], dtype=np.int64)
    steps = np.arange(len(h) + 1, dtype=np.int64)
    row = steps.copy()
    for i, token in enumerate(r, start=1):
        best = np.empty_like(row)
        best[0] = i
        best[1:] = np.minimum(row[:-1] + (h != token), row[1:] + 1)
        row = np.minimum.accumulate(best - steps) + steps
    return int(row[-1])


def ctc_collapse(tokens: np.ndarray, blank: int) -> np.ndarray:
    """Greedy CTC decoding of a per-step best-token sequence: merge runs of equal tokens, then drop `blank`."""
    if tokens.size == 0:
        return tokens
    first = np.ones(tokens.size, dtype=bool)
    first[1:] = tokens[1:] != tokens[:-1]
    merged = tokens[first]
    return merged[merged != blank]


class _EditRateMetric(OptBaseMetric):
    """Shared part of WER and CER: decode predictions and labels to index sequences, sum edits and lengths."""

    unit = "tokens"
    title = "error rate"

    def __init__(self, EOF: str = "", ctc: str = "false") -> None:
        super().__init__(EOF, ctc)
        name = type(self).__name__
        self.eof = _optional_id(name, "EOF", EOF)
        self.ctc = bool_arg(name, "ctc", ctc)
        if self.ctc and self.eof is None:
            raise PluginError(f"{name}: ctc collapse needs the blank id, given as EOF (e.g. {name}(0,true))")
        self.reset()

    def reset(self) -> None:
        self.edits = 0
        self.ref_len = 0
        self.samples = 0

    def _units(self, tokens: np.ndarray) -> List[Hashable]:
        """The units compared by the edit distance (tokens; words for `WERMetric` with a space id)."""
        return tokens.tolist()

    def _predictions(self, out: torch.Tensor) -> List[np.ndarray]:
        if out.dim() == 0:
            raise DataError(f"{type(self).__name__}: output 0 is a scalar; expected index sequences [B,T]")
        if out.dim() == 3 and out.shape[2] > 1:
            out = torch.argmax(out, dim=2)  # per-step scores [B,T,C]
        values = out.reshape(out.shape[0], -1).to(torch.float64)
        finite = torch.isfinite(values)
        tokens = torch.where(finite, torch.round(values), torch.zeros_like(values)).to(torch.int64).numpy()
        tokens[~finite.numpy()] = INVALID
        rows = []
        for row in tokens:
            if self.ctc:
                row = ctc_collapse(row, self.eof)
            keep = (row == INVALID) | (row >= 0)
            if self.eof is not None:
                keep &= row != self.eof
            rows.append(row[keep])
        return rows

    def _references(self, target: Any, batch: int) -> List[np.ndarray]:
        name = type(self).__name__
        labels = as_tensor_list(target)
        require_labels(name, labels)
        padded = labels[0]
        rows_given = padded.shape[0] if padded.dim() else 1
        if rows_given != batch:
            raise DataError(f"{name}: {batch} predictions but labels for {rows_given} samples")
        if padded.is_floating_point() and not bool((padded == torch.round(padded)).all()):
            raise DataError(f"{name}: the labels hold non-integer values; they must be token indices")
        rows = padded.reshape(batch, -1).to(torch.int64).numpy()
        if len(labels) >= 2:
            lengths = labels[1].reshape(-1)
            if lengths.numel() != batch:
                raise DataError(f"{name}: label 1 (lengths) has {lengths.numel()} values for {batch} samples")
            lengths = lengths.to(torch.float64).numpy()
            if (lengths < 0).any() or (lengths > rows.shape[1]).any() or (lengths != np.round(lengths)).any():
                raise DataError(f"{name}: label lengths must be whole numbers in 0..{rows.shape[1]} (the padded "
                                f"label length)")
            return [row[:int(n)] for row, n in zip(rows, lengths)]
        out = []
        for row in rows:
            keep = row >= 0
            if self.eof is not None:
                keep &= row != self.eof
            out.append(row[keep])
        return out

    def __call__(self, pred: Outputs, target: Any) -> None:
        hyps = self._predictions(as_tensor_list(pred)[0])
        refs = self._references(target, len(hyps))
        for ref, hyp in zip(refs, hyps):
            r, h = self._units(ref), self._units(hyp)
            self.edits += edit_distance(r, h)
            self.ref_len += len(r)
        self.samples += len(hyps)

    def compute(self) -> float:
        if self.ref_len == 0:
            return float("inf") if self.edits else 0.0
        return self.edits / self.ref_len

    def report(self) -> str:
        return (f"{self.title} is {self.compute()} ({self.edits} edits / {self.ref_len} reference {self.unit}, "
                f"{self.samples} samples)")


@register_plugin(PluginType.Metric, "1.0")
class WERMetric(_EditRateMetric):
    """Word error rate = (substitutions + deletions + insertions) / reference words, over the whole set (lower is
    better). `EOF`: the pad/blank id stripped from predictions and labels (empty: none; negative values are always
    stripped); `ctc`: greedy CTC collapse of the predictions (merge repeats, drop the EOF blank) before scoring;
    `space`: when given, the sequences are characters and words are the runs between this id."""

    unit = "words"
    title = "WER"

    def __init__(self, EOF: str = "", ctc: str = "false", space: str = "") -> None:
        self.space = _optional_id("WERMetric", "space", space)
        super().__init__(EOF, ctc)
        self.args = (EOF, ctc, space)
        if self.space is not None and self.space == self.eof:
            raise PluginError("WERMetric: space and EOF must be different ids")

    def _units(self, tokens: np.ndarray) -> List[Hashable]:
        if self.space is None:
            return tokens.tolist()
        words: List[Tuple[int, ...]] = []
        current: List[int] = []
        for t in tokens.tolist() + [self.space]:
            if t == self.space:
                if current:
                    words.append(tuple(current))
                current = []
            else:
                current.append(t)
        return words


@register_plugin(PluginType.Metric, "1.0")
class CERMetric(_EditRateMetric):
    """Character error rate = character edits / reference characters, over the whole set (lower is better); every
    index is one character (spaces included). Arguments as `WERMetric`: `EOF` pad/blank id, `ctc` collapse."""

    unit = "characters"
    title = "CER"

    def __init__(self, EOF: str = "", ctc: str = "false") -> None:
        super().__init__(EOF, ctc)
