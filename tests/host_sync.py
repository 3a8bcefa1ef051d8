"""A host-sync detector that needs no GPU: code runs on the "meta" device (shapes, dtypes, no data;
like CUDA, not the host), and every operation that would make the host wait for a CUDA device is
reported.

A CUDA call makes the host wait when it reads a device value on the host (`item`, `tolist`, a bool
test, `nonzero`, a copy to the CPU) or copies host memory to the device without `non_blocking`
(cudaMemcpy from pageable memory waits for every kernel queued before it). Two views see them:
- each aten call (a dispatch mode): blocking uploads, copies down, data-dependent ops;
- each Python-level tensor call (a function mode): `tensor[index] = number` on a device tensor.
  On CUDA, torch stages that number as a CPU scalar tensor and `index_put_` copies it to the device
  with a blocking copy (the sync the first H100 run found in the sampler's min_tokens path); on the
  meta device torch makes it on the device at once, so the aten view alone would miss it.

    assert host_syncs(lambda device: code_under_test(torch.zeros(4, 100, device=device))) == []
"""
from __future__ import annotations

import numbers

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("meta")
# aten calls whose result depends on device values the host must read first
_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "bincount",
          "repeat_interleave", "equal", "is_nonzero"}
_HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero"}


class _HostSync(Exception):
    """Raised at the first sync: after a host read the code cannot go on without data."""


def _off_host(devices) -> bool:
    return any(d != "cpu" for d in devices)


def _aten_sync(name: str, devices: tuple[str, ...], kwargs: dict) -> bool:
    if name in _READS and _off_host(devices):
        return True
    if name in ("_to_copy", "copy_"):
        target = kwargs.get("device")
        target = torch.device(target).type if target is not None else None
        blocking = not kwargs.get("non_blocking", False)
        if target == "cpu" and _off_host(devices):
            return True  # a copy down waits for the value
        if target not in (None, "cpu") and "cpu" in devices and blocking:
            return True
        return name == "copy_" and len(set(devices)) > 1 and blocking
    return False


class _Aten(TorchDispatchMode):
    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        devices = tuple(a.device.type for a in args if isinstance(a, torch.Tensor))
        if _aten_sync(name, devices, kwargs):
            self.found.append(f"aten.{name} on {devices} {kwargs}")
            raise _HostSync
        return func(*args, **kwargs)


class _Python(TorchFunctionMode):
    def __init__(self, found: list[str]):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        on_device = isinstance(first, torch.Tensor) and first.device.type != "cpu"
        if func in (torch.tensor, torch.as_tensor) and torch.device(kwargs.get("device") or "cpu").type != "cpu":
            self.found.append(f"torch.{name}(..., device={kwargs['device']}): a blocking copy of host values")
            raise _HostSync
        if on_device and name in _HOST_READS:
            self.found.append(f"Tensor.{name}: a device value read on the host")
            raise _HostSync
        if on_device and name == "__setitem__" and isinstance(args[2], numbers.Number):
            self.found.append(f"tensor[...] = {args[2]!r}: a host scalar copied to the device (blocking on CUDA)")
            raise _HostSync
        return func(*args, **kwargs)


def host_syncs(fn) -> list[str]:
    """Run `fn(device)` on the meta device; the ways it would make the host wait (empty: none)."""
    found: list[str] = []
    try:
        with _Python(found), _Aten(found):
            fn(DEVICE)
    except _HostSync:
        pass
    except (NotImplementedError, RuntimeError) as e:
        if "meta" not in str(e):
            raise
        found.append(f"a data-dependent op: {e}")  # a meta tensor cannot answer it: neither can CUDA without a sync
    return found
