"""The compiler and library cfg fields (quantopt/passes/compiler_fields.py): parsing, the dynamic-shape keys they
write (against upstream's goldens op_ds_keys), the weight ranges optimize_wdc_for_x2 doubles (against an
independent re-implementation and upstream's golden op_wdc_x2), and the clear errors for values that need what
quantopt lacks (Winograd weights, the NPU library's dtype table, feature-map tiling)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch
from golden_helpers import run_golden_cfg

from quantopt.cli import main
from quantopt.config.fields import FIELDS, UPSTREAM_FIELDS
from quantopt.config.reader import read_cfg
from quantopt.errors import ConfigError
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.passes.compiler_fields import write_compiler_keys, x2_compression_rate

CORPUS = Path(__file__).resolve().parent / "data" / "golden_corpus"
NEW_FIELDS = {
    "enable_ds": False, "ds_output_shape_constant": "disable", "ds_parameter_constant": "disable",
    "cast_dtypes_for_lib": False, "with_winograd": False, "optimize_wdc_for_x2": False,
    "regularize_activation_perchannel_scales": "disable", "featuremap_tiling_param": [],
    "featuremap_splits_item_x": 1, "featuremap_splits_item_y": 1, "featuremap_splits_sram_size": 0,
    "featuremap_splits_concat_blk": 3, "featuremap_splits_overlap_rate": 50,
}
PER_LAYER = {"enable_ds", "ds_output_shape_constant", "ds_parameter_constant", "cast_dtypes_for_lib", "with_winograd",
             "optimize_wdc_for_x2", "regularize_activation_perchannel_scales"}


# ------------------------------------------------------------------------------------------------ parsing
def test_fields_have_upstream_defaults_and_are_implemented() -> None:
    assert {name: FIELDS[name].default for name in NEW_FIELDS} == NEW_FIELDS
    assert {name for name in NEW_FIELDS if FIELDS[name].per_layer} == PER_LAYER
    assert not set(NEW_FIELDS) & UPSTREAM_FIELDS


def _cfg(tmp_path: Path, *lines: str) -> Path:
    (tmp_path / "g.txt").write_text("")  # read_cfg checks that the graph exists, not what it holds
    path = tmp_path / "opt.cfg"
    path.write_text("[Common]\ngraph = g.txt\n" + "".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(("line", "name", "value"), [
    ("enable_ds = true", "enable_ds", True),
    ("ds_output_shape_constant = all", "ds_output_shape_constant", "all"),
    ("ds_output_shape_constant = [1, 0,1]", "ds_output_shape_constant", (1, 0, 1)),
    ("ds_parameter_constant = default", "ds_parameter_constant", "default"),
    ("optimize_wdc_for_x2 = True", "optimize_wdc_for_x2", True),
    ("regularize_activation_perchannel_scales = enable", "regularize_activation_perchannel_scales", "enable"),
    ("featuremap_tiling_param = [(1,3,2,2), (5, 6, 1, 2)]", "featuremap_tiling_param", [(1, 3, 2, 2), (5, 6, 1, 2)]),
    ("featuremap_splits_item_x = 127", "featuremap_splits_item_x", 127),
    ("featuremap_splits_sram_size = 8191", "featuremap_splits_sram_size", 8191),
    ("featuremap_splits_concat_blk = 1", "featuremap_splits_concat_blk", 1),
    ("featuremap_splits_overlap_rate = 0", "featuremap_splits_overlap_rate", 0),
])
def test_values_parse(tmp_path: Path, line: str, name: str, value: object) -> None:
    cfg = read_cfg(str(_cfg(tmp_path, line)))
    got = getattr(cfg, name)
    got = got.global_value if name in PER_LAYER else got
    assert (tuple(got) if isinstance(value, tuple) else got) == value


def test_per_layer_values_resolve_by_type(tmp_path: Path) -> None:
    cfg = read_cfg(str(_cfg(tmp_path, "ds_output_shape_constant = disable & <[Split] : [1,0]><[Crop] : all>")))
    graph = _ds_graph()
    got = {n.name: str(cfg.ds_output_shape_constant.get(n)) for n in graph.nodes}
    assert got == {"x": "disable", "reshape": "disable", "crop": "all", "split": "[1,0]"}


@pytest.mark.parametrize("line", [
    "enable_ds = maybe", "ds_output_shape_constant = some", "ds_output_shape_constant = [2]",
    "ds_output_shape_constant = []", "ds_parameter_constant = [0,1]", "cast_dtypes_for_lib = 2x",
    "with_winograd = sometimes", "optimize_wdc_for_x2 = x2", "regularize_activation_perchannel_scales = true",
    "featuremap_tiling_param = [(1,2,3)]", "featuremap_tiling_param = (1,2,3,4)", "featuremap_splits_item_x = 0",
    "featuremap_splits_item_y = 128", "featuremap_splits_sram_size = 8192", "featuremap_splits_concat_blk = 0",
    "featuremap_splits_overlap_rate = 100", "featuremap_splits_overlap_rate = 12.5",
])
def test_bad_values_name_the_line(tmp_path: Path, line: str) -> None:
    path = _cfg(tmp_path, "model_name = m", line)
    with pytest.raises(ConfigError) as e:
        read_cfg(str(path))
    assert f"opt.cfg:4: field '{line.split(' = ')[0]}'" in str(e.value)


def test_field_listing_shows_them(capsys: pytest.CaptureFixture) -> None:
    assert main(["--field"]) == 0
    out = capsys.readouterr().out
    for name in NEW_FIELDS:
        assert re.search(rf"^\s*{name}\b", out, re.M), name


# ------------------------------------------------------------------------------------------------ tiny models
def _ds_graph() -> PyGraph:
    b = GraphBuilder("cf")
    x = b.input("x", [1, 8, 16])
    r = b.layer("Reshape", [x], [[1, 8, 4, 4]], name="reshape", params={"shape": [1, 8, 4, 4]})
    c = b.layer("Crop", [r], [[1, 8, 4, 2]], name="crop", params={"crops": [[0, 1], [0, 8], [0, 4], [1, 3]]})
    s = b.layer("Split", [c], [[1, 8, 4, 1], [1, 8, 4, 1]], name="split", params={"axis": 3, "splits": [1, 1]})
    return b.build(s)


def _conv_graph(kernel: int = 3, channels: int = 8, fc_weights: np.ndarray = None) -> PyGraph:
    rng = np.random.default_rng(3)
    b = GraphBuilder("cf")
    x = b.input("x", [1, 10, 10, channels])
    pad = kernel // 2
    c = b.layer("Convolution", [x], [[1, 10, 10, 16]], name="conv",
                params={"num_output": 16, "kernel_x": kernel, "kernel_y": kernel, "stride_x": 1, "stride_y": 1,
                        "pad_left": pad, "pad_right": pad, "pad_top": pad, "pad_bottom": pad, "dilation_x": 1,
                        "dilation_y": 1, "group": 1, "with_activation": "NONE"},
                constants={"weights": rng.uniform(-1, 1, (16, kernel, kernel, channels)).astype(np.float32),
                           "biases": rng.uniform(-0.1, 0.1, 16).astype(np.float32)})
    w = fc_weights if fc_weights is not None else rng.uniform(-1, 1, (16, 16)).astype(np.float32)
    f = b.layer("FullyConnected", [c], [[1, 10, 10, 16]], name="fc", params={"num_output": 16,
                                                                            "with_activation": "NONE"},
                constants={"weights": w, "biases": rng.uniform(-0.1, 0.1, 16).astype(np.float32)})
    return b.build([f])


def _run(tmp_path: Path, graph: PyGraph, *lines: str) -> Tuple[int, Path]:
    """quantopt --cfg on `graph` with 4 seeded calibration samples; returns the exit code and the output folder."""
    write_ir(graph, str(tmp_path / "g.txt"))
    shape = list(graph.input_tensors[0].ir_shape)
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).standard_normal([4] + shape[1:]).astype(np.float32))
    out = tmp_path / "out"
    text = ["graph = g.txt", "model_name = g", "dataset = numpydataset", "calibration_data = calib.npy",
            "calibration_batch_size = 1", f"output_dir = {out}",
            "quantize_method_for_weight = per_tensor_symmetric_restricted_range", *lines]
    (tmp_path / "opt.cfg").write_text("[Common]\n" + "".join(t + "\n" for t in text))
    return main(["--cfg", str(tmp_path / "opt.cfg"), "--log-level", "ERROR"]), out


def _layers(txt: Path) -> Dict[str, Dict[str, str]]:
    layers: Dict[str, Dict[str, str]] = {}
    current: Dict[str, str] = {}
    for line in txt.read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "layer_id":
            current = {}
        if key == "layer_name":
            layers[value] = current
        if key:
            current[key] = value
    return layers


def _keys(layers: Dict[str, Dict[str, str]], prefix: str = "ds_") -> Dict[str, Dict[str, str]]:
    return {name: {k: v for k, v in keys.items() if k.startswith(prefix)} for name, keys in layers.items()}


# ------------------------------------------------------------------------------------------------ IR keys
@pytest.mark.parametrize("letter", ["A", "B", "C"])
def test_ds_keys_as_upstream_writes_them(tmp_path: Path, letter: str) -> None:
    folder = CORPUS / "op_ds_keys" / "golden" / letter
    golden = _keys(_layers(folder / "op_ds_keys_o.txt"))
    assert golden["reshape"] == {"ds_output_shape": "[[1,8,4,4]]"}  # enable_ds
    assert golden["crop"] == {"ds_crops": "[[0,1],[0,8],[0,4],[1,3]]", "ds_output_shape": "[[1,8,4,2]]"}
    assert golden["split"] == {} and golden["tanh"] == {"ds_output_shape": "[[1,8,4,1]]"}  # [1,0] / [1,1] cut to [1]
    ours = run_golden_cfg(folder, "op_ds_keys", tmp_path / "out", quiet=True)
    assert _keys(_layers(ours)) == golden
    assert len(read_ir(str(ours)).nodes) == len(golden)  # quantopt reads its own IR with the keys back


def test_ds_output_shape_constant_all_on_every_layer(tmp_path: Path) -> None:
    code, out = _run(tmp_path, _ds_graph(), "ds_output_shape_constant = all")
    assert code == 0
    keys = _keys(_layers(out / "g_o.txt"))
    assert keys == {"x": {"ds_output_shape": "[[1,8,16]]"}, "reshape": {"ds_output_shape": "[[1,8,4,4]]"},
                    "crop": {"ds_output_shape": "[[1,8,4,2]]"},
                    "split": {"ds_output_shape": "[[1,8,4,1],[1,8,4,1]]"}}


def test_defaults_write_no_ds_keys(tmp_path: Path) -> None:
    code, out = _run(tmp_path, _ds_graph(), "enable_ds = false & <[Crop]:true>")  # enable_ds only acts on Reshape
    assert code == 0
    assert all(not keys for keys in _keys(_layers(out / "g_o.txt")).values())


def test_mixed_flags_replace_entries_of_an_existing_shape() -> None:
    graph = _ds_graph()
    split = graph.node("split")
    split.params["ds_output_shape"] = ["[s0,8,4,1]", "[s0,8,4,1]"]
    write_compiler_keys(graph, ds_output_shape_constant="disable")
    assert split.params["ds_output_shape"] == ["[s0,8,4,1]", "[s0,8,4,1]"]
    from quantopt.config.kinds_compiler import DsShapeConstantKind
    write_compiler_keys(graph, ds_output_shape_constant=DsShapeConstantKind().parse("[0,1,1]"))
    assert split.params["ds_output_shape"] == ["[s0,8,4,1]", [1, 8, 4, 1]]
    assert "ds_output_shape" not in graph.node("crop").params  # one output: [0] (cut) writes nothing


# ------------------------------------------------------------------------------------------------ WDC
def _rate_reference(q: np.ndarray, bits: int) -> float:
    """Independent numpy form of the X2 compression estimate (float32 like upstream)."""
    q = q.astype(np.int64).ravel()
    best = np.float32(1.0)
    for length in ((5, 6) if bits == 8 else (10, 12)):
        if length > bits:
            continue
        inside = np.count_nonzero((q >= -(2 ** (length - 1)) - 1) & (q <= 2 ** (length - 1) - 1))
        p = np.float32(inside) / np.float32(q.size)
        rate = (p * np.float32(length) + (np.float32(1) - p) * np.float32(3 * length)) / np.float32(bits)
        best = min(best, rate) if rate < 1.0 else best
    return float(best)


@pytest.mark.parametrize(("bits", "spread"), [(8, 127), (8, 40), (8, 10), (16, 32767), (16, 900), (16, 300)])
def test_compression_rate_matches_reference(bits: int, spread: int) -> None:
    q = torch.from_numpy(np.random.default_rng(spread).integers(-spread, spread + 1, 999))
    assert x2_compression_rate(q, bits) == pytest.approx(_rate_reference(q.numpy(), bits), abs=0, rel=0)


def _doublings(w: np.ndarray, bits: int = 8) -> int:
    """How often upstream's loop doubles a per-tensor symmetric range: quantize, estimate, double."""
    qmax = 2 ** (bits - 1) - 1
    absmax = float(np.abs(w).max())
    for k in range(4):
        scale = np.float32(2 * qmax) / np.float32(2 * absmax * 2 ** k)
        q = np.clip(np.round(np.float32(scale) * w.astype(np.float32)), -qmax, qmax)
        if _rate_reference(q, bits) < 0.9:
            return k
    return 4


@pytest.mark.parametrize(("name", "weights"), [
    ("uniform", np.random.default_rng(1).uniform(-1, 1, (16, 16))),
    ("binary", np.where(np.random.default_rng(2).random((16, 16)) < 0.5, -1.0, 1.0)),
    ("spiky", np.pad(np.full((1, 1), 1.0), ((0, 15), (0, 15))) + np.random.default_rng(3).normal(0, 0.02, (16, 16))),
])
def test_wdc_doubles_weight_ranges(tmp_path: Path, name: str, weights: np.ndarray) -> None:
    w = weights.astype(np.float32)
    k = _doublings(w)
    graph = _conv_graph(kernel=1, fc_weights=w)
    code, out = _run(tmp_path / "wdc", graph, "optimize_wdc_for_x2 = false & <[FullyConnected]:true>")
    assert code == 0
    code, base = _run(tmp_path / "base", _conv_graph(kernel=1, fc_weights=w))
    assert code == 0
    ours, plain = _layers(out / "g_o.txt"), _layers(base / "g_o.txt")
    assert float(ours["fc"]["weights_scale"]) == float(np.float32(254) / np.float32(2 * np.abs(w).max() * 2 ** k))
    assert float(plain["fc"]["weights_scale"]) == float(np.float32(254) / np.float32(2 * np.abs(w).max()))
    assert ours["conv"] == plain["conv"]  # the flag is per layer
    assert {"uniform": 2, "binary": 3, "spiky": 0}[name] == k


def test_wdc_golden_doublings() -> None:
    """Upstream's golden op_wdc_x2/A: binary conv weights doubled 3 times, uniform FC weights twice, the spiky FC
    not at all; 16-bit (C): 4 times, 4 and once; per-channel weights (B) as without the field."""
    scales = {letter: {name: keys.get("weights_scale") for name, keys in
                       _layers(CORPUS / "op_wdc_x2" / "golden" / letter / "op_wdc_x2_o.txt").items()}
              for letter in "AC"}
    assert float(scales["A"]["conv"]) == 127 / 8 and float(scales["A"]["fc_sparse"]) == 127.0
    assert float(scales["C"]["conv"]) == pytest.approx(32767 / 16) and float(scales["C"]["fc_sparse"]) == 32767 / 2


def test_wdc_with_global_calibration_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, _ = _run(tmp_path, _conv_graph(kernel=1), "optimize_wdc_for_x2 = true",
                   "global_calibration = bias_correction[1]")
    assert code == 2
    assert "opt.cfg:9: field 'optimize_wdc_for_x2': cannot be combined with global_calibration" in \
        capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ refusals
def _error_of(tmp_path: Path, capsys: pytest.CaptureFixture, graph: PyGraph, *lines: str) -> str:
    code, _ = _run(tmp_path, graph, *lines)
    assert code == 2
    return capsys.readouterr().err


def test_winograd_refused_where_upstream_would_apply_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    err = _error_of(tmp_path, capsys, _conv_graph(), "with_winograd = true")
    assert "opt.cfg:9: field 'with_winograd': Convolution layer(s) 'conv' would run as Winograd F(2,3)" in err


@pytest.mark.parametrize("graph", [lambda: _conv_graph(kernel=1), lambda: _conv_graph(channels=4)],
                         ids=["1x1", "4 input channels"])
def test_winograd_changes_nothing_where_no_layer_qualifies(tmp_path: Path, graph: Callable[[], PyGraph]) -> None:
    code, out = _run(tmp_path / "on", graph(), "with_winograd = true")
    assert code == 0
    code, base = _run(tmp_path / "off", graph())
    assert code == 0
    assert (out / "g_o.txt").read_text() == (base / "g_o.txt").read_text()


@pytest.mark.parametrize(("line", "message"), [
    ("cast_dtypes_for_lib = false & <[FullyConnected]:true>",
     "field 'cast_dtypes_for_lib': true for layer(s) 'fc': upstream then inserts Cast layers"),
    ("featuremap_splits_item_x = 2", "field 'featuremap_splits_item_x': 2 asks upstream's NPU compiler flow to tile"),
    ("featuremap_splits_item_y = 3", "field 'featuremap_splits_item_y': 3 asks"),
    ("featuremap_splits_sram_size = 512", "field 'featuremap_splits_sram_size': 512 asks"),
    ("featuremap_tiling_param = [(1,2,2,2)]", "field 'featuremap_tiling_param': feature-map tiling of layer ranges"),
])
def test_values_needing_missing_machinery_are_errors(tmp_path: Path, capsys: pytest.CaptureFixture, line: str,
                                                     message: str) -> None:
    assert f"opt.cfg:9: {message}" in _error_of(tmp_path, capsys, _conv_graph(kernel=1), line)


def test_accepted_values_without_effect_change_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines: List[str] = ["featuremap_splits_concat_blk = 7", "featuremap_splits_overlap_rate = 10",
                        "cast_dtypes_for_lib = false", "regularize_activation_perchannel_scales = enable"]
    code, out = _run(tmp_path / "on", _conv_graph(kernel=1), *lines)
    assert code == 0
    assert "regularize_activation_perchannel_scales = enable (layers 'x', 'conv', 'fc') changes nothing" in caplog.text
    code, base = _run(tmp_path / "off", _conv_graph(kernel=1))
    assert code == 0
    assert (out / "g_o.txt").read_text() == (base / "g_o.txt").read_text()


def test_unimplemented_upstream_fields_still_get_their_own_error(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every upstream field is implemented now; the reader still answers a listed one with "not implemented yet"
    rather than "unknown key" (for fields upstream adds later)."""
    monkeypatch.setattr("quantopt.config.reader.UPSTREAM_FIELDS", frozenset({"future_upstream_field"}))
    with pytest.raises(ConfigError, match="opt.cfg:3: field 'future_upstream_field' of the Compass Optimizer is "
                                          "not implemented in quantopt yet"):
        read_cfg(str(_cfg(tmp_path, "future_upstream_field = 1")))
