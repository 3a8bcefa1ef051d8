"""Qwen3-VL prompt building against transformers: the image processor transformers picks for a Qwen3-VL
checkpoint (same grid, same pixels at patch 16), the prompt ids, and the M-RoPE positions of
`Qwen3VLModel.get_rope_index` for 0 to 3 images."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLConfig, Qwen3VLModel

from helpers import image
from vlm_sdk.testing.families import fixtures
from vlm_sdk.config import EngineArgs
from vlm_sdk.errors import CheckpointError
from vlm_sdk.model_loader import load_tokenizer, read_checkpoint
from vlm_sdk.models.common.qwen_vl.rope_index import mrope_positions
from vlm_sdk.models.registry import load, resolve

IMG, VSTART, VEND = 500, 501, 502
MERGE = 2


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints("qwen3_vl")


@pytest.fixture(scope="module")
def info(ckpt):
    return read_checkpoint(ckpt)


def test_the_checkpoint_resolves_to_the_family(info):
    fam = resolve([info.architecture])
    assert fam is load("qwen3_vl") and fam.name == "qwen3_vl" and fam.display_name == "Qwen3-VL"


@pytest.mark.parametrize("size", [(300, 200), (120, 260), (1, 1), (2000, 90), (700, 700)])
def test_pixels_and_grid_equal_the_processor_transformers_picks(ckpt, info, size):
    ours = load("qwen3_vl").image_processor_cls.from_preprocessor_config(info.preprocessor, info.hf_config)
    theirs = AutoImageProcessor.from_pretrained(str(ckpt))  # transformers' choice for model_type qwen3_vl
    assert type(theirs).__name__.startswith("Qwen2VLImageProcessor") and theirs.patch_size == ours.patch_size == 16
    img = image(*size, seed=sum(size))
    mine, ref = ours(img), theirs([img], return_tensors="pt")
    assert list(mine.meta.grid_thw) == ref["image_grid_thw"][0].tolist()
    assert mine.data.dtype == torch.uint8 and mine.data.shape == (mine.size, 3 * 16 * 16)  # bytes, one frame
    pixels = ours.normalized(mine)  # as the model makes them on its device
    assert pixels.shape == ref["pixel_values"].shape == (mine.size, 3 * 2 * 16 * 16)
    assert (pixels - ref["pixel_values"]).abs().max().item() <= 1e-6
    t, h, w = mine.meta.grid_thw
    assert mine.num_tokens == t * h * w // 4


def test_patch_geometry_comes_from_the_vision_config_and_must_agree_with_it(info):
    cls = load("qwen3_vl").image_processor_cls
    bare = {k: v for k, v in info.preprocessor.items() if k not in ("patch_size", "merge_size", "temporal_patch_size")}
    ip = cls.from_preprocessor_config(bare, info.hf_config)
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (16, 2, 2)
    bounds = cls.from_preprocessor_config({}, info.hf_config)  # none given: the published Qwen3-VL bounds
    assert (bounds.min_pixels, bounds.max_pixels, bounds.patch_size) == (256 * 256, 4096 * 4096, 16)
    with pytest.raises(CheckpointError, match="patch_size 14 differs from config.json vision_config.patch_size 16"):
        cls.from_preprocessor_config({**info.preprocessor, "patch_size": 14}, info.hf_config)


def test_prompt_ids_equal_transformers(ckpt, info):
    fam = load("qwen3_vl")
    ip = fam.image_processor_cls.from_preprocessor_config(info.preprocessor, info.hf_config)
    processor = fam.make_processor(load_tokenizer(ckpt), ip, info.hf_config, EngineArgs())
    conv = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                         {"type": "image", "image": image(300, 200)},
                                         {"type": "text", "text": "with"}, {"type": "image", "image": image(90, 150)}]}]
    ours = processor(conv)
    reference = fixtures("qwen3_vl").reference
    ref = reference.hf_prompt(AutoTokenizer.from_pretrained(str(ckpt)), reference.hf_image_processor(str(ckpt)),
                                  info.hf_config, conv)
    assert ours.token_ids == ref["input_ids"][0].tolist()
    assert [im.meta.grid_thw for im in ours.images] == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    text = AutoTokenizer.from_pretrained(str(ckpt)).decode(ours.token_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCompare<|vision_start|>")
    assert text.endswith("<|vision_end|><|im_end|>\n<|im_start|>assistant\n")
    assert all(im.key is not None for im in ours.images)
    smaller = processor([{"role": "user", "content": [{"type": "image", "image": image(300, 200),
                                                       "max_pixels": 32 * 32 * 16}]}]).images[0]
    assert smaller.key != ours.images[0].key and smaller.num_tokens <= 16


# -- positions ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_model() -> Qwen3VLModel:
    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=512, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, intermediate_size=32,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=16,
                           num_position_embeddings=16, deepstack_visual_indexes=[0], spatial_merge_size=MERGE),
        image_token_id=IMG, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    return Qwen3VLModel(cfg).eval()


def block(grid: tuple[int, int, int]) -> list[int]:
    t, h, w = grid
    return [VSTART] + [IMG] * (t * h * w // MERGE ** 2) + [VEND]


A, B, C = (1, 8, 12), (1, 16, 8), (1, 2, 14)
CASES = {
    "no_image": ([1, 2, 3, 4, 5, 6, 7], []),
    "one_image": ([1, 2, 3] + block(A) + [4, 5], [A]),
    "two_images": ([9] + block(A) + [4, 5] + block(B) + [6], [A, B]),
    "three_images": ([9] + block(A) + [4, 5] + block(B) + [6] + block(C) + [7, 8, 9], [A, B, C]),
    "image_at_start": ([IMG] * 24 + [VEND, 4, 5, 6], [A]),
    "image_at_end": ([1, 2, 3, VSTART] + [IMG] * 32, [B]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_positions_equal_get_rope_index(hf_model, case):
    ids, grids = CASES[case]
    ours, delta = mrope_positions(ids, grids, IMG, MERGE)
    input_ids = torch.tensor([ids])
    ref, ref_delta = hf_model.get_rope_index(input_ids, mm_token_type_ids=(input_ids == IMG).int(),
                                             image_grid_thw=torch.tensor(grids) if grids else None)
    assert ours.dtype == torch.int64 and torch.equal(ours, ref[:, 0])
    assert delta == int(ref_delta.item())
    assert len(ids) + delta == int(ours.max()) + 1  # decode continues one past the largest position


def test_the_processors_positions_equal_get_rope_index_on_its_prompt(ckpt, info):
    fam = load("qwen3_vl")
    ip = fam.image_processor_cls.from_preprocessor_config(info.preprocessor, info.hf_config)
    prompt = fam.make_processor(load_tokenizer(ckpt), ip, info.hf_config, EngineArgs())(
        [{"role": "user", "content": [{"type": "image", "image": image(300, 200)}, {"type": "text", "text": "and"},
                                      {"type": "image", "image": image(64, 200)}, {"type": "text", "text": "Hi"}]}])
    with torch.device("meta"):  # get_rope_index reads only the config
        hf = Qwen3VLModel(info.hf_config)
    input_ids = torch.tensor([prompt.token_ids])
    ref, delta = hf.get_rope_index(input_ids, mm_token_type_ids=(input_ids == info.hf_config.image_token_id).int(),
                                   image_grid_thw=torch.tensor([im.meta.grid_thw for im in prompt.images]))
    assert torch.equal(prompt.positions.table, ref[:, 0]) and prompt.positions.rope_delta == int(delta.item())


def test_preprocessor_layouts_read_alike(info):
    cls = load("qwen3_vl").image_processor_cls
    flat = {k: v for k, v in info.preprocessor.items() if k != "size"}
    size = info.preprocessor["size"]
    flat.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    a = cls.from_preprocessor_config(info.preprocessor, info.hf_config)
    b = cls.from_preprocessor_config(flat, info.hf_config)
    assert (a.min_pixels, a.max_pixels, a.image_mean) == (b.min_pixels, b.max_pixels, b.image_mean) == (
        64 * 64, 32 * 32 * 256, (0.5, 0.5, 0.5))
