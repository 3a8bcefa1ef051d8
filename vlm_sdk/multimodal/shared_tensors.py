"""Bytes and tensors that cross between processes once, through shared memory, never through a pipe.

    write_shared(data) -> name               a new shared-memory file holding `data` (bytes / a buffer)
    map_shared(name, size) -> mmap           the file mapped and its name removed: the mapping alone keeps it
    dumps(value) / loads(blob)               pickle whose tensors and arrays of SHARE_BYTES or more travel as
                                             shared-memory files (`persistent_id`): the pickle carries their
                                             names, shapes and dtypes, the receiver maps the pages

A shared file lives in /dev/shm (tmpfs: memory, never a disk) where there is one, else the temporary
directory. The writer creates it and never removes it; the reader removes its name as soon as it has
mapped it, so a file outlives no reader, and the mapping (and with it the memory) goes when the last
tensor viewing it does (`torch.frombuffer` holds the mapping). A writer that dies before its reader
maps the file leaves it behind: `remove_shared` is for that path (the pool that sent the job removes
its input file whatever the worker did).
"""
from __future__ import annotations

import io
import mmap
import os
import pickle
import secrets
import tempfile

import numpy as np
import torch

SHARE_BYTES = 1 << 12  # smaller arrays are cheaper pickled than mapped (a page each)
_PREFIX = "vlm-shm-"


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _path(name: str) -> str:
    if not name.startswith(_PREFIX) or os.sep in name:
        raise ValueError(f"not a shared-memory name of ours: {name!r}")
    return os.path.join(_directory(), name)


def write_shared(data) -> str:
    """A new shared-memory file with the bytes of `data` (any buffer); its name."""
    view = memoryview(data).cast("B")
    name = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        written = 0
        while written < len(view):  # os.write releases the GIL
            written += os.write(fd, view[written:])
    finally:
        os.close(fd)
    return name


def map_shared(name: str, size: int) -> mmap.mmap:
    """The file `name` mapped (read-write, shared) and its name removed; `size` bytes of it."""
    path = _path(name)
    fd = os.open(path, os.O_RDWR)
    try:
        if size == 0:
            return mmap.mmap(-1, 1)  # mmap refuses length 0; nothing to read from it
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
        os.unlink(path)


def remove_shared(name: str) -> None:
    """Remove the file `name` if it is still there (its reader never came)."""
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


class _Pickler(pickle.Pickler):
    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.names: list[str] = []  # the files written, removed again if the pickle fails

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.requires_grad \
                and obj.numel() * obj.element_size() >= SHARE_BYTES:
            flat = obj.detach().contiguous().reshape(-1)
            self.names.append(write_shared(flat.view(torch.uint8).numpy()))
            return "tensor", self.names[-1], str(obj.dtype).removeprefix("torch."), tuple(obj.shape)
        if isinstance(obj, np.ndarray) and obj.nbytes >= SHARE_BYTES and not obj.dtype.hasobject:
            self.names.append(write_shared(np.ascontiguousarray(obj).reshape(-1).view(np.uint8)))
            return "array", self.names[-1], obj.dtype.str, obj.shape
        return None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        kind, name, dtype, shape = pid
        count = int(np.prod(shape, dtype=np.int64))
        if kind == "tensor":
            torch_dtype = getattr(torch, dtype)
            pages = map_shared(name, count * torch_dtype.itemsize)
            return torch.frombuffer(pages, dtype=torch_dtype, count=count).view(shape)  # holds `pages`
        if kind == "array":
            np_dtype = np.dtype(dtype)
            return np.frombuffer(map_shared(name, count * np_dtype.itemsize), dtype=np_dtype, count=count).reshape(shape)
        raise pickle.UnpicklingError(f"unknown shared object kind {kind!r}")


def dumps(value) -> bytes:
    """`value` pickled, its large tensors and arrays written to shared memory (see the module docstring)."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    try:
        pickler.dump(value)
    except BaseException:
        for name in pickler.names:
            remove_shared(name)
        raise
    return buf.getvalue()


def loads(blob: bytes):
    """`dumps`' value back; its tensors view the shared pages (nothing copied)."""
    return _Unpickler(io.BytesIO(blob)).load()
