"""Upstream cfg fields with upstream's semantics: quant_ir_name, skip_optimization, write_similarity_to_ir,
record_debug_acc_info, perf_mode_for_lib, resize_degrade_to_nearest, activation_perchannel_min_elements (the CLI
runs use the bundled digits example; ignore_missing_statistic is tested with the statistic files)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli import example_cfg

from quantopt.cli import main
from quantopt.config.fields import FIELDS, UPSTREAM_FIELDS
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.reader import read_ir
from quantopt.pipeline import finish_settings, quantize_model, run_quantized, settings_from_arguments
from quantopt.quant.dtype import Dtype

NEW_FIELDS = ("quant_ir_name", "skip_optimization", "write_similarity_to_ir", "record_debug_acc_info",
              "perf_mode_for_lib", "resize_degrade_to_nearest", "activation_perchannel_min_elements",
              "ignore_missing_statistic")


def test_fields_are_implemented_with_upstream_defaults() -> None:
    defaults = {name: FIELDS[name].default for name in NEW_FIELDS}
    assert defaults == {"quant_ir_name": "", "skip_optimization": False, "write_similarity_to_ir": False,
                        "record_debug_acc_info": False, "perf_mode_for_lib": True, "resize_degrade_to_nearest": False,
                        "activation_perchannel_min_elements": 1, "ignore_missing_statistic": False}
    assert not set(NEW_FIELDS) & UPSTREAM_FIELDS
    assert FIELDS["perf_mode_for_lib"].per_layer and FIELDS["resize_degrade_to_nearest"].per_layer


def _layers(txt: Path) -> dict:
    """layer name -> {key: value text} of an IR text file."""
    layers, current = {}, None
    for line in txt.read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "layer_id":
            current = {}
        if current is not None and key:
            current[key] = value
        if key == "layer_name":
            layers[value] = current
    return layers


def test_quant_ir_name_wins_over_out_ir_name(tmp_path: Path) -> None:
    cfg = example_cfg(tmp_path, "out_ir_name = plain\nquant_ir_name = older\n", metric=None, data=None, label=None)
    assert main(["--cfg", str(cfg)]) == 0
    assert (tmp_path / "out" / "older.txt").is_file() and not (tmp_path / "out" / "plain.txt").exists()


def test_skip_optimization_evaluates_the_float_model_only(tmp_path: Path) -> None:
    cfg = example_cfg(tmp_path, "skip_optimization = true\n", calibration_data=None)
    assert main(["--cfg", str(cfg)]) == 0
    out = tmp_path / "out"
    assert not list(out.glob("*.txt")) and not list(out.glob("*.bin")) and not list(out.glob("*template.json"))
    report = json.loads((out / "digits_report.json").read_text())
    (metric,) = report["metrics"]
    assert metric["float"] > 0.9 and metric["quant"] is None
    assert "no statistics, no quantization, no IR" in (out / "digits_opt.log").read_text()


def test_write_similarity_to_ir_writes_the_analysis_and_reads_back(tmp_path: Path) -> None:
    cfg = example_cfg(tmp_path, "write_similarity_to_ir = true\n", metric=None, data=None, label=None)
    assert main(["--cfg", str(cfg)]) == 0
    out = tmp_path / "out"
    layers = _layers(out / "digits_o.txt")
    template = json.loads((out / "digits_opt_template.json").read_text())
    for name, keys in layers.items():
        assert keys["D_layer_id"] == keys["layer_id"]
        assert keys["D_dynamic_shape"] == keys["layer_top_shape"]
        sim = template[name]["just_for_display"].get("similarity")
        if sim:  # the written cosine is the analysis' cumulative cosine of the output
            (tensor, values), = sim.items()
            assert float(keys["D_cos"]) == pytest.approx(values["cumulative_cos"], rel=1e-12)
            assert float(keys["D_mse"]) == pytest.approx(values["cumulative_mse"], rel=1e-12)
    graph = read_ir(str(out / "digits_o.txt"))  # quantopt reads its own annotated IR
    assert len(graph.nodes) == len(layers)


def test_layers_without_analysis_write_nan_and_read_back(tmp_path: Path) -> None:
    """A layer the analysis has no result for (an integer Cast, a layer left out) gets D_cos = nan, which quantopt
    reads back: the D_ keys are information for IR viewers, never read by a forward."""
    from quantopt.analysis.run_records import similarity_keys
    from quantopt.ir.writer import write_ir

    g = GraphBuilder("one")
    x = g.input("x", [1, 4])
    y = g.layer("Activation", [x], [[1, 4]], name="relu", params=dict(method="RELU"))
    q = quantize_model(g.build([y]), [torch.ones(1, 4), -torch.ones(1, 4)])
    assert similarity_keys(q, []) == 2
    txt, _ = write_ir(q, str(tmp_path / "q.txt"))
    assert _layers(Path(txt))["relu"]["D_cos"] == "nan"
    again = read_ir(txt)
    assert again.node("relu").params["D_cos"] != again.node("relu").params["D_cos"]  # NaN


def test_record_debug_acc_info_appends_one_record_per_run(tmp_path: Path) -> None:
    cfg = example_cfg(tmp_path, "record_debug_acc_info = true\n")
    assert main(["--cfg", str(cfg)]) == 0
    assert main(["--cfg", str(cfg)]) == 0
    lines = (tmp_path / "out" / "digits_record_model_acc.txt").read_text().splitlines()
    assert len(lines) == 4
    first, second = json.loads(lines[1]), json.loads(lines[3])
    assert first == second  # deterministic runs give the same record (only the time lines differ)
    assert first["model"] == "digits" and first["fields"]["weight_bits"] == 8
    assert set(first["float_metrics"]) == set(first["quant_metrics"]) == {"TopKMetric"}
    assert first["outputs"] and 0.9 < first["outputs"][0]["cosine"] <= 1.0


def test_perf_mode_for_lib_is_written_per_layer(tmp_path: Path) -> None:
    cfg = example_cfg(tmp_path, "perf_mode_for_lib = true & <[Convolution]:false>\n", metric=None, data=None,
                      label=None)
    assert main(["--cfg", str(cfg)]) == 0
    layers = _layers(tmp_path / "out" / "digits_o.txt")
    values = {(keys["layer_type"], keys["is_perf_mode"]) for keys in layers.values()}
    assert ("Convolution", "false") in values and ("Convolution", "true") not in values
    assert ("FullyConnected", "true") in values


def _resize_graph(method: str):
    g = GraphBuilder("resize")
    x = g.input("x", [1, 4, 4, 3])
    y = g.layer("Resize", [x], [[1, 8, 8, 3]], name="up", params=dict(method=method, mode="HALF_PIXEL"))
    return g.build([y])


def test_resize_degrade_to_nearest_quantizes_a_nearest_resize() -> None:
    data = [torch.from_numpy(np.random.default_rng(3).normal(0, 1, (2, 4, 4, 3)).astype(np.float32))]
    float_graph = _resize_graph("BILINEAR")
    q = quantize_model(float_graph, [data], settings={"resize_degrade_to_nearest": True})
    assert str(q.node("up").params["method"]).upper() == "NEAREST"
    assert str(float_graph.node("up").params["method"]).upper() == "BILINEAR"
    reference = quantize_model(_resize_graph("NEAREST"), [data])
    ours, = run_quantized(q, data)
    expected, = run_quantized(reference, data)
    assert torch.equal(ours, expected)
    plain = quantize_model(_resize_graph("BILINEAR"), [data])
    assert not torch.equal(run_quantized(plain, data)[0], expected)


def _per_channel_graph(spatial: int):
    r = np.random.default_rng(0)
    g = GraphBuilder("pc")
    x = g.input("x", [1, spatial, spatial, 3])
    y = g.layer("Convolution", [x], [[1, spatial, spatial, 4]], name="conv",
                params=dict(num_output=4, kernel_x=1, kernel_y=1, stride_x=1, stride_y=1, pad_left=0, pad_right=0,
                            pad_top=0, pad_bottom=0, dilation_x=1, dilation_y=1, group=1, with_activation="NONE"),
                constants={"weights": r.normal(0, 0.3, (4, 1, 1, 3)).astype(np.float32),
                           "biases": np.zeros(4, np.float32)})
    return g.build([y])


@pytest.mark.parametrize("spatial, minimum, per_channel", [(4, 1, True), (4, 16, True), (4, 17, False)])
def test_activation_perchannel_min_elements(spatial: int, minimum: int, per_channel: bool) -> None:
    g = _per_channel_graph(spatial)
    settings_from_arguments(g, {"q_mode_activation": "per_channel_symmetric_full_range",
                                "perchannel_min_elements": minimum})
    fallen = finish_settings(g)
    assert (g.node("conv").settings.q_mode_activation == "per_channel_symmetric_full_range") == per_channel
    assert bool(fallen) != per_channel
    if fallen:
        assert "activation_perchannel_min_elements = 17" in fallen[0][1]


def test_modify_batch_dim_writes_an_ir_for_that_batch(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "four").mkdir()
    base = example_cfg(tmp_path / "one", metric=None, data=None, label=None)
    four = example_cfg(tmp_path / "four", "modify_batch_dim = 4\n", metric=None, data=None, label=None)
    assert main(["--cfg", str(base)]) == 0 and main(["--cfg", str(four)]) == 0
    one_ir = read_ir(str(tmp_path / "one" / "out" / "digits_o.txt"))
    four_ir = read_ir(str(tmp_path / "four" / "out" / "digits_o.txt"))
    assert one_ir.input_tensors[0].ir_shape[0] == 1 and four_ir.input_tensors[0].ir_shape[0] == 4
    assert all(t.ir_shape[0] == 4 for n in four_ir.nodes if str(n.type) != "Constant" for t in n.outputs)
    samples = torch.from_numpy(np.load(Path(__file__).resolve().parents[1] / "examples/digits/data/val.npy")[:8])
    samples = samples.to(torch.float32)
    ours, = run_quantized(four_ir, [samples])
    theirs, = run_quantized(one_ir, [samples])
    assert torch.equal(ours, theirs)  # the same integers, the IR now made for batch 4


def test_modify_batch_dim_reports_a_layer_holding_the_old_batch(tmp_path: Path, capsys) -> None:
    g = GraphBuilder("cat")
    x = g.input("x", [1, 4])
    c = g.layer("Constant", [], [[1, 4]], name="row", constants={"weights": np.ones((1, 4), np.float32)})
    y = g.layer("Concat", [x, c], [[2, 4]], name="rows", params=dict(axis=0))
    graph = g.build([y])
    from quantopt.ir.writer import write_ir
    write_ir(graph, str(tmp_path / "cat.txt"), str(tmp_path / "cat.bin"))
    np.save(tmp_path / "calib.npy", np.ones((2, 4), np.float32))
    cfg = tmp_path / "opt.cfg"
    cfg.write_text(f"[Common]\ngraph = {tmp_path / 'cat.txt'}\nbin = {tmp_path / 'cat.bin'}\ndataset = NumpyDataset\n"
                   f"calibration_data = {tmp_path / 'calib.npy'}\noutput_dir = {tmp_path / 'out'}\n"
                   "modify_batch_dim = 3\n")
    assert main(["--cfg", str(cfg)]) != 0
    err = capsys.readouterr().err
    assert "layer 'rows' (Concat) produced [4, 4] for output 'rows' but the IR declares [6, 4] (modify_batch_dim = 3 " \
        "scaled dim 0 of every layer output; this layer's does not follow the batch)" in err


def test_modify_batch_dim_names_the_cause_when_a_layer_refuses_its_inputs(tmp_path: Path, capsys) -> None:
    """InTopK's targets are a Constant of one sample: at batch 2 the layer refuses them, and the error says that
    modify_batch_dim made the batch (found by benchmarks/fuzz_cfg_runs.py, docs/robustness.md)."""
    g = GraphBuilder("topk")
    x = g.input("x", [1, 8])
    t = g.layer("Constant", [], [[1]], name="target", constants={"weights": np.array([3], np.float32)})
    y = g.layer("InTopK", [x, t], [[1]], name="intopk", params=dict(k=3), output_dtypes=[Dtype.UINT8])
    graph = g.build([y])
    from quantopt.ir.writer import write_ir
    write_ir(graph, str(tmp_path / "topk.txt"), str(tmp_path / "topk.bin"))
    np.save(tmp_path / "calib.npy", np.ones((2, 8), np.float32))
    cfg = tmp_path / "opt.cfg"
    text = (f"[Common]\ngraph = {tmp_path / 'topk.txt'}\nbin = {tmp_path / 'topk.bin'}\ndataset = NumpyDataset\n"
            f"calibration_data = {tmp_path / 'calib.npy'}\noutput_dir = {tmp_path / 'out'}\n")
    cfg.write_text(text)
    assert main(["--cfg", str(cfg)]) == 0
    cfg.write_text(text.replace(str(tmp_path / "out"), str(tmp_path / "out2")) + "modify_batch_dim = 2\n")
    assert main(["--cfg", str(cfg)]) == 3
    err = [line for line in capsys.readouterr().err.splitlines() if "[ERROR]" in line]
    assert len(err) == 1 and "layer 'intopk' (InTopK)" in err[0] and "(modify_batch_dim = 2 scaled dim 0 of every " \
        "layer output but the Constants'; this layer's inputs do not follow the batch)" in err[0], err
    assert not (tmp_path / "out2").exists() or not any((tmp_path / "out2").glob("*_o.txt"))


def test_modify_batch_dim_refuses_a_model_without_batch_dim(tmp_path: Path, capsys) -> None:
    cfg = example_cfg(tmp_path, "modify_batch_dim = 4\nwithout_batch_dim = true\n", metric=None, data=None,
                      label=None)
    assert main(["--cfg", str(cfg)]) == 2
    assert "field 'modify_batch_dim': needs a batch dimension" in capsys.readouterr().err


@pytest.mark.parametrize("copies", [2, 3])
def test_export_parallel_batch_runs_copies_side_by_side(tmp_path: Path, copies: int) -> None:
    cfg = example_cfg(tmp_path, f"export_parallel_batch = {copies}\n", metric=None, data=None, label=None)
    assert main(["--cfg", str(cfg)]) == 0
    joined = read_ir(str(tmp_path / "out" / "digits_o.txt"))
    types = [str(n.type) for n in joined.nodes]
    assert types.count("Split") == 1 and types.count("Concat") == 1 and types.count("Convolution") == 3 * copies
    assert joined.input_tensors[0].ir_shape[0] == copies
    samples = np.load(Path(__file__).resolve().parents[1] / "examples/digits/data/val.npy")[:4 * copies]
    samples = torch.from_numpy(samples).to(torch.float32)
    # the single model, quantized from the same cfg, on each copy's rows
    (tmp_path / "single").mkdir()
    single = example_cfg(tmp_path / "single", metric=None, data=None, label=None)
    assert main(["--cfg", str(single)]) == 0
    one = read_ir(str(tmp_path / "single" / "out" / "digits_o.txt"))
    # N runs of the single model on batches b_0..b_N-1 (4 samples each) vs one run of the joined IR on rows
    # [b_0[i], b_1[i], ...] for each i (the joined IR's dim 0 holds one sample per copy)
    groups = samples.reshape(copies, 4, *samples.shape[1:])
    expected = [run_quantized(one, [groups[k]])[0] for k in range(copies)]
    got = torch.stack([run_quantized(joined, [groups[:, i]])[0] for i in range(4)], dim=1)
    assert torch.equal(got, torch.stack(expected))


def test_export_parallel_batch_names_never_collide(tmp_path: Path) -> None:
    """A model with a layer already named like the inserted Concat ('y_concat', 'a_concat'), a tensor named like a
    copy's ('t_clone_0') and two outputs of one layer (each its own Concat): every name of the joined IR unique,
    and the joined IR gives each copy's integers."""
    from quantopt.ir.writer import write_ir
    from quantopt.passes.parallel_batch import parallel_copies

    g = GraphBuilder("names")
    x = g.input("x", [1, 4])
    t = g.layer("Activation", [x], [[1, 4]], name="t", params=dict(method="RELU"))
    yc = g.layer("Activation", [t], [[1, 4]], name="t_clone_0", outputs=["y_concat"], params=dict(method="RELU"))
    a, b = g.layer("Split", [t], [[1, 2], [1, 2]], name="y", outputs=["a", "b"], params=dict(axis=1, splits=[2, 2]))
    c = g.layer("Activation", [yc], [[1, 4]], name="a_concat", outputs=["c"],
                params=dict(method="RELU"))
    graph = g.build([a, b, c])
    rng = np.random.default_rng(4)
    calib = [torch.from_numpy(rng.normal(0, 1, (2, 4)).astype(np.float32)) for _ in range(2)]
    q = quantize_model(graph, calib)
    joined = parallel_copies(q, 3)
    layers = [n.name for n in joined.nodes]
    tensors = [o.name for n in joined.nodes for o in n.outputs]
    assert len(set(layers)) == len(layers) and len(set(tensors)) == len(tensors)
    assert [o.name for o in joined.output_tensors] == ["a", "b", "c"]
    txt, _ = write_ir(joined, str(tmp_path / "joined.txt"))
    again = read_ir(txt)
    rows = torch.from_numpy(rng.normal(0, 1, (3, 4)).astype(np.float32))
    got = run_quantized(again, [rows])
    for k in range(3):
        for out, want in zip(got, run_quantized(q, [rows[k:k + 1]])):
            assert torch.equal(out[k:k + 1], want)


def _kv_graph(cache: str):
    """new[1,1,8] -> tanh -> k; cache [1,3,8] (an Input fed back, or a Constant of zeros); Concat on axis 1."""
    g = GraphBuilder("kv")
    x = g.input("new", [1, 1, 8])
    k = g.layer("Activation", [x], [[1, 1, 8]], name="k", params=dict(method="TANH"))
    if cache == "Input":
        past = g.input("past", [1, 3, 8])
    else:
        past = g.layer("Constant", [], [[1, 3, 8]], name="past", constants={"weights": np.zeros((1, 3, 8), np.float32)})
    y = g.layer("Concat", [past, k], [[1, 4, 8]], name="cache", params=dict(axis=1))
    return g.build([y])


@pytest.mark.parametrize("cache", ["Input", "Constant"])
def test_unify_scales_for_kvc_concat_keeps_one_cache_scale(cache: str) -> None:
    r = np.random.default_rng(5)
    batches = [[torch.from_numpy(r.normal(0, 2, (1, 1, 8)).astype(np.float32))] for _ in range(4)]
    if cache == "Input":  # the fed-back cache holds earlier steps' values, in a narrower range than k
        batches = [b + [torch.from_numpy(r.uniform(-0.3, 0.3, (1, 3, 8)).astype(np.float32))] for b in batches]
    plain = quantize_model(_kv_graph(cache), batches)
    q = quantize_model(_kv_graph(cache), batches, settings={"unify_scales_for_kvc_concat": True})
    k, past, out = (q.quant.get(q.node(n).outputs[0]) for n in ("k", "past", "cache"))
    assert float(past.scale) == float(k.scale) == float(out.scale) and int(past.zerop) == int(out.zerop)
    assert not {"scale_value", "shift_value"} & set(q.node("cache").params)
    if cache == "Input":
        assert float(plain.quant.get(plain.node("past").outputs[0]).scale) != float(k.scale)
    got, = run_quantized(q, batches[0])  # dequantized output
    if cache == "Constant":  # the empty cache is stored as the integer of 0 and dequantizes to 0
        assert torch.equal(got[:, :3], torch.zeros_like(got[:, :3]))
        assert int(q.node("past").params["weights_zp"]) == int(out.zerop)
        weights = q.node("past").get_constant("weights").betensor
        assert torch.equal(weights, torch.full_like(weights, -int(out.zerop)))
    else:  # a step's output, fed back as the next step's cache, comes out unchanged: one scale for the cache
        again, = run_quantized(q, [batches[1][0], got[:, 1:]])
        assert torch.equal(again[:, :3], got[:, 1:])


def test_calibration_shuffe_is_one_fixed_order(tmp_path: Path) -> None:
    def ir(name: str, extra: str) -> bytes:
        (tmp_path / name).mkdir()
        cfg = example_cfg(tmp_path / name, extra, metric=None, data=None, label=None, calibration_batch_size="4")
        assert main(["--cfg", str(cfg)]) == 0
        return (tmp_path / name / "out" / "digits_o.txt").read_bytes()

    plain = ir("plain", "")
    once, again = ir("once", "calibration_shuffe = true\n"), ir("again", "calibration_shuffe = true\n")
    assert once == again  # the same order in every run
    assert once != plain  # `mean` (the default) depends on the sample order
    ext = "calibration_strategy_for_activation = extrema\n"  # order-free statistics: the same IR
    assert ir("ext", ext) == ir("ext_shuffled", ext + "calibration_shuffe = true\n")


def test_collate_along_moves_the_sample_axis() -> None:
    from quantopt.data import collate_along

    samples = [[torch.full((4, 3), float(i)), torch.full((2,), float(i))] for i in range(5)]
    inputs, label = collate_along(1, 1, samples)
    assert inputs.shape == (4, 5, 3) and torch.equal(inputs[:, 2], torch.full((4, 3), 2.0))
    assert label.shape == (2, 5) and torch.equal(label[:, 4], torch.full((2,), 4.0))
    multi, _ = collate_along(1, 0, [[[torch.zeros(4, 3), torch.ones(4, 3)], 0] for _ in range(2)])
    assert [x.shape for x in multi] == [(4, 2, 3), (4, 2, 3)]


def _time_major_model(tmp_path: Path) -> Path:
    """x [T=4, N=1, F=3] -> tanh, written as a float IR."""
    from quantopt.ir.writer import write_ir

    g = GraphBuilder("tm")
    x = g.input("x", [4, 1, 3])
    y = g.layer("Activation", [x], [[4, 1, 3]], name="act", params=dict(method="TANH"))
    write_ir(g.build([y]), str(tmp_path / "tm.txt"), str(tmp_path / "tm.bin"))
    return tmp_path / "tm.txt"


def test_data_batch_dim_stacks_samples_on_that_axis(tmp_path: Path, capsys) -> None:
    txt = _time_major_model(tmp_path)
    data = np.random.default_rng(0).normal(0, 1, (6, 4, 3)).astype(np.float32)  # 6 samples of [T, F]
    np.save(tmp_path / "calib.npy", data)
    cfg = tmp_path / "opt.cfg"
    base = (f"[Common]\ngraph = {txt}\ndataset = NumpyDataset\ncalibration_data = {tmp_path / 'calib.npy'}\n"
            f"output_dir = {tmp_path / 'out'}\ncalibration_strategy_for_activation = extrema\n"
            "calibration_batch_size = 3\n")
    cfg.write_text(base + "data_batch_dim = 1\n")
    assert main(["--cfg", str(cfg)]) == 0
    assert "calibration_batch_size = 3 is used as 1" in capsys.readouterr().err
    template = json.loads((tmp_path / "out" / "tm_opt_template.json").read_text())
    info = template["x"]["just_for_display"]["quantization_info"]["x"]
    assert float(info["fmin"]) == pytest.approx(float(data.min())) and float(info["fmax"]) == \
        pytest.approx(float(data.max()))
    cfg.write_text(base)  # the default axis 0 reads the same file as samples of [4, 3]: refused, naming the axis
    assert main(["--cfg", str(cfg)]) == 4
    assert "samples have shape [4, 3] but the IR expects [1, 3]" in capsys.readouterr().err
