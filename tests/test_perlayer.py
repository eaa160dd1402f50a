"""The per-layer value grammar and its resolution order (docs/user-guide.md, Per-layer values)."""
from __future__ import annotations

import pytest

from quantopt.config.perlayer import PerLayerSyntaxError, parse_per_layer, split_per_layer


def _int(text: str) -> int:
    return int(text)


def test_plain_global_value():
    v = parse_per_layer("8", _int)
    assert v.global_value == 8 and v.rules == []
    assert v.resolve(3, "Convolution", "conv1") == 8


def test_priority_id_range_then_optype_then_regex_then_global():
    v = parse_per_layer("8 & <{conv.*}:12> <[Convolution]:16> <[(2,4)]:10>", _int)
    assert v.resolve(3, "Convolution", "conv3") == 10  # id range wins over type and regex
    assert v.resolve(7, "Convolution", "conv7") == 16  # type wins over regex
    assert v.resolve(7, "Pooling", "conv_pool") == 12  # regex (prefix match)
    assert v.resolve(7, "Pooling", "pool_conv") == 8  # re.match is anchored at the start
    assert v.resolve(0, "Input", "input") == 8


def test_first_matching_rule_of_a_kind_wins():
    v = parse_per_layer("1 & <[(0,5)]:2> <[(3,9)]:3> <{a}:4> <{ab}:5>", _int)
    assert v.resolve(4, "X", "z") == 2
    assert v.resolve(7, "X", "z") == 3
    assert v.resolve(20, "X", "abc") == 4


def test_optype_match_is_case_insensitive_and_matches_activation_method():
    v = parse_per_layer("mean & <[sigmoid, FullyConnected]:kld>", str)
    assert v.resolve(1, "Activation", "act", method="SIGMOID") == "kld"
    assert v.resolve(1, "fullyconnected", "fc") == "kld"
    assert v.resolve(1, "Activation", "act", method="TANH") == "mean"


def test_values_may_contain_brackets_and_colons():
    global_text, pairs = split_per_layer("weighted_scale_param[1,2,3,4] & <[Softmax]:[2,20]> <{a:b}:x>")
    assert global_text == "weighted_scale_param[1,2,3,4]"
    assert pairs == [("[Softmax]", "[2,20]"), ("{a:b}", "x")]


def test_regex_with_braces_quantifier():
    v = parse_per_layer("0 & <{conv\\d{2}}:1>", _int)
    assert v.resolve(9, "X", "conv12") == 1
    assert v.resolve(9, "X", "conv1") == 0


def test_get_uses_node_fields():
    class Node:
        layer_id = 5
        type = "Activation"
        name = "sig"
        params = {"method": "SIGMOID"}

    v = parse_per_layer("8 & <[Sigmoid]:16>", _int)
    assert v.get(Node()) == 16
    assert v.get() == 8


@pytest.mark.parametrize("text, phrase", [
    ("8 &", "nothing after '&'"),
    ("& <[Conv]:1>", "missing global value"),
    ("8 & [Conv]:1", "expected '<'"),
    ("8 & <[Conv]1>", "expected ':'"),
    ("8 & <[Conv]:>", "empty value"),
    ("8 & <[(3,1)]:4>", "is empty"),
    ("8 & <[(1,2),x]:4>", "ranges are written"),
    ("8 & <{(}:4>", "invalid regex"),
    ("8 & <[Conv]:4", "missing '>'"),
    ("8 & <Conv:4>", "must start with"),
    ("8 & <[]:4>", "empty selector"),
    ("x & <[Conv]:4>", "value 'x'"),
])
def test_syntax_errors(text, phrase):
    with pytest.raises(PerLayerSyntaxError, match=None) as info:
        parse_per_layer(text, _int)
    assert phrase in str(info.value)


def test_unknown_optype_rejected():
    with pytest.raises(PerLayerSyntaxError, match="unknown operator type"):
        parse_per_layer("8 & <[Convolutoin]:4>", _int, known_optype=lambda n: n == "Convolution")
