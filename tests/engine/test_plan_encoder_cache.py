"""The encoder cache in the memory arithmetic (issue 15): its bound, encoder_cache_memory, is set aside
from the memory_utilization budget before the KV cache is sized on CUDA (weights + activation peak +
encoder cache + KV <= utilization x total), the fixes that raise memory_utilization count it, and
`vlm-sdk plan` shows it (a line, a JSON key, `--encoder-cache-memory`) and budgets it the same way.
CUDA sizing is tested on numbers (a mocked `mem_get_info`), as the other DeviceBudget tests are."""
import json

import pytest
import torch

from helpers import TESTS, plan_cache
from vlm_sdk.protocol.cache_layout import CacheLayout
from vlm_sdk.protocol.cache_spec import AttentionSpec
from vlm_sdk.cli import main
from vlm_sdk.config import DEFAULT_ENCODER_CACHE_MEMORY, EngineArgs
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.plan import plan
from vlm_sdk.worker import kv_cache
from vlm_sdk.memory.kv import CacheConfig, DeviceBudget, size_cache

QWEN_3B = TESTS / "configs" / "qwen2_5_vl_3b.json"
MIB, GIB = 1 << 20, 1 << 30
PER_BLOCK = 917_504  # Qwen2.5-VL-7B bf16, 16 tokens


# -- DeviceBudget and the engine's CUDA sizing ------------------------------------------------------------

def test_budget_sets_the_encoder_cache_aside_before_the_kv_cache():
    without = DeviceBudget(24 * GIB, 16 * GIB, GIB)
    with_enc = DeviceBudget(24 * GIB, 16 * GIB, GIB, 512 * MIB)
    assert with_enc.reserved_bytes == 17 * GIB + 512 * MIB
    kv = int(0.9 * 24 * GIB) - 17 * GIB - 512 * MIB
    assert with_enc.blocks(0.9, PER_BLOCK) == kv // PER_BLOCK
    assert without.blocks(0.9, PER_BLOCK) - with_enc.blocks(0.9, PER_BLOCK) in (585, 586)  # 512 MiB / 896 KiB
    # the whole identity: weights & co + activation peak + encoder cache + KV <= utilization x total
    blocks = with_enc.blocks(0.9, PER_BLOCK)
    assert with_enc.reserved_bytes + blocks * PER_BLOCK <= 0.9 * 24 * GIB
    assert with_enc.reserved_bytes + (blocks + 1) * PER_BLOCK > 0.9 * 24 * GIB


def test_utilization_for_counts_the_encoder_cache():
    for total, in_use, peak, enc, cache in ((100, 30, 10, 5, 1), (7919, 3000, 1234, 400, 77),
                                            (80 * GIB, 20 * GIB, GIB, 256 * MIB, 40 * GIB)):
        b = DeviceBudget(total, in_use, peak, enc)
        need = b.utilization_for(cache)
        assert int(need * total) >= in_use + peak + enc + cache
        assert int(round(need - 0.01, 2) * total) < in_use + peak + enc + cache
    # the encoder cache alone can push the need over a hundredth
    assert DeviceBudget(100, 30, 10).utilization_for(10) == 0.5
    assert DeviceBudget(100, 30, 10, 1).utilization_for(10) == 0.51


def test_memory_utilization_fix_applied_with_the_encoder_cache_gives_the_blocks():
    """The fix a too-small cache offers (CacheConfig.fixes_for -> utilization_for), applied, yields at
    least the blocks asked for: the encoder cache is in both halves of the arithmetic."""
    budget = DeviceBudget(24 * GIB, 16 * GIB, GIB, DEFAULT_ENCODER_CACHE_MEMORY)
    cache = size_cache(EngineArgs(memory_utilization=0.8), PER_BLOCK, 0, budget)
    want = cache.num_blocks + 1000
    u = cache.fixes_for(want)["memory_utilization"]
    assert size_cache(EngineArgs(memory_utilization=u), PER_BLOCK, 0, budget).num_blocks >= want
    assert size_cache(EngineArgs(memory_utilization=round(u - 0.01, 2)), PER_BLOCK, 0, budget).num_blocks < want
    assert f"{DEFAULT_ENCODER_CACHE_MEMORY:,}-byte encoder cache" in cache.source


@pytest.fixture
def cuda_24g(monkeypatch):
    """A CUDA device of 24 GiB with 16 GiB in use (weights and others), as `plan_cache` measures it."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * GIB, 24 * GIB))
    return torch.device("cuda")


def test_engine_cuda_sizing_subtracts_encoder_cache_memory(cuda_24g):
    peak = GIB
    off = plan_cache(EngineArgs(memory_utilization=0.9, encoder_cache_memory=0), PER_BLOCK, cuda_24g, 10**6, peak)
    default = plan_cache(EngineArgs(memory_utilization=0.9), PER_BLOCK, cuda_24g, 10**6, peak)
    big = plan_cache(EngineArgs(memory_utilization=0.9, encoder_cache_memory="2GiB"), PER_BLOCK, cuda_24g, 10**6,
                     peak)
    assert off.budget.encoder_cache_bytes == 0 and big.budget.encoder_cache_bytes == 2 * GIB
    assert default.budget.encoder_cache_bytes == DEFAULT_ENCODER_CACHE_MEMORY
    free_for_kv = int(0.9 * 24 * GIB) - 16 * GIB - peak
    assert off.num_blocks == free_for_kv // PER_BLOCK
    assert default.num_blocks == (free_for_kv - DEFAULT_ENCODER_CACHE_MEMORY) // PER_BLOCK
    assert big.num_blocks == (free_for_kv - 2 * GIB) // PER_BLOCK
    # kv_cache_memory / num_blocks are taken as given (the encoder cache does not shrink them)
    given = plan_cache(EngineArgs(kv_cache_memory="1GiB", encoder_cache_memory="2GiB"), PER_BLOCK, cuda_24g, 10**6,
                       peak)
    assert given.num_blocks == GIB // PER_BLOCK


def test_no_room_error_names_the_encoder_cache_and_its_utilization_fits(cuda_24g):
    # 0.75 x 24 GiB = 18 GiB = in use 16 + peak 1 + ~1 GiB: room for the KV cache only without a 1 GiB encoder cache
    args = EngineArgs(memory_utilization=0.75, encoder_cache_memory="1GiB")
    with pytest.raises(InvalidRequestError) as info:
        plan_cache(args, PER_BLOCK, cuda_24g, 10**6, GIB, image_setting="max_pixels")
    msg = str(info.value)
    assert f"encoder_cache_memory sets aside {GIB:,}" in msg and "or encoder_cache_memory" in msg
    need = DeviceBudget(24 * GIB, 16 * GIB, GIB, GIB).utilization_for(PER_BLOCK)
    assert f"Raise memory_utilization to at least {need:.2f}" in msg
    assert plan_cache(EngineArgs(memory_utilization=need, encoder_cache_memory="1GiB"), PER_BLOCK, cuda_24g, 10**6,
                      GIB).num_blocks >= 1
    assert plan_cache(EngineArgs(memory_utilization=0.75, encoder_cache_memory=0), PER_BLOCK, cuda_24g, 10**6,
                      GIB).num_blocks >= 1


def test_out_of_memory_while_allocating_leaves_room_for_the_encoder_cache(cuda_24g, monkeypatch):
    def oom(*a, **k):
        raise torch.OutOfMemoryError("mocked")
    monkeypatch.setattr(kv_cache, "allocate_caches", oom)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    cache = plan_cache(EngineArgs(kv_cache_memory="4GiB", encoder_cache_memory="2GiB"), PER_BLOCK, cuda_24g, 10**6,
                       GIB)
    with pytest.raises(InvalidRequestError) as info:
        kv_cache.allocate_or_explain(CacheLayout.uniform(28, AttentionSpec(4, 128, "bfloat16")), cache, cuda_24g)
    fits = (8 * GIB - GIB - 2 * GIB) // PER_BLOCK  # free minus the activation peak and the encoder cache
    assert f"set num_blocks <= {fits} " in str(info.value) and f"the encoder cache {2 * GIB:,}" in str(info.value)


# -- vlm-sdk plan ---------------------------------------------------------------------------------------

def test_plan_budgets_the_encoder_cache_like_the_engine():
    base = dict(device_memory="24GiB", block_size=64)
    default = plan(QWEN_3B, **base)
    off = plan(QWEN_3B, **base, encoder_cache_memory=0)
    big = plan(QWEN_3B, **base, encoder_cache_memory="2GiB")
    assert (default.encoder_cache_bytes, off.encoder_cache_bytes, big.encoder_cache_bytes) == (
        DEFAULT_ENCODER_CACHE_MEMORY, 0, 2 * GIB)
    room = int(0.9 * 24 * GIB) - default.weights_bytes - default.activation_peak_bytes
    assert off.num_blocks == room // off.kv_bytes_per_block
    assert default.num_blocks == (room - DEFAULT_ENCODER_CACHE_MEMORY) // default.kv_bytes_per_block
    assert big.num_blocks == (room - 2 * GIB) // big.kv_bytes_per_block
    assert not default.problems and default.to_dict()["encoder_cache_bytes"] == DEFAULT_ENCODER_CACHE_MEMORY


def test_plan_counts_the_encoder_cache_beside_a_given_kv_cache():
    """num_blocks that fit beside the weights and activations, but not beside a 4 GiB encoder cache too."""
    fit = plan(QWEN_3B, device_memory="24GiB", block_size=64, num_blocks=20000, encoder_cache_memory=0)
    [problem] = [pr for pr in fit.problems if "does not fit in" in pr.message]
    largest = problem.fixes["num_blocks"]
    assert not plan(QWEN_3B, device_memory="24GiB", block_size=64, num_blocks=largest, encoder_cache_memory=0).problems
    p = plan(QWEN_3B, device_memory="24GiB", block_size=64, num_blocks=largest, encoder_cache_memory="4GiB")
    [problem] = [pr for pr in p.problems if "does not fit in" in pr.message]
    assert problem.fixes == {
        "num_blocks": (24 * GIB - p.weights_bytes - p.activation_peak_bytes - 4 * GIB) // p.kv_bytes_per_block}
    assert "4.00 GiB (4,294,967,296 B) encoder cache (encoder_cache_memory)" in problem.message


def test_plan_memory_utilization_fix_counts_the_encoder_cache():
    cfg = TESTS / "configs" / "qwen2_5_vl_7b.json"
    low = plan(cfg, device_memory="48GiB", memory_utilization=0.3, encoder_cache_memory="4GiB")
    [problem] = low.problems
    u = problem.fixes["memory_utilization"]
    assert u > plan(cfg, device_memory="48GiB", memory_utilization=0.3,
                    encoder_cache_memory=0).problems[0].fixes["memory_utilization"]
    assert plan(cfg, device_memory="48GiB", memory_utilization=u, encoder_cache_memory="4GiB").num_blocks >= 1


def test_plan_cli_encoder_cache_memory_line_key_and_help(capsys):
    argv = ["plan", str(QWEN_3B), "--device-memory", "24GiB", "--block-size", "64"]
    assert main(argv + ["--encoder-cache-memory", "512MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["encoder_cache_bytes"] == 512 * MIB
    assert main(argv + ["--encoder-cache-memory", "512MiB"]) == 0
    table = capsys.readouterr().out
    [line] = [ln for ln in table.splitlines() if ln.startswith("encoder cache")]
    assert "512.00 MiB" in line and "set aside from the memory_utilization budget" in line
    assert main(argv + ["--encoder-cache-memory", "0"]) == 0
    assert "encoder_cache_memory=0" in capsys.readouterr().out
    assert main(argv + ["--encoder-cache-memory", "512"]) == 2  # a bare number is refused, with an example
    assert "no unit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--encoder-cache-memory" in help_text and "encoder cache" in help_text
