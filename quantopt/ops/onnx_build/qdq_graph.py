"""The ONNX graph being assembled: unique names, initializers, nodes, and every IR tensor's quantized value.

An IR tensor becomes an integer ONNX value (the output of a QuantizeLinear, an integer data-movement op or an
integer initializer); consumers read it through one shared DequantizeLinear. ONNX parameters follow the ONNX
convention: scale = 1 / scale_ir, zero point = -zp_ir (quantopt: q = round(x * scale - zp); ONNX: q = round(x /
scale) + zero_point).

Layouts. IR activations are channels-last; ONNX Conv/Pool/Resize want channels-first. A value may exist in several
layouts: `views[tensor][perm]` is an ONNX value equal to `ir_value.transpose(perm)`. A channels-first op registers
its output under the channels-first perm, and an integer Transpose is only inserted when a consumer asks for a
layout nobody produced, so chains of convolutions stay channels-first without back-and-forth transposes, and an
IR Transpose layer is just a new view of the same ONNX value.

The graph every operator's `@SPEC.export` function writes into (docs/onnx-export.md, "Operators of plugins"); `onnx`
is imported when a graph is made, so that importing the operators needs no onnx.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ...errors import UnsupportedError
from ...graph.node import PyNode
from ...graph.tables import QuantTable, TensorQuant, quant_of
from ...graph.tensor import PyTensor
from ...quant.dtype import Dtype
from .._quant import requant_of
from .perms import Perm, identity, inverse

ONNX_INT_TYPES: Dict[Dtype, Tuple[str, Any]] = {
    Dtype.INT8: ("INT8", np.int8), Dtype.UINT8: ("UINT8", np.uint8),
    Dtype.INT16: ("INT16", np.int16), Dtype.UINT16: ("UINT16", np.uint16),
    Dtype.INT32: ("INT32", np.int32),
}
"""IR integer dtypes an activation may have in the exported graph (QuantizeLinear makes the 8/16-bit ones; int32
tensors come from integer inputs and constants only)."""


UINT8_OFFSET = 128
"""In "exact" and "effective" mode an int8 activation is exported as uint8 holding the IR integer + 128 (zero point
+ 128), and 8-bit weights read by an integer kernel as uint8 (`onnx_build.mac.kernel_weight_offset`)."""


CARRIED_INT_TYPES: Dict[Dtype, Dtype] = {
    Dtype.ALIGNED_INT4: Dtype.INT8, Dtype.ALIGNED_UINT4: Dtype.UINT8,
    Dtype.ALIGNED_INT12: Dtype.INT16, Dtype.ALIGNED_UINT12: Dtype.UINT16,
}
"""Integer tensors (scale 1) of types ONNX has no QDQ form for, carried in the next wider ONNX type (a 0/1 mask
constant the importer stored as aligned_uint4): the same integers."""


QUANTIZABLE = (Dtype.INT8, Dtype.UINT8, Dtype.INT16, Dtype.UINT16)
FLOAT = 1
"""onnx.TensorProto.FLOAT (a Cast target)."""


def scalar(value: Union[float, int, torch.Tensor], what: str, tensor: PyTensor) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UnsupportedError(f"tensor '{tensor.name}' has per-channel {what}; QuantizeLinear/DequantizeLinear "
                                   "of activations are exported per tensor only")
        value = value.reshape(-1)[0].item()
    return float(value)


def per_channel_scales(q: TensorQuant) -> Optional[np.ndarray]:
    """float32 scales along the last axis of a per-channel activation (zero point 0) of parameters `q`, else None."""
    if isinstance(q.scale, torch.Tensor) and q.scale.numel() > 1:
        return q.scale.to(torch.float32).reshape(-1).numpy()
    return None


def onnx_scale(ir_scale: Union[float, np.ndarray]) -> np.ndarray:
    """float32(1) / float32(scale): the reciprocal quantopt's own dequantization multiplies by."""
    return (np.float32(1.0) / np.asarray(ir_scale, dtype=np.float32)).astype(np.float32)


@dataclass(frozen=True)
class QParams:
    """ONNX quantization parameters of one activation tensor."""

    scale: Union[float, Tuple[float, ...]]  # ONNX scale (1 / IR scale), float32; one per channel (last IR axis)
    zero_point: int       # ONNX zero point (-IR zp)
    dtype: Dtype          # integer dtype of the ONNX value
    qmin: int
    qmax: int
    offset: int = 0       # ONNX integer - IR integer (128 where an int8 tensor is carried as uint8)

    @property
    def per_channel(self) -> bool:
        return isinstance(self.scale, tuple)


class QDQGraph:
    """Nodes, initializers and tensor views of the ONNX graph under construction."""

    def __init__(self, opset: int, quant: QuantTable, scales: str = "exact", dynamic_batch: bool = True,
                 int64_inputs: bool = False) -> None:
        from onnx import TensorProto, helper, numpy_helper

        self._helper, self._numpy_helper, self._tp = helper, numpy_helper, TensorProto
        self.opset = opset
        self.scales = scales  # "ir" or "effective" (see onnx_qdq.SCALE_MODES)
        self.dynamic_batch = dynamic_batch
        self.int64_inputs = int64_inputs
        """Integer graph inputs are declared int64 (as the source ONNX model's token ids) and saturated to the IR
        type inside the graph."""
        self.quant = quant
        """The quantization parameters of the exported (quantized) graph's tensors (`PyGraph.quant`)."""
        self.nodes: List[Any] = []
        self.initializers: List[Any] = []
        self.inputs: List[Any] = []
        self.outputs: List[Any] = []
        self._names: set = set()
        self._node_names: set = set()
        self.views: Dict[str, Dict[Perm, str]] = {}
        self._dq: Dict[Tuple[str, Perm], str] = {}
        self._qparam_names: Dict[Tuple[Any, ...], str] = {}
        self._ranks: Dict[str, int] = {}
        self.layer = ""  # name of the IR layer being converted (node name prefix)
        self.float_layers: Dict[str, None] = {}
        """"exact" mode: layers left in the float QDQ form (not bit-exact), in graph order."""

    # ------------------------------------------------------------------------------------------------ names
    def reserve(self, name: str) -> None:
        self._names.add(name)

    def unique(self, hint: str) -> str:
        name, k = hint, 1
        while name in self._names:
            name, k = f"{hint}_{k}", k + 1
        self._names.add(name)
        return name

    def _node_name(self, op: str) -> str:
        hint = f"{self.layer}/{op}" if self.layer else op
        name, k = hint, 1
        while name in self._node_names:
            name, k = f"{hint}_{k}", k + 1
        self._node_names.add(name)
        return name

    # ------------------------------------------------------------------------------------------------ building
    def const(self, hint: str, array: Any) -> str:
        """A new initializer holding `array` (numpy dtype kept)."""
        name = self.unique(hint)
        array = np.asarray(array)
        array = array if array.flags.c_contiguous else np.ascontiguousarray(array)  # keeps 0-d arrays 0-d
        self.initializers.append(self._numpy_helper.from_array(array, name))
        return name

    def ints(self, hint: str, values: Iterable[int]) -> str:
        return self.const(hint, np.asarray(list(values), dtype=np.int64))

    def add(self, op: str, inputs: Sequence[str], hint: Optional[str] = None, output: Optional[str] = None,
            **attrs: Any) -> str:
        """Append a one-output node; the output is `output` exactly (a reserved name) or a unique name from `hint`."""
        out = output if output is not None else self.unique(hint or f"{self.layer}/{op}")
        self.nodes.append(self._helper.make_node(op, list(inputs), [out], name=self._node_name(op),
                                                 **{k: v for k, v in attrs.items() if v is not None}))
        return out

    def add_multi(self, op: str, inputs: Sequence[str], hints: Sequence[str], **attrs: Any) -> List[str]:
        """Append a node with one output per hint."""
        outs = [self.unique(h) for h in hints]
        self.nodes.append(self._helper.make_node(op, list(inputs), outs, name=self._node_name(op),
                                                 **{k: v for k, v in attrs.items() if v is not None}))
        return outs

    def io_shape(self, t: PyTensor) -> List[Union[int, str]]:
        """Shape of a graph input/output: the IR shape, its batch dim symbolic when `dynamic_batch`."""
        shape: List[Union[int, str]] = [int(d) for d in t.ir_shape]
        if self.dynamic_batch and shape:
            shape[0] = "batch"
        return shape

    def elem_type(self, dtype: Dtype) -> int:
        """onnx.TensorProto element type of an integer IR dtype."""
        return int(getattr(self._tp, ONNX_INT_TYPES[dtype][0]))

    def value_info(self, name: str, elem: str, shape: Sequence[Union[int, str]]) -> Any:
        return self._helper.make_tensor_value_info(name, getattr(self._tp, elem), list(shape))

    # ------------------------------------------------------------------------------------------------ qparams
    def qparams(self, t: PyTensor) -> QParams:
        q = self.quant.get(t)
        if q.qmin is None or q.qmax is None:
            raise UnsupportedError(f"tensor '{t.name}' is not quantized (no integer range)")
        if t.dtype in CARRIED_INT_TYPES and q.qinvariant:
            lo, hi = t.dtype.int_range()
            return QParams(1.0, 0, CARRIED_INT_TYPES[t.dtype], max(int(q.qmin), lo), min(int(q.qmax), hi))
        if t.dtype not in ONNX_INT_TYPES:
            raise UnsupportedError(f"tensor '{t.name}' has dtype {t.dtype}; the exported graph carries int8, uint8, "
                                   "int16, uint16 activations (and int32 integer inputs/constants)")
        channel_scales = per_channel_scales(q)
        scale = scalar(q.scale, "scales", t) if channel_scales is None else float(channel_scales.min())
        zp = int(round(scalar(q.zerop, "zero points", t)))
        lo, hi = t.dtype.int_range()
        if not lo <= -zp <= hi:
            raise UnsupportedError(f"tensor '{t.name}': zero point {zp} gives the ONNX zero point {-zp}, outside "
                                   f"the {t.dtype} range")
        if scale <= 0:
            raise UnsupportedError(f"tensor '{t.name}' has a non-positive scale {scale}")
        onnx = (float(onnx_scale(scale)) if channel_scales is None
                else tuple(float(v) for v in onnx_scale(channel_scales)))
        qmin, qmax = max(int(q.qmin), lo), min(int(q.qmax), hi)
        if self.unsigned_kernels and t.dtype == Dtype.INT8 and not q.qinvariant \
                and (self.unit_domain or channel_scales is None):
            # the same real values as uint8: onnxruntime fuses a QDQ convolution into its integer kernel only
            # when input and output share one type, and with uint8 on both sides (`unsigned_kernels`) its integer
            # GEMMs are exact on every CPU. A per-channel tensor of the float modes stays int8: no MAC layer reads
            # it there, and onnxruntime would fuse a per-axis uint8 QuantizeLinear into a QLinearConv that refuses
            # per-axis output zero points
            return QParams(onnx, UINT8_OFFSET - zp, Dtype.UINT8, qmin + UINT8_OFFSET, qmax + UINT8_OFFSET,
                           UINT8_OFFSET)
        return QParams(onnx, -zp, t.dtype, qmin, qmax)

    def channel_axis(self, t: PyTensor, perm: Optional[Perm]) -> Optional[int]:
        """The ONNX axis of a per-channel tensor's channels (its last IR axis) in layout `perm`; None per tensor."""
        if not self.qparams(t).per_channel:
            return None
        rank = self.rank(t)
        return (tuple(perm) if perm is not None else identity(rank)).index(rank - 1)

    def qparam_inputs(self, t: PyTensor) -> Tuple[str, str]:
        """(scale, zero point) initializers of `t`, shared by every tensor with the same ONNX params (one zero
        point per channel for a per-channel tensor, as per-axis DequantizeLinear wants)."""
        return self._scale_input(t), self._zero_point_input(t, per_axis=self.qparams(t).per_channel)

    def zero_point(self, t: PyTensor) -> str:
        """`t`'s ONNX zero point as one scalar initializer (what integer kernels take)."""
        return self._zero_point_input(t)

    def _key(self, t: PyTensor) -> Tuple[float, int, Dtype]:
        p = self.qparams(t)
        return p.scale, p.zero_point, p.dtype

    def _scale_input(self, t: PyTensor) -> str:
        key = ("scale",) + self._key(t)
        if key not in self._qparam_names:
            self._qparam_names[key] = self.const(f"{t.name}_scale", np.array(key[1], dtype=np.float32))
        return self._qparam_names[key]

    def _zero_point_input(self, t: PyTensor, per_axis: bool = False) -> str:
        key = ("zero_point",) + self._key(t) + (per_axis,)
        if key not in self._qparam_names:
            np_dtype = ONNX_INT_TYPES[key[3]][1]
            value = np.full(len(key[1]), key[2], dtype=np_dtype) if per_axis else np.array(key[2], dtype=np_dtype)
            self._qparam_names[key] = self.const(f"{t.name}_zero_point", value)
        return self._qparam_names[key]

    # ------------------------------------------------------------------------------------------------ views
    def rank(self, t: PyTensor) -> int:
        return self._ranks.get(t.name, len(t.ir_shape))

    def set_int(self, t: PyTensor, name: str, perm: Optional[Perm] = None) -> None:
        """Register `name` as the integer value of IR tensor `t` in layout `perm` (identity by default)."""
        rank = len(t.ir_shape)
        self._ranks[t.name] = rank
        self.views.setdefault(t.name, {})[tuple(perm) if perm is not None else identity(rank)] = name

    def perms(self, t: PyTensor) -> List[Perm]:
        return list(self.views.get(t.name, {}))

    def int_value(self, t: PyTensor, perm: Optional[Perm] = None) -> str:
        """The integer ONNX value of `t` in layout `perm`, adding one integer Transpose if nobody produced it."""
        views = self.views.get(t.name)
        if not views:
            raise UnsupportedError(f"tensor '{t.name}' has no exported producer")
        want = tuple(perm) if perm is not None else identity(self.rank(t))
        if want in views:
            return views[want]
        have, source = next(iter(views.items()))
        # source = ir.transpose(have); want = ir.transpose(want) = source.transpose(inverse(have)[want])
        inv = inverse(have)
        step = tuple(inv[a] for a in want)
        name = self.add("Transpose", [source], hint=f"{t.name}_t{''.join(map(str, want))}", perm=list(step))
        views[want] = name
        return name

    def float_value(self, t: PyTensor, perm: Optional[Perm] = None, unit: bool = False) -> str:
        """DequantizeLinear of `t` in layout `perm` (one per tensor and layout, shared by all consumers).

        `unit`: dequantized with scale 1, i.e. the integer minus its zero point, for a layer whose weights carry
        its whole requantization multiplier (`QDQGraph.unit_domain`)."""
        want = tuple(perm) if perm is not None else identity(self.rank(t))
        key = (t.name, want, unit)
        if key not in self._dq:
            q = self.int_value(t, want)
            scale = self._unit_scale() if unit else self._scale_input(t)
            zp = self._zero_point_input(t, per_axis=not unit and self.qparams(t).per_channel)
            suffix = "" if want == identity(len(want)) else "_t" + "".join(map(str, want))
            suffix += "_codes" if unit else ""
            axis = None if unit else self.channel_axis(t, want)
            self._dq[key] = self.add("DequantizeLinear", [q, scale, zp], hint=f"{t.name}_dq{suffix}", axis=axis)
        return self._dq[key]

    def _unit_scale(self) -> str:
        key = ("unit_scale",)
        if key not in self._qparam_names:
            self._qparam_names[key] = self.const("unit_scale", np.array(1.0, dtype=np.float32))
        return self._qparam_names[key]

    @property
    def unit_domain(self) -> bool:
        """In "exact" mode, Convolution, DepthwiseConv and FullyConnected read their input and write their
        output with scale 1 and carry the multiplier M · 2^-N as their weight scale: the output multiplier an
        integer QLinear kernel derives, x_scale · w_scale / y_scale, is then M · 2^-N exactly in float32 (with the
        IR's scales no float32 weight scale may give it exactly), so its requantization rounds as quantopt's."""
        return self.scales == "exact"

    @property
    def unsigned_kernels(self) -> bool:
        """"exact" and "effective": every 8-bit integer an onnxruntime integer kernel reads is uint8 (int8
        activations carried +128, weights +128 with zero point 128). On x86 onnxruntime turns int8 QDQ activations
        into uint8 itself, and its u8·s8 GEMM (vpmaddubsw on AVX2 CPUs without VNNI) adds pairs of products into
        int16 with saturation, while its u8·u8 GEMM widens to 16 bits first and is exact on every CPU. "ir" keeps
        the IR's types: the plain, portable QDQ model (int8 with zero point 0 is what other runtimes expect)."""
        return self.scales in ("exact", "effective")

    @property
    def folds_multipliers(self) -> bool:
        """"exact" and "effective": the integer multipliers' rounding is reproduced, not only the IR's scales."""
        return self.scales != "ir"

    def quantize(self, t: PyTensor, value: str, perm: Optional[Perm] = None, exact: bool = False,
                 unit: bool = False, bounds: Optional[Tuple[Any, Any]] = None, lossless: bool = False) -> str:
        """QuantizeLinear of the float `value` with `t`'s params (after a Clip to the dequantized bounds of a range
        narrower than the dtype); the result becomes `t`'s integer value in layout `perm`.

        `exact` (used when `folds_multipliers`, where quantopt's integers are themselves a float32 quantization
        round(x · scale − zp), i.e. graph inputs and lookup tables): QuantizeLinear computes x / (1 / scale), which
        rounds exact ties such as 0.5 · 255 = 127.5 differently, so the value is multiplied by the IR scale and
        quantized with scale 1 instead. `unit`: `value` is already in integer units (scale 1). `bounds`: IR
        integer bounds narrower than the range (a fused RELU6/CLIP), applied by the same Clip. `lossless`: the float
        value is one of the input's dequantized values (MAX, nearest Resize, Pad of unchanged params), so the float
        form is exact; any other float form in "exact" mode is recorded in `float_layers`."""
        p = self.qparams(t)
        if self.unit_domain and not (unit or exact or lossless) and self.layer:
            self.float_layers.setdefault(self.layer, None)
        if p.dtype not in QUANTIZABLE:
            raise UnsupportedError(f"tensor '{t.name}' has dtype {p.dtype}: QuantizeLinear makes 8- and 16-bit "
                                   "integers only")
        per_axis = p.per_channel and not (unit or (exact and self.folds_multipliers))
        zp = self._zero_point_input(t, per_axis=per_axis)
        if p.per_channel and exact and not unit:
            raise UnsupportedError(f"tensor '{t.name}': a per-channel float32 quantization has no exact QDQ form")
        if unit or (exact and self.folds_multipliers):
            if not unit:
                ir_scale = np.array(scalar(self.quant.get(t).scale, "scales", t), dtype=np.float32)
                value = self.add("Mul", [value, self.const(f"{t.name}_ir_scale", ir_scale)],
                                 hint=f"{t.name}_scaled")
            scale, step = self._unit_scale(), np.float32(1.0)
        else:
            scale, step = self._scale_input(t), np.asarray(p.scale, dtype=np.float32)
        qmin, qmax = p.qmin, p.qmax
        if bounds is not None and any(isinstance(b, torch.Tensor) for b in bounds):
            value = self._channel_bounds(t, value, perm, bounds, p, step)  # per-channel RELU6/CLIP bounds
        elif bounds is not None:
            qmin, qmax = max(qmin, bounds[0] + p.offset), min(qmax, bounds[1] + p.offset)
        if (qmin, qmax) != p.dtype.int_range() and np.ndim(step):  # a narrower range on per-channel steps
            value = self._channel_bounds(t, value, perm, (qmin - p.offset, qmax - p.offset), p, step)
        elif (qmin, qmax) != p.dtype.int_range():  # in float: onnxruntime has no 16-bit integer Clip
            lo, hi = ((np.float32(v - p.zero_point) * step).astype(np.float32) for v in (qmin, qmax))
            value = self.add("Clip", [value, self.const(f"{t.name}_qmin", lo), self.const(f"{t.name}_qmax", hi)],
                             hint=f"{t.name}_range")
        axis = None if unit or (exact and self.folds_multipliers) else self.channel_axis(t, perm)
        q = self.add("QuantizeLinear", [value, scale, zp], hint=f"{t.name}_q", axis=axis)
        self.set_int(t, q, perm)
        return q

    def _channel_bounds(self, t: PyTensor, value: str, perm: Optional[Perm], bounds: Tuple[Any, Any], p: QParams,
                        step: Any) -> str:
        """Max/Min with per-channel integer bounds (Clip takes scalars only), shaped along the channel axis."""
        rank = self.rank(t)
        shape = [1] * rank
        shape[(tuple(perm) if perm is not None else identity(rank)).index(rank - 1)] = -1
        for i, (bound, op) in enumerate(zip(bounds, ("Max", "Min"))):
            ints = np.asarray(bound.numpy() if isinstance(bound, torch.Tensor) else bound, dtype=np.float64)
            values = ((ints + p.offset - p.zero_point) * np.asarray(step, dtype=np.float64)).astype(np.float32)
            values = np.broadcast_to(values, (self._channels(t),)) if values.ndim == 0 else values
            value = self.add(op, [value, self.const(f"{t.name}_{'lo' if i == 0 else 'hi'}", values.reshape(shape))])
        return value

    def _channels(self, t: PyTensor) -> int:
        return int(t.ir_shape[-1])

    def rescale(self, value: str, factor: float, what: str = "requant") -> str:
        """When `folds_multipliers`, multiply `value` by `factor`: the ratio between what an integer multiplier/shift
        applies and the exact scale ratio it approximates (left out when it rounds to 1 in float32)."""
        if not self.folds_multipliers or np.float32(factor) == np.float32(1.0):
            return value
        return self.add("Mul", [value, self.const(f"{self.layer}/{what}_rounding", np.array(factor, np.float32))])

    def common_perm(self, tensors: Sequence[PyTensor], rank: int, prefer: Optional[Perm] = None) -> Perm:
        """A layout every tensor already has (so no Transpose is needed), `prefer` first; identity otherwise."""
        if not tensors or any(self.rank(t) != rank for t in tensors):
            return identity(rank)
        shared = [p for p in self.perms(tensors[0]) if all(p in self.views.get(t.name, {}) for t in tensors[1:])]
        if prefer is not None and prefer in shared:
            return prefer
        return shared[0] if shared else identity(rank)


def same_qparams(node: PyNode, a: PyTensor, b: PyTensor) -> bool:
    """Whether two tensors `a`, `b` of layer `node` carry identical quantization (integers can then move between
    them unchanged)."""
    table = quant_of(node)
    qa, qb = table.get(a), table.get(b)
    sa, sb = per_channel_scales(qa), per_channel_scales(qb)
    if sa is not None or sb is not None:
        return (sa is not None and sb is not None and np.array_equal(sa, sb) and a.dtype == b.dtype
                and (qa.qmin, qa.qmax) == (qb.qmin, qb.qmax) and float(qa.zerop) == float(qb.zerop))
    try:
        return (scalar(qa.scale, "scales", a) == scalar(qb.scale, "scales", b) and
                scalar(qa.zerop, "zero points", a) == scalar(qb.zerop, "zero points", b) and
                a.dtype == b.dtype and (qa.qmin, qa.qmax) == (qb.qmin, qb.qmax))
    except UnsupportedError:
        return False


def require_same(node: PyNode, a: PyTensor, b: PyTensor) -> None:
    """Refuse a data-movement layer whose output is quantized unlike its input: its ONNX op moves integers."""
    if not same_qparams(node, a, b):
        raise node_error(node, f"output '{b.name}' is quantized differently from input '{a.name}'; a data-movement "
                               "layer must keep its input's params")


def requant_ratio(node: PyNode) -> np.ndarray:
    """M · 2^-N of a layer's stored multiplier/shift, [1] per tensor or [C] per channel (float64)."""
    mult, shift = requant_of(node)
    m = np.asarray(mult.numpy() if isinstance(mult, torch.Tensor) else [mult], dtype=np.float64).reshape(-1)
    n = np.asarray(shift.numpy() if isinstance(shift, torch.Tensor) else [shift], dtype=np.float64).reshape(-1)
    return m * np.power(2.0, -n)


def node_error(node: PyNode, message: str) -> UnsupportedError:
    return UnsupportedError(f"layer '{node.name}' ({node.type}): {message}")


def int_or(node: PyNode, key: str, default: int) -> int:
    """An integer param of the layer, `default` where it has none (pads, strides, kernel sizes, group)."""
    return int(node.get_param(key, optional=True, default_value=default))
