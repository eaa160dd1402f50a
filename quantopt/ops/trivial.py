"""Graph plumbing that moves values without computing: NoOp, Dummy and Meshgrid.

NoOp hands input 0 to every output; Dummy hands input i to output i; Meshgrid broadcasts two 1-D vectors into the
two coordinate grids of numpy's `meshgrid`. None of them changes a value, so quantized they carry their input's
quantization params and move the integers exactly as they move floats (one code path for both). The integer
semantics are in docs/semantics/plumbing.md.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..graph.node import PyNode
from ..graph.tensor import PyTensor
from ..registry import PASSTHROUGH_DTYPES, declare_op
from ..registry.schema import Bool, Param, Text
from ._quant import check_quantized_inputs, copy_params, layer_settings, params, quantize_activation, set_qinvariant
from ._shared import bool_param

SEMANTICS = "docs/semantics/plumbing.md"


def _check_per_tensor(node: PyNode, t: PyTensor) -> None:
    """Per-channel params stay valid only where the last axis keeps its meaning; these ops may move it."""
    q = params(node, t)
    for what in ("scale", "zerop"):
        v = getattr(q, what)
        if isinstance(v, torch.Tensor) and v.numel() > 1:
            raise UnsupportedError(f"layer '{node.name}' ({node.type}): input '{t.name}' has per-channel "
                                   "quantization; this op needs per-tensor scale and zero point")


# ------------------------------------------------------------------------------------------------ NoOp
NOOP = declare_op("NoOp", params={}, dtypes=PASSTHROUGH_DTYPES, integer="passthrough (every output is input 0)",
                  semantics=f"{SEMANTICS}#noop",
                  summary="Every output is a copy of input 0 (further inputs are only ordering dependencies).")


@NOOP.forward
def noop_forward(self: PyNode) -> None:
    if not self.inputs:
        raise self._error("needs at least one input")
    for out in self.outputs:
        out.betensor = self.inputs[0].betensor.clone()


@NOOP.quantize
def noop_quantize(self: PyNode) -> None:
    """Every output carries input 0's params (upstream clones them)."""
    check_quantized_inputs(self, self.inputs[:1])
    for out in self.outputs:
        copy_params(self, out, self.inputs[0])


# ------------------------------------------------------------------------------------------------ Dummy
DUMMY = declare_op("Dummy", params={}, dtypes=PASSTHROUGH_DTYPES, integer="passthrough (output i is input i)",
                   semantics=f"{SEMANTICS}#dummy",
                   summary="Output i is a copy of input i (a placeholder layer).")


@DUMMY.forward
def dummy_forward(self: PyNode) -> None:
    if len(self.outputs) > len(self.inputs):
        raise self._error(f"has {len(self.outputs)} outputs but only {len(self.inputs)} inputs (output i copies "
                          "input i)")
    for out, inp in zip(self.outputs, self.inputs):
        out.betensor = inp.betensor.clone()


@DUMMY.quantize
def dummy_quantize(self: PyNode) -> None:
    """Output i carries input i's params. An input without quantization params (possible only in hand-built graphs)
    gets, as upstream: a float one its calibrated range with the layer's activation mode (signed), an integer one
    scale 1 with its own dtype's bits."""
    for out, inp in zip(self.outputs, self.inputs):
        if params(self, inp).qmin is not None:
            copy_params(self, out, inp)
        elif inp.ir_dtype.is_float:
            quantize_activation(self, out, True, int(layer_settings(self).q_bits_activation))
        else:
            set_qinvariant(self, out, inp.ir_dtype.bits, inp.ir_dtype.is_signed)


# ------------------------------------------------------------------------------------------------ Meshgrid
MESHGRID = declare_op(
    "Meshgrid",
    params={"indexing": Param(Text(choices=("xy", "ij")), "xy: outputs [len(y), len(x)] (Cartesian); ij: outputs "
                              "[len(x), len(y)] (matrix)", default="xy"),
            "sparse": Param(Bool(), "true: each output keeps only its own axis, the other has size 1",
                            default=False),
            "copy": Param(Bool(), "numpy's copy flag; values are the same either way (not read)", default=True)},
    dtypes=PASSTHROUGH_DTYPES, integer="passthrough; output i carries input i's params",
    semantics=f"{SEMANTICS}#meshgrid", summary="Inputs: two 1-D vectors x and y.")


@MESHGRID.forward
def meshgrid_forward(self: PyNode) -> None:
    """numpy.meshgrid(x, y, indexing, sparse): output 0 repeats x along the other axis, output 1 repeats y."""
    if len(self.inputs) != 2 or len(self.outputs) != 2:
        raise self._error(f"needs exactly two inputs and two outputs, got {len(self.inputs)} and {len(self.outputs)}")
    x, y = self.inputs[0].betensor, self.inputs[1].betensor
    if x.dim() != 1 or y.dim() != 1:
        raise self._error(f"inputs must be 1-D vectors, got shapes {list(x.shape)} and {list(y.shape)}")
    indexing = str(self.get_param("indexing", optional=True, default_value="xy")).lower()
    if indexing not in ("xy", "ij"):
        raise self._error(f"indexing must be xy or ij, got {indexing!r}")
    sparse = bool_param(self, "sparse", False)
    if indexing == "xy":  # rows follow y, columns follow x
        g0, g1 = x.reshape(1, -1), y.reshape(-1, 1)
        full = (y.numel(), x.numel())
    else:
        g0, g1 = x.reshape(-1, 1), y.reshape(1, -1)
        full = (x.numel(), y.numel())
    if not sparse:
        g0, g1 = g0.expand(full), g1.expand(full)
    self.outputs[0].betensor = g0.contiguous()
    self.outputs[1].betensor = g1.contiguous()


@MESHGRID.quantize
def meshgrid_quantize(self: PyNode) -> None:
    """Output i carries input i's params: the grids only repeat the inputs' values."""
    check_quantized_inputs(self, self.inputs[:2])
    for out, inp in zip(self.outputs, self.inputs):
        _check_per_tensor(self, inp)
        copy_params(self, out, inp)
