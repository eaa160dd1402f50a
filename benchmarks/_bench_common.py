"""Shared pieces of the real-model benchmarks (real_model_speed.py, vs_upstream.py): where the models are, and
seeded stand-in inputs, so both scripts measure the same files on the same kind of data.

Nothing here is part of the quantopt package; the model packages are benchmark extras (benchmarks/requirements.txt).
"""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any, Callable, List, Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
SHARED_MODELS = Path(os.environ.get("QUANTOPT_SHARED_MODELS", REPO / "tests" / "data" / "shared_models"))
"""The reference Parser IRs and their goldens: tests/data/shared_models, or $QUANTOPT_SHARED_MODELS (the same
variable tests/conftest.py reads)."""
UPSTREAM = Path(os.environ.get("QUANTOPT_UPSTREAM", SHARED / "upstream"))
"""The upstream tools (run-parser.sh, Compass_Optimizer, setup.sh): ../shared/upstream, or $QUANTOPT_UPSTREAM."""
SHARED_IR_NAMES = ["syn_resnet", "syn_mobilenet", "ppocr_cls", "mtcnn_onet"]
DEFAULT_CACHE = Path(os.path.expanduser("~/.cache/quantopt-bench"))

PPOCR_REC = ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx")
PPOCR_DET = ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx")
PPOCR6_REC = ("rapidocr", "models/PP-OCRv6_rec_small.onnx")
PPOCR6_DET = ("rapidocr", "models/PP-OCRv6_det_small.onnx")


MODEL_DIR = os.environ.get("QUANTOPT_BENCH_MODEL_DIR", "")
"""A folder holding copies of the packaged model files (by file name), for a machine without the packages."""


def packaged_file(package: str, relative: str) -> Optional[Path]:
    """A data file inside an installed package, found without importing it (its runtime dependencies, opencv and
    friends, need not be installed), else a copy in $QUANTOPT_BENCH_MODEL_DIR; None when neither is there."""
    if MODEL_DIR and Path(MODEL_DIR, Path(relative).name).is_file():
        return Path(MODEL_DIR, Path(relative).name)
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root, *relative.split("/"))
        if path.is_file():
            return path
    return None


def text_page(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A light page with dark glyph-like blocks in a few lines, RGB [h, w, 3] in 0..255: closer to what an OCR model
    sees than uniform noise, which drives some activations to unusual ranges."""
    img = np.full((h, w, 3), 230.0, np.float32) + rng.normal(0, 8, (h, w, 3)).astype(np.float32)
    lines = max(1, h // 48)
    for i in range(lines):
        size = max(6, int(h / lines * rng.uniform(0.4, 0.7)))
        y = int(i * h / lines + rng.integers(0, max(1, h // lines - size)))
        x = int(rng.integers(0, max(1, w // 8)))
        while x + size < w - 2 and rng.random() < 0.95:
            gw = int(size * rng.uniform(0.5, 1.0))
            glyph = rng.random((size, gw)) < 0.45
            img[y:y + size, x:x + gw][glyph] = rng.uniform(0, 70)
            x += gw + int(rng.integers(1, max(2, size // 3)))
    return np.clip(img, 0, 255)


def ppocr_rec_input(rng: np.random.Generator, width: int) -> np.ndarray:
    """One 1x3x48xW recognizer input, normalized as PaddleOCR does: (x / 255 - 0.5) / 0.5."""
    img = text_page(rng, 48, width)
    return ((img / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None].astype(np.float32)


def ppocr_det_input(rng: np.random.Generator, size: int) -> np.ndarray:
    """One 1x3xSxS detector input, normalized with ImageNet mean/std as the detector's preprocessing does."""
    img = text_page(rng, size, size) / 255.0
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)
    return ((img - mean) / std).transpose(2, 0, 1)[None].astype(np.float32)


def seeded_inputs(graph: Any, rng: np.random.Generator) -> List[Any]:
    """One random input per graph input: normal floats; token ids in [0, 64); masks ones with the last quarter 0."""
    import torch

    feeds = []
    for t in graph.input_tensors:
        shape = [int(d) for d in t.ir_shape]
        if t.ir_dtype.torch_dtype.is_floating_point:
            feeds.append(torch.from_numpy(rng.normal(0, 1, shape).astype(np.float32)))
        elif "mask" in t.name:
            mask = np.ones(shape, np.int64)
            mask[..., shape[-1] * 3 // 4:] = 0
            feeds.append(torch.from_numpy(mask).to(t.ir_dtype.torch_dtype))
        else:
            feeds.append(torch.from_numpy(rng.integers(0, 64, shape)).to(t.ir_dtype.torch_dtype))
    return feeds


def least_cpu(repeat: int, fn: Callable[[], Any], warmup: int = 1) -> float:
    """Least CPU seconds (time.process_time: the machine may be shared) of `repeat` calls of `fn` after `warmup`
    untimed ones."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best
