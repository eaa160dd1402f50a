"""Command line: `quantopt --cfg F | --field | --plugin | --version`, and the subcommands `quantopt import`
(ONNX → float IR), `quantopt run` (run an IR on .npy inputs) and `quantopt export` (quantized IR → ONNX QDQ).

User errors print one line and exit with the error's code (2 config, 3 IR, 4 data, 5 plugin, 6 unsupported);
a traceback is shown only with --debug.

Importing this module loads no torch, numpy, networkx or onnx: `--version`, `--help` (also of the subcommands),
`--field` and cfg errors answer in a fraction of a second, and everything that computes is imported inside the
function that needs it (tests/test_fast_start.py checks it).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, TextIO

from .cli_support import guarded, run_parser
from .errors import UnsupportedError
from .log import setup_console
from .version import __version__

_COMMANDS_HELP = """commands:
  import MODEL.onnx -o DIR     convert an ONNX model to a float IR
  run MODEL.txt -i X.npy -o DIR
                               run a float or quantized IR on .npy inputs
  export MODEL_o.txt --format onnx-qdq -o F.onnx
                               export a quantized IR as an exact ONNX QDQ model
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantopt", usage="quantopt [-h] [-c CFG] [-f] [-p] [-v] [--log-level LEVEL] "
                                "[--debug]\n       quantopt {import,run,export} ... (see quantopt COMMAND --help)",
                                description="Post-training quantization for an integer NPU.", epilog=_COMMANDS_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--cfg", help="run the workflow described by this cfg file ([Common] section)")
    p.add_argument("-f", "--field", action="store_true", help="list every cfg field with default and allowed values")
    p.add_argument("-p", "--plugin", action="store_true", help="list registered datasets, metrics and operators")
    p.add_argument("-v", "--version", action="store_true", help="print the version")
    p.add_argument("--log-level", default=None, help="debug, info (default), warning or error "
                                                     "(also env QUANTOPT_LOG)")
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    return p


def print_fields(out: Optional[TextIO] = None) -> None:
    """`quantopt --field`: the field table by group, with defaults and allowed values (imports no torch)."""
    out = out or sys.stdout
    from .config.fields import all_fields

    groups: dict = {}
    for f in all_fields():
        groups.setdefault(f.group, []).append(f)
    for group, fields in groups.items():
        print(f"[{group}]", file=out)
        for f in fields:
            default = repr(f.default) if f.default != "" else "(empty)"
            per_layer = "  (per-layer syntax)" if f.per_layer else ""
            print(f"  {f.name}", file=out)
            print(f"      {f.description}{per_layer}", file=out)
            print(f"      default: {default}; allowed: {f.allowed()}", file=out)


def _signature(cls: type) -> str:
    import inspect

    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return "(...)"
    params = [str(p) for name, p in sig.parameters.items() if name != "self"]
    return "(" + ", ".join(params) + ")"


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
        return rel if not rel.startswith("..") else path
    except ValueError:
        return path


def print_plugins(out: Optional[TextIO] = None) -> None:
    """`quantopt --plugin`: the registered datasets, metrics and operators (after plugin discovery)."""
    out = out or sys.stdout
    from .registry import DATASETS, LOADED, METRICS, OP_FORWARD, OP_QUANTIZE, QCONFIGS
    from .registry.optype import OpType

    for title, table in (("datasets", DATASETS), ("metrics", METRICS), ("qconfigs", QCONFIGS)):
        print(f"{title}:", file=out)
        for key in table.keys():
            reg = table.get(key)
            print(f"  {reg.obj.__name__}{_signature(reg.obj)}  version {reg.version}  [{_short(reg.source)}]",
                  file=out)
    names = sorted(set(OP_FORWARD.keys()) | set(OP_QUANTIZE.keys()))
    both = sum(1 for n in names if OP_FORWARD.get(n) and OP_QUANTIZE.get(n))
    print(f"operators ({len(names)} with a forward or quantize registration, {both} with both; "
          f"{len(OpType)} types known):", file=out)
    for n in names:
        parts = []
        for label, table in (("forward", OP_FORWARD), ("quantize", OP_QUANTIZE)):
            reg = table.get(n)
            parts.append(f"{label} {reg.version} [{_short(reg.source)}]" if reg else f"{label} -")
        print(f"  {n:<22} " + "  ".join(parts), file=out)
    failed = [p for p in LOADED if not p.ok]
    if failed:
        print("plugin files that failed to load:", file=out)
        for p in failed:
            print(f"  {p.path}: {p.error}", file=out)


def run_cfg(path: str) -> int:
    """`quantopt --cfg`: the cfg is read and checked before plugins and the model code (torch) are loaded, so that
    its errors answer at once; an operator type the cfg names that only a plugin registers loads the plugins
    during reading (config/optypes.py)."""
    from .config.reader import read_cfg

    cfg = read_cfg(path)
    from .config.kinds_compat import check_compat_cfg

    check_compat_cfg(cfg)
    from .config.graph_checks import check_cfg_against_graph
    from .graph.graph import QuantizeGraph
    from .ir.reader import read_ir
    from .master import OptMaster
    from .registry import discover_plugins

    discover_plugins()
    if str(cfg.graph).lower().endswith(".onnx"):
        from .frontends.onnx import import_onnx, parse_input_shapes, parse_input_values
        shapes = cfg.input_shape or ""
        values = parse_input_values([cfg.input_value] if cfg.input_value else [])
        if cfg.compat_quantized_model:  # a QDQ model keeps its own quantization (docs/compat-quantized.md)
            from .frontends.onnx_qdq import import_onnx_qdq as import_onnx
        graph = import_onnx(cfg.graph, parse_input_shapes([shapes] if shapes else []), input_values=values)
    else:
        graph = read_ir(cfg.graph, cfg.bin or None, QuantizeGraph, allow_unknown_keys=cfg.allow_unknown_ir_keys)
    if graph.header.get("compat_quantized_model") is True:
        raise UnsupportedError("IRs of pre-quantized models (compat_quantized_model=true) are not supported",
                               file=cfg.graph)
    check_cfg_against_graph(cfg, graph)
    master = OptMaster(graph, cfg)
    try:
        master()
    except BaseException:  # a failed run (a metric plugin raising after the IR was written) leaves only its log
        for path in master.files_written:
            if os.path.isfile(path) and not path.endswith("_opt.log"):
                os.remove(path)
        raise
    return 0


def import_main(argv: List[str]) -> int:
    """`quantopt import model.onnx -o DIR [--input-shape name:1,3,224,224 ...]`: ONNX → float IR files."""
    p = argparse.ArgumentParser(prog="quantopt import", description="Convert an ONNX model to a float IR.")
    p.add_argument("model", help="the .onnx file")
    p.add_argument("-o", "--output-dir", required=True, help="folder for <name>.txt and <name>.bin")
    p.add_argument("--input-shape", action="append", default=[],
                   help="fixed shape of a dynamic input, name:d0,d1,... (repeat per input)")
    p.add_argument("--input-value", action="append", default=[],
                   help="fix an input to constants, name:v0,v1,... (repeat per input), e.g. sr:16000")
    p.add_argument("--name", default=None, help="model name (default: the file name)")
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    args = p.parse_args(argv)
    setup_console(None)

    def convert() -> int:
        from .frontends.onnx import import_onnx_to_ir, parse_input_shapes, parse_input_values
        txt, bin_path = import_onnx_to_ir(args.model, args.output_dir, parse_input_shapes(args.input_shape),
                                          args.name, parse_input_values(args.input_value))
        print(txt)
        print(bin_path)
        return 0
    return guarded(convert, args.debug)


def run_main(argv: List[str]) -> int:
    """`quantopt run`: the arguments are checked here first (--help, usage errors: no torch), then runner.run_main
    parses the same argv again and runs."""
    run_parser().parse_args(argv)
    from .runner import run_main as main_fn
    return main_fn(argv)


def export_main(argv: List[str]) -> int:
    """`quantopt export` (exporters/cli.py parses its arguments before importing the exporter)."""
    from .exporters.cli import export_main as main_fn
    return main_fn(argv)


SUBCOMMANDS = {"import": import_main, "run": run_main, "export": export_main}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    if argv and not argv[0].startswith("-"):
        return _unknown_command(argv[0])
    args = _parser().parse_args(argv)
    try:
        setup_console(args.log_level)
    except ValueError as e:
        print(f"quantopt: {e}", file=sys.stderr)
        return 2
    return guarded(lambda: _dispatch(args), args.debug)


def _unknown_command(word: str) -> int:
    """A first argument that is neither an option nor a command: name it, and the command it was probably meant to
    be, instead of argparse's "unrecognized arguments"."""
    import difflib

    close = difflib.get_close_matches(word, list(SUBCOMMANDS), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    names = ", ".join(SUBCOMMANDS)
    print(f"quantopt: unknown command {_clip(word)!r}{hint} (commands: {names}; or quantopt --cfg FILE)",
          file=sys.stderr)
    return 2


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _dispatch(args: argparse.Namespace) -> int:
    if args.version:
        print(f"quantopt {__version__}")
        return 0
    if args.field:
        print_fields()
        return 0
    if args.plugin:
        from .registry import discover_plugins

        discover_plugins()
        print_plugins()
        return 0
    if args.cfg:
        return run_cfg(args.cfg)
    _parser().print_usage(sys.stderr)
    print("quantopt: nothing to do: give --cfg FILE, --field, --plugin or --version", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
