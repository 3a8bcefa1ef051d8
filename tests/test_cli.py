"""The README's main job (`vlm-sdk chat` on the built-in tiny model) and a small `vlm-sdk bench`."""
import json
from pathlib import Path

from vlm_sdk.cli import main

SAMPLE = str(Path(__file__).resolve().parents[1] / "samples" / "shapes.png")


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
