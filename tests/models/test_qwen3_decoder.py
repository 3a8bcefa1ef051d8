"""The Llama-style decoder with Qwen3-VL's options (q/k norm, interleaved M-RoPE, DeepStack) against
transformers' Qwen3VLTextModel (random weights in every parameter, float32) on both kernel sets: whole
prefill, a prefill chunked through the image rows, and decode steps on a paged cache with
non-contiguous blocks. Then its config from both config.json layouts, and two tensor-parallel ranks
against one (q/k norm per head needs no collective)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import Qwen3Config, Qwen3VLConfig, Qwen3VLTextConfig, Qwen3VLTextModel

from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.attention.metadata import AttentionMetadata, StepMetadata
from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.moe import MoeConfig
from vlm_sdk.layers.ops import make_ops
from vlm_sdk.layers.parallel_state import ParallelGroups, TPGroup
from vlm_sdk.model_loader import read_config, text_config
from vlm_sdk.models.common.llama_config import LlamaDecoderConfig
from vlm_sdk.models.common.llama_decoder import LlamaDecoder
from vlm_sdk.testing.distributed import run_on_ranks
from vlm_sdk.weight_loading import load_checked

BLOCK = 16
DIMS = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256)
# head_dim 16: 8 frequencies, interleaved t h w t h w t h; theta not a default of any family
ROPE = {"rope_type": "default", "rope_theta": 5e4, "mrope_section": [3, 3, 2], "mrope_interleaved": True}
LEVELS = 2  # DeepStack features after layers 0 and 1 of 3
TEXT_BEFORE, GRID, TEXT_AFTER = 5, (4, 4), 4  # 5 text tokens, a 4 x 4 image, 4 text tokens: 25 > one block
# the decoder's chain (tests/tolerance.py): 3 layers of DIMS over at most 32 tokens; no tower, no head
TERMS = forward_terms(layers=3, hidden=64, intermediate=96, tokens=32, head_dim=16) - 64


def close(actual, expected):
    assert_reduction_close(actual, expected, TERMS)


def hf_model(seed: int = 0) -> Qwen3VLTextModel:
    model = Qwen3VLTextModel(Qwen3VLTextConfig(**DIMS, rope_parameters=dict(ROPE))).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model


def prompt() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [L], M-RoPE positions [3, L] as transformers' get_rope_index lays out one image, image rows [n])."""
    h, w = GRID
    text = torch.arange(TEXT_BEFORE)
    hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    image = torch.stack((torch.zeros(h * w, dtype=torch.long), hh.flatten(), ww.flatten())) + TEXT_BEFORE  # [3, n]
    after = torch.arange(TEXT_AFTER) + int(image.max()) + 1
    positions = torch.cat((text.expand(3, -1), image, after.expand(3, -1)), dim=1)  # [3, L]
    ids = torch.randint(0, DIMS["vocab_size"], (positions.shape[1],), generator=torch.Generator().manual_seed(4))
    return ids, positions, torch.arange(TEXT_BEFORE, TEXT_BEFORE + h * w)


def features(n: int) -> list[torch.Tensor]:  # LEVELS x [n, hidden]
    g = torch.Generator().manual_seed(9)
    return [torch.randn(n, DIMS["hidden_size"], generator=g) for _ in range(LEVELS)]


def build(hf: Qwen3VLTextModel, backend: str = "torch", tp: TPGroup = TPGroup(), **overrides) -> LlamaDecoder:
    cfg = replace(LlamaDecoderConfig.from_hf(hf.config, tie_word_embeddings=True, mrope=True), **overrides)
    dec = LlamaDecoder(cfg, ops=make_ops(backend, torch.device("cpu")), parallel=ParallelGroups(tp))
    load_checked(dec, hf.state_dict().items(), dec.checkpoint_map(prefix=""))  # strict: q_norm / k_norm named
    return dec


def run(dec: LlamaDecoder, kv, ids, positions, start: int, blocks: list[int], deepstack=None) -> torch.Tensor:
    """One step of one sequence: tokens at [start, start + N) -> their hidden states [N, hidden]."""
    n, seq_len = len(ids), start + len(ids)
    idx = torch.arange(start, seq_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(blocks)[idx // BLOCK] * BLOCK + idx % BLOCK,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.tensor([blocks], dtype=torch.int32), query_lens_cpu=[n], seq_lens_cpu=[seq_len],
        max_query_len=n, max_seq_len=seq_len)
    meta = StepMetadata.uniform(dec.ops.attention.prepare(meta, kv[0][0]), len(kv))
    with torch.no_grad():
        return dec(dec.embed(ids), positions, kv, meta, deepstack=deepstack)


def new_cache(dec: LlamaDecoder, num_blocks: int = 5):
    shape = (num_blocks, BLOCK, dec.layers[0].num_kv_heads, dec.cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in dec.layers]


@torch.no_grad()
def hf_hidden(hf, ids, positions, rows=None, feats=None) -> torch.Tensor:  # [L, hidden]
    mask = None
    if rows is not None:
        mask = torch.zeros(1, len(ids), dtype=torch.bool)
        mask[0, rows] = True
    return hf(input_ids=ids[None], position_ids=positions[:, None], visual_pos_masks=mask,
              deepstack_visual_embeds=feats).last_hidden_state[0]


@pytest.fixture(scope="module")
def hf():
    return hf_model()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("deepstack", [False, True], ids=["plain", "deepstack"])
@pytest.mark.parametrize("chunk", [None, 12], ids=["whole", "chunked"])
def test_matches_transformers(hf, backend, deepstack, chunk):
    """Prefill (whole, or split at token 12: inside the image, so each chunk carries its own image rows
    and the matching slice of every DeepStack level), then two decode steps."""
    ids, positions, rows = prompt()
    feats = features(len(rows)) if deepstack else None
    dec = build(hf, backend)
    kv, blocks = new_cache(dec), [3, 1, 4]
    ref = hf_hidden(hf, ids, positions, rows if deepstack else None, feats)
    bounds = [0, len(ids)] if chunk is None else [0, chunk, len(ids)]
    outs = []
    for start, end in zip(bounds, bounds[1:]):
        step = None
        if deepstack:
            inside = (rows >= start) & (rows < end)  # this chunk's image rows, relative to the chunk
            step = (rows[inside] - start, [f[inside] for f in feats])
        outs.append(run(dec, kv, ids[start:end], positions[:, start:end], start, blocks, step))
    close(torch.cat(outs), ref)
    for token in (7, 299):  # decode: index + rope delta on all three axes, no image rows
        next_pos = positions[0, -1] + 1
        ids, positions = torch.cat((ids, torch.tensor([token]))), torch.cat((positions, next_pos.expand(3, 1)), dim=1)
        out = run(dec, kv, ids[-1:], positions[:, -1:], len(ids) - 1, blocks)
        ref = hf_hidden(hf, ids, positions, rows if deepstack else None, feats)
        close(out[0], ref[-1])


@pytest.mark.parametrize("change", ["contiguous", "no_qk_norm"])
def test_each_option_matters(hf, change):
    """The parity above is not luck: the decoder without either option differs from transformers."""
    ids, positions, _ = prompt()
    if change == "contiguous":
        dec = build(hf, mrope_interleaved=False)
    else:  # the checkpoint's q_norm / k_norm have no slot then: load the rest
        dec = LlamaDecoder(replace(build(hf).cfg, qk_norm=False))
        sd = {k: v for k, v in hf.state_dict().items() if "q_norm" not in k and "k_norm" not in k}
        load_checked(dec, sd.items(), dec.checkpoint_map(prefix=""))
    out = run(dec, new_cache(dec), ids, positions, 0, [0, 1])
    assert (out - hf_hidden(hf, ids, positions)).abs().max() > 1e-2


def test_deepstack_levels_beyond_the_layers_are_refused(hf):
    ids, positions, rows = prompt()
    dec = build(hf)
    too_many = [torch.zeros(len(rows), DIMS["hidden_size"])] * (DIMS["num_hidden_layers"] + 1)
    with pytest.raises(ValueError, match="4 DeepStack levels for 3 decoder layers"):
        run(dec, new_cache(dec), ids, positions, 0, [0, 1], (rows, too_many))


def rank_hidden(tp: TPGroup, state_dict: dict, cfg: LlamaDecoderConfig) -> dict:
    """On one of two ranks: the whole prompt's hidden states with DeepStack (run_on_ranks' target)."""
    ids, positions, rows = prompt()
    dec = LlamaDecoder(cfg, parallel=ParallelGroups(tp))
    load_checked(dec, state_dict.items(), dec.checkpoint_map(prefix=""))
    out = run(dec, new_cache(dec), ids, positions, 0, [0, 1], (rows, features(len(rows))))
    return {"hidden": out, "q_norm": dec.layers[0].q_norm.weight.clone(), "heads": dec.layers[0].num_heads}


def test_two_ranks_equal_one(hf):
    ids, positions, rows = prompt()
    dec = build(hf)
    expected = run(dec, new_cache(dec), ids, positions, 0, [0, 1], (rows, features(len(rows))))
    results = run_on_ranks(rank_hidden, 2, hf.state_dict(), dec.cfg, timeout_s=300)
    for r in results:
        assert r["heads"] == DIMS["num_attention_heads"] // 2  # sharded heads, whole per-head norm weights
        assert torch.equal(r["q_norm"], hf.state_dict()["layers.0.self_attn.q_norm.weight"])
        close(r["hidden"], expected)


# ---------------------------------------------------------------------------------------------
# config.json layouts

# Qwen3-VL-8B-Instruct's published text config: `rope_scaling` + `rope_theta`, not `rope_parameters`
PUBLISHED_TEXT = dict(attention_bias=False, head_dim=128, hidden_act="silu", hidden_size=4096,
                      intermediate_size=12288, max_position_embeddings=262144, model_type="qwen3_vl_text",
                      num_attention_heads=32, num_hidden_layers=36, num_key_value_heads=8, rms_norm_eps=1e-6,
                      rope_scaling={"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                      rope_theta=5000000, tie_word_embeddings=False, vocab_size=151936)
EXPECTED_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=5e6, mrope_section=(24, 20, 20),
                   mrope_interleaved=True, qk_norm=True, attention_bias=False, o_proj_bias=False)


def fields(cfg: LlamaDecoderConfig) -> dict:
    return {k: getattr(cfg, k) for k in EXPECTED_8B}


def test_published_flat_config_file(tmp_path):
    raw = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
           "tie_word_embeddings": False, "text_config": PUBLISHED_TEXT,
           "vision_config": {"model_type": "qwen3_vl", "out_hidden_size": 4096, "deepstack_visual_indexes": [8, 16, 24]}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    text = text_config(read_config(tmp_path).hf_config)
    assert fields(LlamaDecoderConfig.from_hf(text, tie_word_embeddings=False, mrope=True)) == EXPECTED_8B


def test_nested_and_generic_layouts_agree():
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    nested = {k: v for k, v in PUBLISHED_TEXT.items() if k not in ("rope_scaling", "rope_theta")}
    v5 = Qwen3VLConfig(text_config={**nested, "rope_parameters": rope}).text_config  # transformers 5's own
    plain = type("GenericTextConfig", (), dict(PUBLISHED_TEXT))()  # a config nothing converted
    for config in (v5, plain):
        assert fields(LlamaDecoderConfig.from_hf(config, tie_word_embeddings=False, mrope=True)) == EXPECTED_8B


def test_qwen3_defaults_and_refusals():
    def parse(rope: dict, mrope: bool = True, **dims):
        return LlamaDecoderConfig.from_hf(Qwen3VLTextConfig(**{**DIMS, **dims}, rope_parameters=rope),
                                          tie_word_embeddings=True, mrope=mrope)
    # transformers' Qwen3-VL interleaves whatever the config says: a config silent on it is interleaved,
    # and without a section transformers uses (24, 20, 20)
    silent = parse({"rope_type": "default", "rope_theta": 1e6}, head_dim=128)
    assert (silent.mrope_section, silent.mrope_interleaved) == ((24, 20, 20), True)
    assert not parse({**ROPE, "mrope_interleaved": False}).mrope_interleaved
    # h would need frequency 3*4 - 2 = 10 of 8: transformers' slices would silently come up short
    with pytest.raises(CheckpointError, match=r"interleaved mrope_section \(2, 4, 2\)"):
        parse({**ROPE, "mrope_section": [2, 4, 2]})
    with pytest.raises(CheckpointError, match="sums to 9"):
        parse({**ROPE, "mrope_section": [3, 3, 3]})
    biased = parse(ROPE, attention_bias=True)
    assert (biased.attention_bias, biased.o_proj_bias, biased.qk_norm) == (True, True, True)
    # the plain Qwen3 LLM: q/k norm, 1-D RoPE
    qwen3 = LlamaDecoderConfig.from_hf(Qwen3Config(**DIMS), tie_word_embeddings=True, mrope=False)
    assert (qwen3.qk_norm, qwen3.mrope_section, qwen3.mrope_interleaved, qwen3.attention_bias) == \
        (True, None, False, False)
    # Qwen2-MoE's MLP (shared experts) is refused; Qwen3-MoE's experts are read (`moe`)
    qwen2_moe = type("MoeTextConfig", (), {**DIMS, "model_type": "qwen2_moe"})()
    with pytest.raises(CheckpointError, match="qwen2_moe"):
        LlamaDecoderConfig.from_hf(qwen2_moe, tie_word_embeddings=True, mrope=False)
    experts = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1]}
    qwen3_moe = type("MoeTextConfig", (), {**DIMS, **experts, "model_type": "qwen3_vl_moe_text"})()
    assert LlamaDecoderConfig.from_hf(qwen3_moe, tie_word_embeddings=True, mrope=False).moe == \
        MoeConfig(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True, mlp_only_layers=(1,))
    with pytest.raises(CheckpointError, match="num_experts=8 but no moe_intermediate_size"):
        LlamaDecoderConfig.from_hf(type("C", (), {**DIMS, **experts, "moe_intermediate_size": None,
                                                  "model_type": "qwen3_moe"})(), tie_word_embeddings=True, mrope=False)
    with pytest.raises(CheckpointError, match=r"decoder_sparse_step \(0\) must be positive"):
        LlamaDecoderConfig.from_hf(type("C", (), {**DIMS, **experts, "decoder_sparse_step": 0,
                                                  "model_type": "qwen3_moe"})(), tie_word_embeddings=True, mrope=False)
