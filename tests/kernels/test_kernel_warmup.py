"""The start-up warm-up (vlm_sdk/worker/kernel_warmup.py): its steps stay within the engine's limits
and reach every kernel variant; on the CPU it runs the tiny model through the Triton kernels (the
interpreter) and launches each kernel in each of its constexpr variants; on CUDA, after it, a varied
workload compiles nothing."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

from aot_compile import JitKeys, kernel_functions
from helpers import conversations
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.worker.kernel_warmup import run_warmup, warmup_steps


@pytest.mark.parametrize("max_model_len,max_tokens,cache_tokens", [
    (32768, 8192, 10 ** 6), (4096, 2048, 1024), (100, 8192, 10 ** 6), (40, 40, 64)])
def test_steps_fit_the_limits_and_cover_both_tiles(max_model_len, max_tokens, cache_tokens):
    steps = warmup_steps(max_model_len, max_tokens, cache_tokens)
    limit = min(max_model_len, cache_tokens)
    for s in steps:
        assert len(s.query_lens) == len(s.seq_lens)
        assert all(0 < q <= n <= limit for q, n in zip(s.query_lens, s.seq_lens)), s
        assert sum(s.query_lens) <= max_tokens, s
    prefill = [max(s.query_lens) for s in steps if max(s.query_lens) > 1]
    assert min(prefill) <= 64  # the 64-row tile (kernels/flash_config.py)
    if min(limit, max_tokens) > 65:
        assert max(prefill) > 64  # and the 128-row one
    mixed = [s for s in steps if 1 in s.query_lens and max(s.query_lens) > 1]
    assert mixed
    decode = [s for s in steps if max(s.query_lens) == 1]
    assert min(max(s.seq_lens) for s in decode) == 1  # one split: the direct write
    if limit >= 1024:
        assert max(max(s.seq_lens) for s in decode) >= 1024  # split (>= 256 keys a split) + merge


class _Spy:
    """Records each launch of a kernel (its constexprs and JIT cache key), then runs it unless
    `mode["run"]` is False: a JIT key is Triton's binder on the launch arguments (shapes, dtypes, ints),
    never the tensors' values, so a pass that only has to reveal keys need not run the interpreter."""

    def __init__(self, fn, sink: list, key: JitKeys, mode: dict):
        self.fn, self.sink, self.key, self.mode = fn, sink, key, mode

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append((self.fn.__name__, kwargs, self.key(self.fn, args, kwargs)))
            if self.mode["run"]:
                return self.fn[grid](*args, **kwargs)
        return launch


def test_warmup_runs_every_text_kernel_variant_cpu(tiny_ckpt, monkeypatch):
    """The warm-up launches every text kernel in each constexpr variant; after it and the largest-image
    encode of the CUDA memory profile, serving text and image prompts (one chunked beside decodes) adds
    no JIT cache key (Triton's CUDA binder on the real launch arguments): nothing would compile."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    llm = LLM(tiny_ckpt, device="cpu", attention_backend="triton", max_num_seqs=4, num_blocks=64,
              max_num_batched_tokens=64, show_progress=False)
    launches: list = []
    key = JitKeys()
    mode = {"run": True}
    for name, fn in kernel_functions().items():
        module, attr = name.split(".")
        monkeypatch.setattr(importlib.import_module(f"vlm_sdk.kernels.{module}"), attr,
                            _Spy(fn, launches, key, mode))
    seconds = run_warmup(local_worker(llm.engine).runner, max_model_len=llm.engine.scheduler_config.max_model_len,
                         max_num_batched_tokens=64)
    assert seconds > 0
    seen = {name for name, _, _ in launches}
    # the decoder rotates and stores K/V in one kernel; the vision tower's rotary comes with its encode below
    assert seen == {"_decode_split_kernel", "_decode_merge_kernel", "_paged_prefill_kernel", "_rotary_store_kv_kernel",
                    "_rms_norm_kernel", "_silu_and_mul_kernel"}
    assert {kw["DIRECT"] for name, kw, _ in launches if name == "_decode_split_kernel"} == {True, False}
    assert {kw["HAS_RESIDUAL"] for name, kw, _ in launches if name == "_rms_norm_kernel"} == {True, False}

    # what the CUDA memory profile runs before the warm-up: the largest image through the vision tower (the
    # profile's item may be a video's 768-token patch; the prompts served below have images only, and that
    # patch would triple the interpreter's time). Its keys only: interpreting a ~1,000-patch tower took 2/3
    # of this test; the image served below runs its kernels for real.
    mode["run"] = False
    local_worker(llm.engine).runner.model.encode_images([llm.engine.inputs.processor.largest_still_image()])
    mode["run"] = True
    warm = {k for _, _, k in launches}
    launches.clear()
    convs = conversations()
    llm.chat([convs["text"], convs["one_image"], convs["text"]],  # the image prompt (112 tokens) is chunked
             [SamplingParams(max_tokens=n, temperature=0.0) for n in (2, 3, 5)])
    new = {k for name, _, k in launches if k not in warm}
    assert not new, "\n".join(map(str, sorted(new)))


def _compiled_variants() -> int:
    """Kernels compiled in this process so far: the JIT caches of every kernel, every device."""
    return sum(len(cache[0]) for fn in kernel_functions().values() for cache in fn.device_caches.values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_no_compilation_after_warmup_cuda(tiny_ckpt, enforce_eager):
    """Start an engine (memory profile, graph capture, warm-up), then serve a varied workload: batches of
    1 to 12 requests (8 at a time), prompts of 42 to 1119 tokens (block tables 3 to 75 blocks wide), one
    and two images, outputs of 3 to 51 tokens, the long prompt chunked (256-token budget) beside decodes;
    decode steps from CUDA graphs, or eagerly at every batch size."""
    llm = LLM(tiny_ckpt, device="cuda", dtype="bfloat16", attention_backend="triton", max_num_seqs=8,
              max_num_batched_tokens=256, enforce_eager=enforce_eager, show_progress=False)
    after_start = _compiled_variants()
    assert after_start > 0
    convs = conversations()
    text, image, images = convs["text"], convs["one_image"], convs["two_images"]
    long_text = [{"role": "user", "content": "count: " + " ".join(str(i) for i in range(300))}]
    for batch, max_tokens in ((1, 3), (2, 40), (5, 17), (8, 9), (12, 5)):
        chosen = [[text, image, images, long_text][i % 4] for i in range(batch)]
        llm.chat(chosen, [SamplingParams(max_tokens=max_tokens + i, temperature=0.0) for i in range(batch)])
    assert _compiled_variants() == after_start, "Triton compiled new kernel variants while serving"
