"""Helpers shared by the golden tests (tests/test_golden_conformance.py, tests/test_golden_corpus.py) and
benchmarks/golden_corpus_report.py: run quantopt with a golden's cfg and compare its IR with the golden's layer by
layer. No pytest here, so the benchmark can import it too."""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from quantopt.analysis.ir_compare import LayerDiff, compare_quantized_irs, forgive_upstream_bias_wrap
from quantopt.cli import main as quantopt_main
from quantopt.graph.graph import PyGraph
from quantopt.graph.node import PyNode
from quantopt.graph.tensor import PyTensor
from quantopt.ir.reader import read_ir

FAILED_NOTE = "upstream_failed.txt"
"""In a corpus variant's golden folder instead of the golden IR: upstream's optimizer failed there
(benchmarks/make_golden_corpus.py writes its error lines)."""
PATH_KEYS = ("graph", "bin", "calibration_data", "data", "label")
SCALE_RTOL = 1e-6
"""Scales agree to float32 precision: two float32 forwards that sum in different orders give calibrated ranges a few
float32 ulps apart (docs/golden-differences.md)."""


MACHINE_DIFFERENCES = "machine_differences.json"
"""In the corpus folder: per kind of CPU, the layers whose golden upstream's own optimizer writes otherwise on it
(written by benchmarks/golden_machine_differences.py, which runs upstream there)."""


def cpu_vendor() -> str:
    """The x86 vendor string of /proc/cpuinfo ("AuthenticAMD", "GenuineIntel"), "" where there is none: MKL picks
    other GEMM and vector-math kernels on Intel CPUs than on AMD ones, and upstream's float forward calls them."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return ""
    return ""


def machine_layers(corpus: Path, model: str, letter: str) -> Dict[str, List[str]]:
    """Layer -> kinds of difference from the committed golden that upstream itself shows on this machine's kind of
    CPU for `model`/`letter` (empty where none is recorded): the goldens were made on an AMD CPU, and on an Intel
    one upstream's float forward (MKL's float32 GEMMs, torch's exp, erf and sqrt) rounds a few calibrated ranges
    one ulp apart; quantopt, which calls the same kernels, then writes what upstream writes there."""
    path = corpus / MACHINE_DIFFERENCES
    if not path.is_file():
        return {}
    machines = json.loads(path.read_text())["machines"]
    return dict(machines.get(cpu_vendor(), {}).get("cases", {}).get(f"{model}/{letter}", {}))


def upstream_failure(folder: Path) -> str:
    """The first error line of a variant's `upstream_failed.txt`, without upstream's log prefix."""
    lines = (folder / FAILED_NOTE).read_text().splitlines()[1:]
    text = lines[0] if lines else "no error line"
    return text.split("]: ", 1)[-1][:200]


def golden_cfg(folder: Path, out: Path, cfg: Path, extra: Sequence[str] = ()) -> Path:
    """Writes to `cfg` the golden's `opt.cfg` with its relative paths made absolute, its output sent to `out` and
    `extra` lines (`field = value`) added: the committed cfg text stays what upstream ran."""
    lines: List[str] = []
    for raw in (folder / "opt.cfg").read_text().splitlines():
        key, sep, value = raw.partition("=")
        k = key.strip().lower()
        if sep and k in PATH_KEYS:
            raw = f"{key.strip()} = {(folder / value.strip()).resolve()}"
        elif sep and k == "output_dir":
            raw = f"output_dir = {out}"
        lines.append(raw)
    lines.extend(extra)
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


class QuantoptFailed(RuntimeError):
    """quantopt refused or failed a golden cfg: its exit code and error line (directories left out of paths)."""

    def __init__(self, code: int, error: str) -> None:
        super().__init__(f"quantopt exited with {code}: {error}")
        self.code, self.error = code, error


def run_golden_cfg(folder: Path, model: str, out: Path, quiet: bool = False, extra: Sequence[str] = ()) -> Path:
    """Runs `quantopt --cfg` with the golden cfg of `folder` plus the `extra` lines; returns the written IR
    (`out/<model>_o.txt`), or raises QuantoptFailed with the error line of quantopt's log."""
    cfg = golden_cfg(folder, out, out.parent / f"{model}_{folder.name}.cfg", extra)
    argv = ["--cfg", str(cfg)] + (["--log-level", "ERROR"] if quiet else [])
    errors = _ErrorLines()
    logger = logging.getLogger("quantopt")
    logger.addHandler(errors)
    try:
        code = quantopt_main(argv)
    finally:
        logger.removeHandler(errors)
    if code != 0:
        error = errors.lines[-1] if errors.lines else "no error logged"
        raise QuantoptFailed(code, re.sub(r"(?<![\w'/])/(?:[^/\s:']+/)+", "", error))
    return out / f"{model}_o.txt"


class _ErrorLines(logging.Handler):
    """Collects the error lines quantopt logs while a cfg runs."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@dataclass
class GoldenComparison:
    """quantopt's IR against a golden: one LayerDiff per golden layer, and the layers only quantopt has."""

    diffs: List[LayerDiff]
    extra: List[str] = field(default_factory=list)
    ranges: Tuple[int, int] = (0, 0)
    """(tensors with bit-identical calibrated ranges, tensors compared), where the caller measured them."""
    paired: Dict[str, str] = field(default_factory=dict)
    """Golden layer name -> quantopt's layer name, for the inserted layers paired by position (their tensors)."""

    @property
    def identical(self) -> int:
        return sum(d.identical for d in self.diffs)

    @property
    def differing(self) -> Dict[str, LayerDiff]:
        return {d.name: d for d in self.diffs if not d.identical}


def _edge(node: PyNode) -> Tuple[str, Tuple[str, ...], Tuple[str, ...]]:
    return str(node.type), tuple(t.name for t in node.inputs), tuple(t.name for t in node.outputs)


def _rename(graph: PyGraph, t: PyTensor, name: str) -> None:
    """Rename a tensor of `graph`; its quantization parameters, keyed by name, move with it."""
    if t in graph.quant:
        graph.quant.set(name, graph.quant.get(t))
        graph.quant.drop(t)
    t.name = name


def pair_inserted_layers(ours: PyGraph, golden: PyGraph) -> Dict[str, str]:
    """Golden layer name -> quantopt layer name for the layers upstream inserted under a run-dependent name (the
    recurrent layers' Casts, `<producer>_Cast__<numbers>`): a golden layer absent from quantopt's IR by name is
    paired with the one quantopt layer, itself absent from the golden by name, of the same type reading and writing
    the same tensors. Renames quantopt's layer in `ours` (a graph read for the comparison) so the comparison then
    compares everything as for any other layer; nothing else is paired."""
    golden_names = {n.name for n in golden.nodes}
    our_names = {n.name for n in ours.nodes}
    candidates: Dict[Tuple[str, Tuple[str, ...], Tuple[str, ...]], List[PyNode]] = {}
    for n in ours.nodes:
        if n.name not in golden_names:
            candidates.setdefault(_edge(n), []).append(n)
    pairs: Dict[str, str] = {}
    for ref in golden.nodes:
        if ref.name in our_names:
            continue
        found = candidates.get(_edge(ref), [])
        if len(found) == 1:
            pairs[ref.name] = found[0].name
            found[0].name = ref.name
    # second pass: inserted layers whose output tensors carry run-dependent names too (float islands' Quantize and
    # DeQuantize): same type and input tensors, and each output read by the same layers at the same positions; the
    # output tensors are renamed to the golden's as well
    by_readers: Dict[tuple, List[PyNode]] = {}
    readers_ours = _readers(ours)
    for n in ours.nodes:
        if n.name not in golden_names and n.name not in pairs.values():
            by_readers.setdefault(_reader_edge(n, readers_ours), []).append(n)
    readers_golden = _readers(golden)
    for ref in golden.nodes:
        if ref.name in our_names or ref.name in pairs:
            continue
        found = by_readers.get(_reader_edge(ref, readers_golden), [])
        if len(found) == 1:
            pairs[ref.name] = found[0].name
            found[0].name = ref.name
            for mine, theirs in zip(found[0].outputs, ref.outputs):
                _rename(ours, mine, theirs.name)
    # third pass: chains of inserted layers (a DeQuantize then a Quantize between two quantized layers): in graph
    # order, the one unpaired layer of the same type reading the same tensors whose outputs have as many readers, the
    # same ones where they are layers of both graphs; its outputs are renamed to the golden's so the next layer of
    # the chain reads known tensors; repeated while it pairs
    def same_readers(mine: PyNode, theirs: PyNode) -> bool:
        ro, rg = _readers(ours), _readers(golden)
        for a, b in zip(mine.outputs, theirs.outputs):
            x, y = ro.get(a.name, ()), rg.get(b.name, ())
            known = golden_names & our_names
            if len(x) != len(y) or [r for r in x if r[0] in known] != [r for r in y if r[0] in known]:
                return False
        return True

    while True:
        paired = set(pairs.values())
        left = [n for n in ours.nodes if n.name not in golden_names and n.name not in paired]
        progress = False
        for ref in golden.nodes:
            if ref.name in our_names or ref.name in pairs:
                continue
            found = [n for n in left if str(n.type) == str(ref.type) and len(n.outputs) == len(ref.outputs)
                     and [t.name for t in n.inputs] == [t.name for t in ref.inputs] and same_readers(n, ref)]
            if len(found) == 1:
                pairs[ref.name] = found[0].name
                found[0].name = ref.name
                for mine, theirs in zip(found[0].outputs, ref.outputs):
                    _rename(ours, mine, theirs.name)
                left.remove(found[0])
                progress = True
        if not progress:
            return pairs


def _readers(graph: PyGraph) -> Dict[str, Tuple[Tuple[str, int], ...]]:
    found: Dict[str, List[Tuple[str, int]]] = {}
    for n in graph.nodes:
        for i, t in enumerate(n.inputs):
            found.setdefault(t.name, []).append((n.name, i))
    return {k: tuple(sorted(v)) for k, v in found.items()}


def _reader_edge(node: PyNode, readers: Dict[str, Tuple[Tuple[str, int], ...]]) -> tuple:
    return (str(node.type), tuple(t.name for t in node.inputs),
            tuple(readers.get(t.name, ()) for t in node.outputs))


def compare_with_golden(ours_ir: Path, golden_ir: Path, rtol: float = SCALE_RTOL) -> GoldenComparison:
    """Layer-by-layer comparison (quantopt.analysis.ir_compare), with upstream's int32 bias wrap-around forgiven.
    The golden is read accepting layer keys quantopt does not know (upstream's LayerNorm carries a `lut`, say): the
    comparison names what it lacks. Layers upstream inserted under run-dependent names are paired with quantopt's
    by their tensors first (`pair_inserted_layers`)."""
    ours: PyGraph = read_ir(str(ours_ir))
    golden: PyGraph = read_ir(str(golden_ir), allow_unknown_keys=True)
    pairs = pair_inserted_layers(ours, golden)
    diffs = compare_quantized_irs(ours, golden, rtol=rtol)
    forgive_upstream_bias_wrap(diffs, ours, golden)
    names = {n.name for n in golden.nodes}
    return GoldenComparison(diffs, [f"{n.name} ({n.type})" for n in ours.nodes if n.name not in names], paired=pairs)


KINDS = (
    ("layer missing", "missing layer"),
    ("type ", "layer type"),
    ("scale_value", "scale/shift"),
    ("shift_value", "scale/shift"),
    ("scale_type", "scale/shift"),
    ("shift_type", "scale/shift"),
    ("constant lut", "lut"),
    ("constant weights_scale", "weights scale/zp"),
    ("constant weights_zp", "weights scale/zp"),
    ("constant biases_scale", "bias scale/zp"),
    ("constant weights", "weights"),
    ("weights_", "weights scale/zp"),
    ("constant biases", "biases"),
    ("biases_", "bias scale/zp"),
    ("constant scale", "per-channel scale/shift"),
    ("constant shift", "per-channel scale/shift"),
    ("constant negative_slope", "negative slope"),
    ("quantize_method", "quantize method"),
)
"""Prefix of an ir_compare difference → the kind of difference the corpus report and docs speak of."""


def difference_kind(difference: str) -> str:
    """The kind of one ir_compare difference: output type, range (output scale/zero point), scale/shift, lut,
    weights, biases, ...; `<kind> absent` when quantopt writes no such value at all (another quantization form)."""
    if difference.startswith("output "):
        what = difference.split()[2]
        return "output type" if what == "dtype" else "range"
    absent = " None != " in difference or difference.endswith(" missing")
    for prefix, kind in KINDS:
        if difference.startswith(prefix):
            return f"{kind} absent" if absent and kind != "missing layer" else kind
    return "other"


def layer_kinds(diff: LayerDiff) -> List[str]:
    """The sorted distinct kinds of a layer's differences."""
    return sorted({difference_kind(d) for d in diff.differences})
