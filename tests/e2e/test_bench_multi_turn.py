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
                  "identical outputs: 3/3", "KV blocks in use after: 0"):
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
