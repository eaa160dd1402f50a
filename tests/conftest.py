"""Shared test fixtures: paths to the reference models with upstream goldens (tests/data/shared_models), and the
device every cfg workflow of the suite runs on.

`QUANTOPT_TEST_DEVICE=cuda python -m pytest` runs the same suite with every `quantopt --cfg` the tests start computing
on that device (the goldens included), and tests/test_device_parity.py
compares each corpus model's outputs on it with the CPU's. `QUANTOPT_TEST_DEVICE=fake-cuda` does the same on a CPU
emulation of a CUDA device (tests/fake_cuda.py), which finds tensors on the wrong device without a GPU. Unset, the
suite runs on the CPU (docs/performance.md, "Devices")."""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

CPU_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2"}
"""The committed goldens were made by the upstream optimizer on an x86-64 CPU with AVX2 and no AVX-512, and its
float forward is torch's CPU kernels, whose softmax and GELU round differently with 512-bit vectors. The suite asks
torch and oneDNN for their AVX2 kernels (before torch is imported; a variable already set is kept), so that the
goldens hold on AVX-512 machines too (docs/golden-differences.md, "Machines"). MKL is left alone: asked for AVX2
on an Intel CPU, its float64 GEMMs change with the thread count."""
if "torch" not in sys.modules:
    for _name, _value in CPU_KERNELS.items():
        os.environ.setdefault(_name, _value)

REPO = Path(__file__).resolve().parents[1]
SHARED_MODELS = Path(os.environ.get("QUANTOPT_SHARED_MODELS", REPO / "tests" / "data" / "shared_models"))
MODEL_NAMES = ["syn_resnet", "syn_mobilenet", "ppocr_cls", "mtcnn_onet"]
TEST_DEVICE = os.environ.get("QUANTOPT_TEST_DEVICE", "").strip()


@pytest.fixture(scope="session", autouse=True)
def _load_plugins():
    from quantopt.registry import discover_plugins

    discover_plugins()


@pytest.fixture(scope="session", autouse=True)
def _workflow_device():
    """With QUANTOPT_TEST_DEVICE set, every `quantopt --cfg` workflow of the session runs on that device where its
    cfg leaves `device` at the CPU (the field's listing and defaults stay as they are); `fake-cuda` means `cuda` on
    the CPU emulation of tests/fake_cuda.py (device mistakes without a GPU)."""
    if not TEST_DEVICE:
        yield
        return
    from fake_cuda import fake_cuda

    from quantopt import master
    from quantopt.device import parse_device, resolve_device

    emulated = TEST_DEVICE.lower() == "fake-cuda"
    device = "cuda" if emulated else parse_device(TEST_DEVICE)

    def on_test_device(spec: str = "auto"):
        return resolve_device(device if parse_device(spec) == "cpu" else spec)

    saved = master.resolve_device
    master.resolve_device = on_test_device
    try:
        with fake_cuda() if emulated else contextlib.nullcontext():
            yield
    finally:
        master.resolve_device = saved


def shared_model_dir(name: str) -> Path:
    path = SHARED_MODELS / name
    if not path.is_dir():
        pytest.skip(f"reference model folder {path} is not present")
    return path
