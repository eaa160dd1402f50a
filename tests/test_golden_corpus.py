"""Upstream conformance on the committed golden corpus (tests/data/golden_corpus: small transformer, recurrent, OCR,
detection and U-Net models plus one-operator graphs, with upstream's quantized IRs for the cfg variants A/B/C, made
by benchmarks/make_golden_corpus.py). Unlike tests/test_golden_conformance.py it needs nothing outside the repository
and never skips.

quantopt does not reproduce every layer of these goldens yet, so each model and variant has a regression floor in
`floors.json`: at least that many identical layers, and exactly the listed layers differing. An improvement fails
the test too, on purpose: raise the floors with `python benchmarks/golden_corpus_report.py --write-floors`. A
variant quantopt cannot run yet (an operator it lacks) is recorded with its error, and one upstream failed on with
upstream's error (the corpus then holds no golden for it).
docs/golden-differences.md explains the differences."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from golden_helpers import (
    FAILED_NOTE,
    QuantoptFailed,
    compare_with_golden,
    layer_kinds,
    machine_layers,
    run_golden_cfg,
    upstream_failure,
)

CORPUS = Path(__file__).resolve().parent / "data" / "golden_corpus"
FLOORS: Dict[str, Dict[str, Any]] = json.loads((CORPUS / "floors.json").read_text())["models"]
CASES: List[Tuple[str, str]] = [(model, letter) for model in sorted(FLOORS) for letter in sorted(FLOORS[model])]


def test_corpus_complete() -> None:
    """Every corpus folder has floors for all three variants, and a golden IR or upstream's failure note for each,
    so a model cannot drop out of the test unnoticed."""
    folders = sorted(p.name for p in CORPUS.iterdir() if p.is_dir())
    assert folders == sorted(FLOORS), f"corpus folders {folders} != floors.json models {sorted(FLOORS)}"
    for model, variants in FLOORS.items():
        assert sorted(variants) == ["A", "B", "C"], model
        for letter in variants:
            folder = CORPUS / model / "golden" / letter
            assert (folder / "opt.cfg").is_file(), folder
            assert (folder / f"{model}_o.txt").is_file() != (folder / FAILED_NOTE).is_file(), folder


def test_machine_record_names_golden_layers() -> None:
    """Every layer machine_differences.json excuses on some kind of CPU is a layer of that case's golden, with known
    kinds of difference: the record cannot excuse what does not exist."""
    from golden_helpers import KINDS, MACHINE_DIFFERENCES

    known_kinds = {kind for _, kind in KINDS} | {"range", "output type"}
    machines = json.loads((CORPUS / MACHINE_DIFFERENCES).read_text())["machines"]
    assert machines
    for record in machines.values():
        assert record["cases"]
        for case, layers in record["cases"].items():
            model, letter = case.split("/")
            golden = (CORPUS / model / "golden" / letter / f"{model}_o.txt").read_text()
            for name, kinds in layers.items():
                assert f"layer_name={name}\n" in golden, (case, name)
                assert kinds and set(kinds) <= known_kinds, (case, name, kinds)


@pytest.mark.parametrize(("model", "letter"), CASES, ids=[f"{m}-{v}" for m, v in CASES])
def test_corpus_layers(model: str, letter: str, tmp_path: Path) -> None:
    """quantopt on one corpus model and variant: no worse than the floor, and the differing layers exactly those
    recorded. Where quantopt cannot run the cfg yet, it must still fail the recorded way; where upstream failed
    (no golden), quantopt must run the cfg."""
    floor = FLOORS[model][letter]
    folder = CORPUS / model / "golden" / letter
    try:
        ours = run_golden_cfg(folder, model, tmp_path / "out", quiet=True)
    except QuantoptFailed as e:
        expected = floor.get("quantopt_failed")
        assert expected is not None, f"{model}/{letter}: {e}"
        assert (e.code, e.error) == (expected["exit"], expected["error"]), f"{model}/{letter} fails otherwise: {e}"
        return
    assert "quantopt_failed" not in floor, (f"{model}/{letter} now runs; record its figures with "
                                            f"`python benchmarks/golden_corpus_report.py --write-floors`")
    if "upstream_failed" in floor:
        assert floor["upstream_failed"] == upstream_failure(folder)
        assert ours.is_file()
        return
    result = compare_with_golden(ours, folder / f"{model}_o.txt")
    differing = {name: layer_kinds(d) for name, d in result.differing.items()}
    summary = f"{model}/{letter}: {result.identical} of {len(result.diffs)} layers identical; differing: {differing}"
    print(summary)
    assert len(result.diffs) == floor["layers"], summary
    # layers upstream itself writes otherwise on this kind of CPU: they must differ as upstream's do, or not at all
    machine = {name: kinds for name, kinds in machine_layers(CORPUS, model, letter).items()
               if name not in floor["differing"]}
    moved = {name: differing.pop(name) for name in list(differing) if name in machine}
    assert all(kinds == machine[name] for name, kinds in moved.items()), (
        f"layers differ otherwise than upstream's on this machine ({machine}); {summary}")
    assert result.identical + len(moved) >= floor["identical"], (
        f"regression below the floor {floor['identical']}; {summary}")
    fixed = sorted(set(floor["differing"]) - set(differing))
    broken = {name: differing[name] for name in sorted(set(differing) - set(floor["differing"]))}
    assert not broken, f"layers that now differ from the golden: {broken}; {summary}"
    assert not fixed, (f"layers now identical to the golden: {fixed}; raise the floors with "
                       f"`python benchmarks/golden_corpus_report.py --write-floors`")
    assert sorted(result.extra) == floor["extra"], f"layers only quantopt writes changed: {sorted(result.extra)}"
