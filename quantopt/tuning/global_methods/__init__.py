"""Global calibration (docs/global-calibration.md): multi-layer methods run between local calibration and quantization.

`calibrate_globally(graph, spec, batches)` is the workflow's step: it returns a copy of the calibrated float graph on
which the methods of the `global_calibration` field ran, in the order written, and leaves `graph` as it is (the float
model, for metrics and the similarity analysis). Methods change what quantization reads: tensor ranges
(`min`/`max`, `min_key_axis`/`max_key_axis`), the float weights/biases of MAC layers and the affine parameters of
norms, and (mvn_correction) layer settings; the copy holds them, and quantization reads the copy.
`apply_global_calibration(graph, spec, batches)` runs the methods in place on a graph the caller owns. Either way
they measure against a copy of the float graph taken before the first method, so the float reference never drifts
(the smoothing methods, which turn the float model into an equivalent one, smooth that copy too).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from ...errors import ConfigError, DataError
from ...graph.graph import PyGraph, QuantizeGraph
from ...log import OPT_INFO
from ._common import Batch, layer_errors, target_layers
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

@dataclass
class GlobalCalibration:
    """What `calibrate_globally` returns: the calibrated copy and, per method text, the layers it changed."""
    graph: QuantizeGraph
    changed: Dict[str, List[str]]


def calibrate_globally(graph: QuantizeGraph, spec: Union[str, Sequence[GlobalMethodSpec], None],
                       batches: Sequence[Union[torch.Tensor, Sequence[torch.Tensor]]],
                       log_loss: bool = True) -> GlobalCalibration:
    """A copy of the calibrated float `graph` with the methods of `spec` applied (ranges, constants, settings), for
    quantization; `graph` is left as it is. Arguments as `apply_global_calibration`."""
    tuned = graph.clone()
    changed = apply_global_calibration(tuned, spec, batches, log_loss)
    return GlobalCalibration(tuned, changed)


def _batches(batches: Sequence[Union[torch.Tensor, Sequence[torch.Tensor]]]) -> List[Batch]:
    return [[b] if isinstance(b, torch.Tensor) else list(b) for b in batches]


def apply_global_calibration(graph: PyGraph, spec: Union[str, Sequence[GlobalMethodSpec], None],
                             batches: Sequence[Union[torch.Tensor, Sequence[torch.Tensor]]],
                             log_loss: bool = True) -> Dict[str, List[str]]:
    """Run the methods of `spec` in place on a calibrated float graph the caller owns (ranges set by
    `calibrate_graph`); the workflow runs them on a copy (`calibrate_globally`).

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
    reference = graph.clone()
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


__all__ = ["IMPLEMENTATIONS", "METHODS", "GlobalCalibration", "GlobalCalibrationKind", "GlobalMethodSpec",
           "apply_global_calibration", "calibrate_globally", "format_global_calibration", "parse_global_calibration",
           "reconstruction_errors"]
