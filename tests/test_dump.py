"""Tensor dumps: every layer output and constant of one batch, float and quantized, in files whose names are safe
on disk, unique and deterministic whatever the layer and tensor names, with an index.json to read them back."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from quantopt.analysis.dump import INDEX_FILE, MAX_STEM, dump_tensors, safe_stem
from quantopt.analysis.similarity import to_float
from quantopt.graph.builder import GraphBuilder
from quantopt.pipeline import quantize_model

GEO = dict(kernel_x=3, kernel_y=3, stride_x=1, stride_y=1, pad_left=1, pad_right=1, pad_top=1, pad_bottom=1,
           dilation_x=1, dilation_y=1, group=1)
FILE_RE = re.compile(r"^\d{4}_[A-Za-z0-9._-]+\.(float|quant)\.npy$")


def awkward_model():
    """Layer and tensor names with separators, dot-dot, unicode, spaces and names that sanitize alike."""
    r = np.random.default_rng(0)
    g = GraphBuilder("awk")
    x = g.input("in:0", [1, 5, 5, 3], layer_name="../input")
    a = g.layer("Convolution", [x], [[1, 5, 5, 4]], name="a/b", outputs=[".."],
                params=dict(num_output=4, with_activation="NONE", **GEO),
                constants={"weights": r.normal(0, 0.4, (4, 3, 3, 3)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 4).astype(np.float32)})
    b = g.layer("Activation", [a], [[1, 5, 5, 4]], name="激活 café", outputs=["x y"], params=dict(method="RELU"))
    c = g.layer("Activation", [a], [[1, 5, 5, 4]], name="x:y", outputs=["x:y"], params=dict(method="RELU"))
    d = g.layer("Eltwise", [b, c], [[1, 5, 5, 4]], name="C:\\tmp\\..\\CON", outputs=["/" * 300],
                params=dict(method="ADD", with_activation="NONE"))
    return g.build([d])


def data(seed: int = 1, batch: int = 2) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0, 1, (batch, 5, 5, 3)).astype(np.float32))


@pytest.fixture(scope="module")
def graphs():
    g = awkward_model()
    q = quantize_model(g, [data(s) for s in range(3)])
    return g, q


def test_safe_stem() -> None:
    assert safe_stem("a/b") == "a_b"
    assert safe_stem("..") == "tensor" and safe_stem("../../etc/passwd") == "_.._etc_passwd"
    assert safe_stem("café") == "cafe" and safe_stem("激活 café") == "_cafe"
    assert safe_stem("") == "tensor" and safe_stem("-rf") == "rf"
    assert safe_stem("x" * 500) == "x" * MAX_STEM
    assert all(FILE_RE.match(f"0000_{safe_stem(n)}.float.npy") for n in ["a b", "\x00", "..", ".hidden", "C:\\x"])


def test_dump_files_are_safe_unique_and_indexed(graphs, tmp_path: Path) -> None:
    g, q = graphs
    out = tmp_path / "dump"
    index_path = dump_tensors(g, q, data(9), str(out), model_name="awk")
    assert index_path == str(out / INDEX_FILE)
    files = sorted(p.name for p in out.iterdir())
    assert all(p.is_file() for p in out.iterdir())  # no sub-folders, nothing escaped the folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]
    npy = [f for f in files if f != INDEX_FILE]
    assert all(FILE_RE.match(f) for f in npy), npy
    assert len(set(f.lower() for f in npy)) == len(npy)  # unique even on a case-insensitive file system
    index = json.loads((out / INDEX_FILE).read_text(encoding="utf-8"))
    assert index["format"] == "quantopt-dump" and index["batch_size"] == 2 and index["model"] == "awk"
    listed = [e[side]["file"] for e in index["tensors"] for side in ("float", "quant") if e[side]]
    assert sorted(listed) == npy
    names = {e["tensor"] for e in index["tensors"] if e["kind"] == "output"}
    assert names == {"in:0", "..", "x y", "x:y", "/" * 300}
    # the two tensors whose names sanitize alike ('x y', 'x:y') get different files
    by_name = {e["tensor"]: e for e in index["tensors"] if e["kind"] == "output"}
    assert by_name["x y"]["float"]["file"] != by_name["x:y"]["float"]["file"]
    assert [e["index"] for e in index["tensors"]] == list(range(len(index["tensors"])))


def test_dump_values_match_the_graphs(graphs, tmp_path: Path) -> None:
    g, q = graphs
    x = data(9)
    index = json.loads(Path(dump_tensors(g, q, [x], str(tmp_path))).read_text(encoding="utf-8"))
    g.forward([x], keep_tensors=True)
    q.forward([x], keep_tensors=True)
    fl = {t.name: t for t in g.tensors().values()}
    qt = {t.name: t for t in q.tensors().values()}
    checked = 0
    for e in index["tensors"]:
        if e["kind"] == "output":
            f = np.load(tmp_path / e["float"]["file"], allow_pickle=False)
            assert np.array_equal(f, fl[e["tensor"]].betensor.numpy())
            info = e["quant"]
            qv = np.load(tmp_path / info["file"], allow_pickle=False)
            assert qv.dtype == np.dtype(info["dtype"]) and qv.dtype.itemsize <= 2
            assert np.array_equal(qv.astype(np.int64), qt[e["tensor"]].betensor.numpy())
            assert info["qmin"] <= qv.min() and qv.max() <= info["qmax"]
            deq = (qv.astype(np.float64) + info["zerop"]) / info["scale"]
            assert np.allclose(deq, to_float(qt[e["tensor"]]).numpy(), rtol=1e-6, atol=1e-6)
            checked += 1
        else:
            node = g.node(e["layer"])
            f = np.load(tmp_path / e["float"]["file"], allow_pickle=False)
            assert np.array_equal(f, node.constants[e["key"]].betensor.numpy())
            qc = q.node(e["layer"]).constants[e["key"]]
            qv = np.load(tmp_path / e["quant"]["file"], allow_pickle=False)
            assert np.array_equal(qv.astype(np.int64), qc.betensor.numpy())
    assert checked == 5


def test_dump_is_deterministic_and_float_only_works(graphs, tmp_path: Path) -> None:
    g, q = graphs
    a = json.loads(Path(dump_tensors(g, q, data(9), str(tmp_path / "a"))).read_text(encoding="utf-8"))
    b = json.loads(Path(dump_tensors(g, q, data(9), str(tmp_path / "b"))).read_text(encoding="utf-8"))
    assert a == b
    for p in (tmp_path / "a").iterdir():
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes()
    c = json.loads(Path(dump_tensors(g, None, data(9), str(tmp_path / "c"))).read_text(encoding="utf-8"))
    assert all(e["quant"] is None for e in c["tensors"])
    assert all(p.name.endswith((".float.npy", ".json")) for p in (tmp_path / "c").iterdir())
