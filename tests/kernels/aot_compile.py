"""Ahead-of-time compile of every Triton kernel of vlm_sdk.kernels for NVIDIA targets, on a machine
without a GPU: `python tests/kernels/aot_compile.py --arch 90 --arch 80` prints one JSON line per
(kernel, case, arch) with the registers and spill bytes ptxas reports.

How the launch parameters are found: each case calls the kernel's own launcher on "meta" tensors of a
production shape (bfloat16, the model's real head counts, strides and block size), with the module's
kernels swapped for recorders, so the grid-independent part of the launch (constexprs, block sizes,
num_warps / num_stages, the specialisation of pointers and ints) is exactly what the launcher would
pass on a GPU. Each recorded launch is then specialised by Triton's own binder for the CUDA backend
and compiled with `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`; ptxas (shipped
inside triton) runs with -v, and its log gives the spills. A CompiledKernel's n_spills is only filled
when a driver loads the binary, hence the log. Run with TRITON_INTERPRET unset (the kernels must be
JITFunctions) and a fresh TRITON_CACHE_DIR (a cache hit skips ptxas and its log).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

BF16 = torch.bfloat16
BLOCK_SIZE = 16  # EngineArgs.block_size default
META = "meta"


@dataclass(frozen=True)
class TextShape:
    """A language model's attention and MLP sizes."""
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int


# GQA groups 7 and 8 at head_dim 128 (Qwen2.5-VL-7B and -3B), and Qwen3-VL-8B (q/k norm, interleaved M-RoPE)
QWEN25_7B = TextShape("qwen2.5-vl-7b", 28, 4, 128, 3584, 18944)
QWEN25_3B = TextShape("qwen2.5-vl-3b", 16, 2, 128, 2048, 11008)
QWEN3_8B = TextShape("qwen3-vl-8b", 32, 8, 128, 4096, 12288)
TEXT_SHAPES = (QWEN25_7B, QWEN25_3B)
# the KV cache dtypes' and the short chunk's variants: one shape (each binary costs ~10 s of the suite
# an arch; the variants change the loads, not the GQA grouping the two shapes differ in)
VARIANT_SHAPE = QWEN25_7B
# Gemma 3's local layers (window 1024) and image spans at head_dim 256 (4B: 8q/4kv); the 27B's head_dim
# 128 and GQA group 2 are within the text shapes' range
GEMMA3_4B = TextShape("gemma-3-4b", 8, 4, 256, 2560, 10240)
GEMMA3_WINDOW = 1024
# The cases compiled for sm_80 (A100) as well as sm_90 (H100, the production target): one per kernel
# whose code depends on the arch most (tensor-core products: mma on sm_80, wgmma on sm_90), the
# largest head_dim and tile. Compiling every case for both archs took ~140 s of a ~15-minute suite;
# `--all-cases` does it (an A100 deployment's check).
SM80_CASES = frozenset({
    ("paged_attention_decode", "qwen2.5-vl-7b 8 splits"),
    ("paged_attention_decode", "gemma-3-4b window 8 splits"),
    ("paged_prefill_attention", "qwen2.5-vl-7b chunk 2048"),
    ("paged_prefill_attention", "gemma-3-4b window chunk 2048"),
    ("varlen_attention", "qwen2.5-vl-vit full 4096"),
    ("fused_moe", "qwen3-vl-30b-a3b prefill 2048 (64-row blocks)"),
    ("int4_gemm", "qwen2.5-vl-7b AWQ gate_up, 2048 rows"),
    ("fp8_block_gemm", "qwen3-vl-8b gate_up, 2048 rows"),
    ("skinny_gemm", "64 rows per program"),
})
# MoE experts: (experts, per token, hidden, expert width on one rank)
QWEN3_30B_A3B = (128, 8, 2048, 768)
QWEN3_235B_A22B_TP8 = (128, 8, 4096, 1536 // 8)
# vision towers: (name, heads, head_dim, hidden, intermediate); no GQA
QWEN25_VIT = ("qwen2.5-vl-vit", 16, 80, 1280, 3420)
INTERNVIT_300M = ("internvit-300m", 16, 64, 1024, 4096)


def _qkv(n: int, heads: int, kv_heads: int, head_dim: int):
    """q, k, v as the decoder makes them: views of one packed [n, H + 2Hkv, D] projection."""
    qkv = torch.empty(n, heads + 2 * kv_heads, head_dim, dtype=BF16, device=META)
    return qkv.split([heads, kv_heads, kv_heads], dim=1)


def _cache(shape: TextShape, num_blocks: int = 4096, dtype: torch.dtype = BF16):
    size = (num_blocks, BLOCK_SIZE, shape.kv_heads, shape.head_dim)
    return torch.empty(size, dtype=dtype, device=META), torch.empty(size, dtype=dtype, device=META)


def _kv_scales() -> dict:
    """An FP8 cache's per-layer scales (kv_cache_dtype='fp8')."""
    return {"k_scale": torch.empty((), device=META), "v_scale": torch.empty((), device=META)}


def _int_cache(shape: TextShape, bits: int, num_blocks: int = 4096) -> tuple[tuple, dict]:
    """An int8 / int4 cache (kv_cache_dtype='int8' / 'int4'): uint8 code pages and float32 (scale, zero)."""
    width = shape.head_dim if bits == 8 else shape.head_dim // 2
    pages = tuple(torch.empty(num_blocks, BLOCK_SIZE, shape.kv_heads, width, dtype=torch.uint8, device=META)
                  for _ in range(2))
    sz = {name: torch.empty(num_blocks, BLOCK_SIZE, shape.kv_heads, 2, device=META) for name in ("k_sz", "v_sz")}
    return pages, sz


def _ints(*size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int32, device=META)


def cases() -> list[tuple]:
    """(module, case name, a call of the module's launcher at a production shape[, the archs it is for:
    every one asked when absent])."""
    from vlm_sdk.kernels import (paged_attention_decode, paged_prefill_attention, rms_norm, rotary, rotary_store_kv,
                                 silu_and_mul, store_kv, varlen_attention)
    out: list[tuple] = []
    max_blocks = 32768 // BLOCK_SIZE
    fp8 = torch.float8_e4m3fn
    for s in TEXT_SHAPES:
        # an FP8 cache is read from its bits (any GPU) unless `hardware` (sm_89+: Triton's e4m3 conversion)
        def decode(s=s, splits=1, cache=BF16, hardware=False, bits=0):
            q, _, _ = _qkv(64, s.heads, s.kv_heads, s.head_dim)
            (kc, vc), extra = _int_cache(s, bits) if bits else (_cache(s, dtype=cache), _kv_scales() if cache == fp8
                                                                 else {})
            paged_attention_decode.paged_attention_decode(q, kc, vc, _ints(64, max_blocks), _ints(64),
                                                          s.head_dim ** -0.5, num_splits=splits, fp8_hardware=hardware,
                                                          **extra)

        def prefill(s=s, max_q=2048, cache=BF16, hardware=False, bits=0):
            q, _, _ = _qkv(4096, s.heads, s.kv_heads, s.head_dim)
            (kc, vc), extra = _int_cache(s, bits) if bits else (_cache(s, dtype=cache), _kv_scales() if cache == fp8
                                                                 else {})
            paged_prefill_attention.paged_prefill_attention(q, kc, vc, _ints(4, max_blocks), _ints(5), _ints(4),
                                                            max_q, s.head_dim ** -0.5, fp8_hardware=hardware, **extra)

        def kv(s=s, cache=BF16, bits=0):
            _, k, v = _qkv(256, s.heads, s.kv_heads, s.head_dim)
            (kc, vc), extra = _int_cache(s, bits) if bits else (_cache(s, dtype=cache), _kv_scales() if cache == fp8
                                                                 else {})
            store_kv.store_kv(k, v, kc, vc, torch.empty(256, dtype=torch.int64, device=META), **extra)

        def rope(s=s):
            q, k, _ = _qkv(256, s.heads, s.kv_heads, s.head_dim)
            rotary.rotary_embedding(q, k, torch.empty(3, 256, dtype=torch.int64, device=META),
                                    torch.empty(s.head_dim // 2, device=META), mrope_section=(16, 24, 24))

        def rope_store(s=s, n=64, section=(16, 24, 24), interleaved=False, qk_norm=False, cache=BF16):
            q, k, v = _qkv(n, s.heads, s.kv_heads, s.head_dim)
            kc, vc = _cache(s, dtype=cache)
            w = torch.empty(s.head_dim, dtype=BF16, device=META) if qk_norm else None
            rotary_store_kv.rotary_store_kv(q, k, v, kc, vc, torch.empty(n, dtype=torch.int64, device=META),
                                            torch.empty(3, n, dtype=torch.int64, device=META),
                                            torch.empty(s.head_dim // 2, device=META), mrope_section=section,
                                            mrope_interleaved=interleaved, q_norm_weight=w, k_norm_weight=w,
                                            **(_kv_scales() if cache == fp8 else {}))

        out += [("paged_attention_decode", f"{s.name} direct", decode),
                ("rotary_store_kv", f"{s.name} mrope, 64 decode rows", rope_store),
                ("paged_attention_decode", f"{s.name} 8 splits", lambda d=decode: d(splits=8)),
                ("paged_prefill_attention", f"{s.name} chunk 2048", prefill),
                ("store_kv", s.name, kv),
                ("rotary", f"{s.name} mrope", rope)]
        if s != VARIANT_SHAPE:
            continue
        out += [("paged_prefill_attention", f"{s.name} chunk 64", lambda p=prefill: p(max_q=64)),
                # kv_cache_dtype='fp8': the same kernels over an e4m3 cache with per-layer scales
                ("paged_attention_decode", f"{s.name} fp8 KV direct", lambda d=decode: d(cache=fp8)),
                ("paged_attention_decode", f"{s.name} fp8 KV 8 splits", lambda d=decode: d(splits=8, cache=fp8)),
                ("paged_prefill_attention", f"{s.name} fp8 KV chunk 2048", lambda p=prefill: p(cache=fp8)),
                ("store_kv", f"{s.name} fp8 KV", lambda f=kv: f(cache=fp8)),
                ("rotary_store_kv", f"{s.name} mrope, 64 decode rows, fp8 KV", lambda f=rope_store: f(cache=fp8)),
                # kv_cache_dtype='int8' / 'int4': codes dequantized in registers with per-token scales
                ("paged_attention_decode", f"{s.name} int8 KV 8 splits", lambda d=decode: d(splits=8, bits=8)),
                ("paged_attention_decode", f"{s.name} int4 KV 8 splits", lambda d=decode: d(splits=8, bits=4)),
                ("paged_prefill_attention", f"{s.name} int8 KV chunk 2048", lambda p=prefill: p(bits=8)),
                ("paged_prefill_attention", f"{s.name} int4 KV chunk 2048", lambda p=prefill: p(bits=4)),
                ("store_kv", f"{s.name} int8 KV", lambda f=kv: f(bits=8)),
                ("store_kv", f"{s.name} int4 KV", lambda f=kv: f(bits=4)),
                # sm_90 only: Triton has no e4m3 type below sm_89
                ("paged_attention_decode", f"{s.name} fp8 KV hardware 8 splits",
                 lambda d=decode: d(splits=8, cache=fp8, hardware=True), (90,)),
                ("paged_prefill_attention", f"{s.name} fp8 KV hardware chunk 2048",
                 lambda p=prefill: p(cache=fp8, hardware=True), (90,))]

    for s in (GEMMA3_4B,):
        def windowed_decode(s=s, splits=1, bits=0):
            q, _, _ = _qkv(64, s.heads, s.kv_heads, s.head_dim)
            (kc, vc), extra = _int_cache(s, bits) if bits else (_cache(s), {})
            paged_attention_decode.paged_attention_decode(q, kc, vc, _ints(64, max_blocks), _ints(64),
                                                          s.head_dim ** -0.5, num_splits=splits, window=GEMMA3_WINDOW,
                                                          **extra)

        def windowed_int_prefill(s=s, bits=8):
            q, _, _ = _qkv(4096, s.heads, s.kv_heads, s.head_dim)
            (kc, vc), extra = _int_cache(s, bits)
            paged_prefill_attention.paged_prefill_attention(q, kc, vc, _ints(4, max_blocks), _ints(5), _ints(4),
                                                            2048, s.head_dim ** -0.5, window=GEMMA3_WINDOW, **extra)

        def windowed_prefill(s=s, max_q=2048, spans=False, window=GEMMA3_WINDOW):
            q, _, _ = _qkv(4096, s.heads, s.kv_heads, s.head_dim)
            kc, vc = _cache(s)
            paged_prefill_attention.paged_prefill_attention(q, kc, vc, _ints(4, max_blocks), _ints(5), _ints(4),
                                                            max_q, s.head_dim ** -0.5, window=window,
                                                            key_limits=_ints(4096) if spans else None)
        out += [("paged_attention_decode", f"{s.name} window direct", windowed_decode),
                ("paged_attention_decode", f"{s.name} window 8 splits", lambda d=windowed_decode: d(splits=8)),
                ("paged_prefill_attention", f"{s.name} window chunk 2048", windowed_prefill),
                ("paged_prefill_attention", f"{s.name} window + image spans chunk 2048",
                 lambda p=windowed_prefill: p(spans=True)),
                ("paged_prefill_attention", f"{s.name} global + image spans chunk 2048",
                 lambda p=windowed_prefill: p(spans=True, window=None)),
                ("paged_attention_decode", f"{s.name} window int8 KV 8 splits",
                 lambda d=windowed_decode: d(splits=8, bits=8)),
                ("paged_prefill_attention", f"{s.name} window int8 KV chunk 2048", windowed_int_prefill)]

    def rope_qk_norm(s=QWEN3_8B):
        q, k, _ = _qkv(256, s.heads, s.kv_heads, s.head_dim)
        w = torch.empty(s.head_dim, dtype=BF16, device=META)
        rotary.rotary_embedding(q, k, torch.empty(3, 256, dtype=torch.int64, device=META),
                                torch.empty(s.head_dim // 2, device=META), mrope_section=(24, 20, 20),
                                mrope_interleaved=True, q_norm_weight=w, k_norm_weight=w)
    out.append(("rotary", f"{QWEN3_8B.name} q/k norm interleaved", rope_qk_norm))
    out.append(("rotary_store_kv", f"{QWEN3_8B.name} q/k norm interleaved", lambda: rope_store(
        QWEN3_8B, section=(24, 20, 20), interleaved=True, qk_norm=True)))

    def rope_vision(name=QWEN25_VIT[0], heads=QWEN25_VIT[1], head_dim=QWEN25_VIT[2]):
        """The vision towers' 2-D RoPE: [2, N] (row, column) positions, two sections of D/4."""
        q, k, _ = torch.empty(4096, 3, heads, head_dim, dtype=BF16, device=META).unbind(1)
        rotary.rotary_embedding(q, k, torch.empty(2, 4096, dtype=torch.int64, device=META),
                                torch.empty(head_dim // 2, device=META),
                                mrope_section=(head_dim // 4, head_dim // 4))
    if _accepts(rope_vision):  # the rotary launcher takes [2, N] positions once the vision RoPE is on it
        out.append(("rotary", f"{QWEN25_VIT[0]} 2-D vision", rope_vision))

    for name, heads, head_dim, _, _ in (QWEN25_VIT, INTERNVIT_300M):
        def varlen(heads=heads, head_dim=head_dim, max_len=4096):
            qkv = torch.empty(8192, 3, heads, head_dim, dtype=BF16, device=META)
            q, k, v = qkv.unbind(1)  # the vision towers' layout
            varlen_attention.varlen_attention(q, k, v, _ints(9), max_len, head_dim ** -0.5)
        out += [("varlen_attention", f"{name} full 4096", varlen),
                ("varlen_attention", f"{name} window 64", lambda f=varlen: f(max_len=64))]

    for name, hidden, inter in ((QWEN25_7B.name, 3584, 18944), (QWEN25_3B.name, 2048, 11008),
                                (QWEN25_VIT[0], 1280, 3420)):
        def norm(residual=False):
            x = torch.empty(256, hidden, dtype=BF16, device=META)
            rms_norm.rms_norm(x, torch.empty(hidden, dtype=BF16, device=META), 1e-6,
                              residual=torch.empty_like(x) if residual else None)

        def swiglu(inter=inter):
            silu_and_mul.silu_and_mul(torch.empty(256, 2 * inter, dtype=BF16, device=META))
        out += [("rms_norm", name, norm), ("rms_norm", f"{name} + residual", lambda f=norm: f(residual=True)),
                ("silu_and_mul", name, swiglu)]
    from vlm_sdk.kernels import fused_moe

    def moe(shape=QWEN3_30B_A3B, tokens=1):
        """The experts of Qwen3-VL-30B-A3B (128 of width 768, 8 per token) for a step of `tokens`: both
        products (gate_up with SiLU-and-mul, down with the routing weights), 16-row or 64-row blocks."""
        experts, top_k, hidden, inter = shape
        fused_moe.fused_moe(torch.empty(tokens, hidden, dtype=BF16, device=META),
                            torch.empty(experts, 2 * inter, hidden, dtype=BF16, device=META),
                            torch.empty(experts, hidden, inter, dtype=BF16, device=META),
                            torch.empty(tokens, top_k, dtype=torch.float32, device=META),
                            torch.empty(tokens, top_k, dtype=torch.int64, device=META))
    def moe_fp8(shape=QWEN3_30B_A3B, tokens=1, block=(128, 128)):
        """The same experts in block-wise FP8 (Qwen3-VL-30B-A3B-Instruct-FP8): float8 weights, a float32
        scale per 128 x 128 block, dequantized per tile."""
        from vlm_sdk.kernels.fused_moe_torch import ExpertScales
        experts, top_k, hidden, inter = shape
        fp8 = torch.float8_e4m3fn
        scales = ExpertScales(torch.empty(experts, 2 * inter // block[0], -(-hidden // block[1]), device=META),
                              torch.empty(experts, -(-hidden // block[0]), -(-inter // block[1]), device=META), block)
        fused_moe.fused_moe(torch.empty(tokens, hidden, dtype=BF16, device=META),
                            torch.empty(experts, 2 * inter, hidden, dtype=fp8, device=META),
                            torch.empty(experts, hidden, inter, dtype=fp8, device=META),
                            torch.empty(tokens, top_k, dtype=torch.float32, device=META),
                            torch.empty(tokens, top_k, dtype=torch.int64, device=META), scales)
    # sm_90 only: Triton has no e4m3 type before sm_89 (the op refuses FP8 experts on older GPUs)
    out += [("fused_moe", "qwen3-vl-30b-a3b fp8 decode", moe_fp8, (90,)),
            ("fused_moe", "qwen3-vl-30b-a3b fp8 prefill 2048", lambda f=moe_fp8: f(tokens=2048), (90,))]
    out += [("fused_moe", "qwen3-vl-30b-a3b decode (16-row blocks)", moe),
            ("fused_moe", "qwen3-vl-30b-a3b prefill 2048 (64-row blocks)", lambda f=moe: f(tokens=2048)),
            ("fused_moe", "qwen3-vl-235b-a22b tp=8 prefill 2048", lambda f=moe: f(QWEN3_235B_A22B_TP8, 2048))]
    from vlm_sdk.kernels import exponential_race, token_bitmask

    def bitmask(dtype=torch.float32, vocab=151936):  # structured outputs' mask
        logits = torch.empty(64, vocab, dtype=dtype, device=META)
        token_bitmask.apply_token_bitmask_(logits, _ints(64), _ints(64, -(-vocab // 32)))
    out += [("token_bitmask", "151,936 vocab fp32 logits", bitmask),
            ("token_bitmask", "151,936 vocab bf16 logits", lambda f=bitmask: f(BF16))]

    def race(vocab=151936):  # the sampler's draw: fp32 probabilities, one int64 key per row
        probs = torch.empty(64, vocab, dtype=torch.float32, device=META)
        exponential_race.exponential_race(probs, torch.empty(64, dtype=torch.int64, device=META))
    out += [("exponential_race", "64 rows x 151,936 vocab", race)]
    from vlm_sdk.kernels import skinny_gemm

    def skinny(m, n, k, bn, bias=False):  # decode projections at batch m; bn: block_n on an H100 (132 SMs)
        x = torch.empty(m, k, dtype=BF16, device=META)
        w = torch.empty(n, k, dtype=BF16, device=META)
        b = torch.empty(n, dtype=BF16, device=META) if bias else None
        skinny_gemm.launch(x, w, b, torch.empty(m, n, dtype=BF16, device=META), bn)
    for s in TEXT_SHAPES:
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        for m in (1, 8):
            out += [("skinny_gemm", f"{s.name} qkv + bias, {m} rows",
                     lambda m=m, n=qkv, k=s.hidden: skinny(m, n, k, skinny_gemm_block(n), bias=True)),
                    ("skinny_gemm", f"{s.name} o_proj, {m} rows",
                     lambda m=m, n=s.hidden, k=s.heads * s.head_dim: skinny(m, n, k, skinny_gemm_block(n)))]
    out.append(("skinny_gemm", "64 rows per program", lambda: skinny(4, 4096, 4096, 64)))
    from vlm_sdk.kernels import top_p_cut

    def nucleus(vocab=151936):  # top-p past the sampler's candidates, on the device
        probs = torch.empty(64, vocab, dtype=torch.float32, device=META)
        top_p_cut.top_p_cut_(probs, torch.empty(64, dtype=torch.bool, device=META),
                             torch.empty(64, dtype=torch.float32, device=META))
    out += [("top_p_cut", "64 rows x 151,936 vocab", nucleus)]
    return out + quantized_gemm_cases() + gated_delta_net_cases()


# Gated DeltaNet layers (Qwen3.5): (name, hidden, key heads, value heads, head dim, conv width), one rank.
# One shape: the other published ones (e.g. 35B-A3B: 2048, 16, 32) change only GROUP and the norm's width,
# and each binary costs compile time in the suite (the chunked rule's three ~30 s an arch).
QWEN35_27B = ("qwen3.5-27b", 5120, 16, 48, 128, 4)


def gated_delta_net_cases() -> list[tuple]:
    """Qwen3.5's linear-attention layers: the conv over a prefill chunk and a decode step (x the q | k | v
    columns of the in_proj output, as the layer passes them), the chunked rule over 2048 tokens of 4
    requests, the recurrent rule at batch 64, the gated norm, and the zero-centred RMSNorm."""
    from vlm_sdk.kernels import causal_conv1d, gated_delta_rule_chunk, gated_delta_rule_recurrent, gated_rms_norm
    from vlm_sdk.kernels import rms_norm
    slots = 256
    name, hidden, hk, hv, d, width = QWEN35_27B
    conv_dim = (2 * hk + hv) * d

    def conv(tokens, decode):
        x = torch.empty(tokens, conv_dim + hv * d, dtype=BF16, device=META)[:, :conv_dim]
        w = torch.empty(conv_dim, width, dtype=BF16, device=META)
        state = torch.empty(slots, conv_dim, width - 1, dtype=BF16, device=META)
        batch = tokens if decode else 4
        ids = torch.empty(batch, dtype=torch.int64, device=META)
        init = torch.empty(batch, dtype=torch.bool, device=META)
        if decode:
            causal_conv1d.causal_conv1d_update(x, w, None, state, ids, init)
        else:
            causal_conv1d.causal_conv1d_varlen(x, w, None, state, _ints(5), ids, init, max_query_len=1024)

    def rule(tokens, decode):
        mixed = torch.empty(tokens, conv_dim, dtype=BF16, device=META)
        q = mixed[:, :hk * d].view(tokens, hk, d)
        k = mixed[:, hk * d:2 * hk * d].view(tokens, hk, d)
        v = mixed[:, 2 * hk * d:].view(tokens, hv, d)
        g = torch.empty(tokens, hv, device=META)
        beta = torch.empty(tokens, hv, dtype=BF16, device=META)
        state = torch.empty(slots, hv, d, d, device=META)
        batch = tokens if decode else 4
        ids = torch.empty(batch, dtype=torch.int64, device=META)
        init = torch.empty(batch, dtype=torch.bool, device=META)
        if decode:
            gated_delta_rule_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, state, ids, init)
        else:
            gated_delta_rule_chunk.chunk_gated_delta_rule(q, k, v, g, beta, state, _ints(5), 1024, ids, init)

    def gated_norm(tokens):
        x = torch.empty(tokens * hv, d, dtype=BF16, device=META)
        gated_rms_norm.gated_rms_norm(x, torch.empty_like(x), torch.empty(d, dtype=BF16, device=META), 1e-6)

    def norm(residual=False):
        x = torch.empty(256, hidden, dtype=BF16, device=META)
        rms_norm.rms_norm(x, torch.empty(hidden, dtype=BF16, device=META), 1e-6,
                          residual=torch.empty_like(x) if residual else None, zero_centered=True)
    return [("gated_delta_rule_chunk", f"{name} prefill 2048 tokens of 4", lambda: rule(2048, False)),
            ("causal_conv1d", f"{name} prefill 2048 tokens of 4", lambda: conv(2048, False)),
            ("causal_conv1d", f"{name} decode 64", lambda: conv(64, True)),
            ("gated_delta_rule_recurrent", f"{name} decode 64", lambda: rule(64, True)),
            ("gated_rms_norm", f"{name} 64 tokens", lambda: gated_norm(64)),
            ("rms_norm", f"{name} zero-centred", norm),
            ("rms_norm", f"{name} zero-centred + residual", lambda: norm(residual=True))]


def _projections(s: TextShape) -> dict[str, tuple[int, int]]:
    """The decoder's four products of a model, (N, K): fused q | k | v, o_proj, fused gate | up, down."""
    return {"qkv": ((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden), "o_proj": (s.hidden, s.heads * s.head_dim),
            "gate_up": (2 * s.intermediate, s.hidden), "down": (s.hidden, s.intermediate)}


def quantized_gemm_cases() -> list[tuple]:
    """The quantized checkpoints' GEMMs with the launch an H100 (132 SMs) would get: AWQ, GPTQ (desc_act) and
    compressed-tensors W4A16 (transposed views; sym without zero points) int4 at Qwen2.5-VL-7B's shapes, block
    FP8 at Qwen3-VL-8B's; decode (1 and 16 rows: split K) and prefill (2048 rows: tiles). FP8 read from its
    bits on both archs, with Triton's conversion on sm_90."""
    from vlm_sdk.kernels import fp8_block_gemm, int4_gemm
    out: list[tuple] = []

    def int4(m, n, k, awq, desc_act=False, group=128):
        x = torch.empty(m, k, dtype=BF16, device=META)
        qweight = torch.empty((k, n // 8) if awq else (k // 8, n), dtype=torch.int32, device=META)
        zeros = torch.empty(k // group, n // 8, dtype=torch.int32, device=META)
        scales = torch.empty(k // group, n, dtype=torch.float16, device=META)
        g_idx = torch.empty(k, dtype=torch.int32, device=META) if desc_act else None
        int4_gemm.int4_gemm(x, qweight, zeros, scales, awq=awq, group=group, g_idx=g_idx, zero_offset=0 if awq else 1,
                            config=int4_gemm.gpu_config(m, n, k, group, 132))

    def w4a16(m, n, k, sym, group=128):
        """compressed-tensors W4A16 as its layer launches it: transposed views of [N, K/8], [N, K/G], [N/8, K/G]."""
        x = torch.empty(m, k, dtype=BF16, device=META)
        packed = torch.empty(n, k // 8, dtype=torch.int32, device=META)
        scale = torch.empty(n, k // group, dtype=BF16, device=META)
        zeros = None if sym else torch.empty(n // 8, k // group, dtype=torch.int32, device=META).t()
        int4_gemm.int4_gemm(x, packed.t(), zeros, scale.t(), awq=False, group=group, zero_offset=8 if sym else 0,
                            config=int4_gemm.gpu_config(m, n, k, group, 132))

    def fp8(m, n, k, hardware):
        x = torch.empty(m, k, dtype=BF16, device=META)
        w = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=META)
        s = torch.empty(-(-n // 128), -(-k // 128), device=META)
        fp8_block_gemm.fp8_block_gemm(x, w, s, (128, 128), config=fp8_block_gemm.gpu_config(m, n, k, (128, 128), 132),
                                      fp8_hardware=hardware)

    for name, (n, k) in _projections(QWEN25_7B).items():
        for m in (1, 16, 2048):
            out += [("int4_gemm", f"{QWEN25_7B.name} AWQ {name}, {m} rows", lambda m=m, n=n, k=k: int4(m, n, k, True))]
        out += [("int4_gemm", f"{QWEN25_7B.name} GPTQ desc_act {name}, {m} rows",
                 lambda m=m, n=n, k=k: int4(m, n, k, False, True)) for m in (1, 2048)]
        out += [("int4_gemm", f"{QWEN25_7B.name} W4A16 {'sym' if sym else 'asym'} {name}, {m} rows",
                 lambda m=m, n=n, k=k, sym=sym: w4a16(m, n, k, sym)) for m in (1, 2048) for sym in (True, False)]
    for name, (n, k) in _projections(QWEN3_8B).items():
        for m in (1, 2048):
            out += [("fp8_block_gemm", f"{QWEN3_8B.name} {name}, {m} rows", lambda m=m, n=n, k=k: fp8(m, n, k, False)),
                    ("fp8_block_gemm", f"{QWEN3_8B.name} {name}, {m} rows, hardware e4m3",
                     lambda m=m, n=n, k=k: fp8(m, n, k, True), (90,))]
    return out


def skinny_gemm_block(n: int, sms: int = 132) -> int:
    """`skinny_gemm.block_n` as an H100 (132 SMs) computes it, without a GPU."""
    from vlm_sdk.kernels import skinny_gemm
    want = max(1, n // (skinny_gemm.PROGRAMS_PER_SM * sms))
    return max(2, min(64, 1 << (want.bit_length() - 1)))


def _accepts(call: Callable[[], None]) -> bool:
    """Whether a launcher takes these arguments (its checks raise ValueError before any launch)."""
    try:
        record(call)
    except ValueError:
        return False
    return True


def kernel_functions() -> dict[str, object]:
    """Every top-level Triton kernel (a JITFunction named *_kernel) of vlm_sdk.kernels, by qualified name."""
    import importlib
    import pkgutil

    import triton
    from triton.runtime.interpreter import InterpretedFunction
    import vlm_sdk.kernels as package
    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"vlm_sdk.kernels.{info.name}")
        for attr, value in vars(module).items():
            # compiled, or interpreted under TRITON_INTERPRET=1 (the in-process CPU tests)
            if (isinstance(value, (triton.runtime.JITFunction, InterpretedFunction)) and attr.endswith("_kernel")
                    and getattr(value, "fn", value).__module__ == module.__name__):
                found[f"{info.name}.{attr}"] = value
    return found


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the launch instead."""

    def __init__(self, fn, sink: list):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink.append((self.fn, args, kwargs))


def record(call: Callable[[], None]) -> list:
    """The launches `call` makes, as (JITFunction, args, kwargs), the kernels swapped back afterwards."""
    import importlib
    launches: list = []
    kernels = kernel_functions()
    modules = {name: importlib.import_module(f"vlm_sdk.kernels.{name.split('.')[0]}") for name in kernels}
    try:
        for name, fn in kernels.items():
            setattr(modules[name], name.split(".")[1], _Recorder(fn, launches))
        call()
    finally:
        for name, fn in kernels.items():
            setattr(modules[name], name.split(".")[1], fn)
    return launches


class JitKeys:
    """The JIT cache key Triton's CUDA binder gives a launch (its specialisation and launch options):
    two launches with the same key share one compiled kernel. Works on any tensors (meta, CPU), for
    compiled or interpreted kernels; compiles nothing."""

    def __init__(self, arch: int = 90):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        self.backend = make_backend(GPUTarget("cuda", arch, 32))
        self.binders: dict[str, object] = {}

    def __call__(self, fn, args, kwargs) -> tuple[str, str, str]:
        import triton
        from triton.runtime.jit import create_function_from_signature
        name = fn.__name__
        if name not in self.binders:
            # under TRITON_INTERPRET=1 the module holds an InterpretedFunction: bind through a
            # JITFunction over the same Python function and do_not_specialize list
            jit = fn if isinstance(fn, triton.runtime.JITFunction) else triton.runtime.JITFunction(
                fn.fn, do_not_specialize=fn.kwargs.get("do_not_specialize"),
                do_not_specialize_on_alignment=fn.kwargs.get("do_not_specialize_on_alignment"))
            self.binders[name] = create_function_from_signature(jit.signature, jit.params, self.backend)
        _, specialization, options = self.binders[name](*args, **kwargs)
        return name, repr(specialization), repr(sorted(options.items()))


_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def _source(fn, args, kwargs, arch: int):
    """(ASTSource, options, target) of one recorded launch, specialised by Triton's own binder as a
    launch on sm_<arch> would be."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options, target


def compile_source(src, options, target) -> dict:
    """Compile for `target`; registers and spill bytes from ptxas's -v log."""
    import triton
    from triton import knobs
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=target, options=options.__dict__)
    seconds = time.perf_counter() - t0
    text = log.getvalue()
    spills = [int(a) + int(b) for a, b in _SPILLS.findall(text)]
    regs = [int(r) for r in _REGS.findall(text)]
    if not spills or not regs:
        raise RuntimeError(f"no ptxas -v report for {src.name} (a cache hit? use a fresh TRITON_CACHE_DIR):\n"
                           f"{text}")
    return {"regs": max(regs), "spill_bytes": max(spills), "seconds": round(seconds, 2),
            "num_warps": compiled.metadata.num_warps, "num_stages": compiled.metadata.num_stages,
            "constexprs": {src.fn.arg_names[k[0]]: v for k, v in src.constants.items()}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", required=True, help="compute capability, e.g. 90")
    parser.add_argument("--only", default=None, help="compile only the cases of this kernel module")
    parser.add_argument("--all-cases", action="store_true",
                        help="every case for every arch asked (default: sm_80 compiles only SM80_CASES)")
    opts = parser.parse_args(argv)
    done: dict[tuple, dict] = {}  # one compile per distinct specialisation (cases may share a binary)
    for module, case, call, *only_archs in cases():
        if opts.only and module != opts.only:
            continue
        archs = [a for a in opts.arch if (not only_archs or a in only_archs[0])
                 and (opts.all_cases or a != 80 or (module, case) in SM80_CASES)]
        for fn, args, kwargs in record(call):
            for arch in archs:
                row = {"module": module, "kernel": fn.__name__, "case": case, "arch": f"sm_{arch}"}
                try:
                    src, options, target = _source(fn, args, kwargs, arch)
                    key = (arch, src.hash(), repr(sorted(options.__dict__.items())))
                    if key not in done:
                        done[key] = dict(compile_source(src, options, target), first_case=case)
                    result = dict(done[key])
                    first = result.pop("first_case")
                    row.update(result, **({"same_binary_as": first} if first != case else {}))
                except Exception as e:  # reported per row: one kernel failing must not hide the others
                    row["error"] = f"{type(e).__name__}: {e}"[:2000]
                print(json.dumps(row, default=str), flush=True)
    # what the suite checks coverage against: every kernel the package defines
    print(json.dumps({"kernels": sorted(fn.__name__ for fn in kernel_functions().values())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
