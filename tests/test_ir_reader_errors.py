"""Malformed IR inputs: each one gives a specific quantopt error naming the file and the exact line."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest

from quantopt.errors import IRError, QuantOptError
from quantopt.ir.reader import read_ir

VALID = """\
model_name=tiny
layer_number=3
input_tensors=[data]
output_tensors=[act]

layer_id=0
layer_name=data
layer_type=Input
layer_bottom=[]
layer_bottom_shape=[]
layer_bottom_type=[]
layer_top=[data]
layer_top_shape=[[1,4]]
layer_top_type=[float32]

layer_id=1
layer_name=fc
layer_type=FullyConnected
layer_bottom=[data]
layer_bottom_shape=[[1,4]]
layer_bottom_type=[float32]
layer_top=[fc]
layer_top_shape=[[1,2]]
layer_top_type=[float32]
weights_type=float32
weights_offset=0
weights_size=32
weights_shape=[2,4]
biases_type=float32
biases_offset=32
biases_size=8
biases_shape=[2]
num_output=2
with_activation=NONE

layer_id=2
layer_name=act
layer_type=Activation
layer_bottom=[fc]
layer_bottom_shape=[[1,2]]
layer_bottom_type=[float32]
layer_top=[act]
layer_top_shape=[[1,2]]
layer_top_type=[float32]
method=RELU
"""

BIN = np.arange(10, dtype="<f4").tobytes()  # weights [2,4] then biases [2]: 40 bytes

# the last section (layer 'act') and its pieces, used as unique anchors for mutations
ACT_TOP = "layer_top=[act]\nlayer_top_shape=[[1,2]]\nlayer_top_type=[float32]"
FC_TOP = "layer_top=[fc]\nlayer_top_shape=[[1,2]]\nlayer_top_type=[float32]"


def line_of(text: str, line: str, occurrence: int = 1) -> int:
    """1-based number of the `occurrence`-th line of `text` equal to `line`."""
    seen = 0
    for number, candidate in enumerate(text.splitlines(), start=1):
        if candidate == line:
            seen += 1
            if seen == occurrence:
                return number
    raise AssertionError(f"line {line!r} not in the IR text")


def mutate(old: str, new: str) -> Callable[[str], str]:
    def apply(text: str) -> str:
        assert text.count(old) == 1, f"mutation anchor {old!r} must occur exactly once"
        return text.replace(old, new)
    return apply


def write_ir_files(folder: Path, text: str, data: Optional[bytes] = BIN, name: str = "tiny") -> str:
    txt = folder / f"{name}.txt"
    txt.write_text(text, encoding="utf-8")
    if data is not None:
        (folder / f"{name}.bin").write_bytes(data)
    return str(txt)


def expect_error(path: str, cls: type, line: Optional[int], phrase: str, file: Optional[str] = None) -> QuantOptError:
    with pytest.raises(cls) as info:
        read_ir(path)
    err = info.value
    assert type(err) is cls, f"expected {cls.__name__}, got {type(err).__name__}: {err}"
    assert err.file == (file or path)
    assert err.line == line, f"expected line {line}, got {err.line}: {err}"
    assert phrase in err.message, f"{phrase!r} not in {err.message!r}"
    where = f"{err.file}:{line}" if line else err.file
    assert f": {where}: " in str(err)
    return err


# ------------------------------------------------------------------------------------------- sanity
def test_template_is_valid(tmp_path):
    g = read_ir(write_ir_files(tmp_path, VALID))
    assert [n.name for n in g.nodes] == ["data", "fc", "act"]
    assert g.node("fc").constants["weights"].betensor.flatten().tolist() == list(range(8))
    assert g.node("fc").constants["biases"].betensor.tolist() == [8.0, 9.0]
    assert [t.name for t in g.input_tensors] == ["data"]
    assert [t.name for t in g.output_tensors] == ["act"]


# ------------------------------------------------------------------------------- text-level errors
# (id, mutation, locator of the expected line in the mutated text, phrase of the message)
CASES = [
    ("line_without_equals",
     mutate("method=RELU", "method=RELU\nthis line has no equals sign"),
     lambda t: line_of(t, "this line has no equals sign"), "expected key=value"),
    ("malformed_key_space",
     mutate("num_output=2", "num output=2"),
     lambda t: line_of(t, "num output=2"), "malformed key 'num output'"),
    ("malformed_key_empty",
     mutate("num_output=2", "=2"),
     lambda t: line_of(t, "=2"), "malformed key ''"),
    ("malformed_key_bracket",
     mutate("num_output=2", "num[0]=2"),
     lambda t: line_of(t, "num[0]=2"), "malformed key 'num[0]'"),
    ("duplicate_key_in_layer",
     mutate("method=RELU", "method=RELU\nmethod=TANH"),
     lambda t: line_of(t, "method=TANH"), "duplicate key 'method' in one section (first at line 45)"),
    ("duplicate_key_in_header",
     mutate("model_name=tiny", "model_name=tiny\nmodel_name=other"),
     lambda t: 2, "duplicate key 'model_name'"),
    ("header_missing",
     lambda t: t.split("\n\n", 1)[1],
     lambda t: 1, "the first section must be the header"),
    ("first_section_is_a_layer",
     mutate("output_tensors=[act]\n\n", "output_tensors=[act]\n"),
     lambda t: 1, "the first section must be the header"),
    ("layer_number_too_big",
     mutate("layer_number=3", "layer_number=4"),
     lambda t: 2, "layer_number=4 but the file has 3 layer section(s)"),
    ("layer_number_too_small",
     mutate("layer_number=3", "layer_number=2"),
     lambda t: 2, "layer_number=2 but the file has 3 layer section(s)"),
    ("layer_number_not_int",
     mutate("layer_number=3", "layer_number=three"),
     lambda t: 2, "'layer_number' must be an integer"),
    ("missing_layer_type",
     mutate("layer_type=Activation\n", ""),
     lambda t: line_of(t, "layer_id=2"), "layer 'act': missing required key 'layer_type'"),
    ("missing_layer_top",
     mutate("layer_top=[act]\n", ""),
     lambda t: line_of(t, "layer_id=2"), "layer 'act': missing required key 'layer_top'"),
    ("missing_layer_id",
     mutate("layer_id=2\n", ""),
     lambda t: line_of(t, "layer_name=act"), "layer 'act': missing required key 'layer_id'"),
    ("missing_layer_name",
     mutate("layer_name=act\n", ""),
     lambda t: line_of(t, "layer_id=2"), "missing required key 'layer_name'"),
    ("non_integer_layer_id",
     mutate("layer_id=2", "layer_id=two"),
     lambda t: line_of(t, "layer_id=two"), "'layer_id' must be an integer, got 'two'"),
    ("float_layer_id",
     mutate("layer_id=2", "layer_id=2.0"),
     lambda t: line_of(t, "layer_id=2.0"), "'layer_id' must be an integer"),
    ("invalid_layer_type",
     mutate("layer_type=Activation", "layer_type=Not A Type!"),
     lambda t: line_of(t, "layer_type=Not A Type!"), "invalid layer_type 'Not A Type!'"),
    ("unknown_top_dtype",
     mutate(ACT_TOP, ACT_TOP.replace("[float32]", "[float33]")),
     lambda t: line_of(t, "layer_top_type=[float33]"), "unknown dtype 'float33' in 'layer_top_type'"),
    ("unknown_bottom_dtype",
     mutate("layer_bottom_type=[float32]\nlayer_top=[act]", "layer_bottom_type=[floaty]\nlayer_top=[act]"),
     lambda t: line_of(t, "layer_bottom_type=[floaty]"), "unknown dtype 'floaty' in 'layer_bottom_type'"),
    ("top_dtype_count",
     mutate(ACT_TOP, ACT_TOP.replace("[float32]", "[float32,float32]")),
     lambda t: line_of(t, "layer_top_type=[float32,float32]"),
     "'layer_top_type' lists 2 dtype(s) but the layer has 1 tensor(s)"),
    ("unknown_constant_dtype",
     mutate("weights_type=float32", "weights_type=float99"),
     lambda t: line_of(t, "weights_type=float99"), "unknown dtype 'float99' for constant 'weights'"),
    ("constant_size_mismatch",
     mutate("weights_size=32", "weights_size=36"),
     lambda t: line_of(t, "weights_size=36"),
     "constant 'weights': size 36 bytes does not match shape [2, 4] of float32 (32 bytes)"),
    ("constant_shape_mismatch",
     mutate("weights_shape=[2,4]", "weights_shape=[2,5]"),
     lambda t: line_of(t, "weights_size=32"), "size 32 bytes does not match shape [2, 5] of float32 (40 bytes)"),
    ("constant_dtype_size_mismatch",
     mutate("biases_type=float32", "biases_type=int16"),
     lambda t: line_of(t, "biases_size=8"), "does not match shape [2] of int16 (4 bytes)"),
    ("top_shape_of_too_many_dims",
     mutate(ACT_TOP, ACT_TOP.replace("[[1,2]]", "[[1,1,1,1,1,1,1,1,1,2]]")),
     lambda t: line_of(t, "layer_top_shape=[[1,1,1,1,1,1,1,1,1,2]]"),
     "holds a tensor of 10 dims [1, 1, 1, 1, 1, 1, 1, 1, 1, 2]; at most 8 are supported"),
    ("constant_bad_shape",
     mutate("weights_shape=[2,4]", "weights_shape=[2,x]"),
     lambda t: line_of(t, "weights_shape=[2,x]"), "'weights_shape' must be a list of non-negative integers"),
    ("negative_offset",
     mutate("biases_offset=32", "biases_offset=-4"),
     lambda t: line_of(t, "biases_offset=-4"), "'biases_offset' must be a non-negative integer, got '-4'"),
    ("negative_size",
     mutate("biases_size=8", "biases_size=-8"),
     lambda t: line_of(t, "biases_size=-8"), "'biases_size' must be a non-negative integer"),
    ("constant_past_end_of_bin",
     mutate("biases_offset=32", "biases_offset=36"),
     lambda t: line_of(t, "biases_offset=36"), "constant 'biases' spans bytes [36, 44) but"),
    ("multi_constant_list_lengths",
     mutate("biases_type=float32\nbiases_offset=32", "biases_type=[float32,float32]\nbiases_offset=[32]"),
     lambda t: line_of(t, "biases_type=[float32,float32]"), "list-valued _type needs equally long"),
    ("bad_value_grammar",
     mutate("num_output=2", "num_output=[2"),
     lambda t: line_of(t, "num_output=[2"), "bad value for 'num_output': unbalanced '[': missing ']'"),
    ("bad_shape_grammar",
     mutate(ACT_TOP, ACT_TOP.replace("[[1,2]]", "[[1,2]")),
     lambda t: line_of(t, "layer_top_shape=[[1,2]"), "bad value for 'layer_top_shape'"),
    ("bad_name_list",
     mutate("layer_bottom=[fc]", "layer_bottom=[fc,,x]"),
     lambda t: line_of(t, "layer_bottom=[fc,,x]"), "bad name list for 'layer_bottom'"),
    ("negative_dimension",
     mutate(ACT_TOP, ACT_TOP.replace("[[1,2]]", "[[1,-2]]")),
     lambda t: line_of(t, "layer_top_shape=[[1,-2]]"), "non-integer or negative dimension"),
    ("empty_layer_top",
     mutate(ACT_TOP, "layer_top=[]\nlayer_top_shape=[]\nlayer_top_type=[]"),
     lambda t: line_of(t, "layer_top=[]"), "a layer must produce at least one tensor"),
    ("bottom_nobody_produces",
     mutate("layer_bottom=[fc]", "layer_bottom=[fcx]"),
     lambda t: line_of(t, "layer_id=2"), "layer 'act' reads tensor 'fcx' that no layer produces"),
    ("duplicate_tensor_name",
     mutate(ACT_TOP, FC_TOP),
     lambda t: line_of(t, "layer_id=2"), "duplicate tensor name 'fc': produced by layer 'fc' and layer 'act'"),
    ("duplicate_layer_name",
     mutate("layer_name=act", "layer_name=fc"),
     lambda t: line_of(t, "layer_id=2"), "duplicate layer name 'fc' (first defined at "),
    ("top_vs_top_shape_count",
     mutate("layer_top=[act]", "layer_top=[act,act2]"),
     lambda t: line_of(t, "layer_top=[act,act2]") + 1,
     "'layer_top_shape' lists 1 shape(s) but the layer has 2 tensor(s)"),
    ("bottom_shape_count",
     mutate("layer_bottom_shape=[[1,2]]", "layer_bottom_shape=[[1,2],[1,2]]"),
     lambda t: line_of(t, "layer_bottom_shape=[[1,2],[1,2]]"),
     "'layer_bottom_shape' lists 2 shape(s) but the layer has 1 tensor(s)"),
    ("bottom_shape_vs_producer",
     mutate("layer_bottom_shape=[[1,2]]", "layer_bottom_shape=[[1,3]]"),
     lambda t: line_of(t, "layer_id=2"),
     "layer 'act': layer_bottom_shape [1, 3] of 'fc' differs from the producer's layer_top_shape [1, 2]"),
    ("input_tensors_unknown",
     mutate("input_tensors=[data]", "input_tensors=[datax]"),
     lambda t: 3, "input_tensors names tensor 'datax' that no layer produces"),
    ("output_tensors_unknown",
     mutate("output_tensors=[act]", "output_tensors=[act,nothing]"),
     lambda t: 4, "output_tensors names tensor 'nothing' that no layer produces"),
    ("top_range_count",
     mutate("method=RELU", "method=RELU\nlayer_top_range=[[0.0,1.0],[0.0,2.0]]"),
     lambda t: line_of(t, "layer_top_range=[[0.0,1.0],[0.0,2.0]]"), "must list one entry per output (1)"),
    ("top_range_not_pair",
     mutate("method=RELU", "method=RELU\nlayer_top_range=[[0.0,1.0,2.0]]"),
     lambda t: line_of(t, "layer_top_range=[[0.0,1.0,2.0]]"), "entries must be [min,max] pairs"),
]


@pytest.mark.parametrize("mutation, locate, phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_ir(tmp_path, mutation, locate, phrase):
    text = mutation(VALID)
    assert text != VALID
    path = write_ir_files(tmp_path, text)
    expect_error(path, IRError, locate(text), phrase)


def test_cycle(tmp_path):
    text = mutate("layer_bottom=[data]", "layer_bottom=[act]")(VALID)
    path = write_ir_files(tmp_path, text)
    with pytest.raises(IRError) as info:
        read_ir(path)
    err = info.value
    assert err.file == path
    assert "the graph has a cycle" in err.message
    assert "fc -> act -> fc" in err.message or "act -> fc -> act" in err.message
    assert err.line in (line_of(text, "layer_id=1"), line_of(text, "layer_id=2"))


def test_subgraph_without_layers(tmp_path):
    """Subgraph sections are read (tests/ops/test_if_loop.py); one with no layer is an IR error at its line."""
    text = VALID + "\nsubgraph_name=body\nlayer_number=0\ninput_tensors=[]\noutput_tensors=[]\n"
    path = write_ir_files(tmp_path, text)
    expect_error(path, IRError, line_of(text, "layer_number=0"), "layer_number=0 but 0 section(s) follow")


def test_subgraph_inside_header(tmp_path):
    text = VALID.replace("model_name=tiny", "model_name=tiny\nsubgraph_name=main")
    path = write_ir_files(tmp_path, text)
    expect_error(path, IRError, 2, "the file starts with a subgraph")


# ------------------------------------------------------------------------------- file-level errors
def test_bin_file_missing(tmp_path):
    path = write_ir_files(tmp_path, VALID, data=None)
    expect_error(path, IRError, None, "binary file not found", file=str(tmp_path / "tiny.bin"))


def test_model_bin_header_file_missing(tmp_path):
    text = VALID.replace("layer_number=3", "layer_number=3\nmodel_bin=./weights.bin")
    path = write_ir_files(tmp_path, text)  # writes tiny.bin, but the header names weights.bin
    expect_error(path, IRError, None, "binary file not found", file=os.path.join(str(tmp_path), "./weights.bin"))


def test_explicit_bin_path_missing(tmp_path):
    path = write_ir_files(tmp_path, VALID)
    missing = str(tmp_path / "other.bin")
    with pytest.raises(IRError) as info:
        read_ir(path, missing)
    assert info.value.file == missing and info.value.line is None
    assert "binary file not found" in info.value.message


def test_txt_file_missing(tmp_path):
    expect_error(str(tmp_path / "nothere.txt"), IRError, None, "graph file not found")


def test_txt_path_is_a_directory(tmp_path):
    (tmp_path / "dir.txt").mkdir()
    expect_error(str(tmp_path / "dir.txt"), IRError, None, "graph file not found")


def test_undecodable_text_file(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"model_name=x\n" + bytes(range(128, 256)) + b"\x00\x01")
    (tmp_path / "tiny.bin").write_bytes(BIN)
    expect_error(str(path), IRError, None, "not a text IR file (undecodable byte at offset 13)")


def test_binary_file_given_as_txt(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(np.full(64, -1.0e-30, dtype="<f4").tobytes())
    expect_error(str(path), IRError, None, "not a text IR file")


def test_empty_file(tmp_path):
    path = write_ir_files(tmp_path, "")
    expect_error(path, IRError, None, "empty IR file")


def test_blank_only_file(tmp_path):
    path = write_ir_files(tmp_path, "\n   \n\t\n\n")
    expect_error(path, IRError, None, "empty IR file")


def test_error_is_a_quantopt_error_with_exit_code(tmp_path):
    path = write_ir_files(tmp_path, VALID.replace("layer_number=3", "layer_number=9"))
    with pytest.raises(QuantOptError) as info:
        read_ir(path)
    assert info.value.exit_code == 3
    assert str(info.value).startswith(f"IR error: {path}:2: ")


# ------------------------------------------------------------------------------- accepted variants
def test_equals_inside_value_is_accepted(tmp_path):
    text = VALID.replace("method=RELU", "method=RELU\nnote=a=b=c")
    g = read_ir(write_ir_files(tmp_path, text), allow_unknown_keys=True)  # 'note' is no Activation key
    assert g.node("act").params["note"] == "a=b=c"


def test_comments_and_extra_blank_lines_are_accepted(tmp_path):
    text = "# a comment\n" + VALID.replace("\n\n", "\n\n\n  \n") + "\n\n\n"
    g = read_ir(write_ir_files(tmp_path, text))
    assert len(g.nodes) == 3


def test_missing_io_names_are_guessed(tmp_path):
    text = VALID.replace("input_tensors=[data]\noutput_tensors=[act]\n", "")
    g = read_ir(write_ir_files(tmp_path, text))
    assert [t.name for t in g.input_tensors] == ["data"]
    assert [t.name for t in g.output_tensors] == ["act"]


def test_layer_number_is_optional(tmp_path):
    g = read_ir(write_ir_files(tmp_path, VALID.replace("layer_number=3\n", "")))
    assert len(g.nodes) == 3


def _mask_ir(tmp_path, fill: float) -> str:
    """x + a Constant mask holding `fill` in its upper triangle (a causal attention mask), written as an IR."""
    from quantopt.graph.builder import GraphBuilder
    from quantopt.ir.writer import write_ir

    mask = np.triu(np.full((4, 4), fill, dtype=np.float32), k=1)
    b = GraphBuilder()
    x = b.input("x", [1, 4, 4])
    m = b.layer("Constant", [], [[1, 4, 4]], name="mask", constants={"weights": mask[None]})
    y = b.layer("Add", [x, m], [[1, 4, 4]], name="add")
    txt, _ = write_ir(b.build([y]), str(tmp_path / "mask.txt"))
    return txt


def test_a_constant_layer_may_hold_an_infinite_mask(tmp_path):
    """Exporters write causal/padding masks as -inf: a Constant layer keeps them (NaN stays an error)."""
    g = read_ir(_mask_ir(tmp_path, float("-inf")))
    mask = g.node("mask").constants["weights"].betensor
    assert bool(np.isneginf(mask.numpy()).any())
    with pytest.raises(IRError, match="constant 'weights' holds 6 NaN value"):
        read_ir(_mask_ir(tmp_path, float("nan")))
