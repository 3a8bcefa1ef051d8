"""Review fixes: per-image pixel bounds, capacity fixes, tied heads on CUDA, vision grouping, KV-cache
sizing errors, decode layout on the metadata."""
from __future__ import annotations

import dataclasses
import json
import time
from types import MappingProxyType

import pytest
import torch

from helpers import conversations, image
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.config import CacheConfig, EngineArgs, SchedulerConfig
from vlm_sdk.engine import capacity
from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.config import DeviceBudget
from vlm_sdk.engine.kv_cache import plan_cache
from vlm_sdk.worker.model_runner import _patch_groups
from vlm_sdk.models.qwen2_5_vl.image_processor import max_image_grid, max_image_patches
from vlm_sdk.engine.scheduler import ScheduledBatch
from vlm_sdk.errors import InputTooLongError, InvalidImageError, InvalidRequestError
from vlm_sdk.model_loader import _safetensors_files, iter_safetensors, read_checkpoint
from vlm_sdk.layers import activation
from vlm_sdk.models.qwen2_5_vl import fixes, vision
from vlm_sdk.models.qwen2_5_vl.image_processor import QwenImage, Qwen2VLImageProcessor
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs
from vlm_sdk.testing import make_tiny_checkpoint
from vlm_sdk.worker.io import NewRequestData
from vlm_sdk.worker.request_state import RequestState

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)
BLOCKS = 20  # 320 tokens


@pytest.fixture(scope="module")
def limited(tiny_ckpt):
    """An engine whose processor refuses images over max_model_len tokens (what the engine wires)."""
    llm = LLM(tiny_ckpt, num_blocks=BLOCKS, show_progress=False)
    llm.engine.processor.max_image_tokens = llm.engine.scheduler_config.max_model_len
    return llm


def _one(img, **bounds):
    return [{"role": "user", "content": [{"type": "image", "image": img, **bounds},
                                         {"type": "text", "text": "Describe."}]}]


# -- 1. per-image pixel bounds ----------------------------------------------------------------------

def test_huge_own_min_pixels_is_refused_before_resizing(limited, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the image must not be resized")
    monkeypatch.setattr(Qwen2VLImageProcessor, "__call__", boom)
    start = time.perf_counter()
    with pytest.raises(InvalidImageError) as info:
        limited.engine.build_prompt(_one(image(64, 48, 1), min_pixels=10**9, max_pixels=2 * 10**9))
    assert time.perf_counter() - start < 1.0
    msg = str(info.value)
    for part in ("image 0", "64x48", "min_pixels=1000000000 (set on the image part)",
                 "max_pixels=2000000000 (set on the image part)", "320 one image may take",
                 "Lower the image part's min_pixels to at most"):
        assert part in msg, (part, msg)


def test_own_max_pixels_refusal_suggests_a_value_that_fits(limited):
    with pytest.raises(InvalidImageError) as info:
        limited.engine.build_prompt(_one(image(600, 600, 2), max_pixels=10**7))
    msg = str(info.value)
    assert "max_pixels=10000000 (set on the image part)" in msg
    assert "min_pixels=3136 (the preprocessor default)" in msg
    best = int(msg.split("max_pixels to at most ")[1].rstrip("."))
    ip = limited.engine.image_processor
    assert ip.num_image_tokens(600, 600, max_pixels=best) <= 320 < ip.num_image_tokens(600, 600, max_pixels=best + 1)
    prompt = limited.engine.processor(_one(image(600, 600, 2), max_pixels=best))  # accepted
    assert prompt.image_tokens[0] <= 320


def test_engine_level_bounds_still_get_input_too_long(tiny_ckpt):
    """An image too big under the engine's own bounds is the prompt check's business (with fixes)."""
    llm = LLM(tiny_ckpt, num_blocks=6, show_progress=False)
    llm.engine.processor.max_image_tokens = llm.engine.scheduler_config.max_model_len
    big = [{"role": "user", "content": [{"type": "image", "image": image(400, 300, 5)},
                                        {"type": "image", "image": image(250, 250, 6)},
                                        {"type": "text", "text": "What differs?"}]}]
    with pytest.raises(InputTooLongError) as info:
        llm.chat(big, PARAMS)
    assert {"num_blocks", "max_pixels"} <= set(info.value.fixes)
    # an image part's small own min_pixels does not make the engine's max_pixels its fault
    with pytest.raises(InputTooLongError):
        llm.chat(_one(image(400, 300, 5), min_pixels=28 * 28), PARAMS)


def test_min_above_max_names_where_each_came_from(limited):
    with pytest.raises(InvalidRequestError) as info:
        limited.engine.build_prompt(_one(image(64, 64), min_pixels=300_000))
    assert "image 0: min_pixels (300000, set on the image part) is larger than max_pixels (200704, the " \
           "preprocessor default)" in str(info.value)


def test_own_min_pixels_is_recorded(limited):
    prompt = limited.engine.build_prompt(_one(image(100, 100, 1), min_pixels=28 * 28 * 16))
    assert prompt.images[0].meta.own_min_pixels == 28 * 28 * 16 and not prompt.images[0].meta.own_max_pixels
    plain = limited.engine.build_prompt(_one(image(100, 100, 1)))
    assert plain.images[0].meta.own_min_pixels is None
    # the what-if count uses each image's own min_pixels: at the current max_pixels it is the real count
    at = limited.engine.processor.image_tokens_with_max_pixels
    assert at(prompt, limited.engine.image_processor.max_pixels) == prompt.image_tokens


# -- 2. capacity: fixes that work, settings needed together, the limit named -----------------------

@pytest.fixture(scope="module")
def ten_blocks(tiny_ckpt):
    llm = LLM(tiny_ckpt, num_blocks=10, show_progress=False)  # 160 tokens
    llm.engine.processor.max_image_tokens = llm.engine.scheduler_config.max_model_len
    return llm


def test_max_pixels_fix_respects_each_images_own_min_pixels(ten_blocks):
    conv = _one(image(100, 100, 1), min_pixels=100_352)  # upsized to 144 tokens by its own min_pixels
    with pytest.raises(InputTooLongError) as info:
        ten_blocks.chat(conv, PARAMS)
    assert info.value.image_tokens == [144]
    assert "max_pixels" not in info.value.fixes  # the engine's max_pixels cannot shrink this image


def test_no_max_pixels_fix_for_images_with_their_own(ten_blocks):
    with pytest.raises(InputTooLongError) as info:
        ten_blocks.chat(_one(image(400, 300, 5), max_pixels=200_704), PARAMS)
    assert info.value.image_tokens == [154] and "max_pixels" not in info.value.fixes


def test_max_pixels_fix_works_with_a_mix_of_images(tiny_ckpt):
    mixed = [{"role": "user", "content": [
        {"type": "image", "image": image(120, 120, 3), "min_pixels": 28 * 28 * 16},  # 16 tokens, floor
        {"type": "image", "image": image(400, 300, 5)},
        {"type": "text", "text": "Compare."}]}]
    llm = LLM(tiny_ckpt, num_blocks=6, show_progress=False)
    with pytest.raises(InputTooLongError) as info:
        llm.chat(mixed, PARAMS)
    best = info.value.fixes["max_pixels"]
    assert 28 * 28 * 16 <= best < llm.engine.image_processor.max_pixels
    fixed = LLM(tiny_ckpt, num_blocks=6, max_pixels=best, show_progress=False)
    assert fixed.chat(mixed, PARAMS)[0].token_ids


def test_largest_max_pixels_never_returns_its_cap_or_the_current_value():
    assert fixes.largest_max_pixels(lambda v: 10, 50, 3136, 28) is None  # fits everywhere: not the limit
    assert fixes.largest_max_pixels(lambda v: 100, 50, 3136, 28) is None  # fits nowhere
    tokens = lambda v: v // 784  # noqa: E731
    assert fixes.largest_max_pixels(tokens, 50, 3136, 28) == 50 * 784
    assert fixes.largest_max_pixels(tokens, 50, 3136, 28, below=40 * 784) == 39 * 784
    assert fixes.largest_max_pixels(tokens, 50, 3136, 28, below=4 * 784) is None


def test_check_prompt_fits_offers_max_pixels_only_below_the_current():
    img = ImageInput(torch.zeros(1, 1), 60, QwenImage((1, 2, 2)), source_size=(500, 500))
    prompt = PromptInputs(token_ids=[0] * 70, images=[img], image_positions=[0])
    cache = CacheConfig(16, 4, 1000, "test")
    sched = SchedulerConfig(8, 64, 64, "the KV cache capacity")
    def setting_fixes(max_pixels):
        def image_setting_fixes(p, capacity_tokens):
            best = fixes.max_pixels_fix(p, capacity_tokens, lambda p, v: [10], 3136, 28, max_pixels)
            return {} if best is None else {"max_pixels": best}
        return image_setting_fixes

    with pytest.raises(InputTooLongError) as info:  # the what-if count claims it fits at the cap
        capacity.check_prompt_fits(prompt, cache, sched, 4096, False, setting_fixes(200_704))
    assert info.value.fixes["max_pixels"] < 200_704
    with pytest.raises(InputTooLongError) as info:  # same without the current value: the cap is no fix
        capacity.check_prompt_fits(prompt, cache, sched, 4096, False, setting_fixes(None))
    assert "max_pixels" not in info.value.fixes


def test_max_model_len_and_cache_needed_together(tiny_ckpt):
    llm = LLM(tiny_ckpt, num_blocks=6, max_model_len=64, show_progress=False)
    conv = [{"role": "user", "content": "word " * 60}]
    with pytest.raises(InputTooLongError) as info:
        llm.chat(conv, PARAMS)
    err = info.value
    n, blocks = err.prompt_tokens, -(-err.prompt_tokens // 16)
    assert n > 96 and err.fixes == {}
    assert err.together == {"max_model_len": n, "num_blocks": blocks}
    assert f"No single setting makes it fit; these together do: max_model_len={n}, num_blocks={blocks}" in str(err)
    assert "max_model_len=64 (set by you)" in str(err)
    fixed = LLM(tiny_ckpt, num_blocks=blocks, max_model_len=n, show_progress=False)
    assert fixed.chat(conv, PARAMS)[0].token_ids
    with pytest.raises(InputTooLongError) as info:  # the conversation index keeps them
        llm.chat([conversations()["text"], conv], PARAMS)
    assert info.value.together == err.together and "conversation 1" in str(info.value)


def test_user_set_max_model_len_equal_to_the_cache_is_named(tiny_ckpt):
    llm = LLM(tiny_ckpt, num_blocks=6, max_model_len=96, show_progress=False)
    with pytest.raises(InputTooLongError) as info:
        llm.chat([{"role": "user", "content": "word " * 60}], PARAMS)
    assert "max_model_len=96 (set by you)" in str(info.value)
    assert "max_model_len" in info.value.together


def test_input_too_long_error_constructor_is_backward_compatible():
    old = InputTooLongError(100, [10], 50, {"num_blocks": 7}, "a reason", 2)
    assert old.together == {} and old.conversation_index == 2
    assert "Any one of these settings makes it fit: num_blocks=7." in str(old)
    both = InputTooLongError(100, [], 50, {"max_pixels": 784}, "r", together={"max_model_len": 100, "num_blocks": 7})
    assert "So do these together: max_model_len=100, num_blocks=7." in str(both)


# -- 3. tied lm_head compared on the model's device --------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tied_lm_head_check_on_cuda(tmp_path_factory):
    from vlm_sdk.models.qwen2_5_vl.model import Qwen2_5_VLForCausalLM
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tied_cuda"), tie_word_embeddings=True)
    cfg = read_checkpoint(ckpt).hf_config
    weights = {k: v for k, v in iter_safetensors(ckpt, show_progress=False) if k != "lm_head.weight"}
    embed = weights["model.embed_tokens.weight"]
    dev = torch.device("cuda")
    for head, untied in ((embed.clone(), False), (embed + 1, True)):
        with torch.device(dev):
            model = Qwen2_5_VLForCausalLM(cfg, dtype=torch.float32, device=dev)
        model.load_weights(dict(weights, **{"lm_head.weight": head}).items())
        assert (model.decoder.lm_head is not None) == untied
        if untied:
            assert model.decoder.lm_head.weight.device.type == "cuda"
            torch.testing.assert_close(model.decoder.lm_head.weight.cpu(), head)


# -- 4. vision tower in groups of at most max_vision_patches ----------------------------------------

def test_patch_groups():
    assert _patch_groups([4, 4, 4], None) == [range(0, 3)]
    assert _patch_groups([4, 4, 4], 8) == [range(0, 2), range(2, 3)]
    assert _patch_groups([10, 2, 2, 10], 4) == [range(0, 1), range(1, 3), range(3, 4)]  # a big one alone
    assert _patch_groups([], 4) == [range(0, 0)]


def test_grouped_encoding_matches_one_call(tiny_ckpt):
    llm = LLM(tiny_ckpt, show_progress=False)
    convs = [conversations()["two_images"], conversations()["one_image"], conversations()["multi_turn"]]
    prompts = [llm.engine.build_prompt(c) for c in convs]
    runner = llm.engine.runner
    calls = []
    encode = runner.model.encode_images

    def counting(images):
        calls.append(len(images))
        return encode(images)

    def embeds(limit):
        states = [RequestState.from_new(NewRequestData(
            f"r{i}", p.token_ids, [], p.images, p.image_positions, p.positions, PARAMS, [], 0))
            for i, p in enumerate(prompts)]
        runner.max_vision_patches = limit
        calls.clear()
        runner._encode_images([(s, 1) for s in states])
        per_seq = [torch.cat([runner.encoder_cache.get(s.request_id, i) for i in range(len(s.images))])
                   for s in states]
        for s in states:
            runner.encoder_cache.free(s.request_id)
        return per_seq, list(calls)

    runner.model.encode_images = counting
    try:
        whole, whole_calls = embeds(None)
        alone, alone_calls = embeds(1)  # every image in its own call
        first_two = sum(im.size for im in prompts[0].images)
        pairs, pair_calls = embeds(first_two)
    finally:
        runner.max_vision_patches = None
        del runner.model.encode_images
    assert whole_calls == [4] and alone_calls == [1, 1, 1, 1] and pair_calls[0] == 2 and sum(pair_calls) == 4
    for a, b, c, p in zip(whole, alone, pairs, prompts):
        assert a.shape[0] == sum(p.image_tokens)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)
    # and a whole engine step with grouping still generates
    runner.max_vision_patches = 1
    try:
        assert all(o.token_ids for o in llm.chat(convs, PARAMS))
    finally:
        runner.max_vision_patches = None


def test_max_image_patches_bounds_every_image():
    ip = Qwen2VLImageProcessor()
    max_pixels = 28 * 28 * 1280
    limit = max_image_patches(ip, max_pixels)
    assert limit == 1280 * 4 and max_image_grid(ip, max_pixels) == (1, 64, 80)
    t, h, w = ip.grid_thw(896, 1120, max_pixels=max_pixels)
    assert t * h * w == limit  # reached by a real image (a square one falls short)
    for height, width in ((1001, 1001), (3000, 2000), (500, 4000), (123, 4567), (2000, 2000)):
        t, h, w = ip.grid_thw(height, width, max_pixels=max_pixels)
        assert t * h * w <= limit
    assert max_image_patches(ip, 1000) == 4  # below one cell: the smallest image


# -- 5. the CUDA "no room for the KV cache" error ---------------------------------------------------

def test_no_room_error_gives_the_memory_utilization_that_fits(monkeypatch):
    total, free, per_block, peak = 80 * 2**30, 30 * 2**30, 2**20, 10 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 45 * 2**30)
    args = EngineArgs(memory_utilization=0.7)
    with pytest.raises(InvalidRequestError) as info:
        plan_cache(args, per_block, torch.device("cuda"), 10**6, peak, image_setting="max_pixels")
    need = DeviceBudget(total, total - free, peak).utilization_for(per_block)
    assert need == 0.76
    msg = str(info.value)
    assert "Raise memory_utilization to at least 0.76" in msg
    assert "max_num_batched_tokens=8192 tokens" in msg and "max_num_seqs=64 rows" in msg
    assert "one max_pixels image" in msg
    cache = plan_cache(EngineArgs(memory_utilization=need), per_block, torch.device("cuda"), 10**6, peak)
    assert cache.num_blocks >= 1
    with pytest.raises(InvalidRequestError):
        plan_cache(EngineArgs(memory_utilization=0.75), per_block, torch.device("cuda"), 10**6, peak)
    with pytest.raises(InvalidRequestError, match="Even memory_utilization=1"):
        plan_cache(EngineArgs(memory_utilization=0.9), per_block, torch.device("cuda"), 10**6, 60 * 2**30)


def test_min_memory_utilization_is_the_smallest_two_decimal_value():
    for total, free, peak, per_block in ((100, 50, 10, 1), (1000, 500, 100, 100), (7919, 3000, 1234, 77)):
        need = DeviceBudget(total, total - free, peak).utilization_for(per_block)
        assert int(need * total) >= total - free + peak + per_block
        assert int(round(need - 0.01, 2) * total) < total - free + peak + per_block


# -- 6. min_pixels > max_pixels in the image processor ----------------------------------------------

def test_image_processor_bounds_error_says_where_each_came_from():
    ip = Qwen2VLImageProcessor()
    with pytest.raises(InvalidRequestError) as info:
        ip(image(64, 64), min_pixels=2_000_000)
    assert "min_pixels (2000000, passed to this call) is larger than max_pixels (1003520, the processor " \
           "default)" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        ip.smart_resize(64, 64, max_pixels=1000)
    assert "min_pixels (3136, the processor default) is larger than max_pixels (1000, passed to this call)" \
           in str(info.value)


# -- 7. dead code, docs, decode layout -------------------------------------------------------------

def test_decode_layout_is_prepared_once_per_step_by_the_torch_backend():
    """The torch backend builds the decode groups in `prepare` (once per step), into its own frozen
    metadata; layers read it and write nothing back."""
    from vlm_sdk.attention.torch_backend import TorchBackend, TorchMetadata

    class Layer:
        scale = 0.3

    torch.manual_seed(0)
    blocks, bs, hkv, d = 8, 4, 2, 8
    k_cache, v_cache = torch.randn(blocks, bs, hkv, d), torch.randn(blocks, bs, hkv, d)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5, 14]), query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([6, 3], dtype=torch.int32),
        block_tables=torch.tensor([[0, 1], [3, 0]], dtype=torch.int32),
        query_lens_cpu=[1, 1], seq_lens_cpu=[6, 3], max_query_len=1, max_seq_len=6)
    backend = TorchBackend()
    prepared = backend.prepare(meta, k_cache)
    assert isinstance(prepared, TorchMetadata) and prepared.decode_layout is not None
    layout = prepared.decode_layout
    q = torch.randn(2, 4, d)
    k, v = torch.randn(2, hkv, d), torch.randn(2, hkv, d)
    out = backend.forward(q, k, v, Layer(), (k_cache, v_cache), prepared)
    assert prepared.decode_layout is layout
    with pytest.raises(TypeError, match="prepare"):
        backend.forward(q, k, v, Layer(), (k_cache, v_cache), meta)  # not prepared
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.decode_layout = None
    # the same as attending sequence by sequence
    for i, (table, n) in enumerate(((meta.block_tables[0], 6), (meta.block_tables[1], 3))):
        k = k_cache[table.long()].reshape(-1, hkv, d)[:n].repeat_interleave(2, dim=1)  # [n, H, D]
        v = v_cache[table.long()].reshape(-1, hkv, d)[:n].repeat_interleave(2, dim=1)
        ref = torch.softmax(torch.einsum("hd,nhd->hn", q[i], k) * 0.3, -1)
        torch.testing.assert_close(out[i], torch.einsum("hn,nhd->hd", ref, v))


def test_small_cleanups(tmp_path):
    assert isinstance(activation.ACTIVATIONS, MappingProxyType)
    with pytest.raises(TypeError):
        activation.ACTIVATIONS["relu"] = torch.relu
    assert not hasattr(ScheduledBatch(), "num_tokens")
    # shards are read in file-name order whatever order the index lists them in
    for name in ("b.safetensors", "a.safetensors", "c.safetensors"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "c.safetensors", "y": "a.safetensors", "z": "b.safetensors", "w": "c.safetensors"}}))
    assert [p.name for p in _safetensors_files(tmp_path)] == ["a.safetensors", "b.safetensors", "c.safetensors"]
