"""Build graphs in Python (tests, examples, frontends) with the same structure the IR reader produces."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ..quant.dtype import Dtype
from ..registry.optype import OpType, register_optype
from .graph import PyGraph, QuantizeGraph
from .node import PyNode
from .tensor import PyTensor

ArrayLike = Union[np.ndarray, torch.Tensor, Sequence[float]]


class GraphBuilder:
    """Accumulates layers; `build()` finalizes the graph exactly like `read_ir` does."""

    def __init__(self, name: str = "model") -> None:
        self.name = name
        self._nodes: List[PyNode] = []
        self._shapes: Dict[str, Sequence[int]] = {}
        self._dtypes: Dict[str, Dtype] = {}
        self._inputs: List[str] = []

    def input(self, name: str, shape: Sequence[int], dtype: Dtype = Dtype.FP32,
              layer_name: Optional[str] = None) -> str:
        self.layer("Input", [], [shape], name=layer_name or name, outputs=[name], output_dtypes=[dtype])
        self._inputs.append(name)
        return name

    def layer(self, optype: str, inputs: Sequence[str], output_shapes: Sequence[Sequence[int]],
              name: Optional[str] = None, params: Optional[Mapping[str, Any]] = None,
              constants: Optional[Mapping[str, ArrayLike]] = None, outputs: Optional[Sequence[str]] = None,
              output_dtypes: Optional[Sequence[Dtype]] = None,
              constant_dtypes: Optional[Mapping[str, Dtype]] = None) -> Union[str, List[str]]:
        """Add a layer; returns its output tensor name (or names when it has several outputs)."""
        if optype not in OpType:
            register_optype(optype)
        name = name or f"{optype.lower()}_{len(self._nodes)}"
        node = PyNode(name, OpType.lookup(optype), len(self._nodes))
        node.params = OrderedDict(params or {})
        outputs = list(outputs) if outputs else ([f"{name}_{i}" for i in range(len(output_shapes))]
                                                 if len(output_shapes) > 1 else [name])
        output_dtypes = list(output_dtypes) if output_dtypes else [Dtype.FP32] * len(outputs)
        node.inputs = [PyTensor(t, dtype=self._dtypes.get(t, Dtype.FP32), shape=self._shapes.get(t)) for t in inputs]
        node.outputs = [PyTensor(o, dtype=d, shape=s) for o, s, d in zip(outputs, output_shapes, output_dtypes)]
        for key, value in (constants or {}).items():
            dtype = (constant_dtypes or {}).get(key, Dtype.FP32)
            data = torch.as_tensor(np.asarray(value)).to(dtype.torch_dtype)
            node.constants[key] = PyTensor(name + key, data, dtype, tuple(data.shape))
        for o, s, d in zip(outputs, output_shapes, output_dtypes):
            self._shapes[o] = s
            self._dtypes[o] = d
        self._nodes.append(node)
        return outputs[0] if len(outputs) == 1 else outputs

    def build(self, outputs: Sequence[str], graph_cls: type = QuantizeGraph) -> PyGraph:
        g = graph_cls(self.name)
        for n in self._nodes:
            g.add_node(n)
        g.finalize()
        g.set_io(self._inputs, list(outputs))
        return g
