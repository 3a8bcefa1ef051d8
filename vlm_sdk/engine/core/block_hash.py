"""Hashes of full KV blocks, the keys of the prefix cache.

A block's K/V depend on every token before it, so a block's hash chains its parent's:

    hash(block i) = BLAKE2b(hash(block i-1) | token ids of block i | (image key, which of the image's
                            tokens opens the block's part of it, and where) per image in block i)

A request's `cache_salt` seeds the chain (the first block's parent is a hash of the salt), so no
block of one salt ever has the hash of another salt's (or of an unsalted request's) block.

Image tokens are all the same placeholder id; the image's key (its decoded pixels and the settings
that shaped its patches: `ImageInput.key`) tells two images apart. M-RoPE positions follow from
the tokens and the image grids before them, which the chain and the keys already cover. An image
without a key stops the chain: neither its blocks nor any after them are cached.

    block_size 4       tokens  t t <img0 img0 | img0 img0 img0 t | t t t .
    hashes                     h0 = H(-, [t t P P], (k0, 0))
                               h1 = H(h0, [P P P t], (k0, 2))
                               (block 2 is not full: no hash yet)
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

_HASH_BYTES = 16


@dataclass(frozen=True)
class ImageSpan:
    start: int  # index of the image's first token in the sequence
    end: int  # one past its last token
    key: bytes | None  # `ImageInput.key`


def block_hash(parent: bytes | None, token_ids: list[int], images: list[tuple[bytes, int, int]]) -> bytes:
    """`images`: per image with tokens in the block, (key, the block's first token of it counted from the
    image's first token, where in the block that token sits)."""
    h = hashlib.blake2b(parent or b"", digest_size=_HASH_BYTES)
    h.update(array("q", token_ids).tobytes())
    for key, offset, at in images:
        h.update(key)
        h.update(offset.to_bytes(8, "little") + at.to_bytes(8, "little"))
    return h.digest()


def salt_seed(salt: str | None) -> bytes | None:
    """The parent hash of a salted sequence's first block; None (no parent) without a salt."""
    if salt is None:
        return None
    return hashlib.blake2b(b"cache_salt\0" + salt.encode("utf-8", "surrogatepass"), digest_size=_HASH_BYTES).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], spans: list[ImageSpan], block_size: int,
                        num_tokens: int, seed: bytes | None = None) -> None:
    """Append to `hashes` the hashes of the blocks that `token_ids[:num_tokens]` fills, up to the first
    block holding an image without a key; `seed` (`salt_seed`) is the first block's parent."""
    for i in range(len(hashes), num_tokens // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        images = []
        for s in spans:
            if s.start < hi and s.end > lo:
                if s.key is None:
                    return
                first = max(lo, s.start)
                images.append((s.key, first - s.start, first - lo))
        hashes.append(block_hash(hashes[-1] if hashes else seed, token_ids[lo:hi], images))
