"""InternLM2 and Llama LLMs on the Llama-style decoder, against transformers' LlamaForCausalLM.

InternLM2 has no transformers class (its modeling code is remote code we do not import), but it is a
Llama with other names and a grouped, packed wqkv: a Llama checkpoint rewritten in the InternLM2 layout
must give the Llama's logits.
"""
from __future__ import annotations

import pytest
import torch
from einops import rearrange
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, Qwen2Config

from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.attention.metadata import AttentionMetadata, StepMetadata
from vlm_sdk.errors import CheckpointError
from vlm_sdk.weight_loading import load_checked
from vlm_sdk.models.common.internlm2_weights import (internlm2_decoder_config, internlm2_to_llama_names, pack_wqkv,
                                              unpack_wqkv)
from vlm_sdk.models.common.llama_config import LlamaDecoderConfig
from vlm_sdk.models.common.llama_decoder import LlamaDecoder

# published InternLM2 dicts carry `rope_scaling`, which transformers 5 warns about on every config built
pytestmark = pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")

# the decoder's chain (tests/tolerance.py): 2 layers of DIMS over at most 16 tokens, and the head
TERMS = forward_terms(layers=2, hidden=64, intermediate=96, tokens=16, head_dim=8)


def close(actual, expected):
    assert_reduction_close(actual, expected, TERMS)
BLOCK = 16
DIMS = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
THETA = 5e5  # not a family default: a decoder that ignored the config's theta would not match
PROMPT = [5, 17, 250, 3, 99, 42, 7, 7, 180, 64, 2, 299, 11, 150, 73, 8, 31, 222, 16, 90]  # 20 tokens


def llama_model(attention_bias: bool, seed: int = 0) -> LlamaForCausalLM:
    """A tiny GQA Llama with random values in every parameter (norm weights and biases included)."""
    cfg = LlamaConfig(**DIMS, attention_bias=attention_bias, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": THETA})
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else
                    0.1 * noise if name.endswith(".bias") else 0.15 * noise)
    return model


def to_internlm2(sd: dict[str, torch.Tensor], bias: bool, prefix: str = "") -> dict[str, torch.Tensor]:
    """A Llama state_dict in the InternLM2 checkpoint layout (written independently of the module's map)."""
    h, hkv, d = DIMS["num_attention_heads"], DIMS["num_key_value_heads"], 64 // 8
    out = {f"{prefix}model.tok_embeddings.weight": sd["model.embed_tokens.weight"],
           f"{prefix}model.norm.weight": sd["model.norm.weight"],
           f"{prefix}output.weight": sd["lm_head.weight"]}
    for i in range(DIMS["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"{prefix}model.layers.{i}."
        for kind in ("weight", "bias") if bias else ("weight",):
            q, k, v = (sd[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}attention.wqkv.{kind}"] = pack_wqkv(q, k, v, h, hkv, d)
            out[f"{dst}attention.wo.{kind}"] = sd[f"{src}self_attn.o_proj.{kind}"]
        out[f"{dst}feed_forward.w1.weight"] = sd[f"{src}mlp.gate_proj.weight"]
        out[f"{dst}feed_forward.w3.weight"] = sd[f"{src}mlp.up_proj.weight"]
        out[f"{dst}feed_forward.w2.weight"] = sd[f"{src}mlp.down_proj.weight"]
        out[f"{dst}attention_norm.weight"] = sd[f"{src}input_layernorm.weight"]
        out[f"{dst}ffn_norm.weight"] = sd[f"{src}post_attention_layernorm.weight"]
    return out


def internlm2_config(bias: bool, rope_scaling: dict | None = None, **overrides) -> PretrainedConfig:
    """The llm_config of an InternVL2-8B-style checkpoint: a plain dict, as remote code would read it."""
    d = dict(architectures=["InternLM2ForCausalLM"], model_type="internlm2", bias=bias, rope_theta=THETA,
             rope_scaling=rope_scaling, tie_word_embeddings=False, hidden_act="silu", **DIMS)
    d.update(overrides)
    return PretrainedConfig(**d)


def new_cache(cfg: LlamaDecoderConfig, num_blocks: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]


def run_step(dec: LlamaDecoder, kv, ids: list[int], start: int, blocks: list[int], axes: int) -> torch.Tensor:
    """One sequence's step: tokens `ids` at positions start.. (as `[N]` when axes is 1, else `[3, N]`
    with equal rows); returns their logits `[N, vocab]`."""
    n, seq_len = len(ids), start + len(ids)
    pos = torch.arange(start, seq_len)  # [N]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(blocks)[pos // BLOCK] * BLOCK + pos % BLOCK,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.tensor([blocks], dtype=torch.int32), query_lens_cpu=[n], seq_lens_cpu=[seq_len],
        max_query_len=n, max_seq_len=seq_len)
    meta = StepMetadata.uniform(dec.ops.attention.prepare(meta, kv[0][0]), len(kv))  # once per step, as the runner does
    positions = pos if axes == 1 else pos.expand(3, -1)  # [N] or [3, N]
    with torch.no_grad():
        return dec.compute_logits(dec(dec.embed(torch.tensor(ids)), positions, kv, meta))


def assert_matches_hf(dec: LlamaDecoder, hf: LlamaForCausalLM, steps: int = 3) -> None:
    """Prefill PROMPT then greedy-decode `steps` tokens on the paged cache (non-contiguous blocks);
    every step's logits equal transformers' full recompute of the sequence so far."""
    kv, blocks = new_cache(dec.cfg), [4, 1]
    ids = list(PROMPT)
    logits = run_step(dec, kv, ids, 0, blocks, axes=1)  # [20, vocab]
    with torch.no_grad():
        close(logits, hf(torch.tensor([ids])).logits[0])
    for _ in range(steps):
        ids.append(int(logits[-1].argmax()))
        logits = run_step(dec, kv, ids[-1:], len(ids) - 1, blocks, axes=3)  # [1, vocab]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        close(logits[0], ref)


# ---------------------------------------------------------------------------------------------
# wqkv packing

@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_pack_unpack_round_trip(heads, kv_heads):
    d, hidden = 8, 24
    g = torch.Generator().manual_seed(1)
    for tail in ((hidden,), ()):  # weights [rows, hidden] and biases [rows]
        q = torch.randn(heads * d, *tail, generator=g)
        k, v = (torch.randn(kv_heads * d, *tail, generator=g) for _ in range(2))
        packed = pack_wqkv(q, k, v, heads, kv_heads, d)
        assert packed.shape == ((heads + 2 * kv_heads) * d, *tail)
        for got, want in zip(unpack_wqkv(packed, heads, kv_heads, d), (q, k, v)):
            assert got.is_contiguous() and torch.equal(got, want)
    with pytest.raises(ValueError, match="expected 48 rows"):
        unpack_wqkv(torch.zeros(47, hidden), 8, 2, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        pack_wqkv(torch.zeros(24, 1), torch.zeros(16, 1), torch.zeros(16, 1), 3, 2, 8)


def test_pack_order_is_internlm2_rearrange():
    """InternLM2's attention reads q/k/v out of the packed projection with einops; the packed weight
    must put each Llama head where that code looks for it."""
    heads, kv_heads, d, hidden = 8, 2, 4, 16
    groups = heads // kv_heads
    g = torch.Generator().manual_seed(2)
    wq, wk, wv = (torch.randn(n * d, hidden, generator=g) for n in (heads, kv_heads, kv_heads))
    x = torch.randn(2, 5, hidden, generator=g)  # [b, q, hidden]
    qkv = x @ pack_wqkv(wq, wk, wv, heads, kv_heads, d).T  # [b, q, (H + 2Hkv) D]
    # InternLM2Attention.forward
    qkv = rearrange(qkv, "b q (h gs d) -> b q h gs d", gs=2 + groups, d=d)
    q = rearrange(qkv[..., :groups, :], "b q h gs d -> b q (h gs) d")
    k, v = qkv[..., -2, :], qkv[..., -1, :]
    torch.testing.assert_close(q, (x @ wq.T).view(2, 5, heads, d))
    torch.testing.assert_close(k, (x @ wk.T).view(2, 5, kv_heads, d))
    torch.testing.assert_close(v, (x @ wv.T).view(2, 5, kv_heads, d))


# ---------------------------------------------------------------------------------------------
# InternLM2 checkpoints

@pytest.mark.parametrize("bias,rope_scaling,prefix", [
    (False, None, ""),
    (True, {"type": "dynamic", "factor": 2.0}, "language_model."),
], ids=["no_bias", "bias_dynamic_rope_prefixed"])
def test_internlm2_checkpoint_matches_llama(bias, rope_scaling, prefix):
    hf = llama_model(attention_bias=bias)
    cfg = internlm2_decoder_config(internlm2_config(bias, rope_scaling))
    assert (cfg.attention_bias, cfg.o_proj_bias, cfg.rope_theta, cfg.tie_word_embeddings) == (bias, bias, THETA, False)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mrope_section) == (8, 2, 8, None)
    dec = LlamaDecoder(cfg)
    ckpt = to_internlm2(hf.state_dict(), bias, prefix)
    load_checked(dec, internlm2_to_llama_names(ckpt.items(), cfg, prefix=prefix),
                 dec.checkpoint_map("model.", "lm_head.weight"))
    assert_matches_hf(dec, hf)


def test_names_and_pass_through():
    hf = llama_model(attention_bias=True)
    cfg = internlm2_decoder_config(internlm2_config(True))
    ckpt = to_internlm2(hf.state_dict(), True, prefix="language_model.")
    others = {"vision_model.embeddings.patch_embedding.weight": torch.zeros(1),
              "mlp1.0.weight": torch.zeros(1),
              "language_model.model.layers.0.attention.rotary_emb.inv_freq": torch.zeros(1)}
    out = dict(internlm2_to_llama_names({**ckpt, **others}.items(), cfg, "language_model.", "llm."))
    sd = hf.state_dict()
    assert set(out) == {f"llm.{k}" for k in sd} | set(others)
    for k, v in sd.items():
        assert torch.equal(out[f"llm.{k}"], v), k


@pytest.mark.parametrize("kind,shape", [("weight", [40, 64]), ("weight", [48, 32]), ("bias", [40])])
def test_bad_wqkv_shape(kind, shape):
    cfg = internlm2_decoder_config(internlm2_config(True))
    name = f"model.layers.1.attention.wqkv.{kind}"
    expected = r"\[96, 64\]" if kind == "weight" else r"\[96\]"
    with pytest.raises(CheckpointError, match=rf"{name}.*\[{', '.join(map(str, shape))}\].*{expected}"):
        list(internlm2_to_llama_names([(name, torch.zeros(shape))], cfg))


def test_internlm2_config_fields():
    cfg = internlm2_decoder_config(internlm2_config(False, {"type": "dynamic", "factor": 2.0}))
    assert cfg.rope_theta == THETA and not cfg.attention_bias and not cfg.o_proj_bias
    assert internlm2_decoder_config(internlm2_config(False), tie_word_embeddings=True).tie_word_embeddings
    # no model_type / architectures / bias / rope_theta / tie_word_embeddings: InternLM2's own defaults
    bare = PretrainedConfig(**DIMS)
    cfg = internlm2_decoder_config(bare)
    assert (cfg.attention_bias, cfg.o_proj_bias, cfg.rope_theta, cfg.tie_word_embeddings) == (True, True, 1e4, False)
    with pytest.raises(CheckpointError, match="linear"):
        internlm2_decoder_config(internlm2_config(False, {"type": "linear", "factor": 2.0}))
    with pytest.raises(CheckpointError, match="llama config"):
        internlm2_decoder_config(LlamaConfig(**DIMS))


# ---------------------------------------------------------------------------------------------
# Llama text configs

def test_llama_checkpoint_matches_hf():
    hf = llama_model(attention_bias=True, seed=3)
    cfg = LlamaDecoderConfig.from_hf(hf.config, tie_word_embeddings=False, mrope=False)
    assert (cfg.attention_bias, cfg.o_proj_bias, cfg.rope_theta) == (True, True, THETA)
    dec = LlamaDecoder(cfg)
    load_checked(dec, hf.state_dict().items(), dec.checkpoint_map("model.", "lm_head.weight"))
    assert_matches_hf(dec, hf)


def test_bias_flags_per_family():
    llama = LlamaDecoderConfig.from_hf(LlamaConfig(**DIMS), tie_word_embeddings=False, mrope=False)
    assert (llama.attention_bias, llama.o_proj_bias, llama.rope_theta) == (False, False, 1e4)
    qwen = LlamaDecoderConfig.from_hf(Qwen2Config(**DIMS), tie_word_embeddings=True, mrope=False)
    assert (qwen.attention_bias, qwen.o_proj_bias) == (True, False)
    # InternVL's llm_config for a Qwen2 LLM: a generic config from the published dict
    generic = PretrainedConfig(model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1e6, **DIMS)
    qwen = LlamaDecoderConfig.from_hf(generic, tie_word_embeddings=False, mrope=False)
    assert (qwen.attention_bias, qwen.o_proj_bias, qwen.rope_theta) == (True, False, 1e6)
    assert LlamaDecoder(qwen).layers[0].o_proj.bias is None


def test_rope_types_and_unsupported_configs():
    dynamic = LlamaConfig(**DIMS, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 123.0})
    assert LlamaDecoderConfig.from_hf(dynamic, tie_word_embeddings=False, mrope=False).rope_theta == 123.0
    refused = [
        (LlamaConfig(**DIMS, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "linear"),
        (LlamaConfig(**DIMS, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}), "llama3"),
        (LlamaConfig(**DIMS, mlp_bias=True), "mlp_bias"),
        (LlamaConfig(**DIMS, hidden_act="gelu"), "hidden_act 'gelu'"),
        (PretrainedConfig(model_type="phi3", architectures=["Phi3ForCausalLM"], **DIMS), "'phi3'"),
        (PretrainedConfig(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], **DIMS), "'qwen2_moe'"),
    ]
    for config, message in refused:
        with pytest.raises(CheckpointError, match=message):
            LlamaDecoderConfig.from_hf(config, tie_word_embeddings=False, mrope=False)


class _Lazy:
    """A lazy checkpoint tensor over `t` that records the rows each read covers."""

    def __init__(self, t: torch.Tensor):
        self.t, self.shape, self.dtype, self.reads = t, t.shape, t.dtype, []

    def narrow(self, dim, start, length):
        self.reads.append((dim, start, length))
        return self.t.narrow(dim, start, length).clone()

    def materialize(self):
        self.reads.append("whole")
        return self.t.clone()


@pytest.mark.parametrize("kv_heads,tp", [(2, 2), (4, 2), (1, 2), (2, 4)])
def test_lazy_wqkv_parts_read_only_the_ranks_kv_groups(kv_heads, tp):
    """Each rank's slices of the lazy q / k / v (as its `QKVParallelLinear` slots take them, KV heads
    split or replicated) equal the eager unpack's, and come from one read of just its KV groups."""
    from vlm_sdk.layers.linear import QKVParallelLinear
    from vlm_sdk.layers.parallel_state import TPGroup

    heads, d = 8, 3
    hidden = heads * d
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * d, hidden, generator=g) for n in (heads, kv_heads, kv_heads))
    cfg = LlamaDecoderConfig.from_hf(LlamaConfig(**{**DIMS, "num_attention_heads": heads, "hidden_size": hidden,
                                                    "num_key_value_heads": kv_heads}),
                                     tie_word_embeddings=False, mrope=False)
    wqkv = pack_wqkv(q, k, v, heads, kv_heads, d)
    rows_per_group = (heads // kv_heads + 2) * d
    for rank in range(tp):
        lazy = _Lazy(wqkv)
        parts = dict(internlm2_to_llama_names([("model.layers.0.attention.wqkv.weight", lazy)], cfg))
        slots = QKVParallelLinear(hidden, d, heads, kv_heads, False, tp=TPGroup(rank, tp)).slots(
            "", [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"])
        for (name, part), whole in zip(parts.items(), (q, k, v)):
            shard = slots[name].shard
            assert part.shape == whole.shape
            assert torch.equal(part.narrow(0, shard.start, shard.length), whole.narrow(0, shard.start, shard.length))
        first = rank * (heads // tp) // (heads // kv_heads)  # the KV group of its first query head
        groups = max(1, kv_heads // tp)
        assert lazy.reads == [(0, first * rows_per_group, groups * rows_per_group)]
    assert torch.equal(_Lazy(wqkv).materialize(), wqkv)
    eager = unpack_wqkv(wqkv, heads, kv_heads, d)
    lazy_parts = [p for _, p in internlm2_to_llama_names([("model.layers.0.attention.wqkv.weight", _Lazy(wqkv))], cfg)]
    assert all(torch.equal(p.materialize(), e) for p, e in zip(lazy_parts, eager))
