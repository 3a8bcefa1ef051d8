"""`vlm-sdk bench`: our engine against transformers `generate`, in one process, same checkpoint.

Workload: N requests, each one image and a short question, max_tokens spread evenly over 16..128,
greedy, eos ignored so both sides produce exactly max_tokens tokens per request. The images take the
family's `bench_image_sizes` in turn (Qwen2.5-VL and Qwen3-VL: every image 448x448; InternVL:
448x448 and 1920x1080, 1 tile and 2 tiles + thumbnail at max_num 6); the preprocessing comparison
is the family's `benchmark_preprocessing` hook. Ours gets all requests at once (continuous
batching); transformers runs static batches (left padded), each generating until its longest
request is done. Both timings include image preprocessing and tokenization. Tokens/s counts only the tokens each request asked for.
"""
from __future__ import annotations

import json
import os
import random
import time

import numpy as np
import torch
from PIL import Image

from vlm_sdk.bench.device_share import bench_device, release_device_memory


def _images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    """Smooth colour blobs plus noise, one image per (width, height)."""
    rng = np.random.default_rng(seed)
    images = []
    for width, height in sizes:
        base = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        im = Image.fromarray(base).resize((width, height), Image.BICUBIC)
        noise = rng.integers(-20, 20, size=(height, width, 3))
        images.append(Image.fromarray(np.clip(np.asarray(im, dtype=np.int64) + noise, 0, 255).astype(np.uint8)))
    return images


def _workload(n: int, sizes: list[tuple[int, int]]):
    questions = ["What is in this image?", "Describe the picture.", "What colours do you see?",
                 "Is there any text?"]
    images = _images([sizes[i % len(sizes)] for i in range(n)])
    max_tokens = [int(round(x)) for x in np.linspace(16, 128, n)]
    random.Random(0).shuffle(max_tokens)
    convs = [[{"role": "user", "content": [{"type": "image", "image": images[i]},
                                           {"type": "text", "text": questions[i % len(questions)]}]}]
             for i in range(n)]
    return images, convs, max_tokens


def run_benchmark(args) -> int:
    from vlm_sdk.demo_checkpoint import tiny_model_dir
    from vlm_sdk.model_loader import read_checkpoint
    from vlm_sdk.models.registry import resolve
    from vlm_sdk.testing.families import fixtures

    model_dir = args.model or str(tiny_model_dir("bench", args.family))
    info = read_checkpoint(model_dir)
    family = resolve([info.architecture]).name
    fixture = fixtures(family)
    image_sizes = [tuple(size) for size in fixture.bench_image_sizes]
    images, convs, max_tokens = _workload(args.num_requests, image_sizes)
    device = bench_device(args.device)
    report: dict = {"model": model_dir, "family": family, "device": device, "num_requests": args.num_requests,
                    "image_sizes": image_sizes, "max_tokens": max_tokens,
                    "torch_threads": torch.get_num_threads()}

    if args.tensor_parallel_size > 1 or getattr(args, "pipeline_parallel_size", 1) > 1:
        return _run_tp_comparison(args, report, convs, max_tokens)
    report["preprocess"] = fixture.benchmark_preprocessing(info.preprocessor, info.hf_config, images)

    report["ours"] = _timed_engine(model_dir, device, convs, max_tokens)
    release_device_memory(device)  # the transformers peer gets what our engine held
    ours_tokens = report["ours"].pop("tokens")
    ours_s = report["ours"]["seconds"]
    useful = sum(max_tokens)

    hf = _run_transformers(family, model_dir, convs, max_tokens, args.hf_batch_size, device)
    report["transformers"] = {k: v for k, v in hf.items() if k != "tokens"}
    report["transformers"]["tokens_per_s"] = useful / hf["seconds"]
    report["ratio"] = report["ours"]["tokens_per_s"] / report["transformers"]["tokens_per_s"]
    same = sum(a == b for a, b in zip(ours_tokens, hf["tokens"]))
    report["identical_greedy_share"] = same / len(convs)

    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        pre = report["preprocess"]
        sizes = " and ".join(f"{w}x{h}" for w, h in image_sizes)
        print(f"model {model_dir} ({family}) on {device}, {torch.get_num_threads()} threads, {args.num_requests} "
              f"requests with {sizes} images ({report['ours']['prompt_tokens']} prompt tokens), "
              f"max_tokens {min(max_tokens)}..{max(max_tokens)} ({useful} tokens in all)")
        print(f"  ours         {ours_s:7.2f} s  {report['ours']['tokens_per_s']:8.1f} tokens/s  (all requests at once)")
        print(f"  transformers {hf['seconds']:7.2f} s  {report['transformers']['tokens_per_s']:8.1f} tokens/s  "
              f"(static batches of {args.hf_batch_size})")
        print(f"  ratio ours/transformers: {report['ratio']:.2f}x; identical greedy outputs: "
              f"{same}/{len(convs)}")
        print(f"  image preprocessing per image ({sizes}): ours {pre['ours_ms_per_image']:.2f} ms, transformers "
              f"{pre['transformers_ms_per_image']:.2f} ms (max abs diff {pre['max_abs_diff']:.2e})")
    return 0


def _timed_engine(model_dir: str, device: str, convs, max_tokens, **engine_args) -> dict:
    """Our engine on the workload (after a warm-up): seconds, engine steps, tokens, the engine's stats;
    the engine is shut down after."""
    from vlm_sdk import LLM, SamplingParams
    llm = LLM(model_dir, device=device, show_progress=False, **engine_args)
    try:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
        llm.chat(convs[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        engine, steps, batches = llm.engine, [0], [0]
        step, launched = engine.step, engine._launched

        def counted():
            steps[0] += 1
            return step()

        def counted_batch(batch):
            batches[0] += 1
            return launched(batch)
        # instance attributes shadow the methods for this run only: engine steps, and batches launched (a
        # step with pipeline micro-batches may launch one and return, or only read one)
        engine.step, engine._launched = counted, counted_batch
        t0 = time.perf_counter()
        outs = llm.chat(convs, params)
        seconds = time.perf_counter() - t0
        tokens = [o.token_ids for o in outs]
        return {"seconds": seconds, "steps": steps[0], "ms_per_step": 1000 * seconds / steps[0], "tokens": tokens,
                "batches": batches[0], "ms_per_batch": 1000 * seconds / batches[0],
                "generated_tokens": sum(len(t) for t in tokens), "tokens_per_s": sum(max_tokens) / seconds,
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs), "stats": llm.stats(),
                "kv_blocks": engine.cache_config.num_blocks, "weights_bytes_per_rank": engine.memory_report.weights_bytes}
    finally:
        llm.shutdown()


def _run_tp_comparison(args, report: dict, convs, max_tokens) -> int:
    """`--tensor-parallel-size N`: the same workload on one rank and on N, in this run; the cost of the
    collectives and of sending each step to the other ranks shows as time per engine step."""
    n, pp = args.tensor_parallel_size, getattr(args, "pipeline_parallel_size", 1)
    load_before = os.getloadavg()
    one = _timed_engine(report["model"], report["device"], convs, max_tokens)
    release_device_memory(report["device"])  # the next engine sizes its cache on what is free
    parallel = dict(tensor_parallel_size=n, pipeline_parallel_size=pp, enable_expert_parallel=args.enable_expert_parallel)
    turns = None
    if pp > 1:  # the peer of micro-batching: the same stages taking turns, one step at a time
        turns = _timed_engine(report["model"], report["device"], convs, max_tokens, pipeline_micro_batches=1,
                              **parallel)
        release_device_memory(report["device"])
    many = _timed_engine(report["model"], report["device"], convs, max_tokens, **parallel)
    tokens = one.pop("tokens")
    same = sum(a == b for a, b in zip(tokens, many.pop("tokens")))
    label = f"tp{n}" if pp == 1 else f"pp{pp}xtp{n}"
    report.update({"tp1": one, label: many, "tensor_parallel_size": n, "pipeline_parallel_size": pp,
                   "enable_expert_parallel": args.enable_expert_parallel,
                   "ms_per_step_ratio": many["ms_per_step"] / one["ms_per_step"],
                   "identical_greedy_share": same / len(convs), "load_average": [load_before, os.getloadavg()]})
    if turns is not None:
        same_turns = sum(a == b for a, b in zip(tokens, turns.pop("tokens")))
        report.update({f"{label}_turns": turns, "micro_batches": pp,
                       "micro_batching_speedup": many["tokens_per_s"] / turns["tokens_per_s"],
                       "ms_per_batch_ratio": many["ms_per_batch"] / turns["ms_per_batch"],
                       "identical_greedy_share_turns": same_turns / len(convs)})
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(f"model {report['model']} ({report['family']}) on {report['device']}, {report['torch_threads']} threads, "
          f"{len(convs)} requests, max_tokens {min(max_tokens)}..{max(max_tokens)}")
    name_many = f"tp={n}" if pp == 1 else f"pp={pp}xtp={n}"
    for name, r in (("tp=1", one), (name_many, many)):
        print(f"  {name:<6} {r['seconds']:7.2f} s  {r['steps']:4d} steps  {r['ms_per_step']:7.2f} ms/step  "
              f"{r['tokens_per_s']:8.1f} tokens/s  weights/rank {r['weights_bytes_per_rank'] / 2**20:.1f} MiB  "
              f"KV blocks {r['kv_blocks']}")
    print(f"  time per step {name_many} / tp=1: {report['ms_per_step_ratio']:.2f}x; identical greedy outputs: "
          f"{same}/{len(convs)}")
    if turns is not None:
        print(f"  pipeline micro-batches: {pp} in flight against the stages taking turns (--pipeline-micro-batches 1), "
              f"same run:")
        for name, r in (("turns", turns), (f"{pp} in flight", many)):
            print(f"    {name:<12} {r['seconds']:7.2f} s  {r['batches']:4d} batches  {r['ms_per_batch']:7.2f} ms/batch  "
                  f"{r['tokens_per_s']:8.1f} tokens/s")
        print(f"    tokens/s micro-batched / turns: {report['micro_batching_speedup']:.2f}x; time per batch "
              f"{report['ms_per_batch_ratio']:.2f}x; identical greedy outputs {same_turns}/{len(convs)} (turns), "
              f"{same}/{len(convs)} (micro-batched)")
        (b1, b5, _), (a1, a5, _) = load_before, os.getloadavg()
        print(f"    load average before {b1:.2f} (5 min {b5:.2f}), after {a1:.2f} (5 min {a5:.2f}) on "
              f"{os.cpu_count()} cores")
    return 0


def _run_transformers(family: str, model_dir: str, convs, max_tokens, batch_size: int, device: str) -> dict:
    from transformers import AutoTokenizer
    from vlm_sdk.testing import reference
    from vlm_sdk.testing.families import fixtures

    family_reference = fixtures(family).reference
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    proc = family_reference.hf_image_processor(model_dir)
    model = family_reference.hf_model(model_dir, dtype).to(device)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def prompt(conv):
        return family_reference.hf_prompt(tok, proc, model.config, conv)

    def run(batch_convs, batch_max):
        prompts = [prompt(c) for c in batch_convs]
        batch = {k: v.to(device) for k, v in reference.hf_batch(prompts, pad).items()}
        rows = reference.hf_greedy(model, batch, max(batch_max), eos_token_ids=None)
        return [r[:m] for r, m in zip(rows, batch_max)]

    run(convs[:2], [4, 4])  # warm-up
    tokens = []
    t0 = time.perf_counter()
    for i in range(0, len(convs), batch_size):
        tokens.extend(run(convs[i:i + batch_size], max_tokens[i:i + batch_size]))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": tokens, "batch_size": batch_size}
