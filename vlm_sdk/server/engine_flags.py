"""The engine's flags, one definition for `vlm-sdk serve` and `vlm-sdk chat`: made from `EngineArgs`
itself (`--num-blocks`, `--kv-cache-memory`, ...) and from every registered family's engine settings
(`FamilySpec.engine_settings`, e.g. an image size bound), so every setting an error message names is a
flag of the same name. Each flag's help says its default; the flags fall into the groups of `GROUPS`
for `--help GROUP` (a setting no group names lands in "engine: other"). vLLM's names for the same
settings are added by vlm_sdk/server/vllm_names.py.

Nothing here imports torch: `--help` answers before the engine's modules load.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from vlm_sdk.config import EngineArgs
from vlm_sdk.models import registry
from vlm_sdk.server.parser import COMMON
from vlm_sdk.server.vllm_names import ENGINE_ALIASES

ENGINE_HELP = {
    "dtype": "weights' and activations' dtype: bfloat16, float16 or float32 (default: bfloat16 on CUDA, float32 on "
             "the CPU)",
    "device": "'cpu', 'cuda' or 'cuda:N' (default: cuda when a GPU is visible, else cpu)",
    "seed": "the engine's seed for requests that bring none (default 0)",
    "block_size": "tokens per KV cache block (default 16)",
    "num_blocks": "KV cache blocks (default: sized by --kv-cache-memory or --memory-utilization; overrides both)",
    "kv_cache_memory": "KV cache size with a unit, e.g. 8GiB, 512MiB (4096B for bytes); overrides "
                       "--memory-utilization (default: CUDA sizes it by --memory-utilization; the CPU holds "
                       "max_num_seqs sequences of max_model_len tokens, at most 1 GiB)",
    "memory_utilization": "CUDA only (refused on the CPU): share of the GPU's TOTAL memory for weights + activations "
                          "+ KV cache, like vLLM's gpu_memory_utilization, not of free memory like LMDeploy's "
                          "cache_max_entry_count (default 0.9)",
    "max_model_len": "longest sequence (prompt + output) in tokens (default: what the cache holds, at most the "
                     "model's max_position_embeddings)",
    "max_num_seqs": "most requests running at once (default 64)",
    "max_num_batched_tokens": "most tokens one engine step computes; a longer prompt is prefilled in chunks "
                              "(default 8192)",
    "max_num_encoder_tokens_per_step": "most image tokens one step sends through the vision tower; a step's further "
                                       "images and a video's next frame groups wait for the next steps, so decode "
                                       "steps beside an image flood stay short; a larger image runs alone in a step "
                                       "(default: 256 on the CPU, 1024 on CUDA; 0: no bound)",
    "max_prefill_tokens_with_decodes": "most tokens a prefill chunk computes in a step that also has decode rows, so "
                                       "a long prompt's or an image's tokens share steps with them (default: 128 on "
                                       "the CPU, 512 on CUDA; 0: no bound; not for families that prefill an image "
                                       "whole)",
    "allow_unfit_images": "start even if the largest image the image settings allow cannot fit in max_model_len "
                          "(a warning instead of the refusal; such images are refused per request; default off)",
    "enable_prefix_caching": "reuse the KV blocks of a prompt prefix seen before (text and images, keyed by "
                             "content; default on; --no-enable-prefix-caching turns it off)",
    "encoder_cache_memory": "vision embeddings kept for reuse, e.g. 512MiB (default 256MiB); 0 turns the encoder "
                            "cache off",
    "attention_backend": "'triton' (default on CUDA) or 'torch' (the reference path, default on the CPU)",
    "kv_cache_dtype": "the KV cache's dtype: 'auto' (the model's, default), 'fp8' (float8 e4m3 with per-layer K and "
                      "V scales from the checkpoint, else 1.0: twice the tokens in the same memory), or 'int8' / "
                      "'int4' (per-token, per-head asymmetric codes with their scales and zeros: ~1.9x / ~3.6x "
                      "the tokens at head_dim 128)",
    "quant_policy": "LMDeploy's spelling of --kv-cache-dtype: 8 is int8, 4 int4, 0 auto (default: not given)",
    "small_m_gemm": "the decoder's qkv and o projections at <= 8 rows: 'torch' (cuBLAS, default) or 'triton' "
                    "(needs the Triton kernel set; vlm-sdk bench --gpu measures which is faster)",
    "enforce_eager": "CUDA: run decode steps eagerly instead of replaying captured CUDA graphs (default off)",
    "piecewise_cuda_graphs": "CUDA: steps with prefill rows replay piecewise CUDA graphs around eager attention "
                             "(default off; not yet run on a GPU)",
    "async_scheduling": "schedule and launch the next step while this one runs (default: on with CUDA and one "
                        "rank; --no-async-scheduling turns it off)",
    "preemption_warning_per_minute": "log a warning when preemptions in the last 60 s exceed this (default 10)",
    "tensor_parallel_size": "split the model over this many ranks (GPUs), one process each (default 1); "
                            "under torchrun, the number of processes it starts",
    "pipeline_parallel_size": "split the decoder layers over this many pipeline stages, each of "
                              "tensor_parallel_size ranks (default 1): the first stage runs the vision tower and "
                              "the embeddings, the last the LM head and sampling",
    "pp_layer_partition": "each pipeline stage's decoder layer count, e.g. '4,6' (vLLM's VLLM_PP_LAYER_PARTITION; "
                          "default: an even split, the remainder to the stages before the last)",
    "pipeline_micro_batches": "micro-batches in flight at once under pipeline parallelism (vLLM's batch queue; "
                              "default: one per stage, so the stages overlap; 1: the stages take turns on each step)",
    "shard_vision": "under tensor parallelism, split the vision tower over the ranks too (default; "
                    "--no-shard-vision gives every rank a whole copy)",
    "enable_expert_parallel": "under tensor parallelism, give each rank whole MoE experts (num_experts / "
                              "tensor_parallel_size of them) instead of a slice of every expert; attention "
                              "stays split by heads (default off)",
    "distributed_timeout": "seconds a tensor-parallel rank waits for its peers before the engine fails (default 600)",
    "distributed_executor_backend": "where tensor-parallel ranks 1..N-1 run: 'mp' (processes on this machine, the "
                                    "default) or 'ray' (Ray actors across the nodes of a Ray cluster: ray start "
                                    "--head / --address first; pip install 'vlm-sdk[ray]')",
    "ray_placement_strategy": "with --distributed-executor-backend ray: the placement group's strategy, one bundle "
                              "per rank: PACK (default), SPREAD, STRICT_PACK (one node), STRICT_SPREAD (a node each)",
    "max_image_pixels": "largest image, in pixels, checked from its header before decoding (serve's default "
                        "16777216 = 4096x4096; the Python API's 64000000)",
    "max_request_image_pixels": "the pixels of all of a request's images together, checked before any is decoded "
                                "(serve's default 67108864; none in the Python API)",
    "max_video_bytes": "largest video, as a size with a unit (256MiB); also the most the server fetches for one "
                       "video URL (serve's default 256MiB; the Python API's 1GiB)",
    "max_video_seconds": "longest video, in seconds, read from its container before decoding (default 3600)",
    "max_video_frames": "most frames sampled from one video (default 768)",
    "max_video_decode_pixels": "most pixels decoded for one video: every frame from the keyframe before each sampled "
                               "one, at the source size (at least 256x256 a frame), counted before decoding (default "
                               "8000000000)",
    "max_video_container_frames": "most frames in one video's container, every one of which is indexed whichever are "
                                  "sampled; read from its header where it says, else counted as they are indexed "
                                  "(default 216000: an hour at 60 fps)",
    "preprocess_workers": "processes that decode, resize and patchify images, the bytes and patches passed through "
                          "shared memory (serve's default 2; the Python API's 0: on the prompt threads); a process "
                          "that dies on an image fails that request alone (400) and is replaced",
    "revision": "branch, tag or commit of a model given as a Hub id 'Org/Name' (default: main)",
    "num_state_slots": "a model with state layers: state slots (a running request's, the rest prefix-cache "
                       "checkpoints), carved out before the KV blocks (default max_num_seqs, twice that with "
                       "prefix caching)",
    "model_family": "the module path of a model family (its FAMILY, a FamilySpec) outside vlm_sdk's registry to "
                    "serve the checkpoint with, instead of the one its config.json architecture names",
    "max_logit_bias": "logit_bias entries per request (default 300); each is applied at every step",
    "max_stop_token_ids": "stop_token_ids per request (default 300); min_tokens bans each at every step",
    "max_grammar_bytes": "bytes of one structured-output spec: schema, regex, choice list or grammar (default 1048576)",
    "grammar_compile_timeout": "CPU seconds one grammar may take to compile, with its first mask, in a grammar "
                               "process (default 10; at most 10x as long in wall time)",
    "max_grammar_memory": "memory one compiled grammar may hold with its first mask, measured where it compiles, "
                          "e.g. 64MiB (default)",
    "grammar_cache_memory": "compiled grammars kept for reuse, by their measured memory, e.g. 64MiB (default)",
    "grammar_workers": "grammars compiled at once, each in a process of its own (default 2)",
    "max_tools": "tools per request (default 128, OpenAI's limit); each is rendered into the prompt",
    "max_tool_bytes": "bytes of a request's tools together as JSON: names, descriptions, parameter schemas "
                      "(default 1048576)",
    "tool_call_parser": "how tool calls are read from the output: 'hermes' (<tool_call> JSON), 'qwen3_coder' "
                        "or 'qwen3_xml' (<tool_call><function=...><parameter=...> XML) or 'none' "
                        "(default: from the chat template)",
    "reasoning_parser": "how reasoning is split from the answer: 'qwen3' or 'deepseek_r1' (<think> blocks) or "
                        "'none' (default: 'qwen3' when the chat template has a <think> block)",
    "speculative_config": "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                          "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' (drafts looked up in the request's "
                          "prompt and output, verified in one step; default off)",
    "allow_special_tokens_in_text": "read special tokens written in message text (<|im_end|>, ...) as control tokens; "
                                    "by default (off) they are plain text, so a user cannot forge another role's turn",
}
# (group title, EngineArgs fields and family settings in it); family settings not named here join "images
# and video", any other field "engine: other"
GROUPS = (
    ("engine: memory and KV cache", ("max_model_len", "memory_utilization", "kv_cache_memory", "num_blocks",
                                     "block_size", "kv_cache_dtype", "quant_policy", "enable_prefix_caching",
                                     "encoder_cache_memory", "max_num_seqs", "max_num_batched_tokens",
                                     "max_num_encoder_tokens_per_step", "max_prefill_tokens_with_decodes",
                                     "num_state_slots", "allow_unfit_images",
                                     "preemption_warning_per_minute")),
    ("engine: model and device", ("revision", "model_family", "dtype", "device", "seed", "attention_backend", "small_m_gemm",
                                  "enforce_eager", "piecewise_cuda_graphs", "async_scheduling",
                                  "speculative_config")),
    ("engine: parallelism", ("tensor_parallel_size", "pipeline_parallel_size", "pp_layer_partition",
                             "pipeline_micro_batches", "enable_expert_parallel", "shard_vision",
                             "distributed_executor_backend", "ray_placement_strategy", "distributed_timeout")),
    ("engine: images and video", ("max_image_pixels", "max_request_image_pixels", "max_video_bytes",
                                  "max_video_seconds", "max_video_frames", "max_video_decode_pixels",
                                  "max_video_container_frames", "preprocess_workers")),
    ("engine: per-request budgets and output parsing", (
        "allow_special_tokens_in_text", "max_logit_bias", "max_stop_token_ids", "max_grammar_bytes",
        "grammar_compile_timeout", "max_grammar_memory", "grammar_cache_memory", "grammar_workers",
        "max_tools", "max_tool_bytes", "tool_call_parser", "reasoning_parser")),
)
OTHER_GROUP = "engine: other"
FAMILY_GROUP = "engine: images and video"
_SWITCHES = {"async_scheduling"}  # on/off switches whose default (None) means "decided by the device"
# flags whose EngineArgs default (None) does not tell their type; the rest follow their default's type
_FLAG_TYPES = {"revision": str, "model_family": str, "dtype": str, "device": str, "attention_backend": str, "kv_cache_memory": str,
               "encoder_cache_memory": str, "memory_utilization": float, "max_grammar_memory": str,
               "grammar_cache_memory": str, "tool_call_parser": str, "reasoning_parser": str,
               "max_video_bytes": str, "distributed_executor_backend": str, "speculative_config": str,
               "max_num_encoder_tokens_per_step": int, "max_prefill_tokens_with_decodes": int,
               "pp_layer_partition": str, "pipeline_micro_batches": int}
_NOT_FLAGS = ("show_progress", "mm_processor_kwargs")  # the latter: one flag per family setting (and vLLM's JSON)


def help_with_default(name: str, default) -> str:
    """The flag's help, ending with its default unless the text says it already."""
    text = ENGINE_HELP.get(name, name.replace("_", " "))
    if "default" in text:
        return text
    return f"{text} (default {default})"


def engine_setting_names() -> list[str]:
    """Every engine setting that is a flag: EngineArgs' fields, then the families' settings."""
    return [f.name for f in fields(EngineArgs) if f.name not in _NOT_FLAGS] + list(registry.engine_settings())


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (), common: tuple[str, ...] = (),
                     groups: dict[str, argparse._ArgumentGroup] | None = None) -> None:
    """Add every engine setting but `skip` as a flag (dest `engine_<name>`, default None: "not given"),
    each in its group of `GROUPS`, the `common` ones in the group titled COMMON (`groups`: title -> an
    existing group to use instead of a new one), with vLLM's spellings of the same setting beside ours."""
    groups = dict(groups or {})

    def group_of(name: str, family: bool = False):
        title = COMMON if name in common else \
            next((t for t, names in GROUPS if name in names), FAMILY_GROUP if family else OTHER_GROUP)
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        return groups[title]
    for f in fields(EngineArgs):
        if f.name in _NOT_FLAGS or f.name in skip:
            continue
        flags = ("--" + f.name.replace("_", "-"), *ENGINE_ALIASES.get(f.name, ()))
        default = None if f.default is MISSING else f.default
        help_text = help_with_default(f.name, default)
        if isinstance(default, bool) or f.name in _SWITCHES:  # an on/off switch: --name / --no-name
            group_of(f.name).add_argument(*flags, dest="engine_" + f.name, default=None,
                                          action=argparse.BooleanOptionalAction, help=help_text)
            continue
        kind = _FLAG_TYPES.get(f.name) or ({"float": float, "int": int}.get(type(default).__name__)
                                            if default is not None else int)
        group_of(f.name).add_argument(*flags, dest="engine_" + f.name, type=kind, default=None,
                                      metavar=f.name.upper(), help=help_text)
    for name, setting in registry.engine_settings().items():
        if name in skip:
            continue
        default = "the checkpoint's" if setting.default is None else setting.default
        help_text = setting.help if "default" in setting.help else f"{setting.help} (default {default})"
        if setting.type is bool:  # a family's switch (Gemma 3's do_pan_and_scan): --name / --no-name
            group_of(name, family=True).add_argument("--" + name.replace("_", "-"), dest="engine_" + name,
                                                     action=argparse.BooleanOptionalAction, default=None,
                                                     help=help_text)
            continue
        group_of(name, family=True).add_argument("--" + name.replace("_", "-"), dest="engine_" + name,
                                                 type=setting.type, default=None, metavar=name.upper(),
                                                 help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings given on the command line (`LLM(model, **engine_kwargs(args))`)."""
    return {k[len("engine_"):]: v for k, v in vars(args).items() if k.startswith("engine_") and v is not None}
