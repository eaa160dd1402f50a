"""Golden vectors of upstream's integer forward for operators whose quantopt integer forward follows it.

    python benchmarks/make_upstream_forward_goldens.py [--upstream DIR] [--out tests/data/upstream_forward]

For each small case below, quantopt builds a one-layer float graph, quantizes it (seeded data) and writes the
quantized IR; the upstream optimizer, run as a separate program in its own venv (benchmarks/upstream_interchange.py
explains the environment), loads that IR with its forward tool, runs seeded integer inputs through it and saves the
layer's input and output integers. The case's IR and both integer tensors are committed as JSON
(`<case>.json`) and `<case>_o.txt/.bin`; tests/ops/test_upstream_forward_goldens.py feeds the input integers to
quantopt's layer and requires the same output integers. quantopt itself never imports or calls upstream.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantopt.graph.builder import GraphBuilder  # noqa: E402
from quantopt.ir.writer import write_ir  # noqa: E402
from quantopt.pipeline import quantize_model  # noqa: E402

DRIVER = r'''
import json, sys
import numpy as np
from AIPUBuilder.Optimizer.tools.optimizer_forward import OptForward
txt, bin_path, feeds, out = sys.argv[1:5]
handler = OptForward(txt, bin_path)
data = np.load(feeds)
handler.forward_with_quantized_data([data[f"arr_{i}"] for i in range(len(data.files))], keep_tensors=True)
node = [n for n in handler.optimizer.g.nodes if n.name == "op"][0]
json.dump({"input": node.inputs[0].betensor.cpu().long().tolist(),
           "output": node.outputs[0].betensor.cpu().long().tolist()}, open(out, "w"))
'''

CASES: Dict[str, Dict[str, Any]] = {
    # FAST_EXP Softmax, table path (adjust_q 8, quantopt's default; 11), rows of 17 and of 40
    "softmax_fast_exp_q8": dict(op="Softmax", shape=[2, 4, 17], out=[2, 4, 17],
                                params={"axis": -1, "quantize_method": "FAST_EXP"}, std=4.0, code_std=12.0),
    "softmax_fast_exp_q11": dict(op="Softmax", shape=[3, 40], out=[3, 40],
                                 params={"axis": -1, "quantize_method": "FAST_EXP", "adjust_q": 11}, std=6.0,
                                 code_std=20.0),
    # AVG pooling: a padded 3x3/2 window (counts 4, 6, 9), and a 2x96 global window (count 192)
    "pooling_avg_pad": dict(op="Pooling", shape=[1, 9, 10, 3], out=[1, 5, 5, 3], std=2.0,
                            params={"method": "AVG", "kernel_y": 3, "kernel_x": 3, "stride_y": 2, "stride_x": 2,
                                    "pad_top": 1, "pad_bottom": 1, "pad_left": 1, "pad_right": 1,
                                    "dilation_y": 1, "dilation_x": 1, "ceil_mode": False,
                                    "count_include_pad": False}),
    "pooling_avg_global": dict(op="Pooling", shape=[1, 2, 96, 64], out=[1, 1, 1, 64], std=2.0, code_lo=40,
                               params={"method": "AVG", "kernel_y": 2, "kernel_x": 96, "stride_y": 1, "stride_x": 1,
                                       "pad_top": 0, "pad_bottom": 0, "pad_left": 0, "pad_right": 0,
                                       "dilation_y": 1, "dilation_x": 1, "ceil_mode": False,
                                       "count_include_pad": False}),
}
SETTINGS = {"q_mode_activation": "per_tensor_asymmetric", "q_bits_activation": 8, "q_strategy_activation": "extrema"}


def make_case(name: str, case: Dict[str, Any], out_dir: Path, upstream: Path, work: str) -> None:
    b = GraphBuilder(name)
    x = b.input("x", list(case["shape"]))
    y = b.layer(case["op"], [x], [list(case["out"])], name="op", params=dict(case["params"]))
    graph = b.build([y])
    rng = np.random.default_rng(sum(map(ord, name)))  # seeded per case
    calib = [[torch.from_numpy(rng.normal(0.3, case["std"], case["shape"]).astype(np.float32))] for _ in range(3)]
    qgraph = quantize_model(graph, calib, SETTINGS)
    txt, bin_path = write_ir(qgraph, str(out_dir / f"{name}_o.txt"))
    inp = qgraph.quant.get(qgraph.input_tensors[0])  # the quantized input's params
    if "code_std" in case:  # logits a few dozen codes apart: varied probabilities
        codes = np.clip(np.rint(rng.normal(0.0, case["code_std"], case["shape"])), int(inp.qmin), int(inp.qmax))
    else:  # code_lo: averages far from zero, where the 8-bit multiplier's error reaches the rounding
        codes = rng.integers(case.get("code_lo", int(inp.qmin)), int(inp.qmax) + 1, size=case["shape"])
    feeds = os.path.join(work, f"{name}_in.npz")
    np.savez(feeds, codes.astype(np.int8 if int(inp.qmin) < 0 else np.uint8))
    result = os.path.join(work, f"{name}.json")
    venv = Path(os.environ.get("UPSTREAM_OPT_VENV", "/tmp/upstream-opt-venv"))
    driver = os.path.join(work, "driver.py")
    Path(driver).write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=f"{upstream / 'Compass_Optimizer'}:{upstream / 'stubs'}",
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    subprocess.run([str(venv / "bin" / "python"), driver, txt, bin_path, feeds, result], env=env, check=True,
                   cwd=work, stdout=subprocess.DEVNULL)
    data = json.loads(Path(result).read_text())
    data["case"] = name
    (out_dir / f"{name}.json").write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"{name}: {np.asarray(data['output']).size} output integers")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", default=os.environ.get("QUANTOPT_UPSTREAM", str(ROOT.parent / "shared" / "upstream")))
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "upstream_forward"))
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for name, case in CASES.items():
            make_case(name, case, out_dir, Path(args.upstream), work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
