"""The [Common] cfg reader: syntax, field validation, path resolution and cross-field checks."""
from __future__ import annotations

from pathlib import Path

import pytest

from quantopt.config.fields import FIELDS, Field, field
from quantopt.config.kinds import BoolKind, ChoiceKind, FloatKind, IntKind, MetricListKind
from quantopt.config.perlayer import PerLayerValue
from quantopt.config.reader import read_cfg
from quantopt.errors import ConfigError


@pytest.fixture
def model(tmp_path: Path) -> Path:
    txt = tmp_path / "m.txt"
    txt.write_text("model_name=m\nlayer_number=1\ninput_tensors=[x]\noutput_tensors=[x]\n\n"
                   "layer_id=0\nlayer_name=x\nlayer_type=Input\nlayer_bottom=[]\nlayer_bottom_shape=[]\n"
                   "layer_bottom_type=[]\nlayer_top=[x]\nlayer_top_shape=[[1,2]]\nlayer_top_type=[float32]\n")
    (tmp_path / "m.bin").write_bytes(b"")
    return txt


def write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "opt.cfg"
    p.write_text(body)
    return p


def test_minimal_cfg_and_defaults(tmp_path, model):
    cfg = read_cfg(str(write(tmp_path, "[Common]\ngraph = m.txt\n")))
    assert cfg.graph == str(model)
    assert cfg.output_dir == "./opt_log"
    assert cfg.metric_batch_size == 1 and cfg.eval_original_model is True


def test_comments_case_insensitive_keys_and_spaces_in_values(tmp_path, model):
    sub = tmp_path / "dir with space"
    sub.mkdir()
    (sub / "calib.npy").write_bytes(b"x")
    cfg = read_cfg(str(write(tmp_path, "# comment\n; other comment\n[common]\nGRAPH = m.txt\n"
                                       "Dataset = NumpyDataset\ncalibration_data = dir with space/calib.npy\n")))
    assert cfg.calibration_data == str(sub / "calib.npy")
    assert cfg.dataset == "NumpyDataset"


def test_paths_resolve_from_cfg_folder_not_cwd(tmp_path, model, monkeypatch):
    monkeypatch.chdir("/")
    cfg = read_cfg(str(write(tmp_path, "[Common]\ngraph = ./m.txt\n")))
    assert cfg.graph == str(model)


@pytest.mark.parametrize("body, line, phrase", [
    ("[Common]\ngraph = m.txt\nmetric_batch_sise = 4\n", 3, "did you mean 'metric_batch_size'"),
    ("[Common]\ngraph = m.txt\ngraph = m.txt\n", 3, "duplicate key 'graph' (first set at line 2)"),
    ("[Common]\ngraph = m.txt\nmetric_batch_size = 0\n", 3, "expected an integer in [1, 1048576]"),
    ("[Common]\ngraph = m.txt\nmetric_batch_size = four\n", 3, "invalid value 'four'"),
    ("[Common]\ngraph = nope.txt\n", 2, "expected the path of an existing file"),
    ("[Common]\ngraph = m.txt\neval_original_model = maybe\n", 3, "expected true or false"),
    ("[Common]\ngraph = m.txt\nthis line has no equals\n", 3, "expected key = value"),
    ("graph = m.txt\n", 1, "must follow a [Common]"),
    ("[Other]\ngraph = m.txt\n", 1, "unknown section [Other]"),
    ("[Common]\ngraph = m.txt\nmodel_name = a/b\n", 3, "without path separators"),
    ("[Common]\ngraph = m.txt\nmetric = TopKMetric(1\n", 3, "field 'metric'"),
    ("[Common]\ngraph = m.txt\nfeaturemap_tiling_param = [(1,2,2)]\n", 3, "field 'featuremap_tiling_param'"),
    ("[Common]\ngraph = m.txt\n[Common]\n", 3, "duplicate [Common]"),
])
def test_errors_name_file_line_and_field(tmp_path, model, body, line, phrase):
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        read_cfg(str(path))
    err = info.value
    assert err.file == str(path) and err.line == line
    assert phrase in str(err)
    assert str(err).startswith(f"config error: {path}:{line}: ")


def test_missing_cfg_and_missing_graph(tmp_path, model):
    with pytest.raises(ConfigError, match="cfg file not found"):
        read_cfg(str(tmp_path / "absent.cfg"))
    with pytest.raises(ConfigError, match="field 'graph' is required"):
        read_cfg(str(write(tmp_path, "[Common]\nmodel_name = x\n")))
    with pytest.raises(ConfigError, match="no \\[Common\\] section"):
        read_cfg(str(write(tmp_path, "# only a comment\n")))


def test_cross_field_checks(tmp_path, model):
    (tmp_path / "d.npy").write_bytes(b"x")
    with pytest.raises(ConfigError, match="needs validation 'data'"):
        read_cfg(str(write(tmp_path, "[Common]\ngraph = m.txt\ndataset = NumpyDataset\nmetric = TopKMetric\n")))
    with pytest.raises(ConfigError, match="no 'dataset' plugin"):
        read_cfg(str(write(tmp_path, "[Common]\ngraph = m.txt\ncalibration_data = d.npy\n")))
    with pytest.raises(ConfigError, match="needs a 'dataset' plugin"):
        read_cfg(str(write(tmp_path, "[Common]\ngraph = m.txt\ndata = d.npy\nmetric = TopKMetric\n")))


def test_empty_value_keeps_default(tmp_path, model):
    cfg = read_cfg(str(write(tmp_path, "[Common]\ngraph = m.txt\noutput_dir =\n")))
    assert cfg.output_dir == "./opt_log"


def test_metric_list_kind():
    kind = MetricListKind()
    assert kind.parse("TopKMetric,TopKMetric(5), CosDistanceMetric()") == [
        ("TopKMetric", ()), ("TopKMetric", ("5",)), ("CosDistanceMetric", ())]
    assert kind.parse("A(x, y),A(x,y)") == [("A", ("x", "y"))]
    for bad in ("A,", "A(", "A(1,,2)", "A B", ""):
        with pytest.raises(ValueError):
            kind.parse(bad)


def test_value_kinds():
    assert BoolKind().parse("TRUE") is True and BoolKind().parse("false") is False
    assert IntKind(4, 16).parse("16") == 16
    with pytest.raises(ValueError):
        IntKind(4, 16).parse("17")
    assert FloatKind(1.0).parse("1.05") == 1.05
    with pytest.raises(ValueError):
        FloatKind(1.0).parse("nan")
    assert ChoiceKind(["extrema", "mean"]).parse("MEAN") == "mean"


def test_per_layer_field_through_reader(tmp_path, model):
    name = "test_only_per_layer_bits"
    field(name, 8, IntKind(8, 16), "test field", per_layer=True)
    try:
        cfg = read_cfg(str(write(tmp_path, f"[Common]\ngraph = m.txt\n{name} = 8 & <[Softmax]:16> <{{fc.*}}:12>\n")))
        value = getattr(cfg, name)
        assert isinstance(value, PerLayerValue)
        assert value.resolve(3, "Softmax", "prob") == 16 and value.resolve(3, "X", "fc1") == 12
        with pytest.raises(ConfigError, match="invalid per-layer value"):
            read_cfg(str(write(tmp_path, f"[Common]\ngraph = m.txt\n{name} = 8 & <[Softmax]:32>\n")))
    finally:
        del FIELDS[name]


def test_field_table_is_complete_and_described():
    assert len(FIELDS) >= 15
    for f in FIELDS.values():
        assert isinstance(f, Field)
        assert f.description and f.allowed()
        assert f.name == f.name.lower()


# ------------------------------------------------------------------ presets
def test_preset_accurate_fills_the_fields_the_cfg_leaves_out(tmp_path, model):
    from quantopt.config.presets import PRESETS

    path = write(tmp_path, "[Common]\ngraph = m.txt\npreset = accurate\n")
    cfg = read_cfg(str(path))
    assert cfg.preset == "accurate" and set(cfg.preset_fields) == set(PRESETS["accurate"])
    from quantopt.config.fields import FIELDS

    for name, text in PRESETS["accurate"].items():
        value = getattr(cfg, name)
        assert (value.get() if hasattr(value, "get") else value) == FIELDS[name].kind.parse(text), name


def test_a_field_written_in_the_cfg_wins_over_the_preset(tmp_path, model):
    body = ("[Common]\ngraph = m.txt\npreset = accurate\n"
            "quantize_method_for_weight = per_tensor_symmetric_restricted_range\n")
    cfg = read_cfg(str(write(tmp_path, body)))
    assert str(cfg.quantize_method_for_weight) == "per_tensor_symmetric_restricted_range"
    assert "quantize_method_for_weight" not in cfg.preset_fields
    from quantopt.config.presets import PRESETS

    expected = PRESETS["accurate"]["calibration_strategy_for_activation"]
    assert str(cfg.calibration_strategy_for_activation) == expected


def test_without_preset_the_defaults_are_upstreams(tmp_path, model):
    cfg = read_cfg(str(write(tmp_path, "[Common]\ngraph = m.txt\n")))
    assert cfg.preset == "none" and cfg.preset_fields == {}
    assert str(cfg.quantize_method_for_weight) == "per_tensor_symmetric_restricted_range"
    assert str(cfg.calibration_strategy_for_activation) == "mean"


def test_unknown_preset_is_a_config_error(tmp_path, model):
    with pytest.raises(ConfigError, match=r"opt.cfg:3: field 'preset': invalid value 'fast'.*none, accurate"):
        read_cfg(str(write(tmp_path, "[Common]\ngraph = m.txt\npreset = fast\n")))


def test_preset_settings_for_the_python_api():
    from quantopt.config.layer_settings import LayerSettings
    from quantopt.config.presets import preset_settings

    settings = LayerSettings(**preset_settings("accurate"))
    assert settings.q_mode_weight == "per_channel_symmetric_restricted_range"
    assert settings.detect_finite_masks is True  # a global field every layer's settings carry
    assert preset_settings("none") == {}
    with pytest.raises(ValueError, match="unknown preset 'x'"):
        preset_settings("x")
