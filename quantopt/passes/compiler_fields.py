"""The cfg fields that steer upstream's NPU compiler and library rather than the quantization (docs/user-guide.md,
"Compiler and library fields").

- `enable_ds`, `ds_output_shape_constant`, `ds_parameter_constant` write the dynamic-shape keys `ds_output_shape`
  and `ds_crops` into the quantized IR exactly where upstream writes them (`write_compiler_keys`).
- `optimize_wdc_for_x2` doubles the calibrated range of weight constants that would not compress well on an X2 NPU
  (`optimize_weights_for_wdc`), before quantization: the one field here that changes numbers.
- `with_winograd`, `cast_dtypes_for_lib` and the feature-map tiling fields need what quantopt does not have
  (Winograd weights, the library's dtype table, graph tiling): `check_compiler_fields` refuses a value that would
  need it, naming the cfg line, and accepts upstream's defaults (and values that change nothing there either).
- `regularize_activation_perchannel_scales`: upstream's optimizer reads it from tensor attributes its flow never
  sets, so `enable` changes nothing in upstream; here it changes nothing either, with a warning.
"""
from __future__ import annotations

import copy
import math
from typing import Any, List, Sequence, Tuple

import torch

from ..errors import ConfigError
from ..graph.graph import PyGraph
from ..graph.node import PyNode
from ..log import OPT_INFO, OPT_WARN
from ..quant.params import QuantMode, linear_quant_params, quantize

WDC_TRIALS = 4
"""Upstream doubles a weight range at most this many times."""
WDC_GOOD_RATE = 0.9
"""A compression rate (compressed / plain size) below this stops the doubling."""
WINOGRAD_TARGETS = {
    # target: (Winograd cube (Cout, H, W), direct-convolution cube (Cout, H, W)), from the reference's X3 table
    "V3C4": ((16, 4, 8), (16, 2, 8)),
    "V3B4": ((16, 2, 8), (16, 1, 8)),
}
WINOGRAD_CYCLES = {"wino": (60, 110), "conv": (36, 72)}
"""Prefetch cycles per kernel, by input-channel group size (0: exactly 32 input channels, 1: otherwise)."""
WINOGRAD_DDR_UTIL = 0.8
WINOGRAD_M, WINOGRAD_R = 4, 3  # F(2,3): 4 input columns per tile, 3 taps


def _for(value: Any, node: PyNode) -> Any:
    """A per-layer field's value for `node` (a plain value applies to every layer)."""
    return value.get(node) if hasattr(value, "get") and not isinstance(value, dict) else value


def _names(found: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in found[:4]) + (", ..." if len(found) > 4 else "")


def _error(cfg: Any, name: str, message: str) -> ConfigError:
    if hasattr(cfg, "error"):
        return cfg.error(name, message)
    return ConfigError(f"field '{name}': {message}", field=name)


# ------------------------------------------------------------------------------------------------ refusals
def winograd_layers(graph: PyGraph, with_winograd: Any) -> List[str]:
    """Convolution layers with `with_winograd` true that upstream would turn into Winograd F(2,3) convolutions: the
    layer shape rules and the prefetch-cycle estimate must favour Winograd on both X3 targets."""
    found = []
    for n in graph.nodes:
        if str(n.type) != "Convolution" or not _for(with_winograd, n) or not n.inputs or not n.outputs:
            continue
        if all(_winograd_pays(n, cubes) for cubes in WINOGRAD_TARGETS.values()):
            found.append(n.name)
    return found


def _winograd_pays(n: PyNode, cubes: Tuple[Tuple[int, int, int], Tuple[int, int, int]]) -> bool:
    in_shape, out_shape = list(n.inputs[0].ir_shape), list(n.outputs[0].ir_shape)
    if len(in_shape) != 4 or len(out_shape) != 4:
        return False
    _, h_in, w_in, c_in = (int(v) for v in in_shape)
    _, h_out, w_out, c_out = (int(v) for v in out_shape)
    p = n.params

    def param(key: str, default: int = 1) -> int:
        return int(p.get(key, default))

    if not (param("group") == 1 and c_in > 4 and h_in > 7 and w_in > 7 and param("kernel_x", 0) == 3
            and param("kernel_y", 0) == 3 and param("stride_x") == 1 and param("stride_y") == 1
            and param("dilation_x") == 1 and param("dilation_y") == 1):
        return False
    group_size = 0 if c_in == 32 else 1
    cube_cin = (2 ** group_size) * 32

    def kernels(cube: Tuple[int, int, int]) -> float:
        cout, h, w = cube
        return (math.ceil(c_in / cube_cin) * math.ceil(c_out / cout) * math.ceil(h_out / h) *
                math.ceil(w_out / w))

    overhead = (WINOGRAD_R * WINOGRAD_M - WINOGRAD_R * WINOGRAD_R) * c_in * c_out / (32 * WINOGRAD_DDR_UTIL)
    wino = WINOGRAD_CYCLES["wino"][group_size] * kernels(cubes[0])
    conv = WINOGRAD_CYCLES["conv"][group_size] * kernels(cubes[1])
    return wino + overhead < conv


def check_compiler_fields(graph: PyGraph, cfg: Any) -> None:
    """Before the graph passes: refuse the values that need graph tiling, the library's dtype table or Winograd
    weights; warn that `regularize_activation_perchannel_scales = enable` changes nothing."""
    for name, default in (("featuremap_splits_item_x", 1), ("featuremap_splits_item_y", 1),
                          ("featuremap_splits_sram_size", 0)):
        if getattr(cfg, name) != default:
            raise _error(cfg, name, f"{getattr(cfg, name)} asks upstream's NPU compiler flow to tile the feature "
                         f"maps into parallel parts (a graph rewrite quantopt does not implement); use {default}")
    if cfg.featuremap_tiling_param:
        raise _error(cfg, "featuremap_tiling_param", "feature-map tiling of layer ranges is a graph rewrite quantopt "
                     "does not implement; leave the field empty")
    casts = [n.name for n in graph.nodes if str(n.type) != "Cast" and _for(cfg.cast_dtypes_for_lib, n)]
    if casts:
        raise _error(cfg, "cast_dtypes_for_lib", f"true for layer(s) {_names(casts)}: upstream then inserts Cast "
                     "layers where the NPU library lacks a layer's input/output dtypes, which needs the library's "
                     "dtype table; quantopt does not have it. Set the field false")
    wino = winograd_layers(graph, cfg.with_winograd)
    if wino:
        raise _error(cfg, "with_winograd", f"Convolution layer(s) {_names(wino)} would run as Winograd F(2,3) "
                     "convolutions with transformed 3x4 weights, a form quantopt does not implement; set the field "
                     "false (or false for these layers)")
    if any(str(n.type) == "Convolution" and _for(cfg.with_winograd, n) for n in graph.nodes):
        OPT_INFO("with_winograd: no Convolution layer qualifies for Winograd F(2,3); nothing changes")
    regular = [n.name for n in graph.nodes if _for(cfg.regularize_activation_perchannel_scales, n) == "enable"]
    if regular:
        OPT_WARN(f"regularize_activation_perchannel_scales = enable (layers {_names(regular)}) changes nothing: "
                 "upstream's optimizer reads the switch from tensor attributes its flow never sets, so its "
                 "per-channel activation scales stay as calibrated, and quantopt's do too")


# ------------------------------------------------------------------------------------------------ WDC
def x2_compression_rate(q: torch.Tensor, bits: int) -> float:
    """The compressed/plain size ratio of integer weights under X2 weight data compression, as upstream estimates
    it: each candidate code length L = i+1 stores a value within [-2^i - 1, 2^i - 1] in L bits and any other in 3L
    bits; of the lengths the hardware offers (5 and 6 for 8-bit weights, 10 and 12 otherwise) the best one below
    1.0 counts, else 1.0 (no compression). Float32 arithmetic, as upstream."""
    flat = q.flatten().to(torch.int64)
    total = flat.numel()
    rates = torch.full((16,), 1000.0, dtype=torch.float32)
    for i in range(min(bits, 16)):
        hits = int(((flat <= (1 << i) - 1) & (flat >= -(1 << i) - 1)).sum())
        prob = torch.tensor(hits, dtype=torch.float32) / total
        avg_len = prob * (i + 1) + (1 - prob) * (3 * (i + 1))
        rates[i] = avg_len / bits
    lengths = (5, 6) if bits == 8 else (10, 12)
    usable = [rates[length - 1] for length in lengths if length <= 16 and bool(rates[length - 1] < 1.0)]
    return float(min(usable)) if usable else 1.0


def optimize_weights_for_wdc(graph: PyGraph, flag: Any) -> List[Tuple[str, str, int]]:
    """`optimize_wdc_for_x2`: for each calibrated constant of a layer with the flag, up to 4 times: quantize with
    the layer's weight mode and bits; if the estimated compression rate is not below 0.9, double the calibrated
    min and max. Per-channel constants are quantized from their per-channel ranges, which do not change, so their
    integer values do not either. Returns (layer, constant, doublings) for each doubled constant."""
    changed = []
    for n in graph.nodes:
        if not _for(flag, n) or n.settings is None:
            continue
        s = n.settings
        mode = QuantMode.from_name(s.q_mode_weight)
        if str(n.type) == "DepthwiseConv" and "q_mode_weight" not in s.explicit:
            mode = mode.to_per_channel()  # upstream's default weight mode of depthwise convolutions
        bits = int(s.q_bits_weight)
        for key, t in n.constants.items():
            r, rc = graph.ranges.get(t), graph.ranges.channels(t)
            if r.min is None or r.max is None or not t.betensor.is_floating_point() or t.betensor.numel() == 0:
                continue
            per_channel = mode.is_per_channel and rc.min is not None and rc.max is not None
            doublings = 0
            for _ in range(WDC_TRIALS):
                r = graph.ranges.get(t)
                p = (linear_quant_params(rc.min, rc.max, bits, mode, True) if per_channel else
                     linear_quant_params(r.min, r.max, bits, mode.to_per_tensor(), True))
                q = quantize(t.betensor, p.scale, p.zerop, p.qmin, p.qmax, axis=0 if per_channel else None)
                if x2_compression_rate(q, bits) < WDC_GOOD_RATE:
                    break
                graph.ranges.set(t, r.min * 2, r.max * 2)
                doublings += 1
            if doublings:
                changed.append((n.name, key, doublings))
                OPT_INFO(f"optimize_wdc_for_x2: range of {n.name}'s constant {key} doubled {doublings} time(s) for "
                         "weight data compression (accuracy may drop)")
    return changed


# ------------------------------------------------------------------------------------------------ IR keys
def ds_flags(value: Any, outputs: int) -> List[int]:
    """`ds_output_shape_constant` for a layer with `outputs` outputs: one 0/1 flag per output (a shorter list is
    padded with 0, a longer one cut)."""
    if value == "all":
        return [1] * outputs
    if value == "disable" or value is None:
        return [0] * outputs
    flags = [int(v) for v in value][:outputs]
    return flags + [0] * (outputs - len(flags))


def write_compiler_keys(qgraph: PyGraph, enable_ds: Any = False, ds_output_shape_constant: Any = "disable",
                        ds_parameter_constant: Any = "disable") -> None:
    """The dynamic-shape keys of the quantized IR, as upstream writes them: a Reshape with `enable_ds` gets its
    output shape as `ds_output_shape` (unless the float IR gave one); a Crop with `ds_parameter_constant = default`
    gets `ds_crops` = its crops; a layer whose `ds_output_shape_constant` flags are all 1 gets all its output shapes
    as `ds_output_shape`; flags mixing 0 and 1 replace the flagged entries of an existing `ds_output_shape` and
    otherwise write nothing (with a warning)."""
    for n in qgraph.nodes:
        if str(n.type) == "Reshape" and _for(enable_ds, n) and "ds_output_shape" not in n.params:
            n.params["ds_output_shape"] = [[int(v) for v in n.outputs[0].ir_shape]]
        if str(n.type) == "Crop" and _for(ds_parameter_constant, n) == "default":
            n.params["ds_crops"] = copy.deepcopy(n.params.get("crops"))
        flags = ds_flags(_for(ds_output_shape_constant, n), len(n.outputs))
        shapes = [[int(v) for v in t.ir_shape] for t in n.outputs]
        if flags and all(flags):
            n.params["ds_output_shape"] = shapes
        elif len(flags) > 1 and any(flags):
            if "ds_output_shape" not in n.params:
                OPT_WARN(f"ds_output_shape_constant: layer '{n.name}' ({n.type}) has no derived ds_output_shape "
                         "to make partly constant; nothing written")
                continue
            current = list(n.params["ds_output_shape"])
            for i, flag in enumerate(flags):
                if flag and i < len(current):
                    current[i] = shapes[i]
            n.params["ds_output_shape"] = current


def wdc_from_cfg(graph: PyGraph, cfg: Any, global_calibration: bool) -> List[Tuple[str, str, int]]:
    """`optimize_wdc_for_x2` of a read cfg, after local calibration. Upstream applies it after its global
    calibration methods, which quantopt runs later on a copy, so the two together are refused."""
    flagged = [n.name for n in graph.nodes if _for(cfg.optimize_wdc_for_x2, n)]
    if flagged and global_calibration:
        raise _error(cfg, "optimize_wdc_for_x2", "cannot be combined with global_calibration (upstream adjusts the "
                     "weight ranges after the global methods, which quantopt applies to a copy at quantization); "
                     "use one of the two")
    return optimize_weights_for_wdc(graph, cfg.optimize_wdc_for_x2) if flagged else []
