"""The `device` field: parsing without torch, resolution against the machine, graphs moved to a device, and the
exact-arithmetic block. The CUDA path itself needs a GPU: where torch sees one, the last test runs the digits example
on it and compares the integers with the CPU's."""
from __future__ import annotations

import pytest
import torch

from quantopt.config.kinds import DeviceKind
from quantopt.device import exact_arithmetic, resolve_device
from quantopt.errors import UnsupportedError
from quantopt.ir.reader import read_ir
from quantopt.pipeline import quantize_model, run_quantized
from quantopt.registry import discover_plugins

DIGITS = "examples/digits/model/digits.txt"


@pytest.mark.parametrize("text,value", [("auto", "auto"), (" CPU ", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1"),
                                        ("CUDA:03", "cuda:3")])
def test_field_values(text: str, value: str) -> None:
    assert DeviceKind().parse(text) == value


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "mps", ""])
def test_field_refuses_other_devices(text: str) -> None:
    with pytest.raises(ValueError):
        DeviceKind().parse(text)


def test_resolution() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UnsupportedError, match="torch sees no CUDA device"):
            resolve_device("cuda")
    else:
        with pytest.raises(UnsupportedError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_exact_arithmetic_restores_the_settings() -> None:
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    with exact_arithmetic(torch.device("cuda")):
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.deterministic
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def _digits(device: str):
    discover_plugins()
    g = read_ir(DIGITS).to(device)
    torch.manual_seed(0)
    batches = [torch.randn(4, *g.input_tensors[0].ir_shape[1:]) for _ in range(2)]
    with exact_arithmetic(torch.device(device)):
        q = quantize_model(g, batches)
        return [o.cpu() for o in run_quantized(q, batches[0])], q


def test_graph_to_cpu_runs_and_keeps_constants_there() -> None:
    outs, q = _digits("cpu")
    assert q.device == torch.device("cpu")
    assert all(t.betensor.device.type == "cpu" for n in q.nodes for t in n.constants.values())
    assert outs[0].shape[0] == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none on this machine)")
def test_cuda_integers_equal_cpu_integers() -> None:
    """One quantized IR, its integer forward on both devices: the same integers (calibration on another device may
    move a range by an ulp, so the IR is made once)."""
    cpu, q = _digits("cpu")
    q_cuda = q.clone().to("cuda")
    torch.manual_seed(0)
    x = torch.randn(4, *q.input_tensors[0].ir_shape[1:])
    with exact_arithmetic(torch.device("cuda")):
        on_cuda = run_quantized(q_cuda, x)
    on_cpu = run_quantized(q, x)
    assert all(t.betensor.device.type == "cuda" for n in q_cuda.nodes for t in n.constants.values())
    for a, b in zip(on_cpu, on_cuda):
        assert torch.equal(a, b.cpu())
