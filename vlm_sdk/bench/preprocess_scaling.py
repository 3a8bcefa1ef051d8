"""Image preprocessing throughput with 1, 2, 4 worker processes, against transformers' on the same images
(issue 49: `bench-serve --flood` prints it; target: 2 workers >= 1.7x one on 2 cores, and >= transformers').

Every figure is images/s of the family's image preprocessing as a prompt build runs it
(`PromptProcessor.preprocess_image`: the image part's checks, its decode, resize and patchify, the cache
key; no template or tokenizer, which stay on the prompt thread whatever the workers), the images as
encoded bytes (what a server holds after its base64 decode), from as many threads as there are workers
(AsyncLLM's image pool has a thread per worker):

    in process, 1 thread        preprocess_workers 0: today's path on one prompt thread
    in process, 2 threads       preprocess_workers 0 on two threads (PIL releases the GIL in its decoder
                                and resize; the rest holds it)
    N workers                   preprocess_workers N, N threads
    transformers                decode (PIL, RGB) and the family's transformers image processor, one image
                                a call on one thread: what a server built on it does per image

Each row preprocesses every image once after one warm-up image per thread (the workers' imports are not
timed). The machine's load average is printed with the figures: on a shared machine they drift.
"""
from __future__ import annotations

import io
import os
import threading
import time


def _rate(inputs, images: list[bytes], threads: int) -> float:
    """images/s building one-image prompts of `images` from `threads` threads, each taking the next image."""
    from vlm_sdk.multimodal.messages import ImageRef

    def one(data: bytes):
        inputs.processor.preprocess_image(ImageRef(data))
    for data in images[:threads]:  # warm up: worker imports, first-call caches
        one(data)
    lock, next_index = threading.Lock(), [0]
    errors: list[BaseException] = []

    def work():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(images):
                return
            try:
                one(images[i])
            except BaseException as e:  # reported, not swallowed
                errors.append(e)
                return
    pool = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
    return len(images) / (time.perf_counter() - t0)


def _transformers_rate(model_dir: str, images: list[bytes]) -> tuple[float | None, str]:
    """images/s of the checkpoint's transformers image processor (AutoImageProcessor, its PIL backend where
    there is one), decode included, one image a call; None with the reason when transformers cannot load it."""
    from PIL import Image
    try:
        from transformers import AutoImageProcessor
        try:
            proc = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        except (TypeError, ValueError):
            proc = AutoImageProcessor.from_pretrained(model_dir)
    except Exception as e:  # transformers' own refusal, reported in the output
        return None, f"{type(e).__name__}: {e}"

    def one(data: bytes):
        return proc(Image.open(io.BytesIO(data)).convert("RGB"), return_tensors="pt")
    one(images[0])
    t0 = time.perf_counter()
    for data in images:
        one(data)
    return len(images) / (time.perf_counter() - t0), type(proc).__name__


def preprocess_scaling(model_dir: str, images: list[bytes], workers: tuple[int, ...] = (1, 2, 4)) -> dict:
    """The rows of the module docstring, as {"rows": {name: images/s}, "ratios": ..., "load_average": ...}."""
    from vlm_sdk.config import EngineArgs
    from vlm_sdk.engine.input.processor import InputProcessor
    from vlm_sdk.model_loader import read_checkpoint
    from vlm_sdk.models import registry
    info = read_checkpoint(model_dir)
    family = registry.resolve([info.architecture])
    rows: dict[str, float | None] = {}
    load = [os.getloadavg()]
    inputs = InputProcessor(model_dir, info, family, EngineArgs())
    try:
        rows["in process, 1 thread"] = _rate(inputs, images, 1)
        rows["in process, 2 threads"] = _rate(inputs, images, 2)
    finally:
        inputs.close()
    for n in workers:
        inputs = InputProcessor(model_dir, info, family, EngineArgs(preprocess_workers=n))
        try:
            rows[f"{n} worker{'s' if n > 1 else ''}"] = _rate(inputs, images, n)
        finally:
            inputs.close()
    rows["transformers"], theirs = _transformers_rate(model_dir, images)
    load.append(os.getloadavg())
    one, two = rows.get("1 worker"), rows.get("2 workers")
    ratios = {"2_workers_over_1": None if not (one and two) else two / one,
              "2_workers_over_transformers": None if not (two and rows["transformers"]) else two / rows["transformers"],
              "2_workers_over_in_process_1_thread": None if not two else two / rows["in process, 1 thread"]}
    return {"images": len(images), "transformers_processor": theirs, "rows": rows, "ratios": ratios,
            "targets": {"2_workers_over_1": 1.7, "2_workers_over_transformers": 1.0},
            "cpu_count": os.cpu_count(), "load_average": load}


def print_scaling(report: dict, what: str) -> None:
    print(f"  image preprocessing, {report['images']} {what} (images/s; transformers: "
          f"{report['transformers_processor']}; load average {report['load_average'][0][0]:.1f} -> "
          f"{report['load_average'][1][0]:.1f} on {report['cpu_count']} cores):")
    for name, rate in report["rows"].items():
        print(f"    {name:24} {'n/a' if rate is None else format(rate, '8.1f')}")
    r = report["ratios"]

    def g(k):
        return "n/a" if r[k] is None else f"{r[k]:.2f}x"
    print(f"    2 workers / 1 worker {g('2_workers_over_1')} (target >= 1.7x), 2 workers / transformers "
          f"{g('2_workers_over_transformers')} (target >= 1x), 2 workers / in process on 1 thread "
          f"{g('2_workers_over_in_process_1_thread')}")
