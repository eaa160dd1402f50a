"""Benchmark: quantopt's per-layer mixed-precision search against upstream's single cut point.

    python benchmarks/mixed_precision_search.py [cfg] [--set key=value ...]

Default: the bundled digits example with 4-bit weights (int8 activations), which loses accuracy, and
`mixed_precision_auto_search = 6,0.0,L` (the first metric may not drop at all on 6 validation batches). Both
searches start from the same statistics and score the same batches; the script prints, per method, how many
layers it promotes to 16 bits, the metric it reaches and how many graph evaluations it needed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from quantopt.config.reader import read_cfg
from quantopt.ir.reader import read_ir
from quantopt.log import setup_console
from quantopt.master import OptMaster
from quantopt.registry import discover_plugins
from quantopt.tuning.mixed_precision import candidate_layers, cut_point_search, per_layer_search

EXAMPLE_CFG = Path(__file__).resolve().parents[1] / "examples" / "digits" / "opt.cfg"
DEFAULT_SET = ["weight_bits=4", "mixed_precision_auto_search=6,0.0,L"]


def cfg_with(path: Path, settings: List[str], folder: str) -> Path:
    """A copy of the cfg with `key=value` lines replaced or added (output_dir moved into `folder`)."""
    lines = path.read_text().splitlines()
    values: Dict[str, str] = dict(s.split("=", 1) for s in settings)
    values["output_dir"] = folder
    out = []
    for line in lines:
        key = line.split("=", 1)[0].strip()
        if "=" in line and key in values:
            continue
        out.append(line)
    out += [f"{k.strip()} = {v.strip()}" for k, v in values.items()]
    target = path.parent / f".bench_{Path(folder).name}.cfg"
    target.write_text("\n".join(out) + "\n")
    return target


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cfg", nargs="?", default=str(EXAMPLE_CFG))
    ap.add_argument("--set", action="append", default=None, help="override a cfg field, key=value (repeatable)")
    args = ap.parse_args(argv)
    setup_console("warning")
    discover_plugins()
    with tempfile.TemporaryDirectory() as tmp:
        path = cfg_with(Path(args.cfg), args.set if args.set is not None else DEFAULT_SET, tmp)
        try:
            cfg = read_cfg(str(path))
        finally:
            path.unlink()
        graph = read_ir(cfg.graph, cfg.bin or None)
        master = OptMaster(graph, cfg)
        master.output_dir = tmp
        master.prepare_statistics()
        auto = cfg.mixed_precision_auto_search
        if not auto.enabled:
            print("mixed_precision_auto_search is disabled in this cfg (batches < 1)", file=sys.stderr)
            return 2
        score, float_score = master.search_scorer()
        original = {n.name: n.settings for n in graph.nodes}
        rows = []
        for name, fn in (("per-layer (quantopt)", per_layer_search), ("single cut (upstream)", cut_point_search)):
            for n in graph.nodes:
                n.settings = original[n.name]
            start = time.perf_counter()
            result = fn(graph, score, float_score, auto)
            rows.append((name, result, time.perf_counter() - start))
    print(f"cfg: {args.cfg}  overrides: {', '.join(args.set if args.set is not None else DEFAULT_SET)}")
    print(f"candidate layers: {len(candidate_layers(graph))}; float metric {float_score:.6f}; configured precision "
          f"{rows[0][1].base_score:.6f}; threshold {auto}")
    print(f"{'method':<24}{'promoted':>9}{'metric':>11}{'reached':>9}{'evaluations':>13}{'seconds':>9}")
    for name, r, sec in rows:
        print(f"{name:<24}{len(r.promoted):>9}{r.final_score:>11.6f}{str(r.reached):>9}{r.evaluations:>13}"
              f"{sec:>9.1f}")
    per_layer, cut = rows[0][1], rows[1][1]
    print(f"promoted layers, per-layer ÷ single cut: {len(per_layer.promoted)} / {len(cut.promoted)}")
    print(f"per-layer promoted: {', '.join(per_layer.promoted) or '(none)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
