"""OptMaster: runs the workflow (reference §6.1) step by step, each step timed and logged."""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

import torch

from .config.reader import Config
from .data import make_dataset, make_loader, make_metrics, prepare_inputs, split_sample
from .errors import IRError, UnsupportedError
from .graph.graph import QuantizeGraph
from .graph.node import PyNode
from .log import OPT_INFO, OPT_WARN, StepTimer, attach_file, detach_file, warning_count
from .registry import OP_FORWARD, OptBaseMetric


class OptMaster:
    """Owns one run: the graph, the cfg, the data loaders and the metrics."""

    def __init__(self, graph: QuantizeGraph, cfg: Config) -> None:
        self.graph = graph
        self.cfg = cfg
        self.timer = StepTimer()
        self.model_name = cfg.model_name or graph.name
        self.output_dir = cfg.output_dir
        self.files_written: List[str] = []
        self.calibration_loader: Optional[torch.utils.data.DataLoader] = None
        self.validation_loader: Optional[torch.utils.data.DataLoader] = None
        self.float_metrics: List[OptBaseMetric] = []
        self.report: Dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------------ steps
    def check_operators(self) -> None:
        """Every layer type must have a forward implementation; list all offenders at once."""
        missing: Dict[str, List[str]] = {}
        for n in self.graph.nodes:
            if OP_FORWARD.get(str(n.type)) is None:
                missing.setdefault(str(n.type), []).append(n.name)
        if missing:
            parts = [f"{t} (layer{'s' if len(v) > 1 else ''} {', '.join(repr(x) for x in v[:3])}"
                     f"{', ...' if len(v) > 3 else ''})" for t, v in missing.items()]
            raise UnsupportedError("no forward implementation for layer type(s) " + "; ".join(parts) +
                                   ". Add one with an operator plugin (see docs/plugins.md)",
                                   file=self.graph.source_file)

    def prepare(self) -> None:
        cfg = self.cfg
        if cfg.calibration_data:
            ds = make_dataset(cfg, cfg.calibration_data)
            self.calibration_loader = make_loader(cfg, ds, cfg.calibration_batch_size)
            OPT_INFO(f"calibration data: {len(ds)} samples from {cfg.calibration_data}")
            self._check_first_batch(self.calibration_loader, cfg.calibration_data)
        if cfg.data:
            ds = make_dataset(cfg, cfg.data, cfg.label or None)
            self.validation_loader = make_loader(cfg, ds, cfg.metric_batch_size)
            OPT_INFO(f"validation data: {len(ds)} samples from {cfg.data}")
            self._check_first_batch(self.validation_loader, cfg.data)
        self.float_metrics = make_metrics(cfg)

    def _check_first_batch(self, loader: torch.utils.data.DataLoader, source: str) -> None:
        batch = next(iter(loader))
        inputs, _ = split_sample(batch, source)
        prepare_inputs(self.graph, inputs, self.cfg, source, 0)

    def zero_forward_check(self) -> None:
        """Run all-zero inputs through the float graph; every layer's output shape must match the IR."""
        def check(node: PyNode) -> None:
            for t in node.outputs:
                got = tuple(t.betensor.shape)
                if got != tuple(t.ir_shape):
                    file, line = node.source if node.source else (None, None)
                    raise IRError(f"layer '{node.name}' ({node.type}) produced {list(got)} for output '{t.name}' "
                                  f"but the IR declares {list(t.ir_shape)}", file=file, line=line)

        self.graph.forward(self.graph.zero_inputs(), after_node=check)

    def evaluate_float(self) -> Dict[str, float]:
        scores: Dict[str, float] = {}
        if not self.float_metrics or self.validation_loader is None:
            return scores
        for m in self.float_metrics:
            m.reset()
        source = self.cfg.data
        with torch.no_grad():
            for i, batch in enumerate(self.validation_loader):
                inputs, label = split_sample(batch, source)
                outputs = self.graph.forward(prepare_inputs(self.graph, inputs, self.cfg, source, i))
                for m in self.float_metrics:
                    m(list(outputs), label)
        for (cls_name, args), m in zip(self.cfg.metric, self.float_metrics):
            name = cls_name + (f"({','.join(args)})" if args else "")
            scores[name] = float(m.compute())
            OPT_INFO(f"float metric: {m.report()}")
        return scores

    # ------------------------------------------------------------------------------------------------ run
    def __call__(self) -> Dict[str, Any]:
        os.makedirs(self.output_dir, exist_ok=True)
        log_path = os.path.join(self.output_dir, f"{self.model_name}_opt.log")
        attach_file(log_path)
        start = time.perf_counter()
        try:
            OPT_INFO(f"model '{self.model_name}': {len(self.graph.nodes)} layers, inputs "
                     f"{[t.name for t in self.graph.input_tensors]}, outputs "
                     f"{[t.name for t in self.graph.output_tensors]}")
            with self.timer.step("check operators"):
                self.check_operators()
            with self.timer.step("prepare data and metrics"):
                self.prepare()
            with self.timer.step("zero-input forward check"):
                self.zero_forward_check()
            metrics: Dict[str, float] = {}
            if self.cfg.eval_original_model and self.float_metrics:
                with self.timer.step("float metric"):
                    metrics = self.evaluate_float()
            OPT_WARN("quantization is not available in this version: the run stops after the float checks and "
                     "metrics, and no quantized IR is written")
            self.files_written.append(log_path)
            self.report = {
                "model": self.model_name,
                "inputs": [t.name for t in self.graph.input_tensors],
                "outputs": [t.name for t in self.graph.output_tensors],
                "float_metrics": metrics,
                "steps": [(name, round(sec, 3)) for name, sec in self.timer.steps],
                "wall_time": round(time.perf_counter() - start, 3),
                "warnings": warning_count(),
                "files": list(self.files_written),
            }
            self._print_report()
            return self.report
        finally:
            detach_file()

    def _print_report(self) -> None:
        r = self.report
        lines = ["==================== quantopt report ====================",
                 f"model:   {r['model']}",
                 f"inputs:  {', '.join(r['inputs'])}",
                 f"outputs: {', '.join(r['outputs'])}"]
        for name, score in r["float_metrics"].items():
            lines.append(f"float metric {name}: {score:.6f}")
        for name, sec in r["steps"]:
            lines.append(f"step {name:<28} {sec:8.3f}s")
        lines.append(f"total wall time {r['wall_time']:.3f}s, {r['warnings']} warning(s) (see the log)")
        for f in r["files"]:
            lines.append(f"wrote {f}")
        for line in lines:
            OPT_INFO(line)
