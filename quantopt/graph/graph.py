"""PyGraph: nodes over a networkx DiGraph, kept in topological order, with a memory-frugal forward executor."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import networkx as nx
import torch

from ..errors import DataError, IRError
from .node import PyNode
from .tables import QuantTable, RangeTable, StatisticsTable, node_tensors
from .tensor import PyTensor
from .wide_values import WideValues

NodeHook = Callable[[PyNode], None]


class PyGraph:
    """A model graph. Edges are PyTensor objects shared by producer and consumers."""

    def __init__(self, name: str = "model") -> None:
        self.name = name
        self.nodes: List[PyNode] = []
        self.nx = nx.DiGraph()
        self.input_tensors: List[PyTensor] = []
        self.output_tensors: List[PyTensor] = []
        self.header: OrderedDict[str, Any] = OrderedDict()
        self.source_file: Optional[str] = None
        self._storage: Any = None  # keeps the mmap of the .bin alive while constants view it
        self._last_use: Dict[int, int] = {}
        self.device = torch.device("cpu")
        self.statistics = StatisticsTable()  # tensor name -> statistics (graph/tables.py)
        self.ranges = RangeTable()  # tensor name -> calibrated ranges (graph/tables.py)
        self.quant = QuantTable()  # tensor name -> quantization parameters (graph/tables.py)
        self.wide_values = WideValues()  # the float forward's float64 results (docs/architecture.md, "Float reference")

    # ----------------------------------------------------------------------------------------- structure
    def add_node(self, node: PyNode) -> PyNode:
        node.graph = self
        if node.detached_ranges is not None:  # a layer built on its own brings the ranges set on it
            for t in node_tensors(node):
                if t in node.detached_ranges:
                    self.ranges.copy_from(node.detached_ranges, t)
            node.detached_ranges = None
        if node.detached_quant is not None:  # ... and the quantization parameters set on it
            for t in node_tensors(node):
                if t in node.detached_quant:
                    self.quant.copy_from(node.detached_quant, t)
            node.detached_quant = None
        self.nodes.append(node)
        return node

    def node(self, name: str) -> PyNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no layer named '{name}'")

    def to(self, device: Union[str, torch.device]) -> PyGraph:
        """Move every constant to `device`; inputs fed later follow it (`feed_inputs`). Returns the graph."""
        device = torch.device(device)
        for n in self.nodes:
            for t in n.constants.values():
                t.betensor = t.betensor.to(device)
        self.device = device
        return self

    def tensors(self) -> Dict[str, PyTensor]:
        """Activation tensors by name (node outputs)."""
        return {t.name: t for n in self.nodes for t in n.outputs}

    def finalize(self, file: Optional[str] = None) -> PyGraph:
        """Check names and edges, build the networkx graph and sort nodes topologically (ties by layer_id)."""
        producers: Dict[str, PyNode] = {}
        layer_names: Dict[str, PyNode] = {}
        for n in self.nodes:
            if n.name in layer_names:
                line = n.source[1] if n.source else None
                raise IRError(f"duplicate layer name '{n.name}' (first defined at "
                              f"{layer_names[n.name].where()})", file=file, line=line)
            layer_names[n.name] = n
            for t in n.outputs:
                if t.name in producers:
                    line = n.source[1] if n.source else None
                    raise IRError(f"duplicate tensor name '{t.name}': produced by layer '{producers[t.name].name}' "
                                  f"and layer '{n.name}'", file=file, line=line)
                producers[t.name] = n
                t.pnode = n
        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.name, node=n)
        for n in self.nodes:
            for t in n.inputs:
                p = producers.get(t.name)
                if p is None:
                    line = n.source[1] if n.source else None
                    raise IRError(f"layer '{n.name}' reads tensor '{t.name}' that no layer produces",
                                  file=file, line=line)
                if g.has_edge(p.name, n.name):
                    g.edges[p.name, n.name]["tensors"].append(t.name)
                else:
                    g.add_edge(p.name, n.name, tensors=[t.name])
        try:
            cycle = nx.find_cycle(g)
        except nx.NetworkXNoCycle:
            cycle = None
        if cycle:
            names = " -> ".join([e[0] for e in cycle] + [cycle[0][0]])
            first = layer_names[cycle[0][0]]
            raise IRError(f"the graph has a cycle: {names}", file=file, line=first.source[1] if first.source else None)
        order = {n.name: (n.layer_id, i) for i, n in enumerate(self.nodes)}
        sorted_names = list(nx.lexicographical_topological_sort(g, key=lambda name: order[name]))
        self.nodes = [layer_names[name] for name in sorted_names]
        self.nx = g
        # input edges must be the producer's own tensor objects
        for n in self.nodes:
            n.inputs = [producers[t.name].outputs[[o.name for o in producers[t.name].outputs].index(t.name)]
                        for t in n.inputs]
        self._compute_last_use()
        return self

    def set_io(self, inputs: Sequence[str], outputs: Sequence[str], file: Optional[str] = None,
               line: Optional[int] = None) -> None:
        tensors = self.tensors()
        for label, names in (("input_tensors", inputs), ("output_tensors", outputs)):
            for nm in names:
                if nm not in tensors:
                    raise IRError(f"{label} names tensor '{nm}' that no layer produces", file=file, line=line)
        self.input_tensors = [tensors[n] for n in inputs]
        self.output_tensors = [tensors[n] for n in outputs]
        self._compute_last_use()

    def _compute_last_use(self) -> None:
        last: Dict[int, int] = {}
        for idx, n in enumerate(self.nodes):
            for t in n.outputs:
                last.setdefault(id(t), idx)
            for t in n.inputs:
                last[id(t)] = idx
        self._last_use = last

    # ----------------------------------------------------------------------------------------- execution
    def feed_inputs(self, data: Union[Sequence[torch.Tensor], Mapping[str, torch.Tensor], torch.Tensor]) -> None:
        if isinstance(data, torch.Tensor):
            data = [data]
        if isinstance(data, Mapping):
            missing = [t.name for t in self.input_tensors if t.name not in data]
            if missing:
                raise DataError(f"no data given for graph input(s) {missing}")
            data = [data[t.name] for t in self.input_tensors]
        if len(data) != len(self.input_tensors):
            raise DataError(f"the model has {len(self.input_tensors)} input(s) "
                            f"{[t.name for t in self.input_tensors]} but {len(data)} were given")
        for t, d in zip(self.input_tensors, data):
            if not isinstance(d, torch.Tensor):
                d = torch.as_tensor(d)
            t.betensor = d.to(self.device)

    def forward(self, data: Union[Sequence[torch.Tensor], Mapping[str, torch.Tensor], torch.Tensor],
                keep_tensors: bool = False, after_node: Optional[NodeHook] = None) -> List[torch.Tensor]:
        """Run every node in order; intermediates are freed after their last consumer unless `keep_tensors`."""
        self.feed_inputs(data)
        keep = {id(t) for t in self.output_tensors} | {id(t) for t in self.input_tensors}
        for idx, n in enumerate(self.nodes):
            n.forward()
            if after_node is not None:
                after_node(n)
            if keep_tensors:
                continue
            for t in list(n.inputs) + list(n.outputs):
                if id(t) not in keep and self._last_use.get(id(t), -1) <= idx:
                    t.release()
                    self.wide_values.drop(t)
        if not keep_tensors:  # no layer reads the graph outputs' float64 values after the forward
            for t in self.output_tensors:
                self.wide_values.drop(t)
        return [t.betensor for t in self.output_tensors]

    def zero_inputs(self, batch_size: Optional[int] = None) -> List[torch.Tensor]:
        """All-zero inputs with the IR shapes and compute dtypes (the forward sanity check feeds these)."""
        feeds = []
        for t in self.input_tensors:
            shape = list(t.ir_shape)
            if batch_size is not None and shape:
                shape[0] = batch_size
            feeds.append(torch.zeros(shape, dtype=t.ir_dtype.torch_dtype))
        return feeds

    def clone(self) -> PyGraph:
        """Deep copy: new nodes and tensors (values cloned), same structure. The statistics table is copied sharing
        its entries (statistics are read-only once collected), the range and parameter tables with their values cloned
        (they are edited on copies; graph/tables.py)."""
        g = type(self)(self.name)
        g.statistics = self.statistics.copy()
        g.ranges = self.ranges.copy()
        g.quant = self.quant.copy()
        g.header = OrderedDict(self.header)
        g.source_file = self.source_file
        g._storage = self._storage
        g.device = self.device
        tmap: Dict[int, PyTensor] = {}

        def ct(t: PyTensor) -> PyTensor:
            if id(t) not in tmap:
                tmap[id(t)] = t.clone()
            return tmap[id(t)]

        for n in self.nodes:
            m = PyNode(n.name, n.type, n.layer_id)
            m.params = OrderedDict(n.params)
            m.attrs = dict(n.attrs)
            m.source = n.source
            m.quantized = n.quantized
            m.additional = n.additional
            m.settings = n.settings
            m.inputs = [ct(t) for t in n.inputs]
            m.outputs = [ct(t) for t in n.outputs]
            for t in m.outputs:
                t.pnode = m
            m.constants = OrderedDict((k, ct(v)) for k, v in n.constants.items())
            m.placeholders = [ct(t) for t in n.placeholders]
            g.add_node(m)
        g.nx = self.nx.copy()
        for name in g.nx.nodes:
            g.nx.nodes[name]["node"] = g.node(name)
        self.wide_values.copy_to(g.wide_values, tmap)
        g.input_tensors = [tmap[id(t)] for t in self.input_tensors]
        g.output_tensors = [tmap[id(t)] for t in self.output_tensors]
        g._compute_last_use()
        return g

    def __deepcopy__(self, memo: Dict[int, Any]) -> PyGraph:
        """`copy.deepcopy` is `clone()`: the graph keys its execution plan by tensor identity and may share a
        memory-mapped weights file, neither of which a generic deep copy carries over."""
        copied = self.clone()
        memo[id(self)] = copied
        return copied

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {len(self.nodes)} layers)"


class QuantizeGraph(PyGraph):
    """The graph OptMaster works on: a float graph plus, once quantized, its integer copy `quantgraph`."""

    def __init__(self, name: str = "model") -> None:
        super().__init__(name)
        self.quantgraph: Optional[QuantizeGraph] = None

