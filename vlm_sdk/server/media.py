"""Fetch the images and videos named in a chat request, under the server's `MediaPolicy`.

A server that fetches URLs on behalf of its clients is an SSRF vector: without a policy, a request
could make it read cloud metadata (169.254.169.254), internal services or local files. So:

* http(s) hosts must be in the domain allowlist, re-checked at every redirect hop (redirects are
  followed by hand, never by aiohttp);
* every address a host resolves to must be public. This is enforced inside the resolver that the
  connection itself uses (`GuardedResolver`), so a DNS answer that changes between a check and the
  connect (DNS rebinding) cannot slip through; IP-literal hosts, which aiohttp never resolves, are
  checked before each hop;
* bodies are capped in bytes while streaming (an image: --max-media-bytes; a video: --max-video-bytes),
  and the whole fetch (all hops) in time;
* `file://` is read only inside one allowed directory, opened one component at a time from the
  directory's descriptor without following any symbolic link (no check-then-open race); bare paths
  and other schemes are refused.
"""
from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import socket
import stat
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from vlm_sdk.errors import InvalidImageError, InvalidVideoError, without_reprs
from vlm_sdk.server.config import MediaPolicy, accepted_sources

_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 1 << 16


def _clip(text: str, limit: int = 100) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def _address_problem(address: str) -> str | None:
    """Why `address` may not be connected to ('loopback', 'private'...), or None when it is public."""
    ip = _ip(address)
    if ip is None:
        return "unparsable"
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is not None:
            ip = embedded
    # site_local: fec0::/10, deprecated (RFC 3879) but still routed inside some networks; IPv6 only
    for kind in ("unspecified", "loopback", "link_local", "site_local", "multicast", "private", "reserved"):
        if getattr(ip, f"is_{kind}", False):
            return kind.replace("_", "-")
    return None if ip.is_global else "non-global"


def _refusal(host: str, address: str, kind: str) -> str:
    what = f"address {address} is" if host == address else f"host {host!r} resolves to {address},"
    return (f"{what} a {kind} address; such addresses are refused unless the server setting "
            f"--allow-private-media-addresses is given")


class _BlockedAddress(OSError):
    """Raised by `GuardedResolver`; aiohttp wraps it in a ClientConnectorError."""


class GuardedResolver(AbstractResolver):
    """Wraps a resolver and refuses hosts that resolve to any non-public address."""

    def __init__(self, inner: AbstractResolver, *, allow_private: bool, owns_inner: bool = False):
        self._inner, self._allow_private, self._owns_inner = inner, allow_private, owns_inner

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if not self._allow_private:
            for result in results:
                kind = _address_problem(result["host"])
                if kind is not None:
                    raise _BlockedAddress(_refusal(host, result["host"], kind))
        return results

    async def close(self) -> None:
        if self._owns_inner:
            await self._inner.close()


@dataclass(frozen=True)
class _Media:
    """What is fetched: its word in messages, its error, its cap in bytes and the flag that sets it."""
    kind: str
    error: type
    max_bytes: int
    flag: str


class MediaFetcher:
    """Resolves image and video sources in OpenAI-style messages under a MediaPolicy."""

    def __init__(self, policy: MediaPolicy, *, resolver: AbstractResolver | None = None):
        self.policy = policy
        self._image = _Media("image", InvalidImageError, policy.max_bytes, "--max-media-bytes")
        self._video = _Media("video", InvalidVideoError, policy.max_video_bytes, "--max-video-bytes")
        self._resolver = resolver
        self._session: aiohttp.ClientSession | None = None
        self._domains = tuple(d.strip().lower().rstrip(".").strip("[]") for d in policy.allowed_domains)

    async def resolve_messages(self, messages: list) -> list:
        """Return a copy of `messages` whose image and video sources are data: URL strings or fetched
        bytes (a video given as a list of frames: each frame so)."""
        if not isinstance(messages, (list, tuple)):
            return messages
        slots: list[tuple[Any, Any, Any, _Media]] = []  # (container, key, source, kind)
        out = []
        for msg in messages:
            if not isinstance(msg, dict) or not isinstance(msg.get("content"), (list, tuple)):
                out.append(msg)
                continue
            parts = []
            for part in msg["content"]:
                new = dict(part) if isinstance(part, dict) else part
                kind = part.get("type") if isinstance(part, dict) else None
                media = self._video if kind in ("video", "video_url") else self._image
                if kind in ("image", "video") and part.get(kind) is not None:
                    if kind == "video" and isinstance(part[kind], (list, tuple)):  # frames
                        new[kind] = list(part[kind])
                        slots.extend((new[kind], i, frame, self._image) for i, frame in enumerate(part[kind]))
                    else:
                        slots.append((new, kind, part[kind], media))
                elif kind in ("image_url", "video_url"):
                    url = part.get(kind)
                    if isinstance(url, dict) and url.get("url") is not None:  # a bare string is refused later
                        new[kind] = dict(url)
                        slots.append((new[kind], "url", url["url"], media))
                parts.append(new)
            out.append({**msg, "content": parts})
        tasks = [asyncio.ensure_future(self._load(source, media)) for _, _, source, media in slots]
        try:
            loaded = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        for (target, key, _, _), value in zip(slots, loaded):
            target[key] = value
        return out

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def _load(self, source: Any, media: "_Media") -> str | bytes:
        if not isinstance(source, str):
            raise media.error(f"{media.kind} source of type {type(source).__name__}; {accepted_sources(media.kind)}")
        head = source[:8].lower()
        if head.startswith("data:"):
            return source
        if head.startswith(("http://", "https://")):
            try:
                return await asyncio.wait_for(self._fetch(source, media), self.policy.timeout_s)
            except asyncio.TimeoutError:
                raise media.error(f"fetching {media.kind} URL {_clip(source)} timed out after "
                                        f"{self.policy.timeout_s:g} s (redirects included; the server "
                                        f"setting --media-timeout raises it)") from None
        if head.startswith("file://"):
            if "\x00" in unquote(source):  # no file name holds one; every os call would raise ValueError
                raise media.error(f"file URL {_clip(source)} holds a NUL byte (%00), which no file name can")
            return await self._read_file(source, media)
        what = f"its scheme {source.split('://', 1)[0]!r} is not read" if "://" in source else "a bare path is never read"
        raise media.error(f"{media.kind} source {_clip(source)}: {what}; {accepted_sources(media.kind)}")

    def _session_for_fetch(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            inner = self._resolver or aiohttp.ThreadedResolver()
            guard = GuardedResolver(inner, allow_private=self.policy.allow_private_addresses,
                                    owns_inner=self._resolver is None)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(resolver=guard),
                cookie_jar=aiohttp.DummyCookieJar(),  # no cookies carried from one client's fetch to another's
                trust_env=False,  # no environment proxy that would connect on our behalf, unchecked
                timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    def _check_url(self, url: URL, where: str, media: "_Media") -> None:
        """Every rule of the policy the URL breaks, in one error: its host outside the allowlist, and
        an address that is not public (an IP literal, or localhost: known without a DNS query; another
        host name is resolved only once allowed, by the connection's own resolver)."""
        if url.scheme not in ("http", "https") or not url.raw_host:
            raise media.error(f"{where}: only http(s) URLs with a host can be fetched")
        host = url.raw_host.lower().rstrip(".")
        literal = _ip(host)
        broken = []
        allowed = any(host == e or (e.startswith(".") and (host == e[1:] or host.endswith(e)))
                      or (literal is not None and literal == _ip(e)) for e in self._domains)
        if not allowed:
            broken.append(f"host {host!r} is not an allowed media domain (the server setting --allowed-media-domains "
                          f"allows it)")
        if not self.policy.allow_private_addresses:
            address = host if literal is not None else "127.0.0.1" if _is_localhost(host) else None
            kind = _address_problem(address) if address is not None else None
            if kind is not None:
                broken.append(_refusal(host, address, kind))
            elif not allowed and literal is None:
                broken[-1] += ("; once allowed, the addresses it resolves to must be public too (or the setting "
                               "--allow-private-media-addresses given)")
        if broken:
            rules = broken[0] if len(broken) == 1 else \
                f"it breaks {len(broken)} rules of the server's media policy: " + "; and ".join(broken)
            raise media.error(f"{where}: {rules}")

    async def _fetch(self, source: str, media: "_Media") -> bytes:
        session = self._session_for_fetch()
        try:
            url = URL(source)
        except (ValueError, TypeError) as exc:
            raise media.error(f"{media.kind} URL {_clip(source)} is not a valid URL ({exc})") from None
        where = f"{media.kind} URL {_clip(source)}"
        for _ in range(self.policy.max_redirects + 1):
            self._check_url(url, where, media)
            try:
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status in _REDIRECTS and "Location" in resp.headers:
                        try:
                            url = url.join(URL(resp.headers["Location"]))
                        except (ValueError, TypeError):
                            raise media.error(f"{where}: invalid redirect Location "
                                                    f"{_clip(resp.headers['Location'])}") from None
                        where = f"{media.kind} URL {_clip(source)} (redirected to {_clip(str(url))})"
                        continue
                    if not 200 <= resp.status < 300:
                        raise media.error(f"{where}: the server answered HTTP {resp.status} "
                                                f"{resp.reason or ''}".rstrip())
                    return await self._read_body(resp, where, media)
            except aiohttp.ClientError as exc:
                cause = getattr(exc, "os_error", None) or exc.__cause__
                if isinstance(cause, _BlockedAddress):
                    raise media.error(f"{where}: {cause}") from None
                if isinstance(exc, aiohttp.ClientConnectorError):
                    why = f"cannot connect to {exc.host}:{exc.port} ({exc.os_error})"
                else:
                    why = f"{type(exc).__name__}: {exc}"
                raise media.error(f"cannot fetch {where}: {without_reprs(why)}") from None
        raise media.error(f"{where}: more than {self.policy.max_redirects} redirects "
                                f"(the media policy's max_redirects)")

    async def _read_body(self, resp: aiohttp.ClientResponse, where: str, media: "_Media") -> bytes:
        cap = media.max_bytes
        if resp.content_length is not None and resp.content_length > cap:
            raise media.error(f"{where}: Content-Length {resp.content_length} bytes is over the "
                              f"limit of {cap} bytes per {media.kind} (server setting {media.flag})")
        body = bytearray()
        async for chunk in resp.content.iter_chunked(_CHUNK):
            body += chunk
            if len(body) > cap:
                raise media.error(f"{where}: the body is over the limit of {cap} bytes per {media.kind} "
                                  f"(server setting {media.flag})")
        return bytes(body)

    async def _read_file(self, source: str, media: "_Media") -> bytes:
        """Every rule the URL breaks, in one error: no local directory allowed, a host named, a path
        outside the allowed directory."""
        root = self.policy.allowed_local_path
        parsed = urlparse(source)
        path = url2pathname(unquote(parsed.path))
        if "\0" in path:
            raise media.error(f"file URL {_clip(source)} holds a NUL character (%00), which no file name has")
        broken = []
        if root is None:
            broken.append("local files are not read unless the server setting --allowed-local-media-path is given")
        if parsed.netloc not in ("", "localhost"):
            broken.append(f"it names host {parsed.netloc!r}; only local files ('file:///abs/path') are read")
        parts = _parts_beneath(path, root) if root is not None else None
        if root is not None and parts is None:
            broken.append("it is outside the directory that the server setting --allowed-local-media-path allows")
        if broken:
            rules = broken[0] if len(broken) == 1 else \
                f"it breaks {len(broken)} rules of the server's media policy: " + "; and ".join(broken)
            raise media.error(f"file URL {_clip(source)}: {rules}")
        return await asyncio.to_thread(self._read_beneath, root, parts, source, media)

    def _read_beneath(self, root: str, parts: list[str], source: str, media: "_Media") -> bytes:
        """Open `parts` one by one from the root's descriptor, never following a symbolic link, so a
        component swapped for a link after any check cannot lead outside the root (a realpath check
        followed by an open could be raced that way)."""
        try:
            fd = os.open(os.path.realpath(root), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise media.error(f"cannot open the directory that the server setting "
                                    f"--allowed-local-media-path names: {exc.strerror or exc}") from None
        try:
            if not parts:
                raise media.error(f"file URL {_clip(source)} is not a regular file (a directory, FIFO or device)")
            for i, name in enumerate(parts):
                last = i == len(parts) - 1
                # O_NONBLOCK: opening a FIFO must not hang
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
                try:
                    nxt = os.open(name, flags, dir_fd=fd)
                except OSError as exc:
                    raise self._open_error(source, name, fd, exc, media) from None
                except ValueError as exc:  # a lone surrogate the file system cannot encode
                    raise media.error(f"file URL {_clip(source)} is not a valid file name ({exc})") from None
                os.close(fd)
                fd = nxt
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise media.error(f"file URL {_clip(source)} is not a regular file (a directory, FIFO or device)")
            with open(fd, "rb", closefd=False) as f:
                data = f.read(media.max_bytes + 1)
        except OSError as exc:
            raise media.error(f"cannot read file URL {_clip(source)}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        if len(data) > media.max_bytes:
            raise media.error(f"file URL {_clip(source)} is over the limit of {media.max_bytes} bytes per "
                              f"{media.kind} (server setting {media.flag})")
        return data

    @staticmethod
    def _open_error(source: str, name: str, dir_fd: int, exc: OSError, media: "_Media") -> InvalidImageError:
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if link:
            return media.error(f"file URL {_clip(source)} passes through the symbolic link {name!r}; links are "
                                     f"not followed, so that nothing outside the directory that the server setting "
                                     f"--allowed-local-media-path allows is read")
        if exc.errno == errno.ENOENT:
            return media.error(f"file URL {_clip(source)}: no such file")
        if exc.errno == errno.ENOTDIR:
            return media.error(f"file URL {_clip(source)}: {name!r} is not a directory")
        return media.error(f"cannot read file URL {_clip(source)}: {exc.strerror or exc}")


def _is_localhost(host: str) -> bool:
    """'localhost' and its subdomains: loopback by definition (RFC 6761), whatever DNS would say."""
    return host == "localhost" or host.endswith(".localhost")


def _parts_beneath(path: str, root: str) -> list[str] | None:
    """The components of `path` below `root` (as given, or with its links resolved: the operator's
    own path), '..' resolved in the text; None when it is not below the root."""
    path = os.path.normpath(path)
    if not os.path.isabs(path):
        return None
    for base in dict.fromkeys((os.path.normpath(os.path.abspath(root)), os.path.realpath(root))):
        if os.path.commonpath([base, path]) == base:
            rel = os.path.relpath(path, base)
            return [] if rel == "." else rel.split(os.sep)
    return None
