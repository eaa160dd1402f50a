"""The `Dtype` enum of the IR: names, storage in the .bin, integer ranges and torch compute types (docs/ir-format.md,
section 6)."""
from __future__ import annotations

import enum
from typing import Optional, Tuple

import numpy as np
import torch

from . import minifloat


class Dtype(enum.Enum):
    BFP16 = "bfloat16"
    FP16 = "float16"
    FP32 = "float32"
    FP64 = "float64"
    BOOL = "bool"
    INT8 = "int8"
    UINT8 = "uint8"
    INT16 = "int16"
    UINT16 = "uint16"
    INT32 = "int32"
    UINT32 = "uint32"
    INT64 = "int64"
    UINT64 = "uint64"
    ALIGNED_INT4 = "aligned_int4"
    ALIGNED_UINT4 = "aligned_uint4"
    ALIGNED_INT12 = "aligned_int12"
    ALIGNED_UINT12 = "aligned_uint12"
    FP8_E4M3FN = "float8_e4m3fn"
    FP8_E5M2 = "float8_e5m2"
    FP6_E2M3FN = "float6_e2m3fn"
    FP6_E3M2FN = "float6_e3m2fn"
    FP4_E2M1FN = "float4_e2m1fn"

    def __str__(self) -> str:
        return self.value

    @property
    def ir_name(self) -> str:
        return self.value

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_minifloat(self) -> bool:
        return self in _MINIFLOAT_FORMATS

    @property
    def is_signed(self) -> bool:
        return self.is_float or self in _SIGNED_INTS

    @property
    def bits(self) -> int:
        return _BITS[self]

    @property
    def storage(self) -> np.dtype:
        """numpy dtype of one element in the .bin (little endian)."""
        return np.dtype(_STORAGE[self]).newbyteorder("<")

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    def int_range(self) -> Tuple[int, int]:
        if self.is_float or self is Dtype.BOOL:
            raise ValueError(f"{self.value} has no integer range")
        bits = self.bits
        if self.is_signed:
            return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        return 0, 2 ** bits - 1

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype quantopt computes in: float32/64 keep theirs; integers widen to int64; other floats → float32."""
        return _TORCH[self]


_FLOATS = {Dtype.BFP16, Dtype.FP16, Dtype.FP32, Dtype.FP64, Dtype.FP8_E4M3FN, Dtype.FP8_E5M2, Dtype.FP6_E2M3FN,
           Dtype.FP6_E3M2FN, Dtype.FP4_E2M1FN}
_SIGNED_INTS = {Dtype.INT8, Dtype.INT16, Dtype.INT32, Dtype.INT64, Dtype.ALIGNED_INT4, Dtype.ALIGNED_INT12}
_BITS = {Dtype.BFP16: 16, Dtype.FP16: 16, Dtype.FP32: 32, Dtype.FP64: 64, Dtype.BOOL: 1, Dtype.INT8: 8,
         Dtype.UINT8: 8, Dtype.INT16: 16, Dtype.UINT16: 16, Dtype.INT32: 32, Dtype.UINT32: 32, Dtype.INT64: 64,
         Dtype.UINT64: 64, Dtype.ALIGNED_INT4: 4, Dtype.ALIGNED_UINT4: 4, Dtype.ALIGNED_INT12: 12,
         Dtype.ALIGNED_UINT12: 12, Dtype.FP8_E4M3FN: 8, Dtype.FP8_E5M2: 8, Dtype.FP6_E2M3FN: 6,
         Dtype.FP6_E3M2FN: 6, Dtype.FP4_E2M1FN: 4}
_STORAGE = {Dtype.BFP16: "u2", Dtype.FP16: "f2", Dtype.FP32: "f4", Dtype.FP64: "f8", Dtype.BOOL: "u1",
            Dtype.INT8: "i1", Dtype.UINT8: "u1", Dtype.INT16: "i2", Dtype.UINT16: "u2", Dtype.INT32: "i4",
            Dtype.UINT32: "u4", Dtype.INT64: "i8", Dtype.UINT64: "u8", Dtype.ALIGNED_INT4: "i1",
            Dtype.ALIGNED_UINT4: "u1", Dtype.ALIGNED_INT12: "i2", Dtype.ALIGNED_UINT12: "u2",
            Dtype.FP8_E4M3FN: "u1", Dtype.FP8_E5M2: "u1", Dtype.FP6_E2M3FN: "u1", Dtype.FP6_E3M2FN: "u1",
            Dtype.FP4_E2M1FN: "u1"}
_TORCH = {d: torch.int64 for d in Dtype}
_TORCH.update({Dtype.FP32: torch.float32, Dtype.FP16: torch.float32, Dtype.BFP16: torch.float32,
               Dtype.FP64: torch.float64, Dtype.BOOL: torch.bool, Dtype.FP8_E4M3FN: torch.float32,
               Dtype.FP8_E5M2: torch.float32, Dtype.FP6_E2M3FN: torch.float32, Dtype.FP6_E3M2FN: torch.float32,
               Dtype.FP4_E2M1FN: torch.float32})
_MINIFLOAT_FORMATS = {Dtype.FP8_E4M3FN: minifloat.E4M3FN, Dtype.FP8_E5M2: minifloat.E5M2,
                      Dtype.FP6_E2M3FN: minifloat.E2M3FN, Dtype.FP6_E3M2FN: minifloat.E3M2FN,
                      Dtype.FP4_E2M1FN: minifloat.E2M1FN}

_ALIASES = {
    "fp16": Dtype.FP16, "half": Dtype.FP16, "fp32": Dtype.FP32, "float": Dtype.FP32, "fp64": Dtype.FP64,
    "double": Dtype.FP64, "bf16": Dtype.BFP16, "bfp16": Dtype.BFP16, "int4": Dtype.ALIGNED_INT4,
    "uint4": Dtype.ALIGNED_UINT4, "int12": Dtype.ALIGNED_INT12, "uint12": Dtype.ALIGNED_UINT12,
    "fp8_e4m3fn": Dtype.FP8_E4M3FN, "fp8_e5m2": Dtype.FP8_E5M2, "fp6_e2m3fn": Dtype.FP6_E2M3FN,
    "fp6_e3m2fn": Dtype.FP6_E3M2FN, "fp4_e2m1fn": Dtype.FP4_E2M1FN,
}


def dtype_from_name(name: str) -> Optional[Dtype]:
    """Dtype for an IR name or alias (`int8`, `dtype.int8`, `fp16`...), or None if it is not a dtype name."""
    key = str(name).strip().lower()
    if key.startswith("dtype."):
        key = key[len("dtype."):]
    for d in Dtype:
        if d.value == key:
            return d
    return _ALIASES.get(key)


def int_dtype_for_bits(bits: int, signed: bool) -> Dtype:
    """The integer IR dtype that holds `bits`-bit values (4 → aligned_int4, ≤8 → int8, ≤12 → aligned_int12...)."""
    table = [(4, Dtype.ALIGNED_INT4, Dtype.ALIGNED_UINT4), (8, Dtype.INT8, Dtype.UINT8),
             (12, Dtype.ALIGNED_INT12, Dtype.ALIGNED_UINT12), (16, Dtype.INT16, Dtype.UINT16),
             (32, Dtype.INT32, Dtype.UINT32), (64, Dtype.INT64, Dtype.UINT64)]
    for limit, s, u in table:
        if bits <= limit:
            return s if signed else u
    raise ValueError(f"no integer dtype holds {bits} bits")


def decode_storage(raw: np.ndarray, dtype: Dtype) -> torch.Tensor:
    """Storage array (as read from the .bin) → compute tensor, without a copy where the layout allows it."""
    if dtype is Dtype.FP32:
        arr = raw if raw.flags.aligned else raw.copy()
        return torch.from_numpy(arr)
    if dtype is Dtype.BFP16:  # np.asarray: a 0-d array shifted is a numpy scalar, which torch does not take
        bits = np.asarray(raw.astype(np.uint32) << 16)
        return torch.from_numpy(bits.view(np.float32))
    if dtype.is_minifloat:
        return torch.from_numpy(np.asarray(minifloat.decode(raw, _MINIFLOAT_FORMATS[dtype])))
    if dtype is Dtype.FP16:
        return torch.from_numpy(raw.astype(np.float32))
    if dtype is Dtype.FP64:
        return torch.from_numpy(raw.astype(np.float64))
    if dtype is Dtype.BOOL:
        return torch.from_numpy(raw.astype(np.bool_))
    if dtype is Dtype.UINT64:
        return torch.from_numpy(raw.view(np.int64).copy())
    return torch.from_numpy(raw.astype(np.int64))


def encode_storage(tensor: torch.Tensor, dtype: Dtype) -> np.ndarray:
    """Compute tensor → little-endian storage array of `dtype` (exact for values the dtype can hold)."""
    arr = tensor.detach().cpu().contiguous().numpy()
    if dtype is Dtype.BFP16:
        f = arr.astype(np.float32)
        bits = f.view(np.uint32).astype(np.uint64)
        # round to nearest even on the dropped 16 bits; NaN keeps a quiet NaN pattern
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        truncated = (bits >> 16).astype(np.uint16)
        nan_bits = np.where(truncated & 0x7F, truncated, truncated | np.uint16(0x40))
        rounded = np.where(np.isnan(f), nan_bits, rounded)
        return rounded.astype("<u2")
    if dtype.is_minifloat:
        return minifloat.encode(arr.astype(np.float32), _MINIFLOAT_FORMATS[dtype])
    if dtype is Dtype.UINT64:
        return arr.astype(np.int64).view(np.uint64).astype("<u8")
    if dtype.is_float:
        return arr.astype(dtype.storage)
    if dtype is Dtype.BOOL:
        return arr.astype(np.uint8)
    lo, hi = dtype.int_range()
    # int64 values (the quantized graph's) are checked and narrowed as they are, without a copy
    ints = arr.astype(np.int64, copy=False) if arr.dtype.kind in "iub" else np.rint(arr).astype(np.int64)
    if ints.size and (ints.min() < lo or ints.max() > hi):
        raise OverflowError(f"values in [{ints.min()}, {ints.max()}] do not fit {dtype.value} [{lo}, {hi}]")
    return ints.astype(dtype.storage)
