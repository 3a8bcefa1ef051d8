"""Gemma 3 prompt building against transformers' own Gemma3Processor (over Gemma3ImageProcessorPil: no
torchvision): the prompt ids (each <start_of_image> expanded in the text, "\\n\\n" merged as transformers
merges it), the pixels of every frame, pan-and-scan crops with transformers' options and defaults, and
the typed errors and fixes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import image
from vlm_sdk.config import EngineArgs
from vlm_sdk.errors import InvalidImageError, InvalidRequestError
from vlm_sdk.model_loader import load_tokenizer, read_checkpoint
from vlm_sdk.models.gemma3 import reference
from vlm_sdk.models.gemma3.image_processor import PanAndScan
from vlm_sdk.models.registry import load, resolve
from vlm_sdk.multimodal.pixels import images_to_device

SMALL_CROPS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}  # crops of the small test images


def conversations() -> dict[str, list[dict]]:
    a, b, c, wide, tall = image(320, 200, 1), image(100, 90, 2), image(64, 200, 3), image(900, 200, 4), image(90, 400, 5)
    return {
        "text": [{"role": "user", "content": "Tell me a short story about the sea."}],
        "one_image": [{"role": "user", "content": [{"type": "image", "image": a},
                                                   {"type": "text", "text": "What is in this image?"}]}],
        "two_images": [{"role": "system", "content": "You compare pictures."},
                       {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image", "image": b},
                                                    {"type": "text", "text": "with"}, {"type": "image", "image": c}]}],
        "wide_and_tall": [{"role": "user", "content": [{"type": "image", "image": wide}, {"type": "image", "image": tall},
                                                       {"type": "text", "text": "Read both."}]}],
        "multi_turn": [{"role": "user", "content": [{"type": "image", "image": b}, {"type": "text", "text": "Describe it."}]},
                       {"role": "assistant", "content": "A colourful square."},
                       {"role": "user", "content": "Which colour is most common?"}],
    }


@pytest.fixture(scope="module")
def parts(gemma3_ckpt):
    info = read_checkpoint(gemma3_ckpt)
    family = resolve([info.architecture])
    ip = family.image_processor_cls.from_preprocessor_config(info.preprocessor, info.hf_config)
    return info, family, load_tokenizer(gemma3_ckpt), ip, reference.hf_image_processor(str(gemma3_ckpt))


def processor(parts, **settings):
    info, family, tok, ip, _ = parts
    return family.make_processor(tok, ip, info.hf_config, EngineArgs.from_kwargs(mm_processor_kwargs=settings))


def pixels(prompt) -> torch.Tensor:  # [frames, 3, S, S] as the model makes them on its device
    return images_to_device([im.data for im in prompt.images], [im.meta.pixel_lut for im in prompt.images],
                            "cpu", torch.float32)


def test_the_checkpoint_resolves_to_the_family(parts):
    info, family, *_ = parts
    assert family is load("gemma3") and family.display_name == "Gemma 3"
    assert info.architecture == "Gemma3ForConditionalGeneration"


@pytest.mark.parametrize("settings", [{}, SMALL_CROPS], ids=["whole_images", "pan_and_scan"])
@pytest.mark.parametrize("name", list(conversations()))
def test_prompt_and_pixels_equal_transformers(parts, name, settings):
    info, _, tok, _, hf_ip = parts
    conv = conversations()[name]
    ours = processor(parts, **settings)(conv)
    ref = reference.hf_prompt(tok, hf_ip, info.hf_config, conv, **settings)
    assert ours.token_ids == ref["input_ids"][0].tolist()
    soft = [i for i, t in enumerate(ref["token_type_ids"][0].tolist()) if t]
    per = info.hf_config.mm_tokens_per_image
    assert [p + k for p in ours.image_positions for k in range(per)] == soft  # each frame's soft tokens, in order
    if ours.images:
        assert torch.equal(pixels(ours), ref["pixel_values"])  # the same float32 bits
        assert all(im.num_tokens == per and im.size == 1 for im in ours.images)


def test_pan_and_scan_frames_and_keys(parts):
    conv = conversations()["wide_and_tall"]
    prompt = processor(parts, **SMALL_CROPS)(conv)
    frames = [(im.meta.image, im.meta.frame, im.meta.crops) for im in prompt.images]
    # 900x200: ratio 4.5 -> min(4, floor(900 / 32), round 4.5 up = 5) = 4 crops; 90x400: round 4.4 = 4 crops
    assert frames == [(0, f, 4) for f in range(5)] + [(1, f, 4) for f in range(5)]
    assert len({im.key for im in prompt.images}) == 10
    plain = processor(parts)(conv)
    assert [im.key for im in plain.images] == [prompt.images[0].key, prompt.images[5].key]  # the whole images share
    text = processor(parts, **SMALL_CROPS).tokenizer.decode(prompt.token_ids)
    assert text.count("Here is the original image") == 2


def test_an_image_part_sets_its_own_pan_and_scan(parts):
    info, _, tok, _, hf_ip = parts
    wide = image(900, 200, 4)
    conv = [{"role": "user", "content": [{"type": "image", "image": wide, **SMALL_CROPS,
                                          "pan_and_scan_max_num_crops": 2}, {"type": "text", "text": "Hi"}]}]
    ours = processor(parts)(conv)
    ref = reference.hf_prompt(tok, hf_ip, info.hf_config, conv, **SMALL_CROPS, pan_and_scan_max_num_crops=2)
    assert ours.token_ids == ref["input_ids"][0].tolist() and len(ours.images) == 3
    assert torch.equal(pixels(ours), ref["pixel_values"])


@pytest.mark.parametrize("size", [(1, 1), (200, 200), (239, 200), (240, 200), (900, 200), (200, 900), (1001, 333),
                                  (4000, 256), (600, 255), (3000, 100), (257, 1024)])
@pytest.mark.parametrize("options", [PanAndScan(True), PanAndScan(True, 32, 3, 1.5), PanAndScan(True, 100, 8, 1.2)],
                         ids=["defaults", "min32_max3_ratio1.5", "min100_max8"])
def test_crops_equal_transformers_pan_and_scan(parts, size, options):
    hf_ip = parts[4]
    img = image(*size, seed=size[0])
    chw = np.asarray(img).transpose(2, 0, 1)
    theirs = hf_ip.pan_and_scan(chw, options.min_crop_size, options.max_num_crops, options.min_ratio_to_activate)
    ours = options.boxes(*size)
    assert [c.shape for c in theirs] == [(3, b - t, r - left) for left, t, r, b in ours]
    for crop, (left, t, r, b) in zip(theirs, ours):
        assert np.array_equal(crop, chw[:, t:b, left:r])


def test_defaults_are_transformers_and_pan_and_scan_is_off(parts):
    ip = parts[3]
    assert ip.pan_and_scan == PanAndScan(False, 256, 4, 1.2) and ip.size == 112
    assert len(processor(parts)(conversations()["wide_and_tall"]).images) == 2


def test_an_image_too_large_for_max_model_len_is_refused_with_the_fix(parts):
    proc = processor(parts, **SMALL_CROPS)
    per = proc.tokens_per_image
    proc.max_image_tokens = 2 * per + 1  # 5 frames would not fit; 2 would
    with pytest.raises(InvalidImageError, match=rf"1 \+ 4 crops = {5 * per} image tokens, more than the "
                                                rf"{2 * per + 1}.*pan_and_scan_max_num_crops to at most 1"):
        proc(conversations()["wide_and_tall"])


def test_image_setting_fixes_name_fewer_crops_then_none(parts):
    proc = processor(parts, **SMALL_CROPS)
    per = proc.tokens_per_image
    prompt = proc(conversations()["wide_and_tall"])  # 2 images x 5 frames
    text = len(prompt.token_ids) - 10 * per
    assert proc.image_setting_fixes(prompt, text + 6 * per) == {"pan_and_scan_max_num_crops": 2}
    assert proc.image_setting_fixes(prompt, text + 2 * per) == {"do_pan_and_scan": False}
    assert proc.image_setting_fixes(prompt, text + per) == {}
    assert processor(parts).image_setting_fixes(processor(parts)(conversations()["one_image"]), 10) == {}


def test_settings_are_checked_and_another_familys_refused(parts):
    with pytest.raises(InvalidRequestError, match="do_pan_and_scan must be true or false"):
        processor(parts, do_pan_and_scan=1)
    with pytest.raises(InvalidRequestError, match="max_pixels.*is not an engine setting of Gemma 3"):
        processor(parts, max_pixels=1000)
    conv = [{"role": "user", "content": [{"type": "image", "image": image(50, 50), "max_num": 2}]}]
    with pytest.raises(InvalidRequestError, match="max_num is not an image setting of Gemma 3"):
        processor(parts)(conv)


def test_text_prompts_refuse_the_soft_image_token(parts):
    proc = processor(parts)
    assert proc.text_prompt([5, 6, proc.boi_id]).token_ids == [5, 6, proc.boi_id]
    with pytest.raises(InvalidRequestError, match="image placeholder token <image_soft_token>"):
        proc.text_prompt([5, proc.image_token_id])


def test_video_parts_are_refused(parts):
    conv = [{"role": "user", "content": [{"type": "video", "video": [image(32, 32)]}]}]
    with pytest.raises(InvalidRequestError, match="Gemma 3 takes no video input"):
        processor(parts)(conv)
