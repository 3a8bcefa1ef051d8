"""Formatting a `MemoryPlan` for people (a table) and machines (JSON), and the `vlm-sdk plan` command."""
from __future__ import annotations

import argparse
import json

from vlm_sdk.engine.memory_report import format_bytes as _size, table
from vlm_sdk.models import registry
from vlm_sdk.config import parse_bytes
from vlm_sdk.plan.planner import PLAN_OPTIONS, MemoryPlan, plan


def _problem_lines(title: str, problems) -> list[str]:
    if not problems:
        return [f"{title}: none"]
    def listed(pr) -> str:
        parts = [", ".join(f"{k}={v}" for k, v in pr.fixes.items())] if pr.fixes else []
        if pr.together:
            parts.append("together: " + " + ".join(f"{k}={v}" for k, v in pr.together.items()))
        return f"  [fixes: {'; '.join(parts)}]" if parts else ""
    return [f"{title}:"] + [f"  - {pr.message}{listed(pr)}" for pr in problems]


def format_plan(p: MemoryPlan) -> str:
    device_memory = "-"
    if p.device_memory_bytes:
        device_memory = f"{_size(p.device_memory_bytes)} x memory_utilization {p.memory_utilization}"
        if p.device_in_use_bytes is not None:
            device_memory += f"; {_size(p.device_in_use_bytes)} in use on it now"
    rows = [
        ("model", f"{p.architecture} ({p.config_path})"),
        ("device / dtype / tp", f"{p.device}, {p.dtype}, tp={p.tp}"),
        ("device memory", device_memory),
        ("weights: language model", _size(p.weights_language_model_bytes)),
        ("weights: vision tower", _size(p.weights_vision_bytes)),
        ("weights: projector", _size(p.weights_projector_bytes)),
        ("weights: total per rank", _size(p.weights_bytes)),
        ("activation peak (estimate)", f"{_size(p.activation_peak_bytes)}: LM step "
         f"{_size(p.activation_language_model_bytes)}, vision {_size(p.activation_vision_bytes)}"),
        ("KV per token", f"{p.kv_bytes_per_token:,} B ({p.num_layers} layers x 2 x {p.num_kv_heads} KV heads x "
         f"{p.head_dim} x {p.dtype})"),
        ("KV per block", f"{p.kv_bytes_per_block:,} B ({p.block_size} tokens)"),
        ("KV blocks", f"{p.num_blocks:,} = {_size(p.kv_cache_bytes)} ({p.cache_source})"),
        ("KV capacity", f"{p.capacity_tokens:,} tokens"),
        ("max_model_len", f"{p.max_model_len:,} (max_position_embeddings {p.max_position_embeddings:,})"),
        ("longest single request", f"{p.longest_request_tokens:,} tokens"),
        ("largest allowed image", f"{p.image_tokens_per_image:,} tokens ({p.largest_image})"),
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


def add_plan_parser(sub) -> None:
    cmd = sub.add_parser("plan", help="how memory would be split (weights, activations, KV cache) and what "
                         "fits, from config.json alone")
    cmd.add_argument("model", help="checkpoint directory or its config.json")
    dev = cmd.add_mutually_exclusive_group()
    dev.add_argument("--device-memory", help="device memory to plan for, e.g. 80GiB")
    dev.add_argument("--device", help="read the total memory of this device (cuda:0), or 'cpu'")
    cmd.add_argument("--memory-utilization", type=float)
    cmd.add_argument("--kv-cache-memory", help="KV cache bytes (e.g. 2GiB)")
    for name in ("num-blocks", "block-size", "max-model-len", "max-num-seqs", "max-num-batched-tokens"):
        cmd.add_argument(f"--{name}", type=int)
    for name, (family, setting) in registry.plan_settings().items():  # each family's image option
        schema = next(s for s in family.engine_settings if s.name == setting)
        cmd.add_argument(f"--{name.replace('_', '-')}", type=schema.type,
                         help=f"{family.display_name}: {schema.help} (the engine's {setting})")
    cmd.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int,
                     help="tensor-parallel ranks: figures are per rank, as the engine's start-up report shows them")
    cmd.add_argument("--shard-vision", action=argparse.BooleanOptionalAction, default=None,
                     help="with --tp: split the vision tower over the ranks (the default) or not")
    for name in ("prompt-tokens", "output-tokens", "images"):
        cmd.add_argument(f"--{name}", type=int)
    cmd.add_argument("--dtype")
    cmd.add_argument("--json", action="store_true", help="print one JSON object")


def run_plan(args) -> int:
    options = {k: getattr(args, k) for k in PLAN_OPTIONS}
    if args.kv_cache_memory is not None:
        options["kv_cache_memory"] = parse_bytes(args.kv_cache_memory, "kv_cache_memory")
    result = plan(args.model, **options)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0
