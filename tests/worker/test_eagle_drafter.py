"""The EAGLE-3 drafter's bookkeeping (worker/eagle_drafter.py): every proposal the engine receives while a request
runs in prefill chunks, verification steps and rollbacks equals the draft run densely, from scratch, over the
sequence as it stood (the target's aux states of one whole-sequence forward, the draft's rows t = 0..n-2 with
token t + 1, then its k autoregressive steps). The draft's attention is made to mix positions (random q/k), so a
draft K/V at a wrong slot, a missing prefill row or a stale rejected row would change the drafts."""
import pytest
import torch

from vlm_sdk import LLM, SamplingParams
from vlm_sdk.multimodal.prompts import TokensPrompt
from vlm_sdk.testing.eagle3 import make_token_local, write_eagle3_draft
from vlm_sdk.testing.families import fixtures
from vlm_sdk.testing.hooks import local_worker

K = 3


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter")
    # the vocabulary the tokenizer has (no padded ids): the generated sequences are fed back as prompts
    target = fixtures("qwen2_5_vl").make_tiny_checkpoint(root / "target", init_std=0.1, vocab_size=1012)
    make_token_local(target, attention_scale=0.5)
    draft = write_eagle3_draft(target, root / "draft", aux_layer_ids=[0, 1, 1], hidden_weight=0.5)
    llm = LLM(str(target), show_progress=False, max_num_batched_tokens=16, enable_prefix_caching=False,
              speculative_config={"method": "eagle3", "model": str(draft), "num_speculative_tokens": K})
    d = local_worker(llm.engine).draft
    g = torch.Generator().manual_seed(0)
    a = d.midlayer.self_attn
    for p in (a.q_proj.weight, a.k_proj.weight):  # attention over the context, not only the row itself
        p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    a.q_proj.bias.mul_(0.25)
    a.k_proj.bias.mul_(0.25)
    return llm, target


def _dense_drafts(draft, tokens: list[int], aux: torch.Tensor) -> list[int]:  # aux [>= n - 1, 3 * hidden]
    """The draft from scratch over tokens[0..n-1]: rows t = 0..n-2, then K - 1 more."""
    keys, values = [], []

    def attend(q, k, v):  # dense causal attention over every row so far, this call's included
        keys.append(k)
        values.append(v)
        kk, vv = torch.cat(keys), torch.cat(values)
        first = kk.shape[0] - q.shape[0]
        from vlm_sdk.worker.eagle_drafter import _attend
        return _attend(q, kk, vv, first)

    n = len(tokens)
    rows = n - 1
    pos = torch.arange(rows).expand(3, -1)
    normed, pre = draft(torch.tensor(tokens[1:]), draft.combine(aux[:rows]), pos, attend)
    out = [int(draft.draft_tokens(normed[-1:])[0])]
    h = pre[-1:]
    for j in range(1, K):
        normed, h = draft(torch.tensor(out[-1:]), h, torch.full((3, 1), rows - 1 + j), attend)
        out.append(int(draft.draft_tokens(normed)[0]))
    return out


def test_every_proposal_equals_the_draft_run_from_scratch(llm):
    llm, target = llm
    engine = llm.engine
    worker = local_worker(engine)
    drafter = worker.runner.drafter
    seen = []
    propose = drafter.propose

    def recording(model, rows, aux, positions):
        drafts, seconds = propose(model, rows, aux, positions)
        for state, _, nxt, proposes in rows:
            if proposes:  # the sequence then: its known tokens up to this step's, then the tokens after them
                known = state.token_ids[:state.num_computed_tokens + 1] + nxt
                seen.append((known, drafts[state.request_id]))
        return drafts, seconds

    drafter.propose = recording
    finals = {}
    try:
        prompts = [list(range(40, 75)), list(range(200, 221)) * 2]
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        for ids in prompts:
            rid = engine.add_request(engine.inputs.build_prompt(TokensPrompt(tuple(ids))), params)
            finals[rid] = list(ids)
        while engine.has_unfinished():
            for o in engine.step():
                finals[o.request_id] += o.new_token_ids
    finally:
        drafter.propose = propose
    s = engine.stats()
    assert s["spec_verify_steps"] > 0 and 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
    assert len(seen) > 20
    # the target's aux states of each whole sequence, from one step over all of it
    whole = LLM(str(target), show_progress=False, enable_prefix_caching=False,
                speculative_config=engine.args.speculative_config)
    model, draft = local_worker(whole.engine).model, worker.draft
    checked = 0
    for full in finals.values():
        whole.generate(TokensPrompt(tuple(full)), SamplingParams(max_tokens=1))
        aux = model.aux_hidden_states()  # [len(full), 3 * hidden]
        assert aux.shape[0] == len(full)
        for known, drafts in seen:
            if full[:len(known)] == known:
                assert drafts == _dense_drafts(draft, known, aux), len(known)
                checked += 1
    assert checked == len(seen)
