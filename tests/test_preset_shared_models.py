"""The scoring pieces of benchmarks/preset_shared_models.py: the rendered-line scores (direction agreement with
float, per-line cosines) against a plain numpy reference, and that the rendered ppocr_cls inputs are deterministic
for a seed, of the classifier's shape and range, with every other line turned 180 degrees (needs Pillow and a
DejaVu font: skipped, with the reason, when either is missing)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load():
    name = "preset_shared_models_bench"
    if name not in sys.modules:
        if str(_BENCH) not in sys.path:
            sys.path.insert(0, str(_BENCH))
        spec = importlib.util.spec_from_file_location(name, _BENCH / "preset_shared_models.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


bench = _load()


def test_rendered_scores_match_a_numpy_reference():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(40, 2))
    want = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    got = np.clip(want + rng.normal(0, 0.05, want.shape), 0, 1)
    got[5] = want[5, ::-1]  # one line whose decision flips, unless it was a tie
    r = bench.rendered_scores(torch.from_numpy(want).float(), torch.from_numpy(got).float())
    w, g = want.astype(np.float32).astype(np.float64), got.astype(np.float32).astype(np.float64)
    cos = (w * g).sum(1) / np.linalg.norm(w, axis=1) / np.linalg.norm(g, axis=1)
    assert r["agree"] == pytest.approx(np.mean(w.argmax(1) == g.argmax(1)))
    assert r["agree"] < 1.0
    assert r["mean"] == pytest.approx(cos.mean(), abs=1e-9)
    assert r["min"] == pytest.approx(cos.min(), abs=1e-9)


def test_rendered_cls_inputs_are_seeded_and_turn_every_other_line():
    pytest.importorskip("PIL", reason="rendering needs Pillow")
    text = sys.modules.get("text") or pytest.importorskip("text")
    if not text.find_fonts():
        pytest.skip("no DejaVu font (apt-get install fonts-dejavu-core)")
    a = bench.rendered_cls_inputs(4, seed=1)
    assert a.shape == (4, 3, 48, bench.CLS_WIDTH) and a.dtype == torch.float32
    assert float(a.min()) >= -1.0 and float(a.max()) <= 1.0
    assert torch.equal(a, bench.rendered_cls_inputs(4, seed=1))
    assert not torch.equal(a, bench.rendered_cls_inputs(4, seed=2))
    # line 1 is the crop of its seed turned upside down before the preprocessing
    fonts = text.find_fonts()
    lines = text.text_lines(max_chars=12)
    k = int(np.random.default_rng(1).permutation(len(lines))[1])
    gray = text.render_line(lines[k], 1 * 100_003 + 70_000 + 1, fonts)
    assert np.array_equal(a[1:2].numpy(), text.rec_input(np.ascontiguousarray(gray[::-1, ::-1]), bench.CLS_WIDTH))
    assert not np.array_equal(a[1:2].numpy(), text.rec_input(gray, bench.CLS_WIDTH))
