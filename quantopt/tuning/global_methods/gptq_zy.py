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
unchanged calibrated range and the layer's usual quantize function produce exactly those integers (the float
constants are restored after quantization). A layer keeps rounding to nearest when GPTQ does not lower the
Hessian-weighted error tr(ΔW·H·ΔWᵀ) of the undamped Hessian.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from ...graph.graph import PyGraph
from ...graph.node import PyNode
from ...log import OPT_INFO
from ...progress import progress
from ...quant.params import dequantize, quantize
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
    """Per-row quantization grid of a layer's weights, rows grouped as [G, rows per group]."""

    def __init__(self, qnode: PyNode, groups: int) -> None:
        scale, zp, self.qmin, self.qmax = weight_quant(qnode)
        out = int(qnode.constants["weights"].betensor.shape[0])
        self.scale = torch.broadcast_to(scale.reshape(-1), (out,)).reshape(groups, -1)
        self.zp = torch.broadcast_to(zp.reshape(-1), (out,)).reshape(groups, -1)

    def integers(self, w: torch.Tensor) -> torch.Tensor:
        """Integer weights of a column [G, rows] (or a matrix [G, rows, columns]) as the quantize function rounds."""
        s, z = (self.scale, self.zp) if w.dim() == 2 else (self.scale[..., None], self.zp[..., None])
        return quantize(w.to(torch.float32), s, z, self.qmin, self.qmax)

    def values(self, q: torch.Tensor) -> torch.Tensor:
        s, z = (self.scale, self.zp) if q.dim() == 2 else (self.scale[..., None], self.zp[..., None])
        return dequantize(q, s, z)


def _gptq(w: torch.Tensor, h: torch.Tensor, grid: _Grid, act_order: bool, damp: float, block: int) -> torch.Tensor:
    """Integer weights [G, rows, columns] chosen by GPTQ for float weights w [G, rows, columns] and Hessians h."""
    w = w.clone()
    h = h.clone()
    cols = int(w.shape[2])
    dead = torch.diagonal(h, dim1=1, dim2=2) == 0
    eye = torch.eye(cols, dtype=h.dtype).expand_as(h)
    h = torch.where(dead[:, None, :] & (eye > 0), torch.ones_like(h), h)
    w = torch.where(dead[:, None, :], torch.zeros_like(w), w)
    perm = torch.arange(cols).expand(w.shape[0], cols)
    if act_order:
        perm = torch.argsort(torch.diagonal(h, dim1=1, dim2=2), dim=1, descending=True, stable=True)
        w = torch.gather(w, 2, perm[:, None, :].expand_as(w))
        h = torch.gather(torch.gather(h, 1, perm[:, :, None].expand_as(h)), 2, perm[:, None, :].expand_as(h))
    diag = torch.diagonal(h, dim1=1, dim2=2)
    h = h + eye * (damp * diag.mean(dim=1))[:, None, None]
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w, dtype=torch.int64)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1 = w[:, :, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = w1[:, :, i]
            qi = grid.integers(col)
            q[:, :, i1 + i] = qi
            err = (col - grid.values(qi).to(col.dtype)) / u[:, i1 + i, i1 + i][:, None]
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
    grid = _Grid(qnode, groups)
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
    target = chosen.reshape(shape)
    if bool((quantize(new_w, scale, zp, qmin, qmax) != target).any()):
        return False, "the GPTQ integers cannot be expressed in float weights; rounding to nearest kept"
    moved = int((nearest.reshape(shape) != target).sum())
    wt.betensor = new_w.to(wt.betensor.dtype)
    return True, (f"{moved} of {target.numel()} weights quantized differently from rounding to nearest; "
                  f"Hessian-weighted error {e_rtn:.6g} -> {e_gptq:.6g}")


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
        reason = skip_reason(qnode)
        if reason is not None or node.name not in hessians:
            OPT_INFO(f"gptq_zy: layer '{node.name}' skipped: {reason or 'no calibration data reached it'}")
            continue
        if _groups(node) != int(hessians[node.name].shape[0]):
            OPT_INFO(f"gptq_zy: layer '{node.name}' skipped: its group count does not match its input")
            continue
        done, message = _layer(node, qnode, hessians[node.name], spec)
        if done:
            changed.append(node.name)
        OPT_INFO(f"gptq_zy: layer '{node.name}': {message}")
    return changed
