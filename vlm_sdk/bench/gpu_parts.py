"""The pieces of `vlm-sdk bench --gpu` (`vlm_sdk/bench/gpu.py`) that are not about our engine.

- `build_checkpoint`: a Qwen2.5-VL checkpoint with random weights, made on the target device (a 3.7B
  model initialised on the CPU would take minutes) and saved the way `vlm_sdk.testing` saves its tiny
  ones, with the same tokenizer and preprocessor files. The transformers model is returned: it is
  the peer of the throughput figure.
- Reference rates: device copy bandwidth and matmul rate, measured in the same run as the figures.
- Floors' arithmetic: the bytes one decode step must read, the FLOPs of a prefill.
- `paged_attention_alone`: the decode attention kernel on random data, with its achieved bandwidth.
- `transformers_throughput`: the peer of the throughput figure, transformers `generate` in one batch.
"""
from __future__ import annotations

import gc
import math
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch

# The tiny checkpoint's writers: the GPU benchmark writes the same tokenizer, generation and
# preprocessor files around weights that it initialises on the device itself.
from vlm_sdk.models.common.tiny_checkpoint import no_hf_progress_bars
from vlm_sdk.models.qwen2_5_vl import tiny_checkpoint as _testing
from vlm_sdk.protocol.blocks import blocks_needed
from vlm_sdk.errors import VLMError


class GpuBenchError(VLMError):
    """The GPU benchmark cannot run as asked (no CUDA device, sizes that do not fit) or its run was not
    what it claims to measure (a timed decode step that did not decode every sequence)."""


@dataclass(frozen=True)
class ModelShape:
    """The architecture knobs of a Qwen2.5-VL checkpoint (names as `vlm_sdk.testing` overrides)."""
    text_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int | None  # None: the tokenizer's size rounded up to a multiple of 64
    tie_word_embeddings: bool
    mrope_section: tuple[int, ...] | None
    max_position_embeddings: int
    vision_depth: int
    vision_hidden_size: int
    vision_heads: int
    vision_intermediate_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    min_pixels: int
    max_pixels: int


# The published Qwen2.5-VL-3B-Instruct config (patch 14, temporal patch 2, merge 2, silu, rope_theta
# 1e6 and rms_norm_eps 1e-6 are fixed by vlm_sdk.testing for every shape).
QWEN2_5_VL_3B = ModelShape(
    text_hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2, intermediate_size=11008,
    vocab_size=151936, tie_word_embeddings=True, mrope_section=(16, 24, 24), max_position_embeddings=128000,
    vision_depth=32, vision_hidden_size=1280, vision_heads=16, vision_intermediate_size=3420, window_size=112,
    fullatt_block_indexes=(7, 15, 23, 31), min_pixels=3136, max_pixels=12845056)

# `make_tiny_checkpoint`'s default shape, for the CPU smoke run
TINY = ModelShape(**{f.name: _testing._DEFAULTS[f.name] for f in fields(ModelShape)})


class DeviceTimer:
    """Seconds per call of `fn`: CUDA events on a GPU (the host may run ahead), a wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def per_call(self, fn: Callable[[], object], calls: int = 1) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls


# ----------------------------------------------------------------------------------------------
# checkpoint

def build_checkpoint(out: Path, shape: ModelShape, *, device: torch.device, dtype: torch.dtype, seed: int,
                     init_std: float):
    """Write an HF-format Qwen2.5-VL checkpoint of `shape` to `out`; return the transformers model
    (on `device`, in `dtype`, sdpa attention, eval mode) whose weights were saved."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    opts = {**_testing._DEFAULTS, **asdict(shape), "preprocessor_layout": "nested"}
    tokenizer, ids, config = _testing.qwen_tokenizer_and_config(opts)
    out.mkdir(parents=True, exist_ok=True)
    with no_hf_progress_bars():
        # created on the device, in the target dtype: no CPU copy of the weights ever exists
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation="sdpa")
        model.to(device).eval().requires_grad_(False)
        _redraw(model, seed, init_std, device)
        model.save_pretrained(out)
    _testing.write_qwen_side_files(out, tokenizer, ids, opts)
    return model


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int, std: float, device: torch.device) -> None:
    """Matrices ~ N(0, std), biases ~ N(0, 0.02), norms = 1, drawn on the device with a private
    generator. Speed does not depend on the values; a fixed draw keeps runs comparable."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():  # tied parameters appear once
        if p.ndim >= 2:
            p.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.fill_(1.0)
    head, embed = model.lm_head.weight, model.get_input_embeddings().weight
    if model.config.tie_word_embeddings and head is not embed:
        head.copy_(embed)  # two parameters but one tensor in the checkpoint: make them equal


# ----------------------------------------------------------------------------------------------
# reference rates

def copy_bandwidth(timer: DeviceTimer, nbytes: int, reps: int) -> float:
    """Bytes/s of a device-to-device copy of `nbytes` (bytes read + bytes written), best of `reps`:
    what the memory system delivers to a plain streaming kernel."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=timer.device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = min(timer.per_call(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * nbytes / best


def matmul_rate(timer: DeviceTimer, n: int, dtype: torch.dtype, reps: int) -> float:
    """FLOP/s of an [n, n] @ [n, n] product in `dtype`, best of `reps`."""
    gen = torch.Generator(device=timer.device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=timer.device, dtype=dtype)
    b = torch.randn(n, n, generator=gen, device=timer.device, dtype=dtype)
    c = torch.empty(n, n, device=timer.device, dtype=dtype)
    torch.matmul(a, b, out=c)  # warm-up (and cuBLAS heuristics)
    best = min(timer.per_call(lambda: torch.matmul(a, b, out=c)) for _ in range(reps))
    return 2 * n ** 3 / best


# ----------------------------------------------------------------------------------------------
# floors

def decode_weight_bytes(decoder: torch.nn.Module, batch: int) -> int:
    """Bytes of LLM weights one decode step of `batch` sequences reads: every decoder layer and the
    final norm once, the LM head matrix once (the embedding itself when tied), and `batch` embedding
    rows (already counted when tied: the same matrix). The vision tower is not run while decoding."""
    total = sum(p.numel() * p.element_size() for name, p in decoder.named_parameters()  # shared ones once
                if not name.startswith("embed_tokens."))
    embed = decoder.embed_tokens.weight
    row_bytes = embed.shape[1] * embed.element_size()
    if getattr(decoder, "lm_head", None) is None:  # tied: the logits read the whole embedding
        return total + embed.numel() * embed.element_size()
    return total + batch * row_bytes


def prefill_flops(hf_config, grids: list[tuple[int, int, int]], num_tokens: int) -> dict[str, float]:
    """Matmul FLOPs of one prefill: the vision tower on images of these (t, h, w) patch grids, then
    `num_tokens` prompt tokens through the LLM and the LM head on the one sampled row.

    Linear layers cost 2 * in * out per row; attention 4 * n * L * d per block or layer (QK^T and PV
    over L keys; causal in the LLM, so sum over rows of their prefix). Norms, rotary and softmax are
    left out: a floor counts only the work no implementation can skip."""
    v, t = hf_config.vision_config, hf_config.text_config
    hid, inter, merge = v.hidden_size, v.intermediate_size, v.spatial_merge_size
    patch_in = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    per_patch = patch_in * hid + v.depth * (hid * 3 * hid + hid * hid + 3 * hid * inter)
    merged_in = hid * merge ** 2
    per_merged = merged_in * merged_in + merged_in * v.out_hidden_size
    unit = v.window_size // merge // v.patch_size  # window side in merged tokens
    full_blocks = len(v.fullatt_block_indexes)
    patches = vision_attn = 0
    for gt, gh, gw in grids:
        patches += gt * gh * gw
        full = gt * (gh * gw) ** 2  # each frame attends within itself
        mh, mw = gh // merge, gw // merge
        windowed = gt * sum((min(unit, mh - i) * min(unit, mw - j) * merge ** 2) ** 2
                            for i in range(0, mh, unit) for j in range(0, mw, unit))
        vision_attn += 4 * hid * (full_blocks * full + (v.depth - full_blocks) * windowed)

    d = t.hidden_size // t.num_attention_heads
    q, kv = t.num_attention_heads * d, t.num_key_value_heads * d
    per_token = t.num_hidden_layers * (t.hidden_size * (q + 2 * kv) + q * t.hidden_size
                                       + 3 * t.hidden_size * t.intermediate_size)
    causal_pairs = num_tokens * (num_tokens + 1) // 2
    return {
        "vision_linear": 2.0 * (patches * per_patch + patches // merge ** 2 * per_merged),
        "vision_attention": float(vision_attn),
        "llm_linear": 2.0 * num_tokens * per_token,
        "llm_attention": 4.0 * q * causal_pairs * t.num_hidden_layers,
        "lm_head": 2.0 * t.hidden_size * t.vocab_size,
    }


# ----------------------------------------------------------------------------------------------
# the decode attention kernel alone

def attention_impl(device: torch.device) -> str:
    """What `paged_attention_alone` runs: the Triton kernel on CUDA, or under TRITON_INTERPRET=1 on the
    CPU; otherwise the torch reference (Triton cannot launch on CPU tensors without the interpreter)."""
    if device.type == "cuda":
        return "triton"
    return "triton-interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "torch-reference"


@torch.inference_mode()
def paged_attention_alone(timer: DeviceTimer, *, batch: int, context: int, num_heads: int, num_kv_heads: int,
                          head_dim: int, block_size: int, dtype: torch.dtype, calls: int, seed: int,
                          kv_dtype: torch.dtype | None = None, kv_int: int = 0) -> dict:
    """Time `paged_attention_decode` on `batch` sequences of `context` cached tokens in a randomly
    permuted paged cache; return seconds per call, the bytes it must move and its max difference
    from the torch reference. `kv_dtype`: the cache's (None: `dtype`; float8 e4m3: an FP8 cache of the
    same random values, scales 1.0). `kv_int` 8 / 4: an int8 / int4 cache of the same values (codes and
    their float32 scales and zeros, kernels/kv_int.py), its bytes counted with the scales.

    On CUDA the working set is spread over enough copies (different blocks of one cache) to be at
    least 4x the L2 cache, so K/V come from DRAM; the calls are replayed from one CUDA graph, as
    the engine replays its decode steps, so host launch time does not pose as kernel time."""
    from vlm_sdk.kernels import paged_attention_decode as pad

    device, impl = timer.device, attention_impl(timer.device)
    blocks_per_seq = blocks_needed(context, block_size)
    kv_dtype = kv_dtype or dtype
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * torch.finfo(kv_dtype).bits // 8  # K + V read
    if kv_int:  # codes (D or D/2 bytes) and 8 bytes of scale and zero a token and head, for K and V
        kv_bytes = 2 * batch * context * num_kv_heads * (head_dim * kv_int // 8 + 8)
    moved = kv_bytes + 2 * batch * num_heads * head_dim * torch.finfo(dtype).bits // 8  # + q read, out written
    sets = 1
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
        sets = max(1, math.ceil(4 * l2 / kv_bytes))
    gen = torch.Generator(device=device).manual_seed(seed)
    num_blocks = sets * batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen, device=device,
                          dtype=dtype).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen, device=device,
                          dtype=dtype).to(kv_dtype)
    scales = {}
    if kv_int:  # the same values quantized per token and head
        from vlm_sdk.kernels import kv_int as int_kv
        (k_cache, k_sz), (v_cache, v_sz) = int_kv.quantize(k_cache, kv_int), int_kv.quantize(v_cache, kv_int)
        scales = {"k_sz": k_sz.contiguous(), "v_sz": v_sz.contiguous()}
    elif kv_dtype == torch.float8_e4m3fn:  # the layer's scales: 1.0 (randn values are well inside e4m3's range)
        scales = {"k_scale": torch.ones((), device=device), "v_scale": torch.ones((), device=device)}
    tables = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = tables.view(sets, batch, blocks_per_seq)  # [sets, B, blocks per sequence]
    q = torch.randn(batch, num_heads, head_dim, generator=gen, device=device, dtype=dtype)  # [B, H, D]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    kernel = pad.paged_attention_decode_ref if impl == "torch-reference" else pad.paged_attention_decode
    # chosen on the host before any capture, as the engine's decode graphs do
    num_splits = pad.choose_num_splits(batch, num_kv_heads, context, device)

    def call(s: int) -> torch.Tensor:
        return kernel(q, k_cache, v_cache, tables[s], seq_lens, scale, num_splits=num_splits, max_seq_len=context,
                      out=out, **scales)

    for s in range(sets):  # warm-up: Triton compiles outside the timed region (and the capture)
        call(s)
    ref = pad.paged_attention_decode_ref(q, k_cache, v_cache, tables[0], seq_lens, scale, **scales)
    max_abs_diff = (call(0).float() - ref.float()).abs().max().item()
    if device.type == "cuda":
        timer.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                call(i % sets)
        graph.replay()
        per_call = min(timer.per_call(graph.replay) for _ in range(5)) / calls
    else:
        per_call = timer.per_call(lambda: call(0), calls)
    return {"seconds_per_call": per_call, "bytes": moved, "kv_bytes": kv_bytes, "impl": impl, "copies": sets,
            "num_splits": num_splits, "calls": calls, "max_abs_diff_vs_reference": max_abs_diff}


# ----------------------------------------------------------------------------------------------
# the transformers peer

def transformers_throughput(model, model_dir: str, convs: list, max_tokens: int, timer: DeviceTimer,
                            eos: list[int]) -> dict:
    """transformers generate on all conversations in one left-padded batch; prompts are built the
    documented way (`vlm_sdk.models.qwen2_5_vl.reference`), inside the timed region as ours are."""
    from transformers import AutoTokenizer, GenerationConfig
    from vlm_sdk.models.qwen2_5_vl import reference as family_reference
    from vlm_sdk.testing import reference

    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = family_reference.hf_image_processor(model_dir)
    pad = tok.pad_token_id

    @torch.inference_mode()
    def generate(batch_convs, n: int) -> int:
        prompts = [family_reference.hf_prompt(tok, proc, model.config, c) for c in batch_convs]
        batch = {k: v.to(model.device) for k, v in reference.hf_batch(prompts, pad).items()}
        # min_new_tokens = max_new_tokens masks eos to the end: every row gets n tokens, as ignore_eos
        gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=eos,
                               pad_token_id=pad)
        out = model.generate(**batch, generation_config=gen)
        return out.shape[0] * (out.shape[1] - batch["input_ids"].shape[1])

    generate(convs[:2], 4)  # warm-up
    timer.sync()
    t0 = time.perf_counter()
    tokens = generate(convs, max_tokens)
    timer.sync()
    seconds = time.perf_counter() - t0
    check_tokens("transformers", tokens, len(convs), max_tokens)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "batch_size": len(convs),
            "attn_implementation": model.config._attn_implementation}


def check_tokens(who: str, tokens: int, requests: int, max_tokens: int) -> None:
    if tokens != requests * max_tokens:
        raise GpuBenchError(f"{who} generated {tokens} tokens, not {requests} x {max_tokens}: the throughput "
                            "would compare different work")


# ----------------------------------------------------------------------------------------------
# environment

def checkpoint_dir() -> tempfile.TemporaryDirectory:
    """A temporary directory under $VLM_SDK_CACHE when set (the system's temp dir otherwise)."""
    root = os.environ.get("VLM_SDK_CACHE")
    if root:
        Path(root).mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix="bench-gpu-", dir=root or None)


def free_memory(device: torch.device) -> None:
    gc.collect()  # CUDA graphs and caches can sit in reference cycles
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def plan_vs_engine(planned, engine) -> dict:
    """`vlm-sdk plan` (made just before the engine started, on the same device and settings) against
    what the engine measured: blocks, weights and activation peak. Issue 6 asks for blocks within 3%."""
    r = engine.memory_report
    diff = (planned.num_blocks - r.num_blocks) / max(r.num_blocks, 1)
    return {"plan_blocks": planned.num_blocks, "engine_blocks": r.num_blocks, "blocks_difference": diff,
            "within_3_percent": abs(diff) <= 0.03, "plan_weights_bytes": planned.weights_bytes,
            "engine_weights_bytes": r.weights_bytes, "engine_weights_allocated_bytes": r.weights_allocated_bytes,
            "plan_activation_peak_bytes": planned.activation_peak_bytes,
            "engine_activation_peak_bytes": r.activation_peak_bytes}


def plan_options(engine_kwargs: dict) -> dict:
    """The engine settings `plan()` also takes."""
    from vlm_sdk.plan import PLAN_OPTIONS
    return {k: v for k, v in engine_kwargs.items() if k in PLAN_OPTIONS}


def image_setting_fix(planned) -> dict:
    """The family's image setting at the value `vlm-sdk plan` offers when the largest image the
    checkpoint allows does not fit max_model_len (the engine would refuse to start: UnfitImagesError);
    {} when it fits. As an engine keyword: {"max_pixels": 3012128} for Qwen2.5-VL at 4096 tokens."""
    from vlm_sdk.models import registry

    _, setting = registry.load(planned.family).plan_setting
    for problem in planned.problems:  # without a workload, only the largest image's problem offers it
        if setting in problem.fixes:
            return {setting: problem.fixes[setting]}
    return {}
