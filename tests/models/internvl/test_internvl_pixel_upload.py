"""InternVL tiles travel as bytes (`tile_bytes`, 1/4 of the float32 tiles) and are normalised on the
model's device through the processor's table: bit for bit the host float tiles (`__call__`, which equal
transformers'), the thumbnail included; the engine's processor hands out the bytes; the model's
`encode_images` gives the same embeddings from bytes as from floats."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_sdk.model_loader import iter_safetensors, read_checkpoint
from vlm_sdk.models.internvl.image_processor import InternVLImageProcessor
from vlm_sdk.models.internvl.model import InternVLForCausalLM
from vlm_sdk.models.internvl.processor import InternVLImage
from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.multimodal.pixels import images_to_device


def picture(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("size,max_num", [((90, 70), 1), ((200, 430), 6)], ids=["one_tile", "tiles_and_thumbnail"])
def test_byte_tiles_normalised_on_the_device_equal_the_float_tiles(size, max_num):
    proc = InternVLImageProcessor(image_size=56, max_num=max_num)
    pic = picture(*size, seed=sum(size))
    raw, floats = proc.tile_bytes(pic), proc(pic)  # [tiles, 3, S, S] each
    assert raw.dtype == torch.uint8 and raw.shape == floats.shape and floats.nbytes == 4 * raw.nbytes
    assert (raw.shape[0] > 1) == (max_num > 1)
    got = images_to_device([raw], [proc.pixel_lut], "cpu", torch.float32)
    assert torch.equal(got, floats)
    assert torch.equal(images_to_device([raw], [proc.pixel_lut], "cpu", torch.bfloat16), floats.bfloat16())


def test_the_engine_processor_hands_out_bytes_and_the_model_takes_them(internvl_ckpt):
    from vlm_sdk.config import EngineArgs
    from vlm_sdk.model_loader import load_tokenizer
    from vlm_sdk.models.registry import resolve
    info = read_checkpoint(internvl_ckpt)
    family = resolve([info.architecture])
    image_processor = family.image_processor_cls.from_preprocessor_config(info.preprocessor, info.hf_config)
    proc = family.make_processor(load_tokenizer(internvl_ckpt), image_processor, info.hf_config, EngineArgs())
    pic = picture(120, 260, 1)
    inputs = proc([{"role": "user", "content": [{"type": "image", "image": pic}, {"type": "text", "text": "hi"}]}])
    (im,) = inputs.images
    assert im.data.dtype == torch.uint8 and im.meta.pixel_lut is not None
    model = InternVLForCausalLM(info.hf_config)
    model.load_weights(iter_safetensors(internvl_ckpt, show_progress=False), source=internvl_ckpt)
    floats = images_to_device([im.data], [im.meta.pixel_lut], "cpu", torch.float32)
    with torch.no_grad():
        a = model.encode_images([im, im])
        b = model.encode_images([ImageInput(floats, im.num_tokens, InternVLImage(im.meta.tiles))] * 2)
    assert torch.equal(a, b)
