"""The per-run report: `<model>_report.json` and a self-contained `<model>_report.html`.

Whether a quantized model is good enough is a judgement call; the report puts the evidence on one page: metrics
float/quantized/drop, the per-layer similarity chart (cumulative and isolated cosine), the worst layers, every
layer's bit widths and dtypes, float-vs-quantized value histograms of the worst layers, and the wall time of each
step. The HTML needs no network and no plotting library: its charts are inline SVG generated here, with stable
ids and classes (`#similarity-chart`, `.series-cumulative`, `.series-isolated`, `#bits-chart`, `#steps-chart`,
`svg.histogram`, `.hist-float`, `.hist-quant`) so that tests and users' scripts can find them.

Data flow: graphs → `layer_bits`, `histograms_of` (the first analysed batch) → `build_report` (a JSON-ready dict) →
`render_html` (a string) → `write_report` (both files, atomically). Everything after the graphs is a pure
function of its arguments, so the same run gives byte-identical files.
"""
from __future__ import annotations

import html
import json
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tables import TensorQuant, quant_of
from ..ir.writer import atomic_write
from ..threads import one_thread
from .similarity import LayerSimilarity, cosine, to_float

REPORT_FORMAT = "quantopt-report"
REPORT_VERSION = 1

# ---------------------------------------------------------------------------------------------------- data


def _num(v: Any, digits: int = 9) -> Optional[float]:
    """A JSON-safe float: rounded (stable text across platforms), non-finite values become null."""
    if v is None:
        return None
    f = float(v)
    if not math.isfinite(f):
        return None
    return float(f"{f:.{digits}g}")


def _dtype_name(d: Any) -> str:
    return str(getattr(d, "value", d))


def worst_layers(similarities: Sequence[LayerSimilarity], count: int = 10) -> List[LayerSimilarity]:
    """Layer outputs with the lowest isolated cosine (the layer's own error), ties by cumulative cosine."""
    def key(s: LayerSimilarity) -> Tuple[float, float, int]:
        iso = s.isolated_cos if math.isfinite(s.isolated_cos) else -math.inf
        cum = s.cumulative_cos if math.isfinite(s.cumulative_cos) else -math.inf
        return iso, cum, s.layer_id

    return sorted(similarities, key=key)[:count]


HISTOGRAM_LAYERS = 5
"""How many of the worst layers' outputs the report histograms."""


def worst_tensors(similarities: Sequence[LayerSimilarity], count: int = HISTOGRAM_LAYERS) -> List[str]:
    """Names of the output tensors of the `count` worst layers: what `collect_histograms` should look at."""
    return [s.tensor for s in worst_layers(similarities, count)]


def value_stats(x: torch.Tensor) -> Dict[str, Optional[float]]:
    """min/max/mean/std of a tensor in float64 (None for an empty tensor), summed on one thread
    (`threads.one_thread`: the same at any thread count)."""
    v = x.detach().reshape(-1).to(torch.float64)
    if v.numel() == 0:
        return {"min": None, "max": None, "mean": None, "std": None}
    with one_thread():
        return {"min": _num(v.min()), "max": _num(v.max()), "mean": _num(v.mean()),
                "std": _num(v.std(unbiased=False))}


def value_histogram(float_values: torch.Tensor, quant_values: torch.Tensor, bins: int = 48) -> Dict[str, Any]:
    """Histograms of a float tensor and its dequantized counterpart over one shared value range.

    The shared range makes clipping visible: quantized values piled in the edge bins while the float values run
    further out. Non-finite values are left out of the counts (and counted in `nonfinite`).
    """
    if bins < 1:
        raise ValueError(f"histogram needs at least one bin, got {bins}")
    f = float_values.detach().reshape(-1).to(torch.float64).cpu().numpy()
    q = quant_values.detach().reshape(-1).to(torch.float64).cpu().numpy()
    f_ok, q_ok = f[np.isfinite(f)], q[np.isfinite(q)]
    both = np.concatenate([f_ok, q_ok])
    lo, hi = (float(both.min()), float(both.max())) if both.size else (0.0, 0.0)
    if hi <= lo:  # one value: widen by enough to survive `_num`'s 9-digit rounding at any magnitude
        pad = max(0.5, abs(lo) * 1e-6)
        lo, hi = lo - pad, hi + pad
    fc, _ = np.histogram(f_ok, bins=bins, range=(lo, hi))
    qc, _ = np.histogram(q_ok, bins=bins, range=(lo, hi))
    same = f.shape == q.shape
    return {"bins": int(bins), "lo": _num(lo), "hi": _num(hi),
            "float_counts": [int(c) for c in fc], "quant_counts": [int(c) for c in qc],
            "float": value_stats(float_values), "quant": value_stats(quant_values),
            "cosine": _num(cosine(float_values, quant_values)) if same else None,
            "numel": int(f.size), "nonfinite": int(f.size - f_ok.size + q.size - q_ok.size)}


def collect_histograms(float_graph: PyGraph, quant_graph: PyGraph, inputs: Sequence[torch.Tensor],
                       tensors: Sequence[str], bins: int = 48) -> Dict[str, Dict[str, Any]]:
    """Run one batch through both graphs and histogram the named layer outputs (float vs dequantized).

    Only the named tensors are copied as the graphs run (no `keep_tensors`), so this costs one forward of each
    graph and the memory of a few tensors. Returns tensor name → `value_histogram` dict plus `layer`/`type`.
    A run that computed the per-layer similarity already has these values: `histograms_of` reads them.
    """
    wanted = set(tensors)
    if not wanted:
        return {}

    def grab(store: Dict[str, Tuple[PyNode, torch.Tensor]], quantized: bool):
        def hook(node: PyNode) -> None:
            for t in node.outputs:
                if t.name in wanted:
                    store[t.name] = (node, to_float(t, quant_of(node)).clone() if quantized
                                     else t.betensor.detach().clone())
        return hook

    fvals: Dict[str, Tuple[PyNode, torch.Tensor]] = {}
    qvals: Dict[str, Tuple[PyNode, torch.Tensor]] = {}
    with torch.no_grad():
        float_graph.forward(list(inputs), after_node=grab(fvals, False))
        quant_graph.forward(list(inputs), after_node=grab(qvals, True))
    values = {name: (fvals[name][0], fvals[name][1], qvals[name][1]) for name in fvals if name in qvals}
    return histograms_of(values, tensors, bins)


def histograms_of(values: Mapping[str, Tuple[PyNode, torch.Tensor, torch.Tensor]], tensors: Sequence[str],
                  bins: int = 48) -> Dict[str, Dict[str, Any]]:
    """Histograms of the named tensors from (float layer, float value, dequantized value) per tensor name, e.g.
    the first batch `analysis.similarity.layer_similarity` kept (no forward at all)."""
    out: Dict[str, Dict[str, Any]] = {}
    for name in tensors:
        if name not in values or name in out:
            continue
        node, fv, qv = values[name]
        h = {"layer": node.name, "type": str(node.type), "tensor": name}
        h.update(value_histogram(fv, qv, bins))
        out[name] = h
    return out


def _scale_summary(q: TensorQuant) -> Dict[str, Any]:
    scale = q.scale
    if isinstance(scale, torch.Tensor) and scale.numel() > 1:
        s = scale.detach().to(torch.float64)
        return {"per_channel": True, "scale_min": _num(s.min()), "scale_max": _num(s.max())}
    if isinstance(scale, torch.Tensor):
        scale = scale.item()
    return {"per_channel": False, "scale": _num(scale) if scale is not None else None}


def layer_bits(quant_graph: PyGraph) -> List[Dict[str, Any]]:
    """Per layer of the quantized graph: output and constant dtypes, bit widths and scale (range if per-channel)."""
    rows: List[Dict[str, Any]] = []
    for n in quant_graph.nodes:
        table = quant_of(n)
        outputs = []
        for t in n.outputs:
            q = table.get(t)
            entry = {"tensor": t.name, "dtype": _dtype_name(t.dtype), "qbits": q.qbits,
                     "qinvariant": bool(q.qinvariant)}
            entry.update(_scale_summary(q))
            outputs.append(entry)
        constants = {}
        for key, t in n.constants.items():
            q = table.get(t)
            entry = {"dtype": _dtype_name(t.dtype), "qbits": q.qbits}
            entry.update(_scale_summary(q))
            constants[key] = entry
        rows.append({"layer_id": n.layer_id, "name": n.name, "type": str(n.type), "outputs": outputs,
                     "constants": constants})
    return rows


def _sim_dict(s: LayerSimilarity) -> Dict[str, Any]:
    """Strict-JSON record of one layer output; a NaN/inf value becomes null, `note` says why."""
    note = s.note
    bad = [k for k in ("isolated_cos", "cumulative_cos") if not math.isfinite(getattr(s, k))]
    if bad and not note:
        note = f"{' and '.join(bad)} not finite"
    return {"layer_id": s.layer_id, "name": s.name, "type": s.type, "tensor": s.tensor,
            "cumulative_cos": _num(s.cumulative_cos), "cumulative_mse": _num(s.cumulative_mse),
            "isolated_cos": _num(s.isolated_cos), "isolated_mse": _num(s.isolated_mse), "note": note}


def build_report(summary: Mapping[str, Any], similarities: Sequence[LayerSimilarity] = (),
                 layers: Sequence[Mapping[str, Any]] = (), histograms: Optional[Mapping[str, Mapping]] = None,
                 worst_count: int = 10) -> Dict[str, Any]:
    """The report as a JSON-ready dict.

    `summary` is the run summary OptMaster builds (keys used when present: model, inputs, outputs, float_metrics,
    quant_metrics, steps as (name, seconds) pairs, wall_time, warnings, files); `similarities` come from
    `layer_similarity`, `layers` from `layer_bits`, `histograms` from `collect_histograms`.
    """
    fm = dict(summary.get("float_metrics") or {})
    qm = dict(summary.get("quant_metrics") or {})
    names = list(fm) + [k for k in qm if k not in fm]
    metrics = [{"name": k, "float": _num(fm.get(k)), "quant": _num(qm.get(k)),
                "drop": _num(fm[k] - qm[k]) if k in fm and k in qm else None} for k in names]
    worst = worst_layers(similarities, worst_count)
    hist = dict(histograms or {})
    order = [s.tensor for s in worst if s.tensor in hist] + sorted(k for k in hist if k not in
                                                                   {s.tensor for s in worst})
    steps = [{"name": str(name), "seconds": _num(sec, 6)} for name, sec in summary.get("steps", [])]
    extra: Dict[str, Any] = {"mixed_precision": _search_dict(summary["mixed_precision"])} \
        if summary.get("mixed_precision") else {}
    if summary.get("quantized_io"):
        extra["quantized_io"] = [dict(io) for io in summary["quantized_io"]]
    if summary.get("advice"):
        extra["advice"] = [dict(a) for a in summary["advice"]]
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "model": str(summary.get("model", "model")),
        "inputs": list(summary.get("inputs", [])),
        "outputs": list(summary.get("outputs", [])),
        "metrics": metrics,
        "similarity": [_sim_dict(s) for s in similarities],
        "worst_layers": [_sim_dict(s) for s in worst],
        "layers": [dict(r) for r in layers],
        "histograms": [dict(hist[k]) for k in order],
        "steps": steps,
        "wall_time": _num(summary.get("wall_time"), 6),
        "warnings": int(summary.get("warnings", 0) or 0),
        "files": [str(f) for f in summary.get("files", [])],
        **extra,
    }


def _cos_text(w: Mapping[str, Any], key: str) -> str:
    """A cosine cell: the value, or "NaN" where the similarity was not finite (JSON null)."""
    return "NaN" if w.get(key) is None else _fmt(w[key])


def _search_dict(search: Mapping[str, Any]) -> Dict[str, Any]:
    """The mixed-precision search record with strict-JSON numbers."""
    out = dict(search)
    for key in ("float_score", "base_score", "final_score"):
        out[key] = _num(out.get(key))
    out["sensitivity"] = {k: _num(v) for k, v in dict(out.get("sensitivity") or {}).items()}
    out["steps"] = [dict(s, score=_num(s.get("score")), drop=_num(s.get("drop"))) for s in out.get("steps", [])]
    return out


def report_json(report: Mapping[str, Any]) -> str:
    """The JSON text of a report (strict JSON: non-finite floats were already turned into null)."""
    return json.dumps(report, indent=2, allow_nan=False) + "\n"


def report_paths(output_dir: str, model: str) -> Tuple[str, str]:
    return (os.path.join(output_dir, f"{model}_report.json"), os.path.join(output_dir, f"{model}_report.html"))


def write_report(output_dir: str, report: Mapping[str, Any]) -> List[str]:
    """Write `<model>_report.json` and `<model>_report.html` atomically; returns both paths.

    The two files list themselves under `files`, so the report names everything the run wrote.
    """
    json_path, html_path = report_paths(output_dir, str(report.get("model", "model")))
    data = dict(report)
    data["files"] = list(report.get("files", [])) + [p for p in (json_path, html_path)
                                                     if p not in report.get("files", [])]
    atomic_write(json_path, report_json(data).encode("utf-8"))
    atomic_write(html_path, render_html(data).encode("utf-8"))
    return [json_path, html_path]


# ---------------------------------------------------------------------------------------------------- SVG

_W, _H = 920, 320
_M = {"l": 78, "r": 16, "t": 30, "b": 44}
COLORS = {"cumulative": "#1f77b4", "isolated": "#d62728", "float": "#1f77b4", "quant": "#ff7f0e",
          "act": "#2ca02c", "weight": "#9467bd", "step": "#1f77b4"}


def _e(s: Any) -> str:
    return html.escape(str(s), quote=True)


def _c(v: float) -> str:
    """Coordinate text: two decimals, no '-0.00'."""
    t = f"{v:.2f}"
    return "0.00" if t == "-0.00" else t


def _fmt(v: Optional[float], spec: str = ".6f") -> str:
    return "n/a" if v is None else format(v, spec)


def nice_ticks(lo: float, hi: float, count: int = 5) -> List[float]:
    """Round tick values covering [lo, hi] (1, 2, 5 × 10^k steps)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else [0.0]
    raw = (hi - lo) / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    k = 0
    while first + k * step <= hi + step * 1e-9:
        ticks.append(round(first + k * step, 12))
        k += 1
    return ticks


def _tick_label(v: float, ticks: Sequence[float]) -> str:
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else abs(v) or 1.0
    decimals = max(0, min(8, -int(math.floor(math.log10(step))) if step < 1 else 0))
    if abs(v) >= 1e5:
        return f"{v:.3g}"
    return f"{v:.{decimals}f}"


def _axes(ticks: Sequence[float], y_of, x0: float, x1: float, y_label: str) -> List[str]:
    parts = ['<g class="axis axis-y">']
    for t in ticks:
        y = y_of(t)
        parts.append(f'<line class="grid" x1="{_c(x0)}" y1="{_c(y)}" x2="{_c(x1)}" y2="{_c(y)}"/>')
        parts.append(f'<text x="{_c(x0 - 6)}" y="{_c(y + 4)}" text-anchor="end">{_e(_tick_label(t, ticks))}</text>')
    parts.append(f'<text class="axis-label" transform="translate(14,{_c((_M["t"] + _H - _M["b"]) / 2)}) '
                 f'rotate(-90)" text-anchor="middle">{_e(y_label)}</text></g>')
    return parts


def similarity_svg(similarity: Sequence[Mapping[str, Any]]) -> str:
    """Line chart of cumulative and isolated cosine per layer output, in graph order (`#similarity-chart`)."""
    vals = [v for s in similarity for v in (s.get("cumulative_cos"), s.get("isolated_cos")) if v is not None]
    x0, x1, y0, y1 = _M["l"], _W - _M["r"], _M["t"], _H - _M["b"]
    n = len(similarity)
    head = (f'<svg id="similarity-chart" class="chart" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" '
            f'role="img" aria-label="per-layer cosine similarity">')
    if not n or not vals:
        return head + f'<text x="{_W / 2}" y="{_H / 2}" text-anchor="middle">no similarity data</text></svg>'
    lo, hi = min(vals), max(max(vals), 1.0)
    pad = max((hi - lo) * 0.05, 1e-6)
    ticks = nice_ticks(lo - pad, hi)
    lo_axis, hi_axis = min(ticks[0], lo - pad), max(ticks[-1], hi)

    def x_of(i: int) -> float:
        return x0 + (x1 - x0) * (0.5 if n == 1 else i / (n - 1))

    def y_of(v: float) -> float:
        return y1 - (y1 - y0) * (v - lo_axis) / (hi_axis - lo_axis)

    parts = [head, f'<rect class="frame" x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}"/>']
    parts += _axes(ticks, y_of, x0, x1, "cosine similarity")
    step = max(1, math.ceil(n / 20))
    parts.append('<g class="axis axis-x">')
    for i in range(0, n, step):
        parts.append(f'<text x="{_c(x_of(i))}" y="{y1 + 16}" text-anchor="middle">{i}</text>')
    parts.append(f'<text class="axis-label" x="{_c((x0 + x1) / 2)}" y="{_H - 6}" text-anchor="middle">'
                 'layer output (graph order)</text></g>')
    for key in ("cumulative", "isolated"):
        pts = [(x_of(i), y_of(s[f"{key}_cos"])) for i, s in enumerate(similarity) if s.get(f"{key}_cos") is not None]
        parts.append(f'<polyline class="series series-{key}" fill="none" stroke="{COLORS[key]}" stroke-width="1.5" '
                     f'points="{" ".join(f"{_c(x)},{_c(y)}" for x, y in pts)}"/>')
        parts.append(f'<g class="points points-{key}" fill="{COLORS[key]}">')
        for i, s in enumerate(similarity):
            v = s.get(f"{key}_cos")
            if v is None:
                continue
            parts.append(f'<circle class="point" cx="{_c(x_of(i))}" cy="{_c(y_of(v))}" r="2.5"><title>'
                         f'{_e(s["name"])} ({_e(s["type"])}) {_e(s["tensor"])}: {key} cos {v:.6f}</title></circle>')
        parts.append("</g>")
    parts.append(_legend([("cumulative", "cumulative cos"), ("isolated", "isolated cos")], x0, y0 - 10))
    parts.append("</svg>")
    return "".join(parts)


def _legend(items: Sequence[Tuple[str, str]], x: float, y: float, spacing: float = 120) -> str:
    """A one-row legend whose baseline is at `y` (placed in the top margin, clear of the data)."""
    parts = ['<g class="legend">']
    for k, (key, label) in enumerate(items):
        xx = x + k * spacing
        parts.append(f'<rect x="{_c(xx)}" y="{_c(y - 9)}" width="12" height="10" fill="{COLORS[key]}"/>'
                     f'<text x="{_c(xx + 18)}" y="{_c(y)}">{_e(label)}</text>')
    parts.append("</g>")
    return "".join(parts)


def bits_svg(layers: Sequence[Mapping[str, Any]]) -> str:
    """Bar chart of each layer's output bit width and weight bit width (`#bits-chart`)."""
    x0, x1, y0, y1 = _M["l"], _W - _M["r"], _M["t"], _H - _M["b"]
    head = (f'<svg id="bits-chart" class="chart" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" role="img" '
            f'aria-label="per-layer bit widths">')
    rows = []
    for r in layers:
        act = max((o.get("qbits") or 0 for o in r.get("outputs", [])), default=0)
        w = (r.get("constants", {}).get("weights") or {}).get("qbits") or 0
        rows.append((r, act, w))
    top = max([b for _, a, w in rows for b in (a, w)] + [8])
    if not rows:
        return head + f'<text x="{_W / 2}" y="{_H / 2}" text-anchor="middle">no layers</text></svg>'
    ticks = nice_ticks(0, top, 4)

    def y_of(v: float) -> float:
        return y1 - (y1 - y0) * v / max(ticks[-1], top)

    slot = (x1 - x0) / len(rows)
    bw = max(slot * 0.4, 0.5)
    parts = [head, f'<rect class="frame" x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}"/>']
    parts += _axes(ticks, y_of, x0, x1, "bits")
    for i, (r, act, w) in enumerate(rows):
        xs = x0 + i * slot + slot * 0.1
        for k, (cls, v) in enumerate((("act", act), ("weight", w))):
            if not v:
                continue
            parts.append(f'<rect class="bar bar-{cls}" x="{_c(xs + k * bw)}" y="{_c(y_of(v))}" width="{_c(bw)}" '
                         f'height="{_c(y1 - y_of(v))}" fill="{COLORS[cls]}"><title>{_e(r["name"])} '
                         f'({_e(r["type"])}): {"output" if cls == "act" else "weights"} {v} bits</title></rect>')
    every = max(1, math.ceil(len(rows) / 20))
    for i in range(0, len(rows), every):
        parts.append(f'<text x="{_c(x0 + (i + 0.5) * slot)}" y="{y1 + 16}" text-anchor="middle">{i}</text>')
    parts.append(f'<text class="axis-label" x="{_c((x0 + x1) / 2)}" y="{_H - 6}" text-anchor="middle">'
                 'layer (graph order)</text>')
    parts.append(_legend([("act", "output bits"), ("weight", "weight bits")], x0, y0 - 10))
    parts.append("</svg>")
    return "".join(parts)


def histogram_svg(h: Mapping[str, Any], index: int, width: int = 440, height: int = 220) -> str:
    """Overlaid float (filled) and dequantized (outline) histograms on one value axis (`svg.histogram`).

    Counts are drawn on a square-root scale: activations after ReLU put most values in one bin, and a linear
    scale would flatten the tails where clipping shows.
    """
    ml, mr, mt, mb = 48, 10, 24, 34
    x0, x1, y0, y1 = ml, width - mr, mt, height - mb
    bins = int(h["bins"])
    lo, hi = float(h["lo"]), float(h["hi"])
    fc, qc = h["float_counts"], h["quant_counts"]
    top = max(max(fc, default=0), max(qc, default=0), 1)

    def x_of(k: float) -> float:
        return x0 + (x1 - x0) * k / bins

    def y_of(c: float) -> float:
        return y1 - (y1 - y0) * math.sqrt(c / top)

    def outline(counts: Sequence[int]) -> str:
        d = [f"M{_c(x_of(0))},{_c(y1)}"]
        for k, c in enumerate(counts):
            d.append(f"L{_c(x_of(k))},{_c(y_of(c))}L{_c(x_of(k + 1))},{_c(y_of(c))}")
        d.append(f"L{_c(x_of(bins))},{_c(y1)}Z")
        return "".join(d)

    parts = [f'<svg id="hist-{index}" class="chart histogram" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="value histogram of {_e(h["tensor"])}">',
             f'<rect class="frame" x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}"/>',
             f'<path class="hist-float" d="{outline(fc)}" fill="{COLORS["float"]}" fill-opacity="0.35" '
             f'stroke="{COLORS["float"]}" stroke-width="1"><title>float values</title></path>',
             f'<path class="hist-quant" d="{outline(qc)}" fill="none" stroke="{COLORS["quant"]}" '
             f'stroke-width="1.5"><title>dequantized values</title></path>']
    for v in nice_ticks(lo, hi, 4):
        x = x0 + (x1 - x0) * ((v - lo) / (hi - lo) if hi > lo else 0.5)  # a degenerate range draws its ticks mid-axis
        parts.append(f'<text x="{_c(x)}" y="{y1 + 14}" text-anchor="middle">{_e(f"{v:.4g}")}</text>')
    parts.append(f'<text x="{x0 - 4}" y="{y0 + 10}" text-anchor="end">{top}</text>'
                 f'<text x="{x0 - 4}" y="{y1}" text-anchor="end">0</text>'
                 f'<text class="axis-label" x="{_c((x0 + x1) / 2)}" y="{height - 4}" text-anchor="middle">'
                 'value (count per bin, square-root scale)</text>')
    parts.append(_legend([("float", "float"), ("quant", "quantized")], x0, y0 - 8, spacing=80))
    parts.append("</svg>")
    return "".join(parts)


def steps_svg(steps: Sequence[Mapping[str, Any]]) -> str:
    """Horizontal bars of the wall time of each workflow step (`#steps-chart`)."""
    rows = [(s["name"], s.get("seconds") or 0.0) for s in steps]
    label_w, bar_x1, row_h = 230, _W - 90, 20
    height = max(len(rows), 1) * row_h + 20
    parts = [f'<svg id="steps-chart" class="chart" width="{_W}" height="{height}" viewBox="0 0 {_W} {height}" '
             f'role="img" aria-label="wall time per step">']
    top = max([sec for _, sec in rows] + [1e-9])
    for i, (name, sec) in enumerate(rows):
        y = 10 + i * row_h
        w = (bar_x1 - label_w) * sec / top
        parts.append(f'<text x="{label_w - 8}" y="{y + 13}" text-anchor="end">{_e(name)}</text>'
                     f'<rect class="bar bar-step" x="{label_w}" y="{y + 2}" width="{_c(w)}" height="{row_h - 6}" '
                     f'fill="{COLORS["step"]}"><title>{_e(name)}: {sec:.3f}s</title></rect>'
                     f'<text x="{_c(label_w + w + 6)}" y="{y + 13}">{sec:.3f}s</text>')
    parts.append("</svg>")
    return "".join(parts)


# ---------------------------------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1000px}
h1{font-size:1.5em;margin-bottom:4px}h2{font-size:1.15em;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
svg.chart{display:block;margin:8px 0;font-size:11px}svg .frame{fill:none;stroke:#999}
svg .grid{stroke:#eee}svg .axis-label{font-size:12px;fill:#444}.muted{color:#777}
.hists{display:flex;flex-wrap:wrap;gap:12px}.hist{border:1px solid #eee;padding:6px}
.hist h3{font-size:13px;margin:2px 0}
"""


def _table(cls: str, head: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[int] = ()) -> str:
    out = [f'<table id="{cls}"><thead><tr>' + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    for r in rows:
        out.append("<tr>" + "".join(f'<td class="num">{_e(v)}</td>' if i in numeric else f"<td>{_e(v)}</td>"
                                    for i, v in enumerate(r)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _bits_text(entry: Mapping[str, Any]) -> str:
    bits = entry.get("qbits")
    text = str(entry.get("dtype", ""))
    if bits is not None:
        text += f" ({bits} bits)"
    if entry.get("per_channel"):
        text += " per-channel"
    return text


def render_html(report: Mapping[str, Any]) -> str:
    """The report page: one self-contained HTML string (inline CSS and SVG, no script, no external resource)."""
    model = str(report.get("model", "model"))
    p: List[str] = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
                    f"<title>quantopt report: {_e(model)}</title><style>{_CSS}</style></head><body>",
                    f'<h1 id="title">quantopt report: {_e(model)}</h1>',
                    f'<p class="muted">inputs: {_e(", ".join(report.get("inputs", [])))} &middot; outputs: '
                    f'{_e(", ".join(report.get("outputs", [])))} &middot; wall time '
                    f'{_fmt(report.get("wall_time"), ".3f")}s &middot; {int(report.get("warnings", 0))} warning(s)</p>']

    p.append('<h2 id="metrics">Metrics</h2>')
    metrics = report.get("metrics", [])
    if metrics:
        p.append(_table("metrics-table", ["metric", "float", "quantized", "drop (float − quantized)"],
                        [[m["name"], _fmt(m["float"]), _fmt(m["quant"]), _fmt(m["drop"], "+.6f")] for m in metrics],
                        numeric=(1, 2, 3)))
    else:
        p.append('<p class="muted">no metric was evaluated (set <code>metric</code> and <code>data</code> in the '
                 'cfg).</p>')

    p.append('<h2 id="similarity">Per-layer similarity</h2><p class="muted">Cosine similarity of each layer output '
             'with the float graph. <b>Cumulative</b>: the quantized graph runs on its own results, so errors add up '
             'along the graph. <b>Isolated</b>: each layer gets the float inputs, so the value is the layer\'s own '
             'error. Hover a point for the layer name.</p>')
    p.append(similarity_svg(report.get("similarity", [])))

    p.append('<h2 id="worst">Worst layers</h2>')
    worst = report.get("worst_layers", [])
    p.append(_table("worst-table", ["id", "layer", "type", "tensor", "isolated cos", "isolated mse", "cumulative cos",
                                    "cumulative mse"],
                    [[w["layer_id"], w["name"] + (f' ({w["note"]})' if w.get("note") else ""), w["type"],
                      w["tensor"], _cos_text(w, "isolated_cos"), _fmt(w["isolated_mse"], ".4g"),
                      _cos_text(w, "cumulative_cos"), _fmt(w["cumulative_mse"], ".4g")]
                     for w in worst], numeric=(0, 4, 5, 6, 7)))
    advice = report.get("advice", [])
    if advice:
        p.append('<h2 id="advice">Accuracy advice</h2><ul id="advice-list">' +
                 "".join(f'<li><b>{_e(a["layer"])}</b> ({_e(a["layer_type"])}): <code>{_e(a["cause"])}</code> '
                         f'{_e(a["message"])}' + (f'; fix: <code>{_e(a["field"])}</code>' if a.get("field") else "")
                         + "</li>" for a in advice) + "</ul>")

    hists = report.get("histograms", [])
    p.append('<h2 id="histograms">Value histograms of the worst layers</h2>')
    if hists:
        p.append('<p class="muted">One batch; float values filled, dequantized values outlined, on a shared range. '
                 'Dequantized mass piled at an edge that the float values pass means clipping.</p><div class="hists">')
        for i, h in enumerate(hists):
            f, q = h.get("float", {}), h.get("quant", {})
            p.append(f'<div class="hist"><h3>{_e(h["layer"])} ({_e(h["type"])}) &rarr; {_e(h["tensor"])}</h3>'
                     + histogram_svg(h, i) +
                     f'<div class="muted">float [{_fmt(f.get("min"), ".4g")}, {_fmt(f.get("max"), ".4g")}], '
                     f'quantized [{_fmt(q.get("min"), ".4g")}, {_fmt(q.get("max"), ".4g")}], '
                     f'cos {_fmt(h.get("cosine"))}</div></div>')
        p.append("</div>")
    else:
        p.append('<p class="muted">no histograms were collected.</p>')

    layers = report.get("layers", [])
    p.append('<h2 id="bits">Per-layer bit widths and dtypes</h2>')
    p.append(bits_svg(layers))
    sims: Dict[str, Mapping[str, Any]] = {s["tensor"]: s for s in report.get("similarity", [])}
    rows = []
    for r in layers:
        outs = "; ".join(f'{o["tensor"]}: {_bits_text(o)}' for o in r.get("outputs", []))
        consts = "; ".join(f"{k}: {_bits_text(v)}" for k, v in r.get("constants", {}).items())
        cos = [sims[o["tensor"]] for o in r.get("outputs", []) if o["tensor"] in sims]
        rows.append([r["layer_id"], r["name"], r["type"], outs, consts or "-",
                     _fmt(cos[0]["isolated_cos"]) if cos else "-", _fmt(cos[0]["cumulative_cos"]) if cos else "-"])
    p.append(_table("layers-table", ["id", "layer", "type", "outputs", "constants", "isolated cos", "cumulative cos"],
                    rows, numeric=(0, 5, 6)))

    steps = report.get("steps", [])
    p.append('<h2 id="steps">Wall time per step</h2>')
    p.append(steps_svg(steps))
    p.append(_table("steps-table", ["step", "seconds"], [[s["name"], _fmt(s["seconds"], ".3f")] for s in steps],
                    numeric=(1,)))

    files = report.get("files", [])
    if files:
        p.append('<h2 id="files">Files written</h2><ul id="files-list">' +
                 "".join(f"<li><code>{_e(f)}</code></li>" for f in files) + "</ul>")
    p.append("</body></html>\n")
    return "\n".join(p)
