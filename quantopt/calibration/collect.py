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
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..config.upstream_defects import MASK_AS_DATA
from ..errors import DataError
from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..graph.recorded import ForwardRecord
from ..graph.tables import TensorStatistics, ranges_of, statistics_of
from ..graph.tensor import PyTensor
from ..quant.params import QuantMode
from .inf_mask import apply_inf_mask_ranges
from .statistics import (
    INF_MASK_THRESHOLD,
    ExtremaState,
    StatisticsConfig,
    plain_extrema,
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
                                  record: Optional[ForwardRecord] = None) -> int:
    """Fold every batch's layer outputs into their tensors' statistics (per channel of the last axis too where the
    layer's activation mode is per channel), and the values the float forward left in the layer's placeholders (per
    tensor only: their shapes are the layer's own business); returns the number of batches. With `record`, the
    layer outputs of its first batches are kept there (graph/recorded.py)."""
    configs: Dict[int, StatisticsConfig] = {
        id(n): _stat_config(n, n.settings.q_strategy_activation, key_axis=-1 if _per_channel_activations(n) else None,
                            activation=True)
        for n in graph.nodes}
    placeholder_configs: Dict[int, StatisticsConfig] = {
        id(n): _stat_config(n, n.settings.q_strategy_activation, key_axis=None, activation=True) for n in graph.nodes}
    count = 0
    table = graph.statistics
    updates = _PassUpdates()

    def hook(node: PyNode) -> None:
        cfg = configs[id(node)]
        for t in node.outputs:
            if node.type == "Input" and t.betensor.is_floating_point() and bool(torch.isnan(t.betensor).any()):
                raise DataError(f"calibration batch {count} has NaN values in input '{t.name}'")
            updates.update(table.of(t), t.betensor, cfg, count)
        for t in node.placeholders:
            if t.betensor.numel() > 0 and t.betensor.is_floating_point():
                updates.update(table.of(t), t.betensor, placeholder_configs[id(node)], count)
        if record is not None:
            record.keep(node)

    try:
        with torch.no_grad():
            for inputs in batches:
                if record is not None:
                    record.start_batch(inputs)
                graph.forward(inputs, after_node=hook)
                count += 1
    finally:
        updates.store()
    return count


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
        key = id(stats)
        if cfg.extrema_only and x.numel():
            clipped = plain_extrema(x.detach(), float(cfg.mask_threshold))
            if clipped is not None:
                held = self._states.get(key)
                if held is not None and batch_index != 0:
                    held[1].fold(*clipped, cfg.momentum)
                    return
                if starts_over(stats, batch_index):
                    stats.reset()
                    self._states[key] = (stats, ExtremaState(*clipped, *clipped))
                    return
                state = ExtremaState.of(stats)
                state.fold(*clipped, cfg.momentum)
                self._states[key] = (stats, state)
                return
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
