"""Engine settings. `EngineArgs` is what a user passes; the engine resolves it once, at start-up, into
frozen configs whose every number is final (no "auto" left)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Collection, Mapping

from vlm_sdk.errors import InvalidRequestError, UnknownArgumentError
from vlm_sdk.spec_config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    import torch

# Importing this module imports no torch: the CLI builds its flags from EngineArgs, and `--help` must not
# wait for torch (seconds). The torch objects are made when first used: `DTYPES` and `KV_FP8` below are
# module attributes made on access (`__getattr__`), `torch_dtype()` inside this module.
DTYPE_NAMES = MappingProxyType({"float32": "float32", "fp32": "float32", "float": "float32",
                                "bfloat16": "bfloat16", "bf16": "bfloat16",
                                "float16": "float16", "fp16": "float16", "half": "float16"})


# kv_cache_dtype: "auto" is the model's dtype; "fp8" float8 e4m3 with per-layer K and V scales
# (kernels/kv_quant.py): half of bf16's bytes per block, twice the tokens; "int8" / "int4" (LMDeploy's
# quant_policy 8 / 4) per-token, per-head asymmetric codes with a float32 scale and zero each
# (kernels/kv_int.py): 1.9x and 3.6x bf16's tokens at head_dim 128
KV_CACHE_DTYPES = ("auto", "fp8", "int8", "int4")
INT_KV_BITS = MappingProxyType({"int8": 8, "int4": 4})
# LMDeploy's quant_policy -> the kv_cache_dtype it names (0: no KV quantization)
QUANT_POLICIES = MappingProxyType({0: "auto", 8: "int8", 4: "int4"})
DISTRIBUTED_EXECUTOR_BACKENDS = (None, "mp", "ray")
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def torch_dtype(name: str) -> torch.dtype:
    """A `DTYPE_NAMES` name (or a torch dtype's own name, e.g. "float8_e4m3fn") as a torch dtype."""
    import torch
    return getattr(torch, DTYPE_NAMES.get(name, name))


def __getattr__(name: str):
    if name == "DTYPES":  # name -> torch dtype
        return MappingProxyType({k: torch_dtype(v) for k, v in DTYPE_NAMES.items()})
    if name == "KV_FP8":
        return torch_dtype("float8_e4m3fn")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_UNITS = MappingProxyType({"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                           "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def parse_bytes(value: int | str, name: str = "device_memory", *, unit_required: bool = False) -> int:
    """80GiB, 6784MiB, 1.5GB, 4096B or an int of bytes -> bytes. With `unit_required`, a string
    without a unit ("24") is refused with an example: 24GiB for a small number, 180709785B for a large
    one (an int is always bytes). `InvalidRequestError` (param=name) for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidRequestError(f"{name}={value!r} is not a size: use e.g. {name}='8GiB' (or an int of bytes)",
                                  param=name)
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidRequestError(f"{name}={value!r} is not a size: use e.g. 80GiB, 6784MiB, 40GB or 4096B",
                                  param=name)
    number, unit = m.groups()
    if unit_required and not unit:
        meant = f"{number}GiB" if float(number) < 4096 else f"{number}B"
        raise InvalidRequestError(
            f"{name}={value!r} has no unit: write e.g. --{name.replace('_', '-')} {meant} ({name}='{meant}'; "
            f"units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB; an int in Python is bytes)", param=name)
    return int(float(number) * _UNITS[unit.lower()])


DEFAULT_MEMORY_UTILIZATION = 0.9
# vision embeddings kept for reuse after their request has passed the image (the encoder cache):
# about 28 of Qwen2.5-VL-7B's largest images (1280 tokens x 3584 x 2 bytes), or 256 448x448 images
# of a 3B model; 0 turns the cache off
DEFAULT_ENCODER_CACHE_MEMORY = 256 << 20
# per request: a few hundred logit_bias entries bans or favours a word list; more only cost every step
DEFAULT_MAX_LOGIT_BIAS = 300
DEFAULT_MAX_STOP_TOKEN_IDS = 300
# structured outputs: a JSON Schema of 1 MiB is far beyond a hand-written one (a 100,000-value enum fits)
DEFAULT_MAX_GRAMMAR_BYTES = 1 << 20
DEFAULT_GRAMMAR_COMPILE_TIMEOUT = 10.0
# measured in the grammar process after the compile and the first mask (a 20,000-string choice list
# holds ~56 MiB; ordinary schemas well under 1 MiB)
DEFAULT_MAX_GRAMMAR_MEMORY = 64 << 20
# an ordinary JSON Schema holds 0.1-1 MiB compiled: 64 MiB keeps 60-600 of them, and a stream of distinct
# large grammars grows the server by no more than this
DEFAULT_GRAMMAR_CACHE_MEMORY = 64 << 20
DEFAULT_MAX_TOOLS = 128  # OpenAI's limit per request ("array_above_max_length")
# a request's tools as JSON (names, descriptions, parameter schemas), all rendered into the prompt; as
# much as one structured-output spec may hold, since their schemas are checked as one grammar
DEFAULT_MAX_TOOL_BYTES = DEFAULT_MAX_GRAMMAR_BYTES


@dataclass(frozen=True)
class EngineArgs:
    """Everything a user may set on `LLM(...)` / `AsyncLLM(...)`. None means "choose for me".

    KV capacity comes from the first of `num_blocks`, `kv_cache_memory` (bytes as an int, or a size
    string with a unit: "8GiB", "512MiB"), or, on CUDA, `memory_utilization` (default 0.9) of the
    device's TOTAL memory minus what is in use (weights, other processes) and the profiled activation
    peak; on the CPU the default is enough for max_num_seqs sequences of max_model_len tokens, at most
    1 GiB, and memory_utilization is refused (there is no device memory to take a share of).

    After construction `kv_cache_memory` is always an int (bytes) and `memory_utilization` a float
    (the default resolved); `memory_utilization_given` says whether the user set it.
    """
    dtype: str | None = None  # float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # "cuda" when available, else "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None  # bytes, or "8GiB"; an int after construction
    memory_utilization: float | None = None  # CUDA only; None: DEFAULT_MEMORY_UTILIZATION
    max_model_len: int | None = None
    max_num_seqs: int = 64
    # a model with state layers (a fixed-size state per request, vlm_sdk/protocol/cache_spec.py StateSpec): the
    # state slots carved out before the KV blocks: a running request's live slot, the rest checkpoints of
    # prefix caching; None: max_num_seqs, twice that with enable_prefix_caching (memory/kv.py)
    num_state_slots: int | None = None
    max_num_batched_tokens: int = 8192
    # image tokens (vision embeddings) one step may send through the vision tower: the rest of a step's
    # images, a video's next frame groups, wait for the next steps, so the decode rows beside them keep a
    # bounded step (engine/core/vision_budget.py); a larger image runs alone in a step; 0 or None: no bound
    # (`vlm-sdk serve` on the CPU: 256, server/config.py SERVING_STEP_SHARES)
    max_num_encoder_tokens_per_step: int | None = None
    # a prefill chunk in a step that also has decode rows computes at most this many tokens, so a long prompt's
    # or an image's tokens go through the decoder over several steps beside them (a step without decode rows
    # is not bounded); not for a family whose image tokens attend to each other (FamilySpec.whole_images: an
    # image is prefilled in one chunk); 0 or None: no bound (`vlm-sdk serve` on the CPU: 128)
    max_prefill_tokens_with_decodes: int | None = None
    # the model family's engine settings (its `FamilySpec.engine_settings`, e.g. an image size bound),
    # checked by the family when the engine starts; an image part's own options win over them
    mm_processor_kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    max_image_pixels: int = 64_000_000  # refuse decoding anything larger (decompression bombs)
    # the pixels of all of one request's images together, checked from their headers before any is
    # decoded; None: no limit beyond max_image_pixels per image (`vlm-sdk serve` sets one)
    max_request_image_pixels: int | None = None
    # one video's limits (vlm_sdk/multimodal/video_io.py), checked from its container before any frame is
    # decoded: its encoded size (bytes, or "512MiB"), its duration, the frames sampled from it, the pixels
    # decoded to reach them (every frame from the keyframe before each sampled one, at the source size, at
    # least 256x256 a frame), and the frames in its container, each of which is indexed (an hour at 60
    # fps); each frame is also an image: max_image_pixels
    max_video_bytes: int | str = 1 << 30
    max_video_seconds: float = 3600.0
    max_video_frames: int = 768
    max_video_decode_pixels: int = 8_000_000_000
    max_video_container_frames: int = 216_000
    # images decoded, resized and patchified in this many worker processes (multimodal/pixel_workers.py:
    # the bytes go once through shared memory, the patches come back the same way), so preprocessing grows
    # with cores and holds no GIL of the engine's process; 0: on the prompt-building threads (`vlm-sdk serve`
    # sets a default: server/config.py SERVER_PREPROCESS_WORKERS)
    preprocess_workers: int = 0
    # special tokens (<|im_end|>, <|im_start|>, ...) written in message text are read as control
    # tokens, as the template's own are; off (the default), they are plain text, so a user cannot end
    # their turn and forge another role's
    allow_special_tokens_in_text: bool = False
    seed: int = 0
    show_progress: bool = True
    attention_backend: str | None = None  # "triton" (default on CUDA) or "torch" (default on the CPU)
    # the KV cache's dtype: "auto" (the model's) or "fp8" (float8 e4m3, K and V divided by per-layer
    # scales: the checkpoint's k_scale / v_scale tensors, else 1.0): twice the tokens in the same memory;
    # "int8" / "int4": per-token, per-head asymmetric codes with their scales and zeros (kernels/kv_int.py)
    kv_cache_dtype: str = "auto"
    # LMDeploy's spelling of the same: 8 is kv_cache_dtype "int8", 4 "int4", 0 "auto"; None: not given.
    # Given with a different kv_cache_dtype, refused
    quant_policy: int | None = None
    # the decoder's qkv and o projections at <= 8 rows (decode at small batch): "torch" (F.linear: cuBLAS on
    # CUDA) or "triton" (kernels/skinny_gemm.py; the Triton kernel set only). `vlm-sdk bench --gpu` times
    # both at the model's shapes; the default stays "torch" until a GPU run says otherwise
    small_m_gemm: str = "torch"
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of from captured CUDA graphs
    # CUDA, off until run on a GPU: steps with prefill rows replay piecewise CUDA graphs around eager
    # attention (worker/piecewise_graphs.py); the memory profile counts their buffers and pool when on
    piecewise_cuda_graphs: bool = False
    # schedule and launch step t+1 while step t runs, its sampled ids kept on the device for t+1's inputs
    # (vlm_sdk/engine/llm_engine.py); None: on CUDA with one rank. A request that finishes computes one
    # token more, which is dropped; steps sampling a grammar- or penalty-bound request run synchronously
    async_scheduling: bool | None = None
    preemption_warning_per_minute: int = 10  # log a warning when preemptions in 60 s exceed this
    # tensor parallelism: the model split over this many ranks (GPUs), one worker process per rank
    tensor_parallel_size: int = 1
    # pipeline parallelism: the decoder layers split over this many stages (each stage tensor_parallel_size
    # ranks); pp_layer_partition: each stage's layer count, "4,6" (vLLM's VLLM_PP_LAYER_PARTITION; None: even)
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | None = None
    # pipeline parallelism: micro-batches in flight at once (vLLM's batch queue): the engine schedules the
    # next from the requests not in flight while earlier ones are still in the stages. None: one per stage;
    # 1: one step at a time (the stages take turns)
    pipeline_micro_batches: int | None = None
    shard_vision: bool = True  # under tensor parallelism: split the vision tower too (False: a copy per rank)
    # under tensor parallelism: MoE layers place num_experts / tensor_parallel_size whole experts on each
    # rank instead of a slice of every expert (vLLM's enable_expert_parallel); no effect on dense models
    enable_expert_parallel: bool = False
    distributed_timeout: float = 600.0  # seconds a rank waits for its peers in a collective before failing
    # where ranks 1..N-1 run: "mp" (processes spawned on this machine) or "ray" (Ray actors placed by a
    # placement group, across the nodes of a Ray cluster: vlm_sdk/executor/ray_executor.py); None: torchrun's
    # processes when started by torchrun, else "mp"
    distributed_executor_backend: str | None = None
    # the Ray placement group's strategy, one bundle per rank: PACK (as few nodes as fit), SPREAD,
    # STRICT_PACK (one node) or STRICT_SPREAD (one rank per node)
    ray_placement_strategy: str = "PACK"
    # start even when the largest image the image settings allow cannot fit in max_model_len (a warning
    # instead of the refusal; such images are then refused per request)
    allow_unfit_images: bool = False
    # prefix caching: full KV blocks are kept, keyed by their tokens, their images' content and
    # settings, and everything before them; a prompt that starts the same way reuses them
    enable_prefix_caching: bool = True
    encoder_cache_memory: int | str = DEFAULT_ENCODER_CACHE_MEMORY  # bytes, or "256MiB"; 0: no encoder cache
    # the branch, tag or commit of a model given as a Hub id ("Org/Name"; vlm_sdk/hub.py); None: main
    revision: str | None = None
    # the module path of a family (`FAMILY`, a FamilySpec) outside vlm_sdk's registry to serve the checkpoint
    # with, instead of the family its config.json architecture names (models/registry.py `resolve`)
    model_family: str | None = None
    # what one request may ask of every step (README "What one request may cost"): each logit_bias entry
    # is written into its logits, and min_tokens bans each stop_token_id, at every step
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    # structured outputs (vlm_sdk/engine/structured_output.py): a grammar is first compiled, with its first
    # mask, in a grammar process of its own (a crash, a timeout or too much memory there is the request's
    # 400, never the server's end); `grammar_workers` such compiles run at once, beside prompt building
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES  # one spec's text (a schema, regex, choice list, grammar)
    # CPU seconds of the grammar process (it runs at a low priority: a busy machine stretches the wall time, up
    # to 10x, without counting against the grammar)
    grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT
    max_grammar_memory: int | str = DEFAULT_MAX_GRAMMAR_MEMORY  # one compiled grammar with its first mask
    grammar_cache_memory: int | str = DEFAULT_GRAMMAR_CACHE_MEMORY  # compiled grammars kept, by measured bytes
    grammar_workers: int = 2
    # a request's tools (vlm_sdk/chat_options.py), checked before any is rendered or compiled: how many
    # (OpenAI's 128) and their JSON's bytes together (names, descriptions, schemas: all go into the prompt)
    max_tools: int = DEFAULT_MAX_TOOLS
    max_tool_bytes: int = DEFAULT_MAX_TOOL_BYTES
    # how a chat's output is read (vlm_sdk/parsers): the tool-call format ("hermes") and the reasoning
    # block ("qwen3", "deepseek_r1"); None: from the chat template (<tool_call> -> hermes, <think> ->
    # qwen3); "none": off
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # speculative decoding (vlm_sdk/spec_config.py): vLLM's dict ({"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_min": 2, "prompt_lookup_max": 5}) or its JSON text; a SpeculativeConfig after construction
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None

    def __post_init__(self):
        """Resolve the two settings that have a user-facing spelling and a working value."""
        if isinstance(self.kv_cache_memory, str):
            object.__setattr__(self, "kv_cache_memory",
                               parse_bytes(self.kv_cache_memory, "kv_cache_memory", unit_required=True))
        if isinstance(self.encoder_cache_memory, str):  # "0" (off) needs no unit
            e = self.encoder_cache_memory
            object.__setattr__(self, "encoder_cache_memory", 0 if e.strip() == "0" else
                               parse_bytes(e, "encoder_cache_memory", unit_required=True))
        for name in ("max_grammar_memory", "grammar_cache_memory"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, parse_bytes(getattr(self, name), name, unit_required=True))
        if isinstance(self.max_video_bytes, str):
            object.__setattr__(self, "max_video_bytes",
                               parse_bytes(self.max_video_bytes, "max_video_bytes", unit_required=True))
        if self.quant_policy is not None:
            object.__setattr__(self, "kv_cache_dtype", _kv_dtype_of_policy(self.quant_policy, self.kv_cache_dtype))
        object.__setattr__(self, "speculative_config", parse_speculative_config(self.speculative_config))
        given = self.memory_utilization is not None
        object.__setattr__(self, "memory_utilization_given", given)
        if not given:
            object.__setattr__(self, "memory_utilization", DEFAULT_MEMORY_UTILIZATION)

    @classmethod
    def from_kwargs(cls, family_settings: Collection[str] = (), **kwargs) -> "EngineArgs":
        """`family_settings`: the names model families declare (`vlm_sdk.models.registry.engine_args`
        passes them); such keywords go into `mm_processor_kwargs`."""
        known = {f.name for f in fields(cls)}
        routed = {k: kwargs.pop(k) for k in list(kwargs) if k in family_settings and k not in known}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UnknownArgumentError(f"unknown engine argument(s) {unknown}; accepted: "
                                       f"{sorted(known | set(family_settings))}")
        given = kwargs.pop("mm_processor_kwargs", None) or {}
        if not isinstance(given, Mapping):
            raise InvalidRequestError(f"mm_processor_kwargs must be a mapping of setting -> value, got "
                                      f"{type(given).__name__}", param="mm_processor_kwargs")
        routed = {k: v for k, v in routed.items() if v is not None}
        clash = sorted(k for k in routed if k in given and given[k] != routed[k])
        if clash:
            raise InvalidRequestError(
                f"{clash[0]} is set twice with different values: {clash[0]}={routed[clash[0]]!r} and "
                f"mm_processor_kwargs[{clash[0]!r}]={given[clash[0]]!r}; set it once", param=clash[0])
        options = {**dict(given), **routed}
        args = cls(mm_processor_kwargs=MappingProxyType(options), **kwargs)
        args.validate()
        return args

    def validate(self) -> None:
        def positive(name):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        for name in ("block_size", "num_blocks", "kv_cache_memory", "max_model_len", "max_num_seqs", "num_state_slots",
                     "max_num_batched_tokens", "max_image_pixels", "max_request_image_pixels",
                     "max_video_bytes", "max_video_frames", "max_video_decode_pixels", "max_video_container_frames",
                     "preemption_warning_per_minute", "tensor_parallel_size", "pipeline_parallel_size",
                     "pipeline_micro_batches", "max_grammar_bytes",
                     "max_grammar_memory", "grammar_cache_memory", "grammar_workers", "max_tools", "max_tool_bytes"):
            positive(name)
        w = self.preprocess_workers
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise InvalidRequestError(f"preprocess_workers must be an integer of 0 (images preprocessed in the "
                                      f"engine's process) or more, got {w!r}", param="preprocess_workers")
        for name in ("max_num_encoder_tokens_per_step", "max_prefill_tokens_with_decodes"):
            t = getattr(self, name)
            if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
                raise InvalidRequestError(f"{name} must be an integer of 0 (no bound) or more, got {t!r}", param=name)
        e = self.encoder_cache_memory
        if not isinstance(e, int) or isinstance(e, bool) or e < 0:
            raise InvalidRequestError(f"encoder_cache_memory must be a size of 0 or more (e.g. '256MiB'; 0 turns the "
                                      f"encoder cache off), got {e!r}", param="encoder_cache_memory")
        if not isinstance(self.memory_utilization, (int, float)) or isinstance(self.memory_utilization, bool) \
                or not 0.0 < self.memory_utilization <= 1.0:
            raise InvalidRequestError(f"memory_utilization must be a number in (0, 1], got {self.memory_utilization!r}")
        if not isinstance(self.mm_processor_kwargs, Mapping):
            raise InvalidRequestError(f"mm_processor_kwargs must be a mapping, got {self.mm_processor_kwargs!r}")
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise InvalidRequestError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_NAMES)}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        if self.attention_backend is not None and self.attention_backend not in ("torch", "triton"):
            raise InvalidRequestError(f"attention_backend must be 'torch' or 'triton', got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} ('auto': the model's "
                                      f"dtype; 'fp8': float8 e4m3 with per-layer scales; 'int8' / 'int4': per-token "
                                      f"per-head codes with scales and zeros, LMDeploy's quant_policy 8 / 4), got "
                                      f"{self.kv_cache_dtype!r}", param="kv_cache_dtype")
        for name in ("max_logit_bias", "max_stop_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidRequestError(f"{name} must be an integer >= 0 (0 refuses the field), got {value!r}",
                                          param=name)
        t = self.grammar_compile_timeout
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
            raise InvalidRequestError(f"grammar_compile_timeout must be a positive number of seconds, got {t!r}",
                                      param="grammar_compile_timeout")
        v = self.max_video_seconds
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
            raise InvalidRequestError(f"max_video_seconds must be a positive number of seconds, got {v!r}",
                                      param="max_video_seconds")
        if self.small_m_gemm not in ("torch", "triton"):
            raise InvalidRequestError(f"small_m_gemm must be 'torch' or 'triton', got {self.small_m_gemm!r}",
                                      param="small_m_gemm")
        t = self.distributed_timeout
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
            raise InvalidRequestError(f"distributed_timeout must be a positive number of seconds, got {t!r}",
                                      param="distributed_timeout")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise InvalidRequestError(f"distributed_executor_backend must be one of "
                                      f"{list(DISTRIBUTED_EXECUTOR_BACKENDS)} ('mp': rank processes on this machine; "
                                      f"'ray': Ray actors across a Ray cluster's nodes), got "
                                      f"{self.distributed_executor_backend!r}", param="distributed_executor_backend")
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise InvalidRequestError(f"ray_placement_strategy must be one of {list(RAY_PLACEMENT_STRATEGIES)}, got "
                                      f"{self.ray_placement_strategy!r}", param="ray_placement_strategy")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise InvalidRequestError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}",
                                      param="async_scheduling")
        for name in ("show_progress", "enforce_eager", "piecewise_cuda_graphs", "shard_vision", "enable_expert_parallel", "allow_unfit_images", "enable_prefix_caching",
                     "allow_special_tokens_in_text"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def __reduce__(self):
        """Pickled as plain fields (a mappingproxy does not pickle): tensor-parallel rank processes
        receive the args they run with."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["mm_processor_kwargs"] = dict(self.mm_processor_kwargs)
        if self.speculative_config is not None:
            state["speculative_config"] = self.speculative_config.as_dict()
        if not self.memory_utilization_given:
            state["memory_utilization"] = None
        return _engine_args_from_state, (state,)

    def check_cpu_settings(self) -> None:
        """memory_utilization is a share of a CUDA device's memory: on the CPU it would size nothing."""
        if self.memory_utilization_given:
            raise InvalidRequestError(
                f"memory_utilization={self.memory_utilization} applies to CUDA devices only (a share of the GPU's "
                f"total memory); this engine runs on the CPU, where the KV cache is num_blocks, kv_cache_memory or "
                f"the CPU default (max_num_seqs sequences of max_model_len tokens, at most 1 GiB). Leave "
                f"memory_utilization out, or size the cache with e.g. kv_cache_memory='2GiB' "
                f"(--kv-cache-memory 2GiB)", param="memory_utilization")

    def parallel_config(self) -> ParallelConfig:
        """The ranks' layout these settings ask for (the engine's and `vlm-sdk plan`'s)."""
        from vlm_sdk.pp_partition import parse_partition
        partition = parse_partition(self.pp_layer_partition)
        if partition is not None and self.pipeline_parallel_size == 1:
            raise InvalidRequestError(f"pp_layer_partition={self.pp_layer_partition!r} splits layers over pipeline "
                                      f"stages, but pipeline_parallel_size is 1: set pipeline_parallel_size "
                                      f"(--pipeline-parallel-size / -pp) to {len(partition)}",
                                      param="pp_layer_partition")
        self.micro_batches()  # refused here, before any rank starts
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, self.enable_expert_parallel,
                              partition)

    def micro_batches(self) -> int:
        """Micro-batches in flight at once: `pipeline_micro_batches`, by default one per pipeline stage."""
        n, pp = self.pipeline_micro_batches, self.pipeline_parallel_size
        if n is not None and n > pp:
            raise InvalidRequestError(
                f"pipeline_micro_batches={n} exceeds pipeline_parallel_size={pp}: each stage runs one micro-batch at a "
                f"time, so at most {pp} are in flight" + (" (there is no pipeline with one stage)" if pp == 1 else "")
                + f": set pipeline_micro_batches to {pp} or less (--pipeline-micro-batches), or leave it unset",
                param="pipeline_micro_batches")
        return pp if n is None else n

    def resolve_async_scheduling(self, device: torch.device, tensor_parallel_size: int) -> bool:
        """Whether steps are scheduled asynchronously: `async_scheduling`, or by default on CUDA with one
        rank (on the CPU a step's work is done when it returns: there is nothing to overlap)."""
        if self.speculative_config is not None:
            if self.async_scheduling:
                raise InvalidRequestError(
                    "async_scheduling=True does not compose with speculative_config yet: a verification step's accepted "
                    "tokens decide the next step's inputs, so it is read before the next is scheduled. Leave "
                    "async_scheduling unset (or False) with speculative decoding", param="async_scheduling")
            return False
        if self.async_scheduling is None:
            return device.type == "cuda" and tensor_parallel_size == 1
        if self.async_scheduling and tensor_parallel_size > 1:
            if self.pipeline_parallel_size > 1:  # the sampled ids are the last stage's, the inputs the first's
                raise InvalidRequestError(
                    f"async_scheduling=True needs one rank, and pipeline_parallel_size={self.pipeline_parallel_size}: "
                    f"the next step's ids would stay on the last stage's device while the first stage embeds them. "
                    f"The pipeline overlaps its steps by itself: pipeline_micro_batches (default one per stage) "
                    f"micro-batches are in flight while the next is scheduled. Leave async_scheduling unset (or "
                    f"False) with pipeline parallelism", param="async_scheduling")
            raise InvalidRequestError(
                f"async_scheduling=True needs tensor_parallel_size=1 (got {tensor_parallel_size}): the next step's "
                f"ids stay on rank 0's device. Leave async_scheduling unset (or False) with tensor parallelism",
                param="async_scheduling")
        return self.async_scheduling

    def resolve_device(self) -> torch.device:
        import torch
        if self.device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            if device.type == "cpu":
                self.check_cpu_settings()
            return device
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise InvalidRequestError(f"device={self.device!r} is not a device: use 'cpu', 'cuda' or 'cuda:N'") from e
        if device.type not in ("cpu", "cuda"):
            raise InvalidRequestError(f"device={self.device!r}: only 'cpu' and 'cuda' are supported")
        if device.type == "cpu":
            self.check_cpu_settings()
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise InvalidRequestError(f"device={self.device!r} was asked for but no CUDA device is available; "
                                          "use device='cpu'")
            count = torch.cuda.device_count()
            if device.index is not None and device.index >= count:
                raise InvalidRequestError(f"device={self.device!r} but only {count} CUDA device(s) exist "
                                          f"(cuda:0..cuda:{count - 1})")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is None:
            return torch_dtype("bfloat16" if device.type == "cuda" else "float32")
        return torch_dtype(self.dtype)

    def resolve_kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The cache's dtype for a model of `dtype` (`vlm-sdk plan` and the engine both ask here): the
        model's, float8 e4m3, or for int8 / int4 torch.int8 / torch.int4 as markers of the format (the
        pages are uint8 codes beside float32 scales: `AttentionSpec` of dtype "int8" / "int4")."""
        return kv_cache_torch_dtype(self.kv_cache_dtype, dtype)


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """`EngineArgs.resolve_kv_cache_dtype` for a given kv_cache_dtype value (the plan's side by side)."""
    if kv_cache_dtype == "fp8":
        return torch_dtype("float8_e4m3fn")
    if kv_cache_dtype in INT_KV_BITS:
        return torch_dtype(kv_cache_dtype)
    return dtype


def kv_cache_dtype_name(kv_dtype: torch.dtype) -> str:
    """The kv_cache_dtype value that gives a cache of `kv_dtype` ("auto" for a float one)."""
    name = str(kv_dtype).removeprefix("torch.")
    return "fp8" if name == "float8_e4m3fn" else name if name in INT_KV_BITS else "auto"


def _kv_dtype_of_policy(policy, kv_cache_dtype: str) -> str:
    """The kv_cache_dtype LMDeploy's quant_policy names; `InvalidRequestError` for another policy, or when
    kv_cache_dtype says something else ("auto", the default, gives way)."""
    if isinstance(policy, bool) or policy not in QUANT_POLICIES:
        raise InvalidRequestError(f"quant_policy must be one of {sorted(QUANT_POLICIES)} (LMDeploy's: 8 int8 KV cache, "
                                  f"4 int4, 0 none), got {policy!r}", param="quant_policy")
    named = QUANT_POLICIES[policy]
    if kv_cache_dtype not in ("auto", named):
        raise InvalidRequestError(f"quant_policy={policy} asks for kv_cache_dtype={named!r} but kv_cache_dtype="
                                  f"{kv_cache_dtype!r} is set too: set one of them (--quant-policy {policy} is "
                                  f"--kv-cache-dtype {named})", param="quant_policy")
    return named


def _engine_args_from_state(state: dict) -> EngineArgs:
    return EngineArgs(**{**state, "mm_processor_kwargs": MappingProxyType(state["mm_processor_kwargs"])})


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int  # longest sequence (prompt + output) the engine runs
    max_model_len_source: str
    # image tokens one step may send through the vision tower (engine/core/vision_budget.py); None: no bound
    max_num_encoder_tokens_per_step: int | None = None
    max_prefill_tokens_with_decodes: int = 0  # the most tokens of a prefill chunk beside decode rows (0: no bound)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over ranks, every dimension in one value: `EngineArgs.parallel_config()`,
    carried to every rank in `RankConfig.parallel`; each rank's own groups are a `ParallelGroups`
    (vlm_sdk/layers/parallel_state.py). Ranks = tensor x pipeline, stage-major: global rank
    stage * tensor_parallel_size + tp_rank. `pp_layer_partition`: each stage's decoder layers (None: the
    even split; checked against the model's layers in vlm_sdk/layers/pp_partition.py)."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE layers: whole experts over the tensor-parallel ranks
    pp_layer_partition: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} and pipeline_parallel_size "
                             f"{self.pipeline_parallel_size} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class RankConfig:
    """`EngineArgs` resolved once, on the engine side (`EngineArgs.resolve`): what every rank receives, so
    no rank works out a default of its own. `args` keeps the user's settings for the rest."""
    args: EngineArgs
    device_type: str  # "cuda" or "cpu"
    dtype: str  # e.g. "bfloat16"
    attention_backend: str  # "triton" or "torch"
    async_scheduling: bool
    decode_graphs: bool  # decode steps replay whole-step CUDA graphs
    piecewise_graphs: bool  # steps with prefill rows may replay piecewise CUDA graphs (one rank; the model's
    # decoder stack decides the rest: vlm_sdk/worker/piecewise_graphs.py)
    kv_cache_dtype: str = ""  # the cache's dtype, e.g. "bfloat16" or "float8_e4m3fn"; "": the model's
    parallel: ParallelConfig = ParallelConfig()  # the ranks' layout (tensor, pipeline, expert)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return torch_dtype(self.kv_cache_dtype or self.dtype)


def resolve_rank_config(args: EngineArgs) -> RankConfig:
    """Every default of `args` that depends on the device or the rank count, decided here and nowhere else."""
    device = args.resolve_device()
    size = args.tensor_parallel_size * args.pipeline_parallel_size
    if args.speculative_config is not None and size > 1:
        pp = args.pipeline_parallel_size
        raise InvalidRequestError(
            f"speculative_config with tensor_parallel_size={args.tensor_parallel_size}"
            f"{f' x pipeline_parallel_size={pp}' if pp > 1 else ''} is not built yet (the verification step runs on "
            f"one rank today): set tensor_parallel_size=1{' and pipeline_parallel_size=1' if pp > 1 else ''}, or "
            f"leave speculative_config out", param="speculative_config")
    backend = args.attention_backend or ("triton" if device.type == "cuda" else "torch")
    if args.small_m_gemm == "triton" and backend != "triton":
        raise InvalidRequestError(f"small_m_gemm='triton' needs the Triton kernel set, and attention_backend is "
                                  f"'{backend}'{'' if args.attention_backend else ' (the default on ' + device.type + ')'}"
                                  f": set attention_backend='triton', or small_m_gemm='torch'", param="small_m_gemm")
    # under pipeline parallelism every step runs eagerly (the graphs capture a whole model's forward)
    # EAGLE-3 drafts read every step's hidden states, which the captured graphs do not hand out: eager steps
    eagle = args.speculative_config is not None and args.speculative_config.method == "eagle3"
    if eagle and args.piecewise_cuda_graphs:
        raise InvalidRequestError("piecewise_cuda_graphs=True does not compose with speculative_config method='eagle3' "
                                  "yet (the draft reads the target's hidden states between layers, outside the "
                                  "graphs): leave piecewise_cuda_graphs unset", param="piecewise_cuda_graphs")
    decode_graphs = device.type == "cuda" and backend == "triton" and not args.enforce_eager \
        and args.pipeline_parallel_size == 1 and not eagle
    dtype = args.resolve_dtype(device)
    kv_dtype = args.resolve_kv_cache_dtype(dtype)
    if kv_dtype == torch_dtype("float8_e4m3fn"):
        check_fp8_kv_cache(device, backend)
    if args.kv_cache_dtype in INT_KV_BITS:
        check_int_kv_cache(device, backend, args.kv_cache_dtype)
    return RankConfig(args, device.type, _name(dtype), backend, args.resolve_async_scheduling(device, size),
                      decode_graphs, decode_graphs and args.piecewise_cuda_graphs and size == 1, _name(kv_dtype),
                      args.parallel_config())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fp8_kv_cache_runs(device: torch.device, backend: str) -> bool:
    """Whether kv_cache_dtype='fp8' would start on this device and backend (`check_fp8_kv_cache`)."""
    try:
        check_fp8_kv_cache(device, backend)
    except InvalidRequestError:
        return False
    return True


def check_fp8_kv_cache(device: torch.device, backend: str) -> None:
    """kv_cache_dtype='fp8' where it runs: the torch backend anywhere; the Triton kernels on CUDA compute
    capability 8.0 or newer, the GPUs they are compiled and checked for (e4m3 in hardware from 8.9, from its
    bits on 8.0-8.6: kernels/fp8_bits.py), and in the CPU interpreter. `InvalidRequestError` at start-up
    otherwise, naming the device and what works."""
    if device.type != "cuda" or backend != "triton":
        return
    import torch
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        raise InvalidRequestError(
            f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.0 or newer for the Triton attention kernels; "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}. Use kv_cache_dtype='auto' "
            f"(--kv-cache-dtype auto), or attention_backend='torch' (slower)", param="kv_cache_dtype")


def int_kv_cache_runs(device: torch.device, backend: str, kv_cache_dtype: str = "int8") -> bool:
    """Whether kv_cache_dtype='int8' / 'int4' would start on this device and backend (`check_int_kv_cache`)."""
    try:
        check_int_kv_cache(device, backend, kv_cache_dtype)
    except InvalidRequestError:
        return False
    return True


def check_int_kv_cache(device: torch.device, backend: str, kv_cache_dtype: str) -> None:
    """kv_cache_dtype='int8' / 'int4' where it runs: the torch backend anywhere; the Triton kernels in the CPU
    interpreter and on CUDA compute capability 8.0 or newer, the GPUs the kernels are compiled for (plain
    integer and float32 arithmetic: no float8). `InvalidRequestError` at start-up otherwise."""
    if device.type != "cuda" or backend != "triton":
        return
    import torch
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        raise InvalidRequestError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute capability 8.0 or newer for the Triton "
            f"attention kernels; {torch.cuda.get_device_name(device)} is {major}.{minor}. Use kv_cache_dtype='auto' "
            f"(--kv-cache-dtype auto), or attention_backend='torch' (slower)", param="kv_cache_dtype")
