"""The statistics pass over a graph and local calibration of every tensor.

Statistics of activations are folded in one float forward per calibration batch (a hook after each layer), so
memory does not grow with the number of batches. A layer's placeholders (`node.placeholders`: tensors inside the
layer that its float forward sets, such as a recurrent cell's gate activations) are folded after its forward like
its outputs, per tensor, and calibrated with the layer's activation strategy, so its quantize function can read their
ranges. Weights (every floating constant but biases) get their
statistics once, per tensor and per output channel (axis 0). Each layer's `settings` (a LayerSettings) decide the
strategies and hence which statistics are worth computing.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..config.upstream_defects import MASK_AS_DATA
from ..errors import DataError
from ..graph.graph import PyGraph
from ..graph.grouped import Unsplit, batch_parts, failure_reason, group_size, groupable, same_shapes
from ..graph.node import PyNode
from ..graph.recorded import ForwardRecord
from ..graph.tables import TensorStatistics, ranges_of, statistics_of
from ..graph.tensor import PyTensor
from ..log import OPT_DEBUG, OPT_WARN
from ..quant.params import QuantMode
from .finite_mask import finite_mask_thresholds
from .inf_mask import apply_inf_mask_ranges
from .statistics import (
    INF_MASK_THRESHOLD,
    ExtremaState,
    StatisticsConfig,
    plain_extrema,
    plain_extrema_rows,
    starts_over,
    update_statistics,
)
from .strategies import apply_strategy, parse_strategy

if TYPE_CHECKING:
    from ..config.layer_settings import LayerSettings

NOT_WEIGHTS = ("biases",)
"""Constants that are never calibrated as weights: biases are quantized with the input and weight scales."""


def weight_constants(node: PyNode) -> List[PyTensor]:
    """The constants of a layer that are calibrated and quantized like weights."""
    return [t for key, t in node.constants.items()
            if key not in NOT_WEIGHTS and t.betensor.is_floating_point() and t.betensor.numel() > 0]


def _stat_config(node: PyNode, strategy: str, key_axis: int | None = None,
                 activation: bool = False) -> StatisticsConfig:
    """What to collect for one tensor: what its strategy needs, and for activations the histogram the
    `min_activation_sqnr_db` check reads (calibration/low_sqnr.py)."""
    st = parse_strategy(strategy)
    s = node.settings
    histogram = st.needs_histogram or (activation and s.min_activation_sqnr_db > 0.0)
    mask_threshold = math.inf if MASK_AS_DATA in s.upstream_defects else INF_MASK_THRESHOLD
    return StatisticsConfig(momentum=s.running_statistic_momentum, histc_bins=s.histc_bins,
                            need_histogram=histogram, need_moments=st.needs_moments, key_axis=key_axis,
                            trim=s.trim_infinity_before_statistic or None, mask_threshold=mask_threshold)


def collect_weight_statistics(graph: PyGraph) -> None:
    """Per-tensor and per-channel (axis 0) statistics of every weight constant."""
    for n in graph.nodes:
        for t in weight_constants(n):
            graph.statistics.set(t, weight_statistics(n, t))


def weight_statistics(node: PyNode, t: PyTensor) -> TensorStatistics:
    """New statistics of one weight constant of `node` from its values (per tensor, and per channel along axis 0)."""
    stats = TensorStatistics()
    cfg = _stat_config(node, node.settings.q_strategy_weight, key_axis=0 if t.betensor.dim() > 0 else None)
    update_statistics(stats, t.betensor, cfg, 0)
    return stats


def _per_channel_activations(node: PyNode) -> bool:
    return QuantMode.from_name(node.settings.q_mode_activation).is_per_channel


def recalibrate_weight(node: PyNode, t: PyTensor, settings: Optional[LayerSettings] = None) -> None:
    """Statistics and calibrated ranges of one weight constant again, after its float values changed, with the
    layer's settings (or `settings`: those its quantize function uses, when it replaces some)."""
    s = settings if settings is not None else node.settings
    stats = weight_statistics(node, t)
    statistics_of(node).set(t, stats)
    symmetric = not QuantMode.from_name(s.q_mode_weight).is_asymmetric
    ranges = ranges_of(node)
    ranges.set(t, *apply_strategy(stats, s.q_strategy_weight, s.q_bits_weight, symmetric=symmetric,
                                  ir_range=t.ir_range, per_channel=False))
    if stats.extrema_min_key_axis is not None:
        ranges.set_channels(t, *apply_strategy(stats, s.q_strategy_weight, s.q_bits_weight,
                                               symmetric=symmetric, ir_range=t.ir_range, per_channel=True), axis=0)


def collect_activation_statistics(graph: PyGraph, batches: Iterable[Sequence[torch.Tensor]],
                                  record: Optional[ForwardRecord] = None, group: Optional[int] = None) -> int:
    """Fold every batch's layer outputs into their tensors' statistics (per channel of the last axis too where the
    layer's activation mode is per channel), and the values the float forward left in the layer's placeholders (per
    tensor only: their shapes are the layer's own business); returns the number of batches. With `record`, the
    layer outputs of its first batches are kept there (graph/recorded.py).

    Batches of one shape after the first (and after those the record keeps) are run `group` at a time as one
    forward of their concatenation (graph/grouped.py; default: `group_size` of the first batch's layer outputs), and
    each batch's statistics are folded from its own rows of every output, in batch order: the statistics are those
    of one forward per batch, bit for bit, while the per-layer cost of a forward is paid once per group. A graph
    that cannot run a group (a layer that holds one IR batch only; placeholders, whose rows are the layer's
    business; an output that does not split into the batches' rows) has that group and the rest of the pass run
    batch by batch: nothing of a failed group is folded, and an error of the data itself recurs in its own batch."""
    run = _StatisticsPass(graph, record, group)
    try:
        with torch.no_grad():
            pending: List[List[torch.Tensor]] = []
            for inputs in batches:
                inputs = list(inputs)
                if pending and (len(pending) == run.group or not same_shapes(pending[0], inputs)):
                    run.group_forward(pending)
                    pending = []
                if run.alone() or not groupable(graph, inputs):
                    run.forward(inputs)
                else:
                    pending.append(inputs)
            if pending:
                run.group_forward(pending)
    finally:
        run.updates.store()
        run.mark_mask_thresholds()
    return run.count


class _StatisticsPass:
    """The statistics pass's state: per-layer configs, the pending statistics updates, the batch count, and how many
    batches a forward takes (`group`, 1 until the first batch has shown what its outputs cost)."""

    def __init__(self, graph: PyGraph, record: Optional[ForwardRecord], group: Optional[int]) -> None:
        if group is not None and group < 1:
            raise ValueError(f"group must be at least 1, not {group}")
        self.graph = graph
        self.record = record
        self.count = 0
        self.updates = _PassUpdates()
        self.chosen = group
        self.group = 1
        self.configs: Dict[int, StatisticsConfig] = {
            id(n): _stat_config(n, n.settings.q_strategy_activation,
                                key_axis=-1 if _per_channel_activations(n) else None, activation=True)
            for n in graph.nodes}
        # with detect_finite_masks, the layers of finite attention masks take theirs as mask values
        # (calibration/finite_mask.py), unless their settings take mask values as data (mask_as_data)
        self.mask_thresholds: Dict[int, float] = {}
        wanted = any(n.settings.detect_finite_masks for n in graph.nodes)
        thresholds = finite_mask_thresholds(graph) if wanted else {}
        for n in graph.nodes:
            threshold = thresholds.get(n.name)
            cfg = self.configs[id(n)]
            if threshold is not None and n.settings.detect_finite_masks and math.isfinite(cfg.mask_threshold) \
                    and threshold < cfg.mask_threshold:
                self.configs[id(n)] = replace(cfg, mask_threshold=threshold)
                self.mask_thresholds[id(n)] = threshold
        self.placeholder_configs: Dict[int, StatisticsConfig] = {
            id(n): _stat_config(n, n.settings.q_strategy_activation, key_axis=None, activation=True)
            for n in graph.nodes}

    def mark_mask_thresholds(self) -> None:
        """Write the finite-mask thresholds into the statistics of the layers that used one (the analysis leaves
        the same positions out of its comparisons; a statistic file keeps them)."""
        table = self.graph.statistics
        for n in self.graph.nodes:
            threshold = self.mask_thresholds.get(id(n))
            if threshold is None:
                continue
            for t in n.outputs:
                stats = table.of(t)
                stats.inf_mask_threshold = torch.tensor(threshold, dtype=torch.float64)
                if stats.inf_mask_high is not None:
                    OPT_WARN(f"layer '{n.name}' ({n.type}): on a finite attention mask's path, "
                             f"{int(stats.inf_mask_high)} value(s) of at least {threshold:g} were left out of the "
                             "statistics with the mask values; they saturate to the integer maximum "
                             "(docs/statistics-and-dump.md)")

    def alone(self) -> bool:
        """Whether the next batch runs by itself: the first one, those the record keeps, or no grouping."""
        recording = self.record is not None and self.record.wants_more()
        return self.count == 0 or recording or self.group == 1

    def forward(self, inputs: List[torch.Tensor]) -> None:
        """One batch's forward, its statistics folded layer by layer (the first also sets `group`)."""
        table = self.graph.statistics
        output_bytes = 0

        def hook(node: PyNode) -> None:
            nonlocal output_bytes
            cfg = self.configs[id(node)]
            for t in node.outputs:
                _check_input(node, t.betensor, t.name, self.count)
                self.updates.update(table.of(t), t.betensor, cfg, self.count)
                output_bytes += t.betensor.nbytes
            for t in _placeholder_values(node):
                self.updates.update(table.of(t), t.betensor, self.placeholder_configs[id(node)], self.count)
            if self.record is not None:
                self.record.keep(node)

        if self.record is not None:
            self.record.start_batch(inputs)
        self.graph.forward(inputs, after_node=hook)
        if self.count == 0 and not any(_placeholder_values(n) for n in self.graph.nodes):
            self.group = self.chosen if self.chosen is not None else group_size(output_bytes)
        self.count += 1

    def group_forward(self, group: List[List[torch.Tensor]]) -> None:
        """Batches of one shape as one forward of their concatenation, each batch's statistics folded from its rows
        in batch order (or, where the graph cannot run them so, one forward each and no grouping from then on)."""
        k = len(group)
        if k == 1:
            self.forward(group[0])
            return
        table = self.graph.statistics
        # per output: its statistics, each batch's extrema where the extrema path takes them (found while the values
        # are in cache) or else its values, and the config
        held: List[Tuple[TensorStatistics, List[Optional[Tuple[float, float]]], List[Optional[torch.Tensor]],
                         StatisticsConfig]] = []

        def hook(node: PyNode) -> None:
            if _placeholder_values(node):
                raise Unsplit()  # a layer that set none in the first batch
            cfg = self.configs[id(node)]
            for t in node.outputs:
                parts = batch_parts(t.betensor, t.ir_shape, k)
                if parts is None:
                    raise Unsplit()
                for j, part in enumerate(parts):
                    _check_input(node, part, t.name, self.count + j)
                extrema = _parts_extrema(t.betensor, parts, cfg) if cfg.extrema_only else [None] * k
                held.append((table.of(t), extrema, [p if e is None else None for p, e in zip(parts, extrema)], cfg))

        try:
            self.graph.forward([torch.cat(parts) for parts in zip(*group)], after_node=hook)
        except Exception as error:  # the batches run again one by one: a real error recurs
            OPT_DEBUG(f"statistics pass: batches {self.count} to {self.count + k - 1} and the rest run one per "
                      f"forward: {failure_reason(error)}")
            self.group = 1
            for inputs in group:
                self.forward(inputs)
            return
        for j in range(k):
            for stats, extrema, parts, cfg in held:
                self.updates.update_with(stats, parts[j], extrema[j], cfg, self.count + j)
        self.count += k


def _placeholder_values(node: PyNode) -> List[PyTensor]:
    """The layer's placeholders holding float values its forward set: what the statistics fold of them (their rows
    are the layer's own layout, so a grouped forward cannot split them)."""
    return [t for t in node.placeholders if t.betensor.numel() > 0 and t.betensor.is_floating_point()]


def _check_input(node: PyNode, x: torch.Tensor, name: str, batch_index: int) -> None:
    if node.type == "Input" and x.is_floating_point() and bool(torch.isnan(x).any()):
        raise DataError(f"calibration batch {batch_index} has NaN values in input '{name}'")


def _parts_extrema(value: torch.Tensor, parts: List[torch.Tensor],
                   cfg: StatisticsConfig) -> List[Optional[Tuple[float, float]]]:
    """`plain_extrema` of each batch's part of `value` (`grouped.batch_parts`), by one reduction over its rows (once for
    a value every batch shares); None for an empty part."""
    if not value.numel():
        return [None] * len(parts)
    threshold = float(cfg.mask_threshold)
    if all(p is value for p in parts):
        return [plain_extrema(value.detach(), threshold)] * len(parts)
    return plain_extrema_rows(value.detach().reshape(len(parts), -1), threshold)


class _PassUpdates:
    """`update_statistics` over one pass's batches, with the statistics of tensors on the extrema path (the default
    strategies) kept as Python floats (`ExtremaState`) until `store`: per batch one aminmax and a few float
    operations instead of four new 0-d tensors, which cost as much as a small layer's forward. A batch the extrema
    path cannot take (NaN, mask values, an empty tensor) stores the tensor's state first and goes through
    `update_statistics`; the statistics end the same either way (tests/calibration/test_pass_updates.py)."""

    def __init__(self) -> None:
        self._states: Dict[int, Tuple[TensorStatistics, ExtremaState]] = {}

    def update(self, stats: TensorStatistics, x: torch.Tensor, cfg: StatisticsConfig, batch_index: int) -> None:
        """`update_statistics(stats, x, cfg, batch_index)`, its result in `stats` by `store` at the latest."""
        extrema = plain_extrema(x.detach(), float(cfg.mask_threshold)) if cfg.extrema_only and x.numel() else None
        self.update_with(stats, x, extrema, cfg, batch_index)

    def update_with(self, stats: TensorStatistics, x: Optional[torch.Tensor], extrema: Optional[Tuple[float, float]],
                    cfg: StatisticsConfig, batch_index: int) -> None:
        """`update` given x's `plain_extrema` already, found on the extrema path (then x is not read and may be
        None); None: x goes through `update_statistics`."""
        key = id(stats)
        if extrema is not None:
            held = self._states.get(key)
            if held is not None and batch_index != 0:
                held[1].fold(*extrema, cfg.momentum)
                return
            if starts_over(stats, batch_index):
                stats.reset()
                self._states[key] = (stats, ExtremaState(*extrema, *extrema))
                return
            state = ExtremaState.of(stats)
            state.fold(*extrema, cfg.momentum)
            self._states[key] = (stats, state)
            return
        assert x is not None
        held = self._states.pop(key, None)
        if held is not None:
            held[1].store(stats)
        update_statistics(stats, x, cfg, batch_index)

    def store(self) -> None:
        """Write every held state into its statistics."""
        for stats, state in self._states.values():
            state.store(stats)
        self._states.clear()


def calibrate_graph(graph: PyGraph) -> None:
    """Calibrated ranges (`min`/`max`, and `min_key_axis`/`max_key_axis` for weights and per-channel activations),
    each with min <= 0 <= max. Mask tensors (statistics that saw ±inf or |x| >= 1e30) then get the ranges that keep
    their masking through the integer forward (calibration/inf_mask.py); other tensors are left as calibrated."""
    _calibrate_ranges(graph)
    apply_inf_mask_ranges(graph)


def _calibrate_ranges(graph: PyGraph) -> None:
    for n in graph.nodes:
        calibrate_layer(n)


def calibrate_placeholders(n: PyNode) -> None:
    """Per-tensor ranges of the layer's placeholders that have statistics, with its activation strategy and bits
    (placeholders without statistics keep min/max None: a quantize function that needs them says so)."""
    s = n.settings
    symmetric = not QuantMode.from_name(s.q_mode_activation).is_asymmetric
    table = statistics_of(n)
    for t in n.placeholders:
        st = table.get(t)
        if st.extrema_min is None:
            continue
        ranges_of(n).set(t, *apply_strategy(st, s.q_strategy_activation, s.q_bits_activation,
                                            symmetric=symmetric, ir_range=t.ir_range, per_channel=False))


def calibrate_layer(n: PyNode) -> None:
    """The calibrated ranges of one layer's outputs, placeholders and weight constants from its statistics and
    settings."""
    s = n.settings
    act_symmetric = not QuantMode.from_name(s.q_mode_activation).is_asymmetric
    table, ranges = statistics_of(n), ranges_of(n)
    for t in n.outputs:
        st = table.get(t)
        if st.extrema_min is None:
            raise DataError(f"layer '{n.name}': no statistics were collected for tensor '{t.name}' "
                            "(did the calibration data reach it?)")
        ranges.set(t, *apply_strategy(st, s.q_strategy_activation, s.q_bits_activation,
                                      symmetric=act_symmetric, ir_range=t.ir_range, per_channel=False))
        if _per_channel_activations(n) and st.extrema_min_key_axis is not None:
            ranges.set_channels(t, *apply_strategy(st, s.q_strategy_activation, s.q_bits_activation,
                                                   symmetric=act_symmetric, ir_range=t.ir_range, per_channel=True),
                                axis=-1)
    calibrate_placeholders(n)
    w_symmetric = not QuantMode.from_name(s.q_mode_weight).is_asymmetric
    for t in weight_constants(n):
        st = table.get(t)
        ranges.set(t, *apply_strategy(st, s.q_strategy_weight, s.q_bits_weight, symmetric=w_symmetric,
                                      ir_range=t.ir_range, per_channel=False))
        if st.extrema_min_key_axis is not None:
            ranges.set_channels(t, *apply_strategy(st, s.q_strategy_weight, s.q_bits_weight, symmetric=w_symmetric,
                                                   ir_range=t.ir_range, per_channel=True), axis=0)
