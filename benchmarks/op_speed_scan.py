"""Benchmark: quantopt's float and integer forward of one operator at a time, at realistic shapes, in CPU
milliseconds on one thread, against onnxruntime's float32 forward of the same single-operator ONNX model.

    python benchmarks/op_speed_scan.py [--only conv3x3,where,...] [--repeat 5] [--no-int] [--layers]
                                       [--json FILE] [--keep DIR] [--list]

Where a real model's float/ORT or int/float ratio (benchmarks/real_model_speed.py) comes from is easier to see one
operator at a time: each case is an ONNX model of one operator (or the few nodes an exporter writes for it: GELU,
SiLU, GroupNorm as Reshape/InstanceNorm/Reshape, channel shuffle) with seeded weights and inputs, written into a
temporary folder (--keep DIR keeps the files). Per case: onnxruntime's forward (one intra-op thread, sequential),
the model imported by quantopt's ONNX importer and its float forward, then the model quantized with the default
settings on three seeded inputs (`quantize_model`) and its integer forward on a fourth. Every time is CPU time
(time.process_time), torch and onnxruntime on one thread, the least of --repeat runs after a few warm-up runs.

Columns: ORT ms; quantopt float ms and float/ORT; "op float ms", the float forward's own layers only, and op/ORT:
that leaves out the graph inputs, constants and the NCHW<->NHWC Transposes the importer puts at the model's
boundary (once per model in a real one, not once per layer); integer ms and int/float (the whole forwards: the
integer forward's inputs are quantized in its Input layers). The note is the largest difference of the float
outputs from onnxruntime's ("err"), or what stopped the case, in one line: a QuantOptError of the importer or of
quantization ("refused ...", e.g. an operator quantopt does not import) is an answer, not a failure of the scan; any
other exception is reported as "FAILED ..." and makes the exit code 1. --layers adds, per case, the layer types and
the slowest layers of each forward; --json FILE writes every figure (per-layer times included).

Reading the ratios: plain and 1-D convolutions (conv3x3, conv1x1, conv1d_k3, conv1d_k5s2) sit at the float64
GEMM floor by design. quantopt's exact float reference sums Convolution layers in float64 (docs/performance.md,
"Native float reference" and "The same benchmark on an AVX-512 machine, with the float64 GEMM floor";
docs/architecture.md, "Float reference"), and a float64 GEMM runs at a fraction of the speed of onnxruntime's
float32 convolution, so their float/ORT of 3-6 is that floor, not an inefficiency of the layer. Elementwise layers
are near 1 in float and several times slower in integer (exact int64 / float64 arithmetic per element); the
smallest cases (well under 0.1 ms) measure the fixed cost per layer more than the operator.
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import onnx
from _bench_common import least_cpu
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT
I64 = TensorProto.INT64
CALIB_SAMPLES = 3
"""Seeded inputs that calibrate the integer graph; the one after them is timed."""

Gen = Callable[[np.random.Generator], np.ndarray]
Input = Tuple[str, int, List[int]]


# ------------------------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Random:
    """A float initializer drawn from the case's own seeded generator when its model is built (normal, scaled by
    `scale`, else by 1/sqrt(fan-in)), so that one case's weights do not depend on which other cases exist."""
    name: str
    shape: Tuple[int, ...]
    scale: Optional[float] = None

    def make(self, rng: np.random.Generator) -> TensorProto:
        fan = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        scale = self.scale if self.scale is not None else 1.0 / np.sqrt(max(fan, 1))
        return numpy_helper.from_array((rng.standard_normal(self.shape) * scale).astype(np.float32), self.name)


@dataclass
class Case:
    """One single-operator model: its nodes, inputs (name, ONNX type, shape), outputs (a name for float, or
    (name, ONNX type)) and initializers, and how its non-normal inputs are drawn (`gen`)."""
    name: str
    shape: str
    nodes: List[onnx.NodeProto]
    inputs: List[Input]
    outputs: List[Union[str, Tuple[str, int]]]
    inits: List[Union[TensorProto, Random]] = field(default_factory=list)
    opset: int = 17
    gen: Dict[str, Gen] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())

    def model(self) -> onnx.ModelProto:
        """The ONNX model, its random weights seeded by the case name."""
        rng = np.random.default_rng(self.seed)
        inits = [i.make(rng) if isinstance(i, Random) else i for i in self.inits]
        outs = [helper.make_tensor_value_info(o, F, None) if isinstance(o, str)
                else helper.make_tensor_value_info(o[0], o[1], None) for o in self.outputs]
        graph = helper.make_graph(self.nodes, self.name,
                                  [helper.make_tensor_value_info(n, t, s) for n, t, s in self.inputs], outs, inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8
        return model

    def feeds(self, index: int) -> Dict[str, np.ndarray]:
        """Input sample `index`, seeded by the case name and the index: standard normal unless `gen` says."""
        rng = np.random.default_rng((self.seed, index))
        out = {}
        for name, dtype, shape in self.inputs:
            if name in self.gen:
                out[name] = self.gen[name](rng)
            elif dtype == F:
                out[name] = rng.standard_normal(shape).astype(np.float32)
            else:
                raise ValueError(f"case {self.name}: input {name} needs a generator")
        return out


def W(name: str, shape: Sequence[int], scale: Optional[float] = None) -> Random:
    """A random float weight (see `Random`)."""
    return Random(name, tuple(shape), scale)


def C(name: str, values: Any, dtype: Any = np.float32) -> TensorProto:
    """A constant initializer."""
    return numpy_helper.from_array(np.asarray(values, dtype), name)


def _dims(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


def _positive(shape: Sequence[int]) -> Gen:
    """Inputs in [0.1, 1.1): divisors, Sqrt and Pow bases."""
    return lambda rng: (rng.random(shape) + 0.1).astype(np.float32)


def unary(name: str, op: str, shape: List[int], gen: Optional[Gen] = None, **attrs: Any) -> Case:
    return Case(name, _dims(shape), [helper.make_node(op, ["x"], ["y"], **attrs)], [("x", F, shape)], ["y"],
                gen={"x": gen} if gen else {})


def conv(name: str, x: List[int], cout: int, k: int, group: int = 1, stride: int = 1, dil: int = 1) -> Case:
    """Conv of kernel k in every spatial dimension, 'same' padding, with bias."""
    ks = [k] * (len(x) - 2)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=ks, strides=[stride] * len(ks),
                            dilations=[dil] * len(ks), pads=[dil * (kk // 2) for kk in ks] * 2, group=group)
    desc = f"{_dims(x)} k{_dims(ks)} ->{cout} g{group} s{stride} d{dil}"
    return Case(name, desc, [node], [("x", F, x)], ["y"], [W("w", [cout, x[1] // group, *ks]), W("b", [cout], 0.1)])


def conv_transpose(name: str, x: List[int], cout: int, k: int, stride: int = 2) -> Case:
    """2-D ConvTranspose that doubles the map (odd k: pad k//2 and output padding 1)."""
    pads, out_pad = ([k // 2] * 4, [1, 1]) if k % 2 else ([0] * 4, [0, 0])
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], kernel_shape=[k, k], strides=[stride] * 2,
                            pads=pads, output_padding=out_pad)
    return Case(name, f"{_dims(x)} k{k} s{stride} ->{cout}", [node], [("x", F, x)], ["y"],
                [W("w", [x[1], cout, k, k]), W("b", [cout], 0.1)])


def pool(name: str, op: str, x: List[int], k: int, s: int, p: int) -> Case:
    attrs: Dict[str, Any] = dict(kernel_shape=[k, k], strides=[s, s], pads=[p] * 4)
    if op == "AveragePool":
        attrs["count_include_pad"] = 0
    return Case(name, f"{_dims(x)} k{k} s{s}", [helper.make_node(op, ["x"], ["y"], **attrs)], [("x", F, x)], ["y"])


def binary(name: str, op: str, desc: str, a: List[int], b: List[int], gen: Optional[Dict[str, Gen]] = None) -> Case:
    return Case(name, desc, [helper.make_node(op, ["x", "x2"], ["y"])], [("x", F, a), ("x2", F, b)], ["y"],
                gen=gen or {})


def cases() -> List[Case]:
    """Every case, in table order: convolutions, resize, pooling, normalizations, activations and elementwise,
    the MatMul family, data movement and reductions, recurrent layers."""
    m = [1, 64, 80, 80]  # a detector's stride-8 map
    cs = [
        conv("conv3x3", m, 64, 3),
        conv("conv1x1", [1, 128, 40, 40], 256, 1),
        conv_transpose("convT_k3s2", [1, 64, 40, 40], 64, 3),
        conv_transpose("convT_k2s2", [1, 128, 40, 40], 64, 2),
        conv("conv1d_k3", [1, 64, 4000], 64, 3),
        conv("conv1d_k5s2", [1, 80, 3000], 128, 5, stride=2),
        conv("conv_dil2", [1, 64, 40, 40], 64, 3, dil=2),
        conv("conv_dil4", [1, 128, 40, 40], 128, 3, dil=4),
        conv("conv_g4", [1, 128, 40, 40], 128, 3, group=4),
        conv("conv_g32", [1, 128, 40, 40], 128, 3, group=32),
        conv("dw3x3", [1, 128, 40, 40], 128, 3, group=128),
        conv("dw3x3_s2", [1, 128, 80, 80], 128, 3, group=128, stride=2),
        conv("dw5x5", [1, 128, 40, 40], 128, 5, group=128),
        conv("dw7x7", [1, 128, 40, 40], 128, 7, group=128),
        conv("conv3d", [1, 16, 8, 40, 40], 16, 3),
    ]
    cs.append(Case("resize_nearest", _dims(m) + " x2",
                   [helper.make_node("Resize", ["x", "", "sc"], ["y"], mode="nearest",
                                     coordinate_transformation_mode="asymmetric", nearest_mode="floor")],
                   [("x", F, m)], ["y"], [C("sc", [1, 1, 2, 2])]))
    cs.append(Case("resize_linear", _dims(m) + " x2",
                   [helper.make_node("Resize", ["x", "", "sc"], ["y"], mode="linear")],
                   [("x", F, m)], ["y"], [C("sc", [1, 1, 2, 2])]))
    cs.append(Case("resize_linear_ac", "1x64x40x40 ->80x80 align_corners",
                   [helper.make_node("Resize", ["x", "", "", "sz"], ["y"], mode="linear",
                                     coordinate_transformation_mode="align_corners")],
                   [("x", F, [1, 64, 40, 40])], ["y"], [C("sz", [1, 64, 80, 80], np.int64)]))
    cs += [
        pool("maxpool3_s1", "MaxPool", m, 3, 1, 1),
        pool("maxpool3_s2", "MaxPool", m, 3, 2, 1),
        pool("maxpool5_s1", "MaxPool", [1, 128, 40, 40], 5, 1, 2),  # SPPF
        pool("avgpool3_s1", "AveragePool", m, 3, 1, 1),
        pool("avgpool3_s2", "AveragePool", m, 3, 2, 1),
        unary("globalavgpool", "GlobalAveragePool", [1, 256, 40, 40]),
    ]
    cs.append(Case("instancenorm", _dims(m),
                   [helper.make_node("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-5)],
                   [("x", F, m)], ["y"], [W("s", [64], 1.0), W("b", [64], 0.1)]))
    cs.append(Case("groupnorm_torch", "1x128x40x40 G32",  # torch's export of GroupNorm before opset 18
                   [helper.make_node("Reshape", ["x", "shp1"], ["r"]),
                    helper.make_node("InstanceNormalization", ["r", "one", "zero"], ["n"], epsilon=1e-5),
                    helper.make_node("Reshape", ["n", "shp2"], ["r2"]),
                    helper.make_node("Mul", ["r2", "g"], ["mul"]),
                    helper.make_node("Add", ["mul", "bb"], ["y"])],
                   [("x", F, [1, 128, 40, 40])], ["y"],
                   [C("shp1", [1, 32, -1], np.int64), C("one", np.ones(32)), C("zero", np.zeros(32)),
                    C("shp2", [1, 128, 40, 40], np.int64), W("g", [128, 1, 1], 1.0), W("bb", [128, 1, 1], 0.1)]))
    # GroupNormalization-18 (per-group scale) is deprecated by the onnx checker; -21 takes a per-channel scale
    cs.append(Case("groupnorm_op21", "1x128x40x40 G32 (opset 21)",
                   [helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=32, epsilon=1e-5)],
                   [("x", F, [1, 128, 40, 40])], ["y"], [W("s", [128], 1.0), W("b", [128], 0.1)], opset=21))
    cs.append(Case("layernorm", "1x128x384",
                   [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1, epsilon=1e-5)],
                   [("x", F, [1, 128, 384])], ["y"], [W("s", [384], 1.0), W("b", [384], 0.1)]))
    cs.append(Case("batchnorm", _dims(m), [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])],
                   [("x", F, m)], ["y"],
                   [W("s", [64], 1.0), W("b", [64], 0.1), W("m", [64], 0.1), C("v", np.full(64, 1.5))]))
    # activations and elementwise
    cs.append(unary("softmax", "Softmax", [1, 12, 128, 128], axis=-1))
    cs.append(Case("gelu_erf", "1x128x1536",
                   [helper.make_node("Div", ["x", "sq2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                    helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["x", "a"], ["mul"]),
                    helper.make_node("Mul", ["mul", "half"], ["y"])],
                   [("x", F, [1, 128, 1536])], ["y"], [C("sq2", np.sqrt(2.0)), C("one", 1.0), C("half", 0.5)]))
    cs += [unary("sigmoid", "Sigmoid", m), unary("hardswish", "HardSwish", m), unary("tanh", "Tanh", m),
           unary("relu", "Relu", m)]
    cs.append(Case("silu", _dims(m), [helper.make_node("Sigmoid", ["x"], ["s"]),
                                      helper.make_node("Mul", ["x", "s"], ["y"])], [("x", F, m)], ["y"]))
    cs.append(Case("prelu", _dims(m), [helper.make_node("PRelu", ["x", "sl"], ["y"])], [("x", F, m)], ["y"],
                   [W("sl", [64, 1, 1], 0.2)]))
    cs.append(Case("clip06", _dims(m), [helper.make_node("Clip", ["x", "lo", "hi"], ["y"])], [("x", F, m)], ["y"],
                   [C("lo", 0.0), C("hi", 6.0)]))
    cs.append(Case("where", _dims(m), [helper.make_node("Greater", ["x", "z"], ["c"]),
                                       helper.make_node("Where", ["c", "x", "y0"], ["y"])],
                   [("x", F, m), ("y0", F, m)], ["y"], [C("z", 0.0)]))
    cs += [
        binary("add_bcast", "Add", "1x64x80x80 + 1x64x1x1", m, [1, 64, 1, 1]),
        binary("mul2", "Mul", "1x64x80x80 * 1x64x80x80", m, m),
    ]
    cs.append(Case("pow2", "1x128x384 ^2", [helper.make_node("Pow", ["x", "e"], ["y"])], [("x", F, [1, 128, 384])],
                   ["y"], [C("e", 2.0)]))
    cs += [
        binary("pow_xy", "Pow", "1x64x80x80 ^ 1x64x80x80", m, m, gen={"x": _positive(m)}),
        unary("sqrt", "Sqrt", m, gen=_positive(m)),
        binary("div", "Div", "1x64x80x80 / 1x64x80x80", m, m, gen={"x2": _positive(m)}),
    ]
    # the MatMul family
    cs.append(Case("matmul_batched", "1x12x128x64 @ 1x12x64x128", [helper.make_node("MatMul", ["a", "b"], ["y"])],
                   [("a", F, [1, 12, 128, 64]), ("b", F, [1, 12, 64, 128])], ["y"]))
    cs.append(Case("matmul_const", "1x128x384 @ 384x1536 + b",
                   [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["y"])],
                   [("x", F, [1, 128, 384])], ["y"], [W("w", [384, 1536], 0.05), W("b", [1536], 0.1)]))
    cs.append(Case("gemm", "128x384 -> 1536", [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
                   [("x", F, [128, 384])], ["y"], [W("w", [1536, 384]), W("b", [1536], 0.1)]))
    cs.append(Case("einsum_qk", "bhqd,bhkd->bhqk 1x12x128x64",
                   [helper.make_node("Einsum", ["a", "b"], ["y"], equation="bhqd,bhkd->bhqk")],
                   [("a", F, [1, 12, 128, 64]), ("b", F, [1, 12, 128, 64])], ["y"]))
    cs.append(Case("gather_embed", "30522x384 table, 1x128 ids",
                   [helper.make_node("Gather", ["tab", "ids"], ["y"], axis=0)],
                   [("ids", I64, [1, 128])], ["y"], [W("tab", [30522, 384], 0.05)],
                   gen={"ids": lambda rng: rng.integers(0, 30522, (1, 128)).astype(np.int64)}))
    # data movement
    cs.append(Case("concat4", "4x 1x64x80x80 axis1", [helper.make_node("Concat", list("abcd"), ["y"], axis=1)],
                   [(n, F, m) for n in "abcd"], ["y"]))
    cs.append(Case("split4", "1x256x40x40 -> 4", [helper.make_node("Split", ["x", "sp"], list("abcd"), axis=1)],
                   [("x", F, [1, 256, 40, 40])], list("abcd"), [C("sp", [64] * 4, np.int64)]))
    cs.append(Case("slice", "1x256x80x80 [:, 64:192, 1::2]",
                   [helper.make_node("Slice", ["x", "st", "en", "ax", "stp"], ["y"])],
                   [("x", F, [1, 256, 80, 80])], ["y"],
                   [C("st", [64, 1], np.int64), C("en", [192, 80], np.int64), C("ax", [1, 2], np.int64),
                    C("stp", [1, 2], np.int64)]))
    cs.append(Case("transpose_heads", "1x128x384 ->1x12x128x32",
                   [helper.make_node("Reshape", ["x", "shp"], ["r"]),
                    helper.make_node("Transpose", ["r"], ["y"], perm=[0, 2, 1, 3])],
                   [("x", F, [1, 128, 384])], ["y"], [C("shp", [1, 128, 12, 32], np.int64)]))
    cs.append(Case("transpose_nchw", "1x64x80x80 perm 0,2,3,1",
                   [helper.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 3, 1])], [("x", F, m)], ["y"]))
    cs.append(Case("shuffle", "1x128x40x40 channel shuffle g2",
                   [helper.make_node("Reshape", ["x", "s1"], ["r"]),
                    helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3, 4]),
                    helper.make_node("Reshape", ["t", "s2"], ["y"])],
                   [("x", F, [1, 128, 40, 40])], ["y"],
                   [C("s1", [1, 2, 64, 40, 40], np.int64), C("s2", [1, 128, 40, 40], np.int64)]))
    cs.append(Case("reducemean_last", "1x128x384 axis -1 keep",
                   [helper.make_node("ReduceMean", ["x"], ["y"], axes=[-1], keepdims=1)],
                   [("x", F, [1, 128, 384])], ["y"]))
    cs.append(Case("reducesum_hw", "1x64x80x80 axes 2,3",
                   [helper.make_node("ReduceSum", ["x", "ax"], ["y"], keepdims=1)],
                   [("x", F, m)], ["y"], [C("ax", [2, 3], np.int64)]))
    cs.append(Case("reducemax_c", "1x64x80x80 axis 1",
                   [helper.make_node("ReduceMax", ["x"], ["y"], axes=[1], keepdims=1)], [("x", F, m)], ["y"]))
    for mode in ("reflect", "constant", "edge"):
        cs.append(Case(f"pad_{mode}", "1x64x80x80 +1 HW", [helper.make_node("Pad", ["x", "p"], ["y"], mode=mode)],
                       [("x", F, m)], ["y"], [C("p", [0, 0, 1, 1, 0, 0, 1, 1], np.int64)]))
    cs += [
        unary("depthtospace", "DepthToSpace", [1, 256, 40, 40], blocksize=2, mode="DCR"),
        unary("depthtospace_crd", "DepthToSpace", [1, 256, 40, 40], blocksize=2, mode="CRD"),
        unary("spacetodepth", "SpaceToDepth", m, blocksize=2),
    ]
    cs.append(Case("cumsum", "1x64x4000 axis 2", [helper.make_node("CumSum", ["x", "ax"], ["y"])],
                   [("x", F, [1, 64, 4000])], ["y"], [C("ax", 2, np.int64)]))
    cs.append(Case("topk", "1x80x8400 k100 axis -1", [helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=-1)],
                   [("x", F, [1, 80, 8400])], ["v", ("i", I64)], [C("k", [100], np.int64)]))
    cs.append(Case("argmax", "1x21x160x160 axis 1", [helper.make_node("ArgMax", ["x"], ["y"], axis=1, keepdims=0)],
                   [("x", F, [1, 21, 160, 160])], [("y", I64)]))
    cs += more_cases(m)
    cs += bert_base_cases()
    # recurrent layers: 100 steps, batch 1, 64 inputs, 128 hidden units
    steps, inputs, hidden = 100, 64, 128
    cs.append(Case("lstm", f"seq{steps} in{inputs} h{hidden}",
                   [helper.make_node("LSTM", ["x", "W", "R", "B"], ["Y", "Yh", "Yc"], hidden_size=hidden)],
                   [("x", F, [steps, 1, inputs])], ["Y"],
                   [W("W", [1, 4 * hidden, inputs]), W("R", [1, 4 * hidden, hidden]), W("B", [1, 8 * hidden], 0.1)]))
    cs.append(Case("gru", f"seq{steps} in{inputs} h{hidden}",
                   [helper.make_node("GRU", ["x", "W", "R", "B"], ["Y", "Yh"], hidden_size=hidden,
                                     linear_before_reset=1)],
                   [("x", F, [steps, 1, inputs])], ["Y"],
                   [W("W", [1, 3 * hidden, inputs]), W("R", [1, 3 * hidden, hidden]), W("B", [1, 6 * hidden], 0.1)]))
    return cs


def more_cases(m: List[int]) -> List[Case]:
    """Operators of real models beyond the first set: more activations and element-wise math, comparisons,
    broadcasting and indexing, other normalizations and reductions, and common convolution shapes."""
    t = [1, 128, 384]  # a transformer's hidden states
    cs = [
        conv("conv3x3_s2", [1, 64, 80, 80], 128, 3, stride=2),
        conv("conv7x7_s2_stem", [1, 3, 224, 224], 64, 7, stride=2),
        Case("conv1x7", "1x128x40x40 k1x7 ->128",
             [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[1, 7], pads=[0, 3, 0, 3])],
             [("x", F, [1, 128, 40, 40])], ["y"], [W("w", [128, 128, 1, 7]), W("b", [128], 0.1)]),
        Case("gemm_vec", "1x2048 -> 1000", [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
             [("x", F, [1, 2048])], ["y"], [W("w", [1000, 2048], 0.05), W("b", [1000], 0.1)]),
        unary("leakyrelu", "LeakyRelu", m, alpha=0.1),
        unary("elu", "Elu", m),
        unary("hardsigmoid", "HardSigmoid", m),
        unary("softplus", "Softplus", m),
        unary("exp", "Exp", m),
        unary("log", "Log", m, gen=_positive(m)),
        unary("reciprocal", "Reciprocal", m, gen=_positive(m)),
        unary("abs", "Abs", m),
        unary("erf", "Erf", t),
        unary("floor", "Floor", m),
        unary("sin", "Sin", m),
        binary("sub_bcast", "Sub", "1x64x80x80 - 1x1x80x80", m, [1, 1, 80, 80]),
        binary("max2", "Max", "1x64x80x80 max 1x64x80x80", m, m),
        binary("mul_scalar_row", "Mul", "1x128x384 * 384", t, [384]),
        unary("softmax_c", "Softmax", m, axis=1),
        unary("logsoftmax", "LogSoftmax", [1, 128, 1000], axis=-1),
        Case("mish", _dims(m), [helper.make_node("Softplus", ["x"], ["sp"]), helper.make_node("Tanh", ["sp"], ["th"]),
                                helper.make_node("Mul", ["x", "th"], ["y"])], [("x", F, m)], ["y"]),
        unary("lrn", "LRN", [1, 64, 56, 56], size=5),
        unary("reducel2", "ReduceL2", m, axes=[1], keepdims=1),
        unary("reducemin_last", "ReduceMin", t, axes=[-1], keepdims=1),
        unary("globalmaxpool", "GlobalMaxPool", m),
        unary("lpnorm", "LpNormalization", t, axis=-1, p=2),
        Case("expand", "1x64x1x1 -> 1x64x80x80", [helper.make_node("Expand", ["x", "shp"], ["y"])],
             [("x", F, [1, 64, 1, 1])], ["y"], [C("shp", m, np.int64)]),
        Case("tile", "1x64x40x40 x(1,1,2,2)", [helper.make_node("Tile", ["x", "rep"], ["y"])],
             [("x", F, [1, 64, 40, 40])], ["y"], [C("rep", [1, 1, 2, 2], np.int64)]),
        Case("gather_c", "1x256x40x40 channels[64 idx]", [helper.make_node("Gather", ["x", "idx"], ["y"], axis=1)],
             [("x", F, [1, 256, 40, 40])], ["y"], [C("idx", np.arange(0, 256, 4), np.int64)]),
        Case("flatten_fc", "1x512x7x7 flatten -> 1000",
             [helper.make_node("Flatten", ["x"], ["f"], axis=1),
              helper.make_node("Gemm", ["f", "w", "b"], ["y"], transB=1)],
             [("x", F, [1, 512, 7, 7])], ["y"], [W("w", [1000, 512 * 49], 0.01), W("b", [1000], 0.1)]),
        Case("sub_mean", "1x128x384 - mean, ^2, mean (LayerNorm by parts)",
             [helper.make_node("ReduceMean", ["x"], ["mu"], axes=[-1], keepdims=1),
              helper.make_node("Sub", ["x", "mu"], ["d"]), helper.make_node("Mul", ["d", "d"], ["sq"]),
              helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1], keepdims=1),
              helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
              helper.make_node("Div", ["d", "sd"], ["y"])],
             [("x", F, t)], ["y"], [C("eps", 1e-5)]),
    ]
    return cs


def bert_base_cases() -> List[Case]:
    """A BERT-base layer's shapes at sequence 512 (12 heads of 64, hidden 768, feed-forward 3072) and masks and
    comparisons, casts and many-way splits and concatenations, the shapes a transformer of real size brings."""
    seq, hidden, heads = 512, 768, 12
    hs = [1, seq, hidden]
    scores = [1, heads, seq, seq]
    cs = [
        Case("bert_scores", "1x12x512x64 @ 1x12x64x512", [helper.make_node("MatMul", ["a", "b"], ["y"])],
             [("a", F, [1, heads, seq, 64]), ("b", F, [1, heads, 64, seq])], ["y"]),
        unary("bert_softmax", "Softmax", scores, axis=-1),  # a graph output: the LUT method
        Case("bert_attention", "softmax(1x12x512x512) @ 1x12x512x64",  # inside the graph: FAST_EXP
             [helper.make_node("Softmax", ["s"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["y"])],
             [("s", F, scores), ("v", F, [1, heads, seq, 64])], ["y"]),
        Case("bert_layernorm", "1x512x768", [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)],
             [("x", F, hs)], ["y"], [W("s", [hidden], 1.0), W("b", [hidden], 0.1)]),
        Case("bert_ffn", "1x512x768 -> 3072 gelu -> 768",
             [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
              helper.make_node("Gelu", ["hb"], ["g"]), helper.make_node("MatMul", ["g", "w2"], ["o"]),
              helper.make_node("Add", ["o", "b2"], ["y"])],
             [("x", F, hs)], ["y"], [W("w1", [hidden, 4 * hidden], 0.03), W("b1", [4 * hidden], 0.1),
                                     W("w2", [4 * hidden, hidden], 0.03), W("b2", [hidden], 0.1)], opset=20),
        Case("mask_where", "1x12x512x512 where(mask, x, -1e4)",
             [helper.make_node("Equal", ["m", "zero"], ["eq"]), helper.make_node("Where", ["eq", "fill", "x"], ["y"])],
             [("x", F, scores), ("m", F, [1, 1, 1, seq])], ["y"], [C("zero", 0.0), C("fill", -1e4)],
             gen={"m": lambda rng: (rng.random((1, 1, 1, seq)) > 0.1).astype(np.float32)}),
        Case("cast_roundtrip", "1x64x80x80 float->int32->float",
             [helper.make_node("Cast", ["x"], ["i"], to=TensorProto.INT32),
              helper.make_node("Cast", ["i"], ["y"], to=TensorProto.FLOAT)], [("x", F, [1, 64, 80, 80])], ["y"],
             gen={"x": lambda rng: (rng.standard_normal((1, 64, 80, 80)) * 10).astype(np.float32)}),
        Case("split16", "1x256x40x40 -> 16", [helper.make_node("Split", ["x", "sp"], [f"y{i}" for i in range(16)],
                                                               axis=1)],
             [("x", F, [1, 256, 40, 40])], [f"y{i}" for i in range(16)], [C("sp", [16] * 16, np.int64)]),
        Case("concat16", "16x 1x16x40x40 axis1", [helper.make_node("Concat", [f"x{i}" for i in range(16)], ["y"],
                                                                   axis=1)],
             [(f"x{i}", F, [1, 16, 40, 40]) for i in range(16)], ["y"]),
        Case("flip", "1x64x80x80 [:, :, ::-1]",
             [helper.make_node("Slice", ["x", "st", "en", "ax", "stp"], ["y"])], [("x", F, [1, 64, 80, 80])], ["y"],
             [C("st", [-1], np.int64), C("en", [-(1 << 62)], np.int64), C("ax", [2], np.int64),
              C("stp", [-1], np.int64)]),
        Case("argmin_last", "1x80x8400 axis -1", [helper.make_node("ArgMin", ["x"], ["y"], axis=-1, keepdims=1)],
             [("x", F, [1, 80, 8400])], [("y", I64)]),
        unary("reduceprod", "ReduceProd", [1, 64, 80, 80], axes=[1], keepdims=1,
              gen=lambda rng: (rng.random((1, 64, 80, 80)) * 0.2 + 0.9).astype(np.float32)),
        pool("avgpool7_s1", "AveragePool", [1, 64, 40, 40], 7, 1, 3),
        Case("convT_dw", "1x64x40x40 k4 s2 groups 64",
             [helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], kernel_shape=[4, 4], strides=[2, 2],
                               pads=[1, 1, 1, 1], group=64)],
             [("x", F, [1, 64, 40, 40])], ["y"], [W("w", [64, 1, 4, 4]), W("b", [64], 0.1)]),
    ]
    return cs


# ------------------------------------------------------------------------------------------------ measurement
WARMUP_CALLS = 4
"""Calls before the timed ones (`least_cpu`): besides the memos of a first forward, the C library's allocator takes a
few rounds to stop handing a large freed block back to the system (each new one then page-faults, which counts as
CPU time: a case with a 6 MiB output read 3x its steady time on its first calls)."""


class _LayerClock:
    """The after-node hook of one forward: CPU seconds per layer since the previous layer ended."""

    def __init__(self) -> None:
        self.times: Dict[str, float] = {}
        self.last = time.process_time()

    def __call__(self, node: Any) -> None:
        now = time.process_time()
        key = f"{node.type}:{node.name}"
        self.times[key] = self.times.get(key, 0.0) + now - self.last
        self.last = time.process_time()


def per_layer(graph: Any, feeds: List[Any], repeat: int) -> Dict[str, float]:
    """Layer ("type:name") -> least CPU seconds over `repeat` forwards, the clock read in the after-node hook (the
    graph's own bookkeeping between two layers goes to the later one)."""
    import torch

    best: Dict[str, float] = {}
    for _ in range(repeat):
        clock = _LayerClock()
        with torch.no_grad():
            graph.forward(feeds, after_node=clock)
        for key, t in clock.times.items():
            best[key] = min(best.get(key, t), t)
    return best


def op_ms(layers: Dict[str, float]) -> float:
    """ms of the layers that are the operator itself: not the graph inputs (in the integer graph, with their
    quantization), constants, or the NCHW<->NHWC Transposes the importer puts at the model's boundary (in a real
    model those occur once, not per layer)."""
    return 1e3 * sum(t for key, t in layers.items()
                     if not key.startswith(("Input:", "Constant:"))
                     and not (key.startswith("Transpose:") and key.endswith("_post_transpose")))


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _error(stage: str, e: Exception) -> Tuple[str, bool]:
    """(note, failed): a QuantOptError is quantopt's answer (refusal, `failed` False); anything else is a bug."""
    from quantopt.errors import QuantOptError

    if isinstance(e, QuantOptError):
        lines = [ln.strip() for ln in e.message.strip().splitlines()]
        # the importer's message: a header line, then one line per node it cannot import
        body = " | ".join(lines[1:]) if stage == "import" and len(lines) > 1 else " ".join(lines)
        return _one_line(f"refused ({stage}, {type(e).__name__}): {body}"), False
    return _one_line(f"FAILED {stage}: {type(e).__name__}: {e}"), True


def _max_difference(got: Sequence[Any], want: Sequence[np.ndarray]) -> str:
    """The float outputs against onnxruntime's: "err <largest absolute difference>", or what does not match."""
    if len(got) != len(want):
        return f"{len(got)} outputs, onnxruntime {len(want)}"
    err = 0.0
    for g, w in zip(got, want):
        a, b = g.detach().double().numpy(), np.asarray(w, np.float64)
        if a.shape != b.shape:
            return f"output shape {tuple(a.shape)}, onnxruntime {tuple(b.shape)}"
        if b.size:
            err = max(err, float(np.max(np.abs(a - b))))
    return f"err {err:.1e}"


def measure(case: Case, folder: Path, repeat: int, integer: bool) -> Dict[str, Any]:
    """One case's figures (ms), its note and whether it failed (an exception that is not quantopt's answer)."""
    import onnxruntime as ort
    import torch

    from quantopt.frontends.onnx import import_onnx
    from quantopt.pipeline import quantize_model

    row: Dict[str, Any] = {"name": case.name, "shape": case.shape, "note": "", "failed": False}
    path = folder / f"{case.name}.onnx"
    onnx.save(case.model(), str(path))
    feeds = [case.feeds(i) for i in range(CALIB_SAMPLES + 1)]
    try:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        reference = session.run(None, feeds[0])
        row["ort_ms"] = 1e3 * least_cpu(repeat, lambda: session.run(None, feeds[0]), WARMUP_CALLS)
    except Exception as e:  # noqa: BLE001  (one case's failure is reported; the scan goes on)
        row["note"], row["failed"] = _error("onnxruntime", e)
        return row
    try:
        graph = import_onnx(str(path), {n: s for n, _, s in case.inputs})
    except Exception as e:  # noqa: BLE001
        row["note"], row["failed"] = _error("import", e)
        return row
    row["types"] = list(dict.fromkeys(str(n.type).split(".")[-1] for n in graph.nodes))
    # positional, in the ONNX model's input order (the importer may rename the inputs)
    tensors = [[torch.from_numpy(np.ascontiguousarray(f[n])) for n, _, _ in case.inputs] for f in feeds]

    def forward(g: Any, sample: List[Any]) -> List[Any]:
        with torch.no_grad():
            return g.forward(sample)

    try:
        row["note"] = _max_difference(forward(graph, tensors[0]), reference)
        row["float_ms"] = 1e3 * least_cpu(repeat, lambda: forward(graph, tensors[0]), WARMUP_CALLS)
        row["float_layers"] = per_layer(graph, tensors[0], repeat)
        row["op_float_ms"] = op_ms(row["float_layers"])
    except Exception as e:  # noqa: BLE001
        row["note"], row["failed"] = _error("float forward", e)
        return row
    if not integer:
        return row
    stage = "quantize"
    try:
        start = time.process_time()
        qgraph = quantize_model(graph, tensors[:CALIB_SAMPLES])
        row["quantize_s"] = time.process_time() - start
        stage = "integer forward"
        row["int_ms"] = 1e3 * least_cpu(repeat, lambda: forward(qgraph, tensors[CALIB_SAMPLES]), WARMUP_CALLS)
        row["int_layers"] = per_layer(qgraph, tensors[CALIB_SAMPLES], repeat)
        row["op_int_ms"] = op_ms(row["int_layers"])
    except Exception as e:  # noqa: BLE001
        row["note"], row["failed"] = _error(stage, e)
    return row


# ------------------------------------------------------------------------------------------------ report
COLUMNS = [("case", 18, "<"), ("shape", 34, "<"), ("ORT ms", 7, ">"), ("float ms", 8, ">"), ("float/ORT", 9, ">"),
           ("op float ms", 11, ">"), ("op/ORT", 6, ">"), ("int ms", 7, ">"), ("int/float", 9, ">"), ("note", 0, "<")]


def _cells(values: Sequence[str]) -> str:
    return "| " + " | ".join(f"{v:{align}{width}}" for v, (_, width, align) in zip(values, COLUMNS)) + " |"


def _num(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(row: Dict[str, Any], a: str, b: str) -> str:
    return _num(row[a] / row[b], 1) if row.get(a) is not None and row.get(b) else "-"


def table_line(row: Dict[str, Any]) -> str:
    """The row of one case in the printed table."""
    return _cells([row["name"], row["shape"][:34], _num(row.get("ort_ms")), _num(row.get("float_ms")),
                   _ratio(row, "float_ms", "ort_ms"), _num(row.get("op_float_ms")),
                   _ratio(row, "op_float_ms", "ort_ms"), _num(row.get("int_ms")), _ratio(row, "int_ms", "float_ms"),
                   row["note"]])


def machine() -> str:
    """CPU model, library versions: what the figures depend on."""
    import onnxruntime as ort
    import torch

    from quantopt.version import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"CPU {cpu}; python {platform.python_version()}, torch {torch.__version__}, onnxruntime "
            f"{ort.__version__}, onnx {onnx.__version__}, numpy {np.__version__}, quantopt {__version__}")


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list of case names (default: all; see --list)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs after the warm-up; the least counts")
    ap.add_argument("--no-int", action="store_true", help="float forward only: no quantization, no integer forward")
    ap.add_argument("--layers", action="store_true", help="per case, the layer types and the slowest layers")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--keep", help="write the ONNX models into this folder (default: a temporary one)")
    ap.add_argument("--list", action="store_true", help="print the case names and shapes and exit")
    args = ap.parse_args(argv)
    every = cases()
    if args.list:
        for case in every:
            print(f"{case.name:18} {case.shape}")
        return 0
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - {c.name for c in every})
    if unknown:
        print(f"unknown case(s): {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print("--repeat must be at least 1", file=sys.stderr)
        return 2
    selected = [c for c in every if not only or c.name in only]

    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    logging.disable(logging.WARNING)  # the importer's and calibration's notes would break the table
    from quantopt.registry import discover_plugins

    discover_plugins()
    print(machine())
    print(f"one thread (torch, onnxruntime), CPU time, least of {args.repeat} runs after {WARMUP_CALLS} warm-up runs;"
          " ms per forward")
    print(_cells([name for name, _, _ in COLUMNS]))
    print("|" + "|".join("-" * (max(width, len(name)) + 2) for name, width, _ in COLUMNS) + "|")
    rows = []
    start = time.process_time()
    with tempfile.TemporaryDirectory(prefix="op_speed_scan_") as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for case in selected:
            row = measure(case, folder, args.repeat, not args.no_int)
            rows.append(row)
            print(table_line(row), flush=True)
            if args.layers and "types" in row:
                print(f"    layers: {', '.join(row['types'])}")
                for key in ("float_layers", "int_layers"):
                    if key in row:
                        top = sorted(row[key].items(), key=lambda kv: -kv[1])[:4]
                        print(f"    {key.split('_')[0]:5}: " + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in top))
    failed = [r["name"] for r in rows if r["failed"]]
    print(f"total CPU {time.process_time() - start:.1f} s; {len(rows)} cases"
          + (f", failed: {', '.join(failed)}" if failed else ""))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "repeat": args.repeat, "rows": rows}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
