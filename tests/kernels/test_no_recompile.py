"""No Triton compilation while serving: the ints that vary from step to step are not specialised.

Triton specialises an int argument equal to 1 or divisible by 16 (a different compiled variant per
case), so a stride that follows the block-table width or the token count compiles new variants
while serving (a 1-3 s stall each). The kernels list those ints in `do_not_specialize`; the first
test pins the lists (a refactor that drops one fails), the second runs the launchers over a varied
workload (batch sizes, lengths, block-table widths, split counts, token counts) on "meta" tensors and
asks Triton's own CUDA binder for each launch's JIT cache key: every kernel must stay within the
variants the start-up warm-up (vlm_sdk/worker/kernel_warmup.py) compiles.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from aot_compile import BF16, META, QWEN25_7B, QWEN25_VIT, _cache, _ints, _qkv, kernel_functions, record
from vlm_sdk.kernels import (paged_attention_decode, paged_prefill_attention, rms_norm, rotary, silu_and_mul,
                             store_kv, varlen_attention)

# kernel -> the per-step int arguments it must not specialise
PER_STEP_INTS = {
    "_decode_split_kernel": {"num_splits", "stride_bt"},
    "_decode_merge_kernel": {"num_splits"},
    "_paged_prefill_kernel": {"stride_tb"},
    "_rotary_kernel": {"stride_pos_row"},
}
# kernel -> compiled variants one model may launch (what the warm-up must run): decode direct or
# split; prefill/varlen tiles of 64 or 128 query rows (flash_launch_config); norm with or without
# the residual add
VARIANTS = {"_decode_split_kernel": 2, "_decode_merge_kernel": 1, "_paged_prefill_kernel": 2,
            "_varlen_attention_kernel": 2, "_rotary_kernel": 1, "_store_kv_kernel": 1, "_rms_norm_kernel": 2,
            "_silu_and_mul_kernel": 1}


def _do_not_specialize(fn) -> set[str]:
    """The names a kernel does not specialise, whether Triton built it compiled or interpreted."""
    names = getattr(fn, "do_not_specialize", None)
    if names is None:  # InterpretedFunction (TRITON_INTERPRET=1) keeps the jit arguments as kwargs
        names = fn.kwargs.get("do_not_specialize") or []
    return set(names)


def _as_jit(fn) -> triton.runtime.JITFunction:
    """A JITFunction over the same Python function (under the interpreter the module holds an
    InterpretedFunction); only its binder is used, nothing is compiled."""
    if isinstance(fn, triton.runtime.JITFunction):
        return fn
    return triton.runtime.JITFunction(fn.fn, do_not_specialize=fn.kwargs.get("do_not_specialize"))


@pytest.mark.parametrize("kernel", sorted(PER_STEP_INTS))
def test_per_step_ints_are_not_specialised(kernel):
    fn = {f.__name__: f for f in kernel_functions().values()}[kernel]
    missing = PER_STEP_INTS[kernel] - _do_not_specialize(fn)
    assert not missing, f"{kernel} specialises per-step ints {sorted(missing)}: add them to do_not_specialize"


def _workload():
    """Launcher calls a serving run makes for one model: every combination of the per-step sizes."""
    s = QWEN25_7B
    kc, vc = _cache(s)
    scale = s.head_dim ** -0.5
    graph_positions = torch.empty(3, 4096, dtype=torch.int64, device=META)  # a CUDA-graph buffer
    for batch, width, splits in itertools.product((1, 3, 16, 17, 64), (1, 2, 16, 17, 2048), (1, 2, 7, 16, 64)):
        q, _, _ = _qkv(batch, s.heads, s.kv_heads, s.head_dim)
        yield lambda: paged_attention_decode.paged_attention_decode(q, kc, vc, _ints(batch, width), _ints(batch),
                                                                    scale, num_splits=splits)
    for tokens, batch, width in itertools.product((1, 16, 17, 64, 65, 2048), (1, 2, 16), (1, 16, 17, 300)):
        q, k, v = _qkv(tokens, s.heads, s.kv_heads, s.head_dim)
        yield lambda: paged_prefill_attention.paged_prefill_attention(
            q, kc, vc, _ints(batch, width), _ints(batch + 1), _ints(batch), tokens, scale)
        yield lambda: store_kv.store_kv(k, v, kc, vc, torch.empty(tokens, dtype=torch.int64, device=META))
        inv_freq = torch.empty(s.head_dim // 2, device=META)
        for positions in (torch.empty(3, tokens, dtype=torch.int64, device=META), graph_positions[:, :tokens]):
            yield lambda: rotary.rotary_embedding(q, k, positions, inv_freq, mrope_section=(16, 24, 24))
        x = torch.empty(tokens, s.hidden, dtype=BF16, device=META)
        w = torch.empty(s.hidden, dtype=BF16, device=META)
        yield lambda: rms_norm.rms_norm(x, w, 1e-6)
        yield lambda: rms_norm.rms_norm(x, w, 1e-6, residual=torch.empty_like(x))
        yield lambda: silu_and_mul.silu_and_mul(torch.empty(tokens, 2 * s.intermediate, dtype=BF16, device=META))
    _, heads, head_dim, _, _ = QWEN25_VIT
    for patches, segments, max_len in ((16, 1, 16), (64, 1, 64), (256, 4, 64), (256, 1, 256), (4096, 3, 4000)):
        q, k, v = torch.empty(patches, 3, heads, head_dim, dtype=BF16, device=META).unbind(1)
        yield lambda: varlen_attention.varlen_attention(q, k, v, _ints(segments + 1), max_len, head_dim ** -0.5)


def test_varied_workload_stays_within_the_warm_variants():
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders = {}
    keys: dict[str, set] = {}
    for call in _workload():
        for fn, args, kwargs in record(call):
            jit = _as_jit(fn)
            if fn.__name__ not in binders:
                binders[fn.__name__] = create_function_from_signature(jit.signature, jit.params, backend)
            _, specialization, options = binders[fn.__name__](*args, **kwargs)
            keys.setdefault(fn.__name__, set()).add((repr(specialization), repr(sorted(options.items()))))
    counts = {name: len(k) for name, k in keys.items()}
    assert counts == VARIANTS, f"distinct JIT cache keys per kernel {counts}, the warm-up compiles {VARIANTS}"
