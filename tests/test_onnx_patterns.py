"""ONNX importer on the patterns a standard `torch.onnx.export` of a BERT writes: attention-mask Cast to bool,
Expand, Where/Equal/Not on masks, Range for positions, and Shape->Gather->Unsqueeze->Concat chains of a model
exported with dynamic axes (folded once the input shapes are fixed). Each tiny model is exported here with seeded
weights, imported, and its float forward compared with onnxruntime."""
from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx", reason="the optional dependency 'onnx' is not installed (pip install onnx)")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install onnxruntime)")

import quantopt.ops  # noqa: E402,F401
from quantopt.frontends.onnx import import_onnx  # noqa: E402
from quantopt.graph.graph import PyGraph  # noqa: E402

SEQ = 8
HIDDEN = 16
TOL = 1e-5


class MaskedAttention(nn.Module):
    """One attention head with an int64 padding mask, the mask built as HF's eager BERT builds it."""

    def __init__(self, vocab: int = 50, fill: float = float(torch.finfo(torch.float32).min)) -> None:
        super().__init__()
        self.fill = fill
        self.emb = nn.Embedding(vocab, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)  # Range (folded: the shape is fixed)
        x = self.emb(ids) + self.pos(positions)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        keep = mask.bool()[:, None, None, :]  # Cast to bool
        keep = keep.expand(ids.shape[0], 1, ids.shape[1], ids.shape[1])  # Expand of a run-time tensor
        bias = torch.where(keep, 0.0, self.fill)  # Where on the mask
        scores = q[:, None] @ k[:, None].transpose(-1, -2) / HIDDEN ** 0.5 + bias
        return torch.softmax(scores, dim=-1) @ v[:, None]


class MaskLogic(nn.Module):
    """Equal / Not / And on a mask, a Where selecting between activations, and a no-op Expand."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pad = mask == 0  # Equal
        keep = torch.logical_not(pad) & (x.sum(-1) > 0)  # Not, Greater, And
        keep = keep.expand_as(mask)  # Expand to the shape it has: no layer
        y = torch.where(keep[..., None], x * 2.0, -x)
        return y + mask.to(torch.float32)[..., None]  # Cast back to float


class DynamicReshape(nn.Module):
    """Head split/merge written with x.size(): Shape->Gather->Unsqueeze->Concat chains under dynamic axes, and an
    Expand of an activation to a larger shape (a Tile)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        h = self.fc(x).view(b, s, 4, -1).transpose(1, 2)  # [b, 4, s, d]
        pooled = h.mean(dim=2, keepdim=True).expand(b, 4, s, HIDDEN // 4)  # Expand [b,4,1,d] -> [b,4,s,d]
        return (h * pooled).transpose(1, 2).reshape(b, s, -1)


def _export(model: nn.Module, inputs: Sequence[torch.Tensor], names: List[str], path: Path,
            dynamic: Optional[Dict[str, Dict[int, str]]] = None) -> str:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, tuple(inputs), str(path), input_names=names, output_names=["out"], opset_version=17,
                          dynamic_axes=dynamic, dynamo=False)
    return str(path)


def _compare(path: str, feeds: Dict[str, np.ndarray], shapes: Optional[Dict[str, List[int]]] = None) -> PyGraph:
    graph = import_onnx(path, shapes)
    got = graph.forward([torch.from_numpy(feeds[t.name[:-2]]) for t in graph.input_tensors])
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(g.numpy(), r, rtol=TOL, atol=TOL * max(1.0, float(np.abs(r).max())))
    return graph


def _types(graph: PyGraph) -> Counter:
    return Counter(str(n.type).split(".")[-1] for n in graph.nodes)


def _ops(path: str) -> Counter:
    return Counter(n.op_type for n in onnx.load(path).graph.node)


@pytest.mark.parametrize("fill", ["finfo_min", "neg_inf"])
def test_bert_attention_mask(tmp_path: Path, fill: str) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (1, SEQ)).astype(np.int64)
    mask = np.ones((1, SEQ), np.int64)
    mask[:, 5:] = 0
    dynamic = {"ids": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}}
    value = float("-inf") if fill == "neg_inf" else float(torch.finfo(torch.float32).min)
    path = _export(MaskedAttention(fill=value), [torch.from_numpy(ids), torch.from_numpy(mask)], ["ids", "mask"],
                   tmp_path / "attn.onnx", dynamic)
    assert {"Cast", "Expand", "Where", "Range", "Shape"} <= set(_ops(path))
    shapes = {"ids": [1, SEQ], "mask": [1, SEQ]}
    graph = _compare(path, {"ids": ids, "mask": mask}, shapes)
    types = _types(graph)
    assert types["Cast"] == 0 and types["Where"] == 1 and types["Tile"] == 1  # Cast to bool: x != 0
    assert not {"Range", "Shape", "Concat"} & set(types)
    logical = [n for n in graph.nodes if str(n.type).endswith("Logical")]
    assert [n.params["method"] for n in logical] == ["NOT_EQUAL"]
    assert logical[0].name.endswith("_equal")
    # a sample without padding too
    _compare(path, {"ids": ids, "mask": np.ones_like(mask)}, shapes)


def test_mask_logic_and_noop_expand(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, SEQ, 3)).astype(np.float32)
    mask = rng.integers(0, 2, (2, SEQ)).astype(np.int64)
    path = _export(MaskLogic(), [torch.from_numpy(x), torch.from_numpy(mask)], ["x", "mask"], tmp_path / "m.onnx")
    assert {"Equal", "Not", "And", "Where"} <= set(_ops(path))
    graph = _compare(path, {"x": x, "mask": mask})
    assert _types(graph)["Tile"] == 0


def test_dynamic_axes_fold_once_shapes_are_fixed(tmp_path: Path) -> None:
    x = np.random.default_rng(2).standard_normal((2, SEQ, HIDDEN)).astype(np.float32)
    path = _export(DynamicReshape(), [torch.from_numpy(x)], ["x"], tmp_path / "dyn.onnx",
                   dynamic={"x": {0: "batch", 1: "seq"}})
    assert {"Shape", "Gather", "Unsqueeze", "Concat", "Expand"} <= set(_ops(path))
    graph = _compare(path, {"x": x}, {"x": [2, SEQ, HIDDEN]})
    types = _types(graph)
    assert types["Tile"] == 1 and not {"Shape", "Concat", "Gather"} & set(types)
    tile = next(n for n in graph.nodes if str(n.type).endswith("Tile"))
    assert list(tile.params["repeats"]) == [1, 1, SEQ, 1]
