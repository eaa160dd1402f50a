"""Float islands (`trigger_float_op`, docs/mixed-precision.md): layers that stay float inside a quantized model.

`quantize_graph` calls `insert_boundary_layers` on the quantized copy before any layer is quantized, then
`make_float_layer` instead of the quantize function for each float layer:

- a `Quantize` layer on every edge from a float layer to an integer layer (one per tensor, shared by all integer
  consumers; a tensor of an integer IR type, such as a mask or an index a float layer reshaped, crosses as it is
  and is quantized as exact integers: scale 1, zero point 0), a `DeQuantize` layer on every edge from an integer
  layer to a float layer (one per tensor and float type),
  and a `Cast` where a float tensor enters a layer of a narrower float type (float32 → float16/bfloat16);
  an integer consumer accepts an integer producer of another bit width as it is (as upstream does);
- an If/Loop layer reads an integer tensor of the model (an index, a count, a condition: its IR dtype is an integer
  type) as it is, without a DeQuantize (as upstream): such a tensor is quantized as an exact integer (scale 1,
  zero point 0), so its values are the model's; an integer Constant read only by such layers keeps its IR dtype
  (`ops/io.py`, `KEEP_IR_INTEGER`). docs/semantics/control-flow.md;
- float layers keep float weights rounded to their float type (biases stay float32), or with `*_act_*_wht`
  store weight-only quantized weights (integers with `weights_scale`/`weights_zp`, or fp8/fp4 values with a
  per-channel `weights_scale`) that their forward dequantizes;
- each float layer is written with `unquantifiable=true` and float output types, so a re-read IR runs exactly the
  same mixed forward. The executor rounds every output of such a layer to its float type (`PyNode.forward`).

The simulated backend has a float kernel for every operator, so `X_preferred` and `X_preferred!` mean the same.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch

from ..config.kinds_accuracy import FloatChoice, parse_trigger_float
from ..graph.float_layer import round_to_float_dtype
from ..graph.graph import PyGraph
from ..graph.names import unique_name as _unique
from ..graph.node import PyNode
from ..graph.tables import quant_of
from ..graph.tensor import PyTensor
from ..log import OPT_INFO
from ..ops._quant import set_qinvariant
from ..ops.io import KEEP_IR_INTEGER
from ..quant import minifloat
from ..quant.dtype import Dtype
from ..registry.optype import OpType

FLOAT_DTYPES = {"float16": Dtype.FP16, "bfloat16": Dtype.BFP16, "float32": Dtype.FP32}
FLOAT_WIDTH = {Dtype.FP16: 16, Dtype.BFP16: 16, Dtype.FP32: 32}
MINIFLOAT_WEIGHTS = {"fp8e4m3fn": (Dtype.FP8_E4M3FN, minifloat.E4M3FN, 448.0),
                     "fp4e2m1fn": (Dtype.FP4_E2M1FN, minifloat.E2M1FN, 6.0)}
"""Weight-only float formats: (IR dtype, format, largest finite value)."""
MINIFLOAT_SCALE_GUARD = 1e-5
"""Added to |w|max before scale = largest value / |w|max, so an all-zero channel gets a finite scale."""
INTEGER_READERS = frozenset({"If", "Loop"})
"""Float layers that read an integer tensor of the model as it is (a condition, a trip count), as upstream's."""


def float_choices(graph: PyGraph) -> Dict[str, FloatChoice]:
    """Layer name -> FloatChoice for the layers whose settings ask to run in float."""
    out: Dict[str, FloatChoice] = {}
    for n in graph.nodes:
        value = getattr(n.settings, "trigger_float_op", "disable") if n.settings is not None else "disable"
        choice = parse_trigger_float(value)
        if choice is not None:
            out[n.name] = choice
    return out



def new_border_layer(graph: PyGraph, optype: OpType, name: str, src: PyTensor, out_name: str, layer_id: int,
                     settings) -> PyNode:
    """A Quantize/DeQuantize/Cast layer reading `src`, added to `graph`; its output's quantization is set later."""
    node = PyNode(name, optype, layer_id)
    node.additional = True
    node.settings = settings
    node.inputs = [src]
    out = src.clone(out_name)
    graph.ranges.copy_from(graph.ranges, src, out)  # it is quantized from its source's calibrated range
    graph.quant.drop(out)  # not quantized until its quantize function runs
    out.pnode = node
    node.outputs = [out]
    graph.add_node(node)
    return node


def insert_boundary_layers(graph: PyGraph, choices: Dict[str, FloatChoice]) -> List[str]:
    """Insert Quantize/DeQuantize/Cast layers at the float/integer borders of `graph` (the quantized copy, before
    quantization); returns the inserted layer names. Inserted Casts are float layers: they are added to
    `choices` with their consumer's float type."""
    if not choices:
        return []
    taken = {n.name for n in graph.nodes} | set(graph.tensors())
    quantizers: Dict[int, PyTensor] = {}
    dequantizers: Dict[Tuple[int, Dtype], PyTensor] = {}
    casts: Dict[Tuple[int, Dtype], PyTensor] = {}
    inserted: List[str] = []
    as_is: Dict[int, PyTensor] = {}
    for n in list(graph.nodes):
        consumer = choices.get(n.name)
        for i, t in enumerate(list(n.inputs)):
            producer = choices.get(t.pnode.name) if t.pnode is not None else None
            if producer is None and consumer is None:
                continue
            if producer is None and reads_integer_as_is(n, t):
                as_is[id(t)] = t
                continue
            if producer is not None and consumer is None:
                if not t.ir_dtype.is_float:  # integers (a mask, an index) cross as they are: exact integers
                    continue
                if id(t) not in quantizers:
                    q = new_border_layer(graph, OpType.Quantize, _unique(f"{t.name}_quantize", taken), t,
                                   _unique(f"{t.name}_q", taken), n.layer_id, n.settings)
                    quantizers[id(t)] = q.outputs[0]
                    inserted.append(q.name)
                n.inputs[i] = quantizers[id(t)]
                continue
            want = FLOAT_DTYPES[consumer.act_type]
            if producer is None:
                key = (id(t), want)
                if key not in dequantizers:
                    d = new_border_layer(graph, OpType.DeQuantize, _unique(f"{t.name}_dequantize", taken), t,
                                   _unique(f"{t.name}_dq", taken), n.layer_id, n.settings)
                    d.outputs[0].dtype = d.outputs[0].ir_dtype = want
                    d.params["unquantifiable"] = True
                    dequantizers[key] = d.outputs[0]
                    inserted.append(d.name)
                n.inputs[i] = dequantizers[key]
                continue
            have = FLOAT_DTYPES[producer.act_type]
            if FLOAT_WIDTH[want] < FLOAT_WIDTH[have] or (want != have and FLOAT_WIDTH[want] == FLOAT_WIDTH[have]):
                key = (id(t), want)
                if key not in casts:
                    c = new_border_layer(graph, OpType.Cast, _unique(f"{t.name}_cast_{want.value}", taken), t,
                                   _unique(f"{t.name}_{want.value}", taken), n.layer_id, n.settings)
                    c.params["to_dtype"] = want
                    c.params["unquantifiable"] = True
                    c.outputs[0].dtype = c.outputs[0].ir_dtype = want
                    casts[key] = c.outputs[0]
                    inserted.append(c.name)
                    choices[c.name] = FloatChoice(consumer.act_type, None, consumer.forced)
                n.inputs[i] = casts[key]
    _mark_integer_constants(graph, as_is)
    graph.finalize(graph.source_file)
    graph.set_io([t.name for t in graph.input_tensors], [t.name for t in graph.output_tensors])
    if inserted:
        OPT_INFO(f"float islands: {len(choices)} float layer(s); inserted {len(inserted)} Quantize/DeQuantize/Cast "
                 f"layer(s)")
    return inserted


def reads_integer_as_is(node: PyNode, t: PyTensor) -> bool:
    """`node` (a float layer) reads the integer tensor `t` of an integer layer as it is, without a DeQuantize: an
    If/Loop layer reading a tensor whose IR dtype is an integer type (an index, a count, a condition)."""
    return str(node.type) in INTEGER_READERS and not t.ir_dtype.is_float


def _mark_integer_constants(graph: PyGraph, as_is: Dict[int, PyTensor]) -> None:
    """Integer Constants read only by layers that take them as they are keep their IR dtype when quantized
    (upstream leaves such a Constant unquantized): their output is marked with `KEEP_IR_INTEGER`."""
    readers: Dict[int, List[PyNode]] = {}
    for n in graph.nodes:
        for t in n.inputs:
            readers.setdefault(id(t), []).append(n)
    for key, t in as_is.items():
        if t.pnode is not None and str(t.pnode.type) == "Constant" and \
                all(reads_integer_as_is(r, t) for r in readers.get(key, [])):
            t.extra[KEEP_IR_INTEGER] = True


def check_integer_inputs(node: PyNode) -> None:
    """The integer inputs an If/Loop layer reads as they are must hold exact integers (scale 1, zero point 0)
    once their producers are quantized; any other quantized integer input would be read wrongly."""
    for t in node.inputs:
        if t.pnode is None or not t.pnode.quantized or not reads_integer_as_is(node, t):
            continue
        q = quant_of(node).get(t)
        exact = q.qinvariant and bool(torch.all(torch.as_tensor(q.scale) == 1)) and \
            bool(torch.all(torch.as_tensor(q.zerop) == 0))
        if not exact:
            raise node._error(f"integer input '{t.name}' is quantized (scale {q.scale}, zero point {q.zerop}); "
                              "an If/Loop layer reads its integer inputs as they are")


def make_float_layer(node: PyNode, choice: FloatChoice) -> None:
    """Turn a layer of the quantized copy into a float layer of `choice` (see the module doc)."""
    dtype = FLOAT_DTYPES[choice.act_type]
    check_integer_inputs(node)
    node.quantized = False
    node.params["unquantifiable"] = True
    table = quant_of(node)
    for t in node.outputs:
        table.drop(t)  # a float output: no quantization params
        if t.ir_dtype.is_float:
            t.dtype = t.ir_dtype = dtype
        else:  # an integer output (a mask, an index): integer layers read it as exact integers, with no Quantize
            set_qinvariant(node, t, t.ir_dtype.bits, t.ir_dtype.is_signed)
    for key, c in list(node.constants.items()):
        if not c.betensor.is_floating_point() or key == "biases":
            continue
        if key == "weights" and choice.weight_format is not None:
            _weight_only(node, c, choice.weight_format)
            continue
        c.betensor = round_to_float_dtype(c.betensor.to(torch.float32), dtype)
        c.dtype = c.ir_dtype = dtype
        if key == "weights":  # float weights carry scale 1 and zero point 0, as upstream writes them
            node.params["weights_scale"] = 1.0
            node.params["weights_zp"] = 0


def _weight_only(node: PyNode, w: PyTensor, fmt: str) -> None:
    """Weight-only quantization of a float layer's weights: integers with the layer's weight bits/mode, or fp8/fp4
    values scaled per output channel (axis 0) so each channel's |w|max maps to the format's largest value."""
    from ..quant.params import QuantMode

    if QuantMode.from_name(node.settings.q_mode_weight).is_per_block:
        _weight_only_blocks(node, w, fmt)
        return
    if fmt == "int":
        from ..ops._quant import quantize_weights

        per_channel = not QuantMode.from_name(node.settings.q_mode_weight).is_per_tensor
        p = quantize_weights(node, per_channel=per_channel)
        if isinstance(p.scale, torch.Tensor) and p.scale.numel() > 1:
            _set_constant(node, "weights_scale", p.scale.to(torch.float32), Dtype.FP32)
            _set_constant(node, "weights_zp", p.zerop.to(torch.int64), Dtype.INT32)
        else:
            node.params["weights_scale"] = float(p.scale)
            node.params["weights_zp"] = int(p.zerop)
        return
    dtype, fmt_table, largest = MINIFLOAT_WEIGHTS[fmt]
    values = w.betensor.to(torch.float32)
    absmax = values.reshape(values.shape[0], -1).abs().amax(dim=1)
    scale = (largest / (absmax + MINIFLOAT_SCALE_GUARD)).to(torch.float32)
    scaled = values * scale.reshape([-1] + [1] * (values.dim() - 1))
    grid = minifloat.decode(minifloat.encode(scaled.numpy(), fmt_table), fmt_table)
    w.betensor = torch.from_numpy(np.ascontiguousarray(grid, dtype=np.float32))
    w.dtype = w.ir_dtype = dtype
    _set_constant(node, "weights_scale", scale, Dtype.FP32)


def _weight_blocks(node: PyNode, w: PyTensor) -> Tuple[torch.Tensor, int]:
    """The weights as rows of `weight_block_size` consecutive values along their last axis (the input channels of
    a FullyConnected), and that size; a last axis the size does not divide is an error naming the layer."""
    size = int(node.settings.weight_block_size)
    values = w.betensor.to(torch.float32)
    if values.dim() < 2 or int(values.shape[-1]) % size:
        raise node._error(f"per-block weights: weight_block_size = {size} does not divide the weights' last axis "
                          f"({list(values.shape)})")
    return values.reshape(-1, size), size


def _weight_only_blocks(node: PyNode, w: PyTensor, fmt: str) -> None:
    """Weight-only weights with one scale per block (`quantize_method_for_weight = per_block_*`): integers of the
    layer's weight bits from each block's calibrated range (the layer's weight strategy over the block's values),
    or fp8/fp4 values with each block's |w|max at the format's largest value. `weights_scale` (and `weights_zp`)
    hold one value per block, in row-major block order; the layer records `weight_block_size`."""
    from ..calibration.collect import weight_statistics
    from ..calibration.strategies import apply_strategy
    from ..quant.params import QuantMode, linear_quant_params, quantize

    blocks, size = _weight_blocks(node, w)
    shape = list(w.betensor.shape)
    s = node.settings
    if fmt == "int":
        mode = QuantMode.from_name(s.q_mode_weight)
        block_tensor = PyTensor(w.name + "_blocks", blocks, Dtype.FP32, list(blocks.shape))
        stats = weight_statistics(node, block_tensor)
        lo, hi = apply_strategy(stats, s.q_strategy_weight, int(s.q_bits_weight), symmetric=not mode.is_asymmetric,
                                ir_range=None, per_channel=True)
        mode = QuantMode.make("per_channel", mode.is_asymmetric, not mode.is_restricted)
        p = linear_quant_params(lo, hi, int(s.q_bits_weight), mode, True)
        q = quantize(blocks, p.scale, p.zerop, p.qmin, p.qmax, axis=0)
        w.betensor = q.reshape(shape)
        w.dtype = w.ir_dtype = p.dtype
        _set_constant(node, "weights_scale", torch.as_tensor(p.scale, dtype=torch.float32).reshape(-1), Dtype.FP32)
        _set_constant(node, "weights_zp", torch.as_tensor(p.zerop).to(torch.int64).reshape(-1), Dtype.INT32)
    else:
        dtype, fmt_table, largest = MINIFLOAT_WEIGHTS[fmt]
        scale = (largest / (blocks.abs().amax(dim=1) + MINIFLOAT_SCALE_GUARD)).to(torch.float32)
        grid = minifloat.decode(minifloat.encode((blocks * scale.reshape(-1, 1)).cpu().numpy(), fmt_table),
                                fmt_table)
        w.betensor = torch.from_numpy(np.ascontiguousarray(grid, dtype=np.float32)).reshape(shape)
        w.dtype = w.ir_dtype = dtype
        _set_constant(node, "weights_scale", scale, Dtype.FP32)
    node.params["weight_block_size"] = size


def _set_constant(node: PyNode, key: str, values: torch.Tensor, dtype: Dtype) -> None:
    t = PyTensor(node.name + "_" + key, values, dtype, list(values.shape))
    node.constants[key] = t


__all__ = ["FLOAT_DTYPES", "INTEGER_READERS", "check_integer_inputs", "float_choices", "insert_boundary_layers",
           "make_float_layer", "reads_integer_as_is"]
