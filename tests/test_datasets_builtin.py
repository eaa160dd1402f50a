"""Built-in dataset plugins (numpy family, ImageFolderDataset, TokenDataset) on tiny generated files.

Expected values are written out by hand (pixels, normalisation, transposes, padding), never recomputed with the
code under test.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from quantopt import DataError, PluginError
from quantopt.registry import DATASETS, PluginType, builtin_plugin_dir, discover_plugins, get_plugin

try:
    from PIL import Image
except ImportError:  # pillow is optional (extra "vision")
    Image = None

needs_pil = pytest.mark.skipif(Image is None, reason="pillow is not installed (optional extra 'vision')")


@pytest.fixture(scope="module", autouse=True)
def _plugins() -> None:
    discover_plugins()


def dataset(name: str) -> Any:
    return get_plugin(PluginType.Dataset, name)


def raises(match: str, cls: str, *args: Any, file: Optional[str] = None, **kwargs: Any) -> DataError:
    with pytest.raises(DataError, match=match) as info:
        dataset(cls)(*args, **kwargs)
    if file is not None:
        assert file in str(info.value)
    return info.value


@pytest.mark.parametrize("name, file", [
    ("NumpyNHWC2NCHWDataset", "aipubt_opt_dataset_numpy.py"),
    ("NumpyNCHW2NHWCDataset", "aipubt_opt_dataset_numpy.py"),
    ("NUMPYNHWCRGB2BGR", "aipubt_opt_dataset_numpy.py"),
    ("NumpyNHWCRGB2NCBGRHWDataset", "aipubt_opt_dataset_numpy.py"),
    ("NumpyMIMONCHWDataset", "aipubt_opt_dataset_numpy.py"),
    ("NumpyMultiInputWithoutBatchDimDataset", "aipubt_opt_dataset_numpy.py"),
    ("NumpyZippedDataset", "aipubt_opt_dataset_numpy.py"),
    ("OpTestNumpyZippedDataset", "aipubt_opt_dataset_numpy.py"),
    ("ImageFolderDataset", "aipubt_opt_dataset_image.py"),
    ("TokenDataset", "aipubt_opt_dataset_text.py"),
])
def test_registered_as_builtins(name: str, file: str) -> None:
    reg = DATASETS.get(name.lower())
    assert reg is not None and reg.builtin and reg.obj.__name__ == name
    assert os.path.abspath(reg.source) == os.path.join(builtin_plugin_dir(), file)


# ============================================================================================ numpy layouts
@pytest.fixture
def nhwc(tmp_path: Path) -> tuple:
    data = np.arange(2 * 2 * 3 * 3, dtype=np.float32).reshape(2, 2, 3, 3)  # N=2, H=2, W=3, C=3
    np.save(tmp_path / "nhwc.npy", data)
    np.save(tmp_path / "label.npy", np.array([7, 8]))
    return str(tmp_path / "nhwc.npy"), str(tmp_path / "label.npy"), data


def test_nhwc_to_nchw(nhwc: tuple) -> None:
    path, label, _ = nhwc
    x, y = dataset("NumpyNHWC2NCHWDataset")(path, label)[1]
    assert tuple(x.shape) == (3, 2, 3) and x.dtype == torch.float32 and y.item() == 8
    # sample 1 starts at 18; element (h, w, c) = 18 + 9h + 3w + c, now found at [c, h, w]
    assert x[0].tolist() == [[18, 21, 24], [27, 30, 33]]
    assert x[2, 1, 2].item() == 18 + 9 + 6 + 2
    assert x.is_contiguous()


def test_nchw_to_nhwc(tmp_path: Path) -> None:
    data = np.arange(2 * 3 * 2 * 2, dtype=np.float64).reshape(2, 3, 2, 2)  # N, C=3, H=2, W=2
    np.save(tmp_path / "nchw.npy", data)
    x, y = dataset("NumpyNCHW2NHWCDataset")(str(tmp_path / "nchw.npy"))[0]
    assert tuple(x.shape) == (2, 2, 3) and y.item() == float("-inf")
    # element (c, h, w) = 4c + 2h + w, now at [h, w, c]
    assert x[0, 0].tolist() == [0, 4, 8] and x[1, 1].tolist() == [3, 7, 11]


def test_rgb_to_bgr_variants(nhwc: tuple) -> None:
    path, label, _ = nhwc
    x, _ = dataset("NUMPYNHWCRGB2BGR")(path, label)[0]
    assert tuple(x.shape) == (2, 3, 3)
    assert x[0, 0].tolist() == [2, 1, 0] and x[1, 2].tolist() == [17, 16, 15]
    x, y = dataset("NumpyNHWCRGB2NCBGRHWDataset")(path, label)[0]
    assert tuple(x.shape) == (3, 2, 3) and y.item() == 7
    assert x[0].tolist() == [[2, 5, 8], [11, 14, 17]]  # B plane first
    assert x[2].tolist() == [[0, 3, 6], [9, 12, 15]]  # R plane last
    batch, labels = next(iter(DataLoader(dataset("NumpyNHWCRGB2NCBGRHWDataset")(path, label), batch_size=2)))
    assert tuple(batch.shape) == (2, 3, 2, 3) and labels.tolist() == [7, 8]


@pytest.mark.parametrize("cls", ["NumpyNHWC2NCHWDataset", "NumpyNCHW2NHWCDataset", "NUMPYNHWCRGB2BGR",
                                 "NumpyNHWCRGB2NCBGRHWDataset"])
def test_layout_variants_need_4d_data(tmp_path: Path, cls: str) -> None:
    path = str(tmp_path / "flat.npy")
    np.save(path, np.zeros((4, 3, 3)))
    raises(r"shape \[4, 3, 3\]; expected 4-D", cls, path, file=path)


@pytest.mark.parametrize("cls", ["NUMPYNHWCRGB2BGR", "NumpyNHWCRGB2NCBGRHWDataset"])
def test_rgb_to_bgr_needs_three_channels(tmp_path: Path, cls: str) -> None:
    path = str(tmp_path / "rgba.npy")
    np.save(path, np.zeros((1, 2, 2, 4)))
    raises("4 channels in its last axis", cls, path, file=path)


def test_layout_variant_reports_nan_with_its_sample(tmp_path: Path) -> None:
    data = np.zeros((3, 2, 2, 3), dtype=np.float32)
    data[1, 0, 1, 2] = np.nan
    path = str(tmp_path / "nan.npy")
    np.save(path, data)
    ds = dataset("NumpyNHWC2NCHWDataset")(path)
    ds[0]
    with pytest.raises(DataError, match="NaN at sample 1") as info:
        ds[1]
    assert path in str(info.value)


# ========================================================================================= numpy multi-input
def test_multi_input_reads_a_structured_npy(tmp_path: Path) -> None:
    records = np.zeros(3, dtype=[("ids", np.int32, (2,)), ("img", np.float32, (2, 2))])
    records["ids"] = [[1, 2], [3, 4], [5, 6]]
    records["img"] = np.arange(12).reshape(3, 2, 2)
    path = str(tmp_path / "fields.npy")
    np.save(path, records)
    labels = np.zeros(3, dtype=[("cls", np.int64), ("box", np.float32, (4,))])
    labels["cls"] = [9, 8, 7]
    labels["box"][2] = [1, 2, 3, 4]
    label_path = str(tmp_path / "label_fields.npy")
    np.save(label_path, labels)
    ds = dataset("NumpyMultiInputDataset")(path, label_path)
    assert ds.keys == ["ids", "img"] and len(ds) == 3
    (ids, img), (cls, box) = ds[2]
    assert ids.tolist() == [5.0, 6.0] and img.tolist() == [[8, 9], [10, 11]]
    assert cls.item() == 7 and box.tolist() == [1, 2, 3, 4]
    raises("structured array", "NumpyDataset", path, file=path)


def test_pickled_dict_npy_gets_an_npz_hint(tmp_path: Path) -> None:
    path = str(tmp_path / "dict.npy")
    np.save(path, {"a": np.zeros((2, 3))}, allow_pickle=True)
    for cls in ("NumpyMultiInputDataset", "NumpyMIMONCHWDataset", "NumpyMultiInputWithoutBatchDimDataset",
                "NumpyZippedDataset"):
        raises(r"object \(pickled\) array.*np\.savez", cls, path, file=path)


def test_mimo_nchw(tmp_path: Path) -> None:
    a = np.arange(2 * 1 * 2 * 3, dtype=np.float32).reshape(2, 1, 2, 3)  # (N, H=1, W=2, C=3)
    b = np.ones((2, 2, 2, 1), dtype=np.float32)
    path = str(tmp_path / "mimo.npz")
    np.savez(path, a=a, b=b)
    (xa, xb), y = dataset("NumpyMIMONCHWDataset")(path)[1]
    assert tuple(xa.shape) == (3, 1, 2) and tuple(xb.shape) == (1, 2, 2)
    assert xa[:, 0, :].tolist() == [[6, 9], [7, 10], [8, 11]]
    bad = str(tmp_path / "bad.npz")
    np.savez(bad, a=a, c=np.zeros((2, 5)))
    raises(r"array 'c' has shape \[2, 5\]", "NumpyMIMONCHWDataset", bad, file=bad)


def test_without_batch_dim_is_one_whole_sample(tmp_path: Path) -> None:
    a = np.array([[1.5, 2.5, 3.5], [4.5, 5.5, 6.5]], dtype=np.float32)
    ids = np.array([101, 7, 102, 0], dtype=np.int64)
    path = str(tmp_path / "nobatch.npz")
    np.savez(path, a=a, shape_a=np.array([2, 3]), ids=ids)
    label_path = str(tmp_path / "label.npz")
    np.savez(label_path, out=np.array([0.25, 0.75]))
    ds = dataset("NumpyMultiInputWithoutBatchDimDataset")(path, label_path)
    assert len(ds) == 1 and ds.keys == ["a", "ids"]
    (xa, xi), label = ds[0]
    assert xa.dtype == torch.float32 and xa.tolist() == a.tolist()
    assert xi.dtype == torch.int64 and xi.tolist() == [101, 7, 102, 0]
    assert isinstance(label, list) and label[0].tolist() == [0.25, 0.75]
    (ba, bi), _ = next(iter(DataLoader(ds, batch_size=1)))  # the loader adds the dim that data.py strips
    assert tuple(ba.shape) == (1, 2, 3) and tuple(bi.shape) == (1, 4)
    with pytest.raises(IndexError):
        ds[1]
    single = str(tmp_path / "single.npz")
    np.savez(single, x=np.array([[True, False]]))
    x, y = dataset("NumpyMultiInputWithoutBatchDimDataset")(single)[0]
    assert x.dtype == torch.bool and x.tolist() == [[True, False]] and y.item() == float("-inf")
    nan = str(tmp_path / "nan.npz")
    np.savez(nan, x=np.array([1.0, np.nan]))
    with pytest.raises(DataError, match="array 'x' contains NaN") as info:
        dataset("NumpyMultiInputWithoutBatchDimDataset")(nan)[0]
    assert nan in str(info.value)


def test_zipped_keeps_dtypes_and_uses_output_shapes(tmp_path: Path) -> None:
    x0 = np.arange(6, dtype=np.float32).reshape(3, 2)
    x1 = np.array([10, 20, 30], dtype=np.int32)
    x2 = np.array([[1], [2], [65535]], dtype=np.uint16)
    data = str(tmp_path / "data.npz")
    np.savez(data, **{"0": x0, "1": x1, "2": x2, "shape_0": np.array([1, 2]), "shape_1": np.array([1]),
                      "shape_2": np.array([1, 1])})
    label = str(tmp_path / "label.npz")
    np.savez(label, **{"0": np.arange(12, dtype=np.float32).reshape(3, 4), "1": np.array(5, dtype=np.int8),
                       "shape_0": np.array([1, 4]), "shape_1": np.array([], dtype=np.int64)})
    for cls in ("NumpyZippedDataset", "OpTestNumpyZippedDataset"):
        ds = dataset(cls)(data, label)
        assert len(ds) == 3 and ds.keys == ["0", "1", "2"] and [s.tolist() for s in ds.input_shapes] == \
            [[1, 2], [1], [1, 1]]
        (a, b, c), (l0, l1) = ds[2]
        assert a.dtype == torch.float32 and a.tolist() == [4, 5]
        assert b.dtype == torch.int32 and b.item() == 30
        assert c.dtype == torch.int64 and c.tolist() == [65535]
        assert l0.tolist() == [8, 9, 10, 11]
        assert l1.dtype == torch.int8 and l1.item() == 5  # empty shape: the whole (scalar) label every time
    (a, b, c), y = dataset("NumpyZippedDataset")(data)[0]
    assert y.item() == float("-inf")
    (ba, bb, bc), (bl0, bl1) = next(iter(DataLoader(dataset("NumpyZippedDataset")(data, label), batch_size=3)))
    assert tuple(ba.shape) == (3, 2) and bb.tolist() == [10, 20, 30] and bl1.tolist() == [5, 5, 5]


def test_zipped_errors(tmp_path: Path) -> None:
    uneven = str(tmp_path / "uneven.npz")
    np.savez(uneven, **{"0": np.zeros((3, 2)), "1": np.zeros(2)})
    raises("different sample counts", "NumpyZippedDataset", uneven, file=uneven)
    only_shapes = str(tmp_path / "shapes.npz")
    np.savez(only_shapes, shape_0=np.array([1, 2]))
    raises("no data arrays", "NumpyZippedDataset", only_shapes, file=only_shapes)
    good = str(tmp_path / "good.npz")
    np.savez(good, **{"0": np.zeros((3, 2))})
    short = str(tmp_path / "short.npz")
    np.savez(short, **{"0": np.zeros((2, 4)), "shape_0": np.array([1, 4])})
    err = raises("label array '0' has 2 samples but the data file", "NumpyZippedDataset", good, short, file=short)
    assert good in str(err)
    nan = str(tmp_path / "nan.npz")
    np.savez(nan, **{"0": np.array([[0.0], [np.inf]])})
    with pytest.raises(DataError, match="array '0' contains inf at sample 1"):
        dataset("NumpyZippedDataset")(nan)[1]
    plain = str(tmp_path / "x.npy")
    np.save(plain, np.zeros((2, 2)))
    raises("single .npy array", "NumpyZippedDataset", plain, file=plain)


# ============================================================================================ images (.npy)
def _npy_image(path: Path, pixels: Any) -> str:
    np.save(path, np.array(pixels))
    return str(path)


# one 2x2 RGB image; pixel (h, w) = [R, G, B]
PIXELS = [[[10, 20, 30], [50, 60, 70]],
          [[90, 100, 110], [130, 140, 150]]]


def test_image_normalisation_hand_computed(tmp_path: Path) -> None:
    path = _npy_image(tmp_path / "img.npy", np.array(PIXELS, dtype=np.uint8))
    ds = dataset("ImageFolderDataset")(path, mean="10,20,30", std="2,4,5")
    x, y = ds[0]
    assert x.dtype == torch.float32 and tuple(x.shape) == (2, 2, 3) and y.item() == float("-inf")
    # (p - mean) / std per channel: R (10,50,90,130)-10 /2, G (20,60,100,140)-20 /4, B (30,70,110,150)-30 /5
    assert x[..., 0].tolist() == [[0, 20], [40, 60]]
    assert x[..., 1].tolist() == [[0, 10], [20, 30]]
    assert x[..., 2].tolist() == [[0, 8], [16, 24]]
    # scale first: p/255 with ImageNet-style numbers; p=50: (50/255 - 0.5) / 0.25 = -1.2156862745...
    x, _ = dataset("ImageFolderDataset")(path, scale=1 / 255, mean=0.5, std=0.25)[0]
    assert x[0, 1, 0].item() == pytest.approx((50 / 255 - 0.5) / 0.25, abs=1e-6)
    assert x[1, 1, 2].item() == pytest.approx((150 / 255 - 0.5) / 0.25, abs=1e-6)


def test_image_bgr_nchw_and_integer_dtype(tmp_path: Path) -> None:
    path = _npy_image(tmp_path / "img.npy", np.array(PIXELS, dtype=np.uint8))
    # BGR: mean/std are in the output (B, G, R) order
    x, _ = dataset("ImageFolderDataset")(path, color="BGR", layout="NCHW", mean=[30, 20, 10])[0]
    assert tuple(x.shape) == (3, 2, 2)
    assert x[0].tolist() == [[0, 40], [80, 120]]  # B - 30
    assert x[2].tolist() == [[0, 40], [80, 120]]  # R - 10
    assert x[1].tolist() == [[0, 40], [80, 120]]  # G - 20
    raw, _ = dataset("ImageFolderDataset")(path, dtype="uint8", layout="nchw")[0]
    assert raw.dtype == torch.uint8 and raw[2].tolist() == [[30, 70], [110, 150]]
    signed, _ = dataset("ImageFolderDataset")(path, dtype="int8", mean=128)[0]
    assert signed.dtype == torch.int8 and signed[1, 1].tolist() == [2, 12, 22]
    with pytest.raises(DataError, match=r"values in \[-236, 44\], outside int8") as info:
        dataset("ImageFolderDataset")(path, dtype="int8", mean=128, std=0.5)[0]
    assert path in str(info.value)


def test_image_resize_and_crop(tmp_path: Path) -> None:
    path = _npy_image(tmp_path / "img.npy", np.array(PIXELS, dtype=np.float32))
    x, _ = dataset("ImageFolderDataset")(path, resize="1,1")[0]
    assert x[0, 0].tolist() == [70, 80, 90]  # 2x2 → 1x1 (antialiased bilinear): the mean of the four pixels
    x, _ = dataset("ImageFolderDataset")(path, resize=(4, 4), interpolation="nearest")[0]
    assert x[..., 0].tolist() == [[10, 10, 50, 50], [10, 10, 50, 50], [90, 90, 130, 130], [90, 90, 130, 130]]
    x, _ = dataset("ImageFolderDataset")(path, resize="4x4")[0]  # bilinear, align_corners=False
    assert x[0, :, 0].tolist() == [10, 20, 40, 50]
    x, _ = dataset("ImageFolderDataset")(path, resize=4, crop=2, interpolation="nearest")[0]
    assert x[..., 0].tolist() == [[10, 50], [90, 130]]  # center 2x2 of the 4x4
    x, _ = dataset("ImageFolderDataset")(path, crop="1,2")[0]  # no resize; top = round(0.5) = 0
    assert x[..., 0].tolist() == [[10, 50]]
    with pytest.raises(DataError, match="smaller than the crop 3x3"):
        dataset("ImageFolderDataset")(path, crop=3)


def test_image_gray_npy_and_channel_checks(tmp_path: Path) -> None:
    path = _npy_image(tmp_path / "g.npy", np.array([[0, 100], [200, 255]], dtype=np.uint8))
    x, _ = dataset("ImageFolderDataset")(path, color="gray", layout="NCHW", scale=2, mean=255, std=255)[0]
    assert tuple(x.shape) == (1, 2, 2)
    # (2p - 255) / 255 for p = 0, 100, 200, 255
    assert x[0].flatten().tolist() == pytest.approx([-1, (200 - 255) / 255, (400 - 255) / 255, (510 - 255) / 255])
    raises(r"needs 3 channel\(s\)", "ImageFolderDataset", path, file=path)
    rgb = _npy_image(tmp_path / "rgb.npy", np.zeros((2, 2, 3)))
    raises(r"needs 1 channel\(s\)", "ImageFolderDataset", rgb, color="GRAY", file=rgb)


def test_image_class_folders_give_sorted_class_indices(tmp_path: Path) -> None:
    root = tmp_path / "train"
    for cls, names in (("zebra", ["b.npy", "a.npy"]), ("cat", ["x.npy"]), ("dog", []), ("ant", ["q.npy"])):
        (root / cls).mkdir(parents=True)
        for i, name in enumerate(names):
            _npy_image(root / cls / name, np.full((2, 2, 3), i, dtype=np.uint8))
    (root / "zebra" / "notes.txt").write_text("not an image")
    (root / ".hidden").mkdir()
    _npy_image(root / ".hidden" / "h.npy", np.zeros((2, 2, 3)))
    ds = dataset("ImageFolderDataset")(str(root))
    assert ds.classes == ["ant", "cat", "dog", "zebra"]  # 'dog' is empty but keeps its index
    assert [k for k, _ in ds.items] == ["ant/q.npy", "cat/x.npy", "zebra/a.npy", "zebra/b.npy"]
    assert [ds[i][1].item() for i in range(len(ds))] == [0, 1, 3, 3]
    assert ds[2][0].sum().item() == 12 and ds[3][0].sum().item() == 0  # a.npy (value 1) before b.npy
    batch, labels = next(iter(DataLoader(ds, batch_size=4)))
    assert tuple(batch.shape) == (4, 2, 2, 3) and labels.dtype == torch.int64 and labels.tolist() == [0, 1, 3, 3]


def test_image_label_file(tmp_path: Path) -> None:
    root = tmp_path / "val"
    root.mkdir()
    for name in ("img_2.npy", "img_10.npy", "my image.npy"):
        _npy_image(root / name, np.zeros((2, 2, 3), dtype=np.uint8))
    labels = tmp_path / "val.txt"
    labels.write_text("# name label\nimg_10.npy 4\n\nmy image.npy 0\n./img_2.npy 17\nunused.npy 3\n")
    ds = dataset("ImageFolderDataset")(str(root), str(labels))
    assert [k for k, _ in ds.items] == ["img_10.npy", "img_2.npy", "my image.npy"]  # sorted by name
    assert [ds[i][1].item() for i in range(3)] == [4, 17, 0]
    missing = tmp_path / "missing.txt"
    missing.write_text("img_10.npy 4\nimg_2.npy 1\n")
    err = raises("no label for image 'my image.npy'", "ImageFolderDataset", str(root), str(missing))
    assert str(missing) in str(err)
    twice = tmp_path / "twice.txt"
    twice.write_text("img_10.npy 4\nimg_2.npy 1\nimg_10.npy 5\n")
    raises("labelled twice", "ImageFolderDataset", str(root), str(twice), file=f"{twice}:3")
    bad = tmp_path / "bad.txt"
    bad.write_text("img_10.npy 4\nimg_2.npy cat\n")
    raises("integer label", "ImageFolderDataset", str(root), str(bad), file=f"{bad}:2")


def test_image_list_file_keeps_its_order(tmp_path: Path) -> None:
    (tmp_path / "imgs").mkdir()
    for i, name in enumerate(("b.npy", "a.npy")):
        _npy_image(tmp_path / "imgs" / name, np.full((2, 2, 3), i + 1, dtype=np.uint8))
    listing = tmp_path / "calib.txt"
    listing.write_text("imgs/b.npy 1\nimgs/a.npy 0\n")
    ds = dataset("ImageFolderDataset")(str(listing), str(listing))  # the list can be its own label file
    assert [ds[i][0][0, 0, 0].item() for i in range(2)] == [1, 2] and [ds[i][1].item() for i in range(2)] == [1, 0]
    assert dataset("ImageFolderDataset")(str(listing))[0][1].item() == float("-inf")
    gone = tmp_path / "gone.txt"
    gone.write_text("imgs/a.npy\nimgs/nope.npy\n")
    raises("image 'imgs/nope.npy' not found", "ImageFolderDataset", str(gone), file=f"{gone}:2")
    other = tmp_path / "other.txt"
    other.write_text("imgs/a.npy\nreadme.md\n")
    raises("not an image file", "ImageFolderDataset", str(other), file=f"{other}:2")


def test_image_folder_errors(tmp_path: Path) -> None:
    raises("not found", "ImageFolderDataset", str(tmp_path / "nothing"), file=str(tmp_path / "nothing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    raises("holds no images", "ImageFolderDataset", str(empty), file=str(empty))
    mixed = tmp_path / "mixed"
    (mixed / "cls").mkdir(parents=True)
    _npy_image(mixed / "top.npy", np.zeros((2, 2, 3)))
    _npy_image(mixed / "cls" / "in.npy", np.zeros((2, 2, 3)))
    raises("mixes images", "ImageFolderDataset", str(mixed), file=str(mixed))
    sizes = tmp_path / "sizes"
    sizes.mkdir()
    _npy_image(sizes / "a.npy", np.zeros((2, 2, 3)))
    second = _npy_image(sizes / "b.npy", np.zeros((3, 2, 3)))
    ds = dataset("ImageFolderDataset")(str(sizes))
    with pytest.raises(DataError, match=r"sample 1\) gives shape \[3, 2, 3\] but the first image 'a.npy'") as info:
        ds[1]
    assert second in str(info.value)
    assert tuple(dataset("ImageFolderDataset")(str(sizes), resize="2,2")[1][0].shape) == (2, 2, 3)
    nan = tmp_path / "nan"
    nan.mkdir()
    _npy_image(nan / "a.npy", np.zeros((2, 2, 3)))
    bad = _npy_image(nan / "b.npy", np.array([[[0.0, np.nan, 0.0]]]))
    with pytest.raises(DataError, match=r"sample 1\) contains NaN") as info:
        dataset("ImageFolderDataset")(str(nan), resize=2)[1]
    assert bad in str(info.value)
    pickled = tmp_path / "p.npy"
    np.save(pickled, np.array([None]), allow_pickle=True)
    raises("unreadable .npy image", "ImageFolderDataset", str(pickled), file=str(pickled))


@pytest.mark.parametrize("kwargs, match", [
    ({"resize": "224,abc"}, "resize must be H,W"), ({"resize": "1,2,3"}, "resize must be H,W"),
    ({"crop": 0}, "crop must be"), ({"mean": "1,2"}, "mean must be one number or 3"),
    ({"std": 0}, "std must be non-zero"), ({"std": "nan"}, "std must be finite"),
    ({"color": "CMYK"}, "color must be one of"), ({"layout": "NDHWC"}, "layout must be one of"),
    ({"dtype": "uint32"}, "dtype must be one of"), ({"interpolation": "area"}, "interpolation must be one of"),
    ({"scale": "1,2"}, "scale must be one number"), ({"resize": 4, "crop": 5}, "larger than resize"),
])
def test_image_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    path = _npy_image(tmp_path / "img.npy", np.zeros((2, 2, 3)))
    with pytest.raises(PluginError, match=match):
        dataset("ImageFolderDataset")(path, **kwargs)


def test_image_without_pillow_is_a_plugin_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.png").write_bytes(b"not decoded")
    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(PluginError, match="needs Pillow"):
        dataset("ImageFolderDataset")(str(tmp_path / "a.png"))
    npy = _npy_image(tmp_path / "b.npy", np.zeros((2, 2, 3)))  # .npy images need no Pillow
    assert tuple(dataset("ImageFolderDataset")(npy)[0][0].shape) == (2, 2, 3)


# ============================================================================================ images (PNG)
@needs_pil
def test_png_rgb_gray_and_palette(tmp_path: Path) -> None:
    Image.fromarray(np.array(PIXELS, dtype=np.uint8), "RGB").save(tmp_path / "rgb.png")
    x, _ = dataset("ImageFolderDataset")(str(tmp_path / "rgb.png"), mean="10,20,30", std="2,4,5", layout="NCHW")[0]
    assert x.tolist() == [[[0, 20], [40, 60]], [[0, 10], [20, 30]], [[0, 8], [16, 24]]]
    Image.fromarray(np.array([[0, 100], [200, 255]], dtype=np.uint8), "L").save(tmp_path / "gray.png")
    g, _ = dataset("ImageFolderDataset")(str(tmp_path / "gray.png"), color="GRAY", dtype="uint8")[0]
    assert g.dtype == torch.uint8 and g[..., 0].tolist() == [[0, 100], [200, 255]]
    rgb, _ = dataset("ImageFolderDataset")(str(tmp_path / "gray.png"))[0]  # gray → RGB repeats the value
    assert rgb[1, 0].tolist() == [200, 200, 200]
    pal = Image.fromarray(np.array([[0, 1]], dtype=np.uint8), "P")
    pal.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    pal.save(tmp_path / "pal.png")
    p, _ = dataset("ImageFolderDataset")(str(tmp_path / "pal.png"), color="BGR")[0]
    assert p[0].tolist() == [[0, 0, 255], [255, 0, 0]]


@needs_pil
def test_png_folder_with_labels_and_bad_file(tmp_path: Path) -> None:
    for cls, value in (("1_dog", 40), ("0_cat", 80)):
        (tmp_path / cls).mkdir()
        Image.fromarray(np.full((3, 3, 3), value, dtype=np.uint8)).save(tmp_path / cls / "img.png")
    ds = dataset("ImageFolderDataset")(str(tmp_path), resize=2, scale=0.5)
    assert len(ds) == 2 and ds.classes == ["0_cat", "1_dog"]
    (x0, y0), (x1, y1) = ds[0], ds[1]
    assert (y0.item(), y1.item()) == (0, 1)
    assert tuple(x0.shape) == (2, 2, 3) and torch.all(x0 == 40) and torch.all(x1 == 20)
    broken = tmp_path / "1_dog" / "zz.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 this is no jpeg")
    ds = dataset("ImageFolderDataset")(str(tmp_path), resize=2)  # the first image is still fine
    assert [k for k, _ in ds.items] == ["0_cat/img.png", "1_dog/img.png", "1_dog/zz.jpg"]
    with pytest.raises(DataError, match=r"sample 2: unreadable image") as info:
        ds[2]
    assert str(broken) in str(info.value)
    with pytest.raises(DataError, match="unreadable image"):  # as the first image: found when constructing
        dataset("ImageFolderDataset")(str(broken))


# ============================================================================================ tokens
def test_tokens_txt_padding_and_truncation(tmp_path: Path) -> None:
    path = tmp_path / "ids.txt"
    path.write_text("5 6 7\n1,2\n\n9 8 7 6 5\n")
    ds = dataset("TokenDataset")(str(path), max_length=4)
    assert len(ds) == 3
    (ids, mask), y = ds[0]
    assert ids.dtype == torch.int64 and mask.dtype == torch.int64 and y.item() == float("-inf")
    assert ids.tolist() == [5, 6, 7, 0] and mask.tolist() == [1, 1, 1, 0]
    assert ds[1][0][0].tolist() == [1, 2, 0, 0] and ds[1][0][1].tolist() == [1, 1, 0, 0]
    assert ds[2][0][0].tolist() == [9, 8, 7, 6] and ds[2][0][1].tolist() == [1, 1, 1, 1]
    left = dataset("TokenDataset")(str(path), max_length="4", pad_id="3", padding_side="left",
                                   truncation_side="left", dtype="int32", inputs="attention_mask,input_ids")
    (mask, ids), _ = left[1]
    assert ids.dtype == torch.int32 and ids.tolist() == [3, 3, 1, 2] and mask.tolist() == [0, 0, 1, 1]
    assert left[2][0][1].tolist() == [8, 7, 6, 5]
    longest = dataset("TokenDataset")(str(path), inputs="input_ids")  # no max_length: the longest sample
    assert longest[1][0].tolist() == [1, 2, 0, 0, 0]
    ids, _ = next(iter(DataLoader(longest, batch_size=3)))
    assert tuple(ids.shape) == (3, 5)


def test_tokens_jsonl_with_masks_and_types(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    lines = [{"input_ids": [101, 7, 102], "token_type_ids": [0, 0, 1], "label": 1, "text": "ignored"},
             {"input_ids": [101, 102], "label": 0},
             {"input_ids": [101, 9, 9, 102], "attention_mask": [1, 1, 0, 1], "label": 0}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    ds = dataset("TokenDataset")(str(path), str(path), max_length=5,
                                 inputs="input_ids,token_type_ids,attention_mask")
    (ids, types, mask), label = ds[0]
    assert ids.tolist() == [101, 7, 102, 0, 0] and types.tolist() == [0, 0, 1, 0, 0]
    assert mask.tolist() == [1, 1, 1, 0, 0] and label.item() == 1
    assert ds[1][0][2].tolist() == [1, 1, 0, 0, 0] and ds[1][0][1].tolist() == [0] * 5
    assert ds[2][0][2].tolist() == [1, 1, 0, 1, 0] and ds[2][1].item() == 0
    bare = tmp_path / "bare.jsonl"  # bare lists of ids; labels from a .txt (a float row → float32)
    bare.write_text("[101, 102]\n[101, 5, 102]\n")
    labels = tmp_path / "labels.txt"
    labels.write_text("1 0.5\n0 1\n")
    (ids, mask), label = dataset("TokenDataset")(str(bare), str(labels))[0]
    assert ids.tolist() == [101, 102, 0] and mask.tolist() == [1, 1, 0]
    assert label.dtype == torch.float32 and label.tolist() == [1.0, 0.5]


def test_tokens_numpy_files(tmp_path: Path) -> None:
    npy = str(tmp_path / "ids.npy")
    np.save(npy, np.array([[4, 5, 6], [7, 8, 9]], dtype=np.int32))
    label = str(tmp_path / "label.npy")
    np.save(label, np.array([3, 1]))
    ds = dataset("TokenDataset")(npy, label, max_length=2, inputs="input_ids")
    ids, y = ds[1]
    assert ids.dtype == torch.int64 and ids.tolist() == [7, 8] and y.item() == 1
    npz = str(tmp_path / "ids.npz")
    np.savez(npz, input_ids=np.array([[4, 5, 0]]), attention_mask=np.array([[1, 1, 0]]))
    (ids, mask), _ = dataset("TokenDataset")(npz, max_length=4)[0]
    assert ids.tolist() == [4, 5, 0, 0] and mask.tolist() == [1, 1, 0, 0]
    floats = str(tmp_path / "floats.npy")
    np.save(floats, np.array([[1.0, 2.0]]))
    assert dataset("TokenDataset")(floats, inputs="input_ids")[0][0].tolist() == [1, 2]


def _write(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_token_errors_name_the_line_or_sample(tmp_path: Path) -> None:
    path = _write(tmp_path, "a.txt", "1 2\n3 x 4\n")
    raises("'x' is not an integer token id", "TokenDataset", path, file=f"{path}:2")
    path = _write(tmp_path, "b.txt", "1 2\n3 -4\n")
    raises(r"sample 1 \(line 2\): token id -4 at position 1 is negative", "TokenDataset", path, file=f"{path}:2")
    path = _write(tmp_path, "c.txt", "1 2\n3 40\n")
    raises("not below vocab_size 30", "TokenDataset", path, vocab_size=30, file=path)
    raises("not below int32", "TokenDataset", _write(tmp_path, "d.txt", "1 3000000000\n"), dtype="int32")
    path = _write(tmp_path, "e.jsonl", "[1, 2]\n[]\n")
    raises(r"sample 1 \(line 2\) has no tokens", "TokenDataset", path, file=f"{path}:2")
    path = _write(tmp_path, "f.jsonl", '{"input_ids": [1, 2], "attention_mask": [1]}\n')
    raises("attention_mask has 1 values but input_ids has 2", "TokenDataset", path, file=f"{path}:1")
    path = _write(tmp_path, "g.jsonl", '{"input_ids": [1, 2], "attention_mask": [1, 2]}\n')
    raises("attention_mask value 2 at position 1 is not 0 or 1", "TokenDataset", path)
    path = _write(tmp_path, "h.jsonl", '[1, 2]\n{"input_ids": [1, 2.5]}\n')
    raises("'input_ids' must be a list of integers", "TokenDataset", path, file=f"{path}:2")
    path = _write(tmp_path, "i.jsonl", "[1, 2]\n[1, 2\n")
    raises("not valid JSON", "TokenDataset", path, file=f"{path}:2")
    path = _write(tmp_path, "j.jsonl", '{"ids": [1]}\n')
    raises("object with 'input_ids'", "TokenDataset", path, file=f"{path}:1")
    nan = str(tmp_path / "nan.npy")
    np.save(nan, np.array([[1.0, 2.0], [3.0, np.nan]]))
    raises("contains NaN at sample 1", "TokenDataset", nan, file=nan)
    frac = str(tmp_path / "frac.npy")
    np.save(frac, np.array([[1.0, 2.5]]))
    raises("non-integer value at sample 0", "TokenDataset", frac, file=frac)
    ragged = str(tmp_path / "ragged.npy")
    np.save(ragged, np.array([[1, 2], [3]], dtype=object), allow_pickle=True)
    raises("pickle is never loaded", "TokenDataset", ragged, file=ragged)
    flat = str(tmp_path / "flat.npy")
    np.save(flat, np.array([1, 2, 3]))
    raises(r"shape \[3\]; expected \(samples, sequence length\)", "TokenDataset", flat, file=flat)
    npz = str(tmp_path / "x.npz")
    np.savez(npz, input_ids=np.ones((2, 3), dtype=np.int64), attention_mask=np.ones((2, 2), dtype=np.int64))
    raises(r"array 'attention_mask' has shape \[2, 2\]", "TokenDataset", npz, file=npz)
    np.savez(npz, input_ids=np.ones((2, 3), dtype=np.int64), pixel_values=np.ones((2, 3)))
    raises("unknown array 'pixel_values'", "TokenDataset", npz, file=npz)
    raises("file not found", "TokenDataset", str(tmp_path / "none.txt"))
    raises("holds no samples", "TokenDataset", _write(tmp_path, "empty.txt", "\n\n"))


def test_token_label_errors(tmp_path: Path) -> None:
    data = _write(tmp_path, "ids.txt", "1 2\n3 4\n")
    short = _write(tmp_path, "short.txt", "1\n")
    err = raises("holds 1 labels but the data file", "TokenDataset", data, short, file=short)
    assert data in str(err)
    ragged = _write(tmp_path, "ragged.txt", "1\n2 3\n")
    raises("the label of sample 1 has 2 values but the first has 1", "TokenDataset", data, ragged,
           file=f"{ragged}:2")
    nan = _write(tmp_path, "nan.txt", "1\nnan\n")
    raises("the label of sample 1 contains NaN", "TokenDataset", data, nan, file=f"{nan}:2")
    words = _write(tmp_path, "words.txt", "1\ncat\n")
    raises("expected numbers, got 'cat'", "TokenDataset", data, words, file=f"{words}:2")
    nolabel = _write(tmp_path, "nolabel.jsonl", '{"label": 1}\n{"text": "x"}\n')
    raises("has no 'label'", "TokenDataset", data, nolabel, file=f"{nolabel}:2")


@pytest.mark.parametrize("kwargs, match", [
    ({"max_length": "0"}, "max_length must be"), ({"max_length": "abc"}, "max_length must be"),
    ({"pad_id": "-1"}, "pad_id must be"), ({"inputs": "input_ids,position_ids"}, "inputs must be"),
    ({"inputs": "input_ids,input_ids"}, "inputs must be"), ({"dtype": "float32"}, "dtype must be one of"),
    ({"padding_side": "middle"}, "padding_side must be"), ({"truncation_side": "x"}, "truncation_side must be"),
    ({"vocab_size": 5, "pad_id": 5}, "pad_id 5 is not below vocab_size 5"),
])
def test_token_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    path = _write(tmp_path, "ids.txt", "1 2\n")
    with pytest.raises(PluginError, match=match):
        dataset("TokenDataset")(path, **kwargs)


def test_dataset_args_reach_the_plugin_and_typos_are_cfg_errors(tmp_path, capsys):
    """`dataset_args` passes constructor keywords from the cfg; an unknown keyword names the field."""
    from quantopt.cli import main

    repo = Path(__file__).resolve().parents[1]
    example = repo / "examples" / "digits"
    data = np.load(example / "data" / "calib.npy")[:8]
    np.save(tmp_path / "calib_nchw.npy", np.transpose(data, (0, 3, 1, 2)) if data.ndim == 4 else data)
    base = (f"[Common]\ngraph = {example / 'model' / 'digits.txt'}\nbin = {example / 'model' / 'digits.bin'}\n"
            f"model_name = digits\ncalibration_data = {tmp_path / 'calib_nchw.npy'}\n"
            f"output_dir = {tmp_path / 'out'}\n")
    cfg = tmp_path / "bad.cfg"
    cfg.write_text(base + "dataset = NumpyDataset\ndataset_args = layout=NCHW\n")
    assert main(["--cfg", str(cfg)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[ERROR]")]
    assert len(err) == 1 and "dataset_args" in err[0] and "'layout'" in err[0]
    cfg.write_text(base + "dataset = NumpyDataset\ndataset_args = layout\n")
    assert main(["--cfg", str(cfg)]) == 2
    assert "dataset_args" in capsys.readouterr().err


def test_dataset_args_configure_the_token_dataset(tmp_path):
    """The same keywords a user writes in the cfg reach TokenDataset through make_dataset."""
    from types import SimpleNamespace

    from quantopt.config.kinds import KeywordArgsKind
    from quantopt.data import make_dataset

    (tmp_path / "ids.txt").write_text("1 2 3\n4 5\n")
    cfg = SimpleNamespace(dataset="TokenDataset",
                          dataset_args=KeywordArgsKind().parse("max_length=4; inputs=input_ids; pad_id=9"))
    ds = make_dataset(cfg, str(tmp_path / "ids.txt"))
    first = ds[0][0]
    first = first[0] if isinstance(first, (list, tuple)) else first
    assert first.tolist() == [1, 2, 3, 9]


def test_numpy_datasets_keep_integer_arrays_integer(tmp_path: Path) -> None:
    """Token ids or masks in a .npy/.npz reach an IR's integer input as integers (float32 would refuse or round
    ids above 2^24); float arrays still become float32."""
    ids = np.array([[3, 1, 2 ** 25 + 1], [0, 7, 9]], dtype=np.int64)
    np.save(tmp_path / "ids.npy", ids)
    np.savez(tmp_path / "multi.npz", ids=ids, x=np.ones((2, 3), dtype=np.float64))
    sample = dataset("NumpyDataset")(str(tmp_path / "ids.npy"))[0][0]
    assert sample.dtype == torch.int64 and sample.tolist() == [3, 1, 2 ** 25 + 1]
    inputs = dataset("NumpyMultiInputDataset")(str(tmp_path / "multi.npz"))[1][0]
    assert [t.dtype for t in inputs] == [torch.int64, torch.float32] and inputs[0].tolist() == [0, 7, 9]


def test_integer_data_feeds_a_float_input_and_ids_an_integer_one() -> None:
    """prepare_inputs: uint8 image data reaches a float32 IR input as float32 (exact); int64 ids reach an int32
    input in its compute dtype (int64); float data for an integer input stays an error naming the input."""
    from types import SimpleNamespace

    from quantopt.data import prepare_inputs
    from quantopt.graph.builder import GraphBuilder
    from quantopt.quant.dtype import Dtype

    b = GraphBuilder("feed")
    img = b.input("img", [1, 2, 2])
    ids = b.input("ids", [1, 3], dtype=Dtype.INT32)
    graph = b.build([img, ids])
    cfg = SimpleNamespace(data_batch_dim=0, without_batch_dim=False)
    feed = prepare_inputs(graph, [torch.tensor([[[0, 255], [7, 9]]], dtype=torch.uint8),
                                  torch.tensor([[1, 2, 3]])], cfg, "data.npz", 0)
    assert feed[0].dtype == torch.float32 and feed[0].tolist() == [[[0.0, 255.0], [7.0, 9.0]]]
    assert feed[1].dtype == Dtype.INT32.torch_dtype and feed[1].tolist() == [[1, 2, 3]]
    with pytest.raises(DataError, match="input 'ids'"):
        prepare_inputs(graph, [feed[0], torch.zeros(1, 3)], cfg, "data.npz", 0)
