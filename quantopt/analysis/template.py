"""The per-layer JSON template `<model>_opt_template.json` (docs/user-guide.md): every layer's editable settings
(the keys `opt_config` accepts) plus a read-only `just_for_display` section with real JSON values."""
from __future__ import annotations

import json
import math
from typing import Any, Dict, Optional, Sequence

import torch

from ..graph.graph import PyGraph
from ..graph.tables import TensorQuant, TensorRange
from ..graph.tensor import PyTensor
from ..ir.writer import atomic_write
from .similarity import LayerSimilarity


def _plain(v: Any) -> Any:
    """JSON-ready value: tensors become numbers or lists, non-finite floats become strings."""
    if isinstance(v, torch.Tensor):
        v = v.tolist() if v.numel() != 1 or v.dim() > 0 else v.item()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if hasattr(v, "value") and not isinstance(v, (int, float, str, bool)):
        return v.value
    return v


def tensor_info(t: PyTensor, params: TensorQuant, q_range: TensorRange,
                f_range: Optional[TensorRange]) -> Dict[str, Any]:
    """The quantization of the quantized tensor `t` (its params `params`) and the float range that decided it: its
    own calibrated range `q_range` (the quantized graph is made from the calibrated graph, after any global method),
    else the float tensor's."""
    ref = q_range if q_range.min is not None or f_range is None else f_range
    return {"scale": _plain(params.scale), "zerop": _plain(params.zerop), "qbits": params.qbits,
            "dtype": _plain(t.dtype), "qmin": params.qmin, "qmax": params.qmax, "fmin": _plain(ref.min),
            "fmax": _plain(ref.max), "qinvariant": bool(params.qinvariant)}


def build_template(float_graph: PyGraph, quant_graph: PyGraph,
                   similarities: Sequence[LayerSimilarity] = ()) -> Dict[str, Any]:
    """Layer name -> settings (editable) + layer_id/layer_type and display info (ignored when loaded back)."""
    sims = {(s.name, s.tensor): s for s in similarities}
    fnodes = {n.name: n for n in float_graph.nodes}
    out: Dict[str, Any] = {}
    for n in quant_graph.nodes:
        if n.additional:  # Quantize/DeQuantize/Cast inserted at float-island borders: derived, not editable
            continue
        fn = fnodes.get(n.name)
        entry: Dict[str, Any] = {"layer_id": n.layer_id, "layer_type": str(n.type)}
        if n.settings is not None:
            entry.update(n.settings.to_json())
        info = {}
        for i, t in enumerate(n.outputs):
            ft = fn.outputs[i] if fn is not None and i < len(fn.outputs) else None
            info[t.name] = tensor_info(t, quant_graph.quant.get(t), quant_graph.ranges.get(t),
                                       float_graph.ranges.get(ft) if ft is not None else None)
        display: Dict[str, Any] = {"quantization_info": info}
        similarity = {t.name: sims[(n.name, t.name)].as_dict() for t in n.outputs if (n.name, t.name) in sims}
        if similarity:
            display["similarity"] = {k: {kk: vv for kk, vv in v.items() if kk.endswith(("_cos", "_mse"))}
                                     for k, v in similarity.items()}
        entry["just_for_display"] = display
        out[n.name] = entry
    return out


def write_template(path: str, template: Dict[str, Any]) -> str:
    return atomic_write(path, (json.dumps(template, indent=2) + "\n").encode("utf-8"))
