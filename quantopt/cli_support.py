"""What the quantopt commands share and the compute modules need too: the mapping of errors to one line and an
exit code (`guarded`) and the arguments of `quantopt run` (`run_parser`). Torch-free, so that `--help` and usage
errors answer at once; runner.py imports it instead of the command-line module above it.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from typing import Callable

from .errors import QuantOptError, as_out_of_memory
from .log import OPT_ERROR


def guarded(action: Callable[[], int], debug: bool) -> int:
    """Run a command: a user error prints one line and returns its exit code, a bug one line (traceback with
    --debug) and 1."""
    try:
        return action()
    except QuantOptError as e:
        if debug:
            traceback.print_exc()
        OPT_ERROR(str(e))
        return e.exit_code
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        OPT_ERROR("interrupted")
        return 130
    except Exception as e:  # a bug in quantopt, not a user error, unless the machine ran out of memory
        if debug:
            traceback.print_exc()
        oom = as_out_of_memory(e)
        if oom is not None:
            OPT_ERROR(str(oom))
            return oom.exit_code
        hint = "the traceback is above" if debug else "rerun with --debug for a traceback"
        OPT_ERROR(f"internal error: {type(e).__name__}: {e} ({hint})")
        return 1


def _device(text: str) -> str:
    """--device checked like the cfg field `device`, without torch."""
    from .device import parse_device

    try:
        return parse_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run_parser() -> argparse.ArgumentParser:
    """The arguments of `quantopt run` (torch-free: --help and usage errors answer at once)."""
    p = argparse.ArgumentParser(prog="quantopt run", description="Run a float or quantized IR on .npy inputs and "
                                                                 "save its outputs as .npy files.")
    p.add_argument("model", help="the IR graph file (.txt)")
    p.add_argument("--bin", default=None, help="the IR weights file (default: model_bin of the header, or "
                                               "MODEL.bin)")
    p.add_argument("-i", "--input", action="append", required=True, metavar="FILE",
                   help="one .npy per IR input, in IR input order (repeat -i), or one .npz with an array per input")
    p.add_argument("-o", "--output-dir", required=True, metavar="OUTDIR",
                   help="folder for the outputs (new, empty, or an earlier run's output, which is replaced)")
    p.add_argument("--dequantize", action="store_true",
                   help="also save each integer output dequantized to float32 as <name>.dequant.npy")
    p.add_argument("--quantize-inputs", action="store_true",
                   help="quantized IR: take float inputs and quantize them with the input tensors' scale/zp")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="run N samples at a time (default: all at once)")
    p.add_argument("--device", default="cpu", type=_device,
                   help="where the forward runs: cpu (default), cuda, cuda:N, or auto (CUDA when torch sees one); "
                        "the outputs are the same on every device")
    p.add_argument("--dump-all", action="store_true", help="also save every layer's outputs under OUTDIR/layers/")
    p.add_argument("--allow-unknown-ir-keys", action="store_true",
                   help="accept layer keys the layer's type does not know (an IR of a newer Parser; warned, unused)")
    p.add_argument("--log-level", default=None, help="debug, info (default), warning or error")
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    return p
