"""The operator plugin of docs/plugins.md ("4.1 Writing an operator", examples/plugin_op): loaded from ./plugin by a
`quantopt --cfg` run, it quantizes, computes the integers it documents, is checked by the IR reader, exports to
ONNX exactly, and is the text the docs show.

Registries are global: every test loads the plugin afresh inside `plugin_run_dir`, which puts back everything the
load changed (registrations, declarations, key schemas, operator types, the loaded-files record, the plugin module)
so that other tests, in any order, see the registries as they were.
"""
from __future__ import annotations

import contextlib
import importlib.util
import re
import shutil
import sys
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np
import pytest
import torch
from quant_helpers import params_of

import quantopt
from quantopt import registry
from quantopt.cli import main
from quantopt.graph.values import to_float
from quantopt.registry import known_keys
from quantopt.registry.optype import OpType

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "plugin_op"
PLUGIN = EXAMPLE / "plugin" / "aipubt_opt_op_hardclip.py"
OPTYPE = "HardClip"
CLIPS = ("clip1", "clip2")
QUANTIZED_IR = Path("opt_log") / "hardclip_demo_o.txt"
FILES = ("model.txt", "model.bin", "calib.npy", "opt.cfg")


# ------------------------------------------------------------------------------------------------ isolation
@contextlib.contextmanager
def registries_restored() -> Iterator[None]:
    """Put back, on exit, everything that loading a plugin changes in quantopt's global state."""
    tables = [(t, {k: dict(v) for k, v in t.all.items()}, dict(t.active))
              for t in (registry.OP_FORWARD, registry.OP_QUANTIZE, registry.OP_EXPORT, registry.DATASETS,
                        registry.METRICS, registry.QCONFIGS)]
    specs = dict(registry.OP_SPECS)
    schemas, builtin_schemas = dict(known_keys._SCHEMAS), set(known_keys._BUILTIN_SCHEMAS)
    declared = {k: set(v) for k, v in known_keys._DECLARED.items()}
    types: Dict[str, object] = object.__getattribute__(OpType, "_types")
    type_names = dict(types)
    loaded, loaded_paths = list(registry.LOADED), dict(registry._loaded_paths)
    modules, path = set(sys.modules), list(sys.path)
    try:
        yield
    finally:
        for table, all_versions, active in tables:
            table.all.clear()
            table.all.update(all_versions)
            table.active.clear()
            table.active.update(active)
        registry.OP_SPECS.clear()
        registry.OP_SPECS.update(specs)
        for store, saved in ((known_keys._SCHEMAS, schemas), (known_keys._DECLARED, declared)):
            store.clear()
            store.update(saved)
        known_keys._BUILTIN_SCHEMAS.clear()
        known_keys._BUILTIN_SCHEMAS.update(builtin_schemas)
        types.clear()
        types.update(type_names)
        registry.LOADED[:] = loaded
        registry._loaded_paths.clear()
        registry._loaded_paths.update(loaded_paths)
        for name in set(sys.modules) - modules:
            if name.startswith(registry.PLUGIN_PREFIX):  # the plugin module (quantopt's own modules stay loaded)
                del sys.modules[name]
        sys.path[:] = path


@contextlib.contextmanager
def plugin_run_dir(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """`folder` holding the example (model, data, cfg) and the plugin in ./plugin, as the cwd; plugin discovery
    runs again on the next `quantopt` command (the session's conftest has run it already, without ./plugin)."""
    for name in FILES:
        shutil.copy(EXAMPLE / name, folder / name)
    (folder / "plugin").mkdir()
    shutil.copy(PLUGIN, folder / "plugin" / PLUGIN.name)
    with registries_restored():
        monkeypatch.chdir(folder)
        monkeypatch.delenv("AIPUPLUGIN_PATH", raising=False)
        monkeypatch.setattr(registry, "_discovered", False)
        yield folder


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    with plugin_run_dir(tmp_path, monkeypatch) as folder:
        yield folder


@pytest.fixture
def quantized(work: Path) -> Path:
    """The example quantized by `quantopt --cfg opt.cfg` in `work`."""
    assert main(["--cfg", "opt.cfg"]) == 0
    return work / QUANTIZED_IR


def read(path: Path):
    from quantopt.ir.reader import read_ir

    return read_ir(str(path))


def samples(count: int = 48, seed: int = 7, spread: float = 1.5) -> torch.Tensor:
    """Seeded inputs, by default wider than the calibration data's, so that both layers clip and the input
    quantization saturates."""
    values = np.random.default_rng(seed).standard_normal((count, 16)) * spread
    return torch.from_numpy(values.astype(np.float32))


# ------------------------------------------------------------------------------------------------ reference
def round_half_even_shift(v: np.ndarray, shift: int) -> np.ndarray:
    """round_half_even(v / 2^shift) of int64 integers (a negative shift multiplies), in numpy integer arithmetic."""
    if shift <= 0:
        return v * (1 << -shift)
    q = v >> shift  # floor
    rem = v - (q << shift)
    half = 1 << (shift - 1)
    return q + ((rem > half) | ((rem == half) & (q % 2 == 1))).astype(np.int64)


def hardclip_reference(x_q: np.ndarray, zp_x: int, gain: float, mult: int, shift: int, zp_y: int,
                       lo: int, hi: int) -> np.ndarray:
    """docs/plugins.md: y_q = clamp(round_half_even(s·(x_q + zp_x)·M·2^-N) - zp_y, lo, hi), s = sign(gain)."""
    sign = -1 if gain < 0 else 1
    acc = sign * (x_q.astype(np.int64) + zp_x) * mult
    return np.clip(round_half_even_shift(acc, shift) - zp_y, lo, hi)


def check_layer(node) -> np.ndarray:
    """The layer's integer output against the reference on its actual integer input; returns the output."""
    x, y = node.inputs[0], node.outputs[0]
    qx, qy = params_of(node, x), params_of(node, y)
    lo = max(int(qy.qmin), int(node.params["limit_lo"]))
    hi = min(int(qy.qmax), int(node.params["limit_hi"]))
    want = hardclip_reference(x.betensor.numpy(), int(qx.zerop), float(node.params["gain"]),
                              int(node.params["scale_value"]), int(node.params["shift_value"]), int(qy.zerop), lo, hi)
    got = y.betensor.numpy()
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)
    return got


# ------------------------------------------------------------------------------------------------ tests
def test_public_api_reexports_the_builtin_helpers() -> None:
    from quantopt.ops import _quant, _shared, api
    from quantopt.quant import params, requant
    from quantopt.registry import schema

    assert len(api.__all__) == len(set(api.__all__))
    for name in api.__all__:
        value = getattr(api, name)
        source = next((m for m in (_quant, _shared, params, requant, schema, registry) if hasattr(m, name)), None)
        assert source is not None and getattr(source, name) is value, name  # re-exported, not copied
    for name in ("declare_op", "Param", "Int", "Float", "Bool", "Text", "Ints", "Floats", "Axis", "DtypeName",
                 "Either", "Value"):
        assert name in quantopt.__all__ and getattr(quantopt, name) is getattr(api, name)


def test_run_writes_the_quantized_layer(quantized: Path, capsys) -> None:
    text = quantized.read_text()
    for name, gain, limit in (("clip1", "1.5", "2.0"), ("clip2", "-0.75", "1.0")):
        section = text.split(f"layer_name={name}\n", 1)[1].split("\n\n", 1)[0]
        assert "layer_type=HardClip\n" in section
        assert f"gain={gain}\n" in section and f"limit={limit}\n" in section
        for key in ("scale_value", "shift_value", "limit_lo", "limit_hi"):
            assert re.search(rf"^{key}=-?\d+$", section, re.M), (key, section)
        assert "layer_top_type=[int8]" in section
    graph = read(quantized)
    for name in CLIPS:
        node = graph.node(name)
        assert node.quantized and str(node.type) == OPTYPE
        assert isinstance(node.params["limit_lo"], int) and isinstance(node.params["limit_hi"], int)
        assert int(node.params["scale_value"]) > 0
    capsys.readouterr()
    assert main(["--plugin"]) == 0  # the listing shows the plugin's operator with its file
    out = capsys.readouterr().out
    assert re.search(r"^  HardClip +forward 1\.0 \[\S*aipubt_opt_op_hardclip\.py\]  quantize 1\.0 "
                     r"\[\S*aipubt_opt_op_hardclip\.py\]$", out, re.M), out


def test_integer_forward_is_the_documented_formula(quantized: Path) -> None:
    graph = read(quantized)
    with torch.no_grad():
        graph.forward([samples()], keep_tensors=True)
    outputs = [check_layer(graph.node(name)) for name in CLIPS]
    for got, node in zip(outputs, (graph.node(n) for n in CLIPS)):
        y = params_of(node, node.outputs[0])
        assert got.min() == y.qmin or got.max() == y.qmax  # the data reaches the clamp
    # narrower stored bounds clamp (as when the output range is wider than ±limit): edit them in the IR
    text = re.sub(r"^limit_lo=-?\d+$", "limit_lo=-90", quantized.read_text(), flags=re.M)
    narrowed = quantized.with_name("narrowed.txt")
    narrowed.write_text(re.sub(r"^limit_hi=-?\d+$", "limit_hi=70", text, flags=re.M))
    shutil.copy(quantized.with_suffix(".bin"), narrowed.with_suffix(".bin"))
    graph = read(narrowed)
    with torch.no_grad():
        graph.forward([samples()], keep_tensors=True)
    for name in CLIPS:
        got = check_layer(graph.node(name))
        assert got.min() == -90 and got.max() == 70


def test_dequantized_output_follows_the_float_model(quantized: Path) -> None:
    x = samples(seed=11, spread=1.0)  # distributed as the calibration data
    float_graph = read(quantized.parents[1] / "model.txt")
    quant_graph = read(quantized)
    with torch.no_grad():
        want = float_graph.forward([x])[0].double().reshape(-1)
        quant_graph.forward([x])
    got = to_float(quant_graph.output_tensors[0]).double().reshape(-1)
    cosine = float(torch.dot(want, got) / (want.norm() * got.norm()))
    assert cosine > 0.995, cosine
    assert float((want - got).abs().mean()) < 0.02  # a few output steps (1/127.5) at most on average


def _bad_model(work: Path, old: str, new: str) -> int:
    """model.txt with the first `old` line of layer clip1 replaced; returns that line's number."""
    lines = (work / "model.txt").read_text().split("\n")
    start = lines.index("layer_name=clip1")
    number = lines.index(old, start)
    lines[number] = new
    (work / "bad.txt").write_text("\n".join(lines))
    (work / "bad.cfg").write_text((work / "opt.cfg").read_text().replace("model.txt", "bad.txt"))
    return number + 1


@pytest.mark.parametrize("old, new, phrase", [
    ("limit=2.0", "limit=two", "parameter 'limit': must be a finite number, got 'two'"),
    ("limit=2.0", "limit=[1,2]", "parameter 'limit': must be a finite number"),
    ("gain=1.5", "gain=true", "parameter 'gain': must be a finite number, got True"),
    ("gain=1.5", "gian=1.5", "unknown key 'gian' for a HardClip layer; did you mean 'gain'?"),
    ("limit=2.0", "limit_hi=3", "a HardClip layer needs parameter 'limit' (float, required)"),
], ids=["word", "list", "bool", "unknown_key", "missing"])
def test_ir_reader_checks_the_declared_keys(work: Path, capsys, old: str, new: str, phrase: str) -> None:
    number = _bad_model(work, old, new)
    if "needs parameter" in phrase:  # a missing key: the error names the layer's first line
        number = (work / "bad.txt").read_text().split("\n").index("layer_id=2") + 1
    assert main(["--cfg", "bad.cfg"]) == 3
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[ERROR]")]
    assert len(errors) == 1, errors
    assert f"bad.txt:{number}: layer 'clip1': {phrase}" in errors[0], errors[0]


def test_operator_check_is_an_ir_error_naming_the_layer(work: Path, capsys) -> None:
    _bad_model(work, "limit=2.0", "limit=-1.0")  # a finite number, so the reader accepts it; the operator refuses
    number = (work / "bad.txt").read_text().split("\n").index("layer_id=2") + 1
    assert main(["--cfg", "bad.cfg"]) == 3
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[ERROR]")]
    assert len(errors) == 1 and f"bad.txt:{number}" in errors[0] and "limit must be > 0, got -1.0" in errors[0]


@pytest.mark.parametrize("scales", ["exact", "effective", "ir"])
def test_onnx_export_computes_the_same_integers(quantized: Path, scales: str) -> None:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from quantopt.exporters.onnx_qdq import convert_graph
    from quantopt.ops.onnx_build.perms import inverse

    graph = read(quantized)
    model, qdq = convert_graph(graph, scales=scales)
    views = {}
    for node in graph.nodes:
        t = node.outputs[0]
        perm, value = next(iter(qdq.views[t.name].items()))
        views[t.name] = (value, perm, qdq.qparams(t).offset)
        if value not in {o.name for o in model.graph.output}:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(value))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = samples(seed=3)
    results = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"data": x.numpy()})))

    def ort_integers(name: str) -> np.ndarray:
        value, perm, offset = views[name]
        return results[value].astype(np.int64).transpose(inverse(perm)) - offset

    with torch.no_grad():
        graph.forward([x], keep_tensors=True)
    if scales == "exact":  # the whole model: every tensor's integers are quantopt's
        for name in views:
            np.testing.assert_array_equal(ort_integers(name), graph.node(name).outputs[0].betensor.numpy(), name)
    for name in CLIPS:  # each HardClip on onnxruntime's integers for its input, in every mode
        node = graph.node(name)
        node.inputs[0].betensor = torch.from_numpy(ort_integers(node.inputs[0].name))
        with torch.no_grad():
            node.forward()
        np.testing.assert_array_equal(ort_integers(name), node.outputs[0].betensor.numpy(), name)
    assert not qdq.float_layers


def test_docs_show_the_plugin_file_verbatim() -> None:
    code = PLUGIN.read_text()
    docs = (REPO / "docs" / "plugins.md").read_text()
    assert f"`plugin/{PLUGIN.name}`:\n\n```python\n{code}```\n" in docs
    assert "### 4.1 Writing an operator" in docs
    assert "### Operators of plugins" in (REPO / "docs" / "onnx-export.md").read_text()


def test_example_files_come_from_make_model(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("plugin_op_make_model", EXAMPLE / "make_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path)
    for name in ("model.txt", "model.bin", "calib.npy"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / name).read_bytes(), name


def test_the_plugin_leaves_nothing_registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the plugin registers it; leaving `plugin_run_dir` puts the registries back."""
    before: List[str] = sorted(registry.OP_FORWARD.keys())
    with plugin_run_dir(tmp_path, monkeypatch):
        registry.discover_plugins()
        assert OPTYPE in OpType and registry.OP_FORWARD.get(OPTYPE) is not None
        assert registry.OP_EXPORT.get(OPTYPE) is not None and known_keys.schema_of(OPTYPE) is not None
        assert "aipubt_opt_op_hardclip" in sys.modules
    assert OPTYPE not in OpType and OPTYPE not in registry.OP_SPECS
    assert registry.OP_FORWARD.get(OPTYPE) is None and registry.OP_QUANTIZE.get(OPTYPE) is None
    assert registry.OP_EXPORT.get(OPTYPE) is None and known_keys.known_keys(OPTYPE) is None
    assert "aipubt_opt_op_hardclip" not in sys.modules
    assert sorted(registry.OP_FORWARD.keys()) == before
