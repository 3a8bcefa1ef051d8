"""Start-up and runtime memory: the breakdown the engine logs, its refusal of a max_model_len the cache
cannot hold (each suggested value then starts), plan == engine on every tiny checkpoint layout, the live
stats and the preemption warning."""
import dataclasses
import logging

import pytest
import torch

from helpers import plan_cache
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.config import DEFAULT_ENCODER_CACHE_MEMORY, EngineArgs
from vlm_sdk.memory.capacity import check_max_model_len_fits
from vlm_sdk.memory.kv import CacheConfig, DeviceBudget, size_cache
from vlm_sdk.memory.weights import weight_bytes
from vlm_sdk.engine.core.preemption_watch import PreemptionWatch
from vlm_sdk.errors import CacheTooSmallError, InvalidRequestError
from vlm_sdk.plan import plan


GIB = 1 << 30


def _llm(ckpt, **kw):
    return LLM(str(ckpt), device="cpu", show_progress=False, **kw)


# -- refusal at start-up ------------------------------------------------------------------------------

def test_refusal_names_the_numbers_and_every_suggested_value_starts(tiny_ckpt):
    with pytest.raises(CacheTooSmallError) as info:
        _llm(tiny_ckpt, num_blocks=10, max_model_len=1000)
    err = info.value
    assert isinstance(err, InvalidRequestError) and err.param == "max_model_len"
    assert (err.max_model_len, err.needed_blocks, err.num_blocks) == (1000, 63, 10)
    assert err.fixes == {"max_model_len": 160, "num_blocks": 63}  # num_blocks overrides kv_cache_memory
    msg = str(err)
    for text in ("max_model_len=1000", "63 blocks of 16 tokens", "10 blocks = 160 tokens",
                 "largest max_model_len that fits is 160", "max_model_len=160; num_blocks=63"):
        assert text in msg, text
    for key, value in err.fixes.items():
        # max_model_len=160 starts a text engine; images of the largest allowed size (256 tokens) would
        # not fit it, which the start-up refuses unless told to accept (tests/server/test_fixes_across_...)
        unfit = {"allow_unfit_images": True} if key == "max_model_len" else {}
        llm = _llm(tiny_ckpt, **{"num_blocks": 10, "max_model_len": 1000, key: value, **unfit})
        assert llm.stats()["max_model_len"] == value if key == "max_model_len" else 1000
        assert llm.stats()["kv_blocks_total"] == (value if key == "num_blocks" else 10)
        assert llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))[0].token_ids


def test_refusal_of_a_kv_cache_memory_cache_offers_kv_cache_memory(tiny_ckpt):
    per_block = 8192  # 2 layers x 2 x 2 KV heads x 16 x 4 bytes x 16 tokens
    with pytest.raises(CacheTooSmallError) as info:
        _llm(tiny_ckpt, kv_cache_memory=10 * per_block + 100, max_model_len=1000)
    assert info.value.fixes == {"max_model_len": 160, "kv_cache_memory": 63 * per_block, "num_blocks": 63}
    llm = _llm(tiny_ckpt, kv_cache_memory=info.value.fixes["kv_cache_memory"], max_model_len=1000)
    assert llm.stats()["kv_blocks_total"] == 63


def test_refusal_on_a_device_budget_names_memory_utilization():
    """The CUDA rule, on numbers: the value offered is the smallest that starts (two decimals)."""
    per_block = 917_504  # Qwen2.5-VL-7B bf16, 16 tokens
    budget = DeviceBudget(total_bytes=24 * GIB, in_use_bytes=16_584_333_312, activation_peak_bytes=970_063_872)
    args = EngineArgs(memory_utilization=0.9, max_model_len=128_000)
    cache = size_cache(args, per_block, 0, budget)
    with pytest.raises(CacheTooSmallError) as info:
        check_max_model_len_fits(cache, 128_000)
    fixes = info.value.fixes
    assert fixes["max_model_len"] == cache.capacity_tokens and set(fixes) == {
        "max_model_len", "memory_utilization", "kv_cache_memory", "num_blocks"}
    u = fixes["memory_utilization"]
    assert f"memory_utilization={u}" in str(info.value)
    check_max_model_len_fits(size_cache(EngineArgs(memory_utilization=u), per_block, 0, budget), 128_000)
    with pytest.raises(CacheTooSmallError):
        check_max_model_len_fits(size_cache(EngineArgs(memory_utilization=round(u - 0.01, 2)), per_block, 0,
                                            budget), 128_000)
    # a device too small for any setting: only max_model_len is offered, and the message says why
    small = DeviceBudget(total_bytes=18 * GIB, in_use_bytes=16_584_333_312, activation_peak_bytes=970_063_872)
    with pytest.raises(CacheTooSmallError) as info:
        check_max_model_len_fits(size_cache(args, per_block, 0, small), 128_000)
    assert set(info.value.fixes) == {"max_model_len"} and "no cache setting can" in str(info.value)


def test_fixes_follow_the_rule_that_sized_the_cache():
    budget = DeviceBudget(80 * GIB, 20 * GIB, GIB)
    assert set(CacheConfig(16, 10, 1000, "", "num_blocks", budget).fixes_for(20)) == {"num_blocks"}
    assert set(CacheConfig(16, 10, 1000, "", "kv_cache_memory").fixes_for(20)) == {"kv_cache_memory", "num_blocks"}
    assert set(CacheConfig(16, 10, 1000, "", "cpu_default").fixes_for(20)) == {"kv_cache_memory", "num_blocks"}
    assert set(CacheConfig(16, 10, 1000, "", "memory_utilization", budget).fixes_for(20)) == {
        "memory_utilization", "kv_cache_memory", "num_blocks"}
    assert CacheConfig(16, 10, 1000, "", "num_blocks", budget).fixes_for(100 * GIB // 1000) == {}


# -- the start-up report, and plan == engine ----------------------------------------------------------

def test_startup_report_is_logged_and_matches_what_was_loaded(tiny_ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="vlm_sdk"):
        llm = _llm(tiny_ckpt, num_blocks=40)
    [text] = [r.getMessage() for r in caplog.records if "KV cache and memory at start-up" in r.getMessage()]
    r = llm.memory_report
    model = local_worker(llm.engine).model
    assert r.weights_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert r.weights_projector_bytes > 0 and r.weights_vision_bytes > 0
    assert (r.num_blocks, r.block_size, r.capacity_tokens) == (40, 16, 640)
    assert r.kv_bytes_per_block == 8192 and r.kv_bytes_per_token == 512
    assert r.activation_peak_bytes is None  # only CUDA measures it
    for piece in ("40 x 8,192 B (16 tokens)", "640 tokens", "num_blocks=40 set by you", "512 B (2 layers x 2 x 2",
                  f"{r.weights_bytes:,} B", "not measured"):
        assert piece in text, piece
    d = r.to_dict()
    for key in ("kv_bytes_per_token", "kv_bytes_per_block", "num_blocks", "capacity_tokens", "weights_bytes",
                "activation_peak_bytes", "encoder_cache_bytes"):
        assert key in d
    # the encoder cache: its bound, the default here; on the CPU it is not carved out of anything
    assert d["encoder_cache_bytes"] == r.encoder_cache_bytes == DEFAULT_ENCODER_CACHE_MEMORY
    [line] = [ln for ln in text.splitlines() if ln.startswith("encoder cache")]
    assert "256.00 MiB" in line and "encoder_cache_memory" in line and "beside the KV cache" in line


def test_startup_report_encoder_cache_off_and_set_aside_on_cuda(tiny_ckpt):
    r = _llm(tiny_ckpt, num_blocks=40, encoder_cache_memory="8MiB").memory_report
    assert r.to_dict()["encoder_cache_bytes"] == 8 << 20
    off = _llm(tiny_ckpt, num_blocks=40, encoder_cache_memory=0).memory_report
    assert off.to_dict()["encoder_cache_bytes"] == 0 and "encoder_cache_memory=0" in off.format()
    # the wording of a cache sized by memory_utilization (CUDA), on the figures of a CPU report
    cuda = dataclasses.replace(r, device_memory_bytes=24 * GIB, device_in_use_bytes=16 * GIB,
                               cache_source="memory_utilization=0.9 of 25,769,803,776 bytes, after ...")
    [line] = [ln for ln in cuda.format().splitlines() if ln.startswith("encoder cache")]
    assert "8.00 MiB" in line and "set aside from the memory_utilization budget before sizing the KV cache" in line


def _agree(ckpt, options, engine_options):
    llm = _llm(ckpt, **engine_options)
    p = plan(ckpt, device="cpu", **options)
    r = llm.memory_report
    for key in ("num_blocks", "capacity_tokens", "kv_bytes_per_block", "kv_bytes_per_token", "block_size",
                "weights_language_model_bytes", "weights_vision_bytes", "weights_projector_bytes",
                "max_model_len", "image_tokens_per_image", "encoder_cache_bytes"):
        assert getattr(p, key) == getattr(r, key), key
    assert p.weights_bytes == weight_bytes(local_worker(llm.engine).model).total


@pytest.mark.parametrize("fixture", ["internvl_llama_ckpt", "internvl_original_ckpt", "internvl_internlm2_ckpt"])
@pytest.mark.parametrize("options", [{}, {"max_dynamic_patch": 2, "num_blocks": 50, "block_size": 32}])
def test_plan_equals_engine_on_the_other_internvl_layouts(request, fixture, options):
    """Each family's default layout: tests/e2e/test_family_capacity.py."""
    _agree(request.getfixturevalue(fixture), options, options)  # plan takes the engine's setting names


def test_plan_refuses_the_other_familys_image_setting(tiny_ckpt, internvl_ckpt):
    with pytest.raises(InvalidRequestError, match="--max-dynamic-patch is not a setting of Qwen2.5-VL.*use --max-pixels"):
        plan(tiny_ckpt, max_dynamic_patch=3)
    with pytest.raises(InvalidRequestError, match="use --max-dynamic-patch"):
        plan(internvl_ckpt, max_pixels=200_000)


# -- runtime ------------------------------------------------------------------------------------------

def test_stats_free_blocks_and_largest_prompt_now(tiny_ckpt):
    llm = _llm(tiny_ckpt, num_blocks=12, max_model_len=128, allow_unfit_images=True)
    s = llm.stats()
    assert (s["kv_blocks_free"], s["largest_prompt_tokens_now"]) == (12, 128)  # capped at max_model_len
    engine = llm.engine
    prompt = engine.inputs.build_prompt([{"role": "user", "content": "Tell me a story about the sea."}])
    engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    s = llm.stats()
    used = -(-len(prompt.token_ids) // 16)
    assert (s["kv_blocks_used"], s["kv_blocks_free"]) == (used, 12 - used)
    assert s["largest_prompt_tokens_now"] == min(128, (12 - used) * 16)
    while engine.has_unfinished():
        engine.step()
    assert llm.stats()["kv_blocks_free"] == 12


def test_preemptions_are_counted_and_warned_about(tiny_ckpt, caplog):
    llm = _llm(tiny_ckpt, num_blocks=8, max_model_len=128, preemption_warning_per_minute=1, allow_unfit_images=True)
    convs = [[{"role": "user", "content": f"Tell me story number {i}."}] for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="vlm_sdk"):
        outs = llm.chat(convs, SamplingParams(max_tokens=50, ignore_eos=True))
    assert all(len(o.token_ids) == 50 for o in outs)
    s = llm.stats()
    assert s["num_preemptions"] >= 2 and s["num_preemptions_last_minute"] == s["num_preemptions"]
    assert s["kv_blocks_used"] == 0
    [warning] = [r.getMessage() for r in caplog.records if "preemptions in the last 60 s" in r.getMessage()]
    for piece in ("preemption_warning_per_minute", "8 blocks x 16 tokens = 128 tokens", "max_num_seqs",
                  "memory_utilization, kv_cache_memory or num_blocks"):
        assert piece in warning, piece


def test_preemption_watch_threshold_window_and_rate_limit():
    now = [0.0]
    watch = PreemptionWatch(3, clock=lambda: now[0], logger=logging.getLogger("test_preemption_watch"))
    said = []

    def describe(n):
        said.append(n)
        return f"{n} preemptions"
    assert watch.record(3, describe) is None  # 3 is not more than 3
    now[0] = 10.0
    assert watch.record(1, describe) == "4 preemptions"
    now[0] = 20.0
    assert watch.record(5, describe) is None and watch.count_last_minute() == 9  # at most one a minute
    now[0] = 75.0  # those of t=0 and t=10 have left the window; over a minute since the warning
    assert watch.count_last_minute() == 5
    assert watch.record(1, describe) == "6 preemptions"
    now[0] = 200.0
    assert watch.count_last_minute() == 0 and watch.record(2, describe) is None
    assert said == [4, 6] and watch.num_warnings == 2


# -- one arithmetic for the too-long error, the refusal and plan ---------------------------------------

def test_too_long_error_offers_the_same_fixes_as_plan(tiny_ckpt):
    from vlm_sdk.errors import InputTooLongError
    llm = _llm(tiny_ckpt, num_blocks=3, allow_unfit_images=True)
    story = [{"role": "user", "content": "Tell me a story about the sea. " * 8}]
    with pytest.raises(InputTooLongError) as info:
        llm.chat(story, SamplingParams(max_tokens=20))
    n = info.value.prompt_tokens
    # both fit the whole request: the prompt and its 20 output tokens
    planned = plan(tiny_ckpt, device="cpu", num_blocks=3, prompt_tokens=n, output_tokens=20)
    [problem] = [pr for pr in planned.problems if f"request of {n + 20} tokens" in pr.message]
    assert problem.fixes == info.value.fixes == {"num_blocks": -(-(n + 20) // 16)}


def test_too_long_error_on_a_device_budget_offers_memory_utilization():
    from vlm_sdk.config import SchedulerConfig
    from vlm_sdk.memory.capacity import check_prompt_fits
    from vlm_sdk.errors import InputTooLongError
    from vlm_sdk.multimodal.inputs import PromptInputs
    per_block = 917_504
    budget = DeviceBudget(total_bytes=24 * GIB, in_use_bytes=16 * GIB, activation_peak_bytes=GIB)
    cache = size_cache(EngineArgs(memory_utilization=0.8), per_block, 0, budget)
    sched = SchedulerConfig(64, 8192, cache.capacity_tokens, "the KV cache capacity")
    n = cache.capacity_tokens + 100
    with pytest.raises(InputTooLongError) as info:
        check_prompt_fits(PromptInputs(token_ids=[1] * n), cache, sched, 128_000, False)
    fixes = info.value.fixes
    # max_tokens not set: sized for the prompt and 256 output tokens, and the message says so
    assert info.value.output_tokens == 256 and "room for 256 output tokens" in str(info.value)
    assert fixes == cache.fixes_for(-(-(n + 256) // 16)) and set(fixes) == {"memory_utilization", "kv_cache_memory",
                                                                            "num_blocks"}
    bigger = size_cache(EngineArgs(memory_utilization=fixes["memory_utilization"]), per_block, 0, budget)
    assert bigger.capacity_tokens >= n + 256


def test_both_limits_below_the_prompt_need_both_settings_in_plan_and_engine(tiny_ckpt):
    from vlm_sdk.errors import InputTooLongError
    llm = _llm(tiny_ckpt, num_blocks=3, max_model_len=40, allow_unfit_images=True)
    story = [{"role": "user", "content": "Tell me a story about the sea. " * 8}]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with pytest.raises(InputTooLongError) as info:
        llm.chat(story, params)
    n = info.value.prompt_tokens + 20  # the whole request
    planned = plan(tiny_ckpt, device="cpu", num_blocks=3, max_model_len=40, prompt_tokens=n - 20, output_tokens=20)
    [problem] = [pr for pr in planned.problems if f"request of {n} tokens" in pr.message]
    assert problem.fixes == info.value.fixes == {}
    assert problem.together == info.value.together == {"max_model_len": n, "num_blocks": -(-n // 16)}
    fixed = _llm(tiny_ckpt, **info.value.together, allow_unfit_images=True)
    assert len(fixed.chat(story, params)[0].token_ids) == 20


# -- the CUDA "no room for the KV cache" error ------------------------------------------------------

def test_no_room_for_the_kv_cache_on_cuda_gives_the_memory_utilization_that_fits(monkeypatch):
    total, free, per_block, peak = 80 * 2**30, 30 * 2**30, 2**20, 10 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    args = EngineArgs(memory_utilization=0.7)
    with pytest.raises(InvalidRequestError) as info:
        plan_cache(args, per_block, torch.device("cuda"), 10**6, peak, image_setting="max_pixels")
    need = DeviceBudget(total, total - free, peak).utilization_for(per_block)
    assert need == 0.76
    msg = str(info.value)
    assert "Raise memory_utilization to at least 0.76" in msg
    assert "max_num_batched_tokens=8192 tokens" in msg and "max_num_seqs=64 rows" in msg
    assert "one max_pixels image" in msg
    cache = plan_cache(EngineArgs(memory_utilization=need), per_block, torch.device("cuda"), 10**6, peak)
    assert cache.num_blocks >= 1
    with pytest.raises(InvalidRequestError):
        plan_cache(EngineArgs(memory_utilization=0.75), per_block, torch.device("cuda"), 10**6, peak)
    with pytest.raises(InvalidRequestError, match="Even memory_utilization=1"):
        plan_cache(EngineArgs(memory_utilization=0.9), per_block, torch.device("cuda"), 10**6, 60 * 2**30)


def test_min_memory_utilization_is_the_smallest_two_decimal_value():
    for total, free, peak, per_block in ((100, 50, 10, 1), (1000, 500, 100, 100), (7919, 3000, 1234, 77)):
        need = DeviceBudget(total, total - free, peak).utilization_for(per_block)
        assert int(need * total) >= total - free + peak + per_block
        assert int(round(need - 0.01, 2) * total) < total - free + peak + per_block


def test_no_room_error_counts_only_this_engines_weights(monkeypatch):
    """A second engine on a device another engine already fills (the GPU run's `bench --multi-turn`): what is
    in use is split into this engine's own weights and the rest (CUDA context, other engines, other
    processes), instead of calling all of it "this engine's weights"."""
    total, free, per_block = 80 * 2**30, 4 * 2**30, 2**20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    with pytest.raises(InvalidRequestError) as info:
        plan_cache(EngineArgs(memory_utilization=0.9), per_block, torch.device("cuda"), 10**6, 2**30,
                   weights=7 * 2**30)
    msg = str(info.value)
    in_use = total - free
    assert f"{in_use:,} are in use ({7 * 2**30:,} by this engine's weights, {in_use - 7 * 2**30:,} by the CUDA " \
           f"context, other engines and other processes)" in msg
