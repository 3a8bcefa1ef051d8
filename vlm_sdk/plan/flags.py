"""`vlm-sdk plan`'s flags: the engine's settings under the names `vlm-sdk serve` and `LLM(...)` use, so a
fix plan prints pastes into either, and a workload per request. Plain argparse (no torch): `--help`
answers at once; the command runs in report.py."""
from __future__ import annotations

import argparse

from vlm_sdk.config import KV_CACHE_DTYPES, QUANT_POLICIES
from vlm_sdk.models import registry

_SIZE = "a size with a unit: 80GiB, 6784MiB, 40GB, 180709785B (a bare number is refused)"
_HELP = {
    "num-blocks": "KV cache blocks (overrides --kv-cache-memory and --memory-utilization); checked against the "
                  "device: a cache that does not fit beside the weights and activations is a problem (default: "
                  "sized by --memory-utilization)",
    "block-size": "tokens per KV block (default 16)",
    "max-model-len": "longest sequence (prompt + output) in tokens (default: what the cache holds, at most the "
                     "model's max_position_embeddings)",
    "max-num-seqs": "most requests running at once (default 64); sizes the logits part of the activation peak",
    "max-num-batched-tokens": "most tokens one engine step computes (default 8192); sizes the activation peak",
    "prompt-tokens": "workload: TEXT tokens per request only; images are not counted here: each of --images is "
                     "counted at the largest allowed size (the 'largest allowed image' row, set by the family's "
                     "image setting; default 0)",
    "output-tokens": "workload: tokens generated per request (max_tokens); counted in the request's length "
                     "(default 0)",
    "images": "workload: images per request, each counted at the largest allowed size (default 0)",
    "num-state-slots": "a model with state layers: state slots carved out before the blocks (default max_num_seqs, "
                       "twice that with prefix caching)",
}


def add_plan_parser(sub) -> argparse.ArgumentParser:
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
                     "unless --dtype says otherwise (default: this machine's GPU)")
    dev.add_argument("--device", help="plan this device: cuda:N (reads its total memory and what is in use on it) "
                     "or cpu (float32 by default; weights + activations + KV cache checked against host RAM)")
    cmd.add_argument("--host-memory", help=f"with --device cpu: the host RAM to check against (default: this "
                     f"machine's, /proc/meminfo MemTotal); {_SIZE}")
    cmd.add_argument("--memory-utilization", "--gpu-memory-utilization", type=float, help="share of TOTAL device memory (like vLLM's "
                     "gpu_memory_utilization, not LMDeploy's share of free memory) for weights + activations + KV "
                     "cache (default 0.9); sizes the cache when neither --num-blocks nor --kv-cache-memory is set")
    cmd.add_argument("--kv-cache-memory", help=f"KV cache size, e.g. 2GiB ({_SIZE}); overrides "
                     "--memory-utilization; checked against the device (default: sized by --memory-utilization)")
    cmd.add_argument("--encoder-cache-memory", help=f"the most vision embeddings kept for reuse across requests "
                     f"(the encoder cache), e.g. 256MiB (the default; {_SIZE}), 0 for none; counted beside the "
                     "weights and activations, and set aside before --memory-utilization sizes the KV cache")
    for name in ("num-blocks", "block-size", "max-model-len", "max-num-seqs", "max-num-batched-tokens",
                 "num-state-slots"):
        vllm = ("--num-gpu-blocks-override",) if name == "num-blocks" else ()  # vLLM's name of the same setting
        cmd.add_argument(f"--{name}", *vllm, type=int, help=_HELP[name])
    cmd.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                     help="prefix caching (default on): with state layers it doubles the default state slots")
    cmd.add_argument("--model-family", help="the module path of a family (its FAMILY) outside vlm_sdk's registry to "
                     "plan the checkpoint with, as the engine's model_family (default: the registry's)")
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
    cmd.add_argument("--tp", "--tensor-parallel-size", "-tp", dest="tp", type=int,
                     help="tensor-parallel ranks: figures are per rank, as the engine's start-up report shows them "
                          "(default 1)")
    cmd.add_argument("--pp", "--pipeline-parallel-size", "-pp", dest="pp", type=int,
                     help="pipeline stages: each stage's weights, activations and KV share, the stage that binds the "
                          "cache and a balancing layer partition (default 1)")
    cmd.add_argument("--pp-layer-partition", dest="pp_layer_partition",
                     help="with --pp: each stage's decoder layer count, e.g. '4,6' (default: even)")
    cmd.add_argument("--shard-vision", action=argparse.BooleanOptionalAction, default=None,
                     help="with --tp: split the vision tower over the ranks (the default) or not")
    cmd.add_argument("--enable-expert-parallel", action=argparse.BooleanOptionalAction, default=None,
                     help="with --tp: whole MoE experts per rank (num_experts / tp each) instead of a slice of "
                          "every expert, as the engine's setting (default off)")
    for name in ("prompt-tokens", "output-tokens", "images"):
        cmd.add_argument(f"--{name}", type=int, help=_HELP[name])
    cmd.add_argument("--workload", metavar="FILE", help="a workload to plan for: JSONL of OpenAI chat bodies (images "
                     "as {\"width\", \"height\"} or file / data: URLs, read to their header only; \"prompt_tokens\" per "
                     "line, else counted by the checkpoint's tokenizer) or {\"histogram\": {...}} of prompt_tokens, "
                     "output_tokens, images and image_sizes; reports the share that fits, requests at once at "
                     "p50/p95/p99, what binds and the settings that serve 99%% (plan/workload_file.py; default: none, one "
                     "request of the planned shape)")
    cmd.add_argument("--html", metavar="FILE", help="also write the plan as a self-contained page: the device's "
                     "memory as a stacked bar, requests at once against context length, and the workload against "
                     "capacity (plan/picture.py; default: none written)")
    cmd.add_argument("--svg", metavar="FILE", help="also write the same pictures as one SVG file (default: none written)")
    cmd.add_argument("--dtype", help="weights and KV cache dtype: bfloat16 / float16 / float32 (default bfloat16 on "
                     "a GPU, float32 on the CPU, as the engine)")
    cmd.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="the KV cache's dtype: auto (the model's, the "
                     "default), fp8 (float8 e4m3 with per-layer scales: one byte per value), or int8 / int4 "
                     "(per-token, per-head codes with a float32 scale and zero each)")
    cmd.add_argument("--quant-policy", type=int, choices=sorted(QUANT_POLICIES), help="LMDeploy's spelling of "
                     "--kv-cache-dtype: 8 is int8, 4 int4, 0 auto (default: not given)")
    cmd.add_argument("--kv-cache-memory-bytes", dest="kv_cache_memory", type=lambda t: f"{t}B" if t.isdigit() else t,
                     metavar="BYTES", help="vLLM's name of --kv-cache-memory: a bare number is bytes (default: not set)")
    cmd.add_argument("--speculative-config", help="speculative decoding as the engine's JSON, e.g. '{\"method\": "
                     "\"ngram\", \"num_speculative_tokens\": 4}': the verification step's 1 + k logits rows per "
                     "sequence are counted (default off)")
    cmd.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    return cmd
