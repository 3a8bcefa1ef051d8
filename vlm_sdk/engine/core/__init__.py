"""Scheduling and KV bookkeeping on the engine thread: live `Sequence`s, the `Scheduler` (token budget,
admission, preemption) and its plain `SchedulerOutput` for the ranks, the `BlockManager` over the
`BlockPool` (ref counts, the prefix cache keyed by `block_hash`), the preemption watch."""
