"""Small transformers architectures with seeded random weights, exported to ONNX for benchmarks/real_model_goldens.py.

Only all-MiniLM-L6-v2's weights ship in a package here; these build the other architectures users bring from their
transformers configs (GPT-2, BERT, DistilBERT, RoBERTa, ALBERT, ViT, Swin, MobileViT, LLaMA, the T5 and Whisper
encoders, wav2vec 2.0, ELECTRA, MobileBERT, DeBERTa-v2, GPT-NeoX, OPT, BLOOM, Qwen2, Phi, the CLIP text and vision
towers, ConvNeXt, SegFormer, ResNet, RegNet, PoolFormer, DINOv2, ConvNeXt V2, MPNet, SqueezeBERT, Gemma, Mistral,
Falcon, GPT-J, GPT-BigCode, StableLM, the BART encoder, HuBERT), two layers (or stages) of width 64 or less, so
that every graph pattern of the real exports (padding masks of finfo.min, position ids computed from the token ids,
rotary embeddings, RMSNorm, relative position buckets, ALiBi, convolutional feature extractors) goes through the
upstream Parser and Optimizer. Weights are random (seeded): the goldens test fidelity, not accuracy.

Nothing here is part of the quantopt package; transformers is a benchmark extra (benchmarks/requirements.txt).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

SEQ = 32
"""Tokens per sample of the text models."""


def _configs(t: Any) -> Dict[str, Tuple[Any, List[str]]]:
    """Architecture name -> (config, input names)."""
    text = ["input_ids", "attention_mask"]
    return {
        "hf_gpt2": (t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=64), text),
        "hf_distilbert": (t.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=500,
                                             max_position_embeddings=64), text),
        "hf_roberta": (t.RobertaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, vocab_size=500, max_position_embeddings=70), text),
        "hf_albert": (t.AlbertConfig(hidden_size=64, embedding_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=500, max_position_embeddings=64), text),
        "hf_vit": (t.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               image_size=32, patch_size=8, num_channels=3), ["pixel_values"]),
        "hf_llama": (t.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=500, max_position_embeddings=64), text),
        "hf_t5_encoder": (t.T5Config(d_model=64, num_layers=2, num_heads=4, d_ff=128, d_kv=16, vocab_size=500),
                          text),
        "hf_bert": (t.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 vocab_size=500, max_position_embeddings=64), text),
        "hf_swin": (t.SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[2, 2],
                                 num_heads=[2, 4], window_size=4), ["pixel_values"]),
        "hf_mobilevit": (t.MobileViTConfig(image_size=32, num_channels=3, hidden_sizes=[32, 48, 64],
                                           neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 80]), ["pixel_values"]),
        "hf_whisper_encoder": (t.WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4,
                                               encoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32,
                                               decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64,
                                               vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                               decoder_start_token_id=1), ["input_features"]),
        "hf_wav2vec2": (t.Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 2),
                                         conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                         num_conv_pos_embedding_groups=4), ["input_values"]),
        "hf_electra": (t.ElectraConfig(hidden_size=64, embedding_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, vocab_size=500, max_position_embeddings=64), text),
        "hf_mobilebert": (t.MobileBertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=64, embedding_size=32, intra_bottleneck_size=32,
                                             true_hidden_size=32, vocab_size=500, max_position_embeddings=64,
                                             num_feedforward_networks=2), text),
        "hf_deberta_v2": (t.DebertaV2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=128, vocab_size=500, max_position_embeddings=64,
                                            relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16,
                                            max_relative_positions=64), text),
        "hf_gpt_neox": (t.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, vocab_size=500, max_position_embeddings=64,
                                        rotary_pct=0.5), text),
        "hf_opt": (t.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, vocab_size=500,
                               max_position_embeddings=64, word_embed_proj_dim=64), text),
        "hf_bloom": (t.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=500), text),
        "hf_qwen2": (t.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=500, max_position_embeddings=64), text),
        "hf_phi": (t.PhiConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               vocab_size=500, max_position_embeddings=64, partial_rotary_factor=0.5), text),
        "hf_clip_text": (t.CLIPTextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, vocab_size=500, max_position_embeddings=64), text),
        "hf_clip_vision": (t.CLIPVisionConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                              intermediate_size=128, image_size=32, patch_size=8), ["pixel_values"]),
        "hf_convnext": (t.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                                         image_size=32), ["pixel_values"]),
        "hf_segformer": (t.SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[4, 2],
                                           hidden_sizes=[16, 32], num_attention_heads=[1, 2], patch_sizes=[7, 3],
                                           strides=[4, 2], mlp_ratios=[2, 2], decoder_hidden_size=32),
                         ["pixel_values"]),
        "hf_resnet": (t.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                     layer_type="bottleneck"), ["pixel_values"]),
        "hf_regnet": (t.RegNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8),
                      ["pixel_values"]),
        "hf_poolformer": (t.PoolFormerConfig(num_encoder_blocks=2, depths=[1, 1], hidden_sizes=[16, 32],
                                             patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1]), ["pixel_values"]),
        "hf_dinov2": (t.Dinov2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
                                     image_size=32, patch_size=8), ["pixel_values"]),
        "hf_convnextv2": (t.ConvNextV2Config(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], image_size=32),
                          ["pixel_values"]),
        "hf_mpnet": (t.MPNetConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                   vocab_size=500, max_position_embeddings=64), text),
        "hf_squeezebert": (t.SqueezeBertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=128, vocab_size=500, max_position_embeddings=64,
                                               embedding_size=64, q_groups=2, k_groups=2, v_groups=2,
                                               post_attention_groups=2, intermediate_groups=2, output_groups=2), text),
        "hf_gemma": (t.GemmaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                   intermediate_size=128, vocab_size=500, max_position_embeddings=64, head_dim=16),
                     text),
        "hf_mistral": (t.MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=128, vocab_size=500,
                                       max_position_embeddings=64, sliding_window=16), text),
        "hf_falcon": (t.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=500,
                                     new_decoder_architecture=False, multi_query=True, alibi=False), text),
        "hf_gptj": (t.GPTJConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=64, rotary_dim=8), text),
        "hf_gpt_bigcode": (t.GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=64,
                                              multi_query=True), text),
        "hf_stablelm": (t.StableLmConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=500,
                                         max_position_embeddings=64), text),
        "hf_bart_encoder": (t.BartConfig(d_model=64, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
                                         decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                         vocab_size=500, max_position_embeddings=64), text),
        "hf_hubert": (t.HubertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                     conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                                     num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4), ["input_values"]),
    }


NAMES = ["hf_gpt2", "hf_bert", "hf_distilbert", "hf_roberta", "hf_albert", "hf_vit", "hf_swin", "hf_mobilevit",
         "hf_llama", "hf_t5_encoder", "hf_whisper_encoder", "hf_wav2vec2", "hf_electra", "hf_mobilebert",
         "hf_deberta_v2", "hf_gpt_neox", "hf_opt", "hf_bloom", "hf_qwen2", "hf_phi", "hf_clip_text", "hf_clip_vision",
         "hf_convnext", "hf_segformer", "hf_resnet", "hf_regnet", "hf_poolformer", "hf_dinov2", "hf_convnextv2",
         "hf_mpnet", "hf_squeezebert", "hf_gemma", "hf_mistral", "hf_falcon", "hf_gptj", "hf_gpt_bigcode",
         "hf_stablelm", "hf_bart_encoder", "hf_hubert"]
"""The architectures, in the order the benchmark makes them."""
IMAGE_MODELS = ("hf_vit", "hf_swin", "hf_mobilevit", "hf_clip_vision", "hf_convnext", "hf_segformer", "hf_resnet",
                "hf_regnet", "hf_poolformer", "hf_dinov2", "hf_convnextv2")
AUDIO_MODELS = ("hf_wav2vec2", "hf_hubert")


def input_shapes(name: str) -> Dict[str, Tuple[int, ...]]:
    """Input name -> shape with batch 1."""
    if name in IMAGE_MODELS:
        return {"pixel_values": (1, 3, 32, 32)}
    if name in AUDIO_MODELS:
        return {"input_values": (1, 1600)}
    if name == "hf_whisper_encoder":
        return {"input_features": (1, 16, 64)}
    return {"input_ids": (1, SEQ), "attention_mask": (1, SEQ)}


def sampler(name: str, samples: int, image: Callable[[np.random.Generator, Tuple[int, ...]], np.ndarray]
            ) -> Callable[[np.random.Generator], Dict[str, np.ndarray]]:
    """`samples` samples per input: token ids with trailing padding of random length, images, or audio."""
    def sample(rng: np.random.Generator) -> Dict[str, np.ndarray]:
        if name in IMAGE_MODELS:
            return {"pixel_values": image(rng, (1, 3, 32, 32))}
        if name in AUDIO_MODELS:
            return {"input_values": (0.3 * rng.standard_normal((samples, 1600))).astype(np.float32)}
        if name == "hf_whisper_encoder":
            return {"input_features": rng.standard_normal((samples, 16, 64)).astype(np.float32)}
        ids = rng.integers(3, 500, (samples, SEQ)).astype(np.int64)
        mask = np.ones((samples, SEQ), np.int64)
        for i in range(samples):
            mask[i, int(rng.integers(SEQ // 2, SEQ + 1)):] = 0
        return {"input_ids": ids, "attention_mask": mask}
    return sample


def export(name: str, path: Path, seed: int) -> Optional[Path]:
    """The architecture as ONNX at `path` (legacy exporter, opset 17, eager attention); None without transformers."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return None
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers

    config, names = _configs(transformers)[name]
    torch.manual_seed(seed)
    if name == "hf_t5_encoder":
        model = transformers.T5EncoderModel(config)
    elif name == "hf_whisper_encoder":
        model = transformers.WhisperModel(config).get_encoder()
    elif name == "hf_bart_encoder":
        model = transformers.BartModel(config).get_encoder()
    elif name == "hf_clip_text":
        model = transformers.CLIPTextModel(config)
    elif name == "hf_clip_vision":
        model = transformers.CLIPVisionModel(config)
    else:
        model = transformers.AutoModel.from_config(config, attn_implementation="eager")
    feeds = sampler(name, 1, lambda rng, shape: rng.uniform(-1, 1, shape).astype(np.float32))(
        np.random.default_rng(0))
    return export_hidden_state(model.eval(), names, [feeds[k] for k in names], path, "y")


def export_hidden_state(model: Any, names: Sequence[str], example: Sequence[np.ndarray], path: Path,
                        output: str) -> Path:
    """A transformers model's last hidden state as ONNX at `path` (legacy exporter, opset 17), its inputs passed by
    keyword name (the positional order changes between transformers releases); written to a temporary file first,
    so an interrupted export leaves nothing at `path`."""
    import torch

    class Wrapped(torch.nn.Module):
        """Keyword inputs by name, the last hidden state out."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return self.model(**dict(zip(names, args))).last_hidden_state

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Wrapped(), tuple(torch.from_numpy(a) for a in example), str(tmp), input_names=list(names),
                          output_names=[output], opset_version=17, dynamo=False)
    tmp.replace(path)
    return path
