"""A plan for a real workload (`vlm-sdk plan --workload FILE`): its requests (workload_file.py) against the
planned cache, by the engine's own arithmetic (`CacheConfig.blocks_for`, `fixes_for`).

    tokens(r)    = text + its images' tokens (the family's count for each size) + its videos' prompt tokens
                   (workload_file.Video: the frames the processor samples, their tokens, the text around
                   each item) + max_tokens
    fits(r)      tokens(r) <= the longest request (max_model_len, the cache, the model's positions)
    at_once(r)   = min(max_num_seqs, num_blocks // blocks_for(tokens(r)), state slots)
                   requests of r's size the cache holds at once, each running to its end
    pX           the weighted X-th percentile by tokens (the smallest size with at least X% of the
                 requests' weight at or below it); at_once at pX: requests of that size
    KV at pX     max_num_seqs requests of pX tokens, as blocks and as a share of the cache (>1: they wait)
    encoder      one image's vision embeddings: its tokens x hidden_size x dtype bytes (Qwen3-VL's DeepStack
                 rows are wider: a lower bound there); how many p50 images encoder_cache_memory keeps; a
                 video's the same per vision token, over its items (each temporal patch or frame its own
                 entry): how many p50 videos it keeps whole
    binds        at p99: what stops more: max_model_len / the cache (it does not fit), max_num_seqs, the KV
                 blocks, or the state slots
    serve_99     settings, pasteable together, that make the p99 request fit and run max_num_seqs of it at
                 once; where no cache on the device holds that many, the max_num_seqs it does hold
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vlm_sdk.memory.capacity import requests_at_once
from vlm_sdk.plan.rules import Facts, flags
from vlm_sdk.plan.workload_file import Request, Video

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class Percentile:
    p: int
    tokens: int  # request tokens (prompt + output) at this percentile
    blocks: int  # one such request's KV blocks over every group
    kv_bytes: int
    at_once: int
    kv_share: float  # max_num_seqs such requests' blocks / the cache's


@dataclass(frozen=True)
class WorkloadPlan:
    requests: int  # lines, or kinds of request in a histogram
    fit_share: float  # of the weight: requests that fit whole (prompt + max_tokens)
    longest_request_tokens: int
    percentiles: tuple[Percentile, ...]
    images_per_request: float  # mean
    image_tokens_p50: int
    image_tokens_p99: int
    encoder_bytes_per_token: int
    encoder_cache_bytes: int
    encoder_cache_images_p50: int  # p50 images encoder_cache_memory holds
    binds: str
    serve_99: dict = field(default_factory=dict)  # setting -> value: all of them together serve 99%
    # instead: the same memory as an FP8 cache (kv_cache_dtype), this cache at fewer at once (max_num_seqs), or
    # smaller images (the family's image setting) under which max_num_seqs of the p99 request fit
    serve_99_alternatives: dict = field(default_factory=dict)
    # the requests by tokens: (from, to, share of the weight) in equal bins from 0 (the picture's histogram)
    histogram: tuple = ()
    videos_per_request: float = 0.0  # mean
    video_frames_p50: int = 0  # frames sampled
    video_items_p50: int = 0  # vision-tower items (encoder-cache entries)
    video_tokens_p50: int = 0  # vision tokens (what the tower fills)
    video_tokens_p99: int = 0
    encoder_cache_videos_p50: int = 0  # p50 videos (every item) encoder_cache_memory holds

    def at(self, p: int) -> Percentile:
        return next(x for x in self.percentiles if x.p == p)

    def flags(self) -> str:
        return flags(self.serve_99, " ")

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "percentiles"}
        out["percentiles"] = [x.__dict__ for x in self.percentiles]
        out["histogram"] = [list(b) for b in self.histogram]
        out["serve_99_flags"] = self.flags()
        return out


def percentile(values: list[tuple[int, float]], p: int) -> int:
    """The smallest value with at least p% of the weight at or below it (`values`: (value, weight))."""
    ordered = sorted(values)
    total = sum(w for _, w in ordered)
    running = 0.0
    for v, w in ordered:
        running += w
        if running >= total * p / 100 * (1 - 1e-12):
            return v
    return ordered[-1][0]


def plan_workload(requests: list[Request], f: Facts, encoder_bytes_per_token: int, encoder_cache_bytes: int,
                  fp8_blocks: int | None = None) -> WorkloadPlan:
    """The workload against the plan's cache `f` (plan/rules.Facts)."""
    args, cache, blocks = f.args, f.cache, f.blocks
    slots = cache.num_state_slots or args.max_num_seqs  # a running request holds one live state slot
    total_w = sum(r.weight for r in requests)
    fit_w = sum(r.weight for r in requests if r.total_tokens <= f.longest)
    sizes = [(r.total_tokens, r.weight) for r in requests]

    sized = dataclasses.replace(cache, num_blocks=blocks)

    def at_once(tokens: int) -> int:  # the start-up line's count (memory/capacity.py)
        return 0 if tokens > f.longest else requests_at_once(sized, tokens, args.max_num_seqs)

    pcts = []
    for p in PERCENTILES:
        t = percentile(sizes, p)
        b = cache.blocks_for(max(t, 1))
        pcts.append(Percentile(p, t, b, b * f.per_block, at_once(t), args.max_num_seqs * b / max(blocks, 1)))
    images = [(t, r.weight) for r in requests for t in r.image_tokens]
    img50 = percentile(images, 50) if images else 0
    img99 = percentile(images, 99) if images else 0
    per_image = img50 * encoder_bytes_per_token
    videos = [(v, r.weight) for r in requests for v in r.videos]
    v50 = _median_video(videos)
    v99 = percentile([(v.vision_tokens, w) for v, w in videos], 99) if videos else 0
    per_video = v50.vision_tokens * encoder_bytes_per_token if v50 else 0
    top = pcts[-1]
    binds = _binds(top, f, slots)
    serve, instead = _serve_99(top, requests, f, slots, fp8_blocks)
    return WorkloadPlan(
        requests=len(requests), fit_share=fit_w / total_w, longest_request_tokens=f.longest, percentiles=tuple(pcts),
        images_per_request=sum(len(r.image_tokens) * r.weight for r in requests) / total_w,
        image_tokens_p50=img50, image_tokens_p99=img99, encoder_bytes_per_token=encoder_bytes_per_token,
        encoder_cache_bytes=encoder_cache_bytes,
        encoder_cache_images_p50=encoder_cache_bytes // per_image if per_image else 0,
        binds=binds, serve_99=serve, serve_99_alternatives=instead, histogram=histogram(sizes),
        videos_per_request=sum(len(r.videos) * r.weight for r in requests) / total_w,
        video_frames_p50=v50.frames if v50 else 0, video_items_p50=v50.items if v50 else 0,
        video_tokens_p50=v50.vision_tokens if v50 else 0, video_tokens_p99=v99,
        encoder_cache_videos_p50=encoder_cache_bytes // per_video if per_video else 0)


def _median_video(videos: list) -> "Video | None":
    """The p50 video by vision tokens (its frames and items with it); None without videos."""
    if not videos:
        return None
    tokens = percentile([(v.vision_tokens, w) for v, w in videos], 50)
    return next(v for v, _ in videos if v.vision_tokens == tokens)


def histogram(sizes: list[tuple[int, float]], bins: int = 40) -> tuple[tuple[int, int, float], ...]:
    """(from, to, share) of the weight in `bins` equal bins of tokens from 0 to the largest; empty ones left out."""
    top = max(t for t, _ in sizes)
    width = max(1, -(-(top + 1) // bins))
    total = sum(w for _, w in sizes)
    shares: dict[int, float] = {}
    for t, w in sizes:
        shares[t // width] = shares.get(t // width, 0.0) + w / total
    return tuple((i * width, (i + 1) * width, s) for i, s in sorted(shares.items()))


def _binds(top: Percentile, f: Facts, slots: int) -> str:
    if top.tokens > f.longest:
        if top.tokens > f.max_pos:
            return f"the model's max_position_embeddings ({f.max_pos}): the p99 request ({top.tokens} tokens) is longer"
        why = "max_model_len" if f.args.max_model_len is not None and f.args.max_model_len < top.tokens else "the KV cache"
        return f"{why}: the p99 request ({top.tokens} tokens) is longer than the longest request ({f.longest})"
    if top.at_once >= f.args.max_num_seqs:
        return f"max_num_seqs ({f.args.max_num_seqs}): the cache holds more p99 requests than that"
    if top.at_once == slots < f.blocks // top.blocks:
        return f"the state slots ({slots}, num_state_slots)"
    return (f"the KV cache: {f.blocks} blocks hold {top.at_once} p99 requests of {top.blocks} blocks "
            f"(max_num_seqs {f.args.max_num_seqs})")


def _serve_99(top: Percentile, requests: list[Request], f: Facts, slots: int,
              fp8_blocks: int | None) -> tuple[dict, dict]:
    """(settings that together make the p99 request fit and max_num_seqs of it run at once; instead,
    the max_num_seqs the planned cache runs them at)."""
    args, cache = f.args, f.cache
    serve: dict = {}
    instead: dict = {}
    tokens = top.tokens
    if tokens > f.max_pos:  # no length setting helps: smaller images for the p99 request
        r = min((r for r in requests if r.total_tokens >= tokens), key=lambda r: r.total_tokens)
        k = len(r.image_tokens)
        fit = f.image.fitting((f.max_pos - r.beside_images) // k) if k else None
        if fit is not None and fit.value is not None:
            serve[f.image.setting] = fit.value
        tokens = min(tokens, f.max_pos)
    if args.max_model_len is not None and args.max_model_len < tokens:  # else max_model_len follows the cache
        serve["max_model_len"] = tokens
    need = args.max_num_seqs * cache.blocks_for(max(tokens, 1))
    fewer = 0 < top.at_once < args.max_num_seqs  # this cache runs fewer of them at once
    if need > f.blocks:
        grow = cache.fixes_for(need)
        for name in (cache.rule, "kv_cache_memory", "num_blocks"):  # one sizing rule: the one in use first
            if name in grow:
                serve[name] = grow[name]
                break
        if "kv_cache_dtype" in grow:  # or the same memory holding FP8 blocks
            (instead if serve else serve)["kv_cache_dtype"] = grow["kv_cache_dtype"]
        if not serve and fewer:  # no cache on this device holds max_num_seqs of them: run fewer at once
            serve["max_num_seqs"] = top.at_once
            fewer = False
            if fp8_blocks is not None and fp8_blocks > f.blocks:  # an FP8 cache of the same memory holds more
                instead["kv_cache_dtype"] = "fp8"
    if cache.num_state_slots and slots < args.max_num_seqs:
        serve["num_state_slots"] = args.max_num_seqs
    if fewer:
        instead["max_num_seqs"] = top.at_once
    smaller = _smaller_images(top, requests, f)
    if smaller:
        instead.update(smaller)
    return serve, instead


def _smaller_images(top: Percentile, requests: list[Request], f: Facts) -> dict:
    """The family's image setting under which max_num_seqs requests of the p99 one's text and output, its
    images capped at the size that setting allows, fit the planned cache at once: {} when none does, or
    the request has no image, or max_num_seqs of it already fit."""
    args = f.args
    r = min((r for r in requests if r.total_tokens >= top.tokens), key=lambda r: r.total_tokens, default=None)
    if r is None or not r.image_tokens or top.at_once >= args.max_num_seqs:
        return {}
    share = dataclasses.replace(f.cache, num_blocks=f.blocks // args.max_num_seqs).capacity_tokens  # one's share
    per_image = (min(share, f.longest) - r.beside_images) // len(r.image_tokens)
    fit = f.image.fitting(per_image) if per_image >= 1 else None
    return {f.image.setting: fit.value} if fit is not None and fit.value is not None else {}


def workload_rows(w: WorkloadPlan, size) -> list[tuple[str, str]]:
    """The plan table's workload rows (`size`: bytes in words)."""
    rows = [("workload requests", f"{w.requests:,}; {w.fit_share:.1%} fit whole (longest request "
             f"{w.longest_request_tokens:,} tokens)")]
    for x in w.percentiles:
        rows.append((f"  p{x.p} request", f"{x.tokens:,} tokens = {x.blocks:,} blocks ({size(x.kv_bytes)}); "
                     f"{x.at_once} at once; max_num_seqs of them take {x.kv_share:.0%} of the cache"))
    if w.image_tokens_p50:
        rows.append(("  images", f"{w.images_per_request:.2f} per request; p50 {w.image_tokens_p50:,} tokens, p99 "
                     f"{w.image_tokens_p99:,}; the encoder cache ({size(w.encoder_cache_bytes)}) keeps "
                     f"{w.encoder_cache_images_p50:,} p50 images ({w.encoder_bytes_per_token:,} B a token)"))
    if w.video_tokens_p50:
        rows.append(("  videos", f"{w.videos_per_request:.2f} per request; p50 {w.video_frames_p50:,} frames = "
                     f"{w.video_items_p50:,} items, {w.video_tokens_p50:,} tokens; p99 {w.video_tokens_p99:,} tokens; "
                     f"the encoder cache keeps {w.encoder_cache_videos_p50:,} p50 videos whole"))
    rows.append(("  binds", w.binds))
    rows.append(("  to serve 99%", w.flags() or "nothing to change"))
    if w.serve_99_alternatives:
        rows.append(("  or instead", flags(w.serve_99_alternatives, ", or ")))
    return rows
