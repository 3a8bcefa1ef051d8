"""Several engines of one benchmark on one device, each sized for its share.

An engine's `memory_utilization` bounds the whole device's use when it sizes its KV cache: what is in
use before it (its weights, the CUDA context, engines started earlier, other processes) counts against
it (`vlm_sdk.memory.kv.DeviceBudget`). Two engines that each ask for 0.9 leave the second nothing: the
first H100 run's `bench --multi-turn` failed so. Started one after another, the k-th of n engines takes
its share with k/n of the total utilization: the first 0.45, the second 0.9, each about 0.45 of the
device. What a later engine cannot see in use (an earlier one's activation peak, freed after its
profile, and its encoder cache, filled while serving) comes out of the 1 - utilization left over.
On the CPU nothing is shared (each engine has its own default cache).
"""
from __future__ import annotations

import gc

import torch

from vlm_sdk.config import DEFAULT_MEMORY_UTILIZATION


def bench_device(device: str | None) -> str:
    """The device a benchmark runs on: the one given, else CUDA when there is one."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def shared_engine_args(device: str, count: int, utilization: float = DEFAULT_MEMORY_UTILIZATION) -> list[dict]:
    """Engine keyword arguments for `count` engines started in this order on `device`, each sized
    for 1/count of `utilization` of the device."""
    if count < 1 or not 0.0 < utilization <= 1.0:
        raise ValueError(f"need count >= 1 and utilization in (0, 1], got {count}, {utilization}")
    if torch.device(device).type != "cuda":
        return [{} for _ in range(count)]
    return [{"memory_utilization": round(utilization * (k + 1) / count, 4)} for k in range(count)]


def describe(device: str, args: list[dict], names: list[str]) -> str:
    """One line saying how the engines share the device (for the report)."""
    if torch.device(device).type != "cuda":
        return f"device: {len(args)} engines on {device}, each with its own default cache"
    parts = ", ".join(f"{n} memory_utilization {a['memory_utilization']}" for n, a in zip(names, args))
    return (f"device: {len(args)} engines share {device}, started in this order: {parts} (each bounds the device's "
            f"total use, the engines before it included: about {args[0]['memory_utilization']} of it each)")


def release_device_memory(device: str) -> None:
    """Give the memory of engines that are gone back to the device before the next one sizes itself:
    the next engine measures the device's free memory, and torch's allocator keeps freed blocks."""
    gc.collect()  # CUDA graphs and caches can sit in reference cycles
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
