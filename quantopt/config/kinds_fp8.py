"""Value kind of `activation_block_size` (fp8 activations, docs/low-bit.md)."""
from __future__ import annotations

import re

from .kinds import ValueKind

ACTIVATION_BLOCK_SIZE_DEFAULT = 256
"""Upstream's default; the only value with the meaning upstream gives the field (none: see below)."""


class ActivationBlockSizeKind(ValueKind):
    """`activation_block_size`: an unsigned integer, as upstream reads it. Upstream's optimizer stores the value on
    every layer and never reads it again (its activations, fp8 ones included, get one scale per tensor, and it
    refuses per-block activation modes), so a value other than the default could only be a user expecting per-block
    activations that neither tool quantizes: an error says so instead of quietly ignoring it."""

    def parse(self, text: str) -> int:
        t = text.strip()
        if not re.fullmatch(r"\d+", t):
            raise ValueError("not an unsigned integer")
        value = int(t)
        if value != ACTIVATION_BLOCK_SIZE_DEFAULT:
            raise ValueError(f"{value} would ask for per-block activation scales, which neither quantopt nor upstream "
                             "quantizes (activations, fp8 ones included, take one scale per tensor or per channel; "
                             "per-block scales are for weights: weight_block_size)")
        return value

    def allowed(self) -> str:
        return f"{ACTIVATION_BLOCK_SIZE_DEFAULT} (an unsigned integer that upstream reads and never uses)"
