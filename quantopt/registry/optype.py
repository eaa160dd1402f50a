"""Operator types as a small open registry: `OpType.Convolution` is an interned name, new ones come from
`register_optype` (plugins, or the IR reader meeting an unknown `layer_type`)."""
from __future__ import annotations

from typing import Dict, List


class OpTypeName(str):
    """An operator type name; compares and hashes as its plain name ('Convolution')."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"OpType.{str(self)}"


class _OpTypeRegistry:
    def __init__(self) -> None:
        object.__setattr__(self, "_types", {})

    def __getattr__(self, name: str) -> OpTypeName:
        types: Dict[str, OpTypeName] = object.__getattribute__(self, "_types")
        if name in types:
            return types[name]
        raise AttributeError(f"OpType has no operator type '{name}' (register it with register_optype('{name}'))")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("OpType is read-only; use register_optype()")

    def __contains__(self, name: object) -> bool:
        return str(name) in self._types

    def __iter__(self):
        return iter(sorted(self._types.values()))

    def __len__(self) -> int:
        return len(self._types)

    def lookup(self, name: str) -> OpTypeName:
        """Exact name, else the unique case-insensitive match; KeyError if none."""
        if name in self._types:
            return self._types[name]
        folded = [t for t in self._types.values() if t.lower() == str(name).lower()]
        if len(folded) == 1:
            return folded[0]
        raise KeyError(name)

    def register(self, name: str) -> OpTypeName:
        if not name or not str(name).replace("_", "").isalnum():
            raise ValueError(f"invalid operator type name '{name}'")
        if name not in self._types:
            self._types[name] = OpTypeName(name)
        return self._types[name]

    def names(self) -> List[str]:
        return sorted(self._types)


OpType = _OpTypeRegistry()


def register_optype(name: str) -> OpTypeName:
    """Add (or return the existing) operator type `name`; plugins call this before registering a new op."""
    return OpType.register(name)


# The operator types quantopt knows by name (upstream's type names); forward/quantize support is a separate question,
# answered by the op registries.
_KNOWN = """
Input Constant ConstantOfShape Shape Dummy NoOp If Loop Switch CacheUpdate SlotUpdate QueryRebatch DataStride
Quantize DeQuantize Cast FakeQuantWithMinMaxVars ConvInteger MatMulInteger
Convolution Convolution3D ConvTranspose ConvTranspose3D DepthwiseConv FullyConnected MatMul Gemm BatchNorm BiasAdd
Dilation Erosion Col2Im
Eltwise Add Sub Mul Div DivMod Mod Pow SquaredDifference BitShift Bitwise Logical Where Count
Activation RELU RELU6 LeakyRELU PRELU CRELU Clip ELU SELU CELU GELU Silu Swish MISH Sigmoid HardSigmoid Hardswish Tanh
Softplus Softsign SHRINK THRESHOLDEDRELU BNLL
Abs Negative Sign Acos Acosh Asin Asinh Atan Atanh Cosine Cosh Sine Sinh Tan Erf Exp Log Sqrt Rsqrt Reciprocal Square
Ceil Floor Round Trunc IsInf IsNaN
LayerNorm GroupNorm InstanceNorm RMSNorm MVN LRN Normalization Moments NormalizedMoments SufficientStatistics
ZeroFraction
Softmax LogSoftmax Hardmax SDPAttention RotaryEmbedding
Pooling Pooling3D GlobalPool AdaptivePool FractionalPool MaxPoolingWithArgMax MaxUnpool MaxRoiPool ROIPooling RoiAlign
PyramidROIAlign CropAndResize
Resize Interp GridSample AffineGrid UpsampleByIndex Meshgrid OverlapAdd
Reshape Transpose Permute Squeeze Pad Tile Repeat Concat Split Slice StridedSlice Crop SpaceToDepth DepthToSpace
SpaceToBatch BatchToSpace BatchToSpaceND BatchToDepth ChannelShuffle ReverseSequence
Gather GatherElements GatherND ScatterElements ScatterND OneHot EmbeddingLookupSparse Compress NonZero Unique TopK Sort
ArgMinMax InTopK AccidentalHits Filter SegmentReduce Cumulate CollapseRepeated Reduce
BasicLSTM GRUv1 GRUv3 RNN
NMS PostNMS1 PostNMS2 Proposal GenerateProposals DecodeBox DetectionOutput Region RegionFuse BoundingBox FilterBoxes
GetValidCount MultiboxTransformLoc HeatmapMaxKeypoint CTCGreedyDecoder CTCBeamDecoder
RgbToYuv YuvToRgb Logit
"""
for _name in _KNOWN.split():
    register_optype(_name)
