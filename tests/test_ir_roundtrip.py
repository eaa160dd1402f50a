"""read → write → read keeps every byte: the tiny all-dtype IR, the shared reference IRs, atomic and
deterministic writes, and zero-copy float32 constants."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest
import torch
from conftest import MODEL_NAMES, SHARED_MODELS

import quantopt.ir.writer as writer_module
from quantopt.ir.reader import read_ir
from quantopt.ir.writer import serialize_ir, write_ir
from quantopt.quant.dtype import Dtype, decode_storage


# ------------------------------------------------------------------------------------- the tiny IR
def _storage_values(dtype: Dtype, rng: np.random.Generator) -> np.ndarray:
    """Storage array (what the .bin holds) with interesting bit patterns for `dtype`."""
    if dtype is Dtype.BOOL:
        return np.array([0, 1, 1, 0, 1], dtype="u1")
    if dtype is Dtype.FP32:
        return np.concatenate([rng.standard_normal(6), [0.0, -0.0, 3.4e38, -3.4e38, 1e-40]]).astype("<f4")
    if dtype is Dtype.FP64:
        return np.concatenate([rng.standard_normal(5), [np.pi, -0.0, 1e-310]]).astype("<f8")
    # only finite codes: the reader refuses NaN/inf in float constants (the codecs' NaN payloads: test_dtype.py)
    if dtype is Dtype.FP16:  # every kind of finite half: normals, subnormals, zeros, the largest
        return np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x3C00, 0xC000, 0x7BFF, 0xFBFF, 0x8001, 0x3555],
                        dtype="<u2").view("<f2")
    if dtype is Dtype.BFP16:
        return np.array([0x0000, 0x8000, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x0080, 0x8001, 0x0001, 0x4049],
                        dtype="<u2")
    if dtype.is_minifloat:  # every finite code of the format
        codes = np.arange(2 ** dtype.bits, dtype="u1")
        return codes[np.isfinite(decode_storage(codes, dtype).numpy())]
    lo, hi = dtype.int_range()
    middle = rng.integers(max(lo, -2 ** 62), min(hi, 2 ** 62), size=5, dtype=np.int64)
    values = [lo, hi, 0] + [int(v) for v in middle]
    if dtype is Dtype.UINT64:
        return np.array(values, dtype=np.uint64).astype("<u8")
    return np.array(values, dtype=np.int64).astype(dtype.storage)


class IRText:
    """Builds IR text and its .bin with sequential offsets (the layout the writer produces)."""

    def __init__(self) -> None:
        self.sections: List[List[str]] = []
        self.bin = bytearray()

    def section(self, *lines: str) -> List[str]:
        self.sections.append(list(lines))
        return self.sections[-1]

    def constant(self, lines: List[str], stem: str, arrays: List[Tuple[Dtype, np.ndarray]], as_list: bool = False
                 ) -> None:
        types, offsets, sizes, shapes = [], [], [], []
        for dtype, arr in arrays:
            data = np.ascontiguousarray(arr).tobytes()
            types.append(dtype.value)
            offsets.append(str(len(self.bin)))
            sizes.append(str(len(data)))
            shapes.append("[" + ",".join(str(d) for d in arr.shape) + "]")
            self.bin += data
        if as_list:
            lines += [f"{stem}_type=[{','.join(types)}]", f"{stem}_offset=[{','.join(offsets)}]",
                      f"{stem}_size=[{','.join(sizes)}]", f"{stem}_shape=[{','.join(shapes)}]"]
        else:
            lines += [f"{stem}_type={types[0]}", f"{stem}_offset={offsets[0]}", f"{stem}_size={sizes[0]}",
                      f"{stem}_shape={shapes[0]}"]

    def text(self) -> str:
        return "\n\n".join("\n".join(s) for s in self.sections) + "\n"


def tiny_ir() -> IRText:
    rng = np.random.default_rng(1234)
    ir = IRText()
    ir.section("model_name=tiny_all", "model_domain=image_classification", "layer_number=5", "precision=float32",
               "compat_quantized_model=false", "model_bin=./tiny.bin", "input_tensors=[data]",
               "output_tensors=[split_a,split_b,out]")
    ir.section("layer_id=0", "layer_name=data", "layer_type=Input", "layer_bottom=[]", "layer_bottom_shape=[]",
               "layer_bottom_type=[]", "layer_top=[data]", "layer_top_shape=[[1,4,4,3]]", "layer_top_type=[float32]",
               "layer_top_range=[[-1.5,2.25]]", "layer_top_scale=[1.0]", "layer_top_zp=[0]")
    # one constant of every dtype, each with its own (non-contiguous in memory) storage
    consts = ir.section("layer_id=1", "layer_name=consts", "layer_type=AllDtypesForRoundTrip",
                        "layer_bottom=[data]", "layer_bottom_shape=[[1,4,4,3]]", "layer_bottom_type=[float32]",
                        "layer_top=[consts]", "layer_top_shape=[[1,4,4,3]]", "layer_top_type=[float32]")
    for dtype in Dtype:
        values = _storage_values(dtype, rng)
        if values.size % 2 == 0 and dtype is not Dtype.BOOL:
            values = values.reshape(2, -1)
        ir.constant(consts, "c_" + dtype.value, [(dtype, values)])
    consts += ["weights_range=[-1.0,1.0]", "alpha=0.200000", "epsilon=1e-05", "flag=True", "axis=[-1]",
               "note=a=b", "with_activation=NONE", "method=MAX", "big=123456789012", "neg_inf=-inf"]
    # two outputs with per-output range/scale/zp, a list-valued constant and quantized-IR style params
    split = ir.section("layer_id=2", "layer_name=split", "layer_type=SplitForRoundTrip", "layer_bottom=[consts]",
                       "layer_bottom_shape=[[1,4,4,3]]", "layer_bottom_type=[float32]",
                       "layer_top=[split_a,split_b]", "layer_top_shape=[[1,4,4,1],[1,4,4,2]]",
                       "layer_top_type=[int8,uint8]", "layer_top_range=[[-128,127],[0,255]]",
                       "layer_top_scale=[66.12385559082031,0.5]", "layer_top_zp=[0,-5]")
    ir.constant(split, "lut", [(Dtype.UINT8, np.arange(256, dtype="u1")),
                               (Dtype.INT16, rng.integers(-32768, 32767, 193).astype("<i2")),
                               (Dtype.FP32, rng.standard_normal((2, 3)).astype("<f4"))], as_list=True)
    split += ["axis=3", "split=[1,2]", "scale_value=[128,22917,22884]", "shift_value=22",
              "scale_type=[uint16,uint16,uint16]", "shift_type=int8", "is_perf_mode=true", "unquantifiable=false",
              "activation_quantization_axis=[None,None]"]
    # per-channel output scale/zp stored in the .bin
    conv = ir.section("layer_id=3", "layer_name=conv", "layer_type=Convolution", "layer_bottom=[split_b]",
                      "layer_bottom_shape=[[1,4,4,2]]", "layer_bottom_type=[uint8]", "layer_top=[conv]",
                      "layer_top_shape=[[1,4,4,4]]", "layer_top_type=[int8]", "layer_top_range=[[-127,127]]")
    ir.constant(conv, "layer_top_scale", [(Dtype.FP32, rng.uniform(1, 100, 4).astype("<f4"))])
    ir.constant(conv, "layer_top_zp", [(Dtype.INT32, np.array([0, 1, -2, 3], dtype="<i4"))])
    ir.constant(conv, "weights", [(Dtype.INT8, rng.integers(-127, 128, (4, 3, 3, 2)).astype("i1"))])
    ir.constant(conv, "biases", [(Dtype.INT32, rng.integers(-2 ** 31, 2 ** 31 - 1, 4).astype("<i4"))])
    ir.constant(conv, "scale", [(Dtype.UINT16, np.array([1, 2, 65535, 0], dtype="<u2"))])
    ir.constant(conv, "shift", [(Dtype.INT8, np.array([-3, 0, 12, 31], dtype="i1"))])
    conv += ["kernel_x=3", "kernel_y=3", "stride_x=1", "stride_y=1", "pad_left=1", "pad_right=1", "pad_top=1",
             "pad_bottom=1", "group=1", "num_output=4", "with_activation=RELU", "weights_scale=182.07623291015625",
             "weights_zp=0", "is_perf_mode=true", "unquantifiable=false", "activation_quantization_axis=[None]"]
    ir.section("layer_id=4", "layer_name=out", "layer_type=Eltwise", "layer_bottom=[conv,split_a]",
               "layer_bottom_shape=[[1,4,4,4],[1,4,4,1]]", "layer_bottom_type=[int8,int8]", "layer_top=[out]",
               "layer_top_shape=[[1,4,4,4]]", "layer_top_type=[float16]", "method=ADD", "with_activation=NONE")
    return ir


def _write_tiny(folder: Path) -> Tuple[str, bytes, bytes]:
    ir = tiny_ir()
    text = ir.text().encode("utf-8")
    (folder / "tiny.txt").write_bytes(text)
    (folder / "tiny.bin").write_bytes(bytes(ir.bin))
    return str(folder / "tiny.txt"), text, bytes(ir.bin)


@pytest.fixture
def tiny(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    return _write_tiny(src)


def _files(folder: Path) -> List[str]:
    return sorted(os.listdir(folder))


def test_tiny_ir_round_trip_is_byte_identical(tiny, tmp_path):
    path, text, data = tiny
    g = read_ir(path)
    out = tmp_path / "out"
    txt, binp = write_ir(g, str(out / "tiny.txt"))
    assert Path(binp).read_bytes() == data
    assert Path(txt).read_bytes() == text
    assert _files(out) == ["tiny.bin", "tiny.txt"]
    # and the written IR reads back to the same text again
    again = serialize_ir(read_ir(txt), "tiny.bin")
    assert again == (text.decode("utf-8"), data)


def test_tiny_ir_covers_every_dtype(tiny):
    g = read_ir(tiny[0])
    consts = g.node("consts").constants
    assert {c.dtype for c in consts.values()} == set(Dtype)
    assert len(consts) == len(Dtype)


def test_tiny_ir_values(tiny):
    g = read_ir(tiny[0])
    c = g.node("consts").constants
    assert c["c_aligned_int4"].betensor.flatten().tolist()[:3] == [-8, 7, 0]
    assert c["c_aligned_uint4"].betensor.flatten().tolist()[:3] == [0, 15, 0]
    assert c["c_aligned_int12"].betensor.flatten().tolist()[:3] == [-2048, 2047, 0]
    assert c["c_uint64"].dtype is Dtype.UINT64
    assert c["c_bool"].betensor.dtype == torch.bool
    assert c["c_bfloat16"].betensor.flatten()[2].item() == 1.0
    assert c["c_float16"].betensor.flatten()[4].item() == 1.0
    e4m3 = c["c_float8_e4m3fn"].betensor.flatten()
    assert e4m3[0x7E].item() == 448.0 and e4m3.numel() == 254  # every code but the two NaNs
    assert c["c_float8_e5m2"].betensor.flatten()[0x7B].item() == 57344.0
    assert c["c_float4_e2m1fn"].betensor.flatten().tolist()[:8] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert c["c_int8"].ir_range is None
    assert c["c_float32"].betensor.shape == (11,)
    assert c["c_int32"].betensor.shape == (2, 4)


def test_multi_output_and_list_constants(tiny):
    g = read_ir(tiny[0])
    split = g.node("split")
    a, b = split.outputs
    assert (a.ir_range, b.ir_range) == ([-128, 127], [0, 255])
    qa, qb = g.quant.get(a), g.quant.get(b)
    assert (qa.scale, qb.scale) == (66.12385559082031, 0.5)
    assert (qa.zerop, qb.zerop) == (0, -5)
    assert (a.dtype, b.dtype) == (Dtype.INT8, Dtype.UINT8)
    assert list(split.constants) == ["lut_0", "lut_1", "lut_2"]
    assert [t.dtype for t in split.constants.values()] == [Dtype.UINT8, Dtype.INT16, Dtype.FP32]
    assert split.constants["lut_0"].betensor.tolist() == list(range(256))
    assert split.params["scale_type"] == [Dtype.UINT16] * 3
    assert split.params["activation_quantization_axis"] == [None, None]
    conv = g.node("conv")
    assert g.quant.get(conv.outputs[0]).zerop.tolist() == [0, 1, -2, 3]
    assert g.quant.get(conv.outputs[0]).scale.shape == (4,)
    assert "layer_top_scale" not in conv.constants
    assert g.node("consts").constants["c_float32"].ir_range is None
    assert g.node("data").outputs[0].ir_range == [-1.5, 2.25]


def test_constant_range_and_raw_params(tiny, tmp_path):
    g = read_ir(tiny[0])
    consts = g.node("consts")
    assert consts.params["alpha"] == 0.2
    assert consts.params["flag"] is True
    assert consts.params["note"] == "a=b"
    text = serialize_ir(g, "tiny.bin")[0]
    assert "alpha=0.200000\n" in text and "flag=True\n" in text
    # a changed value is written in the canonical form
    consts.params["alpha"] = 0.25
    consts.params["flag"] = False
    text = serialize_ir(g, "tiny.bin")[0]
    assert "alpha=0.25\n" in text and "flag=false\n" in text


def test_deterministic_output(tiny, tmp_path):
    g = read_ir(tiny[0])
    write_ir(g, str(tmp_path / "a" / "m.txt"))
    write_ir(g, str(tmp_path / "b" / "m.txt"))
    write_ir(read_ir(str(tmp_path / "a" / "m.txt")), str(tmp_path / "c" / "m.txt"))
    for name in ("m.txt", "m.bin"):
        first = (tmp_path / "a" / name).read_bytes()
        assert (tmp_path / "b" / name).read_bytes() == first
        assert (tmp_path / "c" / name).read_bytes() == first
    assert serialize_ir(g, "x.bin") == serialize_ir(g, "x.bin")


def test_model_bin_follows_the_written_name(tiny, tmp_path):
    g = read_ir(tiny[0])
    txt, binp = write_ir(g, str(tmp_path / "renamed.txt"))
    assert "model_bin=./renamed.bin\n" in Path(txt).read_text()
    assert read_ir(txt).node("conv").constants["weights"].betensor.shape == (4, 3, 3, 2)


def test_changed_constant_is_rewritten(tiny, tmp_path):
    g = read_ir(tiny[0])
    w = g.node("conv").constants["weights"]
    w.betensor = torch.zeros(2, 2, dtype=torch.int64)
    w.ir_shape = (2, 2)
    txt, _ = write_ir(g, str(tmp_path / "m.txt"))
    g2 = read_ir(txt)
    assert g2.node("conv").constants["weights"].betensor.tolist() == [[0, 0], [0, 0]]
    assert "weights_size=4\n" in Path(txt).read_text()


def test_out_of_order_offsets_are_read_by_offset(tmp_path):
    """Constants listed out of offset order (the Parser puts biases first in the .bin) keep their values;
    the writer lays them out again sequentially."""
    text = ("model_name=m\nlayer_number=2\ninput_tensors=[x]\noutput_tensors=[y]\n\n"
            "layer_id=0\nlayer_name=x\nlayer_type=Input\nlayer_bottom=[]\nlayer_bottom_shape=[]\n"
            "layer_bottom_type=[]\nlayer_top=[x]\nlayer_top_shape=[[1,2]]\nlayer_top_type=[float32]\n\n"
            "layer_id=1\nlayer_name=y\nlayer_type=FullyConnected\nlayer_bottom=[x]\nlayer_bottom_shape=[[1,2]]\n"
            "layer_bottom_type=[float32]\nlayer_top=[y]\nlayer_top_shape=[[1,3]]\nlayer_top_type=[float32]\n"
            "weights_type=float32\nweights_offset=12\nweights_size=24\nweights_shape=[3,2]\n"
            "biases_type=float32\nbiases_offset=0\nbiases_size=12\nbiases_shape=[3]\nnum_output=3\n")
    (tmp_path / "m.txt").write_text(text)
    (tmp_path / "m.bin").write_bytes(np.arange(9, dtype="<f4").tobytes())
    g = read_ir(str(tmp_path / "m.txt"))
    assert g.node("y").constants["biases"].betensor.tolist() == [0.0, 1.0, 2.0]
    assert g.node("y").constants["weights"].betensor.tolist() == [[3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]
    txt, _ = write_ir(g, str(tmp_path / "out" / "m.txt"))
    g2 = read_ir(txt)
    assert g2.node("y").constants["biases"].betensor.tolist() == [0.0, 1.0, 2.0]
    assert g2.node("y").constants["weights"].betensor.tolist() == [[3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]


def test_unaligned_float32_constant(tmp_path):
    text = ("model_name=m\nlayer_number=1\ninput_tensors=[x]\noutput_tensors=[x]\n\n"
            "layer_id=0\nlayer_name=x\nlayer_type=Constant\nlayer_bottom=[]\nlayer_bottom_shape=[]\n"
            "layer_bottom_type=[]\nlayer_top=[x]\nlayer_top_shape=[[3]]\nlayer_top_type=[float32]\n"
            "weights_type=float32\nweights_offset=1\nweights_size=12\nweights_shape=[3]\n\n"
            # a packed .bin: the float32 constant follows a 1-byte one (an offset that follows no constant is an
            # error, tests/bad_inputs)
            "layer_id=1\nlayer_name=pad\nlayer_type=Constant\nlayer_bottom=[]\nlayer_top=[pad]\n"
            "layer_top_shape=[[1]]\nlayer_top_type=[uint8]\n"
            "weights_type=uint8\nweights_offset=0\nweights_size=1\nweights_shape=[1]\n")
    text = text.replace("layer_number=1", "layer_number=2")
    (tmp_path / "m.txt").write_text(text)
    (tmp_path / "m.bin").write_bytes(b"\x00" + np.array([1.5, -2.0, 3.25], dtype="<f4").tobytes())
    g = read_ir(str(tmp_path / "m.txt"))
    assert g.node("x").constants["weights"].betensor.tolist() == [1.5, -2.0, 3.25]


# ------------------------------------------------------------------------------------ atomic writes
def _fail_on_call(monkeypatch, n: int) -> None:
    real = writer_module.encode_storage
    calls = {"n": 0}

    def encode(tensor, dtype):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError("simulated failure while encoding a constant")
        return real(tensor, dtype)

    monkeypatch.setattr(writer_module, "encode_storage", encode)


def test_failed_write_leaves_nothing(tiny, tmp_path, monkeypatch):
    g = read_ir(tiny[0])
    out = tmp_path / "out"
    out.mkdir()
    _fail_on_call(monkeypatch, 10)
    with pytest.raises(RuntimeError, match="simulated failure"):
        write_ir(g, str(out / "tiny.txt"))
    assert _files(out) == []


def test_failed_write_keeps_previous_files(tiny, tmp_path, monkeypatch):
    g = read_ir(tiny[0])
    out = tmp_path / "out"
    write_ir(g, str(out / "tiny.txt"))
    before = {name: (out / name).read_bytes() for name in _files(out)}
    g.node("conv").constants["weights"].betensor.zero_()
    _fail_on_call(monkeypatch, len(Dtype) + 8)
    with pytest.raises(RuntimeError):
        write_ir(g, str(out / "tiny.txt"))
    assert {name: (out / name).read_bytes() for name in _files(out)} == before


def test_failure_writing_the_second_file_removes_both_temp_files(tiny, tmp_path, monkeypatch):
    g = read_ir(tiny[0])
    out = tmp_path / "out"
    out.mkdir()
    real_fsync = os.fsync
    calls = {"n": 0}

    def fsync(fd):
        calls["n"] += 1
        if calls["n"] == 2:  # the .txt (the .bin is written first)
            raise OSError(28, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(writer_module.os, "fsync", fsync)
    with pytest.raises(OSError, match="No space"):
        write_ir(g, str(out / "tiny.txt"))
    assert _files(out) == []


def test_failure_renaming_leaves_no_temp_files(tiny, tmp_path, monkeypatch):
    g = read_ir(tiny[0])
    out = tmp_path / "out"
    out.mkdir()

    def replace(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(writer_module.os, "replace", replace)
    with pytest.raises(OSError):
        write_ir(g, str(out / "tiny.txt"))
    assert _files(out) == []


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permission bits")
def test_written_files_get_default_permissions_without_touching_the_umask(tiny, tmp_path, monkeypatch):
    """The IR files get the mode any file the user creates gets (the kernel applies the umask), and the writer
    never sets the process umask (a process-wide change other threads would see)."""
    g = read_ir(tiny[0])
    out = tmp_path / "out"
    out.mkdir()
    plain = out / "plain"
    plain.write_bytes(b"")
    expected = plain.stat().st_mode & 0o777
    plain.unlink()

    def umask(mask):
        raise AssertionError("the writer changed the process umask")

    monkeypatch.setattr(writer_module.os, "umask", umask)
    txt, binp = write_ir(g, str(out / "tiny.txt"))
    assert (os.stat(txt).st_mode & 0o777, os.stat(binp).st_mode & 0o777) == (expected, expected)
    assert sorted(_files(out)) == ["tiny.bin", "tiny.txt"]

# --------------------------------------------------------------------------------------------- mmap
def _mapped_ranges(path: str) -> List[Tuple[int, int]]:
    real = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    return ranges


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/maps"),
                                reason="needs /proc/self/maps (Linux)")


@linux_only
def test_float32_constants_are_views_of_the_mapping(tiny, tmp_path):
    path = tiny[0]
    binp = str(Path(path).with_suffix(".bin"))
    g = read_ir(path)
    ranges = _mapped_ranges(binp)
    assert ranges, "the .bin is not memory-mapped"
    w = g.node("consts").constants["c_float32"].betensor
    ptr = w.data_ptr()
    assert any(lo <= ptr < hi for lo, hi in ranges)
    # the mapping is copy-on-write: changing the tensor in memory leaves the file alone
    before = Path(binp).read_bytes()
    w.fill_(7.0)
    assert Path(binp).read_bytes() == before


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@linux_only
def test_large_bin_is_not_copied(tmp_path):
    size = 50 * 1024 * 1024
    n = size // 4
    text = ("model_name=big\nlayer_number=1\ninput_tensors=[w]\noutput_tensors=[w]\n\n"
            "layer_id=0\nlayer_name=w\nlayer_type=Constant\nlayer_bottom=[]\nlayer_bottom_shape=[]\n"
            f"layer_bottom_type=[]\nlayer_top=[w]\nlayer_top_shape=[[{n}]]\nlayer_top_type=[float32]\n"
            f"weights_type=float32\nweights_offset=0\nweights_size={size}\nweights_shape=[{n}]\n")
    (tmp_path / "big.txt").write_text(text)
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(size)  # zero-filled
    before = _rss_bytes()
    g = read_ir(str(tmp_path / "big.txt"))
    grown = _rss_bytes() - before
    w = g.node("w").constants["weights"].betensor
    assert w.shape == (n,)
    assert any(lo <= w.data_ptr() < hi for lo, hi in _mapped_ranges(str(tmp_path / "big.bin")))
    assert grown < size // 4, f"reading grew RSS by {grown} bytes for a {size}-byte .bin"
    assert float(w[-1]) == 0.0


# --------------------------------------------------------------------------------- reference models
def _shared_irs() -> List[Tuple[str, str]]:
    cases = []
    for name in MODEL_NAMES:
        cases.append((name, f"{name}/{name}.txt"))
        for variant in ("A", "B", "C"):
            cases.append((name, f"{name}/golden/{variant}/{name}_o.txt"))
    return cases


@pytest.mark.parametrize("rel", [c[1] for c in _shared_irs()], ids=[c[1] for c in _shared_irs()])
def test_shared_ir_round_trip(rel, tmp_path):
    src = SHARED_MODELS / rel
    if not src.is_file():
        pytest.skip(f"reference IR {src} is not present")
    g = read_ir(str(src))
    txt, binp = write_ir(g, str(tmp_path / src.name))
    assert Path(binp).read_bytes() == src.with_suffix(".bin").read_bytes()
    written = Path(txt).read_text(encoding="utf-8")
    original = src.read_text(encoding="utf-8")
    # identical text; the only liberty is the number of blank lines at the very end of the file
    assert written.endswith("\n") and not written.endswith("\n\n")
    assert written.rstrip("\n") == original.rstrip("\n")
