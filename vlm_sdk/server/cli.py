"""`vlm-sdk serve MODEL [--host] [--port] [server settings] [engine args]`.

Engine flags are made from `EngineArgs` itself (`--num-blocks`, `--kv-cache-memory`, ...) and from
every registered model family's engine settings (`FamilySpec.engine_settings`, e.g. an image size
bound), so every setting an error message names is a flag of the same name.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import MISSING, fields
from typing import NoReturn

from vlm_sdk.config import EngineArgs
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.models import registry
from vlm_sdk.server.config import SERVER_MAX_VIDEO_BYTES, MediaPolicy, ServerConfig

_ENGINE_HELP = {
    "num_blocks": "KV cache blocks (overrides kv_cache_memory and memory_utilization)",
    "kv_cache_memory": "KV cache size with a unit, e.g. 8GiB, 512MiB (4096B for bytes); overrides memory_utilization",
    "memory_utilization": "CUDA only (refused on the CPU): share of the GPU's TOTAL memory for weights + activations "
                          "+ KV cache, like vLLM's gpu_memory_utilization, not of free memory like LMDeploy's "
                          "cache_max_entry_count (default 0.9)",
    "allow_unfit_images": "start even if the largest image the image settings allow cannot fit in max_model_len "
                          "(a warning instead of the refusal; such images are refused per request)",
    "enable_prefix_caching": "reuse the KV blocks of a prompt prefix seen before (text and images, keyed by "
                             "content; default on; --no-enable-prefix-caching turns it off)",
    "encoder_cache_memory": "vision embeddings kept for reuse, e.g. 256MiB (default); 0 turns the encoder cache off",
    "max_model_len": "longest sequence (prompt + output) in tokens",
    "attention_backend": "'triton' (default on CUDA) or 'torch' (the reference path, default on the CPU)",
    "kv_cache_dtype": "the KV cache's dtype: 'auto' (the model's, default) or 'fp8' (float8 e4m3 with per-layer K and "
                      "V scales from the checkpoint, else 1.0: twice the tokens in the same memory)",
    "small_m_gemm": "the decoder's qkv and o projections at <= 8 rows: 'torch' (cuBLAS, default) or 'triton' "
                    "(needs the Triton kernel set; vlm-sdk bench --gpu measures which is faster)",
    "enforce_eager": "CUDA: run decode steps eagerly instead of replaying captured CUDA graphs",
    "async_scheduling": "schedule and launch the next step while this one runs (default: on with CUDA and one "
                        "rank; --no-async-scheduling turns it off)",
    "tensor_parallel_size": "split the model over this many ranks (GPUs), one process each (default 1); "
                            "under torchrun, the number of processes it starts",
    "shard_vision": "under tensor parallelism, split the vision tower over the ranks too (default; "
                    "--no-shard-vision gives every rank a whole copy)",
    "enable_expert_parallel": "under tensor parallelism, give each rank whole MoE experts (num_experts / "
                              "tensor_parallel_size of them) instead of a slice of every expert; attention "
                              "stays split by heads",
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
    "revision": "branch, tag or commit of a model given as a Hub id 'Org/Name' (default: main)",
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
    "tool_call_parser": "how tool calls are read from the output: 'hermes' (<tool_call> JSON) or 'none' "
                        "(default: from the chat template)",
    "reasoning_parser": "how reasoning is split from the answer: 'qwen3' or 'deepseek_r1' (<think> blocks) or "
                        "'none' (default: 'qwen3' when the chat template has a <think> block)",
    "allow_special_tokens_in_text": "read special tokens written in message text (<|im_end|>, ...) as control tokens; "
                                    "by default they are plain text, so a user cannot forge another role's turn",
}
_ALIASES = {"tensor_parallel_size": ("--tp",)}
_SWITCHES = {"async_scheduling"}  # on/off switches whose default (None) means "decided by the device"
# flags whose EngineArgs default (None) does not tell their type; the rest follow their default's type
_FLAG_TYPES = {"revision": str, "dtype": str, "device": str, "attention_backend": str, "kv_cache_memory": str,
               "encoder_cache_memory": str, "memory_utilization": float, "max_grammar_memory": str,
               "grammar_cache_memory": str, "tool_call_parser": str, "reasoning_parser": str,
               "max_video_bytes": str, "distributed_executor_backend": str}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in fields(EngineArgs):
        if f.name in ("show_progress", "mm_processor_kwargs"):  # the latter: one flag per family setting below
            continue
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is MISSING else f.default
        help_text = _ENGINE_HELP.get(f.name, f"default {default}")
        if isinstance(default, bool) or f.name in _SWITCHES:  # an on/off switch: --name / --no-name
            group.add_argument(flag, dest="engine_" + f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
            continue
        kind = _FLAG_TYPES.get(f.name) or ({"float": float, "int": int}.get(type(default).__name__)
                                            if default is not None else int)
        group.add_argument(flag, *_ALIASES.get(f.name, ()), dest="engine_" + f.name, type=kind, default=None,
                           metavar=f.name.upper(), help=help_text)
    for name, setting in registry.engine_settings().items():
        group.add_argument("--" + name.replace("_", "-"), dest="engine_" + name, type=setting.type, default=None,
                           metavar=name.upper(), help=setting.help)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k[len("engine_"):]: v for k, v in vars(args).items() if k.startswith("engine_") and v is not None}


def add_serve_parser(sub) -> None:
    add_serve_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server (POST /v1/chat/completions)"))


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="HF-format checkpoint directory or Hugging Face Hub id 'Org/Name' "
                                             "(default: the tiny random one)")
    d = ServerConfig()
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port (printed at start-up)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", default=None, help="name clients pass as 'model' (default: the Hub id as given, "
                                                                      "else the directory's name)")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes)
    p.add_argument("--max-json-values", type=_positive, default=d.max_json_values,
                   help="JSON values in a request body, counted before it is parsed (default 200000)")
    p.add_argument("--limit-images", type=int, default=d.limit_images, help="images per request")
    p.add_argument("--limit-videos", type=int, default=d.limit_videos, help="videos per request")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds in-flight requests get after SIGTERM before they are aborted")
    p.add_argument("--max-stop-strings", type=_count, default=d.max_stop_strings,
                   help="stop strings per request (default 4, as OpenAI's API)")
    p.add_argument("--max-stop-chars", type=_count, default=d.max_stop_chars,
                   help="characters per stop string (default 256)")
    p.add_argument("--max-n", type=_positive, default=d.max_n,
                   help="choices ('n') per request, each a sequence in the batch (default 8)")
    p.add_argument("--max-response-logprobs", type=_positive, default=d.max_response_logprobs,
                   help="logprob entries a non-streamed response may hold, n x max_tokens x (top_logprobs + 1) "
                        "(default 1000000; streamed responses are not bounded by it)")
    p.add_argument("--max-completion-prompts", type=_positive, default=d.max_completion_prompts,
                   help="prompts in one /v1/completions request (a list of prompts), each completed 'n' "
                        "times (default 64)")
    p.add_argument("--max-sequences-per-request", type=_positive, default=d.max_sequences_per_request,
                   help="sequences one request puts in the batch: prompts x n in /v1/completions, n in chat "
                        "(default 64)")
    p.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout,
                   help="seconds a connection may stay open without a complete request head, idle or "
                        "sending its headers slowly")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds a request body may take to arrive (408 after)")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections at once; more are answered 503 and closed")
    m = MediaPolicy()
    p.add_argument("--allowed-media-domains", nargs="*", default=[],
                   help="hosts whose http(s) image and video URLs may be fetched, separated by spaces or commas "
                        "('.example.com' = any subdomain)")
    p.add_argument("--allowed-local-media-path", default=None,
                   help="file:// image and video URLs are read only under it")
    p.add_argument("--allow-private-media-addresses", action="store_true",
                   help="let media URLs resolve to loopback/private/link-local addresses")
    p.add_argument("--max-media-bytes", type=int, default=m.max_bytes, help="one fetched image (videos: "
                   "--max-video-bytes)")
    p.add_argument("--media-timeout", type=float, default=m.timeout_s)
    p.add_argument("--media-uuid-cache", type=int, default=ServerConfig().media_uuid_cache_bytes,
                   help="bytes of images and videos kept under their parts' 'uuid' (vLLM's), so a client may "
                        "send one again as {'uuid': ..} alone; 0 keeps none (default 256 MiB)")
    add_replica_flags(p)
    add_engine_flags(p)


def add_replica_flags(p: argparse.ArgumentParser) -> None:
    """Data-parallel replicas on Ray Serve (vlm_sdk/replicas/; the routing rule: routing.py)."""
    from vlm_sdk.replicas.launch import ReplicaConfig
    from vlm_sdk.replicas.routing import POLICIES, RoutingConfig
    r, c = RoutingConfig(), ReplicaConfig()
    g = p.add_argument_group("data-parallel replicas on Ray Serve (pip install 'vlm-sdk[ray]')")
    g.add_argument("--data-parallel-size", "--replicas", type=_positive, default=None,
                   help="serve this many engine replicas (each --tensor-parallel-size ranks) on Ray Serve "
                        "behind this server; Serve replaces one that dies")
    g.add_argument("--routing", choices=POLICIES, default=r.policy,
                   help="cache_aware: a request goes to the replica that last took its first image or prompt "
                        "prefix unless that one is loaded past the bounds below, else to the least loaded; "
                        "round_robin: in turn")
    g.add_argument("--routing-max-queue", type=_positive, default=r.max_queue,
                   help="requests in flight on a replica past which cache affinity is ignored")
    g.add_argument("--routing-max-kv-usage", type=float, default=r.max_kv_usage,
                   help="KV cache usage (0-1] on a replica past which cache affinity is ignored")
    g.add_argument("--routing-chunk-tokens", type=_positive, default=r.chunk_tokens,
                   help="prompt-prefix hashes cover whole chunks of this many tokens")
    g.add_argument("--routing-prefix-tokens", type=_positive, default=r.prefix_tokens,
                   help="tokens of a prompt that are hashed for routing")
    g.add_argument("--routing-stats-period", type=float, default=r.stats_period_s,
                   help="seconds between each replica's load reports")
    g.add_argument("--replica-cpus", type=float, default=c.replica_cpus, help="CPUs Ray reserves per replica")
    g.add_argument("--min-replicas", type=_positive, default=None, help="autoscaling lower bound (with --max-replicas)")
    g.add_argument("--max-replicas", type=_positive, default=None,
                   help="let Ray Serve's autoscaler scale between --min-replicas and this")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to join ('auto': this node's; default: a new local one)")


def replica_configs(args: argparse.Namespace) -> tuple:
    """(ReplicaConfig, RoutingConfig) when --data-parallel-size was given, else (None, None)."""
    if args.data_parallel_size is None and args.max_replicas is None:
        return None, None
    from vlm_sdk.replicas.launch import ReplicaConfig
    from vlm_sdk.replicas.routing import RoutingConfig
    try:
        routing = RoutingConfig(policy=args.routing, max_queue=args.routing_max_queue,
                                max_kv_usage=args.routing_max_kv_usage, chunk_tokens=args.routing_chunk_tokens,
                                prefix_tokens=args.routing_prefix_tokens, stats_period_s=args.routing_stats_period)
        replicas = ReplicaConfig(data_parallel_size=args.data_parallel_size or args.min_replicas or 1,
                                 replica_cpus=args.replica_cpus, min_replicas=args.min_replicas,
                                 max_replicas=args.max_replicas, ray_address=args.ray_address)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    return replicas, routing


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:  # 0 would refuse every request, even n=1
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def run_serve(args: argparse.Namespace) -> int:
    from vlm_sdk.engine.heap import bound_server_heap
    from vlm_sdk.server.runner import serve
    bound_server_heap()  # before the engine's threads (engine/heap.py)
    model = args.model
    if model is None:
        from vlm_sdk.demo_checkpoint import tiny_model_dir
        model = str(tiny_model_dir())
        name = registry.load(registry.family_names()[0]).display_name  # tiny_model_dir's default family
        print(f"[vlm-sdk] no model given: serving a tiny {name}-shaped checkpoint with RANDOM weights at "
              f"{model}", file=sys.stderr)
    engine = engine_kwargs(args)
    video_bytes = EngineArgs(max_video_bytes=engine.get("max_video_bytes", SERVER_MAX_VIDEO_BYTES)).max_video_bytes
    media = MediaPolicy(allowed_domains=tuple(args.allowed_media_domains),
                        allowed_local_path=args.allowed_local_media_path,
                        allow_private_addresses=args.allow_private_media_addresses,
                        max_bytes=args.max_media_bytes, max_video_bytes=video_bytes, timeout_s=args.media_timeout)
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                          served_model_name=args.served_model_name, max_request_bytes=args.max_request_bytes,
                          max_json_values=args.max_json_values,
                          limit_images=args.limit_images, limit_videos=args.limit_videos,
                          shutdown_timeout=args.shutdown_timeout, media=media,
                          keep_alive_timeout=args.keep_alive_timeout, body_timeout=args.body_timeout,
                          max_connections=args.max_connections,
                          max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
                          max_n=args.max_n, max_response_logprobs=args.max_response_logprobs,
                          max_completion_prompts=args.max_completion_prompts,
                          media_uuid_cache_bytes=args.media_uuid_cache,
                          max_sequences_per_request=args.max_sequences_per_request)

    replicas, routing = replica_configs(args)
    return serve(model, config, replicas, routing, **engine)


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is when a record comes (not the one at start-up)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr, flush=True)


def show_engine_logs() -> None:
    """The engine's start-up memory report and warnings go to stderr unless the caller set up logging."""
    log = logging.getLogger("vlm_sdk")
    if not log.handlers and not logging.getLogger().handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[vlm-sdk] %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def exit_now(code: int | None) -> NoReturn:
    """End the process with `code` (None: 0) once the command is done. The interpreter's own
    finalisation of torch's and transformers' objects takes 1-2 s on a busy VM, which `vlm-sdk serve`
    would spend after SIGTERM on top of --shutdown-timeout (and freezing them instead makes nanobind,
    under triton, print hundreds of "leaked" lines at exit): flush what was written, then leave the
    memory to the OS. Every rank process and thread the command started was joined before it returned."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be written anyway
            pass
    os._exit(code or 0)


def serve_main(argv: list[str]) -> int:
    """`vlm-sdk serve` without the rest of the CLI: `python -m vlm_sdk.serve`'s body."""
    from vlm_sdk.errors import VLMError
    show_engine_logs()
    parser = argparse.ArgumentParser(prog="python -m vlm_sdk.serve", description="OpenAI-compatible HTTP server "
                                     "(the same as vlm-sdk serve; torchrun's entry point)")
    add_serve_arguments(parser)
    try:
        return run_serve(parser.parse_args(argv))
    except VLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
