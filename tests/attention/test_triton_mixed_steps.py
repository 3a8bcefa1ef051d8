"""Mixed steps on the Triton backend (issue 19 point 1): query-length-1 rows go to the decode kernel,
the others to the prefill kernel over their real (sequence, query tile) pairs with the GQA group packed
into the tile's rows; parity with the torch backend (the reference) under the interpreter, small shapes,
over a float cache and an FP8 one (kv_cache_dtype="fp8": the store quantizes with the layer's scales, every
kernel reads them back)."""
from __future__ import annotations

import os

import pytest
import torch

from tolerance import assert_reduction_close, attention_terms
from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.attention.torch_backend import TorchBackend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton on the CPU needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 8
HEAD_DIM = 32


class Layer:
    scale = HEAD_DIM ** -0.5
    window = None  # full attention

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0, device="cpu"):
        self.k_scale = torch.tensor(k_scale, device=device)  # an FP8 cache's scales (unread by a float one)
        self.v_scale = torch.tensor(v_scale, device=device)


def _step(query_lens, seq_lens, num_heads, num_kv_heads, dtype=torch.float32, seed=0):
    """q/k/v of the new tokens, a random earlier cache, and the plain metadata of one step."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=g)  # pages out of order
    tables, used = [], 0
    for n in blocks:
        tables.append(perm[used:used + n].tolist() + [0] * (max(blocks) - n))
        used += n
    cache = (num_blocks, BLOCK, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(cache, generator=g).to(dtype)
    v_cache = torch.randn(cache, generator=g).to(dtype)
    slots = [tables[b][p // BLOCK] * BLOCK + p % BLOCK
             for b, (q, s) in enumerate(zip(query_lens, seq_lens)) for p in range(s - q, s)]
    n = len(slots)
    q = torch.randn(n, num_heads, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(n, num_kv_heads, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(n, num_kv_heads, HEAD_DIM, generator=g).to(dtype)
    starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens))
    return (q, k, v), (k_cache, v_cache), meta


def _to(meta: AttentionMetadata, device) -> AttentionMetadata:
    fields = {name: (val.to(device) if isinstance(val, torch.Tensor) else val) for name, val in meta.fields().items()}
    return AttentionMetadata(**fields)


def _run(backend, qkv, caches, meta, device, scales=(1.0, 1.0)):
    q, k, v = (t.to(device) for t in qkv)
    kc, vc = (c.clone().to(device) for c in caches)
    prepared = backend.prepare(_to(meta, device), kc)
    return backend.forward(q, k, v, Layer(*scales, device), (kc, vc), prepared), prepared


# (query_lens, seq_lens): decode rows first (the scheduler's order), decode rows between prefill rows
# (gathered), a lone single-token chunk, a q_len 0 row
STEPS = {
    "decodes_first": ([1, 1, 1, 13, 6], [9, 30, 17, 13, 22]),
    "interleaved": ([5, 1, 11, 1, 0, 1], [21, 40, 11, 3, 8, 16]),
    "prefill_only": ([7, 9], [7, 25]),
}


@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (7, 1), (8, 1)], ids=lambda h: f"group{h[0] // h[1]}")
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_step_matches_torch_backend(step, heads, dtype):
    from vlm_sdk.attention.triton_backend import TritonBackend
    qkv, caches, meta = _step(*STEPS[step], *heads, dtype=dtype)
    ref, _ = _run(TorchBackend(), [t.float() for t in qkv], [c.float() for c in caches], meta, "cpu")
    out, prepared = _run(TritonBackend(), qkv, caches, meta, DEVICE)
    head_dim = qkv[0].shape[-1]
    assert_reduction_close(out.float().cpu(), ref, attention_terms(head_dim, max(STEPS[step][1])), dtype, roundings=2)
    decodes = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
    assert (prepared.decode_rows is None) == (not decodes)
    if decodes:
        assert prepared.decode_rows.num_rows == len(decodes)
        assert (prepared.decode_rows.token_index is None) == (decodes == list(range(len(decodes))))


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_step_over_fp8_cache_matches_torch_backend(step, dtype):
    """The same steps over an FP8 cache (the earlier tokens quantized as the store would, this step's
    stored by each backend) with scales 0.3 / 2.0: both backends store the same bytes and attend over the
    same values."""
    from vlm_sdk.attention.triton_backend import TritonBackend
    from vlm_sdk.kernels import kv_quant
    qkv, caches, meta = _step(*STEPS[step], 4, 2, dtype=dtype, seed=3)
    scales = (0.3, 2.0)
    fp8 = [kv_quant.quantize(c.float(), torch.tensor(s), kv_quant.KV_FP8) for c, s in zip(caches, scales)]
    ref_caches = [c.clone() for c in fp8]
    q, k, v = qkv
    layer = Layer(*scales)
    backend = TorchBackend()
    ref = backend.forward(q.float(), k.float(), v.float(), layer, ref_caches, backend.prepare(meta, ref_caches[0]))
    got_caches = [c.clone().to(DEVICE) for c in fp8]
    triton_backend = TritonBackend()
    out = triton_backend.forward(*(t.to(DEVICE) for t in qkv), Layer(*scales, DEVICE), got_caches,
                                 triton_backend.prepare(_to(meta, DEVICE), got_caches[0]))
    for got, want in zip(got_caches, ref_caches):  # this step's K/V stored as the same bytes
        if dtype == torch.float32:
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    assert_reduction_close(out.float().cpu(), ref, attention_terms(HEAD_DIM, max(STEPS[step][1])), dtype, roundings=2)


def test_prefill_tiles_cover_real_tiles_only():
    """The tile list holds cdiv(q_len, tile) (sequence, first query) pairs per prefill row, none for
    decode or empty rows: 63 decodes beside an 8k chunk launch 8192 / 16 tiles per KV head, not
    64 x cdiv(8192, 16) (the old grid's (B, H, cdiv(max_q, BLOCK_M)) shape, per query head)."""
    from vlm_sdk.attention.triton_backend import TritonBackend
    from vlm_sdk.kernels import paged_prefill_attention as ppa
    tiles = ppa.prefill_tiles([1, 9, 0, 4], 4, "cpu", seqs=[1, 3])
    assert tiles.tolist() == [[1, 0], [1, 4], [1, 8], [3, 0]]
    assert ppa.prefill_tiles([1, 1], 4, "cpu", seqs=[]).shape == (0, 2)
    assert ppa.query_tile("cuda", torch.bfloat16) == 16 and ppa.query_tile("cpu", torch.float32) == 4
    dense = ppa.dense_tiles(2, 9, 4, "cpu")
    assert dense.tolist() == [[0, 0], [0, 4], [0, 8], [1, 0], [1, 4], [1, 8]]

    lens = [1] * 63 + [8192]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(8255, dtype=torch.int64), query_start_loc=torch.tensor([0] + lens).cumsum(0),
        seq_lens=torch.tensor([100] * 63 + [8192], dtype=torch.int32),
        block_tables=torch.zeros(64, 512, dtype=torch.int32), query_lens_cpu=lens,
        seq_lens_cpu=[100] * 63 + [8192], max_query_len=8192, max_seq_len=8192)
    prepared = TritonBackend().prepare(meta, torch.empty(4, 16, 2, 8, device="meta"))
    tile = prepared.query_tile_len
    assert prepared.prefill_tiles.shape == (8192 // tile, 2)
    assert prepared.decode_rows.num_rows == 63 and prepared.decode_rows.token_index is None


def test_mixed_step_launches_the_decode_kernel_on_decode_rows(monkeypatch):
    """Per layer: one decode launch with the query-length-1 rows, one prefill launch with the tiles."""
    from vlm_sdk.attention.triton_backend import TritonBackend
    from vlm_sdk.kernels import paged_attention_decode, paged_prefill_attention
    calls = []
    dec, pre = paged_attention_decode.paged_attention_decode, paged_prefill_attention.paged_prefill_attention
    monkeypatch.setattr(paged_attention_decode, "paged_attention_decode",
                        lambda q, *a, **kw: calls.append(("decode", q.shape[0])) or dec(q, *a, **kw))
    monkeypatch.setattr(paged_prefill_attention, "paged_prefill_attention",
                        lambda q, *a, **kw: calls.append(("prefill", kw["tiles"].shape[0])) or pre(q, *a, **kw))
    qkv, caches, meta = _step(*STEPS["interleaved"], 4, 2)
    _run(TritonBackend(), qkv, caches, meta, DEVICE)
    assert calls == [("decode", 3), ("prefill", 2 + 3)]  # q_len 5 and 11 in tiles of 4
