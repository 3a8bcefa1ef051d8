"""Qwen pixels travel as bytes and become float on the model's device (`pixels_to_device`): bit for bit
transformers' host normalisation (float64 rescale, float32 normalise, frames repeated), in float32 and
after a cast to a low-precision dtype; 1/8 of the bytes; several images, several processors' tables; the
model's `encode_images` gives the same embeddings from bytes as from float patches."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_sdk.model_loader import iter_safetensors, read_checkpoint
from vlm_sdk.models.common.qwen_vl.image_processor import Qwen2VLImageProcessor, pixels_to_device
from vlm_sdk.models.qwen2_5_vl.model import Qwen2_5_VLForCausalLM
from vlm_sdk.multimodal.inputs import ImageInput


def picture(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def host_normalised(proc: Qwen2VLImageProcessor, image: ImageInput) -> torch.Tensor:  # [patches, 3*T*p*p]
    """The host path the processor used to run: float64 rescale, float32 (x - mean) / std, frames repeated."""
    p, t = proc.patch_size, proc.temporal_patch_size
    x = image.data.numpy().reshape(-1, 3, p * p).astype(np.float64) * proc.rescale_factor
    x = x.astype(np.float32)
    x -= np.array(proc.image_mean, dtype=np.float32).reshape(1, 3, 1)
    x /= np.array(proc.image_std, dtype=np.float32).reshape(1, 3, 1)
    return torch.from_numpy(np.repeat(x[:, :, None, :], t, axis=2).reshape(x.shape[0], -1))


def test_bytes_normalised_on_the_device_equal_the_host_path_bit_for_bit():
    proc = Qwen2VLImageProcessor(max_pixels=200_000)
    images = [proc(picture(300, 410, 0)), proc(picture(97, 61, 1))]
    assert all(im.data.dtype == torch.uint8 for im in images)
    ref = torch.cat([host_normalised(proc, im) for im in images])
    got = pixels_to_device(images, proc.temporal_patch_size, "cpu", torch.float32)
    assert torch.equal(got, ref)
    for dtype in (torch.bfloat16, torch.float16):  # the table is rounded once: same as casting the floats
        assert torch.equal(pixels_to_device(images, 2, "cpu", dtype), ref.to(dtype))


def test_bytes_are_an_eighth_of_the_float_patches():
    proc = Qwen2VLImageProcessor()
    image = proc(picture(1024, 1024, 2))
    t, gh, gw = image.meta.grid_thw
    assert (gh, gw) == (70, 70)  # smart_resize under the default max_pixels: 980 x 980
    assert image.data.nbytes == gh * gw * 3 * 14 * 14  # 588 B a patch
    assert proc.normalized(image).nbytes == 8 * image.data.nbytes  # float32 x 2 frames: 4,704 B a patch


def test_images_of_different_processors_use_their_own_tables():
    a = Qwen2VLImageProcessor(max_pixels=60_000)
    b = Qwen2VLImageProcessor(max_pixels=60_000, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
    pic = picture(200, 150, 3)
    images = [a(pic), b(pic)]
    got = pixels_to_device(images, 2, "cpu", torch.float32)
    assert torch.equal(got, torch.cat([host_normalised(a, images[0]), host_normalised(b, images[1])]))


def test_mixed_bytes_and_floats_are_refused():
    proc = Qwen2VLImageProcessor(max_pixels=60_000)
    im = proc(picture(100, 100, 4))
    floats = ImageInput(proc.normalized(im), im.num_tokens, im.meta)
    assert torch.equal(pixels_to_device([floats], 2, "cpu", torch.float32), proc.normalized(im))  # floats: as given
    with pytest.raises(ValueError, match="mix"):
        pixels_to_device([im, floats], 2, "cpu", torch.float32)


def test_encode_images_from_bytes_equals_from_floats(tiny_ckpt):
    model = Qwen2_5_VLForCausalLM(read_checkpoint(tiny_ckpt).hf_config)
    model.load_weights(iter_safetensors(tiny_ckpt, show_progress=False))
    proc = Qwen2VLImageProcessor(max_pixels=40_000)
    images = [proc(picture(120, 90, 5)), proc(picture(60, 200, 6))]
    floats = [ImageInput(proc.normalized(im), im.num_tokens, im.meta) for im in images]
    with torch.no_grad():
        assert torch.equal(model.encode_images(images), model.encode_images(floats))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_upload_equals_the_cpu_result(dtype):
    proc = Qwen2VLImageProcessor()
    images = [proc(picture(1024, 1024, 7)), proc(picture(333, 555, 8))]
    got = pixels_to_device(images, 2, "cuda", dtype)  # pinned bytes, gather on the GPU
    torch.cuda.synchronize()
    assert got.device.type == "cuda" and torch.equal(got.cpu(), pixels_to_device(images, 2, "cpu", dtype))
