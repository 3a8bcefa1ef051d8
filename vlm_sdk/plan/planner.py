"""`plan()`: how a model's memory would be split, from config.json alone (no weights, nothing loaded).

Everything the engine decides is decided here by the engine's own code: config.json is parsed by
`model_loader.read_config` (as `read_checkpoint` parses it), the model is built on the meta device
(no memory) so layer / head counts and parameter counts are the engine's, the block count comes from
the engine's `kv_cache.size_cache`, and every fix from `CacheConfig.fixes_for` (the start-up refusal
and the too-long error use it too). Units: bytes unless a name says tokens / blocks / pixels.

    kv_bytes_per_token = layers * 2 (K, V) * kv heads per rank * head_dim * dtype bytes
                         (kv_heads / tp; 1 when tp > kv_heads: each rank keeps a copy of one KV head)
    kv_bytes_per_block = kv_bytes_per_token * block_size
    num_blocks         = num_blocks | kv_cache_memory // per_block
                         | (device memory * memory_utilization - in use - activation peak
                            - encoder_cache_memory) // per_block
                         | the CPU default (max_num_seqs full-length sequences, at most 1 GiB)
    in use             = weights, plus with --device cuda:N what is in use on it now
    fits               in use + activation peak + encoder cache + num_blocks * per_block <= device memory
                       (or host RAM with --device cpu): else a problem naming the largest num_blocks /
                       kv_cache_memory that fits (`device.py`). With no device given and no GPU here,
                       `plan` refuses.
The encoder cache (vision embeddings kept for reuse) counts at its bound, encoder_cache_memory: it
fills while the engine serves, so the engine sets it aside before sizing the KV cache, as here.

Weights per rank with `tp`: the model is built on the meta device as rank 0 of `tp` ranks builds it
(vlm_sdk/executor/launch.py checks the same split), so its parameters are exactly one rank's: the
language model split by heads, intermediate size and vocabulary, norms whole, and the vision tower
and projector split too unless `shard_vision` is False (then whole on every rank).

The activation peak is an ESTIMATE (the engine measures it on CUDA with a profiling forward):
    language model: forward(tokens) + max_num_seqs * vocab * (4 (float32 logits) + 40 (the sampler's
                    worst row: penalties, top-k/top-p, logprobs; worker/sampler.py))
                    + the largest image's tokens * hidden * dtype bytes (held across prefill chunks)
                    + on a GPU without enforce_eager: forward(max_num_seqs) + max_num_seqs * vocab * (dtype
                      bytes + 4) (the decode graphs' pool with their logits, and its float32 logits buffer)
                      and with piecewise_cuda_graphs: forward(max_num_batched_tokens) + their buffers
                      (`piecewise_graphs.held_bytes`),
                    forward(n) = n * (4 * hidden + 2 * intermediate / tp + qkv width / tp) * dtype bytes,
                    tokens = min(max_num_batched_tokens, max_position_embeddings)
    vision tower:   vision rows (patches / tile patches) of the largest allowed image
                    * (4 * vision hidden + 2 * vision intermediate) * dtype bytes (attention runs in
                    fused kernels: no patches x patches scores); the family's hooks give the image
                    (`FamilySpec.image_limits`) and the widths (`vision_activation_widths`)
    peak = max(language model, vision tower): the vision tower's buffers are freed before the LM runs.
With --device-memory the CUDA context (~0.5 GiB) and other processes are not counted: the engine,
which measures them, gets slightly fewer blocks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from vlm_sdk.config import DTYPES, DeviceBudget, EngineArgs
from vlm_sdk.engine.capacity import max_model_len_fixes
from vlm_sdk.engine.image_fit import unfit_image_fixes
from vlm_sdk.protocol.blocks import blocks_needed
from vlm_sdk.worker.kv_cache import bytes_per_block, size_cache
from vlm_sdk.engine.memory_report import MemoryTotals
from vlm_sdk.worker.weights import weight_bytes
from vlm_sdk.worker.piecewise_graphs import held_bytes
from vlm_sdk.worker.profiler import profile_num_tokens
from vlm_sdk.worker.sampler import WORST_BYTES_PER_ENTRY as SAMPLER_BYTES_PER_ENTRY
from vlm_sdk.errors import InvalidRequestError, UnknownArgumentError, format_size
from vlm_sdk.executor.launch import check_tensor_parallel_size
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.model_loader import read_config
from vlm_sdk.models import registry
from vlm_sdk.plan import device as _device
from vlm_sdk.plan.device import DEVICE_HINT, Memory, cache_fit_problem, parse_size

__all__ = ["MemoryPlan", "PLAN_OPTIONS", "Problem", "plan"]

_ENGINE_OPTIONS = ("memory_utilization", "kv_cache_memory", "num_blocks", "dtype", "block_size", "max_model_len",
                   "max_num_seqs", "max_num_batched_tokens", "shard_vision", "encoder_cache_memory",
                   "enforce_eager", "piecewise_cuda_graphs")
# each registered family's image option (`FamilySpec.plan_setting`)
FAMILY_OPTIONS = tuple(registry.plan_settings())
PLAN_OPTIONS = ("device_memory", "device", "host_memory", *_ENGINE_OPTIONS, *FAMILY_OPTIONS, "tp",
                "prompt_tokens", "output_tokens", "images")


@dataclass(frozen=True)
class Problem:
    message: str
    fixes: Mapping[str, int | float | str] = field(default_factory=dict)  # setting -> a value that solves it
    together: Mapping[str, int | float | str] = field(default_factory=dict)  # settings that only solve it together

    def to_dict(self) -> dict:
        return {"message": self.message, "fixes": dict(self.fixes), "together": dict(self.together)}


@dataclass(frozen=True)
class MemoryPlan(MemoryTotals):
    config_path: str
    architecture: str
    family: str                      # the registered family name (`FamilySpec.name`)
    device: str                      # "cpu", "cuda:0", or "device memory" when --device-memory was given
    host_memory_bytes: int | None    # --device cpu: the RAM weights + activations + KV cache are checked against
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
    device_in_use_bytes: int | None  # --device cuda:N: in use on it now (CUDA context, other processes)
    memory_utilization: float
    encoder_cache_bytes: int         # encoder_cache_memory: set aside before the KV cache (0: off)
    # what fits
    max_position_embeddings: int     # tokens
    max_model_len: int               # tokens; the user's value, else min(max_position_embeddings, capacity)
    max_num_seqs: int
    image_tokens_per_image: int      # tokens of the largest allowed image
    largest_image: str               # that image, in words
    largest_fitting_image_tokens: int  # the largest image that fits alone in the longest request (0: none)
    largest_fitting_image: str       # that image, in words, with the setting that allows it
    prompt_tokens: int | None        # workload: text tokens per request
    output_tokens: int | None
    images: int | None
    max_concurrent_requests: int | None  # None without a workload
    problems: tuple[Problem, ...]    # what fails: the engine refuses to start, or a request is refused
    notes: tuple[Problem, ...] = ()  # what runs below the settings (fewer requests at once than max_num_seqs)

    @property
    def activation_peak_bytes(self) -> int:
        return max(self.activation_language_model_bytes, self.activation_vision_bytes)

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
        out = {k: v for k, v in self.__dict__.items() if k not in ("problems", "notes")}
        for name in ("weights_bytes", "activation_peak_bytes", "capacity_tokens", "kv_cache_bytes",
                     "longest_request_tokens", "request_tokens"):
            out[name] = getattr(self, name)
        out["problems"] = [p.to_dict() for p in self.problems]
        out["notes"] = [p.to_dict() for p in self.notes]
        return out


def plan(config_path_or_dir, **options) -> MemoryPlan:
    """The memory plan of a config of any registered family (a directory or the config.json file).
    Where: device_memory ("80GiB", or an int of bytes) or device ("cpu"; "cuda:N": read its total);
    one of them is required on a machine without a GPU (with one, its GPU is planned). host_memory
    (with device="cpu"; default this machine's RAM). Settings (the engine's names and units):
    memory_utilization, kv_cache_memory ("2GiB" or bytes), encoder_cache_memory ("256MiB", bytes, or 0
    for none), num_blocks, dtype, block_size,
    max_model_len, max_num_seqs, max_num_batched_tokens, the family's image setting (`FAMILY_OPTIONS`:
    max_pixels, max_dynamic_patch), tp, shard_vision, and a workload per request: prompt_tokens (text
    only), images (each at the largest allowed size), output_tokens. `InvalidRequestError` for a bad
    option, `CheckpointError` for a config the engine could not serve either."""
    unknown = sorted(set(options) - set(PLAN_OPTIONS))
    if unknown:
        hints = "".join(f"; {k}: use {_image_field_hints()[k]}" for k in unknown if k in _image_field_hints())
        raise UnknownArgumentError(f"unknown plan option(s) {unknown}{hints}; accepted: {sorted(PLAN_OPTIONS)}")
    o = dict.fromkeys(PLAN_OPTIONS) | {k: v for k, v in options.items() if v is not None}
    sizes = {k: parse_size(o[k], k) for k in ("device_memory", "kv_cache_memory", "host_memory") if o[k] is not None}
    args = EngineArgs.from_kwargs(**{k: sizes.get(k, o[k]) for k in _ENGINE_OPTIONS if o[k] is not None})
    plan_settings = registry.plan_settings()
    for name, (fam, setting) in plan_settings.items():
        if o[name] is not None:  # checked by the declaring family's schema, under the plan option's name
            schema = next(s for s in fam.engine_settings if s.name == setting)
            dataclasses.replace(schema, name=name).check(o[name])
    for name in ("tp", "prompt_tokens", "output_tokens", "images"):
        v = o[name]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "tp" else 0)):
            raise InvalidRequestError(f"{name} must be a {'positive' if name == 'tp' else 'non-negative'} "
                                      f"integer, got {v!r}")
    tp = o["tp"] or 1

    info = read_config(config_path_or_dir)
    family = registry.resolve([info.architecture])
    option, setting = family.plan_setting
    for other in plan_settings:
        if other != option and o[other] is not None:
            raise InvalidRequestError(f"--{_flag(other)} is not a setting of {family.display_name} (this config is "
                                      f"{info.architecture}): use --{_flag(option)}", param=other)
    family_options = {} if o[option] is None else {setting: o[option]}

    device, device_memory, other_use, host_memory = _where(o, sizes)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)

    check_tensor_parallel_size(family, info.hf_config, tp, args.shard_vision)  # the engine's refusal
    # the engine's own modules (rank 0's), no memory: counts can never disagree
    model = family.meta_model(info.hf_config, dtype, tp, args.shard_vision)
    layers, kv_heads, head_dim = model.num_layers, model.num_kv_heads, model.head_dim  # kv_heads: per rank
    per_block = bytes_per_block(layers, kv_heads, head_dim, args.block_size, dtype)
    max_pos = int(family.text_config(info.hf_config).max_position_embeddings)

    weights = weight_bytes(model)  # one rank's parameters
    image = family.image_limits(info.preprocessor, info.hf_config, model, family_options)
    act_lm, act_vision = _activations(model, family.vision_activation_widths(info.hf_config, model), image.patches,
                                      args, max_pos, dtype, tp, image.tokens, cuda_graphs=device != "cpu")
    peak = max(act_lm, act_vision)

    # the engine's own sizing rules, on the memory it would find after loading the weights
    encoder = args.encoder_cache_memory
    budget = None if device_memory is None else DeviceBudget(device_memory, other_use + weights.total, peak, encoder)
    cache = size_cache(args, per_block, max_pos, budget)
    blocks = max(cache.num_blocks, 0)
    memory = (Memory(device_memory, other_use, "device memory") if device_memory is not None else
              Memory(host_memory, 0, "host RAM"))
    if budget is None:  # the CPU: grow-the-cache fixes are bounded by host RAM (sizing rules stay the engine's)
        cache = dataclasses.replace(cache, budget=DeviceBudget(host_memory, weights.total, peak, encoder))
    capacity = blocks * args.block_size
    max_model_len = args.max_model_len or min(max_pos, capacity)
    longest = min(capacity, max_pos, max_model_len)
    fits_alone = image.fitting(longest)

    problems: list[Problem] = []  # the engine would refuse to start, or a request would be refused
    notes: list[Problem] = []  # it runs, but below what the settings ask for
    too_big = cache_fit_problem(memory, weights.total, peak, blocks, per_block, cache.rule, cache.source, encoder) \
        if blocks >= 1 and (device_memory is None or cache.rule != "memory_utilization") else None
    if too_big is not None:  # memory_utilization sizes the cache to fit by construction
        problems.append(Problem(*too_big))
    if blocks < 1:
        fixes = cache.fixes_for(1)
        problems.append(Problem(f"no room for one KV block ({per_block:,} bytes) with {cache.source}"
                                + (" (the activation peak is an estimate: lower --max-num-batched-tokens or "
                                   "--max-num-seqs to shrink it)" if cache.rule == "memory_utilization" else ""),
                                fixes))
    if args.max_model_len is not None and args.max_model_len > max_pos:
        problems.append(Problem(f"max_model_len {args.max_model_len} > the model's max_position_embeddings "
                                f"{max_pos}: set --max-model-len {max_pos}", {"max_model_len": max_pos}))
    elif args.max_model_len is not None and args.max_model_len > capacity >= 1:
        fixes = max_model_len_fixes(dataclasses.replace(cache, num_blocks=blocks), args.max_model_len)
        problems.append(Problem(f"max_model_len {args.max_model_len} > capacity {capacity} tokens (the engine "
                                f"refuses to start): set {_flags(fixes, ', or ')}", fixes))
    if args.max_model_len is None and 1 <= capacity < max_pos:
        grow = cache.fixes_for(blocks_needed(max_pos, args.block_size))
        notes.append(Problem(f"max_model_len follows the cache: {capacity} tokens, below the model's "
                             f"max_position_embeddings {max_pos}"
                             + (f"; for the full length set {_flags(grow, ', or ')}" if grow else
                                "; no cache this device holds reaches the full length"), grow))
    if image.tokens > longest >= 1:  # the engine refuses to start (engine/image_fit.py): the same fixes
        fixes, together, room = unfit_image_fixes(image, image.setting, cache, longest, max_pos,
                                                  args.max_model_len is not None)
        text = f"the largest allowed image ({image.tokens} tokens) does not fit alone in the longest request " \
               f"({longest} tokens); each fix leaves {room} tokens for a request's text and output"
        if fixes:
            text += f": set {_flags(fixes, ', or ')}"
        if together:
            text += f"; or together {_flags(together, ' ')}"
        problems.append(Problem(text, fixes, together))

    concurrent = None
    workload = (o["prompt_tokens"], o["output_tokens"], o["images"])
    if any(v is not None for v in workload):
        p, out_tokens, k = (v or 0 for v in workload)
        need_tokens = p + k * image.tokens + out_tokens
        need_blocks = blocks_needed(max(need_tokens, 1), args.block_size)
        if need_tokens <= longest:
            concurrent = min(args.max_num_seqs, blocks // need_blocks)
            if concurrent < args.max_num_seqs:
                grow = cache.fixes_for(args.max_num_seqs * need_blocks)
                more = (f"; for {args.max_num_seqs} at once: {_flags(grow, ', or ')}" if grow else
                        f"; this device cannot hold {args.max_num_seqs} at once")
                notes.append(Problem(
                    f"max_num_seqs {args.max_num_seqs} but the cache holds {concurrent} requests of {need_tokens} "
                    f"tokens at once: the others wait for blocks (and running ones that grow preempt each "
                    f"other). Set --max-num-seqs {max(concurrent, 1)}{more}",
                    {"max_num_seqs": max(concurrent, 1), **grow}))
        else:
            concurrent = 0
            fixes: dict[str, int | float] = {}
            together: dict[str, int | float] = {}
            if need_tokens <= max_pos:
                grow = cache.fixes_for(need_blocks) if capacity < need_tokens else {}
                if args.max_model_len is not None and args.max_model_len < need_tokens:
                    if capacity >= need_tokens:
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
            problems.append(Problem(
                f"a request of {need_tokens} tokens ({p} text + {k} x {image.tokens} image + {out_tokens} "
                f"output) does not fit: the longest request is {longest} tokens"
                + (f"; fix with one of: {_flags(fixes, '; ')}" if fixes else "")
                + (f"; or set together: {_flags(together, ' and ')}" if together else "")
                + ("" if fixes or together else "; shorten the request"), fixes, together))

    return MemoryPlan(
        config_path=str(info.config_path), architecture=info.architecture, family=family.name, device=device,
        host_memory_bytes=host_memory,
        dtype=str(dtype).removeprefix("torch."), tp=tp, weights_language_model_bytes=weights.language_model,
        weights_vision_bytes=weights.vision, weights_projector_bytes=weights.projector,
        activation_language_model_bytes=act_lm, activation_vision_bytes=act_vision, num_layers=layers,
        num_kv_heads=kv_heads, head_dim=head_dim, block_size=args.block_size, kv_bytes_per_token=cache.bytes_per_token,
        kv_bytes_per_block=per_block, num_blocks=blocks, cache_source=cache.source, device_memory_bytes=device_memory,
        device_in_use_bytes=other_use if device_memory is not None and o["device_memory"] is None else None,
        memory_utilization=args.memory_utilization, encoder_cache_bytes=encoder, max_position_embeddings=max_pos,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs, image_tokens_per_image=image.tokens, largest_image=image.text,
        largest_fitting_image_tokens=fits_alone.tokens if fits_alone else 0,
        largest_fitting_image=fits_alone.text if fits_alone else "none: not even the smallest image fits",
        prompt_tokens=o["prompt_tokens"], output_tokens=o["output_tokens"], images=o["images"],
        max_concurrent_requests=concurrent, problems=tuple(problems), notes=tuple(notes))


def _where(o: dict, sizes: dict) -> tuple[str, int | None, int, int | None]:
    """(device in words, device memory or None on the CPU, bytes in use on it now, host RAM on the CPU)."""
    if o["device_memory"] is not None and o["device"] is not None:
        raise InvalidRequestError(f"device_memory and device={o['device']!r} are both set: give one "
                                  f"({DEVICE_HINT})", param="device")
    if o["device_memory"] is not None:
        where = ("device memory", sizes["device_memory"], 0, None)
    elif o["device"] is None and not torch.cuda.is_available():
        raise InvalidRequestError(f"plan for which device? This machine has no GPU: give {DEVICE_HINT}",
                                  param="device")
    else:
        dev = EngineArgs(device=o["device"]).resolve_device()  # no device given: this machine's GPU
        if dev.type == "cpu":
            where = ("cpu", None, 0, sizes.get("host_memory") or _device.host_memory_bytes())
        else:  # what is in use now (CUDA context, other processes) stays in use
            free, total = torch.cuda.mem_get_info(dev)
            where = (str(dev), total, total - free, None)
    if o["host_memory"] is not None and where[0] != "cpu":
        raise InvalidRequestError("host_memory is the RAM of a CPU plan: give it with --device cpu", param="host_memory")
    return where


def _image_field_hints() -> dict[str, str]:
    """An image part's own field that is not an engine setting -> the engine setting plan takes instead."""
    out = {}
    for fam in registry.families():
        engine = {s.name for s in fam.engine_settings}
        for s in fam.image_settings:
            if s.name not in engine:
                out.setdefault(s.name, f"{fam.plan_setting[0]} ({s.name} is only an image part's own field in "
                                       f"{fam.display_name})")
    return out


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _value(name: str, v) -> str:
    """A fix's value as its flag takes it: sizes with a unit (an int of bytes -> 432MiB)."""
    return format_size(v) if name == "kv_cache_memory" and isinstance(v, int) else str(v)


def _flags(fixes: Mapping[str, int | float | str], sep: str) -> str:
    return sep.join(f"--{_flag(k)} {_value(k, v)}" for k, v in fixes.items())


def _activations(model, vision_widths: tuple[int, int], patches: int, args: EngineArgs, max_pos: int,
                 dtype: torch.dtype, tp: int, image_tokens: int, cuda_graphs: bool) -> tuple[int, int]:
    """(language model, vision tower) activation peak estimates in bytes; see the module docstring.
    The language model's counts what the engine's profile runs beside its step (worker/profiler.py):
    the logits and the sampler's temporaries at max_num_seqs rows, the largest image's embeddings held
    across chunks, and on a GPU the CUDA graphs' memory (the decode graphs' pool: a decode forward of
    max_num_seqs tokens; the piecewise graphs', when on: `piecewise_graphs.held_bytes` and a forward of
    the token budget)."""
    c = model.decoder_config
    nbytes = torch.finfo(dtype).bits // 8
    tokens = profile_num_tokens(args.max_num_batched_tokens, max_pos)
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim

    def forward(n: int) -> int:  # the estimated peak of a forward of n tokens
        return n * (4 * c.hidden_size + (2 * c.intermediate_size + qkv) // tp) * nbytes
    lm = forward(tokens)
    lm += args.max_num_seqs * c.vocab_size * (4 + SAMPLER_BYTES_PER_ENTRY)  # logits (float32) + sampler
    lm += image_tokens * c.hidden_size * nbytes  # the largest image's embeddings, held across chunks
    if cuda_graphs and not args.enforce_eager:
        # the decode graphs' pool: a forward and its logits, and the graphs' float32 logits buffer
        lm += forward(args.max_num_seqs) + args.max_num_seqs * c.vocab_size * (nbytes + 4)
        if args.piecewise_cuda_graphs and tp == 1:
            lm += forward(args.max_num_batched_tokens) + held_bytes(
                args.max_num_batched_tokens, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                model.position_rows, dtype)
    dim, inter = vision_widths
    return lm, patches * (4 * dim + 2 * inter) * nbytes
