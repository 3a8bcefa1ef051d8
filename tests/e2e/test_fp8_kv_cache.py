"""kv_cache_dtype="fp8" through the engine, on the CPU (the torch backend; the Triton kernels' FP8 paths are
tests/kernels/test_fp8_kv_kernels.py and tests/attention/test_triton_mixed_steps.py):

- greedy tokens with an FP8 cache against the float cache of the same engine, on a batch of prompts of 3 to
  100 tokens, every family. Teacher-forced: each step of the float run's greedy continuation is asked of
  the FP8 engine with the float run's tokens before it, so one flip does not turn every later token into
  a mismatch. Stated rate: at least 70% of the steps pick the same token, and the float run's token's
  logprob moves by at most 1 nat (0.2 on average). Why so loose: the tiny checkpoints' random weights
  (std 0.2, so that greedy tokens vary) give nearly flat next-token distributions, and e4m3 keeps 3
  mantissa bits (a relative error of up to 1/16 per K and V value), so near-ties flip. Measured here
  (Qwen2.5-VL, Qwen3-VL, InternVL; before placeholder ids were kept out of the prompts): 84%, 91%, 80% agreement; mean change 0.13, 0.08, 0.14 nats, largest
  0.64, 0.44, 0.60. A read that is off by 10% (a scale applied wrong) moves the mean to 0.22-0.25 and
  the largest to 0.8-1.2; off by 25%, the largest to 26 nats; off by 2x, agreement falls to 15%.
- the cache holds twice the tokens at the same kv_cache_memory (bf16 -> fp8; four times from float32);
- per-layer scales from the checkpoint (k_scale / v_scale, and the deprecated single kv_scale), else 1.0;
- prefix caching and preemption unchanged: tokens with a cached prefix, and with preemptions, equal an
  FP8 run without them;
- memory you can see: stats() and the start-up report name the KV dtype and the weight format; a prompt
  too long for a kv_cache_memory-sized cache offers kv_cache_dtype='fp8' when the same memory would hold
  it, and not when it would not;
- start-up refusals: an unknown kv_cache_dtype; a GPU the Triton kernels do not cover.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import InputTooLongError, InvalidRequestError
from vlm_sdk.testing.hooks import local_worker

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")
STEPS = 16


PLACEHOLDERS = ("<|image_pad|>", "<|video_pad|>", "<IMG_CONTEXT>")  # ids a prompt of token ids may not hold


def _placeholder_ids(llm: LLM) -> set[int]:
    tok = llm.engine.inputs.tokenizer.wrapped
    ids = {tok.convert_tokens_to_ids(t) for t in PLACEHOLDERS}
    return {i for i in ids if isinstance(i, int) and tok.convert_ids_to_tokens(i) in PLACEHOLDERS}


def _prompts(vocab: int, banned: set[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[t if t not in banned else 10 for t in torch.randint(10, vocab, (n,), generator=g).tolist()]
            for n in (3, 9, 17, 30, 45, 64, 80, 100)]


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_greedy_equals_float_within_the_stated_rate(tiny_checkpoints, family):
    path = str(tiny_checkpoints(family))
    ref = LLM(path, show_progress=False)
    fp8 = LLM(path, show_progress=False, kv_cache_dtype="fp8")
    vocab = ref.engine.inputs.raw_prompt_tokens.vocab_size  # ids a prompt may hold
    banned = _placeholder_ids(ref)  # the image / video placeholders: refused in a prompt of token ids
    assert banned
    prompts = _prompts(vocab, banned)
    float_runs = ref.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True,
                                                      logprobs=0))
    # teacher forcing: the float run's prefix, one step; tokens past the tokenizer's vocabulary (the random
    # LM head has more rows) and placeholder tokens cannot be fed back, so a continuation stops before the first
    forced, expected = [], []
    for prompt, run in zip(prompts, float_runs):
        for k in range(STEPS):
            if max(run.token_ids[:k + 1]) >= vocab or banned & set(run.token_ids[:k]):
                break
            forced.append(prompt + run.token_ids[:k])
            expected.append((run.token_ids[k], run.logprobs[k].logprob))
    assert len(forced) >= 64
    outs = fp8.generate(forced, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=20))
    same, changes = 0, []
    for out, (token, logprob) in zip(outs, expected):
        same += out.token_ids[0] == token
        fp8_logprobs = dict(out.logprobs[0].top_logprobs)
        assert token in fp8_logprobs, "the float run's token fell out of the FP8 run's 20 most likely"
        changes.append(abs(fp8_logprobs[token] - logprob))
    assert same / len(outs) >= 0.7, f"{same} of {len(outs)} teacher-forced steps agree"
    assert max(changes) <= 1.0 and sum(changes) / len(changes) <= 0.2, (max(changes), sum(changes) / len(changes))
    # the cache really is FP8: every layer's K and V
    caches = fp8.engine.executor.collective_rpc(_cache_dtypes)[0]
    assert caches == {torch.float8_e4m3fn}


def _cache_dtypes(worker) -> set:
    return {t.dtype for pair in worker.caches for t in pair}


@pytest.mark.parametrize("dtype, factor", [("bfloat16", 2), ("float32", 4)])
def test_cache_holds_twice_the_tokens_at_the_same_memory(tiny_ckpt, dtype, factor):
    memory = "2MiB"
    base = LLM(tiny_ckpt, show_progress=False, dtype=dtype, kv_cache_memory=memory)
    fp8 = LLM(tiny_ckpt, show_progress=False, dtype=dtype, kv_cache_memory=memory, kv_cache_dtype="fp8")
    a, b = base.stats(), fp8.stats()
    assert b["kv_bytes_per_block"] * factor == a["kv_bytes_per_block"]
    assert b["kv_capacity_tokens"] == factor * a["kv_capacity_tokens"] and b["kv_blocks_total"] == factor * a[
        "kv_blocks_total"]
    assert (a["kv_cache_dtype"], b["kv_cache_dtype"]) == (dtype, "float8_e4m3fn")
    assert a["weight_format"] == b["weight_format"] == "float"
    report = fp8.memory_report
    assert report.kv_cache_dtype == "float8_e4m3fn" and report.to_dict()["kv_cache_dtype"] == "float8_e4m3fn"
    assert "x float8_e4m3fn) (kv_cache_dtype='fp8'" in report.format()
    # what was allocated is what was counted
    allocated = fp8.engine.executor.collective_rpc(_cache_bytes)[0]
    assert allocated == b["kv_blocks_total"] * b["kv_bytes_per_block"]


def _cache_bytes(worker) -> int:
    return sum(t.numel() * t.element_size() for pair in worker.caches for t in pair)


def _first_layer_cache(worker) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t.clone() for t in worker.caches[0])


def _with_scales(src: Path, dst: Path, scales: dict[int, tuple], shape: tuple = ()) -> Path:
    """A copy of the checkpoint with per-layer scale tensors: {layer: (k_scale, v_scale)}, or
    {layer: (kv_scale,)} for the deprecated single one, next to the layer's q_proj."""
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(files[0])
    prefix = next(n for n in tensors if n.endswith("layers.0.self_attn.q_proj.weight")).removesuffix(
        "layers.0.self_attn.q_proj.weight")
    for layer, values in scales.items():
        names = ("k_scale", "v_scale") if len(values) == 2 else ("kv_scale",)
        for name, value in zip(names, values):
            tensors[f"{prefix}layers.{layer}.self_attn.{name}"] = torch.full(shape, value, dtype=torch.float32)
    save_file(tensors, files[0], metadata={"format": "pt"})
    return dst


def _layer_scales(worker) -> list[float]:
    """k_scale, v_scale of each decoder layer in turn."""
    from vlm_sdk.layers.attention import PagedAttention
    return [float(s) for m in worker.model.modules() if isinstance(m, PagedAttention) for s in (m.k_scale, m.v_scale)]


def test_scales_come_from_the_checkpoint_else_one(tiny_ckpt, tmp_path):
    plain = LLM(tiny_ckpt, show_progress=False, kv_cache_dtype="fp8")
    assert plain.engine.executor.collective_rpc(_layer_scales)[0] == [1.0] * 4

    path = _with_scales(tiny_ckpt, tmp_path / "scaled", {0: (0.05, 0.08), 1: (0.02, 0.03)})
    scaled = LLM(str(path), show_progress=False, kv_cache_dtype="fp8")
    assert scaled.engine.executor.collective_rpc(_layer_scales)[0] == pytest.approx([0.05, 0.08, 0.02, 0.03])
    # [1]-shaped (compressed-tensors saves them so) and the deprecated kv_scale: one for both
    path = _with_scales(tiny_ckpt, tmp_path / "kv_scale", {0: (0.04,), 1: (0.06,)}, shape=(1,))
    merged = LLM(str(path), show_progress=False, kv_cache_dtype="fp8")
    assert merged.engine.executor.collective_rpc(_layer_scales)[0] == pytest.approx([0.04, 0.04, 0.06, 0.06])
    # the store divides by them: layer 0's K (values up to ~5) is held as ~20x itself (k_scale 0.05), V as
    # 12.5x (0.08), and reads back as the float cache's within e4m3's rounding (a relative 1/16)
    prompt = _prompts(plain.engine.inputs.raw_prompt_tokens.vocab_size, _placeholder_ids(plain))[5]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    float_llm = LLM(tiny_ckpt, show_progress=False)
    for llm in (float_llm, scaled):
        llm.generate([prompt], params)  # the prompt's K/V stay in their blocks (the same ids in both)
    (k_float, v_float), = [float_llm.engine.executor.collective_rpc(_first_layer_cache)[0]]
    (k_fp8, v_fp8), = [scaled.engine.executor.collective_rpc(_first_layer_cache)[0]]
    assert k_float.abs().max() > 1.0 and (k_float != 0).sum() == len(prompt) * k_float.shape[-1] * 2  # 2 KV heads
    for stored, want, scale in ((k_fp8, k_float, 0.05), (v_fp8, v_float, 0.08)):
        raw = stored.float()
        assert raw.abs().max() > 0.5 * want.abs().max() / scale  # held divided by the scale
        bad = (raw * scale - want).abs() > want.abs() / 16 + scale * 2 ** -10  # e4m3 subnormals: 2**-9 apart
        assert not bad.any(), (raw[bad][:5] * scale, want[bad][:5])


def test_prefix_caching_and_preemption_unchanged(tiny_ckpt):
    """An FP8 engine gives the same greedy tokens with a cached prefix (a second request sharing the first's
    blocks) and under preemption (a cache too small for the batch) as an FP8 engine that has neither."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(10, 900, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(10, 900, (n,), generator=g).tolist() for n in (3, 7, 11, 20)]
    cold = LLM(tiny_ckpt, show_progress=False, kv_cache_dtype="fp8", enable_prefix_caching=False)
    want = [o.token_ids for o in cold.generate(prompts, params)]
    warm = LLM(tiny_ckpt, show_progress=False, kv_cache_dtype="fp8")
    warm.generate(prompts[:1], params)  # the shared prefix's blocks are cached now
    assert [o.token_ids for o in warm.generate(prompts, params)] == want
    assert warm.stats()["prefix_cache_hit_tokens"] >= 3 * 32
    tight = LLM(tiny_ckpt, show_progress=False, kv_cache_dtype="fp8", num_blocks=12, enable_prefix_caching=False,
                allow_unfit_images=True)
    assert [o.token_ids for o in tight.generate(prompts, params)] == want
    assert tight.stats()["num_preemptions"] > 0


def test_too_long_prompt_offers_fp8_where_it_fits(tiny_ckpt):
    probe = LLM(tiny_ckpt, show_progress=False, dtype="bfloat16", num_blocks=4, allow_unfit_images=True)
    per_block = probe.stats()["kv_bytes_per_block"]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_ckpt, show_progress=False, dtype="bfloat16", kv_cache_memory=6 * per_block,
              allow_unfit_images=True)  # 96 tokens
    fits_fp8 = list(range(10, 150))  # 150 tokens + 4: 10 blocks, within the FP8 cache's 12
    with pytest.raises(InputTooLongError) as info:
        llm.generate([fits_fp8], params)
    assert info.value.fixes["kv_cache_dtype"] == "fp8"
    assert "kv_cache_dtype='fp8'" in str(info.value) and "--kv-cache-dtype fp8" in str(info.value)
    fixed = LLM(tiny_ckpt, show_progress=False, dtype="bfloat16", kv_cache_memory=6 * per_block,
                allow_unfit_images=True, kv_cache_dtype="fp8")
    out = fixed.generate([fits_fp8], params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    with pytest.raises(InputTooLongError) as info:  # 13 blocks: more than FP8's 12
        llm.generate([list(range(10, 200))], params)
    assert "kv_cache_dtype" not in info.value.fixes and "kv_cache_memory" in info.value.fixes
    # a num_blocks cache stays num_blocks whatever the dtype: no FP8 fix
    with pytest.raises(InputTooLongError) as info:
        probe.generate([list(range(10, 80))], params)
    assert set(info.value.fixes) == {"num_blocks"}


def test_bad_kv_cache_dtype_is_refused_naming_it(tiny_ckpt):
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of") as info:
        LLM(tiny_ckpt, show_progress=False, kv_cache_dtype="int2")
    assert info.value.param == "kv_cache_dtype"


def test_fp8_on_a_gpu_the_kernels_do_not_cover_is_a_start_up_error(monkeypatch):
    from vlm_sdk.config import check_fp8_kv_cache, fp8_kv_cache_runs
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(InvalidRequestError, match=r"compute capability 8.0 or newer.*Tesla T4 is 7.5") as info:
        check_fp8_kv_cache(torch.device("cuda"), "triton")
    assert "--kv-cache-dtype auto" in str(info.value) and "attention_backend='torch'" in str(info.value)
    assert not fp8_kv_cache_runs(torch.device("cuda"), "triton")
    check_fp8_kv_cache(torch.device("cuda"), "torch")  # torch's casts run on any GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fp8_kv_cache_runs(torch.device("cuda"), "triton")  # A100: e4m3 from its bits
