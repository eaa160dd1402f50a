"""Conformance run: the ONNX backend test cases shipped with the `onnx` wheel, imported and run through quantopt's
float forward, compared with their expected outputs.

Three suites: `node` (the operator cases built in memory by `onnx.backend.test.case.node.collect_testcases`),
`pytorch-converted` and `pytorch-operator` (folders with `model.onnx` and `test_data_set_*/{input,output}_*.pb`
under `onnx/backend/test/data/`). Every case ends as pass, skip (the importer rejects it with a clear
`QuantOptError`) or fail (a crash, a forward error or a wrong result).

    python -m quantopt.frontends.onnx.conformance [-v] [--suite S] [OpType ...]     # per-op counts
    python -m quantopt.frontends.onnx.conformance --check                           # regressions vs the baseline,
                                                                                    # and layer types the importer
                                                                                    # made without a QDQ export
    python -m quantopt.frontends.onnx.conformance --write-baseline                  # record the current passes
    python -m quantopt.frontends.onnx.conformance --docs                            # the tables of docs/onnx.md

docs/onnx.md quotes the counts; tests/test_onnx_conformance.py checks the baseline.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

RTOL = 1e-4
"""Max abs error allowed, relative to the expected output's range (at least 1)."""
RTOL_FP16 = 1e-3
"""The same for float16/bfloat16 outputs: the expected values were computed and rounded in 16-bit arithmetic
(about 3 decimal digits), quantopt's float forward computes in float32."""
SUITES = ("node", "pytorch-converted", "pytorch-operator")
STATUSES = ("pass", "skip", "fail")
BASELINE = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "data",
                                        "onnx_conformance_baseline.json"))
"""Default baseline file (in the source checkout)."""


HEAVY_NODE_MODULES = ("averagepool", "lppool", "maxpool")
"""Node-case modules of onnx whose expected outputs take seconds to generate (pure-Python pooling references);
the quick slice of the test suite leaves them out (pytorch-converted covers 1-D/2-D pooling)."""


class Case(NamedTuple):
    """One test case: `op` is the ONNX op type it tests ("<Op> (expanded)" for a function-body expansion;
    the sorted op types joined by '+' for a multi-op model)."""
    suite: str
    name: str
    op: str
    model: Any
    inputs: List[Any]
    outputs: List[Any]


def _to_array(value: Any) -> Optional[np.ndarray]:
    """A test value as a numpy array (TensorProto or ndarray); None for sequences, optionals and maps."""
    from onnx import TensorProto, numpy_helper
    if isinstance(value, TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (np.generic, int, float, bool)):
        return np.asarray(value)
    return None


def _op_label(model: Any) -> str:
    types = sorted({n.op_type for n in model.graph.node if n.op_type != "Constant"})
    if not types:
        return "Constant" if model.graph.node else "?"
    return types[0] if len(types) == 1 else "+".join(types)


# ------------------------------------------------------------------------------------------------ case sources
def node_cases(ops: Optional[set] = None) -> Iterator[Tuple[str, str, Any, List[Any], List[Any]]]:
    """(name, op type, model, inputs, outputs) of the in-memory node test cases of the installed onnx (first
    data set of each)."""
    for case in iter_cases(("node",), ops):
        yield case.name, case.op, case.model, case.inputs, case.outputs


def _collect_node_cases(light: bool) -> List[Any]:
    """onnx's node test cases; `light`: without the modules in HEAVY_NODE_MODULES (when nothing imported them
    yet)."""
    import importlib
    import pkgutil
    import warnings

    import onnx.backend.test.case.node as pkg
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case generators overflow casts on purpose
        registry = getattr(pkg, "_NodeTestCases", None)
        if not light or registry is None:
            return list(pkg.collect_testcases(None))
        from onnx.backend.test.case.utils import import_recursive
        for _, name, is_pkg in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
            if name in HEAVY_NODE_MODULES or (is_pkg and name.startswith("ai_onnx_ml")):
                continue
            module = importlib.import_module(f"{pkg.__name__}.{name}")
            if is_pkg:
                import_recursive(module)
        return list(registry)


def _node_suite(light: bool = False) -> Iterator[Case]:
    cases = [c for c in _collect_node_cases(light) if c.data_sets]
    plain = {c.name: _op_label(c.model) for c in cases if "_expanded" not in c.name}
    for c in cases:
        if "_expanded" in c.name:
            base = plain.get(c.name[:c.name.index("_expanded")])
            op = f"{base} (expanded)" if base else _op_label(c.model)
        else:
            op = plain[c.name]
        inputs, outputs = c.data_sets[0]
        yield Case("node", c.name, op, c.model, list(inputs), list(outputs))


def data_dir(suite: str) -> str:
    """`onnx/backend/test/data/<suite>` of the installed onnx."""
    import onnx
    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", suite)


def _data_suite(suite: str) -> Iterator[Case]:
    """Cases stored as files: `<case>/model.onnx` and `<case>/test_data_set_0/{input,output}_<i>.pb`."""
    import onnx
    for case_dir in sorted(glob.glob(os.path.join(data_dir(suite), "*"))):
        data = os.path.join(case_dir, "test_data_set_0")
        model_path = os.path.join(case_dir, "model.onnx")
        if not (os.path.isfile(model_path) and os.path.isdir(data)):
            continue
        model = onnx.load(model_path)
        yield Case(suite, os.path.basename(case_dir), _op_label(model), model, _read_tensors(data, "input"),
                   _read_tensors(data, "output"))


def _read_tensors(folder: str, kind: str) -> List[Any]:
    """`<folder>/<kind>_<i>.pb` as TensorProtos, in index order."""
    import onnx
    files = glob.glob(os.path.join(folder, f"{kind}_*.pb"))
    files.sort(key=lambda p: int(os.path.basename(p)[len(kind) + 1:-3]))
    return [onnx.load_tensor(p) for p in files]


def iter_cases(suites: Sequence[str] = SUITES, ops: Optional[set] = None, light: bool = False) -> Iterator[Case]:
    """The cases of `suites` (optionally only those of op types `ops`), in a fixed order; `light`: node cases
    without HEAVY_NODE_MODULES."""
    for suite in suites:
        if suite not in SUITES:
            raise ValueError(f"unknown suite '{suite}' (expected one of {', '.join(SUITES)})")
        for case in (_node_suite(light) if suite == "node" else _data_suite(suite)):
            if ops is None or case.op in ops:
                yield case


# ------------------------------------------------------------------------------------------------ one case
def freeze_inputs(model: Any, inputs: List[np.ndarray]) -> Tuple[Any, List[np.ndarray]]:
    """The case with every graph input but the first turned into an initializer holding its test value: weights,
    axes, pads, scales ... are constants in real models, and the importer requires them to be."""
    from onnx import numpy_helper
    init = {i.name for i in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in init]
    if len(names) < 2 or len(names) != len(inputs):
        return model, inputs
    m = type(model)()
    m.CopyFrom(model)
    keep = [i for i in m.graph.input if i.name == names[0] or i.name in init]
    for name, value in zip(names[1:], inputs[1:]):
        if isinstance(value, np.ndarray) and value.dtype != object:
            m.graph.initializer.append(numpy_helper.from_array(value, name=name))
        else:
            return model, inputs
    del m.graph.input[:]
    m.graph.input.extend(keep)
    return m, inputs[:1]


def _message(e: Exception) -> str:
    text = getattr(e, "message", None) or str(e)
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(e).__name__)[:200]


def _compare(got: np.ndarray, ref: np.ndarray) -> str:
    """'' when `got` matches `ref`, else what differs."""
    if got.shape != ref.shape:
        if got.size != ref.size:
            return f"shape {list(got.shape)} != {list(ref.shape)}"
        got = got.reshape(ref.shape)
    if ref.dtype == bool or np.issubdtype(ref.dtype, np.integer):
        if not np.array_equal(got.astype(np.float64), ref.astype(np.float64)):
            return "integer/bool output differs"
        return ""
    r = ref.astype(np.float64)
    g = got.astype(np.float64)
    if not np.array_equal(np.isnan(r), np.isnan(g)):
        return "NaN pattern differs"
    inf = np.isinf(r)
    if not np.array_equal(r[inf], g[inf]):
        return "inf values differ"
    fin = np.isfinite(r)
    if fin.any():
        tol = RTOL_FP16 if ref.dtype == np.float16 or ref.dtype.name == "bfloat16" else RTOL
        span = max(float(r[fin].max() - r[fin].min()), 1.0)
        err = float(np.abs(g[fin] - r[fin]).max()) / span
        if not err <= tol:
            return f"max error {err:.3g} of the output range"
    return ""


def run_case(model: Any, inputs: List[Any], outputs: List[Any], tmp: Optional[str] = None,
             layer_types: Optional[set] = None) -> Tuple[str, str]:
    """('pass' | 'skip' | 'fail', detail): skip = the importer rejects the case with a clear error. Models older
    than opset 11 are upgraded first (`upgrade_opset`); inputs after the first are frozen into constants
    (`freeze_inputs`). The model is written to `tmp` (a folder; a fresh temporary one when None). `layer_types`,
    when given, receives the layer types of the imported graph."""
    if tmp is None:
        with tempfile.TemporaryDirectory() as folder:
            return run_case(model, inputs, outputs, folder, layer_types)
    import torch

    import quantopt.ops  # noqa: F401  (registers the forwards)
    from quantopt.errors import QuantOptError
    from quantopt.frontends.onnx import import_onnx
    from quantopt.frontends.onnx.loader import upgrade_opset
    feeds_np = [_to_array(x) for x in inputs]
    refs = [_to_array(x) for x in outputs]
    if any(x is None for x in feeds_np + refs):
        return "skip", "sequence / optional / map values are not supported"
    if any(x.dtype == object for x in feeds_np + refs):
        return "skip", "string tensors are not supported"
    model, why = upgrade_opset(model)
    if why:
        return "skip", why
    model, feeds_np = freeze_inputs(model, feeds_np)
    if any(x.size == 0 for x in feeds_np):
        return "skip", "empty (zero-size) inputs are not supported (input shapes must be positive)"
    try:
        import onnx
        init = {i.name for i in model.graph.initializer}
        names = [i.name for i in model.graph.input if i.name not in init]
        shapes = {n: list(np.shape(x)) for n, x in zip(names, feeds_np) if np.ndim(x)}
        path = os.path.join(tmp, "case.onnx")
        onnx.save(model, path)
        graph = import_onnx(path, shapes)
        if layer_types is not None:
            layer_types.update(str(n.type) for n in graph.nodes)
    except QuantOptError as e:
        return "skip", _message(e)
    except Exception as e:  # an importer bug: count it as a failure
        return "fail", f"import crashed: {type(e).__name__}: {e}"[:200]
    if len(feeds_np) != len(graph.input_tensors):
        return "skip", "inputs that are constant-folded or optional are not fed"
    try:
        # np.require keeps a 0-d array 0-d (np.ascontiguousarray makes it 1-d)
        got = graph.forward([torch.from_numpy(np.require(x, requirements="C")) for x in feeds_np])
    except QuantOptError as e:
        return "fail", f"forward: {_message(e)}"
    except Exception as e:
        return "fail", f"forward crashed: {type(e).__name__}: {str(e)[:160]}"
    if len(got) != len(refs):
        return "fail", f"{len(got)} outputs, expected {len(refs)}"
    for g, ref, t in zip(got, refs, graph.output_tensors):
        if t.ir_shape is not None and tuple(g.shape) != tuple(t.ir_shape):  # the forward must give the IR's shape
            return "fail", f"forward gives shape {list(g.shape)} for output '{t.name}' of IR shape {list(t.ir_shape)}"
        why = _compare(g.detach().cpu().numpy(), np.asarray(ref))
        if why:
            return "fail", why
    return "pass", ""


# ------------------------------------------------------------------------------------------------ runs
class Result(NamedTuple):
    suite: str
    name: str
    op: str
    status: str
    detail: str
    layer_types: Tuple[str, ...] = ()
    """the layer types of the imported graph (none when the import failed)"""


def run_all(suites: Sequence[str] = SUITES, ops: Optional[set] = None,
            select: Optional[Mapping[str, Optional[set]]] = None, light: bool = False) -> List[Result]:
    """Run the cases of `suites`: only op types `ops`; with `select`, only the case names `select[suite]` (all of
    a suite whose entry is None); `light`: see `iter_cases`."""
    import logging
    import warnings
    results = []
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # unsupported-opset warnings and the like: the status says it
    try:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for case in iter_cases(suites, ops, light):
                if select is not None:
                    names = select.get(case.suite, set())
                    if names is not None and case.name not in names:
                        continue
                made: set = set()
                status, detail = run_case(case.model, case.inputs, case.outputs, tmp, made)
                results.append(Result(case.suite, case.name, case.op, status, detail, tuple(sorted(made))))
    finally:
        logging.disable(previous)
    return results


def unexported_types(results: Sequence[Result]) -> Dict[str, List[str]]:
    """Layer types the importer made in `results` that have no ONNX QDQ export mapping, each with up to three of
    the cases that made it: a quantized import of such a model could not be exported (docs/onnx-export.md)."""
    import quantopt.ops  # noqa: F401  (registers the mappings)
    from quantopt.registry import export_function
    out: Dict[str, List[str]] = {}
    for r in results:
        for t in r.layer_types:
            if export_function(t) is None:
                names = out.setdefault(t, [])
                if len(names) < 3:
                    names.append(f"{r.suite}/{r.name}")
    return dict(sorted(out.items()))


def counts(results: Sequence[Result]) -> Dict[str, Dict[str, Dict[str, int]]]:
    """{suite: {op: {'pass': n, 'skip': n, 'fail': n}}}."""
    out: Dict[str, Dict[str, Dict[str, int]]] = {}
    for r in results:
        c = out.setdefault(r.suite, {}).setdefault(r.op, {s: 0 for s in STATUSES})
        c[r.status] += 1
    return {s: dict(sorted(v.items())) for s, v in out.items()}


def totals(per_op: Mapping[str, Mapping[str, int]]) -> Dict[str, int]:
    t = {s: 0 for s in STATUSES}
    for c in per_op.values():
        for s in STATUSES:
            t[s] += c[s]
    return t


def table(per_op: Mapping[str, Mapping[str, int]], title: str = "ONNX op") -> str:
    """Markdown table of the per-op counts with a total row."""
    rows = [f"| {title} | pass | skip | fail |", "|---|---|---|---|"]
    for op, c in per_op.items():
        rows.append(f"| {op} | {c['pass']} | {c['skip']} | {c['fail']} |")
    t = totals(per_op)
    rows.append(f"| total | {t['pass']} | {t['skip']} | {t['fail']} |")
    return "\n".join(rows)


def docs_tables(results: Sequence[Result]) -> str:
    """The tables docs/onnx.md quotes: suite totals, then per suite one row per op type with a converter and one
    row each for function-body expansions and for op types without a converter."""
    from . import supported_onnx_ops
    supported = set(supported_onnx_ops())
    per_suite = counts(results)
    out = ["| suite | pass | skip | fail |", "|---|---|---|---|"]
    for suite in SUITES:
        t = totals(per_suite.get(suite, {}))
        out.append(f"| {suite} | {t['pass']} | {t['skip']} | {t['fail']} |")
    for suite in SUITES:
        rows: Dict[str, Dict[str, int]] = {}
        groups = {"expanded": ({}, "function bodies (`*_expanded`, {n} op types)"),
                  "other": ({}, "op types without a converter ({n})")}
        for op, c in per_suite.get(suite, {}).items():
            parts = set(op.split("+"))
            if op.endswith(" (expanded)"):
                groups["expanded"][0][op] = c
            elif parts <= supported | {"Constant"}:
                rows[op] = c
            else:
                groups["other"][0][op] = c
        for members, label in groups.values():
            if members:
                rows[label.format(n=len(members))] = totals(members)
        out += ["", f"`{suite}`:", "", table(rows)]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ baseline
def make_baseline(results: Sequence[Result]) -> Dict[str, Any]:
    """The JSON baseline: onnx version, per-suite per-op counts and the passing case names per op."""
    import onnx
    passed: Dict[str, Dict[str, List[str]]] = {}
    for r in results:
        if r.status == "pass":
            passed.setdefault(r.suite, {}).setdefault(r.op, []).append(r.name)
    c = counts(results)
    return {"onnx_version": onnx.__version__, "rtol": RTOL, "rtol_fp16": RTOL_FP16,
            "totals": {s: totals(c[s]) for s in SUITES if s in c},
            "counts": {s: c[s] for s in SUITES if s in c},
            "passed": {s: {op: sorted(names) for op, names in sorted(passed[s].items())} for s in SUITES
                       if s in passed}}


def load_baseline(path: str = BASELINE) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _dump(obj: Any, depth: int = 0) -> str:
    """JSON with one case name per line and each {pass, skip, fail} on one line: short, reviewable diffs."""
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(obj, dict) and obj and any(isinstance(v, (dict, list)) for v in obj.values()):
        items = [f"{inner}{json.dumps(k)}: {_dump(v, depth + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and obj:
        return "[\n" + ",\n".join(inner + json.dumps(v) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj)


def write_baseline(results: Sequence[Result], path: str = BASELINE) -> None:
    """Write the baseline atomically."""
    text = _dump(make_baseline(results)) + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def expected_passes(baseline: Mapping[str, Any], suites: Optional[Sequence[str]] = None,
                    ops: Optional[set] = None) -> Dict[str, set]:
    """{suite: case names that passed in the baseline} (only of `suites` / op types `ops` when given)."""
    out: Dict[str, set] = {}
    for suite, per_op in baseline.get("passed", {}).items():
        if suites is not None and suite not in suites:
            continue
        out[suite] = {n for op, names in per_op.items() if ops is None or op in ops for n in names}
    return out


def regressions(results: Sequence[Result], baseline: Mapping[str, Any],
                expected: Optional[Mapping[str, set]] = None) -> List[str]:
    """Cases that passed in the baseline and now fail, skip or were not run at all. `expected`: the baseline passes
    this run covers ({suite: names}); default all of them."""
    now = {(r.suite, r.name): r for r in results}
    passed = expected_passes(baseline)
    if expected is not None:
        passed = {s: set(names) & passed.get(s, set()) for s, names in expected.items()}
    out = []
    for suite, names in sorted(passed.items()):
        for name in sorted(names):
            r = now.get((suite, name))
            if r is None:
                out.append(f"{suite}/{name}: passed in the baseline, not run now (case missing)")
            elif r.status != "pass":
                out.append(f"{suite}/{name} ({r.op}): passed in the baseline, now {r.status}: {r.detail}")
    return out


def quick_selection(baseline: Mapping[str, Any], per_op: int = 3, share: int = 8) -> Dict[str, Optional[set]]:
    """A deterministic, representative slice for the quick test: every pytorch case, and per node op type
    max(per_op, passes // share) of its baseline passes spread evenly over the sorted names (node cases from
    HEAVY_NODE_MODULES left out)."""
    available = {c.name for c in iter_cases(("node",), light=True)}
    chosen: set = set()
    for names in baseline.get("passed", {}).get("node", {}).values():
        names = sorted(n for n in names if n in available)
        k = min(len(names), max(per_op, len(names) // share))
        if k:
            step = len(names) / k
            chosen.update(names[int(i * step)] for i in range(k))
    return {"node": chosen, "pytorch-converted": None, "pytorch-operator": None}


# ------------------------------------------------------------------------------------------------ CLI
def _parse(argv: List[str]) -> Dict[str, Any]:
    opts: Dict[str, Any] = {"verbose": False, "suites": [], "ops": [], "write": None, "check": None, "docs": False}
    it = iter(argv)
    for a in it:
        if a in ("-v", "--verbose"):
            opts["verbose"] = True
        elif a == "--docs":
            opts["docs"] = True
        elif a == "--suite":
            opts["suites"].append(next(it, ""))
        elif a.startswith("--suite="):
            opts["suites"].append(a.split("=", 1)[1])
        elif a in ("--write-baseline", "--check"):
            opts["write" if a == "--write-baseline" else "check"] = BASELINE
        elif a.startswith("--write-baseline=") or a.startswith("--check="):
            key, value = a[2:].split("=", 1)
            opts["write" if key == "write-baseline" else "check"] = value
        elif a in ("-h", "--help"):
            opts["help"] = True
        elif a.startswith("-"):
            raise SystemExit(f"unknown option {a} (see --help)")
        else:
            opts["ops"].append(a)
    for s in opts["suites"]:
        if s not in SUITES:
            raise SystemExit(f"unknown suite '{s}' (expected one of {', '.join(SUITES)})")
    return opts


def main(argv: Optional[List[str]] = None) -> int:
    """Print the per-suite, per-op tables; --check exits 1 on a regression against the baseline."""
    opts = _parse(sys.argv[1:] if argv is None else list(argv))
    if opts.get("help"):
        print(__doc__)
        return 0
    suites = opts["suites"] or list(SUITES)
    ops = set(opts["ops"]) or None
    if opts["write"] == BASELINE and (ops or opts["suites"]):
        raise SystemExit("--write-baseline records the full run: give no op types and no --suite (or name "
                         "another file: --write-baseline=PATH)")
    results = run_all(suites, ops)
    if opts["verbose"]:
        for r in results:
            if r.status != "pass":
                print(f"{r.status:4s} {r.suite}/{r.name} ({r.op}): {r.detail}")
    per_suite = counts(results)
    if opts["docs"]:
        print(docs_tables(results))
    else:
        for suite in suites:
            print(f"\n### {suite}\n")
            print(table(per_suite.get(suite, {})))
        print("\n| suite | pass | skip | fail |\n|---|---|---|---|")
        for suite in suites:
            t = totals(per_suite.get(suite, {}))
            print(f"| {suite} | {t['pass']} | {t['skip']} | {t['fail']} |")
    rc = 0
    if opts["check"]:
        base = load_baseline(opts["check"])
        bad = regressions(results, base, expected_passes(base, suites, ops))
        for line in bad:
            print(f"REGRESSION {line}")
        print(f"\n{len(bad)} regression(s) against {opts['check']} (onnx {base.get('onnx_version')})")
        missing = unexported_types(results)
        for kind, names in missing.items():
            print(f"NO QDQ EXPORT for layer type {kind} (made by {', '.join(names)})")
        print(f"{len(missing)} layer type(s) made by the importer without an ONNX QDQ export mapping")
        rc = 1 if bad or missing else 0
    if opts["write"]:
        write_baseline(results, opts["write"])
        print(f"\nbaseline written to {opts['write']}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
