"""Built-in per-pixel (and per-sample) class metrics: `mIoUMetric` (+ `mIoUNCHWMetric`, `mIoUafterargmaxMetric`)
and `F1scoreMetric`.

Output 0 holds class scores along a class axis (`NHWC`: the last axis, `NCHW`: axis 1), reduced by argmax here,
or already class indices (`INDEX` / `mIoUafterargmaxMetric`). The label holds one class index per pixel, in any
shape with one value per predicted pixel ([B,H,W], [B,H,W,1], [B,1,H,W]). Only per-class counts are kept between
batches, so any number of images streams through.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from quantopt import DataError, OptBaseMetric, PluginError, PluginType, register_plugin
from quantopt.metric_helpers import as_tensor_list, require_labels

Outputs = Union[torch.Tensor, Sequence[torch.Tensor]]
LAYOUTS = ("NHWC", "NCHW", "INDEX")




def _int_arg(metric: str, name: str, value: Any, minimum: int) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        n = minimum - 1
    if n < minimum:
        raise PluginError(f"{metric}: {name} must be an integer >= {minimum}, got '{value}'")
    return n


def _layout_arg(metric: str, value: Any, allowed: Tuple[str, ...]) -> str:
    text = str(value).strip().upper()
    if text not in allowed:
        raise PluginError(f"{metric}: layout must be one of {', '.join(allowed)}, got '{value}'")
    return text


def _class_indices(metric: str, t: torch.Tensor, what: str) -> np.ndarray:
    """int64 class indices from an integer or float tensor holding whole numbers (dequantized outputs are rounded)."""
    if t.is_floating_point():
        r = torch.round(t.to(torch.float64))
        if what == "label" and not bool((r == t).all()):
            raise DataError(f"{metric}: the labels hold non-integer values; they must be class indices")
        r = torch.nan_to_num(r, nan=-1.0, posinf=-1.0, neginf=-1.0)  # a NaN prediction is no class at all
        return r.to(torch.int64).reshape(-1).numpy()
    return t.to(torch.int64).reshape(-1).numpy()


def _predicted(metric: str, out: torch.Tensor, layout: str) -> Tuple[np.ndarray, int]:
    """(flat predicted class per pixel, class count or 0 when unknown) from output 0 in `layout`."""
    if layout == "INDEX":
        return _class_indices(metric, out, "prediction"), 0
    if out.dim() < 2:
        raise DataError(f"{metric}: output 0 has shape {list(out.shape)}; with layout {layout} it needs a batch and "
                        f"a class axis")
    axis = out.dim() - 1 if layout == "NHWC" else 1
    classes = out.shape[axis]
    if classes == 1:
        # one channel: the probability of class 1 (binary segmentation with a sigmoid output)
        pred = (out.select(axis, 0).to(torch.float64) >= 0.5).to(torch.int64)
        return pred.reshape(-1).numpy(), 2
    return torch.argmax(out, dim=axis).reshape(-1).numpy(), classes


def _labels(metric: str, target: Any, pixels: int) -> np.ndarray:
    labels = as_tensor_list(target)
    require_labels(metric, labels)
    label = labels[0]
    if label.numel() != pixels:
        raise DataError(f"{metric}: the prediction has {pixels} pixels in this batch but the label has "
                        f"{label.numel()} values (shape {list(label.shape)}); give one class index per pixel")
    return _class_indices(metric, label, "label")


@register_plugin(PluginType.Metric, "1.0")
class mIoUMetric(OptBaseMetric):
    """Mean intersection-over-union of the predicted class map against the label map (higher is better).

    `class_num` (0: the size of the output's class axis), `layout` of output 0 (NHWC: classes on the last axis,
    NCHW: on axis 1, INDEX: output 0 already holds class indices), `ignore_index` (label value that is not scored,
    default 255; `none` for no such value; negative labels are never scored).
    """

    def __init__(self, class_num: str = "0", layout: str = "NHWC", ignore_index: str = "255") -> None:
        super().__init__(class_num, layout, ignore_index)
        name = type(self).__name__
        self.class_num = _int_arg(name, "class_num", class_num, 0)
        self.layout = _layout_arg(name, layout, LAYOUTS)
        if self.layout == "INDEX" and self.class_num == 0:
            raise PluginError(f"{name}: give class_num (>= 1): an output of class indices does not tell the class "
                              f"count")
        text = str(ignore_index).strip().lower()
        try:
            self.ignore_index: Optional[int] = None if text in ("none", "") else int(text)
        except ValueError:
            raise PluginError(f"{name}: ignore_index must be an integer or none, got '{ignore_index}'") from None
        self.reset()

    def reset(self) -> None:
        # rows: label class; columns: predicted class, the last column counting predictions outside 0..C-1
        self.confusion: Optional[np.ndarray] = None

    def __call__(self, pred: Outputs, target: Any) -> None:
        name = type(self).__name__
        p, classes = _predicted(name, as_tensor_list(pred)[0], self.layout)
        g = _labels(name, target, p.size)
        n = self.class_num or classes
        if self.class_num and classes and classes != self.class_num:
            raise DataError(f"{name}: output 0 has {classes} classes on its {self.layout} class axis but "
                            f"class_num is {self.class_num}")
        if self.confusion is None:
            self.confusion = np.zeros((n, n + 1), dtype=np.int64)
        elif self.confusion.shape[0] != n:
            raise DataError(f"{name}: output 0 has {n} classes in this batch, {self.confusion.shape[0]} before")
        scored = g >= 0
        if self.ignore_index is not None:
            scored &= g != self.ignore_index
        g, p = g[scored], p[scored]
        if g.size and int(g.max()) >= n:
            raise DataError(f"{name}: label value {int(g.max())} is not a class index 0..{n - 1} "
                            f"(class_num {n}, ignore_index {self.ignore_index})")
        p = np.where((p >= 0) & (p < n), p, n)
        self.confusion += np.bincount(g * (n + 1) + p, minlength=n * (n + 1)).reshape(n, n + 1)

    def iou(self) -> np.ndarray:
        """Per-class IoU; NaN for a class that is neither in the labels nor predicted."""
        if self.confusion is None:
            return np.zeros(0)
        c = self.confusion
        n = c.shape[0]
        inter = np.diag(c[:, :n]).astype(np.float64)
        union = c.sum(axis=1) + c[:, :n].sum(axis=0) - inter
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(union > 0, inter / union, np.nan)

    def compute(self) -> float:
        iou = self.iou()
        valid = ~np.isnan(iou)
        return float(iou[valid].mean()) if valid.any() else 0.0

    def report(self) -> str:
        iou = self.iou()
        if self.confusion is None or not self.confusion.sum():
            return "mIoU is 0.0 (no labelled pixels)"
        acc = float(np.trace(self.confusion[:, :-1]) / self.confusion.sum())
        return (f"mIoU is {self.compute()} over {int((~np.isnan(iou)).sum())} classes "
                f"(pixel accuracy {acc:.6g})")


@register_plugin(PluginType.Metric, "1.0")
class mIoUNCHWMetric(mIoUMetric):
    """`mIoUMetric` with the class scores on axis 1 (NCHW output): `mIoUNCHWMetric(class_num=0, ignore_index=255)`."""

    def __init__(self, class_num: str = "0", ignore_index: str = "255") -> None:
        super().__init__(class_num, "NCHW", ignore_index)


@register_plugin(PluginType.Metric, "1.0")
class mIoUafterargmaxMetric(mIoUMetric):
    """`mIoUMetric` for a model whose output 0 already holds class indices (it ends with an ArgMax):
    `mIoUafterargmaxMetric(class_num=19, layout=NHWC, ignore_index=255)`; the layout only names the label layout
    upstream, here any label shape with one value per pixel is accepted."""

    def __init__(self, class_num: str = "19", layout: str = "NHWC", ignore_index: str = "255") -> None:
        _layout_arg("mIoUafterargmaxMetric", layout, ("NHWC", "NCHW"))
        super().__init__(class_num, "INDEX", ignore_index)


@register_plugin(PluginType.Metric, "1.0")
class F1scoreMetric(OptBaseMetric):
    """F1 score of per-pixel (or per-sample) class predictions (higher is better).

    `layout` of output 0: NHWC / NCHW (class scores on the last axis / axis 1, argmax taken here; a single channel
    is the probability of class 1, positive at >= 0.5) or INDEX (class indices). `average`: `binary` (F1 of class
    `positive`, default 1) or `macro` (mean F1 over the classes present in labels or predictions). Negative labels
    are not scored.
    """

    def __init__(self, layout: str = "NHWC", average: str = "binary", positive: str = "1") -> None:
        super().__init__(layout, average, positive)
        self.layout = _layout_arg("F1scoreMetric", layout, LAYOUTS)
        self.average = str(average).strip().lower()
        if self.average not in ("binary", "macro"):
            raise PluginError(f"F1scoreMetric: average must be binary or macro, got '{average}'")
        self.positive = _int_arg("F1scoreMetric", "positive", positive, 0)
        self.reset()

    def reset(self) -> None:
        self.tp = np.zeros(0, dtype=np.int64)
        self.fp = np.zeros(0, dtype=np.int64)
        self.fn = np.zeros(0, dtype=np.int64)

    def _add(self, name: str, values: np.ndarray) -> None:
        counts = np.bincount(values, minlength=len(self.tp)) if values.size else np.zeros(0, dtype=np.int64)
        size = max(len(self.tp), len(counts))
        for attr in ("tp", "fp", "fn"):
            arr = getattr(self, attr)
            if len(arr) < size:
                setattr(self, attr, np.concatenate([arr, np.zeros(size - len(arr), dtype=np.int64)]))
        if counts.size:
            getattr(self, name)[:len(counts)] += counts

    def __call__(self, pred: Outputs, target: Any) -> None:
        p, _ = _predicted("F1scoreMetric", as_tensor_list(pred)[0], self.layout)
        g = _labels("F1scoreMetric", target, p.size)
        scored = g >= 0
        g, p = g[scored], p[scored]
        hit = g == p
        self._add("tp", g[hit])
        self._add("fn", g[~hit])
        wrong = p[~hit]
        self._add("fp", wrong[wrong >= 0])

    def per_class(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(precision, recall, F1) per class index; 0 where undefined."""
        tp, fp, fn = (a.astype(np.float64) for a in (self.tp, self.fp, self.fn))
        with np.errstate(invalid="ignore", divide="ignore"):
            precision = np.where(tp + fp > 0, tp / (tp + fp), 0.0)
            recall = np.where(tp + fn > 0, tp / (tp + fn), 0.0)
            f1 = np.where(2 * tp + fp + fn > 0, 2 * tp / (2 * tp + fp + fn), 0.0)
        return precision, recall, f1

    def compute(self) -> float:
        _, _, f1 = self.per_class()
        if self.average == "binary":
            return float(f1[self.positive]) if self.positive < len(f1) else 0.0
        present = (self.tp + self.fp + self.fn) > 0
        return float(f1[present].mean()) if present.any() else 0.0

    def report(self) -> str:
        precision, recall, _ = self.per_class()
        if self.average == "binary":
            c = self.positive
            pr = (precision[c], recall[c]) if c < len(precision) else (0.0, 0.0)
            return f"F1 score is {self.compute()} (class {c}: precision {pr[0]:.6g}, recall {pr[1]:.6g})"
        present = int(((self.tp + self.fp + self.fn) > 0).sum())
        return f"F1 score is {self.compute()} (macro average over {present} classes)"
