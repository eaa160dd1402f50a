"""PyTensor: a graph edge or constant: torch data plus IR info. What the stages compute about a tensor (statistics,
calibrated ranges, quantization parameters) lives in the graph's side tables, keyed by tensor name
(graph/tables.py; docs/architecture.md, "What a tensor holds, and the side tables")."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..quant.dtype import Dtype

Number = Union[int, float]


MAX_RANK = 8
"""Most dims a tensor may have. Models use at most 6 or 7 (a window attention's partitions); torch's own kernels
refuse some ranks above 15 (GELU: "dimensions are invalid"), so a higher rank, which only a broken model gives, is
refused when the model is read, naming the layer or node, instead of failing in a forward."""


class PyTensor:
    """One tensor of the graph. `betensor` holds the current value (float, or integers when quantized); `dtype` is
    its current dtype (the quantized one once its producer is quantized), `ir_dtype`/`ir_shape`/`ir_range` what the
    IR declares, `pnode` the producing layer. Slots: a stage cannot hang its state on a tensor by accident."""

    __slots__ = ("name", "betensor", "ir_shape", "ir_dtype", "dtype", "ir_range", "pnode", "extra", "__weakref__")

    def __init__(self, name: str, data: Optional[torch.Tensor] = None, dtype: Dtype = Dtype.FP32,
                 shape: Optional[Sequence[int]] = None) -> None:
        self.name = name
        self.betensor: torch.Tensor = data if data is not None else torch.empty(0)
        self.ir_shape: Tuple[int, ...] = tuple(shape) if shape is not None else tuple(self.betensor.shape)
        self.ir_dtype: Dtype = dtype
        self.dtype: Dtype = dtype
        self.ir_range: Optional[List[Number]] = None
        self.pnode: Any = None
        self.extra: Dict[str, Any] = {}

    @property
    def ir_numel(self) -> int:
        n = 1
        for d in self.ir_shape:
            n *= int(d)
        return n

    def clone(self, name: Optional[str] = None) -> PyTensor:
        """A copy with the value cloned (its side-table entries stay with the graph: copy them where needed)."""
        t = PyTensor(name or self.name, self.betensor.clone(), self.ir_dtype, self.ir_shape)
        for key in ("dtype", "ir_range"):
            setattr(t, key, getattr(self, key))
        t.extra = dict(self.extra)
        return t

    def release(self) -> None:
        """Drop the value (the executor calls this once the last consumer has run)."""
        self.betensor = torch.empty(0)

    def __repr__(self) -> str:
        return f"PyTensor({self.name!r}, shape={list(self.ir_shape)}, dtype={self.dtype.value})"
