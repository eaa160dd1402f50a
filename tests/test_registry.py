"""Version rules of the registries and plugin discovery (including a broken plugin file)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from quantopt import OptBaseMetric, PluginType, op_register, register_optype, register_plugin
from quantopt.errors import PluginError
from quantopt.registry import (
    DATASETS,
    METRICS,
    OP_FORWARD,
    Version,
    VersionedRegistry,
    builtin_plugin_dir,
    forward_function,
    get_plugin,
    load_plugin_dir,
)


def test_versions_compare_as_versions():
    assert Version.parse("1.10") > Version.parse("1.9")
    assert Version.parse("2") > Version.parse("1.99.99")
    assert Version.parse("1.0") == Version.parse("1") == Version.parse(1.0)
    assert Version.parse("1.2.3") < Version.parse("1.2.10")
    for bad in ("", "a", "1.x", "-1"):
        with pytest.raises(PluginError):
            Version.parse(bad)


def test_highest_version_wins_and_ties_keep_first():
    reg = VersionedRegistry("thing")
    assert reg.register("k", "a", "1.9", "/x/a.py")
    assert reg.register("k", "b", "1.10", "/x/b.py")
    assert reg.get("k").obj == "b"
    assert not reg.register("k", "c", "1.2", "/x/c.py")  # lower: registered, not active
    assert reg.get("k").obj == "b"
    assert not reg.register("k", "d", "1.10.0", "/x/d.py")  # same version: first stays
    assert reg.get("k").obj == "b"
    assert set(reg.all["k"]) == {Version.parse("1.9"), Version.parse("1.10"), Version.parse("1.2")}


def test_op_register_requires_known_optype():
    with pytest.raises(PluginError, match="register_optype"):
        op_register("NoSuchOpTypeXYZ")(lambda node: None)


def test_register_new_optype_and_forward():
    t = register_optype("TestOnlyDoubler")

    @op_register(t, "1.0")
    def doubler(node):
        node.outputs[0].betensor = node.inputs[0].betensor * 2

    # registered outside quantopt: handed out guarded (its exceptions become PluginErrors), wrapping `doubler`
    assert forward_function("TestOnlyDoubler").__wrapped__ is doubler


def test_plugin_type_checks():
    with pytest.raises(PluginError, match="OptBaseMetric"):
        register_plugin(PluginType.Metric)(type("NotAMetric", (), {}))
    with pytest.raises(PluginError, match="torch.utils.data.Dataset"):
        register_plugin(PluginType.Dataset)(type("NotADataset", (), {}))
    with pytest.raises(PluginError):
        register_plugin("Metric")


def test_get_plugin_is_case_insensitive_and_lists_known():
    assert get_plugin(PluginType.Dataset, "NUMPYDATASET").__name__ == "NumpyDataset"
    with pytest.raises(PluginError, match="registered: .*NumpyDataset"):
        get_plugin(PluginType.Dataset, "nope")


def test_builtin_plugins_are_loaded_from_package_folder():
    folder = builtin_plugin_dir()
    assert os.path.isfile(os.path.join(folder, "aipubt_opt_dataset_numpy.py"))
    assert DATASETS.get("numpydataset").builtin
    assert METRICS.get("topkmetric").builtin


def _write(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / name
    p.write_text(textwrap.dedent(body))
    return p


def test_discovery_loads_good_files_and_warns_on_broken_one(tmp_path, caplog):
    folder = tmp_path / "plugs"
    _write(folder, "aipubt_test_broken.py", "import not_a_module_anywhere_xyz\n")
    _write(folder, "aipubt_test_good_metric.py", """
        from quantopt import OptBaseMetric, PluginType, register_plugin

        @register_plugin(PluginType.Metric, "1.0")
        class TestOnlyGoodMetric(OptBaseMetric):
            def __call__(self, pred, target): pass
            def reset(self): pass
            def compute(self): return 1.0
    """)
    _write(folder, "not_a_plugin.py", "raise RuntimeError('must not be imported')\n")
    import logging

    logger = logging.getLogger("quantopt")
    logger.addHandler(caplog.handler)
    try:
        results = load_plugin_dir(str(folder))
    finally:
        logger.removeHandler(caplog.handler)
    by_name = {Path(r.path).name: r for r in results}
    assert set(by_name) == {"aipubt_test_broken.py", "aipubt_test_good_metric.py"}
    assert not by_name["aipubt_test_broken.py"].ok
    assert "ModuleNotFoundError" in by_name["aipubt_test_broken.py"].error
    assert by_name["aipubt_test_good_metric.py"].ok
    assert METRICS.get("testonlygoodmetric") is not None
    assert any("aipubt_test_broken.py:1" in rec.getMessage() and "failed to import" in rec.getMessage()
               for rec in caplog.records)


def test_plugin_overrides_builtin_only_with_higher_version(tmp_path):
    folder = tmp_path / "override"
    _write(folder, "aipubt_test_override_same.py", """
        from quantopt import OpType, op_register

        @op_register(OpType.Transpose, "1.0")
        def same_version(node):
            raise AssertionError("a same-version plugin must not replace the built-in")
    """)
    _write(folder, "aipubt_test_override_higher.py", """
        from quantopt import OpType, op_register

        @op_register(OpType.Reshape, "1.10")
        def higher_version(node):
            node.outputs[0].betensor = node.inputs[0].betensor.reshape(-1) * 0
    """)
    before = OP_FORWARD.get("Reshape")
    try:
        load_plugin_dir(str(folder))
        assert OP_FORWARD.get("Transpose").builtin
        assert OP_FORWARD.get("Reshape").obj.__name__ == "higher_version"
        assert not OP_FORWARD.get("Reshape").builtin
    finally:
        OP_FORWARD.active["Reshape"] = before


def test_metric_base_protocol():
    class M(OptBaseMetric):
        def __init__(self, *args):
            super().__init__(*args)
            self.n = 0

        def __call__(self, pred, target):
            self.n += len(target)

        def reset(self):
            self.n = 0

        def compute(self):
            return float(self.n)

    m = M("a")
    m([torch.zeros(2)], torch.zeros(2))
    assert m.args == ("a",) and m.compute() == 2.0 and "2.0" in m.report()


def test_aipupluginpath_and_cwd_plugin_folder_in_subprocess(tmp_path):
    """End to end through the CLI: folders on AIPUPLUGIN_PATH in order, then ./plugin; from any cwd."""
    first = tmp_path / "first"
    second = tmp_path / "second"
    work = tmp_path / "work"
    metric = """
        from quantopt import OptBaseMetric, PluginType, register_plugin

        @register_plugin(PluginType.Metric, "{version}")
        class {name}(OptBaseMetric):
            def __call__(self, pred, target): pass
            def reset(self): pass
            def compute(self): return 0.0
    """
    _write(first, "aipubt_first.py", metric.format(version="1.0", name="PathOneMetric"))
    _write(second, "aipubt_second.py", metric.format(version="1.0", name="PathTwoMetric"))
    _write(work / "plugin", "aipubt_local.py", metric.format(version="3.1", name="LocalFolderMetric"))
    env = dict(os.environ, AIPUPLUGIN_PATH=os.pathsep.join([str(first), str(second)]))
    out = subprocess.run([sys.executable, "-m", "quantopt.cli", "--plugin"], cwd=work, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("PathOneMetric", "PathTwoMetric", "LocalFolderMetric", "NumpyDataset", "TopKMetric"):
        assert name in out.stdout
    assert "version 3.1" in out.stdout


def test_incomplete_metric_plugin_is_a_plugin_error(tmp_path):
    from quantopt.config.reader import read_cfg
    from quantopt.data import make_metrics

    @register_plugin(PluginType.Metric, "1.0")
    class TestOnlyIncompleteMetric(OptBaseMetric):
        def __call__(self, pred, target):
            pass

    (tmp_path / "m.txt").write_text("model_name=m\n\nlayer_id=0\nlayer_name=x\nlayer_type=Input\nlayer_bottom=[]\n"
                                    "layer_top=[x]\nlayer_top_shape=[[1]]\nlayer_top_type=[float32]\n")
    (tmp_path / "d.npy").write_bytes(b"")
    cfg_path = tmp_path / "c.cfg"
    cfg_path.write_text("[Common]\ngraph = m.txt\ndataset = NumpyDataset\ndata = d.npy\n"
                        "metric = TestOnlyIncompleteMetric\n")
    with pytest.raises(PluginError, match="could not be constructed: TypeError"):
        make_metrics(read_cfg(str(cfg_path)))
