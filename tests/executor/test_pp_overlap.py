"""Pipeline micro-batches run the stages at the same time (CPU, gloo: each stage its own process and
threads): the intervals in which the two stages computed overlap with two micro-batches in flight, and
never with the stages taking turns (pipeline_micro_batches=1), on the same model and requests; the greedy
tokens are the same both ways."""
from __future__ import annotations

import pytest

from vlm_sdk import LLM, SamplingParams
from vlm_sdk.testing import make_tiny_checkpoint
from vlm_sdk.testing.pp_hooks import overlap_seconds, stage_busy

pytestmark = pytest.mark.timing  # the overlap needs each stage's compute to outlast the engine's step: run alone


def test_micro_batches_overlap_the_stages_and_turns_never_do(tmp_path_factory):
    # wide enough that a stage's share of a 128-token chunk takes longer than scheduling the next micro-batch
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("pp_overlap"), "qwen2_5_vl", num_layers=4,
                                text_hidden_size=256, intermediate_size=1024)
    prompts = [" ".join(f"word{i * 7 + j}" for j in range(150)) for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(show_progress=False, pipeline_parallel_size=2, num_blocks=200, max_num_batched_tokens=128)
    runs = {}
    for micro_batches in (1, 2):
        with LLM(ckpt, pipeline_micro_batches=micro_batches, **kw) as two:
            tokens = [o.token_ids for o in two.generate(prompts, params)]
            first, last = two.engine.executor.collective_rpc(stage_busy)
            runs[micro_batches] = (tokens, overlap_seconds(first, last), sum(e - s for s, e in last))
    assert runs[1][0] == runs[2][0]
    assert runs[1][1] == 0.0, "stages taking turns never compute at once"
    # two micro-batches: stage 0 computes the next while stage 1 computes the one before, for a good part
    # of stage 1's time (all of it when both have whole cores)
    assert runs[2][1] > 0.2 * runs[2][2], runs
