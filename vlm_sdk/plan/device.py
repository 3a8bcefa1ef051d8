"""What `plan` plans for, and whether the cache fits there.

    device      --device-memory SIZE (a device of that much memory, bfloat16 by default)
                | --device cuda[:N] (its total memory, and what is in use on it now)
                | --device cpu (host RAM: MemTotal of /proc/meminfo, or --host-memory SIZE)
                | nothing: this machine's GPU; with no GPU, `plan` refuses and asks for one of the above
    fits        in use + weights + activation peak + encoder cache + KV cache <= device (or host) memory

Sizes: an int is bytes; a string needs a unit (24GiB, 6784MiB, 1.5GB, 180709785B): `--device-memory 24`
is refused with the sizes it may have meant, never read as 24 bytes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from vlm_sdk.config import parse_bytes
from vlm_sdk.memory.report import format_bytes
from vlm_sdk.errors import InvalidRequestError, format_size

__all__ = ["DEVICE_HINT", "cache_fit_problem", "host_memory_bytes", "parse_size"]

DEVICE_HINT = ("--device-memory 24GiB (device_memory=\"24GiB\": a GPU of that much memory, bfloat16), or "
               "--device cpu (device=\"cpu\": this machine's CPU, float32, checked against its RAM)")
_SIZE_OPTIONS = ("device_memory", "kv_cache_memory", "host_memory")


def parse_size(value: int | str, name: str) -> int:
    """A plan size: an int of bytes, or a string with a unit (`config.parse_bytes`), at least 1 byte."""
    n = parse_bytes(value, name, unit_required=True)
    if n < 1:
        raise InvalidRequestError(f"{name}={value!r} must be a positive size, e.g. 24GiB", param=name)
    return n


def host_memory_bytes() -> int:
    """This machine's RAM (MemTotal of /proc/meminfo; else the sysconf page count)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Memory:
    """Where the plan runs: `total` bytes, of which `other_use` is taken before the model loads."""
    total: int
    other_use: int
    what: str  # "device memory" | "host RAM"


def cache_fit_problem(mem: Memory, weights: int, peak: int, num_blocks: int, per_block: int, rule: str,
                      source: str, encoder: int = 0, state: int = 0):
    """(message, fixes) when the KV cache does not fit beside the weights, the activation peak and the
    encoder cache (`encoder` bytes, its bound), naming the largest num_blocks / kv_cache_memory that
    does (only settings that would take effect: num_blocks overrides kv_cache_memory); None when it fits.
    `state`: the state slots' bytes, part of the cache (carved out before its blocks)."""
    cache = num_blocks * per_block + state
    room = mem.total - mem.other_use - weights - peak - encoder
    if cache <= room:
        return None
    used = f"{format_bytes(weights)} of weights"
    if mem.other_use:
        used += f", {format_bytes(mem.other_use)} already in use"
    enc = f", the {format_bytes(encoder)} encoder cache (encoder_cache_memory)" if encoder else ""
    head = (f"the KV cache of {num_blocks:,} blocks = {format_bytes(cache)} ({source}) does not fit in "
            f"{format_bytes(mem.total)} of {mem.what} beside {used}{enc} and the {format_bytes(peak)} activation "
            f"peak (an estimate)")
    fit = max(room - state, 0) // per_block
    if room <= 0:
        return (f"{head}: the weights, the activation peak{' and the encoder cache' if encoder else ''} alone need "
                f"{format_bytes(mem.total - room)}, more than the {mem.what}, even without a KV cache; plan more "
                f"memory, a smaller --dtype or more --tp" + (", or lower --encoder-cache-memory" if encoder else ""),
                {})
    if fit < 1:
        return (f"{head}: not one {per_block:,}-byte block fits in the {format_bytes(room)} left; lower "
                f"--max-num-batched-tokens / --max-num-seqs / the image size setting"
                + (" / --encoder-cache-memory" if encoder else "") + ", or plan more memory", {})
    fixes: dict[str, int | str] = {}
    if rule != "num_blocks":
        fixes["kv_cache_memory"] = fit * per_block + state
    fixes["num_blocks"] = fit
    slots = f" beside {format_bytes(state)} of state slots" if state else ""
    return (f"{head}: {format_bytes(room)} is left for it; the largest that fits is num_blocks={fit}{slots} "
            f"(kv_cache_memory={format_size(fit * per_block + state)} = {format_bytes(fit * per_block + state)})",
            fixes)
