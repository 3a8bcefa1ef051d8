"""`vlm-sdk bench --gpu`: every section runs end to end on the CPU with the tiny shape (`--tiny`), the
report has the promised structure, and the floors' arithmetic matches transformers' own model."""
import json
import math

import pytest
import torch
from torch import nn

from vlm_sdk.bench.gpu import TINY_RUN, format_report
from vlm_sdk.bench.gpu_figures import DECODE_TARGETS
from vlm_sdk.bench.gpu_parts import TINY, build_checkpoint, decode_weight_bytes, prefill_flops
from vlm_sdk.cli import main


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_tiny_run_reports_every_figure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLM_SDK_CACHE", str(tmp_path / "cache"))
    profile = tmp_path / "profile.txt"
    # the engine as it runs on CUDA: asynchronous scheduling (off by default on the CPU)
    argv = ["bench", "--gpu", "--tiny", "--json", "--async-scheduling", "--profile", str(profile)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)

    assert report["command"] == "vlm-sdk " + " ".join(argv)
    assert report["async_scheduling"] is True
    assert report["device"] and report["preset"] == "tiny" and report["torch"] == torch.__version__
    assert _positive(report["reference_rates"]["copy_GBps"]) and _positive(report["reference_rates"]["matmul_TFLOPs"])
    rate = report["reference_rates"]["matmul_TFLOPs"] * 1e12 / 1e3  # FLOP per ms
    model = report["model"]
    assert model["parameters"] == model["llm_parameters"] + model["vision_parameters"] > 0

    figures = report["figures"]
    batches = TINY_RUN.decode_batches
    # kernel alone, one per decode batch, cold prefill and its two parts, throughput
    assert len(figures) == 1 + len(batches) + 3 + 1
    for f in figures:
        assert _positive(f["value"]) and _positive(f["baseline"]) and _positive(f["ratio"]), f
        assert f["unit"] and f["baseline_kind"] and f["target"]
        assert f["pass"] is None if f["target_ratio"] is None else isinstance(f["pass"], bool)

    attn, decode, throughput = figures[0], figures[1:1 + len(batches)], figures[-1]
    prefill, vision, llm = figures[-4:-1]
    assert attn["unit"] == "GB/s" and attn["target_ratio"] == 0.70
    assert attn["details"]["impl"] in ("triton-interpreter", "torch-reference")
    assert attn["details"]["max_abs_diff_vs_reference"] < 1e-4
    for batch, f in zip(batches, decode):
        assert f["unit"] == "ms/step" and f["target_ratio"] == DECODE_TARGETS.get(batch)
        d = f["details"]
        assert _positive(d["weight_bytes"]) and _positive(d["kv_bytes"])
        assert TINY_RUN.context < d["mean_context"] < TINY_RUN.context + TINY_RUN.decode_max_tokens(batch)
    d = prefill["details"]
    assert all(_positive(v) for v in d["flops"].values())
    assert d["text_tokens"] >= TINY_RUN.prefill_text_tokens and d["image_tokens"] > 0
    assert "cold" in prefill["name"] and prefill["target_ratio"] == 2.0
    assert "vision tower" in vision["name"] and "language model" in llm["name"]
    assert vision["target_ratio"] is None and llm["target_ratio"] is None
    f = d["flops"]  # the parts' floors add up to the whole
    assert math.isclose(vision["baseline"], (f["vision_linear"] + f["vision_attention"]) / rate)
    assert math.isclose(vision["baseline"] + llm["baseline"], prefill["baseline"])
    assert len(d["cold_ms"]) == len(d["vision_ms"]) == len(d["llm_ms"]) == TINY_RUN.prefill_reps
    assert report["engine_settings"]["enable_prefix_caching"] is False
    want = TINY_RUN.requests * TINY_RUN.max_tokens
    assert throughput["details"]["ours"]["tokens"] == throughput["details"]["transformers"]["tokens"] == want

    pv = report["plan_vs_engine"]  # on the CPU both use the CPU default rule: identical
    assert pv["plan_blocks"] == pv["engine_blocks"] > 0 and pv["within_3_percent"] is True
    assert pv["plan_weights_bytes"] == pv["engine_weights_bytes"] > 0

    # cuBLAS vs the small-M kernel at the model's projection shapes, both timed, the winner recorded
    gemm = report["small_m_gemm"]
    assert [(r["projection"], r["rows"]) for r in gemm["rows"]] == [
        (p, m) for p in ("qkv", "o", "gate_up", "down") for m in (1, 2, 4, 8)]
    for r in gemm["rows"]:
        assert _positive(r["torch_us"]) and _positive(r["triton_us"]) and r["winner"] in ("torch", "triton")
        assert r["winner"] == ("triton" if r["triton_us"] < r["torch_us"] else "torch")
        assert r["max_rel_diff"] < 1e-5  # float32: the same products summed in another order
    assert gemm["recommended"] in ("torch", "triton") and report["engine_settings"]["small_m_gemm"] == "torch"
    assert "small-M projections" in format_report(report)

    # the profile: decode at the smallest and largest batch, a cold prefill; every section has rows
    sections = report["profile"]["sections"]
    assert [s["title"].split(":")[0] for s in sections] == [
        f"decode, batch {min(batches)}, {TINY_RUN.context} ctx", f"decode, batch {max(batches)}, {TINY_RUN.context} ctx",
        "cold prefill, 224x224 image + text"]
    for s in sections:
        assert s["rows"] and _positive(s["wall_ms_per_step"]) and _positive(s["recorded_ms_per_step"])
        assert all(_positive(r["us_per_step"]) and _positive(r["calls_per_step"]) for r in s["rows"])
        assert math.isclose(sum(s["kinds_us_per_step"].values()) / 1e3, s["recorded_ms_per_step"], rel_tol=1e-6)
    text = profile.read_text()
    assert text.count("=== ") == 3 and "us/step" in text and "calls/step" in text
    assert sections[0]["rows"][0]["name"] in text

    assert not list((tmp_path / "cache").glob("bench-gpu-*"))  # the temporary checkpoint is gone
    table = format_report(report)
    assert all(f["name"] in table for f in figures) and report["device"] in table and report["command"] in table
    assert "vlm-sdk plan vs the engine" in table


def test_prefill_flops_match_transformers_model(tmp_path):
    model = build_checkpoint(tmp_path / "ckpt", TINY, device=torch.device("cpu"), dtype=torch.float32, seed=0,
                             init_std=0.2)
    visual, layers = model.model.visual, model.model.language_model.layers
    cfg = model.config
    grid, tokens = (1, 10, 12), 7  # a 5x6 merged grid: windows of 4x4, 4x2, 1x4 and 1x2 merged tokens
    flops = prefill_flops(cfg, [grid], tokens)

    def matrices(module):
        return sum(p.numel() for p in module.parameters() if p.ndim >= 2)
    patches = grid[0] * grid[1] * grid[2]
    per_patch = matrices(visual.patch_embed) + matrices(visual.blocks)
    assert flops["vision_linear"] == 2 * (patches * per_patch + patches // 4 * matrices(visual.merger))
    assert flops["llm_linear"] == 2 * tokens * matrices(layers)
    assert flops["lm_head"] == 2 * model.lm_head.weight.numel()

    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf
    _, cu = hf.get_vision_window_index(torch.tensor([grid]), spatial_merge_size=2, window_size=112, patch_size=14,
                                       kwargs={})
    windows = torch.as_tensor(cu).diff()
    v = cfg.vision_config
    full = len(v.fullatt_block_indexes)
    expected = 4 * v.hidden_size * (full * patches ** 2 + (v.depth - full) * int((windows ** 2).sum()))
    assert flops["vision_attention"] == expected
    t = cfg.text_config
    assert flops["llm_attention"] == 4 * t.hidden_size * (tokens * (tokens + 1) // 2) * t.num_hidden_layers


class _Decoder(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.lm_head = None if tied else nn.Linear(8, 100, bias=False)


def test_decode_weight_bytes_reads_the_head_once():
    layers = 2 * (8 * 8 + 8) * 4
    assert decode_weight_bytes(_Decoder(tied=True), batch=5) == layers + 100 * 8 * 4
    assert decode_weight_bytes(_Decoder(tied=False), batch=5) == layers + 100 * 8 * 4 + 5 * 8 * 4


def test_gpu_options_are_refused_without_gpu(capsys):
    assert main(["bench", "--tiny", "--context", "64"]) == 2
    assert "--tiny, --context only apply with --gpu" in capsys.readouterr().err
    assert main(["bench", "--no-async-scheduling"]) == 2
    assert "--async-scheduling only apply with --gpu" in capsys.readouterr().err
    assert main(["bench", "--piecewise-cuda-graphs", "--small-m-gemm", "triton", "--profile", "p.txt"]) == 2
    assert "--profile, --small-m-gemm, --piecewise-cuda-graphs only apply with --gpu" in capsys.readouterr().err


def test_gpu_refuses_cpu_benchmark_checkpoint(capsys):
    assert main(["bench", "--gpu", "--tiny", "--model", "/nowhere"]) == 2
    assert "drop --model" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when there is no GPU")
def test_full_run_without_cuda_points_to_tiny(capsys):
    assert main(["bench", "--gpu"]) == 2
    assert "--tiny" in capsys.readouterr().err


def test_bench_sets_the_image_setting_its_shapes_need(tmp_path):
    """The H100 run: the 3B checkpoint's max_pixels allows a 16,384-token image, above the bench's
    max_model_len, and the engine refused to start. The bench sets the image setting `vlm-sdk plan`
    offers and says so; the engine then starts (here the tiny shape with the 3B's max_pixels)."""
    import dataclasses

    from vlm_sdk import LLM
    from vlm_sdk.bench.gpu import _engine_kwargs, _start_engine
    from vlm_sdk.errors import UnfitImagesError
    cfg = dataclasses.replace(TINY_RUN, shape=dataclasses.replace(TINY, max_pixels=12845056))
    build_checkpoint(tmp_path, cfg.shape, device=torch.device("cpu"), dtype=torch.float32, seed=0, init_std=0.2)
    with pytest.raises(UnfitImagesError):  # as shipped before
        LLM(str(tmp_path), **_engine_kwargs(cfg, torch.device("cpu")))
    report = {"notes": []}
    llm = _start_engine(str(tmp_path), cfg, torch.device("cpu"), report)
    fixed = report["engine_settings"]["max_pixels"]
    assert fixed < 12845056 and any(f"max_pixels={fixed}" in n for n in report["notes"])
    # the largest image at the bench's max_pixels fits (largest_image() may be a video's patch: videos
    # are refused per request when a part's frames do not fit)
    from vlm_sdk.models.common.qwen_vl.image_processor import max_image_grid
    ip = llm.engine.processor.image_processor
    t, h, w = max_image_grid(ip, fixed)
    assert t * h * w // ip.merge_size ** 2 <= llm.engine.scheduler_config.max_model_len
    llm.shutdown()
