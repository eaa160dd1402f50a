"""Value kinds of the graph-pass cfg fields (docs/user-guide.md, "Graph passes"). Torch-free, like kinds.py."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Tuple

from .kinds import ValueKind

_GROUP = re.compile(r"\s*\[\s*([+-]?\d+)\s*((?:,\s*[+-]?\d+(?:\.\d*)?\s*)*)\]\s*")


@dataclass(frozen=True, repr=False)
class TuneOpValue:
    """`[quant_method, p1, ...][approx_method, q1, ...]...`: bracket groups of numbers, the first of each an
    integer (a method), the rest its parameters. `extra` is the first group, `approx` the numbers of all the
    others, flattened (as upstream reads a value); `groups` keeps them apart (BasicLSTM takes one pair per gate)."""

    groups: Tuple[Tuple[float, ...], ...]

    @property
    def extra(self) -> Tuple[float, ...]:
        return self.groups[0]

    @property
    def approx(self) -> Tuple[float, ...]:
        return tuple(v for g in self.groups[1:] for v in g)

    def __str__(self) -> str:
        return "".join("[" + ",".join(f"{v:g}" for v in g) + "]" for g in self.groups)

    __repr__ = __str__  # `quantopt --field` and the run log print the value as a cfg writes it


def parse_tune_op(text: str) -> TuneOpValue:
    """Parse `[m, p...][m, p...]...`; ValueError when the text is anything else."""
    t = str(text).strip()
    groups = []
    pos = 0
    while pos < len(t):
        m = _GROUP.match(t, pos)
        if m is None:
            raise ValueError("expected bracket groups like [0][0] or [1,1][0]")
        rest = [float(v) for v in m.group(2).replace(" ", "").split(",") if v]
        groups.append((float(int(m.group(1))),) + tuple(rest))
        pos = m.end()
    if not groups:
        raise ValueError("expected bracket groups like [0][0] or [1,1][0]")
    return TuneOpValue(tuple(groups))


class TuneOpKind(ValueKind):
    """`enable_pass_tune_op_softmax` / `enable_pass_tune_op_complicated_activations` values."""

    def parse(self, text: str) -> TuneOpValue:
        return parse_tune_op(text)

    def allowed(self) -> str:
        return "bracket groups [quant_method, params...][approx_method, params...], e.g. [0][0] or [1,1][0]"


__all__ = ["TuneOpKind", "TuneOpValue", "parse_tune_op"]
