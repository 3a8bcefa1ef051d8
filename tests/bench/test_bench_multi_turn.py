"""`vlm-sdk bench --multi-turn` runs end to end on the tiny checkpoints (small settings) and prints its
ratios; its figures are timings, so nothing here asserts a speed (BENCHMARKS.md has the real run)."""
import json

import pytest

from vlm_sdk.cli import main

SMALL = ["--turns", "3", "--answer-tokens", "3", "--rounds", "2", "--users", "3", "--user-tokens", "2"]


def test_multi_turn_bench_prints_both_ratios(tiny_ckpt, capsys):
    assert main(["bench", "--multi-turn", "--model", str(tiny_ckpt), *SMALL]) == 0
    out = capsys.readouterr().out
    for piece in ("multi-turn: 2 conversation(s) per mode of 3 turns about one 448x448 image",
                  "TTFT of turns 2-3 (their medians summed), on/off: ", "target <= 0.3x",
                  "identical answers on and off: 6/6",
                  "many users: 3 requests at once sharing one system prompt", "throughput on/off: ",
                  "identical outputs: 3/3", "KV blocks in use after: 0",
                  "2 engines on cpu, each with its own default cache"):
        assert piece in out, piece
    assert len([ln for ln in out.splitlines() if ln.strip()[:1].isdigit()]) == 3  # one row per turn


def test_multi_turn_bench_json_on_internvl(internvl_ckpt, capsys):
    assert main(["bench", "--multi-turn", "--model", str(internvl_ckpt), "--json", *SMALL]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["family"] == "internvl" and r["modes"]["off"] == {"enable_prefix_caching": False,
                                                                "encoder_cache_memory": 0}
    mt, mu = r["multi_turn"], r["many_users"]
    assert mt["ratio_later_turns"] > 0 and len(mt["ratio_per_round"]) == 2 and mt["identical_answers"] == 6
    turns = mt["per_turn"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    # the history grows with the real answers: every turn's prompt is longer than the one before
    assert turns[0]["prompt_tokens"] > 256 and turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"] < \
        turns[2]["prompt_tokens"]
    # later turns start on the cached history (the image included); caching off serves nothing
    assert all(t["cached_tokens_on"] > 256 for t in turns[1:])
    assert mu["throughput_ratio"] > 0 and mu["identical_outputs"] == 3
    for mode in ("on", "off"):
        assert mu[mode]["tokens_per_s"] > 0 and r["stats"][mode]["kv_blocks_used"] == 0
    assert mu["off"]["cached_tokens"] == 0  # caching off serves nothing from a cache


@pytest.mark.parametrize("argv, message", [
    (["--turns", "3"], "--turns only apply with --multi-turn"),
    (["--multi-turn", "--turns", "1"], "--turns must be at least 2"),
    (["--multi-turn", "--users", "0"], "--users must be a positive integer"),
    (["--multi-turn", "--gpu"], "separate benchmarks"),
    (["--multi-turn", "--requests", "8"], "--requests only apply with --gpu")])
def test_multi_turn_bench_refuses_options_it_would_ignore(tiny_ckpt, capsys, argv, message):
    assert main(["bench", "--model", str(tiny_ckpt), *argv]) == 2
    assert message in capsys.readouterr().err


def test_two_engines_share_one_device_each_for_its_half():
    """On CUDA the bench's engines start one after another with memory_utilization 0.45 then 0.9 (each
    bounds the device's total use, the earlier engine's included): with the engine's own sizing rule
    each gets about half; two engines at 0.9 each (the first H100 run) left the second not one block."""
    from vlm_sdk.bench.device_share import shared_engine_args
    from vlm_sdk.config import EngineArgs
    from vlm_sdk.memory.kv import DeviceBudget, size_cache

    assert shared_engine_args("cpu", 2) == [{}, {}]
    shares = shared_engine_args("cuda", 2)
    assert shares == [{"memory_utilization": 0.45}, {"memory_utilization": 0.9}]
    total, context, weights, peak, per_block = 80 * 2**30, 2**29, 2**31, 2**31, 2**20
    encoder = EngineArgs().encoder_cache_memory

    def both(first: float, second: float) -> tuple[int, int]:
        one = size_cache(EngineArgs(memory_utilization=first), per_block, 0,
                         DeviceBudget(total, context + weights, peak, encoder)).num_blocks
        in_use = context + 2 * weights + one * per_block  # the second engine measures after loading its weights
        two = size_cache(EngineArgs(memory_utilization=second), per_block, 0,
                         DeviceBudget(total, in_use, peak, encoder)).num_blocks
        return one, two
    one, two = both(shares[0]["memory_utilization"], shares[1]["memory_utilization"])
    half = 0.45 * total / per_block
    slack = (context + weights + peak + encoder) / per_block
    assert half - slack <= one <= half and half - slack <= two <= half
    # all the engines' memory, with each one's activation peak and encoder cache in use: within the device
    assert context + 2 * (weights + peak + encoder) + (one + two) * per_block < total
    assert both(0.9, 0.9)[1] < 1


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_multi_turn_bench_runs_on_one_gpu(tiny_ckpt, capsys):
    assert main(["bench", "--multi-turn", "--model", str(tiny_ckpt), "--device", "cuda", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "2 engines share cuda, started in this order: on memory_utilization 0.45, off memory_utilization 0.9" in out
    assert "identical answers on and off: 6/6" in out and "KV blocks in use after: 0" in out
