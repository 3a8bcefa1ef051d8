"""The layers' collectives on two real CPU ranks over gloo (`vlm_sdk.testing.distributed.run_on_ranks`):
RowParallelLinear's all-reduce (bias once), VocabParallelEmbedding's all-reduce, and the LM head's
logits gathered to the whole, unevenly split vocab; every rank returns the tp=1 result. And the
helper itself: a failing rank raises here with its traceback, and the rank left waiting in a
collective is ended."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tolerance import assert_reduction_close
from vlm_sdk.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vlm_sdk.layers.linear import ColumnParallelLinear, RowParallelLinear
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.testing.distributed import run_on_ranks
from vlm_sdk.weight_loading import load_checked

HIDDEN, INTER, VOCAB = 8, 12, 11  # ceil(11 / 2) = 6 vocab rows on rank 0, 5 on rank 1


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"up.weight": torch.randn(INTER, HIDDEN, generator=g), "up.bias": torch.randn(INTER, generator=g),
            "down.weight": torch.randn(HIDDEN, INTER, generator=g), "down.bias": torch.randn(HIDDEN, generator=g),
            "embed": torch.randn(VOCAB, HIDDEN, generator=g), "x": torch.randn(5, HIDDEN, generator=g)}


def _layers(tp: TPGroup, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer loaded with this rank's slices, run on the same inputs."""
    up, down = ColumnParallelLinear(HIDDEN, INTER, True, tp=tp), RowParallelLinear(INTER, HIDDEN, True, tp=tp)
    load_checked(up, t.items(), up.slots("", "up.weight", "up.bias"), ignore=frozenset(t) - {"up.weight", "up.bias"})
    load_checked(down, t.items(), down.slots("", "down.weight", "down.bias"),
                 ignore=frozenset(t) - {"down.weight", "down.bias"})
    emb, head = VocabParallelEmbedding(VOCAB, HIDDEN, tp=tp), ParallelLMHead(VOCAB, HIDDEN, tp=tp)
    for layer in (emb, head):
        load_checked(layer, [("embed", t["embed"])], layer.slots("weight", "embed"))
    ids = torch.tensor([0, 5, 6, 10, 3, 6])
    with torch.no_grad():
        return {"mlp": down(F.gelu(up(t["x"]))), "embedding": emb(ids), "logits": head.logits(t["x"]),
                "local_vocab": torch.tensor(head.weight.shape[0])}


def test_layers_return_the_whole_result_on_every_rank():
    t = _tensors()
    full = _layers(TPGroup(), t)
    ranks = run_on_ranks(_layers, 2, t, timeout_s=300)
    assert [int(r["local_vocab"]) for r in ranks] == [6, 5]
    for r, out in enumerate(ranks):
        assert_reduction_close(out["mlp"], full["mlp"], INTER)  # the bias counted once
        torch.testing.assert_close(out["embedding"], full["embedding"], rtol=0, atol=0)
        assert out["logits"].shape == (5, VOCAB)
        assert_reduction_close(out["logits"], full["logits"], HIDDEN)


def _fails_on_rank_1(tp: TPGroup) -> None:
    if tp.rank == 1:
        raise ArithmeticError("rank 1 gave up")
    tp.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes


def test_a_failing_rank_raises_with_its_traceback_and_no_rank_outlives_the_call():
    import multiprocessing
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed:.*ArithmeticError: rank 1 gave up"):
        run_on_ranks(_fails_on_rank_1, 2, timeout_s=300)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("vlm-tp-rank-")]
