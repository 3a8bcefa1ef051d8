"""The engine/worker seam: the scheduler hands the model runner plain data, the worker keeps its own
per-request state and an encoder cache keyed by (request, image), and frees both when told."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import conversations, full_attention_cache
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.config import SchedulerConfig
from vlm_sdk.engine.core.scheduler import Scheduler
from vlm_sdk.engine.core.sequence import Sequence
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.protocol.scheduler_output import NO_IDS, CachedRequestData, NewRequestData, SchedulerOutput

PLAIN = (int, str, float, bool, type(None), torch.Tensor, SamplingParams)


def _assert_plain(value, path="out"):
    """Only ints/strings/lists/dicts/tensors/frozen dataclasses: no engine object reaches the worker."""
    if dataclasses.is_dataclass(value):
        assert not isinstance(value, Sequence), path
        for f in dataclasses.fields(value):
            _assert_plain(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(value):
            _assert_plain(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _assert_plain(k, path), _assert_plain(v, f"{path}[{k!r}]")
    else:
        assert isinstance(value, PLAIN), f"{path} is a {type(value).__name__}"


def _seq(name, n_prompt):
    return Sequence(name, PromptInputs(token_ids=list(range(n_prompt))), SamplingParams(max_tokens=100))


def _run(s: Scheduler) -> SchedulerOutput:
    """Schedule, convert for the worker, then do the engine's postprocess (one sampled token = 7)."""
    batch = s.schedule()
    out = s.worker_input(batch)
    _assert_plain(out)
    for seq, n in batch.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return out


def test_scheduler_sends_new_then_only_changes_then_frees():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64,
                                  max_model_len_source="test"), full_attention_cache(5, 4))
    a, b = _seq("a", 5), _seq("b", 4)
    s.add(a), s.add(b)
    out = _run(s)  # a's 5 prompt tokens, then 1 of b's
    assert [n.request_id for n in out.new_requests] == ["a", "b"] and not out.cached_requests
    assert out.num_scheduled_tokens == {"a": 5, "b": 1}
    first = out.new_requests[0]
    assert isinstance(first, NewRequestData) and first.prompt_token_ids == [0, 1, 2, 3, 4]
    assert first.output_token_ids == [] and first.block_ids == ([0, 1],) and first.num_computed_tokens == 0
    out = _run(s)  # a decodes its sampled token 7; b continues its prefill
    assert not out.new_requests and out.num_scheduled_tokens == {"a": 1, "b": 3}
    # nothing added: the shared empty NO_IDS, not a new list per request per step
    assert out.cached_requests == [CachedRequestData("a", NO_IDS, 5, [7]), CachedRequestData("b", NO_IDS, 1, NO_IDS)]
    # a grows past its blocks while b holds 2 of the 5: the pool runs dry and b (the latest) is preempted
    for _ in range(20):
        out = _run(s)
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == {"b"} and "b" not in out.num_scheduled_tokens
    while "b" not in out.num_scheduled_tokens:
        s.finish(a, "stop") if a.num_tokens >= 12 else None
        out = _run(s)
    resumed = [n for n in out.new_requests if n.request_id == "b"][0]  # recompute from token 0
    assert resumed.num_computed_tokens == 0 and resumed.prompt_token_ids == [0, 1, 2, 3]
    assert resumed.output_token_ids == b.output_token_ids[:len(resumed.output_token_ids)]
    assert "a" in out.finished_request_ids  # finished since the last step: the worker frees it
    assert not _run(s).finished_request_ids  # said once


@pytest.fixture(scope="module")
def chunky(tiny_ckpt):
    return LLM(tiny_ckpt, max_num_batched_tokens=13, show_progress=False)


def test_images_encoded_once_per_request_and_dropped_after_prefill(chunky):
    runner = local_worker(chunky.engine).runner
    encode, calls, sizes = runner.model.encode_images, [], []

    def counting(images):
        calls.append(len(images))
        return encode(images)

    convs = [conversations()["two_images"], conversations()["one_image"]]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine = chunky.engine
    prompts = [engine.build_prompt(c) for c in convs]
    runner.model.encode_images = counting
    try:
        for p in prompts:
            engine.add_request(p, params)
        while engine.has_unfinished():
            engine.step()
            sizes.append(sum(len(s.image_embeds) for s in runner.requests.values()))
    finally:
        del runner.model.encode_images
    # prefill is chunked 13 tokens at a time, yet every image went through the tower once
    assert sum(calls) == 3
    assert max(sizes) > 0 and sizes[-1] == 0  # entries live only while prefill still needs them
    engine.step()  # nothing left to run: the worker is told of the finished requests and frees them
    assert not runner.requests
    assert len(runner.encoder_cache) == 3  # kept for reuse by image key, held by no request


def test_seeded_sampling_survives_preemption(tiny_ckpt):
    """A preempted request recomputes; its own generator continues as if nothing happened."""
    convs = list(conversations().values())
    params = [SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True, seed=100 + i)
              for i in range(len(convs))]
    free = LLM(tiny_ckpt, show_progress=False).chat(convs, params)
    longest = max(len(o.prompt_token_ids) + 40 for o in free)
    tight = LLM(tiny_ckpt, num_blocks=-(-longest // 16) + 1, allow_unfit_images=True, show_progress=False)
    outs = tight.chat(convs, params)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in free]
