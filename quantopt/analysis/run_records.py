"""What a run leaves for later inspection besides the report: the precision analysis written into the quantized IR
(`write_similarity_to_ir`) and a record appended per run (`record_debug_acc_info`)."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Mapping, Sequence

from ..graph.graph import PyGraph
from .similarity import LayerSimilarity

RECORD_FIELDS = ("quantize_method_for_weight", "quantize_method_for_activation", "calibration_strategy_for_weight",
                 "calibration_strategy_for_activation", "running_statistic_momentum", "calibration_batch_size",
                 "activation_bits", "weight_bits", "bias_bits", "lut_items_in_bits", "preset", "global_calibration")
"""The cfg fields a record repeats (per-layer fields as their global value)."""


def _number(v: float) -> str:
    return "nan" if v != v else repr(float(v))


def similarity_keys(qgraph: PyGraph, similarities: Sequence[LayerSimilarity]) -> int:
    """Write D_cos / D_mse (each output's cumulative cosine and MSE against the float model, comma-separated in
    output order, `nan` where the analysis has none), D_dynamic_shape (the outputs' shapes) and D_layer_id on every
    layer of `qgraph`, the keys upstream's tools write for IR viewers. Returns the number of layers annotated."""
    by_tensor: Dict[tuple, LayerSimilarity] = {(s.name, s.tensor): s for s in similarities}
    count = 0
    for n in qgraph.nodes:
        found = [by_tensor.get((n.name, t.name)) for t in n.outputs]
        n.params["D_cos"] = ",".join(_number(s.cumulative_cos) if s else "nan" for s in found)
        n.params["D_mse"] = ",".join(_number(s.cumulative_mse) if s else "nan" for s in found)
        n.params["D_dynamic_shape"] = [[int(d) for d in t.ir_shape] for t in n.outputs]
        n.params["D_layer_id"] = int(n.layer_id)
        count += 1
    return count


def _plain(value: Any) -> Any:
    """A field's value as the cfg would write it (a per-layer field with its rules, `global & <sel:value>`)."""
    if getattr(value, "rules", None) == [] and hasattr(value, "global_value"):  # a per-layer field without rules
        value = value.global_value
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


def append_accuracy_record(path: str, cfg: Any, report: Mapping[str, Any],
                           similarities: Sequence[LayerSimilarity]) -> str:
    """Append one run to `path`: a line with the local time, then one JSON line with the model, the main fields,
    the metrics and the cumulative similarity of each model output. Returns the path."""
    outputs = set(report.get("outputs", []))
    output_similarity: List[Dict[str, Any]] = [
        {"tensor": s.tensor, "cosine": s.cumulative_cos, "mse": s.cumulative_mse}
        for s in similarities if s.tensor in outputs]
    record = {
        "model": report.get("model"),
        "fields": {name: _plain(getattr(cfg, name)) for name in RECORD_FIELDS},
        "float_metrics": dict(report.get("float_metrics", {})),
        "quant_metrics": dict(report.get("quant_metrics", {})),
        "outputs": output_similarity,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()) + "\n")
        fh.write(json.dumps(record, allow_nan=True) + "\n")
    return path
