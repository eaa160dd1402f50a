"""Each stage of each golden-corpus and shared model on a torch device, one at a time, so that a failing stage does
not hide the next: the float forward (compared with the CPU's), the integer forward of the CPU-quantized graph
(every layer's output compared with the CPU's; the first differing layer is named), statistics on the device, and
quantization on the device with its IR written. The PP-OCRv4 det and rec models join when their ONNX files are
found (the `rapidocr_onnxruntime` package or $QUANTOPT_BENCH_MODEL_DIR).

    python benchmarks/device_stages.py [--device cuda] [--emulate]

--emulate runs on the CPU emulation of a CUDA device (tests/fake_cuda.py): device mistakes without a GPU. Prints one
line per model, then the failing stages grouped by cause; exit code 1 when any stage failed. benchmarks/gpu_check.sh
runs it on a GPU machine (docs/performance.md, "CUDA").
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import PPOCR_DET, PPOCR_REC, packaged_file  # noqa: E402  (the benchmarks folder is not a package)

FLOAT_TOLERANCE = 1e-4
"""Largest |CPU - device| of a float output counted as equal (the GPU libraries sum in another order)."""


def _inputs(folder: Path) -> List[torch.Tensor]:
    if (folder / "calib.npy").is_file():
        return [torch.from_numpy(np.load(folder / "calib.npy")[:1])]
    with np.load(folder / "calib.npz") as z:
        return [torch.from_numpy(np.ascontiguousarray(z[k][:1])) for k in z.files]


def _where(e: BaseException) -> str:
    frames = [f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in traceback.extract_tb(e.__traceback__)
              if "quantopt" in f.filename][-3:]
    return f"{type(e).__name__}: {str(e)[:200]} @ {' <- '.join(reversed(frames))}"


def _models(work: Path) -> List[Tuple[str, Path, List[torch.Tensor]]]:
    from quantopt.frontends.onnx import import_onnx_to_ir

    data = REPO / "tests" / "data"
    out = [(p.name, p / f"{p.name}.txt", _inputs(p)) for root in ("golden_corpus", "shared_models")
           for p in sorted((data / root).iterdir()) if (p / f"{p.name}.txt").is_file()]
    for name, which, shape in (("ppocr_det", PPOCR_DET, [1, 3, 320, 320]), ("ppocr_rec", PPOCR_REC, [1, 3, 48, 320])):
        path = packaged_file(*which)
        if path is not None:
            txt, _ = import_onnx_to_ir(str(path), str(work), {"x": shape}, name)
            out.append((name, Path(txt), [torch.from_numpy(np.random.default_rng(0).random(shape, np.float32))]))
    return out


def _layer_outputs(graph: Any, x: List[torch.Tensor]) -> Dict[str, Tuple[str, str, torch.Tensor]]:
    seen: Dict[str, Tuple[str, str, torch.Tensor]] = {}

    def keep(n: Any) -> None:
        for t in n.outputs:
            seen[t.name] = (n.name, str(n.type), t.betensor.detach().cpu().clone())
    graph.forward(list(x), after_node=keep)
    return seen


def check_model(txt: Path, x: List[torch.Tensor], dev: torch.device) -> Dict[str, str]:
    """Stage -> "ok" or what went wrong."""
    from quantopt.calibration.collect import collect_activation_statistics
    from quantopt.device import exact_arithmetic
    from quantopt.graph.graph import QuantizeGraph
    from quantopt.ir.reader import read_ir
    from quantopt.ir.writer import write_ir
    from quantopt.pipeline import quantize_model, run_quantized, settings_from_arguments

    result: Dict[str, str] = {}

    def stage(label: str, fn: Callable[[], str]) -> None:
        try:
            with exact_arithmetic(dev), torch.no_grad():
                result[label] = fn()
        except Exception as e:  # noqa: BLE001  (a failing stage is reported; the next one still runs)
            result[label] = _where(e)

    def read() -> Any:
        return read_ir(str(txt), None, QuantizeGraph)

    def float_forward() -> str:
        g = read()
        want = [o.clone() for o in g.forward(list(x))]
        got = [o.cpu() for o in g.to(dev).forward(list(x))]
        worst = max((float((a.double() - b.double()).abs().max()) if a.is_floating_point() and a.numel()
                     else float(not torch.equal(a, b)) for a, b in zip(want, got)), default=0.0)
        return "ok" if worst <= FLOAT_TOLERANCE else f"float outputs differ by {worst:.3g}"

    def integer_forward() -> str:
        q = quantize_model(read(), [x])
        want = _layer_outputs(q, x)
        got = _layer_outputs(q.clone().to(dev), x)
        for name, (layer, kind, a) in want.items():
            b = got[name][2]
            if a.shape != b.shape or not torch.equal(a, b):
                count = int((a != b).sum()) if a.shape == b.shape else -1
                return f"integers differ first at layer {layer} ({kind}), output {name}: {count} of {a.numel()}"
        return "ok"

    def statistics() -> str:
        g = read()
        settings_from_arguments(g)
        collect_activation_statistics(g.to(dev), [x])
        return "ok"

    def quantize_on_device() -> str:
        q = quantize_model(read().to(dev), [x])
        run_quantized(q, x)
        with tempfile.TemporaryDirectory() as d:
            write_ir(q, str(Path(d) / "m.txt"))
        return "ok"

    for label, fn in (("float", float_forward), ("integer", integer_forward), ("statistics", statistics),
                      ("quantize on device", quantize_on_device)):
        stage(label, fn)
    return result


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="the torch device (default cuda)")
    ap.add_argument("--emulate", action="store_true", help="on the CPU emulation of tests/fake_cuda.py")
    args = ap.parse_args(argv)
    emulation: Any = contextlib.nullcontext()
    if args.emulate:
        sys.path.insert(0, str(REPO / "tests"))
        from fake_cuda import fake_cuda
        emulation = fake_cuda()
    from quantopt.registry import discover_plugins

    discover_plugins()
    failures: Dict[str, List[str]] = {}
    start = time.time()
    with tempfile.TemporaryDirectory() as work, emulation:
        dev = torch.device(args.device)
        models = _models(Path(work))
        for name, txt, x in models:
            bad = {k: v for k, v in check_model(txt, x, dev).items() if v != "ok"}
            print(name, "ok" if not bad else bad, flush=True)
            for stage, why in bad.items():
                failures.setdefault(why, []).append(f"{name}/{stage}")
    where = args.device + (" (emulated)" if args.emulate else "")
    print(f"{len(models)} models on {where} in {time.time() - start:.0f} s: "
          f"{sum(map(len, failures.values()))} failing stages, {len(failures)} distinct causes")
    for why, where in sorted(failures.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(where)} x {why}: {', '.join(where[:6])}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
