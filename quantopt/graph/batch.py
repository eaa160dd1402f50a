"""Running a graph at a batch size other than the IR's.

The IR fixes a batch size (dim 0 of its inputs, usually 1); data may come in any batch. The meaning of a run at
batch B is that of B / b independent runs at the IR batch b, every tensor being the concatenation along dim 0 of the
per-group tensors ("groups" of b samples). Most operators compute exactly that when simply fed the whole batch
(convolutions, FullyConnected, element-wise ops, reductions over other axes, ...): they run once. An operator
whose parameters touch dim 0, or whose inputs hold a dim 0 that is not only the batch (an imported transformer's
`Flatten` of the attention mask to [seq, 1], PP-OCR's `Transpose` of q/k/v heads to dim 0), runs once per group
on the group's slice of every batched input, and its outputs are concatenated along dim 0. So a graph gives the
same result per sample at every batch size, whatever reshapes and transposes its IR holds.

An input is *batched* when its value differs from its IR shape in dim 0 only, by a whole factor of the IR's dim 0
(or any number of rows when its IR dim 0 is the IR batch); inputs holding exactly their IR shape (constants, or
everything when the data has the IR batch) are shared by all groups. A layer that needs groups but whose batched
inputs do not split into equal groups cannot run at that batch: a one-line error names it.

`BATCH_RULES` says, per operator type, when a layer needs groups; operator plugins may add their own with
`register_batch_rule` (e.g. `register_batch_rule(["MyConv"], whole_batch)` for an operator that computes each
sample alone). A type without a rule runs per group: slower, but right whatever the operator does with dim 0.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import BatchSizeError
from .wide_values import wide_values_of

BatchRule = Callable[[Any, Sequence[bool]], bool]
"""(node, which inputs are batched) -> True when the layer must run once per group of the IR batch."""

BATCH_RULES: Dict[str, BatchRule] = {}


def register_batch_rule(optypes: Sequence[str], rule: BatchRule) -> None:
    """Declare when layers of `optypes` must run once per IR-batch group (see the module docstring)."""
    for t in optypes:
        BATCH_RULES[str(t)] = rule


# ----------------------------------------------------------------------------------------------------- shapes
def batch_rows(t: Any) -> Optional[int]:
    """Rows of dim 0 of `t`'s value when it differs from its IR shape in dim 0 only (a batched tensor), else None
    (the IR shape itself, or another difference, which is not a batch change)."""
    ir = t.ir_shape
    shape = t.betensor.shape
    if len(shape) != len(ir) or not ir or tuple(shape) == tuple(ir):
        return None
    if tuple(shape[1:]) != tuple(ir[1:]) or int(ir[0]) <= 0:
        return None
    return int(shape[0])


def ir_batch(node: Any) -> int:
    """The IR batch of the graph `node` belongs to (dim 0 of its first input), 1 when unknown."""
    graph = getattr(node, "graph", None)
    inputs = getattr(graph, "input_tensors", None)
    if inputs and inputs[0].ir_shape:
        return int(inputs[0].ir_shape[0])
    return 1


def batch_error(node: Any, detail: str, why: str = "its dim 0 is not only the batch") -> BatchSizeError:
    """The one-line error of a layer that cannot run at the data's batch size."""
    b = ir_batch(node)
    return BatchSizeError(f"layer '{node.name}' ({node.type}) cannot run at this batch size: {detail} ({why}); "
                            "run at " + (f"a multiple of the IR batch size {b}" if b > 1 else "the IR batch size 1"))


def group_count(node: Any, batched: Sequence[bool]) -> int:
    """How many IR-batch groups the batched inputs of `node` split into (all must agree)."""
    count = None
    for t, is_batched in zip(node.inputs, batched):
        if not is_batched:
            continue
        rows, ir0 = int(t.betensor.shape[0]), int(t.ir_shape[0])
        if rows % ir0:
            raise batch_error(node, f"input '{t.name}' has {rows} rows in dim 0 where the IR has {ir0}, not a whole "
                                    f"number of IR batches")
        k = rows // ir0
        if count is not None and k != count:
            raise batch_error(node, f"its inputs hold {count} and {k} IR batches")
        count = k
    return count or 1


def _split(value: Optional[torch.Tensor], k: int) -> List[Optional[torch.Tensor]]:
    if value is None:
        return [None] * k
    return list(torch.chunk(value, k, dim=0))


def run_grouped(node: Any, run: Callable[[], None], k: int, batched: Sequence[bool]) -> None:
    """Run `run` (the node's forward) once per group of `k` on each batched input's dim-0 slice; the outputs are
    the concatenations along dim 0. Inputs get their values back afterwards. Wide values (graph/wide_values.py) are
    split and concatenated with the values they belong to."""
    wide = wide_values_of(node)
    saved: Dict[int, Tuple[Any, torch.Tensor, Optional[torch.Tensor]]] = {}
    parts: Dict[int, Tuple[List[Optional[torch.Tensor]], List[Optional[torch.Tensor]]]] = {}
    for t, is_batched in zip(node.inputs, batched):
        if is_batched and id(t) not in saved:
            w = wide.get(t) if wide is not None else None
            saved[id(t)] = (t, t.betensor, w)
            parts[id(t)] = (_split(t.betensor, k), _split(w, k))
    values: List[List[torch.Tensor]] = [[] for _ in node.outputs]
    wides: List[List[Optional[torch.Tensor]]] = [[] for _ in node.outputs]
    inner: List[List[torch.Tensor]] = []  # each group's placeholder values (tensors inside the layer, batch-major)
    try:
        for g in range(k):
            for key, (t, _, _) in saved.items():
                t.betensor = parts[key][0][g]
                if wide is not None:
                    wide.keep(t, parts[key][1][g])
            run()
            for i, out in enumerate(node.outputs):
                values[i].append(out.betensor)
                wides[i].append(wide.get(out) if wide is not None else None)
            inner.append([p.betensor for p in getattr(node, "placeholders", [])])
    finally:
        for t, value, w in saved.values():
            t.betensor = value
            if wide is not None:
                wide.keep(t, w)
    for i, out in enumerate(node.outputs):
        _check_concatenable(node, out.name, values[i])
        out.betensor = torch.cat(values[i], dim=0)
        if wide is not None:
            whole = all(u is not None for u in wides[i])
            wide.keep(out, torch.cat(wides[i], dim=0) if whole else None)  # type: ignore[arg-type]
    placeholders = getattr(node, "placeholders", [])
    if placeholders and all(len(v) == len(placeholders) for v in inner):
        for j, p in enumerate(placeholders):  # the whole batch's values, as the outputs
            if all(v[j].dim() > 0 and v[j].numel() for v in inner):
                p.betensor = torch.cat([v[j] for v in inner], dim=0)


def _check_concatenable(node: Any, name: str, values: Sequence[torch.Tensor]) -> None:
    """The groups' values of output `name` must be one batch-major tensor when concatenated along dim 0: a 0-d value
    (one number per IR batch, such as a count) or values whose other dims differ (a data-dependent shape) are not,
    and the layer cannot run at this batch (`batch_error`)."""
    if any(v.dim() == 0 for v in values):
        raise batch_error(node, f"its output '{name}' is one value per IR batch (a 0-d tensor)",
                          "no batch of several IR batches can hold it")
    shapes = sorted({tuple(v.shape[1:]) for v in values})
    if len(shapes) > 1:
        raise batch_error(node, f"its output '{name}' takes the shapes {[list(s) for s in shapes]} beyond dim 0 in "
                                "different IR batches", "a data-dependent shape")


def forward_batched(node: Any, run: Callable[[], None]) -> None:
    """Run `run` (the node's forward) on the whole batch, or once per IR-batch group when the layer needs it. A
    float kernel whose bits depend on the batch (`_float_per_group`) also gets its float inputs contiguous
    (`_run_on_contiguous`)."""
    if not node.inputs:
        run()
        return
    if _float_per_group(node) and any(_strided_float(t.betensor) for t in node.inputs):
        _run_on_contiguous(node, lambda: _forward_batched(node, run))
        return
    _forward_batched(node, run)


def _strided_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and not value.is_contiguous()


def _run_on_contiguous(node: Any, run: Callable[[], None]) -> None:
    """Run `run` with each non-contiguous float input replaced by a contiguous copy, the inputs' own values back
    afterwards. Why: torch's element-wise kernels (sigmoid, erf, exp, ...) compute the vector-sized body of each
    inner run with vectorized code and its tail with scalar code, whose last bits differ, and the inner runs follow
    the memory layout. A layer upstream of such a kernel may give a permuted view at one batch size and a
    contiguous tensor at another (InstanceNorm does); on contiguous values the runs depend only on the shape, so a
    sample gets the same bits at any batch."""
    saved = [(t, t.betensor) for t in node.inputs if _strided_float(t.betensor)]
    try:
        for t, value in saved:
            t.betensor = value.contiguous()
        run()
    finally:
        for t, value in saved:
            t.betensor = value


def _forward_batched(node: Any, run: Callable[[], None]) -> None:
    batched = [batch_rows(t) is not None for t in node.inputs]
    if not any(batched) or not BATCH_RULES.get(str(node.type), per_group)(node, batched):
        run()
        return
    k = group_count(node, batched)
    if k == 1:
        run()
        return
    run_grouped(node, run, k, batched)


# ------------------------------------------------------------------------------------------------------ rules
def _rank(node: Any) -> int:
    return len(node.inputs[0].ir_shape) if node.inputs else 0


def _int_values(raw: Any) -> Optional[List[int]]:
    values = raw if isinstance(raw, (list, tuple)) else [raw]
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        return None


def _axes_hit_zero(node: Any, key: str, default: Any, rank: Optional[int] = None) -> bool:
    """Whether the axis (or axes) param `key` names dim 0 (negative axes count from the end). A malformed param
    is left to the operator's own forward, which reports it."""
    rank = _rank(node) if rank is None else rank
    axes = _int_values(node.params.get(key, default))
    if axes is None or rank == 0:
        return False
    return any(a % rank == 0 for a in axes if -rank <= a < rank)


def per_group(node: Any, batched: Sequence[bool]) -> bool:
    """The rule of operators that must always run per group (and of types without a rule)."""
    return True


def whole_batch(node: Any, batched: Sequence[bool]) -> bool:
    """The rule of operators that compute each sample (each dim-0 row) alone."""
    return False


def _axis_rule(key: str, default: Any) -> BatchRule:
    def rule(node: Any, batched: Sequence[bool]) -> bool:
        return _axes_hit_zero(node, key, default)
    return rule


def _broadcast_rule(node: Any, batched: Sequence[bool]) -> bool:
    """Element-wise ops broadcast their inputs: the whole batch runs at once when every batched input's dim 0 is
    the output's dim 0 (all of one IR size) and every shared input has size 1 there (or a lower rank)."""
    rank = max((len(t.ir_shape) for t in node.inputs), default=0)
    batched_dim0 = set()
    for t, is_batched in zip(node.inputs, batched):
        r = len(t.ir_shape)
        if is_batched:
            if r != rank:
                return True
            batched_dim0.add(int(t.ir_shape[0]))
        elif r == rank and rank and int(t.ir_shape[0]) != 1:
            return True
    return len(batched_dim0) > 1


def _matmul_rule(node: Any, batched: Sequence[bool]) -> bool:
    """MatMul: leading dims broadcast like an element-wise op; a batched rank-2 first operand is rows of the
    product (shared second operand)."""
    ranks = [len(t.ir_shape) for t in node.inputs]
    if len(ranks) >= 2 and ranks[0] == 2 and batched[0] and not any(batched[1:]):
        return False
    if any(r < 3 for r, b in zip(ranks, batched) if b):
        return True
    return _broadcast_rule(node, batched)


def _concat_rule(node: Any, batched: Sequence[bool]) -> bool:
    """Concat on another axis than 0 runs whole when shared inputs have size 1 in dim 0 (they follow the batch)."""
    if _axes_hit_zero(node, "axis", None):
        return True
    return any(not b and t.ir_shape and int(t.ir_shape[0]) != 1 for t, b in zip(node.inputs, batched))


def _perm_rule(node: Any, batched: Sequence[bool]) -> bool:
    perm = _int_values(node.params.get("perm"))
    if perm is None or not isinstance(node.params.get("perm"), (list, tuple)):
        return str(node.type) == "Permute"  # Permute without perm reverses the axes
    return bool(perm) and perm[0] != 0


def _squeeze_rule(node: Any, batched: Sequence[bool]) -> bool:
    axis = node.params.get("axis")
    if axis is None or (isinstance(axis, (list, tuple)) and not axis):
        return bool(node.inputs[0].ir_shape) and int(node.inputs[0].ir_shape[0]) == 1
    return _axes_hit_zero(node, "axis", None)


def _gather_rule(node: Any, batched: Sequence[bool]) -> bool:
    """Gather along dim 0 of batched data, or with shared indices under batch_dims, needs groups; an embedding
    lookup (shared data, batched indices) does not."""
    if not batched[0]:
        return False
    if _axes_hit_zero(node, "axis", 0):
        return True
    dims = _int_values(node.params.get("batch_dims", 0))
    return bool(dims and dims[0] > 0 and not (len(batched) > 1 and batched[1]))


def _tile_rule(node: Any, batched: Sequence[bool]) -> bool:
    reps = _int_values(node.params.get("repeats"))
    return bool(reps) and reps[0] != 1


def _repeat_rule(node: Any, batched: Sequence[bool]) -> bool:
    return node.params.get("axis") is None or _axes_hit_zero(node, "axis", None)


def _pad_rule(node: Any, batched: Sequence[bool]) -> bool:
    pads = node.params.get("pads")
    if not isinstance(pads, (list, tuple)) or not pads:
        return False
    if all(isinstance(p, (list, tuple)) for p in pads):
        first = _int_values(pads[0])
        return bool(first) and any(first)
    flat = _int_values(pads)
    rank = len(flat or []) // 2
    return bool(flat) and rank > 0 and (flat[0] != 0 or flat[rank] != 0)


def _reverse_sequence_rule(node: Any, batched: Sequence[bool]) -> bool:
    rank = _rank(node)
    batch_axis = _int_values(node.params.get("batch_axis", 0))
    time_axis = _int_values(node.params.get("time_axis", 1))
    if not batch_axis or not time_axis or rank == 0:
        return False
    return batch_axis[0] % rank != 0 or time_axis[0] % rank == 0


def _norm_rule(node: Any, batched: Sequence[bool]) -> bool:
    if str(node.type) == "InstanceNorm" and "axis" not in node.params:
        return False
    return _axes_hit_zero(node, "axis", [-1])


# Float kernels whose float32 result for a sample depends on the batch it runs in: torch computes transcendental
# functions with a vectorized and a scalar path, and which elements take which depends on the tensor's size; a BLAS
# product sums a row differently depending on how many rows it gets; a long reduction is split between threads
# depending on how many outputs there are. Their float forward runs per IR-batch group, which gives every sample
# exactly the bits it gets alone. Integer forwards are exact and run whole.
FLOAT_PER_GROUP_METHODS = frozenset({"SIGMOID", "TANH", "ELU", "SELU", "CELU", "GELU", "SILU", "SWISH", "MISH",
                                     "SOFTPLUS", "BNLL"})
"""Activation methods (and the standalone types computing them) whose float kernel is not batch-invariant."""

FLOAT_PER_GROUP_TYPES = frozenset({"Sigmoid", "Tanh", "ELU", "SELU", "CELU", "GELU", "Silu", "Swish", "MISH",
                                   "Softplus", "BNLL", "Exp", "Log", "Erf", "Sine", "Cosine", "Tan", "Sinh", "Cosh",
                                   "Asin", "Acos", "Atan", "Asinh", "Acosh", "Atanh", "Rsqrt", "Pow", "Reduce",
                                   "BasicLSTM", "GRUv1", "GRUv3", "Convolution3D", "ConvTranspose",
                                   "ConvTranspose3D"})
"""Operator types whose float kernel is not batch-invariant (checked with torch 2.x on x86; the 3-D and transposed
convolutions: torch's float32 kernels block by the batch's size)."""


NATIVE_FLOAT_TYPES = frozenset({"Convolution", "DepthwiseConv", "FullyConnected"})
"""Types that `float_reference = native` computes with torch's float32 kernels (oneDNN, BLAS), which choose their
blocking, and so a sample's last bits, by the batch's size: with that setting their float forward runs per group."""


def _float_per_group(node: Any) -> bool:
    if node.quantized:
        return False
    kind = str(node.type)
    if kind in NATIVE_FLOAT_TYPES:
        return getattr(getattr(node, "settings", None), "float_reference", "exact") == "native"
    if kind == "Activation":
        return str(node.params.get("method", "")).upper() in FLOAT_PER_GROUP_METHODS
    return kind in FLOAT_PER_GROUP_TYPES


def _or_float(rule: BatchRule) -> BatchRule:
    def combined(node: Any, batched: Sequence[bool]) -> bool:
        return _float_per_group(node) or rule(node, batched)
    return combined


def _float_only(node: Any, batched: Sequence[bool]) -> bool:
    return _float_per_group(node)


# operators computing each dim-0 row alone (convolutions and pooling over the spatial axes of NHWC data, row-wise
# products, per-element functions, per-sample normalizations; Convolution, DepthwiseConv and FullyConnected are
# registered with the float kernels above); Reshape and Slice adapt their IR-batch params themselves
# (ops/shape.py); Shape reports the data's own shape, and MaxPoolingWithArgMax's NHWC/NCHW indices count the data's
# batch (MaxUnpool reads them so), as ONNX defines them for that batch
register_batch_rule(["Pooling", "Pooling3D", "GlobalPool",
                     "AdaptivePool", "Resize", "Interp",
                     "BatchNorm", "GroupNorm", "LRN", "ChannelShuffle", "DepthToSpace", "SpaceToDepth", "GridSample",
                     "Cast", "Quantize", "DeQuantize", "Abs", "Negative", "Ceil", "Floor", "Round", "Trunc", "Sign",
                     "Sqrt", "Square", "Reciprocal", "IsInf", "IsNaN", "Clip", "RELU", "RELU6", "LeakyRELU", "PRELU",
                     "HardSigmoid", "Hardswish", "Softsign", "SHRINK", "THRESHOLDEDRELU", "OneHot", "ConstantOfShape",
                     "Reshape", "Slice", "StridedSlice", "Shape", "MaxPoolingWithArgMax", "MaxUnpool"], whole_batch)
register_batch_rule(["Activation"] + sorted(FLOAT_PER_GROUP_TYPES - {"Pow", "Reduce"}) + sorted(NATIVE_FLOAT_TYPES),
                    _float_only)
register_batch_rule(["CRELU"], _axis_rule("axis", -1))
register_batch_rule(["Eltwise", "Add", "Sub", "Mul", "Div", "Mod", "DivMod", "Logical", "Where", "BitShift",
                     "Bitwise", "SquaredDifference", "BiasAdd"], _broadcast_rule)
register_batch_rule(["Pow"], _or_float(_broadcast_rule))
register_batch_rule(["MatMul"], _matmul_rule)
register_batch_rule(["Concat"], _concat_rule)
register_batch_rule(["Split"], _axis_rule("axis", 0))
register_batch_rule(["Transpose", "Permute"], _perm_rule)
register_batch_rule(["Squeeze"], _squeeze_rule)
register_batch_rule(["Gather"], _gather_rule)
register_batch_rule(["GatherElements", "GatherND", "ScatterND", "ScatterElements", "SpaceToBatch", "BatchToSpace",
                     "Crop"], per_group)
register_batch_rule(["Tile"], _tile_rule)
register_batch_rule(["Repeat"], _repeat_rule)
register_batch_rule(["Pad"], _pad_rule)
register_batch_rule(["ReverseSequence"], _reverse_sequence_rule)
register_batch_rule(["Softmax", "LogSoftmax", "Hardmax", "TopK", "Sort"], _axis_rule("axis", -1))
register_batch_rule(["ArgMinMax"], _axis_rule("axis", 0))
register_batch_rule(["Reduce"], _or_float(_axis_rule("axis", None)))
register_batch_rule(["Cumulate"], _axis_rule("axis", None))
register_batch_rule(["LayerNorm", "RMSNorm", "MVN", "InstanceNorm", "Normalization"], _norm_rule)
