"""`vlm-sdk bench-serve --flood` end to end on the tiny checkpoint at small sizes: every phase reports, the
victims are timed by their tokens, every flood request is answered, the ratios are computed from the phases;
the figures are timings, so nothing here asserts a speed (BENCHMARKS.md has the real runs)."""
import json

from vlm_sdk.bench.flood import flood_images, ratios
from vlm_sdk.cli import main


def test_flood_bench_runs_every_phase(tiny_ckpt, capsys):
    assert main(["bench-serve", "--flood", "--model", str(tiny_ckpt), "--device", "cpu", "--json",
                 "--flood-seconds", "1", "--flood-warmup", "0.3", "--flood-concurrency", "2",
                 "--flood-victim-interval", "0.5", "--flood-distinct", "64", "--flood-image-size", "64",
                 "--flood-video-frames", "2", "--flood-video-size", "32", "--max-tokens", "3",
                 "--flood-engine-arg", "max_num_encoder_tokens_per_step=16", "--flood-preprocess-images", "3",
                 "--flood-preprocess-size", "96", "--flood-preprocess-workers", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    rows = r["preprocessing"]["rows"]  # images/s of each row, on the same 3 images
    assert list(rows) == ["in process, 1 thread", "in process, 2 threads", "1 worker", "transformers"]
    assert all(rate > 0 for rate in rows.values()), rows
    assert r["preprocessing"]["ratios"]["2_workers_over_1"] is None  # no 2-worker row asked for
    assert list(r["phases"]) == ["victims_alone", "image_flood_alone", "image_flood_with_victims",
                                 "video_flood_alone", "video_flood_with_victims"]
    assert r["engine_args"]["max_num_encoder_tokens_per_step"] == "16"
    for name, phase in r["phases"].items():
        if "victims" in phase:
            v = phase["victims"]
            assert v["requests"] == 2 and v["failed"] == 0, v
            assert 0 < v["ttft_ms"]["p50"] <= v["ttft_ms"]["p99"] and v["tpot_ms"]["p50"] > 0
        if "flood" in phase:
            assert phase["flood"]["errors"] == [] and phase["flood"]["completed"] >= 0
    assert set(r["ratios"]) == {"image", "video"}
    assert set(r["ratios"]["image"]["meets"]) == {"ttft_p99_ratio", "tpot_p99_ratio", "flood_throughput_ratio"}


def test_ratios_are_during_over_alone():
    def victims(ttft, tpot):
        return {"victims": {"ttft_ms": {"p50": ttft, "p99": 2 * ttft}, "tpot_ms": {"p50": tpot, "p99": 2 * tpot}}}
    report = {"phases": {"victims_alone": victims(100, 10),
                         "image_flood_alone": {"flood": {"images_per_s": 4.0}},
                         "image_flood_with_victims": {**victims(250, 25), "flood": {"images_per_s": 3.0}}}}
    r = ratios(report)["image"]
    assert (r["ttft_p99_ratio"], r["tpot_p99_ratio"], r["flood_throughput_ratio"]) == (2.5, 2.5, 0.75)
    assert r["meets"] == {"ttft_p99_ratio": True, "tpot_p99_ratio": False, "flood_throughput_ratio": False}


def test_flood_images_are_distinct():
    images = flood_images(16, 64, seed=3)
    assert len(set(images)) == 16 and images == flood_images(16, 64, seed=3)
    assert set(images).isdisjoint(flood_images(16, 64, seed=4))  # each phase its own
