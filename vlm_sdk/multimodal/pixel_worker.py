"""One image preprocessing process: decode, resize and patchify images outside the server's process.

The child is `python -m vlm_sdk.multimodal.pixel_worker` (it imports what a job's function needs and
nothing of the caller's `__main__`). Pipe protocol: every message is an int64 little-endian length and
that many bytes.

    parent -> child, per job:  pickle (input name, input bytes, what, max_image_pixels, fn, args)
                               the encoded image is the shared-memory file `input name`
                               (shared_tensors.write_shared), never the pipe
    child -> parent, per job:  shared_tensors.dumps(("ok", fn(image, *args)) | ("error", exception))
                               the result's tensors in shared memory; `image` the decoded RGB
                               PIL image, upright (image_io.load_image)

`fn` is a module-level function (pickled by reference): the model family's pixel work on one decoded
image, e.g. `qwen_image_pixels`. An error it raises is sent back as it is when it is the SDK's own
(`VLMError`: the request's 400), else as a RuntimeError naming it. A crash of the process itself (a
decoder's segfault, the kernel's OOM killer) ends the pipe: the parent's `PixelWorker` turns that into
the request's `InvalidImageError` and starts another process for the next image.
"""
from __future__ import annotations

import pickle
import struct
import sys

_INT = struct.Struct("<q")


def read_message(stream) -> bytes | None:
    """The next message, or None at the end of the stream (the other side is gone)."""
    head = stream.read(_INT.size)
    if len(head) < _INT.size:
        return None
    n = _INT.unpack(head)[0]
    data = stream.read(n)
    return data if len(data) == n else None


def write_message(stream, data: bytes) -> None:
    stream.write(_INT.pack(len(data)))
    stream.write(data)
    stream.flush()


def run_job(blob: bytes) -> bytes:
    """One job's reply (see the module docstring)."""
    from vlm_sdk.errors import VLMError
    from vlm_sdk.multimodal import shared_tensors
    from vlm_sdk.multimodal.image_io import load_image, reopen
    try:
        name, size, what, max_image_pixels, fn, args = pickle.loads(blob)
        pages = shared_tensors.map_shared(name, size)
        try:
            opened = reopen(bytes(pages), what)  # bytes: PIL's lazy decoder must not view the mapping
        finally:
            pages.close()
        reply = ("ok", fn(load_image(opened, max_image_pixels=max_image_pixels), *args))
    except VLMError as e:
        reply = ("error", e)
    except Exception as e:  # a bug, not the image: the caller sees what it was
        reply = ("error", RuntimeError(f"image preprocessing failed in its process: {type(e).__name__}: {e}"))
    try:
        return shared_tensors.dumps(reply)
    except Exception as e:  # an error that does not pickle
        return shared_tensors.dumps(("error", RuntimeError(f"{type(reply[1]).__name__}: {reply[1]} ({e})")))


def serve(stdin, stdout) -> None:
    while (blob := read_message(stdin)) is not None:
        write_message(stdout, run_job(blob))


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
