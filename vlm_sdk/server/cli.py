"""`vlm-sdk serve MODEL [--host] [--port] [server settings] [engine args]`.

The engine's flags come from vlm_sdk/server/engine_flags.py (one definition for `serve` and `chat`,
made from `EngineArgs` and the families' settings), vLLM's names for them from vllm_names.py; `--help`
shows the common options and the groups (server/parser.py). Nothing here imports torch or the engine
until `run_serve`: `--help` and a refused flag answer at once.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn

from vlm_sdk.config import EngineArgs
from vlm_sdk.engine.gil import SERVER_SWITCH_INTERVAL_MS, set_server_switch_interval
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.models import registry
from vlm_sdk.server.config import SERVER_MAX_VIDEO_BYTES, MediaPolicy, ServerConfig
from vlm_sdk.server.engine_flags import add_engine_flags, engine_kwargs
from vlm_sdk.server.parser import COMMON, Parser, parse_with_hints
from vlm_sdk.server.vllm_names import add_vllm_names, apply_vllm_names

__all__ = ["add_engine_flags", "add_serve_arguments", "add_serve_parser", "engine_kwargs", "exit_now", "run_serve",
           "serve_main", "show_engine_logs"]

SERVE_USAGE = "vlm-sdk serve [MODEL] [options]"
SERVE_DESCRIPTION = ("OpenAI-compatible HTTP server (POST /v1/chat/completions, /v1/completions; GET /v1/models, "
                     "/health, /metrics). Without MODEL: the tiny random checkpoint.")
# the engine settings shown by plain --help, beside the server's own common options
COMMON_ENGINE = ("max_model_len", "memory_utilization", "kv_cache_memory", "num_blocks", "tensor_parallel_size",
                 "dtype", "device")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    brief = {"brief": True} if issubclass(sub._parser_class, Parser) else {}  # a plain argparse parent: full help
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (POST /v1/chat/completions)", usage=SERVE_USAGE,
                       description=SERVE_DESCRIPTION, **brief)
    add_serve_arguments(p)
    return p


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    common = p.add_argument_group(COMMON)
    common.add_argument("model", nargs="?", help="HF-format checkpoint directory or Hugging Face Hub id 'Org/Name' "
                                                  "(default: the tiny random one)")
    common.add_argument("--model", dest="model_flag", metavar="MODEL", default=None,
                        help="the same as MODEL (vLLM's spelling; default: none)")
    d = ServerConfig()
    common.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host}: this machine "
                        "only; vLLM listens on every interface, which --host 0.0.0.0 does here)")
    common.add_argument("--port", type=_port, default=d.port, help=f"port to listen on; 0 picks a free one, printed at "
                        f"start-up (default {d.port})")
    common.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: none)")
    common.add_argument("--served-model-name", default=None, help="name clients pass as 'model' (default: the Hub id "
                        "as given, else the directory's name)")
    common.add_argument("--disable-log-requests", action="store_true",
                        help="no log line per request (default: one line each: method, path, status, tokens, "
                             "time), as vLLM's flag")
    limits = p.add_argument_group("server: limits and timeouts")
    limits.add_argument("--max-request-bytes", type=_positive, default=d.max_request_bytes,
                        help=f"largest request body; a larger Content-Length gets 413 before a byte is read "
                             f"(default {d.max_request_bytes} = 32 MiB)")
    limits.add_argument("--max-json-values", type=_positive, default=d.max_json_values,
                        help=f"JSON values in a request body, counted before it is parsed (default {d.max_json_values})")
    limits.add_argument("--limit-images", type=_count, default=d.limit_images,
                        help=f"images per request (default {d.limit_images})")
    limits.add_argument("--limit-videos", type=_count, default=d.limit_videos,
                        help=f"videos per request (default {d.limit_videos})")
    limits.add_argument("--max-stop-strings", type=_count, default=d.max_stop_strings,
                        help=f"stop strings per request (default {d.max_stop_strings}, as OpenAI's API)")
    limits.add_argument("--max-stop-chars", type=_count, default=d.max_stop_chars,
                        help=f"characters per stop string (default {d.max_stop_chars})")
    limits.add_argument("--max-n", type=_positive, default=d.max_n,
                        help=f"choices ('n') per request, each a sequence in the batch (default {d.max_n})")
    limits.add_argument("--max-response-logprobs", type=_positive, default=d.max_response_logprobs,
                        help="logprob entries a non-streamed response may hold, n x max_tokens x (top_logprobs + 1) "
                             f"(default {d.max_response_logprobs}; streamed responses are not bounded by it)")
    limits.add_argument("--max-completion-prompts", type=_positive, default=d.max_completion_prompts,
                        help="prompts in one /v1/completions request, each completed 'n' times "
                             f"(default {d.max_completion_prompts})")
    limits.add_argument("--max-sequences-per-request", type=_positive, default=d.max_sequences_per_request,
                        help="sequences one request puts in the batch: prompts x n in /v1/completions, n in chat "
                             f"(default {d.max_sequences_per_request})")
    limits.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                        help=f"seconds in-flight requests get after SIGTERM before they are aborted "
                             f"(default {d.shutdown_timeout:g})")
    limits.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout,
                        help="seconds a connection may stay open without a complete request head, idle or sending "
                             f"its headers slowly (default {d.keep_alive_timeout:g})")
    limits.add_argument("--body-timeout", type=float, default=d.body_timeout,
                        help=f"seconds a request body may take to arrive; 408 after (default {d.body_timeout:g})")
    limits.add_argument("--switch-interval-ms", type=_positive_float, default=SERVER_SWITCH_INTERVAL_MS,
                        help="milliseconds a thread of the server runs before the GIL passes to a waiting one: "
                             "short, so that the engine's thread keeps its pace beside threads parsing large "
                             f"bodies (default {SERVER_SWITCH_INTERVAL_MS:g}; Python's own is 5)")
    limits.add_argument("--max-connections", type=_positive, default=d.max_connections,
                        help=f"open connections at once; more are answered 503 and closed (default {d.max_connections})")
    m = MediaPolicy()
    media = p.add_argument_group("server: media URLs (data: URLs are always read)")
    media.add_argument("--allowed-media-domains", nargs="*", default=[],
                       help="hosts whose http(s) image and video URLs may be fetched, separated by spaces or commas "
                            "('.example.com' = any subdomain; default: none)")
    media.add_argument("--allowed-local-media-path", default=None,
                       help="file:// image and video URLs are read only under this directory (default: none)")
    media.add_argument("--allow-private-media-addresses", action="store_true",
                       help="let media URLs resolve to loopback/private/link-local addresses (default off)")
    media.add_argument("--max-media-bytes", type=_positive, default=m.max_bytes,
                       help=f"one fetched image (videos: --max-video-bytes; default {m.max_bytes} = 20 MiB)")
    media.add_argument("--media-timeout", type=float, default=m.timeout_s,
                       help=f"seconds one media download may take, redirects included (default {m.timeout_s:g})")
    media.add_argument("--media-uuid-cache", type=int, default=ServerConfig().media_uuid_cache_bytes,
                       help="bytes of images and videos kept under their parts' 'uuid' (vLLM's), so a client may "
                            "send one again as {'uuid': ..} alone; 0 keeps none (default 256 MiB)")
    add_replica_flags(p)
    add_engine_flags(p, common=COMMON_ENGINE, groups={COMMON: common})
    add_vllm_names(p, "serve")


def add_replica_flags(p: argparse.ArgumentParser) -> None:
    """Data-parallel replicas on Ray Serve (vlm_sdk/replicas/; the routing rule: routing.py)."""
    from vlm_sdk.replicas.config import ReplicaConfig
    from vlm_sdk.replicas.routing import POLICIES, RoutingConfig
    r, c = RoutingConfig(), ReplicaConfig()
    g = p.add_argument_group("data-parallel replicas on Ray Serve (pip install 'vlm-sdk[ray]')")
    g.add_argument("--data-parallel-size", "--replicas", "-dp", type=_positive, default=None,
                   help="serve this many engine replicas (each --tensor-parallel-size ranks) on Ray Serve "
                        "behind this server; Serve replaces one that dies (default: one engine in this process)")
    g.add_argument("--routing", choices=POLICIES, default=r.policy,
                   help="cache_aware: a request goes to the replica that last took its first image or prompt "
                        "prefix unless that one is loaded past the bounds below, else to the least loaded; "
                        f"round_robin: in turn (default {r.policy})")
    g.add_argument("--routing-max-queue", type=_positive, default=r.max_queue,
                   help=f"requests in flight on a replica past which cache affinity is ignored (default {r.max_queue})")
    g.add_argument("--routing-max-kv-usage", type=float, default=r.max_kv_usage,
                   help=f"KV cache usage (0-1] on a replica past which cache affinity is ignored "
                        f"(default {r.max_kv_usage:g})")
    g.add_argument("--routing-chunk-tokens", type=_positive, default=r.chunk_tokens,
                   help=f"prompt-prefix hashes cover whole chunks of this many tokens (default {r.chunk_tokens})")
    g.add_argument("--routing-prefix-tokens", type=_positive, default=r.prefix_tokens,
                   help=f"tokens of a prompt that are hashed for routing (default {r.prefix_tokens})")
    g.add_argument("--routing-stats-period", type=float, default=r.stats_period_s,
                   help=f"seconds between each replica's load reports (default {r.stats_period_s:g})")
    g.add_argument("--replica-cpus", type=float, default=c.replica_cpus,
                   help=f"CPUs Ray reserves per replica (default {c.replica_cpus:g})")
    g.add_argument("--min-replicas", type=_positive, default=None,
                   help="autoscaling lower bound, with --max-replicas (default 1)")
    g.add_argument("--max-replicas", type=_positive, default=None,
                   help="let Ray Serve's autoscaler scale between --min-replicas and this (default: no autoscaling)")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to join ('auto': this node's; default: a new local one)")


def replica_configs(args: argparse.Namespace) -> tuple:
    """(ReplicaConfig, RoutingConfig) when --data-parallel-size was given, else (None, None)."""
    if args.data_parallel_size is None and args.max_replicas is None:
        return None, None
    from vlm_sdk.replicas.config import ReplicaConfig
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


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:  # else bind() raises OverflowError, after the model has loaded
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535 (0: any free one), got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:  # 0 would refuse every request, even n=1
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def check_model_argument(model: str) -> None:
    """A model that can only fail once loading starts fails now: a path that is not there and reads as no
    Hub id 'Org/Name', or a directory without config.json."""
    from vlm_sdk.hub import is_hub_id
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise InvalidRequestError(f"model {model!r} is a directory without config.json: give an HF-format "
                                      f"checkpoint directory (config.json, *.safetensors, the tokenizer files)")
    elif not os.path.exists(path) and not is_hub_id(model):
        raise InvalidRequestError(f"model {model!r}: no such file or directory, and not a Hugging Face Hub id "
                                  f"('Org/Name')")


def check_listen(host: str, port: int) -> None:
    """The address the server will listen on is free now, before the model loads (seconds to minutes):
    bound and released as aiohttp binds it (SO_REUSEADDR). Port 0 and torchrun's other ranks skip."""
    import socket
    if port == 0 or os.environ.get("RANK", "0") != "0":
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InvalidRequestError(f"--host {host!r} is not an address of this machine ({e.strerror}); use e.g. "
                                  f"127.0.0.1 or 0.0.0.0") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as e:
                raise InvalidRequestError(f"cannot listen on {host}:{port}: {e.strerror or e} (another server "
                                          f"there?); choose another --port or --host") from None


def check_serve_inputs(args: argparse.Namespace, model: str | None) -> None:
    """What the command line names, checked before anything loads."""
    if model is not None:
        check_model_argument(model)
    local = args.allowed_local_media_path
    if local is not None and not os.path.isdir(local):
        raise InvalidRequestError(f"--allowed-local-media-path {local!r} is not a directory")
    for host in (h for d in args.allowed_media_domains for h in d.replace(",", " ").split()):
        if "/" in host or ":" in host.strip("[]"):
            raise InvalidRequestError(f"--allowed-media-domains takes host names ('example.com', '.example.com' for "
                                      f"its subdomains), not URLs or ports: got {host!r}")
    check_listen(args.host, args.port)


def server_config(args: argparse.Namespace, engine: dict) -> ServerConfig:
    """The `ServerConfig` of serve's flags (`engine`: the engine settings given, for the video cap)."""
    video_bytes = EngineArgs(max_video_bytes=engine.get("max_video_bytes", SERVER_MAX_VIDEO_BYTES)).max_video_bytes
    media = MediaPolicy(allowed_domains=tuple(args.allowed_media_domains),
                        allowed_local_path=args.allowed_local_media_path,
                        allow_private_addresses=args.allow_private_media_addresses,
                        max_bytes=args.max_media_bytes, max_video_bytes=video_bytes, timeout_s=args.media_timeout)
    return ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
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
                        max_sequences_per_request=args.max_sequences_per_request,
                        log_requests=not args.disable_log_requests)


def run_serve(args: argparse.Namespace, demo_model: Callable[[], Path] | None = None) -> int:
    """Serve `args.model`; none given: the demo checkpoint `demo_model()` makes (vlm_sdk/demo_checkpoint.py,
    handed in by the entry points above the server, so the server itself never reaches the fixtures)."""
    apply_vllm_names(args)
    if args.model and args.model_flag and args.model != args.model_flag:
        raise InvalidRequestError(f"two models given: {args.model!r} and --model {args.model_flag!r}; give one")
    model = args.model or args.model_flag
    check_serve_inputs(args, model)
    from vlm_sdk.engine.heap import bound_server_heap
    from vlm_sdk.server.runner import serve
    bound_server_heap()  # before the engine's threads (engine/heap.py)
    set_server_switch_interval(args.switch_interval_ms)  # engine/gil.py
    if model is None:
        if demo_model is None:
            raise InvalidRequestError("no model given: name a checkpoint directory or a Hub id", param="model")
        model = str(demo_model())
        name = registry.load(registry.family_names()[0]).display_name  # tiny_model_dir's default family
        print(f"[vlm-sdk] no model given: serving a tiny {name}-shaped checkpoint with RANDOM weights at "
              f"{model}", file=sys.stderr)
    engine = engine_kwargs(args)
    config = server_config(args, engine)
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


def serve_main(argv: list[str], demo_model: Callable[[], Path] | None = None) -> int:
    """`vlm-sdk serve` without the rest of the CLI: `python -m vlm_sdk.serve`'s body (`demo_model`: as
    `run_serve`'s)."""
    from vlm_sdk.errors import VLMError
    show_engine_logs()
    parser = Parser(prog="python -m vlm_sdk.serve", usage="python -m vlm_sdk.serve [MODEL] [options]",
                    description=SERVE_DESCRIPTION + " The same as vlm-sdk serve; torchrun's entry point.", brief=True)
    add_serve_arguments(parser)
    try:
        return run_serve(parse_with_hints(parser, argv), demo_model)
    except VLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
