"""Side tables of a graph: per-tensor state of the calibration stage kept out of `PyTensor`, keyed by tensor name.

Tensor names are unique in a graph (outputs, weight constants and placeholders) and survive `PyGraph.clone`, so a
table keyed by name follows its graph through clones. The statistics pass (calibration/collect.py) and the statistic
file (calibration/statistic_file.py) fill `PyGraph.statistics`; calibration, the passes and the ops' quantize
functions read it. The calibrated ranges live the same way in `PyGraph.ranges` (a `RangeTable` of `TensorRange`),
filled by local calibration and edited by the global methods, the passes and the quantize functions
(docs/architecture.md, "What a tensor holds, and the side tables").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Generic, Iterable, Optional, TypeVar, Union

import torch

if TYPE_CHECKING:
    from .node import PyNode
    from .tensor import PyTensor


@dataclass
class TensorStatistics:
    """Statistics slots filled by the statistics pass (per tensor, and per channel along `key_axis`)."""

    extrema_min: Optional[torch.Tensor] = None
    extrema_max: Optional[torch.Tensor] = None
    running_min: Optional[torch.Tensor] = None
    running_max: Optional[torch.Tensor] = None
    running_mean: Optional[torch.Tensor] = None
    running_std: Optional[torch.Tensor] = None
    running_mad: Optional[torch.Tensor] = None
    running_histc: Optional[torch.Tensor] = None
    extrema_min_key_axis: Optional[torch.Tensor] = None
    extrema_max_key_axis: Optional[torch.Tensor] = None
    running_min_key_axis: Optional[torch.Tensor] = None
    running_max_key_axis: Optional[torch.Tensor] = None
    running_mean_key_axis: Optional[torch.Tensor] = None
    running_std_key_axis: Optional[torch.Tensor] = None
    running_mad_key_axis: Optional[torch.Tensor] = None
    running_histc_key_axis: Optional[torch.Tensor] = None
    # mask values (|x| >= the inf-mask threshold, ±inf included) left out of every statistic above: how many were
    # seen below -threshold / above +threshold (0-d float64 counts; None: none seen). calibration/statistics.py
    inf_mask_low: Optional[torch.Tensor] = None
    inf_mask_high: Optional[torch.Tensor] = None
    # the mask threshold of a tensor on a finite-mask chain (calibration/finite_mask.py; 0-d float64), None: 1e30
    inf_mask_threshold: Optional[torch.Tensor] = None
    batches: int = 0

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0 if name == "batches" else None)


TensorKey = Union[str, "PyTensor"]
"""A tensor, or its name."""


def _name(t: TensorKey) -> str:
    return t if isinstance(t, str) else t.name


Entry = TypeVar("Entry")


class _EntryTable(Generic[Entry]):
    """Tensor name -> one entry per tensor: the lookups the statistics and quantization tables share."""

    _new_entry: Callable[[], Entry]
    """Makes the entry `of` creates for a tensor that has none."""

    def __init__(self, entries: Optional[Dict[str, Entry]] = None) -> None:
        self._entries: Dict[str, Entry] = dict(entries or {})

    def of(self, t: TensorKey) -> Entry:
        """The entry of `t` to fill in place, created with the defaults when it has none."""
        name = _name(t)
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = self._new_entry()
        return entry

    def set(self, t: TensorKey, entry: Entry) -> None:
        self._entries[_name(t)] = entry

    def __contains__(self, t: TensorKey) -> bool:
        return _name(t) in self._entries

    def __len__(self) -> int:
        return len(self._entries)


class StatisticsTable(_EntryTable[TensorStatistics]):
    """Tensor name -> TensorStatistics of one graph.

    `of` gives the entry to fill in place (creating an empty one), `get` the entry to read (an unstored empty one
    when the tensor has none), `set` replaces an entry. Statistics are read-only once collected, so copies of the
    table (`copy`: graph clones, detached layer copies) share the entries; replacing an entry in one copy leaves the
    others as they were.
    """

    _new_entry = TensorStatistics

    def get(self, t: TensorKey) -> TensorStatistics:
        """The entry of `t`; an empty TensorStatistics, not stored, when it has none."""
        entry = self._entries.get(_name(t))
        return entry if entry is not None else TensorStatistics()

    def copy(self, names: Optional[Iterable[str]] = None) -> StatisticsTable:
        """A new table sharing the entries (of `names` only, when given)."""
        if names is None:
            return StatisticsTable(self._entries)
        return StatisticsTable({n: self._entries[n] for n in names if n in self._entries})


Bound = Union[float, torch.Tensor]


@dataclass(frozen=True)
class TensorRange:
    """A calibrated range: per tensor (`axis` None; floats or 0-d tensors) or per channel along `axis` (1-d tensors).
    `min`/`max` None: not calibrated."""

    min: Optional[Bound] = None
    max: Optional[Bound] = None
    axis: Optional[int] = None


def _cloned(r: TensorRange) -> TensorRange:
    def c(v: Optional[Bound]) -> Optional[Bound]:
        return v.clone() if isinstance(v, torch.Tensor) else v
    return TensorRange(c(r.min), c(r.max), r.axis)


class RangeTable:
    """Tensor name -> calibrated ranges of one graph: a per-tensor entry and a per-channel one per name (weights have
    both, calibrated separately).

    `get(t)` is the per-tensor range, `channels(t)` the per-channel one (an empty TensorRange when there is none);
    `set`/`set_channels` replace them. Ranges are edited on copies (global methods' candidates, the quantized copy),
    so `copy` gives a table of its own with the values cloned, as tensor clones cloned them before.
    """

    def __init__(self) -> None:
        self._tensor: Dict[str, TensorRange] = {}
        self._channel: Dict[str, TensorRange] = {}

    def get(self, t: TensorKey) -> TensorRange:
        """The per-tensor range of `t` (an empty TensorRange when it has none)."""
        return self._tensor.get(_name(t), _EMPTY)

    def channels(self, t: TensorKey) -> TensorRange:
        """The per-channel range of `t` (an empty TensorRange when it has none)."""
        return self._channel.get(_name(t), _EMPTY_CHANNELS)

    def set(self, t: TensorKey, lo: Optional[Bound], hi: Optional[Bound]) -> None:
        """Give `t` the per-tensor range [lo, hi]."""
        self._tensor[_name(t)] = TensorRange(lo, hi)

    def set_channels(self, t: TensorKey, lo: Optional[Bound], hi: Optional[Bound], axis: int = 0) -> None:
        """Give `t` the per-channel range [lo, hi] along `axis`."""
        self._channel[_name(t)] = TensorRange(lo, hi, axis)

    def __contains__(self, t: TensorKey) -> bool:
        return _name(t) in self._tensor or _name(t) in self._channel

    def __len__(self) -> int:
        return len(set(self._tensor) | set(self._channel))

    def copy_from(self, source: RangeTable, src: TensorKey, dst: Optional[TensorKey] = None) -> None:
        """Copy `src`'s entries of `source` (values cloned) to `dst` (default: the same name) of this table."""
        s, d = _name(src), _name(dst if dst is not None else src)
        for mine, theirs in ((self._tensor, source._tensor), (self._channel, source._channel)):
            if s in theirs:
                mine[d] = _cloned(theirs[s])
            else:
                mine.pop(d, None)

    def copy(self, names: Optional[Iterable[str]] = None) -> RangeTable:
        """A new table with the entries (of `names` only, when given), values cloned."""
        table = RangeTable()
        keep = None if names is None else set(names)
        for mine, theirs in ((table._tensor, self._tensor), (table._channel, self._channel)):
            for n, r in theirs.items():
                if keep is None or n in keep:
                    mine[n] = _cloned(r)
        return table


_EMPTY = TensorRange()
_EMPTY_CHANNELS = TensorRange(axis=0)


Scale = Union[float, torch.Tensor]
ZeroPoint = Union[int, torch.Tensor]


@dataclass
class TensorQuant:
    """The quantization parameters of one tensor, OPT convention: q = round(x * scale - zerop), x = (q + zerop) /
    scale, q in [qmin, qmax].

    Per tensor (`axis` None) `scale`/`zerop` are a float and an int; per channel they are 1-d tensors along `axis`
    (weights: the output-channel axis 0; activations: the last axis). `qinvariant`: the tensor holds integers used as
    they are (indices, counts; scale 1, zero point 0). `qbits` None: the tensor is not quantized.
    """

    scale: Scale = 1.0
    zerop: ZeroPoint = 0
    qbits: Optional[int] = None
    qmin: Optional[int] = None
    qmax: Optional[int] = None
    qinvariant: bool = False
    axis: Optional[int] = None

    @property
    def per_channel(self) -> bool:
        """One scale per channel (a tensor of more than one element)."""
        return isinstance(self.scale, torch.Tensor) and self.scale.numel() > 1

    def copy(self) -> TensorQuant:
        """A copy whose scale and zero point tensors are clones (the copy can be edited on its own)."""
        return TensorQuant(_clone(self.scale), _clone(self.zerop), self.qbits, self.qmin, self.qmax, self.qinvariant,
                           self.axis)


def _clone(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


class _Unquantized(TensorQuant):
    """What `QuantTable.get` gives for a tensor without parameters: the defaults, read-only, so that a write meant
    for the table (`QuantTable.of`) cannot land on an unstored object."""

    def __setattr__(self, key: str, value: Any) -> None:
        if getattr(self, "_sealed", False):
            raise AttributeError(f"parameters read with QuantTable.get cannot be set ('{key}'); use QuantTable.of")
        object.__setattr__(self, key, value)


_UNQUANTIZED = _Unquantized()
object.__setattr__(_UNQUANTIZED, "_sealed", True)


class QuantTable(_EntryTable[TensorQuant]):
    """Tensor name -> TensorQuant of one graph.

    `get(t)` is the parameters to read (read-only defaults when `t` has none), `of(t)` the entry to fill in place
    (created with the defaults), `set` replaces an entry. Parameters are edited on copies (the global methods'
    candidates, the mixed-precision search), so `copy` gives a table of its own with the values cloned.
    """

    _new_entry = TensorQuant

    def get(self, t: TensorKey) -> TensorQuant:
        """The parameters of `t` (the read-only defaults, scale 1 and not quantized, when it has none)."""
        return self._entries.get(_name(t), _UNQUANTIZED)

    def drop(self, t: TensorKey) -> None:
        """Forget the parameters of `t` (it is float again)."""
        self._entries.pop(_name(t), None)

    def copy_from(self, source: QuantTable, src: TensorKey, dst: Optional[TensorKey] = None) -> None:
        """Copy `src`'s entry of `source` (values cloned) to `dst` (default: the same name) of this table."""
        entry = source._entries.get(_name(src))
        if entry is None:
            self.drop(dst if dst is not None else src)
        else:
            self._entries[_name(dst if dst is not None else src)] = entry.copy()

    def copy(self, names: Optional[Iterable[str]] = None) -> QuantTable:
        """A new table with the entries (of `names` only, when given), values cloned."""
        table = QuantTable()
        keep = None if names is None else set(names)
        table._entries = {n: q.copy() for n, q in self._entries.items() if keep is None or n in keep}
        return table


def node_tensors(node: PyNode) -> Iterable[PyTensor]:
    """Every tensor a layer names: inputs, outputs, constants and placeholders."""
    yield from node.inputs
    yield from node.outputs
    yield from node.constants.values()
    yield from node.placeholders


def _table_of(node: PyNode, name: str, empty: Callable[[], Any]) -> Any:
    """The side table `name` a layer's tensors are looked up in: its graph's (`graph.<name>`); otherwise the layer's
    own (`node.detached_<name>`: a detached copy's, or an empty one created here for a layer built on its own)."""
    graph = node.graph
    if graph is not None:
        return getattr(graph, name)
    own = getattr(node, "detached_" + name)
    if own is None:
        own = empty()
        setattr(node, "detached_" + name, own)
    return own


def statistics_of(node: PyNode) -> StatisticsTable:
    """The statistics table a layer's tensors are looked up in (`_table_of`)."""
    return _table_of(node, "statistics", StatisticsTable)


def detached_statistics(source: PyNode, copy: PyNode) -> StatisticsTable:
    """The table of a layer copied out of its graph (`PyNode.detached_copy`, tuning's `clone_nodes`): the source
    layer's entries for the copy's tensor names, shared, as tensor clones shared their statistics objects."""
    return statistics_of(source).copy(t.name for t in node_tensors(copy))


def ranges_of(node: PyNode) -> RangeTable:
    """The range table a layer's tensors are looked up in (`_table_of`)."""
    return _table_of(node, "ranges", RangeTable)


def detached_ranges(source: PyNode, copy: PyNode, input_ranges: Optional[RangeTable] = None) -> RangeTable:
    """The range table of a layer copied out of its graph: the source layer's entries for the copy's tensor names,
    cloned (ranges are edited on copies); the inputs' from `input_ranges` when given (the quantized graph's, whose
    input tensors the copy cloned)."""
    table = ranges_of(source).copy(t.name for t in node_tensors(copy))
    if input_ranges is not None:
        for t in copy.inputs:
            table.copy_from(input_ranges, t)
    return table


def quant_of(node: PyNode) -> QuantTable:
    """The table of quantization parameters a layer's tensors are looked up in (`_table_of`)."""
    return _table_of(node, "quant", QuantTable)


def detached_quant(source: PyNode, copy: PyNode, input_quant: Optional[QuantTable] = None) -> QuantTable:
    """The parameter table of a layer copied out of its graph: the source layer's entries for the copy's tensor
    names, cloned; the inputs' from `input_quant` when given (the table of the graph whose input tensors the copy
    cloned)."""
    table = quant_of(source).copy(t.name for t in node_tensors(copy))
    if input_quant is not None:
        for t in copy.inputs:
            table.copy_from(input_quant, t)
    return table


__all__ = ["QuantTable", "RangeTable", "StatisticsTable", "TensorQuant", "TensorRange", "TensorStatistics",
           "detached_quant", "detached_ranges", "detached_statistics", "node_tensors", "quant_of", "ranges_of",
           "statistics_of"]
