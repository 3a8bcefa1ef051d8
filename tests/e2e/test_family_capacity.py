"""Capacity, settings and bad-input behaviour every model family shares, run on each registered family's
tiny checkpoint and driven only by the registry and the family spec (`models/family.py`): the too-long
error's numbers and every fix it names (the cache's and the family's image setting, `plan_setting[1]`)
make the same conversation run; another family's setting is refused naming it and this family; bad input
is a typed error and the engine goes on; plan == engine with the family's own plan setting."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import conversations, image
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.memory.weights import weight_bytes
from vlm_sdk.errors import InputTooLongError, InvalidImageError, InvalidRequestError, UnfitImagesError, VLMError
from vlm_sdk.model_loader import read_config
from vlm_sdk.models import registry
from vlm_sdk.plan import plan

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)  # a fixed request runs all 4


@pytest.fixture(scope="module")
def family(family_ckpt):
    return registry.load(family_ckpt[0])


@pytest.fixture(scope="module")
def llm(family_ckpt):
    return LLM(family_ckpt[1], show_progress=False)


def _big_conv():
    """One large image (wider than tall, so tiling families cut it into several tiles) and a question."""
    return [{"role": "user", "content": [{"type": "image", "image": image(1200, 400, 7)},
                                         {"type": "text", "text": "What is in this image?"}]}]


def _ask(img, **options):
    return [{"role": "user", "content": [{"type": "image", "image": img, **options},
                                         {"type": "text", "text": "What is it?"}]}]


def test_too_long_error_numbers_and_every_fix_runs_the_same_conversation(family_ckpt, family, llm):
    path = family_ckpt[1]
    setting = family.plan_setting[1]
    reference = llm.engine.inputs.build_prompt(_big_conv())
    n, images = len(reference.token_ids), reference.image_tokens
    # the engine's own arithmetic: the tokens `b` blocks hold, and the blocks a sequence holds, over every
    # cache group (num_blocks * block_size and tokens / block_size for one full-attention group)
    cache = llm.engine.cache_config
    capacity = lambda b: dataclasses.replace(cache, num_blocks=b).capacity_tokens  # noqa: E731
    target = n - sum(images) + sum(images) // 2  # the text and about half the image
    blocks = max(b for b in range(1, cache.blocks_for(n) + 1) if capacity(b) <= target)
    assert 0 < capacity(blocks) < n
    # an image setting that alone makes it fit (the family's fix), where one does: a smaller image
    shrinkable = bool(llm.engine.inputs.processor.image_setting_fixes(reference, capacity(blocks) - PARAMS.max_tokens))
    small = LLM(path, num_blocks=blocks, allow_unfit_images=True, show_progress=False)  # below the largest image
    with pytest.raises(InputTooLongError) as info:
        small.chat(_big_conv(), PARAMS)
    err = info.value
    assert isinstance(err, VLMError)
    assert err.prompt_tokens == n and err.image_tokens == images and len(images) == 1
    assert err.capacity_tokens == capacity(blocks) < err.prompt_tokens
    msg = str(err)
    for number in (err.prompt_tokens, err.capacity_tokens, *err.image_tokens, blocks):
        assert str(number) in msg
    # num_blocks sized this cache and overrides kv_cache_memory, so kv_cache_memory is no fix here
    assert set(err.fixes) == {"num_blocks"} | ({setting} if shrinkable else set())
    assert err.fixes["num_blocks"] == cache.blocks_for(n + 4)  # the prompt and its max_tokens
    assert small.stats()["kv_blocks_used"] == 0
    for key, value in err.fixes.items():
        assert f"{key}={value}" in msg
        fixed = LLM(path, show_progress=False, allow_unfit_images=True, **{"num_blocks": blocks, key: value})
        if key == setting:  # the smaller images fit the same cache, with room for the output
            assert len(fixed.engine.inputs.build_prompt(_big_conv()).token_ids) + 4 <= err.capacity_tokens
        out = fixed.chat(_big_conv(), PARAMS)[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 4  # all its max_tokens
    # the refusal left nothing behind: the same engine serves the next request
    assert len(small.chat(conversations()["text"], PARAMS)[0].token_ids) >= 1
    assert small.stats()["kv_blocks_used"] == 0
    # a text-only prompt too long for the cache is offered no image-setting fix
    with pytest.raises(InputTooLongError) as info:
        small.chat([{"role": "user", "content": "word " * capacity(blocks)}], PARAMS)
    assert info.value.image_tokens == [] and setting not in info.value.fixes
    assert setting not in str(info.value)


def _valid(name: str):
    """A value every schema of setting `name` accepts: a switch's True, else 4."""
    return True if registry.engine_settings().get(name, None) is not None and \
        registry.engine_settings()[name].type is bool else 4


def _other_families_settings(family, kind: str) -> list[tuple[str, str]]:
    """(setting name, owning family's display name) of the other registered families' `kind` settings
    that this family does not also have."""
    own = {s.name for s in getattr(family, kind)}
    out = [(s.name, other.display_name) for other in registry.families() if other.name != family.name
           for s in getattr(other, kind) if s.name not in own]
    if not out:
        pytest.skip(f"no other registered family has {kind} that {family.display_name} lacks")
    return out


def test_another_familys_engine_setting_is_refused_at_start_up(family_ckpt, family):
    for name, owner in _other_families_settings(family, "engine_settings"):
        with pytest.raises(InvalidRequestError) as info:
            LLM(family_ckpt[1], show_progress=False, **{name: _valid(name)})  # valid for the setting's schema
        msg = str(info.value)
        assert info.value.param == name
        for word in (name, family.display_name, owner, *(s.name for s in family.engine_settings)):
            assert word in msg, (name, word)


def _bad_inputs(family) -> list[tuple[list, type, list[str]]]:
    cases = [
        ([{"role": "wizard", "content": "hi"}], InvalidRequestError, ["wizard"]),
        ([{"role": "user", "content": [{"type": "audio"}]}], InvalidRequestError, ["audio"]),
        (_ask(b"not an image at all"), InvalidImageError, ["image"]),
        (_ask("/no/such/file.png"), InvalidImageError, ["/no/such/file.png"]),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}],
         InvalidImageError, ["base64"]),
        ([], InvalidRequestError, ["needs a conversation"]),
        ([[]], InvalidRequestError, ["non-empty"]),
    ]
    for s in family.image_settings:  # the family's own per-image settings, out of their schema's range
        words = [s.name, "true or false"] if s.type is bool else [s.name, "positive"]
        cases.append((_ask(image(64, 64), **{s.name: 0}), InvalidRequestError, words))
        if s.maximum is not None:
            cases.append((_ask(image(64, 64), **{s.name: s.maximum + 1}), InvalidRequestError,
                          [s.name, f"1 to {s.maximum}"]))
    own = [s.name for s in family.image_settings]
    for name, owner in _other_families_settings(family, "image_settings"):
        cases.append((_ask(image(64, 64), **{name: _valid(name)}), InvalidRequestError,
                      [name, family.display_name, *own]))
    return cases


def test_bad_input_is_a_typed_error_naming_the_problem_and_the_engine_goes_on(family, llm):
    for conv, kind, words in _bad_inputs(family):
        with pytest.raises(kind) as info:
            llm.chat(conv, PARAMS)
        for word in words:
            assert word in str(info.value), (conv, word)
        out = llm.chat(_ask(image(100, 80)), PARAMS)[0]
        assert len(out.token_ids) >= 1
        assert llm.stats()["kv_blocks_used"] == 0


def _setting_in_effect(path, family) -> int:
    """The family's plan setting value the checkpoint gives when none is set (its image_limits hook)."""
    info = read_config(path)
    with torch.device("meta"):
        model = family.model_cls(info.hf_config, dtype=torch.float32, device="meta")
    return family.image_limits(info.preprocessor, info.hf_config, model, {}).largest.value


@pytest.mark.parametrize("options", [{}, {"block_size": 8, "max_num_seqs": 3, "image": True},
                                     {"num_blocks": 50, "block_size": 32, "image": True},
                                     # two sequences: the state slots of a model with state layers fit beside
                                     {"kv_cache_memory": 100_000, "max_model_len": 96, "max_num_seqs": 2}])
def test_plan_equals_engine_with_the_familys_own_plan_setting(family_ckpt, family, options):
    path = family_ckpt[1]
    plan_option, setting = family.plan_setting
    options = dict(options)
    if options.pop("image", None):  # the family's image setting, below the checkpoint's value
        value = _setting_in_effect(path, family) // 2
        plan_options, engine_options = {**options, plan_option: value}, {**options, setting: value}
        smaller = plan(path, device="cpu", **plan_options).image_tokens_per_image
        # a smaller image, or none where the setting sizes none of this checkpoint's images (Gemma 3's crop
        # count with pan-and-scan off: every image is one frame); plan == engine is checked the same
        assert smaller <= plan(path, device="cpu").image_tokens_per_image
    else:
        plan_options = engine_options = options
    p = plan(path, device="cpu", **plan_options)
    if p.image_tokens_per_image > p.max_model_len:  # the engine refuses exactly these settings at start-up
        with pytest.raises(UnfitImagesError):
            LLM(str(path), device="cpu", show_progress=False, **engine_options)
        engine_options = {**engine_options, "allow_unfit_images": True}
    llm = LLM(str(path), device="cpu", show_progress=False, **engine_options)
    r = llm.memory_report
    for key in ("num_blocks", "capacity_tokens", "kv_bytes_per_block", "kv_bytes_per_token", "block_size",
                "weights_language_model_bytes", "weights_vision_bytes", "weights_projector_bytes",
                "max_model_len", "image_tokens_per_image"):
        assert getattr(p, key) == getattr(r, key), key
    assert p.weights_bytes == weight_bytes(local_worker(llm.engine).model).total
