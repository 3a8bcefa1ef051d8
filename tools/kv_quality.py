"""What a lower-precision KV cache costs in quality: `vlm-sdk bench`'s requests (one image and a question
each, greedy, 16-128 tokens) on each family's bench checkpoint (~100M random weights, tiny_model_dir
"bench"), with kv_cache_dtype fp8 / int8 / int4 against the model's dtype, in one run per family.

Per dtype, over the positions where the quantized run's context equals the full-precision run's (its
tokens before the position are the same: teacher-forced by construction, up to and including the first
position where the two pick differently):
  agreement   positions picking the full-precision token / such positions
  logprob     |logprob of the full-precision token, quantized - full|: mean and largest (tokens that fell
              out of the quantized run's top 20 are counted apart, as "out")
  identical   requests whose whole output is the full-precision one's

    PYTHONPATH=. python tools/kv_quality.py [--families a,b] [--num-requests 16] [--max-tokens N] [--device cpu]
                                            [--json]

prints one markdown table (BENCHMARKS.md holds its output); --json one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

DTYPES = ("fp8", "int8", "int4")


def _compare(ref, outs) -> dict:
    positions = agree = identical = out_of_top = 0
    errors: list[float] = []
    for r, q in zip(ref, outs):
        identical += r.token_ids == q.token_ids
        for k, (a, b) in enumerate(zip(r.token_ids, q.token_ids)):
            positions += 1
            agree += a == b
            top = dict(q.logprobs[k].top_logprobs)
            if a in top:
                errors.append(abs(top[a] - r.logprobs[k].logprob))
            else:
                out_of_top += 1
            if a != b:  # past here the contexts differ
                break
    return {"positions": positions, "agreement": agree / positions, "identical": identical, "requests": len(ref),
            "logprob_mean": sum(errors) / len(errors), "logprob_max": max(errors), "out_of_top20": out_of_top}


def measure(family: str, num_requests: int, device: str, max_tokens_cap: int | None = None) -> dict:
    from vlm_sdk import LLM, SamplingParams
    from vlm_sdk.bench.engine import _workload
    from vlm_sdk.demo_checkpoint import tiny_model_dir
    from vlm_sdk.testing.families import fixtures

    model_dir = str(tiny_model_dir("bench", family))
    sizes = [tuple(s) for s in fixtures(family).bench_image_sizes]
    _, convs, max_tokens = _workload(num_requests, sizes)
    if max_tokens_cap:  # a shorter run of the same requests
        max_tokens = [min(m, max_tokens_cap) for m in max_tokens]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=20) for m in max_tokens]
    t0 = time.perf_counter()
    runs = {}
    for dtype in ("auto",) + DTYPES:
        llm = LLM(model_dir, device=device, show_progress=False, kv_cache_dtype=dtype)
        runs[dtype] = (llm.chat(convs, params), llm.stats()["kv_bytes_per_block"])
        llm.shutdown()
    ref, ref_bytes = runs["auto"]
    out = {"family": family, "model": model_dir, "requests": num_requests, "tokens": sum(max_tokens),
           "seconds": time.perf_counter() - t0, "dtypes": {}}
    for dtype in DTYPES:
        outs, per_block = runs[dtype]
        out["dtypes"][dtype] = _compare(ref, outs) | {"bytes_per_block_ratio": ref_bytes / per_block}
    return out


def table(results: list[dict]) -> str:
    lines = ["| family | KV cache | tokens per byte vs auto | greedy agreement (positions) | identical outputs | "
             "logprob error mean / max (nats) | token out of top 20 |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for dtype, d in r["dtypes"].items():
            lines.append(f"| {r['family']} | {dtype} | {d['bytes_per_block_ratio']:.2f}x | {d['agreement']:.1%} "
                         f"({d['positions']}) | {d['identical']}/{d['requests']} | {d['logprob_mean']:.4f} / "
                         f"{d['logprob_max']:.3f} | {d['out_of_top20']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vlm_sdk.models.registry import family_names
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(family_names()))
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=None, help="cap each request's max_tokens (default: the bench's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    results = []
    for family in args.families.split(","):
        results.append(measure(family, args.num_requests, args.device, args.max_tokens))
        print(f"{family}: {results[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
