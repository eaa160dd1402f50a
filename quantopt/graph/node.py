"""PyNode: one layer: typed inputs/outputs (shared PyTensor edges), IR params, internal attrs and constants."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import IRError
from ..registry.optype import OpTypeName
from .batch import forward_batched
from .float_layer import run_float_layer
from .tables import QuantTable, RangeTable, StatisticsTable, detached_quant, detached_ranges, detached_statistics
from .tensor import PyTensor

_MISSING = object()


_REGISTRY: Any = None


def _registry() -> Any:
    """The registry module, imported on first use (it imports this module) and then kept: an import statement in
    `forward` costs a few microseconds on every layer of every forward."""
    global _REGISTRY
    if _REGISTRY is None:
        from .. import registry

        _REGISTRY = registry
    return _REGISTRY


class PyNode:
    """A layer. `params` are written to the IR; `attrs` are quantopt-internal and never serialized."""

    def __init__(self, name: str, optype: OpTypeName, layer_id: int = -1) -> None:
        self.name = name
        self.type = optype
        self.layer_id = layer_id
        self.inputs: List[PyTensor] = []
        self.outputs: List[PyTensor] = []
        self.params: OrderedDict[str, Any] = OrderedDict()
        self.attrs: Dict[str, Any] = {}
        self.constants: OrderedDict[str, PyTensor] = OrderedDict()
        self.placeholders: List[PyTensor] = []
        self.quantized = False
        self.additional = False
        self.source: Optional[Tuple[str, int]] = None
        self.graph: Any = None
        self.settings: Any = None  # config.layer_settings.LayerSettings once quantization starts
        # outside a graph only: the statistics its tensors are looked up in (a detached copy's share the source
        # layer's entries; graph/tables.py, `statistics_of`)
        self.detached_statistics: Optional[StatisticsTable] = None
        # outside a graph only: the calibrated ranges of its tensors (a detached copy's own copy; `ranges_of`)
        self.detached_ranges: Optional[RangeTable] = None
        # outside a graph only: the quantization parameters of its tensors (a detached copy's own copy; `quant_of`)
        self.detached_quant: Optional[QuantTable] = None

    def where(self) -> str:
        if self.source:
            return f"{self.source[0]}:{self.source[1]}"
        return f"layer '{self.name}'"

    def _error(self, message: str) -> IRError:
        file, line = self.source if self.source else (None, None)
        return IRError(f"layer '{self.name}' ({self.type}): {message}", file=file, line=line)

    def get_param(self, key: str, optional: bool = False, default_value: Any = None) -> Any:
        """IR parameter `key`; a missing required one is an IR error naming the layer."""
        value = self.params.get(key, _MISSING)
        if value is _MISSING:
            if optional:
                return default_value
            raise self._error(f"missing required parameter '{key}'")
        return value

    def get_attrs(self, key: str, optional: bool = False, default_value: Any = None) -> Any:
        value = self.attrs.get(key, _MISSING)
        if value is _MISSING:
            if optional:
                return default_value
            raise KeyError(f"layer '{self.name}' has no attribute '{key}'")
        return value

    def get_constant(self, key: str, optional: bool = False) -> Optional[PyTensor]:
        if key in self.constants:
            return self.constants[key]
        if optional:
            return None
        raise self._error(f"missing required constant '{key}' ({key}_type/_offset/_size/_shape)")

    @property
    def current_batch_size(self) -> int:
        """Batch size of the data now flowing through the node (dim 0 of its first non-empty input/output)."""
        for t in list(self.inputs) + list(self.outputs):
            if t.betensor.dim() > 0 and t.betensor.numel() > 0:
                return int(t.betensor.shape[0])
        return 1

    def forward(self) -> List[torch.Tensor]:
        fn = _registry().forward_function(self.type)
        if fn is None:
            raise self._error("no forward implementation is registered for this operator type")
        override = self.attrs.get("forward_override")

        def run() -> None:
            if override is not None:
                override(self, fn)
            elif not self.quantized and self.params.get("unquantifiable") is True:
                run_float_layer(self, fn)
            else:
                fn(self)

        forward_batched(self, run)
        return [t.betensor for t in self.outputs]

    def quantize(self) -> None:
        from ..registry import quantize_function

        fn = quantize_function(self.type)
        if fn is None:
            raise self._error("no quantize implementation is registered for this operator type")
        fn(self)
        self.quantized = True

    def detached_copy(self, inputs: Optional[List[PyTensor]] = None, input_ranges: Optional[RangeTable] = None,
                      input_quant: Optional[QuantTable] = None) -> PyNode:
        """A copy with its own tensors (clones of `inputs` when given, else of its own inputs), outside any
        graph: running or quantizing it never touches the original layer's values. Private attrs (`_*`, caches)
        are not copied. Its statistics table shares the original's entries; its range table is its own copy of the
        original's entries, the inputs' taken from `input_ranges` when given (the table `inputs` are looked up in;
        graph/tables.py); its quantization parameters likewise, the inputs' from `input_quant` when given."""
        m = PyNode(self.name, self.type, self.layer_id)
        m.params = OrderedDict(self.params)
        m.attrs = {k: v for k, v in self.attrs.items() if not k.startswith("_")}
        m.settings = self.settings
        m.source = self.source
        m.inputs = [t.clone() for t in (self.inputs if inputs is None else inputs)]
        m.outputs = [t.clone() for t in self.outputs]
        m.constants = OrderedDict((k, v.clone()) for k, v in self.constants.items())
        m.placeholders = [t.clone() for t in self.placeholders]
        m.detached_statistics = detached_statistics(self, m)
        m.detached_ranges = detached_ranges(self, m, input_ranges)
        m.detached_quant = detached_quant(self, m, input_quant)
        return m

    def __repr__(self) -> str:
        return f"PyNode({self.name!r}, {self.type!r}, id={self.layer_id})"
