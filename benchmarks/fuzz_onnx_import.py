"""Random mutation campaign against the ONNX importer: broken models must end in a graph or in one of quantopt's
errors, never in an internal error or a hang.

    python benchmarks/fuzz_onnx_import.py [--mutations N] [--seed S] [--timeout SEC] [--quantize]

Each case takes one of the small ONNX models of tests/data/onnx_small (CNNs, a U-Net, transformers, LSTM/GRU) and
applies 1-3 random mutations: an attribute set to a hostile value (negative, zero, huge, NaN, an empty or overlong
list, a wrong type), a node's operator type swapped, a node input dropped, renamed to a tensor nobody makes or
swapped with another, a node output renamed or duplicated, a node deleted, an initializer given other dims, another
data type or cut data, a graph input given a zero, huge or symbolic dimension or another element type, the opset
changed, or the serialized bytes cut or flipped. The result is imported (`import_onnx`) and, when that succeeds, run
once on all-zero inputs, as `quantopt --cfg` does before any other work (with --quantize also calibrated, quantized
and run in integers). Every case must end in a value or in a
`QuantOptError`; anything else is an internal error, and a case past `--timeout` seconds a hang. The report and the
exit status are those of benchmarks/fuzz_readers.py (status 1 on any internal error or hang). The cases are
deterministic for a given --seed; tests/test_fuzz_onnx_import.py runs a short version in the test suite.
"""
from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "tests" / "data" / "onnx_small"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_readers import Campaign, _on_alarm, report, run_case  # noqa: E402

from quantopt.errors import as_out_of_memory  # noqa: E402

OPS = ["Relu", "Conv", "MatMul", "Gemm", "Gather", "Reshape", "Transpose", "Softmax", "Add", "Mul", "Concat", "Slice",
       "LayerNormalization", "Sigmoid", "Tanh", "Split", "Squeeze", "Unsqueeze", "ReduceMean", "Pow", "Sqrt", "Div",
       "Where", "Expand", "Cast", "Shape", "ConstantOfShape", "Range", "LSTM", "GRU", "Einsum", "TopK", "GatherND",
       "GroupNormalization", "LpNormalization", "MeanVarianceNormalization", "Mean", "ReduceLogSumExp", "ScatterND",
       "ScatterElements", "OneHot", "NoSuchOp", ""]
INTS = [-(2 ** 31), -7, -1, 0, 1, 2, 3, 5, 64, 2 ** 31, 10 ** 12]
FLOATS = [float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 1e-30, 1e38]


def _attr_value(rng: random.Random, attr: Any) -> None:
    """Give `attr` (an AttributeProto) a hostile value of its own kind, or of another kind."""
    from onnx import AttributeProto, helper, numpy_helper

    kind = rng.choice(["same", "same", "same", "other"])
    if kind == "other":
        new = rng.choice([helper.make_attribute(attr.name, rng.choice(INTS)),
                          helper.make_attribute(attr.name, rng.choice(FLOATS)),
                          helper.make_attribute(attr.name, b"bogus"),
                          helper.make_attribute(attr.name, [rng.choice(INTS) for _ in range(rng.randint(1, 4))])])
        attr.CopyFrom(new)
        return
    if attr.type == AttributeProto.INT:
        attr.i = rng.choice(INTS)
    elif attr.type == AttributeProto.FLOAT:
        attr.f = rng.choice(FLOATS)
    elif attr.type == AttributeProto.INTS:
        del attr.ints[:]
        attr.ints.extend(rng.choice([[], [0], [-1, -1], [rng.choice(INTS) for _ in range(rng.randint(1, 9))],
                                     list(attr.ints)[::-1] if len(attr.ints) else [1]]))
    elif attr.type == AttributeProto.FLOATS:
        del attr.floats[:]
        attr.floats.extend([rng.choice(FLOATS) for _ in range(rng.randint(0, 4))])
    elif attr.type == AttributeProto.STRING:
        attr.s = rng.choice([b"", b"bogus", b"NOTSET", b"\xff"])
    elif attr.type == AttributeProto.TENSOR:
        attr.t.CopyFrom(numpy_helper.from_array(np.array(rng.choice([[], [np.nan], [1, 2, 3], [[1.0]]]),
                                                         dtype=np.float32), attr.t.name))


def mutate(rng: random.Random, model: Any) -> str:
    """One random mutation of `model` (a ModelProto) in place; returns what it did."""
    from onnx import TensorProto

    g = model.graph
    nodes = list(g.node)
    kind = rng.choice(["attr", "attr", "op", "input", "output", "delete", "initializer", "graph_input", "opset"])
    if kind == "attr":
        with_attrs = [n for n in nodes if n.attribute]
        if with_attrs:
            n = rng.choice(with_attrs)
            a = rng.choice(list(n.attribute))
            _attr_value(rng, a)
            return f"attribute {a.name} of {n.op_type} '{n.name}'"
        kind = "op"
    if kind == "op" and nodes:
        n = rng.choice(nodes)
        old, n.op_type = n.op_type, rng.choice(OPS)
        return f"{old} '{n.name}' -> {n.op_type}"
    if kind == "input" and nodes:
        n = rng.choice(nodes)
        if not n.input:
            n.input.append("missing_tensor")
            return f"input added to '{n.name}'"
        i = rng.randrange(len(n.input))
        how = rng.choice(["drop", "missing", "swap", "empty", "self"])
        if how == "drop":
            del n.input[i]
        elif how == "missing":
            n.input[i] = "missing_tensor"
        elif how == "swap" and len(n.input) > 1:
            j = (i + 1) % len(n.input)
            n.input[i], n.input[j] = n.input[j], n.input[i]
        elif how == "empty":
            n.input[i] = ""
        elif n.output:
            n.input[i] = n.output[0]  # a cycle
        return f"input {i} of '{n.name}': {how}"
    if kind == "output" and nodes:
        n = rng.choice(nodes)
        if n.output:
            other = rng.choice(nodes)
            n.output[0] = other.output[0] if other.output and rng.random() < 0.5 else "renamed_output"
            return f"output of '{n.name}' -> {n.output[0]}"
    if kind == "delete" and nodes:
        i = rng.randrange(len(nodes))
        del g.node[i]
        return f"node {i} deleted"
    if kind == "initializer" and len(g.initializer):
        t = rng.choice(list(g.initializer))
        how = rng.choice(["dims", "dtype", "cut", "nan"])
        if how == "dims":
            dims = list(t.dims)
            del t.dims[:]
            t.dims.extend(rng.choice([dims[::-1], dims + [1], [0], [2 ** 31], dims[1:]]))
        elif how == "dtype":
            t.data_type = rng.choice([TensorProto.INT64, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BOOL,
                                      TensorProto.STRING, TensorProto.UINT8, 0])
        elif how == "cut" and t.raw_data:
            t.raw_data = t.raw_data[:len(t.raw_data) // 2]
        elif t.data_type == TensorProto.FLOAT and t.raw_data:
            raw = np.frombuffer(t.raw_data, dtype=np.float32).copy()
            raw[rng.randrange(raw.size)] = np.nan
            t.raw_data = raw.tobytes()
        return f"initializer '{t.name}': {how}"
    if kind == "graph_input" and len(g.input):
        inp = rng.choice(list(g.input))
        dims = inp.type.tensor_type.shape.dim
        how = rng.choice(["zero", "huge", "symbolic", "dtype", "rank"])
        if how == "dtype":
            inp.type.tensor_type.elem_type = rng.choice([TensorProto.STRING, TensorProto.BOOL, TensorProto.DOUBLE,
                                                         TensorProto.UINT8, 0])
        elif how == "rank" and len(dims):
            del dims[-1]
        elif len(dims):
            d = dims[rng.randrange(len(dims))]
            if how == "zero":
                d.dim_value = 0
            elif how == "huge":
                d.dim_value = 2 ** 40
            else:
                d.dim_param = "n"
        return f"graph input '{inp.name}': {how}"
    model.opset_import[0].version = rng.choice([1, 7, 11, 13, 17, 21, 99])
    return f"opset {model.opset_import[0].version}"


def mutated_bytes(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    """The model with 1-3 mutations, or (one case in eight) its serialized bytes cut or flipped."""
    import onnx

    if rng.random() < 0.125:
        raw = bytearray(data)
        if rng.random() < 0.5:
            return bytes(raw[:rng.randrange(len(raw))]), "bytes cut"
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw), "bytes flipped"
    model = onnx.load_from_string(data)
    what = [mutate(rng, model) for _ in range(rng.randint(1, 3))]
    return model.SerializeToString(), "; ".join(what)


def import_and_run(path: Path, quantize: bool = False) -> None:
    """What `quantopt --cfg` does with an ONNX graph before any other work: import it, run all-zero inputs; with
    `quantize`, then calibrate on two batches of seeded random inputs (token ids for integer inputs), quantize and
    run the integer forward."""
    import torch

    from quantopt.frontends.onnx import import_onnx
    from quantopt.pipeline import quantize_model, run_quantized
    from quantopt.registry import discover_plugins

    discover_plugins()  # the operators' forwards, as the CLI registers them
    try:
        graph = import_onnx(str(path))
        with torch.no_grad():
            graph.forward(graph.zero_inputs())
            if quantize:
                gen = torch.Generator().manual_seed(0)
                batches = [[torch.randn(z.shape, generator=gen).to(z.dtype) if z.is_floating_point() else
                            torch.randint(0, 8, z.shape, generator=gen).to(z.dtype) for z in graph.zero_inputs()]
                           for _ in range(2)]
                qgraph = quantize_model(graph, batches)
                run_quantized(qgraph, batches[0])
    except Exception as e:  # an allocation failure is the CLI's "out of memory" line (exit code 7), not a bug
        oom = as_out_of_memory(e)
        if oom is None:
            raise
        raise oom from None


def campaign(models: Sequence[Path], folder: Path, n: int, seed: int, timeout: float,
             action: Callable[[Path], None] = import_and_run) -> Campaign:
    """`n` mutated models through `action`; the cases depend only on `seed`."""
    rng = random.Random(seed)
    sources = [(m.stem, m.read_bytes()) for m in models]
    result = Campaign("onnx")
    start = time.perf_counter()
    for i in range(n):
        name, data = rng.choice(sources)
        blob, what = mutated_bytes(rng, data)
        path = folder / f"{name}_{i}.onnx"
        path.write_bytes(blob)
        run_case(result, lambda p=path: action(p), f"case {i} ({name}: {what})", timeout)
        path.unlink()
    result.seconds = time.perf_counter() - start
    return result


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mutations", type=int, default=500, help="cases (default 500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one case may take before it counts as a hang")
    p.add_argument("--quantize", action="store_true",
                   help="also calibrate, quantize and run the integer forward of every model that imports")
    args = p.parse_args(argv)
    signal.signal(signal.SIGALRM, _on_alarm)
    models = sorted(MODELS.glob("*.onnx"))
    with tempfile.TemporaryDirectory(prefix="quantopt-fuzz-onnx-") as tmp:
        result = campaign(models, Path(tmp), args.mutations, args.seed, args.timeout,
                          lambda path: import_and_run(path, args.quantize))
    print(report([result]))
    return 1 if result.internal or result.hangs else 0


if __name__ == "__main__":
    sys.exit(main())
