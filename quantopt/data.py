"""Datasets and metrics from the cfg: plugin lookup, loaders, and the checks that data fits the model."""
from __future__ import annotations

import functools
import inspect
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.utils.data

from .config.reader import Config
from .errors import ConfigError, DataError, PluginError, QuantOptError
from .graph.graph import PyGraph
from .registry import OptBaseMetric, PluginType, get_plugin


def _check_dataset_args(cls: type, name: str, kwargs: dict) -> None:
    """Every `dataset_args` key must be a constructor keyword of the plugin: a typo is a cfg error, not a crash."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in kwargs if k not in params or k in ("self", "data_file", "label_file")]
    if unknown:
        accepted = [p for p in params if p not in ("self", "data_file", "label_file")]
        raise ConfigError(f"dataset plugin '{name}' takes no argument '{unknown[0]}' "
                          f"(it accepts: {', '.join(accepted) or 'none'})", field="dataset_args")


def make_dataset(cfg: Config, data_file: str, label_file: Optional[str] = None) -> torch.utils.data.Dataset:
    cls = get_plugin(PluginType.Dataset, cfg.dataset)
    kwargs = dict(getattr(cfg, "dataset_args", None) or {})
    if kwargs:
        _check_dataset_args(cls, cfg.dataset, kwargs)
    try:
        ds = cls(data_file, label_file, **kwargs) if label_file else cls(data_file, **kwargs)
    except QuantOptError:
        raise
    except FileNotFoundError as e:
        raise DataError(f"dataset '{cfg.dataset}' could not open a file: {e}", file=data_file) from None
    except Exception as e:
        raise DataError(f"dataset plugin '{cfg.dataset}' failed on this file: {type(e).__name__}: {e}",
                        file=data_file) from None
    try:
        n = len(ds)
    except QuantOptError:  # a user plugin's own error, already reported as a plugin error by the registry
        raise
    except Exception as e:
        raise PluginError(f"dataset plugin '{cfg.dataset}' has no usable __len__: {e}") from None
    if n == 0:
        raise DataError("the dataset holds no samples", file=data_file)
    return ds


SHUFFLE_SEED = 0
"""`calibration_shuffe`: the seed of the one fixed permutation of the calibration samples (runs stay reproducible)."""


def shuffled(dataset: torch.utils.data.Dataset) -> torch.utils.data.Dataset:
    """The dataset in one fixed pseudo-random order (seed SHUFFLE_SEED): every pass over it, and every run, sees the
    samples in the same order, unlike a loader that shuffles anew on each pass."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SHUFFLE_SEED)).tolist()
    return torch.utils.data.Subset(dataset, order)


def collate_along(data_dim: int, label_dim: int, samples: List[Any]) -> Any:
    """Collate `[inputs, label]` samples as torch does, then move the sample axis of every input tensor to
    `data_dim` and of a tensor label to `label_dim` (`data_batch_dim`, `label_batch_dim`)."""
    inputs, label = torch.utils.data.default_collate(samples)

    def moved(x: Any, dim: int) -> Any:
        if isinstance(x, torch.Tensor) and dim and x.dim() > dim:
            return x.movedim(0, dim)
        return x

    inputs = [moved(x, data_dim) for x in inputs] if isinstance(inputs, (list, tuple)) else moved(inputs, data_dim)
    return [inputs, moved(label, label_dim)]


def make_loader(cfg: Config, dataset: torch.utils.data.Dataset, batch_size: int) -> torch.utils.data.DataLoader:
    if cfg.without_batch_dim:
        batch_size = 1
    collate = functools.partial(collate_along, cfg.data_batch_dim, cfg.label_batch_dim) \
        if cfg.data_batch_dim or cfg.label_batch_dim else None
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False,
                                       num_workers=cfg.dataloader_workers, collate_fn=collate)


def make_metrics(cfg: Config) -> List[OptBaseMetric]:
    metrics = []
    for name, args in cfg.metric or []:
        cls = get_plugin(PluginType.Metric, name)
        try:
            metrics.append(cls(*args))
        except QuantOptError:
            raise
        except Exception as e:
            raise PluginError(f"metric '{name}({','.join(args)})' could not be constructed: "
                              f"{type(e).__name__}: {e}", field="metric") from None
    return metrics


def split_sample(batch: Any, source: str) -> Tuple[List[torch.Tensor], Any]:
    """A collated `[inputs, label]` batch → (list of input tensors, label)."""
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise PluginError(f"dataset samples must be [inputs, label] pairs (reading {source})")
    inputs, label = batch
    if isinstance(inputs, torch.Tensor):
        inputs = [inputs]
    elif isinstance(inputs, (list, tuple)):
        inputs = list(inputs)
    else:
        raise PluginError(f"dataset inputs must be a tensor or a list of tensors, got {type(inputs).__name__} "
                          f"(reading {source})")
    return [torch.as_tensor(x) for x in inputs], label


def prepare_inputs(graph: PyGraph, inputs: Sequence[torch.Tensor], cfg: Config, source: str,
                   batch_index: int) -> List[torch.Tensor]:
    """Check count, shape, dtype and finiteness of one batch against the IR's inputs; return the feed."""
    if len(inputs) != len(graph.input_tensors):
        raise DataError(f"the model has {len(graph.input_tensors)} input(s) "
                        f"{[t.name for t in graph.input_tensors]} but the dataset gives {len(inputs)}", file=source)
    feed = []
    for x, t in zip(inputs, graph.input_tensors):
        axis = int(cfg.data_batch_dim)
        if cfg.without_batch_dim:
            x = x[0]
            sample_shape, ir_shape = tuple(x.shape), tuple(t.ir_shape)
        else:
            sample_shape = tuple(x.shape[:axis]) + tuple(x.shape[axis + 1:])
            ir_shape = tuple(t.ir_shape[:axis]) + tuple(t.ir_shape[axis + 1:])
        if sample_shape != ir_shape:
            raise DataError(f"input '{t.name}': samples have shape {list(sample_shape)} but the IR expects "
                            f"{list(ir_shape)} (without the batch dim{f', axis {axis}' if axis else ''})",
                            file=source)
        if x.is_floating_point() == t.ir_dtype.is_float or t.ir_dtype.is_float:  # integer data may feed a float input
            x = x.to(t.ir_dtype.torch_dtype)
        if x.is_floating_point() != t.ir_dtype.is_float:
            raise DataError(f"input '{t.name}': data dtype {x.dtype} does not fit the IR dtype "
                            f"{t.ir_dtype.value}", file=source)
        if x.is_floating_point() and not torch.isfinite(x).all():
            bad = int((~torch.isfinite(x)).movedim(axis, 0).reshape(x.shape[axis], -1).any(dim=1).nonzero()[0]) \
                if not cfg.without_batch_dim else 0
            raise DataError(f"input '{t.name}': NaN or inf in batch {batch_index} (sample {bad} of that batch)",
                            file=source)
        feed.append(x)
    return feed
