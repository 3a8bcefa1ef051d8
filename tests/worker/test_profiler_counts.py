"""What the start-up memory profile counts (issue 19 point 6), checked on the CPU with a meter that
counts live tensor bytes instead of CUDA's allocator: the sampler's temporaries at max_num_seqs rows
(however few tokens the profiled step has), the held image embeddings and the CUDA-graph pool."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vlm_sdk.testing.hooks import local_worker
from vlm_sdk.worker.profiler import profile_peak


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops created and that are still alive; the peak since `reset`."""

    def __init__(self):
        super().__init__()
        self.live = self.top = self.base = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                ptr, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if ptr and ptr not in self.seen:
                    self.seen.add(ptr)
                    self.live += size
                    self.top = max(self.top, self.live)
                    weakref.finalize(t, self._free, ptr, size)
        return out

    def _free(self, ptr, size):
        self.seen.discard(ptr)
        self.live -= size

    def reset(self):
        self.base = self.top = self.live

    def peak(self):
        return self.top - self.base


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    from vlm_sdk import LLM
    llm = LLM(str(tiny_ckpt), device="cpu", show_progress=False)
    return llm.engine


def _profile(engine, num_seqs, graph_batch=None, piecewise_tokens=None, held_tokens=0):
    m = local_worker(engine).model
    meter = LiveBytes()
    with meter:
        return profile_peak(m, engine.processor.largest_image(), num_tokens=8, num_seqs=num_seqs, block_size=16,
                            layout=local_worker(engine).layout, dtype=engine.dtype, device=engine.device,
                            attention=local_worker(engine).ops.attention, graph_batch=graph_batch,
                            piecewise_tokens=piecewise_tokens, held_tokens=held_tokens, meter=meter)


def test_the_sampler_share_grows_with_max_num_seqs_beyond_the_step_tokens(engine):
    vocab = local_worker(engine).model.vocab_size
    few, many = _profile(engine, 4), _profile(engine, 4096)  # the tiny vocabulary: many rows to pass the image
    row = vocab * 4  # one float32 row of logits
    # 4092 more rows: the logits and at least two sampler temporaries per row (penalised copy, probs),
    # though the step has only 8 tokens (the profile once took logits of min(num_seqs, tokens) rows)
    assert many.step_bytes - few.step_bytes >= 4092 * 3 * row
    assert few.step_bytes >= 4 * 2 * row and few.graph_pool_bytes == 0


def test_graph_pool_is_counted_and_grows_with_the_captured_batch(engine):
    small, big = _profile(engine, 4, graph_batch=8), _profile(engine, 4, graph_batch=64)
    hidden = local_worker(engine).model.hidden_size * torch.finfo(engine.dtype).bits // 8
    vocab = local_worker(engine).model.vocab_size * 4  # a float32 row of logits: the graphs compute them
    assert small.graph_pool_bytes >= 8 * (hidden + vocab) and big.graph_pool_bytes >= 64 * (hidden + vocab)
    assert big.graph_pool_bytes > small.graph_pool_bytes
    assert big.total == big.step_bytes + big.graph_pool_bytes


def test_piecewise_graphs_are_counted_buffers_outputs_and_pool(engine):
    """With piecewise graphs: their fixed buffers and per-bucket outputs (arithmetic) plus a pool bounded
    by a plain forward of the budget's tokens (measured); nothing without them."""
    from vlm_sdk.memory.consumers.piecewise import held_bytes
    from vlm_sdk.worker.piecewise_graphs import PiecewiseGraphs
    m = local_worker(engine).model
    off, on = _profile(engine, 4), _profile(engine, 4, piecewise_tokens=8)
    layer = m.decoder.layers[0]
    held = held_bytes(8, m.decoder.cfg.hidden_size, layer.num_heads, layer.num_kv_heads, layer.head_dim,
                      m.position_rows, engine.dtype)
    assert off.piecewise_bytes == 0
    assert on.piecewise_bytes > held > 0 and on.total == on.step_bytes + on.graph_pool_bytes + on.piecewise_bytes
    # the arithmetic bounds what the graphs really allocate for their buffers (capture=False: no pool)
    meter = LiveBytes()
    with meter:
        meter.reset()
        graphs = PiecewiseGraphs(m.decoder, local_worker(engine).runner.caches, max_num_batched_tokens=8, device=engine.device,
                                 dtype=engine.dtype, capture=False)
        buffers = meter.peak()
    assert 0 < buffers <= held
    del graphs


def test_held_image_embeddings_are_alive_during_the_step(engine, monkeypatch):
    """The largest image's embeddings are still held while the LLM step, logits and sampler run."""
    m, alive = local_worker(engine).model, []
    encode, compute_logits = m.encode_images, m.compute_logits
    held = []
    monkeypatch.setattr(m, "encode_images", lambda images: held.append(weakref.ref(out := encode(images))) or out)
    monkeypatch.setattr(m, "compute_logits", lambda h: alive.append(held[0]() is not None) or compute_logits(h))
    _profile(engine, 4)
    assert alive == [True]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profile_counts_the_graph_pool_and_the_sampler_rows(tiny_ckpt):
    """On a GPU with CUDA's own allocator statistics: the graph pool is measured, and more
    max_num_seqs rows raise the step's peak by at least their logits."""
    from vlm_sdk import LLM
    eng = LLM(str(tiny_ckpt), device="cuda", dtype="float32", num_blocks=64, show_progress=False).engine
    m = local_worker(eng).model

    def run(num_seqs, graph_batch):
        return profile_peak(m, eng.processor.largest_image(), num_tokens=8, num_seqs=num_seqs, block_size=16,
                            layout=local_worker(eng).layout, dtype=eng.dtype, device=eng.device, attention=local_worker(eng).ops.attention,
                            graph_batch=graph_batch)
    few, many = run(4, 8), run(4096, 8)
    assert few.graph_pool_bytes > 0 and many.graph_pool_bytes > 0
    assert many.step_bytes - few.step_bytes >= 4092 * m.vocab_size * 4



def test_held_video_rows_beyond_the_largest_image_are_counted(engine):
    """`held_tokens` (a video's items within a step's reach, when more than the largest image) adds its
    rows of embeddings to the step's measured peak, as the estimate counts them
    (MemoryInputs.held_vision_tokens); fewer than the image's rows change nothing."""
    m = local_worker(engine).model
    image = engine.processor.largest_image()
    row = m.encode_images([image]).shape[1] * torch.finfo(engine.dtype).bits // 8
    base = _profile(engine, 4)
    assert _profile(engine, 4, held_tokens=image.num_tokens - 1).step_bytes == base.step_bytes
    # enough rows that the step's phase, not the tower's, is the peak: then each row adds its bytes
    n = 2 * base.step_bytes // row  # rows of twice the tower's peak (the tiny tower's is the larger)
    a, b = (_profile(engine, 4, held_tokens=image.num_tokens + k) for k in (n, n + 10_000))
    assert a.step_bytes > base.step_bytes and b.step_bytes - a.step_bytes == 10_000 * row
