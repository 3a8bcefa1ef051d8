"""SamplingParams(n=k): k samples of one prompt built once, their prompt blocks shared through prefix
caching in the same step and the image encoded once; seeded samples differ and are reproducible (sample
i draws from seed + i); closing an async stream aborts every sample."""
import asyncio

import pytest

from helpers import conversations
from vlm_sdk import AsyncLLM, LLM, SamplingParams
from vlm_sdk.errors import InvalidRequestError

SEEDED = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, show_progress=False)


def test_n_validated():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(n=bad)
        assert e.value.param == "n"


def test_sample_seeds_wrap():
    assert SamplingParams(seed=5, n=3).sample(2).seed == 7
    assert SamplingParams(seed=5, n=3).sample(0) == SamplingParams(seed=5)
    assert SamplingParams(seed=2 ** 63 - 1, n=2).sample(1).seed == -(2 ** 63)
    assert SamplingParams(n=2).sample(1).seed is None


def test_seeded_samples_differ_reproducibly_and_share_the_prompt(llm):
    conv = conversations()["one_image"]
    before = llm.stats()
    [out] = llm.chat(conv, SEEDED)
    after = llm.stats()
    samples = out.outputs
    assert [s.index for s in samples] == [0, 1, 2] and samples[0] is out
    assert len({tuple(s.token_ids) for s in samples}) == 3  # different seeds, different choices
    assert all(s.request_id == out.request_id for s in samples)
    # each sample is what a single request with seed + i draws
    for i, s in enumerate(samples):
        [alone] = llm.chat(conv, SamplingParams(seed=7 + i, temperature=1.0, max_tokens=12, ignore_eos=True))
        assert alone.token_ids == s.token_ids
    # the 2nd and 3rd samples hit the first's full prompt blocks in the same step, and its image
    # features were computed once (the encoder cache served the other samples' partial blocks)
    prompt_len = len(out.prompt_token_ids)
    block = after["kv_block_size"]
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    shared = (prompt_len - 1) // block * block  # full blocks before the last prompt token, which is computed
    assert hits == 2 * shared > 0 and samples[1].num_cached_tokens == samples[2].num_cached_tokens == shared
    assert samples[0].num_cached_tokens == 0
    misses = (after["encoder_cache_queries"] - before["encoder_cache_queries"]
              - (after["encoder_cache_hits"] - before["encoder_cache_hits"]))
    assert misses == 1  # the image was encoded once (others were served by the cache or needed none)


def test_n_one_unchanged(llm):
    conv = conversations()["text"]
    [out] = llm.chat(conv, SamplingParams(seed=3, max_tokens=8))
    assert out.index == 0 and out.outputs == [out]


def test_async_n_interleaves_and_close_aborts_all(tiny_ckpt):
    conv = conversations()["one_image"]
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=40, ignore_eos=True)

    async def main():
        async with AsyncLLM(tiny_ckpt, show_progress=False) as engine:
            full = await engine.chat(conv, SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=12,
                                                          ignore_eos=True))
            seen = set()
            async for out in engine.chat_stream(conv, params, request_id="many"):
                seen.add(out.index)
                if len(seen) == 3:
                    break
            for _ in range(400):  # every sample is aborted, its blocks freed
                if not engine.engine.requests:
                    break
                await asyncio.sleep(0.005)
            return full, seen, dict(engine.engine.requests), engine.stats()

    full, seen, left, stats = asyncio.run(main())
    assert [s.index for s in full.outputs] == [0, 1, 2]
    assert len({tuple(s.token_ids) for s in full.outputs}) == 3
    assert seen == {0, 1, 2}
    assert not left and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_without_prefix_caching_the_image_is_still_encoded_once(tiny_ckpt):
    llm = LLM(tiny_ckpt, show_progress=False, enable_prefix_caching=False)
    before = llm.stats()
    [out] = llm.chat(conversations()["one_image"], SEEDED)
    after = llm.stats()
    assert len(out.outputs) == 3 and after["prefix_cache_hit_tokens"] == before["prefix_cache_hit_tokens"]
    assert after["encoder_cache_queries"] - before["encoder_cache_queries"] == 3
    assert after["encoder_cache_hits"] - before["encoder_cache_hits"] == 2


def test_async_samples_join_the_same_step(tiny_ckpt):
    """One `add` command for the n samples: the engine thread cannot step between them, so the
    first's prompt blocks are there for the others in the step that schedules them all."""
    async def main():
        async with AsyncLLM(tiny_ckpt, show_progress=False) as engine:
            steps, added_at = [0], []
            real_step, real_add = engine.engine.step, engine.engine.add_request

            def step():
                steps[0] += 1
                return real_step()

            def add(*args, **kw):
                added_at.append(steps[0])
                return real_add(*args, **kw)
            engine.engine.step, engine.engine.add_request = step, add
            for _ in range(3):  # other requests in flight, so the engine thread is busy stepping
                asyncio.ensure_future(engine.chat(conversations()["text"], SamplingParams(max_tokens=30)))
            await asyncio.sleep(0.2)
            out = await engine.chat(conversations()["one_image"], SEEDED)
            return added_at, out

    added_at, out = asyncio.run(main())
    assert len(out.outputs) == 3 and len(set(added_at[-3:])) == 1
