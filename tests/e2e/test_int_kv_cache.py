"""kv_cache_dtype="int8" / "int4" (LMDeploy's quant_policy 8 / 4) through the engine, on the CPU (the torch
backend; the Triton kernels' int paths are tests/kernels/test_int_kv_kernels.py and, through the engine,
the triton case below).

Greedy agreement, and the bound that predicts it. Per element the int8 cache reads back within s/2,
s = (max - min) / 255 of the token's head (kernels/kv_int.py, tested there), so a query q's attention
logit on key j moves by at most |q|_1 * s_j / (2 sqrt(D)) and the softmax weights by a factor within
exp(+-2 of that); the FP8 cache's bound is |x| / 16 per element (e4m3's half ulp), the same chain with
|x_d| / 16 in place of s / 2. A greedy step flips only where the float run's top-1 / top-2 logprob
margin is below the logit change, and for small changes (margins spread smoothly near 0) the number of
such steps grows in proportion to the change: with rho = (int8's per-element bound) / (FP8's), taken
over the K and V the int8 engine stored for these very prompts, the int8 run disagrees on at most
rho x the FP8 run's disagreements of the same steps, plus a Poisson allowance of 3 sqrt(that) + 1
(the counts are small). The stated prediction is asserted; rho is ~0.1-0.3 on these checkpoints.
Teacher-forced, as tests/e2e/test_fp8_kv_cache.py: each step of the float run's greedy continuation is
asked with the float run's tokens before it. The float run's token's logprob: its mean change is at most
2 rho x FP8's mean change + 0.01 nat (the same linear scaling, a factor 2 for the spread), its largest at
most 0.5 nat. int4 (Q = 15: 17x int8's step) is measured and printed, not required to agree.

Also: bytes (the cache holds what page_bytes says and the scales are allocated beside it), quant_policy,
prefix caching / preemption / chunked prefill unchanged under int8, the Triton backend (interpreter) equal
to the torch backend, sliding-window (Gemma 3) and state layers (Qwen3.5: its state tensors stay in the
model's dtype), and the too-long error's fix naming int4, applied.
"""
from __future__ import annotations

import math

import pytest
import torch

from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import InputTooLongError, InvalidRequestError
from vlm_sdk.kernels import kv_int

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl", "gemma3", "qwen3_5")
STEPS = 16
PLACEHOLDERS = ("<|image_pad|>", "<|video_pad|>", "<IMG_CONTEXT>", "<image_soft_token>", "<start_of_image>",
                "<end_of_image>", "<|vision_start|>", "<|vision_end|>")


def _banned(llm: LLM) -> set[int]:
    tok = llm.engine.inputs.tokenizer.wrapped
    ids = {tok.convert_tokens_to_ids(t) for t in PLACEHOLDERS}
    return {i for i in ids if isinstance(i, int) and tok.convert_ids_to_tokens(i) in PLACEHOLDERS}


def _prompts(vocab: int, banned: set[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[t if t not in banned else 10 for t in torch.randint(10, vocab, (n,), generator=g).tolist()]
            for n in (3, 9, 17, 30, 45, 64, 80, 100)]


def _teacher_forced(ref: LLM, prompts: list[list[int]], vocab: int, banned: set[int]):
    """(forced prompts, the float run's (token, logprob) at each)."""
    runs = ref.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=1))
    forced, expected = [], []
    for prompt, run in zip(prompts, runs):
        for k in range(STEPS):
            if max(run.token_ids[:k + 1]) >= vocab or banned & set(run.token_ids[:k]):
                break
            forced.append(prompt + run.token_ids[:k])
            expected.append((run.token_ids[k], run.logprobs[k].logprob))
    return forced, expected


def _score(llm: LLM, forced, expected) -> tuple[int, list[float]]:
    """(steps that pick the float run's token, the change of that token's logprob at each step)."""
    outs = llm.generate(forced, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=20))
    same, changes = 0, []
    for out, (token, logprob) in zip(outs, expected):
        same += out.token_ids[0] == token
        top = dict(out.logprobs[0].top_logprobs)
        changes.append(abs(top[token] - logprob) if token in top else math.inf)
    return same, changes


def _bounds(worker) -> tuple[float, float]:
    """(int8's mean per-element bound s / 2, FP8's |x| / 16 on the same values) over the written K/V slots."""
    int_bound, fp8_bound = [], []
    for cache in worker.caches:
        if len(cache) != 4:  # a state layer's tensors
            continue
        for codes, sz in ((cache[0], cache[2]), (cache[1], cache[3])):
            written = sz[..., 0] > 0  # [blocks, block_size, Hkv]
            x = kv_int.dequantize(codes[written], sz[written], 8, torch.float32)  # [n, D]
            int_bound.append(sz[written][:, 0].repeat_interleave(x.shape[-1]) / 2)
            fp8_bound.append(x.abs().reshape(-1) / 16)
    return float(torch.cat(int_bound).mean()), float(torch.cat(fp8_bound).mean())


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_greedy_agrees_within_the_predicted_rate(tiny_checkpoints, family):
    path = str(tiny_checkpoints(family))
    ref = LLM(path, show_progress=False)
    vocab = ref.engine.inputs.raw_prompt_tokens.vocab_size
    banned = _banned(ref)
    forced, expected = _teacher_forced(ref, _prompts(vocab, banned), vocab, banned)
    assert len(forced) >= 64
    ref.shutdown()
    results = {}
    for dtype in ("fp8", "int8", "int4"):
        llm = LLM(path, show_progress=False, kv_cache_dtype=dtype)
        results[dtype] = _score(llm, forced, expected)
        if dtype == "int8":
            int_bound, fp8_bound = llm.engine.executor.collective_rpc(_bounds)[0]
        llm.shutdown()
    n = len(forced)
    rho = int_bound / fp8_bound
    flips = {d: n - same for d, (same, _) in results.items()}
    mean = {d: sum(c) / n for d, (_, c) in results.items()}
    print(f"\n{family}: {n} steps, rho {rho:.3f}; disagreements fp8 {flips['fp8']}, int8 {flips['int8']}, "
          f"int4 {flips['int4']}; mean |dlogprob| fp8 {mean['fp8']:.4f}, int8 {mean['int8']:.4f}, "
          f"int4 {mean['int4']:.4f}; max int8 {max(results['int8'][1]):.4f}, int4 {max(results['int4'][1]):.4f} "
          f"(inf: the float run's token left int4's top 20 at {results['int4'][1].count(math.inf)} steps)")
    assert 0 < rho < 1  # int8's step is finer than e4m3's rounding on these values
    predicted = rho * flips["fp8"]
    assert flips["int8"] <= predicted + 3 * math.sqrt(predicted) + 1, (flips, rho)
    assert mean["int8"] <= 2 * rho * mean["fp8"] + 0.002, (mean, rho)
    assert max(results["int8"][1]) <= 0.25


def _caches(worker) -> list[tuple]:
    return [tuple((t.dtype, tuple(t.shape)) for t in c) for c in worker.caches]


def _cache_bytes(worker) -> int:
    return sum(t.numel() * t.element_size() for c in worker.caches for t in c)


@pytest.mark.parametrize("dtype, code_width", [("int8", 16), ("int4", 8)])
def test_pages_and_scales_are_what_the_bytes_count(tiny_ckpt, dtype, code_width):
    """The tiny Qwen2.5-VL (2 layers, 2 KV heads, head_dim 16): uint8 code pages [blocks, 16, 2, 16 or 8]
    and float32 (scale, zero) pairs [blocks, 16, 2, 2] per layer; a block's bytes are 2 layers x (K, V) x
    16 tokens x 2 heads x (code bytes + 8), which is what stats(), the report and the allocation say."""
    llm = LLM(tiny_ckpt, show_progress=False, kv_cache_dtype=dtype, kv_cache_memory="2MiB")
    s = llm.stats()
    assert s["kv_bytes_per_block"] == 2 * 2 * 16 * 2 * (code_width + 8)
    assert s["kv_cache_dtype"] == dtype
    blocks = s["kv_blocks_total"]
    layers = llm.engine.executor.collective_rpc(_caches)[0]
    assert layers == [((torch.uint8, (blocks, 16, 2, code_width)),) * 2 + ((torch.float32, (blocks, 16, 2, 2)),) * 2] * 2
    assert llm.engine.executor.collective_rpc(_cache_bytes)[0] == blocks * s["kv_bytes_per_block"]
    report = llm.memory_report.format()
    assert f"kv_cache_dtype='{dtype}': per-token, per-head asymmetric" in report
    fits = {f.kv_cache_dtype: f for f in llm.memory_report.kv_dtype_fits}
    assert set(fits) == {"auto", "fp8", "int8", "int4"} and fits[dtype].current
    assert fits[dtype].num_blocks == blocks and fits["auto"].bytes_per_token == 2 * 2 * 2 * 16 * 4  # float32
    assert fits["int4"].capacity_tokens > fits["int8"].capacity_tokens > fits["auto"].capacity_tokens


def test_quant_policy_is_lmdeploys_spelling(tiny_ckpt):
    for policy, dtype in ((8, "int8"), (4, "int4")):
        assert LLM(tiny_ckpt, show_progress=False, quant_policy=policy).stats()["kv_cache_dtype"] == dtype
    with pytest.raises(InvalidRequestError, match="quant_policy=8 asks for kv_cache_dtype='int8' but kv_cache_dtype="
                                                  "'fp8' is set too") as info:
        LLM(tiny_ckpt, show_progress=False, quant_policy=8, kv_cache_dtype="fp8")
    assert info.value.param == "quant_policy"
    with pytest.raises(InvalidRequestError, match=r"quant_policy must be one of \[0, 4, 8\]"):
        LLM(tiny_ckpt, show_progress=False, quant_policy=16)
    from vlm_sdk.cli import build_parser
    from vlm_sdk.server.engine_flags import engine_kwargs
    parser, _ = build_parser()
    args = parser.parse_args(["serve", str(tiny_ckpt), "--quant-policy", "4"])
    assert engine_kwargs(args)["quant_policy"] == 4


def test_prefix_caching_preemption_and_chunked_prefill_unchanged(tiny_ckpt):
    """An int8 engine gives the same greedy tokens with a cached prefix (its quantized blocks reused), under
    preemption and with prompts prefilled in chunks as an int8 engine that has none of them: every path
    stores and reads the same codes."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(10, 900, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(10, 900, (n,), generator=g).tolist() for n in (3, 7, 11, 20)]
    cold = LLM(tiny_ckpt, show_progress=False, kv_cache_dtype="int8", enable_prefix_caching=False)
    want = [o.token_ids for o in cold.generate(prompts, params)]
    warm = LLM(tiny_ckpt, show_progress=False, kv_cache_dtype="int8")
    warm.generate(prompts[:1], params)
    assert [o.token_ids for o in warm.generate(prompts, params)] == want
    assert warm.stats()["prefix_cache_hit_tokens"] >= 3 * 32
    tight = LLM(tiny_ckpt, show_progress=False, kv_cache_dtype="int8", num_blocks=12, enable_prefix_caching=False,
                allow_unfit_images=True)
    assert [o.token_ids for o in tight.generate(prompts, params)] == want
    assert tight.stats()["num_preemptions"] > 0
    chunked = LLM(tiny_ckpt, show_progress=False, kv_cache_dtype="int8", enable_prefix_caching=False,
                  max_num_batched_tokens=16, allow_unfit_images=True)
    assert [o.token_ids for o in chunked.generate(prompts, params)] == want


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_triton_backend_equals_torch_backend(tiny_ckpt, dtype):
    """The Triton store, decode and paged prefill kernels (the interpreter) through the engine: the same
    greedy tokens as the torch backend, logprobs within float32 rounding of attention over the same codes."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [list(range(11, 30)), [20, 21, 22]]  # 19 tokens: two chunks of 16, the second beside a decode row
    runs = [LLM(tiny_ckpt, show_progress=False, kv_cache_dtype=dtype, attention_backend=b,
                max_num_batched_tokens=16, allow_unfit_images=True).generate(prompts, params)
            for b in ("torch", "triton")]
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        diff = max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs))
        assert diff < 1e-3, diff


def _state_and_kv_dtypes(worker) -> tuple[set, set]:
    kv, state = set(), set()
    for c in worker.caches:
        (kv if len(c) == 4 and c[0].dtype == torch.uint8 else state).update(t.dtype for t in c)
    return kv, state


def test_state_layers_keep_the_model_dtype(tiny_checkpoints):
    """Qwen3.5: only the full-attention layers' K/V are quantized; the Gated DeltaNet conv state stays in
    the model's dtype and the recurrent state in float32 (its spec's)."""
    llm = LLM(str(tiny_checkpoints("qwen3_5")), show_progress=False, kv_cache_dtype="int8")
    kv, state = llm.engine.executor.collective_rpc(_state_and_kv_dtypes)[0]
    assert kv == {torch.uint8, torch.float32} and state == {torch.float32}
    assert any(g["kind"] == "state" for g in llm.stats()["cache_groups"])


def test_two_ranks_give_the_tokens_of_one(tiny_ckpt):
    """Per-head quantization is rank-local: each rank stores its own KV heads' codes and scales, so two
    ranks give one rank's greedy tokens."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [list(range(11, 40)), [20, 21, 22]]
    one = [o.token_ids for o in LLM(tiny_ckpt, show_progress=False, kv_cache_dtype="int8").generate(prompts, params)]
    with LLM(tiny_ckpt, show_progress=False, kv_cache_dtype="int8", tensor_parallel_size=2) as two:
        assert [o.token_ids for o in two.generate(prompts, params)] == one


def test_too_long_prompt_offers_a_lower_precision_cache_that_fits(tiny_ckpt):
    """A kv_cache_memory cache too small for a prompt names a lower-precision cache when the same bytes
    would hold it (fp8 first, then int8, then int4: at head_dim 16 fp8 and int4 take the same bytes, so
    fp8 is named; at head_dim 128 int4's 72 bytes a token and head beat fp8's 128 and int4 is named where
    only it fits: tests/plan/test_plan_seeds.py, LMDeploy's seed); applied, the request runs; below int4
    nothing is offered."""
    probe = LLM(tiny_ckpt, show_progress=False, num_blocks=4, allow_unfit_images=True)
    per_block = probe.stats()["kv_bytes_per_block"]  # float32: 8,192 B; int4 2,048 B (4x), fp8 2,048 B
    memory = 3 * per_block  # 48 tokens at float32, 192 with int4
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_ckpt, show_progress=False, kv_cache_memory=memory, allow_unfit_images=True)
    prompt = list(range(10, 150))  # 140 + 4 tokens: 9 blocks, within int4's 12
    with pytest.raises(InputTooLongError) as info:
        llm.generate([prompt], params)
    assert info.value.fixes["kv_cache_dtype"] == "fp8"  # the tiny model's head_dim 16: fp8 = int4 bytes
    int8 = LLM(tiny_ckpt, show_progress=False, kv_cache_memory=memory, allow_unfit_images=True, kv_cache_dtype="int8")
    with pytest.raises(InputTooLongError) as info:  # int8's 8 blocks (3,072 B each) hold 128 tokens
        int8.generate([prompt], params)
    assert info.value.fixes["kv_cache_dtype"] == "fp8"  # below int8: fp8, then int4; fp8's 12 blocks fit
    assert "--kv-cache-dtype fp8" in str(info.value)
    from vlm_sdk.memory.kv import CacheConfig
    cache = int8.engine.cache_config
    assert isinstance(cache, CacheConfig) and dict(cache.lower_blocks)["int4"] >= cache.blocks_for(144)
    for dtype in ("fp8", "int4"):
        fixed = LLM(tiny_ckpt, show_progress=False, kv_cache_memory=memory, allow_unfit_images=True,
                    kv_cache_dtype=dtype)
        out = fixed.generate([prompt], params)[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 4
    int4 = LLM(tiny_ckpt, show_progress=False, kv_cache_memory=memory, allow_unfit_images=True, kv_cache_dtype="int4")
    with pytest.raises(InputTooLongError) as info:  # nothing lower than int4
        int4.generate([list(range(10, 300))], params)
    assert "kv_cache_dtype" not in info.value.fixes


def test_odd_head_dim_refuses_int4_naming_it():
    from vlm_sdk.memory.inputs import check_int_kv_head_dim
    from vlm_sdk.protocol.cache_spec import AttentionSpec
    with pytest.raises(InvalidRequestError, match=r"head_dim 81 is odd \(supported: even head_dims") as info:
        check_int_kv_head_dim(AttentionSpec(2, 81, "int4"))
    assert "kv_cache_dtype='int8'" in str(info.value)
    check_int_kv_head_dim(AttentionSpec(2, 81, "int8"))
