"""OptMaster: runs the workflow (docs/user-guide.md, "What a run does") step by step, each step timed and logged."""
from __future__ import annotations

import copy
import os
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from .analysis.advisor import Advice, advice_lines, advise
from .analysis.dump import dump_tensors
from .analysis.report import (
    HISTOGRAM_LAYERS,
    build_report,
    collect_histograms,
    histograms_of,
    layer_bits,
    worst_tensors,
    write_report,
)
from .analysis.run_records import append_accuracy_record, similarity_keys
from .analysis.similarity import (
    Batch,
    FirstBatch,
    LayerSimilarity,
    layer_similarity,
    to_float,
    worst_key,
    worst_layers_table,
)
from .analysis.template import build_template, write_template
from .calibration.collect import calibrate_graph
from .calibration.statistic_file import load_statistics, save_statistics, statistic_file_name
from .config.layer_settings import OptConfig, locate_setting_error
from .config.reader import Config
from .data import make_dataset, make_loader, make_metrics, prepare_inputs, shuffled, split_sample
from .device import exact_arithmetic, resolve_device
from .errors import ConfigError, DataError, IRError, QuantOptError, UnsupportedError, as_out_of_memory
from .graph.batch_fit import Fit
from .graph.graph import PyGraph, QuantizeGraph
from .graph.grouped import grouped_outputs
from .graph.node import PyNode
from .graph.recorded import ForwardRecord
from .graph.tables import quant_of
from .graph.tensor import PyTensor
from .ir.writer import atomic_write, write_ir
from .log import OPT_INFO, OPT_WARN, StepTimer, attach_file, detach_file, error_to_file, warning_count
from .passes import compat_quantized as compat
from .passes.batch_size import modify_batch_size
from .passes.compiler_fields import check_compiler_fields, wdc_from_cfg, write_compiler_keys
from .passes.fake_quant import apply_fake_quant
from .passes.parallel_batch import parallel_copies
from .pipeline import (
    calibrate,
    collect_statistics,
    finish_settings,
    graph_pass_options,
    graph_passes,
    quantize_calibrated,
)
from .progress import progress
from .quantizer import apply_qconfig, assign_float_settings, assign_settings, check_quantizable, quantize_graph
from .registry import OP_FORWARD, OptBaseMetric, PluginType, get_plugin
from .tuning.global_methods import (
    METHODS,
    parse_global_calibration,
)
from .tuning.mixed_precision import SearchResult, per_layer_search
from .tuning.unify_scales import unify_rules_from_cfg


def io_params(qgraph: PyGraph, t: PyTensor, role: str) -> Dict[str, Any]:
    """How a graph input or output `t` of the quantized model `qgraph` is encoded (what the integer backend
    exchanges)."""
    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.tolist() if v.numel() > 1 else v.item()
        return v
    q = qgraph.quant.get(t)
    quantized = q.qmin is not None
    return {"role": role, "name": t.name, "dtype": getattr(t.dtype, "value", str(t.dtype)),
            "scale": plain(q.scale) if quantized else None, "zp": plain(q.zerop) if quantized else None,
            "qmin": q.qmin, "qmax": q.qmax}


def _output_reader(graph: PyGraph, quantized: bool) -> Callable[[PyTensor], torch.Tensor]:
    """What a metric reads of a graph output: a quantized graph's dequantized, a float graph's as it is."""
    if quantized:
        return lambda t: to_float(t, graph.quant)
    return lambda t: t.betensor


def _no_label(label: Any) -> bool:
    """Datasets built without a label file give labels that are all -inf (docs/datasets.md)."""
    items = label if isinstance(label, (list, tuple)) else [label]
    tensors = [torch.as_tensor(t) for t in items]
    return bool(tensors) and all(t.is_floating_point() and t.numel() > 0 and bool((t == float("-inf")).all())
                                 for t in tensors)


class OptMaster:
    """Owns one run: the graph, the cfg, the data loaders and the metrics."""

    def __init__(self, graph: QuantizeGraph, cfg: Config) -> None:
        self.graph = graph
        self.cfg = cfg
        try:
            self.device = resolve_device(cfg.device)
        except UnsupportedError as e:
            raise cfg.error("device", e.message) from None
        graph.to(self.device)
        assign_float_settings(graph, cfg)
        self.timer = StepTimer()
        self.model_name = cfg.model_name or graph.name
        self.output_dir = cfg.output_dir
        self.files_written: List[str] = []
        self.calibration_loader: Optional[torch.utils.data.DataLoader] = None
        self.validation_loader: Optional[torch.utils.data.DataLoader] = None
        along_dim0 = not cfg.data_batch_dim and not cfg.without_batch_dim
        self.calibration_fit = Fit(graph, along_dim0, int(cfg.label_batch_dim))
        self.validation_fit = Fit(graph, along_dim0, int(cfg.label_batch_dim))
        """which batch sizes the float graph runs; the samples left out of short last batches (graph/batch_fit.py)"""
        self.batch_sizes: Dict[str, int] = {"calibration_batch_size": int(cfg.calibration_batch_size),
                                            "metric_batch_size": int(cfg.metric_batch_size)}
        """the loaders' batch sizes: the fields, or the IR's batch where a default cannot run (`fit_batch_sizes`)"""
        self._datasets: Dict[str, Any] = {}
        self.float_metrics: List[OptBaseMetric] = []
        self.quant_metrics: List[OptBaseMetric] = []
        self.similarities: List[LayerSimilarity] = []
        self.advice: List[Advice] = []
        self.report: Dict[str, Any] = {}
        self.histograms: Dict[str, Any] = {}
        self.float_record: Optional[ForwardRecord] = None
        """The statistics pass's float outputs of the analysis batches, until the analysis reads and frees them."""
        self.layer_bits: List[Dict[str, Any]] = []
        self.search_result: Optional[SearchResult] = None
        self.search_inputs: List[List[torch.Tensor]] = []

    # ------------------------------------------------------------------------------------------------ steps
    def check_operators(self) -> None:
        """Every layer type must have a forward implementation; list all offenders at once."""
        missing: Dict[str, List[str]] = {}
        first_line: Optional[int] = None
        for n in self.graph.nodes:
            if OP_FORWARD.get(str(n.type)) is None:
                missing.setdefault(str(n.type), []).append(n.name)
                if first_line is None and n.source:
                    first_line = n.source[1]
        if missing:
            parts = [f"{t} (layer{'s' if len(v) > 1 else ''} {', '.join(repr(x) for x in v[:3])}"
                     f"{', ...' if len(v) > 3 else ''})" for t, v in missing.items()]
            raise UnsupportedError("no forward implementation for layer type(s) " + "; ".join(parts) +
                                   ". Add one with an operator plugin (see docs/plugins.md)",
                                   file=self.graph.source_file, line=first_line)

    def modify_batch_size(self) -> None:
        """`modify_batch_dim`: the graph rewritten for another batch size before any forward (the zero-input check
        then verifies every layer's shape)."""
        for name in ("modify_batch_dim", "export_parallel_batch"):
            if getattr(self.cfg, name) is not None and self.cfg.without_batch_dim:
                raise self.cfg.error(name, "needs a batch dimension, and without_batch_dim = true says the model "
                                           "has none")
        if self.cfg.modify_batch_dim is None:
            return
        if self.cfg.data_batch_dim:
            raise self.cfg.error("modify_batch_dim", f"rewrites dim 0 of every tensor; with data_batch_dim = "
                                                     f"{self.cfg.data_batch_dim} the batch lies elsewhere")
        modify_batch_size(self.graph, int(self.cfg.modify_batch_dim))

    def batch_size(self, requested: int, name: str) -> int:
        """The loader's batch size: `requested`, but with `data_batch_dim` > 0 the IR's size on that axis (the
        graph batches along dim 0 only), said once when it differs."""
        axis = int(self.cfg.data_batch_dim)
        if not axis:
            return requested
        if self.cfg.without_batch_dim:
            raise self.cfg.error("data_batch_dim", "the model has no batch dimension (without_batch_dim = true)")
        short = [t.name for t in self.graph.input_tensors if len(t.ir_shape) <= axis]
        if short:
            raise self.cfg.error("data_batch_dim", f"input '{short[0]}' has no axis {axis}")
        size = int(self.graph.input_tensors[0].ir_shape[axis])
        if requested != size:
            OPT_WARN(f"{name} = {requested} is used as {size}: with data_batch_dim = {axis} a batch holds the IR's "
                     f"size on that axis")
        return size

    def prepare(self) -> None:
        cfg = self.cfg
        if not cfg.calibration_data and not cfg.calibrate_with_zero_inputs and not cfg.statistic_file \
                and not cfg.skip_optimization and not cfg.compat_quantized_model:
            raise ConfigError("field 'calibration_data' is required to quantize: activation ranges come from it "
                              "(set calibrate_with_zero_inputs = true to calibrate on all-zero inputs, for smoke "
                              "tests only)", file=cfg.path)
        if cfg.calibration_data:
            ds = make_dataset(cfg, cfg.calibration_data)
            if cfg.calibration_shuffe:
                ds = shuffled(ds)
            size = self.batch_size(cfg.calibration_batch_size, "calibration_batch_size")
            self.batch_sizes["calibration_batch_size"] = size
            self._datasets["calibration_batch_size"] = ds
            self.calibration_loader = make_loader(cfg, ds, size)
            OPT_INFO(f"calibration data: {len(ds)} samples from {cfg.calibration_data}")
            self._check_first_batch(self.calibration_loader, cfg.calibration_data)
        if cfg.data:
            ds = make_dataset(cfg, cfg.data, cfg.label or None)
            size = self.batch_size(cfg.metric_batch_size, "metric_batch_size")
            self.batch_sizes["metric_batch_size"] = size
            self._datasets["metric_batch_size"] = ds
            self.validation_loader = make_loader(cfg, ds, size)
            OPT_INFO(f"validation data: {len(ds)} samples from {cfg.data}")
            label = self._check_first_batch(self.validation_loader, cfg.data)
            if cfg.metric and _no_label(label):
                names = ", ".join(name for name, _ in cfg.metric)
                raise cfg.error("label" if cfg.is_set("label") else "metric",
                                f"the metric(s) {names} need labels, but the dataset {cfg.dataset} gives none for "
                                f"{cfg.data}: set 'label' to the label file")
        if cfg.qconfig:  # a missing or broken QConfig plugin is found before any model work
            get_plugin(PluginType.QConfig, cfg.qconfig)
        self.float_metrics = make_metrics(cfg)
        self.quant_metrics = [copy.deepcopy(m) for m in self.float_metrics]
        if cfg.mixed_precision_auto_search.enabled and (not self.float_metrics or self.validation_loader is None):
            raise ConfigError("mixed_precision_auto_search needs a metric and validation data (metric, data, label)",
                              field="mixed_precision_auto_search")

    def _check_first_batch(self, loader: torch.utils.data.DataLoader, source: str) -> Any:
        """Check the first batch against the IR's inputs before any model work; returns its label."""
        batch = next(iter(loader))
        inputs, label = split_sample(batch, source)
        prepare_inputs(self.graph, inputs, self.cfg, source, 0)
        return label

    def zero_forward_check(self) -> None:
        """Run all-zero inputs through the float graph; every layer's output shape must match the IR. After
        `modify_batch_dim`, a layer that cannot follow the new batch (an output that keeps the old one, or a layer
        refusing its inputs: a Constant of one sample's values) is named with that cause."""
        batch = self.cfg.modify_batch_dim

        def check(node: PyNode) -> None:
            for t in node.outputs:
                got = tuple(t.betensor.shape)
                if got != tuple(t.ir_shape) and not _loop_scan(node, t):
                    file, line = node.source if node.source else (None, None)
                    why = "" if batch is None else \
                        f" (modify_batch_dim = {batch} scaled dim 0 of every layer output; this layer's does not " \
                        "follow the batch)"
                    raise IRError(f"layer '{node.name}' ({node.type}) produced {list(got)} for output '{t.name}' "
                                  f"but the IR declares {list(t.ir_shape)}{why}", file=file, line=line)

        try:
            self.graph.forward(self.graph.zero_inputs(), after_node=check)
        except QuantOptError as e:
            if batch is None or "modify_batch_dim" in e.message:
                raise
            raise type(e)(f"{e.message} (modify_batch_dim = {batch} scaled dim 0 of every layer output but the "
                          "Constants'; this layer's inputs do not follow the batch)", file=e.file, line=e.line,
                          field=e.field, layer=e.layer) from None

    def calibration_batches(self, limit: Optional[int] = None) -> Iterator[List[torch.Tensor]]:
        """Prepared input batches of the calibration data (all-zero inputs when the user opted into that); a short
        last batch is cut to whole IR batches where the graph cannot run it (`_fitted`)."""
        if self.calibration_loader is None:
            size = self.batch_sizes["calibration_batch_size"]
            self._fitted(self.calibration_fit, self.graph.zero_inputs(size), None, "calibration_batch_size")
            yield self.graph.zero_inputs(size)
            return
        given = 0
        for i, batch in enumerate(self.calibration_loader):
            if limit is not None and i >= limit:
                return
            inputs, _ = split_sample(batch, self.cfg.calibration_data)
            fitted = self._fitted(self.calibration_fit, prepare_inputs(self.graph, inputs, self.cfg,
                                                                       self.cfg.calibration_data, i),
                                  None, "calibration_batch_size")
            if fitted is not None:
                given += 1
                yield fitted[0]
        if not given and self.calibration_fit.dropped:
            raise self._too_few(self.calibration_fit, self.cfg.calibration_data)

    def _fitted(self, fit: Fit, feed: List[torch.Tensor], label: Any,
                field: str) -> Optional[Tuple[List[torch.Tensor], Any]]:
        """(feed, label) of a batch as the graph can run it: a batch of the loader's full size that the graph
        cannot run is a config error naming `field`; a shorter one (the last) keeps its whole IR batches, the
        rest is left out (said once), and None is returned where nothing is left."""
        rows = int(feed[0].shape[0]) if fit.active and feed and feed[0].dim() else 0
        why = fit.refusal(rows) if rows else None
        if why is None:
            return feed, label
        size = self.batch_sizes[field]
        if rows == size:
            given = "" if self.cfg.is_set(field) else " (the default)"
            raise self.cfg.error(field, f"{size}{given} is not a multiple of the IR's batch {fit.ir_batch}, which "
                                        f"the model needs ({why}): set it to a multiple of {fit.ir_batch}")
        before = fit.dropped
        fitted = fit.cut(feed, label)
        if not before:
            source = self.cfg.calibration_data if field == "calibration_batch_size" else self.cfg.data
            OPT_WARN(f"{source}: {fit.dropped} sample(s) of the last batch are left out: they do not make a whole "
                     f"IR batch of {fit.ir_batch}, which the model needs ({why})")
        return fitted

    def _too_few(self, fit: Fit, source: str) -> DataError:
        return DataError(f"no batch of the data holds a whole IR batch of {fit.ir_batch} samples, and the model "
                         f"cannot run fewer ({fit.reason})", file=source)

    def calibration_batch_count(self, limit: Optional[int] = None) -> int:
        """How many batches calibration_batches(limit) yields (the progress bars' total)."""
        n = 1 if self.calibration_loader is None else len(self.calibration_loader)
        return n if limit is None else min(n, limit)

    def statistics(self) -> None:
        """The statistics pass over every calibration batch; it records the float outputs of the batches the
        precision analysis will compare (graph/recorded.py)."""
        self.float_record = ForwardRecord(self.cfg.similarity_data_num)
        count = collect_statistics(self.graph, progress(self.calibration_batches(), "statistics",
                                                        total=self.calibration_batch_count()), self.float_record)
        OPT_INFO(f"statistics collected over {count} calibration batch(es)")

    def search_scorer(self) -> Tuple[Callable[[PyGraph], float], float]:
        """(score of a quantized graph, float score): the first metric on the first `batches` validation batches
        of mixed_precision_auto_search (prepared once and kept)."""
        auto = self.cfg.mixed_precision_auto_search
        batches = list(self.validation_batches(limit=auto.batches))
        self.search_inputs = [inputs for inputs, _ in batches]
        metric = copy.deepcopy(self.float_metrics[0])

        def score(graph: PyGraph, quantized: bool = True) -> float:
            metric.reset()
            with torch.no_grad():
                for outputs, label in grouped_outputs(graph, batches, _output_reader(graph, quantized)):
                    metric([o.cpu() for o in outputs], label)
            return float(metric.compute())

        return score, score(self.graph, quantized=False)

    def mixed_precision_search(self) -> None:
        """Per-layer mixed-precision search on the first metric (tuning/mixed_precision.py), which returns its
        choice; the chosen settings are assigned to the layers here, once, so the JSON template records them."""
        auto = self.cfg.mixed_precision_auto_search
        score, float_score = self.search_scorer()
        OPT_INFO(f"mixed precision search: {auto} on the first {auto.batches} validation batch(es), metric "
                 f"{self.cfg.metric[0][0]}, float score {float_score:.6f}")
        ranking = self.similarity_ranking() if self.cfg.mixed_precision_ranking == "similarity" else None
        self.search_result = per_layer_search(self.graph, score, float_score, auto, ranking=ranking)
        for name, settings in self.search_result.settings.items():
            self.graph.node(name).settings = settings

    def similarity_ranking(self) -> Dict[str, float]:
        """Layer -> 1 - its lowest isolated cosine on the search batches at the configured precision (NaN stays
        NaN: ranked first), for `mixed_precision_ranking = similarity`. Measured on a copy, so the float graph
        keeps its ranges for the search and the quantization after it."""
        copy = self.graph.clone()
        calibrate_graph(copy)
        qgraph = quantize_graph(copy)
        ranking: Dict[str, float] = {}
        for r in layer_similarity(copy, qgraph, self.search_inputs):
            value = 1.0 - r.isolated_cos
            previous = ranking.get(r.name, value)
            ranking[r.name] = value if value != value or previous != previous else max(previous, value)
        return ranking

    def quantize(self) -> QuantizeGraph:
        """Local calibration and scale unification, the global methods (which adjust ranges, weights and biases of
        a copy of the calibrated graph, never the float graph), then quantization (pipeline.calibrate,
        pipeline.quantize_calibrated)."""
        if self.cfg.compat_quantized_model:  # the given params decide (docs/compat-quantized.md)
            compat.compat_calibrate(self.graph)
            qgraph = quantize_graph(self.graph)
            compat.check_given_kept(qgraph)
            return qgraph
        calibrate(self.graph, unify_rules_from_cfg(self.cfg))
        specs = parse_global_calibration(self.cfg.global_calibration)
        if specs and self.calibration_loader is None:
            raise ConfigError("global_calibration needs calibration_data (it measures the layers on real batches)",
                              field="global_calibration")
        wdc_from_cfg(self.graph, self.cfg, bool(specs))  # optimize_wdc_for_x2 (passes/compiler_fields.py)
        limit = max((s.param("batches") for s in specs if "batches" in METHODS[s.name].params), default=1)
        return quantize_calibrated(self.graph, specs, lambda: list(self.calibration_batches(int(limit))),
                                   self.timer.step)

    def quant_forward_check(self, qgraph: QuantizeGraph) -> None:
        """All-zero inputs through the integer graph: shapes as in the IR, every value inside its integer range."""
        def check(node: PyNode) -> None:
            table = quant_of(node)
            for t in node.outputs:
                got = tuple(t.betensor.shape)
                if got != tuple(t.ir_shape) and not _loop_scan(node, t):
                    raise IRError(f"quantized layer '{node.name}' ({node.type}) produced {list(got)} for output "
                                  f"'{t.name}' but the IR declares {list(t.ir_shape)}")
                if not node.quantized:
                    continue
                q = table.get(t)
                if t.dtype.is_minifloat and t.betensor.is_floating_point():  # fp8 values (ops/_fp8.py)
                    if not t.betensor.numel() or float(t.betensor.abs().max()) <= q.qmax:
                        continue
                if t.betensor.is_floating_point() or (t.betensor.numel() and (int(t.betensor.min()) < q.qmin or
                                                                               int(t.betensor.max()) > q.qmax)):
                    raise RuntimeError(f"integer forward of layer '{node.name}' ({node.type}) left '{t.name}' "
                                       f"outside its integer range [{q.qmin}, {q.qmax}] or not integer")

        qgraph.forward(qgraph.zero_inputs(), after_node=check)

    def precision_analysis(self, qgraph: QuantizeGraph) -> None:
        """Per-layer similarity on the first `similarity_data_num` calibration batches, and the histograms of the
        worst layers from the first of them (kept by the similarity pass: no forward of its own). The float graph's
        outputs of those batches come from the statistics pass where it recorded them (graph/recorded.py); the
        record is freed here."""
        record, self.float_record = self.float_record, None
        if self.cfg.compat_quantized_model and self.calibration_loader is None:
            OPT_INFO("compat_quantized_model without calibration_data: no precision analysis")
            return
        limit = self.cfg.similarity_data_num
        first = FirstBatch(worst=HISTOGRAM_LAYERS)
        recorded = record is not None and record.usable
        batches: Iterable[Batch] = record.batches if recorded else self.calibration_batches(limit)
        total = len(record.batches) if recorded else self.calibration_batch_count(limit)
        self.similarities = layer_similarity(self.graph, qgraph, progress(batches, "similarity", total=total),
                                             first_batch=first)
        names = worst_tensors(self.similarities)
        found = histograms_of(first, names)
        missing = [name for name in names if name not in found]
        if missing:  # over several batches other outputs rank worst than over the first alone: run it again
            inputs = record.batches[0].inputs if recorded else next(iter(self.calibration_batches(1)))
            found.update(collect_histograms(self.graph, qgraph, inputs, missing))
        self.histograms = {name: found[name] for name in names if name in found}

    def write_outputs(self, qgraph: QuantizeGraph) -> None:
        base = self.cfg.quant_ir_name or self.cfg.out_ir_name or f"{self.model_name}_o"
        onnx_bytes = None
        if self.cfg.export_onnx_qdq:  # built first: a layer without a QDQ mapping fails before any file is written
            from .exporters.onnx_qdq import build_onnx_qdq
            onnx_bytes = build_onnx_qdq(qgraph).SerializeToString()
        if self.cfg.write_similarity_to_ir:
            similarity_keys(qgraph, self.similarities)
        write_compiler_keys(qgraph, self.cfg.enable_ds, self.cfg.ds_output_shape_constant,
                            self.cfg.ds_parameter_constant)  # dynamic-shape keys (passes/compiler_fields.py)
        txt = os.path.join(self.output_dir, base + ".txt")
        copies = self.cfg.export_parallel_batch
        txt, bin_path = write_ir(parallel_copies(qgraph, int(copies), int(self.cfg.data_batch_dim))
                                 if copies and copies > 1 else qgraph, txt)
        template = build_template(self.graph, qgraph, self.similarities)
        json_path = write_template(os.path.join(self.output_dir, f"{self.model_name}_opt_template.json"), template)
        self.files_written += [txt, bin_path, json_path]
        if onnx_bytes is not None:
            self.files_written.append(atomic_write(os.path.join(self.output_dir, base + ".qdq.onnx"), onnx_bytes))

    def validation_batches(self, loader: Optional[Iterable[Any]] = None,
                           limit: Optional[int] = None) -> Iterator[Tuple[List[torch.Tensor], Any]]:
        """(prepared inputs, label) of the validation batches (the first `limit`) from `loader` (default: the
        validation loader); a short last batch is cut to whole IR batches where the graph cannot run it
        (`_fitted`)."""
        source = self.cfg.data
        given = 0
        for i, batch in enumerate(self.validation_loader if loader is None else loader):
            if limit is not None and i >= limit:
                return
            inputs, label = split_sample(batch, source)
            fitted = self._fitted(self.validation_fit, prepare_inputs(self.graph, inputs, self.cfg, source, i),
                                  label, "metric_batch_size")
            if fitted is not None:
                given += 1
                yield fitted
        if not given and self.validation_fit.dropped:
            raise self._too_few(self.validation_fit, source)

    def evaluate(self, graph: PyGraph, metrics: Sequence[OptBaseMetric], quantized: bool) -> Dict[str, float]:
        """Metric scores of a graph on the validation data; quantized outputs are dequantized first."""
        scores: Dict[str, float] = {}
        if not metrics or self.validation_loader is None:
            return scores
        for m in metrics:
            m.reset()
        source = self.cfg.data

        desc = "quantized metric" if quantized else "float metric"
        feeds = self.validation_batches(progress(self.validation_loader, desc))
        with torch.no_grad():  # several batches per forward where the graph can (graph/grouped.py)
            for outputs, label in grouped_outputs(graph, feeds, _output_reader(graph, quantized)):
                outputs = [o.cpu() for o in outputs]
                for m in metrics:
                    try:
                        m(list(outputs), label)
                    except DataError as e:
                        if e.file or e.field:
                            raise
                        raise DataError(e.message, file=self.cfg.label or source) from None
        for (cls_name, args), m in zip(self.cfg.metric, metrics):
            name = cls_name + (f"({','.join(args)})" if args else "")
            scores[name] = float(m.compute())
            OPT_INFO(f"{'quantized' if quantized else 'float'} metric: {m.report()}")
        return scores

    def model_checks(self) -> None:
        """The first steps of every run: operators, the batch size (`modify_batch_dim`), data and metrics, and the
        float graph's zero-input forward."""
        with self.timer.step("check operators"):
            self.check_operators()
        self.modify_batch_size()
        with self.timer.step("prepare data and metrics"):
            self.prepare()
        with self.timer.step("zero-input forward check"):
            self.zero_forward_check()
        self.fit_batch_sizes()

    def fit_batch_sizes(self) -> None:
        """A batch size left at its default (1) that the model cannot run, because some layer needs whole IR batches
        of b > 1 (graph/batch_fit.py), becomes b, said once: a model made for batch 2 then calibrates and evaluates
        without a cfg change. A batch size the user set is never changed (`_fitted` refuses it, naming the field)."""
        fits = (("calibration_batch_size", self.calibration_fit), ("metric_batch_size", self.validation_fit))
        for field, fit in fits:
            size, b = self.batch_sizes[field], fit.ir_batch
            if self.cfg.is_set(field) or b <= 1 or size % b == 0:
                continue
            if field == "metric_batch_size" and self.validation_loader is None:
                continue
            why = fit.refusal(size)
            if why is None:
                continue
            self.batch_sizes[field] = b
            if field == "calibration_batch_size" and self.calibration_loader is not None:
                self.calibration_loader = make_loader(self.cfg, self._datasets[field], b)
            elif field == "metric_batch_size":
                self.validation_loader = make_loader(self.cfg, self._datasets[field], b)
            OPT_INFO(f"{field} = {b}: the default {size} is not a whole IR batch of {b}, which the model needs "
                     f"({why})")

    def evaluate_float(self) -> Dict[str, float]:
        return self.evaluate(self.graph, self.float_metrics, quantized=False)

    def prepare_statistics(self) -> None:
        """Every step before calibration: operator checks, data, zero-input check, graph passes (upstream's stage 1,
        pipeline.graph_passes), layer settings, statistics."""
        self.model_checks()
        check_compiler_fields(self.graph, self.cfg)  # passes/compiler_fields.py
        with self.timer.step("graph passes"):
            graph_passes(self.graph, **graph_pass_options(self.cfg))
        with self.timer.step("check quantize functions"):
            check_quantizable(self.graph)
        with self.timer.step("layer settings"):
            opt_config = OptConfig.load(self.cfg.opt_config, [n.name for n in self.graph.nodes]) \
                if self.cfg.opt_config else None
            assign_settings(self.graph, self.cfg, opt_config)
            if self.cfg.qconfig:
                apply_qconfig(self.graph, self.cfg.qconfig)
            if self.cfg.compat_quantized_model:  # the given weights' modes and bits (docs/compat-quantized.md)
                compat.prepare_given(self.graph, self.cfg)
            finish_settings(self.graph, self.cfg.enable_pass_deeply_set_unquantifiable)
        with self.timer.step("statistics"):
            if self.cfg.statistic_file:
                count = load_statistics(self.graph, self.cfg.statistic_file,
                                        ignore_missing=self.cfg.ignore_missing_statistic)
                OPT_INFO(f"statistics of {count} tensor(s) loaded from {self.cfg.statistic_file}; "
                         "statistics pass skipped")
            elif self.cfg.compat_quantized_model and self.calibration_loader is None:
                collect_statistics(self.graph, [])
                OPT_INFO("compat_quantized_model without calibration_data: weight statistics only")
            else:
                self.statistics()
            if self.cfg.save_statistic_info:
                path = save_statistics(self.graph,
                                       os.path.join(self.output_dir, statistic_file_name(self.model_name)))
                self.files_written.append(path)
                OPT_INFO(f"statistics saved to {path}")

    # ------------------------------------------------------------------------------------------------ run
    def __call__(self) -> Dict[str, Any]:
        try:
            os.makedirs(self.output_dir, exist_ok=True)
        except OSError as e:
            raise self.cfg.error("output_dir", f"cannot create '{self.output_dir}': {e.strerror}") from None
        log_path = os.path.join(self.output_dir, f"{self.model_name}_opt.log")
        attach_file(log_path)
        start = time.perf_counter()
        try:
            with exact_arithmetic(self.device):
                return self._run(start, log_path)
        except QuantOptError as e:
            located = locate_setting_error(e, self.graph, self.cfg)  # the file that set the refused layer value
            error_to_file(str(located))
            if located is e:
                raise
            raise located from None
        except Exception as e:
            oom = as_out_of_memory(e)
            error_to_file(str(oom) if oom is not None else f"internal error: {type(e).__name__}: {e}")
            raise
        finally:
            detach_file()

    def _run(self, start: float, log_path: str) -> Dict[str, Any]:
        """Every step of the run, on `self.device` (logged first when it is not the CPU)."""
        if self.device.type != "cpu":
            OPT_INFO(f"device {self.device} ({torch.cuda.get_device_name(self.device)})")
        if self.cfg.target_fields:
            OPT_INFO(f"min_compatible_zhouyi_target {self.cfg.min_compatible_zhouyi_target}: "
                     + ", ".join(f"{k} = {v}" for k, v in self.cfg.target_fields.items()))
        if self.cfg.preset != "none":
            fields = ", ".join(f"{k} = {v}" for k, v in self.cfg.preset_fields.items()) or \
                "nothing (the cfg sets every field it would)"
            OPT_INFO(f"preset {self.cfg.preset}: {fields}")
        OPT_INFO(f"model '{self.model_name}': {len(self.graph.nodes)} layers, inputs "
                 f"{[t.name for t in self.graph.input_tensors]}, outputs "
                 f"{[t.name for t in self.graph.output_tensors]}")
        if self.cfg.skip_optimization:
            return self._float_only(start, log_path)
        if self.cfg.compat_quantized_model:
            compat.check_compat_graph(self.graph, self.cfg)
            if compat.is_prequantized_ir(self.graph):
                return self._keep_prequantized(start, log_path)
        self.prepare_statistics()
        if self.cfg.mixed_precision_auto_search.enabled:
            with self.timer.step("mixed precision search"):
                self.mixed_precision_search()
        with self.timer.step("calibrate and quantize"):
            qgraph = self.quantize()
        if self.cfg.fake_quant_scopes_for_debug or self.cfg.fake_quant_operators_for_debug:
            apply_fake_quant(self.graph, qgraph, self.cfg.fake_quant_scopes_for_debug,
                             self.cfg.fake_quant_operators_for_debug)
        with self.timer.step("quantized zero-input check"):
            self.quant_forward_check(qgraph)
        with self.timer.step("precision analysis"):
            self.precision_analysis(qgraph)
            self.layer_bits = layer_bits(qgraph)
            for line in worst_layers_table(self.similarities).splitlines():
                OPT_INFO(line)
            self.advice = advise(self.graph, qgraph, self.similarities)
            for line in advice_lines(self.advice):
                OPT_WARN(f"accuracy advice: {line}")
        if self.cfg.dump:
            with self.timer.step("dump tensors"):
                batch = next(iter(self.calibration_batches(1)))
                self.files_written.append(dump_tensors(self.graph, qgraph, batch, self.cfg.dump_dir,
                                                       model_name=self.model_name))
        with self.timer.step("write IR and template"):
            self.write_outputs(qgraph)
        float_scores: Dict[str, float] = {}
        quant_scores: Dict[str, float] = {}
        if self.cfg.eval_original_model and self.float_metrics:
            with self.timer.step("float metric"):
                float_scores = self.evaluate(self.graph, self.float_metrics, quantized=False)
        if self.cfg.eval_optimized_model and self.quant_metrics:
            with self.timer.step("quantized metric"):
                quant_scores = self.evaluate(qgraph, self.quant_metrics, quantized=True)
        return self._finish(start, log_path, qgraph, float_scores, quant_scores)

    def _keep_prequantized(self, start: float, log_path: str) -> Dict[str, Any]:
        """compat_quantized_model with a quantized IR: kept as it is (no statistics, no calibration), checked by the
        zero-input forward, written again and evaluated."""
        self.model_checks()
        qgraph = self.graph
        with self.timer.step("quantized zero-input check"):
            self.quant_forward_check(qgraph)
        with self.timer.step("write IR and template"):
            self.write_outputs(qgraph)
        quant_scores: Dict[str, float] = {}
        if self.cfg.eval_optimized_model and self.quant_metrics:
            with self.timer.step("quantized metric"):
                quant_scores = self.evaluate(qgraph, self.quant_metrics, quantized=True)
        return self._finish(start, log_path, qgraph, {}, quant_scores)

    def _float_only(self, start: float, log_path: str) -> Dict[str, Any]:
        """`skip_optimization`: the float model's checks and metric only; no statistics, no IR."""
        self.model_checks()
        OPT_INFO("skip_optimization = true: no statistics, no quantization, no IR"
                 + ("; eval_optimized_model has no quantized model to evaluate"
                    if self.cfg.eval_optimized_model and self.quant_metrics else ""))
        float_scores: Dict[str, float] = {}
        if self.cfg.eval_original_model and self.float_metrics:
            with self.timer.step("float metric"):
                float_scores = self.evaluate(self.graph, self.float_metrics, quantized=False)
        return self._finish(start, log_path, None, float_scores, {})

    def _finish(self, start: float, log_path: str, qgraph: Optional[QuantizeGraph], float_scores: Dict[str, float],
                quant_scores: Dict[str, float]) -> Dict[str, Any]:
        """The report (returned, printed and written as files) and, with `record_debug_acc_info`, the run's
        record appended to <model_name>_record_model_acc.txt."""
        self.files_written.append(log_path)
        self.report = {
            "model": self.model_name,
            "inputs": [t.name for t in self.graph.input_tensors],
            "outputs": [t.name for t in self.graph.output_tensors],
            "quantized_io": [] if qgraph is None else [
                io_params(qgraph, t, role) for role, ts in (("input", qgraph.input_tensors),
                                                    ("output", qgraph.output_tensors)) for t in ts],
            "float_metrics": float_scores,
            "quant_metrics": quant_scores,
            "metric_drop": {k: float_scores[k] - quant_scores[k] for k in float_scores if k in quant_scores},
            "worst_layers": [s.as_dict() for s in sorted(self.similarities, key=worst_key)[:5]],
            "advice": [a.as_dict() for a in self.advice],
            "steps": [(name, round(sec, 3)) for name, sec in self.timer.steps],
            "wall_time": round(time.perf_counter() - start, 3),
            "warnings": warning_count(),
            "files": list(self.files_written),
        }
        if self.search_result is not None:
            self.report["mixed_precision"] = self.search_result.as_dict()
        if self.cfg.record_debug_acc_info:
            path = os.path.join(self.output_dir, f"{self.model_name}_record_model_acc.txt")
            self.files_written.append(append_accuracy_record(path, self.cfg, self.report, self.similarities))
        report_files = write_report(self.output_dir, build_report(self.report, self.similarities,
                                                                  self.layer_bits, self.histograms))
        self.files_written += report_files
        self.report["files"] = list(self.files_written)
        self._print_report()
        return self.report

    def _print_report(self) -> None:
        r = self.report
        lines = ["==================== quantopt report ====================",
                 f"model:   {r['model']}",
                 f"inputs:  {', '.join(r['inputs'])}",
                 f"outputs: {', '.join(r['outputs'])}"]
        for io in r.get("quantized_io", []):
            if io["scale"] is None:
                lines.append(f"{io['role']:<6} {io['name']}: {io['dtype']} (float)")
            else:
                lines.append(f"{io['role']:<6} {io['name']}: {io['dtype']}, scale {io['scale']}, zp {io['zp']}, "
                             f"range [{io['qmin']}, {io['qmax']}]")
        if r.get("mixed_precision"):
            mp = r["mixed_precision"]
            lines.append(f"mixed precision: {len(mp['promoted'])} layer(s) promoted to {mp['level']}"
                         + (f": {', '.join(mp['promoted'])}" if mp["promoted"] else ""))
        for name in sorted(set(r["float_metrics"]) | set(r["quant_metrics"])):
            parts = []
            if name in r["float_metrics"]:
                parts.append(f"float {r['float_metrics'][name]:.6f}")
            if name in r["quant_metrics"]:
                parts.append(f"quantized {r['quant_metrics'][name]:.6f}")
            if name in r["metric_drop"]:
                parts.append(f"drop {r['metric_drop'][name]:+.6f}")
            lines.append(f"metric {name}: " + ", ".join(parts))
        for name, sec in r["steps"]:
            lines.append(f"step {name:<28} {sec:8.3f}s")
        lines.append(f"total wall time {r['wall_time']:.3f}s, {r['warnings']} warning(s) (see the log)")
        for f in r["files"]:
            lines.append(f"wrote {f}")
        for line in lines:
            OPT_INFO(line)


def _loop_scan(node, t) -> bool:
    """A Loop's scan output has one row per iteration; the IR's first dimension is the Parser's guess."""
    return str(node.type) == "Loop" and node.outputs.index(t) >= int(node.params.get("dependency_inputs_num", 0))
