"""`vlm-sdk bench --structured` runs end to end on the tiny checkpoint (small settings): both workloads
produce every token, the constrained outputs are checked against their grammar, and the report has
its figures; they are timings, so nothing here asserts a speed (BENCHMARKS.md has the real run)."""
import json
import math

from vlm_sdk.cli import main

SMALL = ["--so-requests", "4", "--so-tokens", "6", "--so-rounds", "1"]


def test_structured_bench_reports_both_workloads(tiny_ckpt, capsys):
    assert main(["bench", "--structured", "--model", str(tiny_ckpt), "--json", *SMALL]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["requests"], r["tokens_per_request"], r["rounds"]) == (4, 6, 1)
    assert r["constrained_outputs_checked"] == 2  # every other request of the one "half" round
    # a timing: its value (even its sign, on one round of a busy machine) is the benchmark's to report
    assert set(r["median_ms_per_token"]) == {"none", "half"} and math.isfinite(r["constrained_vs_free_token_cost"])
    assert r["target"] == 1.1 and isinstance(r["meets_target"], bool)
    assert main(["bench", "--structured", "--model", str(tiny_ckpt), *SMALL]) == 0
    assert "a constrained token costs" in capsys.readouterr().out


def test_structured_options_need_the_flag(capsys):
    assert main(["bench", "--so-tokens", "4"]) == 2
    assert "--so-tokens only apply with --structured" in capsys.readouterr().err
