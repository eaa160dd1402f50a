"""Which data batches a graph of IR batch b > 1 can run, and how a short last batch is cut to fit.

A graph runs any whole number of IR batches (graph/batch.py). A batch of r samples that is not a multiple of the IR
batch b runs only where every layer takes its rows whole (convolutions, element-wise layers, ...); a layer whose dim
0 is not only the batch (a Reshape to a fixed shape, an operator without a batch rule) cannot split it into IR
batches. A data loader gives such a batch when the batch size is not a multiple of b, or last, when the sample count
is not a multiple of the batch size. The first is the user's setting to change (a config error naming the field);
the second would stop a whole run on its last few samples, so that batch keeps its first r // b · b samples and the
others are left out, said once (`Fit.dropped`).

Whether the graph runs r rows is found by a forward of all-zero inputs of r rows (only for r not a multiple of b),
once per r while the graph keeps its layers (graph passes may add some): the layer that cannot run them raises
`BatchSizeError` before any other work, and its message is the reason given to the user. The float graph decides
for the quantized one too: quantization keeps its layers, adding only element-wise ones at float borders.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import BatchSizeError
from .graph import PyGraph


@dataclass
class Fit:
    """The rows of a graph's batches: which row counts it runs, and what was left out of short batches."""

    graph: PyGraph
    active: bool = True
    """False where the samples do not lie along dim 0 (`data_batch_dim` > 0, `without_batch_dim`): the graph
    batches along dim 0 only, and such batches hold the IR's size (nothing is cut)"""
    label_dim: int = 0
    """the axis along which a batch's tensor labels are stacked (`label_batch_dim`)"""
    _runs: Dict[Tuple[int, Tuple[int, ...]], Optional[str]] = field(default_factory=dict)
    dropped: int = 0
    """samples left out of short batches so far"""
    reason: str = ""
    """why the first of them was left out (the layer's message)"""

    @property
    def ir_batch(self) -> int:
        inputs = self.graph.input_tensors
        return int(inputs[0].ir_shape[0]) if self.active and inputs and inputs[0].ir_shape else 1

    def refusal(self, rows: int) -> Optional[str]:
        """None when the graph runs batches of `rows` samples, else the reason it cannot (the layer's message)."""
        b = self.ir_batch
        if b <= 1 or rows % b == 0:
            return None
        key = (rows, tuple(id(n) for n in self.graph.nodes))
        if key not in self._runs:
            try:
                with torch.no_grad():
                    self.graph.forward(self.graph.zero_inputs(rows))
                self._runs[key] = None
            except BatchSizeError as e:
                self._runs[key] = e.message
        return self._runs[key]

    def cut(self, inputs: Sequence[torch.Tensor], label: Any = None) -> Optional[Tuple[List[torch.Tensor], Any]]:
        """(inputs, label) of a short batch cut to the whole IR batches it holds where the graph cannot run it as it
        is (the rest counted in `dropped`); None where nothing of it is left; the batch itself where it runs."""
        rows = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 0
        why = self.refusal(rows) if rows else None
        if why is None:
            return list(inputs), label
        keep = rows // self.ir_batch * self.ir_batch
        if not self.dropped:
            self.reason = why
        self.dropped += rows - keep
        if not keep:
            return None
        return [x[:keep] for x in inputs], cut_label(label, rows, keep, self.label_dim)


def cut_label(label: Any, rows: int, keep: int, axis: int = 0) -> Any:
    """The first `keep` of `rows` samples' labels: tensors holding `rows` entries along `axis` and lists of `rows`
    plain entries (strings, numbers) are cut, containers recursively; anything else is one value for the whole
    batch and stays."""
    if isinstance(label, torch.Tensor):
        return label.narrow(axis, 0, keep) if label.dim() > axis and int(label.shape[axis]) == rows else label
    if isinstance(label, (list, tuple)):
        if len(label) == rows and not any(isinstance(v, (torch.Tensor, list, tuple, dict)) for v in label):
            return type(label)(label[:keep])
        return type(label)(cut_label(v, rows, keep, axis) for v in label)
    if isinstance(label, dict):
        return {k: cut_label(v, rows, keep, axis) for k, v in label.items()}
    return label
