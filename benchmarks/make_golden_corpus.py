"""Regenerate the golden corpus under tests/data/golden_corpus/: small seeded torch models, their float IR made by
the upstream Compass Unified Parser and the upstream Compass Optimizer's quantized IRs for the cfg variants A/B/C.

    python benchmarks/make_golden_corpus.py [--out DIR] [--only NAME[,NAME...]] [--upstream DIR] [--keep DIR]

Needs the upstream tools only to regenerate: `run-parser.sh` and `run-opt.sh` of the upstream folder (default
../shared/upstream beside the repository, or $QUANTOPT_UPSTREAM, or --upstream), with their venvs set up; the script
exits with code 2 and says so when they are missing. Upstream is only ever run as a separate program; the tests read
the committed files and never need it.

Per model the folder `<out>/<name>/` gets:
- `<name>.onnx` (torch export, opset 14, `dynamo=False`) and the Parser's float IR `<name>.txt` / `<name>.bin`;
- `calib.npy` (one input) or `calib.npz` (one array per input, in the IR's input order): 8 seeded samples;
- `golden/{A,B,C}/opt.cfg` (paths relative to that folder) with upstream's `<name>_o.txt/.bin` and
  `<name>_opt_template.json`. A: defaults; B: per-channel symmetric weights, asymmetric activations, `extrema`;
  C: 16 bits, `lut_items_in_bits = 10` (the variants of the shared reference models). Where upstream's optimizer
  fails on a variant, `golden/<variant>/upstream_failed.txt` holds its error lines instead of a golden.

Upstream's multi-input dataset plugin reads the .npz as it is (it asks the loaded file for its keys), so the same cfg
text serves both tools. `floors.json` (the regression floors of tests/test_golden_corpus.py) is not written here but by
`python benchmarks/golden_corpus_report.py --write-floors`, which measures quantopt on the corpus.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from golden_cases import IrCase, ir_cases
from torch import nn
from torch.nn import functional as F

from quantopt.ir.writer import write_ir

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "golden_corpus"
DEFAULT_UPSTREAM = Path(os.environ.get("QUANTOPT_UPSTREAM", ROOT.parent / "shared" / "upstream"))
OPSET = 14
SAMPLES = 8
TIMEOUT_S = 900
FAILED_NOTE = "upstream_failed.txt"
"""Written in golden/<variant>/ instead of the golden IR when upstream's optimizer fails on that variant."""

VARIANTS: Dict[str, List[str]] = {
    "A": ["quantize_method_for_weight = per_tensor_symmetric_restricted_range",
          "quantize_method_for_activation = per_tensor_symmetric_full_range"],
    "B": ["quantize_method_for_weight = per_channel_symmetric_restricted_range",
          "quantize_method_for_activation = per_tensor_asymmetric",
          "calibration_strategy_for_activation = extrema"],
    "C": ["weight_bits = 16", "activation_bits = 16", "lut_items_in_bits = 10"],
}
"""The cfg lines of each variant, as in the shared reference models' goldens."""


# --------------------------------------------------------------------------------------------------- the models


class Attention(nn.Module):
    """Multi-head self-attention written out (q/k/v projections, scaled scores, optional additive mask, softmax),
    so the export shows the MatMul/Transpose/Softmax pattern real encoder and decoder exports have."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) * (self.head_dim ** -0.5)
        if mask is not None:
            scores = scores + mask
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.o(ctx.transpose(1, 2).reshape(b, t, d))


class EncoderBlock(nn.Module):
    """Post-LN transformer encoder block (BERT style) with an additive attention mask input [B, 1, T, T]."""

    def __init__(self, dim: int = 32, heads: int = 4, ff: int = 64) -> None:
        super().__init__()
        self.attn = Attention(dim, heads)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ff), nn.GELU(), nn.Linear(ff, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x, mask))
        return self.ln2(x + self.ff(x))


class DecoderBlock(nn.Module):
    """Pre-LN GPT-style decoder block: a constant causal mask (large negative above the diagonal), GELU MLP, final
    LayerNorm and a small vocabulary head."""

    def __init__(self, dim: int = 32, heads: int = 4, ff: int = 64, seq: int = 16, vocab: int = 40) -> None:
        super().__init__()
        self.attn = Attention(dim, heads)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ff), nn.GELU(), nn.Linear(ff, dim))
        self.head = nn.Linear(dim, vocab)
        causal = torch.triu(torch.full((seq, seq), -1e4), diagonal=1)
        self.register_buffer("causal", causal.reshape(1, 1, seq, seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), self.causal)
        x = x + self.ff(self.ln2(x))
        return self.head(self.ln_f(x))


class Recurrent(nn.Module):
    """An LSTM or GRU (batch first; `layers` stacked, optionally bidirectional: the Parser writes one layer per
    direction and a Split of the zero states) and a per-step classifier."""

    def __init__(self, cell: str, features: int = 16, hidden: int = 32, classes: int = 10, layers: int = 1,
                 bidirectional: bool = False) -> None:
        super().__init__()
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(features, hidden, num_layers=layers, batch_first=True,
                                                           bidirectional=bidirectional)
        self.fc = nn.Linear(hidden * (2 if bidirectional else 1), classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(x)
        return self.fc(y)


class SvtrTiny(nn.Module):
    """SVTR-like text recognizer: a strided conv stem (BN, hardswish), height pooled away, one pre-LN transformer
    block over the width positions, a classifier over 37 characters and a softmax."""

    def __init__(self, dim: int = 32, classes: int = 37) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.Hardswish(),
            nn.Conv2d(16, dim, 3, stride=(2, 1), padding=1), nn.BatchNorm2d(dim), nn.Hardswish(),
        )
        self.pool = nn.AvgPool2d((8, 1))
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, 2)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.fc = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(self.stem(x))  # [B, C, 1, W]
        y = y.flatten(2).transpose(1, 2)  # [B, W, C]
        y = y + self.attn(self.ln1(y))
        y = y + self.mlp(self.ln2(y))
        return torch.softmax(self.fc(self.ln_f(y)), dim=-1)


class DetHead(nn.Module):
    """FPN-like detection head: two strided conv stages, the deeper one upsampled (nearest Resize) and concatenated
    with the shallower, then a class map through a sigmoid and a box regression map."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU())
        self.c2 = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU())
        self.lat = nn.Conv2d(32, 16, 1)
        self.mix = nn.Sequential(nn.Conv2d(32, 16, 3, padding=1), nn.ReLU())
        self.cls = nn.Conv2d(16, 3, 1)
        self.box = nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        a = self.c1(x)
        b = nn.functional.interpolate(self.lat(self.c2(a)), scale_factor=2.0, mode="nearest")
        y = self.mix(torch.cat([a, b], dim=1))
        return torch.sigmoid(self.cls(y)), self.box(y)


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())


class UNetTiny(nn.Module):
    """Two-level U-Net: max pooling down, one ConvTranspose and one bilinear Resize up, skip concatenations and a
    per-pixel two-class output."""

    def __init__(self) -> None:
        super().__init__()
        self.e1, self.e2, self.mid = _double_conv(3, 8), _double_conv(8, 16), _double_conv(16, 32)
        self.up2 = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.d2 = _double_conv(32, 16)
        self.red1 = nn.Conv2d(16, 8, 1)
        self.d1 = _double_conv(16, 8)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.e1(x)
        e2 = self.e2(nn.functional.max_pool2d(e1, 2))
        m = self.mid(nn.functional.max_pool2d(e2, 2))
        d2 = self.d2(torch.cat([self.up2(m), e2], dim=1))
        up = nn.functional.interpolate(self.red1(d2), scale_factor=2.0, mode="bilinear", align_corners=False)
        return self.out(self.d1(torch.cat([up, e1], dim=1)))


class MobileNetV2Block(nn.Module):
    """MobileNetV2 stages: a strided stem, an inverted residual (1x1 expand, 3x3 depthwise, 1x1 project, each with
    BN and all but the projection with ReLU6), a strided one, global average pooling and a classifier. The fused
    ReLU6 keeps the convolutions' float64 sums in upstream's float forward."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        self.res = self._inverted(16, 48, 16, 1)
        self.down = self._inverted(16, 64, 24, 2)
        self.fc = nn.Linear(24, 10)

    @staticmethod
    def _inverted(cin: int, mid: int, cout: int, stride: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
                             nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid),
                             nn.ReLU6(), nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = self.down(y + self.res(y))
        return self.fc(y.mean((2, 3)))


class FusedActivations(nn.Module):
    """Convolutions followed by the activations the Parser fuses into them (LeakyReLU, PReLU) or keeps as layers
    (SiLU, HardSigmoid gating, ELU, Softplus, HardSwish)."""

    def __init__(self, ch: int = 8) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(ch, ch, 3, 1, 1) for _ in range(7))
        self.prelu = nn.PReLU(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.convs
        y = nn.functional.silu(c[0](x))
        y = nn.functional.hardsigmoid(c[1](y)) * y
        y = nn.functional.leaky_relu(c[2](y), 0.1)
        y = nn.functional.elu(c[3](y))
        y = self.prelu(c[4](y))
        y = nn.functional.softplus(c[5](y))
        return nn.functional.hardswish(c[6](y))


class Float64Flow(nn.Module):
    """Float64 values through the layers that keep their input's float type in upstream's float forward: a
    convolution without activation into Concat with its Negative, a reflect Pad, a convolution with fused ReLU6, a
    Clip, a bilinear Resize, a strided convolution into PReLU and a last 1x1 convolution, then a max over channels."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 8, 3, 1, 1), nn.Conv2d(16, 8, 3)
        self.c, self.d = nn.Conv2d(8, 8, 3, 2, 1), nn.Conv2d(8, 8, 1)
        self.prelu = nn.PReLU(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y = nn.functional.pad(torch.cat([y, -y], 1), (1, 1, 1, 1), mode="reflect")
        y = nn.functional.relu6(self.b(y)).clamp(-0.5, 0.7)
        y = nn.functional.interpolate(y, scale_factor=2.0, mode="bilinear", align_corners=False)
        y = self.d(self.prelu(self.c(y)))
        return y.amax(1, keepdim=True)
class Norms(nn.Module):
    """A convolution, GroupNorm (4 groups of 4 channels), ReLU, an affine InstanceNorm, ReLU and a closing
    convolution: the Parser's GroupNorm and InstanceNorm layers, and a convolution reading a normalized tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 16, 3, padding=1)
        self.gn = nn.GroupNorm(4, 16)
        self.inn = nn.InstanceNorm2d(16, affine=True)
        self.c2 = nn.Conv2d(16, 8, 3, padding=1)
        with torch.no_grad():  # away from the identity, so that gamma and beta matter
            for norm in (self.gn, self.inn):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.3, 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.inn(torch.relu(self.gn(self.c(x))))))
class LayerNorm2D(nn.Module):
    """Three-head attention (MatMuls reading permuted heads, Softmax, tanh GELU) closed by `nn.LayerNorm([6, 24])`:
    the Parser's LayerNorm over two axes with gamma/beta of shape [6, 24], quantized per channel along their last
    axis under B; input shape [1, 6, 24]."""

    def __init__(self, dim: int = 24, heads: int = 3) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.ln, self.fc = nn.LayerNorm([6, dim]), nn.Linear(dim, 4)
        with torch.no_grad():  # away from the identity, with columns of different ranges: per-channel gamma matters
            self.ln.weight.uniform_(0.5, 1.5).mul_(torch.linspace(0.5, 2.0, dim))
            self.ln.bias.uniform_(-0.3, 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        w = d // self.heads
        q = self.q(x).reshape(b, t, self.heads, w).permute(0, 2, 1, 3)
        k = self.k(x).reshape(b, t, self.heads, w).permute(0, 2, 3, 1)
        v = self.v(x).reshape(b, t, self.heads, w).permute(0, 2, 1, 3)
        a = torch.softmax(torch.matmul(q, k) * w ** -0.5, -1)
        y = torch.matmul(a, v).permute(0, 2, 1, 3).reshape(b, t, d)
        return self.fc(nn.functional.gelu(self.ln(x + y), approximate="tanh"))


class ElementwiseConst(nn.Module):
    """Element-wise layers with scalar constants: a Mul and Add the Parser folds into a BatchNorm, a Div by a constant
    (a Mul by its reciprocal, which `enable_pass_merge_matmul_mul` makes a BatchNorm), Square, Sqrt, Exp, Log, Clip,
    and reductions; input shape [1, 8, 32]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 2.5 + 1.0
        b = torch.sqrt(torch.abs(x) + 0.1)
        c = torch.exp(torch.clamp(x, -3, 2)) / 4.0
        d = torch.log(1 + x * x)
        e = a - b + c * d
        f = torch.clamp(e, -2.0, 3.0) ** 2
        return torch.cat([f.amax(-1, keepdim=True), f.sum(-1, keepdim=True), e.mean(-1, keepdim=True)], -1)


class CausalSDPA(nn.Module):
    """A pre-LN block around `scaled_dot_product_attention(is_causal=True)`: the export writes the causal mask as a
    constant of 0 and -inf added to the scores (a Where the Parser folds into a Constant), and the query/key scale
    as one Constant shared by two Muls."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.o, self.ln = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, -1)

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)

        a = nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(x)


class ViTTiny(nn.Module):
    """Vision transformer: 8x8 patch embedding, class token and learned positions, one pre-LN
    nn.TransformerEncoderLayer (GELU), final LayerNorm and a classifier on the class token."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 8, 8)
        self.pos = nn.Parameter(torch.randn(1, 16, dim) * 0.1)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.layer = nn.TransformerEncoderLayer(dim, heads, 64, dropout=0.0, activation="gelu", batch_first=True,
                                                norm_first=True)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        y = self.layer(torch.cat([self.cls.expand(y.shape[0], -1, -1), y], 1))
        return self.head(self.ln(y[:, 0]))


class ConvNeXtBlock(nn.Module):
    """ConvNeXt block: 4x4 patchify stem, 7x7 depthwise convolution, LayerNorm over channels (channels-last
    permute), pointwise MLP with GELU, per-channel layer scale, residual, pooled classifier."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, 4)
        self.dw = nn.Conv2d(dim, dim, 7, 1, 3, groups=dim)
        self.ln = nn.LayerNorm(dim)
        self.pw1, self.pw2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.rand(dim) * 0.5 + 0.1)
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.pw2(F.gelu(self.pw1(self.ln(self.dw(x).permute(0, 2, 3, 1))))) * self.gamma
        return self.head((x + y.permute(0, 3, 1, 2)).mean((2, 3)))


class MBConvSE(nn.Module):
    """EfficientNet MBConv: SiLU stem, expansion, 5x5 depthwise, squeeze-excitation (mean, SiLU, sigmoid gate),
    projection and residual."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.SiLU())
        self.exp = nn.Sequential(nn.Conv2d(16, 64, 1, bias=False), nn.BatchNorm2d(64), nn.SiLU())
        self.dw = nn.Sequential(nn.Conv2d(64, 64, 5, 1, 2, groups=64, bias=False), nn.BatchNorm2d(64), nn.SiLU())
        self.se1, self.se2 = nn.Conv2d(64, 4, 1), nn.Conv2d(4, 64, 1)
        self.proj = nn.Sequential(nn.Conv2d(64, 16, 1, bias=False), nn.BatchNorm2d(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.dw(self.exp(x))
        gate = torch.sigmoid(self.se2(F.silu(self.se1(y.mean((2, 3), keepdim=True)))))
        return x + self.proj(y * gate)


class YoloSPPF(nn.Module):
    """YOLOv5-like neck: SiLU convolutions, SPPF (three chained 5x5 stride-1 max pools and a Concat), nearest
    upsampling, Concat with the shallower map, sigmoid head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.SiLU())
        self.c2 = nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.SiLU())
        self.cv1, self.cv2 = nn.Conv2d(32, 16, 1), nn.Conv2d(64, 32, 1)
        self.out = nn.Conv2d(48, 3 * 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.c1(x)
        y = F.silu(self.cv1(self.c2(a)))
        p1 = F.max_pool2d(y, 5, 1, 2)
        p2 = F.max_pool2d(p1, 5, 1, 2)
        y = F.silu(self.cv2(torch.cat([y, p1, p2, F.max_pool2d(p2, 5, 1, 2)], 1)))
        return torch.sigmoid(self.out(torch.cat([F.interpolate(y, scale_factor=2.0, mode="nearest"), a], 1)))


class TCN(nn.Module):
    """Temporal convolution network: dilated Conv1d layers (dilation 1, 2, 4, 8) with residual sums."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(8 if i else 2, 8, 3, padding=2 ** i, dilation=2 ** i) for i in range(4))
        self.fc = nn.Conv1d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            y = F.relu(conv(x))
            x = y if i == 0 else x + y
        return self.fc(x)


class VadLike(nn.Module):
    """Voice-activity detector: a strided Conv1d as STFT, magnitude sqrt(re^2 + im^2), log, Conv1d, LSTM and a
    sigmoid per frame from a one-output FullyConnected."""

    def __init__(self) -> None:
        super().__init__()
        self.stft = nn.Conv1d(1, 2 * 17, 32, 16, bias=False)
        self.enc = nn.Conv1d(17, 16, 3, 1, 1)
        self.rnn = nn.LSTM(16, 16, batch_first=True)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stft(x)
        re, im = s[:, :17], s[:, 17:]
        y = F.relu(self.enc(torch.log(torch.sqrt(re * re + im * im) + 1e-3)))
        y, _ = self.rnn(y.transpose(1, 2))
        return torch.sigmoid(self.out(y))


class YoloDecode(nn.Module):
    """YOLO box decoding: sigmoid outputs scaled and offset by a constant grid, squared and multiplied by
    constant anchors, Concat of the parts."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.h = nn.Conv2d(3, 16, 3, 2, 1), nn.Conv2d(16, 2 * 7, 1)
        gy, gx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
        self.register_buffer("grid", torch.stack([gx, gy], -1).reshape(1, 1, 16, 16, 2))
        self.register_buffer("anchor", torch.tensor([[10.0, 13.0], [16.0, 30.0]]).reshape(1, 2, 1, 1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.h(F.silu(self.c(x))).reshape(1, 2, 7, 16, 16).permute(0, 1, 3, 4, 2).sigmoid()
        xy = (y[..., :2] * 2 - 0.5 + self.grid) * 8.0
        wh = (y[..., 2:4] * 2) ** 2 * self.anchor
        return torch.cat([xy, wh, y[..., 4:]], -1).reshape(1, -1, 7)


class MiscConvs(nn.Module):
    """Convolution variants: dilated, grouped, asymmetric kernel after an explicit Pad, HardTanh, ceil-mode
    average pooling without the padding counted, ConvTranspose with output padding, tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.d = nn.Conv2d(3, 8, 3, 1, 2, dilation=2)
        self.g = nn.Conv2d(8, 8, 3, 1, 1, groups=4)
        self.a = nn.Conv2d(8, 8, (3, 2), 1, 0)
        self.t = nn.ConvTranspose2d(8, 4, 3, 2, 1, output_padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.hardtanh(self.g(F.relu(self.d(x))), -1.0, 1.0)
        y = self.a(F.pad(y, (0, 1, 1, 1)))
        y = F.avg_pool2d(y, 3, 2, 1, ceil_mode=True, count_include_pad=False)
        return torch.tanh(self.t(y))


class ReduceAxes(nn.Module):
    """Reductions and softmax off the last axis: softmax over channels, a sum over height broadcast back,
    softsign (a Div of two tensors), a spatial mean."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c(x)
        mixed = torch.softmax(y, 1) * (y.sum(2, keepdim=True).expand_as(y) / 16.0)
        return mixed + F.softsign(y).mean((2, 3), keepdim=True)


class TokenEmbedding(nn.Module):
    """Token ids into an Embedding table (a Gather of an integer input), LayerNorm, mean over the tokens and a
    classifier: the front of a BERT-style encoder, fed int64 ids."""

    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(self.embed(ids)).mean(1))


class ScaledQueryAttention(nn.Module):
    """Attention whose query is scaled by 1/sqrt(d) before the product, as PP-OCRv6's recognizer writes it: the
    Parser's scaling BatchNorm, a Transpose and the MatMul (folded by `enable_pass_merge_matmul_mul`)."""

    def __init__(self, dim: int = 24, heads: int = 3) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q = q * (c // self.heads) ** -0.5
        attn = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, c))


class RMSNormBlock(nn.Module):
    """LLaMA's RMSNorm (x · rsqrt(mean(x²) + eps) · w, fused by the Parser, in float16 under the X2 target's default
    `trigger_float_op`) before FullyConnected layers with a SiLU gate."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(dim) + 0.5)
        self.gate, self.up, self.down = nn.Linear(dim, 32, bias=False), nn.Linear(dim, 32, bias=False), \
            nn.Linear(32, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class PositionIds(nn.Module):
    """RoBERTa's position ids from the token ids (padding 1): ne, an int32 Cast, a cumulative sum times the mask,
    plus the padding index, then two Embeddings and a LayerNorm."""

    def __init__(self, vocab: int = 40) -> None:
        super().__init__()
        self.tok, self.pos, self.ln = nn.Embedding(vocab, 16), nn.Embedding(20, 16), nn.LayerNorm(16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = ids.ne(1).int()
        positions = (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + 1
        return self.ln(self.tok(ids) + self.pos(positions))


class PaddingMaskAttention(nn.Module):
    """Attention under a padding mask in the two forms transformers exports: BERT's extended mask (1 - mask, its
    padded positions filled with finfo(float32).min: a Where between a Constant and the integer-valued rest) added to
    the scores of one branch, and a learned position bias masked T5's way (a Where between the bias and
    finfo(float32).min) added to those of the other."""

    def __init__(self, dim: int = 32, heads: int = 2, seq: int = 12) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.pos_bias = nn.Parameter(torch.randn(1, heads, seq, seq) * 0.5)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        lowest = torch.finfo(x.dtype).min
        inverted = 1.0 - attention_mask[:, None, None, :].to(x.dtype)
        bert_mask = inverted.masked_fill(inverted.to(torch.bool), lowest)
        t5_bias = torch.where(attention_mask[:, None, None, :].to(torch.bool), self.pos_bias,
                              torch.tensor(lowest, dtype=x.dtype))
        q, k, v = self.qkv(x).split(d, -1)

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)

        scores = heads(q) @ heads(k).transpose(-1, -2) * (d // self.heads) ** -0.5
        a = torch.softmax(scores + bert_mask, -1) @ heads(v) + torch.softmax(scores + t5_bias, -1) @ heads(v)
        return self.o(a.transpose(1, 2).reshape(b, t, d))


class MaskArithmetic(nn.Module):
    """Integer arithmetic on an int64 attention mask as OPT and DeBERTa export it: OPT's positions
    `cumsum(mask) * mask - 1` plus its offset 2 into a learned position Embedding (a CumSum of a full-range int32
    input), and DeBERTa's pairwise mask `mask[:, None, :] * mask[:, :, None]` (a product of two int32 tensors),
    cast to float and multiplied onto attention-like scores."""

    def __init__(self, vocab: int = 40, dim: int = 16, seq: int = 12) -> None:
        super().__init__()
        self.tok, self.pos, self.ln = nn.Embedding(vocab, dim), nn.Embedding(seq + 2, dim), nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1) + 2
        h = self.ln(self.tok(ids) + self.pos(positions))
        pair = attention_mask[:, None, :] * attention_mask[:, :, None]
        scores = (h @ h.transpose(1, 2)) * pair.to(h.dtype)
        return torch.softmax(scores, -1) @ h


class PoolNorm(nn.Module):
    """PoolFormer's token mixer `avg_pool(x) - x` (an Eltwise SUB of inputs with equal scales), ConvNeXt V2's global
    response normalization (an L2 norm over the spatial axes, ReduceL2, divided by its channel mean) and an
    F.normalize over the channels of the pooled features (ReduceL2, Clip, Div)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.mix = nn.Conv2d(3, 16, 3, 1, 1), nn.Conv2d(16, 16, 1)
        self.gamma, self.beta = nn.Parameter(torch.randn(1, 16, 1, 1) * 0.5), nn.Parameter(torch.randn(1, 16, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + (F.avg_pool2d(x, 3, 1, 1, count_include_pad=False) - x)
        gx = torch.norm(x, p=2, dim=(2, 3), keepdim=True)
        x = self.gamma * (x * (gx / (gx.mean(dim=1, keepdim=True) + 1e-6))) + self.beta + x
        return F.normalize(self.mix(x).mean(dim=(2, 3)), dim=1)


class Misc1d(nn.Module):
    """1-D odds and ends: Conv1d, MaxPool1d, an unequal Split, x ** 3 (Pow of a constant exponent), Sqrt of Abs,
    a Where on a comparison, adaptive average pooling and a mean over channels."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.c2 = nn.Conv1d(4, 12, 3, 1, 1), nn.Conv1d(5, 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = torch.split(F.max_pool1d(torch.relu(self.c(x)), 2), [3, 4, 5], 1)
        z = torch.cat([a ** 3, torch.sqrt(b.abs() + 0.01)], 1)[:, :5]
        w = torch.where(c > 0.1, c, c * 0.5)
        return self.c2(z) + F.adaptive_avg_pool1d(w, 1).mean(1, keepdim=True)


class CrnnCtc(nn.Module):
    """A CTC text recognizer: convolution, BatchNorm, ReLU and max pooling down to one row, a bidirectional LSTM over
    the columns, a per-column classifier and LogSoftmax over the classes (the LogSoftmax in upstream's form)."""

    def __init__(self) -> None:
        super().__init__()
        self.cnn = nn.Sequential(nn.Conv2d(1, 16, 3, 1, 1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(16, 32, 3, 1, 1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d((4, 1)))
        self.rnn = nn.LSTM(32, 24, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(48, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cnn(x).squeeze(2).transpose(1, 2)
        return torch.log_softmax(self.fc(self.rnn(y)[0]), -1)


class OneOp(nn.Module):
    """A graph of one operator (after the Parser), for the one-operator cases."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fn(*xs)


# ------------------------------------------------------------------------------------------------- the catalogue


Sampler = Callable[[np.random.Generator], Dict[str, np.ndarray]]


@dataclass
class Spec:
    """One corpus model: how to build it, its inputs (name → shape with batch 1), its outputs and its data."""

    build: Callable[[], nn.Module]
    inputs: Dict[str, Tuple[int, ...]]
    outputs: Sequence[str]
    sample: Optional[Sampler] = None
    """SAMPLES samples per input; default: standard normal noise."""
    vocab: Optional[Dict[str, int]] = None
    """Integer inputs (token ids) by name, with their vocabulary size: exported from random ids below it."""


def _normal(spec_inputs: Dict[str, Tuple[int, ...]]) -> Sampler:
    def sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
        return {k: rng.standard_normal((SAMPLES, *s[1:])).astype(np.float32) for k, s in spec_inputs.items()}
    return sample


def _encoder_data(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """Token features plus a padding mask: each sample keeps its first L of 16 positions (L from 8 to 16), the
    others get -10000 as BERT's extended attention mask does."""
    x = rng.standard_normal((SAMPLES, 16, 32)).astype(np.float32)
    mask = np.zeros((SAMPLES, 1, 16, 16), np.float32)
    for i, keep in enumerate(rng.integers(8, 17, SAMPLES)):
        mask[i, :, :, keep:] = -10000.0
    return {"x": x, "mask": mask}


def _image(rng: np.random.Generator, shape: Tuple[int, ...]) -> np.ndarray:
    """Smooth image-like data in [-1, 1]: low-frequency noise upsampled, plus a little pixel noise."""
    n, c, h, w = SAMPLES, shape[1], shape[2], shape[3]
    low = rng.uniform(-1, 1, (n, c, max(h // 8, 1), max(w // 8, 1))).astype(np.float32)
    up = np.repeat(np.repeat(low, 8, axis=2), 8, axis=3)[:, :, :h, :w]
    return np.clip(up + 0.1 * rng.standard_normal((n, c, h, w)), -1, 1).astype(np.float32)


def _image_sampler(name: str, shape: Tuple[int, ...]) -> Sampler:
    return lambda rng: {name: _image(rng, shape)}


def _token_ids(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """int64 token ids below 50, [SAMPLES, 12]."""
    return {"ids": rng.integers(0, 50, (SAMPLES, 12)).astype(np.int64)}


def _position_ids(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """int64 token ids in [2, 40) with trailing padding (id 1) of random length, [SAMPLES, 12]."""
    ids = rng.integers(2, 40, (SAMPLES, 12)).astype(np.int64)
    for i in range(SAMPLES):
        ids[i, int(rng.integers(6, 13)):] = 1
    return {"ids": ids}


def _padded_tokens(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """Token features [SAMPLES, 12, 32] and an int64 attention mask keeping the first 6 to 12 positions."""
    x = rng.standard_normal((SAMPLES, 12, 32)).astype(np.float32)
    mask = np.zeros((SAMPLES, 12), np.int64)
    for i, keep in enumerate(rng.integers(6, 13, SAMPLES)):
        mask[i, :keep] = 1
    return {"x": x, "attention_mask": mask}


def _ids_and_mask(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """int64 token ids below 40 [SAMPLES, 12] and an int64 attention mask keeping the first 6 to 12 positions."""
    ids = rng.integers(0, 40, (SAMPLES, 12)).astype(np.int64)
    mask = np.zeros((SAMPLES, 12), np.int64)
    for i, keep in enumerate(rng.integers(6, 13, SAMPLES)):
        mask[i, :keep] = 1
    return {"ids": ids, "attention_mask": mask}


def _wave(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """Noisy sine waves of random frequency and amplitude, [SAMPLES, 1, 256]."""
    t = np.arange(256, dtype=np.float32)
    waves = [np.sin(t * rng.uniform(0.05, 0.5)) * rng.uniform(0.1, 1) + 0.05 * rng.standard_normal(256)
             for _ in range(SAMPLES)]
    return {"x": np.stack(waves)[:, None].astype(np.float32)}


MODELS: Dict[str, Spec] = {
    "transformer_encoder": Spec(EncoderBlock, {"x": (1, 16, 32), "mask": (1, 1, 16, 16)}, ["y"], _encoder_data),
    "gpt_decoder": Spec(DecoderBlock, {"x": (1, 16, 32)}, ["logits"]),
    "lstm": Spec(lambda: Recurrent("lstm"), {"x": (1, 12, 16)}, ["y"]),
    "gru": Spec(lambda: Recurrent("gru"), {"x": (1, 12, 16)}, ["y"]),
    "bilstm": Spec(lambda: Recurrent("lstm", hidden=24, classes=8, layers=2, bidirectional=True), {"x": (1, 10, 16)},
                   ["y"]),
    "bigru": Spec(lambda: Recurrent("gru", hidden=24, classes=8, bidirectional=True), {"x": (1, 10, 16)}, ["y"]),
    "svtr_tiny": Spec(SvtrTiny, {"x": (1, 3, 32, 64)}, ["probs"], _image_sampler("x", (1, 3, 32, 64))),
    "det_head": Spec(DetHead, {"x": (1, 3, 64, 64)}, ["cls", "box"], _image_sampler("x", (1, 3, 64, 64))),
    "unet_tiny": Spec(UNetTiny, {"x": (1, 3, 32, 32)}, ["seg"], _image_sampler("x", (1, 3, 32, 32))),
    "mbv2_block": Spec(MobileNetV2Block, {"x": (1, 3, 32, 32)}, ["logits"], _image_sampler("x", (1, 3, 32, 32))),
    "fused_activations": Spec(FusedActivations, {"x": (1, 8, 16, 16)}, ["y"], _image_sampler("x", (1, 8, 16, 16))),
    "float64_flow": Spec(Float64Flow, {"x": (1, 4, 16, 16)}, ["y"], _image_sampler("x", (1, 4, 16, 16))),
    "vit_tiny": Spec(ViTTiny, {"x": (1, 3, 32, 32)}, ["y"], _image_sampler("x", (1, 3, 32, 32))),
    "convnext_block": Spec(ConvNeXtBlock, {"x": (1, 3, 32, 32)}, ["y"], _image_sampler("x", (1, 3, 32, 32))),
    "mbconv_se": Spec(MBConvSE, {"x": (1, 3, 32, 32)}, ["y"], _image_sampler("x", (1, 3, 32, 32))),
    "yolo_sppf": Spec(YoloSPPF, {"x": (1, 3, 32, 32)}, ["y"], _image_sampler("x", (1, 3, 32, 32))),
    "tcn": Spec(TCN, {"x": (1, 2, 64)}, ["y"]),
    "vad_like": Spec(VadLike, {"x": (1, 1, 256)}, ["y"], _wave),
    "yolo_decode": Spec(YoloDecode, {"x": (1, 3, 32, 32)}, ["y"], _image_sampler("x", (1, 3, 32, 32))),
    "misc_convs": Spec(MiscConvs, {"x": (1, 3, 16, 16)}, ["y"], _image_sampler("x", (1, 3, 16, 16))),
    "reduce_axes": Spec(ReduceAxes, {"x": (1, 3, 16, 16)}, ["y"], _image_sampler("x", (1, 3, 16, 16))),
    "token_embedding": Spec(TokenEmbedding, {"ids": (1, 12)}, ["y"], _token_ids, vocab={"ids": 50}),
    "misc_1d": Spec(Misc1d, {"x": (1, 4, 32)}, ["y"]),
    "norms": Spec(Norms, {"x": (1, 3, 16, 16)}, ["y"]),
    "crnn_ctc": Spec(CrnnCtc, {"x": (1, 1, 8, 32)}, ["y"], _image_sampler("x", (1, 1, 8, 32))),
    "layernorm_2d": Spec(LayerNorm2D, {"x": (1, 6, 24)}, ["y"]),
    "scaled_query": Spec(ScaledQueryAttention, {"x": (1, 10, 24)}, ["y"]),
    "rmsnorm_block": Spec(RMSNormBlock, {"x": (1, 8, 16)}, ["y"]),
    "position_ids": Spec(PositionIds, {"ids": (1, 12)}, ["y"], _position_ids, vocab={"ids": 40}),
    "pool_norm": Spec(PoolNorm, {"x": (1, 3, 16, 16)}, ["y"], _image_sampler("x", (1, 3, 16, 16))),
    "mask_arithmetic": Spec(MaskArithmetic, {"ids": (1, 12), "attention_mask": (1, 12)}, ["y"], _ids_and_mask,
                            vocab={"ids": 40, "attention_mask": 2}),
    "padding_mask": Spec(PaddingMaskAttention, {"x": (1, 12, 32), "attention_mask": (1, 12)}, ["y"],
                         _padded_tokens, vocab={"attention_mask": 2}),
    "op_softmax": Spec(lambda: OneOp(lambda x: torch.softmax(x, dim=-1)), {"x": (1, 8, 32)}, ["y"]),
    "op_sigmoid": Spec(lambda: OneOp(torch.sigmoid), {"x": (1, 8, 32)}, ["y"]),
    "op_tanh": Spec(lambda: OneOp(torch.tanh), {"x": (1, 8, 32)}, ["y"]),
    "op_gelu": Spec(lambda: OneOp(nn.GELU()), {"x": (1, 8, 32)}, ["y"]),
    "op_layernorm": Spec(lambda: nn.LayerNorm(32), {"x": (1, 8, 32)}, ["y"]),
    "op_matmul": Spec(lambda: OneOp(torch.matmul), {"a": (1, 8, 16), "b": (1, 16, 8)}, ["y"]),
    "op_add": Spec(lambda: OneOp(torch.add), {"a": (1, 8, 32), "b": (1, 8, 32)}, ["y"]),
    "op_mul": Spec(lambda: OneOp(torch.mul), {"a": (1, 8, 32), "b": (1, 8, 32)}, ["y"]),
    "op_concat": Spec(lambda: OneOp(lambda a, b: torch.cat([a, b], dim=-1)), {"a": (1, 8, 16), "b": (1, 8, 16)},
                      ["y"]),
    "op_reducemean": Spec(lambda: OneOp(lambda x: x.mean(dim=-1, keepdim=True)), {"x": (1, 8, 32)}, ["y"]),
    "elementwise_const": Spec(ElementwiseConst, {"x": (1, 8, 32)}, ["y"]),
    "causal_sdpa": Spec(CausalSDPA, {"x": (1, 16, 32)}, ["y"]),
}
"""Every corpus model. Weights are seeded per model (`_seed`), as is the data, so regeneration is reproducible."""

IR_CASES: Dict[str, IrCase] = ir_cases()
"""The one-operator cases whose float IR quantopt writes (benchmarks/golden_cases/)."""


def _seed(name: str) -> int:
    """A per-model seed that does not change when models are added or reordered."""
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % 100_003


# --------------------------------------------------------------------------------------------------- the steps


def export_onnx(name: str, spec: Spec, folder: Path) -> Path:
    """Seeded weights (BatchNorm statistics perturbed, so folding them matters), exported with the legacy exporter."""
    torch.manual_seed(_seed(name))
    model = spec.build().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    vocab = spec.vocab or {}
    args = tuple(torch.randint(0, vocab[k], s) if k in vocab else torch.randn(*s) for k, s in spec.inputs.items())
    path = folder / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), input_names=list(spec.inputs), output_names=list(spec.outputs),
                          opset_version=OPSET, dynamo=False, do_constant_folding=True)
    return path


def write_data(name: str, spec: Spec, folder: Path) -> str:
    """The calibration samples; returns the file name (calib.npy for one input, calib.npz in input order)."""
    rng = np.random.default_rng(_seed(name))
    data = (spec.sample or _normal(spec.inputs))(rng)
    if len(data) == 1:
        np.save(folder / "calib.npy", next(iter(data.values())))
        return "calib.npy"
    np.savez(folder / "calib.npz", **{k: data[k] for k in spec.inputs})
    return "calib.npz"


def _run(cmd: List[str], log: Path, fail: bool = True) -> bool:
    """Runs an upstream script, its output in `log`; a failure stops the script naming the log, or with
    `fail=False` returns False (an upstream defect on one variant is recorded, not fatal)."""
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT_S, check=False)
    if done.returncode != 0 and fail:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {done.returncode}); see {log}")
    return done.returncode == 0


def parse(name: str, spec: Spec, onnx_path: Path, folder: Path, upstream: Path, scratch: Path) -> None:
    """The upstream Parser's float IR of the ONNX file, written as <name>.txt/.bin into `folder`."""
    out = scratch / "parser_out"
    out.mkdir(parents=True, exist_ok=True)
    cfg = scratch / "parser.cfg"
    cfg.write_text("\n".join([
        "[Common]", "model_type = onnx", f"model_name = {name}", "model_domain = image_classification",
        f"input_model = {onnx_path.resolve()}", f"input = {','.join(spec.inputs)}",
        "input_shape = " + ",".join("[" + ",".join(str(d) for d in s) + "]" for s in spec.inputs.values()),
        f"output = {','.join(spec.outputs)}", f"output_dir = {out}", ""]))
    _run([str(upstream / "run-parser.sh"), str(cfg)], scratch / "parser.log")
    for ext in ("txt", "bin"):
        shutil.copyfile(out / f"{name}.{ext}", folder / f"{name}.{ext}")


def opt_cfg_lines(name: str, data_file: str, letter: str, graph_dir: str) -> List[str]:
    """An opt cfg of one variant; paths are relative to `graph_dir` (text put in front of each file name)."""
    dataset = "numpydataset" if data_file.endswith(".npy") else "numpymultiinputdataset"
    return ["[Common]", f"graph = {graph_dir}{name}.txt", f"bin = {graph_dir}{name}.bin", f"model_name = {name}",
            f"dataset = {dataset}", f"calibration_data = {graph_dir}{data_file}", "calibration_batch_size = 1",
            *VARIANTS[letter]]


def quantize(name: str, data_file: str, folder: Path, upstream: Path, scratch: Path,
             extra: Sequence[str] = ()) -> None:
    """The upstream Optimizer's output for each variant, copied with the variant's committed cfg into golden/L/;
    `extra` cfg lines are added to every variant (a one-operator case's field)."""
    for letter in VARIANTS:
        golden = folder / "golden" / letter
        if golden.exists():
            shutil.rmtree(golden)
        golden.mkdir(parents=True)
        (golden / "opt.cfg").write_text("\n".join(opt_cfg_lines(name, data_file, letter, "../../") + list(extra)
                                                  + ["output_dir = ./out", ""]))
        work = scratch / f"opt_{letter}"
        work.mkdir()
        cfg = work / "opt.cfg"
        cfg.write_text("\n".join(opt_cfg_lines(name, data_file, letter, f"{folder.resolve()}/") + list(extra)
                                 + [f"output_dir = {work / 'out'}", ""]))
        log = work / "opt.log"
        if not _run([str(upstream / "run-opt.sh"), str(cfg)], log, fail=False):
            errors = [line.split("]: ", 1)[-1].strip() for line in log.read_text().splitlines()
                      if line.startswith("[E]")]  # without the log prefix and its time stamp
            (golden / FAILED_NOTE).write_text("upstream's optimizer failed on this variant:\n"
                                              + "\n".join(errors[:3] or ["(no error line; see its log)"]) + "\n")
            print(f"{name}/{letter}: upstream failed; noted in {golden / FAILED_NOTE}", flush=True)
            continue
        for file in (f"{name}_o.txt", f"{name}_o.bin", f"{name}_opt_template.json"):
            src = work / "out" / file
            if not src.is_file():
                raise SystemExit(f"upstream wrote no {file} for {name}/{letter}; see {work / 'opt.log'}")
            shutil.copyfile(src, golden / file)


def write_ir_case(name: str, case: IrCase, folder: Path) -> str:
    """The float IR of a one-operator case written by quantopt (`<name>.txt/.bin`) and its calibration samples;
    returns the data file name as `write_data` does."""
    graph = case.build()
    graph.name = name
    write_ir(graph, str(folder / f"{name}.txt"), str(folder / f"{name}.bin"))
    data = case.sample(np.random.default_rng(_seed(name)))
    order = [t.name for t in graph.input_tensors]
    if sorted(data) != sorted(order):
        raise SystemExit(f"golden case {name}: samples for {sorted(data)}, graph inputs {order}")
    if len(order) == 1:
        np.save(folder / "calib.npy", data[order[0]])
        return "calib.npy"
    np.savez(folder / "calib.npz", **{k: data[k] for k in order})
    return "calib.npz"


def make(name: str, out: Path, upstream: Path, keep: Optional[Path]) -> None:
    """One corpus model from scratch: ONNX, data, float IR, the three goldens (for a case of golden_cases/: its
    float IR and data written by quantopt, then the three goldens)."""
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"golden_corpus_{name}_", dir=keep))
    if name in IR_CASES:
        data_file = write_ir_case(name, IR_CASES[name], folder)
    else:
        spec = MODELS[name]
        onnx_path = export_onnx(name, spec, folder)
        data_file = write_data(name, spec, folder)
        parse(name, spec, onnx_path, folder, upstream, scratch)
    quantize(name, data_file, folder, upstream, scratch, IR_CASES[name].cfg_lines if name in IR_CASES else ())
    if keep is None:
        shutil.rmtree(scratch)
    print(f"{name}: done ({folder})", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="corpus folder (default %(default)s)")
    parser.add_argument("--only", default="", help="comma-separated model names (default: all)")
    parser.add_argument("--upstream", type=Path, default=DEFAULT_UPSTREAM,
                        help="folder with run-parser.sh and run-opt.sh (default ../shared/upstream, or "
                             "$QUANTOPT_UPSTREAM)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the scratch folders (upstream logs) here")
    parser.add_argument("--list", action="store_true", help="list the models and exit")
    args = parser.parse_args(argv)
    known = [*MODELS, *IR_CASES]
    if args.list:
        print("\n".join(known))
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or known
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(known)}")
    missing = [s for s in ("run-parser.sh", "run-opt.sh") if not (args.upstream / s).is_file()]
    if missing:
        print(f"make_golden_corpus: the upstream tools are needed to regenerate the corpus, and {args.upstream} has "
              f"no {' or '.join(missing)}; pass --upstream DIR or set QUANTOPT_UPSTREAM (the committed corpus "
              f"needs no regeneration to be tested)", file=sys.stderr)
        return 2
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    for name in names:
        make(name, args.out, args.upstream.resolve(), args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
