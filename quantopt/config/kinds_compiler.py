"""Value kinds of the cfg fields that steer upstream's NPU compiler and library (docs/user-guide.md, "Compiler and
library fields"): dynamic-shape keys and feature-map tiling. Torch-free, like kinds.py."""
from __future__ import annotations

import re
from typing import List, Tuple, Union

from .kinds import ValueKind


class DsFlags(tuple):
    """One 0/1 flag per output of a layer, printed as a cfg writes it ([1,0])."""

    def __repr__(self) -> str:
        return "[" + ",".join(str(v) for v in self) + "]"

    __str__ = __repr__


DsShapeValue = Union[str, DsFlags]
"""`disable`, `all`, or one 0/1 flag per output of a layer."""

_FLAGS = re.compile(r"\[\s*[01]\s*(?:,\s*[01]\s*)*\]")
_TILE = re.compile(r"\(\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\)")
_TILES = re.compile(r"\[\s*(?:\(\s*\d+\s*,\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\)\s*,?\s*)+\]")


class DsShapeConstantKind(ValueKind):
    """`ds_output_shape_constant`: disable, all, or [f0,f1,...] with one 0/1 flag per output."""

    def parse(self, text: str) -> DsShapeValue:
        t = text.strip()
        if t.lower() in ("disable", "all"):
            return t.lower()
        if _FLAGS.fullmatch(t):
            return DsFlags(int(v) for v in t.strip("[]").replace(" ", "").split(","))
        raise ValueError("expected disable, all or a list of 0/1 flags like [1,0]")

    def allowed(self) -> str:
        return "disable, all, or one 0/1 flag per output of the layer, e.g. [1,1,0]"


class TilingParamKind(ValueKind):
    """`featuremap_tiling_param`: empty, or [(i,j,h,w),...] (layer-id range i..j split into h x w parts)."""

    def parse(self, text: str) -> List[Tuple[int, int, int, int]]:
        t = text.strip()
        if not t:
            return []
        if not _TILES.fullmatch(t):
            raise ValueError("expected a list of (i,j,h,w) tuples of unsigned integers")
        return [tuple(int(v) for v in m.groups()) for m in _TILE.finditer(t)]  # type: ignore[misc]

    def allowed(self) -> str:
        return "empty, or [(i,j,h,w),...]: layer ids i..j of the float IR tiled into h x w parts"
