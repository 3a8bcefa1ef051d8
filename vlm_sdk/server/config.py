"""What `vlm-sdk serve` is told: network, auth, request limits and the media policy."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

MiB = 1 << 20

# Engine settings a server sets unless told otherwise, because its clients are not trusted. Images
# are decoded whole before the model's own resize: 4096x4096 is above what the models can use
# (Qwen2.5-VL's default max_pixels is 12,845,056; InternVL tiles any size into at most 12 448x448
# tiles), and a request's images together may hold four such images (8 at 2896x2896).
SERVER_MAX_IMAGE_PIXELS = 4096 * 4096  # 16,777,216
SERVER_MAX_REQUEST_IMAGE_PIXELS = 4 * SERVER_MAX_IMAGE_PIXELS  # 67,108,864
# a fetched or uploaded video: 256 MiB is minutes of 1080p; the engine's other video limits (seconds,
# sampled frames, decoded pixels) are the Python API's
SERVER_MAX_VIDEO_BYTES = 256 * MiB


def accepted_sources(kind: str) -> str:
    """Where the server reads an image or a video from: the one wording of every error that names them."""
    return (f"over HTTP {'an' if kind[0] in 'aeiou' else 'a'} {kind} is read from a data: URL (base64), an "
            f"http(s):// URL whose host is in --allowed-media-domains, or a file:// URL under "
            f"--allowed-local-media-path")


# a serving engine's (max_num_encoder_tokens_per_step, max_prefill_tokens_with_decodes) per device type, where
# not given (engine/core/vision_budget.py). The CPU's from `vlm-sdk bench-serve --flood` on the 2-core machine
# (BENCHMARKS.md: 256 and 128 kept the text victims' p99 TTFT and TPOT within 1.1x and 1.3x of alone beside an
# image flood, against 7.0x and 6.8x unbounded). They cost throughput (the offline `vlm-sdk bench` workload
# took 143 steps instead of 129), so the Python API keeps them off, as vLLM's offline LLM class keeps its own
# defaults; CUDA's are not measured (no GPU was lent): off there until they are.
SERVING_STEP_SHARES = {"cpu": (256, 128)}


def server_engine_args(engine_args: dict) -> dict:
    """`engine_args` with the server's image and video limits, and its vision budget per step on a device that
    has one (SERVING_STEP_SHARES), wherever they were not given."""
    out = {"max_image_pixels": SERVER_MAX_IMAGE_PIXELS,
           "max_request_image_pixels": SERVER_MAX_REQUEST_IMAGE_PIXELS,
           "max_video_bytes": SERVER_MAX_VIDEO_BYTES, **engine_args}
    encoder, prefill = SERVING_STEP_SHARES.get(_device_type(out.get("device")), (None, None))
    out.setdefault("max_num_encoder_tokens_per_step", encoder)
    out.setdefault("max_prefill_tokens_with_decodes", prefill)
    return out


def _device_type(device) -> str:
    """The engine's device type for `device` as given (None: CUDA where torch sees a GPU, as the engine picks)."""
    if device is None:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device).split(":")[0]


@dataclass(frozen=True)
class MediaPolicy:
    """Where the server may read an image from besides a data: URL.

    http(s) URLs are fetched only when their host is in `allowed_domains` (exact host names, or
    ".example.com" for any subdomain); every redirect hop is checked again. Addresses that resolve
    to loopback, private, link-local, multicast or reserved ranges are refused unless
    `allow_private_addresses`. `file://` URLs are read only under `allowed_local_path`.
    """
    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    allow_private_addresses: bool = False
    max_bytes: int = 20 * MiB  # one fetched image
    max_video_bytes: int = SERVER_MAX_VIDEO_BYTES  # one fetched video (serve: the engine's max_video_bytes)
    timeout_s: float = 10.0  # whole download, redirects included
    max_redirects: int = 5

    def __post_init__(self):
        # "a.com,b.com" or "a.com b.com" (one flag value, one config string) names two hosts: read as
        # one, it would fail closed and leave the operator puzzled by a flag they did set
        domains = (self.allowed_domains,) if isinstance(self.allowed_domains, str) else self.allowed_domains
        object.__setattr__(self, "allowed_domains",
                           tuple(host for d in domains for host in re.split(r"[\s,]+", d) if host))


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the bound one is printed and kept on the server object)
    api_key: str | None = None  # when set, /v1/* need "Authorization: Bearer <api_key>"
    served_model_name: str | None = None  # default: the checkpoint directory's name
    max_request_bytes: int = 32 * MiB  # larger bodies get 413
    # JSON values in a body, counted before it is parsed: parsing holds the GIL ~1 µs per value, so this
    # keeps any body's parse near 0.2 s (a chat request needs a few values per message)
    max_json_values: int = 200_000
    limit_images: int = 8  # images per request
    limit_videos: int = 2  # videos per request
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    max_stop_strings: int = 4  # per request, as OpenAI's API allows
    max_stop_chars: int = 256  # per stop string
    max_n: int = 8  # choices per request: each is a sequence in the batch
    # logprob entries a non-streamed response may hold: n x max_tokens x (top_logprobs + 1), max_tokens left
    # out counted as max_model_len (streamed responses hold none: each chunk carries its own tokens')
    max_response_logprobs: int = 1_000_000
    # prompts in one /v1/completions request (vLLM: VLLM_MAX_COMPLETION_PROMPTS, 1024); each prompt is
    # n sequences, so one request adds at most max_completion_prompts * max_n to the batch
    max_completion_prompts: int = 64
    # sequences one request puts in the batch: prompts x n (/v1/completions), n (chat). vLLM bounds n
    # (VLLM_MAX_N_SEQUENCES, 16384) and the prompt list (VLLM_MAX_COMPLETION_PROMPTS, 1024) apart, never
    # their product; here the product is at most one batch (max_num_seqs' default), of which the engine
    # runs at most three quarters at once for one request (engine/core/waiting_queue.py)
    max_sequences_per_request: int = 64
    # connections: an open one must complete a request head within keep_alive_timeout of opening or
    # of its last response (idle and slow-header clients alike), and its body within body_timeout
    keep_alive_timeout: float = 5.0
    body_timeout: float = 60.0
    max_connections: int = 1024  # more are answered 503 and closed before being read
    # media sources kept under their vLLM uuids so a client can refer to them again (server/media_uuids.py)
    media_uuid_cache_bytes: int = 256 * MiB
    media: MediaPolicy = field(default_factory=MediaPolicy)
    # one log line per request (logger vlm_sdk.server, INFO): client, method, path, status, tokens, seconds;
    # `vlm-sdk serve --disable-log-requests` (vLLM's flag) turns it off
    log_requests: bool = True
