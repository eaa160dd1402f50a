"""PyTensor: a graph edge or constant: torch data plus IR info and quantization parameters (statistics and
calibrated ranges live in the graph's side tables, graph/tables.py)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..quant.dtype import Dtype

Number = Union[int, float]


class PyTensor:
    """One tensor of the graph. `betensor` holds the current value (float, or integers when quantized)."""

    def __init__(self, name: str, data: Optional[torch.Tensor] = None, dtype: Dtype = Dtype.FP32,
                 shape: Optional[Sequence[int]] = None) -> None:
        self.name = name
        self.betensor: torch.Tensor = data if data is not None else torch.empty(0)
        self.ir_shape: Tuple[int, ...] = tuple(shape) if shape is not None else tuple(self.betensor.shape)
        self.ir_dtype: Dtype = dtype
        self.dtype: Dtype = dtype
        self.ir_range: Optional[List[Number]] = None
        # quantization parameters, OPT convention: q = round(x * scale - zerop); x = (q + zerop) / scale
        self.scale: Union[float, torch.Tensor] = 1.0
        self.zerop: Union[int, torch.Tensor] = 0
        self.qbits: Optional[int] = None
        self.qmin: Optional[int] = None
        self.qmax: Optional[int] = None
        self.qinvariant: bool = False
        self.key_axis: Optional[int] = None
        self.pnode: Any = None
        self.extra: Dict[str, Any] = {}

    @property
    def ir_numel(self) -> int:
        n = 1
        for d in self.ir_shape:
            n *= int(d)
        return n

    def clone(self, name: Optional[str] = None) -> PyTensor:
        t = PyTensor(name or self.name, self.betensor.clone(), self.ir_dtype, self.ir_shape)
        for key in ("dtype", "ir_range", "qbits", "qmin", "qmax", "qinvariant", "key_axis"):
            setattr(t, key, getattr(self, key))
        for key in ("scale", "zerop"):
            v = getattr(self, key)
            setattr(t, key, v.clone() if isinstance(v, torch.Tensor) else v)
        t.extra = dict(self.extra)
        return t

    def release(self) -> None:
        """Drop the value (the executor calls this once the last consumer has run)."""
        self.betensor = torch.empty(0)

    def __repr__(self) -> str:
        return f"PyTensor({self.name!r}, shape={list(self.ir_shape)}, dtype={self.dtype.value})"
