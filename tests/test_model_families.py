"""Whole small models of the families real Compass IRs come from — transformer encoder, speech LSTM, OCR
(conv + LSTM + CTC-style argmax), detection head (SSD-style decode + NMS), UNet-like decoder — built with the layer
types and params the Parser writes. Each quantizes at 8 and 16 bits, runs its integer forward close to float, and
survives an IR write → re-read bit for bit."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch

from quantopt.analysis.similarity import cosine
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import QuantizeGraph
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.quant.dtype import Dtype

RNG = np.random.default_rng(7)


def w(*shape: int, scale: float = 0.3) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def conv_params(k: int, stride: int = 1, pad: int = 0, out: int = 1, act: str = "NONE", group: int = 1) -> Dict:
    return dict(kernel_x=k, kernel_y=k, stride_x=stride, stride_y=stride, pad_left=pad, pad_right=pad, pad_top=pad,
                pad_bottom=pad, dilation_x=1, dilation_y=1, group=group, num_output=out, with_activation=act)


def lstm_states(b: GraphBuilder, name: str, cell: int) -> List[str]:
    """Zero initial hidden and cell states, written by the Parser as Constant layers."""
    return [b.layer("Constant", [], [[1, cell]], name=f"{name}_{s}0", constants=dict(weights=np.zeros((1, cell),
                                                                                                     np.float32)))
            for s in ("h", "c")]


def transformer() -> Tuple[QuantizeGraph, Callable[[int], List[torch.Tensor]]]:
    """Token ids → embedding Gather → one encoder block (attention + GELU MLP, post-LayerNorm) → mean pool."""
    seq, dim, vocab, heads = 8, 16, 50, 2
    b = GraphBuilder("transformer")
    ids = b.input("ids", [1, seq], dtype=Dtype.INT32)
    table = b.layer("Constant", [], [[vocab, dim]], name="embed_table",
                    constants=dict(weights=w(vocab, dim, scale=1.0)))
    emb = b.layer("Gather", [table, ids], [[1, seq, dim]], name="embed", params=dict(axis=0, batch_dims=0))
    q = b.layer("FullyConnected", [emb], [[1, seq, dim]], name="q", params=dict(num_output=dim, with_activation="NONE"),
                constants=dict(weights=w(dim, dim), biases=w(dim, scale=0.1)))
    k = b.layer("FullyConnected", [emb], [[1, seq, dim]], name="k", params=dict(num_output=dim, with_activation="NONE"),
                constants=dict(weights=w(dim, dim), biases=w(dim, scale=0.1)))
    v = b.layer("FullyConnected", [emb], [[1, seq, dim]], name="v", params=dict(num_output=dim, with_activation="NONE"),
                constants=dict(weights=w(dim, dim), biases=w(dim, scale=0.1)))
    hd = dim // heads

    def split_heads(t: str, name: str) -> str:
        r = b.layer("Reshape", [t], [[1, seq, heads, hd]], name=name + "_r", params=dict(shape=[1, seq, heads, hd]))
        return b.layer("Transpose", [r], [[1, heads, seq, hd]], name=name + "_t", params=dict(perm=[0, 2, 1, 3]))

    qh, kh, vh = split_heads(q, "qh"), split_heads(k, "kh"), split_heads(v, "vh")
    att = b.layer("MatMul", [qh, kh], [[1, heads, seq, seq]], name="scores", params=dict(trans_a=False, trans_b=True))
    prob = b.layer("Softmax", [att], [[1, heads, seq, seq]], name="attn", params=dict(axis=-1))
    ctx = b.layer("MatMul", [prob, vh], [[1, heads, seq, hd]], name="ctx", params=dict(trans_a=False, trans_b=False))
    ct = b.layer("Transpose", [ctx], [[1, seq, heads, hd]], name="ctx_t", params=dict(perm=[0, 2, 1, 3]))
    cr = b.layer("Reshape", [ct], [[1, seq, dim]], name="ctx_r", params=dict(shape=[1, seq, dim]))
    o = b.layer("FullyConnected", [cr], [[1, seq, dim]], name="o", params=dict(num_output=dim, with_activation="NONE"),
                constants=dict(weights=w(dim, dim), biases=w(dim, scale=0.1)))
    r1 = b.layer("Eltwise", [emb, o], [[1, seq, dim]], name="res1", params=dict(method="ADD", with_activation="NONE"))
    ln1 = b.layer("LayerNorm", [r1], [[1, seq, dim]], name="ln1", params=dict(axis=[-1], epsilon=1e-5),
                  constants=dict(weights=1 + w(dim, scale=0.1), biases=w(dim, scale=0.1)))
    f1 = b.layer("FullyConnected", [ln1], [[1, seq, 2 * dim]], name="ff1",
                 params=dict(num_output=2 * dim, with_activation="NONE"),
                 constants=dict(weights=w(2 * dim, dim), biases=w(2 * dim, scale=0.1)))
    g = b.layer("Activation", [f1], [[1, seq, 2 * dim]], name="gelu", params=dict(method="GELU"))
    f2 = b.layer("FullyConnected", [g], [[1, seq, dim]], name="ff2",
                 params=dict(num_output=dim, with_activation="NONE"),
                 constants=dict(weights=w(dim, 2 * dim), biases=w(dim, scale=0.1)))
    r2 = b.layer("Eltwise", [ln1, f2], [[1, seq, dim]], name="res2", params=dict(method="ADD", with_activation="NONE"))
    ln2 = b.layer("LayerNorm", [r2], [[1, seq, dim]], name="ln2", params=dict(axis=[-1], epsilon=1e-5),
                  constants=dict(weights=1 + w(dim, scale=0.1), biases=w(dim, scale=0.1)))
    pooled = b.layer("Reduce", [ln2], [[1, 1, dim]], name="pool", params=dict(method="MEAN", axis=[1], keepdims=True))
    graph = b.build([pooled])
    return graph, lambda seed: [torch.from_numpy(np.random.default_rng(seed).integers(0, vocab, (1, seq)).astype(
        np.int32))]


def speech() -> Tuple[QuantizeGraph, Callable[[int], List[torch.Tensor]]]:
    """Filterbank frames → LSTM → FullyConnected per frame → LogSoftmax over tokens."""
    steps, feat, cell, tokens = 6, 10, 12, 7
    b = GraphBuilder("speech")
    x = b.input("feats", [1, steps, feat])
    y = b.layer("BasicLSTM", [x] + lstm_states(b, "lstm", cell), [[1, steps, cell]], name="lstm",
                params=dict(time_steps=steps, input_size=feat, cell_size=cell, direction="forward",
                            out_sequence=["Y"], activations=["SIGMOID", "TANH", "TANH"]),
                constants=dict(weights=w(4 * cell, feat + cell), biases=w(4 * cell, scale=0.1)))
    fc = b.layer("FullyConnected", [y], [[1, steps, tokens]], name="proj",
                 params=dict(num_output=tokens, with_activation="NONE"),
                 constants=dict(weights=w(tokens, cell, scale=0.6), biases=w(tokens, scale=0.1)))
    out = b.layer("LogSoftmax", [fc], [[1, steps, tokens]], name="logp", params=dict(axis=-1))
    graph = b.build([out])
    return graph, lambda seed: [torch.from_numpy(
        np.random.default_rng(seed).standard_normal((1, steps, feat)).astype(np.float32))]


def ocr() -> Tuple[QuantizeGraph, Callable[[int], List[torch.Tensor]]]:
    """Text-line image → conv + pool backbone → columns as a sequence → LSTM → classes → greedy argmax."""
    h, wd, c, cell, classes = 8, 16, 8, 10, 6
    b = GraphBuilder("ocr")
    x = b.input("img", [1, h, wd, 1])
    c1 = b.layer("Convolution", [x], [[1, h, wd, c]], name="c1", params=conv_params(3, pad=1, out=c, act="RELU"),
                 constants=dict(weights=w(c, 3, 3, 1), biases=w(c, scale=0.1)))
    p1 = b.layer("Pooling", [c1], [[1, 1, wd, c]], name="p1",
                 params=dict(method="AVG", kernel_x=1, kernel_y=h, stride_x=1, stride_y=h, pad_left=0, pad_right=0,
                             pad_top=0, pad_bottom=0, ceil_mode=False, dilation_x=1, dilation_y=1))
    seq = b.layer("Reshape", [p1], [[1, wd, c]], name="seq", params=dict(shape=[1, wd, c]))
    y = b.layer("BasicLSTM", [seq] + lstm_states(b, "lstm", cell), [[1, wd, cell]], name="lstm",
                params=dict(time_steps=wd, input_size=c, cell_size=cell, direction="forward", out_sequence=["Y"],
                            activations=["SIGMOID", "TANH", "TANH"]),
                constants=dict(weights=w(4 * cell, c + cell), biases=w(4 * cell, scale=0.1)))
    logits = b.layer("FullyConnected", [y], [[1, wd, classes]], name="cls",
                     params=dict(num_output=classes, with_activation="NONE"),
                     constants=dict(weights=w(classes, cell, scale=1.0), biases=w(classes, scale=0.1)))
    best = b.layer("ArgMinMax", [logits], [[1, wd, 1]], name="best", params=dict(method="MAX", axis=-1),
                   output_dtypes=[Dtype.INT32])
    graph = b.build([logits, best])
    return graph, lambda seed: [torch.from_numpy(
        np.random.default_rng(seed).uniform(0, 1, (1, h, wd, 1)).astype(np.float32))]


def unet() -> Tuple[QuantizeGraph, Callable[[int], List[torch.Tensor]]]:
    """Encoder conv (stride 2) → decoder ConvTranspose and bilinear Resize → skip Concat → 1x1 head → Sigmoid."""
    h, c = 8, 4
    b = GraphBuilder("unet")
    x = b.input("img", [1, h, h, 3])
    e1 = b.layer("Convolution", [x], [[1, h, h, c]], name="e1", params=conv_params(3, pad=1, out=c, act="RELU"),
                 constants=dict(weights=w(c, 3, 3, 3), biases=w(c, scale=0.1)))
    e2 = b.layer("Convolution", [e1], [[1, h // 2, h // 2, 2 * c]], name="e2",
                 params=conv_params(3, stride=2, pad=1, out=2 * c, act="RELU"),
                 constants=dict(weights=w(2 * c, 3, 3, c), biases=w(2 * c, scale=0.1)))
    up1 = b.layer("ConvTranspose", [e2], [[1, h, h, c]], name="up1",
                  params=dict(kernel_x=2, kernel_y=2, stride_x=2, stride_y=2, pad_left=0, pad_right=0, pad_top=0,
                              pad_bottom=0, dilation_x=1, dilation_y=1, output_padding_x=0, output_padding_y=0,
                              group=1, num_output=c, with_activation="RELU"),
                  constants=dict(weights=w(c, 2, 2, 2 * c), biases=w(c, scale=0.1)))
    up2 = b.layer("Resize", [e2], [[1, h, h, 2 * c]], name="up2",
                  params=dict(method="BILINEAR", mode="HALF_PIXEL", size=[h, h]))
    cat = b.layer("Concat", [e1, up1, up2], [[1, h, h, 4 * c]], name="cat", params=dict(axis=3))
    head = b.layer("Convolution", [cat], [[1, h, h, 1]], name="head", params=conv_params(1, out=1),
                   constants=dict(weights=w(1, 1, 1, 4 * c), biases=w(1, scale=0.1)))
    out = b.layer("Activation", [head], [[1, h, h, 1]], name="mask", params=dict(method="SIGMOID"))
    graph = b.build([out])
    return graph, lambda seed: [torch.from_numpy(
        np.random.default_rng(seed).uniform(-1, 1, (1, h, h, 3)).astype(np.float32))]


def detection() -> Tuple[QuantizeGraph, Callable[[int], List[torch.Tensor]]]:
    """SSD-style: conv backbone → class and box heads (2 anchors per cell) → Sigmoid → DecodeBox → NMS."""
    h, c, per_cell, cols = 8, 8, 2, 4  # 4 score columns: background + 3 classes
    cells = (h // 2) ** 2
    anchors_n = cells * per_cell
    r = np.random.default_rng(11)
    anchors = np.stack([r.uniform(0, 1, anchors_n), r.uniform(0, 1, anchors_n), r.uniform(0.1, 0.4, anchors_n),
                        r.uniform(0.1, 0.4, anchors_n)], 1).astype(np.float32)
    b = GraphBuilder("detection")
    x = b.input("img", [1, h, h, 3])
    f = b.layer("Convolution", [x], [[1, h // 2, h // 2, c]], name="backbone",
                params=conv_params(3, stride=2, pad=1, out=c, act="RELU"),
                constants=dict(weights=w(c, 3, 3, 3), biases=w(c, scale=0.1)))
    cls = b.layer("Convolution", [f], [[1, h // 2, h // 2, per_cell * cols]], name="cls_head",
                  params=conv_params(1, out=per_cell * cols),
                  constants=dict(weights=w(per_cell * cols, 1, 1, c, scale=1.0), biases=w(per_cell * cols)))
    box = b.layer("Convolution", [f], [[1, h // 2, h // 2, per_cell * 4]], name="box_head",
                  params=conv_params(1, out=per_cell * 4),
                  constants=dict(weights=w(per_cell * 4, 1, 1, c, scale=1.0), biases=w(per_cell * 4)))
    cls_r = b.layer("Reshape", [cls], [[1, anchors_n, cols]], name="cls_r", params=dict(shape=[1, anchors_n, cols]))
    scores = b.layer("Activation", [cls_r], [[1, anchors_n, cols]], name="scores", params=dict(method="SIGMOID"))
    deltas = b.layer("Reshape", [box], [[1, anchors_n, 4]], name="deltas", params=dict(shape=[1, anchors_n, 4]))
    dec = b.layer("DecodeBox", [scores, deltas], [[1, 20, 4], [1, 3], [1, 1], [1, 20], [1, 3]], name="decode",
                  params=dict(class_num=3, score_threshold=0.5), constants=dict(weights=anchors))
    nms = b.layer("NMS", [dec[0], dec[1], dec[2], dec[3]], [[1, 8, 4], [1, 3], [1, 8], [1, 8]], name="nms",
                  params=dict(iou_threshold=0.45, max_output_size=4))
    graph = b.build([scores, deltas] + list(nms))
    return graph, lambda seed: [torch.from_numpy(
        np.random.default_rng(seed).uniform(-1, 1, (1, h, h, 3)).astype(np.float32))]


FAMILIES = {"transformer": transformer, "speech": speech, "ocr": ocr, "unet": unet, "detection": detection}
COMPARED = {"detection": ("scores", "deltas")}
"""Outputs compared with float; a detection head's selections may legitimately differ after quantization, so
only the tensors it selects from are compared (the selections are exercised and must re-load bit for bit)."""
MIN_COSINE = {8: 0.98, 16: 0.999}


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_quantizes_and_runs(family: str, bits: int, tmp_path: Path) -> None:
    graph, sample = FAMILIES[family]()
    calib = [sample(s) for s in range(6)]
    settings = dict(q_bits_activation=bits, q_bits_weight=bits, q_bits_bias=48 if bits > 8 else 32,
                    lut_items_in_bits=10 if bits > 8 else 8, q_strategy_activation="extrema")
    qgraph = quantize_model(graph, calib, settings=settings)
    probe = sample(1)  # calibrated with `extrema`, the ranges cover it: only rounding error is measured
    float_out = [t.clone() for t in graph.forward(probe)]
    quant_out = run_quantized(qgraph, probe)
    for f, q, t in zip(float_out, quant_out, graph.output_tensors):
        if family in COMPARED and t.name not in COMPARED[family]:
            continue
        if not f.is_floating_point():  # index outputs (argmax): nearly always the same class
            assert (f.reshape(-1) == q.reshape(-1).to(f.dtype)).float().mean() >= 0.75, t.name
            continue
        assert cosine(f, q) > MIN_COSINE[bits], f"{family}/{bits} bits: output '{t.name}' cosine {cosine(f, q)}"
    ints = [t.betensor.clone() for t in qgraph.output_tensors]
    txt, _ = write_ir(qgraph, str(tmp_path / f"{family}_q.txt"))
    reloaded = read_ir(txt)
    reloaded.forward(probe)
    for a, t in zip(ints, reloaded.output_tensors):
        assert torch.equal(a, t.betensor.to(a.dtype)), f"{family}: re-loaded IR differs on '{t.name}'"
