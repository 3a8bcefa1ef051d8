"""`plan` and the device (issue 20, points 2 and 3; rows 1, 5, 6 of its table): every cache setting is
checked against the planned memory and a cache that does not fit is a problem naming the largest that
does; no device on a machine without a GPU is refused with the options that give one; CPU plans are
checked against host RAM; sizes need a unit."""
import os

import pytest
import torch

from helpers import TESTS
from vlm_sdk.cli import main
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.models import registry
from vlm_sdk.plan import device as plan_device
from vlm_sdk.plan import plan
from vlm_sdk.errors import format_size
from vlm_sdk.plan.device import parse_size

CONFIGS = TESTS / "configs"
QWEN_3B = CONFIGS / "qwen2_5_vl_3b.json"
INTERNVL2_8B = CONFIGS / "internvl2_8b.json"
GIB = 1 << 30


def _fit_problems(p):
    return [pr for pr in p.problems if "does not fit in" in pr.message]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# -- row 1: a num_blocks / kv_cache_memory the device cannot hold ----------------------------------------

def test_num_blocks_too_big_for_the_device_is_a_problem_with_the_largest_that_fits(capsys):
    p = plan(QWEN_3B, device_memory="24GiB", num_blocks=20000, block_size=64)
    [problem] = _fit_problems(p)
    largest = (24 * GIB - p.weights_bytes - p.activation_peak_bytes - p.encoder_cache_bytes) // p.kv_bytes_per_block
    assert 1000 < largest < 20000
    assert problem.fixes == {"num_blocks": largest}  # num_blocks overrides kv_cache_memory: only it would help
    for piece in ("20,000 blocks", "43.95 GiB", "24.00 GiB", "of weights", "activation peak",
                  f"num_blocks={largest} "):
        assert piece in problem.message, piece
    assert not _fit_problems(plan(QWEN_3B, device_memory="24GiB", num_blocks=largest, block_size=64))
    assert _fit_problems(plan(QWEN_3B, device_memory="24GiB", num_blocks=largest + 1, block_size=64))
    # the fix is an engine setting the engine takes as it is
    assert registry.engine_args(**problem.fixes, block_size=64).num_blocks == largest
    assert main(["plan", str(QWEN_3B), "--device-memory", "24GiB", "--num-blocks", "20000", "--block-size",
                 "64"]) == 1  # the engine would refuse it: a non-zero status
    out = capsys.readouterr().out
    assert "problems: none" not in out and f"[fixes: num_blocks={largest}]" in out


def test_kv_cache_memory_too_big_for_the_device_names_both_settings():
    p = plan(QWEN_3B, device_memory="24GiB", kv_cache_memory="40GiB", block_size=64)
    [problem] = _fit_problems(p)
    largest = (24 * GIB - p.weights_bytes - p.activation_peak_bytes - p.encoder_cache_bytes) // p.kv_bytes_per_block
    assert problem.fixes == {"kv_cache_memory": largest * p.kv_bytes_per_block, "num_blocks": largest}
    assert "40.00 GiB" in problem.message and f"kv_cache_memory={format_size(largest * p.kv_bytes_per_block)}" \
        in problem.message
    for value in (problem.fixes["kv_cache_memory"], format_size(problem.fixes["kv_cache_memory"])):  # int or unit
        fixed = plan(QWEN_3B, device_memory="24GiB", kv_cache_memory=value, block_size=64)
        assert fixed.num_blocks == largest and not _fit_problems(fixed)


def test_memory_utilization_cache_fits_by_construction_and_weights_too_big_are_named():
    assert not _fit_problems(plan(QWEN_3B, device_memory="24GiB", block_size=64))
    [problem] = _fit_problems(plan(QWEN_3B, device_memory="6GiB", num_blocks=10))
    assert "even without a KV cache" in problem.message and problem.fixes == {}


def test_the_gpu_of_this_machine_counts_what_is_in_use_on_it(monkeypatch):
    """No device given on a machine with a GPU: that GPU, with its current use (mocked here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (20 * GIB, 24 * GIB))
    p = plan(QWEN_3B, num_blocks=20000, block_size=64)
    assert p.device == "cuda" and p.device_in_use_bytes == 4 * GIB and p.dtype == "bfloat16"
    [problem] = _fit_problems(p)
    largest = (20 * GIB - p.weights_bytes - p.activation_peak_bytes - p.encoder_cache_bytes) // p.kv_bytes_per_block
    assert problem.fixes == {"num_blocks": largest} and "4.00 GiB" in problem.message


# -- no GPU: plan asks for a device; --device cpu is checked against host RAM ------------------------------

def test_without_a_gpu_plan_asks_for_a_device(no_gpu, capsys):
    with pytest.raises(InvalidRequestError) as info:
        plan(QWEN_3B)
    assert info.value.param == "device"
    for piece in ("no GPU", "--device-memory 24GiB", 'device_memory="24GiB"', "--device cpu", 'device="cpu"'):
        assert piece in str(info.value), piece
    assert main(["plan", str(QWEN_3B)]) == 2
    captured = capsys.readouterr()
    assert "--device-memory 24GiB" in captured.err and captured.out == ""
    assert plan(QWEN_3B, device_memory="24GiB").device == "device memory"
    with pytest.raises(InvalidRequestError, match="give one"):
        plan(QWEN_3B, device_memory="24GiB", device="cpu")


def test_cpu_plan_is_checked_against_host_ram(tiny_ckpt, monkeypatch):
    p = plan(tiny_ckpt, device="cpu", num_blocks=40)
    assert p.host_memory_bytes == plan_device.host_memory_bytes() and not p.problems
    # a host with room for 10.5 blocks beside the weights, the activation peak and the encoder cache
    host = p.weights_bytes + p.activation_peak_bytes + p.encoder_cache_bytes + 21 * p.kv_bytes_per_block // 2
    monkeypatch.setattr(plan_device, "host_memory_bytes", lambda: host)
    small = plan(tiny_ckpt, device="cpu", num_blocks=40)
    [problem] = _fit_problems(small)
    assert problem.fixes == {"num_blocks": 10} and "host RAM" in problem.message
    assert not _fit_problems(plan(tiny_ckpt, device="cpu", num_blocks=10))
    # the CPU default cache too, and the fixes that grow the cache stay within host RAM
    [problem] = _fit_problems(plan(tiny_ckpt, device="cpu", host_memory=host, max_model_len=4096))
    assert problem.fixes == {"kv_cache_memory": 10 * p.kv_bytes_per_block, "num_blocks": 10}
    with pytest.raises(InvalidRequestError, match="with --device cpu") as info:
        plan(tiny_ckpt, device_memory="24GiB", host_memory="8GiB")
    assert info.value.param == "host_memory"


def test_host_memory_is_this_machines_ram():
    pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert abs(plan_device.host_memory_bytes() - pages) <= 0.01 * pages


# -- row 5: the LMDeploy seed's command without a GPU ----------------------------------------------------

def test_seed_command_without_a_gpu_asks_instead_of_planning_cpu_float32(no_gpu, capsys):
    argv = ["plan", str(INTERNVL2_8B), "--block-size", "64", "--kv-cache-memory", "180709785B"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "float32" not in captured.out and "--device-memory" in captured.err
    assert main(argv + ["--device-memory", "24GiB", "--json"]) == 1  # its problem: a non-zero status
    import json
    out = json.loads(capsys.readouterr().out)
    assert (out["num_blocks"], out["dtype"], out["kv_bytes_per_token"]) == (21, "bfloat16", 131_072)
    # the CPU only when asked for: float32 as the engine, 30 GiB of weights checked against host RAM
    cpu = plan(INTERNVL2_8B, device="cpu", host_memory="16GiB", block_size=64, kv_cache_memory=180709785)
    assert (cpu.dtype, cpu.kv_bytes_per_token, cpu.num_blocks) == ("float32", 262_144, 10)
    [problem] = _fit_problems(cpu)
    assert "16.00 GiB" in problem.message and "host RAM" in problem.message and "30.08 GiB" in problem.message


# -- row 6: sizes need a unit ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, value, suggestion", [
    ("device_memory", "24", "24GiB"), ("kv_cache_memory", "180709785", "180709785B"),
    ("host_memory", "64", "64GiB"), ("kv_cache_memory", "1.5", "1.5GiB")])
def test_a_size_without_a_unit_is_refused_with_an_example(name, value, suggestion):
    with pytest.raises(InvalidRequestError) as info:
        parse_size(value, name)
    assert info.value.param == name and "no unit" in str(info.value) and suggestion in str(info.value)


def test_units_in_plan_and_its_cli(capsys):
    assert parse_size("24GiB", "device_memory") == 24 * GIB == parse_size(24 * GIB, "device_memory")
    assert parse_size("6784MiB", "x") == 6784 << 20 and parse_size("40GB", "x") == 40 * 10**9
    for bad in ("0GiB", "24 parsecs", True, 24.0):
        with pytest.raises(InvalidRequestError):
            parse_size(bad, "device_memory")
    assert main(["plan", str(QWEN_3B), "--device-memory", "24"]) == 2
    assert "--device-memory 24GiB" in capsys.readouterr().err
    # an int in Python is bytes; the same cache as with a unit
    as_int = plan(INTERNVL2_8B, device_memory=24 * GIB, block_size=64, kv_cache_memory=180709785)
    as_unit = plan(INTERNVL2_8B, device_memory="24GiB", block_size=64, kv_cache_memory="180709785B")
    assert as_int.num_blocks == as_unit.num_blocks == 21
    with pytest.raises(InvalidRequestError, match="no unit"):
        plan(INTERNVL2_8B, device_memory="24GiB", kv_cache_memory="180709785")
    assert format_size(8_388_608) == "8MiB" and format_size(54 * 8_388_608) == "432MiB" and format_size(1000) == "1000B"
