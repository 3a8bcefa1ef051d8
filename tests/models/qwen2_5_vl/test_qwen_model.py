"""Qwen2_5_VLForCausalLM on the paged KV cache against transformers' Qwen2_5_VLForConditionalGeneration."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.attention.metadata import AttentionMetadata, StepMetadata
from vlm_sdk.errors import CheckpointError
from vlm_sdk.model_loader import iter_safetensors, read_checkpoint
from vlm_sdk.models.qwen2_5_vl.model import Qwen2_5_VLForCausalLM
from vlm_sdk.models.common.qwen_vl.image_processor import QwenImage
from vlm_sdk.models.common.qwen_vl.rope_index import mrope_positions
from vlm_sdk.models.registry import resolve
from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.testing import make_tiny_checkpoint

BLOCK = 16
NUM_BLOCKS = 12
# the tiny Qwen2.5-VL's chain (tests/tolerance.py): 1,176-input patches, 2 blocks of width 32 over at most
# 128 patches, a merger of inputs 128 + 128, 2 layers of width 64 (MLP 128) over at most 80 tokens, the head
TERMS = forward_terms(layers=2, hidden=64, intermediate=128, tokens=80, head_dim=16, patch=1176, vision_layers=2,
                      vision_hidden=32, vision_intermediate=64, vision_tokens=128, merger=256)
GRID_A, GRID_B = (1, 8, 12), (1, 16, 8)  # 24 and 32 image tokens; 4x6 and 8x4 merged -> several windows


def close(actual, expected):
    assert_reduction_close(actual, expected, TERMS)


def load_pair(ckpt):
    """transformers' model (the oracle) and ours on the same checkpoint directory."""
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    weights = dict(iter_safetensors(ckpt, show_progress=False))
    ours = Qwen2_5_VLForCausalLM(read_checkpoint(ckpt).hf_config)
    ours.load_weights(weights.items())
    return hf, ours, weights


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    return load_pair(tiny_ckpt)


class Prompts:
    """Token ids of the test prompts, with the checkpoint's special tokens."""

    def __init__(self, cfg):
        self.img, self.vs, self.ve = cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id

    def image(self, grid) -> list[int]:
        t, h, w = grid
        return [self.vs] + [self.img] * (t * h * w // 4) + [self.ve]

    def get(self, name: str) -> tuple[list[int], list[tuple[int, int, int]]]:
        if name == "text":
            return [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], []
        if name == "one_image":
            return [7, 8] + self.image(GRID_A) + [10, 11, 12, 13], [GRID_A]
        if name == "two_images":
            return [7] + self.image(GRID_A) + [20, 21] + self.image(GRID_B) + [30, 31, 32], [GRID_A, GRID_B]
        raise KeyError(name)


def pixels(grids, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14, generator=g)


def images(pixel_values: torch.Tensor, grids) -> list[ImageInput]:
    """`pixel_values` of `grids`, back to back, as the model's image inputs (merge 2)."""
    parts = pixel_values.split([t * h * w for t, h, w in grids])
    return [ImageInput(p, t * h * w // 4, QwenImage(g)) for p, g in zip(parts, grids) for t, h, w in [g]]


class Seq:
    """One prompt prepared for our model: embeddings, M-RoPE positions, the HF reference inputs."""

    def __init__(self, model, ids: list[int], grids, seed: int = 0):
        self.ids, self.grids, self.img = ids, grids, model.image_token_id
        self.pixel_values = pixels(grids, seed) if grids else None
        self.positions, self.delta = mrope_positions(ids, grids, model.image_token_id, model.spatial_merge_size)
        with torch.no_grad():
            embeds = model.embed_tokens(torch.tensor(ids))
            if grids:
                embeds[torch.tensor(ids) == model.image_token_id] = model.encode_images(images(self.pixel_values, grids))
        self.embeds = embeds

    def hf_kwargs(self) -> dict:
        input_ids = torch.tensor([self.ids])
        kw = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        if self.grids:
            kw.update(pixel_values=self.pixel_values, image_grid_thw=torch.tensor(self.grids),
                      mm_token_type_ids=(input_ids == self.img).int())
        return kw


def new_cache(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (NUM_BLOCKS, BLOCK, model.num_kv_heads, model.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]


def run_step(model, kv, items):
    """items: (embeds [q, hidden], positions [3, q], block ids, seq_len after this step) per sequence.
    Returns the logits of every new token, split per sequence."""
    slots, tables = [], []
    q_lens = [e.shape[0] for e, _, _, _ in items]
    seq_lens = [s for _, _, _, s in items]
    width = max(len(b) for _, _, b, _ in items)
    for (_, _, blocks, seq_len), q in zip(items, q_lens):
        p = torch.arange(seq_len - q, seq_len)
        slots.append(torch.tensor(blocks)[p // BLOCK] * BLOCK + p % BLOCK)
        tables.append(blocks + [0] * (width - len(blocks)))
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    meta = StepMetadata.uniform(model.decoder.ops.attention.prepare(meta, kv[0][0]), len(kv))  # once per step, as the runner does
    with torch.no_grad():
        hidden = model(torch.cat([e for e, _, _, _ in items]), torch.cat([p for _, p, _, _ in items], dim=1), kv, meta)
        logits = model.compute_logits(hidden)
    return list(logits.split(q_lens))


def decode_item(model, seq: Seq, token: int, index: int, blocks):
    """The 1-token step for the token at sequence index `index`: position index + rope_delta on all axes."""
    with torch.no_grad():
        e = model.embed_tokens(torch.tensor([token]))
    return e, torch.full((3, 1), index + seq.delta, dtype=torch.int64), blocks, index + 1


def hf_generate(hf, seq: Seq, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF greedy tokens and the logits of each generated step (step 0 = last prompt position)."""
    with torch.no_grad():
        out = hf.generate(**seq.hf_kwargs(), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(seq.ids):].tolist()
    return tokens, [step_logits[0] for step_logits in out.logits]


@pytest.mark.parametrize("name", ["text", "one_image", "two_images"])
def test_prefill_matches_hf(models, name):
    hf, ours, _ = models
    seq = Seq(ours, *Prompts(hf.config).get(name))
    n = len(seq.ids)
    (logits,) = run_step(ours, new_cache(ours), [(seq.embeds, seq.positions, list(range(-(-n // BLOCK))), n)])
    with torch.no_grad():
        ref = hf(**seq.hf_kwargs()).logits[0]
    assert logits.dtype == torch.float32 and logits.shape == (n, ours.vocab_size)
    close(logits, ref)


def test_chunked_prefill_equals_one_prefill(models):
    hf, ours, _ = models
    seq = Seq(ours, *Prompts(hf.config).get("two_images"))
    n = len(seq.ids)
    blocks = [5, 2, 7, 0, 9]
    (full,) = run_step(ours, new_cache(ours), [(seq.embeds, seq.positions, blocks, n)])
    kv = new_cache(ours)
    run_step(ours, kv, [(seq.embeds[:10], seq.positions[:, :10], blocks, 10)])
    (rest,) = run_step(ours, kv, [(seq.embeds[10:], seq.positions[:, 10:], blocks, n)])
    close(rest, full[10:])


@pytest.mark.parametrize("name", ["text", "two_images"])
def test_decode_matches_hf_generate(models, name):
    hf, ours, _ = models
    seq = Seq(ours, *Prompts(hf.config).get(name))
    n = len(seq.ids)
    tokens, ref_logits = hf_generate(hf, seq, steps=3)
    blocks = list(range(-(-(n + 3) // BLOCK)))
    kv = new_cache(ours)
    (logits,) = run_step(ours, kv, [(seq.embeds, seq.positions, blocks, n)])
    close(logits[-1], ref_logits[0])
    for step in (1, 2):
        (logits,) = run_step(ours, kv, [decode_item(ours, seq, tokens[step - 1], n + step - 1, blocks)])
        assert int(logits[0].argmax()) == tokens[step]
        close(logits[0], ref_logits[step])


def test_batched_prefill_then_batched_decode(models):
    hf, ours, _ = models
    p = Prompts(hf.config)
    a = Seq(ours, [7] + p.image(GRID_A) + [10, 11, 12], [GRID_A], seed=1)  # 30 tokens: 2 blocks
    b = Seq(ours, [9, 9] + p.image(GRID_B) + [20, 21, 22, 23, 24], [GRID_B], seed=2)  # 41 tokens: 3 blocks
    blocks_a, blocks_b = [3, 0], [1, 4, 2]
    na, nb = len(a.ids), len(b.ids)
    tok_a, ref_a = hf_generate(hf, a, steps=2)
    tok_b, ref_b = hf_generate(hf, b, steps=2)
    kv = new_cache(ours)
    la, lb = run_step(ours, kv, [(a.embeds, a.positions, blocks_a, na), (b.embeds, b.positions, blocks_b, nb)])
    (alone_a,) = run_step(ours, new_cache(ours), [(a.embeds, a.positions, [0, 1], na)])
    close(la, alone_a)
    with torch.no_grad():
        close(la, hf(**a.hf_kwargs()).logits[0])
        close(lb, hf(**b.hf_kwargs()).logits[0])
    # one decode step for both: the batched decode path of paged_attention
    da, db = run_step(ours, kv, [decode_item(ours, a, tok_a[0], na, blocks_a),
                                 decode_item(ours, b, tok_b[0], nb, blocks_b)])
    close(da[0], ref_a[1])
    close(db[0], ref_b[1])


def test_encode_images_matches_hf_visual(models):
    hf, ours, _ = models
    grids = [GRID_A, GRID_B, (1, 4, 4)]  # windows of 16 and 8 units (A), 2 x 16 (B), one small window
    pv = pixels(grids, seed=3)
    with torch.no_grad():
        ref = hf.model.visual(pv, grid_thw=torch.tensor(grids)).pooler_output
        got = ours.encode_images(images(pv, grids))
    assert got.shape == (24 + 32 + 4, ours.hidden_size)
    close(got, ref)
    # an image alone gives its own rows of the packed output
    with torch.no_grad():
        alone = ours.encode_images(images(pv[96:96 + 128], [GRID_B]))
    close(alone, got[24:56])


def test_encode_images_rejects_bad_input(models):
    _, ours, _ = models
    with pytest.raises(ValueError, match="pixel_values"):
        ours.encode_images([ImageInput(pixels([GRID_A], 0)[:-1], 24, QwenImage(GRID_A))])
    with pytest.raises(ValueError, match="multiples of 2"):
        ours.encode_images([ImageInput(pixels([(1, 3, 4)], 0), 3, QwenImage((1, 3, 4)))])


def test_load_weights_errors(models):
    hf, _, weights = models
    cfg = hf.config.text_config
    fresh = lambda: Qwen2_5_VLForCausalLM(hf.config)  # noqa: E731
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        fresh().load_weights(missing.items())
    extra = dict(weights, **{"model.layers.7.mlp.gate_proj.weight": torch.zeros(cfg.intermediate_size,
                                                                                cfg.hidden_size)})
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.7\.mlp\.gate_proj\.weight"):
        fresh().load_weights(extra.items())
    bad = dict(weights, **{"visual.blocks.0.attn.qkv.weight": torch.zeros(96, 16)})
    with pytest.raises(CheckpointError, match=r"visual\.blocks\.0\.attn\.qkv\.weight.*\[96, 16\].*\[96, 32\]"):
        fresh().load_weights(bad.items())


def test_flat_sharded_checkpoint_loads_the_same(models, tiny_ckpt_flat):
    """Published config layout (rope_scaling mrope), several safetensors shards, same seed -> same weights."""
    _, ours, _ = models
    other = Qwen2_5_VLForCausalLM(read_checkpoint(tiny_ckpt_flat).hf_config)
    other.load_weights(iter_safetensors(tiny_ckpt_flat, show_progress=False))
    assert other.decoder_config == ours.decoder_config
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), other.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_load_accepts_language_model_prefix(models):
    hf, ours, weights = models
    renamed = {("model.language_model." + k[6:] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v for k, v in weights.items()}
    other = Qwen2_5_VLForCausalLM(hf.config)
    other.load_weights(renamed.items())
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), other.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_tied_lm_head(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)
    hf, _, weights = load_pair(ckpt)
    seq_ids = Prompts(hf.config).get("one_image")
    embed = weights["model.embed_tokens.weight"]
    stripped = {k: v for k, v in weights.items() if k != "lm_head.weight"}

    def logits_of(model):
        seq = Seq(model, *seq_ids)
        n = len(seq.ids)
        (logits,) = run_step(model, new_cache(model), [(seq.embeds, seq.positions, [0, 1, 2], n)])
        return seq, logits

    # no lm_head.weight in the checkpoint, or an exact copy of the embedding: the head is the embedding
    for ckpt_weights in (stripped, dict(stripped, **{"lm_head.weight": embed.clone()})):
        ours = Qwen2_5_VLForCausalLM(hf.config)
        ours.load_weights(ckpt_weights.items())
        assert ours.decoder.lm_head is None
        seq, logits = logits_of(ours)
        with torch.no_grad():
            hf.lm_head.weight.copy_(embed)
            ref = hf(**seq.hf_kwargs()).logits[0]
        close(logits, ref)
    # a tied config whose checkpoint carries a different lm_head: transformers uses it, so do we
    if not torch.equal(weights.get("lm_head.weight", embed), embed):
        hf2, ours, _ = load_pair(ckpt)
        assert ours.decoder.lm_head is not None
        seq, logits = logits_of(ours)
        with torch.no_grad():
            close(logits, hf2(**seq.hf_kwargs()).logits[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tied_lm_head_is_compared_on_the_models_device_on_cuda(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tied_cuda"), tie_word_embeddings=True)
    cfg = read_checkpoint(ckpt).hf_config
    weights = {k: v for k, v in iter_safetensors(ckpt, show_progress=False) if k != "lm_head.weight"}
    embed = weights["model.embed_tokens.weight"]
    dev = torch.device("cuda")
    for head, untied in ((embed.clone(), False), (embed + 1, True)):
        with torch.device(dev):
            model = Qwen2_5_VLForCausalLM(cfg, dtype=torch.float32, device=dev)
        model.load_weights(dict(weights, **{"lm_head.weight": head}).items())
        assert (model.decoder.lm_head is not None) == untied
        if untied:
            assert model.decoder.lm_head.weight.device.type == "cuda"
            torch.testing.assert_close(model.decoder.lm_head.weight.cpu(), head)


def test_model_attributes(models):
    hf, ours, _ = models
    text = hf.config.text_config
    assert (ours.num_layers, ours.num_kv_heads, ours.head_dim, ours.hidden_size, ours.vocab_size) == (
        text.num_hidden_layers, text.num_key_value_heads, text.hidden_size // text.num_attention_heads,
        text.hidden_size, text.vocab_size)
    assert ours.image_token_id == hf.config.image_token_id and ours.spatial_merge_size == 2
    assert not any(p.requires_grad for p in ours.parameters())


def test_registry():
    fam = resolve(["Qwen2_5_VLForConditionalGeneration"])
    assert fam.name == "qwen2_5_vl" and fam.model_cls is Qwen2_5_VLForCausalLM
    with pytest.raises(CheckpointError, match="LlavaForConditionalGeneration.*Qwen2_5_VLForConditionalGeneration"):
        resolve(["LlavaForConditionalGeneration"])


def test_bfloat16_runs_close_to_float32(models, tiny_ckpt):
    hf, ours, weights = models
    low = Qwen2_5_VLForCausalLM(hf.config, dtype=torch.bfloat16)
    low.load_weights(weights.items())
    ids, grids = Prompts(hf.config).get("two_images")
    seq32, seq16 = Seq(ours, ids, grids), Seq(low, ids, grids)
    assert seq16.embeds.dtype == torch.bfloat16
    n = len(ids)
    blocks = list(range(-(-n // BLOCK)))
    (ref,) = run_step(ours, new_cache(ours), [(seq32.embeds, seq32.positions, blocks, n)])
    kv16 = [(k.bfloat16(), v.bfloat16()) for k, v in new_cache(low)]
    (got,) = run_step(low, kv16, [(seq16.embeds, seq16.positions, blocks, n)])
    assert got.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min() > 0.98, cos.min()
