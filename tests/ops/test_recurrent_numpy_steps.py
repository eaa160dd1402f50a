"""The numpy steps of small recurrent cells (ops/_recurrent_steps.py) against the torch steps they stand in for:
the same integers for every form, cell and bit width, with one initial-state row for a batch of several, over
forwards whose data bounds differ (the forms kept per bound), and the torch steps taken where they do not apply.

The Python-integer references of each form are in test_lstm_upstream.py, test_gru_upstream.py and test_recurrent.py;
here the two implementations are compared on cases those leave out."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from test_recurrent import build, feeds, gru_weights, lstm_weights
from test_recurrent import settings as cell_settings

import quantopt.ops.recurrent  # noqa: F401  (registers the ops)
from quantopt.ops import _recurrent_steps, recurrent
from quantopt.pipeline import quantize_model

CELLS = [("BasicLSTM", {}), ("BasicLSTM", {"direction": "reverse", "out_sequence": ["H", "C", "Y"]}),
         ("GRUv3", {"version": "GRUV1"}), ("GRUv3", {"version": "GRUV3", "direction": "reverse"})]


def quantized(optype: str, params: Dict[str, Any], bits: int, form: str):
    _, w, b = lstm_weights(20) if optype == "BasicLSTM" else gru_weights(20, params.get("version", "GRUV3"))
    g = build(optype, params, w, b)
    data = [feeds(s, optype) for s in (21, 22)]
    chosen = cell_settings(bits, "per_tensor_asymmetric", "per_channel_symmetric_restricted_range",
                           lstm_integer_form=form, gru_integer_form=form)
    return quantize_model(g, data, chosen)


def recording(steps, ran: List[bool]):
    """`steps` (a numpy-steps function), noting in `ran` whether each call applied."""
    def call(*args):
        result = steps(*args)
        ran.append(result is not None)
        return result
    return call


def outputs(qg, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    return [t.clone() for t in qg.forward(inputs)]


@pytest.mark.parametrize("products", ["numpy", "torch"])
@pytest.mark.parametrize("form", ["upstream", "q15"])
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("optype,params", CELLS)
def test_numpy_steps_give_the_torch_steps_integers(monkeypatch, optype: str, params: Dict[str, Any], bits: int,
                                                   form: str, products: str) -> None:
    """`products`: the steps' weight products by numpy's GEMM, or all by torch's (NUMPY_PRODUCT_TERMS 0)."""
    if products == "torch":
        monkeypatch.setattr(_recurrent_steps, "NUMPY_PRODUCT_TERMS", 0)
    qg = quantized(optype, params, bits, form)
    ran: List[bool] = []
    names = ("lstm_steps", "q15_lstm_steps") if optype == "BasicLSTM" else ("gru_steps", "q15_gru_steps")
    for name in names:
        monkeypatch.setattr(recurrent, name, recording(getattr(recurrent, name), ran))
    # one initial-state row for three sequences, then a batch of its own rows far outside the calibrated range
    cases = [feeds(30, optype, n=3, h_batch=1), feeds(31, optype, n=3, x_std=25.0, h_scale=1.0),
             feeds(32, optype, n=1, x_std=0.5)]
    got = [outputs(qg, x) for x in cases]
    assert ran and all(ran)
    monkeypatch.setattr(_recurrent_steps, "NUMPY_STEP_VALUES", 0)
    ran.clear()
    want = [outputs(qg, x) for x in cases]
    assert ran and not any(ran)
    for g_case, w_case in zip(got, want):
        for a, b in zip(g_case, w_case):
            assert a.dtype == torch.int64 and torch.equal(a, b)


def test_large_cells_keep_the_int8_gemm(monkeypatch) -> None:
    """Where the torch steps take the int8 GEMM, a cell with more than NUMPY_STEP_WEIGHTS hidden weights keeps
    them (its float64 weights read every step would cost more than the kernel calls saved)."""
    from quantopt.ops import _int8_gemm

    monkeypatch.setattr(_int8_gemm, "int8_gemm_used", lambda: True)
    monkeypatch.setattr(_int8_gemm, "INT8_MATMUL_MIN_WEIGHTS", 1)
    qg = quantized("BasicLSTM", {}, 8, "upstream")
    x = feeds(40, "BasicLSTM", n=2)
    ran: List[bool] = []
    plain = recurrent.lstm_steps
    monkeypatch.setattr(recurrent, "lstm_steps", lambda *a: ran.append(plain(*a) is not None) or None)
    outputs(qg, x)
    assert ran == [True]
    monkeypatch.setattr(_recurrent_steps, "NUMPY_STEP_WEIGHTS", 4)  # this cell's hidden weights: more than 4
    for node in qg.nodes:  # plans made again (they keep their numpy forms)
        for key in [k for k in node.attrs if k.startswith("_memo_")]:
            del node.attrs[key]
    outputs(qg, x)
    assert ran == [True, False]


@pytest.mark.parametrize("form", ["upstream", "q15"])
@pytest.mark.parametrize("optype,params", [CELLS[0], CELLS[2]])
def test_step_forms_are_made_once_for_new_data(monkeypatch, optype: str, params: Dict[str, Any], form: str) -> None:
    """The per-step forms (a few per time step) depend on the layer and the states' bound only; what depends on each
    forward's input projection (the gates' requantization) is made per forward. Forwards of new data must not make
    them again: that had cost half a forward of a 200-step cell."""
    qg = quantized(optype, params, 8, form)
    builders = {("BasicLSTM", "upstream"): "_lstm_forms", ("BasicLSTM", "q15"): "_q15_lstm_forms",
                ("GRUv3", "upstream"): "_gru_forms", ("GRUv3", "q15"): "_q15_gru_forms"}
    name = builders[(optype, form)]
    built: List[int] = []
    plain = getattr(_recurrent_steps, name)
    monkeypatch.setattr(_recurrent_steps, name, lambda *a: built.append(1) or plain(*a))
    for seed, scale in ((50, 1.0), (51, 3.0), (52, 0.3)):
        outputs(qg, feeds(seed, optype, n=2, x_std=scale))
    assert built == [1]
