"""`vlm-sdk plan --workload FILE` (plan/workload.py, workload_file.py) on generated workloads whose answers
are worked out by hand here: Qwen2.5-VL-3B's published config (36 layers, 2 KV heads x 128, bfloat16:
36,864 bytes a token; block_size 16: 589,824 a block; hidden 2048), 1,000 blocks = 16,000 tokens."""
import json

import pytest

from helpers import TESTS, image
from vlm_sdk.cli import main
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.plan import plan

CONFIG = TESTS / "configs" / "qwen2_5_vl_3b.json"
BASE = dict(dtype="bfloat16", device_memory="80GiB", num_blocks=1000, max_num_seqs=64)
PER_BLOCK = 36 * 2 * 2 * 128 * 2 * 16


def _line(prompt_tokens: int, max_tokens: int, *sizes) -> str:
    content = [{"type": "image_url", "image_url": {"width": w, "height": h}} for w, h in sizes]
    content.append({"type": "text", "text": "described by prompt_tokens"})
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "prompt_tokens": prompt_tokens})


def test_jsonl_workload_by_hand(tmp_path):
    # 448x448 -> 32x32 patches of 14 -> 256 tokens (merge 2x2); 896x448 -> 64x32 -> 512
    lines = [_line(100, 44, (448, 448))] * 3 + [_line(1000, 600)] + [_line(20_000, 100)]
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(lines) + "\n")
    w = plan(CONFIG, **BASE, workload=str(path)).workload
    # totals: 400 (x3) = 25 blocks; 1600 = 100 blocks; 20,100 > the 16,000 the cache holds
    assert w.requests == 5 and w.fit_share == pytest.approx(4 / 5) and w.longest_request_tokens == 16_000
    p50, p95, p99 = w.percentiles
    assert (p50.tokens, p50.blocks, p50.at_once) == (400, 25, 40)  # 1000 // 25, below max_num_seqs
    assert p50.kv_bytes == 25 * PER_BLOCK and p50.kv_share == pytest.approx(64 * 25 / 1000)
    assert (p95.tokens, p99.tokens, p99.at_once) == (20_100, 20_100, 0)  # the 5th request: weight 4/5 below it
    assert "KV cache" in w.binds and "20100" in w.binds.replace(",", "")
    # 64 requests of 20,100 tokens: 64 x 1257 blocks, max_model_len follows the cache (not set)
    assert w.serve_99 == {"num_blocks": 64 * 1257} and w.flags() == "--num-blocks 80448"
    assert (w.images_per_request, w.image_tokens_p50, w.image_tokens_p99) == (pytest.approx(3 / 5), 256, 256)
    assert w.encoder_bytes_per_token == 2048 * 2
    assert w.encoder_cache_images_p50 == 256 * 2**20 // (256 * 4096)  # the 256MiB default bound


def test_the_settings_it_prints_serve_the_p99_request(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join([_line(100, 44, (448, 448))] * 9 + [_line(1000, 600, (896, 448))]))
    first = plan(CONFIG, **BASE, workload=str(path)).workload
    # p99 is the 10th: 1000 + 512 + 600 = 2112 tokens = 132 blocks; 1000 // 132 = 7 at once, not 64
    assert (first.at(99).tokens, first.at(99).blocks, first.at(99).at_once) == (2112, 132, 7)
    assert first.serve_99 == {"num_blocks": 64 * 132} and first.serve_99_alternatives == {"max_num_seqs": 7}
    again = plan(CONFIG, **{**BASE, **first.serve_99}, workload=str(path)).workload
    assert again.at(99).at_once == 64 and again.serve_99 == {} and "max_num_seqs" in again.binds


def test_a_smaller_image_setting_that_runs_max_num_seqs_at_once(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(_line(20, 20, (896, 448)))  # 20 + 512 + 20 = 552 tokens = 35 blocks: 1000 // 35 = 28 at once
    w = plan(CONFIG, **BASE, workload=str(path)).workload
    assert (w.at(99).tokens, w.at(99).at_once) == (552, 28)
    # 64 at once: 1000 // 64 = 15 blocks = 240 tokens each, 200 for the image: a max_pixels whose largest image
    # is at most 200 tokens
    value = w.serve_99_alternatives["max_pixels"]
    assert w.serve_99_alternatives["max_num_seqs"] == 28 and w.serve_99 == {"num_blocks": 64 * 35}
    smaller = plan(CONFIG, **BASE, max_pixels=value, workload=str(path))
    assert smaller.image_tokens_per_image <= 200 and smaller.workload.at(99).at_once == 64


def test_histogram_by_hand(tmp_path):
    hist = {"histogram": {"prompt_tokens": [[100, 1]], "output_tokens": [[44, 3], [1644, 1]],
                          "images": [[0, 1], [1, 1]], "image_sizes": [[448, 448, 1], [896, 448, 1]]}}
    path = tmp_path / "h.json"
    path.write_text(json.dumps(hist))
    w = plan(CONFIG, **BASE, workload=str(path)).workload
    # kinds: output 44 (3/4) or 1644 (1/4) x no image (1/2) | 256 (1/4) | 512 (1/4): 6 kinds
    # totals 144, 400, 656 (each 3/16, 3/16 x2 halves...), 1744, 2000, 2256
    assert w.requests == 6 and w.fit_share == 1
    assert w.at(50).tokens == 400  # weights: 144: 3/8, 400: 3/16 -> 9/16 >= 1/2
    assert w.at(95).tokens == 2256 and w.at(99).tokens == 2256  # the last 1/16
    assert w.at(99).blocks == 141 and w.at(99).at_once == 1000 // 141
    assert w.images_per_request == pytest.approx(0.5) and w.image_tokens_p50 == 256 and w.image_tokens_p99 == 512


def test_image_sizes_from_files_headers_and_refusals(tmp_path):
    png = tmp_path / "a.png"
    image(448, 448, 1).save(png)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{png}"}}]}],
            "max_tokens": 44, "prompt_tokens": 100}
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps(body))
    assert plan(CONFIG, **BASE, workload=str(path)).workload.at(50).tokens == 400
    body["messages"][0]["content"][0]["image_url"]["url"] = "https://example.com/cat.png"
    path.write_text(json.dumps(body))
    with pytest.raises(InvalidRequestError, match="fetches nothing"):
        plan(CONFIG, **BASE, workload=str(path))
    del body["prompt_tokens"]
    body["messages"][0]["content"] = "hello"
    path.write_text(json.dumps(body))
    with pytest.raises(InvalidRequestError, match="prompt_tokens"):  # no tokenizer beside a bare config
        plan(CONFIG, **BASE, workload=str(path))


def test_the_command_prints_the_rows_and_json(tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    path.write_text(_line(100, 44, (448, 448)))
    assert main(["plan", str(CONFIG), "--device-memory", "80GiB", "--num-blocks", "1000", "--workload", str(path)]) == 0
    out = capsys.readouterr().out
    assert "p99 request" in out and "400 tokens = 25 blocks" in out and "to serve 99%" in out
    main(["plan", str(CONFIG), "--device-memory", "80GiB", "--num-blocks", "1000", "--workload", str(path), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["workload"]["percentiles"][0]["at_once"] == 40 and data["workload"]["serve_99_flags"] == "--num-blocks 1600"  # 64 x 25


def test_text_counted_by_the_checkpoints_tokenizer_as_the_engine_counts_it(tiny_ckpt, tmp_path):
    from vlm_sdk import LLM, SamplingParams
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the sea?"}]
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"messages": messages, "max_tokens": 7}))
    w = plan(tiny_ckpt, device_memory="4GiB", dtype="float32", num_blocks=64, workload=str(path)).workload
    with LLM(tiny_ckpt, num_blocks=64, allow_unfit_images=True, show_progress=False) as llm:
        rendered = llm.render(messages, SamplingParams(max_tokens=7))
    assert w.at(50).tokens == rendered.num_tokens + 7


def _video_line(video: dict, prompt_tokens: int = 50, max_tokens: int = 100, **options) -> str:
    part = {"type": "video_url", "video_url": video, **options}
    return json.dumps({"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}],
                       "max_tokens": max_tokens, "prompt_tokens": prompt_tokens})


def test_videos_by_hand(tmp_path):
    # qwen-vl-utils on 28-pixel cells: 10 s at 30 fps, sampled at 2 fps = 20 frames (10 patches of 2); each frame
    # at most 768 cells (602,112 pixels): 1280x720 -> 1008x560 = 36 x 20 = 720 tokens a patch: 7,200 tokens.
    # The part's fps=1: 10 frames, 5 patches, 3,600 tokens
    lines = [_video_line({"width": 1280, "height": 720, "fps": 30, "frames": 300}),
             _video_line({"width": 1280, "height": 720, "fps": 30, "seconds": 10}, fps=1)]
    path = tmp_path / "v.jsonl"
    path.write_text("\n".join(lines))
    w = plan(CONFIG, **BASE, workload=str(path)).workload
    # totals 50 + 7,200 + 100 = 7,350 (460 blocks) and 3,750 (235 blocks)
    assert (w.at(50).tokens, w.at(50).blocks, w.at(99).tokens, w.at(99).blocks) == (3750, 235, 7350, 460)
    assert w.at(99).at_once == 1000 // 460 and w.fit_share == 1 and "2 p99 requests of 460 blocks" in w.binds
    assert (w.videos_per_request, w.video_frames_p50, w.video_items_p50, w.video_tokens_p50) == (1, 10, 5, 3600)
    assert w.video_tokens_p99 == 7200 and w.image_tokens_p50 == 0
    assert w.encoder_cache_videos_p50 == 256 * 2**20 // (3600 * 2048 * 2)  # the 256MiB default bound, bf16 rows
    assert w.serve_99 == {"num_blocks": 64 * 460}
    bad = tmp_path / "bad.jsonl"
    for video, match in (({"width": 1280, "height": 720, "frames": 300}, "fps"),
                         ({"url": "https://example.com/a.mp4"}, "fetches nothing")):
        bad.write_text(_video_line(video))
        with pytest.raises(InvalidRequestError, match=match):
            plan(CONFIG, **BASE, workload=str(bad))
    bad.write_text(_video_line({"width": 1280, "height": 720, "fps": 30, "frames": 300}, nframes=7, fps=1))
    with pytest.raises(InvalidRequestError, match="fps or nframes"):  # the part's options checked as the engine does
        plan(CONFIG, **BASE, workload=str(bad))


# what the chat template writes around a video part that the workload's text count (text only) leaves out, as
# for an image: Qwen's outer <|vision_start|> <|vision_end|>; InternVL's video is its frames' parts (counted)
VIDEO_WRAPPER = {"qwen2_5_vl": 2, "qwen3_vl": 2, "internvl": 0}


@pytest.mark.parametrize("family", sorted(VIDEO_WRAPPER))
def test_a_video_file_is_priced_as_the_engine_runs_it(tiny_checkpoints, tmp_path, family):
    from vlm_sdk import LLM, SamplingParams
    from vlm_sdk.testing.videos import write_video
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(write_video(frames=16, fps=8, width=64, height=48))
    ckpt = tiny_checkpoints(family)
    # the part's max_frames (both families' setting): InternVL's 4 frames, Qwen's 4 of 2 s at 2 fps as without it
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": f"file://{clip}"}, "max_frames": 4},
                                             {"type": "text", "text": "What happens?"}]}]
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"messages": messages, "max_tokens": 4}))
    w = plan(ckpt, device="cpu", num_blocks=512, block_size=4, workload=str(path)).workload
    with LLM(ckpt, num_blocks=512, block_size=4, show_progress=False) as llm:
        rendered = llm.render(messages, SamplingParams(max_tokens=4))
    (video,) = rendered.videos()
    assert video.frames == 4
    assert (w.video_frames_p50, w.video_items_p50, w.video_tokens_p50) == (video.frames, video.items, video.tokens)
    # the whole prompt: the text by the tokenizer, the video's tokens and the text between its items (Qwen3-VL's
    # timestamps, InternVL's frame labels)
    assert w.at(50).tokens - 4 == rendered.num_tokens - VIDEO_WRAPPER[family]


def test_a_family_without_video_refuses_a_video_part(gemma3_ckpt, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(_video_line({"width": 640, "height": 480, "fps": 30, "frames": 60}))
    with pytest.raises(InvalidRequestError, match="takes no video"):
        plan(gemma3_ckpt, device="cpu", num_blocks=64, workload=str(path))
