"""Sequence decoding ops of OCR and speech heads: CTCGreedyDecoder and CollapseRepeated.

Both have integer outputs of a fixed IR shape (the decoded labels, padded) computed by comparisons only, so the
quantized forward applies the float algorithm to the integers: the argmax of quantized logits is the argmax of the
logits up to ties that quantization creates (the first index wins, as in the float forward). Lengths must be exact
integers. The integer semantics are in docs/semantics/sequence.md.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..log import OPT_WARN
from ..quant.params import integer_range
from ..registry import declare_op
from ..registry.schema import Bool, Param
from ._quant import copy_params, int_value, layer_settings, out_range, params, set_qinvariant, zero_code

SEMANTICS = "docs/semantics/sequence.md"

CTC_OUTPUT_MIN_BITS = 16
"""The decoded labels of CTCGreedyDecoder are at least 16-bit integers (as upstream)."""


def _lengths(node: PyNode, t: PyTensor) -> torch.Tensor:
    """Sequence lengths as int64 (a float length is truncated toward zero); quantized they must be exact integers."""
    if node.quantized:
        _check_length_tensor(node, t)
        return int_value(t).reshape(-1)
    x = t.betensor
    return (torch.trunc(x.to(torch.float64)) if x.is_floating_point() else x).to(torch.int64).reshape(-1)


def _check_length_tensor(node: PyNode, t: PyTensor) -> None:
    q = params(node, t)
    if not q.qinvariant:
        raise UnsupportedError(f"layer '{node.name}' ({node.type}): length input '{t.name}' is a quantized tensor "
                               f"(scale {q.scale}, zero point {q.zerop}); lengths must be exact integers (an integer "
                               "model input, an integer constant or the length output of another layer)")


# ------------------------------------------------------------------------------------------------ CTCGreedyDecoder
CTC_GREEDY_DECODER = declare_op(
    "CTCGreedyDecoder",
    params={"merge_repeated": Param(Bool(), "merge runs of the same class before removing blanks", required=True)},
    dtypes="logits: any; sequence lengths: integer → uint16 (int16 with force_dtype_int; 32 bits for 32-bit "
           "activations), scale 1",
    integer="argmax of the integer logits, merge, drop blank; padding qmax",
    semantics=f"{SEMANTICS}#ctcgreedydecoder",
    summary="Inputs: logits [batch, time, classes], lengths [batch]; output [batch, max_len, 1, 1]: decoded "
            "classes, padded with the output dtype's maximum. The blank is the last class.")


def _pad_value(node: PyNode) -> int:
    """The padding of the decoded labels: the largest value of the output dtype (float graph: the IR dtype)."""
    out = node.outputs[0]
    if node.quantized:
        return out_range(node, out)[1]
    dtype = out.ir_dtype
    if dtype.is_float:
        raise node._error(f"output '{out.name}' must have an integer IR dtype (the decoded classes), got "
                          f"{dtype.value}")
    return integer_range(dtype.bits, dtype.is_signed)[1]


@CTC_GREEDY_DECODER.forward
def ctc_greedy_decoder_forward(self: PyNode) -> None:
    """Per batch row: argmax over classes of the first `len` steps (ties: the lowest class; len <= 0: all steps,
    with a warning), runs of one class merged into one (`merge_repeated`), then the blank (last class) removed;
    written from the start of the row, the rest padded; a decoding longer than the row is cut (with a warning)."""
    if len(self.inputs) != 2:
        raise self._error(f"needs 2 inputs (logits, sequence lengths), got {len(self.inputs)}")
    x = self.inputs[0].betensor
    if x.dim() != 3:
        raise self._error(f"logits must be [batch, time, classes], got shape {list(x.shape)}")
    lengths = _lengths(self, self.inputs[1])
    batch, steps, classes = (int(d) for d in x.shape)
    if lengths.numel() != batch:
        raise self._error(f"sequence lengths hold {lengths.numel()} values for a batch of {batch}")
    out_shape = [batch] + [int(d) for d in self.outputs[0].ir_shape[1:]]
    if len(out_shape) < 2:
        raise self._error(f"output IR shape {list(self.outputs[0].ir_shape)} must be [batch, max_len, ...]")
    width = out_shape[1]
    merge = bool(self.get_param("merge_repeated"))
    out = torch.full([batch, width], _pad_value(self), dtype=torch.int64, device=x.device)
    best = torch.argmax(x, dim=-1)  # the first maximum
    for b in range(batch):
        n = int(lengths[b])
        if n <= 0:
            OPT_WARN(f"layer '{self.name}' (CTCGreedyDecoder): sequence length {n} of batch row {b} is not "
                     f"positive; all {steps} steps are decoded")
            n = steps
        seq = best[b, :n]
        if merge and seq.numel():
            keep = torch.ones_like(seq, dtype=torch.bool)
            keep[1:] = seq[1:] != seq[:-1]
            seq = seq[keep]
        seq = seq[seq != classes - 1]
        if seq.numel() > width:
            OPT_WARN(f"layer '{self.name}' (CTCGreedyDecoder): batch row {b} decodes to {seq.numel()} labels; the "
                     f"output holds {width}, the rest is cut")
            seq = seq[:width]
        out[b, :seq.numel()] = seq
    self.outputs[0].betensor = out.reshape(out_shape)


@CTC_GREEDY_DECODER.quantize
def ctc_greedy_decoder_quantize(self: PyNode) -> None:
    """The decoded classes are exact integers: max(16, activation bits) bits, unsigned unless force_dtype_int."""
    if len(self.inputs) != 2:
        raise self._error(f"needs 2 inputs (logits, sequence lengths), got {len(self.inputs)}")
    _check_length_tensor(self, self.inputs[1])
    s = layer_settings(self)
    set_qinvariant(self, self.outputs[0], max(CTC_OUTPUT_MIN_BITS, int(s.q_bits_activation)), bool(s.force_dtype_int))


# ------------------------------------------------------------------------------------------------ CollapseRepeated
COLLAPSE_REPEATED = declare_op(
    "CollapseRepeated",
    dtypes="labels: any, passthrough; lengths: integer, passthrough",
    integer="compare integers; padding -zp", semantics=f"{SEMANTICS}#collapserepeated",
    summary="Inputs: labels [batch, max_len], lengths [batch]; outputs: the labels with runs merged [batch, width] "
            "(padded with 0), the new lengths [batch].")


@COLLAPSE_REPEATED.forward
def collapse_repeated_forward(self: PyNode) -> None:
    """Per row, within the first `len` labels (len <= 0: none), each run of equal labels kept once; the kept labels
    are packed at the start of the row, the rest is 0 (quantized: -zp clamped to the range); output 1 counts them.
    The output width is the IR's: a longer result is cut."""
    if len(self.inputs) != 2 or len(self.outputs) != 2:
        raise self._error(f"needs 2 inputs (labels, lengths) and 2 outputs, got {len(self.inputs)} and "
                          f"{len(self.outputs)}")
    labels = self.inputs[0].betensor
    lengths = _lengths(self, self.inputs[1])
    if labels.dim() != 2:
        raise self._error(f"labels must be [batch, max_len], got shape {list(labels.shape)}")
    batch, maxlen = (int(d) for d in labels.shape)
    if lengths.numel() != batch or self.inputs[1].betensor.dim() != 1:
        raise self._error(f"lengths must be a [batch] vector, got shape {list(self.inputs[1].betensor.shape)} for "
                          f"labels {list(labels.shape)}")
    ir_shape = self.outputs[0].ir_shape
    if len(ir_shape) != 2:
        raise self._error(f"output 0 IR shape {list(ir_shape)} must be [batch, width]")
    width = int(ir_shape[1])
    keep = torch.ones_like(labels, dtype=torch.bool)
    keep[:, 1:] = labels[:, 1:] != labels[:, :-1]
    keep &= torch.arange(maxlen, device=labels.device).reshape(1, -1) < lengths.to(labels.device).reshape(-1, 1)
    counts = keep.sum(dim=1)
    if self.quantized:
        pad = torch.tensor(zero_code(self, self.inputs[0]), dtype=labels.dtype, device=labels.device)
    else:
        pad = torch.zeros((), dtype=labels.dtype, device=labels.device)
    out = pad.expand(batch, width).clone()
    # the packed position of each kept label: how many were kept before it
    pos = torch.cumsum(keep.to(torch.int64), dim=1) - 1
    take = keep & (pos < width)
    rows = torch.arange(batch, device=labels.device).reshape(-1, 1).expand_as(labels)
    out[rows[take], pos[take]] = labels[take]
    self.outputs[0].betensor = out
    self.outputs[1].betensor = counts.to(torch.int64)


@COLLAPSE_REPEATED.quantize
def collapse_repeated_quantize(self: PyNode) -> None:
    """Passthrough: the labels keep the labels' params, the new lengths (never above the old) the lengths'."""
    if len(self.inputs) != 2 or len(self.outputs) != 2:
        raise self._error(f"needs 2 inputs (labels, lengths) and 2 outputs, got {len(self.inputs)} and "
                          f"{len(self.outputs)}")
    _check_length_tensor(self, self.inputs[1])
    copy_params(self, self.outputs[0], self.inputs[0])
    copy_params(self, self.outputs[1], self.inputs[1])
