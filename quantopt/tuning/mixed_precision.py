"""`mixed_precision_auto_search = batches, threshold, L|G` (docs/mixed-precision.md), searched per layer.

Upstream assumes deeper layers are more sensitive and searches one cut point: every layer after it is promoted.
A model whose sensitive layer sits early (a first conv, an attention softmax) then promotes most of the network.
quantopt measures instead:

1. the float score, and the score with the configured precision (nothing to do if it already satisfies);
2. the promotion level: 16 bits (activations and weights 16, biases 48, LUT 2^10), or float (`float32_preferred`)
   when even every candidate at 16 bits cannot reach the threshold;
3. each candidate layer's sensitivity: the score gain when only that layer is promoted;
4. greedy promotion, most sensitive first, scoring after each step until the threshold holds;
5. pruning: each promoted layer, least sensitive first, is demoted again if the threshold still holds without it.

With `mixed_precision_ranking = similarity` the sensitivities come instead from one precision analysis (each
layer's isolated cosine on the search batches, passed in as `ranking`), and step 4 bisects for the shortest
promoted prefix of that order that satisfies the threshold (the order is assumed monotone enough) before step 5
prunes it: a few evaluations plus one per promoted layer instead of one per candidate.

Every probe scores a mapping layer -> settings (`score_settings`): a copy of the float graph takes those settings,
is re-calibrated from the kept statistics and quantized, and is scored on the search batches; the float graph is
never changed, so one probe cannot leak settings or ranges into the next. The search returns its choice as values
(`SearchResult.settings`, the promoted layers' new settings), which the caller assigns to the float graph once
(OptMaster.mixed_precision_search), so the JSON template records them and can be fed back with `opt_config` to
skip the search. `cut_point_search` is upstream's method, kept for comparison
(benchmarks/mixed_precision_search.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ..calibration.collect import calibrate_graph
from ..config.kinds_accuracy import AutoSearch
from ..config.layer_settings import LayerSettings
from ..graph.graph import QuantizeGraph
from ..log import OPT_INFO, OPT_WARN
from ..progress import progress
from ..quantizer import quantize_graph

PROMOTIONS: Dict[str, Dict[str, Any]] = {
    "16bit": {"q_bits_activation": 16, "q_bits_weight": 16, "q_bits_bias": 48, "lut_items_in_bits": 10},
    "float": {"trigger_float_op": "float32_preferred"},
}
"""What promoting a layer changes in its settings, per level (upstream's values)."""

PASSTHROUGH_TYPES = frozenset({"Reshape", "Transpose", "Permute", "Squeeze", "Flatten", "Split", "Slice",
                               "StridedSlice", "Crop", "Tile", "Repeat", "Pad", "Concat", "DepthToSpace",
                               "SpaceToDepth", "ChannelShuffle", "Gather"})
"""Layers whose output quantization follows their inputs: promoting one alone changes nothing, so they are not
search candidates."""

ScoreFn = Callable[[QuantizeGraph], float]


@dataclass
class SearchStep:
    what: str
    promoted: List[str]
    score: float
    drop: float
    satisfied: bool

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class SearchResult:
    """What a search did and chose. `settings` (layer -> settings) holds the promoted layers' new settings, empty
    when nothing is promoted: the caller assigns them (the search itself leaves the graph as it was)."""
    level: str
    promoted: List[str]
    float_score: float
    base_score: float
    final_score: float
    sensitivity: Dict[str, float] = field(default_factory=dict)
    steps: List[SearchStep] = field(default_factory=list)
    evaluations: int = 0
    reached: bool = True
    settings: Dict[str, LayerSettings] = field(default_factory=dict, repr=False)

    def as_dict(self) -> Dict[str, Any]:
        """The record for the report (the settings are in the template, not here)."""
        d = dataclasses.asdict(dataclasses.replace(self, settings={}))
        d.pop("settings")
        d["steps"] = [s.as_dict() for s in self.steps]
        return d


def candidate_layers(graph: QuantizeGraph) -> List[str]:
    """Layers whose promotion can change the model (not data-movement layers), in graph order."""
    return [n.name for n in graph.nodes if str(n.type) not in PASSTHROUGH_TYPES]


def promoted_settings(settings: LayerSettings, level: str) -> LayerSettings:
    return dataclasses.replace(settings, **PROMOTIONS[level])


def score_settings(graph: QuantizeGraph, settings: Mapping[str, LayerSettings], score_fn: ScoreFn) -> float:
    """The score of `graph` calibrated and quantized with `settings` (layer -> settings; layers not named keep
    their own), measured on a copy so that `graph` (settings, ranges, constants) stays as it was."""
    work = graph.clone()
    for n in work.nodes:
        if n.name in settings:
            n.settings = settings[n.name]
    calibrate_graph(work)
    return float(score_fn(quantize_graph(work)))


class _Prober:
    """Scores sets of promoted layers (`score_settings`) and counts the evaluations; never changes the graph."""

    def __init__(self, graph: QuantizeGraph, score_fn: ScoreFn, float_score: float, auto: AutoSearch) -> None:
        self.graph = graph
        self.score_fn = score_fn
        self.float_score = float_score
        self.auto = auto
        self.original = {n.name: n.settings for n in graph.nodes}
        self.evaluations = 0

    def settings(self, promoted: Sequence[str], level: Optional[str]) -> Dict[str, LayerSettings]:
        """The promoted layers' settings at `level` (none when `level` is None), in graph order."""
        if level is None:
            return {}
        chosen = set(promoted)
        return {name: promoted_settings(s, level) for name, s in self.original.items() if name in chosen}

    def score(self, promoted: Sequence[str], level: Optional[str]) -> float:
        score = score_settings(self.graph, self.settings(promoted, level), self.score_fn)
        self.evaluations += 1
        return score

    def satisfied(self, score: float) -> bool:
        return self.auto.satisfied(self.float_score - score)


def _log_step(result: SearchResult, prober: _Prober, what: str, promoted: Sequence[str], score: float) -> bool:
    ok = prober.satisfied(score)
    step = SearchStep(what, list(promoted), score, prober.float_score - score, ok)
    result.steps.append(step)
    OPT_INFO(f"mixed precision search: {what}: {len(promoted)} promoted layer(s), metric {score:.6f} (drop "
             f"{step.drop:+.6f}) -> {'satisfied' if ok else 'not satisfied'}")
    return ok


def per_layer_search(graph: QuantizeGraph, score_fn: ScoreFn, float_score: float, auto: AutoSearch,
                     candidates: Optional[Sequence[str]] = None,
                     ranking: Optional[Mapping[str, float]] = None) -> SearchResult:
    """The per-layer greedy search (module doc). Returns what it did and chose (`SearchResult.settings`, for the
    caller to assign; `graph` is left as it was); when the threshold cannot be reached even with every candidate in
    float, nothing is promoted and `reached` is False. `ranking` (layer -> sensitivity, larger is more sensitive;
    e.g. 1 - the isolated cosine) replaces the per-layer probes and the greedy steps by a bisection over its order."""
    cands = list(candidates) if candidates is not None else candidate_layers(graph)
    prober = _Prober(graph, score_fn, float_score, auto)
    base = prober.score([], None)
    result = SearchResult("none", [], float_score, base, base)
    if _log_step(result, prober, "configured precision", [], base):
        result.evaluations = prober.evaluations
        return result
    level = None
    for lv in ("16bit", "float"):
        if _log_step(result, prober, f"every candidate at {lv}", cands, prober.score(cands, lv)):
            level = lv
            break
    if level is None:
        OPT_WARN(f"mixed_precision_auto_search: the threshold {auto} is not reachable even with every candidate "
                 "layer in float; the configured precision is kept")
        result.evaluations, result.reached = prober.evaluations, False
        return result
    result.level = level
    if ranking is not None:
        return _bisect_ranked(result, prober, cands, level, ranking)
    for name in progress(cands, "sensitivity"):
        result.sensitivity[name] = prober.score([name], level) - base
    order = sorted(cands, key=lambda nm: (-result.sensitivity[nm], cands.index(nm)))
    chosen: List[str] = []
    score = base
    for name in order:
        chosen.append(name)
        score = prober.score(chosen, level)
        if _log_step(result, prober, f"promote {name}", chosen, score):
            break
    else:
        chosen, score = list(cands), prober.score(cands, level)
    chosen, score = _prune(result, prober, chosen, score, level, cands)
    chosen = [c for c in cands if c in chosen]
    result.promoted, result.final_score, result.evaluations = chosen, score, prober.evaluations
    result.settings = prober.settings(chosen, level)
    OPT_INFO(f"mixed precision search: {len(chosen)} layer(s) at {level}: {', '.join(chosen)}; metric "
             f"{score:.6f} (float {float_score:.6f}); {prober.evaluations} evaluations")
    return result


def _prune(result: SearchResult, prober: _Prober, chosen: List[str], score: float, level: str,
           cands: List[str]) -> tuple:
    """Demote each promoted layer again, least sensitive first, when the threshold still holds without it."""
    def least_first(name: str) -> tuple:
        value = result.sensitivity.get(name, 0.0)
        return (1 if value != value else 0, value if value == value else 0.0, -cands.index(name))

    for name in sorted(chosen, key=least_first):
        if len(chosen) == 1:
            break
        trial = [c for c in chosen if c != name]
        trial_score = prober.score(trial, level)
        if prober.satisfied(trial_score):
            chosen, score = trial, trial_score
            _log_step(result, prober, f"demote {name}", chosen, score)
    return chosen, score


def _bisect_ranked(result: SearchResult, prober: _Prober, cands: List[str], level: str,
                   ranking: Mapping[str, float]) -> SearchResult:
    """The shortest prefix of `cands` ordered by `ranking` (most sensitive first; NaN ranks first) whose
    promotion satisfies the threshold, by bisection (every candidate promoted satisfies it, checked by the caller;
    none does not), then pruned like the probe search's choice."""
    def key(name: str) -> tuple:
        value = float(ranking.get(name, 0.0))
        return (0 if value != value else 1, -value if value == value else 0.0, cands.index(name))

    order = sorted(cands, key=key)
    result.sensitivity = {name: float(ranking.get(name, 0.0)) for name in cands}
    lo, hi = 0, len(order)
    scores = {hi: None}
    while hi - lo > 1:
        mid = (lo + hi) // 2
        score = prober.score(order[:mid], level)
        if _log_step(result, prober, f"most sensitive {mid}", order[:mid], score):
            hi, scores[hi] = mid, score
        else:
            lo = mid
    chosen = list(order[:hi])
    final = scores.get(hi)
    if final is None:
        final = prober.score(chosen, level)
    chosen, final = _prune(result, prober, chosen, final, level, cands)
    chosen = [c for c in cands if c in set(chosen)]
    result.promoted, result.final_score, result.evaluations = chosen, final, prober.evaluations
    result.settings = prober.settings(chosen, level)
    OPT_INFO(f"mixed precision search (similarity ranking): {len(chosen)} layer(s) at {level}: {', '.join(chosen)}; "
             f"metric {final:.6f} (float {result.float_score:.6f}); {prober.evaluations} evaluations")
    return result


def cut_point_search(graph: QuantizeGraph, score_fn: ScoreFn, float_score: float, auto: AutoSearch,
                     candidates: Optional[Sequence[str]] = None, level: str = "16bit") -> SearchResult:
    """Upstream's one-cut search: the largest p such that promoting candidates[p:] satisfies the threshold, found
    by halving p from len(candidates) until satisfied, then probing p + 2^t upward while still satisfied.
    Like the per-layer search, it returns its choice and leaves `graph` as it was; for comparison only."""
    cands = list(candidates) if candidates is not None else candidate_layers(graph)
    prober = _Prober(graph, score_fn, float_score, auto)
    n = len(cands)
    base = prober.score([], None)
    result = SearchResult(level, [], float_score, base, base)
    scores: Dict[int, float] = {n: base}

    def sat(p: int) -> bool:
        if p not in scores:
            scores[p] = prober.score(cands[p:], level)
        _log_step(result, prober, f"cut at {p}", cands[p:], scores[p])
        return prober.satisfied(scores[p])

    p = n
    while not sat(p):
        if p == 0:
            result.reached, result.evaluations = False, prober.evaluations
            return result
        p //= 2
    best, t = p, 0
    while best + 2 ** t <= n and best < n:
        if sat(best + 2 ** t):
            best, t = best + 2 ** t, t + 1
        elif t == 0:
            break
        else:
            t = 0
    result.promoted = cands[best:]
    result.settings = prober.settings(result.promoted, level)
    result.final_score = scores[best]
    result.evaluations = prober.evaluations
    return result
