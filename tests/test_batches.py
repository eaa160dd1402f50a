"""Batch sizes other than the IR's (quantopt.graph.batch): a run at batch B is, tensor by tensor, the dim-0
concatenation of the per-sample runs, bit for bit, for float (float32 bits) and quantized (integers) forwards.

Models: a small BERT-like encoder and a conv + LSTM OCR-like model, both exported by torch (TorchScript exporter,
opset 17) and imported with quantopt's ONNX importer, and the digits example. The BERT-like model builds its
attention mask the way transformers 5 exports it (the mask flattened over batch and sequence, gathered with
indices `batch * seq + kv` that the importer folds into a constant carrying the IR batch) and also has a
token-type buffer expanded to the batch, a CLS token taken along the sequence axis and a masked mean pooling.
The OCR-like model's LSTM goes through the importer's time-major Transposes and Reshapes.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import pytest
import torch

from quantopt.cli import main
from quantopt.config.layer_settings import LayerSettings
from quantopt.errors import UnsupportedError
from quantopt.graph.builder import GraphBuilder
from quantopt.graph.graph import PyGraph, QuantizeGraph
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import write_ir
from quantopt.pipeline import quantize_model
from quantopt.quant.dtype import Dtype

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
SAMPLES = 7  # batch 4 then an odd remainder of 3
VOCAB, HIDDEN, SEQ, HEADS = 50, 16, 8, 2


# ------------------------------------------------------------------------------------------------ the models
def _export(model: torch.nn.Module, args: tuple, path: Path, names: List[str], dynamic: Dict[str, Dict[int, str]]
            ) -> None:
    pytest.importorskip("onnx", reason="the optional dependency 'onnx' is not installed")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(model, args, str(path), input_names=names, output_names=["out"], dynamic_axes=dynamic,
                          opset_version=17, dynamo=False)


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.ln1, self.ln2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.ff1, self.ff2 = torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, mask_add: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, HEADS, HIDDEN // HEADS).permute(0, 2, 1, 3)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        att = q @ k.transpose(-1, -2) / math.sqrt(HIDDEN // HEADS) + mask_add
        ctx = (att.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(b, t, HIDDEN)
        x = self.ln1(x + self.o(ctx))
        return self.ln2(x + self.ff2(torch.nn.functional.gelu(self.ff1(x))))


class BertLike(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Embedding(SEQ, HIDDEN)
        self.typ, self.ln = torch.nn.Embedding(2, HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])
        self.register_buffer("token_type_ids", torch.zeros(1, SEQ, dtype=torch.long))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        types = self.token_type_ids[:, :t].expand(b, t)
        x = self.ln(self.tok(input_ids) + self.typ(types) + self.pos(torch.arange(t).unsqueeze(0)))
        flat = torch.flatten(attention_mask.unsqueeze(-1), 0, 1)                    # [b*t, 1]
        idx = torch.arange(b).view(b, 1, 1, 1) * t + torch.arange(t).view(1, 1, 1, t)
        keep = flat[idx].reshape(-1).reshape(idx.shape) > 0                         # [b, 1, 1, t]
        allowed = keep & (torch.arange(t).view(1, 1, t, 1) >= 0)                   # [b, 1, t, t]
        mask_add = (1.0 - allowed.to(torch.float32)) * -10000.0
        for layer in self.layers:
            x = layer(x, mask_add)
        m = attention_mask.unsqueeze(-1).to(torch.float32)
        pooled = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.cat([pooled, torch.tanh(x[:, 0])], dim=-1)


class OcrLike(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 16, 3, padding=1, stride=(2, 1))
        self.rnn = torch.nn.LSTM(16 * 4, 24, batch_first=True)
        self.fc = torch.nn.Linear(24, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.max_pool2d(torch.relu(self.b1(self.c1(x))), (2, 2))
        y = torch.relu(self.c2(y))
        b, c, h, w = y.shape
        y, _ = self.rnn(y.permute(0, 3, 1, 2).reshape(b, w, c * h))
        return self.fc(y).softmax(-1)


def _bert(folder: Path) -> Path:
    torch.manual_seed(0)
    path = folder / "bert_like.onnx"
    ids, mask = torch.zeros(1, SEQ, dtype=torch.long), torch.ones(1, SEQ, dtype=torch.long)
    _export(BertLike().eval(), (ids, mask), path, ["input_ids", "attention_mask"],
            {"input_ids": {0: "b"}, "attention_mask": {0: "b"}, "out": {0: "b"}})
    return path


def _ocr(folder: Path) -> Path:
    torch.manual_seed(1)
    model = OcrLike().eval()
    with torch.no_grad():
        model.b1.running_mean.uniform_(-0.2, 0.2)
        model.b1.running_var.uniform_(0.5, 1.5)
    path = folder / "ocr_like.onnx"
    _export(model, (torch.zeros(1, 3, 16, 32),), path, ["x"], {"x": {0: "b"}, "out": {0: "b"}})
    return path


def _bert_samples(n: int, seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (n,), generator=g)
    mask = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.int64)
    return [ids, mask]


def _ocr_samples(n: int, seed: int) -> List[torch.Tensor]:
    return [torch.randn(n, 3, 16, 32, generator=torch.Generator().manual_seed(seed))]


def _digits_samples(n: int, seed: int) -> List[torch.Tensor]:
    data = np.load(DIGITS / "data" / "val.npy", allow_pickle=False)
    return [torch.from_numpy(data[seed * n:(seed + 1) * n].copy())]


MODELS = {"bert": (_bert, {"input_ids": [1, SEQ], "attention_mask": [1, SEQ]}, _bert_samples),
          "ocr": (_ocr, {"x": [1, 3, 16, 32]}, _ocr_samples),
          "digits": (None, None, _digits_samples)}


def load(name: str, folder: Path) -> QuantizeGraph:
    export, shapes, _ = MODELS[name]
    if export is None:
        return read_ir(str(DIGITS / "model" / "digits.txt"))
    from quantopt.frontends.onnx import import_onnx

    path = folder / f"{name}.onnx"
    if not path.exists():
        export(folder).rename(path)
    graph = import_onnx(str(path), shapes)
    assert isinstance(graph, QuantizeGraph)
    return graph


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batches")


def calibration(name: str, batch: int) -> List[List[torch.Tensor]]:
    data = MODELS[name][2](8, 5)
    return [[x[i:i + batch] for x in data] for i in range(0, 8, batch)]


# ------------------------------------------------------------------------------------------------ helpers
def data_dependent(graph: PyGraph) -> List[str]:
    """The tensors computed from the inputs (a Constant layer's output keeps its IR shape at every batch)."""
    names = {t.name for t in graph.input_tensors}
    for n in graph.nodes:
        if any(t.name in names for t in n.inputs):
            names.update(t.name for t in n.outputs)
    return sorted(names)


def run_in_batches(graph: PyGraph, data: Sequence[torch.Tensor], batch: int) -> Dict[str, torch.Tensor]:
    """Every data-dependent tensor of `graph` over all samples run `batch` at a time, concatenated on dim 0."""
    wanted = set(data_dependent(graph))
    parts: Dict[str, List[torch.Tensor]] = {}

    def grab(node) -> None:
        for t in node.outputs:
            if t.name in wanted:
                parts.setdefault(t.name, []).append(t.betensor.clone())

    with torch.no_grad():
        for lo in range(0, len(data[0]), batch):
            graph.forward([x[lo:lo + batch] for x in data], after_node=grab)
    return {name: torch.cat(values) for name, values in parts.items()}


def assert_same(per_sample: Dict[str, torch.Tensor], batched: Dict[str, torch.Tensor], what: str) -> None:
    assert per_sample.keys() == batched.keys()
    for name, ref in per_sample.items():
        got = batched[name]
        assert got.dtype == ref.dtype and got.shape == ref.shape, f"{what}: tensor '{name}'"
        if ref.is_floating_point():  # the float32 bits (NaN-free models)
            assert torch.equal(got.view(torch.int32) if got.dtype == torch.float32 else got,
                               ref.view(torch.int32) if ref.dtype == torch.float32 else ref), f"{what}: '{name}'"
        else:
            assert torch.equal(got, ref), f"{what}: tensor '{name}'"


# ------------------------------------------------------------------------------------------------ forwards
@pytest.mark.parametrize("name", list(MODELS))
def test_float_and_quantized_forward_are_the_same_per_sample_at_any_batch(name: str, folder: Path) -> None:
    graph = load(name, folder)
    data = MODELS[name][2](SAMPLES, 1)
    float_ref = run_in_batches(graph, data, 1)
    qgraph = quantize_model(graph, calibration(name, 1))
    quant_ref = run_in_batches(qgraph, data, 1)
    for batch in (4, SAMPLES):  # 4 then the odd remainder 3, and all at once
        assert_same(float_ref, run_in_batches(graph, data, batch), f"{name} float at batch {batch}")
        assert_same(quant_ref, run_in_batches(qgraph, data, batch), f"{name} quantized at batch {batch}")
    for t in qgraph.output_tensors:
        assert not quant_ref[t.name].is_floating_point()


@pytest.mark.parametrize("name", ["bert", "ocr"])
def test_native_float_reference_is_the_same_per_sample_at_any_batch(name: str, folder: Path) -> None:
    """torch's float32 kernels choose their blocking by the batch's size: with `float_reference = native` the
    convolutions and FullyConnected layers run one IR batch at a time (graph/batch.py), so every sample keeps the
    bits it gets alone."""
    graph = load(name, folder)
    for n in graph.nodes:
        n.settings = LayerSettings(float_reference="native")
    data = MODELS[name][2](SAMPLES, 1)
    float_ref = run_in_batches(graph, data, 1)
    for batch in (4, SAMPLES):
        assert_same(float_ref, run_in_batches(graph, data, batch), f"{name} native float at batch {batch}")


@pytest.mark.parametrize("name", ["bert", "ocr"])
def test_extrema_statistics_do_not_depend_on_the_calibration_batch_size(name: str, folder: Path) -> None:
    """Extrema are order- and batching-independent: batch 1 and batch 3 (3 + 3 + 2) give the same statistics,
    ranges and quantized IR."""
    texts = []
    stats = []
    for batch in (1, 3):
        graph = load(name, folder)
        qgraph = quantize_model(graph, calibration(name, batch), {"q_strategy_activation": "extrema"})
        stats.append({t.name: (graph.statistics.get(t).extrema_min, graph.statistics.get(t).extrema_max)
                      for n in graph.nodes for t in n.outputs})
        txt, bin_path = write_ir(qgraph, str(folder / f"{name}_calib{batch}.txt"))
        texts.append((Path(txt).read_text(encoding="utf-8").replace(f"_calib{batch}", ""),
                      Path(bin_path).read_bytes()))
    assert stats[0].keys() == stats[1].keys()
    for key, (lo, hi) in stats[0].items():
        assert torch.equal(lo, stats[1][key][0]) and torch.equal(hi, stats[1][key][1]), key
    assert texts[0] == texts[1]


def test_calibration_batch_size_of_a_cfg_run_gives_the_same_model(tmp_path: Path) -> None:
    """The digits example through `quantopt --cfg` with calibration_batch_size 1 and 16 (extrema): same IR."""
    written = []
    for batch in (1, 16):
        cfg = tmp_path / f"b{batch}.cfg"
        cfg.write_text("[Common]\n"
                       f"graph = {DIGITS / 'model' / 'digits.txt'}\n"
                       f"bin = {DIGITS / 'model' / 'digits.bin'}\n"
                       "model_name = digits\ndataset = NumpyDataset\n"
                       f"calibration_data = {DIGITS / 'data' / 'calib.npy'}\n"
                       f"calibration_batch_size = {batch}\n"
                       "calibration_strategy_for_activation = extrema\n"
                       f"output_dir = {tmp_path / f'out{batch}'}\n", encoding="utf-8")
        assert main(["--cfg", str(cfg)]) == 0
        written.append(((tmp_path / f"out{batch}" / "digits_o.txt").read_text(encoding="utf-8"),
                        (tmp_path / f"out{batch}" / "digits_o.bin").read_bytes()))
    assert written[0] == written[1]


# ------------------------------------------------------------------------------------------------ quantopt run
@pytest.mark.parametrize("name", ["bert", "ocr"])
def test_quantopt_run_with_batch_size_writes_the_per_sample_results(name: str, folder: Path, tmp_path: Path) -> None:
    graph = load(name, folder)
    data = MODELS[name][2](SAMPLES, 2)
    qgraph = quantize_model(graph, calibration(name, 1))
    inputs = []
    for t, x in zip(graph.input_tensors, data):
        path = tmp_path / f"{t.name}.npy"
        np.save(path, x.numpy().astype(np.int32) if not x.is_floating_point() else x.numpy())
        inputs += ["-i", str(path)]
    for kind, g, extra in (("float", graph, []), ("quant", qgraph, ["--quantize-inputs", "--dequantize"])):
        txt, _ = write_ir(g, str(tmp_path / f"{name}_{kind}.txt"))
        outs = {}
        for batch in ("1", "4", None):
            out = tmp_path / f"{kind}_{batch}"
            args = ["run", txt, *inputs, "-o", str(out), "--dump-all", *extra]
            assert main(args + (["--batch-size", batch] if batch else [])) == 0
            outs[batch] = {p.relative_to(out).as_posix(): np.load(p) for p in sorted(out.rglob("*.npy"))}
        assert outs["1"].keys() == outs["4"].keys() == outs[None].keys()
        for file, ref in outs["1"].items():
            for batch in ("4", None):
                got = outs[batch][file]
                assert got.dtype == ref.dtype and got.shape == ref.shape and np.array_equal(got, ref), (kind, file)


# ------------------------------------------------------------------------------------------------ refusals
def test_a_layer_that_cannot_run_at_the_batch_says_so_in_one_line(tmp_path: Path, capsys) -> None:
    """IR batch 2 with the batch moved out of dim 0: batch 3 is no whole number of IR batches."""
    b = GraphBuilder("heads")
    x = b.input("x", [2, 3, 4])
    y = b.layer("Transpose", [x], [[3, 2, 4]], name="to_heads", params={"perm": [1, 0, 2]})
    graph = b.build([y])
    graph.forward([torch.zeros(4, 3, 4)])  # two IR batches: fine
    with pytest.raises(UnsupportedError) as err:
        graph.forward([torch.zeros(3, 3, 4)])
    message = str(err.value)
    assert "\n" not in message and "'to_heads'" in message and "IR batch size 2" in message
    txt, _ = write_ir(graph, str(tmp_path / "heads.txt"))
    np.save(tmp_path / "x.npy", np.zeros((3, 3, 4), np.float32))
    capsys.readouterr()
    assert main(["run", txt, "-i", str(tmp_path / "x.npy"), "-o", str(tmp_path / "o")]) == 6
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "'to_heads'" in lines[0]


# ------------------------------------------------------------------------------------------------ single layers
def _case(name: str):
    """One small graph per batching rule (IR batch 1, input [1, 4, 3]); returns (graph, output names)."""
    b = GraphBuilder(name)
    x = b.input("x", [1, 4, 3])
    flat = b.layer("Reshape", [x], [[4, 3]], name="flat", params={"shape": [4, 3]})  # dim 0 is not the batch
    if name == "softmax_axis0":
        y = b.layer("Softmax", [x], [[1, 4, 3]], params={"axis": 0})
    elif name == "concat_axis0":
        y = b.layer("Concat", [x, x], [[2, 4, 3]], params={"axis": 0})
    elif name == "reduce_axis0":
        y = b.layer("Reduce", [x], [[1, 1, 3]], params={"method": "SUM", "axis": [0, 1]})
    elif name == "transpose_dim0":
        y = b.layer("Transpose", [x], [[4, 1, 3]], params={"perm": [1, 0, 2]})
    elif name == "gather_dim0":
        y = b.layer("Gather", [flat], [[2, 3]], params={"axis": 0}, constants={"indices": [3, 0]},
                    constant_dtypes={"indices": Dtype.INT32})
    elif name == "tile_dim0":
        y = b.layer("Tile", [x], [[2, 4, 3]], params={"repeats": [2, 1, 1]})
    elif name == "add_folded_constant":
        c = b.layer("Constant", [], [[4, 3]], constants={"weights": np.arange(12.0).reshape(4, 3)})
        y = b.layer("Eltwise", [flat, c], [[4, 3]], params={"method": "ADD"})
    elif name == "matmul_folded":
        t = b.layer("Transpose", [flat], [[3, 4]], params={"perm": [1, 0]})
        y = b.layer("MatMul", [flat, t], [[4, 4]])
    elif name == "squeeze_batch":
        y = b.layer("Squeeze", [x], [[4, 3]], params={"axis": [0]})
    elif name == "split_dim0":
        y = b.layer("Split", [flat], [[1, 3], [3, 3]], params={"axis": 0, "splits": [1, 3]})
    elif name == "sigmoid_bits":
        y = b.layer("Activation", [x], [[1, 4, 3]], params={"method": "SIGMOID"})
    else:
        y = b.layer("Exp", [x], [[1, 4, 3]])
    outs = y if isinstance(y, list) else [y]
    return b.build(outs), outs


CASES = ["softmax_axis0", "concat_axis0", "reduce_axis0", "transpose_dim0", "gather_dim0", "tile_dim0",
         "add_folded_constant", "matmul_folded", "squeeze_batch", "split_dim0", "sigmoid_bits", "exp_bits"]


@pytest.mark.parametrize("name", CASES)
def test_each_batching_rule_gives_the_per_sample_results(name: str) -> None:
    graph, _ = _case(name)
    data = [torch.randn(SAMPLES, 4, 3, generator=torch.Generator().manual_seed(7)) * 3]
    reference = run_in_batches(graph, data, 1)
    for batch in (4, SAMPLES):
        assert_same(reference, run_in_batches(graph, data, batch), f"{name} at batch {batch}")
    qgraph = quantize_model(graph, [[data[0][i:i + 1]] for i in range(SAMPLES)])
    quant_reference = run_in_batches(qgraph, data, 1)
    assert_same(quant_reference, run_in_batches(qgraph, data, 4), f"{name} quantized at batch 4")


LAYOUT_SENSITIVE = {"gelu": ("Activation", {"method": "GELU"}, [1, 40, 31]),
                    "sigmoid": ("Activation", {"method": "SIGMOID"}, [1, 40, 31]),
                    "silu": ("Activation", {"method": "SILU"}, [1, 40, 31]),
                    "elu": ("Activation", {"method": "ELU"}, [1, 40, 31]),
                    "softplus": ("Activation", {"method": "SOFTPLUS"}, [1, 40, 31]),
                    "mish": ("Activation", {"method": "MISH"}, [1, 40, 31]),
                    "reduce_mean": ("Reduce", {"method": "MEAN", "axis": [-1]}, [1, 40, 1]),
                    "reduce_sum": ("Reduce", {"method": "SUM", "axis": [1]}, [1, 1, 31])}


@pytest.mark.parametrize("name", sorted(LAYOUT_SENSITIVE))
def test_a_float_kernel_after_a_layout_changing_layer_gives_the_per_sample_bits(name: str) -> None:
    """InstanceNorm gives a contiguous tensor at batch 1 and a permuted view at larger batches. An activation with
    a vectorized body and a scalar tail (31 channels: not a multiple of the vector width) or a reduction summing
    in memory order read the two layouts differently, so without contiguous inputs a sample's last bits changed
    with the batch (found on WavLM's and SEW's feature extractors: GroupNorm of one channel per group, then GELU)."""
    kind, params, shape = LAYOUT_SENSITIVE[name]
    b = GraphBuilder("instance_norm_then_" + name)
    x = b.input("x", [1, 40, 31])
    normalized = b.layer("InstanceNorm", [x], [[1, 40, 31]], params={"epsilon": 1e-5})
    y = b.layer(kind, [normalized], [shape], params=params)
    graph = b.build([y])
    data = [torch.randn(SAMPLES, 40, 31, generator=torch.Generator().manual_seed(7)) * 3]
    reference = run_in_batches(graph, data, 1)
    for batch in (4, SAMPLES):
        assert_same(reference, run_in_batches(graph, data, batch), f"{name} at batch {batch}")
