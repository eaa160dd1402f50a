"""Global calibration (docs/global-calibration.md): multi-layer methods run between local calibration and quantization.

`apply_global_calibration(graph, spec, batches)` runs the methods of the `global_calibration` field in the order
written. Methods change what quantization reads: tensor ranges (`min`/`max`, `min_key_axis`/`max_key_axis`),
the float weights/biases of MAC layers and the affine parameters of norms, and (mvn_correction) layer settings.
They measure against a copy of the float graph taken before the first method, so the float reference never drifts
(the smoothing methods, which turn the float model into an equivalent one, smooth that copy too). Because float
constants are the model itself, their calibrated values are only meant for quantization: call
`restore_float_constants(graph)` once `quantize_graph` has made the quantized copy, so the float graph evaluates
as the original model again.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from ...errors import ConfigError, DataError
from ...graph.graph import PyGraph
from ...log import OPT_INFO
from ._common import ORIGINALS_ATTR, Batch, layer_errors, remember_constants, target_layers
from .adaquant_zy import adaquant_zy
from .adaround import adaround
from .awq_zy import awq_zy
from .bias_correction import bias_correction
from .easy_quant import easy_quant
from .gptq_zy import gptq_zy
from .mvn_correction import mvn_correction
from .smooth_quant_zy import smooth_quant_zy
from .spec import (
    METHODS,
    GlobalCalibrationKind,
    GlobalMethodSpec,
    format_global_calibration,
    parse_global_calibration,
)
from .svd_quant import svd_quant

MethodFn = Callable[[PyGraph, PyGraph, GlobalMethodSpec, Sequence[Batch]], List[str]]

IMPLEMENTATIONS: Dict[str, MethodFn] = {
    "easy_quant": easy_quant,
    "adaround": adaround,
    "bias_correction": bias_correction,
    "adaquant_zy": adaquant_zy,
    "svd_quant": svd_quant,
    "smooth_quant_zy": smooth_quant_zy,
    "awq_zy": awq_zy,
    "gptq_zy": gptq_zy,
    "mvn_correction": mvn_correction,
}

def _remember(graph: PyGraph) -> None:
    for n in graph.nodes:
        if n.constants:
            remember_constants(n)


def restore_float_constants(graph: PyGraph) -> int:
    """Put back the float constants changed by global calibration (weights, biases, norm parameters; constants a
    method added are removed again); returns the number of layers restored."""
    count = 0
    for n in graph.nodes:
        saved = n.attrs.pop(ORIGINALS_ATTR, None)
        if saved is None:
            continue
        for key in [k for k in n.constants if k not in saved]:
            del n.constants[key]
        for key, value in saved.items():
            n.constants[key].betensor = value
        count += 1
    return count


def _batches(batches: Sequence[Union[torch.Tensor, Sequence[torch.Tensor]]]) -> List[Batch]:
    return [[b] if isinstance(b, torch.Tensor) else list(b) for b in batches]


def apply_global_calibration(graph: PyGraph, spec: Union[str, Sequence[GlobalMethodSpec], None],
                             batches: Sequence[Union[torch.Tensor, Sequence[torch.Tensor]]],
                             log_loss: bool = True) -> Dict[str, List[str]]:
    """Run the methods of `spec` on a calibrated float graph (ranges set by `calibrate_graph`).

    `batches`: calibration input batches (each a tensor or a list of input tensors); a method with a `batches`
    parameter uses that many of the first ones, the others use them all. Returns method text -> names of the
    layers it changed. With `log_loss`, the summed layer reconstruction error of the layers in the method's scope
    is logged before and after it.
    """
    specs = parse_global_calibration(spec)
    if not specs:
        return {}
    data = _batches(batches)
    if not data:
        raise DataError("global_calibration needs calibration batches")
    for s in specs:
        if s.name not in IMPLEMENTATIONS:
            raise ConfigError(f"method '{s.name}' is not implemented yet in quantopt", field="global_calibration")
    _remember(graph)
    reference = graph.clone()
    restore_float_constants(reference)
    report: Dict[str, List[str]] = {}
    for s in specs:
        names = [n.name for n in target_layers(graph, s)]
        use = data[:s.param("batches")] if "batches" in METHODS[s.name].params else data
        before = sum(layer_errors(graph, reference, use, names).values()) if log_loss and names else None
        OPT_INFO(f"global calibration: {s} on {len(names)} layer(s), {len(use)} batch(es)")
        with torch.random.fork_rng(devices=[]):
            changed = IMPLEMENTATIONS[s.name](graph, reference, s, data)
        report[str(s)] = changed
        if before is not None:
            after = sum(layer_errors(graph, reference, use, names).values())
            OPT_INFO(f"global calibration: {s}: {len(changed)} layer(s) changed; summed layer reconstruction mse "
                     f"{before:.6g} -> {after:.6g}")
    return report


def reconstruction_errors(graph: PyGraph, reference: PyGraph, batches, names: Optional[Sequence[str]] = None
                          ) -> Dict[str, float]:
    """Per-layer reconstruction MSE of the quantized `graph` against the float `reference` (all MAC layers when
    `names` is not given)."""
    data = _batches(batches)
    if names is None:
        names = [n.name for n in graph.nodes if "weights" in n.constants]
    return layer_errors(graph, reference, data, names)


__all__ = ["IMPLEMENTATIONS", "METHODS", "GlobalCalibrationKind", "GlobalMethodSpec", "apply_global_calibration",
           "format_global_calibration", "parse_global_calibration", "reconstruction_errors",
           "restore_float_constants"]
