"""Every user mistake in the catalogue (bad_input_cases.py) gets ONE error line naming the file and line (or the
cfg field, or the plugin file), its documented exit code, and leaves no output but the run log.

The commands run in-process through `quantopt.cli.main` (no interpreter start per case), on a copy of the digits
example with 8 calibration and 16 validation samples.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterator, List

import numpy as np
import pytest
from bad_input_cases import CASES, Case, Work, case_ids

from quantopt.cli import main
from quantopt.ir.reader import read_ir
from quantopt.registry import load_plugin_dir


class _Records(logging.Handler):
    """Keeps the messages of the `quantopt` logger at WARNING and above (the console handler's output)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self) -> List[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.ERROR]

    def warnings(self) -> List[str]:
        return [r.getMessage() for r in self.records if r.levelno == logging.WARNING]


@pytest.fixture(autouse=True)
def _restore_registries() -> Iterator[None]:
    """The plugins a case loads (and the layer types its IR registers) and the logging the CLI sets up are forgotten
    afterwards, so that later tests (docs/operators.md lists every registered operator; progress and log output
    tests read stderr) see only what they set up themselves."""
    from quantopt import registry
    from quantopt.registry.optype import OpType

    tables = (registry.OP_FORWARD, registry.OP_QUANTIZE, registry.DATASETS, registry.METRICS)
    saved = [({k: dict(v) for k, v in t.all.items()}, dict(t.active)) for t in tables]
    loaded, paths = list(registry.LOADED), dict(registry._loaded_paths)
    from quantopt import log

    types = object.__getattribute__(OpType, "_types")
    saved_types = dict(types)
    logger = logging.getLogger("quantopt")
    saved_log = (list(logger.handlers), logger.level, logger.propagate, log._console_handler, log._file_handler)
    try:
        yield
    finally:
        # the CLI attaches a console handler to the quantopt logger: later in-process tests must not inherit it
        logger.handlers[:] = saved_log[0]
        logger.setLevel(saved_log[1])
        logger.propagate = saved_log[2]
        log._console_handler, log._file_handler = saved_log[3], saved_log[4]
        for t, (all_, active) in zip(tables, saved):
            t.all.clear()
            t.all.update(all_)
            t.active.clear()
            t.active.update(active)
        registry.LOADED[:] = loaded
        registry._loaded_paths.clear()
        registry._loaded_paths.update(paths)
        types.clear()
        types.update(saved_types)


@pytest.fixture
def records() -> Iterator[_Records]:
    handler = _Records()
    logger = logging.getLogger("quantopt")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _argv(c: Case, w: Work) -> List[str]:
    if c.command == "run":
        return ["run", str(w.txt), "-i", str(w.inputs), "-o", str(w.run_out), *c.args]
    return ["--cfg", str(w.cfg), *c.args]


def test_catalogue_is_large_and_covers_every_kind():
    assert len(CASES) >= 150
    ids = case_ids()
    for prefix in ("txt_", "header_", "layer_", "key_", "value_", "bin_", "const_", "cfg_", "data_", "op_", "plugin_",
                   "run_"):
        assert any(i.startswith(prefix) for i in ids), prefix


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input(c: Case, tmp_path: Path, records: _Records) -> None:
    w = Work.create(tmp_path)
    where = c.apply(w)
    if w.plugins.is_dir():
        load_plugin_dir(str(w.plugins))
    code = main(_argv(c, w))
    errors = records.errors()
    assert code == c.code, f"exit code {code}, expected {c.code}: {errors}"
    assert len(errors) == 1, errors
    message = errors[0]
    assert "\n" not in message, message
    assert "internal error" not in message
    assert message.count("plugin error") <= 1, message  # one prefix, however deep the plugin call
    assert where in message, f"{where!r} not in {message!r}"
    if c.match:
        assert re.search(c.match, message), f"{c.match!r} does not match {message!r}"
    # nothing written but the log, which holds the error: no half-written (or complete) outputs of a failed run
    if w.out_dir.exists():
        assert {p.name for p in w.out_dir.iterdir()} <= {"digits_opt.log"}
        log = w.out_dir / "digits_opt.log"
        assert not log.exists() or f"[ERROR] {message}" in log.read_text(), "the log misses the error"
    assert not w.run_out.exists() or not any(w.run_out.iterdir())


# ------------------------------------------------------------------ the opt-out, and what stays accepted
def test_allow_unknown_ir_keys_flag_of_run(tmp_path: Path, records: _Records) -> None:
    w = Work.create(tmp_path)
    w.rename("/conv1/Conv", "with_activation", "with_activaton")
    argv = ["run", str(w.txt), "-i", str(w.inputs), "-o", str(w.run_out), "--allow-unknown-ir-keys"]
    assert main(argv) == 0, records.errors()
    assert any("'with_activaton' is unknown to Convolution layers" in m for m in records.warnings())
    assert (w.run_out / "outputs.json").is_file()


def test_allow_unknown_ir_keys_cfg_field_reaches_the_reader(tmp_path: Path) -> None:
    from quantopt.config.reader import read_cfg

    w = Work.create(tmp_path)
    w.add("/Softmax", "future_key", "1")
    w.cfg_set("allow_unknown_ir_keys", "true")
    cfg = read_cfg(str(w.cfg))
    assert cfg.allow_unknown_ir_keys is True
    graph = read_ir(cfg.graph, cfg.bin, allow_unknown_keys=cfg.allow_unknown_ir_keys)
    assert graph.node("/Softmax").params["future_key"] == 1


def test_packed_misaligned_constant_is_accepted(tmp_path: Path) -> None:
    """Upstream packs constants without padding: an int32 right after 3 int8 bytes is fine."""
    w = Work.create(tmp_path)
    data = w.bin.read_bytes()
    end = len(data)
    w.bin.write_bytes(data + b"\x01\x02\x03" + np.array([7, -7], dtype="<i4").tobytes())
    lines = w.lines()
    stop = w.section("/Softmax").stop
    lines[stop:stop] = ["lut_type=[int8,int32]", f"lut_offset=[{end},{end + 3}]", "lut_size=[3,8]",
                        "lut_shape=[[3],[2]]"]
    w.write_lines(lines)
    g = read_ir(str(w.txt))
    assert g.node("/Softmax").constants["lut_1"].betensor.tolist() == [7, -7]
