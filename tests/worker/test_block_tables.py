"""The worker's persistent block tables: a step writes only the entries it changes, the device table
follows the host mirror after `flush`, a reused row reads zeros past its blocks, and the runner's
packed step inputs (numpy over the tables) equal the per-token reference packing."""
import numpy as np
import pytest
import torch

from vlm_sdk.testing.hooks import local_worker
from vlm_sdk.protocol.blocks import slot_mapping
from vlm_sdk.worker.block_table import BlockTables

CPU = torch.device("cpu")


def test_rows_are_written_incrementally_and_flushed():
    t = BlockTables(4, 8, CPU)
    a = t.add(([7, 2, 5],))
    b = t.add(([1],))
    assert (a, b) == (0, 1)
    assert [len(v) for _, v in t._pending] == [3, 1]
    t.flush()
    assert t._pending == [] and torch.equal(t.device_table, t.host)
    t.append(a, ([9],))
    assert [(s, v.tolist()) for s, v in t._pending] == [(a * 8 + 3, [9])]  # only the new entry
    t.flush()
    assert t.device_table[0, a, :4].tolist() == [7, 2, 5, 9] and torch.equal(t.device_table, t.host)
    t.flush()  # nothing changed: nothing to copy
    assert torch.equal(t.rows(np.array([b, a])), torch.tensor([[1, 0, 0, 0], [7, 2, 5, 9]], dtype=torch.int32))


def test_reused_row_reads_zeros_past_its_blocks():
    t = BlockTables(2, 8, CPU)
    a = t.add(([3, 4, 5, 6],))
    t.remove(a)
    assert t.add(([8],)) == a
    t.flush()
    assert t.device_table[0, a, :5].tolist() == [8, 0, 0, 0, 0]


def test_fixed_tables_refuse_to_grow_and_growable_ones_keep_their_rows():
    fixed = BlockTables(1, 2, CPU)
    fixed.add(([1, 2],))
    with pytest.raises(ValueError, match="cannot hold"):
        fixed.add(([3],))
    grow = BlockTables(1, 2, CPU, growable=True)
    a = grow.add(([1, 2],))
    b = grow.add(([3, 4, 5],))
    grow.append(a, ([6, 7, 8],))
    grow.flush()
    assert grow.max_rows >= 2 and grow.max_blocks >= 5
    assert grow.device_table[0, a, :5].tolist() == [1, 2, 6, 7, 8] and grow.device_table[0, b, :3].tolist() == [3, 4, 5]
    assert torch.equal(grow.device_table, grow.host)


def test_runner_packing_equals_the_per_token_reference(tiny_ckpt):
    """A mixed step (a prefill chunk, decodes) packed by `_prepare` against the old list-based packing."""
    from vlm_sdk import LLM, SamplingParams
    llm = LLM(str(tiny_ckpt), device="cpu", show_progress=False, block_size=4)
    eng, seen = llm.engine, []
    runner = local_worker(eng).runner
    prepare = runner._prepare

    def checked(scheduled):
        step = prepare(scheduled)
        ids, slots, tables, pos = [], [], [], []
        for s, n in scheduled:
            a, b = s.num_computed_tokens, s.num_computed_tokens + n
            ids += s.token_ids[a:b]
            slots += slot_mapping(s.block_ids[0], runner.block_size, a, b)
            tables.append(s.block_ids[0])
            pos.append(runner.model.positions(s.prompt_positions, a, b))
        width = max(map(len, tables))
        meta = step.meta.layer(0)  # one attention group: every layer's
        assert step.input_ids.tolist() == ids and meta.slot_mapping.tolist() == slots
        assert meta.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
        assert torch.equal(step.positions, torch.cat(pos, dim=1))
        seen.append(step.meta.layer(0).max_query_len)
        return step
    runner._prepare = checked
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(3):
        eng.add_request(eng.build_prompt([{"role": "user", "content": "hello " * (3 + 5 * i)}]), params)
    for _ in range(3):
        eng.step()
    eng.add_request(eng.build_prompt([{"role": "user", "content": "late " * 9}]), params)  # joins decodes
    while eng.has_unfinished():
        eng.step()
    assert 1 in seen and max(seen) > 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flush_brings_the_device_table_to_the_pinned_host_mirror():
    dev = torch.device("cuda")
    t = BlockTables(4, 8, dev)
    a = t.add(([7, 2, 5],))
    t.flush()
    t.append(a, ([9, 4],))
    t.flush()
    torch.cuda.synchronize()
    assert torch.equal(t.device_table.cpu(), t.host) and t.host.is_pinned()
    assert t.device_table.index_select(1, torch.tensor([a], device=dev))[0, 0, :5].tolist() == [7, 2, 5, 9, 4]


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "internvl_ckpt"])  # 3 position rows (M-RoPE) and 1
def test_graph_step_staging_equals_the_eager_packing(ckpt, request):
    """Decode steps staged straight into the graphs' input buffer hold what `_prepare` packs for the
    same step (ids, slots, lengths, positions, and the block-table rows they gather); the staged step
    then runs eagerly from `_prepare`'s inputs, so the outputs equal a run without graphs."""
    from vlm_sdk import LLM, SamplingParams
    from vlm_sdk.worker.cuda_graphs import DecodeGraphs
    llm = LLM(str(request.getfixturevalue(ckpt)), device="cpu", show_progress=False, block_size=4)
    eng = llm.engine
    runner = local_worker(eng).runner
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    convs = [[{"role": "user", "content": "hi " * (2 + 3 * i)}] for i in range(3)]
    plain = [o.token_ids for o in llm.chat(convs, params)]
    graphs = DecodeGraphs(local_worker(eng).model, runner.caches, runner.layout, max_num_seqs=4, max_model_len=eng.scheduler_config.max_model_len,
                          block_size=4, device=eng.device, attention=local_worker(eng).ops.attention, capture=False)
    seen, last = [], {}
    run_graph = runner._run_graph

    def remember(scheduled):
        last["scheduled"] = scheduled
        return run_graph(scheduled)

    def staged_run(n):
        host = torch.from_numpy(graphs._host[graphs._turn].numpy()[:, :n].copy())  # [5 + rows, n]
        step = runner._prepare(last["scheduled"])
        meta = step.meta.layer(0)  # one attention group
        assert host[0].tolist() == step.input_ids.tolist() and host[1].tolist() == meta.slot_mapping.tolist()
        assert host[graphs.row_len].tolist() == meta.seq_lens.tolist()
        assert torch.equal(host[graphs.row_pos:], step.positions)
        assert host[graphs.row_src].tolist() == [-1] * n  # synchronous steps: every id is on the host
        width = meta.block_tables.shape[1]
        assert torch.equal(graphs.tables.device_table[0].index_select(0, host[graphs.row_table])[:, :width],
                           meta.block_tables)
        seen.append(n)
        embeds = runner.model.embed_tokens(step.input_ids)
        hidden = runner.model(embeds, step.positions, runner.caches, step.meta)  # [n, hidden]
        graphs.logits_and_argmax(hidden)  # the graph's tail: what the runner reads
        return hidden
    runner._run_graph, graphs.run = remember, staged_run
    runner.graphs = graphs
    try:
        assert [o.token_ids for o in llm.chat(convs, params)] == plain
    finally:
        runner.graphs = None
    assert 3 in seen
