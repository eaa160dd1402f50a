"""Built-in dataset plugin `ImageFolderDataset`: image files → preprocessed image tensors `[image, label]`.

The data file is a folder of images, a list file naming images, or one image. Each image is decoded (Pillow,
imported only when a non-.npy image is read), resized, center-cropped, put in RGB/BGR/gray channel order,
normalised as `(pixel * scale - mean) / std`, laid out HWC or CHW and cast to the requested dtype. Labels come
from a `name label` text file or from class sub-folders. The cfg names the plugin only (`dataset =
ImageFolderDataset`), so the preprocessing arguments are constructor keywords with defaults; a model needing other
values registers a small subclass (docs/datasets.md shows how). Every bad image or line is a `DataError` naming
the file (and line or sample).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.data

from quantopt import DataError, PluginError, PluginType, register_plugin
from quantopt.data_files import text_lines

IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpeg", ".jpg", ".pbm", ".pgm", ".png", ".ppm", ".tif", ".tiff", ".webp",
                    ".npy")
_COLORS = {"RGB": "RGB", "BGR": "BGR", "GRAY": "GRAY", "GREY": "GRAY", "L": "GRAY"}
_LAYOUTS = ("NHWC", "NCHW")
_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "uint8": np.uint8,
           "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64}
_INTERPOLATIONS = ("bilinear", "bicubic", "nearest")

Size = Optional[Tuple[int, int]]
Numbers = Union[float, str, Sequence[float]]


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _key(path: str) -> str:
    """The name of an image as label files write it: '/'-separated, without a leading './'."""
    key = path.replace("\\", "/")
    while key.startswith("./"):
        key = key[2:]
    return key


# --------------------------------------------------------------------------------------------------- arguments
def _error(what: str, value: Any, expected: str) -> PluginError:
    return PluginError(f"ImageFolderDataset: {what} must be {expected}, got {value!r}")


def _parse_size(what: str, value: Any) -> Size:
    """`None`/'' → no resize; 224, '224', '224,200', '224x200', (224, 200) → (H, W)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    items: List[Any]
    if isinstance(value, str):
        items = [t for t in value.lower().replace("x", ",").split(",")]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    try:
        sizes = [int(str(t).strip()) for t in items]
    except ValueError:
        raise _error(what, value, "H,W (two positive integers) or one integer for a square") from None
    if len(sizes) == 1:
        sizes = sizes * 2
    if len(sizes) != 2 or min(sizes) < 1:
        raise _error(what, value, "H,W (two positive integers) or one integer for a square")
    return sizes[0], sizes[1]


def _parse_numbers(what: str, value: Numbers) -> np.ndarray:
    """One number (every channel) or one per channel: a float, a sequence, or a 'a,b,c' string."""
    items = value.split(",") if isinstance(value, str) else (value if isinstance(value, (list, tuple)) else [value])
    try:
        out = np.array([float(str(t).strip()) if isinstance(t, str) else float(t) for t in items], dtype=np.float64)
    except (TypeError, ValueError):
        raise _error(what, value, "a number or comma-separated numbers, one per channel") from None
    if out.size == 0 or not np.isfinite(out).all():
        raise _error(what, value, "finite numbers")
    return out


def _parse_choice(what: str, value: Any, choices: Sequence[str], upper: bool) -> str:
    text = str(value).strip().upper() if upper else str(value).strip().lower()
    if text not in choices:
        raise _error(what, value, "one of " + ", ".join(choices))
    return text


# --------------------------------------------------------------------------------------------------- listing
def _list_folder(folder: str) -> Tuple[List[Tuple[str, str]], Optional[List[str]]]:
    """(key, path) of the images, sorted by key, and the class names when the images are in class sub-folders."""
    try:
        entries = sorted(e for e in os.listdir(folder) if not e.startswith("."))
    except OSError as e:
        raise DataError(f"cannot list the folder: {e.strerror or e}", file=folder) from None
    top = [e for e in entries if os.path.isfile(os.path.join(folder, e)) and _is_image(e)]
    subdirs = [e for e in entries if os.path.isdir(os.path.join(folder, e))]
    nested: List[Tuple[str, str]] = []
    for d in subdirs:
        sub = os.path.join(folder, d)
        try:
            names = sorted(n for n in os.listdir(sub) if not n.startswith("."))
        except OSError as e:
            raise DataError(f"cannot list the folder: {e.strerror or e}", file=sub) from None
        nested += [(f"{d}/{n}", os.path.join(sub, n)) for n in names
                   if _is_image(n) and os.path.isfile(os.path.join(sub, n))]
    if top and nested:
        raise DataError(f"mixes images ('{top[0]}') with class sub-folders holding images ('{nested[0][0]}'); "
                        f"put every image in a class sub-folder, or none", file=folder)
    if top:
        return [(e, os.path.join(folder, e)) for e in top], None
    if not nested:
        raise DataError(f"holds no images (looked for {', '.join(IMAGE_EXTENSIONS)} files, and in sub-folders)",
                        file=folder)
    return nested, subdirs


def _split_label(line: str) -> Tuple[str, Optional[str]]:
    """'path label' → (path, label); a line whose last word is not an integer is all path."""
    parts = line.rsplit(None, 1)
    if len(parts) == 2:
        try:
            int(parts[1])
            return parts[0], parts[1]
        except ValueError:
            pass
    return line, None


def _read_lines(path: str) -> List[Tuple[int, str]]:
    """(line number, stripped text) of the non-blank, non-comment lines of a UTF-8 text file."""
    return text_lines(path, skip_comments=True)


def _list_file(path: str) -> List[Tuple[str, str]]:
    """Images named one per line (optionally followed by a label, ignored here), relative to the list's folder."""
    base = os.path.dirname(os.path.abspath(path))
    out: List[Tuple[str, str]] = []
    for n, line in _read_lines(path):
        name, _ = _split_label(line)
        full = name if os.path.isabs(name) else os.path.join(base, name)
        if not _is_image(name):
            raise DataError(f"'{name}' is not an image file (expected one of {', '.join(IMAGE_EXTENSIONS)})",
                            file=path, line=n)
        if not os.path.isfile(full):
            raise DataError(f"image '{name}' not found (looked for {full})", file=path, line=n)
        out.append((_key(name), full))
    if not out:
        raise DataError("lists no images", file=path)
    return out


def _read_label_file(path: str) -> Dict[str, int]:
    """`name label` per line → {name: class index}; '#' comments and blank lines are skipped."""
    labels: Dict[str, int] = {}
    lines: Dict[str, int] = {}
    for n, line in _read_lines(path):
        name, label = _split_label(line)
        if label is None:
            raise DataError(f"expected 'name label' with an integer label, got '{line}'", file=path, line=n)
        key = _key(name)
        if key in labels:
            raise DataError(f"'{name}' is labelled twice (first on line {lines[key]})", file=path, line=n)
        labels[key] = int(label)
        lines[key] = n
    if not labels:
        raise DataError("holds no labels", file=path)
    return labels


# --------------------------------------------------------------------------------------------------- decoding
def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise PluginError("ImageFolderDataset: reading image files needs Pillow (pip install pillow); .npy "
                          "images are read without it") from None
    return Image


def _decode(path: str, gray: bool, where: str) -> np.ndarray:
    """An (H, W, C) array: uint8 RGB (or gray) from an image file, or the numbers of an (H, W[, C]) .npy."""
    if path.lower().endswith(".npy"):
        try:
            a = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"{where}: unreadable .npy image: {e}", file=path) from None
        if a.dtype.kind not in "buif" or a.ndim not in (2, 3):
            raise DataError(f"{where}: a .npy image must be a numeric (H, W) or (H, W, C) array, got {a.dtype} "
                            f"{list(a.shape)}", file=path)
        a = a.reshape(a.shape + (1,)) if a.ndim == 2 else a
        want = 1 if gray else 3
        if a.shape[2] != want:
            color = "GRAY" if gray else "RGB/BGR"
            raise DataError(f"{where}: a .npy image for color {color} needs {want} channel(s) in its last axis, got "
                            f"shape {list(a.shape)}", file=path)
        return a
    image_module = _pil()
    try:
        with image_module.open(path) as im:
            im.load()
            a = np.asarray(im.convert("L" if gray else "RGB"))
    except Exception as e:  # PIL raises OSError, ValueError, DecompressionBombError, ... for bad files
        raise DataError(f"{where}: unreadable image: {type(e).__name__}: {e}", file=path) from None
    return a.reshape(a.shape + (1,)) if a.ndim == 2 else a


def _resize(x: np.ndarray, size: Tuple[int, int], interpolation: str) -> np.ndarray:
    """Resize an (H, W, C) float64 array; bilinear/bicubic antialias when shrinking (as torchvision's Resize)."""
    if x.shape[:2] == size:
        return x
    t = torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))[None]
    if interpolation == "nearest":
        y = F.interpolate(t, size=size, mode="nearest")
    else:
        y = F.interpolate(t, size=size, mode=interpolation, align_corners=False, antialias=True)
    return y[0].numpy().transpose(1, 2, 0)


@register_plugin(PluginType.Dataset, "1.0")
class ImageFolderDataset(torch.utils.data.Dataset):
    """Images → `[image, label]` with resize, center crop, channel order, normalisation, layout and dtype.

    data_file: a folder (images directly in it, or in class sub-folders), a text file listing image paths (one
    per line, relative to the list's folder), or a single image. label_file: `name label` lines.
    """

    def __init__(self, data_file: str, label_file: Optional[str] = None, resize: Any = None, crop: Any = None,
                 scale: Numbers = 1.0, mean: Numbers = 0.0, std: Numbers = 1.0, color: str = "RGB",
                 layout: str = "NHWC", dtype: str = "float32", interpolation: str = "bilinear") -> None:
        self.data_file = str(data_file)
        self.label_file = str(label_file) if label_file is not None else None
        self.resize = _parse_size("resize", resize)
        self.crop = _parse_size("crop", crop)
        scales = _parse_numbers("scale", scale)
        if scales.size != 1:
            raise _error("scale", scale, "one number")
        self.scale = float(scales[0])
        self.color = _COLORS.get(str(color).strip().upper(), "")
        if not self.color:
            raise _error("color", color, "one of RGB, BGR, GRAY")
        self.channels = 1 if self.color == "GRAY" else 3
        self.mean = self._per_channel("mean", mean)
        self.std = self._per_channel("std", std)
        if (self.std == 0).any():
            raise _error("std", std, "non-zero")
        self.layout = _parse_choice("layout", layout, _LAYOUTS, True)
        self.dtype_name = _parse_choice("dtype", dtype, tuple(_DTYPES), False)
        self.dtype = _DTYPES[self.dtype_name]
        self.interpolation = _parse_choice("interpolation", interpolation, _INTERPOLATIONS, False)
        if self.resize and self.crop and (self.crop[0] > self.resize[0] or self.crop[1] > self.resize[1]):
            raise PluginError(f"ImageFolderDataset: crop {self.crop} is larger than resize {self.resize}")

        self.classes: Optional[List[str]] = None
        if not os.path.exists(self.data_file):
            raise DataError("file or folder not found", file=self.data_file)
        if os.path.isdir(self.data_file):
            self.items, self.classes = _list_folder(self.data_file)
        elif _is_image(self.data_file):
            self.items = [(_key(os.path.basename(self.data_file)), self.data_file)]
        else:
            self.items = _list_file(self.data_file)
        self.labels = self._labels()
        self.sample_shape: Optional[Tuple[int, ...]] = None
        self.sample_shape = tuple(self._image(0).shape)  # fail fast on a bad first image or a missing Pillow

    def _per_channel(self, what: str, value: Numbers) -> np.ndarray:
        v = _parse_numbers(what, value)
        if v.size not in (1, self.channels):
            raise _error(what, value, f"one number or {self.channels} (one per {self.color} channel)")
        return v

    def _labels(self) -> Optional[List[int]]:
        if self.label_file is not None:
            table = _read_label_file(self.label_file)
            out = []
            for key, path in self.items:
                if key not in table:
                    raise DataError(f"no label for image '{key}' ({path})", file=self.label_file)
                out.append(table[key])
            return out
        if self.classes is not None:
            index = {c: i for i, c in enumerate(self.classes)}
            return [index[key.split("/", 1)[0]] for key, _ in self.items]
        return None

    def __len__(self) -> int:
        return len(self.items)

    def _image(self, i: int) -> np.ndarray:
        key, path = self.items[i]
        a = _decode(path, self.color == "GRAY", f"sample {i}")
        x = a.astype(np.float64)
        if not np.isfinite(x).all():
            bad = "NaN" if np.isnan(x).any() else "inf"
            raise DataError(f"image (sample {i}) contains {bad}", file=path)
        if self.resize is not None:
            x = _resize(x, self.resize, self.interpolation)
        if self.crop is not None:
            h, w = x.shape[:2]
            ch, cw = self.crop
            if ch > h or cw > w:
                raise DataError(f"image (sample {i}) is {h}x{w}, smaller than the crop {ch}x{cw}; set resize",
                                file=path)
            top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
            x = x[top:top + ch, left:left + cw]
        if self.color == "BGR":
            x = x[..., ::-1]
        x = (x * self.scale - self.mean) / self.std
        if self.layout == "NCHW":
            x = x.transpose(2, 0, 1)
        shape = tuple(x.shape)
        if self.sample_shape is not None and shape != self.sample_shape:
            first = self.items[0][0]
            raise DataError(f"image (sample {i}) gives shape {list(shape)} but the first image '{first}' gives "
                            f"{list(self.sample_shape)}; set resize (and crop) so that every image has one size",
                            file=path)
        if np.issubdtype(self.dtype, np.integer):
            x = np.rint(x)
            info = np.iinfo(self.dtype)
            if x.size and (x.min() < info.min or x.max() > info.max):
                raise DataError(f"image (sample {i}) has values in [{x.min():g}, {x.max():g}], outside "
                                f"{self.dtype_name} [{info.min}, {info.max}]; adjust scale/mean/std or the dtype",
                                file=path)
        return np.ascontiguousarray(x.astype(self.dtype))

    def __getitem__(self, index: int) -> List[Any]:
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        image = torch.from_numpy(self._image(i))
        label = torch.tensor(self.labels[i], dtype=torch.int64) if self.labels is not None else \
            torch.tensor(float("-inf"), dtype=torch.float32)
        return [image, label]

