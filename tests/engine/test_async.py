"""AsyncLLM: streaming, abort on early exit and on cancel, one caller's error stays its own, and
model work off the event loop."""
import asyncio
import threading

import pytest

from helpers import conversations
from vlm_sdk import AsyncLLM, LLM, SamplingParams
from vlm_sdk.errors import InputTooLongError, InvalidRequestError

LONG = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_ckpt):
    llm = LLM(tiny_ckpt, show_progress=False)
    convs = conversations()
    return {n: llm.chat(convs[n], LONG)[0].token_ids for n in ("text", "one_image", "two_images")}


def test_stream_deltas_and_abort_on_break(tiny_ckpt, expected):
    convs = conversations()

    async def main():
        async with AsyncLLM(tiny_ckpt, show_progress=False) as engine:
            step_threads = set()
            real_step = engine.engine.step

            def spy():
                step_threads.add(threading.current_thread().name)
                return real_step()
            engine.engine.step = spy

            async def full(name):
                deltas, last = [], None
                async for out in engine.chat_stream(convs[name], LONG):
                    deltas.append(out.delta_text)
                    last = out
                return last, "".join(deltas)

            async def quitter():
                seen = 0
                async for out in engine.chat_stream(convs["two_images"], LONG, request_id="quitter"):
                    seen += 1
                    if seen == 3:
                        break
                # the request is gone from the engine (blocks freed) while the others still run
                for _ in range(200):
                    if "quitter" not in engine.engine.requests:
                        break
                    await asyncio.sleep(0.005)
                return "quitter" not in engine.engine.requests, engine.stats()["num_running"]

            (a, text_a), (b, text_b), (gone, running_after) = await asyncio.gather(
                full("text"), full("one_image"), quitter())
            final = engine.stats()
        return a, text_a, b, text_b, gone, running_after, final, step_threads

    a, text_a, b, text_b, gone, running_after, final, threads = asyncio.run(main())
    assert a.token_ids == expected["text"] and b.token_ids == expected["one_image"]
    assert text_a == a.text and text_b == b.text
    assert a.finish_reason == b.finish_reason == "length"
    assert gone and running_after >= 1
    assert final["kv_blocks_used"] == 0 and final["num_running"] == 0
    assert threads == {"vlm-engine"}  # model work never ran on the event loop's thread


def test_cancel_aborts_and_others_finish(tiny_ckpt, expected):
    convs = conversations()

    async def main():
        async with AsyncLLM(tiny_ckpt, show_progress=False) as engine:
            started = asyncio.Event()

            async def victim():
                async for _ in engine.chat_stream(convs["two_images"], LONG, request_id="victim"):
                    started.set()

            task = asyncio.create_task(victim())
            other = asyncio.create_task(engine.chat(convs["text"], LONG))
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if "victim" not in engine.engine.requests:
                    break
                await asyncio.sleep(0.005)
            gone = "victim" not in engine.engine.requests
            result = await other
            return gone, result, engine.stats()

    gone, result, stats = asyncio.run(main())
    assert gone
    assert result.token_ids == expected["text"] and result.delta_text == result.text
    assert stats["kv_blocks_used"] == 0


def test_too_long_fails_only_its_caller(tiny_ckpt, expected):
    convs = conversations()

    async def main():
        async with AsyncLLM(tiny_ckpt, num_blocks=12, allow_unfit_images=True, show_progress=False) as engine:
            ok = asyncio.create_task(engine.chat(convs["text"], LONG))
            with pytest.raises(InputTooLongError) as info:
                await engine.chat([{"role": "user", "content": "many words " * 150}], LONG)
            assert info.value.capacity_tokens == 12 * 16
            result = await ok
            again = await engine.chat(convs["text"], LONG)
            return result, again, engine.stats()

    result, again, stats = asyncio.run(main())
    assert result.token_ids == expected["text"] == again.token_ids
    assert stats["kv_blocks_used"] == 0


def test_internal_failure_is_reported_not_hung(tiny_ckpt):
    """A bug inside a step must reach every caller as EngineDeadError with the cause, not a hang."""
    from vlm_sdk.errors import EngineDeadError
    convs = conversations()

    async def main():
        async with AsyncLLM(tiny_ckpt, show_progress=False) as engine:
            def broken():
                raise RuntimeError("simulated kernel failure")
            engine.engine.step = broken
            with pytest.raises(EngineDeadError, match="simulated kernel failure"):
                await asyncio.wait_for(engine.chat(convs["text"], LONG), timeout=30)
            with pytest.raises(EngineDeadError):
                await engine.chat(convs["text"], LONG)

    asyncio.run(main())


def test_shutdown_ends_open_streams_with_abort(tiny_ckpt):
    convs = conversations()

    async def main():
        engine = AsyncLLM(tiny_ckpt, show_progress=False)
        got_one = asyncio.Event()
        outs = []

        async def consume():
            async for out in engine.chat_stream(convs["text"], SamplingParams(max_tokens=2000, temperature=0.0,
                                                                              ignore_eos=True)):
                outs.append(out)
                got_one.set()

        task = asyncio.create_task(consume())
        await got_one.wait()
        await engine.shutdown()
        await asyncio.wait_for(task, timeout=30)  # must not hang
        from vlm_sdk.errors import EngineDeadError
        with pytest.raises(EngineDeadError, match="shut down"):
            await engine.chat(convs["text"], LONG)
        return outs, engine.stats()

    outs, stats = asyncio.run(main())
    assert outs[-1].finish_reason == "abort" and stats["kv_blocks_used"] == 0


def test_reused_request_id_gets_only_its_own_outputs(tiny_ckpt, expected):
    convs = conversations()

    async def main():
        async with AsyncLLM(tiny_ckpt, show_progress=False) as engine:
            async for _ in engine.chat_stream(convs["two_images"], LONG, request_id="same"):
                break
            with pytest.raises(InvalidRequestError):
                async def twice():
                    s1 = engine.chat_stream(convs["text"], LONG, request_id="dup")
                    first = await s1.__anext__()
                    try:
                        await engine.chat(convs["text"], LONG, request_id="dup")
                    finally:
                        await s1.aclose()
                    return first
                await twice()
            second = await engine.chat(convs["text"], LONG, request_id="same")
            return second, engine.stats()

    second, stats = asyncio.run(main())
    assert second.request_id == "same"
    assert second.prompt_token_ids != [] and second.token_ids == expected["text"]
    assert stats["kv_blocks_used"] == 0
