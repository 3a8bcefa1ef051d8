"""What `vlm-sdk serve` is told: network, auth, request limits and the media policy."""
from __future__ import annotations

from dataclasses import dataclass, field

MiB = 1 << 20


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
    timeout_s: float = 10.0  # whole download, redirects included
    max_redirects: int = 5


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the bound one is printed and kept on the server object)
    api_key: str | None = None  # when set, /v1/* need "Authorization: Bearer <api_key>"
    served_model_name: str | None = None  # default: the checkpoint directory's name
    max_request_bytes: int = 32 * MiB  # larger bodies get 413
    limit_images: int = 8  # images per request
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    media: MediaPolicy = field(default_factory=MediaPolicy)
