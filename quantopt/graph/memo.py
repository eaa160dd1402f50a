"""Per-layer memos of what a forward derives from a layer's params, constants and quantization params.

Why: on small inputs, re-deriving such values on every forward (requantization factors, window counts, lookup
tables, validated geometry) costs more than the arithmetic itself (docs/performance.md, "Small models"). A memo
lives in `node.attrs` under a private key (`_memo_<name>`: never written to the IR, and not copied by
`PyNode.detached_copy`) together with the key it was built from, and is rebuilt whenever a new key differs. A key
must name everything the memoized value depends on: tensors enter it by identity and version
(`torch.Tensor._version` counts in-place writes), so assigning a new constant, writing into one, or changing a
param or a quantization param invalidates the memo, and the value is always the one a fresh computation gives.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, TypeVar

import numpy as np
import torch

from .tables import QuantTable, quant_of

T = TypeVar("T")


class Same:
    """A tensor in a memo key: equal to another `Same` of the very same tensor object at the same version."""

    __slots__ = ("obj", "version")

    def __init__(self, obj: torch.Tensor) -> None:
        self.obj = obj
        self.version = obj._version

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj and other.version == self.version

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = None  # type: ignore[assignment]


class SameValues:
    """A tensor in a cache key: equal to a `SameValues` of any tensor that views the same memory the same way
    (address, shape, strides, dtype) at the same version, such as another reshape of a constant each forward makes.
    It holds its tensor, so that memory cannot be freed and reused by another tensor while the key lives."""

    __slots__ = ("obj", "version")

    def __init__(self, obj: torch.Tensor) -> None:
        self.obj = obj
        self.version = obj._version

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SameValues):
            return False
        a, b = self.obj, other.obj
        return a is b and self.version == other.version or (
            a.data_ptr() == b.data_ptr() and a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and self.version == other.version)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = None  # type: ignore[assignment]


_PLAIN = (int, float, str, bool, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)


def freeze(value: Any) -> Any:
    """`value` as a memo key part: tensors as `Same`, containers as tuples of frozen items, the rest as is."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, torch.Tensor):
        return Same(value)
    if isinstance(value, (list, tuple)):
        if _PLAIN_TYPES.issuperset(map(type, value)):  # a flat list of plain values (most params): no recursion
            return (type(value).__name__, *value)
        return (type(value).__name__, *(freeze(v) for v in value))
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return ("dict", *((k, freeze(v)) for k, v in value.items()))
    return value


def qparams_key(table: QuantTable, t: Any) -> Tuple[Any, ...]:
    """Everything of a tensor's quantization that an integer forward reads (its parameters in `table`)."""
    q = table.get(t)
    return (t.dtype, q.qmin, q.qmax, q.qbits, q.qinvariant, q.axis, freeze(q.scale), freeze(q.zerop))


def layer_key(node: Any) -> Tuple[Any, ...]:
    """A layer's type, state, params, constants (by identity and version, with their dtypes and quantization) and
    its inputs' and outputs' quantization: what a layer-level memo depends on, short of the data."""
    params = [(k, v if type(v) in _PLAIN else freeze(v)) for k, v in node.params.items()]
    table = quant_of(node)  # the parameters live in the layer's graph's table (graph/tables.py)
    return (str(node.type), node.quantized, params,
            tuple((k, Same(c.betensor), qparams_key(table, c)) for k, c in node.constants.items()),
            tuple(qparams_key(table, t) for t in node.inputs), tuple(qparams_key(table, t) for t in node.outputs))


def memo(node: Any, name: str, key: Any, build: Callable[[], T]) -> T:
    """The value memoized on `node` under `name` for `key`, built (and kept) when there is none for that key."""
    slot = "_memo_" + name
    cached: Optional[Tuple[Any, Any]] = node.attrs.get(slot)
    if cached is not None and cached[0] == key:
        return cached[1]
    value = build()
    node.attrs[slot] = (key, value)
    return value
