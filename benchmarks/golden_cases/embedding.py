"""One-operator golden cases of EmbeddingLookupSparse (docs/semantics/embedding.md): an embedding table and per-id
weights fed as model inputs (reshaped), segment ids and ids as integer constants; combiners MEAN, SUM and SQRTN."""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np

from golden_cases import IrCase
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph

SAMPLES = 8
SEGMENTS = [0, 0, 1, 2, 2, 2, 3, 3]
IDS = [5, 1, 0, 3, 3, 2, 4, 1]


def _const(b: GraphBuilder, name: str, values: list) -> str:
    """An index tensor as a float constant holding integers (both tools make it an integer tensor)."""
    data = np.array(values, dtype=np.float32)
    return b.layer("Constant", [], [list(data.shape)], name=name, constants={"weights": data})


def _case(combiner: str) -> Callable[[], PyGraph]:
    def build() -> PyGraph:
        b = GraphBuilder("case")
        table = b.layer("Reshape", [b.input("x", [1, 24])], [[6, 4]], name="table", params={"shape": [6, 4]})
        weights = b.layer("Reshape", [b.input("w", [1, 8])], [[8]], name="flat_w", params={"shape": [8]})
        y = b.layer("EmbeddingLookupSparse", [table, _const(b, "segments", SEGMENTS), _const(b, "ids", IDS), weights],
                    [[4, 4]], name="embeddinglookupsparse", params={"combiner": combiner, "max_norm": "NONE"})
        return b.build([y])
    return build


def _sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    return {"x": rng.normal(0.2, 1.0, size=(SAMPLES, 24)).astype(np.float32),
            "w": rng.uniform(0.2, 1.5, size=(SAMPLES, 8)).astype(np.float32)}


CASES: Dict[str, IrCase] = {
    "op_embeddinglookupsparse": IrCase(_case("MEAN"), _sample),
    "op_embeddinglookupsparse_sum": IrCase(_case("SUM"), _sample),
    "op_embeddinglookupsparse_sqrtn": IrCase(_case("SQRTN"), _sample),
}
"""Folder name -> case (benchmarks/golden_cases/__init__.py)."""
