"""`plan()`: how a model's memory would be split, from config.json alone (no weights, nothing loaded).

Everything the engine decides is decided here by the engine's own code: config.json is parsed by
`model_loader.read_config` (as `read_checkpoint` parses it), the model is built on the meta device
(no memory) so layer / head counts and parameter counts are the engine's, and the block count uses
`kv_cache`'s pure rules. Units: bytes unless a name says tokens / blocks / pixels.

    kv_bytes_per_token = layers * 2 (K, V) * (kv_heads / tp) * head_dim * dtype bytes
    kv_bytes_per_block = kv_bytes_per_token * block_size
    num_blocks         = num_blocks | kv_cache_memory // per_block
                         | (device memory * memory_utilization - weights - activation peak) // per_block
                         | the CPU default (max_num_seqs full-length sequences, at most 1 GiB)

Weights per rank with `tp`: the language model's matrices (2-D parameters, embeddings and lm_head
included) are divided by tp; its norms/biases (1-D), the vision tower and the projector are counted
whole on every rank (a simplification: a real TP engine shards some of these too).

The activation peak is an ESTIMATE (the engine measures it on CUDA with a profiling forward):
    language model: tokens * (4 * hidden + 2 * intermediate / tp + qkv width / tp) * dtype bytes
                    + logits max_num_seqs * vocab * 4 bytes (float32),
                    tokens = min(max_num_batched_tokens, max_position_embeddings)
    vision tower:   patches of the largest allowed image * (4 * vision hidden + 2 * vision intermediate)
                    * dtype bytes (attention runs in fused kernels: no patches x patches scores)
    peak = max(language model, vision tower): the vision tower's buffers are freed before the LM runs.
The device-memory rule also ignores the CUDA context and other processes (the engine sees them).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch

from vlm_sdk.config import DTYPES, EngineArgs
from vlm_sdk.engine.block_manager import blocks_needed
from vlm_sdk.engine.capacity import _largest_max_pixels
from vlm_sdk.engine.kv_cache import (blocks_from_device_memory, bytes_per_block, cpu_default_blocks,
                                     min_memory_utilization)
from vlm_sdk.errors import InvalidRequestError, UnknownArgumentError
from vlm_sdk.model_loader import read_config
from vlm_sdk.models.registry import resolve

__all__ = ["MemoryPlan", "Problem", "plan", "parse_bytes"]

_UNITS = MappingProxyType({"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                           "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
_OPTIONS = ("device_memory", "device", "memory_utilization", "kv_cache_memory", "num_blocks", "dtype",
            "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_pixels", "max_num",
            "tp", "prompt_tokens", "output_tokens", "images")


def parse_bytes(value: int | str, name: str = "device_memory") -> int:
    """80GiB, 6784MiB, 1.5GB or a plain integer -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidRequestError(f"{name}={value!r} is not a size: use e.g. 80GiB, 6784MiB, 40GB or bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class Problem:
    message: str
    fixes: Mapping[str, int | float] = field(default_factory=dict)  # setting -> a value that solves it

    def to_dict(self) -> dict:
        return {"message": self.message, "fixes": dict(self.fixes)}


@dataclass(frozen=True)
class MemoryPlan:
    config_path: str
    architecture: str
    family: str                      # "qwen2_5_vl" | "internvl"
    device: str                      # "cpu", "cuda:0", or "device memory" when --device-memory was given
    dtype: str
    tp: int
    # weights, bytes per rank
    weights_language_model_bytes: int
    weights_vision_bytes: int
    weights_projector_bytes: int
    # activation peak estimate, bytes
    activation_language_model_bytes: int
    activation_vision_bytes: int
    # KV cache
    num_layers: int
    num_kv_heads: int                # per rank
    head_dim: int
    block_size: int                  # tokens
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    num_blocks: int                  # 0 when nothing fits (see problems)
    cache_source: str                # which rule decided num_blocks, in words
    device_memory_bytes: int | None
    memory_utilization: float
    # what fits
    max_position_embeddings: int     # tokens
    max_model_len: int               # tokens; the user's value, else min(max_position_embeddings, capacity)
    max_num_seqs: int
    image_tokens_per_image: int      # tokens of the largest allowed image
    largest_image: str               # that image, in words
    prompt_tokens: int | None        # workload: text tokens per request
    output_tokens: int | None
    images: int | None
    max_concurrent_requests: int | None  # None without a workload
    problems: tuple[Problem, ...]

    @property
    def weights_bytes(self) -> int:
        return self.weights_language_model_bytes + self.weights_vision_bytes + self.weights_projector_bytes

    @property
    def activation_peak_bytes(self) -> int:
        return max(self.activation_language_model_bytes, self.activation_vision_bytes)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    @property
    def longest_request_tokens(self) -> int:
        return min(self.capacity_tokens, self.max_position_embeddings, self.max_model_len)

    @property
    def request_tokens(self) -> int | None:
        """Tokens one workload request holds at its end: prompt text + images + output."""
        if self.prompt_tokens is None and self.images is None and self.output_tokens is None:
            return None
        return ((self.prompt_tokens or 0) + (self.images or 0) * self.image_tokens_per_image
                + (self.output_tokens or 0))

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "problems"}
        for name in ("weights_bytes", "activation_peak_bytes", "capacity_tokens", "kv_cache_bytes",
                     "longest_request_tokens", "request_tokens"):
            out[name] = getattr(self, name)
        out["problems"] = [p.to_dict() for p in self.problems]
        return out


def plan(config_path_or_dir, **options) -> MemoryPlan:
    """The memory plan of a Qwen2.5-VL or InternVL config (a directory or the config.json file).
    Options (all optional): device_memory (bytes or "80GiB") or device ("cpu", "cuda:N": read its
    total), memory_utilization, kv_cache_memory, num_blocks, dtype, block_size, max_model_len,
    max_num_seqs, max_num_batched_tokens, max_pixels (Qwen), max_num (InternVL tiles), tp, and a
    workload prompt_tokens (text) / output_tokens / images per request. `InvalidRequestError` for a
    bad option, `CheckpointError` for a config the engine could not serve either."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise UnknownArgumentError(f"unknown plan option(s) {unknown}; accepted: {sorted(_OPTIONS)}")
    o = dict.fromkeys(_OPTIONS) | {k: v for k, v in options.items() if v is not None}
    engine_fields = ("memory_utilization", "kv_cache_memory", "num_blocks", "dtype", "block_size",
                     "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_pixels")
    args = EngineArgs.from_kwargs(**{k: o[k] for k in engine_fields if o[k] is not None},
                                  **({} if o["max_num"] is None else {"max_dynamic_patch": o["max_num"]}))
    for name in ("tp", "prompt_tokens", "output_tokens", "images"):
        v = o[name]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "tp" else 0)):
            raise InvalidRequestError(f"{name} must be a {'positive' if name == 'tp' else 'non-negative'} "
                                      f"integer, got {v!r}")
    tp = o["tp"] or 1

    # device: the engine's default when neither is given (CUDA when available, else the CPU)
    device_memory = None if o["device_memory"] is None else parse_bytes(o["device_memory"])
    if device_memory is not None:
        device = "device memory"
    else:
        dev = EngineArgs(device=o["device"]).resolve_device()
        device = str(dev)
        if dev.type == "cuda":
            device_memory = torch.cuda.mem_get_info(dev)[1]
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)

    info = read_config(config_path_or_dir)
    family = resolve([info.architecture])
    with torch.device("meta"):  # the engine's own modules, no memory: counts can never disagree
        model = family.model_cls(info.hf_config, dtype=dtype, device="meta")
    layers, kv_heads, head_dim = model.num_layers, model.num_kv_heads, model.head_dim
    if kv_heads % tp:
        raise InvalidRequestError(f"tp={tp} does not divide the model's {kv_heads} KV heads; use a tp that "
                                  f"divides {kv_heads} (e.g. {max(d for d in range(1, kv_heads + 1) if kv_heads % d == 0 and d <= tp)})",
                                  param="tp")
    kv_heads //= tp
    per_block = bytes_per_block(layers, kv_heads, head_dim, args.block_size, dtype)
    max_pos = int(family.text_config(info.hf_config).max_position_embeddings)

    lm, vision, projector = _weights(model, family.name, tp)
    image = _largest_image(family.name, info, model, args)
    act_lm, act_vision = _activations(info.hf_config, model, family.name, image["patches"], args, max_pos, dtype, tp)

    # num_blocks: kv_cache.plan_cache's rules, in its order
    useful = args.max_num_seqs * (args.max_model_len or max_pos)
    weights = lm + vision + projector
    peak = max(act_lm, act_vision)
    if args.num_blocks is not None:
        blocks, source = args.num_blocks, f"num_blocks={args.num_blocks} set by you"
    elif args.kv_cache_memory is not None:
        blocks, source = args.kv_cache_memory // per_block, f"kv_cache_memory={args.kv_cache_memory:,} bytes set by you"
    elif device_memory is not None:
        blocks = blocks_from_device_memory(device_memory, weights, peak, args.memory_utilization, per_block)
        source = (f"memory_utilization={args.memory_utilization} of {device_memory:,} bytes, after "
                  f"{weights:,} of weights and a {peak:,}-byte activation peak (estimate)")
    else:
        blocks = cpu_default_blocks(per_block, useful, args.block_size)
        source = "the CPU default: max_num_seqs full-length sequences, at most 1 GiB"
    blocks = max(blocks, 0)
    capacity = blocks * args.block_size
    max_model_len = args.max_model_len or min(max_pos, capacity)

    def budget_fixes(need_blocks: int) -> dict[str, int | float]:
        fixes: dict[str, int | float] = {"num_blocks": need_blocks, "kv_cache_memory": need_blocks * per_block}
        if device_memory is not None and args.num_blocks is None and args.kv_cache_memory is None:
            u = min_memory_utilization(device_memory, device_memory - weights, peak, need_blocks * per_block)
            if u <= 1:
                fixes["memory_utilization"] = u
        return fixes

    problems: list[Problem] = []
    if blocks < 1:
        problems.append(Problem(f"no room for one KV block ({per_block:,} bytes) with {source}",
                                budget_fixes(1)))
    if args.max_model_len is not None and args.max_model_len > max_pos:
        problems.append(Problem(f"max_model_len {args.max_model_len} > the model's max_position_embeddings "
                                f"{max_pos}: set --max-model-len {max_pos}", {"max_model_len": max_pos}))
    if args.max_model_len is not None and args.max_model_len > capacity >= 1:
        need = blocks_needed(args.max_model_len, args.block_size)
        problems.append(Problem(f"max_model_len {args.max_model_len} > capacity {capacity} tokens (the engine "
                                f"refuses to start): set --max-model-len {capacity}, or a cache of {need} blocks",
                                {"max_model_len": capacity, **budget_fixes(need)}))
    longest = min(capacity, max_pos, max_model_len)
    image_setting = "max_pixels" if family.name == "qwen2_5_vl" else "max_num"
    if image["tokens"] > longest >= 1:
        fix = image["fit"](longest)
        problems.append(Problem(f"the largest allowed image ({image['tokens']} tokens) does not fit alone in the "
                                f"longest request ({longest} tokens)" + (f": set --{image_setting.replace('_', '-')} {fix}"
                                                                          if fix else ""),
                                {image_setting: fix} if fix else {}))

    concurrent = None
    workload = (o["prompt_tokens"], o["output_tokens"], o["images"])
    if any(v is not None for v in workload):
        p, out_tokens, k = (v or 0 for v in workload)
        need_tokens = p + k * image["tokens"] + out_tokens
        if need_tokens <= longest:
            concurrent = min(args.max_num_seqs, blocks // blocks_needed(max(need_tokens, 1), args.block_size))
        else:
            concurrent = 0
            fixes: dict[str, int | float] = {}
            if need_tokens <= max_pos:
                if capacity < need_tokens:
                    fixes.update(budget_fixes(blocks_needed(need_tokens, args.block_size)))
                if args.max_model_len is not None and args.max_model_len < need_tokens:
                    fixes["max_model_len"] = need_tokens
            if k:
                per_image = (longest - p - out_tokens) // k
                fix = image["fit"](per_image) if per_image >= 1 else None
                if fix:
                    fixes[image_setting] = fix
            names = "; ".join(f"--{n.replace('_', '-')} {v}" for n, v in fixes.items())
            problems.append(Problem(
                f"a request of {need_tokens} tokens ({p} text + {k} x {image['tokens']} image + {out_tokens} "
                f"output) does not fit: the longest request is {longest} tokens"
                + (f"; fix with one of: {names}" if names else "; shorten the request"), fixes))

    return MemoryPlan(
        config_path=str(info.config_path), architecture=info.architecture, family=family.name, device=device,
        dtype=str(dtype).removeprefix("torch."), tp=tp, weights_language_model_bytes=lm,
        weights_vision_bytes=vision, weights_projector_bytes=projector, activation_language_model_bytes=act_lm,
        activation_vision_bytes=act_vision, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
        block_size=args.block_size, kv_bytes_per_token=per_block // args.block_size, kv_bytes_per_block=per_block,
        num_blocks=blocks, cache_source=source, device_memory_bytes=device_memory,
        memory_utilization=args.memory_utilization, max_position_embeddings=max_pos, max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs, image_tokens_per_image=image["tokens"], largest_image=image["text"],
        prompt_tokens=o["prompt_tokens"], output_tokens=o["output_tokens"], images=o["images"],
        max_concurrent_requests=concurrent, problems=tuple(problems))


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _weights(model: torch.nn.Module, family: str, tp: int) -> tuple[int, int, int]:
    """(language model, vision tower, projector) bytes per rank; LM matrices / tp, the rest whole."""
    decoder = list(model.decoder.parameters())
    lm = _bytes(p for p in decoder if p.dim() >= 2) // tp + _bytes(p for p in decoder if p.dim() < 2)
    tower = model.visual if family == "qwen2_5_vl" else model.vision
    proj = tower.merger if family == "qwen2_5_vl" else tower.projector
    projector = _bytes(proj.parameters())
    return lm, _bytes(tower.parameters()) - projector, projector


def _largest_image(family: str, info, model, args: EngineArgs) -> dict:
    """{"tokens", "patches", "text", "fit"}: the largest image the settings allow; fit(tokens) -> the
    largest max_pixels / max_num whose largest image is at most `tokens` tokens (None if none)."""
    if family == "qwen2_5_vl":
        from vlm_sdk.models.qwen2_5_vl.image_processor import Qwen2VLImageProcessor, max_image_grid
        ip = Qwen2VLImageProcessor.from_preprocessor_config(info.preprocessor, info.hf_config)
        max_pixels = args.max_pixels or ip.max_pixels
        factor, unit = ip.patch_size * ip.merge_size, ip.merge_size ** 2

        def tokens(v: int) -> int:
            t, h, w = max_image_grid(ip, v)
            return t * h * w // unit
        t, h, w = max_image_grid(ip, max_pixels)

        def fit(limit: int) -> int | None:
            return _largest_max_pixels(tokens, limit, ip.min_pixels, factor, max_pixels)
        return {"tokens": t * h * w // unit, "patches": t * h * w, "fit": fit,
                "text": f"max_pixels {max_pixels}: {h * ip.patch_size}x{w * ip.patch_size} pixels"}
    from vlm_sdk.models.internvl.image_processor import InternVLImageProcessor
    ip = InternVLImageProcessor.from_preprocessor_config(info.preprocessor, info.hf_config)
    per_tile = model.vision.cfg.tokens_per_tile(ip.image_size)
    max_num = args.max_dynamic_patch or ip.max_num
    tiles = ip.tiles_of_grid(max_num)
    grid = model.vision.cfg.grid_of(ip.image_size)

    def fit(limit: int) -> int | None:
        ok = [n for n in range(ip.min_num, max_num) if ip.tiles_of_grid(n) * per_tile <= limit]
        return max(ok) if ok else None
    return {"tokens": tiles * per_tile, "patches": tiles * (grid * grid + 1), "fit": fit,
            "text": f"max_num {max_num}: {tiles} tiles of {ip.image_size}x{ip.image_size} pixels"}


def _activations(hf_config, model, family: str, patches: int, args: EngineArgs, max_pos: int, dtype: torch.dtype,
                 tp: int) -> tuple[int, int]:
    """(language model, vision tower) activation peak estimates in bytes; see the module docstring."""
    c = model.decoder_config
    nbytes = torch.finfo(dtype).bits // 8
    tokens = min(args.max_num_batched_tokens, max_pos)
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    lm = tokens * (4 * c.hidden_size + (2 * c.intermediate_size + qkv) // tp) * nbytes
    lm += args.max_num_seqs * c.vocab_size * 4
    if family == "qwen2_5_vl":
        vc = hf_config.vision_config  # Qwen2.5-VL: transformers' parsed vision config
        dim, inter = vc.hidden_size, vc.intermediate_size
    else:
        dim, inter = model.vision.cfg.hidden_size, model.vision.cfg.intermediate_size
    return lm, patches * (4 * dim + 2 * inter) * nbytes
