"""`quantopt run`: float and quantized IRs run on .npy/.npz inputs give exactly what PyGraph.forward and
run_quantized give (bit-identical integers); inputs are checked before running; OUTDIR is written atomically."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch

import quantopt.runner as runner
from quantopt.analysis.similarity import to_quantized
from quantopt.cli import main
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digits"
FLOAT_IR = EXAMPLE / "model" / "digits.txt"


def val(n: int = 20) -> np.ndarray:
    return np.load(EXAMPLE / "data" / "val.npy", allow_pickle=False)[:n]


@pytest.fixture(scope="module")
def digits_q(tmp_path_factory) -> Path:
    """The digits example quantized with the default settings and written as a quantized IR."""
    graph = read_ir(str(FLOAT_IR))
    calib = torch.from_numpy(np.load(EXAMPLE / "data" / "calib.npy", allow_pickle=False))
    qgraph = quantize_model(graph, [calib[i:i + 16] for i in range(0, len(calib), 16)])
    txt, _ = write_ir(qgraph, str(tmp_path_factory.mktemp("digits_q") / "digits_o.txt"))
    return Path(txt)


def two_input_model(quantized: bool, folder: Path) -> Path:
    """Inputs a, b [1,4]; outputs 'o:1' = a + b and 'o/1' = relu(a), whose safe names are alike."""
    g = GraphBuilder("two")
    a = g.input("a", [1, 4])
    b = g.input("b", [1, 4])
    s = g.layer("Eltwise", [a, b], [[1, 4]], name="add", outputs=["o:1"],
                params=dict(method="ADD", with_activation="NONE"))
    r = g.layer("Activation", [a], [[1, 4]], name="relu", outputs=["o/1"], params=dict(method="RELU"))
    graph = g.build([s, r])
    if quantized:
        rng = np.random.default_rng(3)
        calib = [[torch.from_numpy(rng.normal(0, 1, (4, 4)).astype(np.float32)) for _ in range(2)]
                 for _ in range(3)]
        graph = quantize_model(graph, calib)
    txt, _ = write_ir(graph, str(folder / ("two_q.txt" if quantized else "two.txt")))
    return Path(txt)


def run(*args: object) -> int:
    return main(["run", *[str(a) for a in args]])


def index_of(out: Path) -> dict:
    return json.loads((out / "outputs.json").read_text(encoding="utf-8"))


def q_inputs(txt: Path, x: np.ndarray) -> np.ndarray:
    """Float data quantized with the IR input's params, in the input's integer dtype (what the backend gets)."""
    t = read_ir(str(txt)).input_tensors[0]
    return to_quantized(torch.from_numpy(x), t).numpy().astype(t.dtype.storage)


# ------------------------------------------------------------------------------------------------- float IR
def test_float_ir_outputs_equal_forward(tmp_path: Path, capsys) -> None:
    x = val()
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert run(FLOAT_IR, "-i", tmp_path / "x.npy", "-o", out) == 0
    expected = read_ir(str(FLOAT_IR)).forward([torch.from_numpy(x)])[0].numpy()
    index = index_of(out)
    entry = index["outputs"]["/Softmax_0"]
    got = np.load(out / entry["file"], allow_pickle=False)
    assert got.dtype == np.float32 and np.array_equal(got, expected)
    assert entry["shape"] == [20, 10] and entry["scale"] is None and entry["quantized"] is False
    assert index["quantized"] is False and index["samples"] == 20
    assert index["inputs"]["input_0"]["shape"] == [20, 1, 8, 8]
    assert sorted(p.name for p in out.iterdir()) == sorted(["outputs.json", entry["file"]])
    summary = capsys.readouterr().out
    assert "/Softmax_0: [20,10] float32 min" in summary and "max" in summary


# --------------------------------------------------------------------------------------------- quantized IR
def test_quantized_ir_integer_inputs_bit_identical(digits_q: Path, tmp_path: Path) -> None:
    x = val()
    qx = q_inputs(digits_q, x)
    assert qx.dtype == np.uint8
    np.save(tmp_path / "q.npy", qx)
    out = tmp_path / "out"
    assert run(digits_q, "-i", tmp_path / "q.npy", "-o", out, "--dequantize") == 0
    ref = read_ir(str(digits_q))
    deq = run_quantized(ref, [torch.from_numpy(x)])[0].numpy()
    ints = ref.output_tensors[0].betensor.numpy()
    entry = index_of(out)["outputs"]["/Softmax_0"]
    got = np.load(out / entry["file"], allow_pickle=False)
    assert got.dtype == np.dtype(entry["dtype"]) == np.uint8
    assert np.array_equal(got.astype(np.int64), ints)
    got_deq = np.load(out / entry["dequant_file"], allow_pickle=False)
    assert got_deq.dtype == np.float32 and np.array_equal(got_deq, deq)
    t = ref.quant.get(ref.output_tensors[0])
    assert entry["scale"] == pytest.approx(float(t.scale)) and entry["zp"] == int(t.zerop)
    assert entry["range"] == [t.qmin, t.qmax] and entry["quantized"] is True
    assert entry["min"] == int(ints.min()) and entry["max"] == int(ints.max())


def test_quantize_inputs_equals_run_quantized(digits_q: Path, tmp_path: Path) -> None:
    x = val()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "q.npy", q_inputs(digits_q, x))
    assert run(digits_q, "-i", tmp_path / "x.npy", "-o", tmp_path / "a", "--quantize-inputs", "--dequantize") == 0
    assert run(digits_q, "-i", tmp_path / "q.npy", "-o", tmp_path / "b") == 0
    ref = read_ir(str(digits_q))
    deq = run_quantized(ref, [torch.from_numpy(x)])[0].numpy()
    a = np.load(tmp_path / "a" / "_Softmax_0.npy")
    assert np.array_equal(a, np.load(tmp_path / "b" / "_Softmax_0.npy"))
    assert np.array_equal(a.astype(np.int64), ref.output_tensors[0].betensor.numpy())
    assert np.array_equal(np.load(tmp_path / "a" / "_Softmax_0.dequant.npy"), deq)
    assert index_of(tmp_path / "a")["inputs"]["input_0"]["quantized_by_run"] is True


def test_batch_size_gives_the_same_files(digits_q: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", val(20))
    common = [digits_q, "-i", tmp_path / "x.npy", "--quantize-inputs", "--dequantize", "--dump-all"]
    assert run(*common, "-o", tmp_path / "whole") == 0
    assert run(*common, "-o", tmp_path / "parts", "--batch-size", "7") == 0
    whole, parts = index_of(tmp_path / "whole"), index_of(tmp_path / "parts")
    assert (whole["batches"], parts["batches"]) == (1, 3)
    files = sorted(str(p.relative_to(tmp_path / "whole")) for p in (tmp_path / "whole").rglob("*.npy"))
    assert files == sorted(str(p.relative_to(tmp_path / "parts")) for p in (tmp_path / "parts").rglob("*.npy"))
    for f in files:
        a, b = np.load(tmp_path / "whole" / f), np.load(tmp_path / "parts" / f)
        assert a.dtype == b.dtype and np.array_equal(a, b), f
    assert whole["outputs"] == parts["outputs"] and whole["layers"] == parts["layers"]


def test_dump_all_saves_every_layer(digits_q: Path, tmp_path: Path) -> None:
    x = val(5)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert run(digits_q, "-i", tmp_path / "x.npy", "-o", out, "--quantize-inputs", "--dump-all") == 0
    ref = read_ir(str(digits_q))
    ref.forward([torch.from_numpy(x)], keep_tensors=True)
    layers = index_of(out)["layers"]
    tensors = [t for n in ref.nodes for t in n.outputs]
    assert list(layers) == [t.name for t in tensors]
    for t in tensors:
        e = layers[t.name]
        assert e["file"].startswith("layers/") and "dequant_file" not in e
        got = np.load(out / e["file"], allow_pickle=False)
        assert np.array_equal(got.astype(np.int64), t.betensor.numpy()), t.name
    assert len(list((out / "layers").iterdir())) == len(tensors)


# --------------------------------------------------------------------------------------- multi-input, names
@pytest.mark.parametrize("quantized", [False, True])
def test_npz_by_name_and_positional_and_unique_names(quantized: bool, tmp_path: Path) -> None:
    txt = two_input_model(quantized, tmp_path)
    rng = np.random.default_rng(5)
    a, b = rng.normal(0, 1, (3, 4)).astype(np.float32), rng.normal(0, 1, (3, 4)).astype(np.float32)
    np.savez(tmp_path / "named.npz", b=b, a=a)
    np.savez(tmp_path / "pos.npz", a, b)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    extra = ["--quantize-inputs", "--dequantize"] if quantized else []
    for name, files in (("named", ["named.npz"]), ("pos", ["pos.npz"]), ("npy", ["a.npy", "b.npy"])):
        args: List[object] = [txt, "-o", tmp_path / name, *extra]
        for f in files:
            args += ["-i", tmp_path / f]
        assert run(*args) == 0
    ref = read_ir(str(txt))
    outs = run_quantized(ref, [torch.from_numpy(a), torch.from_numpy(b)])
    index = index_of(tmp_path / "named")
    assert [e["file"] for e in index["outputs"].values()] == ["o_1.npy", "o_1_2.npy"]
    for name in ("named", "pos", "npy"):
        for t, want in zip(ref.output_tensors, outs):
            e = index_of(tmp_path / name)["outputs"][t.name]
            got = np.load(tmp_path / name / e["file"])
            if quantized:
                assert np.array_equal(got.astype(np.int64), t.betensor.numpy())
                assert np.array_equal(np.load(tmp_path / name / e["dequant_file"]), want.numpy())
            else:
                assert np.array_equal(got, want.numpy())


def test_npz_named_after_the_input_layers(tmp_path: Path) -> None:
    """An imported ONNX model's input `x` is the Input layer `x` with the tensor `x_0`: an .npz named after the
    layers is read as named after the tensors."""
    x = val(3)
    np.savez(tmp_path / "by_layer.npz", input=x)
    np.savez(tmp_path / "by_tensor.npz", input_0=x)
    for name in ("by_layer", "by_tensor"):
        assert run(FLOAT_IR, "-i", tmp_path / f"{name}.npz", "-o", tmp_path / name) == 0
    for e in index_of(tmp_path / "by_tensor")["outputs"].values():
        assert np.array_equal(np.load(tmp_path / "by_layer" / e["file"]), np.load(tmp_path / "by_tensor" / e["file"]))


# ----------------------------------------------------------------------------------------------- errors
def _bad_inputs(case: str, tmp: Path, digits_q: Path) -> List[object]:
    x = val(4)
    q = q_inputs(digits_q, x)
    if case == "shape":
        np.save(tmp / "x.npy", x.reshape(4, 1, 4, 16))
        return [FLOAT_IR, "-i", tmp / "x.npy"]
    if case == "count":
        np.save(tmp / "x.npy", x)
        return [FLOAT_IR, "-i", tmp / "x.npy", "-i", tmp / "x.npy"]
    if case == "nan":
        x[2, 0, 3, 3] = np.nan
        np.save(tmp / "x.npy", x)
        return [FLOAT_IR, "-i", tmp / "x.npy"]
    if case == "inf_quantize":
        x[0, 0, 0, 0] = np.inf
        np.save(tmp / "x.npy", x)
        return [digits_q, "-i", tmp / "x.npy", "--quantize-inputs"]
    if case == "missing":
        return [FLOAT_IR, "-i", tmp / "nope.npy"]
    if case == "float_to_quantized":
        np.save(tmp / "x.npy", x)
        return [digits_q, "-i", tmp / "x.npy"]
    if case == "out_of_range":
        np.save(tmp / "q.npy", q.astype(np.int32) + 1)  # 256 somewhere: outside uint8 [0, 255]
        return [digits_q, "-i", tmp / "q.npy"]
    if case == "negative":
        np.save(tmp / "q.npy", q.astype(np.int16) - 300)
        return [digits_q, "-i", tmp / "q.npy"]
    if case == "ints_with_quantize_inputs":
        np.save(tmp / "q.npy", q)
        return [digits_q, "-i", tmp / "q.npy", "--quantize-inputs"]
    if case == "ints_to_float_ir":
        np.save(tmp / "q.npy", q)
        return [FLOAT_IR, "-i", tmp / "q.npy"]
    if case == "pickle":
        np.save(tmp / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
        return [FLOAT_IR, "-i", tmp / "o.npy"]
    if case == "not_numpy":
        (tmp / "x.npy").write_text("hello")
        return [FLOAT_IR, "-i", tmp / "x.npy"]
    if case == "npz_names":
        np.savez(tmp / "x.npz", image=x)
        return [FLOAT_IR, "-i", tmp / "x.npz"]
    if case == "batch_disagree":
        txt = two_input_model(False, tmp)
        np.save(tmp / "a.npy", np.zeros((3, 4), np.float32))
        np.save(tmp / "b.npy", np.zeros((2, 4), np.float32))
        return [txt, "-i", tmp / "a.npy", "-i", tmp / "b.npy"]
    raise AssertionError(case)


ERRORS = {"shape": "shape [4,1,4,16] but the IR expects [1,1,8,8]", "count": "1 input(s) ['input_0'] but 2",
          "nan": "1 NaN and 0 infinite", "inf_quantize": "0 NaN and 1 infinite", "missing": "does not exist",
          "float_to_quantized": "--quantize-inputs", "out_of_range": "outside the quantized input's range [0, 255]",
          "negative": "values in [-300,", "ints_with_quantize_inputs": "integers; give floats",
          "ints_to_float_ir": "float32 in the IR but the file holds uint8", "pickle": "without pickle",
          "not_numpy": "cannot read", "npz_names": "['image'] but the IR inputs are ['input_0 (layer input)']",
          "batch_disagree": "disagree on the batch size"}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_inputs_fail_with_one_line_and_no_output(case: str, digits_q: Path, tmp_path: Path, capsys) -> None:
    args = _bad_inputs(case, tmp_path, digits_q)
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    rc = run(*args, "-o", tmp_path / "new" / "out")
    err = capsys.readouterr().err.strip()
    assert rc == 4, err
    assert len(err.splitlines()) == 1 and err.startswith("[ERROR] data error: "), err
    assert ERRORS[case] in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no OUTDIR, no parent, no temp folder


def test_failure_while_running_leaves_nothing(digits_q: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    np.save(tmp_path / "x.npy", val(6))
    calls = []
    real = runner._values

    def failing(t):
        calls.append(t.name)
        if len(calls) == 5:
            raise RuntimeError("disk on fire")
        return real(t)

    monkeypatch.setattr(runner, "_values", failing)
    rc = run(digits_q, "-i", tmp_path / "x.npy", "-o", tmp_path / "deep" / "out", "--quantize-inputs", "--dump-all")
    assert rc == 1 and "internal error: RuntimeError: disk on fire" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]


def test_out_dir_rules(tmp_path: Path, capsys) -> None:
    np.save(tmp_path / "x.npy", val(2))
    np.save(tmp_path / "y.npy", val(3))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    assert run(FLOAT_IR, "-i", tmp_path / "x.npy", "-o", foreign) == 2
    assert "not empty" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["keep.txt"]
    out = tmp_path / "out"
    out.mkdir()  # an empty folder is fine
    assert run(FLOAT_IR, "-i", tmp_path / "x.npy", "-o", out, "--dump-all") == 0
    assert (out / "layers").is_dir()
    # a later run replaces an earlier run's folder entirely (no stale layer files)...
    assert run(FLOAT_IR, "-i", tmp_path / "y.npy", "-o", out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["_Softmax_0.npy", "outputs.json"]
    assert np.load(out / "_Softmax_0.npy").shape == (3, 10)
    # ...but a failing run leaves it as it was
    assert run(FLOAT_IR, "-i", tmp_path / "nope.npy", "-o", out) == 4
    assert np.load(out / "_Softmax_0.npy").shape == (3, 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "out", "x.npy", "y.npy"]


def test_integer_dtypes_of_ir_inputs_are_kept(tmp_path: Path) -> None:
    """A float IR with an int32 input takes integer data in the int32 range and rejects floats."""
    g = GraphBuilder("ints")
    x = g.input("ids", [1, 3], dtype=Dtype.INT32)
    y = g.layer("Activation", [x], [[1, 3]], name="relu", outputs=["y"], params=dict(method="RELU"),
                output_dtypes=[Dtype.INT32])
    txt, _ = write_ir(g.build([y]), str(tmp_path / "ints.txt"))
    np.save(tmp_path / "ok.npy", np.array([[-5, 7, 2 ** 31 - 1]], dtype=np.int64))
    np.save(tmp_path / "big.npy", np.array([[0, 0, 2 ** 31]], dtype=np.int64))
    np.save(tmp_path / "f.npy", np.zeros((1, 3), np.float32))
    assert run(txt, "-i", tmp_path / "ok.npy", "-o", tmp_path / "o") == 0
    got = np.load(tmp_path / "o" / "y.npy")
    assert got.dtype == np.int32 and got.tolist() == [[0, 7, 2 ** 31 - 1]]
    assert run(txt, "-i", tmp_path / "big.npy", "-o", tmp_path / "o2") == 4
    assert run(txt, "-i", tmp_path / "f.npy", "-o", tmp_path / "o3") == 4
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_bad_batch_size_is_an_error(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", val(2))
    assert run(FLOAT_IR, "-i", tmp_path / "x.npy", "-o", tmp_path / "o", "--batch-size", "0") == 2
    assert not (tmp_path / "o").exists()


def test_batch_size_keeps_outputs_whose_dim0_is_not_the_batch(tmp_path: Path) -> None:
    """A Transpose [1,4] -> [4,1] moves the IR batch out of dim 0: a run at another batch is the dim-0
    concatenation of the per-sample results (quantopt.graph.batch), the same whatever --batch-size."""
    g = GraphBuilder("tr")
    x = g.input("x", [1, 4])
    y = g.layer("Transpose", [x], [[4, 1]], name="t", outputs=["y"], params=dict(perm=[1, 0]))
    txt, _ = write_ir(g.build([y]), str(tmp_path / "tr.txt"))
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "x.npy", data)
    assert run(txt, "-i", tmp_path / "x.npy", "-o", tmp_path / "whole") == 0
    assert np.array_equal(np.load(tmp_path / "whole" / "y.npy"), data.reshape(12, 1))
    assert run(txt, "-i", tmp_path / "x.npy", "-o", tmp_path / "parts", "--batch-size", "2") == 0
    assert np.array_equal(np.load(tmp_path / "parts" / "y.npy"), data.reshape(12, 1))


def test_batch_size_refuses_outputs_without_batch_dim(tmp_path: Path, capsys) -> None:
    g = GraphBuilder("sh")
    x = g.input("x", [1, 4])
    y = g.layer("Shape", [x], [[2]], name="s", outputs=["y"], output_dtypes=[Dtype.INT32])
    txt, _ = write_ir(g.build([y]), str(tmp_path / "sh.txt"))
    np.save(tmp_path / "x.npy", np.arange(12, dtype=np.float32).reshape(3, 4))
    assert run(txt, "-i", tmp_path / "x.npy", "-o", tmp_path / "whole") == 0
    assert np.load(tmp_path / "whole" / "y.npy").tolist() == [3, 4]
    capsys.readouterr()
    assert run(txt, "-i", tmp_path / "x.npy", "-o", tmp_path / "parts", "--batch-size", "2") == 6
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "output 'y' of layer 's' has shape [2]" in err
    assert not (tmp_path / "parts").exists()
