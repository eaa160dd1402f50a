"""Built-in detection metric: `mAPMetric`, mean average precision in the VOC (all-point or 11-point) or COCO
(AP averaged over IoU 0.50:0.05:0.95) style, with its own IoU matching.

Boxes are corners `[y0, x0, y1, x1]` (the order of the DecodeBox/NMS layers; a box given as [y1, x1, y0, x0] is
normalised), compared with continuous IoU: no "+1 pixel" convention. Ground truth is matched image by image as
the batches arrive; between batches only one compact record per detection (class, score, TP/FP/ignored per IoU
threshold) and the ground-truth count per class are kept, and the precision/recall curves are built in
`compute()`.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from quantopt import DataError, OptBaseMetric, PluginError, PluginType, register_plugin
from quantopt.metric_helpers import as_tensor_list

Outputs = Union[torch.Tensor, Sequence[torch.Tensor]]
METHODS = {"voc": "VOC all-point", "voc11": "VOC 11-point", "coco": "COCO AP@[.5:.95]"}
METHOD_ALIASES = {"voc": "voc", "all_point": "voc", "allpoint": "voc", "voc2010": "voc", "voc12": "voc",
                  "voc11": "voc11", "11point": "voc11", "11_point": "voc11", "voc07": "voc11", "voc2007": "voc11",
                  "coco": "coco"}
COCO_THRESHOLDS = np.arange(50, 100, 5) / 100.0
COCO_MAX_DETS = 100
"""COCO keeps at most this many detections per image and class (highest scores first)."""

TP, FP, IGNORED = 1, 0, -1
Detections = Tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes [D,4], scores [D], classes [D]



def _numpy(t: Any) -> np.ndarray:
    t = t if isinstance(t, torch.Tensor) else torch.as_tensor(t)
    return t.detach().cpu().to(torch.float64).numpy()


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of `a` [D,4] with every box of `b` [G,4], corners [y0,x0,y1,x1]; 0 for empty unions."""
    a = np.concatenate([np.minimum(a[:, :2], a[:, 2:]), np.maximum(a[:, :2], a[:, 2:])], axis=1)
    b = np.concatenate([np.minimum(b[:, :2], b[:, 2:]), np.maximum(b[:, :2], b[:, 2:])], axis=1)
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    hi = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=2)
    area_a = np.prod(a[:, 2:] - a[:, :2], axis=1)
    area_b = np.prod(b[:, 2:] - b[:, :2], axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, inter / union, 0.0)


def match_voc(iou: np.ndarray, difficult: np.ndarray, threshold: float) -> np.ndarray:
    """VOC devkit rule, detections in descending score order: each takes its best-overlap box; above the threshold
    it is TP if that box is free, FP if already taken, ignored if the box is difficult; otherwise FP."""
    flags = np.full(iou.shape[0], FP, dtype=np.int8)
    if iou.shape[1] == 0:
        return flags
    taken = np.zeros(iou.shape[1], dtype=bool)
    for d in range(iou.shape[0]):
        j = int(np.argmax(iou[d]))
        if iou[d, j] > threshold:
            if difficult[j]:
                flags[d] = IGNORED
            elif not taken[j]:
                taken[j] = True
                flags[d] = TP
    return flags


def match_coco(iou: np.ndarray, difficult: np.ndarray, threshold: float) -> np.ndarray:
    """COCOeval rule, detections in descending score order: each takes the best still-free box with IoU >= the
    threshold, preferring ordinary boxes; matching only a difficult (ignore) box ignores the detection, and a
    difficult box may absorb several detections."""
    flags = np.full(iou.shape[0], FP, dtype=np.int8)
    order = np.argsort(difficult, kind="stable")  # ordinary boxes first
    iou, difficult = iou[:, order], difficult[order]
    taken = np.zeros(iou.shape[1], dtype=bool)
    for d in range(iou.shape[0]):
        best, best_iou = -1, min(threshold, 1 - 1e-10)
        for g in range(iou.shape[1]):
            if taken[g] and not difficult[g]:
                continue
            if best > -1 and not difficult[best] and difficult[g]:
                break
            if iou[d, g] < best_iou:
                continue
            best, best_iou = g, iou[d, g]
        if best > -1:
            taken[best] = True
            flags[d] = IGNORED if difficult[best] else TP
    return flags


def average_precision(recall: np.ndarray, precision: np.ndarray, method: str) -> float:
    """AP of one precision/recall curve (points in descending score order)."""
    if method == "voc11":
        points = np.arange(11) / 10.0
        return float(sum(precision[recall >= r].max() if (recall >= r).any() else 0.0 for r in points) / 11)
    envelope = np.maximum.accumulate(precision[::-1])[::-1] if precision.size else precision
    if method == "coco":
        points = np.arange(101) / 100.0
        idx = np.searchsorted(recall, points, side="left")
        return float(np.where(idx < envelope.size, envelope[np.minimum(idx, envelope.size - 1)], 0.0).mean()) \
            if envelope.size else 0.0
    rec = np.concatenate([[0.0], recall])
    return float(np.sum((rec[1:] - rec[:-1]) * envelope))


@register_plugin(PluginType.Metric, "1.0")
class mAPMetric(OptBaseMetric):
    """Mean average precision over the classes that have ground truth (higher is better).

    Arguments: `class_num` (ground-truth classes are 0..class_num-1), `start_label` (subtracted from predicted
    classes, which are dropped when the result is outside 0..class_num-1: a model whose class 0 is the background
    uses 1), `method` (`voc`: all-point interpolation, `voc11`: 11-point, `coco`: mean AP over IoU 0.50..0.95),
    `iou_threshold` (VOC methods only, default 0.5).

    Outputs (see docs/metrics.md): 3 or 4 outputs `boxes [B,N,4], scores [B,N], classes [B,N][, count [B]]`, or
    the 6 grouped outputs `class_count, label_per_class, boxes, box_num_per_class, scores, keep`.
    Labels: a tensor [B,M,5] of rows `[class, y0, x0, y1, x1]` (a 6th column marks difficult boxes), padded
    with rows of class -1; or a dict with `bbox` [B,M,4], `label_index` [B,M] and optionally `difficult` [B,M].
    """

    def __init__(self, class_num: str = "90", start_label: str = "0", method: str = "voc",
                 iou_threshold: Optional[str] = None) -> None:
        args = (class_num, start_label, method) + ((iou_threshold,) if iou_threshold is not None else ())
        super().__init__(*args)
        try:
            self.class_num = int(str(class_num).strip())
        except ValueError:
            self.class_num = 0
        if self.class_num < 1:
            raise PluginError(f"mAPMetric: class_num must be a positive integer, got '{class_num}'")
        try:
            self.start_label = int(str(start_label).strip())
        except ValueError:
            raise PluginError(f"mAPMetric: start_label must be an integer, got '{start_label}'") from None
        key = str(method).strip().lower()
        if key not in METHOD_ALIASES:
            raise PluginError(f"mAPMetric: method must be voc, voc11 or coco, got '{method}'")
        self.method = METHOD_ALIASES[key]
        if iou_threshold is not None and self.method == "coco":
            raise PluginError("mAPMetric: the coco method averages over IoU 0.50..0.95; it takes no iou_threshold")
        try:
            threshold = float(str(iou_threshold).strip()) if iou_threshold is not None else 0.5
        except ValueError:
            threshold = float("nan")
        if not 0 < threshold < 1:
            raise PluginError(f"mAPMetric: iou_threshold must be a number between 0 and 1, got '{iou_threshold}'")
        self.thresholds = COCO_THRESHOLDS if self.method == "coco" else np.array([threshold])
        self.reset()

    # ------------------------------------------------------------------------------------------- accumulate
    def reset(self) -> None:
        self.scores: List[List[np.ndarray]] = [[] for _ in range(self.class_num)]  # per class, per image
        self.flags: List[List[np.ndarray]] = [[] for _ in range(self.class_num)]   # int8 [D, thresholds]
        self.npos = np.zeros(self.class_num, dtype=np.int64)  # scored (not difficult) ground-truth boxes
        self.images = 0
        self._cache: Optional[np.ndarray] = None

    def __call__(self, pred: Outputs, target: Any) -> None:
        detections = self._detections(as_tensor_list(pred))
        truths = self._truths(target, len(detections))
        for (boxes, scores, classes), (gt_boxes, gt_classes, difficult) in zip(detections, truths):
            self._add_image(boxes, scores, classes, gt_boxes, gt_classes, difficult)
        self.images += len(detections)
        self._cache = None

    def _add_image(self, boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, gt_boxes: np.ndarray,
                   gt_classes: np.ndarray, difficult: np.ndarray) -> None:
        np.add.at(self.npos, gt_classes[~difficult], 1)
        match = match_coco if self.method == "coco" else match_voc
        for c in np.unique(classes):
            mine = np.nonzero(classes == c)[0]
            mine = mine[np.argsort(-scores[mine], kind="stable")]
            if self.method == "coco":
                mine = mine[:COCO_MAX_DETS]
            gt = gt_classes == c
            iou = iou_matrix(boxes[mine], gt_boxes[gt])
            flags = np.stack([match(iou, difficult[gt], t) for t in self.thresholds], axis=1)
            self.scores[c].append(scores[mine])
            self.flags[c].append(flags)

    def _detections(self, outs: List[torch.Tensor]) -> List[Detections]:
        """Per image (boxes, scores, classes) of the valid detections, classes already shifted and in range."""
        if len(outs) in (3, 4):
            raw = self._flat(outs)
        elif len(outs) == 6:
            raw = self._grouped(outs)
        else:
            raise DataError(f"mAPMetric: the model has {len(outs)} outputs; expected 3 or 4 (boxes [B,N,4], scores "
                            f"[B,N], classes [B,N], optional count [B]) or the 6 grouped detection outputs")
        images = []
        for boxes, scores, classes in raw:
            cls = np.round(classes) - self.start_label
            keep = np.isfinite(scores) & np.isfinite(boxes).all(axis=1) & np.isfinite(cls) \
                & (cls >= 0) & (cls < self.class_num)
            images.append((boxes[keep], scores[keep], cls[keep].astype(np.int64)))
        return images

    @staticmethod
    def _flat(outs: List[torch.Tensor]) -> List[Detections]:
        boxes = _numpy(outs[0])
        batch = boxes.shape[0] if boxes.ndim else 0
        if boxes.ndim != 3 or boxes.shape[2] != 4:
            raise DataError(f"mAPMetric: output 0 (boxes) has shape {list(boxes.shape)}; expected [B,N,4] with "
                            f"corners [y0,x0,y1,x1]")
        n = boxes.shape[1]
        scores, classes = (_numpy(t) for t in outs[1:3])
        for i, (what, arr) in enumerate((("scores", scores), ("classes", classes)), start=1):
            if arr.size != batch * n:
                raise DataError(f"mAPMetric: output {i} ({what}) has shape {list(arr.shape)}; expected [B,N] = "
                                f"[{batch},{n}] like the boxes")
        scores, classes = scores.reshape(batch, n), classes.reshape(batch, n)
        if len(outs) == 4:
            count = _numpy(outs[3])
            if count.size != batch:
                raise DataError(f"mAPMetric: output 3 (count) has shape {list(count.shape)}; expected one valid "
                                f"detection count per image, [B] = [{batch}]")
            count = np.clip(np.nan_to_num(count.reshape(batch)), 0, n).astype(np.int64)
        else:
            count = np.full(batch, n, dtype=np.int64)
        images = []
        for b in range(batch):
            k = int(count[b])
            s, c = scores[b, :k], classes[b, :k]
            valid = (c >= 0) & (s > 0) if len(outs) == 3 else np.ones(k, dtype=bool)  # padding rows
            images.append((boxes[b, :k][valid], s[valid], c[valid]))
        return images

    @staticmethod
    def _grouped(outs: List[torch.Tensor]) -> List[Detections]:
        """class_count [B,1], label_per_class [B,C], boxes [B,N,4], box_num_per_class [B,C], scores [B,N], keep."""
        total, labels, boxes, nums, scores = (_numpy(t) for t in outs[:5])
        if boxes.ndim != 3 or boxes.shape[2] != 4:
            raise DataError(f"mAPMetric: output 2 (boxes) has shape {list(boxes.shape)}; the 6-output layout "
                            f"expects [B,N,4]")
        batch, n = boxes.shape[:2]
        try:
            total, labels, nums = total.reshape(batch, -1), labels.reshape(batch, -1), nums.reshape(batch, -1)
            scores = scores.reshape(batch, n)
        except ValueError:
            raise DataError("mAPMetric: the 6 grouped detection outputs do not share the batch size and box count "
                            "of the boxes output") from None
        images = []
        for b in range(batch):
            groups = int(np.nan_to_num(total[b, 0])) if total.shape[1] else 0
            if not 0 <= groups <= min(labels.shape[1], nums.shape[1]):
                raise DataError(f"mAPMetric: image {b} reports {groups} classes but the class outputs hold "
                                f"{min(labels.shape[1], nums.shape[1])}")
            counts = np.nan_to_num(nums[b, :groups]).astype(np.int64)
            if (counts < 0).any() or counts.sum() > n:
                raise DataError(f"mAPMetric: image {b} reports {int(counts.sum())} boxes in its classes but the "
                                f"boxes output holds {n}")
            k = int(counts.sum())
            images.append((boxes[b, :k], scores[b, :k], np.repeat(labels[b, :groups], counts)))
        return images

    def _truths(self, target: Any, batch: int) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per image (boxes [G,4], classes [G], difficult [G]) without padding rows."""
        if isinstance(target, dict):
            missing = [k for k in ("bbox", "label_index") if k not in target]
            if missing:
                raise DataError(f"mAPMetric: the label dict has no {', '.join(missing)}; expected keys 'bbox' "
                                f"[B,M,4], 'label_index' [B,M] and optionally 'difficult' [B,M]")
            boxes = self._label_array(target["bbox"])
            classes = self._label_array(target["label_index"])
            difficult = self._label_array(target["difficult"]) if "difficult" in target else None
            if boxes.ndim != 3 or boxes.shape[2] != 4 or classes.size != boxes.shape[0] * boxes.shape[1] or \
                    (difficult is not None and difficult.size != classes.size):
                raise DataError(f"mAPMetric: label 'bbox' has shape {list(boxes.shape)} and 'label_index' "
                                f"{list(classes.shape)}; expected [B,M,4] and [B,M]")
            classes = classes.reshape(boxes.shape[:2])
            difficult = difficult.reshape(boxes.shape[:2]) if difficult is not None else np.zeros_like(classes)
        else:
            labels = as_tensor_list(target)
            table = self._label_array(labels[0])
            if table.ndim == 2 and table.shape[0] == batch and table.shape[1] in (5, 6):
                table = table[:, None]  # one box per image
            if table.ndim != 3 or table.shape[2] not in (5, 6):
                raise DataError(f"mAPMetric: the label has shape {list(table.shape)}; expected [B,M,5] rows "
                                f"[class, y0, x0, y1, x1] (or [B,M,6] with a difficult flag), padded with class -1")
            classes, boxes = table[:, :, 0], table[:, :, 1:5]
            difficult = table[:, :, 5] if table.shape[2] == 6 else np.zeros_like(classes)
        if boxes.shape[0] != batch:
            raise DataError(f"mAPMetric: {batch} images of detections but labels for {boxes.shape[0]}")
        out = []
        for b in range(batch):
            c = classes[b]
            if (c != np.round(c)).any():
                raise DataError("mAPMetric: label classes must be whole numbers")
            real = c >= 0
            if (c[real] >= self.class_num).any():
                raise DataError(f"mAPMetric: label class {int(c[real].max())} is outside 0..{self.class_num - 1} "
                                f"(class_num {self.class_num})")
            out.append((boxes[b][real], c[real].astype(np.int64), difficult[b][real] != 0))
        return out

    @staticmethod
    def _label_array(t: Any) -> np.ndarray:
        arr = _numpy(t)
        if not np.isfinite(arr).all():
            if arr.size and (arr == -np.inf).all():
                raise DataError("mAPMetric got non-finite labels: the dataset needs a label file (cfg 'label')")
            raise DataError("mAPMetric: the labels of this batch contain NaN or inf; every label value must be "
                            "finite")
        return arr

    # ------------------------------------------------------------------------------------------------ score
    def class_ap(self) -> np.ndarray:
        """AP per class and IoU threshold [class_num, thresholds]; NaN for a class without ground truth."""
        if self._cache is not None:
            return self._cache
        ap = np.full((self.class_num, len(self.thresholds)), np.nan)
        for c in range(self.class_num):
            if self.npos[c] == 0:
                continue
            if not self.scores[c]:
                ap[c] = 0.0
                continue
            scores = np.concatenate(self.scores[c])
            flags = np.concatenate(self.flags[c])[np.argsort(-scores, kind="stable")]
            for t in range(len(self.thresholds)):
                f = flags[:, t]
                f = f[f != IGNORED]
                tp = np.cumsum(f == TP)
                fp = np.cumsum(f == FP)
                recall = tp / self.npos[c]
                precision = tp / np.maximum(tp + fp, 1)
                ap[c, t] = average_precision(recall, precision, self.method)
        self._cache = ap
        return ap

    def compute(self) -> float:
        ap = self.class_ap()
        valid = ~np.isnan(ap[:, 0])
        return float(ap[valid].mean()) if valid.any() else 0.0

    def report(self) -> str:
        ap = self.class_ap()
        valid = ~np.isnan(ap[:, 0])
        detections = sum(len(s) for per_class in self.scores for s in per_class)
        tail = f"{int(valid.sum())} classes with ground truth, {self.images} images, {detections} detections"
        if self.method == "coco":
            ap50 = float(ap[valid, 0].mean()) if valid.any() else 0.0
            ap75 = float(ap[valid, 5].mean()) if valid.any() else 0.0
            return f"mAP@[.5:.95] is {self.compute()} (AP50 {ap50:.6g}, AP75 {ap75:.6g}; {tail})"
        return f"mAP is {self.compute()} ({METHODS[self.method]}, IoU > {self.thresholds[0]:g}; {tail})"
