"""Dtype (docs/ir-format.md, section 6): names, storage, integer ranges, and bit-exact encode/decode of every format."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quantopt.quant import minifloat
from quantopt.quant.dtype import Dtype, decode_storage, dtype_from_name, encode_storage, int_dtype_for_bits

IR_NAMES = ["float16", "bfloat16", "float32", "float64", "bool", "int8", "uint8", "int16", "uint16", "int32",
            "uint32", "int64", "uint64", "aligned_int4", "aligned_uint4", "aligned_int12", "aligned_uint12",
            "float8_e4m3fn", "float8_e5m2", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"]

MINIFLOATS = [Dtype.FP8_E4M3FN, Dtype.FP8_E5M2, Dtype.FP6_E2M3FN, Dtype.FP6_E3M2FN, Dtype.FP4_E2M1FN]
INTS = [d for d in Dtype if not d.is_float and d is not Dtype.BOOL]


def test_ir_names_are_exactly_the_reference_list():
    assert sorted(d.value for d in Dtype) == sorted(IR_NAMES)
    for d in Dtype:
        assert str(d) == d.value == d.ir_name


@pytest.mark.parametrize("dtype, itemsize, bits", [
    (Dtype.FP32, 4, 32), (Dtype.FP64, 8, 64), (Dtype.FP16, 2, 16), (Dtype.BFP16, 2, 16), (Dtype.BOOL, 1, 1),
    (Dtype.INT8, 1, 8), (Dtype.UINT8, 1, 8), (Dtype.INT16, 2, 16), (Dtype.UINT16, 2, 16), (Dtype.INT32, 4, 32),
    (Dtype.UINT32, 4, 32), (Dtype.INT64, 8, 64), (Dtype.UINT64, 8, 64), (Dtype.ALIGNED_INT4, 1, 4),
    (Dtype.ALIGNED_UINT4, 1, 4), (Dtype.ALIGNED_INT12, 2, 12), (Dtype.ALIGNED_UINT12, 2, 12),
    (Dtype.FP8_E4M3FN, 1, 8), (Dtype.FP8_E5M2, 1, 8), (Dtype.FP6_E2M3FN, 1, 6), (Dtype.FP6_E3M2FN, 1, 6),
    (Dtype.FP4_E2M1FN, 1, 4),
])
def test_storage_size_and_bits(dtype, itemsize, bits):
    assert dtype.itemsize == itemsize
    assert dtype.storage.itemsize == itemsize
    assert dtype.bits == bits
    assert dtype.storage.byteorder in ("<", "|", "=")
    if dtype.storage.byteorder == "=":
        assert np.little_endian


def test_flags():
    floats = {Dtype.FP16, Dtype.BFP16, Dtype.FP32, Dtype.FP64, *MINIFLOATS}
    for d in Dtype:
        assert d.is_float == (d in floats)
        assert d.is_minifloat == (d in MINIFLOATS)
    signed_ints = {Dtype.INT8, Dtype.INT16, Dtype.INT32, Dtype.INT64, Dtype.ALIGNED_INT4, Dtype.ALIGNED_INT12}
    for d in INTS:
        assert d.is_signed == (d in signed_ints)
    assert all(d.is_signed for d in floats)
    assert not Dtype.BOOL.is_signed


@pytest.mark.parametrize("dtype, lo, hi", [
    (Dtype.INT8, -128, 127), (Dtype.UINT8, 0, 255), (Dtype.INT16, -32768, 32767), (Dtype.UINT16, 0, 65535),
    (Dtype.INT32, -2 ** 31, 2 ** 31 - 1), (Dtype.UINT32, 0, 2 ** 32 - 1), (Dtype.INT64, -2 ** 63, 2 ** 63 - 1),
    (Dtype.UINT64, 0, 2 ** 64 - 1), (Dtype.ALIGNED_INT4, -8, 7), (Dtype.ALIGNED_UINT4, 0, 15),
    (Dtype.ALIGNED_INT12, -2048, 2047), (Dtype.ALIGNED_UINT12, 0, 4095),
])
def test_int_ranges(dtype, lo, hi):
    assert dtype.int_range() == (lo, hi)


@pytest.mark.parametrize("dtype", [d for d in Dtype if d.is_float] + [Dtype.BOOL])
def test_no_int_range_for_floats_and_bool(dtype):
    with pytest.raises(ValueError, match="no integer range"):
        dtype.int_range()


@pytest.mark.parametrize("bits, signed, expected", [
    (1, True, Dtype.ALIGNED_INT4), (2, False, Dtype.ALIGNED_UINT4), (4, True, Dtype.ALIGNED_INT4),
    (4, False, Dtype.ALIGNED_UINT4), (5, True, Dtype.INT8), (8, True, Dtype.INT8), (8, False, Dtype.UINT8),
    (9, True, Dtype.ALIGNED_INT12), (12, False, Dtype.ALIGNED_UINT12), (13, True, Dtype.INT16),
    (16, True, Dtype.INT16), (16, False, Dtype.UINT16), (17, True, Dtype.INT32), (24, False, Dtype.UINT32),
    (32, True, Dtype.INT32), (33, True, Dtype.INT64), (48, True, Dtype.INT64), (64, False, Dtype.UINT64),
])
def test_int_dtype_for_bits(bits, signed, expected):
    assert int_dtype_for_bits(bits, signed) is expected
    lo, hi = expected.int_range()
    if signed:
        assert lo <= -(2 ** (bits - 1)) and hi >= 2 ** (bits - 1) - 1
    else:
        assert lo == 0 and hi >= 2 ** bits - 1


@pytest.mark.parametrize("bits", [65, 128])
def test_int_dtype_for_bits_too_wide(bits):
    with pytest.raises(ValueError, match=f"no integer dtype holds {bits} bits"):
        int_dtype_for_bits(bits, True)


@pytest.mark.parametrize("name, expected", [(n, Dtype(n)) for n in IR_NAMES] + [
    ("fp16", Dtype.FP16), ("half", Dtype.FP16), ("fp32", Dtype.FP32), ("float", Dtype.FP32),
    ("fp64", Dtype.FP64), ("double", Dtype.FP64), ("bf16", Dtype.BFP16), ("bfp16", Dtype.BFP16),
    ("int4", Dtype.ALIGNED_INT4), ("uint4", Dtype.ALIGNED_UINT4), ("int12", Dtype.ALIGNED_INT12),
    ("uint12", Dtype.ALIGNED_UINT12), ("fp8_e4m3fn", Dtype.FP8_E4M3FN), ("fp8_e5m2", Dtype.FP8_E5M2),
    ("fp6_e2m3fn", Dtype.FP6_E2M3FN), ("fp6_e3m2fn", Dtype.FP6_E3M2FN), ("fp4_e2m1fn", Dtype.FP4_E2M1FN),
    ("dtype.int8", Dtype.INT8), ("Dtype.UINT8", Dtype.UINT8), ("DTYPE.FP16", Dtype.FP16), ("  Int16 ", Dtype.INT16),
    ("FLOAT32", Dtype.FP32), ("dtype.bf16", Dtype.BFP16),
])
def test_dtype_from_name(name, expected):
    assert dtype_from_name(name) is expected


@pytest.mark.parametrize("name", ["", "int", "float33", "int7", "dtype.", "RELU", "conv1", "dtype.foo", "uint",
                                  "fp8", "float8"])
def test_dtype_from_name_unknown(name):
    assert dtype_from_name(name) is None


def test_dtype_from_name_accepts_a_dtype():
    assert dtype_from_name(Dtype.INT8) is Dtype.INT8  # str(Dtype) is its IR name


# -------------------------------------------------------------------------------- bit-level round trips
def _round_trip_codes(dtype: Dtype, codes: np.ndarray) -> np.ndarray:
    t = decode_storage(codes, dtype)
    out = encode_storage(t, dtype)
    assert out.dtype == dtype.storage
    assert out.shape == codes.shape
    return out


@pytest.mark.parametrize("dtype", MINIFLOATS)
def test_minifloat_every_code_round_trips(dtype):
    codes = np.arange(2 ** dtype.bits, dtype="u1")
    t = decode_storage(codes, dtype)
    assert t.dtype == torch.float32
    assert np.array_equal(_round_trip_codes(dtype, codes), codes)


def test_bfloat16_every_code_round_trips():
    codes = np.arange(2 ** 16, dtype="<u2")
    t = decode_storage(codes, Dtype.BFP16)
    assert t.dtype == torch.float32
    assert np.array_equal(_round_trip_codes(Dtype.BFP16, codes), codes)
    # decoding is exactly the top half of float32
    assert np.array_equal(t.numpy().view(np.uint32) >> 16, codes.astype(np.uint32))
    assert np.array_equal(t.numpy().view(np.uint32) & 0xFFFF, np.zeros(2 ** 16, dtype=np.uint32))


def test_float16_every_code_round_trips():
    codes = np.arange(2 ** 16, dtype="<u2")
    out = _round_trip_codes(Dtype.FP16, codes.view("<f2"))
    assert np.array_equal(out.view("<u2"), codes)


def test_bfloat16_matches_torch():
    codes = np.arange(2 ** 16, dtype="<u2")
    ours = decode_storage(codes, Dtype.BFP16)
    ref = torch.from_numpy(codes.view(np.int16).copy()).view(torch.bfloat16).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    assert torch.equal(ours[finite], ref[finite])


def test_bfloat16_encode_rounds_to_nearest_even():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(20000).astype(np.float32) * 1e3,
                             # exact ties: the dropped 16 bits are 0x8000
                             (np.arange(1000, dtype=np.uint32) << 16 | 0x8000).view(np.float32),
                             np.array([3.4e38, -3.4e38, 1e-45, -1e-45, 0.0, -0.0, np.inf, -np.inf], np.float32)])
    ours = encode_storage(torch.from_numpy(values), Dtype.BFP16)
    ref = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, ref)


def test_bfloat16_nan_stays_nan():
    nan_bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFF800001], dtype=np.uint32)
    out = encode_storage(torch.from_numpy(nan_bits.view(np.float32)), Dtype.BFP16)
    back = decode_storage(out, Dtype.BFP16).numpy()
    assert np.isnan(back).all()
    assert np.array_equal(np.signbit(back), np.signbit(nan_bits.view(np.float32)))


@pytest.mark.parametrize("dtype, torch_dtype", [(Dtype.FP8_E4M3FN, "float8_e4m3fn"), (Dtype.FP8_E5M2, "float8_e5m2")])
def test_fp8_decode_matches_torch(dtype, torch_dtype):
    tdt = getattr(torch, torch_dtype, None)
    if tdt is None:
        pytest.skip(f"torch has no {torch_dtype}")
    codes = np.arange(256, dtype="u1")
    ours = decode_storage(codes, dtype)
    ref = torch.from_numpy(codes.copy()).view(tdt).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    assert torch.equal(ours[finite], ref[finite])
    assert torch.equal(torch.signbit(ours[finite]), torch.signbit(ref[finite]))


@pytest.mark.parametrize("dtype, torch_dtype", [(Dtype.FP8_E4M3FN, "float8_e4m3fn"), (Dtype.FP8_E5M2, "float8_e5m2")])
def test_fp8_encode_matches_torch_inside_range(dtype, torch_dtype):
    tdt = getattr(torch, torch_dtype, None)
    if tdt is None:
        pytest.skip(f"torch has no {torch_dtype}")
    table = decode_storage(np.arange(256, dtype="u1"), dtype).numpy()
    top = float(np.nanmax(table[np.isfinite(table)]))
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.uniform(-top, top, 20000), rng.standard_normal(20000) * 1e-3,
                             # midpoints between neighbouring codes: ties go to the even code
                             (np.sort(table[np.isfinite(table)])[1:] + np.sort(table[np.isfinite(table)])[:-1]) / 2,
                             ]).astype(np.float32)
    ours = encode_storage(torch.from_numpy(values), dtype)
    ref = torch.from_numpy(values).to(tdt).view(torch.uint8).numpy()
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("dtype, largest, smallest_subnormal", [
    (Dtype.FP8_E4M3FN, 448.0, 2.0 ** -9), (Dtype.FP8_E5M2, 57344.0, 2.0 ** -16), (Dtype.FP6_E2M3FN, 7.5, 0.125),
    (Dtype.FP6_E3M2FN, 28.0, 0.0625), (Dtype.FP4_E2M1FN, 6.0, 0.5),
])
def test_minifloat_extremes_and_saturation(dtype, largest, smallest_subnormal):
    table = decode_storage(np.arange(2 ** dtype.bits, dtype="u1"), dtype).numpy()
    finite = table[np.isfinite(table)]
    assert finite.max() == largest and finite.min() == -largest
    assert finite[finite > 0].min() == smallest_subnormal
    # values beyond the largest finite value saturate (no inf code in these formats except e5m2's)
    out = encode_storage(torch.tensor([largest * 4, -largest * 4]), dtype)
    back = decode_storage(out, dtype).tolist()
    assert back == [largest, -largest]


def test_e5m2_infinities_and_e4m3fn_nan():
    inf = encode_storage(torch.tensor([math.inf, -math.inf]), Dtype.FP8_E5M2)
    assert inf.tolist() == [0x7C, 0xFC]
    nan = encode_storage(torch.tensor([math.nan]), Dtype.FP8_E4M3FN)
    assert nan.tolist() == [0x7F]


def test_minifloat_codes_live_in_the_low_bits():
    # a .bin byte with stray high bits decodes like its low bits
    assert decode_storage(np.array([0x41, 0x01], dtype="u1"), Dtype.FP6_E2M3FN).tolist() == [0.125, 0.125]
    assert decode_storage(np.array([0x17, 0x07], dtype="u1"), Dtype.FP4_E2M1FN).tolist() == [6.0, 6.0]
    assert encode_storage(torch.tensor([-6.0]), Dtype.FP4_E2M1FN).tolist() == [0x0F]


@pytest.mark.parametrize("fmt", [minifloat.E2M3FN, minifloat.E3M2FN, minifloat.E2M1FN])
def test_fp6_fp4_match_ml_dtypes(fmt):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    name = {minifloat.E2M3FN: "float6_e2m3fn", minifloat.E3M2FN: "float6_e3m2fn",
            minifloat.E2M1FN: "float4_e2m1fn"}[fmt]
    ref_type = getattr(ml_dtypes, name, None)
    if ref_type is None:
        pytest.skip(f"ml_dtypes has no {name}")
    nbits = 1 + fmt[0] + fmt[1]
    codes = np.arange(2 ** nbits, dtype=np.uint8)
    ref = codes.view(ref_type).astype(np.float32)
    assert np.array_equal(minifloat.decode(codes, fmt), ref)
    rng = np.random.default_rng(2)
    values = rng.uniform(-float(ref.max()), float(ref.max()), 5000).astype(np.float32)
    assert np.array_equal(minifloat.encode(values, fmt), values.astype(ref_type).view(np.uint8))


@pytest.mark.parametrize("dtype", INTS)
def test_int_round_trip_full_range(dtype):
    lo, hi = dtype.int_range()
    rng = np.random.default_rng(dtype.bits)
    if dtype is Dtype.UINT64:
        stored = np.array([0, 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 12345678901234567890], dtype="<u8")
    else:
        inner = rng.integers(max(lo, -2 ** 62), min(hi, 2 ** 62), 1000, dtype=np.int64)
        stored = np.concatenate([[lo, lo + 1, -1 if lo < 0 else 1, 0, hi - 1, hi], inner]).astype(dtype.storage)
    t = decode_storage(stored, dtype)
    assert t.dtype == torch.int64
    if dtype is not Dtype.UINT64:
        assert t.tolist() == stored.astype(np.int64).tolist()
    out = encode_storage(t, dtype)
    assert out.dtype == dtype.storage
    assert out.tobytes() == stored.tobytes()


@pytest.mark.parametrize("dtype", [d for d in INTS if d not in (Dtype.INT64, Dtype.UINT64)])
def test_int_overflow_is_refused(dtype):
    lo, hi = dtype.int_range()
    with pytest.raises(OverflowError, match=dtype.value):
        encode_storage(torch.tensor([hi + 1]), dtype)
    with pytest.raises(OverflowError, match=dtype.value):
        encode_storage(torch.tensor([lo - 1]), dtype)


def test_int_encode_rounds_float_input_half_to_even():
    out = encode_storage(torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999]), Dtype.INT8)
    assert out.tolist() == [0, 2, 2, 0, -2, 2]


@pytest.mark.parametrize("dtype", [Dtype.FP32, Dtype.FP64, Dtype.FP16])
def test_float_round_trip_bits(dtype):
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.standard_normal(1000) * 1e3, [0.0, -0.0, np.inf, -np.inf, np.nan]])
    stored = values.astype(dtype.storage)
    out = encode_storage(decode_storage(stored, dtype), dtype)
    assert out.tobytes() == stored.tobytes()


def test_bool_round_trip():
    stored = np.array([0, 1, 1, 0], dtype="u1")
    t = decode_storage(stored, Dtype.BOOL)
    assert t.dtype == torch.bool
    assert encode_storage(t, Dtype.BOOL).tobytes() == stored.tobytes()


@pytest.mark.parametrize("dtype, expected", [
    (Dtype.FP32, torch.float32), (Dtype.FP16, torch.float32), (Dtype.BFP16, torch.float32),
    (Dtype.FP64, torch.float64), (Dtype.BOOL, torch.bool), (Dtype.INT8, torch.int64),
    (Dtype.UINT64, torch.int64), (Dtype.ALIGNED_INT4, torch.int64), (Dtype.FP8_E4M3FN, torch.float32),
    (Dtype.FP4_E2M1FN, torch.float32),
])
def test_torch_compute_dtype(dtype, expected):
    assert dtype.torch_dtype == expected


@pytest.mark.parametrize("dtype", [d for d in Dtype if d.bits is not None], ids=str)
def test_a_scalar_constant_round_trips_in_every_dtype(dtype: Dtype) -> None:
    """A 0-d constant (an IR tensor of shape []) decodes to a 0-d tensor in every dtype: the bfloat16 and minifloat
    decoders gave numpy scalars, so an IR with a bf16 scalar constant that quantopt wrote could not be read back
    (found by benchmarks/fuzz_cfg_runs.py, docs/robustness.md)."""
    raw = np.asarray(encode_storage(torch.ones([]), dtype))
    back = decode_storage(raw.reshape([]), dtype)
    assert isinstance(back, torch.Tensor) and back.shape == torch.Size([]) and float(back) == 1.0
