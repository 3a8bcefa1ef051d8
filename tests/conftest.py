"""Shared fixtures: tiny Qwen2.5-VL and InternVL checkpoints with random weights, built once per test session."""
from __future__ import annotations

import os
from pathlib import Path

import torch

# Triton kernels run on the CPU only in the interpreter, which is chosen when a kernel is defined:
# set before anything imports vlm_sdk.kernels. A GPU machine runs them compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from vlm_sdk.models.registry import family_names
from vlm_sdk.testing import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """`get(family)`: that family's default tiny checkpoint, built once per session."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{family}"), family=family)
        return built[family]
    return get


@pytest.fixture(scope="session", params=family_names())
def family_ckpt(request, tiny_checkpoints) -> tuple[str, Path]:
    """(family name, its tiny checkpoint) for every registered family: tests of shared behaviour."""
    return request.param, tiny_checkpoints(request.param)


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_checkpoints) -> Path:
    """Default tiny checkpoint (Qwen2.5-VL): transformers 5 layout, one safetensors file, float32."""
    return tiny_checkpoints("qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_ckpt_flat(tmp_path_factory) -> Path:
    """Same weights (same seed) in the published layout: flat config.json with rope_scaling mrope,
    min_pixels/max_pixels preprocessor config, safetensors sharded into several files + index.json."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt_flat"), config_layout="flat",
                                preprocessor_layout="flat", max_shard_size="200KB")


@pytest.fixture(scope="session")
def internvl_ckpt(tiny_checkpoints) -> Path:
    """Tiny InternVL in transformers' layout (InternVLForConditionalGeneration, Qwen2 LLM), max_num 6."""
    return tiny_checkpoints("internvl")


@pytest.fixture(scope="session")
def internvl_original_ckpt(tmp_path_factory) -> Path:
    """The same weights renamed and repacked into the original InternVLChatModel layout."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("internvl_original"), family="internvl", layout="original")


@pytest.fixture(scope="session")
def internvl_llama_ckpt(tmp_path_factory) -> Path:
    """transformers' layout with a Llama LLM (how transformers converts InternLM2-based InternVL2)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("internvl_llama"), family="internvl", llm="llama")


@pytest.fixture(scope="session")
def internvl_internlm2_ckpt(tmp_path_factory) -> Path:
    """The Llama weights above in the original layout with an InternLM2 LLM (packed, grouped wqkv)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("internvl_internlm2"), family="internvl", layout="original",
                                llm="llama")


@pytest.fixture(scope="session")
def gemma3_ckpt(tiny_checkpoints) -> Path:
    """Tiny Gemma 3: two sliding-window layers (window 12) and a global one, 16 tokens per image."""
    return tiny_checkpoints("gemma3")


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster of 2 CPUs for one test module (start-up takes seconds: share it), left at
    the module's end. Skipped where Ray is not installed (a test dependency: pyproject's test extra).
    It also declares 2 GPUs, which are only Ray's resource counts (nothing here runs on CUDA unless the
    machine has it): what tests of GPU placement need."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def _ray_memory_monitor(request):
    """On a local Ray cluster: skip, with Ray's reason, when the node is past Ray's memory threshold
    (tests/ray_memory.py); the raylet log's size is kept so that a kill during the test is seen."""
    if "local_ray" not in request.fixturenames:
        yield
        return
    import ray_memory
    request.getfixturevalue("local_ray")
    reason = ray_memory.over_threshold()
    if reason:
        pytest.skip(reason)
    request.node.ray_log_sizes = ray_memory.log_sizes()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test on Ray that failed while Ray's memory monitor killed a worker is reported as skipped,
    with the monitor's own line: the machine ran out of memory, the code was not shown wrong."""
    outcome = yield
    report = outcome.get_result()
    sizes = getattr(item, "ray_log_sizes", None)
    if sizes is None or not report.failed or call.when != "call":
        return
    import ray_memory
    error = str(call.excinfo.value) if call.excinfo is not None else ""
    reason = ray_memory.kill_since(sizes, error) or ray_memory.over_threshold()
    if reason:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")


# Debian's chromium, driven by playwright: the web sample's and the plan pictures' tests
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    """A headless chromium for the module's pages; skipped, naming the install, where it is missing."""
    if not os.path.exists(CHROMIUM):  # `./run test` installs it when run as root on Debian, and says so
        pytest.skip(f"{CHROMIUM} is missing: these tests drive Debian's chromium; install it with "
                    f"`apt-get install -y chromium` (as root: `./run test` does)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()
