"""Conformance run: the ONNX node test cases shipped with the `onnx` wheel, imported and run through quantopt's
float forward, compared with their expected outputs. `python -m quantopt.frontends.onnx.conformance` prints the
pass/skip/fail counts per ONNX op type (docs/onnx.md quotes them; tests/test_onnx_import.py guards them).
"""
from __future__ import annotations

import os
import sys
import tempfile
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import numpy as np

RTOL = 1e-4
"""Max abs error allowed, relative to the expected output's range (at least 1)."""


def _case_model_path(model, tmp: str) -> str:
    import onnx
    path = os.path.join(tmp, "case.onnx")
    onnx.save(model, path)
    return path


def freeze_inputs(model, inputs: List[np.ndarray]) -> Tuple[object, List[np.ndarray]]:
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


def run_case(model, inputs: List[np.ndarray], outputs: List[np.ndarray]) -> Tuple[str, str]:
    """('pass' | 'skip' | 'fail', detail): skip = the importer rejects the case with a clear error. Inputs after
    the first are frozen into constants (`freeze_inputs`)."""
    model, inputs = freeze_inputs(model, inputs)
    import torch

    import quantopt.ops  # noqa: F401  (registers the forwards)
    from quantopt.errors import QuantOptError
    from quantopt.frontends.onnx import import_onnx
    with tempfile.TemporaryDirectory() as tmp:
        try:
            init = {i.name for i in model.graph.initializer}
            names = [i.name for i in model.graph.input if i.name not in init]
            shapes = {n: list(np.shape(x)) for n, x in zip(names, inputs) if np.ndim(x) and np.size(x)}
            graph = import_onnx(_case_model_path(model, tmp), shapes)
        except QuantOptError as e:
            return "skip", str(e).splitlines()[-1][:160]
        except Exception as e:  # an importer bug: count it as a failure
            return "fail", f"import crashed: {type(e).__name__}: {e}"[:200]
    if len(inputs) != len(graph.input_tensors):
        return "skip", "inputs that are constant-folded or optional are not fed"
    try:
        feeds = [torch.from_numpy(np.ascontiguousarray(x)) for x in inputs]
        got = graph.forward(feeds)
    except QuantOptError as e:
        return "fail", f"forward: {str(e)[:160]}"
    except Exception as e:
        return "fail", f"forward crashed: {type(e).__name__}: {str(e)[:160]}"
    if len(got) != len(outputs):
        return "fail", f"{len(got)} outputs, expected {len(outputs)}"
    for g, ref in zip(got, outputs):
        ref = np.asarray(ref)
        g = g.detach().cpu().numpy()
        if g.shape != ref.shape:
            if g.size == ref.size:
                g = g.reshape(ref.shape)
            else:
                return "fail", f"shape {list(g.shape)} != {list(ref.shape)}"
        if ref.dtype == bool or np.issubdtype(ref.dtype, np.integer):
            if not np.array_equal(g.astype(np.float64), ref.astype(np.float64)):
                return "fail", "integer/bool output differs"
            continue
        r = ref.astype(np.float64)
        gg = g.astype(np.float64)
        if not np.array_equal(np.isnan(r), np.isnan(gg)):
            return "fail", "NaN pattern differs"
        fin = np.isfinite(r)
        if not np.array_equal(r[~fin & ~np.isnan(r)], gg[~fin & ~np.isnan(r)]):
            return "fail", "inf values differ"
        if fin.any():
            span = max(float(r[fin].max() - r[fin].min()), 1.0)
            err = float(np.abs(gg[fin] - r[fin]).max()) / span
            if not err <= RTOL:
                return "fail", f"max error {err:.3g} of the output range"
    return "pass", ""


def node_cases(ops: Optional[set] = None):
    """(name, op type, model, inputs, outputs) of the in-memory node test cases of the installed onnx."""
    from onnx.backend.test.case.node import collect_testcases
    for case in collect_testcases(None):
        model = case.model
        op = model.graph.node[-1].op_type if model.graph.node else "?"
        types = {n.op_type for n in model.graph.node}
        if len(types) == 1:
            op = types.pop()
        if ops is not None and op not in ops:
            continue
        for inputs, outputs in case.data_sets or []:
            yield case.name, op, model, list(inputs), list(outputs)
            break


def run_all(ops: Optional[set] = None) -> Dict[str, Dict[str, int]]:
    counts: Dict[str, Dict[str, int]] = defaultdict(lambda: {"pass": 0, "skip": 0, "fail": 0})
    for _, op, model, inputs, outputs in node_cases(ops):
        status, _ = run_case(model, inputs, outputs)
        counts[op][status] += 1
    return dict(counts)


def main(argv: Optional[List[str]] = None) -> int:
    import logging
    logging.disable(logging.WARNING)
    argv = sys.argv[1:] if argv is None else argv
    verbose = "-v" in argv
    from .converters import CONVERTERS
    only = set(a for a in argv if not a.startswith("-")) or None
    counts: Dict[str, Dict[str, int]] = defaultdict(lambda: {"pass": 0, "skip": 0, "fail": 0})
    for name, op, model, inputs, outputs in node_cases(only):
        if only is None and op not in CONVERTERS:
            counts["(unsupported ops)"]["skip"] += 1
            continue
        status, detail = run_case(model, inputs, outputs)
        counts[op][status] += 1
        if verbose and status != "pass":
            print(f"{status:4s} {name}: {detail}")
    total = {"pass": 0, "skip": 0, "fail": 0}
    for op in sorted(counts):
        c = counts[op]
        print(f"| {op} | {c['pass']} | {c['skip']} | {c['fail']} |")
        for k in total:
            total[k] += c[k]
    print(f"| total | {total['pass']} | {total['skip']} | {total['fail']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
