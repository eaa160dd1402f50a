"""Train a small CNN on scikit-learn's digits and export it as a float Compass IR plus calibration/validation data.

Why: the bundled example needs a real model on real data that anyone can regenerate in seconds on a laptop CPU,
with no download (the 1797 8x8 digits ship inside scikit-learn). The IR is written the way the Compass Parser
writes an NCHW (ONNX/PyTorch) model: an NCHW `Input`, a `Transpose` to NHWC, then NHWC layers with OHWI weights.

Run from anywhere: `python examples/digits/train.py`. Everything is seeded, so a rerun rebuilds the same split,
and on the same torch build the same weights.
"""
from __future__ import annotations

import importlib.util
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if importlib.util.find_spec("quantopt") is None:  # running from a source checkout without `pip install`
    sys.path.insert(0, str(REPO))

from quantopt.graph.builder import GraphBuilder  # noqa: E402
from quantopt.graph.graph import PyGraph  # noqa: E402
from quantopt.ir.reader import read_ir  # noqa: E402
from quantopt.ir.writer import write_ir  # noqa: E402

SEED = 0
NUM_TRAIN = 1200
NUM_CALIB = 64
EPOCHS = 20
BATCH = 32
LR = 1e-2
MIN_ACCURACY = 0.95
MODEL_DIR = HERE / "model"
DATA_DIR = HERE / "data"


class DigitsNet(nn.Module):
    """~4.2k parameters: 8x8 → conv8 → conv16 → maxpool → conv16 → avgpool (2x2x16 = 64 features) → fc10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.conv3 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(64, 10)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.avg_pool2d(F.relu(self.conv3(x)), 2)
        return self.fc(torch.flatten(x, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits(x), dim=1)


def load_split() -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A fixed seeded permutation of all 1797 digits: the first 1200 train, the other 597 are held out."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = digits.target.astype(np.int64)
    perm = np.random.RandomState(SEED).permutation(len(x))
    train, val = perm[:NUM_TRAIN], perm[NUM_TRAIN:]
    return x[train], y[train], x[val], y[val]


def accuracy(model: DigitsNet, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        pred = model(torch.from_numpy(x)).argmax(dim=1).numpy()
    return float((pred == y).mean())


def train(x: np.ndarray, y: np.ndarray, x_val: np.ndarray, y_val: np.ndarray) -> DigitsNet:
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    model = DigitsNet()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, EPOCHS)
    gen = torch.Generator().manual_seed(SEED)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for epoch in range(EPOCHS):
        model.train()
        order = torch.randperm(len(xt), generator=gen)
        for i in range(0, len(xt), BATCH):
            idx = order[i:i + BATCH]
            loss = F.cross_entropy(model.logits(xt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
        if (epoch + 1) % 5 == 0:
            model.eval()
            acc = accuracy(model, x_val, y_val)
            print(f"epoch {epoch + 1:3d}: loss {loss.item():.4f}, held-out accuracy {acc:.4f}")
    model.eval()
    return model


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)


def _conv(b: GraphBuilder, name: str, x: str, conv: nn.Conv2d, in_shape: List[int]) -> Tuple[str, List[int]]:
    n, h, w, _ = in_shape
    out_shape = [n, h, w, conv.out_channels]  # 3x3, stride 1, pad 1 keeps H and W
    top = b.layer("Convolution", [x], [out_shape], name=name, outputs=[name + "_0"],
                  constants=OrderedDict(weights=_np(conv.weight.permute(0, 2, 3, 1)), biases=_np(conv.bias)),
                  params=OrderedDict(num_output=conv.out_channels, kernel_x=3, kernel_y=3, stride_x=1, stride_y=1,
                                     pad_left=1, pad_right=1, pad_top=1, pad_bottom=1, dilation_x=1, dilation_y=1,
                                     group=1, with_activation="RELU"))
    return top, out_shape


def _pool(b: GraphBuilder, name: str, x: str, method: str, in_shape: List[int]) -> Tuple[str, List[int]]:
    n, h, w, c = in_shape
    out_shape = [n, h // 2, w // 2, c]
    params = OrderedDict(kernel_x=2, kernel_y=2, stride_x=2, stride_y=2, pad_left=0, pad_right=0, pad_top=0,
                         pad_bottom=0, dilation_x=1, dilation_y=1, method=method, ceil_mode=False)
    if method == "AVG":
        params["count_include_pad"] = False
    return b.layer("Pooling", [x], [out_shape], name=name, outputs=[name + "_0"], params=params), out_shape


def fc_weights_nhwc(fc: nn.Linear, c: int, h: int, w: int) -> np.ndarray:
    """torch flattens NCHW as (c, h, w); the IR's Reshape flattens NHWC as (h, w, c): reorder the FC columns."""
    out = fc.weight.shape[0]
    return _np(fc.weight.reshape(out, c, h, w).permute(0, 2, 3, 1).reshape(out, c * h * w))


def build_ir(model: DigitsNet) -> PyGraph:
    """The float graph exactly as the Compass Parser lays out an NCHW model."""
    b = GraphBuilder("digits")
    x = b.input("input_0", [1, 1, 8, 8], layer_name="input")
    x = b.layer("Transpose", [x], [[1, 8, 8, 1]], name="input_post_transpose",
                outputs=["input_post_transpose_0"], params={"perm": [0, 2, 3, 1]})
    shape = [1, 8, 8, 1]
    x, shape = _conv(b, "/conv1/Conv", x, model.conv1, shape)
    x, shape = _conv(b, "/conv2/Conv", x, model.conv2, shape)
    x, shape = _pool(b, "/MaxPool", x, "MAX", shape)
    x, shape = _conv(b, "/conv3/Conv", x, model.conv3, shape)
    x, shape = _pool(b, "/AveragePool", x, "AVG", shape)
    _, h, w, c = shape
    features = h * w * c
    x = b.layer("Reshape", [x], [[1, features]], name="/Flatten", outputs=["/Flatten_0"],
                params={"shape": [1, features]})
    x = b.layer("FullyConnected", [x], [[1, 10]], name="/fc/Gemm", outputs=["/fc/Gemm_0"],
                constants=OrderedDict(weights=fc_weights_nhwc(model.fc, c, h, w), biases=_np(model.fc.bias)),
                params=OrderedDict(num_output=10, with_activation="NONE"))
    x = b.layer("Softmax", [x], [[1, 10]], name="/Softmax", outputs=["/Softmax_0"], params={"axis": 1})
    graph = b.build([x])
    graph.header = OrderedDict(model_name="digits", model_domain="image_classification",
                               layer_number=len(graph.nodes), precision="float32",
                               input_tensors=["input_0"], output_tensors=[x])
    return graph


def expected_constants(model: DigitsNet) -> Dict[str, np.ndarray]:
    """What each IR constant must equal, derived straight from the torch parameters."""
    out: Dict[str, np.ndarray] = {}
    for layer, conv in (("/conv1/Conv", model.conv1), ("/conv2/Conv", model.conv2), ("/conv3/Conv", model.conv3)):
        out[layer + "weights"] = _np(conv.weight.permute(0, 2, 3, 1))
        out[layer + "biases"] = _np(conv.bias)
    out["/fc/Gemmweights"] = fc_weights_nhwc(model.fc, 16, 2, 2)
    out["/fc/Gemmbiases"] = _np(model.fc.bias)
    return out


def verify_ir(model: DigitsNet, x_val: np.ndarray) -> None:
    """Re-read the written IR: constants must be the torch weights bit for bit; and once quantopt has the float
    operators registered, its forward must reproduce the torch softmax."""
    from quantopt.registry import discover_plugins, forward_function

    graph = read_ir(str(MODEL_DIR / "digits.txt"))
    consts = {t.name: t.betensor.numpy() for n in graph.nodes for t in n.constants.values()}
    expected = expected_constants(model)
    assert sorted(consts) == sorted(expected), (sorted(consts), sorted(expected))
    for name, value in expected.items():
        np.testing.assert_array_equal(consts[name], value, err_msg=name)
    print(f"IR re-read: {len(graph.nodes)} layers, {len(consts)} constants equal to the torch weights")

    discover_plugins()
    missing = sorted({str(n.type) for n in graph.nodes if forward_function(str(n.type)) is None})
    if missing:
        print(f"quantopt float forward not checked: no forward registered for {missing}")
        return
    with torch.no_grad():
        ref = model(torch.from_numpy(x_val[:64])).numpy()
    got = graph.forward([torch.from_numpy(x_val[:64])])[0].numpy()
    err = float(np.abs(got - ref).max())
    assert err <= 1e-5, f"quantopt float forward differs from torch by {err}"
    print(f"quantopt float forward matches torch on 64 held-out samples (max abs diff {err:.2e})")


def main() -> None:
    torch.set_num_threads(1)  # a 4k-parameter net on 8x8 images: thread overhead outweighs any speed-up
    x_train, y_train, x_val, y_val = load_split()
    model = train(x_train, y_train, x_val, y_val)
    acc = accuracy(model, x_val, y_val)
    if acc < MIN_ACCURACY:
        raise SystemExit(f"held-out accuracy {acc:.4f} is below {MIN_ACCURACY}; not writing the example")

    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    write_ir(build_ir(model), str(MODEL_DIR / "digits.txt"), str(MODEL_DIR / "digits.bin"))
    np.save(DATA_DIR / "calib.npy", np.ascontiguousarray(x_train[:NUM_CALIB], dtype=np.float32))
    np.save(DATA_DIR / "val.npy", np.ascontiguousarray(x_val, dtype=np.float32))
    np.save(DATA_DIR / "val_label.npy", np.ascontiguousarray(y_val, dtype=np.int64))
    verify_ir(model, x_val)
    print(f"torch float top-1 accuracy on the {len(y_val)} held-out digits: {acc:.4f}")


if __name__ == "__main__":
    main()
