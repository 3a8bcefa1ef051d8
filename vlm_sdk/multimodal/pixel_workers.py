"""Image preprocessing in worker processes, so that it grows with cores and no step of it holds our GIL.

    PixelWorkers(count).run(image, max_image_pixels, fn, *args) -> fn(load_image(image), *args)

`run` is called by a prompt-building thread (AsyncLLM's image and video pools, LLM's caller) with an
`OpenedImage` (its header read and checked, image_io.open_image) and the family's pixel function (a
module-level function of the decoded image: decode, resize, patchify, the image's key). The encoded
bytes go to an idle worker once, as a shared-memory file (multimodal/shared_tensors.py), the job's
function and settings as a small pickle; the patches come back as tensors viewing shared memory. The
caller's thread waits on the pipe with the GIL released; the event loop and the engine thread never
wait on it. At most `count` images are preprocessed at once: a caller waits for an idle worker (the
prompt pools run at most as many threads as there are workers, so in the server none waits here and
the pools' fair order between requests is the order the workers take images).

A worker that dies while it holds an image (a decoder that crashes on a hostile file, the OOM killer)
fails that image alone: `run` raises `InvalidImageError` naming the image and how the process ended,
and the next image that worker would have taken goes to a new process. A PIL image handed over as one
(no encoded bytes; the Python API) is preprocessed on the calling thread.
"""
from __future__ import annotations

import pickle
import queue
import signal
import subprocess
import sys
import threading

from vlm_sdk.errors import InvalidImageError
from vlm_sdk.multimodal import shared_tensors
from vlm_sdk.multimodal.image_io import DecodeCancelled, OpenedImage, load_image
from vlm_sdk.multimodal.pixel_worker import read_message, write_message


class PixelWorker:
    """One worker process (started on its first image, and again after it died), one image at a time."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the process now if none runs (its imports take a second or two: do it before images come)."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-m", "vlm_sdk.multimodal.pixel_worker"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def run(self, image: OpenedImage, max_image_pixels: int, fn, args: tuple):
        self.start()
        proc = self._proc
        name = shared_tensors.write_shared(image.data)
        try:
            try:
                write_message(proc.stdin, pickle.dumps((name, len(image.data), image.what, max_image_pixels, fn, args),
                                                       protocol=pickle.HIGHEST_PROTOCOL))
                reply = read_message(proc.stdout)  # blocks with the GIL released
            except (OSError, ValueError):  # the pipe broke, or `close` closed it under us
                reply = None
            if reply is None:
                raise self._died(proc, image) from None
        finally:
            shared_tensors.remove_shared(name)  # the worker removed it, unless it died first
        status, value = shared_tensors.loads(reply)
        if status == "error":
            raise value
        return value

    def _died(self, proc: subprocess.Popen, image: OpenedImage) -> InvalidImageError:
        """The image's error once its process ended mid-job; the process is reaped, the next job starts another."""
        proc.kill()
        code = proc.wait()
        self._proc = None
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        return InvalidImageError(
            f"image from {image.what} could not be preprocessed: the image process handling it ended ({how}) "
            f"while decoding and resizing it; the image is refused (the server goes on, another process takes "
            f"the next image). Send it re-encoded as PNG or JPEG, or smaller.")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            proc.kill()
            proc.wait()


class PixelWorkers:
    """`count` `PixelWorker`s, started at once; `run` takes an idle one (see the module docstring)."""

    def __init__(self, count: int):
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"PixelWorkers needs at least one worker, got {count!r}")
        self.count = count
        self._all = [PixelWorker() for _ in range(count)]
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._busy: set[int] = set()  # ids of the workers holding an image (`busy_pids`)
        self._lock = threading.Lock()
        self._closed = False
        for worker in self._all:
            worker.start()
            self._idle.put(worker)

    def run(self, image: OpenedImage, max_image_pixels: int, fn, *args):
        """`fn(load_image(image, max_image_pixels=...), *args)`, in a worker when `image` has encoded bytes.
        Raises what the job raised (the SDK's typed errors as they are), `InvalidImageError` when its worker
        died, `DecodeCancelled` when the image's request was cancelled before it was sent."""
        if image.data is None:
            return fn(load_image(image, max_image_pixels=max_image_pixels), *args)
        if image.cancelled is not None and image.cancelled.is_set():
            raise DecodeCancelled(image.what)
        worker = self._idle.get()
        try:
            if self._closed:
                raise RuntimeError("the image preprocessing workers are shut down")
            with self._lock:
                self._busy.add(id(worker))
            return worker.run(image, max_image_pixels, fn, args)
        finally:
            with self._lock:
                self._busy.discard(id(worker))
            self._idle.put(worker)

    def pids(self) -> list[int | None]:
        """Each worker's process id (None: not running)."""
        return [w.pid for w in self._all]

    def busy_pids(self) -> list[int]:
        """The process ids of the workers holding an image now."""
        with self._lock:
            return [w.pid for w in self._all if id(w) in self._busy and w.pid is not None]

    def close(self) -> None:
        """End every process; an image being preprocessed fails with `InvalidImageError`. Idempotent."""
        self._closed = True
        for worker in self._all:
            worker.close()
