"""QConfig plugins (cfg field `qconfig`): the example plugin of docs/plugins.md programs per-layer settings of the
digits example; a plugin returning something else, naming an unknown layer, key or value, or raising, stops the run
with one line naming the plugin's file; an unknown plugin name is found before any model work."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import pytest
from test_cli import example_cfg
from test_plugin_op import registries_restored
from test_upstream_fields import _layers

from quantopt import registry
from quantopt.cli import main

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "qconfig" / "aipubt_opt_qconfig_wide_ends.py"


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "plugins"
    folder.mkdir()
    with registries_restored():
        monkeypatch.setenv("AIPUPLUGIN_PATH", str(folder))
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(registry, "_discovered", False)
        yield folder


def test_example_plugin_sets_the_layers_it_names(plugin_dir: Path, tmp_path: Path) -> None:
    shutil.copy(EXAMPLE, plugin_dir / EXAMPLE.name)
    cfg = example_cfg(tmp_path, "qconfig = WideEnds\n", metric=None, data=None, label=None)
    assert main(["--cfg", str(cfg)]) == 0
    layers = _layers(tmp_path / "out" / "digits_o.txt")
    types = {name: keys["layer_type"] for name, keys in layers.items()}
    convs = [n for n, t in types.items() if t == "Convolution"]
    fc = [n for n, t in types.items() if t == "FullyConnected"][-1]
    assert layers[convs[0]]["layer_top_type"] in ("[int16]", "[uint16]") and layers[fc]["layer_top_type"] == "[int16]"
    assert all(layers[c]["layer_top_type"] in ("[int8]", "[uint8]") for c in convs[1:])
    template = json.loads((tmp_path / "out" / "digits_opt_template.json").read_text())
    assert template[fc]["q_bits_bias"] == 48 and template[convs[1]]["q_bits_activation"] == 8


@pytest.mark.parametrize("body, expected", [
    ("return [1, 2]", "configure returned list, not a mapping"),
    ("return {'nope': {'q_bits_activation': 16}}", "names layer 'nope' that the model does not have"),
    ("return {graph.nodes[2].name: {'q_bits_activaton': 16}}", "unknown key 'q_bits_activaton'"),
    ("return {graph.nodes[2].name: {'q_bits_activation': 7}}", "invalid value 7 for 'q_bits_activation'"),
    ("raise KeyError('boom')", "KeyError"),
])
def test_broken_plugin_is_one_line_naming_its_file(plugin_dir: Path, tmp_path: Path, capsys, body: str,
                                                   expected: str) -> None:
    plugin = plugin_dir / "aipubt_opt_qconfig_bad.py"
    plugin.write_text("from quantopt import OptBaseQConfig, PluginType, register_plugin\n\n\n"
                      "@register_plugin(PluginType.QConfig)\nclass Bad(OptBaseQConfig):\n"
                      f"    def configure(self, graph):\n        {body}\n")
    cfg = example_cfg(tmp_path, "qconfig = Bad\n", metric=None, data=None, label=None)
    code = main(["--cfg", str(cfg)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 5 and expected in err and str(plugin) in err
    assert not (tmp_path / "out" / "digits_o.txt").exists()


def test_unknown_plugin_is_found_before_model_work(plugin_dir: Path, tmp_path: Path, capsys) -> None:
    cfg = example_cfg(tmp_path, "qconfig = Missing\n", metric=None, data=None, label=None)
    assert main(["--cfg", str(cfg)]) != 0
    out = capsys.readouterr().err
    assert "no qconfig plugin named 'Missing'" in out and "statistics" not in out.split("no qconfig")[0]


def test_a_non_qconfig_class_is_refused(plugin_dir: Path) -> None:
    with pytest.raises(registry.PluginError, match="must subclass OptBaseQConfig"):
        registry.register_plugin(registry.PluginType.QConfig)(type("NotOne", (), {}))


def test_a_refused_value_names_the_plugin_that_set_it(plugin_dir: Path, tmp_path: Path, capsys) -> None:
    """A valid value a layer cannot take (per-block weights on an integer Convolution) names the plugin's file and
    the key, not the cfg field quantize_method_for_weight."""
    plugin = plugin_dir / "aipubt_opt_qconfig_blocks.py"
    plugin.write_text("from quantopt import OptBaseQConfig, PluginType, register_plugin\n\n\n"
                      "@register_plugin(PluginType.QConfig)\nclass Blocks(OptBaseQConfig):\n"
                      "    def configure(self, graph):\n"
                      "        conv = next(n for n in graph.nodes if str(n.type) == 'Convolution')\n"
                      "        return {conv.name: {'q_mode_weight': 'per_block_symmetric_restricted_range'}}\n")
    cfg = example_cfg(tmp_path, "qconfig = Blocks\n", metric=None, data=None, label=None)
    code = main(["--cfg", str(cfg)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 6 and f"{plugin}: 'q_mode_weight' (per-layer value): layer '" in err and "per-block" in err, err
    assert not (tmp_path / "out" / "digits_o.txt").exists()
