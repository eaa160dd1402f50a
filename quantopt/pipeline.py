"""Calibrate-and-quantize in one call, for Python users, tests and benchmarks (the CLI goes through OptMaster,
which runs the same steps with logging, data plugins and outputs)."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from .calibration.collect import calibrate_graph, collect_activation_statistics, collect_weight_statistics
from .config.layer_settings import LayerSettings, check_settings, with_operator_defaults
from .graph.graph import PyGraph, QuantizeGraph
from .graph.values import to_float
from .passes.inf_mask import detect_inf_mask_nodes
from .passes.merge_matmul_mul import merge_matmul_mul
from .passes.per_channel_fallback import fall_back_to_per_tensor
from .quantizer import quantize_graph
from .tuning.unify_scales import RuleSource, unify_scales

Batch = Union[torch.Tensor, Sequence[torch.Tensor]]


def quantize_model(graph: QuantizeGraph, calibration: Iterable[Batch],
                   settings: Union[None, LayerSettings, Mapping[str, Any]] = None,
                   per_layer: Optional[Mapping[str, Mapping[str, Any]]] = None,
                   unify: RuleSource = None, global_calibration: Optional[str] = None,
                   merge_matmul_mul_pass: bool = True) -> QuantizeGraph:
    """Quantized copy of `graph` calibrated on `calibration` batches.

    `settings`: a LayerSettings or a dict of its fields for every layer (default: the cfg defaults);
    `per_layer`: layer name -> dict of fields overriding `settings` for that layer;
    `unify`: scale unification rules in `unify_scales_for_multi_inputs_operators` syntax (text or UnifyRule list),
    e.g. "[(Concat, 20, 1.05, out)]" for what `unify_scales_for_concat` does;
    `global_calibration`: methods in the cfg field's syntax (e.g. "bias_correction[2] & adaround[2]"), run on the
    calibration batches after local calibration; the float constants are restored once quantized;
    `merge_matmul_mul_pass`: the cfg field `enable_pass_merge_matmul_mul` (upstream's default, on): constant factors
    after MatMuls are folded into them first, which rewrites `graph` itself (passes/merge_matmul_mul.py).
    """
    if merge_matmul_mul_pass:
        merge_matmul_mul(graph)
    base = settings if isinstance(settings, LayerSettings) else LayerSettings(**dict(settings or {}))
    for n in graph.nodes:
        own = dict((per_layer or {}).get(n.name, {}))
        n.settings = with_operator_defaults(dataclasses.replace(base, **own, explicit=base.explicit | frozenset(own)),
                                            n)
        check_settings(n.settings, n)
    fall_back_to_per_tensor(graph)
    detect_inf_mask_nodes(graph)
    collect_weight_statistics(graph)
    batches = [[b] if isinstance(b, torch.Tensor) else list(b) for b in calibration]
    collect_activation_statistics(graph, batches)
    calibrate_graph(graph)
    if unify:
        unify_scales(graph, unify)
    if not global_calibration:
        return quantize_graph(graph)
    from .tuning.global_methods import apply_global_calibration, restore_float_constants

    apply_global_calibration(graph, global_calibration, batches)
    try:
        return quantize_graph(graph)
    finally:
        restore_float_constants(graph)


def run_quantized(qgraph: PyGraph, inputs: Batch) -> list:
    """Integer forward; returns the outputs dequantized to float32 (integer outputs of scale 1 as they are)."""
    qgraph.forward([inputs] if isinstance(inputs, torch.Tensor) else list(inputs))
    return [to_float(t) for t in qgraph.output_tensors]
