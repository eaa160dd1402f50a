"""`min_compatible_zhouyi_target`: upstream's per-target defaults for the fields a cfg leaves unset, the targets
quantopt does not simulate refused when the cfg is read, and the LogSoftmax form of older targets refused."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from test_cli import example_cfg

from quantopt.cli import main
from quantopt.config.reader import read_cfg
from quantopt.graph.builder import GraphBuilder
from quantopt.ir.writer import write_ir


def _cfg(tmp_path: Path, extra: str) -> Path:
    (tmp_path / "m.txt").write_text("")
    path = tmp_path / "t.cfg"
    path.write_text("[Common]\ngraph = m.txt\ncalibrate_with_zero_inputs = true\n" + extra)
    return path


def test_x2_is_the_default_with_its_defaults(tmp_path: Path) -> None:
    cfg = read_cfg(str(_cfg(tmp_path, "")))
    assert cfg.min_compatible_zhouyi_target == "X2" and cfg.bias_effective_bits.global_value == 32
    assert str(cfg.trigger_float_op) == "disable & <[RMSNorm]:float16_preferred!>"
    assert set(cfg.target_fields) == {"bias_effective_bits", "trigger_float_op"}


def test_older_targets_keep_16_bias_bits_and_a_cfg_value_wins(tmp_path: Path) -> None:
    cfg = read_cfg(str(_cfg(tmp_path, "min_compatible_zhouyi_target = x1_1204\n")))
    assert cfg.min_compatible_zhouyi_target == "X1" and cfg.bias_effective_bits.global_value == 16
    assert str(cfg.trigger_float_op) == "disable"
    cfg = read_cfg(str(_cfg(tmp_path, "min_compatible_zhouyi_target = Z2\nbias_effective_bits = 24\n")))
    assert cfg.bias_effective_bits.global_value == 24 and "bias_effective_bits" not in cfg.target_fields


def test_unsimulated_and_unknown_targets_are_refused_naming_the_line(tmp_path: Path, capsys) -> None:
    for value, words in (("X3P", "does not simulate yet"), ("X9", "unknown target 'X9'")):
        cfg = example_cfg(tmp_path, f"min_compatible_zhouyi_target = {value}\n", metric=None, data=None, label=None)
        assert main(["--cfg", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert words in err and "min_compatible_zhouyi_target" in err and "opt.cfg:" in err


def _biases(txt: Path) -> dict:
    """Each FullyConnected/Convolution layer's quantized biases from the IR and its .bin."""
    from quantopt.ir.reader import read_ir

    graph = read_ir(str(txt))
    return {n.name: n.constants["biases"].betensor.to(dtype=__import__("torch").int64)
            for n in graph.nodes if "biases" in n.constants}


def test_x1_keeps_16_significant_bias_bits(tmp_path: Path) -> None:
    (tmp_path / "x1").mkdir()
    (tmp_path / "x2").mkdir()
    wide = "activation_bits = 16\n"  # 16-bit activations: biases beyond 16 bits
    x1 = example_cfg(tmp_path / "x1", wide + "min_compatible_zhouyi_target = X1\n", metric=None, data=None,
                     label=None)
    x2 = example_cfg(tmp_path / "x2", wide, metric=None, data=None, label=None)
    assert main(["--cfg", str(x1)]) == 0 and main(["--cfg", str(x2)]) == 0
    old, new = _biases(tmp_path / "x1" / "out" / "digits_o.txt"), _biases(tmp_path / "x2" / "out" / "digits_o.txt")
    changed = 0
    for name, b in old.items():
        top = int(b.abs().max())
        if top >= 2 ** 15:  # values beyond 16 bits keep only their top 16 bits: their low bits are cleared
            low = top.bit_length() - 16
            assert bool(((b % (2 ** low)) == 0).all()), name
            changed += int(not bool((b == new[name]).all()))
    assert changed >= 1


def test_x2_runs_rmsnorm_in_float16(tmp_path: Path) -> None:
    r = np.random.default_rng(0)
    g = GraphBuilder("rms")
    x = g.input("x", [1, 4, 16])
    y = g.layer("RMSNorm", [x], [[1, 4, 16]], name="rms", params=dict(axis=[-1], epsilon=1e-5),
                constants={"weights": r.normal(1, 0.1, 16).astype(np.float32)})
    z = g.layer("Activation", [y], [[1, 4, 16]], name="act", params=dict(method="TANH"))
    write_ir(g.build([z]), str(tmp_path / "rms.txt"), str(tmp_path / "rms.bin"))
    np.save(tmp_path / "calib.npy", r.normal(0, 1, (4, 4, 16)).astype(np.float32))
    for target, float_rms in (("X2", True), ("X1", False)):
        cfg = tmp_path / f"{target}.cfg"
        cfg.write_text(f"[Common]\ngraph = {tmp_path / 'rms.txt'}\ndataset = NumpyDataset\n"
                       f"calibration_data = {tmp_path / 'calib.npy'}\noutput_dir = {tmp_path / target}\n"
                       f"min_compatible_zhouyi_target = {target}\n")
        assert main(["--cfg", str(cfg)]) == 0
        text = (tmp_path / target / "rms_o.txt").read_text()
        block = text.split("layer_name=rms\n")[1].split("\n\n")[0]
        assert ("layer_top_type=[float16]" in block) == float_rms, block


def test_logsoftmax_is_refused_for_older_targets(tmp_path: Path, capsys) -> None:
    g = GraphBuilder("ls")
    x = g.input("x", [1, 8])
    y = g.layer("LogSoftmax", [x], [[1, 8]], name="ls", params=dict(axis=-1))
    write_ir(g.build([y]), str(tmp_path / "ls.txt"), str(tmp_path / "ls.bin"))
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).normal(0, 1, (2, 8)).astype(np.float32))
    cfg = tmp_path / "ls.cfg"
    cfg.write_text(f"[Common]\ngraph = {tmp_path / 'ls.txt'}\ndataset = NumpyDataset\n"
                   f"calibration_data = {tmp_path / 'calib.npy'}\noutput_dir = {tmp_path / 'out'}\n"
                   "min_compatible_zhouyi_target = X1\n")
    assert main(["--cfg", str(cfg)]) == 6
    assert "another LogSoftmax integer form" in capsys.readouterr().err
