"""The per-type table of known layer keys (quantopt/registry/known_keys.py) against the operators' source, and the
reader's check of it: an op that starts reading a new parameter must add it to the table, or every IR using it
would be refused."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Set

import pytest

import quantopt.ops  # noqa: F401  (registers the built-in operators)
from quantopt.errors import IRError, PluginError
from quantopt.ir.reader import read_ir
from quantopt.registry import OP_FORWARD, OP_QUANTIZE, known_keys, register_op_keys
from quantopt.registry.known_keys import COMMON_KEYS, builtin_table, is_known, value_problem
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


@pytest.mark.parametrize("path", sorted(OPS_DIR.glob("*.py")), ids=lambda p: p.name)
def test_every_param_an_op_reads_is_in_the_table(path: Path) -> None:
    """Literal get_param("k") / params.get("k") / get_constant("k") in an ops module must be a known key of a type
    the module registers (helper modules, `_*.py`: of some built-in type)."""
    types = _types_by_module().get(path.stem)
    table = builtin_table()
    if types is None:
        types = set(table)
    allowed = frozenset().union(*(table.get(t, frozenset()) for t in types))
    read = set(_READ.findall(path.read_text()))
    missing = sorted(k for k in read if not is_known(k, allowed))
    assert not missing, f"{path.name} reads {missing}: add them to quantopt/registry/known_keys.py for {sorted(types)}"


def test_every_builtin_operator_has_a_table_entry() -> None:
    implemented = {t for table in (OP_FORWARD, OP_QUANTIZE) for t, r in table.active.items() if r.builtin}
    assert implemented <= set(builtin_table()), sorted(implemented - set(builtin_table()))


def test_table_names_real_types_and_identifier_keys() -> None:
    for optype, keys in builtin_table().items():
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
    assert value_problem("stride_x", 2) is None
    assert value_problem("axis", [-1, 2]) is None and value_problem("axis", None) is None
    assert "NaN" in value_problem("alpha", float("nan"))
    assert value_problem("kernel_x", 1.0) is not None
    assert value_problem("pad_left", True) is not None
    assert value_problem("perm", [0, "1"]) is not None
    assert value_problem("epsilon", float("inf")) is None  # only sizes must be finite integers


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


def test_declared_keys_equal_the_table() -> None:
    """While the operators move from the legacy table to their declarations: a declared built-in type has exactly
    the table's keys, and the table's value rules never get weaker (sizes, int lists, axes)."""
    from quantopt.registry import OP_SPECS
    from quantopt.registry.known_keys import AXIS_KEYS, INT_LIST_KEYS, SIZE_KEYS

    table = builtin_table()
    for optype, spec in OP_SPECS.items():
        if optype not in table:
            continue
        declared = spec.schema.keys()
        assert declared == table[optype], (optype, sorted(declared ^ table[optype]))
        for key in declared:
            param = spec.schema.param(key)
            if param is None:
                continue
            if key in SIZE_KEYS:
                for bad in (-1, 1.5, True, 2 ** 31, float("nan")):
                    assert param.kind.problem(bad) is not None, (optype, key, bad)
            if key in INT_LIST_KEYS:
                assert param.kind.problem([0, "1"]) is not None, (optype, key)
            if key in AXIS_KEYS:
                assert param.kind.problem([0.5]) is not None, (optype, key)
