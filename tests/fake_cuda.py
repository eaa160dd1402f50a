"""A stand-in CUDA device for machines without a GPU, to find device mistakes in CPU-only test runs.

Inside `fake_cuda()`, torch reports one CUDA device; tensors moved or created there are CPU tensors of the marker
class `FakeCudaTensor`, whose `.device` says `cuda:0`. Every torch call is checked the way the CUDA build checks it:
- tensors of both devices in one call fail ("Expected all tensors to be on the same device"), except CPU scalars
  (0-dim tensors), CPU index tensors indexing a CUDA tensor and values assigned by indexing (a copy), which CUDA
  accepts too;
- `.numpy()` of a CUDA tensor fails;
- integer matrix products and convolutions on CUDA fail (CUDA has no int64 GEMM);
- `.cpu()`, `.to("cpu")` and `.item()` give plain CPU values.
The values are computed on the CPU, so it finds where a tensor is on the wrong device or where a CUDA-only limit is
hit, never a numerical difference of the GPU: that needs a GPU (tests/test_device_parity.py,
benchmarks/gpu_check.sh). QUANTOPT_TEST_DEVICE=fake-cuda runs the suite's workflows and the parity tests on it.
"""
from __future__ import annotations

import contextlib
import traceback
from typing import Any, Callable, Dict, Iterator, List
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

CUDA = torch.device("cuda", 0)


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that stands for one on `cuda:0` (only the mode below gives it that meaning)."""


def _is_fake(x: Any) -> bool:
    return isinstance(x, FakeCudaTensor)


def _plain(x: Any) -> Any:
    if isinstance(x, FakeCudaTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return x.as_subclass(torch.Tensor)
    return x


def _fake(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, FakeCudaTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return x.as_subclass(FakeCudaTensor)
    return x


def _unwrap(x: Any) -> Any:
    """Fake tensors in (nested) lists, tuples and dicts as plain ones; other values as they are (a torch.Size stays a
    Size: `x.new(size)` and `x.new(tuple)` mean different things)."""
    if isinstance(x, FakeCudaTensor):
        return _plain(x)
    if type(x) in (list, tuple):
        return type(x)(_unwrap(v) for v in x)
    if type(x) is dict:
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _wrap(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _fake(x)
    if type(x) in (list, tuple):
        return type(x)(_wrap(v) for v in x)
    if isinstance(x, tuple) and hasattr(type(x), "n_fields"):  # torch.return_types (values, indices)
        return type(x)([_wrap(v) for v in x])
    return x


def _caller() -> str:
    """The innermost quantopt or plugin frame calling torch, named in the emulated errors (a workflow run logs only
    the error line)."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if ("/quantopt/" in path or "/plugins/" in path) and "fake_cuda" not in path:
            return f" [at {'/'.join(path.split('/')[-2:])}:{frame.lineno} {frame.name}]"
    return ""


def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.strip().lower().startswith("cuda")
    return False


def _is_cpu_device(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cpu"
    return isinstance(d, str) and d.strip().lower() == "cpu"


_INT_GEMMS = {torch.mm, torch.bmm, torch.matmul, torch.addmm, torch.baddbmm, torch.addbmm, torch.addmv, torch.mv,
              torch.Tensor.mm, torch.Tensor.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__,
              torch.Tensor.__rmatmul__, torch.Tensor.addmm, torch.Tensor.baddbmm, torch.Tensor.mv,
              torch.nn.functional.linear, torch.nn.functional.conv1d, torch.nn.functional.conv2d,
              torch.nn.functional.conv3d, torch.nn.functional.conv_transpose1d,
              torch.nn.functional.conv_transpose2d, torch.nn.functional.conv_transpose3d, torch.einsum,
              torch.tensordot}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_MOVES_BETWEEN = {torch.Tensor.copy_}
_DEVICE_GET, _IS_CUDA_GET, _IS_CPU_GET = (torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__,
                                          torch.Tensor.is_cpu.__get__)


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if func == _DEVICE_GET:
            return CUDA if _is_fake(args[0]) else torch.device("cpu")
        if func == _IS_CUDA_GET:
            return _is_fake(args[0])
        if func == _IS_CPU_GET:
            return not _is_fake(args[0])
        if func is torch.Tensor.get_device:
            return 0 if _is_fake(args[0]) else -1
        if func is torch.Tensor.cpu:
            return _plain(args[0])
        if func is torch.Tensor.cuda:
            return _fake(_plain(args[0]).clone() if not _is_fake(args[0]) else args[0])
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and _is_fake(args[0]):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first." + _caller())
        target = kwargs.pop("device", None)
        if func in (torch.Tensor.to, torch.Tensor.type_as) or name == "to":
            rest = list(args[1:])
            for i, a in enumerate(rest):
                if isinstance(a, (torch.device, str)) and (_is_cuda_device(a) or _is_cpu_device(a)):
                    target = a
                    rest[i] = torch.device("cpu")
                elif isinstance(a, torch.Tensor):  # .to(other): its device and dtype
                    target = CUDA if _is_fake(a) else torch.device("cpu")
                    rest[i] = a.dtype
            with torch._C.DisableTorchFunctionSubclass():
                out = func(_plain(args[0]), *rest, **kwargs)
            if target is None:
                return _fake(out) if _is_fake(args[0]) else out
            return _fake(out) if _is_cuda_device(target) else _plain(out)
        flat, _ = tree_flatten((args, kwargs))
        tensors: List[torch.Tensor] = [t for t in flat if isinstance(t, torch.Tensor)]
        fakes = [t for t in tensors if _is_fake(t)]
        on_cuda = bool(fakes) or _is_cuda_device(target)
        if on_cuda and not _is_cuda_device(target) and target is not None and _is_cpu_device(target):
            on_cuda = bool(fakes) and func not in (torch.empty_like, torch.zeros_like, torch.ones_like,
                                                   torch.full_like, torch.rand_like, torch.randn_like)
        if fakes and func not in _MOVES_BETWEEN:
            plain = [t for t in tensors if not _is_fake(t) and t.dim() > 0]
            if func in _INDEXING:
                self_fake = _is_fake(args[0])
                index_fake = any(_is_fake(t) for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor))
                if not self_fake and index_fake:
                    raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor "
                                       "(cpu)" + _caller())
                plain = [] if self_fake or func is torch.Tensor.__setitem__ else plain  # setitem copies
            if plain:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"cuda:0 and cpu! ({name}){_caller()}")
        if on_cuda and func in _INT_GEMMS:
            if any(not t.is_floating_point() and not t.is_complex() for t in tensors):
                raise NotImplementedError(f'"{name}_cuda" not implemented for \'Long\'' + _caller())
        if target is not None:
            kwargs["device"] = torch.device("cpu") if (_is_cuda_device(target) or _is_cpu_device(target)) else target
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*_unwrap(args), **_unwrap(kwargs))
        if func is torch.Tensor.item or name in ("tolist", "item"):
            return out
        if on_cuda and not (target is not None and _is_cpu_device(target)):
            return _wrap(out)
        return out


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """Within the block torch sees one CUDA device, emulated as described above."""
    patches: Dict[str, Any] = {
        "torch.cuda.is_available": lambda: True,
        "torch.cuda.device_count": lambda: 1,
        "torch.cuda.get_device_name": lambda *a, **k: "fake CUDA device (CPU emulation)",
        "torch.cuda.synchronize": lambda *a, **k: None,
    }
    with contextlib.ExitStack() as stack:
        for target, value in patches.items():
            stack.enter_context(mock.patch(target, value))
        stack.enter_context(_Mode())
        yield
