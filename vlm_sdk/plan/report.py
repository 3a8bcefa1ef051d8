"""Formatting a `MemoryPlan` for people (a table) and machines (JSON), and the `vlm-sdk plan` command."""
from __future__ import annotations

import argparse
import json

from vlm_sdk.config import KV_CACHE_DTYPES
from vlm_sdk.memory.report import (cache_group_rows, consumer_rows, encoder_cache_text, format_bytes as _size,
                                   kv_token_text, table)
from vlm_sdk.models import registry
from vlm_sdk.plan.contexts import context_rows
from vlm_sdk.plan.planner import PLAN_OPTIONS, MemoryPlan, _value, plan


def _problem_lines(title: str, problems) -> list[str]:
    if not problems:
        return [f"{title}: none"]
    def listed(pr) -> str:
        parts = [", ".join(f"{k}={_value(k, v)}" for k, v in pr.fixes.items())] if pr.fixes else []
        if pr.together:
            parts.append("together: " + " + ".join(f"{k}={_value(k, v)}" for k, v in pr.together.items()))
        return f"  [fixes: {'; '.join(parts)}]" if parts else ""
    return [f"{title}:"] + [f"  - {pr.message}{listed(pr)}" for pr in problems]


def format_plan(p: MemoryPlan) -> str:
    device_memory = "-"
    if p.device_memory_bytes:
        device_memory = f"{_size(p.device_memory_bytes)} x memory_utilization {p.memory_utilization}"
        if p.device_in_use_bytes is not None:
            device_memory += f"; {_size(p.device_in_use_bytes)} in use on it now"
    elif p.host_memory_bytes:
        device_memory = (f"host RAM {_size(p.host_memory_bytes)} (weights + activation peak + KV cache are "
                         f"checked against it)")
    rows = [
        ("model", f"{p.architecture} ({p.config_path})"),
        ("device / dtype / tp", f"{p.device}, {p.dtype}, tp={p.tp}"),
        ("device memory", device_memory),
        ("weights: language model", _size(p.weights_language_model_bytes)),
        ("weights: vision tower", _size(p.weights_vision_bytes)),
        ("weights: projector", _size(p.weights_projector_bytes)),
        ("weights: total per rank", _size(p.weights_bytes)),
        ("weights: format", p.weight_format),
        ("activation peak (estimate)", f"{_size(p.activation_peak_bytes)}: the step-time consumers below"),
        *consumer_rows(p.consumers),
        ("encoder cache", encoder_cache_text(p.encoder_cache_bytes, p.cache_source)),
        ("KV per token", kv_token_text(p.kv_bytes_per_token, p.group_size if p.cache_groups else p.num_layers,
                                       p.num_kv_heads, p.head_dim,
                                       p.kv_cache_dtype or p.dtype)),
        ("KV per block", f"{p.kv_bytes_per_block:,} B ({p.block_size} tokens)"),
        ("KV blocks", f"{p.num_blocks:,} = {_size(p.kv_cache_bytes)} ({p.cache_source})"),
        *cache_group_rows(p.cache_groups, p.group_size, p.num_state_slots, p.state_slot_bytes, p.max_model_len),
        ("KV capacity", f"{p.capacity_tokens:,} tokens" + (" in one sequence" if p.cache_groups else "")
         + (f"; {p.fp8_capacity_tokens:,} with --kv-cache-dtype fp8" if p.fp8_capacity_tokens else "")),
        *[(f"  prefix caching, {k}", v) for k, v in p.prefix_reuse],
        *context_rows(p.context_fits, _size),
        ("max_model_len", f"{p.max_model_len:,} (max_position_embeddings {p.max_position_embeddings:,})"),
        ("longest single request", f"{p.longest_request_tokens:,} tokens"),
        ("largest allowed image", f"{p.image_tokens_per_image:,} tokens ({p.largest_image})"),
        ("vision held per request", p.held_vision),
        ("largest image alone", f"{p.largest_fitting_image_tokens:,} tokens ({p.largest_fitting_image})"),
    ]
    if p.request_tokens is not None:
        rows.append(("workload", f"{p.prompt_tokens or 0} text + {p.images or 0} image(s) + {p.output_tokens or 0} "
                     f"output = {p.request_tokens:,} tokens per request"))
        rows.append(("requests at once", f"{p.max_concurrent_requests} (max_num_seqs {p.max_num_seqs})"))
    lines = [table(rows)] + _problem_lines("problems", p.problems)
    if p.notes:
        lines += _problem_lines("notes", p.notes)
    return "\n".join(lines)


_SIZE = "a size with a unit: 80GiB, 6784MiB, 40GB, 180709785B (a bare number is refused)"
_HELP = {
    "num-blocks": "KV cache blocks (overrides --kv-cache-memory and --memory-utilization); checked against the "
                  "device: a cache that does not fit beside the weights and activations is a problem",
    "block-size": "tokens per KV block (default 16)",
    "max-model-len": "longest sequence (prompt + output) in tokens (default: what the cache holds, at most the "
                     "model's max_position_embeddings)",
    "max-num-seqs": "most requests running at once (default 64); sizes the logits part of the activation peak",
    "max-num-batched-tokens": "most tokens one engine step computes (default 8192); sizes the activation peak",
    "prompt-tokens": "workload: TEXT tokens per request only; images are not counted here: each of --images is "
                     "counted at the largest allowed size (the 'largest allowed image' row, set by the family's "
                     "image setting)",
    "output-tokens": "workload: tokens generated per request (max_tokens); counted in the request's length",
    "images": "workload: images per request, each counted at the largest allowed size",
    "num-state-slots": "a model with state layers: state slots carved out before the blocks (default max_num_seqs, "
                       "twice that with prefix caching)",
}


def add_plan_parser(sub) -> None:
    cmd = sub.add_parser(
        "plan", help="how memory would be split (weights, activations, KV cache) and what fits, from config.json alone",
        description="Plan memory from config.json alone (nothing is loaded). Give the device: --device-memory 24GiB "
                    "(a GPU of that much memory, bfloat16) or --device cpu / cuda:N; without either, this machine's "
                    "GPU, and on a machine with no GPU plan refuses and asks. Options are the engine's settings, with "
                    "the same names and units as vlm-sdk serve and LLM(...): a fix plan prints pastes into either.")
    cmd.add_argument("model", help="checkpoint directory, its config.json, or a Hub id (Org/Name: only its config "
                     "files are fetched, or read from the hub cache)")
    cmd.add_argument("--revision", help="with a Hub id: the branch, tag or commit (default main)")
    dev = cmd.add_mutually_exclusive_group()
    dev.add_argument("--device-memory", help=f"plan a device of this much memory, e.g. 24GiB ({_SIZE}); bfloat16 "
                     "unless --dtype says otherwise")
    dev.add_argument("--device", help="plan this device: cuda:N (reads its total memory and what is in use on it) "
                     "or cpu (float32 by default; weights + activations + KV cache checked against host RAM)")
    cmd.add_argument("--host-memory", help=f"with --device cpu: the host RAM to check against (default: this "
                     f"machine's, /proc/meminfo MemTotal); {_SIZE}")
    cmd.add_argument("--memory-utilization", type=float, help="share of TOTAL device memory (like vLLM's "
                     "gpu_memory_utilization, not LMDeploy's share of free memory) for weights + activations + KV "
                     "cache (default 0.9); sizes the cache when neither --num-blocks nor --kv-cache-memory is set")
    cmd.add_argument("--kv-cache-memory", help=f"KV cache size, e.g. 2GiB ({_SIZE}); overrides "
                     "--memory-utilization; checked against the device")
    cmd.add_argument("--encoder-cache-memory", help=f"the most vision embeddings kept for reuse across requests "
                     f"(the encoder cache), e.g. 256MiB (the default; {_SIZE}), 0 for none; counted beside the "
                     "weights and activations, and set aside before --memory-utilization sizes the KV cache")
    for name in ("num-blocks", "block-size", "max-model-len", "max-num-seqs", "max-num-batched-tokens",
                 "num-state-slots"):
        cmd.add_argument(f"--{name}", type=int, help=_HELP[name])
    cmd.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                     help="prefix caching (default on): with state layers it doubles the default state slots")
    cmd.add_argument("--model-family", help="the module path of a family (its FAMILY) outside vlm_sdk's registry to "
                     "plan the checkpoint with, as the engine's model_family")
    schemas = registry.engine_settings()  # one help true for every family declaring a setting
    for name, (_, setting) in registry.plan_settings().items():  # each family's image option
        owners = " / ".join(f.display_name for f in registry.families() if f.plan_setting[0] == name)
        cmd.add_argument(f"--{name.replace('_', '-')}", type=schemas[setting].type,
                         help=f"{owners} only: {schemas[setting].help} (the engine setting {setting}, as in "
                              f"vlm-sdk serve and LLM(...))")
    cmd.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                     help="no CUDA graphs: the decode graphs' pool is not counted (on a GPU it is by default)")
    cmd.add_argument("--piecewise-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                     help="count the piecewise CUDA graphs' buffers and pool (off by default, as the engine)")
    cmd.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int,
                     help="tensor-parallel ranks: figures are per rank, as the engine's start-up report shows them")
    cmd.add_argument("--shard-vision", action=argparse.BooleanOptionalAction, default=None,
                     help="with --tp: split the vision tower over the ranks (the default) or not")
    cmd.add_argument("--enable-expert-parallel", action=argparse.BooleanOptionalAction, default=None,
                     help="with --tp: whole MoE experts per rank (num_experts / tp each) instead of a slice of "
                          "every expert, as the engine's setting")
    for name in ("prompt-tokens", "output-tokens", "images"):
        cmd.add_argument(f"--{name}", type=int, help=_HELP[name])
    cmd.add_argument("--dtype", help="weights and KV cache dtype: bfloat16 / float16 / float32 (default bfloat16 on "
                     "a GPU, float32 on the CPU, as the engine)")
    cmd.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="the KV cache's dtype: auto (the model's, the "
                     "default) or fp8 (float8 e4m3 with per-layer scales: one byte per value)")
    cmd.add_argument("--json", action="store_true", help="print one JSON object")


def run_plan(args) -> int:
    from vlm_sdk.hub import resolve_model
    model = resolve_model(args.model, args.revision, configs_only=True)  # a local path as it is
    result = plan(model, **{k: getattr(args, k) for k in PLAN_OPTIONS})
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0
