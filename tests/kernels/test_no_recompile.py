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

from aot_compile import (BF16, META, QWEN3_30B_A3B, QWEN25_7B, QWEN25_VIT, JitKeys, _cache, _qkv, kernel_functions,
                         record)
from vlm_sdk.kernels import (fused_moe, paged_attention_decode, paged_prefill_attention, rms_norm, rotary,
                             silu_and_mul, store_kv, varlen_attention)

# kernel -> the per-step int arguments it must not specialise
PER_STEP_INTS = {
    "_decode_split_kernel": {"num_splits", "stride_bt"},
    "_decode_merge_kernel": {"num_splits"},
    "_paged_prefill_kernel": {"stride_tb"},
    "_rotary_kernel": {"stride_pos_row"},
    "_fused_moe_kernel": {"num_pairs"},
}
# kernel -> pointer arguments not specialised on alignment: index tensors that may be views into a
# packed per-step buffer at any offset (the runner's _prepare splits one int64 buffer into ids | slots |
# ... | positions, so the slots and positions start 8 bytes off a 16-byte boundary after an odd count)
UNALIGNED_POINTERS = {
    "_store_kv_kernel": {"slot_ptr"},
    "_rotary_kernel": {"pos_ptr"},
    "_decode_split_kernel": {"block_tables_ptr", "seq_lens_ptr"},
    "_paged_prefill_kernel": {"block_tables", "cu_seqlens_q", "seq_lens", "tiles"},
    "_varlen_attention_kernel": {"cu_seqlens"},
    "_conv_varlen_kernel": {"qsl_ptr", "slots_ptr", "init_ptr"},
    "_conv_state_kernel": {"qsl_ptr", "slots_ptr", "init_ptr"},
    "_conv_update_kernel": {"slots_ptr", "init_ptr"},
    "_gdr_recurrent_kernel": {"slots_ptr", "init_ptr"},
    "_gdr_chunk_prep_kernel": {"qsl_ptr"},
    "_gdr_chunk_state_kernel": {"qsl_ptr", "offsets_ptr", "slots_ptr", "init_ptr"},
    "_gdr_chunk_output_kernel": {"qsl_ptr"},
}
# kernel -> compiled variants one model may launch (what the warm-up must run): decode direct or
# split; prefill: one tile (query_tile); varlen tiles of 64 or 128 query rows (flash_launch_config); norm with or without
# the residual add; the MoE experts: two products x 16- or 64-row blocks
VARIANTS = {"_decode_split_kernel": 2, "_decode_merge_kernel": 1, "_paged_prefill_kernel": 1,
            "_varlen_attention_kernel": 2, "_rotary_kernel": 1, "_store_kv_kernel": 1, "_rms_norm_kernel": 2,
            "_silu_and_mul_kernel": 1, "_fused_moe_kernel": 4,
            # Gated DeltaNet (Qwen3.5-27B's shapes): one variant each whatever the step
            "_conv_varlen_kernel": 1, "_conv_state_kernel": 1, "_conv_update_kernel": 1, "_gdr_chunk_prep_kernel": 1,
            "_gdr_chunk_state_kernel": 1, "_gdr_chunk_output_kernel": 1, "_gdr_recurrent_kernel": 1,
            "_gated_rms_norm_kernel": 1}


def _jit_list(fn, name: str = "do_not_specialize") -> set[str]:
    """A kernel's do_not_specialize(_on_alignment) names, whether Triton built it compiled or interpreted."""
    names = getattr(fn, name, None)
    if names is None:  # InterpretedFunction (TRITON_INTERPRET=1) keeps the jit arguments as kwargs
        names = fn.kwargs.get(name) or []
    return set(names)


@pytest.mark.parametrize("kernel", sorted(PER_STEP_INTS))
def test_per_step_ints_are_not_specialised(kernel):
    fn = {f.__name__: f for f in kernel_functions().values()}[kernel]
    missing = PER_STEP_INTS[kernel] - _jit_list(fn)
    assert not missing, f"{kernel} specialises per-step ints {sorted(missing)}: add them to do_not_specialize"


@pytest.mark.parametrize("kernel", sorted(UNALIGNED_POINTERS))
def test_step_index_pointers_are_not_specialised_on_alignment(kernel):
    fn = {f.__name__: f for f in kernel_functions().values()}[kernel]
    missing = UNALIGNED_POINTERS[kernel] - _jit_list(fn, "do_not_specialize_on_alignment")
    assert not missing, (f"{kernel} specialises the alignment of {sorted(missing)}: add them to "
                         "do_not_specialize_on_alignment")


def _step_ints(n: int, offset: int, dtype=torch.int32) -> torch.Tensor:
    """n ints that start `offset` elements into a packed buffer (any alignment), as _prepare makes them."""
    return torch.empty(offset + n, dtype=dtype, device=META)[offset:]


def _workload():
    """Launcher calls a serving run makes for one model: every combination of the per-step sizes, the
    step's index tensors at aligned and unaligned offsets of a packed buffer."""
    s = QWEN25_7B
    kc, vc = _cache(s)
    scale = s.head_dim ** -0.5
    graph_positions = torch.empty(3, 4096, dtype=torch.int64, device=META)  # a CUDA-graph buffer
    for batch, width, splits in itertools.product((1, 3, 16, 17, 64), (1, 2, 16, 17, 2048), (1, 2, 7, 16, 64)):
        q, _, _ = _qkv(batch, s.heads, s.kv_heads, s.head_dim)
        tables = _step_ints(batch * width, batch).view(batch, width)
        yield lambda: paged_attention_decode.paged_attention_decode(q, kc, vc, tables, _step_ints(batch, splits),
                                                                    scale, num_splits=splits)
    for tokens, batch, width in itertools.product((1, 16, 17, 64, 65, 2048), (1, 2, 16), (1, 16, 17, 300)):
        q, k, v = _qkv(tokens, s.heads, s.kv_heads, s.head_dim)
        tables = _step_ints(batch * width, tokens).view(batch, width)
        yield lambda: paged_prefill_attention.paged_prefill_attention(
            q, kc, vc, tables, _step_ints(batch + 1, batch), _step_ints(batch, tokens + 1), tokens, scale)
        yield lambda: store_kv.store_kv(k, v, kc, vc, _step_ints(tokens, tokens, torch.int64))
        inv_freq = torch.empty(s.head_dim // 2, device=META)
        packed = _step_ints(3 * tokens, 2 * tokens + batch, torch.int64).view(3, tokens)
        for positions in (torch.empty(3, tokens, dtype=torch.int64, device=META), graph_positions[:, :tokens], packed):
            yield lambda: rotary.rotary_embedding(q, k, positions, inv_freq, mrope_section=(16, 24, 24))
        x = torch.empty(tokens, s.hidden, dtype=BF16, device=META)
        w = torch.empty(s.hidden, dtype=BF16, device=META)
        yield lambda: rms_norm.rms_norm(x, w, 1e-6)
        yield lambda: rms_norm.rms_norm(x, w, 1e-6, residual=torch.empty_like(x))
        yield lambda: silu_and_mul.silu_and_mul(torch.empty(tokens, 2 * s.intermediate, dtype=BF16, device=META))
    experts, top_k, hidden, inter = QWEN3_30B_A3B
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=BF16, device=META)
    w2 = torch.empty(experts, hidden, inter, dtype=BF16, device=META)
    for tokens in (1, 3, 16, 17, 32, 33, 64, 65, 2048):
        yield lambda: fused_moe.fused_moe(torch.empty(tokens, hidden, dtype=BF16, device=META), w13, w2,
                                          torch.empty(tokens, top_k, device=META),
                                          torch.empty(tokens, top_k, dtype=torch.int64, device=META))
    yield from _gated_delta_net_workload()
    _, heads, head_dim, _, _ = QWEN25_VIT
    for patches, segments, max_len in ((16, 1, 16), (64, 1, 64), (256, 4, 64), (256, 1, 256), (4096, 3, 4000)):
        q, k, v = torch.empty(patches, 3, heads, head_dim, dtype=BF16, device=META).unbind(1)
        for offset in (0, 1, 3):
            yield lambda: varlen_attention.varlen_attention(q, k, v, _step_ints(segments + 1, offset), max_len,
                                                            head_dim ** -0.5)


def _gated_delta_net_workload():
    """Qwen3.5-27B's linear-attention ops over steps of every size: the conv and the rule (prefill and
    decode) with the step's index tensors at any offset, and the gated norm."""
    from aot_compile import QWEN35_27B
    from vlm_sdk.kernels import causal_conv1d, gated_delta_rule_chunk, gated_delta_rule_recurrent, gated_rms_norm
    _, _, hk, hv, d, width = QWEN35_27B
    conv_dim = (2 * hk + hv) * d
    w = torch.empty(conv_dim, width, dtype=BF16, device=META)
    conv_state = torch.empty(64, conv_dim, width - 1, dtype=BF16, device=META)
    state = torch.empty(64, hv, d, d, device=META)
    for tokens, batch, offset in itertools.product((1, 16, 17, 64, 65, 2048), (1, 2, 16), (0, 1, 3)):
        if batch > tokens:
            continue
        mixed = torch.empty(tokens, conv_dim + hv * d, dtype=BF16, device=META)
        x = mixed[:, :conv_dim]
        q, k = x[:, :hk * d].view(tokens, hk, d), x[:, hk * d:2 * hk * d].view(tokens, hk, d)
        v = x[:, 2 * hk * d:].view(tokens, hv, d)
        g, beta = torch.empty(tokens, hv, device=META), torch.empty(tokens, hv, dtype=BF16, device=META)
        qsl = _step_ints(batch + 1, offset)
        slots = _step_ints(batch, offset + 1, torch.int64)
        init = torch.empty(batch + offset, dtype=torch.bool, device=META)[offset:]
        longest = tokens - batch + 1
        yield lambda: causal_conv1d.causal_conv1d_varlen(x, w, None, conv_state, qsl, slots, init,
                                                         max_query_len=longest)
        yield lambda: gated_delta_rule_chunk.chunk_gated_delta_rule(q, k, v, g, beta, state, qsl, longest, slots, init)
        yield lambda: gated_rms_norm.gated_rms_norm(torch.empty(tokens * hv, d, dtype=BF16, device=META),
                                                    torch.empty(tokens * hv, d, dtype=BF16, device=META),
                                                    torch.empty(d, dtype=BF16, device=META), 1e-6)
        if tokens == batch:  # a decode step
            yield lambda: causal_conv1d.causal_conv1d_update(x, w, None, conv_state, slots, init)
            yield lambda: gated_delta_rule_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, state, slots, init)


def test_varied_workload_stays_within_the_warm_variants():
    key = JitKeys()
    keys: dict[str, set] = {}
    for call in _workload():
        for fn, args, kwargs in record(call):
            keys.setdefault(fn.__name__, set()).add(key(fn, args, kwargs))
    counts = {name: len(k) for name, k in keys.items()}
    assert counts == VARIANTS, f"distinct JIT cache keys per kernel {counts}, the warm-up compiles {VARIANTS}"
