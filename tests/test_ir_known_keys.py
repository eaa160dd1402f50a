"""The layer keys each operator declares (quantopt.registry.declare_op) against the operators' source, and the
reader's check of them: an op that starts reading a new parameter must declare it, or every IR using it would be
refused; the declared kinds keep the geometry rules (sizes, shapes, axes) that keep a malformed IR out of the ops."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Set

import pytest

import quantopt.ops  # noqa: F401  (registers the built-in operators)
from quantopt.errors import IRError, PluginError
from quantopt.ir.reader import read_ir
from quantopt.registry import OP_FORWARD, OP_QUANTIZE, OP_SPECS, known_keys, register_op_keys
from quantopt.registry.known_keys import COMMON_KEYS, declared_types, is_builtin, is_known, param_problem
from quantopt.registry.known_keys import known_keys as keys_of
from quantopt.registry.optype import OpType, register_optype

OPS_DIR = Path(quantopt.ops.__file__).parent
_READ = re.compile(r"""(?:get_param|params\.get|get_constant)\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']""")


def _types_by_module() -> Dict[str, Set[str]]:
    """Built-in operator types per ops module (from the registries: where each forward/quantize is defined)."""
    out: Dict[str, Set[str]] = {}
    for table in (OP_FORWARD, OP_QUANTIZE):
        for optype, reg in table.active.items():
            if reg.builtin:
                out.setdefault(reg.obj.__module__.rsplit(".", 1)[-1], set()).add(optype)
    return out


def _builtin_declared() -> Dict[str, frozenset]:
    return {t: schema.keys() for t, schema in declared_types().items() if is_builtin(t)}


@pytest.mark.parametrize("path", sorted(OPS_DIR.glob("*.py")), ids=lambda p: p.name)
def test_every_param_an_op_reads_is_declared(path: Path) -> None:
    """Literal get_param("k") / params.get("k") / get_constant("k") in an ops module must be a declared key of a
    type the module registers (helper modules, `_*.py`: of some built-in type)."""
    types = _types_by_module().get(path.stem)
    declared = _builtin_declared()
    if types is None:
        types = set(declared)
    allowed = frozenset().union(*(declared.get(t, frozenset()) for t in types))
    read = set(_READ.findall(path.read_text()))
    missing = sorted(k for k in read if not is_known(k, allowed))
    assert not missing, f"{path.name} reads {missing}: declare them in its declare_op for {sorted(types)}"


def test_every_builtin_operator_has_a_declaration() -> None:
    implemented = {t for table in (OP_FORWARD, OP_QUANTIZE) for t, r in table.active.items() if r.builtin}
    assert implemented <= set(_builtin_declared()), sorted(implemented - set(_builtin_declared()))
    for optype in implemented:  # the declaration and the registrations live in one module
        spec_module = Path(OP_SPECS[optype].source).stem
        for table in (OP_FORWARD, OP_QUANTIZE):
            reg = table.get(optype)
            assert reg is not None and reg.obj.__module__.rsplit(".", 1)[-1] == spec_module, (optype, spec_module)


def test_declarations_name_real_types_and_identifier_keys() -> None:
    for optype, keys in _builtin_declared().items():
        assert optype in OpType, optype
        for k in keys:
            assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", k), (optype, k)
    assert {"layer_id", "layer_top_scale", "is_perf_mode", "scale_value"} <= COMMON_KEYS


def test_derived_quantization_keys_and_debug_keys() -> None:
    conv = keys_of("Convolution")
    assert conv is not None
    for key in ("weights_scale", "biases_zp", "weights_range", "D_cos", "layer_top_range"):
        assert is_known(key, conv), key
    assert is_known("lut_scale", frozenset(), constants=["lut"])
    assert not is_known("stride", conv)


def test_value_problems() -> None:
    assert param_problem("Convolution", "stride_x", 2) is None
    assert param_problem("Squeeze", "axis", [-1, 2]) is None and param_problem("Squeeze", "axis", None) is None
    assert "NaN" in param_problem("Activation", "alpha", float("nan"))
    assert param_problem("Convolution", "kernel_x", 1.0) is not None
    assert param_problem("Convolution", "pad_left", True) is not None
    assert param_problem("Transpose", "perm", [0, "1"]) is not None
    assert param_problem("LayerNorm", "epsilon", 1e-5) is None
    assert param_problem("Pooling", "method", "avg") is None  # words in any case
    assert "one of" in param_problem("Pooling", "method", "MEDIAN")
    assert param_problem("NoSuchTypeDeclared", "x", [1, "a"]) is None  # undeclared types are not checked


SIZE_KEYS = frozenset([f"{k}_{a}" for k in ("kernel", "stride", "dilation", "output_padding") for a in "xyz"]
                      + ["pad_left", "pad_right", "pad_top", "pad_bottom"]
                      + [f"pad_{a}_{e}" for a in "xyz" for e in ("begin", "end")]
                      + ["group", "num_output", "multiplier", "block_size", "block_size_x", "block_size_y"])


def test_declared_kinds_keep_the_geometry_rules() -> None:
    """Sizes are non-negative integers below 2^31, shapes and perms lists of integers, axes integers: whatever kind
    a declaration gives them, these values are refused at read time rather than crashing an operator."""
    for optype, schema in declared_types().items():
        if not is_builtin(optype):
            continue
        for key, param in schema.params:
            if key in SIZE_KEYS:
                for bad in (-1, 1.5, True, 2 ** 31, "3"):
                    assert param.kind.problem(bad) is not None, (optype, key, bad)
            if key in ("shape", "perm"):
                for bad in ([0, "1"], 3, [1.5]):
                    assert param.kind.problem(bad) is not None, (optype, key, bad)
            if key == "axis":
                assert param.kind.problem([0.5]) is not None and param.kind.problem("1") is not None, optype


_IR = """model_name=m
input_tensors=[x]
output_tensors=[y]

layer_id=0
layer_name=x
layer_type=Input
layer_bottom=[]
layer_top=[x]
layer_top_shape=[[1,4]]
layer_top_type=[float32]

layer_id=1
layer_name=y
layer_type={optype}
layer_bottom=[x]
layer_top=[y]
layer_top_shape=[[1,4]]
layer_top_type=[float32]
{extra}
"""


def _ir(tmp_path: Path, optype: str, extra: str) -> str:
    (tmp_path / "m.txt").write_text(_IR.format(optype=optype, extra=extra))
    (tmp_path / "m.bin").write_bytes(b"")
    return str(tmp_path / "m.txt")


def test_plugin_types_are_checked_once_they_declare_keys(tmp_path: Path) -> None:
    register_optype("KnownKeysTestOp")
    path = _ir(tmp_path, "KnownKeysTestOp", "alpha=1\nbetta=2")
    assert read_ir(path).node("y").params["betta"] == 2  # declares nothing: not checked
    register_op_keys("KnownKeysTestOp", ["alpha", "beta"])
    with pytest.raises(IRError, match=r"m.txt:21: .*unknown key 'betta' for a KnownKeysTestOp layer; did you mean "
                                      r"'beta'"):
        read_ir(path)
    assert read_ir(path, allow_unknown_keys=True).node("y").params["betta"] == 2
    with pytest.raises(PluginError, match="register_optype"):
        register_op_keys("NoSuchTypeForKeys", ["a"])
    with pytest.raises(PluginError, match="non-empty strings"):
        register_op_keys("KnownKeysTestOp", [""])


def test_a_plugin_can_extend_a_builtin_type(tmp_path: Path) -> None:
    path = _ir(tmp_path, "Softmax", "axis=-1\nknown_keys_test_extra=1")
    with pytest.raises(IRError, match="unknown key 'known_keys_test_extra' for a Softmax layer"):
        read_ir(path)
    register_op_keys("Softmax", ["known_keys_test_extra"])
    try:
        assert read_ir(path).node("y").params["known_keys_test_extra"] == 1
    finally:
        known_keys._DECLARED["Softmax"].discard("known_keys_test_extra")


def test_unknown_keys_are_allowed_only_when_asked(tmp_path: Path) -> None:
    path = _ir(tmp_path, "Softmax", "axis=-1\nfuture_key=1")
    assert read_ir(path, allow_unknown_keys=True).node("y").params["future_key"] == 1
    with pytest.raises(IRError):
        read_ir(path)
