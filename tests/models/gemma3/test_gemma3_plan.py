"""`vlm-sdk plan` on the Gemma 3 4B / 12B / 27B configs alone: the weights transformers' own model has, the
window layers' KV apart from the global layers', and the requests of 8k / 32k / 128k tokens that fit, beside
an all-full-attention allocation of the same memory; and plan equals engine on the CPU, the window's
savings included (as many long requests run at once as the plan says, none preempted).

Where the configs come from (no machine here reaches the Hub); none is a verbatim copy of the Hub file:
- tests/configs/gemma3_12b_it.json: google/gemma-3-12b-it's config.json as a public repository embeds it
  (an LTX-2 text-encoder loader whose comment reads "Source: google/gemma-3-12b-it config.json"), found
  with the search tool; it has no transformers_version.
- tests/configs/gemma3_4b_it.json: the fields of google/gemma-3-4b-it's config.json as two public test
  fixtures give them ("The shape of google/gemma-3-4b-it's config.json, vision tower omitted", a Rust
  parser's; and a C# test's "original gemma-3-4b-it config.json", vision tower included, in which that
  test adds a final_logit_softcapping of its own, left out here).
- tests/configs/gemma3_27b_it.json: a TensorRT-LLM unit test's GEMMA3_27B_CONFIG, whose num_hidden_layers
  (6) and sliding_window (4) it marks "Modified for testing": set back to 62 and 1024, the values a public
  write-up quotes from the published 27B config; its text_config keeps the test's sliding_window_pattern 6
  (transformers' default).
Fields a file leaves out take transformers' Gemma3TextConfig / SiglipVisionConfig defaults. transformers
builds 4,300,079,472 / 12,187,325,040 / 27,432,406,640 parameters from them (the model cards' 4.3B, 12.2B,
27.4B); its 4B and 12B language models are keras-hub's gemma3_4b / 12b presets' counts (3,880,099,328 and
11,765,788,416 at vocab 262,144) plus the 64 extra vocabulary rows of vocab 262,208.
"""
from __future__ import annotations

import pytest
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from helpers import TESTS
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.plan import plan
from vlm_sdk.plan.contexts import context_fits

CONFIGS = {"4b": TESTS / "configs" / "gemma3_4b_it.json", "12b": TESTS / "configs" / "gemma3_12b_it.json",
           "27b": TESTS / "configs" / "gemma3_27b_it.json"}
# (parameters, layers, global layers, KV heads, head_dim) transformers reads from each config
SHAPES = {"4b": (4_300_079_472, 34, 5, 4, 256), "12b": (12_187_325_040, 48, 8, 8, 256),
          "27b": (27_432_406_640, 62, 10, 16, 128)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_weights_and_layers_are_transformers_own(name):
    import json
    with torch.device("meta"):
        theirs = Gemma3ForConditionalGeneration(Gemma3Config.from_dict(json.loads(CONFIGS[name].read_text())))
    params, layers, global_layers, kv, hd = SHAPES[name]
    assert sum(t.numel() for t in theirs.parameters()) == params
    p = plan(CONFIGS[name], device_memory="80GiB")
    assert p.weights_bytes == 2 * params  # bfloat16, every parameter transformers has (the head tied)
    assert p.num_layers == layers and (p.num_kv_heads, p.head_dim) == (kv, hd)
    full = [g for g in p.cache_groups if g["kind"] == "full"]
    window = [g for g in p.cache_groups if g["kind"] == "sliding_window"]
    assert sum(len(g["layers"]) for g in full) == global_layers == theirs.config.text_config.layer_types.count(
        "full_attention")
    assert sum(len(g["layers"]) for g in window) == layers - global_layers
    assert {g["window"] for g in window} == {1024}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("chunk", [8192, 2048])
def test_window_and_global_kv_at_8k_32k_128k_against_full_attention(name, chunk):
    """Each request's KV from the config's numbers alone: a global layer holds every token, a window layer
    the 1,023 keys before its prefill chunk and the chunk (the engine's admission arithmetic)."""
    _, layers, global_layers, kv, hd = SHAPES[name]
    p = plan(CONFIGS[name], device_memory="80GiB", max_num_batched_tokens=chunk)
    page = 2 * 16 * kv * hd * 2  # one layer's K and V of a 16-token block, bfloat16
    kv_bytes = p.num_blocks * p.kv_bytes_per_block
    assert [f.tokens for f in p.context_fits] == [8192, 32768, 131072]
    for f in p.context_fits:
        n = f.tokens
        blocks = -(-n // 16)
        window_blocks = min(blocks, (1024 - 1 + min(chunk, n) - 1) // 16 + 2)
        assert f.global_kv_bytes == global_layers * blocks * page
        assert f.window_kv_bytes == (layers - global_layers) * window_blocks * page
        assert f.full_attention_kv_bytes == layers * blocks * page
        assert f.full_attention_requests == kv_bytes // (layers * blocks * page)
        # where the window saves blocks, more requests fit; where the chunk spans it (8k prompts in one 8k
        # chunk) none are saved, and the group's unused pages (a layer group of 4 in blocks of 5) cost a few
        assert f.requests >= f.full_attention_requests if window_blocks < blocks else \
            f.requests <= f.full_attention_requests
    at_128k = p.context_fits[-1]
    # at 128k a window layer holds under a tenth of a full-attention layer's KV (its window and one chunk:
    # 577 of 8,192 blocks with 8k chunks), so most of a naive cache is not allocated
    assert at_128k.window_kv_bytes * 10 < at_128k.full_attention_kv_bytes * (layers - global_layers) / layers
    assert at_128k.full_attention_kv_bytes > 3 * (at_128k.window_kv_bytes + at_128k.global_kv_bytes)


def test_the_report_shows_them(capsys):
    from vlm_sdk.cli import main
    assert main(["plan", str(CONFIGS["27b"]), "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    for n in ("8,192", "32,768", "131,072"):
        assert f"requests of {n} tokens" in out
    assert "in the window layers" in out and "with every layer full attention" in out


def test_plan_equals_engine_with_the_window_savings(gemma3_ckpt):
    """The tiny Gemma 3 (window 12, 16-token blocks, prefill chunks of 32): requests of 256 tokens hold 4
    blocks in each window layer and 16 in the global one, so a cache of 3 such requests' blocks (72) runs
    all 3 at once, none preempted, where an all-full-attention cache of those bytes holds 1."""
    options = dict(num_blocks=72, max_num_batched_tokens=32)
    p = plan(gemma3_ckpt, device="cpu", **options)
    llm = LLM(gemma3_ckpt, show_progress=False, **options)
    cache = llm.engine.cache_config
    (fit,) = context_fits(cache.layout, cache.num_blocks, cache.block_size, cache.chunk_tokens, (256,))
    assert fit == context_fits(cache.layout, p.num_blocks, p.block_size, 32, (256,))[0]
    assert (fit.requests, fit.full_attention_requests) == (3, 1)
    prompt = [1002] + list(range(10, 10 + 239))  # 240 tokens, then 16 generated: 256
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    roomy = LLM(gemma3_ckpt, show_progress=False).generate([prompt] * 3, params)
    outs = llm.generate([prompt] * 3, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert llm.stats()["num_preemptions"] == 0
