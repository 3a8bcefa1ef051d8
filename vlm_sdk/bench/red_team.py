"""`vlm-sdk bench-serve --red-team`: issue 28's attacks, row by row, against a live server while an
innocent client streams beside them.

Each row sends its requests (built before the row starts, so that the attacker's own work does not
delay anything), `concurrency` at a time, and reports: the HTTP status of every request, the victim
stream's worst gap between two SSE lines over the row (and its median: the step cadence the row's
batch allows; whether the worst gap holds the start of one of the victim's streams, one after
another, and the worst gap within a running stream), and the server's resident memory before and
after it (its own `process_resident_memory_bytes` plus its grammar processes', from /metrics). The
victim runs in a process of its own, so that neither the attacker's client nor its parsing can delay
the lines it times. Afterwards: 5xx count, whether the server still answers /health, the worst gap,
the RSS growth over the whole run (from before the first row to the server idle after the last,
once it has given its allocator's free memory back), each against issue 28's target.

    1  $ref chains of 1,000 and 3,000, Lark rule chains of 3,000 and 30,000
    2  24 distinct ((a{1001}){1000}){N} regexes, 2 at a time
    3  600 distinct choice lists of 5,000 strings, 4 at a time
    4  choice lists of 64,000 strings, 3 at once; Lark grammars of 64,000 alternatives, 3 at once;
       plain one-token probes meanwhile (their slowest is reported)
    5  n=8, logprobs, top_logprobs=20, max_tokens=4000, ignore_eos, non-streamed, twice at once
    6  logit_bias of 2,000,000 entries (28 MB), twice; 301 entries; ids above the vocabulary
    7  stop_token_ids of 3,000,000 ids with min_tokens=150
    8  schemas as JSON strings nested 100,000 deep (three fields), schema true and false, logit_bias
       keys "²" and "١٢٣"
    9  stop_token_ids covering the whole vocabulary (first 300 ids: the cap) with min_tokens=3
    10 chat_template, echo, add_special_tokens
    41.7, 41.9 (issue 41's tool rows: vlm_sdk/bench/red_team_tools.py)
    41.3, 41.5, 41.6, 41.8 (issue 41's load rows: vlm_sdk/bench/red_team_load.py)

A row's body is bytes for /v1/chat/completions, (path, bytes) for another route, or a body that sends
itself; its probes are True (a plain one-token chat request, again and again while the row runs) or
the probe's own body.

`--red-team-scale` < 1 sends fewer of each (at least one): the test suite's quick run.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
import statistics
import sys
import threading
import time
from collections import Counter

import aiohttp

from vlm_sdk.bench.red_team_load import load_rows
from vlm_sdk.bench.red_team_tools import tool_rows
from vlm_sdk.bench.red_team_video import video_rows

IDLE_WAIT_S = 3.0  # after the run, before the last RSS: the server's idle trim and its walk
TARGETS = {"crashes": 0, "server_errors": 0, "worst_gap_s": 0.5, "rss_growth_bytes": 200 << 20}


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _rule_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def rows(model: str, vocab_size: int, scale: float) -> list[tuple[str, list[bytes], int, bool]]:
    """(name, bodies, at once, with plain probes) per row of issue 28's table, in order, then issue 41's."""
    def n(count: int) -> int:
        return max(1, round(count * scale))

    def body(**fields) -> bytes:
        return json.dumps({"model": model, "messages": [{"role": "user", "content": "Answer."}], "max_tokens": 8,
                           **fields}).encode()

    def fmt(schema) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    deep = "[" * 100_000 + "]" * 100_000
    return [
        ("1 $ref / rule chains", [body(response_format=fmt(_ref_chain(1000))), body(response_format=fmt(_ref_chain(3000))),
                                  body(structured_outputs={"grammar": _rule_chain(3000)}),
                                  body(structured_outputs={"grammar": _rule_chain(30_000)})], 2, False),
        ("2 nested-repeat regexes", [body(structured_outputs={"regex": f"((a{{1001}}){{1000}}){{{1000 + i}}}"})
                                     for i in range(n(24))], 2, False),
        ("3 5,000-string choice lists", [body(structured_outputs={"choice": [f"answer {k} number {i}" for i in range(5000)]})
                                         for k in range(n(600))], 4, False),
        ("4 64,000 choices / alternatives", [body(structured_outputs={"choice": [f"c{k}-{i}" for i in range(64_000)]})
                                             for k in range(3)]
         + [body(structured_outputs={"grammar": "start: " + " | ".join(f'"g{k}-{i}"' for i in range(64_000))})
            for k in range(3)], 3, True),
        ("5 n=8 x 4000 x 21 logprobs", [body(n=8, logprobs=True, top_logprobs=20, max_tokens=n(4000), ignore_eos=True,
                                             temperature=1.0, seed=k) for k in range(2)], 2, False),
        ("6 logit_bias", [body(logit_bias={str(2_000_000 + i): 1 for i in range(2_000_000)})] * 2
         + [body(logit_bias={str(i): 1 for i in range(301)}), body(logit_bias={str(vocab_size + 7): 1})], 1, False),
        ("7 stop_token_ids", [body(stop_token_ids=list(range(3_000_000)), min_tokens=150),
                              body(stop_token_ids=list(range(301)))], 1, False),
        ("8 schema strings, booleans, keys", [body(structured_outputs={"json": deep}),
                                              body(response_format=fmt(deep)), body(guided_json=deep),
                                              body(structured_outputs={"json": True}), body(response_format=fmt(False)),
                                              body(logit_bias={"²": 1}), body(logit_bias={"١٢٣": 1})], 1, False),
        ("9 min_tokens vs stop ids", [body(stop_token_ids=list(range(300)), min_tokens=3, max_tokens=6,
                                           temperature=1.0, seed=1)], 1, False),
        ("10 template / echo / specials", [body(chat_template="{{ messages }}"), body(echo=True),
                                           body(add_special_tokens=True)], 1, False),
    ] + video_rows(model, scale) + tool_rows(model, scale) + load_rows(model, scale)


# -- the victim, in a process of its own ----------------------------------------------------------

def _victim(url: str, model: str, api_key: str | None, conn) -> None:
    """Stream long generations one after another until told to stop; send each SSE line's time."""
    import http.client
    from urllib.parse import urlparse
    u = urlparse(url)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3000,
                       "ignore_eos": True, "stream": True})
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    times: list[float] = []
    while not conn.poll():
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        try:
            conn.send(("start", time.monotonic()))  # a gap over it holds a new stream's first token
            c.request("POST", "/v1/chat/completions", body, headers)
            resp = c.getresponse()
            while not conn.poll():
                line = resp.readline()
                if not line:
                    break
                if line.startswith(b"data: "):
                    times.append(time.monotonic())  # CLOCK_MONOTONIC: the same clock in every process
                    if len(times) >= 50:
                        conn.send(("lines", times))
                        times = []
        except OSError:
            time.sleep(0.1)
        finally:
            c.close()
    conn.send(("lines", times))


class Victim:
    def __init__(self, url: str, model: str, api_key: str | None):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_victim, args=(url, model, api_key, child), daemon=True)
        self.times: list[float] = []
        self.starts: list[float] = []  # when each of its streams was requested
        self._reader = threading.Thread(target=self._read, daemon=True)

    def start(self) -> None:
        self._proc.start()
        self._reader.start()
        deadline = time.monotonic() + 60
        while len(self.times) < 20 and time.monotonic() < deadline:
            time.sleep(0.1)

    def _read(self) -> None:
        try:
            while True:
                kind, value = self._conn.recv()
                if kind == "start":
                    self.starts.append(value)
                else:
                    self.times.extend(value)
        except (EOFError, OSError):
            pass

    def stop(self) -> None:
        self._conn.send("stop")
        self._proc.join(timeout=30)
        self._reader.join(timeout=5)

    def gaps(self, t0: float, t1: float) -> list[float]:
        """The victim's waits between lines over [t0, t1], the ones straddling either end included."""
        deadline = time.monotonic() + 10  # the first line after t1 closes a stall running past it
        while not (self.times and self.times[-1] > t1) and time.monotonic() < deadline:
            time.sleep(0.05)
        times = sorted(self.times)
        points = [t for t in times if t < t0][-1:] + [t for t in times if t0 <= t <= t1] + \
            [t for t in times if t > t1][:1]
        return [b - a for a, b in zip(points, points[1:])] or [float("inf")]

    def worst_running_gap(self, t0: float, t1: float) -> float:
        """The worst of `gaps(t0, t1)` within a running stream (none holding one of its starts)."""
        times = sorted(self.times)
        points = [t for t in times if t < t0][-1:] + [t for t in times if t0 <= t <= t1] + \
            [t for t in times if t > t1][:1]
        return max((b - a for a, b in zip(points, points[1:]) if not any(a < s < b for s in self.starts)),
                   default=float("nan"))

    def worst_gap_start(self, t0: float, t1: float) -> tuple[float, bool]:
        """When the worst gap of [t0, t1] began, in seconds after t0 (where in the row it was), and
        whether it holds the start of one of the victim's streams (its request, prefill and first
        token: a time to first token, not a pause in a running stream)."""
        times = sorted(self.times)
        points = [t for t in times if t < t0][-1:] + [t for t in times if t0 <= t <= t1] + \
            [t for t in times if t > t1][:1]
        if len(points) < 2:
            return float("nan"), False
        a, b = max(zip(points, points[1:]), key=lambda ab: ab[1] - ab[0])
        return a - t0, any(a < s < b for s in self.starts)


# -- the run --------------------------------------------------------------------------------------

async def _metrics(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    found = {}
    for name in ("process_resident_memory_bytes", "vlm_sdk_grammar_process_resident_bytes"):
        match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        found[name] = float(match.group(1)) if match else 0.0
    return found


def _rss(m: dict) -> float:
    return m["process_resident_memory_bytes"] + m["vlm_sdk_grammar_process_resident_bytes"]


def _grammar_rss(m: dict) -> float:
    return m["vlm_sdk_grammar_process_resident_bytes"]


async def _send(session, url: str, headers: dict, data: bytes | tuple[str, bytes]) -> tuple[int, str]:
    if hasattr(data, "send"):  # a body that sends itself (a client that hangs up: red_team_video.HangUp)
        return await data.send(session, url, headers)
    path, data = data if isinstance(data, tuple) else ("/v1/chat/completions", data)
    try:
        async with session.post(url + path, data=data, headers=headers) as resp:
            raw = await resp.read()  # parsed after the row: parsing 50 MB here would be the client's own stall
            return resp.status, raw[:400].decode(errors="replace") if resp.status != 200 else ""
    except (aiohttp.ClientError, OSError) as e:
        return 0, f"{type(e).__name__}: {e}"  # no answer: the connection died


async def _row(session, url: str, headers: dict, bodies: list, at_once: int, probes: bool | bytes, model: str) -> dict:
    statuses: list = [None] * len(bodies)
    todo = list(range(len(bodies)))
    probe_times: list[float] = []
    probe_statuses: Counter = Counter()

    async def worker():
        while todo:
            i = todo.pop(0)
            statuses[i] = await _send(session, url, headers, bodies[i])

    async def prober(done: asyncio.Event):
        plain = probes if isinstance(probes, bytes) else json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
        while not done.is_set():
            t0 = time.monotonic()
            probe_statuses[(await _send(session, url, headers, plain))[0]] += 1
            probe_times.append(time.monotonic() - t0)
            await asyncio.sleep(0.2)
    done = asyncio.Event()
    probing = asyncio.create_task(prober(done)) if probes else None
    await asyncio.gather(*(worker() for _ in range(at_once)))
    done.set()
    if probing is not None:
        await probing
    return {"statuses": dict(Counter(s for s, _ in statuses)), "errors": sorted({e for s, e in statuses if e})[:3],
            "slowest_probe_s": max(probe_times) if probe_times else None, "probe_statuses": dict(probe_statuses)}


async def red_team(url: str, api_key: str | None, model: str | None, scale: float) -> dict:
    url = url.rstrip("/")
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if model is None:
            async with session.get(url + "/v1/models", headers=headers) as resp:
                model = (await resp.json())["data"][0]["id"]
        vocab = await _vocab_size(session, url, headers, model)
        table = rows(model, vocab, scale)
        victim = Victim(url, model, api_key)
        victim.start()
        start = await _metrics(session, url)
        results = []
        try:
            for name, bodies, at_once, probes in table:
                before = await _metrics(session, url)
                t0 = time.monotonic()
                row = await _row(session, url, headers, bodies, at_once, probes, model)
                t1 = time.monotonic()
                after = await _metrics(session, url)
                gaps = await asyncio.to_thread(victim.gaps, t0, t1)
                at, new_stream = victim.worst_gap_start(t0, t1)
                row.update(name=name, requests=len(bodies), seconds=t1 - t0, worst_gap_s=max(gaps),
                           median_gap_s=statistics.median(gaps), worst_gap_at_s=at,
                           worst_gap_new_stream=new_stream, worst_running_gap_s=victim.worst_running_gap(t0, t1), victim_streams=sum(t0 <= s <= t1 for s in victim.starts),
                           rss_before_bytes=_rss(before), rss_after_bytes=_rss(after),
                           grammar_rss_after_bytes=_grammar_rss(after))
                results.append(row)
                print_row(row, file=sys.stderr)
        finally:
            victim.stop()
        end = await _metrics(session, url)
        # idle: nothing in flight, the server gives the allocator's free memory back (a trim half a
        # second after its last request, server/app.py); what it holds then is what the run left
        await asyncio.sleep(IDLE_WAIT_S)
        idle = await _metrics(session, url)
        async with session.get(url + "/health") as resp:
            healthy = resp.status == 200
    statuses = Counter()
    for r in results:
        statuses.update(r["statuses"])
        statuses.update(r.get("probe_statuses", {}))
    return {"url": url, "scale": scale, "rows": results, "healthy_after": healthy,
            "server_errors": sum(v for k, v in statuses.items() if k is not None and (k == 0 or k >= 500)),
            "worst_gap_s": max(r["worst_gap_s"] for r in results), "rss_start_bytes": _rss(start),
            "rss_end_bytes": _rss(end), "rss_idle_bytes": _rss(idle), "rss_growth_bytes": _rss(idle) - _rss(start),
            "grammar_rss_end_bytes": _grammar_rss(end), "grammar_rss_idle_bytes": _grammar_rss(idle)}


async def _vocab_size(session, url: str, headers: dict, model: str) -> int:
    """The vocabulary size, from the server's own answer to an id beyond any vocabulary."""
    data = json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                       "logit_bias": {str(2 ** 40): 1}}).encode()
    async with session.post(url + "/v1/chat/completions", data=data, headers=headers) as resp:
        text = await resp.text()
    match = re.search(r"vocabulary size (\d+)", text)
    return int(match.group(1)) if match else 152_064


def _codes(r: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items(), key=lambda kv: str(kv[0])))


def _probe_codes(r: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(r.get("probe_statuses", {}).items(), key=lambda kv: str(kv[0])))


def _gap(r: dict) -> str:
    """The worst gap, where in the row it began, and whether a new victim stream's start is in it."""
    where = "over a new stream's start" if r["worst_gap_new_stream"] else "in a running stream"
    return f"{r['worst_gap_s']:.3f} s at {r['worst_gap_at_s']:.1f} s, {where}"


def print_row(r: dict, file=sys.stdout) -> None:
    probe = f"; slowest probe {r['slowest_probe_s']:.2f} s ({_probe_codes(r)})" if r["slowest_probe_s"] is not None else ""
    print(f"row {r['name']}: {r['requests']} requests in {r['seconds']:.1f} s -> {_codes(r)}; victim's worst gap "
          f"{_gap(r)} (median {r['median_gap_s']:.3f} s; worst within a running stream "
          f"{r['worst_running_gap_s']:.3f} s; {r['victim_streams']} new streams); RSS "
          f"{r['rss_before_bytes'] / 2**20:.0f} -> {r['rss_after_bytes'] / 2**20:.0f} MiB{probe}", file=file, flush=True)


def verdict(report: dict) -> dict:
    """Each target of issue 28 and whether it was met."""
    return {"crashes": (0 if report["healthy_after"] else 1) <= TARGETS["crashes"],
            "server_errors": report["server_errors"] <= TARGETS["server_errors"],
            "worst_gap_s": report["worst_gap_s"] < TARGETS["worst_gap_s"],
            "rss_growth_bytes": report["rss_growth_bytes"] < TARGETS["rss_growth_bytes"]}


def print_report(report: dict) -> None:
    print("| row | requests | statuses | victim's worst gap: when, where | median gap | worst within a running "
          "stream | RSS before -> after (of it grammar processes) | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        probe = f" (slowest probe {r['slowest_probe_s']:.2f} s, {_probe_codes(r)})" if r["slowest_probe_s"] is not None else ""
        print(f"| {r['name']} | {r['requests']} | {_codes(r)} | {_gap(r)}{probe} | {r['median_gap_s']:.3f} s | "
              f"{r['worst_running_gap_s']:.3f} s | {r['rss_before_bytes'] / 2**20:.0f} -> "
              f"{r['rss_after_bytes'] / 2**20:.0f} MiB ({r['grammar_rss_after_bytes'] / 2**20:.0f}) | {r['seconds']:.1f} |")
    ok = verdict(report)
    mib = 2 ** 20
    print(f"\nserver alive after: {report['healthy_after']}; 5xx or dropped: {report['server_errors']}; worst victim gap "
          f"{report['worst_gap_s']:.3f} s; RSS (server and grammar processes) {report['rss_start_bytes'] / mib:.0f} MiB "
          f"at the start, {report['rss_end_bytes'] / mib:.0f} MiB at the last row's end, "
          f"{report['rss_idle_bytes'] / mib:.0f} MiB idle {IDLE_WAIT_S:.0f} s later "
          f"({report['rss_growth_bytes'] / mib:+.0f} MiB; {report['grammar_rss_idle_bytes'] / mib:.0f} MiB of it "
          f"grammar processes)")
    print("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in ok.items()))


def run_red_team(args) -> int:
    """`bench-serve --red-team`: against --url, or a `vlm-sdk serve` child process on --model."""
    from vlm_sdk.bench.serve import ServerProcess
    from vlm_sdk.demo_checkpoint import tiny_model_dir
    server, url = None, args.url
    if url is None:  # room for row 5: 16 sequences of 4,000 tokens beside the victim's
        engine_args = {"num_blocks": 5000, **({"device": args.device} if args.device else {})}
        server = ServerProcess(args.model or str(tiny_model_dir()), engine_args).__enter__()
        url = server.url
    try:
        report = asyncio.run(red_team(url, args.api_key if args.url else None, args.served_model,
                                      args.red_team_scale))
    finally:
        if server is not None:
            code = server.stop()
    if server is not None:
        report["server_exit_code"] = code
        report["healthy_after"] = report["healthy_after"] and code == 0
    if args.json:
        print(json.dumps({**report, "targets_met": verdict(report)}, indent=2))
    else:
        print_report(report)
    return 0 if all(verdict(report).values()) else 1
