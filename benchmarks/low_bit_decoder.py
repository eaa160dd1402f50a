"""Benchmark: low-bit and float-format recipes on a small GPT-style decoder trained here, with perplexity on held-out
text against float (docs/low-bit.md).

    python benchmarks/low_bit_decoder.py [--steps 400] [--seq 64] [--eval 16] [--block 32] [--markdown FILE]
                                         [--only TEXT]

A 2-layer character-level decoder (byte vocabulary, d=96, 4 heads, causal mask) is trained for `--steps` steps on
a frozen snapshot of this repository's docs (benchmarks/data/decoder_train.txt.gz; seeded, one thread, about a
minute), exported to ONNX, imported by quantopt and quantized with several recipes on 8 training sequences; each
recipe's perplexity on `--eval` held-out sequences (the snapshot's user guide, decoder_heldout.txt.gz, never trained
on) is printed next to float's, with the mean KL divergence of its
next-character distribution from float's. Everything is seeded: the figures repeat run to run on one machine.
"""
from __future__ import annotations

import argparse
import gzip
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantopt.frontends.onnx import import_onnx  # noqa: E402
from quantopt.graph.values import to_float  # noqa: E402
from quantopt.pipeline import quantize_model  # noqa: E402

VOCAB = 256


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.register_buffer("causal", torch.triu(torch.full((seq, seq), -1e4), diagonal=1).reshape(1, 1, seq, seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + self.causal, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, dim: int = 96, heads: int = 4, layers: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads, seq) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.blocks(self.embed(ids) + self.pos)))


def corpus() -> Tuple[np.ndarray, np.ndarray]:
    """(training bytes, held-out bytes): a frozen snapshot of this repository's docs (benchmarks/data/decoder_*.txt.gz,
    the user guide held out), so the figures do not move when the docs change."""
    data = ROOT / "benchmarks" / "data"
    train = gzip.decompress((data / "decoder_train.txt.gz").read_bytes())
    held = gzip.decompress((data / "decoder_heldout.txt.gz").read_bytes())
    return np.frombuffer(train, np.uint8), np.frombuffer(held, np.uint8)


def windows(data: np.ndarray, seq: int, count: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.integers(0, len(data) - seq - 1, count)
    return np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64)


def train(model: TinyGPT, data: np.ndarray, steps: int, seq: int) -> float:
    rng = np.random.default_rng(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = torch.from_numpy(windows(data, seq, 32, rng))
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return float(loss.detach())


def export(model: TinyGPT, seq: int, folder: Path) -> Path:
    path = folder / "tiny_gpt.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (torch.zeros(1, seq, dtype=torch.int64),), str(path), input_names=["ids"],
                          output_names=["logits"], opset_version=14, dynamo=False, do_constant_folding=True)
    return path


def fc_layers(graph) -> List[str]:
    return [n.name for n in graph.nodes if str(n.type) == "FullyConnected"]


def recipes(block: int) -> Dict[str, Callable[[List[str]], Tuple[dict, dict, Optional[str]]]]:
    """recipe name -> f(FullyConnected layer names) -> (settings, per-layer settings, global_calibration)."""
    def weight_only(trigger: str, bits: int, mode: str, gcal: Optional[str] = None):
        def make(fcs: List[str]):
            layer = {"trigger_float_op": trigger, "q_bits_weight": bits, "q_mode_weight": mode,
                     "weight_block_size": block}
            return {"q_bits_activation": 16, "q_bits_bias": 48, "lut_items_in_bits": 10}, \
                {name: dict(layer) for name in fcs}, gcal
        return make

    def fp8_activations(quant_type: str, mode: str = "per_tensor_symmetric_restricted_range"):
        """fp8 activations where upstream has fp8 kernels (FullyConnected and MatMul here), 16-bit integers
        elsewhere (the fp8 layers take their own bits)."""
        def make(fcs: List[str]):
            return {"quant_type": quant_type, "q_mode_weight": mode, "q_bits_activation": 16, "q_bits_weight": 16,
                    "q_bits_bias": 48, "lut_items_in_bits": 10}, {}, None
        return make

    return {
        "w8a8 (int8, per-channel weights)": lambda fcs: (
            {"q_mode_weight": "per_channel_symmetric_restricted_range"}, {}, None),
        "w16a16": lambda fcs: ({"q_bits_activation": 16, "q_bits_weight": 16, "q_bits_bias": 48,
                                "lut_items_in_bits": 10}, {}, None),
        "w8afp16, per-channel": weight_only("float16_act_int_wht", 8, "per_channel_symmetric_restricted_range"),
        "w4afp16, per-channel": weight_only("float16_act_int_wht", 4, "per_channel_symmetric_restricted_range"),
        f"w4afp16, blocks of {block}": weight_only("float16_act_int_wht", 4, "per_block_symmetric_restricted_range"),
        f"w4afp16, blocks of {block}, asymmetric": weight_only("float16_act_int_wht", 4, "per_block_asymmetric"),
        f"wfp4afp16, blocks of {block}": weight_only("float16_act_fp4e2m1fn_wht", 4,
                                                     "per_block_symmetric_restricted_range"),
        "fp8e4m3 weights afp16, per-channel": weight_only("float16_act_fp8e4m3fn_wht", 8,
                                                          "per_channel_symmetric_restricted_range"),
        f"w4afp16, blocks of {block} + GPTQ": weight_only("float16_act_int_wht", 4,
                                                          "per_block_symmetric_restricted_range", "gptq_zy[8]"),
        f"w4afp16, blocks of {block} + AWQ": weight_only("float16_act_int_wht", 4,
                                                         "per_block_symmetric_restricted_range", "awq_zy[20,0.2]"),
        f"w4afp16, blocks of {block} + AWQ + GPTQ": weight_only(
            "float16_act_int_wht", 4, "per_block_symmetric_restricted_range", "awq_zy[20,0.2] & gptq_zy[8]"),
        f"wfp4afp16, blocks of {block} + GPTQ": weight_only("float16_act_fp4e2m1fn_wht", 4,
                                                            "per_block_symmetric_restricted_range", "gptq_zy[8]"),
        "wfp8e4m3afp8e4m3 (fp8 FC/MatMul, others int16)": fp8_activations("wfp8e4m3afp8e4m3"),
        "wfp8e4m3afp8e4m3, per-channel weights": fp8_activations("wfp8e4m3afp8e4m3",
                                                                 "per_channel_symmetric_restricted_range"),
        "wfp8e5m2afp8e5m2 (fp8 FC/MatMul, others int16)": fp8_activations("wfp8e5m2afp8e5m2"),
        "w4afp8e4m3, per-channel (fp8 FC, others int16)": fp8_activations("w4afp8e4m3",
                                                                          "per_channel_symmetric_restricted_range"),
    }


def evaluate(graph, batches: List[np.ndarray], quantized: bool, reference: Optional[List[np.ndarray]] = None) \
        -> Tuple[float, float, List[np.ndarray]]:
    """(perplexity, mean KL from the reference distributions, log-probabilities per batch)."""
    nll, count, kl, logps = 0.0, 0, 0.0, []
    for i, seq in enumerate(batches):
        outs = graph.forward([torch.from_numpy(seq[:-1][None])])
        logits = (to_float(graph.output_tensors[0]) if quantized else outs[0]).to(torch.float64)[0]
        logp = torch.log_softmax(logits, dim=-1)
        nll -= float(logp[torch.arange(len(seq) - 1), torch.from_numpy(seq[1:])].sum())
        count += len(seq) - 1
        if reference is not None:
            ref = torch.from_numpy(reference[i])
            kl += float((ref.exp() * (ref - logp)).sum(dim=-1).mean())
        logps.append(logp.numpy())
    return math.exp(nll / count), kl / len(batches), logps


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--eval", type=int, default=16)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--only", default="", help="run only the recipes whose name contains this text")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train_bytes, held_out = corpus()
    model = TinyGPT(seq=args.seq)
    t0 = time.process_time()
    loss = train(model, train_bytes, args.steps, args.seq)
    print(f"trained {args.steps} steps in {time.process_time() - t0:.0f} s CPU, final training loss {loss:.3f}",
          flush=True)
    eval_batches = list(windows(held_out, args.seq, args.eval, np.random.default_rng(1)))
    calib = [[torch.from_numpy(w[:-1][None])] for w in windows(train_bytes, args.seq, 8, np.random.default_rng(2))]
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = export(model, args.seq, Path(tmp))
        float_graph = import_onnx(onnx_path, name="tiny_gpt")
        ppl, _, reference = evaluate(float_graph, eval_batches, quantized=False)
        rows = [("float (quantopt's float forward)", ppl, 0.0)]
        print(f"{'float':<40} perplexity {ppl:8.3f}", flush=True)
        for name, make in recipes(args.block).items():
            if args.only not in name:
                continue
            graph = import_onnx(onnx_path, name="tiny_gpt")
            settings, per_layer, gcal = make(fc_layers(graph))
            q = quantize_model(graph, calib, settings=settings, per_layer=per_layer, global_calibration=gcal)
            ppl_q, kl, _ = evaluate(q, eval_batches, quantized=True, reference=reference)
            rows.append((name, ppl_q, kl))
            print(f"{name:<40} perplexity {ppl_q:8.3f}  KL from float {kl:.5f}", flush=True)
    table = ["| recipe | perplexity (held-out) | mean KL from float |", "|---|---|---|"]
    table += [f"| {name} | {p:.3f} | {k:.5f} |" for name, p, k in rows]
    if args.markdown:
        args.markdown.write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
