"""The README's main job (`vlm-sdk chat` on the built-in tiny model) and a small `vlm-sdk bench`."""
import json

import pytest
import torch

from helpers import SAMPLE_IMAGE
from vlm_sdk.cli import main

SAMPLE = str(SAMPLE_IMAGE)


def test_chat_without_model_uses_tiny_random_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLM_SDK_CACHE", str(tmp_path))
    assert main(["chat", "--image", SAMPLE, "--max-tokens", "8", "What is in this image?"]) == 0
    out, err = capsys.readouterr()
    assert "RANDOM weights" in err
    assert (tmp_path / "tiny-qwen2_5_vl" / "config.json").exists()
    assert "prompt tokens" in err and "image tokens" in err and "time to first token" in err
    assert "tokens/s" in err and "KV blocks used" in err
    # a second run reuses the cached checkpoint
    assert main(["chat", "--max-tokens", "4", "hello"]) == 0
    assert "image tokens 0" in capsys.readouterr().err


def test_chat_reports_bad_image_plainly(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLM_SDK_CACHE", str(tmp_path))
    assert main(["chat", "--image", str(tmp_path / "missing.png"), "hi"]) == 2
    assert "missing.png" in capsys.readouterr().err


def test_bench_json_on_tiny_model(tiny_ckpt, capsys):
    assert main(["bench", "--model", str(tiny_ckpt), "--num-requests", "3", "--hf-batch-size", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ours"]["tokens_per_s"] > 0 and report["transformers"]["tokens_per_s"] > 0
    assert report["ratio"] > 0 and 0.0 <= report["identical_greedy_share"] <= 1.0
    assert report["preprocess"]["max_abs_diff"] <= 1e-6
    assert report["ours"]["stats"]["kv_blocks_used"] == 0


def test_bench_json_on_tiny_qwen3_vl(tiny_checkpoints, capsys):
    """The bench reaches the family only through its spec: its image sizes and its preprocessing
    hook, which compares with transformers at Qwen3-VL's patch 16."""
    ckpt = tiny_checkpoints("qwen3_vl")
    assert main(["bench", "--model", str(ckpt), "--num-requests", "2", "--hf-batch-size", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["family"] == "qwen3_vl" and report["image_sizes"] == [[448, 448]]
    assert report["ours"]["tokens_per_s"] > 0 and report["transformers"]["tokens_per_s"] > 0
    pre = report["preprocess"]
    assert pre["max_abs_diff"] <= 1e-6 and pre["grids_match"] and pre["patch_size"] == 16
    assert 2 * 196 < report["ours"]["prompt_tokens"] < 2 * 196 + 100  # 448 / 32 = 14: 14 * 14 tokens
    assert report["identical_greedy_share"] == 1.0


def test_chat_without_model_on_the_tiny_internvl(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLM_SDK_CACHE", str(tmp_path))
    assert main(["chat", "--family", "internvl", "--image", SAMPLE, "--max-tokens", "4", "What is it?"]) == 0
    err = capsys.readouterr().err
    assert "tiny InternVL-shaped checkpoint with RANDOM weights" in err
    assert (tmp_path / "tiny-internvl" / "config.json").exists()


def test_bench_json_on_tiny_internvl(internvl_ckpt, capsys):
    assert main(["bench", "--model", str(internvl_ckpt), "--num-requests", "2", "--hf-batch-size", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["family"] == "internvl" and report["image_sizes"] == [[448, 448], [1920, 1080]]
    assert report["ours"]["tokens_per_s"] > 0 and report["transformers"]["tokens_per_s"] > 0
    assert report["preprocess"]["max_abs_diff"] <= 1e-6 and report["preprocess"]["tiles_match"]
    assert report["preprocess"]["max_num"] == 6
    # 448x448 is one tile, 1920x1080 two plus the thumbnail: 4 tiles of 256 tokens and the text
    assert 4 * 256 < report["ours"]["prompt_tokens"] < 4 * 256 + 100
    assert report["identical_greedy_share"] == 1.0
    assert report["ours"]["stats"]["kv_blocks_used"] == 0


def test_serve_engine_flags_include_backend_and_eager():
    import argparse
    from vlm_sdk.server.cli import add_engine_flags, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--attention-backend", "torch", "--enforce-eager", "--num-blocks", "8"])
    assert engine_kwargs(args) == {"attention_backend": "torch", "enforce_eager": True, "num_blocks": 8}
    assert engine_kwargs(parser.parse_args([])) == {}


def test_expert_parallel_is_a_flag_of_serve_chat_bench_and_plan(capsys):
    import argparse

    import pytest

    from vlm_sdk.cli import main
    from vlm_sdk.server.cli import add_engine_flags, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_kwargs(parser.parse_args(["--tp", "2", "--enable-expert-parallel"])) == \
        {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    for argv in (["chat", "--help", "parallelism"], ["serve", "--help", "all"], ["bench", "--help"], ["plan", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "--enable-expert-parallel" in capsys.readouterr().out, argv


def test_bench_video_json_on_tiny_model(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """`vlm-sdk bench --video`: the parts of the time to first token and the preprocessing comparison,
    on a short clip (the default is 30 s of 480p)."""
    monkeypatch.setenv("VLM_SDK_CACHE", str(tmp_path))
    assert main(["bench", "--video", "--model", str(tiny_ckpt), "--video-seconds", "2", "--video-rounds", "1",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "854x480 at 30 fps, 60 frames" and report["sampled_frames"] == 4
    assert report["frame_size"] == "840x476" and report["video_tokens"] == 2 * 17 * 30
    parts = report["parts_ms"]
    assert all(parts[k] > 0 for k in ("open", "decode", "preprocess", "build_prompt", "prefill"))
    assert parts["ttft"] == pytest.approx(parts["build_prompt"] + parts["prefill"], rel=0.5)
    pre = report["preprocessing"]
    assert pre["ours_ms"] > 0 and pre["ratio_vs_image_processor_per_frame"] > 0
    assert "ratio_vs_video_processor" in pre or pre["transformers_video_processor"].startswith("unavailable: ")
    assert main(["bench", "--video-fps", "1"]) == 2  # a --video option without --video


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("argv", [["--num-requests", "3", "--hf-batch-size", "2"],
                                  ["--structured", "--so-requests", "4", "--so-tokens", "6", "--so-rounds", "1"]])
def test_benches_run_on_one_gpu(tiny_ckpt, capsys, argv):
    """`vlm-sdk bench` (ours, then the transformers peer on the memory our engine gave back) and
    `--structured` on CUDA."""
    assert main(["bench", "--model", str(tiny_ckpt), "--device", "cuda", *argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cuda"
