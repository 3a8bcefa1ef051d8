"""Scheduling and cache bookkeeping on the engine thread: live `Sequence`s, the `Scheduler` (token budget,
admission, preemption) and its plain `SchedulerOutput` for the ranks, the `CacheCoordinator` running a
manager per cache kind (`cache_managers.py`) over the `BlockPool` and `StatePool` (ref counts, the prefix
cache keyed by `block_hash`), the preemption watch."""
