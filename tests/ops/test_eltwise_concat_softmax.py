"""Float forward of Eltwise / Add / Sub / Mul, Concat and Softmax, against torch."""
from __future__ import annotations

from typing import Any, Callable, List, Mapping, Sequence

import pytest
import torch
import torch.nn.functional as F

from quantopt.errors import IRError
from quantopt.graph.builder import GraphBuilder

ATOL = 1e-6


def run_layer(optype: str, xs: Sequence[torch.Tensor], ir_shapes: Sequence[Sequence[int]],
              out_shape: Sequence[int], params: Mapping[str, Any] | None = None) -> torch.Tensor:
    """One-node graph with one Input per operand; the IR shapes may have a different batch than `xs`."""
    b = GraphBuilder("t")
    names = [b.input(f"x{i}", shape) for i, shape in enumerate(ir_shapes)]
    out = b.layer(optype, names, [list(out_shape)], name="op", params=params)
    return b.build([out]).forward(list(xs))[0]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(*shape) * 3.0


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=1e-6)


def ir(shape: Sequence[int]) -> List[int]:
    """The IR's version of an actual shape: batch 1."""
    return [1, *shape[1:]]


# ------------------------------------------------------------------------------------------------ Eltwise
BINARY_REFS = {"ADD": torch.add, "SUB": torch.sub, "MUL": torch.mul, "MAX": torch.maximum, "MIN": torch.minimum}


@pytest.mark.parametrize("method", list(BINARY_REFS))
def test_eltwise_method_same_shape(method: str) -> None:
    a, b = randn(2, 4, 4, 8, seed=1), randn(2, 4, 4, 8, seed=2)
    y = run_layer("Eltwise", [a, b], [ir(a.shape)] * 2, [1, 4, 4, 8], {"method": method, "with_activation": "NONE"})
    close(y, BINARY_REFS[method](a, b))


@pytest.mark.parametrize("method", list(BINARY_REFS))
@pytest.mark.parametrize("shape_b", [[3, 1, 1, 64], [1, 1, 1, 64], [64], [3, 16, 1, 1]])
def test_eltwise_broadcasting_at_batch_3(method: str, shape_b: List[int]) -> None:
    """syn_mobilenet's squeeze-excite: [1,16,16,64] * [1,1,1,64] in the IR, fed at batch 3."""
    a, b = randn(3, 16, 16, 64, seed=3), randn(*shape_b, seed=4)
    ir_b = ir(shape_b) if len(shape_b) == 4 else shape_b
    y = run_layer("Eltwise", [a, b], [ir(a.shape), ir_b], [1, 16, 16, 64], {"method": method})
    close(y, BINARY_REFS[method](a, b))


def test_eltwise_broadcasts_the_first_operand_too() -> None:
    a, b = randn(2, 1, 1, 8, seed=5), randn(2, 4, 4, 8, seed=6)
    y = run_layer("Eltwise", [a, b], [ir(a.shape), ir(b.shape)], [1, 4, 4, 8], {"method": "SUB"})
    close(y, a - b)


@pytest.mark.parametrize("method,ref", [("ADD", lambda a, b, c: a + b + c),
                                        ("MAX", lambda a, b, c: torch.maximum(torch.maximum(a, b), c)),
                                        ("MIN", lambda a, b, c: torch.minimum(torch.minimum(a, b), c))])
def test_eltwise_three_inputs(method: str, ref: Callable) -> None:
    xs = [randn(2, 3, 3, 4, seed=s) for s in (7, 8, 9)]
    y = run_layer("Eltwise", xs, [ir(x.shape) for x in xs], [1, 3, 3, 4], {"method": method})
    close(y, ref(*xs))


@pytest.mark.parametrize("act,params,ref", [
    ("RELU", {}, F.relu),
    ("RELU6", {}, F.relu6),
    ("CLIP", {"clip_min": -1.0, "clip_max": 2.5}, lambda x: torch.clamp(x, -1.0, 2.5)),
    ("LEAKYRELU", {"negative_slope": 0.1}, lambda x: F.leaky_relu(x, 0.1)),
    ("NONE", {}, lambda x: x),
])
def test_eltwise_with_activation(act: str, params: Mapping[str, Any], ref: Callable) -> None:
    a, b = randn(2, 4, 4, 8, seed=10), randn(2, 4, 4, 8, seed=11)
    y = run_layer("Eltwise", [a, b], [ir(a.shape)] * 2, [1, 4, 4, 8],
                  {"method": "ADD", "with_activation": act, **params})
    close(y, ref(a + b))


@pytest.mark.parametrize("optype,ref", [("Add", torch.add), ("Sub", torch.sub), ("Mul", torch.mul)])
def test_standalone_binary_ops_broadcast(optype: str, ref: Callable) -> None:
    """ppocr_cls: Mul [1,12,96,8] * [1,1,1,8], with_activation=NONE."""
    a, b = randn(3, 12, 96, 8, seed=12), randn(3, 1, 1, 8, seed=13)
    y = run_layer(optype, [a, b], [ir(a.shape), ir(b.shape)], [1, 12, 96, 8], {"with_activation": "NONE"})
    close(y, ref(a, b))


def test_standalone_binary_op_without_params_and_with_activation() -> None:
    a, b = randn(2, 4, 8, seed=14), randn(2, 4, 8, seed=15)
    close(run_layer("Add", [a, b], [ir(a.shape)] * 2, [1, 4, 8]), a + b)
    y = run_layer("Mul", [a, b], [ir(a.shape)] * 2, [1, 4, 8], {"with_activation": "RELU"})
    close(y, F.relu(a * b))


def test_eltwise_unknown_method_is_an_ir_error() -> None:
    a = randn(1, 2, 2, 2)
    with pytest.raises(IRError, match=r"layer 'op'.*unsupported Eltwise method 'DIV'"):
        run_layer("Eltwise", [a, a], [ir(a.shape)] * 2, [1, 2, 2, 2], {"method": "DIV"})


def test_eltwise_unknown_with_activation_is_an_ir_error() -> None:
    a = randn(1, 2, 2, 2)
    with pytest.raises(IRError, match="SIGMOID"):
        run_layer("Eltwise", [a, a], [ir(a.shape)] * 2, [1, 2, 2, 2], {"method": "ADD", "with_activation": "SIGMOID"})


@pytest.mark.parametrize("optype,params", [("Eltwise", {"method": "SUB"}), ("Eltwise", {"method": "MUL"}),
                                           ("Mul", {})])
def test_binary_only_methods_reject_three_inputs(optype: str, params: Mapping[str, Any]) -> None:
    xs = [randn(1, 2, 2, 2)] * 3
    with pytest.raises(IRError, match="exactly 2 inputs, got 3"):
        run_layer(optype, xs, [ir(x.shape) for x in xs], [1, 2, 2, 2], params)


def test_eltwise_single_input_is_an_ir_error() -> None:
    a = randn(1, 2, 2, 2)
    with pytest.raises(IRError, match="at least 2 inputs, got 1"):
        run_layer("Eltwise", [a], [ir(a.shape)], [1, 2, 2, 2], {"method": "ADD"})


def test_eltwise_shapes_that_do_not_broadcast_are_an_ir_error() -> None:
    a, b = randn(1, 4, 4, 8), randn(1, 4, 4, 3)
    with pytest.raises(IRError, match="do not broadcast"):
        run_layer("Eltwise", [a, b], [ir(a.shape), ir(b.shape)], [1, 4, 4, 8], {"method": "ADD"})


# ------------------------------------------------------------------------------------------------ Concat
@pytest.mark.parametrize("axis", [3, -1, 1, -3, 2])
def test_concat_axis(axis: int) -> None:
    shapes = [[2, 4, 4, 3], [2, 4, 4, 3]]
    xs = [randn(*s, seed=i) for i, s in enumerate(shapes)]
    ref = torch.cat(xs, dim=axis)
    y = run_layer("Concat", xs, [ir(s) for s in shapes], ir(ref.shape), {"axis": axis})
    close(y, ref)


def test_concat_three_inputs_of_different_channels_at_batch_3() -> None:
    shapes = [[3, 5, 5, 2], [3, 5, 5, 7], [3, 5, 5, 1]]
    xs = [randn(*s, seed=20 + i) for i, s in enumerate(shapes)]
    ref = torch.cat(xs, dim=-1)
    y = run_layer("Concat", xs, [ir(s) for s in shapes], ir(ref.shape), {"axis": 3})
    close(y, ref)


def test_concat_on_batch_axis() -> None:
    xs = [randn(2, 6, seed=30), randn(3, 6, seed=31)]
    y = run_layer("Concat", xs, [[2, 6], [3, 6]], [5, 6], {"axis": 0})
    close(y, torch.cat(xs, dim=0))


def test_concat_broadcasts_a_batch_1_constant_over_the_batch() -> None:
    torch.manual_seed(32)
    x, c = torch.randn(3, 2, 2, 4), torch.randn(1, 2, 2, 3)
    b = GraphBuilder("t")
    inp = b.input("x", [1, 2, 2, 4])
    const = b.layer("Constant", [], [[1, 2, 2, 3]], name="c", constants={"weights": c})
    out = b.layer("Concat", [inp, const], [[1, 2, 2, 7]], name="op", params={"axis": 3})
    y = b.build([out]).forward([x])[0]
    close(y, torch.cat([x, c.expand(3, 2, 2, 3)], dim=3))


@pytest.mark.parametrize("axis", [4, -5])
def test_concat_axis_out_of_range_is_an_ir_error(axis: int) -> None:
    a = randn(1, 2, 2, 2)
    with pytest.raises(IRError, match="out of range"):
        run_layer("Concat", [a, a], [ir(a.shape)] * 2, [1, 2, 2, 4], {"axis": axis})


def test_concat_missing_axis_is_an_ir_error() -> None:
    a = randn(1, 2, 2, 2)
    with pytest.raises(IRError, match="'axis'"):
        run_layer("Concat", [a, a], [ir(a.shape)] * 2, [1, 2, 2, 4])


def test_concat_mismatched_shapes_are_an_ir_error() -> None:
    a, b = randn(1, 2, 2, 2), randn(1, 3, 2, 2)
    with pytest.raises(IRError, match="cannot be concatenated"):
        run_layer("Concat", [a, b], [ir(a.shape), ir(b.shape)], [1, 2, 2, 4], {"axis": 3})


def test_concat_mismatched_ranks_are_an_ir_error() -> None:
    a, b = randn(1, 2, 2, 2), randn(1, 2, 2)
    with pytest.raises(IRError, match="different ranks"):
        run_layer("Concat", [a, b], [ir(a.shape), ir(b.shape)], [1, 2, 2, 4], {"axis": -1})


# ------------------------------------------------------------------------------------------------ Softmax
@pytest.mark.parametrize("axis", [1, -1, 3, 2, 0])
def test_softmax_axis(axis: int) -> None:
    x = randn(3, 4, 5, 6, seed=40)  # the IR has this batch: axis 0 is a real axis, not one sample's batch of 1
    close(run_layer("Softmax", [x], [list(x.shape)], list(x.shape), {"axis": axis}), torch.softmax(x, dim=axis))


def test_softmax_default_axis_is_last() -> None:
    x = randn(2, 3, 7, seed=41)
    close(run_layer("Softmax", [x], [ir(x.shape)], ir(x.shape)), torch.softmax(x, dim=-1))


def test_softmax_classifier_output_at_other_batch() -> None:
    """The reference models end with Softmax axis=1 on [1,N]."""
    x = randn(8, 10, seed=42) * 10.0
    y = run_layer("Softmax", [x], [[1, 10]], [1, 10], {"axis": 1})
    close(y, F.softmax(x, dim=1))
    torch.testing.assert_close(y.sum(dim=1), torch.ones(8))


@pytest.mark.parametrize("axis", [2, -3, 1.5])
def test_softmax_bad_axis_is_an_ir_error(axis: Any) -> None:
    x = randn(1, 10)
    with pytest.raises(IRError, match="axis"):
        run_layer("Softmax", [x], [[1, 10]], [1, 10], {"axis": axis})
