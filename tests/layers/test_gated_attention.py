"""Qwen3.5's gated full attention (vlm_sdk/layers/gated_attention.py: q | gate projection, zero-centred
q/k norms, partial rotary with interleaved M-RoPE, the output gate) against transformers'
`Qwen3_5Attention` on a whole prompt with three distinct position rows, random weights; both kernel sets;
and two tensor-parallel ranks (composed by hand: o_proj's partial sums added) equal to one."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5TextRotaryEmbedding

from tolerance import assert_reduction_close
from vlm_sdk.layers.gated_attention import GatedAttention, GatedAttentionConfig
from vlm_sdk.layers.ops import TorchOps
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.weight_loading import load_checked

N = 23


def _config() -> Qwen3_5TextConfig:
    # head_dim 64 with a quarter rotated: 16 dims, 8 frequencies interleaved t h w t h w t h (section [3, 3, 2])
    cfg = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_hidden_layers=1, layer_types=["full_attention"], rms_norm_eps=1e-6,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                             "mrope_section": [3, 3, 2], "mrope_interleaved": True})
    cfg._attn_implementation = "eager"
    return cfg


def _hf(cfg, seed: int = 0) -> Qwen3_5Attention:
    torch.manual_seed(seed)
    layer = Qwen3_5Attention(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.3))
    return layer


def _positions() -> torch.Tensor:  # [3, N]: t, h, w rows that differ, as an image's would
    t = torch.arange(N)
    return torch.stack((t, t // 2 + 5, t % 3 + 1))


def _hf_out(cfg, hf, x: torch.Tensor) -> torch.Tensor:
    pos = _positions()[:, None, :]  # [3, 1, N]
    cos, sin = Qwen3_5TextRotaryEmbedding(cfg)(x, pos)
    mask = torch.full((N, N), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return hf(x, (cos, sin), mask)[0][0]


def _ours(cfg, hf, ops, x: torch.Tensor, tp: TPGroup = TPGroup()) -> torch.Tensor:
    layer = GatedAttention(GatedAttentionConfig.from_hf(cfg), ops, tp=tp)
    load_checked(layer, [(f"model.layers.3.self_attn.{n}", t) for n, t in hf.state_dict().items()],
                 layer.slots("model.layers.3.self_attn."))
    rope = ops.rotary_inputs(_positions(), layer.cfg.rotary("cpu"), x.dtype)
    with torch.no_grad():
        q, k, v, gate = layer.project(x[0], rope)
        group = layer.num_heads // layer.num_kv_heads
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                                              v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True)
        return layer.output(attn.transpose(0, 1), gate)


def _terms(cfg) -> int:
    return 2 * cfg.hidden_size + cfg.head_dim + N + cfg.num_attention_heads * cfg.head_dim


def _kernel_sets():
    yield pytest.param(TorchOps, id="torch")

    def triton_ops():
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
        from vlm_sdk.attention.selector import make_backend
        from vlm_sdk.layers.ops import TritonOps
        return TritonOps(make_backend("triton", torch.device("cpu")))
    yield pytest.param(triton_ops, id="triton")


@pytest.mark.parametrize("make_ops", _kernel_sets())
def test_whole_prompt_equals_transformers(make_ops):
    cfg = _config()
    hf = _hf(cfg)
    x = torch.randn(1, N, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    want = _hf_out(cfg, hf, x)
    assert_reduction_close(_ours(cfg, hf, make_ops(), x), want, _terms(cfg))
    assert float(want.std()) > 0.1


def test_config_reads_partial_rotary_and_interleaved_mrope():
    c = GatedAttentionConfig.from_hf(_config())
    assert (c.head_dim, c.rotary_dim, c.mrope_section, c.mrope_interleaved) == (64, 16, (3, 3, 2), True)
    assert c.rotary("cpu").inv_freq.shape == (8,)


def test_two_ranks_sum_to_one():
    cfg = _config()
    hf = _hf(cfg, seed=2)
    x = torch.randn(1, N, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    full = _ours(cfg, hf, TorchOps(), x)
    parts = [_ours(cfg, hf, TorchOps(), x, TPGroup(r, 2)) for r in range(2)]  # o_proj partial sums
    assert_reduction_close(parts[0] + parts[1], full, _terms(cfg))
    with pytest.raises(ValueError, match=r"attention heads \(4\) is not divisible by the tensor-parallel size 3"):
        GatedAttention(GatedAttentionConfig.from_hf(cfg), TorchOps(), device="meta", tp=TPGroup(0, 3))


def test_forward_over_the_paged_cache_in_two_steps_equals_transformers():
    """`forward` with the torch backend's paged KV cache (blocks of 8): the prompt's first 16 tokens,
    then the other 7 reading them from the cache."""
    from vlm_sdk.attention.metadata import AttentionMetadata
    cfg = _config()
    hf = _hf(cfg, seed=4)
    x = torch.randn(1, N, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    want = _hf_out(cfg, hf, x)
    ops = TorchOps()
    layer = GatedAttention(GatedAttentionConfig.from_hf(cfg), ops)
    load_checked(layer, hf.state_dict().items(), layer.slots())
    cache = tuple(torch.zeros(4, 8, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2))
    rotary, outs = layer.cfg.rotary("cpu"), []
    for start, end in ((0, 16), (16, N)):
        meta = AttentionMetadata(slot_mapping=torch.arange(start, end), query_start_loc=torch.tensor(
            [0, end - start], dtype=torch.int32), seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32), query_lens_cpu=[end - start],
            seq_lens_cpu=[end], max_query_len=end - start, max_seq_len=end)
        rope = ops.rotary_inputs(_positions()[:, start:end], rotary, x.dtype)
        with torch.no_grad():
            outs.append(layer(x[0, start:end], rope, cache, ops.attention.prepare(meta, cache[0])))
    assert_reduction_close(torch.cat(outs), want, _terms(cfg))
