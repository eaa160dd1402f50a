"""PyTensor: a graph edge or constant: torch data plus IR info and quantization parameters (statistics and
calibrated ranges live in the graph's side tables, graph/tables.py)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..quant.dtype import Dtype
from .tables import TensorQuant

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
        self._quant = TensorQuant()  # TRANSITIONAL: read and written through graph/tables.py `quant_of`
        self.pnode: Any = None
        self.extra: Dict[str, Any] = {}

    @property
    def scale(self) -> Any:  # TRANSITIONAL
        return self._quant.scale

    @scale.setter
    def scale(self, value: Any) -> None:
        self._quant.scale = value

    @property
    def zerop(self) -> Any:  # TRANSITIONAL
        return self._quant.zerop

    @zerop.setter
    def zerop(self, value: Any) -> None:
        self._quant.zerop = value

    @property
    def qbits(self) -> Any:  # TRANSITIONAL
        return self._quant.qbits

    @qbits.setter
    def qbits(self, value: Any) -> None:
        self._quant.qbits = value

    @property
    def qmin(self) -> Any:  # TRANSITIONAL
        return self._quant.qmin

    @qmin.setter
    def qmin(self, value: Any) -> None:
        self._quant.qmin = value

    @property
    def qmax(self) -> Any:  # TRANSITIONAL
        return self._quant.qmax

    @qmax.setter
    def qmax(self, value: Any) -> None:
        self._quant.qmax = value

    @property
    def qinvariant(self) -> Any:  # TRANSITIONAL
        return self._quant.qinvariant

    @qinvariant.setter
    def qinvariant(self, value: Any) -> None:
        self._quant.qinvariant = value

    @property
    def key_axis(self) -> Any:  # TRANSITIONAL
        return self._quant.axis

    @key_axis.setter
    def key_axis(self, value: Any) -> None:
        self._quant.axis = value

    @property
    def ir_numel(self) -> int:
        n = 1
        for d in self.ir_shape:
            n *= int(d)
        return n

    def clone(self, name: Optional[str] = None) -> PyTensor:
        t = PyTensor(name or self.name, self.betensor.clone(), self.ir_dtype, self.ir_shape)
        for key in ("dtype", "ir_range"):
            setattr(t, key, getattr(self, key))
        t._quant = self._quant.copy()
        t.extra = dict(self.extra)
        return t

    def release(self) -> None:
        """Drop the value (the executor calls this once the last consumer has run)."""
        self.betensor = torch.empty(0)

    def __repr__(self) -> str:
        return f"PyTensor({self.name!r}, shape={list(self.ir_shape)}, dtype={self.dtype.value})"
