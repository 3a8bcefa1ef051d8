"""`vlm-sdk bench --speculative ngram` runs end to end on the tiny checkpoint (small settings): both engines
decode the same greedy workload, their outputs agree, and the report has its figures; they are timings and
acceptance on random weights, so nothing here asserts a speed or a rate's value."""
import json
import math

from vlm_sdk.cli import main

SMALL = ["--spec-requests", "2", "--spec-max-tokens", "12", "--spec-rounds", "1", "--spec-tokens", "3"]


def test_speculative_bench_reports_both_engines(tiny_ckpt, capsys):
    assert main(["bench", "--speculative", "ngram", "--model", str(tiny_ckpt), "--json", *SMALL]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (r["requests"], r["tokens_per_request"], r["rounds"], r["num_speculative_tokens"]) == (2, 12, 1, 3)
    assert r["outputs_equal"] is True and r["weights"] == "given"
    assert set(r["tokens_per_second"]) == {"plain", "speculative"} and math.isfinite(r["speedup"])
    assert 0 <= r["accepted_tokens"] <= r["draft_tokens"] and r["mean_accepted_length"] >= 0
    assert main(["bench", "--speculative", "ngram", "--model", str(tiny_ckpt), *SMALL]) == 0
    assert "mean accepted length" in capsys.readouterr().out


def test_speculative_options_need_the_flag_and_a_built_method(tiny_ckpt, capsys):
    assert main(["bench", "--spec-tokens", "4"]) == 2
    assert "--spec-tokens only apply with --speculative METHOD" in capsys.readouterr().err
    assert main(["bench", "--speculative", "mtp", "--model", str(tiny_ckpt)]) == 2
    assert "not built yet" in capsys.readouterr().err
    assert main(["bench", "--speculative", "eagle3", "--model", str(tiny_ckpt)]) == 2
    assert "needs --spec-draft DIR" in capsys.readouterr().err
    assert main(["bench", "--speculative", "ngram", "--spec-draft", "x", "--model", str(tiny_ckpt)]) == 2
    assert "applies to --speculative eagle3" in capsys.readouterr().err


def test_an_eagle3_draft_given_with_the_model(tiny_ckpt, tmp_path, capsys):
    from vlm_sdk.testing.eagle3 import write_eagle3_draft
    draft = write_eagle3_draft(tiny_ckpt, tmp_path / "draft", aux_layer_ids=[0, 1, 1])
    assert main(["bench", "--speculative", "eagle3", "--model", str(tiny_ckpt), "--spec-draft", str(draft),
                 "--json", *SMALL]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["method"] == "eagle3" and r["outputs_equal"] is True and r["draft_tokens"] > 0
