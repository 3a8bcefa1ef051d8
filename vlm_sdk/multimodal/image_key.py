"""An image's identity for the prefix and encoder caches: what its pixels are, and the settings that
decide what the vision tower makes of them.

Two images share a key only when their decoded pixels are byte-identical (mode, size and every
sample) and they were preprocessed with the same per-image settings (for example min/max pixels,
which decide the patch grid, or the tile count). The key is computed once per image, where the
family's processor decodes it (on the prompt-preparation threads), never per block or per step.
"""
from __future__ import annotations

import hashlib

from PIL import Image

KEY_BYTES = 16  # 128-bit BLAKE2b: collisions are not a practical concern for any cache size


def image_key(image: Image.Image, **settings: object) -> bytes:
    """The key of decoded `image` preprocessed under `settings` (name -> value; plain values whose
    repr is stable: ints, floats, strings, bools, None, tuples of them)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    h.update(repr(sorted(settings.items())).encode())
    return h.digest()


def salted_key(key: bytes, salt: str) -> bytes:
    """The key of an image in a request with `cache_salt` `salt`: another salt's (or no salt's) entry
    for the same image is never found under it."""
    h = hashlib.blake2b(key, digest_size=KEY_BYTES)
    h.update(b"\0cache_salt\0" + salt.encode("utf-8", "surrogatepass"))
    return h.digest()


def pixels_key(pixels, **settings: object) -> bytes:
    """The key of preprocessed pixels (a numpy array or tensor: its dtype, shape and bytes) under
    `settings` (what else decides the embeddings and positions of its tokens): a video's temporal patch,
    whose sampled frames at their resized size are all the vision tower sees of it."""
    import numpy as np
    array = np.ascontiguousarray(pixels.numpy() if hasattr(pixels, "numpy") else pixels)
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(f"{array.dtype}:{array.shape}:".encode())
    h.update(array.data)
    h.update(repr(sorted(settings.items())).encode())
    return h.digest()
