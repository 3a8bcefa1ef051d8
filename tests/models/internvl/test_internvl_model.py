"""InternVL on the paged KV cache against transformers' InternVLForConditionalGeneration.

Prompts for transformers are built independently (its chat template, GotOcr2ImageProcessorPil for the
tiles, placeholders expanded by hand: `vlm_sdk.models.internvl.reference.hf_prompt`); ours come from the
engine's own processor, so equal prompt ids also check our tiling and expansion.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from helpers import internvl_conversations as conversations
from tolerance import assert_reduction_close, forward_terms
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.attention.metadata import AttentionMetadata, StepMetadata
from vlm_sdk.model_loader import iter_safetensors, read_checkpoint
from vlm_sdk.models.internvl.model import InternVLForCausalLM
from vlm_sdk.models.internvl.processor import InternVLImage
from vlm_sdk.models.registry import resolve
from vlm_sdk.multimodal.inputs import ImageInput

MAX_TOKENS = 12
# the tiny InternVL's chain (tests/tolerance.py): 588-input patches, 2 blocks of width 32 over a 1,025-token
# tile, a projector of inputs 128 + 64, 2 layers of width 64 (MLP 128) over at most 2,000 tokens (7 tiles), the head
TERMS = forward_terms(layers=2, hidden=64, intermediate=128, tokens=2000, head_dim=16, patch=588, vision_layers=2,
                      vision_hidden=32, vision_intermediate=64, vision_tokens=1025, merger=192)


def close(actual, expected):
    assert_reduction_close(actual, expected, TERMS)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


class Oracle:
    """transformers' model on a checkpoint directory, with its own prompt construction."""

    def __init__(self, ckpt):
        from transformers import AutoTokenizer, InternVLForConditionalGeneration
        from vlm_sdk.models.internvl.reference import hf_image_processor
        self.model = InternVLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(ckpt)
        self.image_processor = hf_image_processor(str(ckpt))
        self.eos = read_checkpoint(ckpt).eos_token_ids

    def prompt(self, conv) -> dict:
        from vlm_sdk.models.internvl.reference import hf_prompt
        return hf_prompt(self.tokenizer, self.image_processor, self.model.config, conv)

    def greedy(self, conv) -> tuple[list[int], list[int]]:
        from vlm_sdk.testing.reference import hf_greedy
        inputs = self.prompt(conv)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        return inputs["input_ids"][0].tolist(), hf_greedy(self.model, inputs, MAX_TOKENS, self.eos)[0]

    @torch.no_grad()
    def logits(self, inputs: dict) -> torch.Tensor:  # [L, vocab]
        return self.model(**inputs).logits[0].float()


@pytest.fixture(scope="module")
def oracle(internvl_ckpt):
    return Oracle(internvl_ckpt)


@pytest.fixture(scope="module")
def reference(oracle):
    return {name: oracle.greedy(conv) for name, conv in conversations().items()}


@pytest.fixture(scope="module")
def llm(internvl_ckpt):
    return LLM(internvl_ckpt, show_progress=False)


def load_ours(ckpt) -> InternVLForCausalLM:
    info = read_checkpoint(ckpt)
    model = InternVLForCausalLM(info.hf_config)
    model.load_weights(iter_safetensors(ckpt, show_progress=False), source=ckpt)
    return model


@torch.no_grad()
def prefill_logits(model: InternVLForCausalLM, ids: torch.Tensor,  # [L]
                   pixel_values: torch.Tensor | None, image_token_id: int, block: int = 16) -> torch.Tensor:
    """Logits of every prompt position from one prefill on a fresh paged cache."""
    n = ids.numel()
    blocks = -(-n // block)
    shape = (blocks, block, model.num_kv_heads, model.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_lens_cpu=[n], seq_lens_cpu=[n], max_query_len=n, max_seq_len=n)
    meta = StepMetadata.uniform(model.decoder.ops.attention.prepare(meta, caches[0][0]), len(caches))  # once per step, as the runner does
    embeds = model.embed_tokens(ids)  # [L, hidden]
    if pixel_values is not None:
        tiles = pixel_values.shape[0]
        image = ImageInput(pixel_values, tiles * 256, InternVLImage(tiles))  # the tiny config: 256 tokens per tile
        embeds[ids == image_token_id] = model.encode_images([image])
    hidden = model(embeds, torch.arange(n).expand(model.position_rows, -1), caches, meta)  # [L, hidden]
    return model.compute_logits(hidden)


@pytest.mark.parametrize("name", list(conversations()))
def test_prefill_logits_match_transformers(oracle, internvl_ckpt, name):
    ours = load_ours(internvl_ckpt)
    inputs = oracle.prompt(conversations()[name])
    expected = oracle.logits(inputs)
    got = prefill_logits(ours, inputs["input_ids"][0], inputs.get("pixel_values"), oracle.model.config.image_token_id)
    assert got.shape == expected.shape
    close(got, expected)


@pytest.mark.parametrize("name", list(conversations()))
def test_greedy_alone_equals_transformers(llm, reference, name):
    prompt_ids, expected = reference[name]
    out = llm.chat(conversations()[name], GREEDY)[0]
    assert out.prompt_token_ids == prompt_ids
    assert out.token_ids == expected
    assert len(set(expected)) > 3, "random weights gave a degenerate reference; the test would be weak"


def test_several_tiles_per_image(llm, reference):
    prompt = llm.engine.build_prompt(conversations()["one_image"])
    assert [im.meta.tiles for im in prompt.images] == [3] and [im.size for im in prompt.images] == [3]
    assert prompt.image_tokens == [3 * 256]
    two = llm.engine.build_prompt(conversations()["two_images"])
    assert [im.meta.tiles for im in two.images] == [3, 1]


def test_greedy_batched_equals_transformers(llm, reference):
    names = list(conversations())
    outs = llm.chat([conversations()[n] for n in names], GREEDY)
    assert [o.token_ids for o in outs] == [reference[n][1] for n in names]
    assert llm.stats()["kv_blocks_used"] == 0


def test_original_layout_gives_identical_tokens(internvl_original_ckpt, reference):
    info = read_checkpoint(internvl_original_ckpt)
    assert info.hf_config.model_type == "internvl_chat" and info.architecture == "InternVLChatModel"
    original = LLM(internvl_original_ckpt, show_progress=False)
    names = list(conversations())
    outs = original.chat([conversations()[n] for n in names], GREEDY)
    assert [o.token_ids for o in outs] == [reference[n][1] for n in names]
    # the plain chatml template renders the same prompt as the -hf template
    assert [o.prompt_token_ids for o in outs] == [reference[n][0] for n in names]


def test_internlm2_layout_gives_identical_tokens(internvl_llama_ckpt, internvl_internlm2_ckpt):
    llama_oracle = Oracle(internvl_llama_ckpt)
    names = list(conversations())
    expected = [llama_oracle.greedy(conversations()[n])[1] for n in names]
    assert any(len(set(e)) > 3 for e in expected)
    for ckpt in (internvl_llama_ckpt, internvl_internlm2_ckpt):
        outs = LLM(ckpt, show_progress=False).chat([conversations()[n] for n in names], GREEDY)
        assert [o.token_ids for o in outs] == expected, ckpt


def test_internlm2_prefill_logits(internvl_llama_ckpt, internvl_internlm2_ckpt):
    llama_oracle = Oracle(internvl_llama_ckpt)
    inputs = llama_oracle.prompt(conversations()["two_images"])
    expected = llama_oracle.logits(inputs)
    ours = load_ours(internvl_internlm2_ckpt)
    assert ours.internlm2
    got = prefill_logits(ours, inputs["input_ids"][0], inputs["pixel_values"],
                         llama_oracle.model.config.image_token_id)
    close(got, expected)


def test_registry_serves_both_layouts():
    fam = resolve(["InternVLChatModel"])
    assert fam.name == "internvl" and resolve(["InternVLForConditionalGeneration"]) == fam
    assert fam.model_cls is InternVLForCausalLM


def test_original_layout_never_imports_remote_code(internvl_original_ckpt, tmp_path):
    """config.json's auto_map names remote modules; put booby-trapped ones beside it: loading and
    serving must not run them (no trust_remote_code anywhere)."""
    ckpt = tmp_path / "with_remote_code"
    shutil.copytree(internvl_original_ckpt, ckpt)
    for name in ("configuration_internvl_chat.py", "modeling_internvl_chat.py", "tokenization_internlm2.py"):
        (ckpt / name).write_text("raise RuntimeError('remote code was imported')\n")
    out = LLM(ckpt, show_progress=False).chat(conversations()["one_image"], GREEDY)[0]
    assert len(out.token_ids) >= 1
