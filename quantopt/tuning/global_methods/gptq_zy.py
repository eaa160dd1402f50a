"""gptq_zy: Hessian-based column-by-column weight quantization with error feedback (GPTQ, Frantar et al. 2022).

For every FullyConnected, Convolution and DepthwiseConv layer in scope, the float inputs of the first `batches`
calibration batches give the Hessian of the layer's squared output error, H = (2/N)·Σ x·xᵀ over the N input
rows x (a FullyConnected row is one input vector; a convolution row is one receptive field, unfolded in the
weights' (kh, kw, in_c) order; each convolution group, and each DepthwiseConv channel, has its own Hessian).
Dead inputs (zero diagonal) get weight 0; with `use_act_order` columns are visited by descending diagonal;
`perc_damp`·mean(diag H) is added to the diagonal; the upper Cholesky factor U of H⁻¹ drives the updates. Blocks
of `block_size` columns are quantized one column at a time on the grid of the quantized layer (its weight scale,
zero point and integer range): the column's rounding error, divided by U[i, i], is fed back into the columns not
yet quantized, inside the block at once and after it in one matrix product.

The quantized weights are written into the layer's float weights as their dequantized grid values, so the
unchanged calibrated range and the layer's usual quantize function produce exactly those integers (on the
calibrated copy; the float graph keeps its weights). A layer keeps rounding to nearest when GPTQ does not lower the
Hessian-weighted error tr(ΔW·H·ΔWᵀ) of the undamped Hessian.

Weight-only layers with per-block weights (`quantize_method_for_weight = per_block_*`, integer or fp4/fp8 values,
one scale per block of `weight_block_size` weights along the last axis) run the same sweep on their block grid:
each weight's scale (and zero point) is its block's, computed from the original weights as the layer quantizes them
(the scales are fixed before the sweep); a minifloat grid point is the format's value nearest to w·scale. The
weights that set a block's range (max|w|; min and max for asymmetric integers) keep their grid point, the other
weights choose among the grid points inside the block's range, and the written float weights are the grid values
clipped to that range with the range-setting weights unchanged: the layer's weight-only quantization then derives
the same block scales from them and stores exactly the chosen grid points (checked; otherwise the layer keeps
rounding to nearest).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ...config.kinds_accuracy import parse_trigger_float
from ...graph.graph import PyGraph
from ...graph.node import PyNode
from ...log import OPT_INFO
from ...passes.float_islands import MINIFLOAT_WEIGHTS, make_float_layer
from ...progress import progress
from ...quant import minifloat
from ...quant.params import QuantMode, linear_quant_params, quantize
from ...quantizer import quantize_graph
from ...threads import one_thread
from ._common import Batch, skip_reason, target_layers, weight_quant
from .spec import GlobalMethodSpec

GPTQ_TYPES = ("FullyConnected", "Convolution", "DepthwiseConv")


def _groups(node: PyNode) -> int:
    w = node.constants["weights"].betensor
    if str(node.type) == "FullyConnected":
        return 1
    in_c = int(node.inputs[0].ir_shape[-1])
    return in_c // int(w.shape[3])


def _rows(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """Input rows per group, [G, rows, columns], columns in the order of the flattened weights of one group."""
    x = x.to(torch.float64)
    if str(node.type) == "FullyConnected":
        return x.reshape(1, -1, x.shape[-1])
    w = node.constants["weights"].betensor
    kh, kw, cin_g = int(w.shape[1]), int(w.shape[2]), int(w.shape[3])
    p = node.params
    pads = tuple(int(p.get(k, 0)) for k in ("pad_left", "pad_right", "pad_top", "pad_bottom"))
    xc = F.pad(x.permute(0, 3, 1, 2), pads)
    cols = F.unfold(xc, (kh, kw), dilation=(int(p.get("dilation_y", 1)), int(p.get("dilation_x", 1))),
                    stride=(int(p.get("stride_y", 1)), int(p.get("stride_x", 1))))
    n, _, positions = cols.shape
    groups = int(x.shape[-1]) // cin_g
    cols = cols.reshape(n, groups, cin_g, kh * kw, positions)  # unfold orders (channel, kh, kw)
    return cols.permute(1, 0, 4, 3, 2).reshape(groups, n * positions, kh * kw * cin_g)


def _hessians(graph: PyGraph, layers: Sequence[PyNode], data: Sequence[Batch]) -> Dict[str, torch.Tensor]:
    """H = (2/N)·Σ x·xᵀ per layer, [G, columns, columns] in float64, from the float graph's own layer inputs."""
    sums: Dict[str, torch.Tensor] = {}
    counts: Dict[str, int] = {}
    names = {n.name for n in layers}

    def hook(node: PyNode) -> None:
        if node.name not in names:
            return
        rows = _rows(node, node.inputs[0].betensor)
        gram = rows.transpose(1, 2) @ rows
        sums[node.name] = sums[node.name] + gram if node.name in sums else gram
        counts[node.name] = counts.get(node.name, 0) + int(rows.shape[1])

    with torch.no_grad():
        for b in progress(data, "gptq_zy: Hessians"):
            graph.forward(list(b), after_node=hook)
    return {k: 2.0 * v / max(counts[k], 1) for k, v in sums.items()}


class _Grid:
    """Quantization grid of a layer's weights, one scale and zero point per weight, [G, rows per group, columns]:
    integers (`fmt` None) rounded as the quantize function rounds, or fp4/fp8 values (`fmt` a minifloat format) of
    the weights times the scale; a grid value is (q + zp)·(1/scale) as the forward dequantizes."""

    def __init__(self, scale: torch.Tensor, zp: torch.Tensor, qmin: int, qmax: int, fmt: Optional[tuple] = None,
                 bounds: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        self.scale, self.zp, self.qmin, self.qmax, self.fmt = scale, zp, qmin, qmax, fmt
        self.bounds = bounds  # lowest and highest grid point of each weight (per-block: those of its block's range)

    @classmethod
    def of_layer(cls, qnode: PyNode, groups: int, cols: int) -> _Grid:
        """The per-tensor or per-channel grid of an integer layer."""
        scale, zp, qmin, qmax = weight_quant(qnode)
        out = int(qnode.constants["weights"].betensor.shape[0])
        shape = (groups, out // groups, cols)
        s = torch.broadcast_to(scale.reshape(-1), (out,)).reshape(groups, -1, 1).expand(shape)
        z = torch.broadcast_to(zp.reshape(-1), (out,)).reshape(groups, -1, 1).expand(shape)
        return cls(s, z, qmin, qmax)

    def permuted(self, perm: torch.Tensor) -> _Grid:
        """The grid with its columns in the order `perm` [G, columns]."""
        idx = perm[:, None, :].expand_as(self.scale)
        bounds = None if self.bounds is None else tuple(torch.gather(b, 2, idx) for b in self.bounds)
        return _Grid(torch.gather(self.scale, 2, idx), torch.gather(self.zp, 2, idx), self.qmin, self.qmax, self.fmt,
                     bounds)

    def _params(self, w: torch.Tensor, col: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        return (self.scale, self.zp) if col is None else (self.scale[:, :, col], self.zp[:, :, col])

    def integers(self, w: torch.Tensor, col: Optional[int] = None) -> torch.Tensor:
        """Grid points (integers, or minifloat values) of column `col` [G, rows] or of all weights [G, rows, cols],
        as the layer's quantization rounds, as float64."""
        s, z = self._params(w, col)
        if self.fmt is None:
            q = quantize(w.to(torch.float32), s, z, self.qmin, self.qmax).to(torch.float64)
        else:
            scaled = (w.to(torch.float32) * s).numpy()
            values = minifloat.decode(minifloat.encode(scaled, self.fmt), self.fmt)
            q = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64)).reshape(w.shape)
        if self.bounds is None:
            return q
        lo, hi = self.bounds if col is None else (self.bounds[0][:, :, col], self.bounds[1][:, :, col])
        return torch.minimum(torch.maximum(q, lo), hi)

    def values(self, q: torch.Tensor, col: Optional[int] = None) -> torch.Tensor:
        """The float weights of grid points, as the forward dequantizes them (float32)."""
        s, z = self._params(q, col)
        return (q.to(torch.float32) + z) * (1.0 / s)


def _gptq(w: torch.Tensor, h: torch.Tensor, grid: _Grid, act_order: bool, damp: float, block: int,
          pinned: Optional[torch.Tensor] = None, pinned_q: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Grid points [G, rows, columns] (float64) chosen by GPTQ for float weights w [G, rows, columns] and Hessians h;
    where `pinned` is set, the weight takes `pinned_q` (its error is fed back like any other)."""
    w = w.clone()
    h = h.clone()
    cols = int(w.shape[2])
    dead = torch.diagonal(h, dim1=1, dim2=2) == 0
    eye = torch.eye(cols, dtype=h.dtype).expand_as(h)
    h = torch.where(dead[:, None, :] & (eye > 0), torch.ones_like(h), h)
    w = torch.where(dead[:, None, :], torch.zeros_like(w), w)
    perm = torch.arange(cols).expand(w.shape[0], cols)
    if pinned is None or pinned_q is None:
        pinned, pinned_q = torch.zeros_like(w, dtype=torch.bool), torch.zeros_like(w)
    if act_order:
        perm = torch.argsort(torch.diagonal(h, dim1=1, dim2=2), dim=1, descending=True, stable=True)
        idx = perm[:, None, :].expand_as(w)
        w, pinned, pinned_q = torch.gather(w, 2, idx), torch.gather(pinned, 2, idx), torch.gather(pinned_q, 2, idx)
        h = torch.gather(torch.gather(h, 1, perm[:, :, None].expand_as(h)), 2, perm[:, None, :].expand_as(h))
        grid = grid.permuted(perm)
    diag = torch.diagonal(h, dim1=1, dim2=2)
    h = h + eye * (damp * diag.mean(dim=1))[:, None, None]
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1 = w[:, :, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = w1[:, :, i]
            qi = torch.where(pinned[:, :, i1 + i], pinned_q[:, :, i1 + i], grid.integers(col, i1 + i))
            q[:, :, i1 + i] = qi
            err = (col - grid.values(qi, i1 + i).to(col.dtype)) / u[:, i1 + i, i1 + i][:, None]
            w1[:, :, i:] -= err[:, :, None] * u[:, None, i1 + i, i1 + i:i2]
            err1[:, :, i] = err
        w[:, :, i2:] -= err1 @ u[:, i1:i2, i2:]
    return torch.gather(q, 2, torch.argsort(perm, dim=1)[:, None, :].expand_as(q)) if act_order else q


def _error(w: torch.Tensor, w_q: torch.Tensor, h: torch.Tensor) -> float:
    d = (w - w_q).to(torch.float64)
    return float(torch.einsum("grc,gcd,grd->", d, h, d))


def _layer(node: PyNode, qnode: PyNode, h: torch.Tensor, spec: GlobalMethodSpec) -> Tuple[bool, str]:
    wt = node.constants["weights"]
    shape = wt.betensor.shape
    groups = int(h.shape[0])
    w = wt.betensor.to(torch.float64).reshape(groups, int(shape[0]) // groups, -1)
    grid = _Grid.of_layer(qnode, groups, int(w.shape[2]))
    nearest = grid.integers(w)
    with one_thread():  # LAPACK factorizations and the scalar error: the same at any thread count (threads.py)
        chosen = _gptq(w, h, grid, spec.param("use_act_order"), float(spec.param("perc_damp")),
                       spec.param("block_size"))
        e_rtn = _error(w, grid.values(nearest), h)
        e_gptq = _error(w, grid.values(chosen), h)
    if not e_gptq < e_rtn:
        return False, f"rounding to nearest kept (Hessian-weighted error {e_rtn:.6g}, GPTQ {e_gptq:.6g})"
    new_w = grid.values(chosen).reshape(shape)
    scale, zp, qmin, qmax = weight_quant(qnode)
    target = chosen.reshape(shape).to(torch.int64)
    if bool((quantize(new_w, scale, zp, qmin, qmax) != target).any()):
        return False, "the GPTQ integers cannot be expressed in float weights; rounding to nearest kept"
    moved = int((nearest.reshape(shape) != target).sum())
    wt.betensor = new_w.to(wt.betensor.dtype)
    return True, (f"{moved} of {target.numel()} weights quantized differently from rounding to nearest; "
                  f"Hessian-weighted error {e_rtn:.6g} -> {e_gptq:.6g}")


# ------------------------------------------------------------------------------------------------ per-block weights
def is_block_layer(qnode: PyNode) -> bool:
    """A weight-only float layer of the quantized graph with one weight scale per block (`weight_block_size`)."""
    return not qnode.quantized and "weight_block_size" in qnode.params and "weights_scale" in qnode.constants


def block_bounds(node: PyNode, blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lo, hi, extremes) of float weight blocks [blocks, size]: the range the block's scale is derived from
    (±max|w| for symmetric integer and minifloat weights, [min(min, 0), max(max, 0)] for asymmetric ones) and
    the mask of the weights that set it (the first one of each bound)."""
    extremes = torch.zeros_like(blocks, dtype=torch.bool)
    rows = torch.arange(int(blocks.shape[0]))
    if QuantMode.from_name(node.settings.q_mode_weight).is_asymmetric and \
            parse_trigger_float(node.settings.trigger_float_op).weight_format == "int":
        mn, mx = blocks.min(dim=1), blocks.max(dim=1)
        extremes[rows, mn.indices] = mn.values < 0
        extremes[rows, mx.indices] |= mx.values > 0
        return torch.clamp(mn.values, max=0.0)[:, None], torch.clamp(mx.values, min=0.0)[:, None], extremes
    mag = blocks.abs().max(dim=1)
    extremes[rows, mag.indices] = mag.values > 0
    top = mag.values[:, None]
    return -top, top, extremes


def _block_grid(qnode: PyNode, groups: int) -> Tuple[_Grid, torch.Tensor]:
    """The per-block grid of a weight-only layer, and its stored (rounded to nearest) grid points, [G, rows, cols]."""
    w = qnode.constants["weights"]
    size = int(qnode.params["weight_block_size"])
    out = int(w.betensor.shape[0])
    shape = (groups, out // groups, w.betensor.numel() // out)

    def per_weight(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32).reshape(-1, 1).expand(-1, size).reshape(shape)

    scale = per_weight(qnode.constants["weights_scale"].betensor)
    zp = per_weight(qnode.constants["weights_zp"].betensor) if "weights_zp" in qnode.constants \
        else torch.zeros(shape, dtype=torch.float32)
    formats = {dtype: fmt for dtype, fmt, _ in MINIFLOAT_WEIGHTS.values()}
    if w.dtype in formats:
        grid = _Grid(scale, zp, 0, 0, formats[w.dtype])
    else:
        s = qnode.settings
        mode = QuantMode.from_name(s.q_mode_weight)
        p = linear_quant_params(torch.tensor([-1.0]), torch.tensor([1.0]), int(s.q_bits_weight),
                                QuantMode.make("per_channel", mode.is_asymmetric, not mode.is_restricted), True)
        grid = _Grid(scale, zp, int(p.qmin), int(p.qmax))
    return grid, w.betensor.to(torch.float64).reshape(shape)


def _block_layer(node: PyNode, qnode: PyNode, h: torch.Tensor, spec: GlobalMethodSpec) -> Tuple[bool, str]:
    """GPTQ on per-block weight-only weights. The block scales are those of the original weights (as the layer
    quantizes them, before the sweep); the weights that set a block's range keep their grid point and their float
    value, the others choose among the grid points of the block's range, and their written grid values are clipped
    to that range, so quantizing the written weights gives back the same scales and exactly the chosen grid points
    (checked with the layer's own weight-only quantization)."""
    wt = node.constants["weights"]
    shape = wt.betensor.shape
    groups = int(h.shape[0])
    size = int(qnode.params["weight_block_size"])
    w = wt.betensor.to(torch.float64).reshape(groups, int(shape[0]) // groups, -1)
    grid, nearest = _block_grid(qnode, groups)
    blocks = wt.betensor.to(torch.float32).reshape(-1, size)
    lo, hi, extremes = block_bounds(node, blocks)
    pinned = extremes.reshape(w.shape)
    grid.bounds = tuple(grid.integers(b.expand_as(blocks).reshape(w.shape)) for b in (lo, hi))
    with one_thread():  # LAPACK factorizations and the scalar error: the same at any thread count (threads.py)
        chosen = _gptq(w, h, grid, spec.param("use_act_order"), float(spec.param("perc_damp")),
                       spec.param("block_size"), pinned, nearest)
        e_rtn = _error(w, grid.values(nearest), h)
        e_gptq = _error(w, grid.values(chosen), h)
    if not e_gptq < e_rtn:
        return False, f"rounding to nearest kept (Hessian-weighted error {e_rtn:.6g}, GPTQ {e_gptq:.6g})"
    values = torch.maximum(torch.minimum(grid.values(chosen).reshape(-1, size), hi), lo)
    new_w = torch.where(extremes, blocks, values).reshape(shape)
    probe = node.detached_copy()
    probe.constants["weights"].betensor = new_w.to(wt.betensor.dtype)
    make_float_layer(probe, parse_trigger_float(node.settings.trigger_float_op))
    same = torch.equal(probe.constants["weights"].betensor.to(torch.float64).reshape(chosen.shape), chosen)
    for key in ("weights_scale", "weights_zp"):
        if key in qnode.constants:
            same = same and key in probe.constants and \
                torch.equal(probe.constants[key].betensor, qnode.constants[key].betensor)
    if not same:
        return False, "the written weights would not give back the block scales and GPTQ choices; rounding to " \
                      "nearest kept"
    moved = int((nearest != chosen).sum())
    wt.betensor = new_w.to(wt.betensor.dtype)
    return True, (f"{moved} of {chosen.numel()} weights quantized differently from rounding to nearest (blocks of "
                  f"{size}); Hessian-weighted error {e_rtn:.6g} -> {e_gptq:.6g}")


def gptq_zy(graph: PyGraph, reference: PyGraph, spec: GlobalMethodSpec, batches: Sequence[Batch]) -> List[str]:
    """GPTQ on every FullyConnected/Convolution/DepthwiseConv layer in scope; returns the layers changed."""
    data = list(batches[:spec.param("batches")])
    layers = []
    for n in target_layers(graph, spec):
        if str(n.type) in GPTQ_TYPES:
            layers.append(n)
        else:
            OPT_INFO(f"gptq_zy: layer '{n.name}' ({n.type}) skipped: gptq_zy handles {', '.join(GPTQ_TYPES)}")
    if not layers:
        return []
    qgraph = quantize_graph(graph)
    hessians = _hessians(graph, layers, data)
    changed = []
    for node in progress(layers, "gptq_zy"):
        qnode = qgraph.node(node.name)
        block = is_block_layer(qnode)
        reason = None if block else skip_reason(qnode)
        if reason is not None or node.name not in hessians:
            OPT_INFO(f"gptq_zy: layer '{node.name}' skipped: {reason or 'no calibration data reached it'}")
            continue
        if _groups(node) != int(hessians[node.name].shape[0]):
            OPT_INFO(f"gptq_zy: layer '{node.name}' skipped: its group count does not match its input")
            continue
        done, message = (_block_layer if block else _layer)(node, qnode, hessians[node.name], spec)
        if done:
            changed.append(node.name)
        OPT_INFO(f"gptq_zy: layer '{node.name}': {message}")
    return changed
