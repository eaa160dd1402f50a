"""The IR value grammar (docs/ir-format.md, section 2): parse_value / format_value / parse_names."""
from __future__ import annotations

import math

import numpy as np
import pytest

from quantopt.ir.grammar import GrammarError, format_value, parse_names, parse_value
from quantopt.quant.dtype import Dtype


@pytest.mark.parametrize("text, expected", [
    ("0", 0),
    ("42", 42),
    ("-7", -7),
    ("+3", 3),
    ("  12  ", 12),
    ("12345678901234567890", 12345678901234567890),
])
def test_ints(text, expected):
    value = parse_value(text)
    assert value == expected
    assert type(value) is int


@pytest.mark.parametrize("text, expected", [
    ("1.0", 1.0),
    ("-0.5", -0.5),
    ("0.200000", 0.2),
    ("44.694862365722656", 44.694862365722656),
    ("1e-05", 1e-05),
    ("1E-05", 1e-05),
    ("-2.5e+3", -2500.0),
    ("1.", 1.0),
    (".5", 0.5),
    ("3e2", 300.0),
    ("inf", math.inf),
    ("-inf", -math.inf),
    ("+inf", math.inf),
    ("Inf", math.inf),
    ("infinity", math.inf),
])
def test_floats(text, expected):
    value = parse_value(text)
    assert type(value) is float
    assert value == expected


@pytest.mark.parametrize("text", ["nan", "NaN", "-nan", "NAN"])
def test_nan(text):
    value = parse_value(text)
    assert isinstance(value, float) and math.isnan(value)


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("false", False), ("True", True), ("False", False), ("TRUE", True), ("FALSE", False),
    ("tRuE", True),
])
def test_bools_any_case(text, expected):
    assert parse_value(text) is expected


@pytest.mark.parametrize("text, expected", [
    ("int8", Dtype.INT8),
    ("uint16", Dtype.UINT16),
    ("float32", Dtype.FP32),
    ("FLOAT16", Dtype.FP16),
    ("bfloat16", Dtype.BFP16),
    ("dtype.int8", Dtype.INT8),
    ("Dtype.UINT8", Dtype.UINT8),
    ("dtype.float32", Dtype.FP32),
    ("aligned_int4", Dtype.ALIGNED_INT4),
    ("aligned_uint12", Dtype.ALIGNED_UINT12),
    ("float8_e4m3fn", Dtype.FP8_E4M3FN),
    ("float4_e2m1fn", Dtype.FP4_E2M1FN),
    ("bool", Dtype.BOOL),
])
def test_dtype_names(text, expected):
    assert parse_value(text) is expected


def test_every_dtype_name_parses_to_itself():
    for d in Dtype:
        assert parse_value(d.value) is d
        assert parse_value("dtype." + d.value) is d
        assert format_value(d) == d.value


def test_aliases_stay_strings_in_values():
    # the value grammar only turns canonical names (and dtype.X) into Dtypes; aliases such as fp16 are plain words
    assert parse_value("fp16") == "fp16"
    assert parse_value("half") == "half"


def test_none():
    assert parse_value("None") is None
    assert parse_value("[None]") == [None]
    assert parse_value("[None,2]") == [None, 2]
    # only the exact spelling is None
    assert parse_value("none") == "none"


@pytest.mark.parametrize("text", ["RELU", "MAX", "conv1", "data_post_transpose", "ROUND_TO_EVEN", "a b",
                                  "model/conv_1:0", "x=y", "1.2.3", "0x10", "-", "1e", "truth"])
def test_bare_strings(text):
    assert parse_value(text) == text
    assert type(parse_value(text)) is str


def test_empty_value_is_empty_string():
    assert parse_value("") == ""
    assert parse_value("   ") == ""


@pytest.mark.parametrize("text, expected", [
    ("[]", []),
    ("[1]", [1]),
    ("[1,2,3]", [1, 2, 3]),
    ("[ 1 , 2 ]", [1, 2]),
    ("[[1,224,224,3]]", [[1, 224, 224, 3]]),
    ("[[1,8,8,4],[1,8,8,4]]", [[1, 8, 8, 4], [1, 8, 8, 4]]),
    ("[[]]", [[]]),
    ("[[],[1]]", [[], [1]]),
    ("[[[1]],[[2,3]]]", [[[1]], [[2, 3]]]),
    ("[[0,255]]", [[0, 255]]),
    ("[[-1.5,2.0]]", [[-1.5, 2.0]]),
    ("[conv1,pool1]", ["conv1", "pool1"]),
    ("[float32,int8]", [Dtype.FP32, Dtype.INT8]),
    ("[uint16,uint16,uint16]", [Dtype.UINT16] * 3),
    ("[true,False]", [True, False]),
    ("[1,2.5,RELU,None,int8,-inf]", [1, 2.5, "RELU", None, Dtype.INT8, -math.inf]),
    ("[[1, 2], [3, 4]]", [[1, 2], [3, 4]]),
])
def test_lists(text, expected):
    assert parse_value(text) == expected


@pytest.mark.parametrize("value", [
    0, 1, -1, 2 ** 40, 0.0, -0.0, 1.0, 0.2, 1e-05, 1e-30, 3.4028234663852886e38, 44.694862365722656, -2.5e-7,
    math.inf, -math.inf, True, False, None, "RELU", "conv1", "a/b:0", "",
    [], [1, 2, 3], [[1, 224, 224, 3]], [[1, 2], [3, 4]], [[[1]], []], ["conv1", "pool1"], [1, 2.5, "x", None, True],
    [[0, 255], [-128, 127]], [Dtype.UINT16, Dtype.INT8], [None],
] + list(Dtype))
def test_round_trip(value):
    text = format_value(value)
    back = parse_value(text)
    assert back == value
    assert type(back) is type(value)
    if isinstance(value, float):
        assert math.copysign(1.0, back) == math.copysign(1.0, value)


def test_round_trip_nan():
    assert format_value(math.nan) == "nan"
    assert math.isnan(parse_value(format_value(math.nan)))
    back = parse_value(format_value([1.0, math.nan]))
    assert back[0] == 1.0 and math.isnan(back[1])


def test_round_trip_random_floats():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(500) * 10.0 ** rng.integers(-30, 30, 500),
                             rng.standard_normal(100).astype(np.float32).astype(np.float64)])
    for v in values:
        assert parse_value(format_value(float(v))) == float(v)


@pytest.mark.parametrize("value, text", [
    (True, "true"), (False, "false"), (None, "None"), (Dtype.UINT16, "uint16"), (0.2, "0.2"), (1e-05, "1e-05"),
    (44.694862365722656, "44.694862365722656"), (math.inf, "inf"), (-math.inf, "-inf"), (3, "3"),
    ([[1, 224, 224, 3]], "[[1,224,224,3]]"), (["a", "b"], "[a,b]"), ((1, 2), "[1,2]"), ([], "[]"),
    (np.int8(-3), "-3"), (np.float32(0.5), "0.5"), (np.bool_(True), "true"), (np.array([[1, 2]]), "[[1,2]]"),
])
def test_format(value, text):
    assert format_value(value) == text


@pytest.mark.parametrize("text, phrase", [
    ("[1,2", "missing ']'"),
    ("[[1,2]", "missing ']'"),
    ("[", "missing ']'"),
    ("1,2]", "unbalanced ']'"),
    ("]", "unbalanced ']'"),
    ("[1]]", "after ']'"),
    ("[1]x", "after ']'"),
    ("[1,,2]", "empty list element"),
    ("[,1]", "empty list element"),
    ("[1,]", "empty list element"),
    ("[[1],]", "empty list element"),
    ("[ , ]", "empty list element"),
    ("[[1] [2]]", "after a nested list"),
    ("[[1]2]", "after a nested list"),
    ("[1 [2]]", "unexpected '['"),
    ("[torch.Size([2, 8, 8, 3]]", "unexpected '['"),
])
def test_malformed(text, phrase):
    with pytest.raises(GrammarError, match=None) as info:
        parse_value(text)
    assert phrase in str(info.value)


def test_grammar_error_is_value_error():
    assert issubclass(GrammarError, ValueError)


def test_parse_names_keeps_literal_strings():
    assert parse_names("[int8,1,true,None,1e-05]") == ["int8", "1", "true", "None", "1e-05"]
    assert parse_names("[]") == []
    assert parse_names("[ a , b ]") == ["a", "b"]
    assert parse_names("conv1") == "conv1"
    assert parse_names("[[a],[b,c]]") == [["a"], ["b", "c"]]


@pytest.mark.parametrize("text", ["[a,,b]", "[a", "a]", "[a]]", "[a]b", "a[b", "[a,]", "[,a]", "[[a],]", "[[a] b]",
                                  "[a [b]]"])
def test_parse_names_malformed(text):
    with pytest.raises(GrammarError):
        parse_names(text)
