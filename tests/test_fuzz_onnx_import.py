"""Broken ONNX models end in one of quantopt's errors, never in an internal error: a short run of
benchmarks/fuzz_onnx_import.py (deterministic), and one test for each fault its campaigns found (docs/robustness.md).
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

pytest.importorskip("onnx")
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from quantopt.cli_support import guarded  # noqa: E402
from quantopt.errors import IRError, OutOfMemoryError, UnsupportedError, as_out_of_memory  # noqa: E402
from quantopt.frontends.onnx import import_onnx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import fuzz_onnx_import  # noqa: E402


def test_a_short_campaign_has_no_internal_error(tmp_path: Path) -> None:
    previous = signal.signal(signal.SIGALRM, fuzz_onnx_import._on_alarm)
    try:
        result = fuzz_onnx_import.campaign(sorted(fuzz_onnx_import.MODELS.glob("*.onnx")), tmp_path, 80, 0, 60.0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert result.cases == 80 and not result.internal and not result.hangs, fuzz_onnx_import.report([result])
    assert sum(result.refused.values()) > 40  # the mutations do break the models


def _model(nodes, inputs, outputs, initializers=(), ir_version: int = 8) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=ir_version)


def _saved(tmp_path: Path, model: onnx.ModelProto) -> str:
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    return str(path)


def _refused(tmp_path: Path, model: onnx.ModelProto, error: type, match: str) -> None:
    """Saving `model` and importing it raises `error` matching `match`."""
    with pytest.raises(error, match=match):
        import_onnx(_saved(tmp_path, model))


def _conv_mul(kernel: Sequence[int] = (3, 3)) -> onnx.ModelProto:
    """Conv -> Mul by a per-channel constant (a pattern folded into the Conv)."""
    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    k = numpy_helper.from_array(np.full((1, 4, 1, 1), 2.0, np.float32), "k")
    return _model([helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=list(kernel), pads=[1, 1, 1, 1]),
                   helper.make_node("Mul", ["c", "k"], ["y"])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, k])


@pytest.mark.parametrize("kernel", [(0, 0), (-1, -1), (7,), (1, 1, 1)])
def test_the_folding_of_a_layer_without_a_known_shape_is_left_to_the_converters(tmp_path: Path,
                                                                               kernel: Sequence[int]) -> None:
    """A Conv whose kernel_shape no shape inference can use has no output shape: the Mul folding raised KeyError
    on it; now it leaves the Conv alone and the converter reports the node."""
    path = tmp_path / "m.onnx"
    onnx.save(_conv_mul(kernel), str(path))
    with pytest.raises((IRError, UnsupportedError)) as info:
        import_onnx(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value).split(":", 1)[0]
    onnx.save(_conv_mul(), str(path))
    assert import_onnx(str(path)) is not None  # the well-formed model still imports, folded


def test_an_initializer_whose_data_does_not_fit_its_dims_is_named(tmp_path: Path) -> None:
    model = _conv_mul()
    init = next(i for i in model.graph.initializer if i.name == "k")
    del init.dims[:]
    init.dims.extend([1, 2])  # 4 values stored
    _refused(tmp_path, model, IRError, "initializer 'k'")


def test_an_initializer_of_an_unknown_data_type_is_named(tmp_path: Path) -> None:
    model = _conv_mul()
    next(i for i in model.graph.initializer if i.name == "k").data_type = 117
    _refused(tmp_path, model, IRError, "initializer 'k'.*data type 117")


def test_an_input_too_large_for_any_tensor_is_refused(tmp_path: Path) -> None:
    model = _conv_mul()
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 2 ** 40
    _refused(tmp_path, model, UnsupportedError, "input 'x' of shape")


def test_a_model_onnx_calls_invalid_is_one_ir_error(tmp_path: Path) -> None:
    model = _conv_mul()
    model.graph.node[1].input[0] = "nobody_makes_this"
    _refused(tmp_path, model, IRError, "not a valid ONNX model: .*nobody_makes_this")


def test_an_old_ir_version_without_initializer_inputs_still_imports(tmp_path: Path) -> None:
    """IR versions before 4 want every initializer listed as a graph input; files that do not are read anyway."""
    path = tmp_path / "m.onnx"
    onnx.save(_model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                            [1, 4])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                     [numpy_helper.from_array(np.ones(1, np.float32), "unused")], ir_version=3), str(path))
    assert import_onnx(str(path)) is not None


@pytest.mark.parametrize("error", [MemoryError("Unable to allocate 8.00 TiB for an array"),
                                   RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                                                "allocate memory: you tried to allocate 844424930131968 bytes"),
                                   RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")])
def test_an_allocation_failure_is_one_out_of_memory_line(error: Exception, caplog) -> None:
    def fail() -> int:
        raise error

    assert guarded(fail, debug=False) == OutOfMemoryError.exit_code == 7
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(lines) == 1 and lines[0].startswith("out of memory: ") and "smaller batch sizes" in lines[0], lines


def test_other_errors_stay_internal_errors(caplog) -> None:
    assert as_out_of_memory(RuntimeError("shape mismatch")) is None

    def fail() -> int:
        raise RuntimeError("shape mismatch")

    assert guarded(fail, debug=False) == 1
    assert "internal error: RuntimeError: shape mismatch" in caplog.text


def test_a_name_that_is_not_utf8_is_one_ir_error(tmp_path: Path) -> None:
    """protobuf hands such a string field over as bytes, which the layer naming stumbled on (AttributeError)."""
    model = _conv_mul()
    model.graph.node[1].name = "mulAAAA"
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString().replace(b"mulAAAA", b"mul\xff\xfe\xfd\xfc"))
    with pytest.raises(IRError, match="not UTF-8 text"):
        import_onnx(str(path))


def test_a_bool_input_of_a_subtraction_is_one_ir_error(tmp_path: Path) -> None:
    """A mask input declared bool and read by Sub (1 - mask): torch has no bool subtraction (RuntimeError)."""
    import torch

    from quantopt.registry import discover_plugins

    discover_plugins()
    one = numpy_helper.from_array(np.ones((1, 4), np.float32), "one")
    path = tmp_path / "m.onnx"
    onnx.save(_model([helper.make_node("Sub", ["one", "mask"], ["y"])],
                     [helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 4])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [one]), str(path))
    graph = import_onnx(str(path))
    with pytest.raises(IRError, match="SUB of bool input"):
        with torch.no_grad():
            graph.forward(graph.zero_inputs())


def test_a_constant_of_an_unknown_data_type_is_one_ir_error(tmp_path: Path) -> None:
    """onnx's reader raised KeyError for the data type (a flipped byte); the checker lets it through."""
    value = numpy_helper.from_array(np.ones(4, np.float32), "v")
    value.data_type = 91
    path = tmp_path / "m.onnx"
    onnx.save(_model([helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Add", ["x", "c"], ["y"])],
                     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])]), str(path))
    with pytest.raises(IRError, match="Constant node .*cannot be read"):
        import_onnx(str(path))


def test_an_opset_newer_than_the_installed_onnx_still_imports(tmp_path: Path) -> None:
    """The checker has no schemas for such an opset: the model is imported as before the check (with the newer
    opset warning), not refused."""
    model = _conv_mul()
    model.opset_import[0].version = onnx.defs.onnx_opset_version() + 1
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    assert import_onnx(str(path)) is not None


def test_a_node_of_a_newer_opset_with_a_dropped_input_is_one_ir_error(tmp_path: Path) -> None:
    """Without the checker (an opset newer than onnx knows) the node counts are still checked against the newest
    schemas: a Mul with one input made the fusions index past its inputs (IndexError)."""
    model = _conv_mul()
    model.opset_import[0].version = onnx.defs.onnx_opset_version() + 1
    del model.graph.node[1].input[1]
    _refused(tmp_path, model, IRError, r"node '.*' \(Mul\) has 1 input\(s\) and 1 output\(s\); its schema takes 2-2")


def test_an_attribute_of_the_wrong_type_in_a_newer_opset_is_one_ir_error(tmp_path: Path) -> None:
    """A float `keepdims` where the schema wants an int made a fusion iterate a float (TypeError)."""
    model = _model([helper.make_node("ReduceMean", ["x"], ["y"], keepdims=1.5)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])])
    model.opset_import[0].version = onnx.defs.onnx_opset_version() + 1
    _refused(tmp_path, model, IRError, "attribute 'keepdims' of node .* is of type FLOAT; its schema says INT")


def test_reduce_axes_of_another_type_are_no_layernorm_pattern(tmp_path: Path) -> None:
    """An `axes` attribute the newest schema does not have (opset 18 made it an input), given as a float: the
    LayerNorm matcher iterated it (TypeError); now the node is left to its converter, which reports it."""
    model = _model([helper.make_node("ReduceMean", ["x"], ["m"], axes=2.0),
                    helper.make_node("Sub", ["x", "m"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    model.opset_import[0].version = onnx.defs.onnx_opset_version() + 1
    _refused(tmp_path, model, UnsupportedError, "ReduceMean")


def test_a_constant_of_shape_with_a_float_shape_is_reported_not_folded(tmp_path: Path) -> None:
    """The folding took the product of a NaN shape as an integer (ValueError); a shape of another type than
    integers is now left to the converter, which reports the node."""
    shape = numpy_helper.from_array(np.array([np.nan, 4], np.float32), "s")
    model = _model([helper.make_node("Constant", [], ["shape"], value=shape),
                    helper.make_node("ConstantOfShape", ["shape"], ["c"]), helper.make_node("Add", ["x", "c"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    with pytest.raises((IRError, UnsupportedError)):
        import_onnx(_saved(tmp_path, model))


def test_a_conv_of_scalar_weights_before_an_add_is_left_to_its_converter(tmp_path: Path) -> None:
    """Seed 18: a Conv whose weights are a scalar constant, followed by the Add of a constant: the bias fusion read
    the weights' output channels (an IndexError); the Conv converter now refuses the layer, naming the weights."""
    w = numpy_helper.from_array(np.array(2.0, np.float32), "w")
    k = numpy_helper.from_array(np.full((1, 4, 1, 1), 1.0, np.float32), "k")
    model = _model([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Add", ["c", "k"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, k])
    _refused(tmp_path, model, UnsupportedError, r"node 'Conv_0' \(Conv.*weights 'w' of shape \[\]: a convolution needs")
