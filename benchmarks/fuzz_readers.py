"""Random mutation campaigns against quantopt's readers: the IR text, the IR .bin, the cfg and the opt_config JSON.

    python benchmarks/fuzz_readers.py [--mutations N] [--seed S] [--timeout SEC] [--targets ir-text,ir-bin,cfg,...]

Each campaign starts from the bundled digits example (its float IR and the quantized IR, the per-layer JSON and the
cfg of a run), applies 1-3
random mutations per case (lines deleted, duplicated, swapped, split or joined; values replaced by hostile tokens such
as nan, 1e308, [[, huge integers or dtype names; keys renamed; characters flipped; text cut short; bytes of the
.bin flipped, cut, extended or overwritten with NaN) and reads the result. Every case must end in a value or in one
of quantopt's errors (`QuantOptError`); anything else is an internal error, and a read that runs past `--timeout`
seconds is a hang. The script prints, per campaign, how many cases were accepted, refused (by exit code) or failed,
with one example per distinct internal error; it exits with status 1 when there was any internal error or hang.

The cases are deterministic for a given --seed. tests/test_fuzz_readers.py runs a short property-based version of
the same idea in the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from contextlib import redirect_stderr
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digits"
sys.path.insert(0, str(REPO))

from quantopt.errors import QuantOptError  # noqa: E402

TOKENS = ["nan", "-nan", "inf", "-inf", "1e308", "-1e308", "1e-400", "-1", "0", "1", "-0", "1.5", "2147483648",
          "99999999999999999999", "-99999999999999999999", "[]", "[[]]", "[", "]", "[[", "]]", "[1,]", "[,]", "[,1]",
          "[[1,2],[3]]", "[1,[2]]", "[a [b]]", "[1]x", "abc", "None", "none", "true", "false", "True", "float32",
          "int8", "uint4", "dtype.int8", "bfloat16", "aligned_int12", "float8_e4m3fn", "bool", "float33", "", " ",
          "=", "a=b", "[a=b]", "0x10", "[[1,8,8,8]]", "[[1,8,8,8],[1]]", "[float32,int8]", "[-1]", "[2147483648]",
          "[[0,255]]", "[nan]", "[[nan,inf]]", "[0,2,3,1]", "[1,64]", "RELU", "MAX", "é", "\x00", "\t", "#", "[" * 50,
          "]" * 50, "1" * 400, "[" * 5000 + "]" * 5000, "\udcff", "\udc80abc",
          "[" + "9" * 30 + "]", "[[0," + "9" * 30 + "]]", "[[1,99999999999,99999999999]]"]
IR_KEYS = ["layer_id", "layer_name", "layer_type", "layer_bottom", "layer_bottom_shape", "layer_bottom_type",
           "layer_top", "layer_top_shape", "layer_top_type", "layer_top_range", "layer_top_scale", "layer_top_zp",
           "weights_type", "weights_offset", "weights_size", "weights_shape", "biases_type", "biases_offset",
           "biases_size", "biases_shape", "layer_top_scale_type", "layer_top_scale_offset", "layer_top_scale_size",
           "layer_top_scale_shape", "lut_type", "lut_offset", "lut_size", "lut_shape", "kernel_x", "stride_y",
           "pad_left", "group", "with_activation", "method", "axis", "perm", "shape", "is_perf_mode", "unquantifiable",
           "scale_value", "shift_value", "weights_scale", "input_tensors", "output_tensors", "model_name",
           "layer_number", "model_bin", "subgraph_name", "D_cos", "unknown_key", "x"]
LAYER_TYPES = ["Input", "Convolution", "DepthwiseConv", "Pooling", "Reshape", "FullyConnected", "Softmax",
               "Transpose", "Eltwise", "Activation", "Concat", "Constant", "softmax", "NoSuchType", "Bad-Type", ""]
CHARS = list("[]=,#\n\r\t \x00\x0b\x0c-+.e01x_") + ["\u2028", "\u00e9", "\ufeff", "\udcff", "\udcc3"]
"""Characters inserted or substituted; the lone surrogates become undecodable bytes (0xff, 0xc3) in the file."""


class Timeout(Exception):
    """Raised by the alarm when one case runs past the per-case limit (a hang)."""


@dataclass
class Campaign:
    name: str
    cases: int = 0
    accepted: int = 0
    refused: Counter = field(default_factory=Counter)
    internal: Dict[str, Tuple[int, str]] = field(default_factory=dict)
    hangs: List[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def internal_count(self) -> int:
        return sum(n for n, _ in self.internal.values())


# ------------------------------------------------------------------------------------------------ mutations
def mutate_lines(rng: random.Random, text: str, keys: Sequence[str]) -> Tuple[str, str]:
    """One random line- or character-level change of a `key=value` text; returns (new text, what was done)."""
    lines = text.split("\n")
    i = rng.randrange(len(lines))
    op = rng.randrange(14)
    if op == 0 and "=" in lines[i]:
        key = lines[i].split("=", 1)[0]
        tok = rng.choice(TOKENS)
        lines[i] = f"{key}={tok}"
        return "\n".join(lines), f"line {i + 1}: value -> {tok!r}"
    if op == 1:
        del lines[i]
        return "\n".join(lines), f"line {i + 1} deleted"
    if op == 2:
        j = rng.randrange(len(lines))
        lines.insert(j, lines[i])
        return "\n".join(lines), f"line {i + 1} copied before line {j + 1}"
    if op == 3:
        j = rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines), f"lines {i + 1} and {j + 1} swapped"
    if op == 4:
        line = f"{rng.choice(keys)}={rng.choice(TOKENS)}"
        lines.insert(i, line)
        return "\n".join(lines), f"line {line!r} inserted at {i + 1}"
    if op == 5:
        cut = rng.randrange(len(text) + 1)
        return text[:cut], f"cut at byte {cut}"
    if op == 6:
        pos = rng.randrange(len(text) + 1)
        ch = rng.choice(CHARS)
        kind = rng.randrange(3)
        if kind == 0:
            return text[:pos] + ch + text[pos:], f"{ch!r} inserted at {pos}"
        if kind == 1:
            return text[:pos] + text[pos + 1:], f"char at {pos} deleted"
        return text[:pos] + ch + text[pos + 1:], f"char at {pos} -> {ch!r}"
    if op == 7 and "=" in lines[i]:
        value = lines[i].split("=", 1)[1]
        key = rng.choice(keys)
        lines[i] = f"{key}={value}"
        return "\n".join(lines), f"line {i + 1}: key -> {key}"
    if op == 8:
        lines.insert(i, "")
        return "\n".join(lines), f"blank line inserted at {i + 1}"
    if op == 9:
        blanks = [k for k, ln in enumerate(lines) if not ln.strip()]
        if blanks:
            k = rng.choice(blanks)
            del lines[k]
            return "\n".join(lines), f"blank line {k + 1} removed"
    if op == 10 and "=" in lines[i]:
        key, value = lines[i].split("=", 1)
        digits = [k for k, c in enumerate(value) if c.isdigit()]
        if digits:
            k = rng.choice(digits)
            new = value[:k] + str(rng.choice([0, 1, 3, 7, 9, 1000000, 2 ** 31, 2 ** 63])) + value[k + 1:]
            lines[i] = f"{key}={new}"
            return "\n".join(lines), f"line {i + 1}: number changed to {new!r}"
    if op == 11:
        types = [k for k, ln in enumerate(lines) if ln.startswith("layer_type=")]
        if types:
            k = rng.choice(types)
            t = rng.choice(LAYER_TYPES)
            lines[k] = f"layer_type={t}"
            return "\n".join(lines), f"line {k + 1}: layer_type -> {t!r}"
    if op == 13:
        depth = rng.choice([100, 1000, 100000])
        return text[:len(text) // 2] + "[" * depth + "]" * depth + text[len(text) // 2:], f"{depth} nested brackets"
    if op == 12 and "=" in lines[i]:
        key, value = lines[i].split("=", 1)
        lines[i] = f"{key}={value}{rng.choice(TOKENS)}"
        return "\n".join(lines), f"line {i + 1}: text appended to the value"
    return mutate_lines(rng, text, keys)


def mutate_bin(rng: random.Random, data: bytes) -> Tuple[bytes, str]:
    """One random change of the .bin's bytes."""
    op = rng.randrange(6)
    if op == 0:
        cut = rng.randrange(len(data) + 1)
        return data[:cut], f"cut to {cut} bytes"
    if op == 1 and data:
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b), "random bytes changed"
    if op == 2 and len(data) >= 4:
        b = bytearray(data)
        pos = rng.randrange(0, len(b) - 3) & ~3
        special = rng.choice([np.nan, np.inf, -np.inf, 3.4e38, -0.0])
        b[pos:pos + 4] = np.array([special], dtype="<f4").tobytes()
        return bytes(b), f"float32 {special} written at {pos}"
    if op == 3:
        extra = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        return data + extra, f"{len(extra)} bytes appended"
    if op == 4:
        return b"", "emptied"
    if op == 5 and data:
        start = rng.randrange(len(data))
        end = min(len(data), start + rng.randint(1, 512))
        return data[:start] + bytes(end - start) + data[end:], f"bytes [{start}, {end}) zeroed"
    return mutate_bin(rng, data)


JSON_VALUES: List[Any] = [None, True, False, 0, -1, 1, 8, 16, 1.5, 1e308, float("nan"), "abc", "", "8", "true",
                          "per_tensor_symmetric_restricted_range", "extrema", [], {}, [1, 2], {"a": 1}, [[[]]],
                          "RELU", 2 ** 64]


def mutate_json(rng: random.Random, text: str, layer_names: Sequence[str]) -> Tuple[str, str]:
    """One random change of the per-layer JSON: in its structure (values, keys, layers) or in its text."""
    op = rng.randrange(7)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # an earlier text mutation broke the JSON: go on in the text
        op = 5
    if op >= 5:
        mutated, what = mutate_lines(rng, text, ['"q_bits_activation"', '"layer_id"', '"x"'])
        return mutated, "text: " + what
    if not isinstance(data, dict) or not data:
        return json.dumps(rng.choice(JSON_VALUES)), "root replaced"
    name = rng.choice(list(data))
    entry = data[name]
    if op == 0 and isinstance(entry, dict) and entry:
        key = rng.choice(list(entry))
        entry[key] = rng.choice(JSON_VALUES)
        what = f"{name}.{key} -> {entry[key]!r}"
    elif op == 1 and isinstance(entry, dict) and entry:
        key = rng.choice(list(entry))
        del entry[key]
        what = f"{name}.{key} deleted"
    elif op == 2:
        data[rng.choice([name + "x", "", "no_such_layer", rng.choice(list(layer_names))])] = rng.choice(JSON_VALUES)
        what = "layer entry added"
    elif op == 3:
        data[name] = rng.choice(JSON_VALUES)
        what = f"{name} replaced"
    else:
        if isinstance(entry, dict):
            entry[rng.choice(["q_bits_weight", "unknown_key", "layer_type", "trigger_float_op"])] = rng.choice(
                JSON_VALUES)
        what = f"{name}: key added"
    return json.dumps(data, allow_nan=True), what


# ------------------------------------------------------------------------------------------------ running
def _on_alarm(signum: int, frame: Any) -> None:
    raise Timeout()


def run_case(campaign: Campaign, action: Callable[[], Any], what: str, timeout: float) -> None:
    campaign.cases += 1
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with redirect_stderr(StringIO()):
            action()
        campaign.accepted += 1
    except Timeout:
        campaign.hangs.append(what)
    except QuantOptError as e:
        campaign.refused[type(e).__name__] += 1
    except Exception as e:  # an internal error: what this script counts
        frames = traceback.extract_tb(e.__traceback__)
        top = next((f for f in reversed(frames) if "quantopt" in f.filename), frames[-1] if frames else None)
        key = f"{type(e).__name__} at {Path(top.filename).name}:{top.lineno}" if top else type(e).__name__
        count, example = campaign.internal.get(key, (0, f"{what}: {type(e).__name__}: {str(e)[:160]}"))
        campaign.internal[key] = (count + 1, example)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def prepare(folder: Path) -> Dict[str, Any]:
    """The digits example with a small data set, and the per-layer JSON one run of it writes."""
    from quantopt.cli import main as quantopt_main

    shutil.copytree(EXAMPLE / "model", folder / "model")
    (folder / "data").mkdir()
    for name, n in (("calib.npy", 8), ("val.npy", 16), ("val_label.npy", 16)):
        np.save(folder / "data" / name, np.load(EXAMPLE / "data" / name)[:n])
    cfg = (EXAMPLE / "opt.cfg").read_text().replace("calibration_batch_size = 16", "calibration_batch_size = 8")
    cfg = cfg.replace("metric_batch_size = 64", "metric_batch_size = 16")
    (folder / "opt.cfg").write_text(cfg)
    with redirect_stderr(StringIO()):
        code = quantopt_main(["--cfg", str(folder / "opt.cfg"), "--log-level", "error"])
    if code != 0:
        raise SystemExit(f"the digits example does not run (exit code {code})")
    out = folder / "opt_log"
    return {"irs": [((folder / "model" / "digits.txt").read_text(), (folder / "model" / "digits.bin").read_bytes()),
                    ((out / "digits_o.txt").read_text(), (out / "digits_o.bin").read_bytes())],
            "cfg": cfg, "json": (out / "digits_opt_template.json").read_text()}


def campaigns(base: Dict[str, Any], folder: Path, targets: Sequence[str], n: int, seed: int, timeout: float
              ) -> List[Campaign]:
    from quantopt.config.layer_settings import OptConfig
    from quantopt.config.reader import read_cfg
    from quantopt.ir.reader import read_ir

    layer_names = [ln.split("=", 1)[1] for ln in base["irs"][0][0].split("\n") if ln.startswith("layer_name=")]
    cfg_keys = [ln.split("=", 1)[0].strip() for ln in base["cfg"].split("\n") if "=" in ln]
    from quantopt.config.fields import FIELDS
    cfg_keys += list(FIELDS)[:40] + ["grpah", "unknown"]
    out = []
    work = folder / "cases"
    work.mkdir()
    for target in targets:
        rng = random.Random(f"{seed}:{target}")
        campaign = Campaign(target)
        start = time.perf_counter()
        for k in range(n):
            case_dir = work / f"{target}-{k}"
            (case_dir / "model").mkdir(parents=True)
            txt, binp = case_dir / "model" / "digits.txt", case_dir / "model" / "digits.bin"
            steps = rng.randint(1, 3)
            what: List[str] = []
            if target in ("ir-text", "ir-bin"):
                text, data = rng.choice(base["irs"])  # the float IR or the quantized one a run writes
                for _ in range(steps):
                    if target == "ir-text":
                        text, w = mutate_lines(rng, text, IR_KEYS)
                    else:
                        data, w = mutate_bin(rng, data)
                    what.append(w)
                txt.write_text(text, encoding="utf-8", errors="surrogateescape")
                binp.write_bytes(data)
                run_case(campaign, lambda p=str(txt): read_ir(p), "; ".join(what), timeout)
            elif target == "cfg":
                text = base["cfg"]
                for _ in range(steps):
                    text, w = mutate_lines(rng, text, cfg_keys)
                    what.append(w)
                for name in ("model", "data"):
                    shutil.rmtree(case_dir / name, ignore_errors=True)
                    os.symlink(folder / name, case_dir / name)
                path = case_dir / "opt.cfg"
                path.write_text(text, encoding="utf-8", errors="surrogateescape")
                run_case(campaign, lambda p=str(path): read_cfg(p), "; ".join(what), timeout)
            elif target == "opt-config":
                text = base["json"]
                for _ in range(steps):
                    text, w = mutate_json(rng, text, layer_names)
                    what.append(w)
                path = case_dir / "opt.json"
                path.write_text(text, encoding="utf-8", errors="surrogateescape")
                run_case(campaign, lambda p=str(path): OptConfig.load(p, layer_names), "; ".join(what), timeout)
            else:
                raise SystemExit(f"unknown target '{target}'")
            shutil.rmtree(case_dir)
        campaign.seconds = time.perf_counter() - start
        out.append(campaign)
    return out


def report(results: Sequence[Campaign]) -> str:
    lines = [f"{'campaign':<11} {'cases':>7} {'accepted':>9} {'refused':>8} {'internal':>9} {'hangs':>6} {'s':>7}"]
    for c in results:
        lines.append(f"{c.name:<11} {c.cases:>7} {c.accepted:>9} {sum(c.refused.values()):>8} {c.internal_count:>9} "
                     f"{len(c.hangs):>6} {c.seconds:>7.1f}")
    for c in results:
        if c.refused:
            lines.append(f"{c.name}: refused as " + ", ".join(f"{k} {v}" for k, v in c.refused.most_common()))
        for key, (count, example) in sorted(c.internal.items()):
            lines.append(f"{c.name}: INTERNAL {key} x{count}: {example}")
        for what in c.hangs[:5]:
            lines.append(f"{c.name}: HANG: {what}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mutations", type=int, default=1000, help="cases per campaign (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds one case may take before it counts as a hang")
    p.add_argument("--targets", default="ir-text,ir-bin,cfg,opt-config",
                   help="comma-separated campaigns: ir-text, ir-bin, cfg, opt-config")
    args = p.parse_args(argv)
    signal.signal(signal.SIGALRM, _on_alarm)
    with tempfile.TemporaryDirectory(prefix="quantopt-fuzz-") as tmp:
        folder = Path(tmp)
        base = prepare(folder)
        results = campaigns(base, folder, [t.strip() for t in args.targets.split(",") if t.strip()],
                            args.mutations, args.seed, args.timeout)
    print(report(results))
    return 1 if any(c.internal or c.hangs for c in results) else 0


if __name__ == "__main__":
    sys.exit(main())
