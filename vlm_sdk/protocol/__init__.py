"""The protocol between the engine and its ranks: every message the engine sends a rank and every
reply, plain data only (SGLang's io_struct, vLLM v1's scheduler output types), and the block
arithmetic both sides must agree on. The engine imports this package and nothing of the worker; the
worker implements it (vlm_sdk/worker/), the executor carries it (vlm_sdk/executor/).

    scheduler_output.py   engine -> ranks, each step: SchedulerOutput (new / cached request data,
                          finished and preempted ids, the grammar bitmask)
    runner_output.py      ranks -> engine, each step: ModelRunnerOutput (tokens, logprobs, the
                          encoder cache's counters), PendingOutput (a launched step not read yet)
    rank.py               ranks -> engine, at start-up: RankLoad (what a rank holds), WeightBytes
    blocks.py             blocks_needed, slot_mapping: how tokens map onto KV blocks and slots
"""
