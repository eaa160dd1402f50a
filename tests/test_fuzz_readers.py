"""Property-based fuzzing of the readers: whatever a mutated IR text or .bin, cfg or opt_config JSON holds, reading
it ends in a value or in one of quantopt's errors (`QuantOptError`), never in another exception (an internal
error, exit code 1). Deterministic (derandomize) and short; benchmarks/fuzz_readers.py runs long campaigns."""
from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, List, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantopt.config.layer_settings import SETTING_FIELDS, OptConfig
from quantopt.config.reader import read_cfg
from quantopt.errors import QuantOptError
from quantopt.ir.reader import read_ir
from quantopt.registry.optype import OpType

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digits"
FUZZ = settings(max_examples=200, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

TOKENS = ["nan", "inf", "-inf", "1e308", "-1", "0", "1.5", "2147483648", "99999999999999999999", "[]", "[[]]", "[",
          "]", "[1,]", "[,]", "[[1,2],[3]]", "[a [b]]", "[1]x", "abc", "None", "true", "float32", "int8", "dtype.int8",
          "bfloat16", "float33", "", "=", "a=b", "[[1,8,8,8]]", "[float32,int8]", "[-1]", "[[0,255]]", "[nan]",
          "[0,2,3,1]", "RELU", "[" * 40 + "]" * 40, "[" * 3000 + "]" * 3000, "\udcff", "é", "[" + "9" * 30 + "]",
          "[[0," + "9" * 30 + "]]", "[[1,99999999999,99999999999]]"]
IR_KEYS = ["layer_id", "layer_name", "layer_type", "layer_bottom", "layer_bottom_shape", "layer_top",
           "layer_top_shape", "layer_top_type", "layer_top_range", "layer_top_scale", "layer_top_zp", "weights_type",
           "weights_offset", "weights_size", "weights_shape", "biases_offset", "layer_top_scale_offset", "lut_type",
           "kernel_x", "stride_y", "pad_left", "group", "with_activation", "method", "axis", "perm", "shape",
           "input_tensors", "output_tensors", "model_name", "layer_number", "model_bin", "subgraph_name", "x"]
CFG_KEYS = ["graph", "bin", "model_name", "dataset", "calibration_data", "calibration_batch_size", "data", "label",
            "metric", "metric_batch_size", "output_dir", "allow_unknown_ir_keys", "q_bits_activation",
            "quantize_method_for_weight", "calibration_strategy_for_activation", "trigger_float_op", "opt_config",
            "global_calibration", "mixed_precision_auto_search", "grpah", "[Common]", "[Other]"]
CHARS = list("[]=,#\n\r\t \x00-+.e01_") + ["\u2028", "\ufeff", "\udcff"]

# one edit of a text: (operation, position, position, token, key, character, free text)
TEXT_EDIT = st.tuples(st.integers(0, 11), st.integers(0, 10 ** 6), st.integers(0, 10 ** 6), st.sampled_from(TOKENS),
                      st.integers(0, 10 ** 3), st.sampled_from(CHARS), st.text(max_size=12))
BIN_EDIT = st.tuples(st.integers(0, 4), st.integers(0, 10 ** 6), st.integers(0, 64), st.binary(max_size=16))


def edit_text(text: str, edit: Tuple[Any, ...], keys: List[str]) -> str:
    op, a, b, token, k, ch, free = edit
    lines = text.split("\n")
    i, j = a % len(lines), b % len(lines)
    key = keys[k % len(keys)]
    if op == 0 and "=" in lines[i]:
        lines[i] = lines[i].split("=", 1)[0] + "=" + token
    elif op == 1:
        del lines[i]
    elif op == 2:
        lines.insert(j, lines[i])
    elif op == 3:
        lines[i], lines[j] = lines[j], lines[i]
    elif op == 4:
        lines.insert(i, f"{key}={token}")
    elif op == 5:
        return text[: a % (len(text) + 1)]
    elif op == 6:
        pos = a % (len(text) + 1)
        return text[:pos] + ch + text[pos + (b % 2):]
    elif op == 7 and "=" in lines[i]:
        lines[i] = key + "=" + lines[i].split("=", 1)[1]
    elif op == 8:
        lines.insert(i, "")
    elif op == 9:
        blanks = [n for n, ln in enumerate(lines) if not ln.strip()]
        if blanks:
            del lines[blanks[a % len(blanks)]]
    elif op == 10:
        pos = a % (len(text) + 1)
        return text[:pos] + free + text[pos:]
    elif op == 11 and "=" in lines[i]:
        lines[i] += token
    return "\n".join(lines)


def edit_bin(data: bytes, edit: Tuple[int, int, int, bytes]) -> bytes:
    op, pos, n, blob = edit
    if op == 0:
        return data[: pos % (len(data) + 1)]
    if op == 1 and data:
        b = bytearray(data)
        p = pos % len(b)
        b[p:p + len(blob)] = blob
        return bytes(b[:len(data)])
    if op == 2 and len(data) >= 4:
        b = bytearray(data)
        p = (pos % (len(data) - 3)) & ~3
        b[p:p + 4] = np.array([[np.nan, np.inf, -np.inf, 1e38, -0.0][n % 5]], dtype="<f4").tobytes()
        return bytes(b)
    if op == 3:
        return data + blob
    return b""


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The digits example's IR and cfg; operator types the mutated IRs register are forgotten afterwards."""
    root = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(EXAMPLE / "model", root / "model")
    shutil.copytree(EXAMPLE / "data", root / "data")
    shutil.copy(EXAMPLE / "opt.cfg", root / "opt.cfg")
    types = object.__getattribute__(OpType, "_types")
    before = dict(types)
    yield root
    types.clear()
    types.update(before)


_counter = itertools.count()


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
    return path


def _only_quantopt_errors(read: Callable[[], Any]) -> None:
    try:
        read()
    except QuantOptError as e:
        assert str(e) and e.exit_code in (2, 3, 4, 5, 6)


@FUZZ
@given(edits=st.lists(TEXT_EDIT, min_size=1, max_size=3))
def test_ir_text_mutations(work: Path, edits: List[Tuple[Any, ...]]) -> None:
    text = (work / "model" / "digits.txt").read_text()
    for e in edits:
        text = edit_text(text, e, IR_KEYS)
    n = next(_counter)  # new names each time: an earlier graph may still map its .bin
    txt = _write(work, f"t{n}.txt", text)
    shutil.copy(work / "model" / "digits.bin", work / f"t{n}.bin")
    _only_quantopt_errors(lambda: read_ir(str(txt)))
    os.remove(txt)
    os.remove(work / f"t{n}.bin")


@FUZZ
@given(edits=st.lists(BIN_EDIT, min_size=1, max_size=3))
def test_ir_bin_mutations(work: Path, edits: List[Tuple[int, int, int, bytes]]) -> None:
    data = (work / "model" / "digits.bin").read_bytes()
    for e in edits:
        data = edit_bin(data, e)
    n = next(_counter)
    shutil.copy(work / "model" / "digits.txt", work / f"b{n}.txt")
    (work / f"b{n}.bin").write_bytes(data)
    _only_quantopt_errors(lambda: read_ir(str(work / f"b{n}.txt")))
    os.remove(work / f"b{n}.txt")
    os.remove(work / f"b{n}.bin")


@FUZZ
@given(edits=st.lists(TEXT_EDIT, min_size=1, max_size=3))
def test_cfg_mutations(work: Path, edits: List[Tuple[Any, ...]]) -> None:
    text = (work / "opt.cfg").read_text()
    for e in edits:
        text = edit_text(text, e, CFG_KEYS)
    path = _write(work, f"c{next(_counter)}.cfg", text)
    _only_quantopt_errors(lambda: read_cfg(str(path)))
    os.remove(path)


LAYERS = ["input", "/conv1/Conv", "/MaxPool", "/fc/Gemm", "/Softmax"]
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
                         st.text(max_size=10), st.sampled_from(["8", "16", "true", "extrema", "mean",
                                                                "per_tensor_asymmetric", "[1,2]", "RELU"]))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) |
                           st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
SETTINGS = st.dictionaries(st.sampled_from(sorted(SETTING_FIELDS) + ["layer_id", "layer_type", "just_for_display",
                                                                     "unknown"]), JSON_VALUES, max_size=4)
OPT_CONFIG = st.dictionaries(st.sampled_from(LAYERS + ["no_such_layer", ""]), SETTINGS | JSON_VALUES, max_size=4)


@FUZZ
@given(doc=OPT_CONFIG | JSON_VALUES, edits=st.lists(TEXT_EDIT, max_size=2))
def test_opt_config_mutations(work: Path, doc: Any, edits: List[Tuple[Any, ...]]) -> None:
    text = json.dumps(doc, indent=1)
    for e in edits:
        text = edit_text(text, e, ['"q_bits_activation"', '"layer_id"', '"/fc/Gemm"'])
    path = _write(work, f"j{next(_counter)}.json", text)
    _only_quantopt_errors(lambda: OptConfig.load(str(path), LAYERS))
    os.remove(path)
