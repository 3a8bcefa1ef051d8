"""Decode attention alone over an int8 / int4 KV cache against bf16 (issue 47's GPU figure: batch 64, targets
>= 1.6x for int8 and >= 2.5x for int4 at long context): `paged_attention_decode` on the same random values
in each cache (`bench.gpu_parts.paged_attention_alone`: K/V from DRAM, calls replayed from a CUDA graph),
Qwen2.5-VL-7B's 28 query / 4 KV heads at head_dim 128. Prints one line per (context, cache) with us/call,
GB/s of the bytes each must read, the ratio against bf16 at that context, and the max difference from the
torch reference. `--tiny` runs the same code on the CPU (the interpreter's speed means nothing).

    PYTHONPATH=. python tools/kv_int_attention.py [--contexts 2048,8192,32768] [--batch 64] [--tiny]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", default="2048,8192,32768")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    from vlm_sdk.bench.gpu_parts import DeviceTimer, paged_attention_alone
    device = torch.device("cpu" if args.tiny else "cuda")
    timer = DeviceTimer(device)
    contexts = [64] if args.tiny else [int(c) for c in args.contexts.split(",")]
    batch, dtype = (2, torch.float32) if args.tiny else (args.batch, torch.bfloat16)
    rows = []
    for context in contexts:
        base = None
        for name, bits in (("bf16" if not args.tiny else "fp32", 0), ("int8", 8), ("int4", 4)):
            r = paged_attention_alone(timer, batch=batch, context=context, num_heads=28, num_kv_heads=4, head_dim=128,
                                      block_size=16, dtype=dtype, calls=2 if args.tiny else args.calls, seed=0,
                                      kv_int=bits)
            base = base or r["seconds_per_call"]
            rows.append({"context": context, "cache": name, "us_per_call": r["seconds_per_call"] * 1e6,
                         "GBps": r["kv_bytes"] / r["seconds_per_call"] / 1e9, "ratio_vs_float": base / r["seconds_per_call"],
                         "max_abs_diff_vs_reference": r["max_abs_diff_vs_reference"], "device": str(device)})
            print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
