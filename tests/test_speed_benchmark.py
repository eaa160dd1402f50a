"""The GEMM floor of benchmarks/real_model_speed.py: which float64 GEMMs a model's float forward amounts to (one
per Convolution that is not depthwise and per FullyConnected layer, at its shapes, and one per time step of a
BasicLSTM), read from a shared IR and from a recurrent graph."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

from quantopt.ir.reader import read_ir

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "data" / "shared_models" / "syn_mobilenet"


def _load_benchmark():
    name = "real_model_speed_benchmark"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "real_model_speed.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_gemm_shapes_of_a_shared_ir():
    bench = _load_benchmark()
    graph = read_ir(str(MODEL / "syn_mobilenet.txt"))
    sample = torch.from_numpy(np.load(MODEL / "calib.npy")[:1].astype(np.float32))
    seen = []
    graph.forward([sample], keep_tensors=True)
    for n in graph.nodes:
        if n.type == "FullyConnected":
            w = n.constants["weights"].betensor
            seen.append((1, n.outputs[0].betensor.numel() // int(w.shape[0]), int(w.shape[1]), int(w.shape[0]), 1))
        elif n.type == "Convolution":
            out_c, kh, kw, cin_g = (int(s) for s in n.constants["weights"].betensor.shape)
            group = int(n.params.get("group", 1))
            assert group * cin_g == int(n.inputs[0].betensor.shape[-1])
            y = n.outputs[0].betensor
            seen.append((group, y.numel() // out_c, kh * kw * cin_g, out_c // group, 1))
    shapes = bench.gemm_shapes(graph, [sample])
    assert shapes == seen
    assert len(shapes) == 13  # 12 Convolution layers and the classifier; the 3 DepthwiseConv layers are no GEMM
    assert all(m > 0 and k > 0 and n > 0 for _, m, k, n, _ in shapes)
    assert bench.gemm_floor(shapes[:2], repeat=1) > 0.0


def test_gemm_shapes_count_an_lstm_step_product_per_time_step():
    import quantopt.ops.recurrent  # noqa: F401  (registers the ops)
    from quantopt.graph.builder import GraphBuilder

    bench = _load_benchmark()
    batch, steps, isz, cs = 2, 5, 6, 8
    gen = np.random.default_rng(0)
    bld = GraphBuilder("lstm")
    ins = [bld.input("x", [batch, steps, isz]), bld.input("h", [batch, cs]), bld.input("c", [batch, cs])]
    out = bld.layer("BasicLSTM", ins, [[batch, steps, cs]], name="op",
                    params=dict(time_steps=steps, input_size=isz, cell_size=cs, out_sequence=["Y"]),
                    constants=dict(weights=gen.standard_normal((4 * cs, isz + cs)).astype(np.float32),
                                   biases=gen.standard_normal(4 * cs).astype(np.float32)))
    graph = bld.build([out])
    feeds = [torch.randn(batch, steps, isz), torch.randn(batch, cs), torch.randn(batch, cs)]
    assert bench.gemm_shapes(graph, feeds) == [(1, batch, isz + cs, 4 * cs, steps)]
