"""The catalogue of bad inputs: each case copies the bundled digits example (small data) and changes ONE thing in
its IR text, .bin, cfg or a plugin file, and says what quantopt must answer: the exit code and what the single
error line must name (the file and line, or the cfg field, or the plugin file).

Cases are generators, not stored files: they follow the example if it changes. `test_bad_inputs.py` runs them.
"""
from __future__ import annotations

import re
import shutil
import struct
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "digits"

CFG, IR, DATA, PLUGIN, UNSUPPORTED = 2, 3, 4, 5, 6


class Work:
    """A copy of examples/digits (8 calibration and 16 validation samples) in `root`, with edit helpers that
    return the line they changed (1-based), so a case can say where the error must point."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.txt = root / "model" / "digits.txt"
        self.bin = root / "model" / "digits.bin"
        self.cfg = root / "opt.cfg"
        self.plugins = root / "plugins"
        self.inputs = root / "x.npy"
        self.run_out = root / "run_out"
        self.out_dir = root / "opt_log"

    @classmethod
    def create(cls, root: Path) -> Work:
        w = cls(root)
        shutil.copytree(EXAMPLE / "model", root / "model")
        (root / "data").mkdir()
        calib = np.load(EXAMPLE / "data" / "calib.npy")
        np.save(root / "data" / "calib.npy", calib[:8])
        np.save(root / "data" / "val.npy", np.load(EXAMPLE / "data" / "val.npy")[:16])
        np.save(root / "data" / "val_label.npy", np.load(EXAMPLE / "data" / "val_label.npy")[:16])
        np.save(w.inputs, calib[:2])
        cfg = (EXAMPLE / "opt.cfg").read_text()
        cfg = cfg.replace("calibration_batch_size = 16", "calibration_batch_size = 8")
        w.cfg.write_text(cfg.replace("metric_batch_size = 64", "metric_batch_size = 16"))
        return w

    # ---------------------------------------------------------------------------------------------- IR text
    def lines(self) -> List[str]:
        return self.txt.read_text().split("\n")

    def write_lines(self, lines: Sequence[str]) -> None:
        self.txt.write_text("\n".join(lines))

    def section(self, layer: Optional[str]) -> range:
        """0-based line indexes of the header (layer None) or of the layer named `layer`."""
        lines = self.lines()
        starts = [0] + [i + 1 for i, ln in enumerate(lines) if not ln.strip()]
        for s in starts:
            e = s
            while e < len(lines) and lines[e].strip():
                e += 1
            body = lines[s:e]
            if not body:
                continue
            if layer is None or f"layer_name={layer}" in body:
                return range(s, e)
        raise KeyError(layer)

    def index(self, layer: Optional[str], key: str) -> int:
        lines = self.lines()
        for i in self.section(layer):
            if lines[i].split("=", 1)[0] == key:
                return i
        raise KeyError((layer, key))

    def value(self, layer: Optional[str], key: str) -> str:
        return self.lines()[self.index(layer, key)].split("=", 1)[1]

    def set(self, layer: Optional[str], key: str, value: str) -> int:
        lines = self.lines()
        i = self.index(layer, key)
        lines[i] = f"{key}={value}"
        self.write_lines(lines)
        return i + 1

    def rename(self, layer: Optional[str], key: str, new_key: str) -> int:
        lines = self.lines()
        i = self.index(layer, key)
        lines[i] = f"{new_key}={lines[i].split('=', 1)[1]}"
        self.write_lines(lines)
        return i + 1

    def add(self, layer: Optional[str], key: str, value: str) -> int:
        lines = self.lines()
        end = self.section(layer).stop
        lines.insert(end, f"{key}={value}")
        self.write_lines(lines)
        return end + 1

    def drop(self, layer: Optional[str], key: str) -> int:
        """Remove a key; returns the line of the section's first key (where 'missing' errors point)."""
        lines = self.lines()
        i = self.index(layer, key)
        first = self.section(layer).start
        del lines[i]
        self.write_lines(lines)
        return first + 1

    def loc(self, line: int) -> str:
        return f"digits.txt:{line}"

    # ---------------------------------------------------------------------------------------------- .bin, cfg
    def poke_float(self, layer: str, stem: str, index: int, value: float) -> None:
        """Overwrite element `index` of float32 constant `stem` of `layer` in the .bin."""
        offset = int(self.value(layer, stem + "_offset")) + 4 * index
        data = bytearray(self.bin.read_bytes())
        data[offset:offset + 4] = struct.pack("<f", value)
        self.bin.write_bytes(bytes(data))

    def cfg_set(self, key: str, value: str) -> int:
        lines = self.cfg.read_text().split("\n")
        for i, ln in enumerate(lines):
            if ln.split("=", 1)[0].strip() == key:
                lines[i] = f"{key} = {value}"
                self.cfg.write_text("\n".join(lines))
                return i + 1
        lines.insert(len(lines) - 1 if lines[-1] == "" else len(lines), f"{key} = {value}")
        self.cfg.write_text("\n".join(lines))
        return lines.index(f"{key} = {value}") + 1

    def plugin(self, name: str, source: str, marker: str = "") -> str:
        """Write plugin file `aipubt_bad_<name>.py`; returns '<file name>:<line of marker>' (or the file name)."""
        self.plugins.mkdir(exist_ok=True)
        path = self.plugins / f"aipubt_bad_{name}.py"
        text = textwrap.dedent(source).lstrip()
        path.write_text(text)
        if not marker or marker == "pass":
            return path.name
        line = next(i for i, ln in enumerate(text.split("\n"), start=1) if ln.strip() == marker)
        return f"{path.name}:{line}"


@dataclass(frozen=True)
class Case:
    id: str
    code: int
    apply: Callable[[Work], str]
    """Makes the one change; returns what the error line must contain (file:line, field or plugin file)."""
    command: str = "cfg"
    """"cfg": `quantopt --cfg`; "run": `quantopt run` on two samples."""
    match: str = ""
    """A regular expression the error line must also match."""
    args: Sequence[str] = ()


CASES: List[Case] = []


def case(code: int, command: str = "cfg", match: str = "", args: Sequence[str] = ()) -> Callable:
    def register(fn: Callable[[Work], str]) -> Callable[[Work], str]:
        CASES.append(Case(fn.__name__, code, fn, command, match, tuple(args)))
        return fn
    return register


CONV1, CONV2, POOL, AVG, FLATTEN, FC, SOFTMAX = ("/conv1/Conv", "/conv2/Conv", "/MaxPool", "/AveragePool", "/Flatten",
                                                 "/fc/Gemm", "/Softmax")


# ============================================================================================ IR text: structure
@case(IR, match="empty IR file")
def txt_empty(w: Work) -> str:
    w.txt.write_text("")
    return "digits.txt"


@case(IR, match="not a text IR file")
def txt_binary(w: Work) -> str:
    w.txt.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x00" * 8)
    return "digits.txt"


@case(IR)
def txt_truncated_mid_layer(w: Work) -> str:
    text = w.txt.read_text()
    cut = text.index("kernel_y", text.index("layer_name=/conv2/Conv"))  # inside conv2, before most of its keys
    w.txt.write_text(text[:cut])
    return "digits.txt:"


@case(IR, match="layer_number")
def txt_header_only(w: Work) -> str:
    w.write_lines(w.lines()[:7])  # the header, no layer
    return w.loc(3)


@case(IR, command="run", match="layer_number")
def run_header_cut_short(w: Work) -> str:
    w.write_lines(w.lines()[:4])  # the header cut after precision=
    return w.loc(3)


@case(IR, match="layer_number=10 but the file has 1 layer section")
def txt_truncated_first_layer(w: Work) -> str:
    lines = w.lines()
    w.write_lines(lines[:10] + [""])  # layer 0 cut after layer_id: no layer_name
    return w.loc(3)


@case(IR, match="expected key=value")
def txt_line_without_equals(w: Work) -> str:
    return _insert_raw(w, CONV1, "this is not a key")


def _insert_raw(w: Work, layer: str, text: str) -> str:
    lines = w.lines()
    end = w.section(layer).stop
    lines.insert(end, text)
    w.write_lines(lines)
    return w.loc(end + 1)


@case(IR, match="malformed key")
def txt_malformed_key(w: Work) -> str:
    return _insert_raw(w, CONV1, "kernel x=3")


@case(IR, match="duplicate key 'kernel_x'")
def txt_duplicate_key_in_layer(w: Work) -> str:
    return w.loc(w.add(CONV1, "kernel_x", "3"))


@case(IR, match="unbalanced")
def txt_unbalanced_bracket(w: Work) -> str:
    return w.loc(w.set(CONV1, "layer_top_shape", "[[1,8,8,8]"))


@case(IR, match="unexpected text")
def txt_text_after_bracket(w: Work) -> str:
    return w.loc(w.set("input_post_transpose", "perm", "[0,2,3,1]x"))


@case(IR, match="empty list element")
def txt_empty_list_element(w: Work) -> str:
    return w.loc(w.set("input_post_transpose", "perm", "[0,,3,1]"))


@case(IR, match="header: bad value for 'input_tensors'")
def header_unbalanced_input_tensors(w: Work) -> str:
    return w.loc(w.set(None, "input_tensors", "[input_0"))


@case(IR, match="header: bad value for 'model_name'")
def header_unbalanced_model_name(w: Work) -> str:
    return w.loc(w.set(None, "model_name", "digits]"))


@case(IR, match="header: bad value")
def header_unbalanced_other_key(w: Work) -> str:
    return w.loc(w.set(None, "model_domain", "[image"))


@case(IR, match="layer_number=11")
def header_layer_number_wrong(w: Work) -> str:
    return w.loc(w.set(None, "layer_number", "11"))


@case(IR, match="must be an integer")
def header_layer_number_not_int(w: Work) -> str:
    return w.loc(w.set(None, "layer_number", "ten"))


@case(IR, match="must be the header")
def header_missing(w: Work) -> str:
    lines = w.lines()
    w.write_lines(lines[w.section(None).stop + 1:])
    return w.loc(1)


@case(IR, match="names tensor 'no_such_tensor'")
def header_unknown_input_tensor(w: Work) -> str:
    return w.loc(w.set(None, "input_tensors", "[no_such_tensor]"))


@case(IR, match="names tensor 'nope'")
def header_unknown_output_tensor(w: Work) -> str:
    return w.loc(w.set(None, "output_tensors", "[nope]"))


@case(IR, match="a subgraph header holds")
def header_subgraph_section(w: Work) -> str:
    return w.loc(w.add(FC, "subgraph_name", "body"))


@case(IR, match="missing required key 'layer_name'")
def layer_missing_name(w: Work) -> str:
    return w.loc(w.drop(CONV2, "layer_name"))


@case(IR, match="missing required key 'layer_type'")
def layer_missing_type(w: Work) -> str:
    return w.loc(w.drop(CONV2, "layer_type"))


@case(IR, match="missing required key 'layer_top'")
def layer_missing_top(w: Work) -> str:
    return w.loc(w.drop(CONV2, "layer_top"))


@case(IR, match="missing required key 'layer_id'")
def layer_missing_id(w: Work) -> str:
    return w.loc(w.drop(CONV2, "layer_id"))


@case(IR, match="'layer_id' must be an integer")
def layer_id_not_integer(w: Work) -> str:
    return w.loc(w.set(CONV2, "layer_id", "two"))


@case(IR, match=r"layer_id 2 is already used by layer '/conv1/Conv' at line \d+")
def layer_id_duplicate(w: Work) -> str:
    return w.loc(w.set(CONV2, "layer_id", "2"))


@case(IR, match="duplicate layer name")
def layer_name_duplicate(w: Work) -> str:
    return w.loc(w.set(CONV2, "layer_name", CONV1) - 1)


@case(IR, match="'layer_name' is empty")
def layer_name_empty(w: Work) -> str:
    return w.loc(w.set(CONV2, "layer_name", ""))


@case(IR, match="duplicate tensor name")
def layer_top_duplicate(w: Work) -> str:
    w.set(CONV2, "layer_top", "[/conv1/Conv_0]")
    return w.loc(w.index(CONV2, "layer_id") + 1)


@case(IR, match="no layer produces")
def layer_bottom_unknown(w: Work) -> str:
    w.set(CONV2, "layer_bottom", "[/conv9/Conv_0]")
    return w.loc(w.index(CONV2, "layer_id") + 1)


@case(IR, match="cycle")
def layer_cycle(w: Work) -> str:
    w.set("input_post_transpose", "layer_bottom", "[/Softmax_0]")
    w.set("input_post_transpose", "layer_bottom_shape", "[[1,10]]")
    return "digits.txt:"


@case(IR, match="layer_top is empty")
def layer_top_empty(w: Work) -> str:
    return w.loc(w.set(CONV2, "layer_top", "[]"))


@case(IR, match="unknown dtype 'float33'")
def layer_top_type_unknown(w: Work) -> str:
    return w.loc(w.set(CONV2, "layer_top_type", "[float33]"))


@case(IR, match="lists 2 shape")
def layer_top_shape_count(w: Work) -> str:
    return w.loc(w.set(CONV2, "layer_top_shape", "[[1,8,8,16],[1]]"))


@case(IR, match="negative dimension")
def layer_top_shape_negative(w: Work) -> str:
    return w.loc(w.set(CONV2, "layer_top_shape", "[[1,8,-8,16]]"))


@case(IR, match="impossible tensor shape")
def layer_top_shape_huge(w: Work) -> str:
    return w.loc(w.set(CONV2, "layer_top_shape", "[[1,99999999999,99999999999,16]]"))


@case(IR, command="run", match="impossible tensor shape")
def run_input_shape_huge(w: Work) -> str:
    return w.loc(w.set("input", "layer_top_shape", "[[1,1,2147483648,8]]"))


@case(IR, match="'layer_top_zp' entries must be finite numbers")
def value_huge_top_zp(w: Work) -> str:
    return w.loc(w.add(CONV1, "layer_top_zp", "[" + "9" * 30 + "]"))


@case(IR, match="list of shapes")
def layer_top_shape_flat(w: Work) -> str:
    return w.loc(w.set(CONV2, "layer_top_shape", "[1,8,8,16]"))


@case(IR, match="differs from the producer")
def layer_bottom_shape_mismatch(w: Work) -> str:
    w.set(CONV2, "layer_bottom_shape", "[[1,8,8,9]]")
    return w.loc(w.index(CONV2, "layer_id") + 1)


@case(IR, match="lists 2 dtype")
def layer_bottom_type_count(w: Work) -> str:
    return w.loc(w.set(CONV2, "layer_bottom_type", "[float32,float32]"))


@case(IR, match="invalid layer_type")
def layer_type_invalid_name(w: Work) -> str:
    return w.loc(w.set(FLATTEN, "layer_type", "Re-shape"))


@case(UNSUPPORTED, match=r"digits\.txt:\d+\b.*no forward implementation for layer type.*Reshpe")
def layer_type_unknown(w: Work) -> str:
    w.set(FLATTEN, "layer_type", "Reshpe")
    return "digits.txt"


# ============================================================================================ IR text: keys
@case(IR, match="unknown key 'with_activaton' for a Convolution layer; did you mean 'with_activation'")
def key_misspelled_with_activation(w: Work) -> str:
    return w.loc(w.rename(CONV1, "with_activation", "with_activaton"))


@case(IR, match="unknown key 'stride' for a Pooling layer; did you mean 'stride_y' or 'stride_x'")
def key_stride_on_pooling(w: Work) -> str:
    return w.loc(w.add(POOL, "stride", "2"))


@case(IR, match="unknown key 'stride_x' for a Softmax layer")
def key_stride_x_on_softmax(w: Work) -> str:
    return w.loc(w.add(SOFTMAX, "stride_x", "2"))


@case(IR, match="unknown key 'pad_left' for a Reshape layer")
def key_pad_on_reshape(w: Work) -> str:
    return w.loc(w.add(FLATTEN, "pad_left", "1"))


@case(IR, match="unknown key 'pad_left' for a Transpose layer")
def key_pad_on_transpose(w: Work) -> str:
    return w.loc(w.add("input_post_transpose", "pad_left", "0"))


@case(IR, match="did you mean 'with_activation'")
def key_misspelled_on_fc(w: Work) -> str:
    return w.loc(w.rename(FC, "with_activation", "with_actvation"))


@case(IR, match="unknown key 'perms'.*did you mean 'perm'")
def key_misspelled_perm(w: Work) -> str:
    return w.loc(w.rename("input_post_transpose", "perm", "perms"))


@case(IR, match="unknown key 'kernal_x'")
def key_misspelled_kernel(w: Work) -> str:
    return w.loc(w.rename(AVG, "kernel_x", "kernal_x"))


@case(IR, match="unknown key 'count_include_pads'")
def key_misspelled_count_include_pad(w: Work) -> str:
    return w.loc(w.rename(AVG, "count_include_pad", "count_include_pads"))


@case(IR, match="unknown key 'Method'")
def key_wrong_case(w: Work) -> str:
    return w.loc(w.rename(POOL, "method", "Method"))


@case(IR, match="unknown constant 'biasse'.*did you mean 'biases'")
def key_misspelled_constant(w: Work) -> str:
    lines = w.lines()
    first = None
    for i in w.section(CONV1):
        if lines[i].startswith("biases_"):
            lines[i] = "biasse_" + lines[i][len("biases_"):]
            first = i if first is None else first
    w.write_lines(lines)
    return w.loc(first + 1)


@case(IR, match=r"unknown key 'activation' for a Softmax layer")
def key_foreign_on_softmax(w: Work) -> str:
    return w.loc(w.add(SOFTMAX, "activation", "RELU"))


# ============================================================================================ IR text: values
@case(IR, match="parameter 'stride_x': NaN is not a valid value")
def value_nan_stride(w: Work) -> str:
    return w.loc(w.set(CONV1, "stride_x", "nan"))


@case(IR, match="parameter 'kernel_x': must be a positive integer")
def value_inf_kernel(w: Work) -> str:
    return w.loc(w.set(CONV2, "kernel_x", "inf"))


@case(IR, match="parameter 'pad_left': must be a non-negative integer")
def value_huge_float_pad(w: Work) -> str:
    return w.loc(w.set(CONV1, "pad_left", "1e308"))


@case(IR, match="parameter 'pad_top': must be a non-negative integer")
def value_huge_int_pad(w: Work) -> str:
    return w.loc(w.set(CONV1, "pad_top", "99999999999999999999"))


@case(IR, match="parameter 'group': must be a positive integer")
def value_negative_group(w: Work) -> str:
    return w.loc(w.set(CONV2, "group", "-1"))


@case(IR, match="parameter 'num_output'")
def value_fractional_num_output(w: Work) -> str:
    return w.loc(w.set(FC, "num_output", "1.5"))


@case(IR, match="parameter 'dilation_y'")
def value_text_dilation(w: Work) -> str:
    return w.loc(w.set(CONV2, "dilation_y", "abc"))


@case(IR, match="parameter 'axis'")
def value_nan_axis(w: Work) -> str:
    return w.loc(w.set(SOFTMAX, "axis", "nan"))


@case(IR, match="parameter 'perm': must be a list of integers")
def value_text_in_perm(w: Work) -> str:
    return w.loc(w.set("input_post_transpose", "perm", "[0,2,3,x]"))


@case(IR, match="parameter 'shape'")
def value_nan_in_shape(w: Work) -> str:
    return w.loc(w.set(FLATTEN, "shape", "[1,nan]"))


@case(IR, match="parameter 'stride_y'")
def value_stride_beyond_int32(w: Work) -> str:
    return w.loc(w.set(POOL, "stride_y", "2147483648"))


@case(IR, match="'layer_top_scale' entries must be finite numbers")
def value_nan_top_scale(w: Work) -> str:
    return w.loc(w.add(CONV1, "layer_top_scale", "[nan]"))


@case(IR, match="'layer_top_range' entries must be")
def value_inf_top_range(w: Work) -> str:
    return w.loc(w.add(CONV1, "layer_top_range", "[[0,inf]]"))


@case(IR, match="'layer_top_range' entries must be")
def value_text_top_range(w: Work) -> str:
    return w.loc(w.add(CONV1, "layer_top_range", "[[a,b]]"))


@case(IR, match="one entry per output")
def value_top_zp_count(w: Work) -> str:
    return w.loc(w.add(CONV1, "layer_top_zp", "[0,0]"))


@case(IR, command="run", match="parameter 'stride_x': NaN is not a valid value")
def run_nan_param(w: Work) -> str:
    return w.loc(w.set(CONV1, "stride_x", "nan"))


@case(IR, command="run", match="parameter 'kernel_y'")
def run_inf_param(w: Work) -> str:
    return w.loc(w.set(CONV2, "kernel_y", "-inf"))


@case(IR, command="run", match="parameter 'pad_bottom'")
def run_huge_param(w: Work) -> str:
    return w.loc(w.set(CONV1, "pad_bottom", "2147483648"))


@case(IR, command="run", match="unknown key 'with_activaton'")
def run_unknown_key(w: Work) -> str:
    return w.loc(w.rename(CONV1, "with_activation", "with_activaton"))


# ============================================================================================ constants and .bin
@case(IR, match="spans bytes")
def bin_short(w: Work) -> str:
    w.bin.write_bytes(w.bin.read_bytes()[:-100])
    return w.loc(w.index(FC, "weights_offset") + 1)


@case(IR, match="spans bytes")
def bin_empty(w: Work) -> str:
    w.bin.write_bytes(b"")
    return w.loc(w.index(CONV1, "weights_offset") + 1)


@case(IR, command="run", match="spans bytes")
def run_bin_short(w: Work) -> str:
    w.bin.write_bytes(w.bin.read_bytes()[:-4])
    return w.loc(w.index(FC, "biases_offset") + 1)


@case(CFG, match="does not exist|not found|no such file")
def bin_missing(w: Work) -> str:
    w.bin.unlink()
    return "opt.cfg:3"


@case(IR, command="run", match="binary file not found")
def run_bin_missing(w: Work) -> str:
    w.bin.unlink()
    return "digits.bin"


@case(IR, match=r"constant 'weights' holds 1 NaN/inf value\(s\) \(first at flat index 5\) in .*digits.bin")
def bin_nan_in_weights(w: Work) -> str:
    w.poke_float(CONV1, "weights", 5, float("nan"))
    return w.loc(w.index(CONV1, "weights_offset") + 1)


@case(IR, match=r"layer '/fc/Gemm': constant 'biases' holds 1 NaN/inf")
def bin_inf_in_biases(w: Work) -> str:
    w.poke_float(FC, "biases", 9, float("inf"))
    return w.loc(w.index(FC, "biases_offset") + 1)


@case(IR, command="run", match="constant 'weights' holds 2 NaN/inf")
def run_bin_nan(w: Work) -> str:
    w.poke_float(CONV2, "weights", 0, float("-inf"))
    w.poke_float(CONV2, "weights", 7, float("nan"))
    return w.loc(w.index(CONV2, "weights_offset") + 1)


@case(IR, match="offset 289 is not a multiple of the 4-byte float32")
def bin_misaligned_offset(w: Work) -> str:
    return w.loc(w.set(CONV1, "biases_offset", "289"))


@case(IR, match="offset 4990 is not a multiple")
def bin_misaligned_offset_between(w: Work) -> str:
    return w.loc(w.set(CONV1, "weights_offset", "4990"))  # inside the .bin, but at no constant's end


@case(IR, match="spans bytes")
def bin_offset_beyond_end(w: Work) -> str:
    return w.loc(w.set(FC, "weights_offset", "16800"))


@case(IR, match="must be a non-negative integer")
def bin_negative_offset(w: Work) -> str:
    return w.loc(w.set(CONV1, "weights_offset", "-4"))


@case(IR, match="must be a non-negative integer")
def bin_negative_size(w: Work) -> str:
    return w.loc(w.set(CONV1, "biases_size", "-32"))


@case(IR, match="does not match shape")
def bin_size_shape_mismatch(w: Work) -> str:
    return w.loc(w.set(CONV1, "biases_size", "36"))


@case(IR, match="not a multiple of the 4-byte float32")
def bin_size_not_multiple(w: Work) -> str:
    return w.loc(w.set(CONV1, "biases_size", "30"))


@case(IR, match="does not match shape")
def bin_shape_size_mismatch(w: Work) -> str:
    w.set(CONV2, "weights_shape", "[16,3,3,9]")
    return w.loc(w.index(CONV2, "weights_size") + 1)


@case(IR, match="unknown dtype 'float33'")
def bin_unknown_dtype(w: Work) -> str:
    return w.loc(w.set(CONV1, "weights_type", "float33"))


@case(IR, match="does not match shape")
def bin_dtype_changed(w: Work) -> str:
    w.set(CONV1, "weights_type", "float16")
    return w.loc(w.index(CONV1, "weights_size") + 1)


@case(IR, match="unknown dtype")
def bin_dtype_is_number(w: Work) -> str:
    return w.loc(w.set(CONV1, "weights_type", "32"))


@case(IR, match="constant 'biases' misses 'biases_offset'")
def const_missing_offset(w: Work) -> str:
    w.drop(CONV1, "biases_offset")
    return w.loc(w.index(CONV1, "biases_type") + 1)


@case(IR, match="constant 'weights' misses 'weights_size'")
def const_missing_size(w: Work) -> str:
    w.drop(CONV2, "weights_size")
    return w.loc(w.index(CONV2, "weights_type") + 1)


@case(IR, match="constant 'weights' misses 'weights_type'")
def const_missing_type(w: Work) -> str:
    w.drop(FC, "weights_type")
    return w.loc(w.index(FC, "weights_offset") + 1)


@case(IR, match="constant 'biases' misses 'biases_shape'")
def const_missing_shape(w: Work) -> str:
    w.drop(FC, "biases_shape")
    return w.loc(w.index(FC, "biases_type") + 1)


@case(IR, match="must be a list of non-negative integers")
def const_shape_not_list(w: Work) -> str:
    return w.loc(w.set(CONV1, "weights_shape", "288"))


@case(IR, match="must be a list of non-negative integers")
def const_shape_negative(w: Work) -> str:
    return w.loc(w.set(CONV1, "weights_shape", "[8,3,-3,1]"))


@case(IR, match="does not match shape")
def const_shape_huge(w: Work) -> str:
    w.set(CONV1, "weights_shape", "[99999999999,99999999999,99999999999]")
    return w.loc(w.index(CONV1, "weights_size") + 1)


@case(IR, match="equally long")
def const_list_type_scalar_rest(w: Work) -> str:
    return w.loc(w.set(CONV1, "weights_type", "[float32,float32]"))


@case(IR, match="constant 'weights'")
def const_missing_in_conv(w: Work) -> str:
    for suffix in ("_type", "_offset", "_size", "_shape"):
        w.drop(CONV2, "weights" + suffix)
    return "digits.txt:"


# ============================================================================================ cfg
@case(CFG, match="unknown key 'grpah'")
def cfg_misspelled_key(w: Work) -> str:
    lines = w.cfg.read_text().split("\n")
    lines[1] = lines[1].replace("graph", "grpah")
    w.cfg.write_text("\n".join(lines))
    return "opt.cfg:2"


@case(CFG)
def cfg_graph_missing(w: Work) -> str:
    return f"opt.cfg:{w.cfg_set('graph', 'model/nope.txt')}"


@case(CFG)
def cfg_allow_unknown_ir_keys_not_bool(w: Work) -> str:
    return f"opt.cfg:{w.cfg_set('allow_unknown_ir_keys', 'maybe')}"


@case(CFG, match="duplicate")
def cfg_duplicate_key(w: Work) -> str:
    w.cfg.write_text(w.cfg.read_text() + "metric = TopKMetric\n")
    return "opt.cfg:"


@case(CFG)
def cfg_zero_batch_size(w: Work) -> str:
    return f"opt.cfg:{w.cfg_set('metric_batch_size', '0')}"


@case(PLUGIN, match="no dataset plugin named 'NoSuchDataset'")
def cfg_unknown_dataset(w: Work) -> str:
    w.cfg_set("dataset", "NoSuchDataset")
    return "field 'dataset'"


@case(PLUGIN, match="no metric plugin named 'NoSuchMetric'")
def cfg_unknown_metric(w: Work) -> str:
    w.cfg_set("metric", "NoSuchMetric")
    return "field 'metric'"


@case(IR, match="unknown key 'with_activaton'")
def cfg_allow_unknown_ir_keys_false(w: Work) -> str:
    w.cfg_set("allow_unknown_ir_keys", "false")
    return w.loc(w.rename(CONV1, "with_activation", "with_activaton"))


# ============================================================================================ plugins
_DATASET = '''
    import numpy as np
    import torch
    import torch.utils.data

    from quantopt import PluginType, register_plugin


    @register_plugin(PluginType.Dataset, "1.0")
    class {cls}(torch.utils.data.Dataset):
        def __init__(self, data_file, label_file=None):
            {init}
            self.x = np.load(data_file)
            self.y = np.load(label_file) if label_file else None

        def __len__(self):
            {len}
            return len(self.x)

        def __getitem__(self, i):
            {getitem}
            label = torch.tensor(float("-inf")) if self.y is None else torch.tensor(self.y[i])
            return [torch.from_numpy(self.x[i]), label]
'''


def _dataset(w: Work, name: str, init: str = "pass", length: str = "pass", getitem: str = "pass") -> str:
    cls = "Bad" + "".join(p.title() for p in name.split("_")) + "Dataset"
    marker = next((b for b in (init, length, getitem) if b != "pass"), "")
    where = w.plugin(name, _DATASET.format(cls=cls, init=init, len=length, getitem=getitem), marker)
    w.cfg_set("dataset", cls)
    return where


_METRIC = '''
    from quantopt import OptBaseMetric, PluginType, register_plugin


    @register_plugin(PluginType.Metric, "1.0")
    class {cls}(OptBaseMetric):
        def __init__(self, *args):
            super().__init__(*args)
            {init}
            self.n = 0

        def __call__(self, pred, target):
            {call}
            self.n += 1

        def reset(self):
            {reset}
            self.n = 0

        def compute(self):
            {compute}
            return float(self.n)

        def report(self):
            {report}
            return "ok"
'''


def _metric(w: Work, name: str, marker: str = "", **bodies: str) -> str:
    cls = "Bad" + "".join(p.title() for p in name.split("_")) + "Metric"
    parts = {k: bodies.get(k, "pass") for k in ("init", "call", "reset", "compute", "report")}
    where = w.plugin(name, _METRIC.format(cls=cls, **parts), marker or next(iter(bodies.values())))
    w.cfg_set("metric", cls)
    return where


@case(PLUGIN, match=r"dataset plugin BadDatasetInitDataset: __init__ raised ValueError: broken init")
def plugin_dataset_init(w: Work) -> str:
    return _dataset(w, "dataset_init", init="raise ValueError('broken init')")


@case(DATA, match="my own data error")
def plugin_dataset_init_data_error(w: Work) -> str:
    _dataset(w, "dataset_data_error", init="from quantopt import DataError; raise DataError('my own data error', "
                                           "file=data_file)")
    return "calib.npy"


@case(PLUGIN, match=r"__len__ raised ZeroDivisionError")
def plugin_dataset_len(w: Work) -> str:
    return _dataset(w, "dataset_len", length="1 / 0")


@case(PLUGIN, match=r"__getitem__\(0\) raised KeyError")
def plugin_dataset_getitem(w: Work) -> str:
    return _dataset(w, "dataset_getitem", getitem="raise KeyError(i)")


@case(PLUGIN, match=r"__getitem__\(\d+\) raised IndexError")
def plugin_dataset_getitem_later(w: Work) -> str:
    return _dataset(w, "dataset_getitem_later", getitem="[][i] if i >= 3 else None")


@case(PLUGIN, match=r"__getitem__\(0\) raised KeyError")
def plugin_dataset_getitem_in_worker(w: Work) -> str:
    """In a DataLoader worker process: torch re-raises the error with the worker's traceback in its text."""
    w.cfg_set("dataloader_workers", "1")
    return _dataset(w, "dataset_getitem_worker", getitem="raise KeyError(i)")


@case(PLUGIN, match=r"\[inputs, label\]")
def plugin_dataset_bad_sample(w: Work) -> str:
    _dataset(w, "dataset_bad_sample", getitem="return torch.zeros(1, 8, 8)")
    return "calib.npy"


@case(PLUGIN, match=r"metric plugin BadMetricInitMetric: __init__ raised RuntimeError")
def plugin_metric_init(w: Work) -> str:
    return _metric(w, "metric_init", init="raise RuntimeError('no')")


@case(PLUGIN, match=r"metric plugin BadMetricCallMetric: __call__ raised TypeError")
def plugin_metric_call(w: Work) -> str:
    return _metric(w, "metric_call", call="raise TypeError('bad call')")


@case(PLUGIN, match=r"reset raised AttributeError")
def plugin_metric_reset(w: Work) -> str:
    return _metric(w, "metric_reset", reset="self.missing.clear()")


@case(PLUGIN, match=r"compute raised ZeroDivisionError")
def plugin_metric_compute(w: Work) -> str:
    return _metric(w, "metric_compute", compute="return 1 / 0")


@case(PLUGIN, match=r"compute returned 'n/a', not a number")
def plugin_metric_compute_not_a_number(w: Work) -> str:
    return _metric(w, "metric_compute_nan", marker="def compute(self):", compute="return 'n/a'")


@case(PLUGIN, match=r"report raised ValueError")
def plugin_metric_report(w: Work) -> str:
    return _metric(w, "metric_report", report="raise ValueError('bad\\nmultiline\\nmessage')")


@case(PLUGIN, match="no metric plugin named 'BadSyntaxMetric'")
def plugin_file_syntax_error(w: Work) -> str:
    w.plugin("syntax_error", "class BadSyntaxMetric(:\n    pass\n")
    w.cfg_set("metric", "BadSyntaxMetric")
    return "field 'metric'"


_OPERATOR = '''
    from quantopt import PyNode, op_register, quant_register, register_optype
    from quantopt.ops.api import copy_params

    register_optype("{optype}")


    @op_register("{optype}", "1.0")
    def forward(self: PyNode) -> None:
        {forward}
        x = self.inputs[0].betensor
        self.outputs[0].betensor = x.reshape(x.shape[0], -1)


    @quant_register("{optype}", "1.0")
    def quantize(self: PyNode) -> None:
        {quantize}
        copy_params(self, self.outputs[0], self.inputs[0])
'''


def _operator(w: Work, name: str, forward: str = "pass", quantize: str = "pass") -> str:
    optype = "BadInputs" + "".join(p.title() for p in name.split("_"))
    marker = forward if forward != "pass" else quantize
    where = w.plugin(name, _OPERATOR.format(optype=optype, forward=forward, quantize=quantize), marker)
    w.set(FLATTEN, "layer_type", optype)
    return where


@case(PLUGIN, command="run", match=r"operator plugin forward \(forward of BadInputsOpForwardRun.*layer '/Flatten'.*"
                                   r"raised RuntimeError: forward broke")
def plugin_operator_forward_run(w: Work) -> str:
    return _operator(w, "op_forward_run", forward="raise RuntimeError('forward broke')")


@case(PLUGIN, match=r"forward of BadInputsOpForwardCfg.* raised IndexError")
def plugin_operator_forward_cfg(w: Work) -> str:
    return _operator(w, "op_forward_cfg", forward="self.inputs[5]")


@case(PLUGIN, match=r"quantize of BadInputsOpQuantize.* raised ZeroDivisionError")
def plugin_operator_quantize(w: Work) -> str:
    return _operator(w, "op_quantize", quantize="1 / 0")


@case(IR, command="run", match="missing required parameter 'alpha'")
def plugin_operator_raises_quantopt_error(w: Work) -> str:
    _operator(w, "op_ir_error", forward="self.get_param('alpha')")
    return w.loc(w.index(FLATTEN, "layer_id") + 1)


def _bad_run_input(w: Work) -> str:
    np.save(w.inputs, np.zeros((2, 3, 8, 8), dtype=np.float32))
    return "x.npy"


@case(DATA, command="run")
def run_input_wrong_shape(w: Work) -> str:
    return _bad_run_input(w)

# ============================================================================================ cfg against the model
def _cfg_line(w: Work, key: str, value: str) -> str:
    return f"opt.cfg:{w.cfg_set(key, value)}"


@case(CFG, match="field 'output_dir': .* is a file, not a folder")
def cfg_output_dir_is_a_file(w: Work) -> str:
    (w.root / "afile").write_text("x")
    return _cfg_line(w, "output_dir", str(w.root / "afile"))


@case(CFG, match="field 'output_dir': .* cannot be created: .* is a file")
def cfg_output_dir_under_a_file(w: Work) -> str:
    (w.root / "afile").write_text("x")
    return _cfg_line(w, "output_dir", str(w.root / "afile" / "out"))


@case(CFG, match="field 'dump_dir': .* is a file, not a folder")
def cfg_dump_dir_is_a_file(w: Work) -> str:
    (w.root / "afile").write_text("x")
    w.cfg_set("dump", "true")
    return _cfg_line(w, "dump_dir", str(w.root / "afile"))


@case(CFG, match=r"field 'model_name': invalid value '.*\.\.\. \(300 characters\)' \(300 characters long\)")
def cfg_model_name_too_long(w: Work) -> str:
    return _cfg_line(w, "model_name", "m" * 300)


@case(CFG, match="the IR's model_name is 260 characters long")
def cfg_ir_model_name_too_long(w: Work) -> str:
    w.set(None, "model_name", "n" * 260)
    w.cfg_set("model_name", "")
    return "opt.cfg"


@case(CFG, match=r"field 'calibration_batch_size': .*expected an integer in \[1, 1048576\]")
def cfg_calibration_batch_size_huge(w: Work) -> str:
    return _cfg_line(w, "calibration_batch_size", str(10 ** 20))


@case(CFG, match=r"field 'metric_batch_size': .*out of range")
def cfg_metric_batch_size_huge(w: Work) -> str:
    return _cfg_line(w, "metric_batch_size", "2000000")


@case(CFG, match="field 'calibration_batch_size'.*out of range")
def cfg_negative_batch_size(w: Work) -> str:
    return _cfg_line(w, "calibration_batch_size", "-1")


@case(CFG, match="beyond 2147483647")
def cfg_integer_beyond_int32(w: Work) -> str:
    return _cfg_line(w, "similarity_data_num", str(2 ** 40))


@case(CFG, match="field 'metric': the metric\\(s\\) TopKMetric need labels")
def cfg_metric_without_label(w: Work) -> str:
    lines = [ln for ln in w.cfg.read_text().split("\n") if not ln.startswith("label")]
    w.cfg.write_text("\n".join(lines))
    return f"opt.cfg:{next(i for i, ln in enumerate(lines, 1) if ln.startswith('metric ='))}"


@case(CFG, match="field 'metric': a metric needs validation 'data'")
def cfg_metric_without_data(w: Work) -> str:
    lines = [ln for ln in w.cfg.read_text().split("\n") if not ln.startswith(("label", "data "))]
    w.cfg.write_text("\n".join(lines))
    return f"opt.cfg:{next(i for i, ln in enumerate(lines, 1) if ln.startswith('metric ='))}"


@case(CFG, match="layer id 99 names no layer of the graph")
def cfg_qinvariant_layer_missing(w: Work) -> str:
    return _cfg_line(w, "set_qinvariant_for_start_nodes", "[99]")


@case(CFG, match="layer 2 .* is a Convolution layer; only Input and Constant")
def cfg_qinvariant_not_a_start_layer(w: Work) -> str:
    return _cfg_line(w, "set_qinvariant_for_start_nodes", "[2]")


@case(CFG, match=r"field 'activation_bits': layer-id range \(50,60\) names no layer")
def cfg_per_layer_range_names_no_layer(w: Work) -> str:
    return _cfg_line(w, "activation_bits", "8 & <[(50,60)]:16>")


@case(CFG, match=r"field 'fake_quant_scopes_for_debug': layer-id range \(40,41\) names no layer")
def cfg_fake_quant_scope_names_no_layer(w: Work) -> str:
    return _cfg_line(w, "fake_quant_scopes_for_debug", "[(1,2),(40,41)]")


@case(CFG, match=r"field 'global_calibration': layer-id range \(70,80\) names no layer")
def cfg_global_calibration_scope_names_no_layer(w: Work) -> str:
    return _cfg_line(w, "global_calibration", "bias_correction[][(70,80)]")


@case(CFG, match=r"malformed line 'x{120}\.\.\. \(10000 characters\)'")
def cfg_long_bad_line_is_clipped(w: Work) -> str:
    w.cfg.write_text(w.cfg.read_text() + "x" * 10000 + "\n")
    return f"opt.cfg:{len(w.cfg.read_text().splitlines())}"


@case(CFG, match="not UTF-8 text")
def cfg_latin1_text(w: Work) -> str:
    w.cfg.write_bytes(w.cfg.read_bytes() + "# caf\xe9\n".encode("latin-1"))
    return "opt.cfg"


@case(CFG, match="no \\[Common\\] section")
def cfg_empty_file(w: Work) -> str:
    w.cfg.write_text("")
    return "opt.cfg"


@case(CFG, match="unknown section \\[Comon\\]")
def cfg_misspelled_section(w: Work) -> str:
    w.cfg.write_text(w.cfg.read_text().replace("[Common]", "[Comon]"))
    return "opt.cfg:1"


@case(CFG, match="field 'featuremap_splits_item_x': invalid value '0' .*expected an integer in \\[1, 127\\]")
def cfg_compiler_field_out_of_range(w: Work) -> str:
    return _cfg_line(w, "featuremap_splits_item_x", "0")


@case(CFG, match="unknown calibration strategy 'magic'")
def cfg_unknown_strategy(w: Work) -> str:
    return _cfg_line(w, "calibration_strategy_for_activation", "magic")


@case(CFG, match="need lo <= 0 <= hi")
def cfg_bad_trim(w: Work) -> str:
    return _cfg_line(w, "trim_infinity_before_statistic", "clip(5, 3)")


@case(CFG, match="field 'activation_bits'.*out of range")
def cfg_activation_bits_out_of_range(w: Work) -> str:
    return _cfg_line(w, "activation_bits", "3")


@case(CFG, match="field 'opt_config'.*no such file")
def cfg_opt_config_missing(w: Work) -> str:
    return _cfg_line(w, "opt_config", "nope.json")


@case(PLUGIN, match="TopKMetric: K must be a positive integer")
def cfg_metric_bad_argument(w: Work) -> str:
    w.cfg_set("metric", "TopKMetric(abc)")
    return "TopKMetric"


# ============================================================================================ data files
def _edit_npy(w: Work, name: str, edit: Callable[[np.ndarray], np.ndarray]) -> str:
    path = w.root / "data" / name
    np.save(path, edit(np.load(path)))
    return name


def _set_nan(x: np.ndarray, index: int) -> np.ndarray:
    x = x.copy()
    x[index] = np.nan
    return x


@case(DATA, match="contains NaN at sample 3")
def data_nan_in_calibration(w: Work) -> str:
    return _edit_npy(w, "calib.npy", lambda x: _set_nan(x, 3))


@case(DATA, match="contains NaN at sample 15")
def data_nan_late_in_validation(w: Work) -> str:
    return _edit_npy(w, "val.npy", lambda x: _set_nan(x, 15))


@case(DATA, match=r"samples have shape \[3, 3\] but the IR expects \[1, 8, 8\]")
def data_calibration_wrong_shape(w: Work) -> str:
    return _edit_npy(w, "calib.npy", lambda x: np.zeros((8, 3, 3), np.float32))


@case(DATA, match="holds no samples")
def data_calibration_empty(w: Work) -> str:
    return _edit_npy(w, "calib.npy", lambda x: x[:0])


@case(DATA, match="not a NumPy .npy or .npz file")
def data_calibration_not_npy(w: Work) -> str:
    (w.root / "data" / "calib.npy").write_text("hello")
    return "calib.npy"


@case(DATA, match="object \\(pickled\\) array")
def data_calibration_pickled(w: Work) -> str:
    np.save(w.root / "data" / "calib.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return "calib.npy"


@case(DATA, match="the label array has 5 samples but the data file")
def data_labels_too_few(w: Work) -> str:
    return _edit_npy(w, "val_label.npy", lambda y: y[:5])


@case(DATA, match=r"TopKMetric: label 50 \(sample 0 of the batch\) is not a class index in \[0, 9\]")
def data_labels_out_of_range(w: Work) -> str:
    return _edit_npy(w, "val_label.npy", lambda y: np.full_like(y, 50))


@case(DATA, match=r"TopKMetric: label -1 .* is not a class index")
def data_labels_negative(w: Work) -> str:
    return _edit_npy(w, "val_label.npy", lambda y: np.where(np.arange(len(y)) == 4, -1, y))


@case(DATA, match=r"TopKMetric: label \d+\.5 .* is not a whole class index")
def data_labels_fractional(w: Work) -> str:
    return _edit_npy(w, "val_label.npy", lambda y: y.astype(np.float32) + 0.5)


@case(DATA, match="labels of this batch contain NaN")
def data_labels_nan(w: Work) -> str:
    return _edit_npy(w, "val_label.npy", lambda y: _set_nan(y.astype(np.float32), 2))


# ============================================================================================ op params at run time
def _layer_loc(w: Work, layer: str) -> str:
    return w.loc(w.section(layer).start + 1)


@case(IR, match=r"perm \[\] is not a permutation of the 4 input axes")
def op_transpose_perm_empty(w: Work) -> str:
    w.set("input_post_transpose", "perm", "[]")
    return _layer_loc(w, "input_post_transpose")


@case(IR, command="run", match=r"perm \[0, 1, 1, 3\] is not a permutation")
def op_transpose_perm_repeats_an_axis(w: Work) -> str:
    w.set("input_post_transpose", "perm", "[0,1,1,3]")
    return _layer_loc(w, "input_post_transpose")


@case(IR, match=r"perm \[0, 1, 2, 7\] is not a permutation")
def op_transpose_perm_axis_out_of_range(w: Work) -> str:
    w.set("input_post_transpose", "perm", "[0,1,2,7]")
    return _layer_loc(w, "input_post_transpose")


@case(IR, match=r"shape \[1, 7\] cannot hold the 64 elements of the input \[1, 2, 2, 16\]")
def op_reshape_wrong_element_count(w: Work) -> str:
    w.set(FLATTEN, "shape", "[1,7]")
    return _layer_loc(w, FLATTEN)


@case(IR, command="run", match=r"shape \[-1, -1\]: dims must be >= 0, with at most one -1")
def op_reshape_two_inferred_dims(w: Work) -> str:
    w.set(FLATTEN, "shape", "[-1,-1]")
    return _layer_loc(w, FLATTEN)


@case(IR, match=r"give an output of \[8, 2000000007\] \(HW\) but layer_top_shape says \[8, 8\]")
def op_conv_huge_pad(w: Work) -> str:
    w.set(CONV1, "pad_left", "2000000000")
    return _layer_loc(w, CONV1)


@case(IR, command="run", match=r"give an output of \[4, 8\] \(HW\) but layer_top_shape says \[8, 8\]")
def op_conv_stride_disagrees_with_top_shape(w: Work) -> str:
    w.set(CONV2, "stride_y", "2")
    return _layer_loc(w, CONV2)


@case(IR, match="axis 5 is out of range for a 2-D input")
def op_softmax_axis_out_of_range(w: Work) -> str:
    w.set(SOFTMAX, "axis", "5")
    return _layer_loc(w, SOFTMAX)


def case_ids() -> List[str]:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "case names must be unique"
    assert all(re.fullmatch(r"[a-z0-9_]+", i) for i in ids)
    return ids
