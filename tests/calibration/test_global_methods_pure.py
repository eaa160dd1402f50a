"""Global methods measure candidates on copies and set their result once (docs/global-calibration.md): a run in
which every candidate is rejected leaves the graph exactly as it was (float constants, every tensor's calibrated
range, the layers' settings), and never changes it on the way (a spy raises on the first different value set on
the graph). Each case forces the rejection by making the method's own criterion see no gain (the candidates
themselves are still built and measured), so a method that sets a candidate on the graph to measure it fails here,
whether or not it takes it back."""
from __future__ import annotations

import importlib
import itertools
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from test_global_methods_more import (
    PER_CHANNEL,
    PER_TENSOR,
    _calibrate,
    _mac_data,
    _mac_model,
    _mvn_data,
    _mvn_model,
    _norm_data,
    _norm_model,
)

from quantopt.graph.tables import RangeTable
from quantopt.graph.tensor import PyTensor
from quantopt.tuning.global_methods import apply_global_calibration


def _snapshot(g) -> Dict[Tuple[str, ...], object]:
    """Everything a global method may change, by layer: constants (values and dtype), the calibrated ranges of
    every input, output and constant, and the settings."""
    out: Dict[Tuple[str, ...], object] = {}
    for n in g.nodes:
        out[(n.name, "settings")] = n.settings
        out[(n.name, "constants")] = tuple(n.constants)
        for k, t in n.constants.items():
            out[(n.name, "const", k)] = t.betensor.clone()
        tensors = [("in", i, t) for i, t in enumerate(n.inputs)] + [("out", i, t) for i, t in enumerate(n.outputs)] + \
            [("const", k, t) for k, t in n.constants.items()]
        for kind, key, t in tensors:
            for part, r in (("tensor", g.ranges.get(t)), ("channels", g.ranges.channels(t))):
                for end, v in (("min", r.min), ("max", r.max)):
                    out[(n.name, kind, str(key), part, end)] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            torch.equal(a, b)
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and float(a) == float(b)
    return a == b


def _rising(start: float = 1.0) -> Callable[..., float]:
    """A loss that only grows: every candidate measured after the first is worse."""
    counter = itertools.count()
    return lambda *args, **kwargs: start + next(counter)


def _no_grad_constant(real: Callable) -> Callable:
    """adaround's reconstruction loss: the real one while training, a constant when the rounding is judged."""
    def recon(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return real(pred, target) if torch.is_grad_enabled() else torch.tensor(1.0)
    return recon


def _constant_loss(real: Callable) -> Callable:
    """The pair probe's loss: the candidate is still built, quantized and run on copies, then judged no better."""
    def loss(self, change) -> float:
        real(self, change)
        return 1.0
    return loss


MODULES = {name: importlib.import_module(f"quantopt.tuning.global_methods.{name}") for name in (
    "adaquant_zy", "adaround", "easy_quant", "gptq_zy", "mvn_correction", "smooth_quant_zy", "svd_quant",
    "bias_correction")}
"""The methods' modules (the package exports their functions under the same names)."""


def _reject(monkeypatch, method: str) -> None:
    """Make `method`'s criterion reject every candidate."""
    mod = MODULES.get(method)
    if method == "adaquant_zy":
        monkeypatch.setattr(mod, "_total_mse", _rising())
    elif method == "adaround":
        monkeypatch.setattr(mod, "_recon", _no_grad_constant(mod._recon))
    elif method == "easy_quant":
        monkeypatch.setattr(mod, "concat_cos", lambda ys, yq: 0.5)
    elif method == "gptq_zy":
        monkeypatch.setattr(mod, "_error", lambda *args: 1.0)
    elif method == "svd_quant":
        monkeypatch.setattr(mod, "_spectrum", lambda x: torch.zeros(1, dtype=torch.float64))
        monkeypatch.setattr(mod, "run_alone", lambda probe, xs: torch.zeros(1))
    elif method == "mvn_correction":
        monkeypatch.setattr(mod, "layer_errors", lambda g, r, d, names: {name: float(next(_COUNT)) for name in names})
    elif method in ("smooth_quant_zy", "awq_zy"):
        probe = MODULES["smooth_quant_zy"].PairProbe
        monkeypatch.setattr(probe, "loss", _constant_loss(probe.loss))
    elif method == "bias_correction":
        monkeypatch.setattr(mod, "channels_last", lambda y, channels: torch.zeros(1, channels, dtype=torch.float64))


_COUNT = itertools.count(1)


def _mac(mode: str, bits: int):
    data = _mac_data()
    return _calibrate(_mac_model(), data, q_mode_weight=mode, q_bits_weight=bits), data


def _norm():
    data = _norm_data()
    return _calibrate(_norm_model(), data, layernorm_integer_form="exact"), data


def _mvn():
    data = _mvn_data()
    return _calibrate(_mvn_model(), data), data


CASES: List[Tuple[str, Callable]] = [
    ("adaquant_zy[3,20,4,1e-3,1e-3,3e-3,1e-2]", lambda: _mac(PER_TENSOR, 4)),
    ("adaquant_zy[3,20,4,1e-3,1e-3,3e-3,1e-2]", lambda: _mac(PER_CHANNEL, 4)),
    ("adaround[3,5,4]", lambda: _mac(PER_TENSOR, 4)),
    ("easy_quant[3]", lambda: _mac(PER_TENSOR, 4)),
    ("easy_quant[3,1,0.5,2,10,0]", lambda: _mac(PER_CHANNEL, 4)),
    ("gptq_zy[3]", lambda: _mac(PER_TENSOR, 4)),
    ("svd_quant[0]", lambda: _mac(PER_TENSOR, 8)),
    ("svd_quant[3]", lambda: _mac(PER_TENSOR, 4)),
    ("bias_correction[3]", lambda: _mac(PER_TENSOR, 4)),
    ("smooth_quant_zy[0.5,1,0,1,5]", _norm),
    ("awq_zy[10,0.3]", _norm),
    ("mvn_correction", _mvn),
]


def _forbid_changes(monkeypatch, g) -> None:
    """An AssertionError as soon as anything sets a different calibrated range in the range table of `g`, or
    different values on one of its constants: with every candidate rejected, nothing of the graph may change, not
    even for a while (a candidate set to be measured and taken back)."""
    constants = {id(t) for n in g.nodes for t in n.constants.values()}
    real = PyTensor.__setattr__

    def spy(self: PyTensor, name: str, value: object) -> None:
        if name == "betensor" and id(self) in constants and not _same(getattr(self, name), value):
            raise AssertionError(f"a rejected candidate set '{name}' of tensor '{self.name}'")
        real(self, name, value)

    def spy_range(kind: str):
        real_set = getattr(RangeTable, kind)
        read = RangeTable.get if kind == "set" else RangeTable.channels

        def setter(self: RangeTable, t, lo, hi, *args, **kwargs) -> None:
            old = read(self, t)
            if self is g.ranges and not (_same(old.min, lo) and _same(old.max, hi)):
                raise AssertionError(f"a rejected candidate set the range of tensor '{getattr(t, 'name', t)}'")
            real_set(self, t, lo, hi, *args, **kwargs)
        return setter

    monkeypatch.setattr(PyTensor, "__setattr__", spy)
    monkeypatch.setattr(RangeTable, "set", spy_range("set"))
    monkeypatch.setattr(RangeTable, "set_channels", spy_range("set_channels"))


@pytest.mark.parametrize("spec, make", CASES, ids=[c[0] for c in CASES])
def test_rejected_candidates_leave_the_graph_as_it_was(monkeypatch, spec: str, make: Callable) -> None:
    g, data = make()
    before = _snapshot(g)
    _reject(monkeypatch, spec.split("[")[0])
    _forbid_changes(monkeypatch, g)
    report = apply_global_calibration(g, spec, data, log_loss=False)
    (changed_layers,) = report.values()
    assert changed_layers == [] or spec.startswith("easy_quant"), report  # easy_quant reports the layers it visited
    after = _snapshot(g)
    assert after.keys() == before.keys()
    changed = [k for k in before if not _same(before[k], after[k])]
    assert not changed, changed


@pytest.mark.parametrize("spec, make", CASES, ids=[c[0] for c in CASES])
def test_the_same_runs_accept_without_the_forced_rejection(spec: str, make: Callable) -> None:
    """The cases above change the graph when left to their criterion, so their candidates differ from the layer's
    values and a leaked candidate would show."""
    g, data = make()
    before = _snapshot(g)
    apply_global_calibration(g, spec, data, log_loss=False)
    after = _snapshot(g)
    assert any(not _same(before[k], after[k]) for k in before)
