"""Fresh layer and tensor names for the layers passes insert."""
from __future__ import annotations

from typing import Set


def unique_name(name: str, taken: Set[str]) -> str:
    """`name` itself, else `name_1`, `name_2`, ... (the first not in `taken`), added to `taken`: inserted layers
    and tensors never collide with the graph's own names."""
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate
