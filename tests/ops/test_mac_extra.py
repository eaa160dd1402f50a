"""Convolution3D, ConvTranspose, ConvTranspose3D, Gemm, BiasAdd: float forward against torch/numpy definitions,
integer forward against an independent reference written from docs/semantics/mac.md (torch float64 convolutions
of integer tensors, python-int requantization), float-vs-dequantized cosine, IR write → re-read identity, errors."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from quant_helpers import params_of

import quantopt.ops.mac_extra as mac_extra
from quantopt.analysis.similarity import cosine
from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

# (activation bits, activation mode, weight mode); 16-bit activations are made symmetric by the quantizer
MODES = [
    (8, "per_tensor_symmetric_full_range", "per_tensor_symmetric_restricted_range"),
    (8, "per_tensor_asymmetric", "per_channel_symmetric_restricted_range"),
    (8, "per_tensor_asymmetric", "per_channel_asymmetric"),
    (16, "per_tensor_symmetric_full_range", "per_channel_symmetric_full_range"),
    (16, "per_tensor_asymmetric", "per_tensor_asymmetric"),
]
ACT_MODES = [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"),
             (16, "per_tensor_symmetric_restricted_range")]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is much faster than several competing ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def data(shape: Sequence[int], seed: int, n: int = 3, loc: float = 0.3, std: float = 1.0) -> List[torch.Tensor]:
    r = _rng(seed)
    return [torch.from_numpy(r.normal(loc, std, size=shape).astype(np.float32)) for _ in range(n)]


def settings(bits: int, amode: str, wmode: str = "per_tensor_symmetric_restricted_range", **extra: Any) -> Dict:
    return dict(q_bits_activation=bits, q_bits_weight=bits, q_bits_bias=48 if bits > 8 else 32,
                q_mode_activation=amode, q_mode_weight=wmode, **extra)


# ------------------------------------------------------------------------------------------ reference arithmetic
def rhe(num: int, shift: int) -> int:
    """round_half_even(num / 2^shift) with python ints; shift <= 0 multiplies exactly."""
    if shift <= 0:
        return num << -shift
    q, rem = divmod(num, 1 << shift)
    half = 1 << (shift - 1)
    return q + (1 if rem > half or (rem == half and q % 2 == 1) else 0)


def ref_requant(acc: np.ndarray, mult, shift, zp_out: int, qmin: int, qmax: int) -> np.ndarray:
    """clamp(round_half_even(acc * M / 2^shift) - zp_out, qmin, qmax), M/shift per channel on the last axis."""
    acc = np.asarray(acc, dtype=np.int64)
    mult = np.broadcast_to(np.asarray(mult, dtype=np.int64), acc.shape)
    shift = np.broadcast_to(np.asarray(shift, dtype=np.int64), acc.shape)
    out = np.empty(acc.shape, dtype=np.int64)
    for idx in np.ndindex(acc.shape):
        out[idx] = min(max(rhe(int(acc[idx]) * int(mult[idx]), int(shift[idx])) - zp_out, qmin), qmax)
    return out


def out_info(node) -> Tuple[int, int, int]:
    """Zero point and integer bounds of the layer's output."""
    q = params_of(node, node.outputs[0])
    return int(q.zerop), int(q.qmin), int(q.qmax)


def ref_act_bounds(node, y: np.ndarray) -> np.ndarray:
    act = str(node.params.get("with_activation", "NONE")).upper()
    if act not in ("RELU", "RELU6", "CLIP"):
        return y
    out = params_of(node, node.outputs[0])
    lo, hi = {"RELU": (0.0, None), "RELU6": (0.0, 6.0)}.get(act, (node.params.get("clip_min"),
                                                                  node.params.get("clip_max")))

    def q(v: float) -> int:
        return min(max(int(np.round(np.float64(v) * np.float64(out.scale) - out.zerop)), out.qmin), out.qmax)
    return np.clip(y, q(lo), out.qmax if hi is None else q(hi))


def requant_params(node):
    if "scale" in node.constants:
        return (node.constants["scale"].betensor.numpy().astype(np.int64),
                node.constants["shift"].betensor.numpy().astype(np.int64))
    return node.params["scale_value"], node.params["shift_value"]


def weight_zp(node, channels: int) -> np.ndarray:
    if "weights_zp" in node.constants:
        return node.constants["weights_zp"].betensor.numpy().astype(np.int64).reshape(-1)
    return np.full(channels, int(node.params.get("weights_zp", 0)), dtype=np.int64)


def mac_reference(node, acc_nobias: np.ndarray) -> np.ndarray:
    """Bias, optional remain_shift hand-over, requantization, fused bounds (docs/semantics/mac.md, MAC output)."""
    b = node.constants["biases"].betensor.numpy().astype(np.int64).reshape(-1)
    mult, shift = requant_params(node)
    remain = node.params.get("remain_shift")
    common = int(np.asarray(shift).reshape(-1)[0])
    wide = (params_of(node, node.inputs[0]).qbits or 8) > 8 or node.constants["weights"].dtype.bits > 8
    if remain is not None and wide and len(set(np.asarray(shift).reshape(-1).tolist())) == 1:
        d = common - int(remain)
        if d > 0:
            pre = ref_requant(acc_nobias, 1, d, 0, -(2 ** 31), 2 ** 31 - 1)
            acc = pre + np.clip(b >> d, -(2 ** 31), 2 ** 31 - 1)
            shift = np.full_like(np.asarray(shift), int(remain))
        else:
            acc = np.clip(acc_nobias, -(2 ** 31), 2 ** 31 - 1) + b
    else:
        acc = acc_nobias + b
    zp_out, qmin, qmax = out_info(node)
    return ref_act_bounds(node, ref_requant(acc, mult, shift, zp_out, qmin, qmax))


# ------------------------------------------------------------------------------------------ Convolution3D
def conv3d_graph(seed: int, group: int = 1, act: str = "NONE", bias: bool = True, cin: int = 4, cout: int = 6,
                 in_dhw=(4, 6, 5), k=(2, 3, 2), s=(1, 2, 1), d=(1, 1, 2), pb=(1, 0, 1), pe=(0, 1, 1)):
    """Weights drawn in ONNX layout [out, in/g, kd, kh, kw], written as the Parser does: [out, kh, kw, kd, in/g]."""
    r = _rng(seed)
    w_onnx = r.normal(0, 0.4, size=(cout, cin // group) + tuple(k)).astype(np.float32)
    consts = {"weights": np.transpose(w_onnx, (0, 3, 4, 2, 1))}
    if bias:
        consts["biases"] = r.normal(0, 0.3, size=(cout,)).astype(np.float32)
    out = [(n + b + e - ((kk - 1) * dd + 1)) // ss + 1 for n, b, e, kk, dd, ss in zip(in_dhw, pb, pe, k, d, s)]
    params = dict(num_output=cout, kernel_z=k[0], kernel_y=k[1], kernel_x=k[2], stride_z=s[0], stride_y=s[1],
                  stride_x=s[2], dilation_z=d[0], dilation_y=d[1], dilation_x=d[2], pad_z_begin=pb[0],
                  pad_z_end=pe[0], pad_y_begin=pb[1], pad_y_end=pe[1], pad_x_begin=pb[2], pad_x_end=pe[2],
                  group=group, with_activation=act)
    if act == "CLIP":
        params.update(clip_min=-0.4, clip_max=1.2)
    g = GraphBuilder("c3")
    x = g.input("x", [1, *in_dhw, cin])
    y = g.layer("Convolution3D", [x], [[1, *out, cout]], name="op", params=params, constants=consts)
    return g.build([y]), w_onnx, consts.get("biases"), [1, *in_dhw, cin]


def torch_conv3d_ref(x: torch.Tensor, w_onnx: np.ndarray, b, node_params) -> torch.Tensor:
    p = node_params
    xt = F.pad(x.double().permute(0, 4, 1, 2, 3), (p["pad_x_begin"], p["pad_x_end"], p["pad_y_begin"],
                                                    p["pad_y_end"], p["pad_z_begin"], p["pad_z_end"]))
    y = F.conv3d(xt, torch.from_numpy(w_onnx).double(), None if b is None else torch.from_numpy(b).double(),
                 stride=(p["stride_z"], p["stride_y"], p["stride_x"]),
                 dilation=(p["dilation_z"], p["dilation_y"], p["dilation_x"]), groups=p["group"])
    return y.permute(0, 2, 3, 4, 1)


def ref_conv3d_int(node) -> np.ndarray:
    """conv3d(x_q padded with -zp_in, w_q + zp_w) with torch float64 on integers (exact), no bias."""
    p = node.params
    w = node.constants["weights"].betensor.numpy().astype(np.int64)
    w = w + weight_zp(node, w.shape[0]).reshape(-1, 1, 1, 1, 1)
    zp = int(params_of(node, node.inputs[0]).zerop)
    x = torch.from_numpy(node.inputs[0].betensor.numpy().astype(np.float64)).permute(0, 4, 1, 2, 3)
    x = F.pad(x, (p["pad_x_begin"], p["pad_x_end"], p["pad_y_begin"], p["pad_y_end"], p["pad_z_begin"],
                  p["pad_z_end"]), value=float(-zp))
    wt = torch.from_numpy(w.astype(np.float64)).permute(0, 4, 3, 1, 2)
    y = F.conv3d(x, wt, stride=(p["stride_z"], p["stride_y"], p["stride_x"]),
                 dilation=(p["dilation_z"], p["dilation_y"], p["dilation_x"]), groups=p["group"])
    return y.permute(0, 2, 3, 4, 1).numpy().astype(np.int64)


# ------------------------------------------------------------------------------------------ ConvTranspose(3D)
def convt_graph(seed: int, nd: int = 2, group: int = 1, act: str = "NONE", bias: bool = True, cin: int = 4,
                cout: int = 6, spatial=None, k=None, s=None, d=None, pb=None, pe=None, op=None):
    """Weights drawn in ONNX layout [in, out/g, k...] and permuted as the Parser does ([1,2,3,0] / [1,3,4,2,0])."""
    r = _rng(seed)
    spatial = spatial or ((4, 3) if nd == 2 else (3, 3, 2))
    k = k or ((3, 2) if nd == 2 else (2, 3, 2))
    s = s or ((2, 3) if nd == 2 else (2, 1, 2))
    d = d or ((1, 2) if nd == 2 else (1, 2, 1))
    pb = pb or ((1, 0) if nd == 2 else (0, 1, 1))
    pe = pe or ((0, 2) if nd == 2 else (1, 0, 0))
    op = op or ((1, 0) if nd == 2 else (1, 0, 1))
    w_onnx = r.normal(0, 0.4, size=(cin, cout // group) + tuple(k)).astype(np.float32)
    w_ir = np.transpose(w_onnx, (1, 2, 3, 0) if nd == 2 else (1, 3, 4, 2, 0))
    consts = {"weights": w_ir}
    if bias:
        consts["biases"] = r.normal(0, 0.3, size=(cout,)).astype(np.float32)
    out = [(n - 1) * ss + (kk - 1) * dd + 1 + o - b - e for n, ss, kk, dd, o, b, e in zip(spatial, s, k, d, op, pb, pe)]
    params: Dict[str, Any] = dict(num_output=cout, group=group, with_activation=act)
    if nd == 2:
        params.update(kernel_y=k[0], kernel_x=k[1], stride_y=s[0], stride_x=s[1], dilation_y=d[0], dilation_x=d[1],
                      pad_top=pb[0], pad_bottom=pe[0], pad_left=pb[1], pad_right=pe[1], output_padding_y=op[0],
                      output_padding_x=op[1])
    else:
        for i, a in enumerate("zyx"):
            params.update({f"kernel_{a}": k[i], f"stride_{a}": s[i], f"dilation_{a}": d[i],
                           f"pad_{a}_begin": pb[i], f"pad_{a}_end": pe[i], f"output_padding_{a}": op[i]})
    if act == "CLIP":
        params.update(clip_min=-0.4, clip_max=1.2)
    g = GraphBuilder("ct")
    x = g.input("x", [1, *spatial, cin])
    y = g.layer("ConvTranspose" if nd == 2 else "ConvTranspose3D", [x], [[1, *out, cout]], name="op",
                params=params, constants=consts)
    geo = dict(s=s, d=d, pb=pb, pe=pe, op=op, group=group)
    return g.build([y]), w_onnx, consts.get("biases"), [1, *spatial, cin], geo


def torch_convt_ref(x: torch.Tensor, w_onnx: np.ndarray, b, geo) -> torch.Tensor:
    """ONNX ConvTranspose: full transposed convolution with output_padding, then the begin/end pads removed."""
    nd = w_onnx.ndim - 2
    fn = F.conv_transpose2d if nd == 2 else F.conv_transpose3d
    y = fn(x.double().movedim(-1, 1), torch.from_numpy(w_onnx).double(),
           None if b is None else torch.from_numpy(b).double(), stride=geo["s"], padding=0,
           output_padding=geo["op"], groups=geo["group"], dilation=geo["d"])
    idx = (slice(None), slice(None)) + tuple(slice(b0, n - e0) for b0, e0, n in zip(geo["pb"], geo["pe"],
                                                                                    y.shape[2:]))
    return y[idx].movedim(1, -1)


def ref_convt_int(node, geo) -> np.ndarray:
    """docs/semantics/mac.md ConvTranspose: the input upsampled by the stride with holes -zp_in, padded with -zp_in
    by (k-1)*d - pad_begin before and (k-1)*d - pad_end + output_padding after (negative amounts crop), then a plain
    convolution (stride 1, dilation d) with the spatially flipped kernel of each output channel; no bias."""
    nd = len(geo["s"])
    zp = int(params_of(node, node.inputs[0]).zerop)
    x = node.inputs[0].betensor.numpy().astype(np.int64)
    w_ir = node.constants["weights"].betensor.numpy().astype(np.int64)  # [cog, kh, kw, (kd,) cin]
    g = geo["group"]
    cog, cin = w_ir.shape[0], w_ir.shape[-1]
    cig = cin // g
    zpw = weight_zp(node, cog * g)
    # per output channel c = gi*cog + j: IR row j restricted to input channels of group gi, in torch order
    kperm = (0, 1) if nd == 2 else (2, 0, 1)
    wc = np.zeros((cog * g, cig) + tuple(w_ir.shape[1 + p] for p in kperm), dtype=np.int64)
    for gi in range(g):
        for j in range(cog):
            sl = w_ir[j, ..., gi * cig:(gi + 1) * cig] + zpw[gi * cog + j]  # [k_ir..., cig]
            sl = np.moveaxis(sl, -1, 0)  # [cig, k_ir...]
            wc[gi * cog + j] = np.transpose(sl, (0,) + tuple(p + 1 for p in kperm))
    wflip = np.flip(wc, axis=tuple(range(2, 2 + nd))).copy()
    n = x.shape[0]
    spatial = x.shape[1:-1]
    up_shape = [(L - 1) * s + 1 for L, s in zip(spatial, geo["s"])]
    u = np.full((n, cin, *up_shape), -zp, dtype=np.int64)
    xc = np.moveaxis(x, -1, 1)
    u[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in geo["s"])] = xc
    ks = wc.shape[2:]
    for ax in range(nd):
        before = (ks[ax] - 1) * geo["d"][ax] - geo["pb"][ax]
        after = (ks[ax] - 1) * geo["d"][ax] - geo["pe"][ax] + geo["op"][ax]
        axis = 2 + ax
        if before < 0:
            u = np.take(u, range(-before, u.shape[axis]), axis=axis)
        if after < 0:
            u = np.take(u, range(0, u.shape[axis] + after), axis=axis)
        pads = [(0, 0)] * u.ndim
        pads[axis] = (max(before, 0), max(after, 0))
        u = np.pad(u, pads, constant_values=-zp)
    fn = F.conv2d if nd == 2 else F.conv3d
    y = fn(torch.from_numpy(u.astype(np.float64)), torch.from_numpy(wflip.astype(np.float64)), stride=1,
           dilation=geo["d"], groups=g)
    return np.moveaxis(y.numpy(), 1, -1).astype(np.int64)


# ------------------------------------------------------------------------------------------ Gemm
def gemm_graph(a_shape, b_shape, c_shape=None, ta=False, tb=False, alpha=1.0, beta=1.0, const_b=None,
               const_c=None, in_dtype: Dtype = Dtype.FP32, act: str = "NONE"):
    g = GraphBuilder("gemm")
    inputs = [g.input("a", list(a_shape), in_dtype)]
    if const_b is None:
        inputs.append(g.input("b", list(b_shape), in_dtype))
    else:
        inputs.append(g.layer("Constant", [], [list(b_shape)], name="cb", constants={"weights": const_b}))
    if c_shape is not None:
        if const_c is None:
            inputs.append(g.input("c", list(c_shape), in_dtype))
        else:
            inputs.append(g.layer("Constant", [], [list(c_shape)], name="cc", constants={"weights": const_c}))
    m = a_shape[1] if ta else a_shape[0]
    n = b_shape[0] if tb else b_shape[1]
    params = dict(trans_a=ta, trans_b=tb, alpha=alpha, beta=beta)
    if act != "NONE":
        params["with_activation"] = act
    y = g.layer("Gemm", inputs, [[m, n]], name="op", params=params)
    return g.build([y])


def gemm_feeds(shapes: Sequence[Sequence[int]], seed: int, n: int = 3) -> List[List[torch.Tensor]]:
    per = [data(s, seed + 10 * i, n, loc=0.2 - 0.3 * i) for i, s in enumerate(shapes)]
    return [list(batch) for batch in zip(*per)]


def np_gemm(a, b, c, ta, tb, alpha, beta):
    a = a.T if ta else a
    b = b.T if tb else b
    y = alpha * (a.astype(np.float64) @ b.astype(np.float64))
    return y if c is None else y + beta * c.astype(np.float64)


def ref_gemm_int(node) -> np.ndarray:
    """docs/semantics/mac.md Gemm, python ints for the requantizations."""
    p = node.params
    ta, tb = node.inputs[0], node.inputs[1]
    a = ta.betensor.numpy().astype(np.int64) + int(params_of(node, ta).zerop)
    b = tb.betensor.numpy().astype(np.int64) + int(params_of(node, tb).zerop)
    a = a.T if p["trans_a"] else a
    b = b.T if p["trans_b"] else b
    acc = a @ b
    if p["alpha"] < 0:
        acc = -acc
    if len(node.inputs) == 3:
        (m, mc), (n, nc) = p["scale_value"], p["shift_value"]
        tc = node.inputs[2]
        c = tc.betensor.numpy().astype(np.int64) + int(params_of(node, tc).zerop)
        cb = np.vectorize(lambda v: rhe(int(v) * mc, nc), otypes=[np.int64])(c)
        acc = acc + (-cb if p["beta"] < 0 else cb)
    else:
        m, n = p["scale_value"], p["shift_value"]
    zp_out, qmin, qmax = out_info(node)
    return ref_act_bounds(node, ref_requant(acc, m, n, zp_out, qmin, qmax))


# ------------------------------------------------------------------------------------------ BiasAdd
def bias_add_graph(seed: int, shape=(1, 4, 5, 6), axis: Optional[int] = None, act: str = "NONE"):
    r = _rng(seed)
    ax = -1 if axis is None else axis
    bias = r.normal(0, 0.8, size=(shape[ax],)).astype(np.float32)
    params: Dict[str, Any] = {"with_activation": act}
    if axis is not None:
        params["axis"] = axis
    g = GraphBuilder("ba")
    y = g.layer("BiasAdd", [g.input("x", list(shape))], [list(shape)], name="op", params=params,
                constants={"biases": bias})
    return g.build([y]), bias


def ref_bias_add_int(node, axis: int) -> np.ndarray:
    x = np.moveaxis(node.inputs[0].betensor.numpy().astype(np.int64), axis, -1)
    w = node.constants["weights"].betensor.numpy().astype(np.int64).reshape(-1)[0] + int(node.params["weights_zp"])
    return np.moveaxis(mac_reference(node, x * w), -1, axis)


# ================================================================================================ float forward
@pytest.mark.parametrize("group,bias", [(1, True), (2, False)])
def test_conv3d_float_matches_torch(group: int, bias: bool) -> None:
    g, w_onnx, b, shape = conv3d_graph(1, group=group, bias=bias)
    x = data([2] + shape[1:], 2, 1)[0]
    got = g.forward([x])[0]
    want = torch_conv3d_ref(x, w_onnx, b, g.node("op").params)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nd", [2, 3])
@pytest.mark.parametrize("group,bias", [(1, True), (2, True), (4, False)])
def test_conv_transpose_float_matches_torch(nd: int, group: int, bias: bool) -> None:
    g, w_onnx, b, shape, geo = convt_graph(3, nd=nd, group=group, bias=bias, cout=8)
    x = data([2] + shape[1:], 4, 1)[0]
    got = g.forward([x])[0]
    torch.testing.assert_close(got.double(), torch_convt_ref(x, w_onnx, b, geo), rtol=1e-5, atol=1e-5)


def test_conv_transpose_float_symmetric_pads_match_torch_padding() -> None:
    """Equal begin/end pads are torch's `padding`: the crop definition agrees with it."""
    g, w_onnx, b, shape, geo = convt_graph(5, nd=2, k=(3, 3), s=(2, 2), d=(1, 1), pb=(1, 1), pe=(1, 1), op=(1, 1))
    x = data([1] + shape[1:], 6, 1)[0]
    want = F.conv_transpose2d(x.double().permute(0, 3, 1, 2), torch.from_numpy(w_onnx).double(),
                              torch.from_numpy(b).double(), stride=2, padding=1, output_padding=1)
    torch.testing.assert_close(g.forward([x])[0].double(), want.permute(0, 2, 3, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("with_c,alpha,beta", [(False, 1.0, 1.0), (True, 0.5, -1.5), (True, -2.0, 0.25)])
def test_gemm_float_matches_numpy(ta: bool, tb: bool, with_c: bool, alpha: float, beta: float) -> None:
    a_shape = (7, 5) if ta else (5, 7)
    b_shape = (4, 7) if tb else (7, 4)
    c_shape = (1, 4) if with_c else None
    g = gemm_graph(a_shape, b_shape, c_shape, ta, tb, alpha, beta)
    feeds = gemm_feeds([a_shape, b_shape] + ([c_shape] if with_c else []), 7, 1)[0]
    got = g.forward(feeds)[0]
    want = np_gemm(*[f.numpy() for f in feeds[:2]], feeds[2].numpy() if with_c else None, ta, tb, alpha, beta)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis", [None, 1])
def test_bias_add_float_matches_numpy(axis) -> None:
    g, bias = bias_add_graph(8, axis=axis)
    x = data([2, 4, 5, 6], 9, 1)[0]
    view = [-1, 1, 1] if axis == 1 else [-1]
    np.testing.assert_allclose(g.forward([x])[0].numpy(), x.numpy() + bias.reshape(view), rtol=1e-6)


# ================================================================================================ integer forward
@pytest.mark.parametrize("bits,amode,wmode", MODES)
@pytest.mark.parametrize("group,act", [(1, "NONE"), (2, "RELU"), (1, "CLIP")])
def test_conv3d_integer_matches_reference(bits: int, amode: str, wmode: str, group: int, act: str) -> None:
    g, _, _, shape = conv3d_graph(10, group=group, act=act)
    qg = quantize_model(g, data(shape, 11), settings(bits, amode, wmode))
    node = qg.node("op")
    qg.forward([data([2] + shape[1:], 12, 1)[0]])
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), mac_reference(node, ref_conv3d_int(node)))


@pytest.mark.parametrize("bits,amode,wmode", MODES)
@pytest.mark.parametrize("nd,group,act", [(2, 1, "NONE"), (2, 2, "RELU6"), (3, 2, "NONE"), (3, 1, "CLIP")])
def test_conv_transpose_integer_matches_reference(bits: int, amode: str, wmode: str, nd: int, group: int,
                                                  act: str) -> None:
    g, _, _, shape, geo = convt_graph(13, nd=nd, group=group, act=act)
    qg = quantize_model(g, data(shape, 14), settings(bits, amode, wmode))
    node = qg.node("op")
    # integers stay in the IR layout; per-channel constants are per output channel (6), not per IR row
    assert node.constants["weights"].betensor.shape == g.node("op").constants["weights"].betensor.shape
    assert all(node.constants[k].betensor.numel() == 6 for k in ("scale", "shift", "weights_scale")
               if k in node.constants)
    qg.forward([data([2] + shape[1:], 15, 1)[0]])
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), mac_reference(node, ref_convt_int(node, geo)))


def test_conv_transpose_large_pads_crop_the_upsampled_input() -> None:
    """Pads larger than (k-1)*d make the zero-insertion padding negative: the reference crops, so must we."""
    g, w_onnx, b, shape, geo = convt_graph(16, nd=2, k=(2, 2), s=(3, 2), d=(1, 1), pb=(2, 1), pe=(3, 2), op=(2, 1))
    x = data([1] + shape[1:], 17, 1)[0]
    torch.testing.assert_close(g.forward([x])[0].double(), torch_convt_ref(x, w_onnx, b, geo), rtol=1e-5, atol=1e-5)
    qg = quantize_model(g, data(shape, 18), settings(8, "per_tensor_asymmetric", "per_channel_asymmetric"))
    node = qg.node("op")
    qg.forward([x])
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), mac_reference(node, ref_convt_int(node, geo)))


@pytest.mark.parametrize("op", ["conv3d", "convt2d", "convt3d"])
def test_sixteen_bit_remain_shift_matches_reference(op: str) -> None:
    if op == "conv3d":
        g, _, _, shape = conv3d_graph(19)
        geo = None
    else:
        g, _, _, shape, geo = convt_graph(19, nd=2 if op == "convt2d" else 3)
    qg = quantize_model(g, data(shape, 20), settings(16, "per_tensor_symmetric_full_range", remain_shift=6))
    node = qg.node("op")
    assert node.params["remain_shift"] == 6
    qg.forward([data(shape, 21, 1)[0]])
    acc = ref_conv3d_int(node) if geo is None else ref_convt_int(node, geo)
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), mac_reference(node, acc))


GEMM_CASES = [
    # a, b, c shapes, trans_a, trans_b, alpha, beta
    ((5, 7), (7, 4), None, False, False, 1.0, 1.0),
    ((7, 5), (4, 7), (1, 4), True, True, 0.75, 1.0),
    ((5, 7), (4, 7), (5, 4), False, True, -1.5, 0.5),
    ((5, 7), (7, 4), (4,), False, False, 2.0, -3.0),
    ((5, 7), (7, 4), (1, 4), False, False, 1.0, 0.0),
]


@pytest.mark.parametrize("bits,amode", ACT_MODES)
@pytest.mark.parametrize("case", GEMM_CASES)
def test_gemm_integer_matches_reference(case, bits: int, amode: str) -> None:
    a_shape, b_shape, c_shape, ta, tb, alpha, beta = case
    shapes = [a_shape, b_shape] + ([c_shape] if c_shape else [])
    g = gemm_graph(a_shape, b_shape, c_shape, ta, tb, alpha, beta)
    qg = quantize_model(g, gemm_feeds(shapes, 22), settings(bits, amode))
    node = qg.node("op")
    qg.forward(gemm_feeds(shapes, 23, 1)[0])
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_gemm_int(node))


@pytest.mark.parametrize("act", ["RELU", "CLIP"])
def test_gemm_with_constant_operands_and_fused_activation(act: str) -> None:
    r = _rng(24)
    b_const = r.normal(0, 0.5, size=(7, 4)).astype(np.float32)
    c_const = r.normal(0, 0.5, size=(1, 4)).astype(np.float32)
    g = gemm_graph((5, 7), (7, 4), (1, 4), const_b=b_const, const_c=c_const, alpha=0.8, beta=1.2, act=act)
    if act == "CLIP":
        g.node("op").params.update(clip_min=-0.3, clip_max=1.0)
    feeds = data((5, 7), 25)
    qg = quantize_model(g, [[f] for f in feeds], settings(8, "per_tensor_asymmetric"))
    node = qg.node("op")
    assert (params_of(node, node.outputs[0]).qmin < 0) == (act == "CLIP")
    qg.forward([feeds[0]], keep_tensors=True)
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_gemm_int(node))
    ref = g.forward([feeds[0]])[0]
    assert cosine(ref, run_quantized(qg, feeds[0])[0]) > 0.99


def test_gemm_of_integer_inputs_is_exact() -> None:
    g = gemm_graph((5, 7), (7, 4), (1, 4), in_dtype=Dtype.INT8)
    r = _rng(26)
    feeds = [[torch.from_numpy(r.integers(-20, 20, size=s)).to(torch.int8) for s in ((5, 7), (7, 4), (1, 4))]
             for _ in range(2)]
    qg = quantize_model(g, feeds, settings(8, "per_tensor_symmetric_full_range"))
    node = qg.node("op")
    out = node.outputs[0]
    oq = params_of(node, out)
    assert oq.qinvariant and oq.scale == 1.0 and oq.zerop == 0
    assert node.params["scale_value"] == [1, 1] and node.params["shift_value"] == [0, 0]
    qg.forward(feeds[0])
    a, b, c = (f.numpy().astype(np.int64) for f in feeds[0])
    np.testing.assert_array_equal(out.betensor.numpy(), np.clip(a @ b + c, oq.qmin, oq.qmax))


@pytest.mark.parametrize("bits,amode", ACT_MODES)
@pytest.mark.parametrize("axis,act", [(None, "NONE"), (1, "RELU"), (None, "CLIP")])
def test_bias_add_integer_matches_reference(bits: int, amode: str, axis, act: str) -> None:
    g, _ = bias_add_graph(27, axis=axis, act=act)
    if act == "CLIP":
        g.node("op").params.update(clip_min=-0.5, clip_max=1.5)
    qg = quantize_model(g, data([1, 4, 5, 6], 28), settings(bits, amode))
    node = qg.node("op")
    w = node.constants["weights"]
    assert list(w.betensor.shape) == [1] and int(w.betensor[0]) == 2 ** (min(bits, 16) - 1) - 1
    assert "remain_shift" not in node.params
    qg.forward([data([2, 4, 5, 6], 29, 1)[0]])
    ax = 3 if axis is None else axis
    np.testing.assert_array_equal(node.outputs[0].betensor.numpy(), ref_bias_add_int(node, ax))


# ================================================================================================ exactness paths
def test_requantize_matches_python_ints() -> None:
    r = _rng(30)
    acc = torch.from_numpy(r.integers(-2 ** 45, 2 ** 45, size=(400,)))
    acc[:8] = torch.tensor([0, 1, -1, 3 << 9, -(3 << 9), 5 << 9, (1 << 9) + (1 << 8), -((1 << 9) + (1 << 8))])
    node = bias_add_graph(0)[0].node("op")
    for mult, shift in ((1, 10), (25000, 31), (1, 0), (32767, 17), (3, -5), (7, -30), (0, 4)):
        got = mac_extra._requantize(node, acc, mult, shift).numpy()
        for v, gv in zip(acc.tolist(), got.tolist()):
            want = rhe(v * mult, shift)
            want = max(min(want, 2 ** 40), -(2 ** 40)) if abs(want) >= 2 ** 40 else want
            assert (gv == want) or (abs(gv) >= 2 ** 40 and abs(want) >= 2 ** 40 and (gv > 0) == (want > 0))


@pytest.mark.parametrize("op", ["conv3d", "convt3d", "bias_add", "gemm"])
def test_int64_paths_agree_with_float_paths(monkeypatch, op: str) -> None:
    """Forcing the x-split accumulation, the int64 matmul and the int64 requantization gives the same integers."""
    feeds = None
    if op == "gemm":
        shapes = [(5, 7), (4, 7), (1, 4)]
        g = gemm_graph(*shapes, tb=True, alpha=0.7, beta=-1.3)
        feeds = gemm_feeds(shapes, 32)
    elif op == "conv3d":
        g, _, _, shape = conv3d_graph(31, group=2)
    elif op == "convt3d":
        g, _, _, shape, _ = convt_graph(31, nd=3, group=2)
    else:
        g, _ = bias_add_graph(31)
        shape = [1, 4, 5, 6]
    qg = quantize_model(g, feeds or data(shape, 32), settings(16, "per_tensor_symmetric_full_range",
                                                              "per_channel_symmetric_restricted_range"))
    x = feeds[0] if feeds else data([2] + shape[1:], 33, 1)[0]
    before = run_quantized(qg, x)[0].clone()
    monkeypatch.setattr(mac_extra, "FLOAT64_EXACT", 2 ** 22)  # above every weight sum, below every bound
    monkeypatch.setattr(mac_extra, "FLOAT32_EXACT", 2 ** 10)
    qg.node("op").attrs.clear()
    assert torch.equal(before, run_quantized(qg, x)[0])


# ================================================================================================ accuracy
def _accuracy_case(op: str):
    if op == "conv3d":
        g, _, _, shape = conv3d_graph(40, group=2)
        return g, [data(shape, 41)]
    if op in ("convt2d", "convt3d"):
        g, _, _, shape, _ = convt_graph(40, nd=2 if op == "convt2d" else 3, group=2, cout=8)
        return g, [data(shape, 41)]
    if op == "gemm":
        shapes = [(5, 7), (4, 7), (1, 4)]
        return gemm_graph(*shapes, tb=True, alpha=0.7, beta=-1.3), [gemm_feeds(shapes, 41)]
    g, _ = bias_add_graph(40)
    return g, [data([1, 4, 5, 6], 41)]


@pytest.mark.parametrize("bits,threshold", [(8, 0.99), (16, 0.9999)])
@pytest.mark.parametrize("op", ["conv3d", "convt2d", "convt3d", "gemm", "bias_add"])
def test_float_vs_dequantized_cosine(op: str, bits: int, threshold: float) -> None:
    g, (calib,) = _accuracy_case(op)
    qg = quantize_model(g, calib, settings(bits, "per_tensor_asymmetric", "per_channel_symmetric_restricted_range",
                                           q_strategy_activation="extrema"))
    for batch in calib:
        feeds = batch if isinstance(batch, list) else [batch]
        assert cosine(g.forward(feeds)[0].clone(), run_quantized(qg, feeds)[0]) > threshold


# ================================================================================================ IR round trip
@pytest.mark.parametrize("bits,amode,wmode", [MODES[0], MODES[2], MODES[3]])
@pytest.mark.parametrize("op", ["conv3d", "convt2d", "convt3d", "gemm", "bias_add"])
def test_written_ir_reloads_bit_identical(tmp_path, op: str, bits: int, amode: str, wmode: str) -> None:
    g, (calib,) = _accuracy_case(op)
    qg = quantize_model(g, calib, settings(bits, amode, wmode))
    feeds = calib[0] if isinstance(calib[0], list) else [calib[0]]
    before = qg.forward(feeds)[0].clone()
    txt, _ = write_ir(qg, str(tmp_path / "q.txt"))
    re = read_ir(txt)
    assert all(n.quantized for n in re.nodes)
    assert torch.equal(before, re.forward(feeds)[0])


# ================================================================================================ errors
def _expect_ir_error(g, feeds, match: str) -> None:
    with pytest.raises(IRError, match=match):
        g.forward(feeds)


def test_conv3d_bad_params_raise() -> None:
    g, _, _, shape = conv3d_graph(50)
    x = [data(shape, 51, 1)[0]]
    g.node("op").params["kernel_z"] = 5
    _expect_ir_error(g, x, "kernel_z=5")
    g, _, _, shape = conv3d_graph(50)
    g.node("op").params["group"] = 3
    _expect_ir_error(g, x, "group=3")
    g, _, _, shape = conv3d_graph(50)
    g.node("op").params["stride_y"] = 0
    _expect_ir_error(g, x, "stride_y")
    g, _, _, shape = conv3d_graph(50)
    g.node("op").params["pad_x_end"] = 3
    _expect_ir_error(g, x, "does not match the IR output shape")


def test_conv_transpose_bad_params_raise() -> None:
    g, _, _, shape, _ = convt_graph(52)
    x = [data(shape, 53, 1)[0]]
    g.node("op").params["num_output"] = 7
    _expect_ir_error(g, x, "num_output=7")
    g, _, _, shape, _ = convt_graph(52)
    g.node("op").params["group"] = 3
    _expect_ir_error(g, x, "group=3")
    g, _, _, shape, _ = convt_graph(52)
    g.node("op").params["output_padding_x"] = 1
    _expect_ir_error(g, x, "does not match the IR output shape")
    g, _, _, shape, _ = convt_graph(52)
    g.node("op").params.update(pad_top=10)
    _expect_ir_error(g, x, "leave no output")
    g, _, _, shape, _ = convt_graph(52)
    g.node("op").constants["weights"].betensor = torch.zeros(3, 3, 2)
    _expect_ir_error(g, x, "4-D")


def test_gemm_and_bias_add_bad_params_raise() -> None:
    g = gemm_graph((5, 7), (7, 4))
    feeds = gemm_feeds([(5, 7), (7, 4)], 54, 1)[0]
    g.node("op").params["trans_a"] = True
    _expect_ir_error(g, feeds, "cannot be multiplied")
    g.node("op").params["trans_a"] = "maybe"
    _expect_ir_error(g, feeds, "trans_a")
    g = gemm_graph((5, 7), (7, 4), (3, 4))
    _expect_ir_error(g, gemm_feeds([(5, 7), (7, 4), (3, 4)], 55, 1)[0], "does not broadcast")
    g = gemm_graph((5, 7), (7, 4))
    g.node("op").params["alpha"] = "x"
    _expect_ir_error(g, feeds, "alpha")
    g, _ = bias_add_graph(56)
    g.node("op").constants["biases"].betensor = torch.zeros(5)
    _expect_ir_error(g, [data([1, 4, 5, 6], 57, 1)[0]], "biases must have 6 elements")
    g, _ = bias_add_graph(56, axis=1)
    g.node("op").params["axis"] = 4
    _expect_ir_error(g, [data([1, 4, 5, 6], 57, 1)[0]], "axis=4")


def test_unsupported_variants_raise_clear_errors() -> None:
    g = gemm_graph((5, 7), (7, 4), alpha=0.0)
    with pytest.raises(UnsupportedError, match="alpha=0"):
        quantize_model(g, gemm_feeds([(5, 7), (7, 4)], 58), settings(8, "per_tensor_asymmetric"))
    g = gemm_graph((5, 7), (7, 4), act="LEAKYRELU")
    g.node("op").params["negative_slope_value"] = 0.1
    with pytest.raises(UnsupportedError, match="LEAKYRELU"):
        quantize_model(g, gemm_feeds([(5, 7), (7, 4)], 58), settings(8, "per_tensor_asymmetric"))


def test_conv_transpose_quantizes_a_fused_leakyrelu() -> None:
    """ConvTranspose finishes as the other MAC layers (tests/ops/test_fused_slopes.py checks that integer path
    exactly): its quantized output, dequantized, follows the float layer's LeakyReLU (cosine above 0.99, where
    leaving the slope out gives far less)."""
    g, _, _, shape, _ = convt_graph(59, act="LEAKYRELU")
    g.node("op").params["negative_slope_value"] = 0.1
    feeds = data(shape, 60)
    expected = [g.forward([f])[0].clone() for f in feeds]
    q = quantize_model(g, feeds, settings(8, "per_tensor_asymmetric"))
    node = q.node("op")
    assert node.params["negative_slope_value"] == 26
    out = node.outputs[0]
    scale, zp = float(q.quant.get(out).scale), float(q.quant.get(out).zerop)
    got = torch.cat([(q.forward([f])[0].to(torch.float64) + zp) / scale for f in feeds]).reshape(-1)
    ref = torch.cat(expected).to(torch.float64).reshape(-1)
    assert cosine(got, ref) > 0.99
    assert cosine(torch.where(ref < 0, ref / 0.1, ref), ref) < cosine(got, ref)  # the slope is not left out


@pytest.mark.parametrize("kind", ["conv3d", "convt2d", "convt3d"])
def test_float_forward_gives_each_sample_its_own_bits_at_any_batch(kind: str) -> None:
    """torch's float32 3-D and transposed convolutions block by the batch's size: these layers run once per IR
    batch of samples (quantopt/graph/batch.py), so a batch gives every sample the bits it gets alone."""
    if kind == "conv3d":
        graph, _, _, shape = conv3d_graph(3, cin=16, cout=16, in_dhw=(6, 12, 12), s=(1, 1, 1), d=(1, 1, 1))
    else:
        graph, _, _, shape, _ = convt_graph(3, cin=8, cout=4, spatial=(10, 10), k=(3, 3), s=(2, 2), d=(1, 1),
                                            pb=(1, 1), pe=(1, 1), op=(0, 0)) if kind == "convt2d" \
            else convt_graph(3, nd=3, cin=8, cout=16, spatial=(4, 6, 6))
    x = torch.randn(5, *shape[1:], generator=torch.Generator().manual_seed(2))
    alone = torch.cat([graph.forward([x[i:i + 1]])[0].clone() for i in range(5)])
    together = graph.forward([x])[0]
    assert torch.equal(alone.view(torch.int32), together.view(torch.int32))
