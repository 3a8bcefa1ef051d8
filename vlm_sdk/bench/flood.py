"""`vlm-sdk bench-serve --flood`: text users beside an image (and a video) flood, against one server.

The victims are a steady, open-loop stream of short text chat requests (one every
`--flood-victim-interval` seconds, streamed, greedy, `--max-tokens` with eos ignored); the flood is
`--flood-concurrency` requests always in flight, each a distinct image (or video) the encoder and
prefix caches have not seen, so that every one costs preprocessing, the vision tower and its prefill.
Five phases of `--flood-seconds` each, in one run on one server (`vlm-sdk serve` in a child process on
`--model`, default the ~100M random bench checkpoint, or `--url`):

    victims alone | image flood alone | image flood + victims | video flood alone | video flood + victims

and the report: the victims' TTFT and TPOT p50 / p99 alone and during each flood, the floods' images/s
(frames/s for video: each sampled frame is an image's worth of work) alone and beside the victims, and
the ratios (during / alone) against issue 49's targets: p99 TTFT <= 3x, p99 TPOT <= 2x, flood
throughput >= 0.85x. Before the phases (with `--model`), the image preprocessing rows: images/s with 1, 2, 4
worker processes against in-process and transformers' image processor (bench/preprocess_scaling.py). A flood phase first warms up for `--flood-warmup` seconds (the queue fills), then its
seconds count: completions are counted inside the window, the victims arrive inside it.
A flood request still open at a phase's end is cancelled (its client hangs up; the server aborts it).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import sys
import time

TARGETS = {"ttft_p99_ratio": 3.0, "tpot_p99_ratio": 2.0, "flood_throughput_ratio": 0.85}
VICTIM_TEXT = "Tell me a short story about a lighthouse keeper."


def flood_images(count: int, size: int, seed: int) -> list[bytes]:
    """`count` distinct JPEGs of `size` x `size` noise (distinct pixels: no cache serves one twice)."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        pixels = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def flood_videos(count: int, frames: int, size: int, seed: int) -> list[bytes]:
    """`count` distinct short MP4s of `frames` noise frames, `size` x `size`, 4 fps."""
    import av
    import numpy as np
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        buf = io.BytesIO()
        with av.open(buf, "w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=4)
            stream.width, stream.height, stream.pix_fmt = size, size, "yuv420p"
            for _ in range(frames):
                pixels = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
                for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        out.append(buf.getvalue())
    return out


def _body(model: str, part: dict, max_tokens: int) -> bytes:
    return json.dumps({"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                       "messages": [{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}]
                       }).encode()


def image_bodies(model: str, images: list[bytes], max_tokens: int) -> list[bytes]:
    return [_body(model, {"type": "image_url", "image_url": {
        "url": "data:image/jpeg;base64," + base64.b64encode(im).decode()}}, max_tokens) for im in images]


def video_bodies(model: str, videos: list[bytes], max_tokens: int, nframes: int) -> list[bytes]:
    return [_body(model, {"type": "video_url", "video_url": {
        "url": "data:video/mp4;base64," + base64.b64encode(v).decode(), "nframes": nframes}}, max_tokens)
        for v in videos]


async def _flood(session, url: str, headers: dict, bodies: list[bytes], concurrency: int,
                 stop: asyncio.Event, done: list[float], errors: list[str], sent: list[int]) -> None:
    """`concurrency` senders, each posting the next body as soon as its last is answered, until `stop`;
    `done` gets the finish time of each answered request (200), `sent[0]` the requests sent."""
    counter = iter(range(10 ** 9))

    async def sender():
        while not stop.is_set():
            i = next(counter)
            body = bodies[i % len(bodies)]
            async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as resp:
                await resp.read()
                if resp.status == 200:
                    done.append(time.perf_counter())
                elif len(errors) < 3:
                    errors.append(f"{resp.status}: {(await resp.text())[:200]}")
    tasks = [asyncio.ensure_future(sender()) for _ in range(concurrency)]
    await stop.wait()
    sent[0] = next(counter)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def victim_stream(session, url: str, headers: dict, model: str, max_tokens: int) -> tuple[float, float | None]:
    """One streamed text request: (TTFT, TPOT) in seconds, timed by the chunks that carry a token (with
    `logprobs` every token has its chunk, whether or not it decodes to text: a random checkpoint's
    tokens mostly do not). TPOT is None below two tokens."""
    body = {"model": model, "messages": [{"role": "user", "content": VICTIM_TEXT}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0.0, "logprobs": True}
    t0, times = time.perf_counter(), []
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"victim: {resp.status}: {(await resp.text())[:200]}")
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"logprobs":{' in line:
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("victim: no token came back")
    return times[0] - t0, (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


async def _victims(session, url: str, headers: dict, model: str, seconds: float, interval: float,
                   max_tokens: int) -> list:
    """One text request every `interval` seconds for `seconds` (open loop: arrivals do not wait for answers)."""
    tasks, t0 = [], time.perf_counter()
    for i in range(max(1, int(seconds / interval))):
        await asyncio.sleep(max(0.0, t0 + i * interval - time.perf_counter()))
        tasks.append(asyncio.ensure_future(victim_stream(session, url, headers, model, max_tokens)))
    return await asyncio.gather(*tasks, return_exceptions=True)


def _victim_figures(results: list) -> dict:
    from vlm_sdk.bench.serve import _dist
    ok = [r for r in results if isinstance(r, tuple)]
    errors = [f"{type(r).__name__}: {r}" for r in results if not isinstance(r, tuple)]
    return {"requests": len(results), "failed": len(errors), "errors": errors[:3],
            "ttft_ms": _dist([r[0] for r in ok]), "tpot_ms": _dist([r[1] for r in ok if r[1] is not None])}


async def _phase(url: str, headers: dict, model: str, bodies: list[bytes] | None, per_body: int, victims: bool,
                 args) -> dict:
    """One phase: a flood of `bodies` (None: no flood) and/or the victims; `per_body`: images per request."""
    import aiohttp
    out: dict = {}
    stop, done, errors, sent = asyncio.Event(), [], [], [0]
    flood = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        if bodies is not None:
            flood = asyncio.ensure_future(_flood(session, url, headers, bodies, args.flood_concurrency, stop, done,
                                                 errors, sent))
            await asyncio.sleep(args.flood_warmup)
        t0 = time.perf_counter()
        if victims:
            out["victims"] = _victim_figures(await _victims(session, url, headers, model, args.flood_seconds,
                                                            args.flood_victim_interval, args.max_tokens))
        else:
            await asyncio.sleep(args.flood_seconds)
        t1 = time.perf_counter()
        if flood is not None:
            counted = sum(1 for t in done if t0 <= t <= t1)
            stop.set()
            await flood
            out["flood"] = {"completed": counted, "seconds": t1 - t0, "requests_per_s": counted / (t1 - t0),
                            "images_per_s": counted * per_body / (t1 - t0), "errors": errors,
                            # more sent than distinct bodies: some repeated, and a cache may have served them
                            "repeated": sent[0] > len(bodies)}
    await asyncio.sleep(min(1.0, args.flood_warmup))  # the aborted requests leave the engine
    return out


async def flood_run(url: str, api_key: str | None, model: str | None, args) -> dict:
    """The five phases in order, on one server; each phase's figures are also printed as it ends."""
    import aiohttp
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    model = model or await _first_model(url, headers)
    async with aiohttp.ClientSession() as session:  # warm-up
        await victim_stream(session, url, headers, model, 2)

    def images(seed: int) -> list[bytes]:
        return image_bodies(model, flood_images(args.flood_distinct, args.flood_image_size, seed),
                            args.flood_max_tokens)

    def videos(seed: int) -> list[bytes]:
        return video_bodies(model, flood_videos(max(4, args.flood_distinct // 4), args.flood_video_frames,
                                                args.flood_video_size, seed), args.flood_max_tokens,
                            args.flood_video_frames)
    # each phase its own images (seeded apart): one phase's are in the encoder and prefix caches for the next
    phases = [("victims_alone", None, 1, True), ("image_flood_alone", images, 1, False),
              ("image_flood_with_victims", images, 1, True)]
    if args.flood_video_frames:
        phases += [("video_flood_alone", videos, args.flood_video_frames, False),
                   ("video_flood_with_victims", videos, args.flood_video_frames, True)]
    report = {"phases": {}}
    for seed, (name, make, per_body, victims) in enumerate(phases):
        bodies = None if make is None else make(seed)
        report["phases"][name] = await _phase(url, headers, model, bodies, per_body, victims, args)
        print(f"  [{name}] {json.dumps(report['phases'][name], default=str)}", file=sys.stderr, flush=True)
    return report


async def _first_model(url: str, headers: dict) -> str:
    import aiohttp
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/models", headers=headers) as resp:
            return (await resp.json())["data"][0]["id"]


def ratios(report: dict) -> dict:
    """during / alone, per flood kind, with each target's verdict."""
    p = report["phases"]
    alone = p["victims_alone"]["victims"]
    out = {}
    for kind in ("image", "video"):
        during, flood_alone = p.get(f"{kind}_flood_with_victims"), p.get(f"{kind}_flood_alone")
        if during is None:
            continue
        v = during["victims"]

        def ratio(a, b):
            return None if a is None or not b else a / b
        r = {"ttft_p99_ratio": ratio(v["ttft_ms"]["p99"], alone["ttft_ms"]["p99"]),
             "tpot_p99_ratio": ratio(v["tpot_ms"]["p99"], alone["tpot_ms"]["p99"]),
             "ttft_p50_ratio": ratio(v["ttft_ms"]["p50"], alone["ttft_ms"]["p50"]),
             "tpot_p50_ratio": ratio(v["tpot_ms"]["p50"], alone["tpot_ms"]["p50"]),
             "flood_throughput_ratio": ratio(during["flood"]["images_per_s"], flood_alone["flood"]["images_per_s"])}
        r["meets"] = {k: (r[k] is not None and (r[k] >= t if k == "flood_throughput_ratio" else r[k] <= t))
                      for k, t in TARGETS.items()}
        out[kind] = r
    return out


def run_flood(args) -> int:
    """`bench-serve --flood`: against --url, or a `vlm-sdk serve` child process on --model."""
    import os
    from vlm_sdk.bench.device_share import bench_device
    from vlm_sdk.bench.serve import ServerProcess
    from vlm_sdk.demo_checkpoint import tiny_model_dir
    model_dir = args.model or (None if args.url else str(tiny_model_dir("bench")))
    engine_args = {"device": bench_device(args.device), **dict(kv.split("=", 1) for kv in args.flood_engine_arg)}
    scaling = None
    if args.flood_preprocess_images and model_dir is not None:  # before the server: nothing else runs beside it
        from vlm_sdk.bench.preprocess_scaling import preprocess_scaling
        scaling = preprocess_scaling(model_dir, flood_images(args.flood_preprocess_images, args.flood_preprocess_size,
                                                            seed=1000),
                                     tuple(int(n) for n in args.flood_preprocess_workers.split(",") if n.strip()))
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            url = stack.enter_context(ServerProcess(model_dir, engine_args)).url
        report = asyncio.run(flood_run(url.rstrip("/"), args.api_key if args.url else None, args.served_model, args))
    report.update({"url": url, "model": model_dir, "engine_args": engine_args, "load_average": os.getloadavg(),
                   "settings": {k: getattr(args, k) for k in ("flood_seconds", "flood_concurrency",
                                                              "flood_victim_interval", "flood_image_size",
                                                              "flood_video_frames", "flood_video_size",
                                                              "max_tokens", "flood_max_tokens")},
                   "ratios": ratios(report), "preprocessing": scaling})
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print(report)
        if scaling is not None:
            from vlm_sdk.bench.preprocess_scaling import print_scaling
            print_scaling(scaling, f"{args.flood_preprocess_size}px JPEGs")
    return 0


def _print(r: dict) -> None:
    def f(x) -> str:
        return "   n/a" if x is None else f"{x:7.1f}"
    s = r["settings"]
    print(f"bench-serve --flood {r['url']} ({r['model']}, {r['engine_args']}): victims 1 per "
          f"{s['flood_victim_interval']} s x {s['max_tokens']} tokens; floods {s['flood_concurrency']} in flight, "
          f"{s['flood_image_size']}px images / {s['flood_video_frames']}-frame {s['flood_video_size']}px videos; "
          f"{s['flood_seconds']} s per phase; load average at the end {r['load_average']}")
    print(f"  {'phase':26} TTFT ms p50 / p99    TPOT ms p50 / p99    flood images/s")
    for name, p in r["phases"].items():
        v, fl = p.get("victims"), p.get("flood")
        lat = (f"{f(v['ttft_ms']['p50'])} / {f(v['ttft_ms']['p99'])}   {f(v['tpot_ms']['p50'])} / "
               f"{f(v['tpot_ms']['p99'])}") if v else " " * 39
        print(f"  {name:26} {lat}   {'' if fl is None else format(fl['images_per_s'], '8.2f')}")
    for kind, x in r["ratios"].items():
        def g(k):
            return "n/a" if x[k] is None else f"{x[k]:.2f}x"
        print(f"  {kind} flood: p99 TTFT {g('ttft_p99_ratio')} (target <= 3x), p99 TPOT {g('tpot_p99_ratio')} "
              f"(<= 2x), throughput {g('flood_throughput_ratio')} (>= 0.85x); p50 TTFT {g('ttft_p50_ratio')}, "
              f"p50 TPOT {g('tpot_p50_ratio')}")
