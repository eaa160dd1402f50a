"""The quantization workflow around the operators: per-layer settings, opt_config JSON, the template, per-layer
similarity (cumulative and isolated), and the CLI run on a small conv/FC model written as an IR."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from quantopt.analysis.similarity import cosine, layer_similarity, worst_layers_table
from quantopt.analysis.template import build_template
from quantopt.cli import main
from quantopt.config.layer_settings import OptConfig, settings_from_cfg
from quantopt.config.reader import read_cfg
from quantopt.errors import ConfigError
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model
from quantopt.quant.dtype import Dtype


def small_model(seed: int = 0):
    """x[1,8,8,3] → conv(RELU) → conv → conv(RELU) → reshape → FC."""
    r = np.random.default_rng(seed)
    g = GraphBuilder("small")
    x = g.input("x", [1, 8, 8, 3])
    geo = dict(kernel_x=3, kernel_y=3, stride_x=1, stride_y=1, pad_left=1, pad_right=1, pad_top=1, pad_bottom=1,
               dilation_x=1, dilation_y=1, group=1)
    a = g.layer("Convolution", [x], [[1, 8, 8, 8]], name="c1", params=dict(num_output=8, with_activation="RELU", **geo),
                constants={"weights": r.normal(0, 0.4, (8, 3, 3, 3)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 8).astype(np.float32)})
    b = g.layer("Convolution", [a], [[1, 8, 8, 8]], name="c2", params=dict(num_output=8, with_activation="NONE", **geo),
                constants={"weights": r.normal(0, 0.3, (8, 3, 3, 8)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 8).astype(np.float32)})
    c = g.layer("Convolution", [b], [[1, 8, 8, 4]], name="c3", params=dict(num_output=4, with_activation="RELU", **geo),
                constants={"weights": r.normal(0, 0.3, (4, 3, 3, 8)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 4).astype(np.float32)})
    d = g.layer("Reshape", [c], [[1, 256]], name="flat", params=dict(shape=[1, 256]))
    e = g.layer("FullyConnected", [d], [[1, 5]], name="fc", params=dict(num_output=5, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.2, (5, 256)).astype(np.float32),
                           "biases": r.normal(0, 0.1, 5).astype(np.float32)})
    return g.build([e])


def batches(n: int = 4, seed: int = 1, batch: int = 2):
    r = np.random.default_rng(seed)
    return [torch.from_numpy(r.normal(0, 1, (batch, 8, 8, 3)).astype(np.float32)) for _ in range(n)]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    write_ir(small_model(), str(tmp_path / "small.txt"))
    data = np.concatenate([b.numpy() for b in batches(4)])
    np.save(tmp_path / "calib.npy", data)
    np.save(tmp_path / "val.npy", data[:6])
    np.save(tmp_path / "val_label.npy", small_model().forward([torch.from_numpy(data[:6])])[0].numpy())
    return tmp_path


def write_cfg(folder: Path, extra: str = "", **values: str) -> Path:
    base = {"graph": "small.txt", "model_name": "small", "dataset": "NumpyDataset", "calibration_data": "calib.npy",
            "calibration_batch_size": "2", "output_dir": "out"}
    base.update(values)
    text = "[Common]\n" + "".join(f"{k} = {v}\n" for k, v in base.items() if v is not None) + extra
    path = folder / "opt.cfg"
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------- settings
def test_per_layer_cfg_values_resolve_per_layer(model_dir: Path) -> None:
    cfg = read_cfg(str(write_cfg(model_dir, activation_bits="8 & <[FullyConnected]:16>",
                                 quantize_method_for_weight="per_tensor_symmetric_restricted_range & <{c2}:"
                                                            "per_channel_symmetric_restricted_range>")))
    g = small_model()
    s = {n.name: settings_from_cfg(cfg, n) for n in g.nodes}
    assert s["fc"].q_bits_activation == 16 and s["c1"].q_bits_activation == 8
    assert s["c2"].q_mode_weight.startswith("per_channel") and s["c3"].q_mode_weight.startswith("per_tensor")


def test_batchnorm_weight_bits_follow_per_layer_rules_only(model_dir: Path) -> None:
    """BatchNorm's 16-bit weights are an operator default: a global weight_bits does not lower them, a per-layer
    rule naming the layer (by type here) or an opt_config entry does."""
    from quantopt.config.layer_settings import OptConfig
    from quantopt.graph.builder import GraphBuilder

    b = GraphBuilder("bn")
    x = b.input("x", [1, 4, 4, 3])
    y = b.layer("BatchNorm", [x], [[1, 4, 4, 3]], name="bn", params=dict(axis=3),
                constants={"weights": np.ones(3, np.float32), "biases": np.zeros(3, np.float32)})
    z = b.layer("Activation", [y], [[1, 4, 4, 3]], name="act", params=dict(method="RELU"))
    bn = b.build([z]).node("bn")
    plain = settings_from_cfg(read_cfg(str(write_cfg(model_dir, weight_bits="8"))), bn)
    assert plain.q_bits_weight == 16 and "q_bits_weight" not in plain.explicit
    ruled = settings_from_cfg(read_cfg(str(write_cfg(model_dir, weight_bits="8 & <[BatchNorm]:8>"))), bn)
    assert ruled.q_bits_weight == 8 and "q_bits_weight" in ruled.explicit
    path = model_dir / "bn.json"
    path.write_text('{"bn": {"q_bits_weight": 10}}')
    assert OptConfig.load(str(path), ["x", "bn", "act"]).apply(plain, bn).q_bits_weight == 10


def test_per_channel_activation_modes_from_the_cfg(model_dir: Path) -> None:
    """The two symmetric per-channel modes are accepted (which layers support them: tests/ops/
    test_per_channel_activations.py); per_channel_asymmetric is a weight-only mode, refused when the cfg is read."""
    ok = read_cfg(str(write_cfg(model_dir, quantize_method_for_activation="per_channel_symmetric_full_range")))
    assert settings_from_cfg(ok, small_model().nodes[1]).q_mode_activation == "per_channel_symmetric_full_range"
    with pytest.raises(ConfigError, match="quantize_method_for_activation.*per_channel_asymmetric"):
        read_cfg(str(write_cfg(model_dir, quantize_method_for_activation="per_channel_asymmetric")))


def test_opt_config_validation(tmp_path: Path) -> None:
    names = [n.name for n in small_model().nodes]
    cases = [({"nope": {}}, "does not have"), ({"c1": {"q_bits_weight": 3}}, "q_bits_weight"),
             ({"c1": {"bogus": 1}}, "unknown key 'bogus'"), ({"c1": 5}, "expected an object"),
             ({"c1": {"q_mode_weight": "per_nothing"}}, "q_mode_weight")]
    for data, message in cases:
        p = tmp_path / "o.json"
        p.write_text(json.dumps(data))
        with pytest.raises(ConfigError, match=message):
            OptConfig.load(str(p), names)
    p.write_text("{ broken")
    with pytest.raises(ConfigError) as e:
        OptConfig.load(str(p), names)
    assert e.value.line == 1


# --------------------------------------------------------------------------------------------- template
def test_template_is_real_json_and_loads_back_unchanged(tmp_path: Path) -> None:
    g = small_model()
    qg = quantize_model(g, batches())
    template = build_template(g, qg, layer_similarity(g, qg, batches(1)))
    text = json.dumps(template)
    entry = json.loads(text)["c2"]
    assert entry["q_bits_activation"] == 8 and entry["layer_type"] == "Convolution"
    info = entry["just_for_display"]["quantization_info"]["c2"]
    assert isinstance(info["scale"], float) and info["dtype"] == "int8" and info["qmin"] == -128
    assert 0.9 < entry["just_for_display"]["similarity"]["c2"]["cumulative_cos"] <= 1.0
    path = tmp_path / "t.json"
    path.write_text(text)
    oc = OptConfig.load(str(path), [n.name for n in g.nodes])
    for n in g.nodes:
        assert oc.apply(n.settings, n) == n.settings


# --------------------------------------------------------------------------------------------- similarity
def test_isolated_similarity_blames_the_degraded_layer() -> None:
    g = small_model()
    qg = quantize_model(g, batches(), per_layer={"c2": {"q_bits_weight": 4}})
    sims = {s.name: s for s in layer_similarity(g, qg, batches(2, seed=5))}
    worst = min(sims.values(), key=lambda s: s.isolated_cos)
    assert worst.name == "c2"
    # downstream layers inherit c2's error cumulatively but not in isolation
    assert sims["c3"].isolated_cos > sims["c3"].cumulative_cos
    assert "c2" in worst_layers_table(list(sims.values())).splitlines()[2]


def test_cosine_edge_cases() -> None:
    z = torch.zeros(4)
    assert cosine(z, z) == 1.0 and cosine(z, torch.ones(4)) == 0.0
    assert cosine(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 4.0])) == pytest.approx(1.0)


# --------------------------------------------------------------------------------------------- CLI
def test_cli_quantizes_writes_ir_template_and_reloads(model_dir: Path, capsys) -> None:
    cfg = write_cfg(model_dir, metric="CosDistanceMetric", data="val.npy", label="val_label.npy",
                     metric_batch_size="3")
    assert main(["--cfg", str(cfg), "--log-level", "info"]) == 0
    out = model_dir / "out"
    q = read_ir(str(out / "small_o.txt"))
    assert [str(t.dtype.value) for t in q.output_tensors] == ["int8"]
    assert all(n.quantized for n in q.nodes)
    template = json.loads((out / "small_opt_template.json").read_text())
    assert set(template) == {n.name for n in q.nodes}
    err = capsys.readouterr().err
    assert "worst" in err and "drop" in err and "quantized" in err


def test_cli_opt_config_overrides_cfg(model_dir: Path) -> None:
    assert main(["--cfg", str(write_cfg(model_dir))]) == 0
    template = json.loads((model_dir / "out" / "small_opt_template.json").read_text())
    template["c3"]["q_bits_activation"] = 16
    edited = model_dir / "edited.json"
    edited.write_text(json.dumps(template, indent=1))
    assert main(["--cfg", str(write_cfg(model_dir, opt_config="edited.json", output_dir="out2"))]) == 0
    q = read_ir(str(model_dir / "out2" / "small_o.txt"))
    assert q.node("c3").outputs[0].dtype in (Dtype.INT16, Dtype.UINT16)
    assert q.node("c2").outputs[0].dtype is Dtype.INT8


@pytest.mark.parametrize("layer, key, value, code", [
    ("c2", "q_mode_weight", "per_block_symmetric_restricted_range", 6),
    ("fc", "q_mode_weight", "per_block_asymmetric", 6),
])
def test_a_refused_per_layer_value_names_the_json_that_set_it(model_dir: Path, capsys, layer: str, key: str,
                                                             value: str, code: int) -> None:
    """The error names the edited JSON, the layer and the key, not the cfg field the value would otherwise come
    from (found by benchmarks/fuzz_cfg_runs.py --layer-edits, docs/robustness.md)."""
    assert main(["--cfg", str(write_cfg(model_dir))]) == 0
    template = json.loads((model_dir / "out" / "small_opt_template.json").read_text())
    template[layer][key] = value
    edited = model_dir / "edited.json"
    edited.write_text(json.dumps(template, indent=1))
    capsys.readouterr()
    assert main(["--cfg", str(write_cfg(model_dir, opt_config="edited.json", output_dir="out2"))]) == code
    errors = [line for line in capsys.readouterr().err.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and f"{edited}: '{key}' (per-layer value): layer '{layer}'" in errors[0], errors
    assert not (model_dir / "out2" / "small_o.txt").exists()


def test_a_refused_per_layer_cfg_rule_names_its_cfg_line(model_dir: Path, capsys) -> None:
    cfg = write_cfg(model_dir, quantize_method_for_weight="per_tensor_symmetric_restricted_range & "
                                                          "<[FullyConnected]:per_block_symmetric_restricted_range>")
    assert main(["--cfg", str(cfg)]) == 6
    errors = [line for line in capsys.readouterr().err.splitlines() if "[ERROR]" in line]
    line = next(i for i, text in enumerate(cfg.read_text().splitlines(), 1) if "quantize_method_for_weight" in text)
    assert len(errors) == 1 and f"{cfg}:{line}: field 'quantize_method_for_weight': layer 'fc'" in errors[0], errors


def test_missing_calibration_data_is_an_error_unless_opted_in(model_dir: Path, capsys) -> None:
    assert main(["--cfg", str(write_cfg(model_dir, calibration_data=None))]) == 2
    assert "calibration_data" in capsys.readouterr().err
    assert not (model_dir / "out" / "small_o.txt").exists()
    cfg = write_cfg(model_dir, calibration_data=None, extra="calibrate_with_zero_inputs = true\n")
    assert main(["--cfg", str(cfg)]) == 0
    assert (model_dir / "out" / "small_o.txt").exists()


def test_bad_opt_config_fails_without_output(model_dir: Path, capsys) -> None:
    (model_dir / "bad.json").write_text(json.dumps({"c1": {"q_bits_activation": 7}}))
    assert main(["--cfg", str(write_cfg(model_dir, opt_config="bad.json"))]) == 2
    assert "q_bits_activation" in capsys.readouterr().err
    assert not (model_dir / "out" / "small_o.txt").exists()


def test_qinvariant_start_node_and_force_dtype_int(model_dir: Path) -> None:
    cfg = read_cfg(str(write_cfg(model_dir, set_qinvariant_for_start_nodes="0", force_dtype_int="true")))
    g = small_model()
    overrides = {n.name: {k: getattr(settings_from_cfg(cfg, n), k) for k in ("qinvariant", "force_dtype_int")}
                 for n in g.nodes}
    assert overrides["x"]["qinvariant"] and not overrides["c1"]["qinvariant"]
    qg = quantize_model(g, [torch.round(b * 10) for b in batches()], per_layer=overrides)
    x = qg.quant.get(qg.node("x").outputs[0])
    assert x.qinvariant and x.scale == 1.0 and x.zerop == 0
    relu_out = qg.node("c1").outputs[0]
    assert relu_out.dtype is Dtype.INT8  # RELU output forced signed
    qg.forward([torch.round(batches(1, seed=9)[0] * 10)], keep_tensors=True)
    assert int(relu_out.betensor.min()) >= -int(qg.quant.get(relu_out).zerop)  # the fused RELU still clamps at float 0
