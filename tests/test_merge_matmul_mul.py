"""`enable_pass_merge_matmul_mul` (passes/merge_matmul_mul.py): which constant factors after a MatMul are folded into
it, that the float model computes the same bits afterwards, how the folded MatMul quantizes (the factor in its
multiplier, not in the IR) and runs as a float layer, and the field off (upstream's behaviour with false)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch
from golden_helpers import golden_cfg

from quantopt.cli import main
from quantopt.config.fields import FIELDS, UPSTREAM_FIELDS
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import QuantizeGraph
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.passes.merge_matmul_mul import FUSED_MULTIPLIER, merge_matmul_mul
from quantopt.pipeline import quantize_model, run_quantized

SCALE = np.float32(1.0 / np.sqrt(8.0))
CORPUS = Path(__file__).resolve().parent / "data" / "golden_corpus"


def _attention(factor: Optional[np.ndarray] = None, shape_only: bool = False, mm_act: str = "NONE",
               extra_reader: str = "", mm_output: bool = False) -> QuantizeGraph:
    """q [1,4,16,8] @ k [1,4,8,16] -> (Reshape, Transpose) -> Mul by a Constant -> Softmax.

    `extra_reader`: "matmul" or "constant" gives that layer's output a second reader (an Add into the output);
    `mm_output`: the MatMul's output is also a graph output."""
    factor = np.asarray(SCALE if factor is None else factor, dtype=np.float32)
    b = GraphBuilder("attn")
    b.input("q", [1, 4, 16, 8])
    b.input("k", [1, 4, 8, 16])
    b.layer("MatMul", ["q", "k"], [[1, 4, 16, 16]], name="mm",
            params={"trans_a": False, "trans_b": False, "with_activation": mm_act})
    side = "mm"
    if shape_only:
        b.layer("Reshape", ["mm"], [[1, 4, 256]], name="flat", params={"shape": [1, 4, 256]})
        b.layer("Transpose", ["flat"], [[1, 256, 4]], name="tr", params={"perm": [0, 2, 1]})
        side = "tr"
    shape = [1, 256, 4] if shape_only else [1, 4, 16, 16]
    b.layer("Constant", [], [list(factor.shape)], name="scale", constants={"weights": factor})
    b.layer("Mul", [side, "scale"], [shape], name="mul", params={"with_activation": "NONE"})
    b.layer("Softmax", ["mul"], [shape], name="softmax", params={"axis": -1})
    outputs = ["softmax"]
    if extra_reader:
        b.layer("Add", ["softmax", {"matmul": side, "constant": "scale"}[extra_reader]], [shape], name="extra",
                params={"with_activation": "NONE"})
        outputs = ["extra"]
    if mm_output:
        outputs.append("mm")
    return b.build(outputs)


def _batches(n: int = 3, seed: int = 5) -> List[List[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, 4, 16, 8, generator=g), torch.randn(1, 4, 8, 16, generator=g)] for _ in range(n)]


def _types(graph: QuantizeGraph) -> Dict[str, str]:
    return {n.name: str(n.type) for n in graph.nodes}


def _outputs(graph: QuantizeGraph, batch: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    graph.forward(list(batch))
    return [t.betensor.clone() for t in graph.output_tensors]


@pytest.mark.parametrize("shape_only", [False, True])
def test_scalar_factor_folds_and_float_forward_keeps_its_bits(shape_only: bool) -> None:
    g = _attention(shape_only=shape_only)
    batch = _batches(1)[0]
    before = _outputs(g, batch)
    folds = merge_matmul_mul(g)
    assert folds == [("mm", "mul", float(SCALE))]
    types = _types(g)
    assert "scale" not in types and types["mul"] == "Crop"
    mul = g.node("mul")
    assert [t.name for t in mul.inputs] == ["tr" if shape_only else "mm"] and not mul.constants
    assert mul.params == {"crops": [[0, 1], [0, 256], [0, 4]] if shape_only else [[0, 1], [0, 4], [0, 16], [0, 16]]}
    assert g.node("mm").params[FUSED_MULTIPLIER] == float(SCALE)
    after = _outputs(g, batch)
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_uniform_tensor_factor_and_scaling_batchnorm_fold() -> None:
    g = _attention(factor=np.full([16], 0.25, np.float32))
    assert merge_matmul_mul(g) == [("mm", "mul", 0.25)]
    b = GraphBuilder("bn")
    b.input("a", [1, 6, 5])
    b.input("c", [1, 5, 3])
    b.layer("MatMul", ["a", "c"], [[1, 6, 3]], name="mm", params={"trans_a": False, "trans_b": False})
    b.layer("BatchNorm", ["mm"], [[1, 6, 3]], name="bn", params={"axis": 2},
            constants={"weights": np.full(3, 0.5, np.float32), "biases": np.zeros(3, np.float32)})
    g = b.build(["bn"])
    x = [torch.randn(1, 6, 5), torch.randn(1, 5, 3)]
    before = _outputs(g, x)
    assert merge_matmul_mul(g) == [("mm", "bn", 0.5)]
    assert _types(g)["bn"] == "Crop" and not g.node("bn").constants
    assert torch.equal(before[0], _outputs(g, x)[0])


@pytest.mark.parametrize("case", ["distinct values", "negative", "zero", "broadcast grows", "matmul two readers",
                                  "constant two readers", "matmul graph output", "relu6 matmul", "mul relu"])
def test_not_folded(case: str) -> None:
    kwargs = {
        "distinct values": dict(factor=np.linspace(0.1, 0.4, 16, dtype=np.float32)),
        "negative": dict(factor=np.float32(-0.5)),
        "zero": dict(factor=np.float32(0.0)),
        "matmul two readers": dict(extra_reader="matmul"),
        "constant two readers": dict(extra_reader="constant"),
        "matmul graph output": dict(mm_output=True),
        "relu6 matmul": dict(mm_act="RELU6"),
    }.get(case, {})
    if case == "broadcast grows":  # [1,4,16,1] * [16] of equal values -> [1,4,16,16]: not a pure scaling
        b = GraphBuilder("grow")
        b.input("q", [1, 4, 16, 8])
        b.input("k", [1, 4, 8, 1])
        b.layer("MatMul", ["q", "k"], [[1, 4, 16, 1]], name="mm", params={"trans_a": False, "trans_b": False})
        b.layer("Constant", [], [[16]], name="scale", constants={"weights": np.full(16, 0.5, np.float32)})
        b.layer("Mul", ["mm", "scale"], [[1, 4, 16, 16]], name="mul", params={"with_activation": "NONE"})
        g = b.build(["mul"])
    else:
        g = _attention(**kwargs)
        if case == "mul relu":
            g.node("mul").params["with_activation"] = "RELU"
    types = _types(g)
    assert merge_matmul_mul(g) == []
    assert _types(g) == types and FUSED_MULTIPLIER not in g.node("mm").params


def test_quantized_matmul_carries_the_factor_in_its_multiplier() -> None:
    folded = quantize_model(_attention(), _batches())
    kept = quantize_model(_attention(), _batches(), merge_matmul_mul_pass=False)
    assert "scale" in _types(kept) and _types(kept)["mul"] == "Mul"
    mm = folded.node("mm")
    assert FUSED_MULTIPLIER not in mm.params
    s_out = float(folded.quant.get(mm.outputs[0]).scale)
    s_in = float(folded.quant.get(mm.inputs[0]).scale) * float(folded.quant.get(mm.inputs[1]).scale)
    ratio = float(mm.params["scale_value"]) * 2.0 ** -int(mm.params["shift_value"])
    assert ratio == pytest.approx(s_out * float(SCALE) / s_in, rel=2e-3)
    # the Crop passes the scale through
    assert folded.quant.get(folded.node("mul").outputs[0]).scale == folded.quant.get(mm.outputs[0]).scale
    # the folded MatMul's output is calibrated after the factor: the scale of the kept Mul's output
    assert s_out == pytest.approx(float(kept.quant.get(kept.node("mul").outputs[0]).scale), rel=1e-6)
    batch = _batches(1, seed=9)[0]
    reference = _outputs(_attention(), batch)[0]
    error = [float((run_quantized(q, batch)[0] - reference).abs().mean()) for q in (folded, kept)]
    assert error[0] < 0.01 and error[0] <= 1.1 * error[1], error  # one rounding fewer: no worse than unfolded


def test_float_matmul_keeps_the_factor_and_round_trips(tmp_path: Path) -> None:
    q = quantize_model(_attention(), _batches(), per_layer={"mm": {"trigger_float_op": "float32_preferred"}})
    assert q.node("mm").params[FUSED_MULTIPLIER] == float(SCALE)
    batch = _batches(1, seed=11)[0]
    first = run_quantized(q, batch)
    txt, _ = write_ir(q, str(tmp_path / "q.txt"))
    again = run_quantized(read_ir(txt), batch)
    assert all(torch.equal(x, y) for x, y in zip(first, again))


@pytest.mark.parametrize("enabled", [True, False])
def test_cfg_field_on_the_corpus_encoder(enabled: bool, tmp_path: Path) -> None:
    """The field's default folds the encoder's 1/sqrt(d) as upstream's golden shows; false keeps the layers."""
    name = "enable_pass_merge_matmul_mul"
    assert FIELDS[name].default is True and name not in UPSTREAM_FIELDS
    folder = CORPUS / "transformer_encoder" / "golden" / "A"
    out = tmp_path / "out"
    extra = [] if enabled else ["enable_pass_merge_matmul_mul = false"]
    cfg = golden_cfg(folder, out, tmp_path / "enc.cfg", extra)
    assert main(["--cfg", str(cfg), "--log-level", "ERROR"]) == 0
    types = _types(read_ir(str(out / "transformer_encoder_o.txt")))
    if enabled:
        assert types["/attn/Mul"] == "Crop" and "/attn/Constant_3" not in types
    else:
        assert types["/attn/Mul"] == "Mul" and types["/attn/Constant_3"] == "Constant"


def _scaled_query(weights: Optional[np.ndarray] = None, biases: Optional[np.ndarray] = None, key_bn: bool = False,
                  key_layer: str = "", query_readers: int = 1) -> QuantizeGraph:
    """(BatchNorm(q) -> Transpose) @ k -> Softmax: the query scaled before the product, as some exports write it.

    `key_bn`: k passes through a scaling BatchNorm of 0.5 too; `key_layer`: k passes through that layer type first
    (Sigmoid ends upstream's walk before the query's BatchNorm is reached); `query_readers`: 2 gives the BatchNorm's
    output a second reader."""
    weights = np.full(8, SCALE, np.float32) if weights is None else weights
    biases = np.zeros(8, np.float32) if biases is None else biases
    b = GraphBuilder("scaled_query")
    b.input("q", [1, 16, 4, 8])
    b.input("k", [1, 4, 8, 16])
    b.layer("BatchNorm", ["q"], [[1, 16, 4, 8]], name="bn", params={"axis": 3},
            constants={"weights": weights, "biases": biases})
    b.layer("Transpose", ["bn"], [[1, 4, 16, 8]], name="tr", params={"perm": [0, 2, 1, 3]})
    key = "k"
    if key_layer:
        b.layer(key_layer, [key], [[1, 4, 8, 16]], name="key_act")
        key = "key_act"
    if key_bn:
        b.layer("BatchNorm", [key], [[1, 4, 8, 16]], name="key_bn", params={"axis": 3},
                constants={"weights": np.full(16, 0.5, np.float32), "biases": np.zeros(16, np.float32)})
        key = "key_bn"
    b.layer("MatMul", ["tr", key], [[1, 4, 16, 16]], name="mm", params={"trans_a": False, "trans_b": False})
    b.layer("Softmax", ["mm"], [[1, 4, 16, 16]], name="softmax", params={"axis": -1})
    outputs = ["softmax"]
    if query_readers == 2:
        b.layer("Sigmoid", ["bn"], [[1, 16, 4, 8]], name="other")
        outputs.append("other")
    return b.build(outputs)


def _query_batch() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return [torch.randn(1, 16, 4, 8, generator=g), torch.randn(1, 4, 8, 16, generator=g)]


@pytest.mark.parametrize("key_bn", [False, True])
def test_scaling_batchnorm_above_a_matmul_folds(key_bn: bool) -> None:
    """A BatchNorm that only scales, reached from the MatMul's inputs through shape-only layers, becomes an identity
    Crop and its factor the MatMul's; with both inputs scaled the factors multiply. The float result moves only by
    rounding (the factor now applies after the product)."""
    g = _scaled_query(key_bn=key_bn)
    batch = _query_batch()
    before = _outputs(g, batch)
    folds = merge_matmul_mul(g)
    # breadth-first: the key's BatchNorm is met before the query's, which sits behind the Transpose
    expected = ([("mm", "key_bn", 0.5)] if key_bn else []) + [("mm", "bn", float(SCALE))]
    assert folds == expected
    types = _types(g)
    assert types["bn"] == "Crop" and not g.node("bn").constants
    assert g.node("bn").params == {"crops": [[0, 1], [0, 16], [0, 4], [0, 8]]}
    if key_bn:
        assert types["key_bn"] == "Crop"
    factor = float(np.float32(SCALE) * np.float32(0.5)) if key_bn else float(SCALE)
    assert g.node("mm").params[FUSED_MULTIPLIER] == factor
    after = _outputs(g, batch)
    assert torch.allclose(before[0], after[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["distinct weights", "bias", "two readers", "walk ends first"])
def test_batchnorm_above_a_matmul_not_folded(case: str) -> None:
    kwargs = {
        "distinct weights": dict(weights=np.linspace(0.1, 0.8, 8, dtype=np.float32)),
        "bias": dict(biases=np.full(8, 0.1, np.float32)),
        "two readers": dict(query_readers=2),
        "walk ends first": dict(key_layer="Sigmoid"),  # the key's Sigmoid is met before the query's BatchNorm
    }[case]
    g = _scaled_query(**kwargs)
    types = _types(g)
    assert merge_matmul_mul(g) == []
    assert _types(g) == types and FUSED_MULTIPLIER not in g.node("mm").params


def test_factor_after_and_scaling_before_multiply() -> None:
    """A MatMul folded with the factor after it and a scaling BatchNorm above it carries both factors."""
    b = GraphBuilder("both")
    b.input("q", [1, 4, 16, 8])
    b.input("k", [1, 4, 8, 16])
    b.layer("BatchNorm", ["q"], [[1, 4, 16, 8]], name="bn", params={"axis": 3},
            constants={"weights": np.full(8, 0.5, np.float32), "biases": np.zeros(8, np.float32)})
    b.layer("MatMul", ["bn", "k"], [[1, 4, 16, 16]], name="mm", params={"trans_a": False, "trans_b": False})
    b.layer("Constant", [], [[1]], name="scale", constants={"weights": np.array([SCALE], np.float32)})
    b.layer("Mul", ["mm", "scale"], [[1, 4, 16, 16]], name="mul", params={"with_activation": "NONE"})
    b.layer("Softmax", ["mul"], [[1, 4, 16, 16]], name="softmax", params={"axis": -1})
    g = b.build(["softmax"])
    batch = _batches(1)[0]
    before = _outputs(g, batch)
    assert merge_matmul_mul(g) == [("mm", "mul", float(SCALE)), ("mm", "bn", 0.5)]
    assert g.node("mm").params[FUSED_MULTIPLIER] == float(np.float32(SCALE) * np.float32(0.5))
    assert torch.allclose(before[0], _outputs(g, batch)[0], rtol=1e-5, atol=1e-6)
