"""Formatting a `MemoryPlan` for people (a table) and machines (JSON), and the `vlm-sdk plan` command."""
from __future__ import annotations

import json

from vlm_sdk.memory.report import (cache_group_rows, consumer_rows, encoder_cache_text, format_bytes as _size,
                                   kv_token_text, table)
from vlm_sdk.memory.kv_dtypes import kv_dtype_rows
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
        ("device / dtype / tp", f"{p.device}, {p.dtype}, tp={p.tp}" + (f", pp={p.pp} (figures below are stage 0's; "
                                                                       f"each stage's at the end)" if p.stages else "")),
        ("device memory", device_memory),
        ("weights: language model", _size(p.weights_language_model_bytes)),
        ("weights: vision tower", _size(p.weights_vision_bytes)),
        ("weights: projector", _size(p.weights_projector_bytes)),
        *([("weights: EAGLE-3 draft", _size(p.weights_draft_bytes) + " (its K/V page is in KV per block)")]
          if p.weights_draft_bytes else []),
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
        *kv_dtype_rows(p.kv_dtype_fits, p.max_model_len),
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
    for st in p.stages:  # pipeline parallelism: what each stage holds; the binding one sizes every stage's cache
        binds = " (binds: every stage holds this many)" if st.stage == p.binding_stage else ""
        rows.append((f"stage {st.stage}: layers {st.layers[0]}..{st.layers[1] - 1}",
                     f"weights {_size(st.weights_bytes)}, activation peak {_size(st.activation_peak_bytes)}, "
                     f"KV {st.kv_bytes_per_block:,} B per block; could hold {st.num_blocks_possible:,} blocks{binds}"))
    if p.balanced_partition is not None:
        current = tuple(st.layers[1] - st.layers[0] for st in p.stages)
        rows.append(("balancing partition", ",".join(map(str, p.balanced_partition)) + (
            " (the current one)" if p.balanced_partition == current else
            f" (--pp-layer-partition {','.join(map(str, p.balanced_partition))}; now {','.join(map(str, current))})")))
    if p.workload is not None:
        from vlm_sdk.plan.workload import workload_rows
        rows += workload_rows(p.workload, _size)
    lines = [table(rows)] + _problem_lines("problems", p.problems)
    if p.notes:
        lines += _problem_lines("notes", p.notes)
    return "\n".join(lines)


EXIT_PROBLEMS = 1  # the engine would refuse to start, or refuse the workload's request


def fits_with_lines(found) -> list[str]:
    if not found:
        return ["what would fit: nothing this plan tried (more ranks, an FP8 KV cache, whole experts per rank, "
                "a quantized checkpoint); see the problems' fixes"]
    return ["what would fit instead (each planned like this one):"] + [f"  - {a.text()}" for a in found]


def write_pictures(result: MemoryPlan, html_path: str | None, svg_path: str | None) -> None:
    """--html / --svg: the plan as a page or one SVG (plan/picture.py)."""
    from pathlib import Path
    from vlm_sdk.plan.picture import page, standalone_svg
    d, curve = result.to_dict(), list(result.at_once_by_length)
    if html_path:
        Path(html_path).write_text(page(d, curve, f"vlm-sdk plan: {result.architecture} on {result.device}"))
    if svg_path:
        Path(svg_path).write_text(standalone_svg(d, curve))


def run_plan(args) -> int:
    """Print the plan; exit status 0 when it has no problems, EXIT_PROBLEMS when it has (with, on a GPU,
    the settings that would fit: more ranks, an FP8 KV cache, a quantized checkpoint)."""
    from vlm_sdk.hub import resolve_model
    from vlm_sdk.plan.alternatives import alternatives
    model = resolve_model(args.model, args.revision, configs_only=True)  # a local path as it is
    options = {k: getattr(args, k) for k in PLAN_OPTIONS}
    result = plan(model, **options)
    found = alternatives(model, options, result) if result.problems and result.device_memory_bytes else None
    write_pictures(result, getattr(args, "html", None), getattr(args, "svg", None))
    if args.json:
        out = result.to_dict()
        if found is not None:
            out["fits_with"] = [a.to_dict() for a in found]
        print(json.dumps(out, indent=2))
    else:
        print("\n".join([format_plan(result), *(fits_with_lines(found) if found is not None else [])]))
    return EXIT_PROBLEMS if result.problems else 0
