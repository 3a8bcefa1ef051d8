"""The engine on the Triton kernels (`attention_backend="triton"`) against the torch reference backend.

On the CPU the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1), which is
slow: few conversations, few tokens. `pytest -m cuda` runs the same checks compiled on a GPU.
"""
import os

import pytest
import torch

from helpers import conversations
from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.config import EngineArgs
from vlm_sdk.worker.cuda_graphs import DecodeGraphs, capture_sizes
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.layers.ops import make_ops

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
ON_GPU = torch.cuda.is_available()


def _interpreter_or_gpu(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")


@pytest.fixture(scope="module")
def convs():
    c = conversations()
    return [c["text"], c["one_image"], c["two_images"]]


@pytest.fixture(scope="module")
def torch_outputs(tiny_ckpt, convs):
    llm = LLM(tiny_ckpt, device="cpu", attention_backend="torch", show_progress=False)
    return [o.token_ids for o in llm.chat(convs, GREEDY)]


@pytest.fixture(scope="module")
def triton_llm(tiny_ckpt):
    """The Triton backend on the CPU (interpreter), shared: building one compiles nothing, but the
    interpreter makes every step slow."""
    _interpreter_or_gpu("cpu")
    return LLM(tiny_ckpt, device="cpu", attention_backend="triton", max_num_seqs=4, num_blocks=64,
               show_progress=False)


def test_triton_greedy_equals_torch_cpu(triton_llm, convs, torch_outputs):
    """Batched prefill (whole prompts, images through varlen attention) then batched decode."""
    assert local_worker(triton_llm.engine).ops.name == "triton" and local_worker(triton_llm.engine).runner.graphs is None
    assert [o.token_ids for o in triton_llm.chat(convs, GREEDY)] == torch_outputs
    assert triton_llm.stats()["kv_blocks_used"] == 0


def test_fp8_kv_cache_triton_greedy_equals_torch_cpu(tiny_ckpt, convs):
    """kv_cache_dtype='fp8' on both backends: the store writes the same e4m3 bytes, the kernels read them
    back with the scales folded in where the torch backend dequantizes, so the tokens are the same."""
    _interpreter_or_gpu("cpu")
    kw = dict(device="cpu", kv_cache_dtype="fp8", max_num_seqs=4, num_blocks=64, show_progress=False)
    convs = convs[:2]  # text and one image: the cache path is the same for a second image's tokens
    want = [o.token_ids for o in LLM(tiny_ckpt, attention_backend="torch", **kw).chat(convs, GREEDY)]
    llm = LLM(tiny_ckpt, attention_backend="triton", **kw)
    assert {t.dtype for pair in local_worker(llm.engine).caches for t in pair} == {torch.float8_e4m3fn}
    assert [o.token_ids for o in llm.chat(convs, GREEDY)] == want


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_fp8_kv_cache_triton_greedy_equals_torch_cuda(tiny_ckpt, convs):
    """The same on a GPU, decode steps from CUDA graphs (the scales are device scalars the graphs replay)."""
    kw = dict(device="cuda", dtype="float32", kv_cache_dtype="fp8", show_progress=False)
    want = [o.token_ids for o in LLM(tiny_ckpt, attention_backend="torch", **kw).chat(convs, GREEDY)]
    llm = LLM(tiny_ckpt, attention_backend="triton", **kw)
    assert local_worker(llm.engine).runner.graphs is not None
    assert [o.token_ids for o in llm.chat(convs, GREEDY)] == want


def test_decoder_layers_rotate_and_store_kv_in_one_launch(triton_llm, convs, torch_outputs, monkeypatch):
    """With the Triton set every decoder layer launches rotary_store_kv once per step and neither
    the rotary nor store_kv alone (the tokens still equal the torch backend's)."""
    import vlm_sdk.kernels.store_kv as store_kv_module
    ops = local_worker(triton_llm.engine).ops
    calls = {"fused": 0, "rotary": 0, "store_kv": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    monkeypatch.setattr(ops, "_rotary_store_kv", counted("fused", ops._rotary_store_kv))
    monkeypatch.setattr(ops, "_rotary", counted("rotary", ops._rotary))
    monkeypatch.setattr(store_kv_module, "store_kv", counted("store_kv", store_kv_module.store_kv))
    steps = 3
    out = triton_llm.chat(convs[0], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == torch_outputs[0][:steps]
    layers = len(local_worker(triton_llm.engine).caches)
    assert calls == {"fused": layers * steps, "rotary": 0, "store_kv": 0}


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_triton_greedy_equals_torch_cuda(tiny_ckpt, convs, torch_outputs, enforce_eager):
    """float32 on the GPU, decode from CUDA graphs or eagerly; a near-tie may flip one conversation."""
    llm = LLM(tiny_ckpt, device="cuda", dtype="float32", attention_backend="triton", num_blocks=64,
              enforce_eager=enforce_eager, show_progress=False)
    assert (local_worker(llm.engine).runner.graphs is None) == enforce_eager
    outs = [o.token_ids for o in llm.chat(convs, GREEDY)]
    assert sum(a == b for a, b in zip(outs, torch_outputs)) >= len(convs) - 1
    assert llm.stats()["kv_blocks_used"] == 0


def test_triton_hidden_states_match_torch(tiny_ckpt):
    """One forward on both kernel sets, compared before sampling: a mixed step of a whole prompt, a
    chunk over earlier context and a decode row."""
    _interpreter_or_gpu("cpu")
    from vlm_sdk.attention.metadata import AttentionMetadata, StepMetadata
    from vlm_sdk.worker.kv_cache import allocate_kv_caches
    from vlm_sdk.memory.kv import CacheConfig

    ref = local_worker(LLM(tiny_ckpt, attention_backend="torch", show_progress=False).engine).model
    tri = local_worker(LLM(tiny_ckpt, attention_backend="triton", show_progress=False).engine).model
    block = 16
    # earlier context: seq 1 has 21 cached tokens, seq 2 has 32 (ends on a block boundary)
    ctx, new = [0, 21, 32], [19, 7, 1]
    tables = [[0, 1], [2, 3, 4], [5, 6, 7]]
    cache = CacheConfig(block, 8, 0, "test")
    outs = []
    for model in (ref, tri):
        caches = allocate_kv_caches(model.num_layers, cache, model.num_kv_heads, model.head_dim, torch.float32,
                                    torch.device("cpu"))
        for k, v in caches:  # the same earlier K/V for both
            k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(1)))
            v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(2)))
        slots = [t[p // block] * block + p % block for c, n, t in zip(ctx, new, tables) for p in range(c, c + n)]
        seq_lens = [c + n for c, n in zip(ctx, new)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, 19, 26, 27], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32),
            query_lens_cpu=new, seq_lens_cpu=seq_lens, max_query_len=19, max_seq_len=33)
        meta = StepMetadata.uniform(model.decoder.ops.attention.prepare(meta, caches[0][0]), len(caches))  # each backend's own, once per step
        ids = torch.randint(0, model.vocab_size, (27,), generator=torch.Generator().manual_seed(3))
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, new)]).expand(3, -1)
        with torch.inference_mode():
            outs.append(model(model.embed_tokens(ids), positions, caches, meta))
    # the tiny Qwen2.5-VL decoder's chain (tests/tolerance.py): 2 layers of width 64, MLP 128, over <= 33 tokens
    assert_reduction_close(outs[1], outs[0], forward_terms(layers=2, hidden=64, intermediate=128, tokens=33, head_dim=16))


def test_padded_decode_path_equals_torch(triton_llm, convs, torch_outputs):
    """The static buffers and padding rows that the CUDA graphs replay, run eagerly on the CPU: a
    batch of 3 runs as the padded size 4 (slot -1, seq_len 0), a lone request as size 1."""
    eng = triton_llm.engine
    graphs = DecodeGraphs(local_worker(eng).model, local_worker(eng).runner.caches, local_worker(eng).runner.layout, max_num_seqs=4,
                          max_model_len=eng.scheduler_config.max_model_len, block_size=eng.args.block_size,
                          device=eng.device, attention=local_worker(eng).ops.attention, capture=False)
    assert graphs.sizes == [1, 2, 4]
    calls = []
    run = graphs.run
    graphs.run = lambda n: calls.append(n) or run(n)
    local_worker(eng).runner.graphs = graphs
    try:
        assert [o.token_ids for o in triton_llm.chat(convs, GREEDY)] == torch_outputs
        assert 3 in calls  # decode steps of all three went through the padded path
        assert [o.token_ids for o in triton_llm.chat(convs[:1], GREEDY)] == torch_outputs[:1]
        assert 1 in calls
    finally:
        local_worker(eng).runner.graphs = None
    assert triton_llm.stats()["kv_blocks_used"] == 0


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_triton_on_cpu_without_interpreter_names_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidRequestError, match="TRITON_INTERPRET=1.*attention_backend='torch'"):
        make_ops("triton", torch.device("cpu"))
    assert make_ops(None, torch.device("cpu")).name == "torch"
    with pytest.raises(InvalidRequestError, match="attention_backend must be 'torch' or 'triton', got 'flash'"):
        EngineArgs.from_kwargs(attention_backend="flash")


def test_internvl_triton_greedy_equals_torch(internvl_ckpt):
    """An InternVL checkpoint (Qwen2 LLM, 1-D RoPE from row 0 of the positions) on the Triton decoder."""
    _interpreter_or_gpu("cpu")
    convs = [conversations()["text"]]  # a short prompt: the interpreter is slow
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    ref = LLM(internvl_ckpt, attention_backend="torch", show_progress=False).chat(convs, greedy)
    tri = LLM(internvl_ckpt, attention_backend="triton", num_blocks=128, show_progress=False).chat(convs, greedy)
    assert [o.token_ids for o in tri] == [o.token_ids for o in ref]


def test_small_m_gemm_triton_runs_the_decode_projections_and_keeps_the_tokens(tiny_ckpt, convs, torch_outputs,
                                                                              monkeypatch):
    """small_m_gemm="triton": the qkv and o projections of steps with at most 8 rows go through
    kernels/skinny_gemm.py (the prompt's longer rows through F.linear); greedy tokens equal the torch
    backend's."""
    import vlm_sdk.kernels.skinny_gemm as skinny
    _interpreter_or_gpu("cpu")
    rows = []
    real = skinny.skinny_gemm
    monkeypatch.setattr(skinny, "skinny_gemm", lambda x, w, b=None, out=None: rows.append(x.shape[0]) or real(x, w, b))
    llm = LLM(tiny_ckpt, device="cpu", attention_backend="triton", small_m_gemm="triton", max_num_seqs=4,
              num_blocks=64, show_progress=False)
    steps = 3
    out = llm.chat(convs[0], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == torch_outputs[0][:steps]
    layers = len(local_worker(llm.engine).caches)
    assert rows == [1] * (2 * layers * (steps - 1))  # two decode steps x (qkv, o) x layers; the prefill: F.linear


def test_small_m_gemm_setting_is_checked():
    with pytest.raises(InvalidRequestError, match="small_m_gemm must be 'torch' or 'triton'"):
        EngineArgs(small_m_gemm="cublas").validate()
    with pytest.raises(InvalidRequestError, match="small_m_gemm='triton' needs the Triton kernel set"):
        make_ops("torch", torch.device("cpu"), "triton")
