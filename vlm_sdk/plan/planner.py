"""`plan()`: how a model's memory would be split, from config.json alone (no weights, nothing loaded).

Everything the engine decides is decided here by the engine's own code: config.json is parsed by
`model_loader.read_config` (as `read_checkpoint` parses it), the model is built on the meta device
(no memory) so layer / head counts and parameter counts are the engine's, the block count comes from
the engine's `memory.kv.size_cache`, and every fix from `CacheConfig.fixes_for` (the start-up refusal
and the too-long error use it too). Units: bytes unless a name says tokens / blocks / pixels.

    kv_bytes_per_token = group_size * 2 (K, V) * kv heads per rank * head_dim * KV dtype bytes
                         (the model's dtype, or 1 with kv_cache_dtype "fp8"; int8 / int4: head_dim
                         or head_dim / 2 code bytes + 8 for the float32 scale and zero, per head)
                         (kv_heads / tp; 1 when tp > kv_heads: each rank keeps a copy of one KV head)
                         (group_size = layers for a model of one attention kind: protocol/cache_layout.py)
    kv_bytes_per_block = kv_bytes_per_token * block_size
    state slots        = a model with state layers: num_state_slots x their bytes, carved out first
    num_blocks         = num_blocks | (kv_cache_memory - state slots) // per_block
                         | (device memory * memory_utilization - in use - activation peak
                            - encoder_cache_memory - state slots) // per_block
                         | the CPU default (max_num_seqs full-length sequences, at most 1 GiB)
    in use             = weights, plus with --device cuda:N what is in use on it now
    fits               in use + activation peak + encoder cache + num_blocks * per_block <= device memory
                       (or host RAM with --device cpu): else a problem naming the largest num_blocks /
                       kv_cache_memory that fits (`device.py`). With no device given and no GPU here,
                       `plan` refuses.
The encoder cache (vision embeddings kept for reuse) counts at its bound, encoder_cache_memory: it
fills while the engine serves, so the engine sets it aside before sizing the KV cache, as here.

Weights per rank with `tp`: the model is built on the meta device as rank 0 of `tp` ranks builds it
(models/parallel_split.py: the executor checks the same split), so its parameters are exactly one
rank's: the language model split by heads, intermediate size and vocabulary, norms whole, and the vision tower
and projector split too unless `shard_vision` is False (then whole on every rank).

Memory consumers (vlm_sdk/memory/consumers/: weights, the activation peak, the MoE experts' step buffers,
logits + sampler, the decode graphs' pool, the piecewise graphs, the encoder cache) are counted by the same pipeline engine start-up
runs (`memory.breakdown`): here every one is an ESTIMATE from the shape and the settings; the engine
measures the step-time ones on a GPU with a profiling forward. With --device-memory the CUDA context
(~0.5 GiB) and other processes are not counted: the engine, which measures them, gets slightly fewer
blocks.

`plan()` reads as its steps: options checked (`_settings`), where it runs (`_where`), the model's
memory inputs and consumers, the KV cache sized by the engine's rules, then each rule that can make the
engine refuse to start or refuse a request (vlm_sdk/plan/rules.py) adds its problem or note.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from vlm_sdk.models.common.eagle3_config import draft_memory
from vlm_sdk.spec_config import check_speculation
from vlm_sdk.config import DTYPES, EngineArgs, ParallelConfig
from vlm_sdk.errors import InvalidRequestError, UnknownArgumentError, format_size
from vlm_sdk.models.parallel_split import check_tensor_parallel_size
from vlm_sdk.memory.breakdown import ConsumerBytes, breakdown
from vlm_sdk.memory.capacity import resolve_max_model_len
from vlm_sdk.memory.inputs import memory_inputs
from vlm_sdk.memory.kv import DeviceBudget, lower_bytes_per_block, size_cache
from vlm_sdk.memory.kv_dtypes import kv_dtype_fits
from vlm_sdk.memory.startup import cache_shares
from vlm_sdk.memory.report import MemoryTotals
from vlm_sdk.model_loader import read_config
from vlm_sdk.models import registry
from vlm_sdk.plan import device as _device
from vlm_sdk.plan import rules
from vlm_sdk.plan.contexts import CONTEXT_LENGTHS, context_fits
from vlm_sdk.plan.device import DEVICE_HINT, Memory, parse_size
from vlm_sdk.plan.picture import at_once_curve
from vlm_sdk.plan.rules import Problem
from vlm_sdk.plan.stages import StagePlan, plan_stages

__all__ = ["MemoryPlan", "PLAN_OPTIONS", "Problem", "plan"]

_ENGINE_OPTIONS = ("memory_utilization", "kv_cache_memory", "num_blocks", "dtype", "block_size", "max_model_len",
                   "max_num_seqs", "max_num_batched_tokens", "shard_vision", "enable_expert_parallel",
                   "encoder_cache_memory", "num_state_slots", "enable_prefix_caching", "model_family",
                   "enforce_eager", "piecewise_cuda_graphs", "kv_cache_dtype", "quant_policy", "speculative_config")
# each registered family's image option (`FamilySpec.plan_setting`)
FAMILY_OPTIONS = tuple(registry.plan_settings())
PLAN_OPTIONS = ("device_memory", "device", "host_memory", *_ENGINE_OPTIONS, *FAMILY_OPTIONS, "tp", "pp",
                "pp_layer_partition", "prompt_tokens", "output_tokens", "images", "workload")


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
    # every memory consumer's estimate (vlm_sdk/memory/consumers/), bytes per rank
    consumers: tuple[ConsumerBytes, ...]
    activation_peak_bytes: int       # the step-time consumers' sum: carved out before the KV cache
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
    held_vision_tokens: int          # vision embeddings a prefilling request holds (MemoryInputs.held_vision_tokens)
    held_vision: str                 # the same, in words
    largest_fitting_image_tokens: int  # the largest image that fits alone in the longest request (0: none)
    largest_fitting_image: str       # that image, in words, with the setting that allows it
    prompt_tokens: int | None        # workload: text tokens per request
    output_tokens: int | None
    images: int | None
    max_concurrent_requests: int | None  # None without a workload
    problems: tuple[Problem, ...]    # what fails: the engine refuses to start, or a request is refused
    notes: tuple[Problem, ...] = ()  # what runs below the settings (fewer requests at once than max_num_seqs)
    weight_format: str = "float"     # the LLM's Linear weights: "float" or the checkpoint's quantized format
    kv_cache_dtype: str = ""         # the KV cache's dtype ("bfloat16", "float8_e4m3fn"); "": the model's
    # the tokens the same settings give an FP8 cache (kv_cache_dtype "fp8"), when this one is not FP8 and
    # its size follows its bytes (not num_blocks); None otherwise
    fp8_capacity_tokens: int | None = None
    kv_dtype_fits: tuple = ()  # the same plan under each kv_cache_dtype (`memory.kv_dtypes.KvDtypeFit`)
    # a model of several cache groups (protocol/cache_layout.py): each group's share, the layers per
    # attention group, the longest sequence the blocks hold, the state slots, and prefix reuse per kind
    cache_groups: tuple = ()
    group_size: int = 0
    cache_capacity_tokens: int | None = None
    num_state_slots: int = 0
    state_slot_bytes: int = 0
    prefix_reuse: tuple = ()
    # a model with sliding-window layers: requests of 8k / 32k / 128k tokens (up to max_position_embeddings),
    # their window and global KV, against an all-full-attention allocation (plan/contexts.py)
    context_fits: tuple = ()
    # --workload FILE: the workload's share that fits, requests at once per percentile, what binds, the
    # settings that serve 99% (plan/workload.py); None without one
    workload: Any = None
    # (context length, requests of that length the cache holds at once) from 128 tokens to the longest request
    at_once_by_length: tuple = ()
    # pipeline parallelism (--pp): each stage's figures (plan/stages.py; the fields above are stage 0's), and
    # the layer counts that would balance the stages
    pp: int = 1
    stages: tuple[StagePlan, ...] = ()
    balanced_partition: tuple[int, ...] | None = None
    weights_draft_bytes: int = 0  # speculative_config method "eagle3": the draft head's weights

    @property
    def binding_stage(self) -> int | None:
        """The stage holding the fewest blocks (every stage holds that many): the one that binds capacity."""
        return min(self.stages, key=lambda s: s.num_blocks_possible).stage if self.stages else None

    def consumer_bytes(self, name: str) -> int:
        """A consumer's bytes (0 when it does not apply: e.g. graph pools on the CPU)."""
        return next((c.bytes for c in self.consumers if c.name == name), 0)

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
        out = {k: v for k, v in self.__dict__.items()
               if k not in ("problems", "notes", "consumers", "workload", "stages")}
        out["workload"] = None if self.workload is None else self.workload.to_dict()
        out["stages"] = [s.to_dict() for s in self.stages]
        out["binding_stage"] = self.binding_stage
        out["consumers"] = [c.to_dict() for c in self.consumers]
        out["kv_dtype_fits"] = [dataclasses.asdict(f) for f in self.kv_dtype_fits]
        for name in ("weights_bytes", "capacity_tokens", "kv_cache_bytes", "state_bytes",
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
    for none), num_blocks, dtype, kv_cache_dtype ("auto", "fp8", "int8" or "int4"; quant_policy 8 / 4:
    LMDeploy's spelling of int8 / int4), block_size,
    max_model_len, max_num_seqs, max_num_batched_tokens, the family's image setting (`FAMILY_OPTIONS`:
    max_pixels, max_dynamic_patch), tp, shard_vision, enable_expert_parallel, and a workload per request: prompt_tokens (text
    only), images (each at the largest allowed size), output_tokens. `InvalidRequestError` for a bad
    option, `CheckpointError` for a config the engine could not serve either."""
    o, sizes = _settings(options)
    info = read_config(config_path_or_dir)
    family = registry.resolve([info.architecture], o["model_family"])
    args, tp = _engine_args(o, sizes, family, info), o["tp"] or 1
    device, device_memory, other_use, host_memory = _where(o, sizes)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)

    pp = o["pp"] or 1
    args = dataclasses.replace(args, pipeline_parallel_size=pp, pp_layer_partition=o["pp_layer_partition"])
    parallel = dataclasses.replace(args.parallel_config(), tensor_parallel_size=tp)  # the engine's layout
    check_tensor_parallel_size(family, info.hf_config, parallel, args.shard_vision)  # the engine's refusal
    # the engine's own modules (rank 0's), no memory: counts can never disagree
    model = family.meta_model(info.hf_config, dtype, parallel, args.shard_vision)
    on_gpu = device != "cpu"
    graphs = on_gpu and not args.enforce_eager
    m = memory_inputs(family, info, args, model, dtype, tp, on_gpu=on_gpu, decode_graphs=graphs,
                      piecewise_graphs=graphs and args.piecewise_cuda_graphs)
    if args.speculative_config is not None:  # the engine's refusal, before anything is sized
        check_speculation(args.speculative_config, m.layout.specs, family.display_name)
    parts = breakdown(m)  # every consumer estimated
    per_block = m.layout.block_bytes(args.block_size)  # the engine's: worker.py reports the same
    stages, balanced = (), None
    if pp > 1:  # each stage's figures (plan/stages.py); the table's are stage 0's, as the engine's report
        stages, balanced = plan_stages(family, info, args, parallel, dtype, m, device_memory, other_use)
        per_block = stages[0].kv_bytes_per_block
    weights, peak, encoder = m.weights, parts.activation_bytes, parts.bytes_of("encoder_cache")
    spec = args.speculative_config
    if spec is not None and spec.method == "eagle3":  # the draft's weights, and its K/V page in every block
        draft_weights, draft_page = draft_memory(spec.model, model, dtype.itemsize, args.block_size)
        weights, per_block = dataclasses.replace(weights, draft=draft_weights), per_block + draft_page

    # the engine's own sizing rules, on the memory it would find after loading the weights; the lower-precision
    # caches' blocks beside them (a planned GPU runs them: the engine refuses only a GPU older than compute 8.0)
    budget = None if device_memory is None else parts.budget(device_memory, other_use + weights.total)
    cache = size_cache(args, per_block or 1, m.max_position_embeddings, budget,
                       lower_bytes_per_block(per_block, m.layout.page_spec, args.block_size) if per_block else (),
                       m.layout)
    sizing_budget = budget
    blocks = max(cache.num_blocks, 0)
    if stages:  # every stage holds the smallest count (one block table serves them all)
        blocks = min(blocks, *(st.num_blocks_possible for st in stages))
    memory = (Memory(device_memory, other_use, "device memory") if device_memory is not None else
              Memory(host_memory, 0, "host RAM"))
    if budget is None:  # the CPU: grow-the-cache fixes are bounded by host RAM (sizing rules stay the engine's)
        cache = dataclasses.replace(cache, budget=DeviceBudget(host_memory, weights.total, peak, encoder))
    capacity = dataclasses.replace(cache, num_blocks=blocks).capacity_tokens
    max_model_len, _ = resolve_max_model_len(args.max_model_len, m.max_position_embeddings, capacity)
    longest = min(capacity, m.max_position_embeddings, max_model_len)
    fits_alone = m.image.fitting(longest)

    facts = rules.Facts(args, cache, blocks, per_block, m.max_position_embeddings, longest, m.image)
    problems = rules.cache_problems(facts, memory, weights.total, peak, encoder, device_memory is not None)
    problems += rules.max_model_len_problems(facts)
    notes = rules.max_model_len_notes(facts)
    problems += rules.image_problems(facts)
    concurrent, workload_problems, workload_notes = rules.workload(facts, o["prompt_tokens"], o["output_tokens"],
                                                                   o["images"])
    served = None if o["workload"] is None else _workload(o, info, m, facts, dtype, encoder, cache)

    return MemoryPlan(
        config_path=str(info.config_path), architecture=info.architecture, family=family.name, device=device,
        host_memory_bytes=host_memory,
        dtype=str(dtype).removeprefix("torch."), tp=tp, weights_language_model_bytes=weights.language_model,
        weights_vision_bytes=weights.vision, weights_projector_bytes=weights.projector,
        consumers=parts.consumers, activation_peak_bytes=peak, num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, block_size=args.block_size,
        kv_bytes_per_token=cache.bytes_per_token, kv_bytes_per_block=per_block, num_blocks=blocks,
        cache_source=cache.source, device_memory_bytes=device_memory,
        device_in_use_bytes=other_use if device_memory is not None and o["device_memory"] is None else None,
        memory_utilization=args.memory_utilization, encoder_cache_bytes=encoder,
        max_position_embeddings=m.max_position_embeddings, max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs, image_tokens_per_image=m.image.tokens, largest_image=m.image.text,
        held_vision_tokens=m.held_vision_tokens, held_vision=m.held_vision_text,
        largest_fitting_image_tokens=fits_alone.tokens if fits_alone else 0,
        largest_fitting_image=fits_alone.text if fits_alone else "none: not even the smallest image fits",
        prompt_tokens=o["prompt_tokens"], output_tokens=o["output_tokens"], images=o["images"],
        max_concurrent_requests=concurrent, problems=tuple(problems + workload_problems),
        notes=tuple(notes + workload_notes), weight_format=m.weight_format,
        kv_cache_dtype=str(m.kv_dtype).removeprefix("torch."),
        fp8_capacity_tokens=None if cache.fp8_blocks is None else
        dataclasses.replace(cache, num_blocks=max(cache.fp8_blocks, 0)).capacity_tokens,
        # none for a pipeline stage 0 of state layers only (no KV page in its blocks), as the engine's report
        kv_dtype_fits=() if not per_block else kv_dtype_fits(
            args, cache, sizing_budget, m.layout.page_spec, str(dtype).removeprefix("torch."),
            m.max_position_embeddings, max_model_len),
        context_fits=context_fits(m.layout, blocks, args.block_size, args.max_num_batched_tokens,
                                  tuple(n for n in CONTEXT_LENGTHS if n <= m.max_position_embeddings)),
        workload=served, at_once_by_length=tuple(at_once_curve(
            min(args.max_num_seqs, cache.num_state_slots or args.max_num_seqs), blocks,
            lambda n: cache.blocks_for(n), longest)),
        **{**cache_shares(m, cache, max_model_len), "cache_capacity_tokens": capacity},
        pp=pp, stages=stages, balanced_partition=balanced, weights_draft_bytes=weights.draft)


def _workload(o: dict, info, m, facts, dtype, encoder: int, cache):
    """--workload FILE against the sized cache (plan/workload.py); images counted by the family's size rule."""
    from vlm_sdk.plan.workload import plan_workload
    from vlm_sdk.plan.workload_file import read_workload
    from vlm_sdk.sampling_params import DEFAULT_MAX_TOKENS
    tokens_for = m.image.tokens_for or (lambda w, h: m.image.tokens)  # no size rule: the largest allowed
    requests = read_workload(o["workload"], tokens_for, o["output_tokens"] if o["output_tokens"] is not None else
                             DEFAULT_MAX_TOKENS, info.config_path.parent, m.image.video_for)
    per_token = m.hidden_size * torch.finfo(dtype).bits // 8  # one image token's embedding
    return plan_workload(requests, facts, per_token, encoder, cache.fp8_blocks)


def _settings(options: dict) -> tuple[dict, dict]:
    """(every plan option, None where not given; the size options in bytes), each checked."""
    unknown = sorted(set(options) - set(PLAN_OPTIONS))
    if unknown:
        hints = "".join(f"; {k}: use {_image_field_hints()[k]}" for k in unknown if k in _image_field_hints())
        raise UnknownArgumentError(f"unknown plan option(s) {unknown}{hints}; accepted: {sorted(PLAN_OPTIONS)}")
    o = dict.fromkeys(PLAN_OPTIONS) | {k: v for k, v in options.items() if v is not None}
    sizes = {k: parse_size(o[k], k) for k in ("device_memory", "kv_cache_memory", "host_memory") if o[k] is not None}
    for name, (fam, setting) in registry.plan_settings().items():
        if o[name] is not None:  # checked by the declaring family's schema, under the plan option's name
            schema = next(s for s in fam.engine_settings if s.name == setting)
            dataclasses.replace(schema, name=name).check(o[name])
    if o["workload"] is not None and not isinstance(o["workload"], (str, os.PathLike)):
        raise InvalidRequestError(f"workload must be a file path, got {o['workload']!r}", param="workload")
    for name in ("tp", "pp", "prompt_tokens", "output_tokens", "images"):
        v = o[name]
        positive = name in ("tp", "pp")
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (1 if positive else 0)):
            raise InvalidRequestError(f"{name} must be a {'positive' if positive else 'non-negative'} "
                                      f"integer, got {v!r}")
    return o, sizes


def _engine_args(o: dict, sizes: dict, family, info) -> EngineArgs:
    """The engine settings of the plan, the family's image setting in mm_processor_kwargs (another
    family's plan option is refused, naming this family's)."""
    option, setting = family.plan_setting
    for other in registry.plan_settings():
        if other != option and o[other] is not None:
            raise InvalidRequestError(f"--{_flag(other)} is not a setting of {family.display_name} (this config is "
                                      f"{info.architecture}): use --{_flag(option)}", param=other)
    engine = {k: sizes.get(k, o[k]) for k in _ENGINE_OPTIONS if o[k] is not None}
    return EngineArgs.from_kwargs(**engine, mm_processor_kwargs={} if o[option] is None else {setting: o[option]})


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


_flag, _value = rules.flag, rules.value  # the report spells fixes the same way
