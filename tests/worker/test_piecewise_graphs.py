"""Piecewise graphs (vlm_sdk/worker/piecewise_graphs.py): the decoder's pieces around eager attention
equal the plain forward on mixed steps; on the CPU with capture=False (same buffers, run eagerly), on
CUDA captured."""
from __future__ import annotations

import os

import pytest
import torch

from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk import LLM
from vlm_sdk.attention.metadata import AttentionMetadata, StepMetadata
from vlm_sdk.memory.kv import CacheConfig
from vlm_sdk.worker.kv_cache import allocate_kv_caches
from vlm_sdk.memory.consumers.piecewise import piecewise_sizes
from vlm_sdk.worker.piecewise_graphs import PiecewiseGraphs

BLOCK = 16


def _mixed_step(ctx, new, device):
    """Metadata of one step: sequences with `ctx` earlier tokens and `new` tokens each (decode rows where
    new is 1), blocks laid out one sequence after the other."""
    tables, nxt = [], 0
    for c, n in zip(ctx, new):
        blocks = -(-(c + n) // BLOCK)
        tables.append(list(range(nxt, nxt + blocks)))
        nxt += blocks
    width = max(len(t) for t in tables)
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for c, n, t in zip(ctx, new, tables) for p in range(c, c + n)]
    seq_lens = [c + n for c, n in zip(ctx, new)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor([0] + new, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        query_lens_cpu=list(new), seq_lens_cpu=seq_lens, max_query_len=max(new), max_seq_len=max(seq_lens))
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, new)]).expand(3, -1).to(device)  # [3, N]
    return meta, positions


def _caches(model, device, dtype):
    caches = allocate_kv_caches(model.num_layers, CacheConfig(BLOCK, 16, 0, "test"), model.num_kv_heads,
                                model.head_dim, dtype, torch.device(device))
    for i, (k, v) in enumerate(caches):  # the same earlier K/V for every run
        k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(2 * i)))
        v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(2 * i + 1)))
    return caches


def _compare(model, device, dtype, capture, steps, terms=None):
    dec = model.decoder
    caches = _caches(model, device, dtype)
    graphs = PiecewiseGraphs(dec, caches, max_num_batched_tokens=64, device=torch.device(device),
                             dtype=dtype, capture=capture)
    for ctx, new in steps:
        meta, positions = _mixed_step(ctx, new, device)
        meta = StepMetadata.uniform(dec.ops.attention.prepare(meta, caches[0][0]), len(caches))
        ids = torch.randint(0, model.vocab_size, (sum(new),), generator=torch.Generator().manual_seed(sum(new)))
        embeds = model.embed_tokens(ids.to(device))
        with torch.inference_mode():
            ref = dec(embeds, positions, [(k.clone(), v.clone()) for k, v in caches], meta)
            out = graphs.run(embeds, positions, meta)
        assert out.shape == ref.shape
        assert_reduction_close(out, ref, terms or DECODER_TERMS)
    return graphs


# (earlier tokens, new tokens) per sequence: decode rows beside a whole prompt and a chunk (27 tokens:
# the 32 bucket), then a smaller step in the same bucket (stale padding rows), then a 64-token step
STEPS = [([30, 0, 21, 47], [1, 19, 6, 1]), ([5, 12], [1, 17]), ([0, 40], [40, 24])]
# the tiny Qwen2.5-VL decoder's chain (tests/tolerance.py): 2 layers of width 64, MLP 128, over <= 64 tokens
DECODER_TERMS = forward_terms(layers=2, hidden=64, intermediate=128, tokens=64, head_dim=16)
# the tiny Qwen3-VL-MoE decoder's: 3 layers of width 48 (two sparse, one dense MLP of 128)
MOE_TERMS = forward_terms(layers=3, hidden=48, intermediate=128, tokens=64, head_dim=16)


# a dense decoder on both backends; one with MoE layers on the torch set only: where the pieces split does
# not depend on the kernels, and the fused MoE kernel's tokens are checked against the torch set's in
# tests/models/qwen3_vl_moe/ (interpreting it here took 22 s of the suite)
@pytest.mark.parametrize("family,backend", [("qwen2_5_vl", "torch"), ("qwen2_5_vl", "triton"),
                                            ("qwen3_vl_moe", "torch")])
def test_piecewise_eager_equals_plain_forward_cpu(tiny_checkpoints, family, backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    model = local_worker(LLM(tiny_checkpoints(family), attention_backend=backend, show_progress=False).engine).model
    graphs = _compare(model, "cpu", torch.float32, False, STEPS, MOE_TERMS if family == "qwen3_vl_moe" else None)
    assert graphs.sizes == [16, 32, 64] and not graphs.graphs


def test_piecewise_sizes():
    assert piecewise_sizes(64) == [16, 32, 64]
    assert piecewise_sizes(2048)[-1] == 2048 and piecewise_sizes(100) == [16, 32, 64, 100]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_piecewise_captured_equals_plain_forward_cuda(tiny_ckpt):
    model = local_worker(LLM(tiny_ckpt, device="cuda", dtype="float32", attention_backend="triton", enforce_eager=True,
                show_progress=False).engine).model
    graphs = _compare(model, "cuda", torch.float32, True, STEPS)
    assert sorted(graphs.graphs) == [16, 32, 64]
    assert all(len(g) == model.num_layers + 1 for g in graphs.graphs.values())


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "internvl_ckpt"])
def test_engine_steps_through_the_piecewise_path_cpu(request, ckpt):
    """The runner's piecewise path (`ModelRunner.piecewise`, built by the worker with piecewise_cuda_graphs
    on CUDA from the model's `decoder_stack()`): whole requests, images included, give the same tokens
    through the pieces (run eagerly here); Qwen2.5-VL's M-RoPE positions [3, N] and InternVL's 1-D [N].
    The model is not changed: the runner wraps it from outside."""
    tiny_ckpt = request.getfixturevalue(ckpt)
    from helpers import conversations
    from vlm_sdk import SamplingParams
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    c = conversations()
    convs = [c["text"], c["one_image"]]
    llm = LLM(tiny_ckpt, attention_backend="torch", show_progress=False)
    ref = [o.token_ids for o in llm.chat(convs, greedy)]
    eng = llm.engine
    worker = local_worker(eng)
    model, runner = worker.model, worker.runner
    before = _attributes(model)
    pw = PiecewiseGraphs(model.decoder_stack(), runner.caches, max_num_batched_tokens=eng.args.max_num_batched_tokens,
                         device=eng.device, dtype=eng.dtype, capture=False)
    calls = []
    run = pw.run
    pw.run = lambda embeds, *a: calls.append(embeds.shape[0]) or run(embeds, *a)
    runner.piecewise = pw
    try:
        assert [o.token_ids for o in llm.chat(convs, greedy)] == ref
    finally:
        runner.piecewise = None
    assert _attributes(model) == before  # nothing installed into the model
    assert calls and max(calls) > 1  # prefill steps went through it


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_with_piecewise_cuda_graphs_equals_torch(tiny_ckpt):
    """piecewise_cuda_graphs=True: the worker captures the pieces after the decode graphs; prefill and
    mixed steps replay them (float32; a near-tie may flip one conversation)."""
    from helpers import conversations
    from vlm_sdk import SamplingParams
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    c = conversations()
    convs = [c["text"], c["one_image"], c["two_images"]]
    ref = [o.token_ids for o in LLM(tiny_ckpt, attention_backend="torch", show_progress=False).chat(convs, greedy)]
    llm = LLM(tiny_ckpt, device="cuda", dtype="float32", attention_backend="triton", num_blocks=64,
              piecewise_cuda_graphs=True, show_progress=False)
    pw = local_worker(llm.engine).runner.piecewise
    assert pw is not None and pw.graphs
    outs = [o.token_ids for o in llm.chat(convs, greedy)]
    assert sum(a == b for a, b in zip(outs, ref)) >= len(convs) - 1


def _attributes(model) -> dict[str, dict[str, int]]:
    """Every module's own attributes (name -> id of the value): what the worker could have installed."""
    return {name: {k: id(v) for k, v in vars(m).items() if not k.startswith("_")} for name, m in model.named_modules()}


def test_qwen3_vl_deepstack_steps_take_the_plain_forward(tiny_checkpoints):
    """Qwen3-VL's steps with image rows add DeepStack features between layers: `stack_inputs` is None for
    them (the runner takes `forward`), while text-only steps go through the pieces; tokens unchanged."""
    from helpers import conversations
    from vlm_sdk import SamplingParams
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    c = conversations()
    convs = [c["text"], c["one_image"]]
    llm = LLM(tiny_checkpoints("qwen3_vl"), attention_backend="torch", show_progress=False,
              enable_prefix_caching=False)  # every prompt computed whole: its step's size is its length
    ref = [llm.chat([conv], greedy)[0].token_ids for conv in convs]
    worker = local_worker(llm.engine)
    pw = PiecewiseGraphs(worker.model.decoder_stack(), worker.runner.caches, device=llm.engine.device,
                         max_num_batched_tokens=llm.engine.args.max_num_batched_tokens, dtype=llm.engine.dtype,
                         capture=False)
    calls = []
    run = pw.run
    pw.run = lambda embeds, *a: calls.append(embeds.shape[0]) or run(embeds, *a)
    worker.runner.piecewise = pw
    try:
        assert [llm.chat([conv], greedy)[0].token_ids for conv in convs] == ref  # one at a time: a step each
    finally:
        worker.runner.piecewise = None
    text, image = (len(llm.engine.inputs.build_prompt(conv).token_ids) for conv in convs)
    assert text in calls and image not in calls  # text prefill through the pieces; the image's took forward


def test_a_model_without_a_decoder_stack_runs_plainly_and_says_so(caplog):
    """The contract's decoder stack is optional: a family whose decoder is its own gets no piecewise graphs
    (the worker logs why at start-up) and every step runs its `forward`."""
    from vlm_sdk.worker.piecewise_graphs import piecewise_stack

    class OwnDecoder:
        def decoder_stack(self):
            return None

    class Stacked:
        def decoder_stack(self):
            return "stack"

    from vlm_sdk.protocol.cache_layout import CacheLayout
    from vlm_sdk.protocol.cache_spec import AttentionSpec, StateSpec, StateTensor
    full = CacheLayout.uniform(2, AttentionSpec(1, 4, "float32"))
    with caplog.at_level("WARNING", logger="vlm_sdk"):
        assert piecewise_stack(OwnDecoder(), True, 1, full) is None
    assert "OwnDecoder declares no decoder stack" in caplog.text
    assert piecewise_stack(Stacked(), True, 1, full) == "stack"
    assert piecewise_stack(Stacked(), False, 1, full) is None and piecewise_stack(Stacked(), True, 2, full) is None
    # a state layer has no attention call to split around: no piecewise graphs, said at start-up
    mixed = CacheLayout.from_specs([AttentionSpec(1, 4, "float32"), StateSpec((StateTensor("s", (2,), "float32"),))])
    with caplog.at_level("WARNING", logger="vlm_sdk"):
        assert piecewise_stack(Stacked(), True, 1, mixed) is None
    assert "Stacked has state layers" in caplog.text


def test_every_family_declares_a_decoder_stack(family_ckpt):
    """Every registered family's model satisfies the `DecoderStack` protocol (models/base.py), but one with
    state layers (no attention call to split a graph around: it declares none)."""
    from vlm_sdk.model_loader import read_checkpoint
    from vlm_sdk.models.base import DecoderLayerHalves, DecoderStack
    from vlm_sdk.models.registry import resolve
    from vlm_sdk.protocol.cache_layout import CacheLayout
    info = read_checkpoint(family_ckpt[1])
    model = resolve([info.architecture]).meta_model(info.hf_config, torch.float32)
    stack = model.decoder_stack()
    if CacheLayout.from_specs(model.cache_specs(torch.float32)).has_state:
        assert stack is None
        return
    assert isinstance(stack, DecoderStack) and all(isinstance(layer, DecoderLayerHalves) for layer in stack.layers)
    assert len(stack.layers) == model.num_layers and stack.position_rows in (1, 3)
