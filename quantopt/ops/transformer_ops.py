"""Transformer building blocks: RotaryEmbedding, CacheUpdate, SlotUpdate and QueryRebatch.

RotaryEmbedding rotates pairs of features of a query/key tensor by position-dependent angles read from cos/sin
caches (the rotary position embedding of LLaMA-style models). Quantized, the output is one signed per-tensor
activation and each rotated feature is the exact integer round_half_even(r_cos·C·X1 ∓ r_sin·S·X2) from three float32
rescale ratios kept in the IR as upstream spells them; the integer semantics, and how they differ from upstream's
float32 evaluation that ignores zero points, are in docs/semantics/transformer.md. CacheUpdate writes new key/value
rows into a KV-cache buffer and reads the cached rows back; quantized, the rows move as integers in the new entries'
quantization (the buffer's integers re-expressed in it exactly). SlotUpdate scatter-adds the rows of each slot to
the positions an index input lists (the integer sums requantized); QueryRebatch gathers the rows each index input
lists into one slot each (passthrough).
"""
from __future__ import annotations

import math
from typing import Callable, Tuple

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tables import ranges_of, statistics_of
from ..graph.tensor import PyTensor
from ..log import OPT_WARN
from ..quant.dtype import Dtype
from ..quant.requant import range_dtype, requantize_int
from ..quant.rounding import div_round_half_even, round_shift
from ..registry import declare_op
from ..registry.schema import Bool, Float, Int, Param, quantized
from ._quant import (
    check_quantized_inputs,
    copy_params,
    int_value,
    is_signed,
    layer_settings,
    out_range,
    params,
    quantize_activation,
    requant_of,
    requant_scale_shift,
    set_qinvariant,
    store_requant,
    tensor_scale,
    tensor_zp,
    zero_code,
)
from ._shared import bool_param, int_param

SEMANTICS = "docs/semantics/transformer.md"

INT64_BOUND = 1 << 62
"""The largest exact numerator the integer RotaryEmbedding forms before its one rounding shift."""

# ------------------------------------------------------------------------------------------------ RotaryEmbedding
ROTARY_EMBEDDING = declare_op(
    "RotaryEmbedding",
    params={"num_heads": Param(Int(lo=1), "heads of a 3-D input [batch, seq, heads*head_size] (required for it)"),
            "rotary_embedding_dim": Param(Int(), "features rotated at the start of each head (< 1: all of them)",
                                          default=0),
            "interleaved": Param(Bool(), "pairs are (even, odd) features; otherwise (first half, second half)",
                                 default=False),
            "rotate_rescale_cos": quantized(Float(), "s_out / (s_x · s_cos), float32"),
            "rotate_rescale_sin": quantized(Float(), "s_out / (s_x · s_sin), float32"),
            "not_rotate_rescale": quantized(Float(), "s_out / s_x for the features that are not rotated, float32")},
    dtypes="x: int8/int16 (any float in float mode); cos, sin: quantized; position_ids: integers; output: signed",
    integer="exact round_half_even(r_cos·C·X1 ∓ r_sin·S·X2) from the float32 ratios (zero points applied)",
    semantics=f"{SEMANTICS}#rotaryembedding",
    summary="Inputs: x [batch, heads, seq, head_size] or [batch, seq, heads*head_size], the cos and sin caches "
            "[max_pos, d] or [batch, max_pos, d] (d >= rotary_embedding_dim/2), optional position_ids [batch, seq] "
            "(default 0..seq-1). real = cos·x1 - sin·x2, imag = sin·x1 + cos·x2.")


def _rope_layout(node: PyNode, x: torch.Tensor) -> Tuple[torch.Tensor, bool]:
    """x as [batch, heads, seq, head_size]; True when it came as a 3-D [batch, seq, heads*head_size]."""
    if x.dim() == 4:
        return x, False
    if x.dim() != 3:
        raise node._error(f"input must be 3-D [batch, seq, hidden] or 4-D [batch, heads, seq, head_size], "
                          f"got shape {list(x.shape)}")
    heads = int_param(node, "num_heads", None)
    if heads is None:
        raise node._error("a 3-D input needs the parameter num_heads")
    b, s, hidden = (int(d) for d in x.shape)
    if hidden % heads:
        raise node._error(f"hidden size {hidden} is not a multiple of num_heads={heads}")
    return x.reshape(b, s, heads, hidden // heads).permute(0, 2, 1, 3), True


def _rope_positions(node: PyNode, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    if len(node.inputs) < 4:
        return torch.arange(seq, device=device).repeat(batch, 1)
    pos = _exact_integers(node, node.inputs[3], "position_ids")
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    try:
        return pos.expand(batch, seq)
    except RuntimeError:
        raise node._error(f"position_ids shape {list(pos.shape)} does not fit [batch, seq] = [{batch}, {seq}]") \
            from None


def _rope_cache(node: PyNode, cache: torch.Tensor, pos: torch.Tensor, half: int, name: str) -> torch.Tensor:
    """cache[b, position_ids[b, s], :half] as [batch, 1, seq, half]."""
    batch = int(pos.shape[0])
    if cache.dim() == 2:
        cache = cache.unsqueeze(0).expand(batch, -1, -1)
    elif cache.dim() != 3 or int(cache.shape[0]) != batch:
        raise node._error(f"{name} cache must be [max_pos, d] or [batch={batch}, max_pos, d], got shape "
                          f"{list(cache.shape)}")
    if int(cache.shape[-1]) < half:
        raise node._error(f"{name} cache has {int(cache.shape[-1])} features, fewer than rotary_embedding_dim/2 = "
                          f"{half}")
    if pos.numel() and (int(pos.min()) < -int(cache.shape[1]) or int(pos.max()) >= int(cache.shape[1])):
        raise node._error(f"position_ids must be in [0, {int(cache.shape[1])}) (the {name} cache's positions), got "
                          f"[{int(pos.min())}, {int(pos.max())}]")
    rows = torch.arange(batch, device=pos.device)[:, None]
    return cache[rows, pos][:, :, :half].unsqueeze(1)


Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                   Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _rope(node: PyNode, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, combine: Combine) -> torch.Tensor:
    """Split, gather the caches, `combine(cos, sin, x1, x2, rest)` -> (real, imag, rest), merge back."""
    if len(node.inputs) not in (3, 4):
        raise node._error(f"needs 3 or 4 inputs (x, cos, sin[, position_ids]), got {len(node.inputs)}")
    x4, was3d = _rope_layout(node, x)
    batch, _, seq, head = (int(d) for d in x4.shape)
    dim = int(node.get_param("rotary_embedding_dim", optional=True, default_value=0))
    if dim < 1:
        dim = head
    if dim > head or dim % 2:
        raise node._error(f"rotary_embedding_dim={dim} must be even and at most the head size {head}")
    half = dim // 2
    pos = _rope_positions(node, batch, seq, x.device)
    c = _rope_cache(node, cos, pos, half, "cos")
    s = _rope_cache(node, sin, pos, half, "sin")
    rot, rest = x4[..., :dim], x4[..., dim:]
    interleaved = bool_param(node, "interleaved", False)
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    real, imag, rest = combine(c, s, x1, x2, rest)
    rotated = torch.stack([real, imag], dim=-1).reshape(rot.shape) if interleaved else torch.cat([real, imag], -1)
    y = torch.cat([rotated, rest], dim=-1)
    if was3d:
        y = y.permute(0, 2, 1, 3).reshape(x.shape)
    return y


def _ratio(node: PyNode, key: str) -> Tuple[int, int]:
    """The float32 param `key` as an exact dyadic n / 2^k (n an integer, k >= 0)."""
    if key not in node.params:
        raise node._error(f"quantized layer lacks its parameter {key}")
    value = float(torch.tensor(float(node.params[key]), dtype=torch.float32))
    n, d = value.as_integer_ratio()
    return n, d.bit_length() - 1


def _bound(node: PyNode, what: str, value: int) -> None:
    if value >= INT64_BOUND:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the exact {what} of the integer rotation needs "
                               "more than 62 bits (rotate_rescale_cos and rotate_rescale_sin differ by too many powers "
                               "of two); requantize cos and sin to one scale")


def _absmax(node: PyNode, t: PyTensor) -> int:
    lo, hi = out_range(node, t)
    zp = tensor_zp(node, t)
    return max(abs(lo + zp), abs(hi + zp))


def _rope_int(node: PyNode) -> torch.Tensor:
    """C, S, X = q + zp; real = rshift(C·X1·n_c·2^(K-k_c) - S·X2·n_s·2^(K-k_s), K) (imag with +), rest =
    rshift(X·n_r, k_r), each rounded half to even once, minus zp_out, clamped to the output range."""
    tx, tc, ts = node.inputs[:3]
    out = node.outputs[0]
    (nc, kc), (ns, ks), (nr, kr) = (_ratio(node, k) for k in ("rotate_rescale_cos", "rotate_rescale_sin",
                                                              "not_rotate_rescale"))
    k = max(kc, ks)
    mc, ms = nc << (k - kc), ns << (k - ks)
    _bound(node, "sum", 2 * _absmax(node, tx) * max(_absmax(node, tc) * abs(mc), _absmax(node, ts) * abs(ms)))
    _bound(node, "product", _absmax(node, tx) * abs(nr))
    zp_out = tensor_zp(node, out)
    qmin, qmax = out_range(node, out)

    def finish(num: torch.Tensor, shift: int) -> torch.Tensor:
        return torch.clamp(round_shift(num, shift) - zp_out, qmin, qmax)

    def combine(c: torch.Tensor, s: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor,
                rest: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cx1, cx2, sx1, sx2 = c * x1, c * x2, s * x1, s * x2
        return (finish(cx1 * mc - sx2 * ms, k), finish(sx1 * ms + cx2 * mc, k), finish(rest * nr, kr))

    x = int_value(tx) + tensor_zp(node, tx)
    cos = int_value(tc) + tensor_zp(node, tc)
    sin = int_value(ts) + tensor_zp(node, ts)
    return _rope(node, x, cos, sin, combine)


@ROTARY_EMBEDDING.forward
def rotary_embedding_forward(self: PyNode) -> None:
    """Float: real = cos·x1 - sin·x2, imag = sin·x1 + cos·x2 in x's float type (float32 for integer inputs);
    quantized: the exact integer rotation (_rope_int)."""
    if self.quantized:
        self.outputs[0].betensor = _rope_int(self)
        return
    if len(self.inputs) < 3:
        raise self._error(f"needs 3 or 4 inputs (x, cos, sin[, position_ids]), got {len(self.inputs)}")
    x = self.inputs[0].betensor
    dtype = x.dtype if x.is_floating_point() else torch.float32
    cos, sin = (t.betensor.to(dtype) for t in self.inputs[1:3])

    def combine(c: torch.Tensor, s: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor,
                rest: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return c * x1 - s * x2, s * x1 + c * x2, rest

    self.outputs[0].betensor = _rope(self, x.to(dtype), cos, sin, combine)


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


@ROTARY_EMBEDDING.quantize
def rotary_embedding_quantize(self: PyNode) -> None:
    """Output: signed, per tensor, from its calibrated range. The ratios as upstream computes them, in float32:
    s_out / (s_x · s_cos), s_out / (s_x · s_sin), s_out / s_x."""
    if len(self.inputs) < 3:
        raise self._error(f"needs 3 or 4 inputs (x, cos, sin[, position_ids]), got {len(self.inputs)}")
    check_quantized_inputs(self, self.inputs[:3])
    out = self.outputs[0]
    quantize_activation(self, out, True)
    s_out, s_x = _f32(tensor_scale(self, out)), _f32(tensor_scale(self, self.inputs[0]))
    s_cos, s_sin = _f32(tensor_scale(self, self.inputs[1])), _f32(tensor_scale(self, self.inputs[2]))
    self.params["rotate_rescale_cos"] = float(s_out / (s_x * s_cos))
    self.params["rotate_rescale_sin"] = float(s_out / (s_x * s_sin))
    self.params["not_rotate_rescale"] = float(s_out / s_x)



# ------------------------------------------------------------------------------------------------ CacheUpdate
CACHE_UPDATE = declare_op(
    "CacheUpdate",
    params={"block_index": Param(Int(lo=0), "the block (first axis) of the buffer the rows go to", required=True)},
    dtypes="passthrough of the new entries' quantization (both outputs); positions: integers",
    integer="rows move as integers; the buffer's other rows re-expressed exactly in the entries' scale",
    semantics=f"{SEMANTICS}#cacheupdate",
    summary="Inputs: the buffer [blocks, 1, max_len, heads*head_dim], positions [1, n] (first row read), the new "
            "entries [1, heads, n, head_dim] (or n = 1 broadcast). Outputs: the cached rows [1, heads, L, head_dim] "
            "(L = position + 1 for one position, else the n positions; padded with 0 or cut to the IR's size) and "
            "the updated buffer.")


def _exact_integers(node: PyNode, t: PyTensor, what: str) -> torch.Tensor:
    """An index input as int64: float values truncated; quantized, an integer tensor (a quantized float tensor
    is refused naming `what`)."""
    if node.quantized:
        if not params(node, t).qinvariant:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): {what} '{t.name}' is a quantized tensor; "
                                   "it must hold exact integers")
        return int_value(t)
    v = t.betensor
    return (torch.trunc(v.to(torch.float64)) if v.is_floating_point() else v).to(torch.int64)


def _cache_positions(node: PyNode, t: PyTensor) -> torch.Tensor:
    """The first row of the positions input as int64 (float values truncated; quantized: an integer tensor)."""
    idx = _exact_integers(node, t, "positions")
    if idx.dim() < 1 or idx.dim() > 2 or idx.numel() == 0:
        raise node._error(f"positions must be [1, n] (or [n]), got shape {list(idx.shape)}")
    return idx[0] if idx.dim() == 2 else idx


def _requantize_exact(node: PyNode, q: torch.Tensor, src: PyTensor, dst: PyTensor) -> torch.Tensor:
    """round_half_even((q + zp_src) · s_dst / s_src) - zp_dst, clamped to dst's range, with the float32 scales as
    exact dyadic rationals; the identity when the two tensors have the same scale and zero point."""
    s_src, s_dst = float(_f32(tensor_scale(node, src))), float(_f32(tensor_scale(node, dst)))
    zp_src, zp_dst = tensor_zp(node, src), tensor_zp(node, dst)
    qmin, qmax = out_range(node, dst)
    if s_src == s_dst:
        return torch.clamp(q + zp_src - zp_dst, qmin, qmax)
    (n_dst, d_dst), (n_src, d_src) = s_dst.as_integer_ratio(), s_src.as_integer_ratio()
    num, den = n_dst * d_src, n_src * d_dst  # s_dst / s_src = num / den
    g = math.gcd(num, den)
    num, den = num // g, den // g
    lo, hi = out_range(node, src)
    if max(abs(lo + zp_src), abs(hi + zp_src)) * num >= INT64_BOUND or 2 * den >= INT64_BOUND:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): the scales of '{src.name}' ({s_src}) and "
                               f"'{dst.name}' ({s_dst}) are too far apart to re-express the buffer exactly in int64")
    return torch.clamp(div_round_half_even((q + zp_src) * num, den) - zp_dst, qmin, qmax)


@CACHE_UPDATE.forward
def cache_update_forward(self: PyNode) -> None:
    """buffer[block, 0, positions, :] = the entries as [n, heads*head_dim]; output 0 the rows 0..p (one position p)
    or the n positions of that block as [1, heads, L, head_dim]; output 1 the updated buffer (a copy: the input
    buffer is not changed)."""
    if len(self.inputs) != 3 or len(self.outputs) != 2:
        raise self._error(f"needs 3 inputs (buffer, positions, entries) and 2 outputs, got {len(self.inputs)} and "
                          f"{len(self.outputs)}")
    tb, tp, te = self.inputs
    if self.quantized:
        buf = _requantize_exact(self, int_value(tb), tb, self.outputs[1])
        entries = int_value(te)
    else:
        entries = te.betensor
        buf = tb.betensor.to(entries.dtype if entries.is_floating_point() else tb.betensor.dtype).clone()
        entries = entries.to(buf.dtype)
    if buf.dim() != 4 or int(buf.shape[1]) < 1:
        raise self._error(f"buffer must be [blocks, 1, max_len, heads*head_dim], got shape {list(buf.shape)}")
    if entries.dim() != 4 or int(entries.shape[0]) != 1:
        raise self._error(f"entries must be [1, heads, n, head_dim], got shape {list(entries.shape)}")
    _, heads, n, head_dim = (int(d) for d in entries.shape)
    blocks, _, max_len, width = (int(d) for d in buf.shape)
    block = int(self.get_param("block_index"))
    if block >= blocks:
        raise self._error(f"block_index={block} is beyond the buffer's {blocks} blocks")
    if heads * head_dim != width:
        raise self._error(f"entries have heads*head_dim = {heads * head_dim} features, the buffer rows {width}")
    idx = _cache_positions(self, tp)
    if int(idx.min()) < 0 or int(idx.max()) >= max_len:
        raise self._error(f"positions must be in [0, {max_len}), got [{int(idx.min())}, {int(idx.max())}]")
    if n not in (1, int(idx.numel())):
        raise self._error(f"{n} entries for {int(idx.numel())} positions")
    rows = entries.permute(0, 2, 1, 3).reshape(n, width)
    buf[block, 0, idx, :] = rows.expand(int(idx.numel()), width) if n == 1 else rows
    out_idx = torch.arange(int(idx[0]) + 1, device=buf.device) if idx.numel() == 1 else idx
    out = buf[block, 0, out_idx, :].reshape(1, int(out_idx.numel()), heads, head_dim).permute(0, 2, 1, 3)
    self.outputs[0].betensor = _fit_axis2(self, out.contiguous())
    self.outputs[1].betensor = buf


def _fit_axis2(node: PyNode, x: torch.Tensor) -> torch.Tensor:
    """Output 0 padded with float 0 (quantized: -zp, clamped) or cut, with a warning, to its IR length (axis 2)."""
    ir_shape = node.outputs[0].ir_shape
    if ir_shape is None or len(ir_shape) != 4:
        return x
    size, have = int(ir_shape[2]), int(x.shape[2])
    if have > size:
        OPT_WARN(f"layer '{node.name}' ({node.type}): {have} cached rows, the IR declares {size}; the rest is cut")
        return x[:, :, :size].contiguous()
    if have == size:
        return x
    fill = 0
    if node.quantized:
        fill = zero_code(node, node.outputs[0])
    pad = torch.full((x.shape[0], x.shape[1], size - have, x.shape[3]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=2)


@CACHE_UPDATE.quantize
def cache_update_quantize(self: PyNode) -> None:
    """Both outputs carry the new entries' params (as upstream); the positions must be integers."""
    if len(self.inputs) != 3 or len(self.outputs) != 2:
        raise self._error(f"needs 3 inputs (buffer, positions, entries) and 2 outputs, got {len(self.inputs)} and "
                          f"{len(self.outputs)}")
    check_quantized_inputs(self, self.inputs)
    for out in self.outputs:
        copy_params(self, out, self.inputs[2])


# ------------------------------------------------------------------------------------------------ SlotUpdate
SLOT_UPDATE = declare_op(
    "SlotUpdate",
    params={},
    dtypes="x: quantized or integer; indices: integers; output: signed like x, from its calibrated range",
    integer="exact integer sums of q + zp, requantized with scale_value/shift_value (activation-bits multiplier)",
    semantics=f"{SEMANTICS}#slotupdate",
    summary="Inputs: x [batch, N, S, D...] and N index vectors; output [batch, M, D...] with "
            "out[b, idx_i[k]] += x[b, i, k] (zeros elsewhere).")


def _index_vector(node: PyNode, t: PyTensor, size: int) -> torch.Tensor:
    """A 1-D index input as int64 within [0, size) (float values truncated; quantized: an integer tensor)."""
    if node.quantized:
        if not params(node, t).qinvariant:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): index input '{t.name}' is a quantized "
                                   "tensor; it must hold exact integers")
        idx = int_value(t)
    else:
        idx = t.betensor
        idx = (torch.trunc(idx.to(torch.float64)) if idx.is_floating_point() else idx).to(torch.int64)
    if idx.dim() != 1:
        raise node._error(f"index input '{t.name}' must be 1-D, got shape {list(idx.shape)}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= size):
        raise node._error(f"index input '{t.name}' must hold values in [0, {size}), got [{int(idx.min())}, "
                          f"{int(idx.max())}]")
    return idx


@SLOT_UPDATE.forward
def slot_update_forward(self: PyNode) -> None:
    """out[b, idx_i[k]] += x[b, i, k] for every slot i and k < len(idx_i); float in x's float type, quantized the
    int64 sums of q + zp_x requantized: clamp(rs(acc · M, N) - zp_out)."""
    x_t, out = self.inputs[0], self.outputs[0]
    ir_shape = out.ir_shape
    if ir_shape is None or len(ir_shape) < 2:
        raise self._error("the output needs an IR shape [batch, M, ...] (M: the positions)")
    x = int_value(x_t) + tensor_zp(self, x_t) if self.quantized else x_t.betensor
    if x.dim() < 3 or int(x.shape[1]) != len(self.inputs) - 1:
        raise self._error(f"input x {list(x.shape)} must be [batch, N, S, ...] with N = the {len(self.inputs) - 1} "
                          "index inputs")
    positions = int(ir_shape[1])
    if list(x.shape[3:]) != [int(d) for d in ir_shape[2:]]:
        raise self._error(f"rows of x {list(x.shape[3:])} differ from the output's {[int(d) for d in ir_shape[2:]]}")
    dtype = torch.int64 if self.quantized else (x.dtype if x.is_floating_point() else torch.float32)
    acc = torch.zeros((int(x.shape[0]), positions, *x.shape[3:]), dtype=dtype, device=x.device)
    for i, t in enumerate(self.inputs[1:]):
        idx = _index_vector(self, t, positions)
        if int(idx.numel()) > int(x.shape[2]):
            raise self._error(f"index input '{t.name}' has {int(idx.numel())} entries, slot {i} only "
                              f"{int(x.shape[2])} rows")
        for k in range(int(idx.numel())):  # in order, as the float reference sums them
            acc[:, int(idx[k])] += x[:, i, k].to(dtype)
    if self.quantized:
        m, n = requant_of(self)
        qmin, qmax = out_range(self, out)
        acc = requantize_int(acc, m, n, tensor_zp(self, out), qmin, qmax)
    out.betensor = acc


@SLOT_UPDATE.quantize
def slot_update_quantize(self: PyNode) -> None:
    """As upstream: signed iff x is (or force_dtype_int); an integer x gives an integer output of the dtype its
    extrema need (multiplier 1, shift 0); otherwise the output from its calibrated range and M/N ≈ s_out / s_x with
    the activation bits as multiplier bits; the shift type is int8."""
    check_quantized_inputs(self, self.inputs)
    x_t, out = self.inputs[0], self.outputs[0]
    s = layer_settings(self)
    signed = is_signed(self, x_t) or bool(s.force_dtype_int)
    if params(self, x_t).qinvariant:
        st, r = statistics_of(self).get(out), ranges_of(self).get(out)
        lo = st.extrema_min if st.extrema_min is not None else r.min
        hi = st.extrema_max if st.extrema_max is not None else r.max
        dtype = range_dtype(float(lo or 0.0), float(hi or 0.0), force_signed=signed)
        set_qinvariant(self, out, dtype.bits, dtype.is_signed)
        store_requant(self, 1, 0, Dtype.UINT8 if dtype.bits <= 8 else Dtype.UINT16, Dtype.INT8)
        return
    quantize_activation(self, out, signed)
    bits = int(s.q_bits_activation)
    ratio = _f32(tensor_scale(self, out)) / _f32(tensor_scale(self, x_t))
    m, n, mdtype, _ = requant_scale_shift(self, ratio, mult_bits=bits)
    store_requant(self, m, n, mdtype, Dtype.INT8)


# ------------------------------------------------------------------------------------------------ QueryRebatch
QUERY_REBATCH = declare_op(
    "QueryRebatch",
    params={},
    dtypes="passthrough of x; indices: integers",
    integer="passthrough; empty rows hold float 0 (clamp(-zp))",
    semantics=f"{SEMANTICS}#queryrebatch",
    summary="Inputs: x [batch, S, ...] and N index vectors; output [batch, N, L, ...] with out[:, i, :len(idx_i)] = "
            "x[:, idx_i] (L: the IR's, at least the longest index vector; zeros elsewhere).")


@QUERY_REBATCH.forward
def query_rebatch_forward(self: PyNode) -> None:
    """out[:, i, k] = x[:, idx_i[k]]; the rest float 0 (quantized: clamp(-zp_out, qmin, qmax))."""
    x_t, out = self.inputs[0], self.outputs[0]
    x = x_t.betensor
    n = len(self.inputs) - 1
    if n < 1 or x.dim() < 2:
        raise self._error(f"needs x [batch, S, ...] and at least one index input, got {len(self.inputs)} inputs and "
                          f"x of shape {list(x.shape)}")
    ir_shape = out.ir_shape
    if ir_shape is not None and len(ir_shape) >= 3 and int(ir_shape[1]) != n:
        raise self._error(f"the output's dim 1 ({int(ir_shape[1])}) must be the number of index inputs ({n})")
    indices = [_index_vector(self, t, int(x.shape[1])) for t in self.inputs[1:]]
    longest = max(int(i.numel()) for i in indices)
    length = int(ir_shape[2]) if ir_shape is not None and len(ir_shape) >= 3 else longest
    if length < longest:
        raise self._error(f"an index input has {longest} entries, more than the output's dim 2 ({length})")
    fill = 0
    if self.quantized:
        fill = zero_code(self, out)
    y = torch.full((int(x.shape[0]), n, length, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    for i, idx in enumerate(indices):
        y[:, i, :int(idx.numel())] = x[:, idx]
    out.betensor = y


@QUERY_REBATCH.quantize
def query_rebatch_quantize(self: PyNode) -> None:
    """The output carries x's params (upstream clones them)."""
    check_quantized_inputs(self, self.inputs)
    copy_params(self, self.outputs[0], self.inputs[0])
