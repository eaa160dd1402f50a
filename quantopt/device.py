"""The torch device a run computes on (cfg field `device`), and the arithmetic settings that keep it exact.

quantopt's integer forward is exact on any device: integers are held in int64, or in float32/float64 where a bound
proves every intermediate exact, so a CUDA run gives the CPU's integers bit for bit. Two CUDA defaults would break
that and are switched off for the duration of a run (and restored after it): TF32 matrix products and convolutions
(10-bit mantissas), and cuDNN's non-deterministic algorithm choice. The float forward on CUDA sums in the GPU
libraries' order, so a calibrated range may differ from the CPU's by an ulp (docs/performance.md).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from .errors import UnsupportedError

if TYPE_CHECKING:  # torch is imported where a device is resolved, so that checking a device name stays torch-free
    import torch

DEVICE_NAMES = "auto, cpu, cuda or cuda:N (N the CUDA device index)"


def parse_device(text: str) -> str:
    """A device name as written in a cfg or on the command line -> its normal form (`auto`, `cpu`, `cuda`,
    `cuda:N`); ValueError otherwise. Needs no torch: the machine is asked only when a run starts."""
    value = text.strip().lower()
    if value in ("auto", "cpu", "cuda"):
        return value
    if value.startswith("cuda:") and value[5:].isdigit():
        return f"cuda:{int(value[5:])}"
    raise ValueError(f"'{text.strip()}' is not a device ({DEVICE_NAMES})")


def resolve_device(spec: str = "auto") -> torch.device:
    """`auto` -> the current CUDA device when torch sees one, else the CPU; `cpu`, `cuda`, `cuda:N` as given,
    refused with one line when the name is not a device or the machine has no such device."""
    import torch

    try:
        spec = parse_device(spec or "auto")
    except ValueError as e:
        raise UnsupportedError(str(e)) from None
    if spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UnsupportedError(f"device = {spec}, but torch sees no CUDA device (torch {torch.__version__}, "
                               f"CUDA build: {torch.version.cuda or 'none'}); use device = cpu or auto")
    device = torch.device(spec)
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UnsupportedError(f"device = {spec}, but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


@contextlib.contextmanager
def exact_arithmetic(device: torch.device) -> Iterator[None]:
    """Within the block, CUDA matrix products and convolutions run in full float32 (no TF32) and cuDNN picks
    deterministic algorithms; the previous settings come back afterwards. Nothing changes for the CPU."""
    import torch

    if device.type != "cuda":
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved
