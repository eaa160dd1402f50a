"""Export the small ONNX models of the Parser-parity test (tests/test_onnx_parser_parity.py) from torch, with seeded
weights, into this folder:

    python tests/data/onnx_small/make_models.py [out_dir [name,name,...]]

- `bert_encoder.onnx` (opset 14): a BERT-style encoder with `input_ids` and an `attention_mask` input (int64, the
  mask turned into an additive bias as BERT does), word/position embeddings, LayerNorm written out as
  ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add (opset < 17), softmax attention, GELU in the Erf form and a
  tanh pooler;
- `mobilenetv3_block.onnx` (opset 14): MobileNetV3-like blocks: conv-BN-hardswish as the HardSwish op and written
  out as x*relu6(x+3)/6, hardsigmoid as the HardSigmoid op and as relu6(x+3)/6, depthwise convolutions, SE,
  a BatchNorm after a ReLU, a per-channel scale and shift after an activation, SiLU x*sigmoid(x) and swish
  x*sigmoid(1.5x);
- `transformer_tanh.onnx` (opset 17): a transformer block with a float attention mask, the ONNX LayerNormalization
  op, GELU in the tanh form and a SiLU feed-forward.
- `resnet18_like.onnx` (opset 13), `unet.onnx` (opset 13): ResNet-18's layout at small widths; a two-level U-Net;
- `vit_tiny.onnx` (opset 17): patch convolution, class token, pre-LN blocks (LayerNormalization op), Erf GELU;
- `gpt2_like.onnx` (opset 14): pre-LN decoder blocks with a causal mask (Trilu + Where), tanh GELU, an LM head;
- `lstm_model.onnx`, `gru_model.onnx` (opset 14): a projection, one LSTM / GRU layer and a per-step head;
- `dynamo_ops.onnx`, `dynamo_attention.onnx` (opset 20): made by torch's dynamo exporter (`torch.onnx.export`'s
  default since torch 2.9; it needs the `onnxscript` package), which writes other forms: an adaptive average pool
  to a size that does not divide the map as GatherND and ReduceMean, PixelShuffle as DepthToSpace, F.normalize as
  ReduceL2/Clip/Expand/Div, Mish and Gelu as the ONNX operators, and an einsum kept as Einsum; the second has
  nn.MultiheadAttention, nn.RMSNorm, tanh GELU, Softplus, CumSum and LeakyReLU.
- `vision_ops.onnx` (opset 17): F.grid_sample by a grid computed from the input (reaching outside [-1, 1],
  reflection padding), torch.triu of an activation (Trilu), an index computed from activations (Sigmoid, Mul,
  Cast to int64, Clip) that a torch.gather (GatherElements) reads, and a Pow by 3.

The committed files were made with torch 2.13 (TorchScript exporter, but for the two dynamo ones); another torch
version may spell some patterns differently, which is why the files themselves are committed.
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn
from torch.nn import functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------------------------------ BERT
class _SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.q, self.k, self.v, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.dh).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.dh) + bias
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).contiguous()
        return self.out(ctx.view(x.shape))


class _BertLayer(nn.Module):
    def __init__(self, d: int, heads: int, ff: int, act: nn.Module) -> None:
        super().__init__()
        self.att = _SelfAttention(d, heads)
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-12), nn.LayerNorm(d, eps=1e-12)
        self.ff1, self.ff2, self.act = nn.Linear(d, ff), nn.Linear(ff, d), act

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.att(x, bias))
        return self.ln2(x + self.ff2(self.act(self.ff1(x))))


class BertEncoder(nn.Module):
    def __init__(self, vocab: int = 100, tokens: int = 16, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.word, self.pos = nn.Embedding(vocab, d), nn.Embedding(tokens, d)
        self.ln = nn.LayerNorm(d, eps=1e-12)
        self.layers = nn.ModuleList([_BertLayer(d, heads, 2 * d, nn.GELU()) for _ in range(layers)])
        self.pooler = nn.Linear(d, d)
        self.register_buffer("positions", torch.arange(tokens)[None], persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        x = self.ln(self.word(input_ids) + self.pos(self.positions))
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, bias)
        return x, torch.tanh(self.pooler(x[:, 0]))


# ------------------------------------------------------------------------------------------------ MobileNetV3
def _hswish_explicit(x: torch.Tensor) -> torch.Tensor:
    return x * F.relu6(x + 3.0) / 6.0


def _hsigmoid_explicit(x: torch.Tensor) -> torch.Tensor:
    return F.relu6(x + 3.0) / 6.0


class _SE(nn.Module):
    def __init__(self, c: int, explicit: bool) -> None:
        super().__init__()
        self.reduce, self.expand, self.explicit = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1), explicit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.expand(F.relu(self.reduce(F.adaptive_avg_pool2d(x, 1))))
        return x * (_hsigmoid_explicit(s) if self.explicit else F.hardsigmoid(s))


class _Block(nn.Module):
    def __init__(self, cin: int, mid: int, cout: int, stride: int, act: Callable, se: int) -> None:
        super().__init__()
        self.expand, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.dw, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid)
        self.se = _SE(mid, se == 2) if se else None
        self.project, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.act, self.residual = act, stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn2(self.dw(self.act(self.bn1(self.expand(x))))))
        if self.se is not None:
            y = self.se(y)
        y = self.bn3(self.project(y))
        return x + y if self.residual else y


class MobileNetV3Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.stem_bn = nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16)
        self.blocks = nn.Sequential(_Block(16, 32, 16, 1, F.hardswish, 1), _Block(16, 48, 24, 2, _hswish_explicit, 2),
                                    _Block(24, 48, 24, 1, F.silu, 0))
        self.post_bn = nn.BatchNorm2d(24)
        self.scale = nn.Parameter(torch.rand(1, 24, 1, 1) + 0.5)
        self.shift = nn.Parameter(torch.rand(1, 24, 1, 1) - 0.5)
        self.head = nn.Conv2d(24, 32, 1)
        self.fc1, self.fc2 = nn.Linear(32, 40), nn.Linear(40, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _hswish_explicit(self.stem_bn(self.stem(x)))
        x = self.post_bn(F.relu(self.blocks(x)))       # a BatchNorm that follows no convolution
        x = F.relu6(x) * self.scale + self.shift        # a per-channel scale and shift after an activation
        h = self.head(x)
        x = h * torch.sigmoid(1.5 * h)                   # swish with beta 1.5
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc2(F.hardswish(self.fc1(x)))


# ------------------------------------------------------------------------------------------------ transformer (tanh)
class TransformerTanh(nn.Module):
    def __init__(self, features: int = 24, tokens: int = 16, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embed, self.ln0 = nn.Linear(features, d), nn.LayerNorm(d)
        self.att = _SelfAttention(d, heads)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff1, self.ff2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.ff3, self.ff4 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.ln0(self.embed(x))
        bias = (1.0 - mask[:, None, None, :]) * -1e4
        x = self.ln1(x + self.att(x, bias))
        x = x + self.ff2(F.gelu(self.ff1(x), approximate="tanh"))
        x = self.ln2(x + self.ff4(F.silu(self.ff3(x))))
        return self.head(x)


# ------------------------------------------------------------------------------------------------ ResNet-18-like
class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet18Like(nn.Module):
    """ResNet-18's layout (stem conv + max pool, four stages of two basic blocks, average pool, fc) at small widths."""

    def __init__(self, widths: Tuple[int, ...] = (8, 16, 24, 32), classes: int = 10) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0])
        blocks, cin = [], widths[0]
        for k, w in enumerate(widths):
            blocks += [_BasicBlock(cin, w, 1 if k == 0 else 2), _BasicBlock(w, w, 1)]
            cin = w
        self.blocks, self.fc = nn.Sequential(*blocks), nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.stem(x))), 3, 2, 1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(x), 1), 1))


# ------------------------------------------------------------------------------------------------ ViT-tiny-like
class _PreLNBlock(nn.Module):
    def __init__(self, d: int, heads: int, gelu: str = "none") -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
        self.att = _SelfAttention(d, heads)
        self.ff1, self.ff2, self.gelu = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), gelu

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.att(self.ln1(x), bias)
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x)), approximate=self.gelu))


class ViTTiny(nn.Module):
    """Patch convolution, a class token, learned positions, pre-LN blocks with Erf GELU, a head on the class token."""

    def __init__(self, image: int = 32, patch: int = 8, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, patch)
        tokens = (image // patch) ** 2 + 1
        self.cls, self.pos = nn.Parameter(torch.randn(1, 1, d) * 0.1), nn.Parameter(torch.randn(1, tokens, d) * 0.1)
        self.blocks = nn.ModuleList([_PreLNBlock(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d, eps=1e-6), nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x, torch.zeros(()))
        return self.head(self.ln(x)[:, 0])


# ------------------------------------------------------------------------------------------------ GPT-2-like
class GPT2Like(nn.Module):
    """Token and position embeddings, pre-LN decoder blocks with a causal mask (torch.tril of ones made in the forward,
    applied with masked_fill: Trilu/Where in the export), tanh GELU, a final LayerNorm and a tied-free LM head."""

    def __init__(self, vocab: int = 64, tokens: int = 16, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.word, self.pos = nn.Embedding(vocab, d), nn.Embedding(tokens, d)
        self.blocks = nn.ModuleList([_PreLNBlock(d, heads, "tanh") for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.register_buffer("positions", torch.arange(tokens)[None], persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.word(input_ids) + self.pos(self.positions[:, :t])
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        bias = torch.zeros(t, t).masked_fill(~causal, -1e4)[None, None]
        for block in self.blocks:
            x = block(x, bias)
        return self.head(self.ln(x))


# ------------------------------------------------------------------------------------------------ U-Net
def _double_conv(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    """Two down levels (max pool), a bottleneck, two up levels (ConvTranspose + skip Concat), a 1x1 head."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.d1, self.d2, self.mid = _double_conv(3, c), _double_conv(c, 2 * c), _double_conv(2 * c, 4 * c)
        self.up2, self.u2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, 2), _double_conv(4 * c, 2 * c)
        self.up1, self.u1 = nn.ConvTranspose2d(2 * c, c, 2, 2), _double_conv(2 * c, c)
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.d1(x)
        s2 = self.d2(F.max_pool2d(s1, 2))
        m = self.mid(F.max_pool2d(s2, 2))
        y = self.u2(torch.cat([self.up2(m), s2], dim=1))
        y = self.u1(torch.cat([self.up1(y), s1], dim=1))
        return torch.sigmoid(self.head(y))


# ------------------------------------------------------------------------------------------------ LSTM / GRU
class RecurrentModel(nn.Module):
    """A linear input projection, one unidirectional LSTM or GRU layer (batch first) and a linear head per step."""

    def __init__(self, cell: str, features: int = 12, hidden: int = 24, classes: int = 5) -> None:
        super().__init__()
        self.proj = nn.Linear(features, hidden)
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(torch.tanh(self.proj(x)))
        return self.head(y)


# ------------------------------------------------------------------------------------------------ export
def _randomise(model: nn.Module) -> nn.Module:
    """BatchNorm statistics and affine parameters away from identity, so that folding them is exercised."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
    return model.eval()


def _bert_inputs() -> Tuple[torch.Tensor, ...]:
    ids = torch.randint(0, 100, (1, 16))
    mask = torch.ones(1, 16, dtype=torch.int64)
    mask[:, 12:] = 0
    return ids, mask


def _tanh_inputs() -> Tuple[torch.Tensor, ...]:
    mask = torch.ones(1, 16)
    mask[:, 13:] = 0
    return torch.randn(1, 16, 24), mask


MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable[[], Tuple[torch.Tensor, ...]], List[str], List[str], int]] = {
    "bert_encoder": (BertEncoder, _bert_inputs, ["input_ids", "attention_mask"], ["sequence", "pooled"], 14),
    "mobilenetv3_block": (MobileNetV3Block, lambda: (torch.randn(1, 3, 32, 32),), ["x"], ["y"], 14),
    "transformer_tanh": (TransformerTanh, _tanh_inputs, ["x", "mask"], ["y"], 17),
    "resnet18_like": (ResNet18Like, lambda: (torch.randn(1, 3, 64, 64),), ["x"], ["y"], 13),
    "vit_tiny": (ViTTiny, lambda: (torch.randn(1, 3, 32, 32),), ["x"], ["y"], 17),
    "gpt2_like": (GPT2Like, lambda: (torch.randint(0, 64, (1, 16)),), ["input_ids"], ["logits"], 14),
    "unet": (UNet, lambda: (torch.randn(1, 3, 32, 32),), ["x"], ["y"], 13),
    "lstm_model": (lambda: RecurrentModel("lstm"), lambda: (torch.randn(1, 10, 12),), ["x"], ["y"], 14),
    "gru_model": (lambda: RecurrentModel("gru"), lambda: (torch.randn(1, 10, 12),), ["x"], ["y"], 14),
}
"""name → (model, example inputs, input names, output names, opset)."""


class DynamoOps(nn.Module):
    """Layers whose dynamo export differs from the TorchScript one (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.prelu = nn.PReLU(16)
        self.pool = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.shuffle = nn.PixelShuffle(2)
        self.conv1d = nn.Conv1d(2, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        y = self.up(self.pool(self.prelu(self.conv(x))))
        y = self.shuffle(torch.cat([y, y * 0.5], 1))
        y = F.adaptive_avg_pool2d(F.pad(y, (1, 1, 1, 1), mode="reflect"), (4, 4))  # 34 -> 4: GatherND
        y = F.interpolate(y, size=(8, 8), mode="nearest")
        a, b = y.chunk(2, dim=1)
        y = F.normalize(torch.where(a > 0, a, F.elu(b)).flatten(2), dim=-1)
        z = self.conv1d(y[:, :, :2].transpose(1, 2).reshape(1, 2, -1))
        return F.mish(z).softmax(-1), y.argmax(-1)


class DynamoAttention(nn.Module):
    """Attention, RMSNorm and an einsum as the dynamo exporter writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = nn.RMSNorm(32)
        self.fc = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        y, _ = self.mha(x, x, x, need_weights=False)
        y = F.gelu(self.fc(self.norm(y + x)), approximate="tanh")
        y = torch.einsum("btd,bsd->bts", y, x)
        return F.softplus(y).cumsum(-1), F.leaky_relu(y, 0.2).amax(-1)


class VisionOps(nn.Module):
    """GridSample, Trilu of an activation, an index computed from activations, a Pow by 3 (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.offset = nn.Conv2d(3, 2, 3, padding=1)
        self.table = nn.Parameter(torch.randn(1, 8, 6))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        f = F.relu(self.conv(x))
        grid = torch.tanh(self.offset(x)).permute(0, 2, 3, 1) * 1.2
        s = F.grid_sample(f, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
        index = (torch.sigmoid(s.mean((2, 3))) * 6).long().clamp(max=5)
        picked = torch.gather(self.table, 2, index[..., None]).squeeze(-1)
        return torch.triu(s.mean(1)).pow(3), picked


MODELS["dynamo_ops"] = (DynamoOps, lambda: (torch.randn(1, 3, 32, 32),), ["x"], ["probabilities", "peak_position"], 20)
MODELS["dynamo_attention"] = (DynamoAttention, lambda: (torch.randn(1, 10, 32),), ["x"], ["scores", "peak_score"], 20)
MODELS["vision_ops"] = (VisionOps, lambda: (torch.randn(1, 3, 12, 12),), ["x"], ["triangle", "picked"], 17)
DYNAMO = {"dynamo_ops", "dynamo_attention"}
"""The models exported by torch's dynamo exporter (the others: the TorchScript one)."""


def export(name: str, out_dir: str = HERE, seed: int = 0) -> str:
    """Export model `name` with weights drawn from `seed`; returns the .onnx path."""
    make, inputs, in_names, out_names, opset = MODELS[name]
    torch.manual_seed(seed)
    model = _randomise(make())
    path = os.path.join(out_dir, f"{name}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs(), path, input_names=in_names, output_names=out_names, opset_version=opset,
                          dynamo=name in DYNAMO)
    if os.path.isfile(path + ".data"):  # the dynamo exporter writes the weights beside the model: taken back in
        import onnx

        onnx.save(onnx.load(path), path, save_as_external_data=False)
        os.remove(path + ".data")
    return path


def main(argv: List[str]) -> int:
    out_dir = argv[0] if argv else HERE
    os.makedirs(out_dir, exist_ok=True)
    names = argv[1].split(",") if len(argv) > 1 else list(MODELS)
    for name in names:
        path = export(name, out_dir)
        print(f"{path}: {os.path.getsize(path)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
