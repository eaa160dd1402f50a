"""The pure pieces of benchmarks/accuracy/ (no model package needed): CER, the CTC greedy decoder, the recognizer's
label list, line wrapping, and that a rendered text line is deterministic for a seed (needs Pillow and a DejaVu
font: skipped, with the reason, when either is missing)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

_TEXT = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy" / "text.py"


def _load_text():
    name = "accuracy_benchmark_text"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _TEXT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


text = _load_text()


def test_edit_distance_and_cer():
    assert text.edit_distance("", "") == 0
    assert text.edit_distance("kitten", "sitting") == 3
    assert text.edit_distance("abc", "") == 3 and text.edit_distance("", "abc") == 3
    assert text.edit_distance("flaw", "lawn") == 2
    assert text.cer(["abc", "hello"], ["abc", "hello"]) == 0.0
    # corpus level: (1 substitution + 2 deletions) over 3 + 5 reference characters
    assert text.cer(["abd", "hel"], ["abc", "hello"]) == pytest.approx(3 / 8)
    with pytest.raises(ValueError):
        text.cer(["a"], ["a", "b"])
    with pytest.raises(ValueError):
        text.cer([""], [""])


def test_ctc_greedy_decode_merges_repeats_and_drops_blanks():
    labels = ["<blank>", "a", "b", " "]
    steps = [1, 1, 0, 1, 2, 2, 3, 0, 0, 2]
    probs = np.eye(4, dtype=np.float32)[steps] * 0.9 + 0.025
    assert text.ctc_greedy_decode(probs, labels) == "aab b"
    assert text.ctc_greedy_decode(np.eye(4)[[0, 0, 0]], labels) == ""
    assert text.ctc_greedy_decode(probs[None], labels) == "aab b"  # a [1, T, C] output works too


def test_character_list_follows_paddleocr():
    assert text.character_list("x\ny\nz", 5) == ["<blank>", "x", "y", "z", " "]
    assert text.character_list("x\ny\nz", 4) == ["<blank>", "x", "y", "z"]
    with pytest.raises(ValueError):
        text.character_list("x\ny", 9)


def test_text_lines_wrap_within_the_limit_and_keep_every_word():
    sentences = ["one two three four five six seven", "a verylongwordthatexceedsthelimit b"]
    lines = text.text_lines(10, sentences)
    assert all(len(line) <= 10 or " " not in line for line in lines)
    assert " ".join(lines).split() == " ".join(sentences).split()
    assert len(text.SENTENCES) == len(set(text.SENTENCES)) >= 50
    assert len(text.text_lines()) >= 150  # enough distinct lines for 32 calibration + 100 evaluation lines


def test_rendered_line_is_deterministic_and_varies_with_the_seed():
    pytest.importorskip("PIL", reason="Pillow is not installed (pip install pillow)")
    fonts = text.find_fonts()
    if not fonts:
        pytest.skip("no DejaVu font installed (Debian package fonts-dejavu-core)")
    a = text.render_line("Seven hungry geese", 7, fonts)
    b = text.render_line("Seven hungry geese", 7, fonts)
    c = text.render_line("Seven hungry geese", 8, fonts)
    assert a.dtype == np.uint8 and a.shape[0] == 48 and a.shape[1] > 100
    assert np.array_equal(a, b)
    assert a.shape != c.shape or not np.array_equal(a, c)
    x = text.rec_input(a, 320)
    assert x.shape == (1, 3, 48, 320) and x.dtype == np.float32
    assert -1.0 <= x.min() and x.max() <= 1.0
    width = min(320, int(np.ceil(a.shape[1] * 48 / a.shape[0])))
    assert np.all(x[..., width:] == 0)  # PaddleOCR pads with zeros after normalising
