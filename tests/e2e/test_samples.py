"""The samples run as their docstrings say (against a real server, with --url), and the client-side
CLI commands: `vlm-sdk chat --url` and `vlm-sdk bench-serve --json`."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, image
from vlm_sdk.cli import main
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

ROOT = REPO
SAMPLE = str(ROOT / "samples" / "shapes.png")


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0)) as s:
        yield s


def run_sample(name: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "samples" / name), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd or ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_image_qa_sample_over_http(srv):
    proc = run_sample("image_qa.py", "--url", srv.url, "--image", SAMPLE, "--max-tokens", "6", "What is this?")
    assert proc.stdout.strip()  # the (random-weight) answer
    assert "prompt tokens" in proc.stderr and "6 generated" in proc.stderr


TURN = re.compile(r"\[turn (\d+): (\d+) prompt tokens \(image included\), (\d+) cached; "
                  r"time to first token (\d+) ms; (\d+) generated\]")


def turns(stderr: str) -> list[dict]:
    """The figures line after each answer."""
    return [dict(zip(("turn", "prompt", "cached", "ttft_ms", "generated"), map(int, m.groups())))
            for m in TURN.finditer(stderr)]


def assert_follow_ups_reuse_the_conversation(proc: subprocess.CompletedProcess, block_size: int) -> None:
    got = turns(proc.stderr)
    assert [t["turn"] for t in got] == [1, 2, 3] and all(t["generated"] == 6 for t in got), proc.stderr
    assert "[turn 2] Which shape is largest?" in proc.stderr and "[turn 3] What colour is it?" in proc.stderr
    for before, after in zip(got, got[1:]):
        # each turn sends the whole conversation again: a longer prompt that starts with the previous one,
        # so at least the previous prompt's full blocks come from the prefix cache
        assert after["prompt"] > before["prompt"]
        assert before["prompt"] // block_size * block_size <= after["cached"] < after["prompt"], got


def test_image_qa_follow_ups_over_http(srv):
    proc = run_sample("image_qa.py", "--url", srv.url, "--image", SAMPLE, "--max-tokens", "6", "What is this?",
                      "--follow-up", "Which shape is largest?", "--follow-up", "What colour is it?")
    assert proc.stdout.strip()
    assert_follow_ups_reuse_the_conversation(proc, srv.stats()["kv_block_size"])
    assert srv.stats()["kv_blocks_used"] == 0


def test_image_qa_follow_ups_in_process(tiny_ckpt):
    proc = run_sample("image_qa.py", "--model", str(tiny_ckpt), "--image", SAMPLE, "--max-tokens", "6",
                      "What is this?", "--follow-up", "Which shape is largest?", "--follow-up", "What colour is it?")
    assert turns(proc.stderr)[0]["cached"] == 0  # a fresh engine: nothing cached before the first turn
    assert_follow_ups_reuse_the_conversation(proc, 16)  # EngineArgs.block_size's default


def test_image_qa_refuses_an_empty_follow_up(srv):
    proc = subprocess.run([sys.executable, str(ROOT / "samples" / "image_qa.py"), "--url", srv.url,
                           "--follow-up", " "], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs some text" in proc.stderr


def test_openai_sample_over_http(srv):
    pytest.importorskip("openai")  # the sample's one dependency outside vlm_sdk
    proc = run_sample("openai_client.py", "--url", srv.url, "--image", SAMPLE, "--max-tokens", "6")
    last = proc.stdout.strip().splitlines()[-1]
    assert srv.model_name in last and "completion_tokens=6" in last and "prompt_tokens=" in last


def test_batch_caption_sample_over_http(srv, tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, size in enumerate([(120, 90), (64, 64), (90, 150)]):
        image(*size, seed=i).save(folder / f"img{i}.{'jpg' if i == 1 else 'png'}")
    (folder / "notes.txt").write_text("not an image")  # skipped by extension
    proc = run_sample("batch_caption.py", "--url", srv.url, str(folder), "--concurrency", "2", "--max-tokens", "5")
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert sorted(Path(r["image"]).name for r in lines) == ["img0.png", "img1.jpg", "img2.png"]
    assert all(r["completion_tokens"] == 5 and isinstance(r["caption"], str) for r in lines)
    assert "images/s" in proc.stderr and "tokens/s" in proc.stderr
    out = tmp_path / "captions.jsonl"
    run_sample("batch_caption.py", "--url", srv.url, str(folder), "--max-tokens", "3", "--out", str(out))
    assert len(out.read_text().splitlines()) == 3


def test_chat_cli_over_http(srv, capsys):
    assert main(["chat", "--url", srv.url, "--image", SAMPLE, "--max-tokens", "6", "What is in this image?"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert srv.url in err and "prompt tokens" in err and "time to first token" in err and "tokens/s" in err
    assert "generated 6" in err
    assert main(["chat", "--url", srv.url, "--model", "nope", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["chat", "--url", srv.url, "--image", "/nonexistent/x.png", "hi"]) == 2
    assert "x.png" in capsys.readouterr().err


def test_bench_serve_json_compares_with_in_process(tiny_ckpt, capsys):
    assert main(["bench-serve", "--model", str(tiny_ckpt), "--num-requests", "4", "--concurrency", "2",
                 "--max-tokens", "6", "--rounds", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    http, inproc = report["http"], report["inprocess"]
    assert http["completed"] == inproc["completed"] == 8 and http["failed"] == 0
    assert http["output_tokens"] == inproc["output_tokens"] == 48 and report["same_token_counts"]
    assert len(report["round_ratios"]) == 2 and http["server_exit_code"] == 0  # the server process drained
    assert report["ratio"] > 0 and http["output_tokens_per_s"] > 0
    assert http["ttft_ms"]["p50"] > 0 and http["tpot_ms"]["p99"] > 0
    assert http["server_stats"]["kv_blocks_used"] == 0 and inproc["stats"]["kv_blocks_used"] == 0


def test_bench_serve_against_a_running_server(srv, capsys):
    assert main(["bench-serve", "--url", srv.url, "--num-requests", "3", "--concurrency", "3",
                 "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "http" in out and "in-process" not in out  # no checkpoint given: nothing to compare with
    assert srv.stats()["kv_blocks_used"] == 0


VIDEO_FIGURES = re.compile(r"\[(\d+) prompt tokens, (\d+) of them the video's \((\d+) vision items\); decoding \+ "
                           r"preprocessing \d+ ms, then time to first token \d+ ms; 6 generated\]")


def test_video_qa_sample_in_process_and_over_http(srv, tiny_ckpt, tmp_path):
    from vlm_sdk.testing.videos import write_video
    clip = tmp_path / "clip.mp4"
    write_video(clip, frames=24, fps=8, width=96, height=64)
    local = run_sample("video_qa.py", "--model", str(tiny_ckpt), "--video", str(clip), "--fps", "2",
                       "--max-tokens", "6", "What happens?")
    figures = VIDEO_FIGURES.search(local.stderr)
    assert figures, local.stderr
    prompt, video, items = map(int, figures.groups())
    assert 0 < video < prompt and items == 3  # 6 frames sampled: 3 temporal patches
    remote = run_sample("video_qa.py", "--url", srv.url, "--video", str(clip), "--fps", "2", "--max-tokens", "6",
                        "What happens?")
    assert remote.stdout == local.stdout  # greedy: the same answer over HTTP
    assert f"[{prompt} prompt tokens (video included)" in remote.stderr
    demo = run_sample("video_qa.py", "--model", str(tiny_ckpt), "--max-tokens", "6")
    assert "a 3 s demo clip" in demo.stderr and VIDEO_FIGURES.search(demo.stderr)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_serve_on_one_gpu_gives_each_engine_its_share(tiny_ckpt, capsys):
    """The server process and the in-process engine hold their caches at once on one GPU."""
    assert main(["bench-serve", "--model", str(tiny_ckpt), "--device", "cuda", "--num-requests", "4",
                 "--concurrency", "2", "--max-tokens", "6", "--rounds", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["engine_shares"] == {"server": {"memory_utilization": 0.45},
                                       "inprocess": {"memory_utilization": 0.9}}
    assert report["http"]["completed"] == report["inprocess"]["completed"] == 4 and report["same_token_counts"]
