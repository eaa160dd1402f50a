"""The operator catalog: docs/operators.md is current, every operator is described and linked to its integer
semantics, the library is as large as promised, and an unknown layer type is one clear error."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from quantopt import ops  # noqa: F401  (registers the built-in operators)
from quantopt.cli import main
from quantopt.ops.catalog import builtin_optypes_with_both, operator_doc, render_operators_markdown
from quantopt.registry import OP_FORWARD, OP_QUANTIZE

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MIN_OPERATORS = 120


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", path.read_text(), re.M)}


def test_operators_md_is_current() -> None:
    expected = render_operators_markdown()
    actual = (DOCS / "operators.md").read_text()
    assert actual == expected, "docs/operators.md is stale: run `python -m quantopt.ops.catalog > docs/operators.md`"


def test_library_size() -> None:
    both = builtin_optypes_with_both()
    assert len(both) >= MIN_OPERATORS, f"only {len(both)} operator types have forward and quantize: {both}"


def test_every_operator_is_described_and_linked() -> None:
    names = sorted(set(OP_FORWARD.keys()) | set(OP_QUANTIZE.keys()))
    undocumented = [n for n in names if operator_doc(n) is None]
    assert not undocumented, f"operators without a declaration (declare_op): {undocumented}"
    broken = []
    for name in names:
        target = operator_doc(name).semantics
        file, _, anchor = target.partition("#")
        path = DOCS / file[len("docs/"):] if file.startswith("docs/") else DOCS / file
        if not path.is_file() or (anchor and anchor not in _anchors(path)):
            broken.append(f"{name}: {target}")
    assert not broken, f"integer-semantics links that do not resolve: {broken}"


def test_unknown_layer_type_is_one_clear_error(tmp_path: Path, capsys) -> None:
    txt = tmp_path / "m.txt"
    txt.write_text(
        "model_name=m\nlayer_number=2\ninput_tensors=[x]\noutput_tensors=[y]\n\n"
        "layer_id=0\nlayer_name=x\nlayer_type=Input\nlayer_bottom=[]\nlayer_bottom_shape=[]\nlayer_bottom_type=[]\n"
        "layer_top=[x]\nlayer_top_shape=[[1,4]]\nlayer_top_type=[float32]\n\n"
        "layer_id=1\nlayer_name=mystery\nlayer_type=FrobnicateV2\nlayer_bottom=[x]\nlayer_bottom_shape=[[1,4]]\n"
        "layer_bottom_type=[float32]\nlayer_top=[y]\nlayer_top_shape=[[1,4]]\nlayer_top_type=[float32]\n")
    (tmp_path / "m.bin").write_bytes(b"")
    np.save(tmp_path / "calib.npy", np.zeros((2, 4), np.float32))
    cfg = tmp_path / "opt.cfg"
    cfg.write_text(f"[Common]\ngraph = {txt}\nbin = {tmp_path / 'm.bin'}\nmodel_name = m\ndataset = NumpyDataset\n"
                   f"calibration_data = {tmp_path / 'calib.npy'}\noutput_dir = {tmp_path / 'out'}\n")
    assert main(["--cfg", str(cfg)]) == 6
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[ERROR]")]
    assert len(err) == 1
    assert "FrobnicateV2" in err[0] and "'mystery'" in err[0] and "docs/plugins.md" in err[0]
    written = sorted(p.name for p in (tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else []
    assert all(name.endswith(".log") for name in written), f"half-written outputs: {written}"


def test_parameter_links_resolve_and_every_declaration_has_a_section() -> None:
    text = (DOCS / "operators.md").read_text()
    anchors = _anchors(DOCS / "operators.md")
    links = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert links and links <= anchors, sorted(links - anchors)
    assert "### Transpose, Permute" in text and "| `perm` | int list |" in text
