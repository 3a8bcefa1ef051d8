"""`vlm-sdk bench --host-overhead` runs on the tiny checkpoint at small sizes and reports every batch with
its parts; the figures are timings, so nothing here asserts a speed (BENCHMARKS.md has the real run)."""
import json

from vlm_sdk.cli import main

SMALL = ["--ho-batches", "1,3", "--ho-steps", "3", "--ho-prompt-len", "20"]
PARTS = {"schedule", "worker_input", "runner_update_states", "runner_prepare", "runner_graph_step", "graph_run",
         "sampler", "engine_postprocess"}


def test_host_overhead_bench_reports_each_batch(tiny_ckpt, capsys):
    assert main(["bench", "--host-overhead", "--model", str(tiny_ckpt), "--json", *SMALL]) == 0
    r = json.loads(capsys.readouterr().out)
    # each batch twice: the synchronous engine, and asynchronous scheduling (CUDA's default)
    assert [(x["batch"], x["async_scheduling"]) for x in r["results"]] == [(1, False), (1, True), (3, False), (3, True)]
    for x in r["results"]:
        assert (x["steps"], x["prompt_len"]) == (3, 20)
        assert set(x["parts_mean_ms"]) == PARTS and all(v >= 0 for v in x["parts_mean_ms"].values())
        assert x["median_ms_per_step"] > 0 and x["target_ms"] is None and x["meets_target"] is None
    assert main(["bench", "--host-overhead", "--model", str(tiny_ckpt), *SMALL]) == 0
    assert "median" in capsys.readouterr().out


def test_host_overhead_options_need_the_flag(capsys):
    assert main(["bench", "--ho-steps", "4"]) == 2
    assert "--ho-steps only apply with --host-overhead" in capsys.readouterr().err
