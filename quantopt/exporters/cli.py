"""`quantopt export MODEL.txt [--bin MODEL.bin] --format onnx-qdq -o OUT.onnx`: a quantized IR written by quantopt
as another format."""
from __future__ import annotations

import argparse
import traceback
from typing import List

from ..errors import QuantOptError, UnsupportedError
from ..log import OPT_ERROR, setup_console
from .options import DEFAULT_SCALES, SCALE_MODES

FORMATS = ("onnx-qdq",)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantopt export", description="Export a quantized IR to another format.")
    p.add_argument("model", help="the quantized IR graph (.txt) written by quantopt")
    p.add_argument("--bin", default=None, help="its weights file (default: the IR's model_bin or <model>.bin)")
    p.add_argument("--format", required=True, choices=FORMATS, help="onnx-qdq: ONNX with QuantizeLinear/"
                   "DequantizeLinear pairs")
    p.add_argument("-o", "--output", required=True, help="the file to write")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default 19, or 21 for 16-bit tensors)")
    p.add_argument("--scales", default=DEFAULT_SCALES, choices=SCALE_MODES,
                   help="exact (default): onnxruntime computes quantopt's integers (integer-unit MAC layers, "
                   "tables as Gather, float64 requantization); effective: the IR's activation scales, weight "
                   "scales and rescaling Muls reproducing the multipliers; ir: the IR's scales only")
    p.add_argument("--static-batch", action="store_true", help="keep the IR batch size instead of a symbolic one")
    p.add_argument("--int64-inputs", action="store_true",
                   help="declare integer inputs (token ids, attention masks) int64, as the source ONNX model does; "
                   "they are saturated to the IR's integer type inside the graph")
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    return p


def export_main(argv: List[str]) -> int:
    """Read the IR, check it is quantized, write the export; prints the written path."""
    args = _parser().parse_args(argv)
    setup_console(None)
    try:
        from ..ir.reader import read_ir
        from ..registry import discover_plugins
        from .onnx_qdq import export_onnx_qdq

        discover_plugins()
        graph = read_ir(args.model, args.bin)
        if not any(n.quantized for n in graph.nodes):
            raise UnsupportedError("this is a float IR; export a quantized IR written by quantopt",
                                   file=args.model)
        path = export_onnx_qdq(graph, args.output, opset=args.opset, scales=args.scales,
                               dynamic_batch=not args.static_batch, int64_inputs=args.int64_inputs)
    except QuantOptError as e:
        if args.debug:
            traceback.print_exc()
        OPT_ERROR(str(e))
        return e.exit_code
    print(path)
    return 0
