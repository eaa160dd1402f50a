"""`enable_pass_merge_matmul_mul`'s first step (passes/mul_to_batchnorm.py): which Muls by a scalar Constant become
BatchNorms, that the float model computes the same values afterwards, how such a BatchNorm quantizes (the weight
bits a Mul would have had, per tensor or per channel as `q_mode_weight` says) and that a MatMul still folds it."""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import pytest
import torch

from quantopt.config.layer_settings import MUL_AS_BATCHNORM
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import QuantizeGraph
from quantopt.passes.merge_matmul_mul import FUSED_MULTIPLIER, merge_matmul_mul
from quantopt.passes.mul_to_batchnorm import mul_to_batchnorm
from quantopt.pipeline import quantize_model

SHAPE = [1, 8, 32]


def _scaled(value: float = 0.25, const_shape: Optional[List[int]] = None, second_reader: bool = False,
            act: str = "NONE", out_shape: Optional[List[int]] = None) -> QuantizeGraph:
    """x -> Exp -> Mul by a Constant -> Log (the graph output)."""
    shape = const_shape if const_shape is not None else []
    b = GraphBuilder("scaled")
    b.input("x", SHAPE)
    b.layer("Exp", ["x"], [SHAPE], name="exp")
    b.layer("Constant", [], [shape], name="c", constants={"weights": np.full(shape, value, np.float32)})
    b.layer("Mul", ["exp", "c"], [out_shape or SHAPE], name="mul", params={"with_activation": act})
    b.layer("Log", ["mul"], [out_shape or SHAPE], name="log")
    outputs = ["log"]
    if second_reader:
        b.layer("Add", ["log", "c"], [SHAPE], name="add", params={"with_activation": "NONE"})
        outputs = ["add"]
    return b.build(outputs)


def _types(graph: QuantizeGraph) -> Dict[str, str]:
    return {n.name: str(n.type) for n in graph.nodes}


def _out(graph: QuantizeGraph, x: torch.Tensor) -> torch.Tensor:
    graph.forward([x])
    return graph.output_tensors[0].betensor.clone()


@pytest.mark.parametrize("act", ["NONE", "RELU"])
def test_scalar_mul_becomes_batchnorm_with_the_same_float_values(act: str) -> None:
    g = _scaled(act=act)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    before = _out(g, x)
    assert mul_to_batchnorm(g) == [("mul", 0.25)]
    assert _types(g) == {"x": "Input", "exp": "Exp", "mul": "BatchNorm", "log": "Log"}
    bn = g.node("mul")
    assert [t.name for t in bn.inputs] == ["exp"]
    assert bn.params["axis"] == 2 and bn.params["epsilon"] == 0 and bn.params["with_activation"] == act
    assert torch.equal(bn.constants["weights"].betensor, torch.full([32], 0.25))
    assert torch.equal(bn.constants["biases"].betensor, torch.zeros(32))
    assert bn.attrs[MUL_AS_BATCHNORM]
    assert torch.equal(_out(g, x), before)


@pytest.mark.parametrize("case", ["integer", "vector", "second_reader", "broadcast", "infinite"])
def test_not_rewritten(case: str) -> None:
    g = {"integer": lambda: _scaled(4.0),
         "vector": lambda: _scaled(const_shape=[32]),
         "second_reader": lambda: _scaled(second_reader=True),
         "broadcast": lambda: _scaled(const_shape=[1, 1, 1, 1], out_shape=[1, 1, 8, 32]),
         "infinite": lambda: _scaled(float("inf"))}[case]()
    assert mul_to_batchnorm(g) == []
    assert _types(g)["mul"] == "Mul" and "c" in _types(g)


def test_the_batchnorm_after_a_matmul_still_folds() -> None:
    b = GraphBuilder("attn")
    b.input("q", [1, 2, 8, 4])
    b.input("k", [1, 2, 4, 8])
    b.layer("MatMul", ["q", "k"], [[1, 2, 8, 8]], name="mm",
            params={"trans_a": False, "trans_b": False, "with_activation": "NONE"})
    b.layer("Constant", [], [[]], name="c", constants={"weights": np.float32(0.5 ** 0.5)})
    b.layer("Mul", ["mm", "c"], [[1, 2, 8, 8]], name="mul", params={"with_activation": "NONE"})
    b.layer("Softmax", ["mul"], [[1, 2, 8, 8]], name="sm", params={"axis": -1})
    g = b.build(["sm"])
    mul_to_batchnorm(g)
    assert merge_matmul_mul(g) == [("mm", "mul", float(np.float32(0.5 ** 0.5)))]
    assert _types(g)["mul"] == "Crop" and g.node("mm").params[FUSED_MULTIPLIER] > 0


@pytest.mark.parametrize("mode", ["per_tensor_symmetric_restricted_range", "per_channel_symmetric_restricted_range"])
def test_quantized_like_upstream(mode: str) -> None:
    """The weights keep the Mul's 8 bits (a model's BatchNorm takes 16); per-tensor weights give one pair."""
    gen = torch.Generator().manual_seed(1)
    q = quantize_model(_scaled(), [torch.randn(SHAPE, generator=gen) for _ in range(3)],
                       settings={"q_mode_weight": mode})
    bn = q.node("mul")
    assert str(bn.type) == "BatchNorm" and bn.constants["weights"].dtype.bits == 8
    if mode.startswith("per_tensor"):
        assert bn.params["weights_scale"] == pytest.approx(127 / 0.25)
        assert "scale_value" in bn.params and "scale" not in bn.constants
    else:
        assert "scale" in bn.constants and bn.constants["weights_scale"].betensor.numel() == 32
