"""Several batches run as one forward of their concatenation, each batch's values read back from its own rows.

Why: a forward pays a fixed cost per layer (op dispatch, plans, small tensors) whatever its batch, and on small and
medium models that cost is most of a forward at batch 1; the passes that run many batches one after another (the
statistics pass, metric evaluation, the mixed-precision search, the global methods' captures of layer inputs and
outputs) pay it once per group instead. It changes no value:
a graph gives every sample the same bits at any batch size (graph/batch.py), so a batch's rows of a grouped
forward's tensor are the tensor its own forward gives. A group is only formed of batches whose inputs have one
shape and hold whole IR batches along dim 0; a graph that cannot run it (a layer that holds one IR batch only,
`BatchSizeError`, or whose constants do) or a tensor that does not split into the batches' rows has the batches
run one by one from then on (said at debug level): a failed group leaves nothing behind, and an error of the data
itself recurs in its own batch's forward.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, TypeVar

import torch

from ..log import OPT_DEBUG
from .graph import PyGraph
from .node import PyNode
from .tensor import PyTensor

FORWARD_GROUP_BYTES = 256 << 20
"""Most bytes of layer outputs (summed over the layers of one forward) a grouped forward may make."""
MAX_FORWARD_GROUP = 8
"""Most batches in one grouped forward: beyond it the per-layer cost a group saves is small against the layers'
own work."""

Extra = TypeVar("Extra")


def group_size(output_bytes: int) -> int:
    """Batches per grouped forward, from the bytes of the layer outputs of one batch's forward."""
    return max(1, min(MAX_FORWARD_GROUP, FORWARD_GROUP_BYTES // max(1, output_bytes)))


def groupable(graph: PyGraph, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether a batch's inputs all hold one whole number of IR batches along dim 0 (the other dims those of the
    IR), so that batches concatenated along dim 0 are one batch of the graph. An input of the IR shape beside
    inputs of more IR batches is shared by them (graph/batch.py) and cannot be concatenated."""
    if len(inputs) != len(graph.input_tensors):
        return False
    counts = set()
    for x, t in zip(inputs, graph.input_tensors):
        ir = tuple(int(d) for d in t.ir_shape)
        if x.dim() == 0 or x.dim() != len(ir) or ir[0] <= 0 or tuple(x.shape[1:]) != ir[1:] or x.shape[0] % ir[0]:
            return False
        counts.add(int(x.shape[0]) // ir[0])
    return len(counts) == 1


def same_shapes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether two batches' inputs have one shape and dtype each (batches that may share a group)."""
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))


def batch_parts(value: torch.Tensor, ir_shape: Sequence[int], k: int) -> Optional[List[torch.Tensor]]:
    """The values of each of `k` equal batches of a grouped forward in one of its tensors, `value` (its IR shape
    `ir_shape`): its rows split in k (a batched tensor), or the whole value for each (a tensor of the IR shape,
    made from constants alone: the same in every batch); None when it is neither."""
    ir = tuple(int(d) for d in ir_shape)
    if tuple(value.shape) == ir:
        return [value] * k
    if value.dim() != len(ir) or not ir or tuple(value.shape[1:]) != ir[1:] or ir[0] <= 0:
        return None
    rows = int(value.shape[0])
    if rows % k or rows % ir[0]:
        return None
    return list(value.split(rows // k))


def grouped_outputs(graph: PyGraph, items: Iterable[Tuple[List[torch.Tensor], Extra]],
                    read: Callable[[PyTensor], torch.Tensor],
                    group: Optional[int] = None) -> Iterator[Tuple[List[torch.Tensor], Extra]]:
    """`([read(t) for t in graph.output_tensors], extra)` per (inputs, extra) item, in order, the forwards run
    `group` batches at a time where they can be (default: `group_size` of the first batch's layer outputs). The
    values are those of one forward per batch; each item's are yielded before the next forward runs."""
    if group is not None and group < 1:
        raise ValueError(f"group must be at least 1, not {group}")
    run = _OutputGroups(graph, read)
    pending: List[Tuple[List[torch.Tensor], Extra]] = []
    for inputs, extra in items:
        if pending and (len(pending) == run.size or not same_shapes(pending[0][0], inputs)):
            yield from run.outputs(pending)
            pending = []
        if run.size == 0:  # the first batch: alone, measured
            output_bytes = run.measured_forward(inputs)
            yield [read(t) for t in graph.output_tensors], extra
            run.size = group if group is not None else group_size(output_bytes)
        elif run.size > 1 and groupable(graph, inputs):
            pending.append((inputs, extra))
        else:
            yield from run.outputs([(inputs, extra)])
    if pending:
        yield from run.outputs(pending)


class _OutputGroups:
    """`grouped_outputs`'s forwards: `size` batches per group (0 before the first batch, 1 once a group failed)."""

    def __init__(self, graph: PyGraph, read: Callable[[PyTensor], torch.Tensor]) -> None:
        self.graph = graph
        self.read = read
        self.size = 0

    def measured_forward(self, inputs: List[torch.Tensor]) -> int:
        """One forward; the bytes of its layer outputs."""
        total = 0

        def count(node: PyNode) -> None:
            nonlocal total
            total += sum(t.betensor.nbytes for t in node.outputs)

        self.graph.forward(inputs, after_node=count)
        return total

    def outputs(self, pending: List[Tuple[List[torch.Tensor], Extra]]) -> Iterator[Tuple[List[torch.Tensor], Extra]]:
        """The outputs of each pending batch: one forward of them all where the graph can run it and its outputs
        split into the batches' rows, else one forward each (and no more groups)."""
        graph, read, k = self.graph, self.read, len(pending)
        if k > 1:
            try:
                graph.forward([torch.cat(parts) for parts in zip(*(inputs for inputs, _ in pending))])
                split = [batch_parts(read(t), t.ir_shape, k) for t in graph.output_tensors]
                reason = failure_reason(Unsplit())
            except Exception as error:  # the batches run again one by one: a real error recurs
                split, reason = [None], failure_reason(error)
            if all(parts is not None for parts in split):
                for j, (_, extra) in enumerate(pending):
                    yield [parts[j] for parts in split], extra  # type: ignore[index]
                return
            OPT_DEBUG(f"grouped forwards: the rest run one batch per forward: {reason}")
            self.size = 1
        for inputs, extra in pending:
            graph.forward(inputs)
            yield [read(t) for t in graph.output_tensors], extra


LayerValues = Dict[str, Tuple[List[torch.Tensor], List[torch.Tensor]]]
"""Per named layer: (its input values, its output values), of one batch."""


class _Seen(Exception):
    """Every named layer of a grouped forward has run: the layers after them are not needed."""


def layer_values(graph: PyGraph, batches: Sequence[List[torch.Tensor]], names: Set[str],
                 read: Callable[[PyTensor], torch.Tensor], group: Optional[int] = None) -> List[LayerValues]:
    """Per batch, `read(t)` (copied) of every input and output of the named layers, each forward stopped after the
    last of them and run `group` batches at a time where it can be (default: `group_size` of the first batch's
    layer outputs up to there). The values are those of a whole forward per batch."""
    if group is not None and group < 1:
        raise ValueError(f"group must be at least 1, not {group}")
    wanted = [n for n in graph.nodes if n.name in names]
    last = wanted[-1] if wanted else None
    out: List[LayerValues] = []
    size, start = 1, 0
    while start < len(batches):
        k = 1
        if out and size > 1 and groupable(graph, batches[start]):
            while k < size and start + k < len(batches) and same_shapes(batches[start], batches[start + k]):
                k += 1
        got, output_bytes = _grouped_layer_values(graph, batches[start:start + k], names, last, read)
        if got is None:  # the group cannot run so: these batches and the rest one by one
            size = 1
            continue
        if not out:
            size = group if group is not None else group_size(output_bytes)
        out.extend(got)
        start += k
    return out


def _grouped_layer_values(graph: PyGraph, group: Sequence[List[torch.Tensor]], names: Set[str],
                          last: Optional[PyNode], read: Callable[[PyTensor], torch.Tensor]
                          ) -> Tuple[Optional[List[LayerValues]], int]:
    """`layer_values` of batches run as one forward (of one batch: as is), with the bytes of the layer outputs up
    to the last named layer; None for a group that cannot run so."""
    k = len(group)
    found: List[LayerValues] = [{} for _ in range(k)]
    output_bytes = 0

    def parts(t: PyTensor) -> List[torch.Tensor]:
        value = read(t)
        if k == 1:
            return [value.clone()]
        split = batch_parts(value, t.ir_shape, k)
        if split is None:
            raise Unsplit()
        return [p.clone() for p in split]

    def hook(node: PyNode) -> None:
        nonlocal output_bytes
        output_bytes += sum(t.betensor.nbytes for t in node.outputs)
        if node.name in names:
            ins, outs = [parts(t) for t in node.inputs], [parts(t) for t in node.outputs]
            for j in range(k):
                found[j][node.name] = ([v[j] for v in ins], [v[j] for v in outs])
        if node is last:
            raise _Seen()

    inputs = list(group[0]) if k == 1 else [torch.cat(p) for p in zip(*group)]
    try:
        graph.forward(inputs, after_node=hook)
    except _Seen:
        pass
    except Exception as error:  # the batches run again one by one: a real error recurs
        if k == 1:
            raise
        OPT_DEBUG(f"grouped forwards: the rest run one batch per forward: {failure_reason(error)}")
        return None, output_bytes
    finally:
        keep = {id(t) for t in graph.input_tensors}
        for n in graph.nodes:  # what a forward stopped early leaves behind is not needed
            for t in n.outputs:
                if id(t) not in keep:
                    t.release()
                    graph.wide_values.drop(t)
    return found, output_bytes


class Unsplit(Exception):
    """A value of a grouped forward that does not split into the batches' rows (or that no batch's rows hold)."""


def failure_reason(error: Exception) -> str:
    """Why a grouped forward failed, in one line (for the debug log of a caller that runs the batches one by one)."""
    if isinstance(error, Unsplit):
        return "a value does not split into the batches' rows"
    return str(error).splitlines()[0] if str(error) else type(error).__name__
