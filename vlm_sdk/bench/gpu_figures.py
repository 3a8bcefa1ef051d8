"""The figures of `vlm-sdk bench --gpu` (`gpu.py` has the configuration, the run and the report).

Each figure is one dict: what was measured, against what (a floor from rates measured in the same run,
or a peer), the ratio and the target. The prefill is measured cold (the bench's engine runs without
prefix caching and every timed request carries an image the vision tower has not seen), and split in
its two parts: the vision tower alone (`encode_images`, timed on the device) and the language model
(the same request with its image's embeddings from the encoder cache, so only the LLM runs).
"""
from __future__ import annotations

import contextlib
import itertools
import random
import statistics
import time
from typing import Iterator

import torch

from vlm_sdk.bench.engine import _images
from vlm_sdk.bench.gpu_parts import GpuBenchError, check_tokens, decode_weight_bytes, paged_attention_alone, \
    prefill_flops
from vlm_sdk.testing.hooks import local_worker

TEXT_VOCAB = 1000  # ids below this are the test tokenizer's ordinary BPE tokens (specials come after)
QUESTIONS = ("What is in this image?", "Describe the picture.", "What colours do you see?", "Is there any text?")
# issue 5's targets: ratio to the floor (at most), share of copy bandwidth and speed-up (at least)
DECODE_TARGETS = {1: 1.25, 64: 1.5}
ATTENTION_TARGET = 0.70
PREFILL_TARGET = 2.0
THROUGHPUT_TARGET = 5.0


def figure(name: str, value: float, unit: str, baseline: float, baseline_kind: str, ratio: float,
           op: str, target: float | None, details: dict) -> dict:
    passed = None if target is None else (ratio <= target if op == "<=" else ratio >= target)
    text = "none (reported only)" if target is None else f"{op} {target:g}x"
    return {"name": name, "value": value, "unit": unit, "baseline": baseline, "baseline_kind": baseline_kind,
            "ratio": ratio, "target": text, "target_ratio": target, "target_op": op, "pass": passed,
            "details": details}


def attention_figure(cfg, timer, dtype, copy_bw, notes) -> dict:
    s = cfg.shape
    r = paged_attention_alone(timer, batch=cfg.attn_batch, context=cfg.attn_context, num_heads=s.num_heads,
                              num_kv_heads=s.num_kv_heads, head_dim=s.text_hidden_size // s.num_heads,
                              block_size=cfg.block_size, dtype=dtype, calls=cfg.attn_calls, seed=cfg.seed)
    if r["impl"] != "triton":
        notes.append(f"paged_attention_decode alone ran as {r['impl']} (no GPU): its bandwidth says nothing")
    bw = r["bytes"] / r["seconds_per_call"]
    return figure(f"paged_attention_decode alone, {cfg.attn_batch} x {cfg.attn_context} ctx", bw / 1e9, "GB/s",
                  copy_bw / 1e9, "copy bandwidth", bw / copy_bw, ">=", ATTENTION_TARGET, r)


# ----------------------------------------------------------------------------------------------
# decode

@contextlib.contextmanager
def decoding(engine, cfg, batch: int) -> Iterator[list]:
    """`batch` text prompts of cfg.context tokens, stepped until every one has its first token, then
    `decode_warmup` steps: yields their sequences, every one decoding; aborts them after."""
    from vlm_sdk.multimodal.inputs import PromptInputs
    from vlm_sdk.protocol.blocks import blocks_needed
    from vlm_sdk.sampling_params import SamplingParams

    max_tokens = cfg.decode_max_tokens(batch)
    need = batch * blocks_needed(cfg.context + max_tokens, cfg.block_size)
    if need > engine.cache_config.num_blocks:
        raise GpuBenchError(f"decode batch {batch} x {cfg.context} tokens needs {need} KV blocks but the cache has "
                            f"{engine.cache_config.num_blocks} ({engine.cache_config.source}); raise "
                            f"--memory-utilization or lower --context / --decode-batches")
    rng = random.Random(cfg.seed + batch)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(PromptInputs(token_ids=[rng.randrange(TEXT_VOCAB) for _ in range(cfg.context)]),
                               params) for _ in range(batch)]
    try:
        seqs = [engine.requests[r] for r in rids]
        for _ in range(max_tokens):  # the prefill steps decode_max_tokens allows for
            if all(s.num_output_tokens > 0 for s in seqs):
                break
            engine.step()
        else:
            raise GpuBenchError(f"decode batch {batch}: the prompts did not finish prefill in {max_tokens} steps")
        for _ in range(cfg.decode_warmup):
            engine.step()
        yield seqs
    finally:
        for r in rids:
            engine.abort(r)


def decode_steps(engine, batch: int, steps: int) -> None:
    """`steps` engine steps that must each decode every one of `batch` sequences, without preemption."""
    preemptions = engine.scheduler.num_preemptions
    short = sum(len(engine.step()) != batch for _ in range(steps))
    if short or engine.scheduler.num_preemptions != preemptions:
        raise GpuBenchError(f"decode batch {batch}: {short} of {steps} steps did not decode all sequences "
                            f"({engine.scheduler.num_preemptions - preemptions} preemptions); raise "
                            f"--memory-utilization")


def decode_figure(engine, cfg, batch: int, timer, copy_bw: float) -> dict:
    """`decode_steps` timed engine steps (host scheduling and sampling included) of `batch` sequences."""
    steps = cfg.decode_steps
    with decoding(engine, cfg, batch) as seqs:
        start_tokens = sum(s.num_tokens for s in seqs)
        timer.sync()
        t0 = time.perf_counter()
        decode_steps(engine, batch, steps)
        timer.sync()
        seconds = (time.perf_counter() - t0) / steps
    # each step attends over every sequence's tokens so far, its new one included
    attended = start_tokens + batch * (steps - 1) / 2
    kv_per_token = engine.cache_config.bytes_per_block // engine.cache_config.block_size
    weight_bytes = decode_weight_bytes(local_worker(engine).model.decoder, batch)
    floor = (weight_bytes + attended * kv_per_token) / copy_bw
    details = {"steps": steps, "weight_bytes": weight_bytes, "kv_bytes": attended * kv_per_token,
               "mean_context": attended / batch, "kv_bytes_per_token": kv_per_token}
    return figure(f"decode step, batch {batch}, {cfg.context} ctx", seconds * 1e3, "ms/step", floor * 1e3, "floor",
                  seconds / floor, "<=", DECODE_TARGETS.get(batch), details)


# ----------------------------------------------------------------------------------------------
# prefill

class ColdPrefill:
    """One image request of cfg.prefill_image pixels a side and cfg.prefill_text_tokens of text, whose
    prompt is built before the clock starts (CPU image preprocessing is not prefill). `prompt(i)` has
    image i, different for every i (seeded), so the vision tower has never seen it."""

    def __init__(self, engine, cfg):
        from vlm_sdk.sampling_params import SamplingParams
        self.engine, self.cfg = engine, cfg
        self.question = _question(engine, cfg.prefill_text_tokens)
        self.params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prompt(self, i: int):
        side = self.cfg.prefill_image
        image = _images([(side, side)], seed=1000 + i)[0]
        return self.engine.inputs.build_prompt(_conversation(image, self.question))

    def first_token(self, prompt, timer) -> float:
        """Seconds from add_request to the request's first (and only) token."""
        engine = self.engine
        timer.sync()
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, self.params)
        while rid in engine.requests:
            engine.step()
        timer.sync()
        return time.perf_counter() - t0


def prefill_figures(engine, cfg, timer, mm_rate: float) -> list[dict]:
    """Cold prefill (a new image each repetition, no prefix cache), the vision tower alone on the same
    images, and the language model alone (each image again, its embeddings from the encoder cache):
    medians over `prefill_reps` after a warm-up. Raises GpuBenchError when a timed request was not what
    it claims (a prefix-cache hit, an encoder-cache hit where none may be, or a miss where one must be)."""
    prefill = ColdPrefill(engine, cfg)
    model = local_worker(engine).model
    prefill.first_token(prefill.prompt(-1), timer)  # warm-up: Triton kernels compile for these shapes
    cold, vision, llm = [], [], []
    for i in range(cfg.prefill_reps):
        prompt = prefill.prompt(i)
        before = engine.stats()
        cold.append(prefill.first_token(prompt, timer))
        mid = engine.stats()
        llm.append(prefill.first_token(prompt, timer))  # the same image again: only the LLM runs
        after = engine.stats()
        _check_cache_use(before, mid, after, i)
        with torch.inference_mode():
            vision.append(timer.per_call(lambda: model.encode_images(prompt.images)))
    flops = prefill_flops(engine.checkpoint.hf_config, [im.meta.grid_thw for im in prompt.images],
                          len(prompt.token_ids))
    vision_flops = flops["vision_linear"] + flops["vision_attention"]
    llm_flops = flops["llm_linear"] + flops["llm_attention"] + flops["lm_head"]
    details = {"prompt_tokens": len(prompt.token_ids), "image_tokens": sum(prompt.image_tokens),
               "text_tokens": len(prompt.token_ids) - sum(prompt.image_tokens),
               "image_grid_thw": [list(im.meta.grid_thw) for im in prompt.images], "flops": flops,
               "reps": cfg.prefill_reps, "cold_ms": [s * 1e3 for s in cold], "vision_ms": [s * 1e3 for s in vision],
               "llm_ms": [s * 1e3 for s in llm]}
    name = f"prefill, {cfg.prefill_image}x{cfg.prefill_image} image + text"
    out = []
    for label, times, work, target in ((f"{name}, cold", cold, vision_flops + llm_flops, PREFILL_TARGET),
                                       (f"{name}: vision tower alone", vision, vision_flops, None),
                                       (f"{name}: language model alone (image cached)", llm, llm_flops, None)):
        seconds, floor = statistics.median(times), work / mm_rate
        out.append(figure(label, seconds * 1e3, "ms", floor * 1e3, "FLOP floor", seconds / floor, "<=", target,
                          details))
    return out


def _check_cache_use(before: dict, mid: dict, after: dict, rep: int) -> None:
    def delta(a, b, key):
        return b[key] - a[key]
    problems = []
    if delta(before, after, "prefix_cache_hit_tokens"):
        problems.append("the prefix cache served tokens")
    if delta(before, mid, "encoder_cache_hits"):
        problems.append("the cold request's image came from the encoder cache")
    if delta(mid, after, "encoder_cache_hits") != 1:
        problems.append("the language-model request's image did not come from the encoder cache")
    if problems:
        raise GpuBenchError(f"prefill repetition {rep}: {'; '.join(problems)}: the figure would not measure "
                            "what it says")


def _conversation(image, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


def _question(engine, text_tokens: int) -> str:
    """A question long enough that the prompt has at least `text_tokens` non-image tokens (template
    included), counted on a smallest image."""
    probe = _images([(56, 56)], seed=3)[0]
    words = itertools.cycle("Describe the picture in detail and name every object you can see".split())
    question = next(words)
    for _ in range(4 * text_tokens):
        prompt = engine.inputs.build_prompt(_conversation(probe, question))
        if len(prompt.token_ids) - sum(prompt.image_tokens) >= text_tokens:
            break
        question += " " + next(words)
    return question


# ----------------------------------------------------------------------------------------------
# throughput

def throughput_convs(cfg) -> list[list[dict]]:
    images = _images([(cfg.request_image, cfg.request_image)] * cfg.requests, seed=1)
    return [_conversation(im, QUESTIONS[i % len(QUESTIONS)]) for i, im in enumerate(images)]


def ours_throughput(llm, convs, cfg, timer) -> dict:
    from vlm_sdk.sampling_params import SamplingParams

    side = (cfg.request_image, cfg.request_image)
    warm = [_conversation(im, QUESTIONS[0]) for im in _images([side] * 2, seed=2)]  # images no timed request has
    llm.chat(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    preemptions = llm.engine.scheduler.num_preemptions
    timer.sync()
    t0 = time.perf_counter()
    outs = llm.chat(convs, SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True))
    timer.sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    check_tokens("ours", tokens, len(convs), cfg.max_tokens)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "preemptions": llm.engine.scheduler.num_preemptions - preemptions}
