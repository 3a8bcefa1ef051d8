"""Qwen2.5-VL, Qwen3-VL and Qwen3.5 (the Qwen3-VL tower before Gated DeltaNet state layers) video end to end on their tiny checkpoints, transformers as the oracle
(tests/video_reference.py): the patches and grid equal its video processor's on the same sampled frames,
the prompt ids (Qwen3-VL: its timestamps) and M-RoPE positions equal its processor's and `get_rope_index`'s
(videos at two sampling rates, an image and text mixed; Qwen2.5-VL's time axis scaled by tokens_per_second),
greedy tokens equal `generate` with chunked prefill through a video, preemption, the prefix and encoder
caches on and off; the cache keys of a video's patches follow its frames and settings.

Qwen2.5-VL's videos here reach further along their time axis than their spatial grid, where transformers
5.3+ parts from Qwen's own rule (issue 50 point 10, models/common/qwen_vl/rope_index.py): its positions and
greedy tokens are checked against Qwen's rule (video_reference.qwen_original_positions) run through
transformers' model, the difference from 5.24's get_rope_index and generate shown beside it."""
from __future__ import annotations

import itertools

import pytest
import torch

from helpers import image
from video_reference import hf_greedy_at, hf_prompt, hf_video_pixels, qwen_original_positions
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.models.common.qwen_vl.image_processor import pixels_to_device
from vlm_sdk.multimodal.messages import parse_messages
from vlm_sdk.multimodal.video_io import open_video
from vlm_sdk.testing.families import fixtures
from vlm_sdk.testing.reference import hf_greedy
from vlm_sdk.testing.videos import write_video

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Qwen3.5-MoE differs from Qwen3.5 only in its MLP: its video path is this one (its text and image
# parity: tests/e2e/test_families.py, tests/e2e/test_qwen3_5.py)
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
CELLS = {"qwen2_5_vl": 28 * 28, "qwen3_vl": 32 * 32, "qwen3_5": 32 * 32}


def fast(family: str) -> dict:  # 8 frames of 112x168: 4 patches of about 24 tokens
    return {"fps": 2.0, "min_pixels": 4 * CELLS[family], "max_pixels": 24 * CELLS[family]}


def slow(family: str) -> dict:  # 6 frames of 64x96: 3 patches (Qwen2.5-VL: 2.67 position units apart)
    return {"fps": 1.5, "min_pixels": 4 * CELLS[family], "max_pixels": 6 * CELLS[family]}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt(family, tiny_checkpoints):
    return tiny_checkpoints(family)


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_video")
    a, b = root / "a.mp4", root / "b.webm"
    write_video(a, frames=32, fps=8, width=168, height=112)
    write_video(b, frames=40, fps=10, width=96, height=64, codec="libvpx-vp9", container="webm")
    return str(a), str(b)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), show_progress=False)


@pytest.fixture(scope="module")
def hf(family, ckpt):
    return fixtures(family).reference.hf_model(str(ckpt))


def conversation(videos, family) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "Watch"}, {"type": "video", "video": videos[0], **fast(family)},
        {"type": "image", "image": image(120, 90, 5)}, {"type": "text", "text": "then"},
        {"type": "video_url", "video_url": {"url": "file://" + videos[1]}, **slow(family)},
        {"type": "text", "text": "What happens?"}]}]


def reference_inputs(llm, family, ckpt, conv) -> dict:
    """transformers' inputs for `conv`: its image processor, its video processor on the frames
    qwen-vl-utils samples (ours: their indices and sizes are tested against it in test_qwen_video_sampling)."""
    from transformers import AutoConfig, AutoTokenizer
    ref = fixtures(family).reference
    processor = llm.engine.inputs.processor
    template, refs = parse_messages(conv)
    videos, images = [], []
    hf_ip = ref.hf_image_processor(str(ckpt))
    for r in refs:
        if type(r).__name__ == "VideoRef":
            video = open_video(r.source.removeprefix("file://"))
            sampling = processor.video_processor.sample(video, dict(r.options))
            pixels, grid = hf_video_pixels(processor.video_processor.frames(video, sampling), processor.image_processor,
                                           "qwen2_vl" if family == "qwen2_5_vl" else "qwen3_vl")
            videos.append({"pixels": pixels, "grid": grid, "sample_fps": sampling.sample_fps, "times": sampling.times})
        else:
            out = hf_ip([r.source], return_tensors="pt")
            images.append({"pixels": out["pixel_values"], "grid": out["image_grid_thw"][0].tolist()})
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    return hf_prompt(tokenizer, AutoConfig.from_pretrained(str(ckpt)), template, videos, images,
                     qwen3=family != "qwen2_5_vl")


def test_patches_and_grid_equal_transformers_video_processor(llm, family, ckpt, videos):
    conv = conversation(videos, family)
    prompt = llm.engine.inputs.build_prompt(conv)
    inputs = reference_inputs(llm, family, ckpt, conv)
    patches = [im for im in prompt.images if im.meta.frames == 2]
    assert len(patches) == 4 + 3  # 8 and 6 sampled frames, 2 per temporal patch
    ours = pixels_to_device(patches, 2, "cpu", torch.float32)  # [patches, 3 * 2 * 14 * 14]
    assert torch.equal(ours, inputs["pixel_values_videos"])
    assert inputs["video_grid_thw"].tolist() == {"qwen2_5_vl": [[4, 8, 12], [3, 4, 6]],
                                                 "qwen3_vl": [[4, 8, 10], [3, 4, 6]],
                                                 "qwen3_5": [[4, 8, 10], [3, 4, 6]]}[family]
    assert prompt.token_ids == inputs["input_ids"][0].tolist()


def test_positions_equal_get_rope_index(llm, family, ckpt, videos, hf):
    conv = conversation(videos, family)
    prompt = llm.engine.inputs.build_prompt(conv)
    inputs = reference_inputs(llm, family, ckpt, conv)
    extra = {"second_per_grid_ts": inputs["second_per_grid_ts"]} if family == "qwen2_5_vl" else {}
    pos, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                         image_grid_thw=inputs["image_grid_thw"],
                                         video_grid_thw=inputs["video_grid_thw"], **extra)
    if family == "qwen2_5_vl":
        qwen, qwen_delta = original_positions(hf, inputs)
        assert torch.equal(prompt.positions.table, qwen) and prompt.positions.rope_delta == qwen_delta
        # transformers 5.24 agrees up to the end of the first video, whose time axis (0, 2, 4, 6) reaches past
        # its 4x6 grid: it resumes the text at +6 on every axis, Qwen's rule at +7
        types_ = inputs["mm_token_type_ids"][0].tolist()
        after_first_video = types_.index(2) + types_[types_.index(2):].index(0)  # its <|vision_end|>
        differ = (pos[:, 0] != qwen).any(0).nonzero().flatten().tolist()
        assert differ[0] == after_first_video and int(qwen[0, differ[0]] - pos[0, 0, differ[0]]) == 1
    else:
        assert torch.equal(prompt.positions.table, pos[:, 0])
        assert prompt.positions.rope_delta == int(delta)
    starts = [p for p, im in zip(prompt.image_positions, prompt.images) if im.meta.grid_thw == (1, 4, 6)]
    if family == "qwen2_5_vl":  # the slow video's patches are int(k * 2 * (2 / 1.5)) apart in time: 0, 2, 5
        assert [int(prompt.positions.table[0, s] - prompt.positions.table[0, starts[0]]) for s in starts] == [0, 2, 5]
    else:  # each patch after its timestamp: "<0.2 seconds>" (frames 0 and 8 of 40 at 10 fps), ...
        text = llm.engine.inputs.tokenizer.decode(prompt.token_ids[starts[0] - 10: starts[0]])
        assert text.endswith("<0.4 seconds><|vision_start|>")


def original_positions(hf, inputs: dict) -> tuple[torch.Tensor, int]:
    """Qwen's rule on transformers' inputs: blocks in prompt order (the image between the two videos)."""
    tps, merge = hf.config.vision_config.tokens_per_second, hf.config.vision_config.spatial_merge_size
    videos = iter(zip(inputs["video_grid_thw"].tolist(), inputs["second_per_grid_ts"]))
    images = iter(inputs["image_grid_thw"].tolist())
    grids, intervals = [], []
    kinds = [k for k, _ in itertools.groupby(inputs["mm_token_type_ids"][0].tolist()) if k]
    for kind in kinds:
        if kind == 2:
            grid, seconds = next(videos)
            grids.append(grid)
            intervals.append(seconds * tps)  # float32, as the processor's second_per_grid_ts
        else:
            grids.append(next(images))
            intervals.append(0.0)
    return qwen_original_positions(inputs["input_ids"][0].tolist(), inputs["mm_token_type_ids"][0].tolist(),
                                   grids, intervals, merge)


def test_greedy_tokens_equal_transformers_generate(llm, family, ckpt, videos, hf):
    conv = conversation(videos, family)
    inputs = reference_inputs(llm, family, ckpt, conv)
    theirs = hf_greedy(hf, inputs, 12)[0]
    assert len(set(theirs)) > 3  # varied tokens: a real comparison
    ours = llm.chat(conv, GREEDY)[0].token_ids
    if family != "qwen2_5_vl":  # timestamps, no time axis in the positions: both rules agree
        assert ours == theirs
        return
    # Qwen2.5-VL: transformers' model driven with Qwen's positions, decoding after the largest one
    n = inputs["input_ids"].shape[1]
    positions, delta = original_positions(hf, inputs)
    assert ours == hf_greedy_at(hf, inputs, positions, n + delta, 12)
    # the same driver with 5.24's own positions (prompt: get_rope_index; decode: its last position + 1, as
    # its generate does) gives generate's tokens: what differs is the positions alone
    pos, _ = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                     image_grid_thw=inputs["image_grid_thw"], video_grid_thw=inputs["video_grid_thw"],
                                     second_per_grid_ts=inputs["second_per_grid_ts"])
    assert hf_greedy_at(hf, inputs, pos[:, 0], int(pos[0, 0, -1]) + 1, 12) == theirs
    assert ours != theirs


@pytest.mark.parametrize("settings", [
    {"max_num_batched_tokens": 20},  # chunked prefill splits the videos' patches
    {"enable_prefix_caching": False},
    {"encoder_cache_memory": 0},
])
def test_engine_settings_change_no_token(family, ckpt, videos, llm, settings):
    conv = conversation(videos, family)
    expected = llm.chat(conv, GREEDY)[0].token_ids
    other = LLM(str(ckpt), show_progress=False, **settings)
    assert other.chat(conv, GREEDY)[0].token_ids == expected
    assert other.chat(conv, GREEDY)[0].token_ids == expected  # again: from the caches where they are on


def test_preemption_changes_no_token(family, ckpt, videos, llm):
    convs = [conversation(videos, family), [{"role": "user", "content": [{"type": "video", "video": videos[1],
                                                                          **fast(family)},
                                                                  {"type": "text", "text": "And this?"}]}]]
    convs.append(conversation(videos[::-1], family))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free = llm.chat(convs, params)
    longest = max(len(o.prompt_token_ids) + 30 for o in free)
    blocks = -(-longest // 16) + 1  # the longest fits alone, not all three together
    assert blocks < sum(-(-(len(o.prompt_token_ids) + 30) // 16) for o in free)
    tight = LLM(str(ckpt), num_blocks=blocks, allow_unfit_images=True, show_progress=False)
    outs = tight.chat(convs, params)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in free]


def test_cache_keys_follow_frames_and_settings(family, ckpt, videos):
    engine = LLM(str(ckpt), show_progress=False).engine
    a = engine.inputs.build_prompt(conversation(videos, family))
    again = engine.inputs.build_prompt(conversation(videos, family))
    assert [im.key for im in a.images] == [im.key for im in again.images]
    assert len({im.key for im in a.images}) == len(a.images)  # every patch its own
    faster = [{"role": "user", "content": [{"type": "video", "video": videos[0], **fast(family), "fps": 4.0}]}]
    first = {im.key for im in a.images[:4]}
    assert first.isdisjoint(im.key for im in engine.inputs.build_prompt(faster).images)


def test_a_repeated_video_is_served_from_the_caches(family, ckpt, videos):
    """The second time: its blocks from the prefix cache; without that, its patches from the encoder cache."""
    conv = conversation(videos, family)
    llm = LLM(str(ckpt), show_progress=False)
    first = llm.chat(conv, GREEDY)[0]
    second = llm.chat(conv, GREEDY)[0]
    assert second.token_ids == first.token_ids
    n = len(first.prompt_token_ids)
    assert second.num_cached_tokens == (n - 1) // 16 * 16  # every full block, the videos' included
    no_prefix = LLM(str(ckpt), enable_prefix_caching=False, show_progress=False)
    items = len(no_prefix.engine.inputs.build_prompt(conv).images)  # 7 video patches and an image
    assert no_prefix.chat(conv, GREEDY)[0].token_ids == first.token_ids
    hits = no_prefix.stats()["encoder_cache_hits"]
    assert no_prefix.chat(conv, GREEDY)[0].token_ids == first.token_ids
    assert no_prefix.stats()["encoder_cache_hits"] - hits == items == 8


def test_chunked_prefill_holds_about_a_chunk_of_a_long_video(family, ckpt, videos, llm):
    """A request holds the embeddings of the patches its chunk reaches (and one straddling the chunk
    before), not the whole video: at most chunk + 2 patches of rows, with the same tokens."""
    from vlm_sdk.testing.hooks import local_worker
    conv = [{"role": "user", "content": [{"type": "video", "video": videos[0], **fast(family), "fps": 4.0},
                                         {"type": "text", "text": "What happens?"}]}]
    chunked = LLM(str(ckpt), max_num_batched_tokens=20, show_progress=False)
    prompt = chunked.engine.inputs.build_prompt(conv)
    patch = max(im.num_tokens for im in prompt.images)
    assert len(prompt.images) == 8 and sum(im.num_tokens for im in prompt.images) > 20 + 2 * patch
    runner = local_worker(chunked.engine).runner
    held = []
    encode = runner._encode_images

    def measured(scheduled):
        encode(scheduled)
        held.append(sum(e.shape[0] for s in runner.requests.values() for e in s.image_embeds.values()))
    runner._encode_images = measured
    try:
        tokens = chunked.chat(conv, GREEDY)[0].token_ids
    finally:
        del runner._encode_images
    assert 0 < max(held) <= 20 + 2 * patch
    assert tokens == llm.chat(conv, GREEDY)[0].token_ids


@pytest.mark.parametrize("family", ["qwen2_5_vl"], indirect=True)
def test_the_server_decodes_a_long_video_after_qwens_positions(family, ckpt, videos, llm, hf):
    """Issue 50 point 10 through the openai client: the same videos and image sent as `video_url` (file://)
    and `image_url` (data:) parts; the greedy token ids the server returns are Qwen's rule's, not 5.24's
    generate's (Qwen2.5-VL only: the other families' timestamps make the two rules agree, tested above)."""
    import base64
    import io
    from pathlib import Path

    from openai import OpenAI

    from vlm_sdk.server.background import BackgroundServer
    from vlm_sdk.server.config import MediaPolicy, ServerConfig
    conv = conversation(videos, family)
    inputs = reference_inputs(llm, family, ckpt, conv)
    positions, delta = original_positions(hf, inputs)
    qwen = hf_greedy_at(hf, inputs, positions, inputs["input_ids"].shape[1] + delta, 12)
    assert qwen != hf_greedy(hf, inputs, 12)[0]  # where the rules part: a test that can tell them apart
    png = io.BytesIO()
    image(120, 90, 5).save(png, format="PNG")  # lossless: the pixels the Python API's part holds
    parts = []
    for part in conv[0]["content"]:
        if part["type"] == "video":
            opts = {k: v for k, v in part.items() if k not in ("type", "video")}
            parts.append({"type": "video_url", "video_url": {"url": "file://" + part["video"], **opts}})
        elif part["type"] == "image":
            parts.append({"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}})
        else:
            parts.append(part)
    config = ServerConfig(port=0, api_key="k", served_model_name="tiny",
                          media=MediaPolicy(allowed_local_path=str(Path(videos[0]).parent)))
    with BackgroundServer(ckpt, config) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
        resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                              max_tokens=12, temperature=0, extra_body={
                                                  "ignore_eos": True, "return_token_ids": True})
    assert resp.model_extra["prompt_token_ids"] == inputs["input_ids"][0].tolist()
    assert resp.choices[0].model_extra["token_ids"] == qwen
