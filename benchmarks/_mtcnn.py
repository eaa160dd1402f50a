"""MTCNN's three networks (PNet, RNet, ONet of facenet-pytorch) as ONNX files, exported once into a cache folder from
the state dicts inside the installed `facenet-pytorch` package (offline; the package itself is not imported, it needs
torchvision). ONet is the accuracy benchmark's export (benchmarks/accuracy/models.py, 48x48); PNet and RNet are
rebuilt here with facenet-pytorch's layer names so its state dicts load into them.

Nothing here is part of the quantopt package; facenet-pytorch is a benchmark extra (benchmarks/requirements.txt).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _bench_common import packaged_file  # noqa: E402  (the benchmarks folder is not a package)

PNET_SIZE = 48
"""PNet is fully convolutional; it is exported at the 48x48 of ONet's input (a 19x19 map of face scores)."""
RNET_SIZE = 24
INSTALL = "pip install --no-deps facenet-pytorch==2.6.0"


class Unavailable(Exception):
    """facenet-pytorch (and so the state dicts) is not installed."""


def _pnet() -> Any:
    import torch
    from torch import nn

    class PNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.prelu1 = nn.Conv2d(3, 10, 3), nn.PReLU(10)
            self.pool1 = nn.MaxPool2d(2, 2, ceil_mode=True)
            self.conv2, self.prelu2 = nn.Conv2d(10, 16, 3), nn.PReLU(16)
            self.conv3, self.prelu3 = nn.Conv2d(16, 32, 3), nn.PReLU(32)
            self.conv4_1, self.conv4_2 = nn.Conv2d(32, 2, 1), nn.Conv2d(32, 4, 1)

        def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
            x = self.pool1(self.prelu1(self.conv1(x)))
            x = self.prelu3(self.conv3(self.prelu2(self.conv2(x))))
            return self.conv4_2(x), torch.softmax(self.conv4_1(x), dim=1)

    return PNet()


def _rnet() -> Any:
    import torch
    from torch import nn

    class RNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.prelu1 = nn.Conv2d(3, 28, 3), nn.PReLU(28)
            self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
            self.conv2, self.prelu2 = nn.Conv2d(28, 48, 3), nn.PReLU(48)
            self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
            self.conv3, self.prelu3 = nn.Conv2d(48, 64, 2), nn.PReLU(64)
            self.dense4, self.prelu4 = nn.Linear(576, 128), nn.PReLU(128)
            self.dense5_1, self.dense5_2 = nn.Linear(128, 2), nn.Linear(128, 4)

        def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
            x = self.pool1(self.prelu1(self.conv1(x)))
            x = self.pool2(self.prelu2(self.conv2(x)))
            x = self.prelu3(self.conv3(x)).permute(0, 3, 2, 1).contiguous()
            x = self.prelu4(self.dense4(x.view(x.shape[0], -1)))
            return self.dense5_2(x), torch.softmax(self.dense5_1(x), dim=1)

    return RNet()


def _export(net: Any, weights: str, size: int, out: Path) -> Path:
    import torch

    net.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    net.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.onnx")
    torch.onnx.export(net, (torch.zeros(1, 3, size, size),), str(tmp), input_names=["x"],
                      output_names=["box", "prob"], dynamo=False, opset_version=17)
    tmp.replace(out)
    return out


def export(which: str, cache: Path) -> Path:
    """The ONNX file of `which` ('pnet', 'rnet' or 'onet') in `cache`, exported on first use (batch 1, opset 17)."""
    if which == "onet":
        spec = importlib.util.spec_from_file_location("_accuracy_models", HERE / "accuracy" / "models.py")
        models = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(models)
        try:
            return models.export_onet(cache)
        except models.Unavailable as e:
            raise Unavailable(str(e)) from e
    if which not in ("pnet", "rnet"):
        raise ValueError(f"unknown MTCNN network {which!r} (pnet, rnet or onet)")
    size = PNET_SIZE if which == "pnet" else RNET_SIZE
    out = cache / f"mtcnn_{which}_{size}x{size}_opset17.onnx"
    if out.is_file():
        return out
    weights = packaged_file("facenet_pytorch", f"data/{which}.pt")
    if weights is None:
        raise Unavailable(f"facenet-pytorch is not installed ({INSTALL})")
    return _export(_pnet() if which == "pnet" else _rnet(), str(weights), size, out)
