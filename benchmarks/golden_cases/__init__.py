"""One-operator golden cases whose float IR quantopt writes itself (operators with no ONNX form the upstream Parser
turns into them: decoders, detection post-processing, colour conversion, ...). `make_golden_corpus.py` gathers
every module of this package: each defines `CASES: Dict[str, IrCase]` (folder name -> case), and the corpus gets
the same layout as for an ONNX model, the float IR written by quantopt's IR writer instead of the Parser
(upstream's optimizer reads it: docs/onnx.md, "Interchange with upstream")."""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Dict, Sequence

import numpy as np

from quantopt.graph.graph import PyGraph

Sampler = Callable[[np.random.Generator], Dict[str, np.ndarray]]


@dataclass
class IrCase:
    """A float graph built with `quantopt.graph.builder.GraphBuilder` (batch 1 shapes) and its calibration data:
    `sample(rng)` returns the corpus' 8 samples per input (first axis), keyed by input tensor name, in the graph's
    input order. `cfg_lines` are added to every variant's cfg (a graph pass or field the case is about)."""

    build: Callable[[], PyGraph]
    sample: Sampler
    cfg_lines: Sequence[str] = ()


def ir_cases() -> Dict[str, IrCase]:
    """Every case of every module of this package; a name defined twice is an error."""
    found: Dict[str, IrCase] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, case in getattr(module, "CASES", {}).items():
            if name in found:
                raise ValueError(f"golden case '{name}' is defined twice (second time in {info.name})")
            found[name] = case
    return found
