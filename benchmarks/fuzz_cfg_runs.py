"""Random valid cfgs through whole `quantopt --cfg` runs: options that are each tested alone, combined.

    python benchmarks/fuzz_cfg_runs.py [--cases N] [--seed S] [--models corpus,onnx] [--timeout SEC] [--layer-edits]

Each case picks a model (a golden-corpus IR of tests/data/golden_corpus with its calibration samples, or an ONNX
model of tests/data/onnx_small with seeded random inputs: token ids for the transformers) and 1-6 fields from a
list of valid values (strategies, modes, bits, global methods, quant types, integer forms, batch sizes,
modify_batch_dim, the QDQ export, graph passes, dumps, ...), and runs `quantopt --cfg` in a process of its own. It
must exit 0 or with one of quantopt's documented error codes (2-7) on one `[ERROR]` line; an internal error
(`internal error:`), a traceback, a run past --timeout, or a failed run that left an IR, template, report or
export behind is a failure. A run that succeeds is checked further:
  - `opt_config = <the written template>` gives the same IR bytes (the per-layer JSON holds every decision);
  - `statistic_file = <the saved statistics>` gives the same IR bytes (the statistics file replaces the pass);
  - the same cfg on one thread (OMP_NUM_THREADS = MKL_NUM_THREADS = 1) gives the same IR bytes as the first run on
    the default thread count (outputs do not depend on the thread count, docs/architecture.md);
  - `quantopt run` of the written IR on the calibration inputs at a random --batch-size (with --dequantize and
    --dump-all half of the time each) exits 0 or with an error code (a batch size the IR cannot take is a one-line
    error);
  - with --layer-edits, 1-3 per-layer values of 1-4 layers of the written template are changed (bits, modes,
    strategies, float islands, ...) and the run is made again with it as `opt_config`: it must exit 0 or with an
    error code, its IR must run, and each edit must be in the template it writes unless its log names the layer
    (a per-layer value is never dropped silently);
  - with --metrics, the case runs again with a metric on labelled data (labels: the dequantized outputs of
    `quantopt run`), a random metric_batch_size and, half of the time, mixed_precision_auto_search: it must exit 0
    or with an error code, and evaluate the metric when it exits 0.
It prints one JSON line per case and a summary, and exits 1 when any case failed. The cases are deterministic for
a given --seed (the machine's speed decides only the timeouts). Findings and fixes: docs/robustness.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "data" / "golden_corpus"
ONNX_SMALL = REPO / "tests" / "data" / "onnx_small"
ERROR_CODES = (2, 3, 4, 5, 6, 7)

PER_TENSOR = ["per_tensor_symmetric_restricted_range", "per_tensor_symmetric_full_range", "per_tensor_asymmetric"]
OPTIONS: Dict[str, List[str]] = {
    "calibration_batch_size": ["1", "2", "3", "5"],
    "quantize_method_for_weight": PER_TENSOR + ["per_channel_symmetric_restricted_range",
                                                "per_channel_symmetric_full_range", "per_channel_asymmetric"],
    "quantize_method_for_activation": PER_TENSOR + ["per_channel_symmetric_restricted_range",
                                                    "per_channel_symmetric_full_range"],
    "weight_bits": ["4", "8", "16"],
    "activation_bits": ["8", "16"],
    "bias_bits": ["16", "32", "48"],
    "calibration_strategy_for_activation": ["extrema", "mean", "3std", "percentile", "kld", "aciq_laplace",
                                            "aciq_gauss", "weighted_scale_param", "quantile[99.9]", "mse",
                                            "0.9percentile"],
    "calibration_strategy_for_weight": ["extrema", "3std", "mse", "aciq_gauss"],
    "global_calibration": ["none", "bias_correction", "easy_quant", "adaround[2]", "mvn_correction",
                           "smooth_quant_zy", "svd_quant", "adaquant_zy[2]", "gptq_zy", "awq_zy"],
    "similarity_data_num": ["1", "2"],
    "quant_type": ["disable", "w8a8", "w16a16", "fp16", "w4afp16", "w8afp16", "bf16"],
    "preset": ["none", "accurate"],
    "running_statistic_momentum": ["0.5", "1.0"],
    "export_onnx_qdq": ["true"],
    "write_similarity_to_ir": ["true"],
    "layernorm_integer_form": ["exact"],
    "div_integer_form": ["exact"],
    "reduce_l2_integer_form": ["exact"],
    "lut_output_range": ["table"],
    "logsoftmax_integer_form": ["exact"],
    "lstm_integer_form": ["q15"],
    "gru_integer_form": ["q15"],
    "fc_float_summation": ["float64"],
    "float_reference": ["native"],
    "unify_scales_for_concat": ["true"],
    "min_activation_sqnr_db": ["20"],
    "trigger_float_op": ["float16_preferred", "float32_act_int_wht", "bfloat16_preferred"],
    "min_compatible_zhouyi_target": ["Z2", "X1"],
    "lut_items_in_bits": ["10"],
    "multiplier_bits": ["8"],
    "unify_shifts_for_aiff": ["false"],
    "force_dtype_int": ["true"],
    "histc_bins": ["512"],
    "calibration_shuffe": ["true"],
    "modify_batch_dim": ["2"],
    "export_parallel_batch": ["2"],
    "bias_effective_bits": ["20"],
    "bias_effective_bits_auto_adaption": ["true"],
    "upstream_defects": ["all"],
    "enable_pass_tune_op_softmax": ["[1,1][0]", "[1,8][0]", "[2,20][0]"],
    "enable_pass_decompose_nonmonotonic_activations": ["true"],
    "enable_pass_split_qkv_fc_in_transformer": ["true"],
    "enable_pass_scaled_dot_product_attention": ["true"],
    "enable_pass_merge_matmul_mul": ["false"],
    "enable_pass_deeply_set_unquantifiable": ["false"],
    "enable_pass_detect_inf_mask_nodes": ["true"],
    "detect_finite_masks": ["true"],
    "fake_quant_operators_for_debug": ["[Softmax, LayerNorm]", "[Convolution, FullyConnected]"],
    "dump": ["true"],
    "skip_optimization": ["true"],
}
LAYER_OPTIONS: Dict[str, List[Any]] = {
    "q_bits_activation": [8, 16],
    "q_bits_weight": [4, 8, 16],
    "q_bits_bias": [16, 32, 48],
    "q_mode_activation": PER_TENSOR + ["per_channel_symmetric_restricted_range"],
    "q_mode_weight": PER_TENSOR + ["per_channel_symmetric_restricted_range", "per_channel_asymmetric"],
    "q_strategy_activation": ["extrema", "mean", "kld", "percentile", "3std", "mse"],
    "q_strategy_weight": ["extrema", "3std", "mse"],
    "trigger_float_op": ["disable", "float16_preferred", "bfloat16_preferred", "float32_preferred"],
    "force_dtype_int": [True, False],
    "lut_items_in_bits": [8, 10],
    "multiplier_bits": [8, 12, 15],
    "bias_effective_bits": [20, 32],
    "unify_shifts_for_aiff": [True, False],
}
"""Per-layer values of the template (the `opt_config` JSON) that a layer-edit run sets on a few layers."""
ROUND_TRIP_FREE = ("export_parallel_batch", "write_similarity_to_ir", "skip_optimization")
"""Fields whose written IR is not the plain quantized model (copies, debug keys, no IR at all): no round trip on
those runs."""

ONNX_INPUTS: Dict[str, Dict[str, Tuple[str, List[int]]]] = {
    "gpt2_like": {"input_ids": ("ids", [16])},
    "bert_encoder": {"input_ids": ("ids", [16]), "attention_mask": ("mask", [16])},
    "dynamo_attention": {"x": ("float", [10, 32])},
    "dynamo_ops": {"x": ("float", [3, 32, 32])},
    "gru_model": {"x": ("float", [10, 12])},
    "lstm_model": {"x": ("float", [10, 12])},
    "mobilenetv3_block": {"x": ("float", [3, 32, 32])},
    "resnet18_like": {"x": ("float", [3, 64, 64])},
    "transformer_tanh": {"x": ("float", [16, 24]), "mask": ("float_mask", [16])},
    "unet": {"x": ("float", [3, 32, 32])},
    "vit_tiny": {"x": ("float", [3, 32, 32])},
    "vision_ops": {"x": ("float", [3, 12, 12])},
}
"""The ONNX models and their inputs without the batch dimension (kind, shape)."""


def corpus_models() -> List[str]:
    return sorted(p.name for p in CORPUS.iterdir() if (p / "calib.npy").exists() and (p / f"{p.name}.txt").exists())


def onnx_data(name: str, folder: Path, rng: np.random.Generator) -> Tuple[List[str], Path]:
    """cfg lines of the model's graph and dataset, and an .npz of its inputs by name for `quantopt run`."""
    arrays: Dict[str, np.ndarray] = {}
    for key, (kind, shape) in ONNX_INPUTS[name].items():
        if kind == "float":
            arrays[key] = rng.normal(0, 1, (8, *shape)).astype(np.float32)
        elif kind == "ids":
            arrays[key] = rng.integers(0, 50, (8, *shape)).astype(np.int64)
        else:
            arrays[key] = np.ones((8, *shape), np.float32 if kind == "float_mask" else np.int64)
            arrays[key][:, 12:] = 0
    np.savez(folder / "inputs.npz", **arrays)
    if len(arrays) == 1 and ONNX_INPUTS[name][next(iter(arrays))][0] == "float":
        np.save(folder / "calib.npy", next(iter(arrays.values())))
        lines = ["dataset = NumpyDataset", f"calibration_data = {folder / 'calib.npy'}"]
    else:
        np.savez(folder / "calib.npz", **arrays, **{f"shape_{k}": np.array(v.shape[1:]) for k, v in arrays.items()})
        lines = ["dataset = NumpyZippedDataset", f"calibration_data = {folder / 'calib.npz'}"]
    return [f"graph = {ONNX_SMALL / name}.onnx"] + lines, folder / "inputs.npz"


def run(args: List[str], timeout: float, threads: int = 0) -> Tuple[Any, str]:
    """(exit code or "timeout", stderr) of a quantopt process; `threads` > 0 sets its thread count."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)) if threads else None
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return "timeout", ""
    return done.returncode, done.stderr


def failed(rc: Any, err: str) -> bool:
    return not (rc == 0 or rc in ERROR_CODES) or "internal error" in err or "Traceback" in err


def ir_digest(folder: Path) -> Dict[str, str]:
    return {p.name: hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(folder.glob("*_o.txt")) + sorted(folder.glob("*_o.bin"))}


def check_nothing_written(result: Dict[str, Any], folder: Path) -> None:
    """Mark `result` (of a failed run) failed when the run left outputs in `folder`: an IR, a template, a report or
    an export of a run that stopped is never written."""
    patterns = ("*_o.txt", "*_o.bin", "*_opt_template.json", "*_report.json", "*.qdq.onnx")
    left = sorted(p.name for pattern in patterns for p in folder.glob(pattern)) if folder.exists() else []
    if left:
        result["failed"], result["half_written"] = True, left


def errors(err: str) -> List[str]:
    return [line[:300] for line in err.splitlines() if "[ERROR]" in line][-2:]


def one_case(i: int, rng: random.Random, nrng: np.random.Generator, models: List[Tuple[str, str]], work: Path,
             timeout: float, layer_rng: Optional[random.Random] = None,
             metric_rng: Optional[random.Random] = None, flags_rng: Optional[random.Random] = None) -> Dict[str, Any]:
    kind, name = rng.choice(models)
    fields = rng.sample(sorted(OPTIONS), rng.randint(1, 6))
    options = {f: rng.choice(OPTIONS[f]) for f in fields}
    folder = work / f"case{i}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if kind == "corpus":
        model = [f"graph = {CORPUS / name / name}.txt", f"bin = {CORPUS / name / name}.bin", "dataset = NumpyDataset",
                 f"calibration_data = {CORPUS / name / 'calib.npy'}"]
        inputs = CORPUS / name / "calib.npy"
    else:
        model, inputs = onnx_data(name, folder, nrng)
    base = ["[Common]"] + model + [f"{k} = {v}" for k, v in options.items()]

    def cfg(tag: str, extra: List[str]) -> str:
        path = folder / f"{tag}.cfg"
        path.write_text("\n".join(base + [f"output_dir = {folder / tag}", f"dump_dir = {folder / tag / 'dump'}"]
                                  + extra) + "\n")
        return str(path)

    case: Dict[str, Any] = {"case": i, "model": name, "options": options}
    rc, err = run(["quantopt", "--cfg", cfg("a", ["save_statistic_info = true"])], timeout)
    case["rc"], case["failed"] = rc, failed(rc, err)
    if rc != 0:
        case["error"] = errors(err)
        check_nothing_written(case, folder / "a")
        return case
    ir = next((folder / "a").glob("*_o.txt"), None)
    if ir is not None:
        batch = rng.choice([1, 2, 3, 8])
        flags = [f for f in ("--dequantize", "--dump-all") if flags_rng is not None and flags_rng.random() < 0.5]
        rc_run, err_run = run(["quantopt", "run", str(ir), "-i", str(inputs), "-o", str(folder / "run"),
                               "--quantize-inputs", "--batch-size", str(batch)] + flags, timeout)
        case["run"] = {"batch": batch, "flags": flags, "rc": rc_run}
        if failed(rc_run, err_run):
            case["failed"], case["run"]["error"] = True, errors(err_run)
    if metric_rng is not None and case.get("run", {}).get("rc") == 0:
        data = next(line.split(" = ", 1)[1] for line in base if line.startswith("calibration_data = "))
        case["metrics"] = metric_run(metric_rng, folder, cfg, data, timeout)
        case["failed"] = case["failed"] or bool(case["metrics"].get("failed"))
    if any(f in options for f in ROUND_TRIP_FREE):
        return case
    reference = ir_digest(folder / "a")
    template = next((folder / "a").glob("*_opt_template.json"))
    statistics = next((folder / "a").glob("*_statistic_info.npz"))
    for tag, line, threads in (("template", f"opt_config = {template}", 0),
                               ("statistics", f"statistic_file = {statistics}", 0), ("one_thread", "", 1)):
        rc_again, err_again = run(["quantopt", "--cfg", cfg(tag, [line] if line else [])], timeout, threads)
        same = rc_again == 0 and ir_digest(folder / tag) == reference
        case[tag] = "same IR" if same else {"rc": rc_again, "error": errors(err_again)}
        case["failed"] = case["failed"] or not same
    if layer_rng is not None:
        case["layer_edits"] = layer_edits(layer_rng, template, folder, cfg, inputs, timeout)
        case["failed"] = case["failed"] or bool(case["layer_edits"].get("failed"))
    return case


METRICS = ["RMSEMetric", "CosDistanceMetric", "MaxAbsErrorMetric", "FlattenCosDistanceMetric"]


def metric_run(rng: random.Random, folder: Path, cfg: Callable[[str, List[str]], str], data: str,
               timeout: float) -> Dict[str, Any]:
    """The case again with a metric on validation data (its calibration inputs, labelled with the dequantized
    outputs of `quantopt run`), a random metric_batch_size and, half of the time, the mixed-precision search: it
    must exit 0 or with an error code, and a run that exits 0 must have evaluated the metric."""
    outputs = json.loads((folder / "run" / "outputs.json").read_text())["outputs"]
    if len(outputs) != 1:
        return {"skipped": "the model has several outputs"}
    out = next(iter(outputs.values()))
    q = np.load(folder / "run" / out["file"]).astype(np.float64)
    labels = ((q + out["zp"]) / out["scale"]).astype(np.float32) if out.get("quantized") else q.astype(np.float32)
    np.save(folder / "labels.npy", labels)
    lines = [f"data = {data}", f"label = {folder / 'labels.npy'}", f"metric = {rng.choice(METRICS)}",
             f"metric_batch_size = {rng.choice([1, 2, 3, 8])}"]
    if rng.random() < 0.5:
        lines += [f"mixed_precision_auto_search = 1,{rng.choice(['0.0', '0.01', '1.0'])},L",
                  f"mixed_precision_ranking = {rng.choice(['probe', 'similarity'])}"]
    result: Dict[str, Any] = {"fields": lines[2:]}
    rc, err = run(["quantopt", "--log-level", "info", "--cfg", cfg("metric", lines)], timeout)
    result["rc"] = rc
    if failed(rc, err):
        result["failed"], result["error"] = True, errors(err)
    elif rc == 0 and "quantized metric:" not in err:
        result["failed"], result["error"] = True, ["exit 0 without a 'quantized metric:' line"]
    elif rc != 0:
        result["error"] = errors(err)
        check_nothing_written(result, folder / "metric")
    return result


def layer_edits(rng: random.Random, template: Path, folder: Path, cfg: Callable[[str, List[str]], str],
                inputs: Path, timeout: float) -> Dict[str, Any]:
    """Edit 1-3 per-layer values of 1-4 layers of the written template and run with it as `opt_config`: the run must
    exit 0 or with a documented error, its IR must run, and every edit must be in the template the run writes (a
    layer whose value quantopt changed must be named in its log: a per-layer value is never dropped silently)."""
    layers = json.loads(template.read_text())
    names = sorted(layers)
    edits: Dict[str, Dict[str, Any]] = {}
    for name in rng.sample(names, min(len(names), rng.randint(1, 4))):
        keys = sorted(k for k in LAYER_OPTIONS if k in layers[name])
        for key in rng.sample(keys, min(len(keys), rng.randint(1, 3))):
            edits.setdefault(name, {})[key] = rng.choice(LAYER_OPTIONS[key])
    for name, values in edits.items():
        layers[name].update(values)
    edited = folder / "edited.json"
    edited.write_text(json.dumps(layers, indent=1))
    result: Dict[str, Any] = {"edits": edits}
    rc, err = run(["quantopt", "--log-level", "info", "--cfg", cfg("edited", [f"opt_config = {edited}"])], timeout)
    result["rc"] = rc
    if rc != 0:
        result["failed"] = failed(rc, err)
        result["error"] = errors(err)
        check_nothing_written(result, folder / "edited")
        return result
    written = json.loads(next((folder / "edited").glob("*_opt_template.json")).read_text())
    dropped = [f"{name}.{key}: {value!r} -> {written[name].get(key)!r}" for name, values in edits.items()
               for key, value in values.items() if written[name].get(key) != value and f"'{name}'" not in err]
    if dropped:
        result["failed"], result["dropped"] = True, dropped
    ir = next((folder / "edited").glob("*_o.txt"), None)
    if ir is not None:
        rc_run, err_run = run(["quantopt", "run", str(ir), "-i", str(inputs), "-o", str(folder / "edited_run"),
                               "--quantize-inputs"], timeout)
        result["run"] = rc_run
        if failed(rc_run, err_run):
            result["failed"], result["run_error"] = True, errors(err_run)
    return result


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", default="corpus,onnx", help="corpus, onnx or both")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per quantopt process")
    parser.add_argument("--layer-edits", action="store_true",
                        help="also run each successful case again with random edits of its per-layer JSON")
    parser.add_argument("--metrics", action="store_true",
                        help="also run each successful case with a metric on labelled data (and, half of the time, "
                             "the mixed-precision search)")
    parser.add_argument("--keep", help="a folder to keep the cases in (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    kinds = set(args.models.split(","))
    models = ([("corpus", m) for m in corpus_models()] if "corpus" in kinds else []) + \
        ([("onnx", m) for m in sorted(ONNX_INPUTS)] if "onnx" in kinds else [])
    if not models:
        parser.error("--models: corpus, onnx or both")
    rng, nrng = random.Random(args.seed), np.random.default_rng(args.seed)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="quantopt_fuzz_"))
    work.mkdir(parents=True, exist_ok=True)
    failures = 0
    try:
        for i in range(args.cases):
            layer_rng = random.Random(args.seed * 1_000_003 + i) if args.layer_edits else None
            metric_rng = random.Random(args.seed * 1_000_003 + i + 1) if args.metrics else None
            flags_rng = random.Random(args.seed * 1_000_003 + i + 2)  # its own stream: the cases of a seed stay
            case = one_case(i, rng, nrng, models, work, args.timeout, layer_rng, metric_rng, flags_rng)
            failures += bool(case["failed"])
            print(json.dumps(case), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{args.cases} cases, {failures} failed (seed {args.seed})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
