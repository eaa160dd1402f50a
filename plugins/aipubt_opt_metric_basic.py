"""Built-in generic metric plugins: `TopKMetric` (classification accuracy) and `CosDistanceMetric`.

Both accumulate per batch (`__call__`), so the whole validation set never has to be held in memory.
Labels that are `-inf` mean the dataset was built without a label file; a metric cannot score those, so it
raises a `DataError` that says so instead of reporting a meaningless number.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Union

import torch
import torch.nn.functional as F

from quantopt import DataError, OptBaseMetric, PluginError, PluginType, register_plugin

Outputs = Union[torch.Tensor, Sequence[torch.Tensor]]


def _as_list(x: Any) -> List[torch.Tensor]:
    items = list(x) if isinstance(x, (list, tuple)) else [x]
    return [t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in items]


def _require_labels(metric: str, labels: List[torch.Tensor]) -> None:
    for t in labels:
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise DataError(f"{metric} got non-finite labels: the dataset needs a label file (cfg 'label')")


@register_plugin(PluginType.Metric, "1.0")
class TopKMetric(OptBaseMetric):
    """Top-K accuracy of output 0 (flattened per batch row) against class-index labels."""

    def __init__(self, K: str = "1") -> None:
        super().__init__(K)
        text = str(K).strip()
        try:
            k = int(text)
        except ValueError:
            raise PluginError(f"TopKMetric: K must be a positive integer, got '{K}'") from None
        if k < 1:
            raise PluginError(f"TopKMetric: K must be a positive integer, got '{K}'")
        self.k = k
        self.reset()

    def __call__(self, pred: Outputs, target: Any) -> None:
        out = _as_list(pred)[0]
        labels = _as_list(target)
        _require_labels("TopKMetric", labels)
        batch = out.shape[0] if out.dim() > 0 else 1
        scores = out.reshape(batch, -1)
        classes = labels[0].reshape(-1)
        if classes.numel() != batch:
            raise DataError(f"TopKMetric: {batch} predictions but {classes.numel()} labels in the batch; labels "
                            f"must be one class index per sample (shape [B] or [B,1])")
        k = min(self.k, scores.shape[1])
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
        outs = _as_list(pred)
        labels = _as_list(target)
        _require_labels("CosDistanceMetric", labels)
        batch = outs[0].shape[0] if outs[0].dim() > 0 else 1
        for name, group in (("output", outs), ("label", labels)):
            for t in group:
                if (t.shape[0] if t.dim() > 0 else 1) != batch:
                    raise DataError(f"CosDistanceMetric: a {name} has batch size {t.shape[0] if t.dim() else 1} "
                                    f"but output 0 has {batch}")
        p = torch.cat([t.reshape(batch, -1).to(torch.float64) for t in outs], dim=1)
        q = torch.cat([t.reshape(batch, -1).to(torch.float64) for t in labels], dim=1)
        if p.shape[1] != q.shape[1]:
            raise DataError(f"CosDistanceMetric: the outputs have {p.shape[1]} values per sample but the labels "
                            f"have {q.shape[1]}")
        self.sum += float(F.cosine_similarity(p, q, dim=1, eps=1e-12).sum())
        self.count += batch

    def reset(self) -> None:
        self.sum = 0.0
        self.count = 0

    def compute(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def report(self) -> str:
        return f"cosine distance is {self.compute()}"
