"""MediaFetcher: the server-side image fetch policy (domains, addresses, redirects, size, time, files).

A local aiohttp server on 127.0.0.1 plays every remote host; a fake resolver maps test host names to
addresses, so nothing touches real DNS or the network.
"""
from __future__ import annotations

import asyncio
import base64
import copy
import io
import os
import socket
import threading

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from PIL import Image

from vlm_sdk.errors import InvalidImageError, InvalidRequestError
from vlm_sdk.multimodal.messages import parse_messages
from vlm_sdk.server import media
from vlm_sdk.server.config import MediaPolicy
from vlm_sdk.server.media import GuardedResolver, MediaFetcher


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (7, 5), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()
BIG = 100_000  # max_bytes in the size tests


class FakeResolver(AbstractResolver):
    def __init__(self, table: dict[str, list[str]]):
        self.table = table
        self.calls: list[str] = []

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        self.calls.append(host)
        if host not in self.table:
            raise OSError(f"fake DNS: unknown host {host}")
        return [ResolveResult(hostname=host, host=addr, port=port,
                              family=socket.AF_INET6 if ":" in addr else socket.AF_INET, proto=0,
                              flags=socket.AI_NUMERICHOST) for addr in self.table[host]]

    async def close(self) -> None:
        pass


class Server:
    """An aiohttp app in its own thread and loop, shared by the whole module."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        @web.middleware
        async def log(request: web.Request, handler):
            self.seen.append(request.path_qs)
            return await handler(request)

        app = web.Application(middlewares=[log])
        app.router.add_get("/img.png", self._img)
        app.router.add_get("/chain/{n}", self._chain)
        app.router.add_get("/redirect", self._redirect)
        app.router.add_get("/big", self._big)
        app.router.add_get("/big-chunked", self._big_chunked)
        app.router.add_get("/slow", self._slow)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def _img(self, request: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def _chain(self, request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        raise web.HTTPFound("/img.png" if n <= 1 else f"/chain/{n - 1}")

    async def _redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["to"])

    async def _big(self, request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (BIG * 3))

    async def _big_chunked(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        try:
            for _ in range(30):
                await resp.write(b"x" * 16384)
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return resp

    async def _slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(3)
        return web.Response(body=PNG)

    def start(self) -> "Server":
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def server():
    srv = Server().start()
    yield srv
    srv.stop()


@pytest.fixture
def srv(server):
    server.seen.clear()
    return server


RESOLVER_TABLE = {"images.test": ["127.0.0.1"], "cdn.images.test": ["127.0.0.1"],
                  "evil.test": ["127.0.0.1"], "internal.test": ["10.0.0.7"],
                  "public.test": ["93.184.216.34"], "mixed.test": ["93.184.216.34", "10.1.2.3"],
                  "v6.test": ["::ffff:127.0.0.1"], "evilimages.test": ["127.0.0.1"]}


def resolve(messages, **policy):
    """Run one MediaFetcher over `messages` with the fake resolver; return (result, fetcher's resolver)."""
    resolver = FakeResolver(RESOLVER_TABLE)

    async def main():
        fetcher = MediaFetcher(MediaPolicy(**policy), resolver=resolver)
        try:
            return await fetcher.resolve_messages(messages)
        finally:
            await fetcher.close()

    return asyncio.run(main())


def one(src, **policy):
    """Resolve a single image_url part and return its new source."""
    out = resolve([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": src}}]}], **policy)
    return out[0]["content"][0]["image_url"]["url"]


def refused(src, *words, **policy) -> str:
    with pytest.raises(InvalidImageError) as info:
        one(src, **policy)
    msg = str(info.value)
    for word in words:
        assert word in msg, (word, msg)
    assert " at 0x" not in msg, msg
    return msg


LOCAL = dict(allowed_domains=("images.test",), allow_private_addresses=True)


# --- sources that need no fetch ------------------------------------------------------------------

def test_data_url_passes_through_unchanged():
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": url},
                                         {"type": "image", "image": url}, {"type": "text", "text": "hi"}]}]
    out = resolve(msgs)
    assert out == msgs
    assert out[0]["content"][0]["image_url"] is url


@pytest.mark.parametrize("src", ["/etc/passwd", "relative/img.png", "ftp://images.test/a.png",
                                 "gopher://x/", "C:\\img.png"])
def test_bare_paths_and_other_schemes_refused(src):
    refused(src, "over HTTP an image is read from a data: URL (base64), an http(s):// URL", **LOCAL)


@pytest.mark.parametrize("src", [123, b"\x89PNG", ["x"], {"url": "data:,"}])
def test_non_string_source_refused(src):
    with pytest.raises(InvalidImageError, match=r"over HTTP an image is read from a data: URL \(base64\), an "
                                                r"http\(s\):// URL"):
        resolve([{"role": "user", "content": [{"type": "image", "image": src}]}])


def test_unknown_structure_passes_through():
    msgs = [{"role": "user", "content": "plain text"}, "not a dict",
            {"role": "user", "content": [{"type": "image_url"}, 5, {"type": "audio", "audio": "x"}]}]
    assert resolve(msgs) == msgs
    assert resolve("not a list") == "not a list"


def test_video_sources_follow_the_image_rules():
    """A video part's source is read like an image's (a bare path never), refused as a video."""
    from vlm_sdk.errors import InvalidVideoError
    with pytest.raises(InvalidVideoError, match=r"video source 'x': a bare path is never read; over HTTP a video is"):
        resolve([{"role": "user", "content": [{"type": "video", "video": "x"}]}])
    data = "data:video/mp4;base64,AAAA"
    out = resolve([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data, "fps": 1.0}}]}])
    assert out[0]["content"][0] == {"type": "video_url", "video_url": {"url": data, "fps": 1.0}}


# --- http(s) fetches -----------------------------------------------------------------------------

def test_allowed_domain_fetch_returns_exact_bytes_and_keeps_fields(srv):
    p = srv.port
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": f"http://images.test:{p}/img.png",
                                                    "max_pixels": 4096, "detail": "high"}, "min_pixels": 64},
                {"type": "image", "image": f"http://images.test:{p}/img.png", "min_pixels": 128,
                 "max_pixels": 9999},
                {"type": "image_url", "image_url": {"url": f"http://cdn.images.test:{p}/img.png"}}]}]
    before = copy.deepcopy(msgs)
    out = resolve(msgs, allowed_domains=(".images.test",), allow_private_addresses=True)
    assert msgs == before  # input not mutated
    parts = out[1]["content"]
    assert parts[0] == {"type": "text", "text": "look"}
    assert parts[1] == {"type": "image_url", "min_pixels": 64,
                        "image_url": {"url": PNG, "max_pixels": 4096, "detail": "high"}}
    assert parts[2] == {"type": "image", "image": PNG, "min_pixels": 128, "max_pixels": 9999}
    assert parts[3] == {"type": "image_url", "image_url": {"url": PNG}}
    assert out[0] == before[0]
    _, images = parse_messages(out)
    assert [(i.source, dict(i.options)) for i in images] == [
        (PNG, {"max_pixels": 4096, "min_pixels": 64}), (PNG, {"min_pixels": 128, "max_pixels": 9999}), (PNG, {})]
    assert srv.seen == ["/img.png"] * 3


def test_a_bare_string_image_url_is_not_fetched_and_is_refused(srv):
    """OpenAI's schema makes `image_url` an object: a bare string is refused (as vLLM refuses it), and
    nothing is fetched for a request that is refused anyway."""
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": f"http://images.test:{srv.port}/img.png"}]}]
    out = resolve(msgs, allowed_domains=("images.test",), allow_private_addresses=True)
    assert out == msgs and srv.seen == []
    with pytest.raises(InvalidRequestError, match="must be an object"):
        parse_messages(out)


def test_domain_not_allowed_refused_without_request(srv):
    p = srv.port
    refused(f"http://evil.test:{p}/img.png", "'evil.test'", "--allowed-media-domains", **LOCAL)
    # ".images.test" matches subdomains and the bare domain, but not a name that merely ends alike
    refused(f"http://evilimages.test:{p}/img.png", "'evilimages.test'", "--allowed-media-domains",
            allowed_domains=(".images.test",), allow_private_addresses=True)
    refused(f"http://cdn.images.test:{p}/img.png", "--allowed-media-domains", **LOCAL)  # exact entry only
    assert srv.seen == []


def test_allowed_domains_separated_by_commas_or_spaces(srv):
    """`--allowed-media-domains a,b` names two hosts (it was read as one, "a,b", and refused both)."""
    assert MediaPolicy(allowed_domains=("evil.test, images.test", "x.test")).allowed_domains == (
        "evil.test", "images.test", "x.test")
    assert MediaPolicy(allowed_domains="a.test b.test").allowed_domains == ("a.test", "b.test")
    assert one(f"http://images.test:{srv.port}/img.png", allowed_domains=("evil.test,images.test",),
               allow_private_addresses=True) == PNG


def test_host_resolving_to_loopback_refused_by_default(srv):
    msg = refused(f"http://images.test:{srv.port}/img.png", "'images.test'", "127.0.0.1", "loopback",
                  "--allow-private-media-addresses", allowed_domains=("images.test",))
    assert "cannot fetch" not in msg
    refused(f"http://internal.test:{srv.port}/", "10.0.0.7", "private", allowed_domains=("internal.test",))
    refused(f"http://v6.test:{srv.port}/", "::ffff:127.0.0.1", "--allow-private-media-addresses",
            allowed_domains=("v6.test",))
    assert srv.seen == []


@pytest.mark.parametrize("host,addr,kind", [
    ("127.0.0.1", "127.0.0.1", "loopback"), ("[::1]", "::1", "loopback"),
    ("[::ffff:127.0.0.1]", "::ffff:7f00:1", "loopback"), ("10.1.2.3", "10.1.2.3", "private"),
    ("169.254.169.254", "169.254.169.254", "link-local"), ("0.0.0.0", "0.0.0.0", "unspecified"),
    ("224.0.0.1", "224.0.0.1", "multicast"), ("[fec0::1]", "fec0::1", "site-local"),
    ("[feff:ffff::1]", "feff:ffff::1", "site-local")])
def test_ip_literals_checked_before_connecting(srv, host, addr, kind):
    bare = host.strip("[]")
    refused(f"http://{host}:{srv.port}/img.png", addr, kind, "--allow-private-media-addresses",
            allowed_domains=(bare,))
    assert srv.seen == []


def test_ip_literal_allowed_with_private_setting(srv):
    assert one(f"http://127.0.0.1:{srv.port}/img.png", allowed_domains=("127.0.0.1",),
               allow_private_addresses=True) == PNG


def test_guard_allows_public_and_refuses_mixed_answers():
    async def main():
        guard = GuardedResolver(FakeResolver(RESOLVER_TABLE), allow_private=False)
        ok = await guard.resolve("public.test", 443)
        assert [r["host"] for r in ok] == ["93.184.216.34"] and ok[0]["port"] == 443
        with pytest.raises(OSError, match=r"10\.1\.2\.3.*--allow-private-media-addresses"):
            await guard.resolve("mixed.test", 443)  # one private address is enough to refuse
        open_guard = GuardedResolver(FakeResolver(RESOLVER_TABLE), allow_private=True)
        assert [r["host"] for r in await open_guard.resolve("mixed.test")] == ["93.184.216.34", "10.1.2.3"]

    asyncio.run(main())


def test_redirect_followed_and_rechecked(srv):
    p = srv.port
    assert one(f"http://images.test:{p}/chain/3", **LOCAL) == PNG
    assert srv.seen == ["/chain/3", "/chain/2", "/chain/1", "/img.png"]
    srv.seen.clear()
    refused(f"http://images.test:{p}/redirect?to=http://evil.test:{p}/img.png", "redirected to",
            "'evil.test'", "--allowed-media-domains", **LOCAL)
    assert srv.seen == [f"/redirect?to=http://evil.test:{p}/img.png"]
    refused(f"http://images.test:{p}/redirect?to=file:///etc/passwd", "only http(s)", **LOCAL)


def test_redirect_to_private_address_refused(srv, monkeypatch):
    # Let 127.0.0.1 (our test "public" server) through; every other private address stays refused.
    real = media._address_problem
    monkeypatch.setattr(media, "_address_problem", lambda a: None if a == "127.0.0.1" else real(a))
    p = srv.port
    policy = dict(allowed_domains=("images.test", "internal.test", "169.254.169.254"))
    assert one(f"http://images.test:{p}/img.png", **policy) == PNG
    refused(f"http://images.test:{p}/redirect?to=http://169.254.169.254/latest/meta-data/",
            "redirected to", "169.254.169.254", "link-local", "--allow-private-media-addresses", **policy)
    refused(f"http://images.test:{p}/redirect?to=http://internal.test:{p}/img.png",
            "redirected to", "'internal.test'", "10.0.0.7", "--allow-private-media-addresses", **policy)


def test_too_many_redirects_refused(srv):
    refused(f"http://images.test:{srv.port}/chain/4", "more than 3 redirects", max_redirects=3, **LOCAL)
    assert len(srv.seen) == 4


def test_oversize_refused_with_and_without_content_length(srv):
    p = srv.port
    refused(f"http://images.test:{p}/big", "Content-Length 300000", f"limit of {BIG} bytes",
            "--max-media-bytes", max_bytes=BIG, **LOCAL)
    refused(f"http://images.test:{p}/big-chunked", f"over the limit of {BIG} bytes", "--max-media-bytes",
            max_bytes=BIG, **LOCAL)


def test_timeout_refused(srv):
    refused(f"http://images.test:{srv.port}/slow", "timed out after 0.3 s", "--media-timeout", "'http://images.test",
            timeout_s=0.3, **LOCAL)


def test_http_error_status_refused(srv):
    refused(f"http://images.test:{srv.port}/missing.png", "HTTP 404", f"images.test:{srv.port}/missing.png",
            **LOCAL)


def test_connection_errors_named_without_reprs():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    msg = refused(f"http://images.test:{port}/img.png", "cannot fetch", f"images.test:{port}/img.png", **LOCAL)
    assert "<" not in msg
    refused("http://nowhere.test/img.png", "cannot fetch", "nowhere.test",
            allowed_domains=("nowhere.test",), allow_private_addresses=True)


def test_long_urls_are_clipped(srv):
    msg = refused(f"http://evil.test:{srv.port}/" + "a" * 5000, "...", **LOCAL)
    assert len(msg) < 400


# --- file:// -------------------------------------------------------------------------------------

@pytest.fixture
def files(tmp_path):
    allowed, outside, sibling = tmp_path / "allowed", tmp_path / "outside", tmp_path / "allowed-evil"
    for d in (allowed, outside, sibling):
        d.mkdir()
    (allowed / "img.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(b"secret")
    (sibling / "x.png").write_bytes(b"sibling")
    (allowed / "link.png").symlink_to(outside / "secret.png")
    (allowed / "big.bin").write_bytes(b"x" * (BIG + 1))
    return tmp_path


def test_file_url_inside_allowed_path_read(files):
    assert one(f"file://{files}/allowed/img.png", allowed_local_path=str(files / "allowed")) == PNG
    assert one(f"file://localhost{files}/allowed/./img.png", allowed_local_path=str(files / "allowed")) == PNG


@pytest.mark.parametrize("rel", ["outside/secret.png", "allowed/link.png", "allowed/../outside/secret.png",
                                 "allowed/%2e%2e/outside/secret.png", "allowed-evil/x.png"])
def test_file_url_escapes_refused(files, rel):
    refused(f"file://{files}/{rel}", "outside", "--allowed-local-media-path",
            allowed_local_path=str(files / "allowed"))


def test_file_url_other_refusals(files):
    root = str(files / "allowed")
    refused(f"file://{files}/allowed/img.png", "--allowed-local-media-path", "not read")
    refused(f"file://{files}/allowed/missing.png", "no such file", allowed_local_path=root)
    refused(f"file://{files}/allowed/big.bin", f"limit of {BIG} bytes", "--max-media-bytes",
            allowed_local_path=root, max_bytes=BIG)
    refused(f"file://{files}/allowed", "not a regular file", allowed_local_path=root)
    refused(f"file://otherhost{files}/allowed/img.png", "'otherhost'", allowed_local_path=root)
    if hasattr(os, "mkfifo"):
        os.mkfifo(files / "allowed" / "fifo")
        refused(f"file://{files}/allowed/fifo", "not a regular file", allowed_local_path=root)


def test_file_url_symlinked_directory_refused(files):
    os.symlink(files / "outside", files / "allowed" / "linkdir")
    msg = refused(f"file://{files}/allowed/linkdir/secret.png", "symbolic link", "'linkdir'",
                  allowed_local_path=str(files / "allowed"))
    assert "outside" in msg


def test_file_url_component_swapped_for_a_link_never_reads_outside(files):
    """Issue 18: a directory swapped for a symlink between a realpath check and the open read a file
    outside the root. The path is now opened a component at a time without following links."""
    root = files / "allowed"
    sub, parked, link = root / "sub", root / "sub-parked", root / "sub-link"
    sub.mkdir()
    (sub / "img.png").write_bytes(PNG)
    (files / "outside" / "img.png").write_bytes(b"secret")
    link.symlink_to(files / "outside")
    stop = threading.Event()

    def swap() -> None:  # sub: the real directory, then a link to outside, and back, as fast as it goes
        while not stop.is_set():
            os.rename(sub, parked)
            os.rename(link, sub)
            os.rename(sub, link)
            os.rename(parked, sub)
    swapper = threading.Thread(target=swap)
    swapper.start()
    read, refusals = [], 0
    try:
        for _ in range(300):
            try:
                read.append(one(f"file://{sub}/img.png", allowed_local_path=str(root)))
            except InvalidImageError:
                refusals += 1
    finally:
        stop.set()
        swapper.join()
    assert b"secret" not in read
    assert set(read) <= {PNG} and len(read) + refusals == 300


def test_every_rule_a_url_breaks_is_named_at_once(files):
    """One error names every rule of the media policy a URL breaks, so that one restart fixes it: a
    loopback literal or localhost outside the allowlist needs both --allowed-media-domains and
    --allow-private-media-addresses; another host name is resolved only once allowed (no DNS query
    for a host the operator did not allow), so its error says what would be checked next."""
    for url, address in (("http://127.0.0.1:9/x.png", "127.0.0.1"), ("http://[::1]:9/x.png", "::1"),
                         ("http://localhost:9/x.png", "127.0.0.1"), ("http://img.localhost:9/x.png", "127.0.0.1")):
        msg = refused(url, "it breaks 2 rules of the server's media policy", "--allowed-media-domains",
                      address, "loopback", "--allow-private-media-addresses")
    msg = refused("http://unknown.test/x.png", "'unknown.test' is not an allowed media domain",
                  "once allowed, the addresses it resolves to must be public too", "--allow-private-media-addresses")
    assert "breaks" not in msg
    msg = refused("http://127.0.0.1:9/x.png", "loopback", "--allow-private-media-addresses",
                  allowed_domains=("127.0.0.1",))
    assert "breaks" not in msg and "--allowed-media-domains" not in msg
    refused("http://127.0.0.1:9/x.png", "'127.0.0.1' is not an allowed media domain", allow_private_addresses=True)
    root = str(files / "allowed")
    refused(f"file://otherhost{files}/allowed/img.png", "it breaks 2 rules", "--allowed-local-media-path is given",
            "names host 'otherhost'")
    refused(f"file://otherhost{files}/outside/secret.png", "it breaks 2 rules", "names host 'otherhost'",
            "outside the directory", allowed_local_path=root)


def test_one_wording_for_the_sources_a_server_reads():
    """The server's errors name the sources as the server reads them, whichever layer refused: the
    media fetcher (a bare path, another scheme, not a string) and the engine's image reader (its
    Python-API list of PIL images, paths and bytes is not what a client can send)."""
    from vlm_sdk.errors import InvalidImageError
    from vlm_sdk.multimodal.image_io import ACCEPTED_SOURCES
    from vlm_sdk.server.config import accepted_sources
    from vlm_sdk.server.protocol import error_from_exception
    wording = accepted_sources("image")
    assert wording.startswith("over HTTP an image is read from a data: URL")
    for source, what in (("/etc/passwd", "a bare path is never read"), ("ftp://a/b.png", "its scheme 'ftp'")):
        assert what in refused(source, wording)
    with pytest.raises(InvalidImageError, match="source of type int; over HTTP an image"):
        resolve([{"role": "user", "content": [{"type": "image", "image": 5}]}])
    engine_error = InvalidImageError(f"unsupported URL scheme in 'gopher://x'; accepted: {ACCEPTED_SOURCES}.")
    message = error_from_exception(engine_error).message
    assert wording in message and "PIL" not in message and message.startswith("unsupported URL scheme")
