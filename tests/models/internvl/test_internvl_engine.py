"""InternVL through the engine: what only InternVL has (typed image placeholders, per-image max_num
and the engine's max_dynamic_patch, the largest max_dynamic_patch fix, both checkpoint layouts in the
CLI, max_num inside image_url). Shared behaviour (typed bad input, another family's settings refused,
every too-long fix runs) is in tests/e2e/test_family_capacity.py."""
from __future__ import annotations

import io

import pytest

from helpers import SAMPLE_IMAGE, image
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.cli import main
from vlm_sdk.errors import InputTooLongError, InvalidImageError, InvalidRequestError

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
SAMPLE = str(SAMPLE_IMAGE)


@pytest.fixture(scope="module")
def llm(internvl_ckpt):
    return LLM(internvl_ckpt, show_progress=False)


def _ask(img, **part):
    return [{"role": "user", "content": [{"type": "image", "image": img, **part},
                                         {"type": "text", "text": "What is it?"}]}]


def _png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_a_typed_image_placeholder_is_text(llm):
    """Issue 18: special tokens typed in message text are text (engine/input/special_text.py), so a typed
    <IMG_CONTEXT> is no image placeholder (it was refused as one more placeholder than images)."""
    conv = [{"role": "user", "content": "look <IMG_CONTEXT> here"}]
    prompt = llm.engine.inputs.build_prompt(conv)
    assert prompt.images == [] and llm.engine.inputs.processor.image_token_id not in prompt.token_ids
    assert len(llm.chat(conv, PARAMS)[0].token_ids) >= 1
    assert llm.stats()["kv_blocks_used"] == 0


def test_placeholder_counts_must_match(llm):
    processor = llm.engine.inputs.processor
    images = llm.engine.inputs.build_prompt(_ask(image(100, 80))).images
    with pytest.raises(InvalidRequestError, match="rendered 0 image placeholders for 1 images"):
        processor.build([{"role": "user", "content": "hi"}], images)
    with pytest.raises(InvalidRequestError, match="more image placeholders"):
        processor.build([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], images)


def test_per_image_max_num_and_engine_max_dynamic_patch(internvl_ckpt, llm):
    wide = image(900, 300, 4)  # aspect 3: a 3x1 grid when allowed
    default = llm.engine.inputs.build_prompt(_ask(wide))
    assert default.images[0].meta.tiles == 4  # 3 tiles + thumbnail (checkpoint max_num 6)
    own = llm.engine.inputs.build_prompt(_ask(wide, max_num=1))
    assert own.images[0].meta.tiles == 1 and own.image_tokens == [256]
    capped = LLM(internvl_ckpt, max_dynamic_patch=2, show_progress=False)
    assert capped.engine.inputs.build_prompt(_ask(wide)).images[0].meta.tiles == 3
    assert capped.engine.inputs.build_prompt(_ask(wide, max_num=6)).images[0].meta.tiles == 4  # the part wins
    largest = capped.engine.inputs.processor.largest_image()
    assert tuple(largest.data.shape) == (3, 3, 448, 448) and largest.size == 3
    assert local_worker(capped.engine).runner.max_vision_patches == 3


def test_too_long_prompt_names_the_largest_max_dynamic_patch_that_fits(internvl_ckpt):
    """The fix's value: the most tiles that fit, and it runs (the message, the engine going on and every
    fix running are checked for every family in tests/e2e/test_family_capacity.py)."""
    small = LLM(internvl_ckpt, num_blocks=60, allow_unfit_images=True, show_progress=False)  # 960 tokens
    conv = _ask(image(1200, 400, 7))  # 3x1 grid + thumbnail = 4 tiles = 1024 image tokens
    with pytest.raises(InputTooLongError) as info:
        small.chat(conv, PARAMS)
    err = info.value
    assert err.image_tokens == [1024] and err.capacity_tokens == 960
    assert err.fixes["max_dynamic_patch"] == 2  # 2 tiles + thumbnail fit; 3 tiles do not
    # the smaller max_dynamic_patch also makes the largest allowed image fit: no allow_unfit_images needed
    fixed = LLM(internvl_ckpt, num_blocks=60, max_dynamic_patch=err.fixes["max_dynamic_patch"], show_progress=False)
    assert len(fixed.chat(conv, PARAMS)[0].token_ids) >= 1


def test_own_max_num_too_big_for_max_model_len_is_refused_before_resizing(internvl_ckpt):
    small = LLM(internvl_ckpt, num_blocks=60, allow_unfit_images=True, show_progress=False)
    with pytest.raises(InvalidImageError, match="at most 2") as info:
        small.chat(_ask(image(1200, 400, 7), max_num=6), PARAMS)
    assert info.value.param == "max_num"


@pytest.mark.parametrize("fixture", ["internvl_ckpt", "internvl_original_ckpt"])
def test_cli_chat_on_both_layouts(request, fixture, capsys):
    ckpt = request.getfixturevalue(fixture)
    assert main(["chat", "--model", str(ckpt), "--image", SAMPLE, "--max-tokens", "4", "What is in this image?"]) == 0
    err = capsys.readouterr().err
    assert "image tokens" in err and "prompt tokens" in err


def test_server_takes_max_num_inside_image_url(internvl_ckpt, llm):
    from server_helpers import data_url, image_message, post
    from vlm_sdk.server.background import BackgroundServer
    from vlm_sdk.server.config import ServerConfig

    wide = image(900, 300, 4)
    expected = {n: llm.chat(_ask(wide, max_num=n), PARAMS)[0] for n in (1, 6)}
    with BackgroundServer(internvl_ckpt, ServerConfig(port=0, served_model_name="ivl")) as srv:
        for n, want in expected.items():
            status, body = post(srv.url, {"model": "ivl", "max_tokens": 4, "temperature": 0,
                                          "messages": image_message(data_url(wide), "What is it?", max_num=n)},
                                key=None)
            assert status == 200, body
            assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
            assert body["choices"][0]["message"]["content"] == want.text
        status, body = post(srv.url, {"model": "ivl", "messages": image_message(data_url(wide), max_num=0)}, key=None)
        assert status == 400, body
        assert body["error"]["param"] == "max_num" and "positive" in body["error"]["message"]
        assert srv.stats()["kv_blocks_used"] == 0
