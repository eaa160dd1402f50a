"""Benchmark: how closely quantopt reproduces the upstream optimizer on the committed golden corpus
(tests/data/golden_corpus, made by benchmarks/make_golden_corpus.py), model by model and variant by variant.

    python benchmarks/golden_corpus_report.py [model ...] [--variants A,B,C] [--corpus DIR] [--details]
                                              [--write-floors]

For each model and variant it runs `quantopt --cfg` with the golden's cfg and prints the golden's layer count, how many
of quantopt's layers are identical to upstream's (written scales, zero points, dtypes, multipliers/shifts and
quantized constants; tests/golden_helpers.py), the share, and each differing layer with its type and the kinds of
difference (range: an output scale or zero point; scale/shift: a multiplier or shift; lut; weights; biases; output
type; missing layer: a layer upstream has and quantopt does not). Layers only quantopt writes are listed as extra.
"same ranges" counts the calibrated tensors whose (fmin, fmax) in the two templates are equal bit for bit, as
benchmarks/golden_ranges.py does for the shared models.
`--details` also prints ir_compare's text of every difference. Where upstream's optimizer failed on a variant (the
corpus holds `upstream_failed.txt` instead of a golden) quantopt still runs the cfg and the report says so; where
quantopt cannot run a cfg (an operator it lacks), the report prints its exit code and error line instead.

`--write-floors` records the measured figures as the regression floors of tests/test_golden_corpus.py
(`floors.json` in the corpus folder): run it after a fidelity improvement to raise them. A layer that differs exactly
as upstream's own output differs on this kind of CPU (tests/data/golden_corpus/machine_differences.json) is printed
as such and counts as identical in the floors, so the floors written on an Intel CPU are those of the AMD CPUs the
goldens were made on. Like the test suite, the script asks torch and oneDNN for their AVX2 kernels (unless
ATEN_CPU_CAPABILITY / DNNL_MAX_CPU_ISA are set): the goldens were made with them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")  # the suite's pins (tests/conftest.py), before torch loads:
os.environ.setdefault("DNNL_MAX_CPU_ISA", "AVX2")  # the goldens were made with torch's AVX2 kernels

from quantopt.analysis.ir_compare import template_ranges  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the comparison helpers shared with the tests

from golden_helpers import (  # noqa: E402
    FAILED_NOTE,
    GoldenComparison,
    QuantoptFailed,
    compare_with_golden,
    layer_kinds,
    machine_layers,
    run_golden_cfg,
    upstream_failure,
)

DEFAULT_CORPUS = REPO / "tests" / "data" / "golden_corpus"
FLOORS_COMMENT = (
    "Regression floors of tests/test_golden_corpus.py, measured by `python benchmarks/golden_corpus_report.py "
    "--write-floors`. Per model and variant: the golden's layer count, the number of layers quantopt reproduces "
    "exactly (a floor: the test fails below it), and the layers that differ today with the kinds of difference (the "
    "test fails when that set of names changes, so both an improvement and a new regression show). Raise the floors "
    "with the same command as fidelity work lands; docs/golden-differences.md explains each difference.")


def corpus_models(corpus: Path) -> List[str]:
    """The corpus's models: its sub-folders with golden cfgs, sorted."""
    return sorted(p.parents[2].name for p in corpus.glob("*/golden/A/opt.cfg"))


def measure(corpus: Path, model: str, letter: str, work: Path,
            extra: Sequence[str] = ()) -> Union[GoldenComparison, QuantoptFailed, None]:
    """quantopt run with one golden's cfg (plus the `extra` cfg lines), compared with the golden; None where upstream
    failed on the variant (quantopt still runs the cfg); quantopt's failure where it cannot run the cfg."""
    folder = corpus / model / "golden" / letter
    out = work / f"{model}_{letter}" / "out"
    out.mkdir(parents=True)
    try:
        ours = run_golden_cfg(folder, model, out, quiet=True, extra=extra)
    except QuantoptFailed as e:
        return e
    if (folder / FAILED_NOTE).is_file():
        return None
    result = compare_with_golden(ours, folder / f"{model}_o.txt")
    mine = template_ranges(out / f"{model}_opt_template.json")
    theirs = template_ranges(folder / f"{model}_opt_template.json")
    shared = [t for t in theirs if t in mine]
    result.ranges = (sum(mine[t] == theirs[t] for t in shared), len(shared))
    return result


def floor_entry(result: GoldenComparison, machine: Dict[str, List[str]]) -> Dict[str, Any]:
    """What floors.json records for one model and variant. A layer that differs exactly as upstream's own output
    differs on this kind of CPU (`machine`: tests/golden_helpers.py `machine_layers`) counts as identical, so floors
    written on such a machine are those of the machine the goldens were made on."""
    differing = {name: layer_kinds(d) for name, d in sorted(result.differing.items())}
    as_upstream = [name for name, kinds in differing.items() if machine.get(name) == kinds]
    return {"layers": len(result.diffs), "identical": result.identical + len(as_upstream),
            "differing": {name: kinds for name, kinds in differing.items() if name not in as_upstream},
            "extra": sorted(result.extra)}


def _compact_lists(text: str) -> str:
    """JSON text with every list of strings on one line, so a layer's kinds read as one line of floors.json."""
    item = r'"(?:[^"\\]|\\.)*"'
    pattern = re.compile(r"\[\n\s*(" + item + r"(?:,\n\s*" + item + r")*)\n\s*\]")
    return pattern.sub(lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="corpus models (default: all)")
    parser.add_argument("--variants", default="A,B,C", help="comma-separated variants (default A,B,C)")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--details", action="store_true", help="print every difference's text")
    parser.add_argument("--write-floors", action="store_true", help="record the figures in <corpus>/floors.json")
    parser.add_argument("--cfg-line", action="append", default=[], metavar="'FIELD = VALUE'",
                        help="add a cfg line to every golden's cfg, e.g. 'upstream_defects = all' (repeatable)")
    args = parser.parse_args(argv)
    known = corpus_models(args.corpus)
    models = args.models or known
    unknown = [m for m in models if m not in known]
    if unknown:
        parser.error(f"not in {args.corpus}: {', '.join(unknown)}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.write_floors and (args.models or variants != ["A", "B", "C"] or args.cfg_line):
        parser.error("--write-floors measures the whole corpus as committed: give no models, --variants or "
                     "--cfg-line")
    floors: Dict[str, Dict[str, Any]] = {}
    rows = []
    print(f"{'model/variant':<26} {'layers':>6} {'identical':>9} {'%':>7} {'same ranges':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for letter in variants:
                result = measure(args.corpus, model, letter, Path(tmp), args.cfg_line)
                if result is None:
                    failure = upstream_failure(args.corpus / model / "golden" / letter)
                    floors.setdefault(model, {})[letter] = {"upstream_failed": failure}
                    print(f"{model + '/' + letter:<26} upstream failed ({failure}); quantopt ran the cfg")
                    continue
                if isinstance(result, QuantoptFailed):
                    floors.setdefault(model, {})[letter] = {"quantopt_failed": {"exit": result.code,
                                                                                "error": result.error}}
                    rows.append((model, letter, 0, 0))
                    print(f"{model + '/' + letter:<26} quantopt failed: exit {result.code}: {result.error}")
                    continue
                machine = machine_layers(args.corpus, model, letter)
                floors.setdefault(model, {})[letter] = floor_entry(result, machine)
                share = result.identical / len(result.diffs) if result.diffs else 1.0
                rows.append((model, letter, len(result.diffs), result.identical))
                same, compared = result.ranges
                print(f"{model + '/' + letter:<26} {len(result.diffs):>6} {result.identical:>9} {share:>7.1%} "
                      f"{same:>5} of {compared:<4}", flush=True)
                for name, d in sorted(result.differing.items()):
                    note = " (as upstream writes it on this kind of CPU)" if machine.get(name) == layer_kinds(d) else ""
                    print(f"    {name} ({d.type}): {', '.join(layer_kinds(d))}{note}")
                    if args.details:
                        for text in d.differences:
                            print(f"        {text}")
                for name in sorted(result.extra):
                    print(f"    extra in quantopt: {name}")
    total, same = sum(r[2] for r in rows), sum(r[3] for r in rows)
    print(f"{'total':<26} {total:>6} {same:>9} {same / max(total, 1):>7.1%}")
    if args.write_floors:
        path = args.corpus / "floors.json"
        path.write_text(_compact_lists(json.dumps({"comment": FLOORS_COMMENT, "models": floors}, indent=1)) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
