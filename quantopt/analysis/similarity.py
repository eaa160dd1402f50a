"""Per-layer precision of the quantized graph: cosine similarity and MSE against the float graph.

Two views per layer output, averaged over the given batches:
* cumulative: the float graph and the integer graph each run on their own upstream results, so a layer's error
  includes everything accumulated before it (what the final output sees);
* isolated: each quantized layer is fed the float graph's inputs quantized with its own input params, so the
  error is the layer's own (what tells a user which layer is to blame).

A mask tensor (its statistics saw ±inf or |x| >= 1e30, calibration/inf_mask.py, or a finite mask's values,
calibration/finite_mask.py) is compared on its other positions only: the mask positions saturate by design and
their huge float values would decide cosine and MSE alone. A NaN or infinite result is kept, with a `note` saying
why, and listed first among the worst layers.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch

from ..calibration.inf_mask import is_mask_tensor
from ..calibration.statistics import INF_MASK_THRESHOLD
from ..graph.graph import PyGraph
from ..graph.memo import SameValues
from ..graph.node import PyNode
from ..graph.recorded import RecordedBatch
from ..graph.tables import QuantTable, TensorStatistics, quant_of
from ..graph.tensor import PyTensor
from ..graph.values import per_tensor_dequantization, to_float, to_quantized
from ..graph.wide_values import wide_values_of
from ..quant.compare import Dequantized, Other, StepBuffers, cosine, cosines_and_mses, mse

__all__ = [  # cosine/mse and to_float/to_quantized are re-exported: the analysis's own vocabulary
    "Batch", "FirstBatch", "LayerSimilarity", "cosine", "layer_similarity", "mse", "to_float", "to_quantized",
    "worst_key", "worst_layers_table",
]


@dataclass
class LayerSimilarity:
    layer_id: int
    name: str
    type: str
    tensor: str
    cumulative_cos: float
    cumulative_mse: float
    isolated_cos: float
    isolated_mse: float
    note: str = ""
    """Why a value is NaN/inf, or that mask positions were left out (empty: nothing to say)."""

    def as_dict(self) -> Dict[str, object]:
        return asdict(self)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1)


class FirstBatch(Dict[str, Tuple[PyNode, torch.Tensor, torch.Tensor]]):
    """tensor name -> (float layer, float value, dequantized quantized value) of the first analysed batch.

    With `worst` set, only the `worst` outputs of that batch that rank lowest by `worst_key` on it are kept (ties by
    output order): when one batch is analysed these are exactly the outputs the report histograms, held as a few
    tensors instead of a dequantized copy of every activation (whose page faults alone cost a quarter of the
    analysis). Without it every output is kept."""

    def __init__(self, worst: Optional[int] = None) -> None:
        super().__init__()
        self.worst = worst
        self._keys: Dict[str, tuple] = {}
        self._offered: Set[str] = set()

    def wants(self, name: str, key: tuple) -> bool:
        """Whether `offer` would keep an entry for `name` with `key` (the caller then makes the entry)."""
        if name in self._offered:
            return False
        if self.worst is None:
            return True
        if self.worst <= 0:
            return False
        return len(self._keys) < self.worst or key < max(self._keys.values())

    def offer(self, name: str, key: tuple, entry: Tuple[PyNode, torch.Tensor, torch.Tensor]) -> None:
        """Keep `entry` for tensor `name` if it ranks among the worst so far (`key`: its `worst_key` and output
        index; lower is worse); the first offer of a name counts."""
        if name in self._offered:
            return
        self._offered.add(name)
        if self.worst is not None:
            if self.worst <= 0:
                return
            self._keys[name] = key
        self[name] = entry
        if self.worst is not None and len(self) > self.worst:
            drop = max(self._keys, key=self._keys.__getitem__)
            del self[drop], self._keys[drop]


Batch = Union[Sequence[torch.Tensor], RecordedBatch]
"""The inputs of one batch, or a batch the statistics pass recorded with the float graph's outputs."""


def layer_similarity(float_graph: PyGraph, quant_graph: PyGraph, batches: Iterable[Batch],
                     first_batch: Optional[FirstBatch] = None) -> List[LayerSimilarity]:
    """Cumulative and isolated similarity of every layer output, averaged over `batches`.

    Per batch it costs one forward of each graph plus, for the isolated view, one run of each quantized layer on its
    quantized float inputs: the float activations of the cumulative run serve the isolated view, each float tensor
    is quantized once for all its consumers, a layer whose quantized float inputs equal its inputs in the quantized
    run is not run again (its isolated result is its cumulative one), and each float output is compared with its
    cumulative and isolated values in one streamed pass (`quant.compare.cosines_and_mses`, integers dequantized step
    by step). The float graph's activations are kept for the batch; each quantized layer is compared as soon as the
    quantized forward has run it, so the quantized graph's activations (int64) are freed after their last reader as
    in a plain forward, and each float tensor's quantized copy after its last reader. A `RecordedBatch` among
    `batches` brings the float graph's outputs with it (graph/recorded.py): the float forward is not run again. With
    `first_batch`, the float and dequantized values of the first batch's layer outputs (all, or the worst few) are
    kept there (the report's histograms read them instead of running again).

    The returned list (one LayerSimilarity per compared output, in graph order) is the analysis' result table: the
    template, report, advisor, run records and `D_*` IR keys read it; nothing is stored on the tensors.
    """
    qnodes = {n.name: n for n in quant_graph.nodes}
    pairs = [(f, qnodes[f.name]) for f in float_graph.nodes if f.name in qnodes]
    run = _Comparison(float_graph, pairs, quant_graph.nodes)
    count = 0
    with torch.no_grad():
        for batch in batches:
            if isinstance(batch, RecordedBatch):
                batch.restore(float_graph)
                inputs = batch.inputs
            else:
                inputs = batch
                float_graph.forward(inputs, keep_tensors=True)
            run.start_batch(first_batch if count == 0 else None)
            quant_graph.forward(inputs, after_node=run.compare)
            count += 1
            _release(float_graph)
            _release(quant_graph)
    sums, notes = run.sums, run.notes
    n = max(count, 1)
    results = []
    for fnode, qnode in pairs:
        for f, _ in zip(fnode.outputs, qnode.outputs):
            acc = sums.get((fnode.name, f.name))
            if acc is None:
                continue
            cum_cos, cum_mse, iso_cos, iso_mse = (v / n for v in acc)
            results.append(LayerSimilarity(fnode.layer_id, fnode.name, str(fnode.type), f.name, cum_cos, cum_mse,
                                           iso_cos, iso_mse, notes.get(f.name, "")))
    return results


class _Comparison:
    """The per-layer comparisons of `layer_similarity`, run as the quantized forward's after-node hook: what one
    layer's comparison needs from the others (sums, notes, the batch's quantized float tensors) lives here."""

    def __init__(self, float_graph: PyGraph, pairs: Sequence[Tuple[PyNode, PyNode]],
                 quant_order: Sequence[PyNode]) -> None:
        self.float_graph = float_graph
        self.float_of = {id(q): f for f, q in pairs}
        self.position = {id(q): i for i, q in enumerate(q for q in quant_order if id(q) in self.float_of)}
        # the position of each float tensor's last reader among the compared layers, in the quantized run's order
        self.last_reader = {id(t): self.position[id(q)]
                            for f, q in sorted(pairs, key=lambda pair: self.position[id(pair[1])]) for t in f.inputs}
        self.sums: Dict[tuple, List[float]] = {}
        self.notes: Dict[str, str] = {}
        self.quantized: Dict[Tuple[int, int], torch.Tensor] = {}
        self.first_batch: Optional[FirstBatch] = None
        self.buffers = StepBuffers()
        # what a layer without inputs (a Constant: an embedding table, say) gives is the same in every batch: its
        # comparison, and whether its quantized float output is the quantized run's value, are found once and
        # reused while its values are the very same memory at the same version (memo.SameValues)
        self.constant_results: Dict[str, Tuple[list, list]] = {}
        self.constant_feeds: Dict[Tuple[int, int], Tuple[SameValues, SameValues]] = {}

    def _results(self, fnode: PyNode, qnode: PyNode, table: QuantTable) -> List[Tuple[tuple, tuple]]:
        """((cumulative cos, mse), (isolated cos, mse)) of each output of the layer pair, computed."""
        fvals = [_flat(f.betensor) for f in fnode.outputs]
        keep = [_unmasked(f, self.float_graph.statistics.get(f), x, self.notes) for f, x in zip(fnode.outputs, fvals)]
        fvals = [x if k is None else x[k] for x, k in zip(fvals, keep)]
        cumulative_values = [q.betensor for q in qnode.outputs]
        isolated_values = _isolated(fnode, qnode, self.quantized, self.constant_feeds)
        _forget_read(self.quantized, fnode, self.position[id(qnode)], self.last_reader)
        results = []
        for i, (x, q, k) in enumerate(zip(fvals, qnode.outputs, keep)):
            others = [_comparable(cumulative_values[i], q, table, k)]
            if isolated_values is not None:
                others.append(_comparable(isolated_values[i], q, table, k))
            both = cosines_and_mses(x, others, self.buffers)
            results.append((both[0], both[-1]))  # without a run of its own, the isolated view is the cumulative
        return results

    def start_batch(self, first_batch: Optional[FirstBatch]) -> None:
        """A new batch: no quantized float tensors yet; `first_batch` is the dict to keep its values in, if any."""
        self.quantized = {}
        self.first_batch = first_batch

    def compare(self, qnode: PyNode) -> None:
        """Compare `qnode`'s outputs, just computed by the quantized forward, with its float layer's."""
        fnode = self.float_of.get(id(qnode))
        if fnode is None:
            return
        notes = self.notes
        table = quant_of(qnode)
        if qnode.inputs:
            results = self._results(fnode, qnode, table)
        else:  # a constant's values: compared again only when they are other values than last batch's
            values = [[SameValues(f.betensor), SameValues(q.betensor)] for f, q in zip(fnode.outputs, qnode.outputs)]
            cached = self.constant_results.get(fnode.name)
            results = cached[1] if cached is not None and cached[0] == values else self._results(fnode, qnode, table)
            self.constant_results[fnode.name] = (values, results)
        for f, (c, i) in zip(fnode.outputs, results):
            acc = self.sums.setdefault((fnode.name, f.name), [0.0, 0.0, 0.0, 0.0])
            for k, v in enumerate(c + i):
                acc[k] += v
            if not all(math.isfinite(v) for v in c + i) and f.name not in notes:
                notes[f.name] = _nonfinite_reason(f.betensor, qnode, f.name)
        if self.first_batch is not None:
            for index, (f, q, (c, i)) in enumerate(zip(fnode.outputs, qnode.outputs, results)):
                key = _rank(i[0], c[0], fnode.layer_id) + (index,)
                if self.first_batch.wants(f.name, key):
                    self.first_batch.offer(f.name, key, (fnode, f.betensor, to_float(q, table)))


def _comparable(value: torch.Tensor, q: PyTensor, table: QuantTable, keep: Optional[torch.Tensor]) -> Other:
    """The dequantized floats of `value` (an output value of quantized tensor `q`) as the comparison takes them:
    integers with per-tensor params dequantized step by step, anything else (per-channel params, float values,
    masked positions) through `to_float` first; the same values either way."""
    params = per_tensor_dequantization(q, table)
    if keep is None and params is not None and not value.is_floating_point():
        return Dequantized(value, *params)
    return _select(to_float(q, table, value), keep)


def _forget_read(quantized: Dict[Tuple[int, int], torch.Tensor], fnode: PyNode, index: int,
                 last_reader: Dict[int, int]) -> None:
    """Drop the quantized copies of the float tensors whose last reader is pair `index`: no later layer asks for
    them, and holding every activation's int64 copy until the batch ends doubled the analysis' memory."""
    done = {id(t) for t in fnode.inputs if last_reader.get(id(t)) == index}
    for key in [k for k in quantized if k[1] in done]:
        del quantized[key]


def _unmasked(t: PyTensor, stats: TensorStatistics, x: torch.Tensor, notes: Dict[str, str]) -> Optional[torch.Tensor]:
    """Positions of a mask tensor's float values that are not mask values (None: compare everything); `stats`: the
    float tensor's statistics, which tell whether it is a mask tensor."""
    if not is_mask_tensor(stats):
        return None
    # the threshold itself, not its float32 rounding; a finite mask's own (calibration/finite_mask.py)
    threshold = INF_MASK_THRESHOLD if stats.inf_mask_threshold is None else float(stats.inf_mask_threshold)
    keep = ~(x.to(torch.float64).abs() >= threshold)
    if bool(keep.all()):
        return None
    notes.setdefault(t.name, f"inf mask: {int((~keep).sum())} mask position(s) of the first batch left out")
    return keep


def _select(y: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    y = _flat(y)
    return y if keep is None else y[keep]


def _nonfinite_reason(x: torch.Tensor, qnode: PyNode, name: str) -> str:
    """Why a similarity is NaN/inf: what the float or the quantized values hold."""
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        kinds = [k for k, bad in (("NaN", torch.isnan(x)), ("±inf", torch.isinf(x))) if bool(bad.any())]
        return f"float output holds {' and '.join(kinds)}"
    for q in qnode.outputs:
        if q.name == name and q.betensor.is_floating_point() and not bool(torch.isfinite(q.betensor).all()):
            return "quantized output holds NaN or ±inf"
    return "values too large for float64 (overflow in cosine/MSE)"


def _isolated(fnode: PyNode, qnode: PyNode, quantized: Dict[Tuple[int, int], torch.Tensor],
              constant_feeds: Dict[Tuple[int, int], Tuple[SameValues, SameValues]]) -> Optional[List[torch.Tensor]]:
    """The output values of the quantized layer run alone on the float graph's inputs quantized with its input
    params (`quantized` caches them per tensor pair for the batch; `constant_feeds` remembers across batches the
    outputs of layers without inputs whose quantized copy is the quantized run's own value, while both are the
    same tensors); None when they equal its inputs of the
    quantized run (and no input carries an unrounded float value the layer might read): the isolated result is
    then the cumulative one. The layer's tensors get their values of the quantized run back."""
    if not qnode.inputs:
        return None
    feeds = []
    table = quant_of(qnode)  # the quantized graph's params
    for qt, ft in zip(qnode.inputs, fnode.inputs):
        key = (id(qt), id(ft))
        if key not in quantized:
            constant = ft.pnode is not None and not ft.pnode.inputs
            kept = constant_feeds.get(key) if constant else None
            if kept is not None and kept[0] == SameValues(ft.betensor) and kept[1] == SameValues(qt.betensor):
                quantized[key] = qt.betensor
            else:
                quantized[key] = _quantized_feed(ft.betensor, qt, table)
                if constant and quantized[key] is qt.betensor:  # kept only where that holds no copy
                    constant_feeds[key] = (SameValues(ft.betensor), SameValues(qt.betensor))
        feeds.append(quantized[key])
    wide = wide_values_of(qnode)
    if len(feeds) == len(qnode.inputs) and all(
            (wide is None or wide.get(qt) is None) and (v is qt.betensor or (
                v.dtype == qt.betensor.dtype and torch.equal(v, qt.betensor)))
            for qt, v in zip(qnode.inputs, feeds)):
        return None
    saved_in = [t.betensor for t in qnode.inputs]
    saved_out = [t.betensor for t in qnode.outputs]
    # the quantized forward goes on after this run: the outputs get their values back with their wide values
    saved_wide = [None if wide is None else wide.get(t) for t in qnode.outputs]
    try:
        for qt, v in zip(qnode.inputs, feeds):
            qt.betensor = v
        qnode.forward()
        return [t.betensor for t in qnode.outputs]
    finally:
        for t, v in zip(qnode.inputs, saved_in):
            t.betensor = v
        for t, v, w in zip(qnode.outputs, saved_out, saved_wide):
            t.betensor = v
            if wide is not None:
                wide.keep(t, w)


FEED_CHECK_FIRST = 1 << 12
"""Elements of the first step of `_quantized_feed`'s comparison: small, as most feeds differ at once."""
FEED_CHECK_STEP = 1 << 18
"""Elements of its later steps (and the least size it steps through at all)."""


def _quantized_feed(x: torch.Tensor, qt: PyTensor, table: QuantTable) -> torch.Tensor:
    """`to_quantized(x, qt, table)`: the float values `x` quantized with the params of `qt`, the quantized run's
    tensor; where that equals `qt`'s own value (checked step by step for a large tensor with per-tensor params),
    that value itself. A large input the quantized run already holds as is (a constant's output, such as a BERT
    export's word-embedding table, or the first layer's input) is then neither quantized whole nor compared whole;
    a differing one (the usual case) is found in the first, small step."""
    mine = qt.betensor
    q = table.get(qt)
    per_channel = q.per_channel or isinstance(q.zerop, torch.Tensor) and q.zerop.numel() > 1
    if per_channel or x.numel() < 2 * FEED_CHECK_STEP or x.shape != mine.shape or not x.is_contiguous() \
            or not mine.is_contiguous():
        return to_quantized(x, qt, table)
    xs, ms = x.reshape(-1), mine.reshape(-1)
    start, step = 0, FEED_CHECK_FIRST
    while start < xs.numel():
        part = to_quantized(xs[start:start + step], qt, table)  # per tensor: element by element, like the whole
        if part.dtype != ms.dtype or not torch.equal(part, ms[start:start + step]):
            return to_quantized(x, qt, table)
        start, step = start + step, FEED_CHECK_STEP
    return mine


def _release(graph: PyGraph) -> None:
    keep = {id(t) for t in graph.input_tensors}
    for n in graph.nodes:
        for t in n.outputs:
            if id(t) not in keep:
                t.release()
                graph.wide_values.drop(t)


def worst_key(r: LayerSimilarity) -> Tuple[float, float, int]:
    """Sort key of the worst layers: lowest isolated cosine, then cumulative; NaN and inf count as lowest, so a
    similarity that could not be computed is listed first, never dropped."""
    return _rank(r.isolated_cos, r.cumulative_cos, r.layer_id)


def _rank(isolated_cos: float, cumulative_cos: float, layer_id: int) -> Tuple[float, float, int]:
    iso = isolated_cos if math.isfinite(isolated_cos) else -math.inf
    cum = cumulative_cos if math.isfinite(cumulative_cos) else -math.inf
    return iso, cum, layer_id


def _cell(v: float, width: int, fmt: str) -> str:
    return f"{'NaN' if math.isnan(v) else format(v, fmt):>{width}}"


def worst_layers_table(results: Sequence[LayerSimilarity], count: int = 10) -> str:
    """A text table of the layers with the lowest isolated cosine (ties: lowest cumulative cosine); a NaN or inf
    similarity comes first, shown as such with its reason."""
    if not results:
        return "per-layer similarity: no layers"
    rows = sorted(results, key=worst_key)[:count]
    width = max(len(r.name) for r in rows)
    lines = [f"worst {len(rows)} of {len(results)} layer outputs by isolated cosine (the layer's own error):",
             f"{'id':>4}  {'layer':<{width}}  {'type':<16} {'isolated cos':>12} {'isolated mse':>12} "
             f"{'cumul. cos':>11} {'cumul. mse':>11}"]
    for r in rows:
        lines.append(f"{r.layer_id:>4}  {r.name:<{width}}  {r.type:<16} {_cell(r.isolated_cos, 12, '.6f')} "
                     f"{_cell(r.isolated_mse, 12, '.4g')} {_cell(r.cumulative_cos, 11, '.6f')} "
                     f"{_cell(r.cumulative_mse, 11, '.4g')}" + (f"  ({r.note})" if r.note else ""))
    return "\n".join(lines)
