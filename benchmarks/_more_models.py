"""More architectures for benchmarks/real_model_speed.py, beyond the models the real-model speed work names: the
general case, so that a ratio met on PP-OCR and MiniLM is seen to hold on other CNNs and on transformers of real
size.

* `zoo_<name>`: the onnx package's own copies of classic ImageNet networks (`onnx/backend/test/data/light`:
  AlexNet, DenseNet-121, Inception v1 and v2, ResNet-50, ShuffleNet, SqueezeNet, VGG-19, ZFNet-512). Their weights
  are constant fills (the files carry ConstantOfShape nodes, which the importer folds), so only speed and memory
  mean anything on them, not accuracy; inputs are seeded normal noise.
* `tf_<name>`: transformers at their published sizes with seeded random weights, exported once into the cache with
  `transformers` (eager attention, legacy exporter, opset 17): BERT-base (seq 128), DistilBERT (seq 128), ViT-S/16
  (224x224), GPT-2 with 6 layers of width 768 (seq 128), a Whisper-tiny-size encoder (80 mel bins, 400 frames).
  Token inputs have trailing padding of random length.
* `rnn_<name>`: recurrent sequence models built with torch (seeded random weights, exported by the legacy exporter,
  opset 17): a CRNN-style head (a 1-D convolution over 64 features, two bidirectional LSTM layers of 256 units over
  80 steps, a 100-class FullyConnected: the recognizer head of older OCR models), one GRU of 128 units over 100
  steps, and one LSTM of 64 units over 200 steps (the size of voice-activity detectors).

Nothing here is part of the quantopt package; `transformers` is a benchmark extra (benchmarks/requirements.txt).
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

ZOO = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet",
       "vgg19", "zfnet512"]
TRANSFORMERS = ["bert_base", "distilbert", "vit_small", "gpt2_small", "whisper_tiny_enc"]
RECURRENT = {"crnn_bilstm256": ("lstm", 256, 2, True, 80), "gru128": ("gru", 128, 1, False, 100),
             "lstm64": ("lstm", 64, 1, False, 200)}
"""(cell, hidden units, layers, bidirectional, steps) of each recurrent model."""
NAMES = [f"zoo_{n}" for n in ZOO] + [f"tf_{n}" for n in TRANSFORMERS] + [f"rnn_{n}" for n in RECURRENT]
"""The model names real_model_speed.py accepts from here (none is in its default list: run them with --models)."""
SEQ = 128
"""Tokens per sample of the text models."""

Feeds = Dict[str, np.ndarray]


class Missing(Exception):
    """A package these models need is not installed: the benchmark reports the model as skipped."""


def _zoo_file(name: str) -> Path:
    spec = importlib.util.find_spec("onnx")
    if spec is None or not spec.submodule_search_locations:
        raise Missing("the onnx package is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "backend" / "test" / "data" / "light" / f"light_{name}.onnx"
    if not path.is_file():
        raise Missing(f"{path.name} is not in this onnx package")
    return path


def zoo(name: str, samples: int) -> Tuple[Path, Dict[str, List[int]], List[Feeds]]:
    """(ONNX file, input shapes, seeded feeds) of a light-zoo network."""
    import onnx

    path = _zoo_file(name)
    model = onnx.load(str(path), load_external_data=False)
    given = {i.name for i in model.graph.initializer}
    inp = next(i for i in model.graph.input if i.name not in given)
    shape = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    feeds = [{inp.name: rng.standard_normal(shape).astype(np.float32)} for _ in range(samples)]
    return path, {inp.name: shape}, feeds


INPUTS = {"bert_base": ["input_ids", "attention_mask", "token_type_ids"], "distilbert": ["input_ids", "attention_mask"],
          "vit_small": ["pixel_values"], "gpt2_small": ["input_ids", "attention_mask"],
          "whisper_tiny_enc": ["input_features"]}
"""Each transformer's ONNX inputs, in the order the export takes them."""


def _transformer(name: str) -> Any:
    """The seeded model, in eval mode (made only to export it)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers as t

    torch.manual_seed(0)
    if name == "bert_base":
        cfg = t.BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
        return t.AutoModel.from_config(cfg, attn_implementation="eager").eval()
    if name == "distilbert":
        cfg = t.DistilBertConfig(dim=768, n_layers=6, n_heads=12, hidden_dim=3072)
        return t.AutoModel.from_config(cfg, attn_implementation="eager").eval()
    if name == "vit_small":
        cfg = t.ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                          image_size=224, patch_size=16)
        return t.AutoModel.from_config(cfg, attn_implementation="eager").eval()
    if name == "gpt2_small":
        cfg = t.GPT2Config(n_embd=768, n_layer=6, n_head=12, n_positions=256)
        return t.AutoModel.from_config(cfg, attn_implementation="eager").eval()
    cfg = t.WhisperConfig(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                          num_mel_bins=80, max_source_positions=200, decoder_layers=1, decoder_attention_heads=6,
                          decoder_ffn_dim=64, vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          decoder_start_token_id=1)
    return t.WhisperModel(cfg).get_encoder().eval()


def _feed(name: str, names: List[str]) -> Callable[[np.random.Generator], Feeds]:
    def make(rng: np.random.Generator) -> Feeds:
        if name == "vit_small":
            return {"pixel_values": rng.uniform(-1, 1, (1, 3, 224, 224)).astype(np.float32)}
        if name == "whisper_tiny_enc":
            return {"input_features": rng.standard_normal((1, 80, 400)).astype(np.float32)}
        length = int(rng.integers(SEQ // 2, SEQ))
        ids = np.zeros((1, SEQ), np.int64)
        ids[0, :length] = rng.integers(1000, 20000, length)
        mask = np.zeros((1, SEQ), np.int64)
        mask[0, :length] = 1
        every = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros((1, SEQ), np.int64)}
        return {n: every[n] for n in names}
    return make


def transformer(name: str, samples: int, cache: Path) -> Tuple[Path, Dict[str, List[int]], List[Feeds]]:
    """(ONNX file, input shapes, seeded feeds) of a transformer, exported into `cache` on first use."""
    if importlib.util.find_spec("transformers") is None:
        raise Missing("transformers is not installed (see benchmarks/requirements.txt)")
    from _hf_archs import export_hidden_state

    path = cache / f"{name}_seed0.onnx"
    names = INPUTS[name]
    make = _feed(name, names)
    if not path.is_file():
        example = make(np.random.default_rng(1))
        export_hidden_state(_transformer(name), names, [example[n] for n in names], path, "y")
    rng = np.random.default_rng(0)
    feeds = [make(rng) for _ in range(samples)]
    return path, {n: list(v.shape) for n, v in feeds[0].items()}, feeds


RNN_FEATURES = 64
"""Features per step of the recurrent models' input."""


def _recurrent_module(name: str) -> Any:
    """The seeded sequence model: a 1-D convolution, the recurrent layers, a FullyConnected head."""
    import torch

    kind, hidden, layers, bidirectional, _ = RECURRENT[name]
    torch.manual_seed(0)

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv1d(RNN_FEATURES, 128, 3, padding=1)
            cell = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
            self.rnn = cell(128, hidden, num_layers=layers, bidirectional=bidirectional, batch_first=True)
            self.fc = torch.nn.Linear(hidden * (2 if bidirectional else 1), 100)

        def forward(self, x: Any) -> Any:
            y, _ = self.rnn(torch.relu(self.conv(x)).transpose(1, 2))
            return self.fc(y)

    return Head().eval()


def recurrent(name: str, samples: int, cache: Path) -> Tuple[Path, Dict[str, List[int]], List[Feeds]]:
    """(ONNX file, input shapes, seeded feeds) of a recurrent model, exported into `cache` on first use."""
    import torch

    steps = RECURRENT[name][4]
    shape = [1, RNN_FEATURES, steps]
    path = cache / f"rnn_{name}_seed0.onnx"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        example = torch.from_numpy(np.random.default_rng(1).standard_normal(shape).astype(np.float32))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note that a batch-first LSTM export fixes the batch size
            torch.onnx.export(_recurrent_module(name), (example,), str(path), opset_version=17, dynamo=False,
                              input_names=["x"], output_names=["y"])
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(samples)]
    return path, {"x": shape}, feeds


def prepare(name: str, samples: int, cache: Path) -> Optional[Tuple[Path, Dict[str, List[int]], List[Feeds]]]:
    """The model's (ONNX file, input shapes, feeds), or None for a name that is not from here."""
    if name.startswith("zoo_") and name[4:] in ZOO:
        return zoo(name[4:], samples)
    if name.startswith("tf_") and name[3:] in TRANSFORMERS:
        return transformer(name[3:], samples, cache)
    if name.startswith("rnn_") and name[4:] in RECURRENT:
        return recurrent(name[4:], samples, cache)
    return None
