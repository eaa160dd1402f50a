"""A whole `quantopt --cfg` run never loads torch's symbolic-shape machinery (sympy and what imports it).

Some torch Python helpers (`torch.broadcast_shapes` among them) import `torch._refs` and with it sympy and
`torch.fx.experimental.symbolic_shapes` on their first call: about 0.4 s of CPU, more than quantizing a small model
takes (docs/performance.md). The operators and passes use their own shape helpers instead; this test fails when a
code path of the workflow reaches such a helper again. Each run is a fresh interpreter, so nothing imported by the
test session counts.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_fast_start import clean_env

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
SYMBOLIC = ("sympy", "torch.fx.experimental.symbolic_shapes")

DRIVER = """
import json, sys
report, argv = sys.argv[1], sys.argv[2:]
from quantopt.cli import main
rc = main(argv)
json.dump({"rc": rc, "loaded": [m for m in MODULES if m in sys.modules]}, open(report, "w"))
""".replace("MODULES", repr(SYMBOLIC))

MODELS = {
    # PReLU (its slope's broadcast is checked when it is quantized), convolutions, pooling, FullyConnected, Softmax
    "mtcnn_onet": DATA / "shared_models" / "mtcnn_onet",
    # attention with a causal mask: the scaled-dot-product pass, MatMul, LayerNorm
    "gpt_decoder": DATA / "golden_corpus" / "gpt_decoder",
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_quantize_run_loads_no_symbolic_shapes(tmp_path: Path, name: str) -> None:
    folder = MODELS[name]
    cfg = tmp_path / "opt.cfg"
    cfg.write_text("[Common]\n"
                   f"graph = {folder / (name + '.txt')}\n"
                   f"bin = {folder / (name + '.bin')}\n"
                   f"model_name = {name}\n"
                   "dataset = numpydataset\n"
                   f"calibration_data = {folder / 'calib.npy'}\n"
                   "calibration_batch_size = 1\n"
                   f"output_dir = {tmp_path / 'out'}\n")
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(report), "--cfg", str(cfg)], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["rc"] == 0
    assert result["loaded"] == [], f"the workflow imported {result['loaded']}"
    assert (tmp_path / "out" / f"{name}_o.txt").is_file()
