"""Quantized Constant layers name their integers' params (`weights_scale`, `weights_zp`, as upstream writes them), and
the exact Casts of an unsigned initial state before a recurrent layer (passes/recurrent_casts.py,
docs/semantics/recurrent.md "Cast of an unsigned initial state"), with the golden comparison pairing upstream's
run-dependent Cast names by position (tests/golden_helpers.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, List

import numpy as np
import pytest
import torch
from golden_helpers import pair_inserted_layers

import quantopt.ops  # noqa: F401  (registers the operators)
import quantopt.quantizer as quantizer_module
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model
from quantopt.quant.dtype import Dtype

T, IN, C = 4, 3, 5
CORPUS = Path(__file__).resolve().parent / "data" / "golden_corpus"


def rnn_graph(optype: str, state: float = 0.0) -> Any:
    """x [1, T, IN] -> recurrent layer whose initial state(s) read one Constant of `state` values -> outputs."""
    r = np.random.default_rng(3)
    rows = (4 if optype == "BasicLSTM" else 3) * C
    w = r.normal(0, 0.4, (rows, IN + C)).astype(np.float32)
    b = r.normal(0, 0.2, (rows + (C if optype == "GRUv1" else 0),)).astype(np.float32)
    g = GraphBuilder("rnn")
    x = g.input("x", [1, T, IN])
    h0 = g.layer("Constant", [], [[1, C]], name="state", constants={"weights": np.full((1, C), state, np.float32)})
    ins = [x, h0, h0] if optype == "BasicLSTM" else [x, h0]
    seq = ["Y", "H", "C"] if optype == "BasicLSTM" else ["H", "Hn"]
    shapes = [[1, T, C]] + [[1, C]] * (len(seq) - 1)
    outs = g.layer(optype, ins, shapes, name="rnn", constants={"weights": w, "biases": b},
                   params={"time_steps": T, "input_size": IN, "cell_size": C, "out_sequence": seq})
    return g.build(outs)


def calib(n: int = 4, seed: int = 5) -> List[List[torch.Tensor]]:
    r = np.random.default_rng(seed)
    return [[torch.from_numpy(r.normal(0.1, 1.0, (1, T, IN)).astype(np.float32))] for _ in range(n)]


def bits_settings(bits: int) -> dict:
    return dict(q_bits_activation=bits, q_bits_weight=bits, q_bits_bias=48 if bits > 8 else 32,
                lut_items_in_bits=8 if bits == 8 else 10)


def quantize(optype: str, bits: int = 8, state: float = 0.0, casts: bool = True, monkeypatch=None) -> Any:
    if not casts:
        monkeypatch.setattr(quantizer_module, "insert_recurrent_state_casts", lambda graph: [])
    return quantize_model(rnn_graph(optype, state), calib(), bits_settings(bits))


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("optype", ["BasicLSTM", "GRUv1"])
def test_zero_state_gets_one_exact_cast_per_edge(optype: str, bits: int, monkeypatch) -> None:
    """The zero state is uint8 of scale 1; each state edge gets a Cast to the signed activation dtype keeping scale
    and zero point (output range the full dtype), named deterministically; the outputs equal those of the graph
    without Casts (an independent run with the pass disabled)."""
    q = quantize(optype, bits)
    state = q.node("state")
    assert state.outputs[0].dtype is Dtype.UINT8
    casts = [n for n in q.nodes if str(n.type) == "Cast"]
    edges = 2 if optype == "BasicLSTM" else 1
    assert [n.name for n in casts] == ["state_Cast", "state_Cast_0"][:edges]
    src = state.outputs[0].name
    assert [n.outputs[0].name for n in casts] == [f"{src}_Cast_tensor_", f"{src}_Cast_tensor__0"][:edges]
    signed = Dtype.INT8 if bits == 8 else Dtype.INT16
    rnn = q.node("rnn")
    for k, cast in enumerate(casts):
        out = cast.outputs[0]
        assert cast.inputs[0] is state.outputs[0] and rnn.inputs[1 + k] is out
        assert cast.params["to_dtype"] is signed and cast.params["ignore_scale_zp"] is True
        assert str(cast.params["clip_mode"]).upper() == "SATURATION"
        qo, qs = q.quant.get(out), q.quant.get(state.outputs[0])
        assert (out.dtype, qo.qmin, qo.qmax) == (signed, -2 ** (bits - 1), 2 ** (bits - 1) - 1)
        assert float(qo.scale) == float(qs.scale) and int(qo.zerop) == int(qs.zerop)
    x = calib(1, seed=9)[0]
    got = [t.clone() for t in q.forward(x)]
    plain = quantize(optype, bits, casts=False, monkeypatch=monkeypatch)
    assert not [n for n in plain.nodes if str(n.type) == "Cast"]
    want = [t.clone() for t in plain.forward(x)]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_state_whose_codes_do_not_fit_gets_no_cast() -> None:
    """A positive constant state quantized as uint8 holds codes above 127: a saturating Cast would change it, so
    quantopt leaves it unsigned (upstream would cast it and saturate)."""
    q = quantize("GRUv1", 8, state=0.5)
    assert q.node("state").outputs[0].dtype is Dtype.UINT8
    assert int(q.node("state").constants["weights"].betensor.max()) > 127
    assert not [n for n in q.nodes if str(n.type) == "Cast"]
    assert q.node("rnn").inputs[1] is q.node("state").outputs[0]


def split_state_graph(optype: str) -> Any:
    """The Parser's bidirectional form: one zero Constant [1, 2, C], a Split into one part per direction, a Reshape
    of each to [1, C], and one recurrent layer per direction reading its Reshape as every initial state."""
    r = np.random.default_rng(4)
    rows = (4 if optype == "BasicLSTM" else 3) * C
    seq = ["Y", "H", "C"] if optype == "BasicLSTM" else ["H", "Hn"]
    g = GraphBuilder("bi")
    x = g.input("x", [1, T, IN])
    k = g.layer("Constant", [], [[1, 2, C]], name="state", constants={"weights": np.zeros((1, 2, C), np.float32)})
    parts = g.layer("Split", [k], [[1, 1, C], [1, 1, C]], name="split", params={"axis": 1, "splits": [1, 1]})
    outs = []
    for d, part in zip(("fw", "bw"), parts):
        h0 = g.layer("Reshape", [part], [[1, C]], name=f"{d}_reshape", params={"shape": [1, C]})
        w = r.normal(0, 0.4, (rows, IN + C)).astype(np.float32)
        b = r.normal(0, 0.2, (rows + (C if optype == "GRUv1" else 0),)).astype(np.float32)
        ins = [x, h0, h0] if optype == "BasicLSTM" else [x, h0]
        shapes = [[1, T, C]] + [[1, C]] * (len(seq) - 1)
        outs += g.layer(optype, ins, shapes, name=d, constants={"weights": w, "biases": b},
                        params={"time_steps": T, "input_size": IN, "cell_size": C, "out_sequence": seq,
                                "direction": "forward" if d == "fw" else "reverse"})
    return g.build(outs)


@pytest.mark.parametrize("optype", ["BasicLSTM", "GRUv1"])
def test_state_through_split_and_reshape_gets_exact_casts(optype: str, monkeypatch) -> None:
    """The zero state reaches each layer through a Split and a Reshape, which keep its integers, dtype, scale and
    zero point: every state edge gets a Cast of its Reshape's output, named after the Reshape; the integer
    outputs equal those of the graph without Casts."""
    q = quantize_model(split_state_graph(optype), calib(), bits_settings(8))
    edges = 2 if optype == "BasicLSTM" else 1
    for d in ("fw", "bw"):
        src = q.node(f"{d}_reshape").outputs[0]
        assert src.dtype is Dtype.UINT8
        casts = [n for n in q.nodes if str(n.type) == "Cast" and n.inputs[0] is src]
        assert [n.name for n in casts] == [f"{d}_reshape_Cast", f"{d}_reshape_Cast_0"][:edges]
        assert [t.name for t in q.node(d).inputs[1:]] == [n.outputs[0].name for n in casts]
        assert all(n.outputs[0].dtype is Dtype.INT8 for n in casts)
    x = calib(1, seed=17)[0]
    got = [t.clone() for t in q.forward(x)]
    monkeypatch.setattr(quantizer_module, "insert_recurrent_state_casts", lambda graph: [])
    plain = quantize_model(split_state_graph(optype), calib(), bits_settings(8))
    assert not [n for n in plain.nodes if str(n.type) == "Cast"]
    for a, b in zip(got, plain.forward(x)):
        assert torch.equal(a, b)


def test_state_through_a_layer_that_changes_its_codes_gets_no_cast(monkeypatch) -> None:
    """A data-movement layer whose output has other params than its input (set here by hand) does not pass the
    Constant's integers on as they are, so nothing proves a Cast exact: that direction's state stays unsigned, the
    other direction's gets its Cast."""
    from quantopt.passes.recurrent_casts import insert_recurrent_state_casts

    monkeypatch.setattr(quantizer_module, "insert_recurrent_state_casts", lambda graph: [])
    q = quantize_model(split_state_graph("GRUv1"), calib(), bits_settings(8))
    q.quant.of(q.node("fw_reshape").outputs[0]).scale = 2.0
    assert insert_recurrent_state_casts(q) == ["bw_reshape_Cast"]
    assert q.node("fw").inputs[1] is q.node("fw_reshape").outputs[0]


@pytest.mark.parametrize("optype", ["BasicLSTM", "GRUv1"])
def test_quantized_ir_round_trip(optype: str, tmp_path: Path) -> None:
    """The Constant's `weights_scale`/`weights_zp` and the Casts are written and read back; the re-read IR computes
    the same integers."""
    q = quantize(optype, 8)
    x = calib(1, seed=11)[0]
    before = [t.clone() for t in q.forward(x)]
    path = write_ir(q, str(tmp_path / "q.txt"))[0]
    text = Path(path).read_text()
    block = text.split("layer_name=state\n", 1)[1].split("\n\n", 1)[0]
    assert "weights_scale=1.0\n" in block and "weights_zp=0\n" in block
    re = read_ir(path)
    state = re.node("state")
    assert isinstance(state.params["weights_scale"], float) and state.params["weights_scale"] == 1.0
    assert state.params["weights_zp"] == 0
    assert [n.name for n in re.nodes if str(n.type) == "Cast"] == [n.name for n in q.nodes if str(n.type) == "Cast"]
    after = re.forward(x)
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_constant_params_are_its_output_params() -> None:
    """A non-integer constant (an additive term) is quantized with its output params, which the layer names."""
    g = GraphBuilder("c")
    x = g.input("x", [1, 4])
    k = g.layer("Constant", [], [[1, 4]], name="k", constants={"weights": np.array([[0.3, -1.7, 2.2, 0.9]],
                                                                                   np.float32)})
    y = g.layer("Add", [x, k], [[1, 4]], name="add", params={"with_activation": "NONE"})
    r = np.random.default_rng(2)
    q = quantize_model(g.build([y]), [[torch.from_numpy(r.normal(0, 1, (1, 4)).astype(np.float32))]
                                      for _ in range(3)])
    node = q.node("k")
    out = q.quant.get(node.outputs[0])
    assert node.params["weights_scale"] == float(out.scale) and node.params["weights_scale"] != 1.0
    assert node.params["weights_zp"] == int(out.zerop)
    want = torch.clamp(torch.round(torch.tensor([[0.3, -1.7, 2.2, 0.9]]) * float(out.scale) - int(out.zerop)),
                       out.qmin, out.qmax).to(torch.int64)
    assert torch.equal(node.constants["weights"].betensor.to(torch.int64).reshape(1, 4), want)


def test_onnx_export_of_the_casts_is_exact() -> None:
    pytest.importorskip("onnxruntime")
    from quantopt.exporters.agreement import measure_agreement

    # the exported cell form (the upstream form is refused by name: tests/ops/test_lstm_upstream.py)
    q = quantize_model(rnn_graph("BasicLSTM"), calib(), {**bits_settings(8), "lstm_integer_form": "q15"})
    result = measure_agreement(q, calib(2, seed=13)[0], per_layer=True)
    assert result.identical == 1.0 and min(result.layers.values()) == 1.0


# ------------------------------------------------------------------------------------------------ golden pairing
def _golden(model: str):
    return read_ir(str(CORPUS / model / "golden" / "A" / f"{model}_o.txt"), allow_unknown_keys=True)


def test_pairing_matches_inserted_layers_by_their_tensors() -> None:
    """Upstream's Casts (run-dependent names) pair with layers of the same type reading and writing the same
    tensors, or, when the written tensor's name differs too, read by the same layers at the same positions (the
    output is renamed to the golden's); a layer whose output other layers read is not paired, and layers present by
    name are left alone."""
    from quantopt.graph.tensor import PyTensor

    golden = _golden("lstm")
    first, second = [n.name for n in golden.nodes if str(n.type) == "Cast"]
    golden_second_out = [n for n in golden.nodes if n.name == second][0].outputs[0].name
    ours = _golden("lstm")
    casts = [n for n in ours.nodes if str(n.type) == "Cast"]
    assert len(casts) == 2
    casts[0].name, casts[1].name = "/rnn/Expand_Cast", "/rnn/Expand_Cast_0"
    casts[1].outputs[0].name = "another_tensor"  # same readers: paired by the second pass, output renamed back
    assert pair_inserted_layers(ours, golden) == {first: "/rnn/Expand_Cast", second: "/rnn/Expand_Cast_0"}
    assert casts[0].name == first and casts[1].name == second and casts[1].outputs[0].name == golden_second_out
    ours = _golden("lstm")
    casts = [n for n in ours.nodes if str(n.type) == "Cast"]
    casts[0].name, casts[1].name = "/rnn/Expand_Cast", "/rnn/Expand_Cast_0"
    written = casts[1].outputs[0]
    written.name = "another_tensor"
    for n in ours.nodes:  # its reader now reads something else: nothing ties it to upstream's Cast
        n.inputs = [PyTensor("unrelated") if t is written else t for t in n.inputs]
    assert pair_inserted_layers(ours, golden) == {first: "/rnn/Expand_Cast"}
    assert casts[1].name == "/rnn/Expand_Cast_0"
    assert pair_inserted_layers(_golden("lstm"), golden) == {}
