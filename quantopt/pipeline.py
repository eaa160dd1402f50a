"""The calibrate-and-quantize workflow as one sequence of steps, shared by `quantopt --cfg` and the Python API.

`OptMaster` (master.py) runs these steps in this order, timing and logging each, with the cfg's data plugins, checks
and output files around them; `quantize_model` runs the same steps on in-memory batches for Python users, tests and
benchmarks. A step takes the graph (and what it needs) and leaves its result on the graph: settings on its layers,
statistics in its table, ranges on its tensors (docs/architecture.md, the flow at its top and "What a tensor holds,
and the side tables").
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .calibration.collect import calibrate_graph, collect_activation_statistics, collect_weight_statistics
from .calibration.low_sqnr import promote_low_sqnr_activations
from .config.layer_settings import LayerSettings, check_settings, with_operator_defaults
from .graph.graph import PyGraph, QuantizeGraph
from .graph.recorded import ForwardRecord
from .graph.values import to_float
from .passes.control_op_preprocess import control_op_preprocess
from .passes.decompose_activations import decompose_nonmonotonic_activations as decompose_nonmonotonic_activations_pass
from .passes.deep_float import deeply_set_unquantifiable as deeply_set_unquantifiable_pass
from .passes.inf_mask import detect_inf_mask_nodes
from .passes.merge_matmul_mul import merge_matmul_mul
from .passes.mul_to_batchnorm import mul_to_batchnorm
from .passes.per_channel_fallback import fall_back_to_per_tensor
from .passes.sdp_attention import apply_sdpa_settings
from .passes.sdp_attention import scaled_dot_product_attention as scaled_dot_product_attention_pass
from .passes.split_qkv_fc import split_qkv_fc
from .passes.tune_op import tune_op_complicated_activations as tune_op_complicated_activations_pass
from .passes.tune_op import tune_op_softmax as tune_op_softmax_pass
from .passes.unsupported_passes import refuse_convert_resize_to_convolution
from .quantizer import quantize_graph
from .tuning.unify_scales import RuleSource, UnifyReport, unify_scales

Batch = Union[torch.Tensor, Sequence[torch.Tensor]]
StepTimer = Callable[[str], ContextManager[Any]]


def _untimed(_name: str) -> ContextManager[Any]:
    return nullcontext()


GRAPH_PASS_FIELDS = {
    "merge_matmul_mul_pass": "enable_pass_merge_matmul_mul",
    "scaled_dot_product_attention": "enable_pass_scaled_dot_product_attention",
    "decompose_nonmonotonic_activations": "enable_pass_decompose_nonmonotonic_activations",
    "tune_op_softmax": "enable_pass_tune_op_softmax",
    "tune_op_complicated_activations": "enable_pass_tune_op_complicated_activations",
    "split_qkv_fc_in_transformer": "enable_pass_split_qkv_fc_in_transformer",
    "convert_resize_to_convolution": "enable_pass_convert_resize_to_convolution",
}
"""`graph_passes` keyword -> the cfg field that gives it."""


def graph_pass_options(cfg: Any) -> Dict[str, Any]:
    """`graph_passes` keywords from a read cfg (per-layer fields stay per-layer values)."""
    return {key: getattr(cfg, name) for key, name in GRAPH_PASS_FIELDS.items()}


def graph_passes(graph: QuantizeGraph, merge_matmul_mul_pass: bool = True, *,
                 scaled_dot_product_attention: bool = False, decompose_nonmonotonic_activations: Any = False,
                 tune_op_softmax: Any = "[0][0]", tune_op_complicated_activations: Any = "[0][0]",
                 split_qkv_fc_in_transformer: bool = False, convert_resize_to_convolution: bool = False) -> None:
    """Float graph rewrites before settings and statistics (upstream's stage 1, in its order), each given by the
    cfg field of its name (`GRAPH_PASS_FIELDS`; per-layer fields take a value with `.get(node)` or one value):
    scaled_dot_product_attention fuses attention chains into SDPAttention layers (passes/sdp_attention.py);
    convert_resize_to_convolution is refused (passes/unsupported_passes.py); decompose_nonmonotonic_activations
    (passes/decompose_activations.py); the two tune_op fields (passes/tune_op.py); merge_matmul_mul rewrites Muls
    by a non-integer scalar Constant as BatchNorms (passes/mul_to_batchnorm.py), then folds constant factors after
    MatMuls into them (passes/merge_matmul_mul.py); split_qkv_fc_in_transformer
    (passes/split_qkv_fc.py)."""
    if convert_resize_to_convolution:
        refuse_convert_resize_to_convolution()
    if scaled_dot_product_attention:
        scaled_dot_product_attention_pass(graph)
    if decompose_nonmonotonic_activations:
        decompose_nonmonotonic_activations_pass(graph, decompose_nonmonotonic_activations)
    tune_op_softmax_pass(graph, tune_op_softmax)
    tune_op_complicated_activations_pass(graph, tune_op_complicated_activations)
    if merge_matmul_mul_pass:
        mul_to_batchnorm(graph)
        merge_matmul_mul(graph)
    if split_qkv_fc_in_transformer:
        split_qkv_fc(graph)


def settings_from_arguments(graph: QuantizeGraph, settings: Union[None, LayerSettings, Mapping[str, Any]] = None,
                            per_layer: Optional[Mapping[str, Mapping[str, Any]]] = None) -> None:
    """Every layer's LayerSettings from Python values (the library's form of `quantizer.assign_settings`)."""
    base = settings if isinstance(settings, LayerSettings) else LayerSettings(**dict(settings or {}))
    for n in graph.nodes:
        own = dict((per_layer or {}).get(n.name, {}))
        n.settings = with_operator_defaults(dataclasses.replace(base, **own, explicit=base.explicit | frozenset(own)),
                                            n)
        check_settings(n.settings, n)


def finish_settings(graph: QuantizeGraph, deeply_set_unquantifiable: bool = True) -> List[Tuple[str, str]]:
    """After the settings are assigned, before the statistics: the layers of fused attentions get upstream's modes
    (passes/sdp_attention.py), per-channel activations that no reader could take
    fall back to per-tensor (passes/per_channel_fallback.py), shape-only readers of float layers run in float too
    with `enable_pass_deeply_set_unquantifiable` (passes/deep_float.py), and Constant mask values become -FLT_MAX
    where `enable_pass_detect_inf_mask_nodes` asks for it (passes/inf_mask.py). Returns the fallen-back layers."""
    apply_sdpa_settings(graph)
    fallen = fall_back_to_per_tensor(graph)
    control_op_preprocess(graph)  # If/Loop and their subgraphs run in float (passes/control_op_preprocess.py)
    if deeply_set_unquantifiable:
        deeply_set_unquantifiable_pass(graph)
    detect_inf_mask_nodes(graph)
    return fallen


def collect_statistics(graph: PyGraph, batches: Iterable[Sequence[torch.Tensor]],
                       record: Optional[ForwardRecord] = None) -> int:
    """Weight statistics, then one forward per calibration batch folded into the activation statistics; returns the
    number of batches. `record` keeps the float layer outputs of the first batches for the precision analysis
    (graph/recorded.py)."""
    collect_weight_statistics(graph)
    return collect_activation_statistics(graph, batches, record)


def calibrate(graph: PyGraph, unify: Sequence[RuleSource] = ()) -> UnifyReport:
    """Local calibration (each tensor's range from its statistics and strategy), 16 bits for the layers whose
    outputs no 8-bit range holds (`min_activation_sqnr_db`, calibration/low_sqnr.py), then each scale unification
    in `unify`, in order (tuning/unify_scales.py)."""
    calibrate_graph(graph)
    promote_low_sqnr_activations(graph)
    report = UnifyReport()
    for rules in unify:
        if rules:
            report.extend(unify_scales(graph, rules))
    return report


def quantize_calibrated(graph: QuantizeGraph, global_calibration: Any = None,
                        batches: Callable[[], Sequence[Batch]] = list, step: StepTimer = _untimed) -> QuantizeGraph:
    """The quantized copy of a calibrated graph. With `global_calibration` methods (the cfg field's text or parsed
    specs), they first make a calibrated copy on `batches()` (ranges, constants, settings for quantization only,
    tuning/global_methods) and the copy is quantized; `graph` itself stays the float model."""
    if not global_calibration:
        return quantize_graph(graph)
    from .tuning.global_methods import calibrate_globally

    with step("global calibration"):
        tuned = calibrate_globally(graph, global_calibration, batches()).graph
    graph.quantgraph = quantize_graph(tuned)
    return graph.quantgraph


def quantize_model(graph: QuantizeGraph, calibration: Iterable[Batch],
                   settings: Union[None, LayerSettings, Mapping[str, Any]] = None,
                   per_layer: Optional[Mapping[str, Mapping[str, Any]]] = None,
                   unify: RuleSource = None, global_calibration: Optional[str] = None,
                   merge_matmul_mul_pass: bool = True) -> QuantizeGraph:
    """Quantized copy of `graph` calibrated on `calibration` batches: the steps above in `quantopt --cfg`'s order.

    `settings`: a LayerSettings or a dict of its fields for every layer (default: the cfg defaults);
    `per_layer`: layer name -> dict of fields overriding `settings` for that layer;
    `unify`: scale unification rules in `unify_scales_for_multi_inputs_operators` syntax (text or UnifyRule list),
    e.g. "[(Concat, 20, 1.05, out)]" for what `unify_scales_for_concat` does;
    `global_calibration`: methods in the cfg field's syntax (e.g. "bias_correction[2] & adaround[2]"), run on the
    calibration batches after local calibration, on a copy (`graph` keeps its float constants);
    `merge_matmul_mul_pass`: the cfg field `enable_pass_merge_matmul_mul` (upstream's default, on): constant factors
    after MatMuls are folded into them first, which rewrites `graph` itself (passes/merge_matmul_mul.py).
    """
    graph_passes(graph, merge_matmul_mul_pass)
    settings_from_arguments(graph, settings, per_layer)
    finish_settings(graph)
    batches = [[b] if isinstance(b, torch.Tensor) else list(b) for b in calibration]
    collect_statistics(graph, batches)
    calibrate(graph, [unify] if unify else [])
    return quantize_calibrated(graph, global_calibration, lambda: batches)


def quantize_prequantized(graph: QuantizeGraph, calibration: Iterable[Batch] = (), options: Any = None,
                          settings: Union[None, LayerSettings, Mapping[str, Any]] = None) -> QuantizeGraph:
    """compat_quantized_model: the quantized copy of a graph carrying a pre-quantized model's params (an ONNX QDQ
    import, frontends/onnx_qdq.py), which it keeps; `calibration` batches are needed only for tensors without
    them; `options`: the compat fields (a read cfg or passes.compat_quantized.CompatOptions;
    docs/compat-quantized.md)."""
    from .passes import compat_quantized as compat

    options = options if options is not None else compat.CompatOptions()
    compat.check_compat_graph(graph, options)
    graph_passes(graph, merge_matmul_mul_pass=False)
    settings_from_arguments(graph, settings)
    compat.prepare_given(graph, options)
    finish_settings(graph)
    collect_statistics(graph, [[b] if isinstance(b, torch.Tensor) else list(b) for b in calibration])
    compat.compat_calibrate(graph)
    qgraph = quantize_graph(graph)
    compat.check_given_kept(qgraph)
    return qgraph


def run_quantized(qgraph: PyGraph, inputs: Batch) -> list:
    """Integer forward; returns the outputs dequantized to float32 (integer outputs of scale 1 as they are)."""
    qgraph.forward([inputs] if isinstance(inputs, torch.Tensor) else list(inputs))
    return [to_float(t, qgraph.quant) for t in qgraph.output_tensors]
