"""Images preprocessed in worker processes (multimodal/pixel_workers.py, EngineArgs.preprocess_workers): the
same prompts as on the prompt's own thread for every family's image path; the bytes and patches cross
through shared memory and leave no file behind; a worker that dies holding an image fails that image
alone with a 400-class error, is replaced, and the other images are served."""
from __future__ import annotations

import io
import os
import signal
import threading
import time

import pytest
import torch
from PIL import Image

from helpers import conversations, image
from vlm_sdk.config import EngineArgs
from vlm_sdk.engine.input.processor import InputProcessor
from vlm_sdk.errors import InvalidImageError, InvalidRequestError
from vlm_sdk.model_loader import read_checkpoint
from vlm_sdk.models import registry
from vlm_sdk.models.common.qwen_vl.image_processor import Qwen2VLImageProcessor, qwen_image_pixels
from vlm_sdk.multimodal import shared_tensors
from vlm_sdk.multimodal.image_io import load_image, open_image
from vlm_sdk.multimodal.pixel_workers import PixelWorkers


def png(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def encoded(conv):
    """`conv` with every PIL image part as PNG bytes (what a server hands over: bytes go to a worker)."""
    def part(p):
        return {**p, "image": png(p["image"])} if isinstance(p, dict) and p.get("type") == "image" else p
    return [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m["content"], list) else m for m in conv]


def ours_left() -> list[str]:
    return [f for f in os.listdir(shared_tensors._directory()) if f.startswith(f"vlm-shm-{os.getpid()}-")]


@pytest.fixture(scope="module")
def workers():
    pool = PixelWorkers(2)
    yield pool
    pool.close()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl", "gemma3"])
def test_workers_build_the_prompts_the_thread_builds(family, tiny_checkpoints, workers):
    """Qwen-VL's, InternVL's and Gemma 3's image functions, each run in a worker: token ids, pixel bytes,
    grids and cache keys equal to those built in process, from the same encoded images."""
    ckpt = tiny_checkpoints(family)
    info = read_checkpoint(str(ckpt))
    inputs = InputProcessor(str(ckpt), info, registry.resolve([info.architecture]), EngineArgs())
    try:
        for name, conv in conversations().items():
            conv = encoded(conv)
            here = inputs.build_prompt(conv, check_fit=False)
            inputs.processor.pixel_workers = workers
            try:
                there = inputs.build_prompt(conv, check_fit=False)
            finally:
                inputs.processor.pixel_workers = None
            assert there.token_ids == here.token_ids, name
            assert len(there.images) == len(here.images), name
            for a, b in zip(there.images, here.images):
                assert a.data.dtype == b.data.dtype and torch.equal(a.data, b.data), name
                assert (a.num_tokens, a.meta, a.source_size, a.key) == (b.num_tokens, b.meta, b.source_size, b.key)
    finally:
        inputs.close()
    assert ours_left() == []


def test_an_error_in_a_worker_is_the_images_own(workers):
    """A corrupt image is refused in the worker with the same typed error and text as in process."""
    ip = Qwen2VLImageProcessor()
    data = png(image(64, 64, 5))[:-40]  # the end of the stream cut off
    with pytest.raises(InvalidImageError) as here:
        qwen_image_pixels(load_image(data), ip, ip.min_pixels, ip.max_pixels)
    with pytest.raises(InvalidImageError) as there:
        workers.run(open_image(data), 64_000_000, qwen_image_pixels, ip, ip.min_pixels, ip.max_pixels)
    assert str(there.value) == str(here.value) and "truncated" in str(there.value)
    assert ours_left() == []


def test_a_worker_that_dies_fails_its_image_alone(workers):
    """Killed while it decodes a 6000x6000 PNG (a decoder crash, the OOM killer): that image is refused
    with InvalidImageError (HTTP 400) naming the signal; the other worker's image is served meanwhile, and the
    next image on the dead one's slot goes to a new process with the same result as before."""
    ip = Qwen2VLImageProcessor()
    buf = io.BytesIO()
    Image.new("RGB", (6000, 6000), (10, 20, 30)).save(buf, format="PNG", compress_level=1)
    big = buf.getvalue()  # 0.5 MB that decode to 108 MB: seconds of decoding and resizing
    small = png(image(200, 120, 8))
    expected = workers.run(open_image(small), 64_000_000, qwen_image_pixels, ip, ip.min_pixels, ip.max_pixels)
    before = set(workers.pids())
    outcome = {}

    def hostile():
        try:
            workers.run(open_image(big), 64_000_000, qwen_image_pixels, ip, ip.min_pixels, ip.max_pixels)
            outcome["hostile"] = "served"
        except InvalidImageError as e:
            outcome["hostile"] = e
    thread = threading.Thread(target=hostile)
    thread.start()
    deadline = time.monotonic() + 60
    while not workers.busy_pids() and time.monotonic() < deadline:
        time.sleep(0.005)
    victim = workers.busy_pids()[0]
    time.sleep(0.05)  # inside the decode: a 36-megapixel PNG takes ~2 s on a quiet core
    os.kill(victim, signal.SIGKILL)
    other = workers.run(open_image(small), 64_000_000, qwen_image_pixels, ip, ip.min_pixels, ip.max_pixels)
    thread.join(60)
    error = outcome["hostile"]
    assert isinstance(error, InvalidImageError) and isinstance(error, InvalidRequestError)  # the server's 400
    assert "SIGKILL" in str(error) and "refused" in str(error)
    assert torch.equal(other[0], expected[0]) and other[1:] == expected[1:]
    # both slots serve again; the dead process was replaced by a new one
    again = [workers.run(open_image(small), 64_000_000, qwen_image_pixels, ip, ip.min_pixels, ip.max_pixels)
             for _ in range(3)]
    assert all(torch.equal(r[0], expected[0]) and r[1:] == expected[1:] for r in again)
    assert victim not in workers.pids() and len(set(workers.pids()) - before) == 1
    assert ours_left() == []


def test_shared_tensors_cross_as_pages_not_copies():
    """A tensor that comes back views its shared pages (writable, no copy made by the pipe) and its file is
    gone once mapped; a small one is pickled inline."""
    big = torch.arange(10_000, dtype=torch.int32).view(100, 100)
    value = shared_tensors.loads(shared_tensors.dumps({"big": big, "small": torch.ones(3)}))
    assert torch.equal(value["big"], big) and torch.equal(value["small"], torch.ones(3))
    blob = shared_tensors.dumps(big)
    assert len(blob) < 1024  # the pickle holds a name, not 40,000 bytes
    assert torch.equal(shared_tensors.loads(blob), big)
    assert ours_left() == []
