"""Built-in generic metric plugins: classification accuracy and output-vs-label similarity or error.

`TopKMetric` (classification accuracy), `CosDistanceMetric` and `FlattenCosDistanceMetric` (cosine similarity),
`MaxAbsErrorMetric`, `RMSEMetric` and `PsnrMetric` (errors against reference outputs given as labels).

All accumulate per batch (`__call__`), so the whole validation set never has to be held in memory (`PsnrMetric`
keeps one number per sample). Labels that are `-inf` mean the dataset was built without a label file; a metric
cannot score those, so it raises a `DataError` that says so instead of reporting a meaningless number.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from quantopt import DataError, OptBaseMetric, PluginError, PluginType, register_plugin
from quantopt.metric_helpers import as_tensor_list, bool_arg, require_labels
from quantopt.threads import one_thread

Outputs = Union[torch.Tensor, Sequence[torch.Tensor]]






def _batch(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() > 0 else 1


def _pairs(metric: str, pred: Outputs, target: Any) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(output, label) per model output, both float64 [B, values]; label i belongs to output i."""
    outs = as_tensor_list(pred)
    labels = as_tensor_list(target)
    require_labels(metric, labels)
    if len(labels) != len(outs):
        raise DataError(f"{metric}: the model has {len(outs)} output(s) but the labels give {len(labels)} "
                        f"array(s); give one label array per output, in output order")
    pairs = []
    for i, (o, t) in enumerate(zip(outs, labels)):
        b = _batch(o)
        if _batch(t) != b:
            raise DataError(f"{metric}: output {i} has batch size {b} but its label has {_batch(t)}")
        p, q = o.reshape(b, -1).to(torch.float64), t.reshape(b, -1).to(torch.float64)
        if p.shape[1] != q.shape[1]:
            raise DataError(f"{metric}: output {i} has {p.shape[1]} values per sample but its label has "
                            f"{q.shape[1]}")
        pairs.append((p, q))
    return pairs


def _cosine(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-row cosine in float64; a zero row gives 0 (not NaN). Summed on one thread: one row's sum would depend on
    the thread count otherwise (quantopt.threads)."""
    with one_thread():
        return F.cosine_similarity(p, q, dim=1, eps=1e-12)


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _check_class_indices(classes: torch.Tensor, count: Optional[int]) -> None:
    """Labels must be whole class indices in range: a fractional label would be truncated and an out-of-range one
    never matches, either way a silently wrong accuracy."""
    values = classes.to(torch.float64)
    fractional = values != torch.round(values)
    if bool(fractional.any()):
        i = int(fractional.nonzero()[0, 0])
        raise DataError(f"TopKMetric: label {float(values[i])!r} (sample {i} of the batch) is not a whole class "
                        "index; labels must be integer class indices")
    outside = (values < 0) if count is None else (values < 0) | (values >= count)
    if bool(outside.any()):
        i = int(outside.nonzero()[0, 0])
        span = "a non-negative class index" if count is None else f"a class index in [0, {count - 1}]"
        raise DataError(f"TopKMetric: label {int(values[i])} (sample {i} of the batch) is not {span} of output 0")


@register_plugin(PluginType.Metric, "1.0")
class TopKMetric(OptBaseMetric):
    """Top-K accuracy of output 0 (flattened per batch row) against class-index labels.

    `with_argmax=true` means output 0 already holds class indices (an ArgMax/TopK layer ends the model): a sample
    is a hit when its label is among the first K indices of its row.
    """

    def __init__(self, K: str = "1", with_argmax: str = "false") -> None:
        super().__init__(K, with_argmax)
        text = str(K).strip()
        try:
            k = int(text)
        except ValueError:
            raise PluginError(f"TopKMetric: K must be a positive integer, got '{K}'") from None
        if k < 1:
            raise PluginError(f"TopKMetric: K must be a positive integer, got '{K}'")
        self.k = k
        self.with_argmax = bool_arg("TopKMetric", "with_argmax", with_argmax)
        self.reset()

    def __call__(self, pred: Outputs, target: Any) -> None:
        out = as_tensor_list(pred)[0]
        labels = as_tensor_list(target)
        require_labels("TopKMetric", labels)
        batch = _batch(out)
        scores = out.reshape(batch, -1)
        classes = labels[0].reshape(-1)
        if classes.numel() != batch:
            raise DataError(f"TopKMetric: {batch} predictions but {classes.numel()} labels in the batch; labels "
                            f"must be one class index per sample (shape [B] or [B,1])")
        _check_class_indices(classes, None if self.with_argmax else scores.shape[1])
        k = min(self.k, scores.shape[1])
        if self.with_argmax:
            # dequantized indices are floats: round; a NaN index never equals a label, so it counts as a miss
            top = torch.round(scores[:, :k].to(torch.float64))
            hits = (top == classes.to(torch.float64).reshape(-1, 1)).any(dim=1)
        else:
            top = torch.topk(scores.float(), k, dim=1).indices
            hits = (top == classes.to(torch.long).reshape(-1, 1)).any(dim=1)
        self.correct += int(hits.sum())
        self.total += batch

    def reset(self) -> None:
        self.correct = 0
        self.total = 0

    def compute(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def report(self) -> str:
        return f"top-{self.k} accuracy is {self.compute()}"


@register_plugin(PluginType.Metric, "1.0")
class CosDistanceMetric(OptBaseMetric):
    """Mean over samples of cos(concat of the sample's flattened outputs, its flattened label(s)).

    Computed in float64 so a near-perfect model (cosine ~0.99999) is not blurred by float32 rounding.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def __call__(self, pred: Outputs, target: Any) -> None:
        outs = as_tensor_list(pred)
        labels = as_tensor_list(target)
        require_labels("CosDistanceMetric", labels)
        batch = _batch(outs[0])
        for name, group in (("output", outs), ("label", labels)):
            for t in group:
                if _batch(t) != batch:
                    raise DataError(f"CosDistanceMetric: a {name} has batch size {_batch(t)} "
                                    f"but output 0 has {batch}")
        p = torch.cat([t.reshape(batch, -1).to(torch.float64) for t in outs], dim=1)
        q = torch.cat([t.reshape(batch, -1).to(torch.float64) for t in labels], dim=1)
        if p.shape[1] != q.shape[1]:
            raise DataError(f"CosDistanceMetric: the outputs have {p.shape[1]} values per sample but the labels "
                            f"have {q.shape[1]}")
        self.sum += float(_cosine(p, q).sum())
        self.count += batch

    def reset(self) -> None:
        self.sum = 0.0
        self.count = 0

    def compute(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def report(self) -> str:
        return f"cosine distance is {self.compute()}"


class _PerOutputMetric(OptBaseMetric):
    """Shared accumulation of per-output sums for the metrics that compare each output with its own label."""

    name = "metric"

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.cos_sum: List[float] = []   # per output: sum over samples of the per-sample cosine
        self.sq_sum: List[float] = []    # per output: sum of squared errors
        self.max_abs: List[float] = []   # per output: max |output - label|
        self.values: List[int] = []      # per output: number of compared values
        self.samples = 0

    def __call__(self, pred: Outputs, target: Any) -> None:
        pairs = _pairs(self.name, pred, target)
        if self.samples and len(pairs) != len(self.values):
            raise DataError(f"{self.name}: this batch has {len(pairs)} output(s), earlier batches had "
                            f"{len(self.values)}")
        if not self.values:
            n = len(pairs)
            self.cos_sum, self.sq_sum, self.max_abs, self.values = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n
        for i, (p, q) in enumerate(pairs):
            diff = p - q
            self.cos_sum[i] += float(_cosine(p, q).sum())
            with one_thread():  # a full float sum: the same at any thread count (quantopt.threads)
                self.sq_sum[i] += float((diff * diff).sum())
            if diff.numel():
                self.max_abs[i] = max(self.max_abs[i], float(diff.abs().max()))
            self.values[i] += diff.numel()
        self.samples += _batch(pairs[0][0])

    def _mse(self, i: int) -> float:
        return self.sq_sum[i] / self.values[i] if self.values[i] else 0.0

    def _cos(self, i: int) -> float:
        return self.cos_sum[i] / self.samples if self.samples else 0.0


@register_plugin(PluginType.Metric, "1.0")
class FlattenCosDistanceMetric(_PerOutputMetric):
    """Per output, the mean over samples of cos(flattened output, its flattened label); the score is the mean over
    outputs, so a small output weighs as much as a large one (unlike `CosDistanceMetric`, which concatenates)."""

    name = "FlattenCosDistanceMetric"

    def compute(self) -> float:
        n = len(self.values)
        return sum(self._cos(i) for i in range(n)) / n if n else 0.0

    def report(self) -> str:
        parts = ", ".join(f"output {i}: {_fmt(self._cos(i))}" for i in range(len(self.values)))
        return f"cosine similarity is {self.compute()}" + (f" ({parts})" if len(self.values) > 1 else "")


@register_plugin(PluginType.Metric, "1.0")
class MaxAbsErrorMetric(_PerOutputMetric):
    """The largest |output - label| over every value of every output of the whole set (lower is better); the report
    adds each output's max error, MSE and mean cosine."""

    name = "MaxAbsErrorMetric"

    def compute(self) -> float:
        return max(self.max_abs) if self.max_abs else 0.0

    def report(self) -> str:
        parts = "; ".join(f"output {i}: max {_fmt(self.max_abs[i])}, MSE {_fmt(self._mse(i))}, "
                          f"cosine {_fmt(self._cos(i))}" for i in range(len(self.values)))
        return f"maximum absolute error is {self.compute()}" + (f" ({parts})" if parts else "")


@register_plugin(PluginType.Metric, "1.0")
class RMSEMetric(_PerOutputMetric):
    """Root mean squared error over every value of every output of the whole set (lower is better)."""

    name = "RMSEMetric"

    def compute(self) -> float:
        total = sum(self.values)
        return math.sqrt(sum(self.sq_sum) / total) if total else 0.0

    def report(self) -> str:
        parts = ", ".join(f"output {i}: {_fmt(math.sqrt(self._mse(i)))}" for i in range(len(self.values)))
        return f"RMSE is {self.compute()}" + (f" ({parts})" if len(self.values) > 1 else "")


PSNR_CAP_DB = 100.0
"""PSNR given to a sample whose output equals its label exactly (an infinite PSNR would make the mean useless)."""


@register_plugin(PluginType.Metric, "1.0")
class PsnrMetric(OptBaseMetric):
    """Mean over samples of the PSNR (dB) of output 0 against label 0: 10·log10(peak² / MSE of the sample).

    `peak` is the largest possible signal value: a positive number (default 255, for 8-bit images), or `auto` to
    take the range (max - min) of all label values seen. Higher is better; an exact sample counts as 100 dB.
    """

    def __init__(self, peak: str = "255") -> None:
        super().__init__(peak)
        text = str(peak).strip().lower()
        if text == "auto":
            self.peak = None
        else:
            try:
                value = float(text)
            except ValueError:
                value = float("nan")
            if not math.isfinite(value) or value <= 0:
                raise PluginError(f"PsnrMetric: peak must be a positive number or 'auto', got '{peak}'")
            self.peak = value
        self.reset()

    def reset(self) -> None:
        self.mse: List[np.ndarray] = []  # one float64 per sample
        self.label_min = math.inf
        self.label_max = -math.inf

    def __call__(self, pred: Outputs, target: Any) -> None:
        outs = as_tensor_list(pred)
        labels = as_tensor_list(target)
        p, q = _pairs("PsnrMetric", outs[:1], labels[:1])[0]
        if q.numel() == 0:
            raise DataError("PsnrMetric: output 0 is empty")
        with one_thread(p.shape[0] == 1):  # a float sum to one value: the same at any thread count
            self.mse.append(((p - q) ** 2).mean(dim=1).numpy())
        self.label_min = min(self.label_min, float(q.min()))
        self.label_max = max(self.label_max, float(q.max()))

    def _peak(self) -> float:
        if self.peak is not None:
            return self.peak
        span = self.label_max - self.label_min
        if not span > 0:
            raise DataError("PsnrMetric(auto): every label value is the same, so the label range gives no peak; "
                            "give the peak explicitly, e.g. PsnrMetric(255)")
        return span

    def compute(self) -> float:
        if not self.mse:
            return 0.0
        mse = np.concatenate(self.mse)
        peak = self._peak()
        with np.errstate(divide="ignore"):
            psnr = 10.0 * np.log10(peak * peak / mse)
        return float(np.minimum(psnr, PSNR_CAP_DB).mean())

    def report(self) -> str:
        if not self.mse:
            return "PSNR is 0.0 dB (no samples)"
        return f"PSNR is {self.compute():.4f} dB (peak {_fmt(self._peak())})"
