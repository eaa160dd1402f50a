"""Every golden-corpus and shared model on the emulated CUDA device of tests/fake_cuda.py, in the default suite (no
GPU needed): calibrated and quantized on the device by `quantopt --cfg` with `device = cuda`, then the written IR run
by `quantopt run --device cuda`. The emulation computes on the CPU, so the outputs must equal a CPU run's exactly;
what it catches is a tensor on the wrong device, numpy of a device tensor or an int64 GEMM CUDA lacks, the
mistakes the first GPU run found (docs/performance.md, "CUDA")."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fake_cuda import fake_cuda
from golden_helpers import golden_cfg, run_golden_cfg
from test_device_parity import FOLDERS, MODELS, _first_samples, _outputs


@pytest.fixture
def cpu_workflows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cfg runs of the test resolve `device` as written, also where QUANTOPT_TEST_DEVICE=cuda sends the suite's
    workflows to a real GPU: the reference run must compute on the CPU, as the emulation does."""
    from quantopt import device, master

    monkeypatch.setattr(master, "resolve_device", device.resolve_device)


@pytest.mark.parametrize("model", MODELS)
def test_model_on_the_emulated_device(model: str, tmp_path: Path, cpu_workflows: None) -> None:
    folder = FOLDERS[model] / "golden" / "A"
    cpu_ir = run_golden_cfg(folder, model, tmp_path / "cpu_opt", quiet=True)
    inputs = _first_samples(model, tmp_path)
    want = _outputs(cpu_ir, inputs, tmp_path / "cpu_run", "cpu", quantized=True)
    cfg = golden_cfg(folder, tmp_path / "dev_opt", tmp_path / "dev.cfg", ["device = cuda"])
    from quantopt.cli import main

    with fake_cuda():
        assert main(["--cfg", str(cfg), "--log-level", "ERROR"]) == 0
        ir = tmp_path / "dev_opt" / cpu_ir.name
        got = _outputs(ir, inputs, tmp_path / "dev_run", "cuda", quantized=True)
    assert ir.read_text() == cpu_ir.read_text()
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{model}: output {name}")
