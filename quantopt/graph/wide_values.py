"""Wide values: the float64 result a layer's float forward rounded a tensor's value from, kept for the layers that
read it unrounded (docs/architecture.md, "Float reference").

Why a side table of the graph, not a field of the tensor: only a graph's float forward writes and reads it
(`ops/_shared.py`, `keep_unrounded` and `unrounded_input`), and it must never be read with any value but the one it
was rounded from. An entry holds that value's identity (a weak reference to the torch tensor, and its in-place
version) and is returned only while the PyTensor's `betensor` is that very tensor, unwritten: a new value (the next
forward, fake quant, a float island, the isolated similarity run) or an in-place write invalidates it without the
tensor knowing, and the entry goes when that value or the tensor is freed. The executor drops the entry of each
intermediate it releases (`PyGraph.forward`), so wide values cost no memory beyond the values they belong to.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .tensor import PyTensor

_Entry = Tuple["weakref.ref[torch.Tensor]", int, torch.Tensor]


class WideValues:
    """A graph's wide values, by tensor: `keep` after assigning a rounded value, `get` while it is still current."""

    __slots__ = ("_entries", "__weakref__")

    def __init__(self) -> None:
        self._entries: weakref.WeakKeyDictionary[PyTensor, _Entry] = weakref.WeakKeyDictionary()

    def keep(self, t: PyTensor, wide: Optional[torch.Tensor]) -> None:
        """`wide` as the value `t.betensor` (as it is now) was rounded from; None drops `t`'s entry."""
        if wide is None:
            self._entries.pop(t, None)
            return
        value = t.betensor
        self._entries[t] = (weakref.ref(value, _forget(self, t)), value._version, wide)

    def get(self, t: PyTensor) -> Optional[torch.Tensor]:
        """The wide value of `t`'s current value, None when there is none (or `t.betensor` has changed since)."""
        entry = self._entries.get(t)
        if entry is None:
            return None
        ref, version, wide = entry
        value = t.betensor
        if ref() is not value or value._version != version:
            return None
        return wide

    def drop(self, t: PyTensor) -> None:
        """Forget `t`'s wide value (the executor, when it releases `t`)."""
        self._entries.pop(t, None)

    def copy_to(self, other: WideValues, tensors: Dict[int, PyTensor]) -> None:
        """Give each tensor's clone (`tensors`: id of the original -> clone, as `PyGraph.clone` maps them) the
        current wide value of the original, as the value of the clone's own `betensor`."""
        for t in list(self._entries):
            wide = self.get(t)
            clone = tensors.get(id(t))
            if wide is not None and clone is not None:
                other.keep(clone, wide)

    def __len__(self) -> int:
        return len(self._entries)


def _forget(table: WideValues, t: PyTensor) -> Callable[[Any], None]:
    """The callback dropping `t`'s entry once the value it was kept with is freed (unless replaced since); it holds
    neither the table nor the tensor."""
    owner, key = weakref.ref(table), weakref.ref(t)

    def forget(ref: Any) -> None:
        live, tensor = owner(), key()
        if live is not None and tensor is not None:
            entry = live._entries.get(tensor)
            if entry is not None and entry[0] is ref:
                del live._entries[tensor]

    return forget


def wide_values_of(node: Any) -> Optional[WideValues]:
    """The wide values of the graph `node` runs in; None for a layer run outside a graph (a copy measured alone),
    which keeps and reads none."""
    return getattr(getattr(node, "graph", None), "wide_values", None)
