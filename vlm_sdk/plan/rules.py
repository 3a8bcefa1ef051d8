"""The rules `vlm-sdk plan` checks once the cache is sized: each finds what would make the engine refuse
to start (or refuse a request) and the settings that would fix it, in the words and values of the
engine's own errors (vlm_sdk/memory/capacity.py, image_fit.py; `CacheConfig.fixes_for`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from vlm_sdk.config import EngineArgs
from vlm_sdk.errors import format_size
from vlm_sdk.memory.capacity import max_model_len_fixes
from vlm_sdk.memory.image_fit import unfit_image_fixes
from vlm_sdk.memory.kv import CacheConfig
from vlm_sdk.models.family import ImageLimits
from vlm_sdk.plan.device import Memory, cache_fit_problem


@dataclass(frozen=True)
class Problem:
    message: str
    fixes: Mapping[str, int | float | str] = field(default_factory=dict)  # setting -> a value that solves it
    together: Mapping[str, int | float | str] = field(default_factory=dict)  # settings that only solve it together

    def to_dict(self) -> dict:
        return {"message": self.message, "fixes": dict(self.fixes), "together": dict(self.together)}


@dataclass(frozen=True)
class Facts:
    """What the rules read: the settings, the sized cache, and what one request can hold."""
    args: EngineArgs
    cache: CacheConfig
    blocks: int  # >= 0
    per_block: int
    max_pos: int
    longest: int  # tokens of the longest single request
    image: ImageLimits

    @property
    def capacity(self) -> int:
        """The longest sequence the blocks hold (in every cache group)."""
        return dataclasses.replace(self.cache, num_blocks=self.blocks).capacity_tokens


def flag(name: str) -> str:
    return name.replace("_", "-")


def value(name: str, v) -> str:
    """A fix's value as its flag takes it: sizes with a unit (an int of bytes -> 432MiB)."""
    return format_size(v) if name == "kv_cache_memory" and isinstance(v, int) else str(v)


def flags(fixes: Mapping[str, int | float | str], sep: str) -> str:
    return sep.join(f"--{flag(k)} {value(k, v)}" for k, v in fixes.items())


def cache_problems(f: Facts, memory: Memory, weights: int, peak: int, encoder: int, device_budget: bool) -> list[Problem]:
    """A cache that does not fit beside the rest (memory_utilization sizes one to fit by construction),
    or not one block."""
    problems = []
    cache, args = f.cache, f.args
    if f.blocks >= 1 and (not device_budget or cache.rule != "memory_utilization"):
        too_big = cache_fit_problem(memory, weights, peak, f.blocks, f.per_block, cache.rule, cache.source, encoder,
                                    cache.state_bytes)
        if too_big is not None:
            problems.append(Problem(*too_big))
    if f.blocks < 1:
        usable = memory.total * args.memory_utilization - memory.other_use if device_budget else memory.total
        if weights >= usable:  # no setting of this plan helps: more ranks, or fewer bytes per weight
            why = (f" (the weights alone, {weights / 2**30:.2f} GiB per rank, exceed the {max(usable, 0) / 2**30:.2f} "
                   f"GiB of {memory.what} this plan may use: split them over more ranks with --tp, or use a "
                   f"quantized checkpoint)")
        elif cache.rule == "memory_utilization":
            why = " (the activation peak is an estimate: lower --max-num-batched-tokens or --max-num-seqs to shrink it)"
        else:
            why = ""
        problems.append(Problem(f"no room for one KV block ({f.per_block:,} bytes) with {cache.source}{why}",
                                cache.fixes_for(1)))
    return problems


def max_model_len_problems(f: Facts) -> list[Problem]:
    """A max_model_len past the model's positions, or past the cache (the engine refuses to start)."""
    args, max_pos, capacity = f.args, f.max_pos, f.capacity
    if args.max_model_len is not None and args.max_model_len > max_pos:
        return [Problem(f"max_model_len {args.max_model_len} > the model's max_position_embeddings "
                        f"{max_pos}: set --max-model-len {max_pos}", {"max_model_len": max_pos})]
    if args.max_model_len is not None and args.max_model_len > capacity >= 1:
        fixes = max_model_len_fixes(dataclasses.replace(f.cache, num_blocks=f.blocks), args.max_model_len)
        return [Problem(f"max_model_len {args.max_model_len} > capacity {capacity} tokens (the engine "
                        f"refuses to start): set {flags(fixes, ', or ')}", fixes)]
    return []


def max_model_len_notes(f: Facts) -> list[Problem]:
    """max_model_len left to follow a cache shorter than the model's positions."""
    if f.args.max_model_len is not None or not 1 <= f.capacity < f.max_pos:
        return []
    grow = f.cache.fixes_for(f.cache.blocks_for(f.max_pos))
    return [Problem(f"max_model_len follows the cache: {f.capacity} tokens, below the model's "
                    f"max_position_embeddings {f.max_pos}"
                    + (f"; for the full length set {flags(grow, ', or ')}" if grow else
                       "; no cache this device holds reaches the full length"), grow)]


def image_problems(f: Facts) -> list[Problem]:
    """The largest allowed image not fitting one request: the engine refuses to start (memory/image_fit.py)."""
    image, longest = f.image, f.longest
    if not image.tokens > longest >= 1:
        return []
    fixes, together, room = unfit_image_fixes(image, image.setting, f.cache, longest, f.max_pos,
                                              f.args.max_model_len is not None)
    text = f"the largest allowed image ({image.tokens} tokens) does not fit alone in the longest request " \
           f"({longest} tokens); each fix leaves {room} tokens for a request's text and output"
    if fixes:
        text += f": set {flags(fixes, ', or ')}"
    if together:
        text += f"; or together {flags(together, ' ')}"
    return [Problem(text, fixes, together)]


def workload(f: Facts, prompt_tokens: int | None, output_tokens: int | None,
             images: int | None) -> tuple[int | None, list[Problem], list[Problem]]:
    """(requests of the workload the cache holds at once, problems, notes); None without a workload."""
    if prompt_tokens is None and output_tokens is None and images is None:
        return None, [], []
    args, image, longest, blocks = f.args, f.image, f.longest, f.blocks
    p, out_tokens, k = prompt_tokens or 0, output_tokens or 0, images or 0
    need_tokens = p + k * image.tokens + out_tokens
    need_blocks = f.cache.blocks_for(max(need_tokens, 1))
    if need_tokens <= longest:
        slots = f.cache.num_state_slots or args.max_num_seqs  # each running request holds a state slot
        concurrent = min(args.max_num_seqs, blocks // need_blocks, slots)
        if concurrent >= args.max_num_seqs:
            return concurrent, [], []
        if concurrent == slots < blocks // need_blocks:  # the state slots bind, not the blocks
            return concurrent, [], [Problem(
                f"max_num_seqs {args.max_num_seqs} but only {slots} state slots (num_state_slots): {slots} requests "
                f"run at once, the others wait for a slot. Set --num-state-slots {args.max_num_seqs} or "
                f"--max-num-seqs {slots}", {"num_state_slots": args.max_num_seqs, "max_num_seqs": slots})]
        grow = f.cache.fixes_for(args.max_num_seqs * need_blocks)
        more = (f"; for {args.max_num_seqs} at once: {flags(grow, ', or ')}" if grow else
                f"; this device cannot hold {args.max_num_seqs} at once")
        return concurrent, [], [Problem(
            f"max_num_seqs {args.max_num_seqs} but the cache holds {concurrent} requests of {need_tokens} "
            f"tokens at once: the others wait for blocks (and running ones that grow preempt each "
            f"other). Set --max-num-seqs {max(concurrent, 1)}{more}",
            {"max_num_seqs": max(concurrent, 1), **grow})]
    fixes: dict[str, int | float] = {}
    together: dict[str, int | float] = {}
    if need_tokens <= f.max_pos:
        grow = f.cache.fixes_for(need_blocks) if f.capacity < need_tokens else {}
        if args.max_model_len is not None and args.max_model_len < need_tokens:
            if f.capacity >= need_tokens:
                fixes["max_model_len"] = need_tokens
            elif grow:  # both limits are below the request: as the engine's too-long error says
                together = {"max_model_len": need_tokens, "num_blocks": grow["num_blocks"]}
        else:
            fixes.update(grow)
    if k:
        per_image = (longest - p - out_tokens) // k
        fit = image.fitting(per_image) if per_image >= 1 else None
        if fit is not None and fit.value is not None:
            fixes[image.setting] = fit.value
    return 0, [Problem(
        f"a request of {need_tokens} tokens ({p} text + {k} x {image.tokens} image + {out_tokens} "
        f"output) does not fit: the longest request is {longest} tokens"
        + (f"; fix with one of: {flags(fixes, '; ')}" if fixes else "")
        + (f"; or set together: {flags(together, ' and ')}" if together else "")
        + ("" if fixes or together else "; shorten the request"), fixes, together)], []
