"""The input processor (vlm_sdk/engine/input/processor.py) is the engine's way in and needs no rank: made
from the checkpoint alone it builds the engine's own prompts, and a family setting it refuses is refused
before any rank starts (under tensor parallelism the ranks' processes used to be spawned, and the
weights loaded, before the processor said no)."""
from __future__ import annotations

import pytest

from helpers import conversations
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.engine import llm_engine
from vlm_sdk.engine.input.processor import InputProcessor
from vlm_sdk.errors import InputTooLongError, InvalidRequestError
from vlm_sdk.model_loader import read_checkpoint
from vlm_sdk.models import registry


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    out = LLM(tiny_ckpt, show_progress=False)
    yield out
    out.shutdown()


@pytest.fixture(scope="module")
def alone(tiny_ckpt, llm):
    """An InputProcessor of the same checkpoint and settings, beside no engine of its own."""
    info = read_checkpoint(str(tiny_ckpt))
    processor = InputProcessor(str(tiny_ckpt), info, registry.resolve([info.architecture]), llm.engine.args)
    eng = llm.engine
    processor.set_capacity(eng.cache_config, eng.scheduler_config, eng.max_position_embeddings)
    yield processor
    processor.close()


def test_made_from_the_checkpoint_alone_it_builds_the_engines_prompts(llm, alone):
    for name, conv in conversations().items():
        ours, engines = alone.build_prompt(conv), llm.inputs.build_prompt(conv)
        assert ours.token_ids == engines.token_ids, name
        assert [im.key for im in ours.images] == [im.key for im in engines.images], name
        assert ours.image_positions == engines.image_positions, name
        # and the engine runs the prompt it did not build
        rid = llm.engine.add_request(ours, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert rid not in llm.engine.requests


def test_its_capacity_is_the_engines(llm, alone):
    """set_capacity gives it the sized cache: a prompt the engine cannot hold is refused here too, with
    the engine's numbers."""
    text = "many words " * (llm.engine.scheduler_config.max_model_len // 2)
    with pytest.raises(InputTooLongError) as ours:
        alone.build_prompt([{"role": "user", "content": text}])
    with pytest.raises(InputTooLongError) as engines:
        llm.inputs.build_prompt([{"role": "user", "content": text}])
    assert (ours.value.prompt_tokens, ours.value.capacity_tokens, ours.value.fixes) == \
        (engines.value.prompt_tokens, engines.value.capacity_tokens, engines.value.fixes)


def test_a_refused_family_setting_starts_no_rank(tiny_ckpt, monkeypatch):
    family = registry.resolve([read_checkpoint(str(tiny_ckpt)).architecture])
    own = {s.name for s in family.engine_settings}
    other = next((s.name for s in registry.engine_settings().values() if s.name not in own), None)
    if other is None:
        pytest.skip("every registered family's engine settings are this family's")
    started = []
    monkeypatch.setattr(llm_engine, "make_executor", lambda *a, **k: started.append(a) or pytest.fail("a rank started"))
    with pytest.raises(InvalidRequestError) as info:
        LLM(tiny_ckpt, show_progress=False, **{other: 4})
    assert info.value.param == other and started == []
