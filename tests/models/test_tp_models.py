"""Tensor parallelism at the model level, on two CPU ranks over gloo: prefill logits (embedding, vision
tower, decoder on a paged KV cache, LM head gathered to the whole vocab) equal the tp=1 model's on every
rank, within the rounding of another summation order (tests/tolerance.py), for every family and LLM, with the vision tower sharded and replicated.

tp=1 is the oracle here (the tp=1 models equal transformers: tests/models/*/). The tp=1 side reads
whole tensors (`iter_safetensors`), the ranks read lazily (`lazy=True`: only their slices), so equal
logits also check the sliced reading, InternLM2's packed wqkv included. One spawn of two ranks runs
every case (`run_on_ranks`); each rank returns its logits and what it holds.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import image
from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.attention.metadata import AttentionMetadata, StepMetadata
from vlm_sdk.config import EngineArgs
from vlm_sdk.layers.parallel_state import ParallelGroups, TPGroup
from vlm_sdk.model_loader import iter_safetensors, load_tokenizer, read_checkpoint
from vlm_sdk.models.registry import resolve
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.testing import make_tiny_checkpoint
from vlm_sdk.testing.distributed import run_on_ranks

# Additions along the longest chain of each tiny family's prefill (tests/tolerance.py): prompts of at most
# 320 tokens; Qwen2.5-VL's 1,176-input patches, 2 blocks of width 32 over at most 128 patches, a merger of
# inputs 128 + 128; InternVL's 588-input patches, 2 blocks over a 1,025-token tile, a projector of inputs
# 128 + 64; both LLMs 2 layers of width 64, MLP 128.
_LLM = dict(layers=2, hidden=64, intermediate=128, tokens=320, head_dim=16)
TERMS = {"qwen2_5_vl": forward_terms(**_LLM, patch=1176, vision_layers=2, vision_hidden=32, vision_intermediate=64,
                                      vision_tokens=128, merger=256),
         "internvl": forward_terms(**_LLM, patch=588, vision_layers=2, vision_hidden=32, vision_intermediate=64,
                                    vision_tokens=1025, merger=192)}
BLOCK = 16

# name -> (family, make_tiny_checkpoint overrides, shard_vision)
CASES = {
    "qwen": ("qwen2_5_vl", {}, True),
    "qwen_replicated_vision": ("qwen2_5_vl", {}, False),
    # 1 KV head on 2 ranks (replicated), a vocab that does not split evenly (1061 = 531 + 530)
    "qwen_kv1_uneven_vocab": ("qwen2_5_vl", {"num_kv_heads": 1, "vocab_size": 1061}, True),
    "internvl": ("internvl", {}, True),
    "internvl_replicated_vision": ("internvl", {}, False),
    "internvl_llama": ("internvl", {"llm": "llama"}, True),
    "internvl_internlm2": ("internvl", {"layout": "original", "llm": "llama"}, True),
    "internvl_internlm2_kv1": ("internvl", {"layout": "original", "llm": "llama", "num_kv_heads": 1}, True),
    "internvl_qk_norm": ("internvl", {"use_qk_norm": True, "vision_depth": 1}, True),
    "internvl_qk_norm_original": ("internvl", {"layout": "original", "use_qk_norm": True, "vision_depth": 1}, True),
    # 3 vision heads do not split over 2 ranks (as InternViT-6B's 25 do not): the tower is replicated instead
    "internvl_vision_heads_3": ("internvl", {"vision_hidden_size": 48, "vision_heads": 3, "vision_depth": 1}, True),
}
UNSPLIT_VISION = {"internvl_vision_heads_3"}
TIED = "qwen_tied_head_differs_on_rank_1"  # a tied config whose lm_head differs from the embedding in rank 1's rows


def _conversation(family: str) -> list[dict]:
    part = {"type": "image", "image": image(120, 90, 4)}
    if family == "internvl":
        part["max_num"] = 1  # one 448 tile: 256 image tokens
    return [{"role": "user", "content": [part, {"type": "text", "text": "What is in this image?"}]}]


def prompt_of(ckpt) -> PromptInputs:
    """The family's own processor on one image + text, as the engine builds prompts."""
    info = read_checkpoint(ckpt)
    family = resolve([info.architecture])
    ip = family.image_processor_cls.from_preprocessor_config(info.preprocessor, info.hf_config)
    return family.make_processor(load_tokenizer(ckpt), ip, info.hf_config, EngineArgs())(_conversation(family.name))


def build(ckpt, tp: TPGroup, shard_vision: bool = True):
    info = read_checkpoint(ckpt)
    model = resolve([info.architecture]).model_cls(info.hf_config, dtype=torch.float32, device="cpu",
                                                   parallel=ParallelGroups(tp),
                                                   shard_vision=shard_vision)
    model.load_weights(iter_safetensors(ckpt, show_progress=False, lazy=tp.size > 1), source=ckpt)
    return model.eval()


@torch.no_grad()
def prefill_logits(model, prompt: PromptInputs) -> torch.Tensor:  # [L, vocab]
    """One prefill of the whole prompt on a fresh paged cache, image rows scattered as the runner does."""
    n = len(prompt.token_ids)
    ids = torch.tensor(prompt.token_ids)
    embeds = model.embed_tokens(ids)  # [L, hidden]
    if prompt.images:
        rows = torch.cat([torch.arange(p, p + im.num_tokens) for p, im in zip(prompt.image_positions, prompt.images)])
        embeds[rows] = model.encode_images(prompt.images)
    blocks = -(-n // BLOCK)
    shape = (blocks, BLOCK, model.num_kv_heads, model.head_dim)  # this rank's KV heads
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_lens_cpu=[n], seq_lens_cpu=[n], max_query_len=n, max_seq_len=n)
    meta = StepMetadata.uniform(model.decoder.ops.attention.prepare(meta, caches[0][0]), len(caches))
    hidden = model(embeds, model.positions(prompt.positions, 0, n), caches, meta)  # [L, hidden]
    return model.compute_logits(hidden)


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def rank_checks(tp: TPGroup, cases: dict[str, tuple]) -> dict[str, dict]:
    """On each rank: every case's logits and what the rank holds."""
    out = {}
    for name, (ckpt, shard_vision, prompt) in cases.items():
        model = build(ckpt, tp, shard_vision)
        groups = model.parameter_groups()
        out[name] = dict(logits=prefill_logits(model, prompt), num_kv_heads=model.num_kv_heads,
                         untied=model.decoder.lm_head is not None,
                         numel={k: _numel(v) for k, v in groups.items()})
    return out


def _tied_checkpoint(path):
    """A tied Qwen2.5-VL checkpoint that also ships an lm_head equal to the embedding except one row of
    rank 1's vocab slice: only rank 1 sees the difference, yet both ranks must untie."""
    ckpt = make_tiny_checkpoint(path, tie_word_embeddings=True)
    tensors = load_file(ckpt / "model.safetensors")
    head = tensors["model.embed_tokens.weight"].clone()
    head[-1] += 1.0  # the last row: rank 1's
    tensors["lm_head.weight"] = head
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    return ckpt


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    cases, expected = {}, {}
    built = {}
    for name, (family, overrides, shard_vision) in CASES.items():
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(name), family=family, **overrides)
        cases[name] = (built[key], shard_vision, prompt_of(built[key]))
    tied = _tied_checkpoint(tmp_path_factory.mktemp("tied"))
    cases[TIED] = (tied, True, prompt_of(tied))
    for name, (ckpt, _, prompt) in cases.items():
        model = build(ckpt, TPGroup())
        expected[name] = dict(logits=prefill_logits(model, prompt), num_kv_heads=model.num_kv_heads,
                              terms=TERMS[CASES.get(name, ("qwen2_5_vl",))[0]],
                              untied=model.decoder.lm_head is not None, vocab=model.vocab_size,
                              numel={k: _numel(v) for k, v in model.parameter_groups().items()})
    return expected, run_on_ranks(rank_checks, 2, cases, timeout_s=600)


@pytest.mark.parametrize("name", [*CASES, TIED])
def test_two_ranks_prefill_logits_equal_one_rank(tp_results, name):
    expected, ranks = tp_results
    ref = expected[name]["logits"]
    assert ref.shape[1] == expected[name]["vocab"] and ref.std() > 0.1  # a real spread: the comparison can fail
    for r, result in enumerate(ranks):
        got = result[name]["logits"]
        assert got.shape == ref.shape, f"rank {r}: {list(got.shape)} (the whole vocab on every rank)"
        assert_reduction_close(got, ref, expected[name]["terms"], msg=f"rank {r}, {name}")


@pytest.mark.parametrize("name", [*CASES, TIED])
def test_each_rank_holds_its_share(tp_results, name):
    """Local KV heads (split, or 1 replicated); half the decoder's weights (the vocab rows ceil-split);
    less than the whole vision tower and projector when sharded (patch embeddings and norms stay whole),
    all of it when replicated."""
    expected, ranks = tp_results
    whole = expected[name]["numel"]
    shard_vision = CASES.get(name, (None, None, True))[2] and name not in UNSPLIT_VISION
    for result in ranks:
        mine = result[name]
        assert mine["num_kv_heads"] == max(1, expected[name]["num_kv_heads"] // 2)
        assert whole["language_model"] * 0.45 < mine["numel"]["language_model"] < whole["language_model"] * 0.55
        for part in ("vision", "projector"):
            if shard_vision:
                assert mine["numel"][part] < whole[part]
            else:
                assert mine["numel"][part] == whole[part]


def test_tied_head_verdict_is_agreed_by_every_rank(tp_results):
    expected, ranks = tp_results
    assert expected[TIED]["untied"]
    assert [r[TIED]["untied"] for r in ranks] == [True, True]  # rank 0's rows equal the embedding: it unties too


# ----------------------------------------------------------------------------------------------
# lazy reading: a rank reads only its slices (no process group needed: composing by hand)


def test_lazy_stream_yields_the_eager_tensors(tiny_ckpt_flat):
    """Over a sharded checkpoint: same names, shapes, dtypes and values; `narrow` along either dim reads
    the eager tensor's slice."""
    from vlm_sdk.model_loader import SafetensorsTensor

    eager = dict(iter_safetensors(tiny_ckpt_flat, show_progress=False))
    seen = []
    for name, lazy in iter_safetensors(tiny_ckpt_flat, show_progress=False, lazy=True):
        whole = eager[name]
        assert isinstance(lazy, SafetensorsTensor) and lazy.shape == whole.shape and lazy.dtype == whole.dtype
        assert torch.equal(lazy.materialize(), whole)
        for dim in range(whole.dim()):
            n = whole.shape[dim]
            assert torch.equal(lazy.narrow(dim, n // 3, n - n // 3 - 1), whole.narrow(dim, n // 3, n - n // 3 - 1))
        seen.append(name)
    assert sorted(seen) == sorted(eager)


def _reads(monkeypatch) -> dict[str, int]:
    """name -> elements read through `SafetensorsTensor`, recorded from now on."""
    from vlm_sdk.model_loader import SafetensorsTensor

    reads: dict[str, int] = {}
    narrow, materialize = SafetensorsTensor.narrow, SafetensorsTensor.materialize

    def counted(method):
        def read(self, *args):
            out = method(self, *args)
            reads[self.name] = reads.get(self.name, 0) + out.numel()
            return out
        return read
    monkeypatch.setattr(SafetensorsTensor, "narrow", counted(narrow))
    monkeypatch.setattr(SafetensorsTensor, "materialize", counted(materialize))
    return reads


@pytest.mark.parametrize("layout", ["qwen2_5_vl", "internvl_internlm2"])
def test_a_rank_reads_only_its_slices(monkeypatch, tmp_path, layout):
    """Rank 1 of 2 reads half of every split tensor (InternLM2's packed wqkv too: only its KV groups),
    and whole only what every rank holds whole (norms, biases of row-parallel layers, patch embeddings)."""
    if layout == "qwen2_5_vl":
        ckpt = make_tiny_checkpoint(tmp_path)
    else:
        ckpt = make_tiny_checkpoint(tmp_path, family="internvl", layout="original", llm="llama")
    sizes = {n: t.numel() for n, t in iter_safetensors(ckpt, show_progress=False)}
    reads = _reads(monkeypatch)
    build(ckpt, TPGroup(1, 2))
    assert set(reads) == set(sizes)  # every tensor was read (the strict loader saw each)
    whole = {n for n in sizes if reads[n] == sizes[n]}
    assert all(reads[n] <= sizes[n] for n in sizes)
    split = ("wqkv", "tok_embeddings", "output.weight", "feed_forward", "attention.wo", "embed_tokens", "lm_head",
             "q_proj", "k_proj", "v_proj", "o_proj", "mlp.", "attn.qkv", "attn.proj", "mlp1.1", "mlp1.3")
    assert not [n for n in whole if any(s in n for s in split) and not n.endswith("bias") and sizes[n] > 1], whole
    assert sum(reads.values()) < 0.65 * sum(sizes.values())
