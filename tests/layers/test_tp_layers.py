"""Tensor-parallel-ready layers (vlm_sdk/layers): with tp_size 2, each rank loads only its slice of a
checkpoint tensor (through `load_checked` and the layer's `slots`), and the ranks' results combined by
hand (sum of row-parallel partials, concatenation of vocab slices) equal the unsharded layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.errors import CheckpointError
from tolerance import assert_reduction_close
from vlm_sdk.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vlm_sdk.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                   RowParallelLinear)
from vlm_sdk.layers.parallel_state import ParallelGroups, TPGroup
from vlm_sdk.weight_loading import load_checked

HIDDEN, INTER = 8, 12
RANKS = (TPGroup(0, 2), TPGroup(1, 2))


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"up.weight": torch.randn(INTER, HIDDEN, generator=g), "up.bias": torch.randn(INTER, generator=g),
            "down.weight": torch.randn(HIDDEN, INTER, generator=g), "down.bias": torch.randn(HIDDEN, generator=g)}


class MLP(nn.Module):
    def __init__(self, tp: TPGroup):
        super().__init__()
        self.up = ColumnParallelLinear(HIDDEN, INTER, True, tp=tp)
        self.down = RowParallelLinear(INTER, HIDDEN, True, tp=tp)

    def slots(self):
        return {**self.up.slots("up.", "up.weight", "up.bias"), **self.down.slots("down.", "down.weight", "down.bias")}

    def forward(self, x):  # [N, HIDDEN] -> [N, HIDDEN], a partial sum on each rank
        return self.down(F.gelu(self.up(x)))


def _load(module: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    load_checked(module, tensors.items(), module.slots())
    return module


def test_column_and_row_layers_hold_their_slice_and_compose_to_the_unsharded_mlp():
    t = _tensors()
    full = _load(MLP(TPGroup()), t)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    partials = []
    for tp in RANKS:
        mlp = _load(MLP(tp), t)
        rows = slice(tp.rank * INTER // 2, (tp.rank + 1) * INTER // 2)
        assert mlp.up.weight.shape == (INTER // 2, HIDDEN)
        assert torch.equal(mlp.up.weight, t["up.weight"][rows]) and torch.equal(mlp.up.bias, t["up.bias"][rows])
        assert mlp.down.weight.shape == (HIDDEN, INTER // 2)
        assert torch.equal(mlp.down.weight, t["down.weight"][:, rows])
        assert torch.equal(mlp.down.bias, t["down.bias"])  # whole; added by rank 0 only
        partials.append(mlp(x))
    assert_reduction_close(partials[0] + partials[1], full(x), INTER)  # down's sum split in two
    assert torch.equal(full(x), F.linear(F.gelu(F.linear(x, t["up.weight"], t["up.bias"])), t["down.weight"],
                                         t["down.bias"]))  # one rank: the plain layers


def test_merged_and_qkv_layers_place_each_parts_slice_back_to_back():
    heads, kv_heads, d = 4, 2, 3
    g = torch.Generator().manual_seed(2)
    parts = {"q": torch.randn(heads * d, HIDDEN, generator=g), "k": torch.randn(kv_heads * d, HIDDEN, generator=g),
             "v": torch.randn(kv_heads * d, HIDDEN, generator=g),
             "gate": torch.randn(INTER, HIDDEN, generator=g), "up": torch.randn(INTER, HIDDEN, generator=g)}
    x = torch.randn(3, HIDDEN, generator=g)
    for tp in RANKS:
        qkv = QKVParallelLinear(HIDDEN, d, heads, kv_heads, False, tp=tp)
        slots = qkv.slots("", ["q", "k", "v"])
        load_checked(qkv, [(n, parts[n]) for n in ("q", "k", "v")], slots)
        assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1)
        expect = torch.cat([parts["q"][tp.rank * 6:(tp.rank + 1) * 6], parts["k"][tp.rank * 3:(tp.rank + 1) * 3],
                            parts["v"][tp.rank * 3:(tp.rank + 1) * 3]])
        assert torch.equal(qkv.weight, expect)
        gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], False, tp=tp)
        load_checked(gate_up, [(n, parts[n]) for n in ("gate", "up")], gate_up.slots("", ["gate", "up"]))
        half = slice(tp.rank * INTER // 2, (tp.rank + 1) * INTER // 2)
        assert torch.equal(gate_up.weight, torch.cat([parts["gate"][half], parts["up"][half]]))
        torch.testing.assert_close(gate_up(x), torch.cat([x @ parts["gate"][half].T, x @ parts["up"][half].T], -1))


def test_vocab_parallel_embedding_and_lm_head_split_an_uneven_vocab():
    vocab = 11  # ceil(11 / 2) = 6 rows on rank 0, 5 on rank 1
    weight = torch.randn(vocab, HIDDEN, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([0, 5, 6, 10, 3, 6])
    hidden = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(4))
    looked_up, logits = [], []
    for tp, (start, stop) in zip(RANKS, ((0, 6), (6, 11))):
        emb = VocabParallelEmbedding(vocab, HIDDEN, tp=tp)
        load_checked(emb, [("embed", weight)], emb.slots("weight", "embed"))
        assert torch.equal(emb.weight, weight[start:stop])
        looked_up.append(emb(ids))
        head = ParallelLMHead(vocab, HIDDEN, tp=tp)
        load_checked(head, [("lm_head", weight)], head.slots("weight", "lm_head"))
        logits.append(head.logits(hidden))  # [4, stop - start]
    assert torch.equal(looked_up[0] + looked_up[1], F.embedding(ids, weight))
    torch.testing.assert_close(torch.cat(logits, dim=-1), hidden @ weight.T)


def test_sharded_loading_stays_strict():
    """A rank checks the whole checkpoint tensor's shape before taking its slice, and names it."""
    t = _tensors()
    t["down.weight"] = torch.randn(HIDDEN, INTER + 2)
    with pytest.raises(CheckpointError, match=r"tensor down.weight has shape \[8, 14\] but MLP expects \[8, 12\]"):
        _load(MLP(TPGroup(1, 2)), t)
    with pytest.raises(CheckpointError, match="missing from the checkpoint: up.bias"):
        load_checked(MLP(TPGroup(0, 2)), [(n, v) for n, v in _tensors().items() if n != "up.bias"],
                     MLP(TPGroup(0, 2)).slots())


def test_tp_group_is_frozen_and_checks_divisibility():
    with pytest.raises(ValueError, match="attention heads .3. is not divisible by the tensor-parallel size 2"):
        QKVParallelLinear(HIDDEN, 2, 3, 1, False, tp=TPGroup(0, 2))
    with pytest.raises(ValueError):
        TPGroup(2, 2)
    with pytest.raises(AttributeError):
        TPGroup().rank = 1  # frozen


def test_llama_decoder_on_two_ranks_loads_half_of_every_split_tensor():
    """The decoder's checkpoint map names each rank's slice: a Llama checkpoint loads strictly into
    either rank, which then holds half the heads, half the MLP and its part of the vocab."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vlm_sdk.models.common.llama_config import LlamaDecoderConfig
    from vlm_sdk.models.common.llama_decoder import LlamaDecoder

    hf_cfg = LlamaConfig(vocab_size=301, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    sd = LlamaForCausalLM(hf_cfg).state_dict()
    cfg = LlamaDecoderConfig.from_hf(hf_cfg, tie_word_embeddings=False, mrope=False)
    for tp in RANKS:
        dec = LlamaDecoder(cfg, parallel=ParallelGroups(tp))
        load_checked(dec, sd.items(), dec.checkpoint_map())
        layer, d = dec.layers[0], cfg.head_dim
        q = sd["model.layers.0.self_attn.q_proj.weight"][tp.rank * 2 * d:(tp.rank + 1) * 2 * d]
        k = sd["model.layers.0.self_attn.k_proj.weight"][tp.rank * d:(tp.rank + 1) * d]
        assert layer.attn.num_heads == 2 and layer.attn.num_kv_heads == 1
        assert torch.equal(layer.qkv_proj.weight[:2 * d], q) and torch.equal(layer.qkv_proj.weight[2 * d:3 * d], k)
        assert layer.o_proj.weight.shape == (32, 2 * d) and layer.down_proj.weight.shape == (32, 24)
        start, stop = (0, 151) if tp.rank == 0 else (151, 301)
        assert torch.equal(dec.embed_tokens.weight, sd["model.embed_tokens.weight"][start:stop])
        assert torch.equal(dec.lm_head.weight, sd["lm_head.weight"][start:stop])


def test_kv_heads_split_or_replicated_per_rank():
    """Hkv % tp == 0: each rank its Hkv/tp heads; Hkv < tp and tp % Hkv == 0: one head per rank, rank r
    taking head r // (tp / Hkv) (the KV head of all its query heads); otherwise refused with the numbers."""
    heads, d = 8, 2
    g = torch.Generator().manual_seed(5)
    for kv_heads, tp_size in ((2, 2), (2, 4), (1, 2), (1, 4), (4, 2)):
        q = torch.randn(heads * d, HIDDEN, generator=g)
        k, v = (torch.randn(kv_heads * d, HIDDEN, generator=g) for _ in range(2))
        for rank in range(tp_size):
            tp = TPGroup(rank, tp_size)
            qkv = QKVParallelLinear(HIDDEN, d, heads, kv_heads, False, tp=tp)
            load_checked(qkv, [("q", q), ("k", k), ("v", v)], qkv.slots("", ["q", "k", "v"]))
            local_q = heads // tp_size
            first_q = rank * local_q
            kv = list(range(first_q * kv_heads // heads, (first_q + local_q - 1) * kv_heads // heads + 1))
            assert qkv.num_kv_heads == len(kv) == max(1, kv_heads // tp_size)  # the KV heads of its query heads
            rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in kv])
            assert torch.equal(qkv.weight, torch.cat([q[first_q * d:(first_q + local_q) * d], k[rows], v[rows]]))
    with pytest.raises(ValueError, match=r"KV heads \(3\) and the tensor-parallel size \(2\)"):
        QKVParallelLinear(HIDDEN, d, 6, 3, False, tp=TPGroup(0, 2))
    with pytest.raises(ValueError, match=r"KV heads \(2\) and the tensor-parallel size \(3\)"):
        QKVParallelLinear(HIDDEN, d, 6, 2, False, tp=TPGroup(0, 3))
