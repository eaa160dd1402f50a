"""Benchmark: the mixed-precision search's two rankings on PP-OCRv4 rec (docs/mixed-precision.md).

    python benchmarks/mixed_precision_rec.py [--threshold 0.05] [--calib 16] [--lines 4] [--weight-bits 6]

The recognizer of rapidocr_onnxruntime (the accuracy benchmark's rec task, benchmarks/accuracy/models.py: rendered
text lines, same seeds) is imported, given per-channel weights of `--weight-bits` bits, and its statistics are
collected once on `--calib` lines. The score is the mean output cosine against float on `--lines` other lines.
Both searches (`mixed_precision_ranking = probe` and `= similarity`) start from the same statistics; the script
prints, per ranking, the promoted layer count, the score reached, the evaluations and the CPU seconds (one thread).
Needs the accuracy benchmark's extras (benchmarks/requirements.txt).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "accuracy"))

import common  # noqa: E402  (benchmarks/accuracy)
import models  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _bench_common import DEFAULT_CACHE  # noqa: E402

from quantopt.analysis.similarity import cosine, layer_similarity, to_float  # noqa: E402
from quantopt.calibration.collect import calibrate_graph  # noqa: E402
from quantopt.config.kinds_accuracy import AutoSearch  # noqa: E402
from quantopt.pipeline import collect_statistics, finish_settings, graph_passes, settings_from_arguments  # noqa: E402
from quantopt.quantizer import quantize_graph  # noqa: E402
from quantopt.tuning.mixed_precision import candidate_layers, per_layer_search  # noqa: E402


def prepared(task, weight_bits: int):
    graph = common.import_quantopt(task)
    graph_passes(graph)
    settings_from_arguments(graph, {"q_mode_weight": "per_channel_symmetric_restricted_range",
                                    "q_bits_weight": weight_bits})
    finish_settings(graph)
    collect_statistics(graph, [common._batch(graph, f) for f in task.calib])
    return graph


def similarity_ranking(graph, batches: List[List[torch.Tensor]]) -> Dict[str, float]:
    calibrate_graph(graph)
    ranking: Dict[str, float] = {}
    for r in layer_similarity(graph, quantize_graph(graph), batches):
        ranking[r.name] = max(ranking.get(r.name, 0.0), 1.0 - r.isolated_cos)
    return ranking


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--threshold", type=float, default=0.05, help="allowed drop of the score (L mode)")
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--lines", type=int, default=4)
    ap.add_argument("--weight-bits", type=int, default=6)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        task = models.rec_task(args.calib, args.lines, 0, Path(DEFAULT_CACHE))
    except common.Unavailable as e:
        print(f"skipped: {e}")
        return 0
    auto = AutoSearch(args.lines, args.threshold, "L")
    print(f"PP-OCRv4 rec, {args.weight_bits}-bit per-channel weights, {args.calib} calibration lines, score = mean "
          f"output cosine on {args.lines} lines, allowed drop {args.threshold}")
    for ranking_name in ("probe", "similarity"):
        graph = prepared(task, args.weight_bits)
        batches = [common._batch(graph, f) for f in task.eval]
        refs = [graph.forward(b)[0].clone() for b in batches]

        def score(qgraph, batches=batches, refs=refs) -> float:
            values = []
            for b, ref in zip(batches, refs):
                qgraph.forward(b)
                values.append(cosine(ref, to_float(qgraph.output_tensors[0])))
            return float(np.mean(values))

        start = time.process_time()
        ranking = similarity_ranking(graph, batches) if ranking_name == "similarity" else None
        result = per_layer_search(graph, score, 1.0, auto, ranking=ranking)
        seconds = time.process_time() - start
        print(f"{ranking_name:<11} {len(candidate_layers(graph))} candidates: {len(result.promoted)} promoted, score "
              f"{result.final_score:.4f} (configured {result.base_score:.4f}), {result.evaluations} evaluations, "
              f"{seconds:.0f} s CPU, reached {result.reached}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
