"""CTCGreedyDecoder and CollapseRepeated: float forward against plain-python decoders written from
docs/semantics/sequence.md, quantized params, integer forward against the same decoders run on the integers,
IR write → re-read bit identity, refused quantized length inputs and bad params."""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from quant_helpers import params_of

from quantopt.errors import IRError, UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model
from quantopt.quant.dtype import Dtype

MODES = [(8, "per_tensor_symmetric_full_range"), (8, "per_tensor_asymmetric"),
         (16, "per_tensor_symmetric_full_range")]


def settings(bits: int, mode: str, **extra: Any) -> Dict[str, Any]:
    return dict(q_bits_activation=bits, q_mode_activation=mode, q_bits_bias=48 if bits > 8 else 32,
                q_strategy_activation="extrema", **extra)


def roundtrip(tmp_path, qg, feeds) -> None:
    before = [t.clone() for t in qg.forward(feeds)]
    re = read_ir(write_ir(qg, str(tmp_path / "q.txt"))[0])
    for a, b in zip(before, re.forward(feeds)):
        assert torch.equal(a, b)


# --- CTCGreedyDecoder ----------------------------------------------------------------------------------------------
def ctc_graph(batch: int, steps: int, classes: int, width: int, merge: bool = True):
    b = GraphBuilder("t")
    x = b.input("x", [batch, steps, classes])
    n = b.input("n", [batch], dtype=Dtype.INT32)
    y = b.layer("CTCGreedyDecoder", [x, n], [[batch, width, 1, 1]], name="op", params={"merge_repeated": merge},
                output_dtypes=[Dtype.INT32])
    return b.build([y])


def ref_ctc(x: np.ndarray, lengths: List[int], width: int, merge: bool, pad: int) -> np.ndarray:
    batch, steps, classes = x.shape
    out = np.full((batch, width, 1, 1), pad, dtype=np.int64)
    for b in range(batch):
        n = lengths[b] if lengths[b] > 0 else steps
        labels, prev = [], None
        for t in range(min(n, steps)):
            row = list(x[b, t])
            c = row.index(max(row))  # the first maximum
            if not (merge and c == prev) and c != classes - 1:
                labels.append(c)
            prev = c
        labels = labels[:width]
        out[b, :len(labels), 0, 0] = labels
    return out


def ctc_feeds(seed: int, batch: int = 2, steps: int = 12, classes: int = 5, lengths=None):
    rng = np.random.default_rng(seed)
    # few classes and a peaked distribution: runs and blanks both occur
    x = rng.normal(0, 1, size=(batch, steps, classes)).astype(np.float32)
    x[..., classes - 1] += 0.6
    lens = lengths if lengths is not None else list(rng.integers(1, steps + 1, size=batch))
    return [torch.from_numpy(x), torch.tensor(lens, dtype=torch.int64)]


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("bits,mode", MODES)
def test_ctc_greedy_decoder(tmp_path, merge: bool, bits: int, mode: str) -> None:
    g = ctc_graph(2, 12, 5, 10, merge)
    feeds = ctc_feeds(1, lengths=[12, 0])
    got = g.forward(feeds)[0]
    want = ref_ctc(feeds[0].numpy(), [12, 0], 10, merge, 2 ** 31 - 1)
    np.testing.assert_array_equal(got.numpy(), want)
    assert (want == 2 ** 31 - 1).any() and (want[..., 0, 0] < 4).any()
    qg = quantize_model(g, [ctc_feeds(s) for s in (2, 3, 4)], settings(bits, mode))
    out = qg.node("op").outputs[0]
    oq = params_of(qg.node("op"), out)
    assert oq.qinvariant and oq.scale == 1.0 and out.dtype == (Dtype.UINT16 if bits <= 16 else Dtype.UINT32)
    qx = qg.node("op").inputs[0]
    for seed in (5, 6):
        f = ctc_feeds(seed)
        got = qg.forward(f)[0]
        qx_val = qx.betensor.numpy()
        np.testing.assert_array_equal(got.numpy(), ref_ctc(qx_val, f[1].tolist(), 10, merge, 65535))
        # the decoded classes agree with the float ones except where quantization ties the argmax
        ties = (qx_val == qx_val.max(axis=-1, keepdims=True)).sum(axis=-1) > 1
        if not ties.any():
            np.testing.assert_array_equal(np.where(got.numpy() == 65535, -1, got.numpy()),
                                          np.where(g.forward(f)[0].numpy() == 2 ** 31 - 1, -1,
                                                   g.forward(f)[0].numpy()))
    roundtrip(tmp_path, qg, ctc_feeds(7))


def test_ctc_force_int_and_cut() -> None:
    g = ctc_graph(1, 12, 5, 2, True)
    x = torch.full((1, 12, 5), -1.0)
    for t, c in enumerate([0, 1, 2, 3, 0, 1]):
        x[0, t, c] = 1.0
    feeds = [x, torch.tensor([6])]
    assert g.forward(feeds)[0].reshape(-1).tolist() == [0, 1]  # 5 labels, 2 kept
    qg = quantize_model(g, [feeds], settings(8, "per_tensor_symmetric_full_range", force_dtype_int=True))
    out = qg.node("op").outputs[0]
    oq = params_of(qg.node("op"), out)
    assert out.dtype == Dtype.INT16 and (oq.qmin, oq.qmax) == (-32768, 32767)
    assert qg.forward(feeds)[0].reshape(-1).tolist() == [0, 1]


def test_ctc_bad_input() -> None:
    g = ctc_graph(2, 12, 5, 10)
    with pytest.raises(IRError, match="sequence lengths hold 3"):
        g.forward([ctc_feeds(1)[0], torch.tensor([[1], [2], [3]])])
    b = GraphBuilder("t")
    x = b.input("x", [1, 4, 3])
    n = b.input("n", [1])  # a float length input: quantized it is not an exact integer
    y = b.layer("CTCGreedyDecoder", [x, n], [[1, 4, 1, 1]], name="op", params={"merge_repeated": True},
                output_dtypes=[Dtype.INT32])
    g = b.build([y])
    with pytest.raises(UnsupportedError, match="lengths must be exact integers"):
        quantize_model(g, [[torch.randn(1, 4, 3), torch.tensor([2.5])]], settings(8, "per_tensor_asymmetric"))


def test_ctc_missing_merge_repeated_is_an_ir_error(tmp_path) -> None:
    path = tmp_path / "m.txt"
    text = write_ir(ctc_graph(1, 4, 3, 4), str(path))[0]
    lines = [ln for ln in open(text).read().splitlines() if not ln.startswith("merge_repeated")]
    open(text, "w").write("\n".join(lines) + "\n")
    with pytest.raises(IRError, match="merge_repeated"):
        read_ir(text)


# --- CollapseRepeated ----------------------------------------------------------------------------------------------
def collapse_graph(batch: int, maxlen: int, width: int, label_dtype: Dtype = Dtype.INT16):
    b = GraphBuilder("t")
    x = b.input("x", [batch, maxlen], dtype=label_dtype)
    n = b.input("n", [batch], dtype=Dtype.UINT32)
    y = b.layer("CollapseRepeated", [x, n], [[batch, width], [batch]], name="op", outputs=["y", "c"],
                output_dtypes=[label_dtype, Dtype.UINT32])
    return b.build(y)


def ref_collapse(labels: np.ndarray, lengths: List[int], width: int, pad) -> tuple:
    out = np.full((labels.shape[0], width), pad, dtype=labels.dtype)
    counts = []
    for b, row in enumerate(labels):
        kept = []
        for t in range(min(max(lengths[b], 0), len(row))):
            if t == 0 or row[t] != row[t - 1]:
                kept.append(row[t])
        counts.append(len(kept))
        out[b, :min(len(kept), width)] = kept[:width]
    return out, np.array(counts)


def test_collapse_repeated_integer_labels(tmp_path) -> None:
    g = collapse_graph(3, 10, 6)
    rng = np.random.default_rng(3)
    labels = torch.from_numpy(rng.integers(0, 3, size=(3, 10)))
    feeds = [labels, torch.tensor([10, 4, 0])]
    y, c = g.forward(feeds)
    want_y, want_c = ref_collapse(labels.numpy(), [10, 4, 0], 6, 0)
    np.testing.assert_array_equal(y.numpy(), want_y)
    np.testing.assert_array_equal(c.numpy(), want_c)
    qg = quantize_model(g, [feeds], settings(8, "per_tensor_asymmetric"))
    node = qg.node("op")
    for out, inp in zip(node.outputs, node.inputs):
        oq, iq = params_of(node, out), params_of(node, inp)
        assert (oq.scale, oq.zerop, out.dtype, oq.qinvariant) == (iq.scale, iq.zerop, inp.dtype, True)
    qy, qc = qg.forward(feeds)
    np.testing.assert_array_equal(qy.numpy(), want_y)
    np.testing.assert_array_equal(qc.numpy(), want_c)
    roundtrip(tmp_path, qg, feeds)


@pytest.mark.parametrize("bits,mode", MODES)
def test_collapse_repeated_float_labels(bits: int, mode: str) -> None:
    """Float labels are quantized: the integer forward collapses equal integers and pads with -zp."""
    g = collapse_graph(2, 8, 8, Dtype.FP32)

    def feeds(seed):
        r = np.random.default_rng(seed)
        return [torch.from_numpy(r.choice([0.5, 1.25, 3.0], size=(2, 8)).astype(np.float32)),
                torch.tensor([8, 5])]

    f = feeds(1)
    want_y, want_c = ref_collapse(f[0].numpy(), [8, 5], 8, np.float32(0))
    y, c = g.forward(f)
    np.testing.assert_array_equal(y.numpy(), want_y)
    qg = quantize_model(g, [feeds(s) for s in (2, 3)] + [f], settings(bits, mode))
    inp = qg.node("op").inputs[0]
    iq = params_of(qg.node("op"), inp)
    qy, qc = qg.forward(f)
    pad = min(max(-int(iq.zerop), iq.qmin), iq.qmax)
    want_qy, want_qc = ref_collapse(inp.betensor.numpy(), [8, 5], 8, pad)
    np.testing.assert_array_equal(qy.numpy(), want_qy)
    np.testing.assert_array_equal(qc.numpy(), want_c)
    deq = (qy.double() + float(iq.zerop)) / float(iq.scale)
    assert float((deq - y.double()).abs().max()) < 2.0 / float(iq.scale)


def test_collapse_repeated_bad_inputs() -> None:
    g = collapse_graph(2, 5, 5)
    with pytest.raises(IRError, match="lengths must be a"):
        g.forward([torch.zeros(2, 5, dtype=torch.int64), torch.tensor([[1], [2]])])
    b = GraphBuilder("t")
    x = b.input("x", [1, 5], dtype=Dtype.INT16)
    y = b.layer("CollapseRepeated", [x], [[1, 5], [1]], name="op")
    with pytest.raises(IRError, match="needs 2 inputs"):
        b.build(y).forward([torch.zeros(1, 5, dtype=torch.int64)])
