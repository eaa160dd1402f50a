"""Scale unification for multi-input layers (`unify_scales_for_concat`, `unify_scales_for_multi_inputs_operators`).

A quantized Concat whose branches carry different scales must requantize every branch; an Eltwise ADD must
cross-multiply its inputs. Both disappear when the branches share one scale. This pass runs on the calibrated float
graph, before quantization: for each target layer it walks upstream from every input, through layers whose output
scale simply follows their input (shape and data-movement ops, max pooling, ...), to the nearest layers whose
output scale comes from their own calibrated range (Conv, FC, Eltwise, norms, LUT activations, Input, ...), and
rewrites those layers' calibrated ranges (`min`/`max`) so they all quantize to one common scale with zero point 0.

How a layer's output scale is set is read from the quantize functions themselves: a provisional quantization of
the whole graph gives every tensor's scale and type, and a layer that is not a known scale-deciding type is quantized
alone with probe input scales (does its output follow?) and with a stretched output range (does its output follow
that?). Nothing is guessed from names, so operator plugins take part without any registration.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from ..config.calibration_values import UNIFY_ALLOWED_TEXT as ALLOWED_TEXT  # noqa: F401  (re-exported)
from ..config.calibration_values import UNIFY_METHODS as METHODS  # noqa: F401  (re-exported)
from ..config.calibration_values import (  # the field value's torch-free grammar (the cfg reader's); re-exported
    UnifyRule,
    UnifyRules,
    parse_unify_rules,
)
from ..errors import QuantOptError
from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.tables import RangeTable, TensorQuant, quant_of, ranges_of
from ..graph.tensor import PyTensor
from ..log import LOGGER, OPT_DEBUG, OPT_INFO
from ..quant.hardware import FLT_EPSILON
from ..quant.params import QuantMode, integer_range
from ..quantizer import quantize_graph

SCALE_DECIDING_TYPES = frozenset((
    "Convolution", "ConvTranspose", "Convolution3D", "ConvTranspose3D", "DepthwiseConv", "FullyConnected", "RNN",
    "BasicLSTM", "GRUv1", "GRUv3", "BatchNorm", "LayerNorm", "InstanceNorm", "GroupNorm", "MatMul", "Eltwise",
    "Input", "Constant"))
"""Types whose output scale is always set from their own calibrated range (upstream's list); other types are
probed."""

PROBE_SCALES = (0.5, 2.0, 10.0)
"""Input scales tried when probing whether a layer's output scale follows its input's."""

PROBE_RANGE_FACTOR = 2.0
"""Output range stretch tried when probing whether a layer's output scale follows its calibrated range."""

_THROUGH, _THROUGH_ALL, _LEAF = "through", "through_all", "leaf"


RuleSource = Union[None, str, Sequence[UnifyRule], Any]
"""Rules for every layer (a sequence or field text), or a per-layer cfg value whose `get(node)` gives them."""


def _rules_resolver(rules: RuleSource) -> Callable[[PyNode], Sequence[UnifyRule]]:
    if rules is None or (isinstance(rules, str) and not rules.strip()):
        return lambda node: ()
    if isinstance(rules, str):
        parsed = parse_unify_rules(rules)
        return lambda node: parsed
    if hasattr(rules, "get") and not isinstance(rules, (list, tuple, dict)):
        def per_layer(node: PyNode) -> Sequence[UnifyRule]:
            v = rules.get(node)
            return parse_unify_rules(v) if isinstance(v, str) else (v or ())
        return per_layer
    fixed = UnifyRules(rules)
    return lambda node: fixed


# ------------------------------------------------------------------------------------------------ the report
@dataclass
class RangeChange:
    """One tensor whose calibrated range was rewritten."""

    layer: str
    layer_type: str
    tensor: str
    old_range: Tuple[float, float]
    new_range: Tuple[float, float]
    old_scale: float


@dataclass
class UnifiedGroup:
    """Target layers aligned together (targets sharing an upstream layer are merged) and what changed."""

    targets: List[str]
    method: str
    scale: float
    changes: List[RangeChange] = field(default_factory=list)


@dataclass
class UnifyReport:
    groups: List[UnifiedGroup] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)
    """Target layer -> why it was left alone."""

    @property
    def changed_layers(self) -> List[str]:
        return [c.layer for g in self.groups for c in g.changes]

    def group_of(self, target: str) -> Optional[UnifiedGroup]:
        return next((g for g in self.groups if target in g.targets), None)

    def extend(self, other: UnifyReport) -> UnifyReport:
        self.groups += other.groups
        self.skipped.update(other.skipped)
        return self


# ------------------------------------------------------------------------------------------------ the pass
@dataclass
class _Target:
    node: PyNode
    rule: UnifyRule
    order: int
    leaves: List[Tuple[PyNode, PyTensor]]
    needs: List[float]


def _scale(q: TensorQuant) -> float:
    s = q.scale
    return float(s.reshape(-1)[0]) if hasattr(s, "reshape") else float(s)


def _zp(q: TensorQuant) -> int:
    z = q.zerop
    return int(z.reshape(-1)[0]) if hasattr(z, "reshape") else int(z)


def _signed(q: TensorQuant) -> bool:
    return q.qmin is not None and q.qmin < 0


def _range(ranges: RangeTable, t: PyTensor) -> Tuple[float, float]:
    r = ranges.get(t)
    lo = float(r.min.reshape(-1)[0]) if hasattr(r.min, "reshape") else float(r.min or 0.0)
    hi = float(r.max.reshape(-1)[0]) if hasattr(r.max, "reshape") else float(r.max or 0.0)
    return lo, hi


def _unquantifiable(qnode: PyNode) -> bool:
    return not qnode.quantized or qnode.params.get("unquantifiable") is True


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The provisional quantization and the probes log nothing: the real quantization says it all once."""
    def drop(record: logging.LogRecord) -> bool:
        return False

    LOGGER.addFilter(drop)
    try:
        yield
    finally:
        LOGGER.removeFilter(drop)


class _Pass:
    """One run: the provisional quantization, cached layer classification, the walks and the rewrite."""

    def __init__(self, graph: PyGraph) -> None:
        self.graph = graph
        previous = getattr(graph, "quantgraph", None)
        with _quiet():
            self.qgraph = quantize_graph(graph)
        if hasattr(graph, "quantgraph"):
            graph.quantgraph = previous
        self.qnodes = {n.name: n for n in self.qgraph.nodes}
        self.quant = self.qgraph.quant  # the provisional quantization's params (graph/tables.py)
        self.kinds: Dict[Tuple[str, int], Optional[str]] = {}

    def qtensor(self, node: PyNode, index: int, inputs: bool) -> PyTensor:
        q = self.qnodes[node.name]
        return (q.inputs if inputs else q.outputs)[index]

    # ---- how a layer's output scale is set
    def kind(self, node: PyNode, out_index: int) -> Optional[str]:
        key = (node.name, out_index)
        if key not in self.kinds:
            with _quiet():
                self.kinds[key] = self._classify(node, out_index)
        return self.kinds[key]

    def _classify(self, node: PyNode, out_index: int) -> Optional[str]:
        q = self.qnodes[node.name]
        out = q.outputs[out_index]
        if str(node.type) == "Concat":
            bits = self.quant.get(out).qbits
            same = all(not self.quant.get(t).qinvariant and (t.dtype, self.quant.get(t).qbits) == (out.dtype, bits)
                       for t in q.inputs)
            return _THROUGH_ALL if same else _LEAF
        if str(node.type) in SCALE_DECIDING_TYPES:
            return _LEAF
        if node.inputs and self._follows_input(node, out_index):
            return _THROUGH
        if self._follows_range(node, out_index):
            return _LEAF
        return None

    def _alone(self, node: PyNode) -> PyNode:
        qnode = self.qnodes[node.name]
        return node.detached_copy(inputs=list(qnode.inputs), input_ranges=ranges_of(qnode), input_quant=self.quant)

    def _follows_input(self, node: PyNode, out_index: int) -> bool:
        for probe in PROBE_SCALES:
            m = self._alone(node)
            table = quant_of(m)  # the copy's own params
            if table.get(m.inputs[0]).qinvariant:
                return False
            table.of(m.inputs[0]).scale = probe
            try:
                m.quantize()
            except (QuantOptError, ValueError, RuntimeError, ZeroDivisionError):
                return False
            got = table.get(m.outputs[out_index])
            if got.qinvariant or abs(_scale(got) - probe) > 1e-6 * probe:
                return False
        return True

    def _follows_range(self, node: PyNode, out_index: int) -> bool:
        scales = []
        lo, hi = _range(self.graph.ranges, node.outputs[out_index])
        if hi - lo < FLT_EPSILON:
            lo, hi = -1.0, 1.0
        for factor in (1.0, PROBE_RANGE_FACTOR):
            m = self._alone(node)
            ranges_of(m).set(m.outputs[out_index], lo * factor, hi * factor)
            try:
                m.quantize()
            except (QuantOptError, ValueError, RuntimeError, ZeroDivisionError):
                return False
            got = quant_of(m).get(m.outputs[out_index])
            if got.qinvariant:
                return False
            scales.append(_scale(got))
        return abs(scales[0] / scales[1] - PROBE_RANGE_FACTOR) < 1e-3

    # ---- walking upstream
    def walk(self, tensor: PyTensor, depth: int) -> Tuple[List[Tuple[PyNode, PyTensor]], str]:
        """The nearest scale-deciding (layer, output tensor) pairs above `tensor`, or ([], why not)."""
        leaves: List[Tuple[PyNode, PyTensor]] = []
        stack = [(tensor, 0)]
        while stack:
            t, d = stack.pop()
            node = t.pnode
            index = [o.name for o in node.outputs].index(t.name)
            q = self.qnodes.get(node.name)
            if q is None or _unquantifiable(q):
                return [], f"layer '{node.name}' is not quantized"
            if self.quant.get(q.outputs[index]).qinvariant:
                return [], f"tensor '{t.name}' holds integers (scale 1)"
            if depth and d > depth:
                return [], f"no scale-deciding layer within depth {depth} above '{tensor.name}'"
            kind = self.kind(node, index)
            if kind is None:
                return [], f"cannot tell how layer '{node.name}' ({node.type}) sets its output scale"
            if kind == _LEAF:
                if all(lt is not t for _, lt in leaves):
                    leaves.append((node, t))
                continue
            parents = node.inputs if kind == _THROUGH_ALL else node.inputs[:1]
            stack.extend((p, d + 1) for p in reversed(parents))
        return leaves, ""

    # ---- one target
    def target(self, node: PyNode, rule: UnifyRule, order: int, skipped: Dict[str, str]) -> Optional[_Target]:
        q = self.qnodes.get(node.name)
        if q is None or _unquantifiable(q):
            skipped[node.name] = "the layer is not quantized"
            return None
        out = self.quant.get(q.outputs[0])
        if out.qinvariant:
            skipped[node.name] = "its output holds integers (scale 1)"
            return None
        branches = [(t, self.quant.get(qt)) for t, qt in zip(node.inputs, q.inputs)
                    if not self.quant.get(qt).qinvariant and t.pnode.name in self.qnodes and
                    not _unquantifiable(self.qnodes[t.pnode.name])]
        if len({id(t) for t, _ in branches}) < 2:
            skipped[node.name] = "fewer than two quantized input branches"
            return None
        scales = [_scale(qt) for _, qt in branches]
        zps = {_zp(qt) for _, qt in branches}
        if str(node.type) == "Concat":
            scales.append(_scale(out))
            zps.add(_zp(out))
        if max(scales) / (min(scales) + FLT_EPSILON) <= rule.threshold and len(zps) == 1:
            skipped[node.name] = f"input scales already within threshold {rule.threshold:g}"
            return None
        leaves: List[Tuple[PyNode, PyTensor]] = []
        for t, _ in branches:
            found, why = self.walk(t, rule.depth)
            if not found:
                skipped[node.name] = why
                return None
            leaves += [lf for lf in found if all(lf[1] is not x[1] for x in leaves)]
        bits = int(out.qbits or 0)
        for leaf, t in leaves:
            lt = self.quant.get(self.qtensor(leaf, [o.name for o in leaf.outputs].index(t.name), inputs=False))
            if int(lt.qbits or 0) != bits:
                skipped[node.name] = (f"upstream layer '{leaf.name}' has {lt.qbits}-bit output, the layer "
                                      f"{bits}-bit")
                return None
        ref_signed = _signed(out) if str(node.type) == "Concat" else None
        needs = [self.need(leaf, t, ref_signed) for leaf, t in leaves]
        if str(node.type) == "Concat":  # the output range decides a mixed-type Concat's scale: align it too
            leaves.append((node, node.outputs[0]))
        return _Target(node, rule, order, leaves, [n for n in needs if n is not None])

    def need(self, node: PyNode, t: PyTensor, signed: Optional[bool]) -> Optional[float]:
        """The scale at which a zero-centred (signed) or zero-based (unsigned) grid covers `t`'s calibrated range,
        in the given signedness (default: the tensor's own)."""
        qt = self.quant.get(self.qtensor(node, [o.name for o in node.outputs].index(t.name), inputs=False))
        signed = _signed(qt) if signed is None else signed
        lo, hi = _range(self.graph.ranges, t)
        absmax = max(abs(lo), abs(hi))
        if absmax < FLT_EPSILON:
            return None
        restricted = QuantMode.from_name(node.settings.q_mode_activation).is_restricted if node.settings else False
        qmin, qmax = integer_range(int(qt.qbits), signed, restricted=signed and restricted)
        return (qmax - qmin) / (2.0 * absmax if signed else absmax)


def _common_scale(method: str, needs: List[float], out_need: Optional[float]) -> Optional[float]:
    if method == "out":
        return out_need
    if not needs:
        return None
    if method == "max":
        return max(needs)
    if method == "min":
        return min(needs)
    return sum(needs) / len(needs)


def _groups(targets: List[_Target]) -> List[List[_Target]]:
    """Targets sharing an upstream tensor are aligned together (union-find over the tensors they rewrite)."""
    parent = list(range(len(targets)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: Dict[int, int] = {}
    for i, tg in enumerate(targets):
        for _, t in tg.leaves:
            j = owner.setdefault(id(t), i)
            parent[find(i)] = find(j)
    groups: Dict[int, List[_Target]] = {}
    for i, tg in enumerate(targets):
        groups.setdefault(find(i), []).append(tg)
    return list(groups.values())


def unify_scales(graph: PyGraph, rules: RuleSource) -> UnifyReport:
    """Rewrite calibrated output ranges so each target layer's input branches share one scale.

    `rules`: field text, a sequence of UnifyRule for every layer, or a per-layer cfg value. Needs calibrated
    ranges and each layer's `settings`. Returns what changed and why targets were left alone.
    """
    resolve = _rules_resolver(rules)
    wanted = []
    for order, n in enumerate(graph.nodes):
        rule = UnifyRules(resolve(n)).rule_for(str(n.type))
        if rule is not None and rule.method != "skip" and len(n.inputs) > 1:
            wanted.append((order, n, rule))
    report = UnifyReport()
    if not wanted:
        return report
    run = _Pass(graph)
    targets = [tg for order, n, rule in wanted if (tg := run.target(n, rule, order, report.skipped)) is not None]
    for group in _groups(targets):
        group.sort(key=lambda tg: tg.order)
        last = group[-1]
        needs = [v for tg in group for v in tg.needs]
        out_t = last.node.outputs[0]
        scale = _common_scale(last.rule.method, needs, run.need(last.node, out_t, None))
        names = [tg.node.name for tg in group]
        if scale is None or scale <= 0:
            for name in names:
                report.skipped[name] = "the calibrated ranges are all zero"
            continue
        result = UnifiedGroup(names, last.rule.method, float(scale))
        done: set = set()
        for tg in group:
            for leaf, t in tg.leaves:
                if id(t) in done:
                    continue
                done.add(id(t))
                qt = run.quant.get(run.qtensor(leaf, [o.name for o in leaf.outputs].index(t.name), inputs=False))
                old = _range(graph.ranges, t)
                frange = float(qt.qmax - qt.qmin) / scale
                new = (-frange / 2.0, frange / 2.0) if _signed(qt) else (0.0, frange)
                if old == new:
                    continue
                graph.ranges.set(t, *new)
                result.changes.append(RangeChange(leaf.name, str(leaf.type), t.name, old, new, _scale(qt)))
        report.groups.append(result)
        _log(result, last.rule)
    for name, why in report.skipped.items():
        OPT_DEBUG(f"unify scales: layer '{name}' left alone: {why}")
    return report


def _log(group: UnifiedGroup, rule: UnifyRule) -> None:
    OPT_INFO(f"unify scales: {', '.join(repr(n) for n in group.targets)} aligned to scale {group.scale:.6g} "
             f"(method {group.method}, depth {rule.depth or 'unlimited'}, threshold {rule.threshold:g})")
    for c in group.changes:
        OPT_INFO(f"unify scales:   {c.layer_type} '{c.layer}' output '{c.tensor}' range "
                 f"[{c.old_range[0]:.6g}, {c.old_range[1]:.6g}] (scale {c.old_scale:.6g}) -> "
                 f"[{c.new_range[0]:.6g}, {c.new_range[1]:.6g}]")


def unify_rules_from_cfg(cfg: Any) -> List[RuleSource]:
    """The unifications the cfg asks for, in order: `unify_scales_for_concat` (Concat, its max depth and
    threshold, method `out`), then `unify_scales_for_multi_inputs_operators` (per-layer rules)."""
    steps: List[RuleSource] = []
    if cfg.unify_scales_for_concat:
        steps.append([UnifyRule("Concat", int(cfg.unify_scales_for_concat_max_depth),
                                float(cfg.unify_scales_for_concat_threshold), "out")])
    rules = cfg.unify_scales_for_multi_inputs_operators
    if _any_rules(rules):
        steps.append(rules)
    return steps


def _any_rules(rules: Any) -> bool:
    if rules is None:
        return False
    values: Iterable[Any] = [rules.global_value] + [v for _, v in rules.rules] if hasattr(rules, "rules") \
        else [rules]
    return any(bool(v) for v in values)
