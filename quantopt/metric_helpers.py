"""Helpers for metric plugins (built-in and user ones): outputs/labels as tensor lists, label checks, cfg flags.

Metric constructor arguments come from the cfg as strings (`metric = TopKMetric(5,true)`); labels come from the
dataset, where all `-inf` means the dataset had no label file.
"""
from __future__ import annotations

from typing import Any, List

import torch

from .errors import DataError, PluginError

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


def as_tensor_list(x: Any) -> List[torch.Tensor]:
    """A metric's outputs or labels (one tensor or a sequence of them) as a list of tensors."""
    items = list(x) if isinstance(x, (list, tuple)) else [x]
    return [t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in items]


def require_labels(metric: str, labels: List[torch.Tensor]) -> None:
    """All `-inf` means "no label file"; any other NaN/inf is bad data in the label file."""
    for t in labels:
        if t.is_floating_point() and not torch.isfinite(t).all():
            if t.numel() and bool((t == float("-inf")).all()):
                raise DataError(f"{metric} got non-finite labels: the dataset needs a label file (cfg 'label')")
            bad = "NaN" if bool(torch.isnan(t).any()) else "inf"
            raise DataError(f"{metric}: the labels of this batch contain {bad}; every label value must be finite")


def bool_arg(metric: str, name: str, value: Any) -> bool:
    """A cfg flag: true/false, 1/0, yes/no, on/off (any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise PluginError(f"{metric}: {name} must be true or false, got '{value}'")
