"""Built-in dataset/metric plugins, loaded through plugin discovery exactly as the cfg would find them."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from quantopt import DataError, PluginError
from quantopt.registry import DATASETS, METRICS, PluginType, builtin_plugin_dir, discover_plugins, get_plugin


@pytest.fixture(scope="module", autouse=True)
def _plugins() -> None:
    discover_plugins()


def dataset(name: str) -> Any:
    return get_plugin(PluginType.Dataset, name)


def metric(name: str) -> Any:
    return get_plugin(PluginType.Metric, name)


def test_plugins_are_discovered_as_builtins() -> None:
    for table, key, file in ((DATASETS, "numpydataset", "aipubt_opt_dataset_numpy.py"),
                             (DATASETS, "numpymultiinputdataset", "aipubt_opt_dataset_numpy.py"),
                             (METRICS, "topkmetric", "aipubt_opt_metric_basic.py"),
                             (METRICS, "cosdistancemetric", "aipubt_opt_metric_basic.py")):
        reg = table.get(key)
        assert reg is not None, key
        assert reg.builtin
        assert os.path.abspath(reg.source) == os.path.join(builtin_plugin_dir(), file)
    assert dataset("NumpyDataset").__name__ == "NumpyDataset"  # the cfg name is case-insensitive
    assert metric("TOPKMETRIC").__name__ == "TopKMetric"


# ------------------------------------------------------------------------------------------------- TopKMetric
# 4 samples, 5 classes. top-1 hits: s0, s3. top-2 adds s1 (0.3 is its second best). s2 misses both.
SCORES = torch.tensor([[0.10, 0.60, 0.20, 0.05, 0.05],
                       [0.50, 0.10, 0.30, 0.05, 0.05],
                       [0.05, 0.10, 0.15, 0.60, 0.10],
                       [0.30, 0.25, 0.20, 0.15, 0.10]])
CLASSES = torch.tensor([1, 2, 0, 0])


@pytest.mark.parametrize("k, expected", [("1", 0.5), ("2", 0.75), (" 3 ", 0.75), ("5", 1.0), ("9", 1.0)])
def test_topk_hand_computed(k: str, expected: float) -> None:
    m = metric("TopKMetric")(k)
    m([SCORES], CLASSES)
    assert m.compute() == pytest.approx(expected)


def test_topk_accumulates_batches_flattens_rows_and_accepts_column_labels() -> None:
    m = metric("TopKMetric")()
    m([SCORES[:2].reshape(2, 1, 5)], CLASSES[:2].reshape(2, 1))
    m([SCORES[2:].reshape(2, 5, 1), torch.zeros(2, 3)], CLASSES[2:].reshape(2, 1))
    assert m.correct == 2 and m.total == 4
    assert m.compute() == 0.5
    assert m.report() == "top-1 accuracy is 0.5"
    m.reset()
    assert m.compute() == 0.0
    m([SCORES], CLASSES)
    assert m.report() == "top-1 accuracy is 0.5"


def test_topk_report_text() -> None:
    m = metric("TopKMetric")("1")
    scores = torch.eye(64)
    classes = torch.arange(64)
    classes[:3] = torch.tensor([1, 2, 3])  # 61 of 64 right
    m([scores], classes)
    assert m.report() == "top-1 accuracy is 0.953125"


@pytest.mark.parametrize("k", ["abc", "0", "-1", "1.5", ""])
def test_topk_invalid_k(k: str) -> None:
    with pytest.raises(PluginError, match="K must be a positive integer"):
        metric("TopKMetric")(k)


def test_topk_without_labels_or_with_wrong_label_count() -> None:
    m = metric("TopKMetric")()
    with pytest.raises(DataError, match="label file"):
        m([SCORES], torch.full((4,), float("-inf")))
    with pytest.raises(DataError, match="4 predictions but 3 labels"):
        m([SCORES], CLASSES[:3])


# ------------------------------------------------------------------------------------------ CosDistanceMetric
def test_cos_distance_single_output() -> None:
    m = metric("CosDistanceMetric")()
    # sample 0 identical direction (cos 1), sample 1 orthogonal (cos 0), sample 2 opposite (cos -1), 3: 3-4-5
    pred = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0], [3.0, 4.0]])
    label = torch.tensor([[1.0, 0.0], [1.0, 0.0], [-2.0, -2.0], [0.0, 5.0]])
    m([pred], label)
    assert m.compute() == pytest.approx((1 + 0 - 1 + 0.8) / 4)
    assert m.report() == f"cosine distance is {m.compute()}" and m.report().startswith("cosine distance is 0.2")


def test_cos_distance_multi_output_concatenates_per_sample() -> None:
    out_a = torch.tensor([[1.0, 0.0], [3.0, 0.0]])  # [B, 2]
    out_b = torch.tensor([[[1.0]], [[4.0]]])  # [B, 1, 1]
    lab_a = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    lab_b = torch.tensor([[1.0], [1.0]])
    # sample 0: (1,0,1)·(1,0,1) → 1; sample 1: (3,0,4)·(0,0,1) = 4 / (5·1) → 0.8
    as_list = metric("CosDistanceMetric")()
    as_list([out_a, out_b], [lab_a, lab_b])
    assert as_list.compute() == pytest.approx(0.9)
    one_tensor = metric("CosDistanceMetric")()
    one_tensor([out_a, out_b], torch.cat([lab_a, lab_b], dim=1))
    assert one_tensor.compute() == pytest.approx(0.9)
    # accumulation over two batches gives the same mean as one batch
    split = metric("CosDistanceMetric")()
    split([out_a[:1], out_b[:1]], [lab_a[:1], lab_b[:1]])
    split([out_a[1:], out_b[1:]], [lab_a[1:], lab_b[1:]])
    assert split.compute() == pytest.approx(0.9)
    split.reset()
    assert split.compute() == 0.0


def test_cos_distance_errors() -> None:
    m = metric("CosDistanceMetric")()
    with pytest.raises(DataError, match="label file"):
        m([torch.ones(2, 3)], torch.full((2,), float("-inf")))
    with pytest.raises(DataError, match="3 values per sample but the labels have 2"):
        m([torch.ones(2, 3)], torch.ones(2, 2))
    with pytest.raises(DataError, match="batch size"):
        m([torch.ones(2, 3)], torch.ones(3, 3))


# ------------------------------------------------------------------------------------------------ datasets
@pytest.fixture
def npy_data(tmp_path: Path) -> tuple:
    data = np.arange(6 * 1 * 4 * 4, dtype=np.float64).reshape(6, 1, 4, 4) / 10
    labels = np.array([3, 1, 4, 1, 5, 9], dtype=np.int64)
    np.save(tmp_path / "data.npy", data)
    np.save(tmp_path / "label.npy", labels)
    return str(tmp_path / "data.npy"), str(tmp_path / "label.npy"), data, labels


def test_numpy_dataset_samples(npy_data: tuple) -> None:
    data_file, label_file, data, labels = npy_data
    ds = dataset("NumpyDataset")(data_file, label_file)
    assert len(ds) == 6
    x, y = ds[2]
    assert x.dtype == torch.float32 and tuple(x.shape) == (1, 4, 4)
    np.testing.assert_array_equal(x.numpy(), data[2].astype(np.float32))
    assert y.dtype == torch.int64 and y.item() == 4
    assert ds[-1][1].item() == 9
    x[:] = 0  # a copy: the mmap'd file data is untouched
    assert ds[2][0].sum() > 0
    with pytest.raises(IndexError):
        ds[6]


def test_numpy_dataset_without_labels(npy_data: tuple) -> None:
    ds = dataset("NumpyDataset")(npy_data[0])
    x, y = ds[0]
    assert y.dtype == torch.float32 and y.dim() == 0 and y.item() == float("-inf")


def test_numpy_dataset_batches_with_default_collate(npy_data: tuple) -> None:
    data_file, label_file, data, labels = npy_data
    batches = list(DataLoader(dataset("NumpyDataset")(data_file, label_file), batch_size=4))
    (x0, y0), (x1, y1) = batches
    assert tuple(x0.shape) == (4, 1, 4, 4) and tuple(y0.shape) == (4,)
    assert tuple(x1.shape) == (2, 1, 4, 4) and tuple(y1.shape) == (2,)
    assert y0.tolist() == labels[:4].tolist()
    np.testing.assert_array_equal(x1.numpy(), data[4:].astype(np.float32))
    x, y = next(iter(DataLoader(dataset("NumpyDataset")(data_file), batch_size=4)))
    assert tuple(y.shape) == (4,) and torch.isinf(y).all()


@pytest.fixture
def npz_data(tmp_path: Path) -> tuple:
    # keys deliberately not alphabetical: the archive order is the input order
    z = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    a = np.arange(5 * 2 * 2, dtype=np.int32).reshape(5, 2, 2)
    np.savez(tmp_path / "data.npz", z_first=z, a_second=a)
    return str(tmp_path / "data.npz"), z, a


def test_numpy_multi_input_dataset(npz_data: tuple, tmp_path: Path) -> None:
    data_file, z, a = npz_data
    ds = dataset("NumpyMultiInputDataset")(data_file)
    assert ds.keys == ["z_first", "a_second"] and len(ds) == 5
    (x0, x1), y = ds[1]
    np.testing.assert_array_equal(x0.numpy(), z[1])
    np.testing.assert_array_equal(x1.numpy(), a[1])
    assert x1.dtype == torch.int32  # integer arrays keep their dtype (an IR's float input converts them)
    assert y.item() == float("-inf")

    np.save(tmp_path / "label.npy", np.arange(5))
    _, y = dataset("NumpyMultiInputDataset")(data_file, str(tmp_path / "label.npy"))[3]
    assert y.item() == 3

    np.savez(tmp_path / "labels.npz", out_b=np.arange(5) * 10, out_a=np.ones((5, 2)))
    ds = dataset("NumpyMultiInputDataset")(data_file, str(tmp_path / "labels.npz"))
    _, y = ds[2]
    assert isinstance(y, list) and y[0].item() == 20 and y[1].tolist() == [1.0, 1.0]

    (b0, b1), (l0, l1) = next(iter(DataLoader(ds, batch_size=4)))
    assert tuple(b0.shape) == (4, 3) and tuple(b1.shape) == (4, 2, 2)
    assert tuple(l0.shape) == (4,) and tuple(l1.shape) == (4, 2)


# ------------------------------------------------------------------------------------------ dataset errors
def _raises(path: str, match: str, cls: str, *args: Any) -> DataError:
    with pytest.raises(DataError, match=match) as info:
        dataset(cls)(*args)
    assert path in str(info.value)
    return info.value


@pytest.mark.parametrize("cls", ["NumpyDataset", "NumpyMultiInputDataset"])
def test_missing_and_unreadable_files(tmp_path: Path, cls: str) -> None:
    missing = str(tmp_path / "nope.npy")
    _raises(missing, "file not found", cls, missing)
    text = tmp_path / "text.npy"
    text.write_text("1,2,3\n")
    _raises(str(text), "unreadable", cls, str(text))
    raw_pickle = tmp_path / "pickled.npy"
    raw_pickle.write_bytes(b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00]\x94.")
    _raises(str(raw_pickle), "pickle", cls, str(raw_pickle))
    broken_zip = tmp_path / "broken.npz"
    broken_zip.write_bytes(b"PK\x03\x04" + b"\x00" * 20)
    _raises(str(broken_zip), "unreadable", cls, str(broken_zip))
    _raises(str(tmp_path), "directory", cls, str(tmp_path))


def test_numpy_dataset_rejects_bad_arrays(tmp_path: Path, npy_data: tuple) -> None:
    obj = str(tmp_path / "obj.npy")
    np.save(obj, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    _raises(obj, "object", "NumpyDataset", obj)
    truncated = tmp_path / "truncated.npy"
    truncated.write_bytes(Path(npy_data[0]).read_bytes()[:200])
    _raises(str(truncated), "unreadable", "NumpyDataset", str(truncated))
    strings = str(tmp_path / "strings.npy")
    np.save(strings, np.array(["a", "b"]))
    _raises(strings, "dtype", "NumpyDataset", strings)
    scalar = str(tmp_path / "scalar.npy")
    np.save(scalar, np.float32(1.0))
    _raises(scalar, "scalar", "NumpyDataset", scalar)
    npz = str(tmp_path / "inputs.npz")
    np.savez(npz, a=np.zeros((2, 3)))
    _raises(npz, "NumpyMultiInputDataset", "NumpyDataset", npz)


def test_label_errors(tmp_path: Path, npy_data: tuple) -> None:
    data_file = npy_data[0]
    short = str(tmp_path / "short.npy")
    np.save(short, np.arange(5))
    err = _raises(short, "5 samples but the data file", "NumpyDataset", data_file, short)
    assert data_file in str(err)
    _raises(str(tmp_path / "none.npy"), "file not found", "NumpyDataset", data_file, str(tmp_path / "none.npy"))
    obj = str(tmp_path / "obj_label.npy")
    np.save(obj, np.array([None] * 6, dtype=object), allow_pickle=True)
    _raises(obj, "object", "NumpyDataset", data_file, obj)
    two = str(tmp_path / "two.npz")
    np.savez(two, a=np.arange(6), b=np.arange(6))
    _raises(two, "2 label arrays", "NumpyDataset", data_file, two)


@pytest.mark.parametrize("bad, word", [(float("nan"), "NaN"), (float("inf"), "inf"), (-float("inf"), "inf")])
def test_non_finite_data_is_reported_with_its_sample(tmp_path: Path, bad: float, word: str) -> None:
    data = np.zeros((4, 3), dtype=np.float32)
    data[2, 1] = bad
    path = str(tmp_path / "bad.npy")
    np.save(path, data)
    ds = dataset("NumpyDataset")(path)
    ds[1]  # the clean samples still load
    with pytest.raises(DataError, match=f"{word} at sample 2") as info:
        ds[2]
    assert path in str(info.value)
    npz = str(tmp_path / "bad.npz")
    np.savez(npz, x=np.zeros((4, 2)), y=data)
    mds = dataset("NumpyMultiInputDataset")(npz)
    with pytest.raises(DataError, match=f"array 'y' contains {word} at sample 2") as info:
        mds[2]
    assert npz in str(info.value)


def test_numpy_multi_input_dataset_errors(tmp_path: Path, npy_data: tuple) -> None:
    uneven = str(tmp_path / "uneven.npz")
    np.savez(uneven, a=np.zeros((4, 2)), b=np.zeros((3, 2)))
    _raises(uneven, "different sample counts", "NumpyMultiInputDataset", uneven)
    empty = str(tmp_path / "empty.npz")
    np.savez(empty)
    _raises(empty, "no arrays", "NumpyMultiInputDataset", empty)
    obj = str(tmp_path / "obj.npz")
    np.savez(obj, a=np.array([None, None], dtype=object))
    _raises(obj, "object", "NumpyMultiInputDataset", obj)
    _raises(npy_data[0], "single .npy array", "NumpyMultiInputDataset", npy_data[0])
    good = str(tmp_path / "good.npz")
    np.savez(good, a=np.zeros((4, 2)), b=np.zeros((4, 1)))
    bad_labels = str(tmp_path / "labels.npz")
    np.savez(bad_labels, out0=np.zeros(4), out1=np.zeros(3))
    _raises(bad_labels, "label array 'out1' has 3 samples", "NumpyMultiInputDataset", good, bad_labels)
