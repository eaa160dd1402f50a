"""The float graph's layer outputs of its first calibration batches, recorded by the statistics pass for the
precision analysis.

Why: the analysis compares the quantized graph with the float graph on the first `similarity_data_num` calibration
batches, which the statistics pass has just run through the float graph; nothing changes the float graph's forward
in between (calibration sets ranges, the global methods tune a copy). Keeping those outputs saves the analysis one
float forward of its batches. They cost the memory of that forward's activations from the statistics step to the
analysis, so recording has a budget: past it everything recorded is dropped and the analysis runs the float forward
itself, as it would without a record.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set

import torch

from .graph import PyGraph
from .node import PyNode

RECORD_BUDGET_BYTES = 1 << 30
"""Most bytes of float activations the statistics pass keeps for the analysis (1 GiB): the analysis of one batch
of most models fits; a larger one is run again instead of holding several GiB through calibration."""


@dataclass
class RecordedBatch:
    """One calibration batch: the inputs as fed to the graphs and every layer output's float value by tensor name."""
    inputs: List[torch.Tensor]
    values: Dict[str, torch.Tensor] = field(default_factory=dict)

    def restore(self, graph: PyGraph) -> None:
        """Put the recorded values back on the graph's layer outputs, as if its forward had just run with
        keep_tensors."""
        for n in graph.nodes:
            for t in n.outputs:
                value = self.values.get(t.name)
                if value is None:
                    raise KeyError(f"no recorded float value for '{t.name}' of layer '{n.name}': the record was "
                                   "made for another graph")
                t.betensor = value


class ForwardRecord:
    """Records the layer outputs of the first `batches` forwards it is shown, within `budget_bytes` (default
    RECORD_BUDGET_BYTES)."""

    def __init__(self, batches: int, budget_bytes: Optional[int] = None) -> None:
        self.limit = batches
        self.budget_bytes = RECORD_BUDGET_BYTES if budget_bytes is None else budget_bytes
        self.batches: List[RecordedBatch] = []
        self.over_budget = False
        self._current: Optional[RecordedBatch] = None
        self._storages: Set[int] = set()
        self._bytes = 0

    @property
    def usable(self) -> bool:
        """Whether the record holds whole batches (at least one, none dropped for the budget)."""
        return bool(self.batches) and not self.over_budget

    def wants_more(self) -> bool:
        """Whether the next forward would be recorded (one of the first `batches`, the budget still holding)."""
        return not self.over_budget and len(self.batches) < self.limit

    def start_batch(self, inputs: Sequence[torch.Tensor]) -> None:
        """A forward begins: record it if it is one of the first `batches` and the budget still holds."""
        self._current = None
        if self.over_budget or len(self.batches) >= self.limit:
            return
        self._current = RecordedBatch(list(inputs))
        self.batches.append(self._current)

    def keep(self, node: PyNode) -> None:
        """Keep `node`'s outputs of the batch being recorded (references, no copies: the forward only drops them)."""
        if self._current is None:
            return
        for t in node.outputs:
            value = t.betensor
            storage = value.untyped_storage()
            if storage.data_ptr() not in self._storages:  # views of one storage count once
                self._storages.add(storage.data_ptr())
                self._bytes += storage.nbytes()
            self._current.values[t.name] = value
        if self._bytes > self.budget_bytes:
            self.drop()
            self.over_budget = True

    def drop(self) -> None:
        """Free everything recorded."""
        self.batches = []
        self._current = None
        self._storages = set()
        self._bytes = 0
