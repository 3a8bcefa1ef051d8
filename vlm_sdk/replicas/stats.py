"""Every replica's engine stats, for the server's /metrics and `stats()`.

Each replica pushes `AsyncLLM.stats()` to a `StatsBoard` actor whenever Serve collects its routing
stats (every `stats_period_s`); the server reads the board. A replica that stops reporting (it died)
leaves the sums after `stale_s`: its counters leave with it, as a restarted server's would.
"""
from __future__ import annotations

import time

# the same on every replica (the same model and cache settings): the smallest is reported, not a sum
_SHARED = ("kv_block_size", "max_model_len", "kv_bytes_per_block", "spec_num_speculative_tokens")


class StatsBoard:
    """A Ray actor (made with `ray.remote(StatsBoard)`): replica id -> (time reported, stats)."""

    def __init__(self):
        self._stats: dict[str, tuple[float, dict]] = {}
        self._pids: dict[str, int] = {}  # replica -> its process (what an operator, or a test, kills)

    def put(self, replica: str, stats: dict, pid: int) -> None:
        self._stats[replica] = (time.monotonic(), stats)
        self._pids[replica] = pid

    def pids(self) -> dict[str, int]:
        """Every replica that ever reported -> its process id."""
        return dict(self._pids)

    def read(self, stale_s: float) -> dict[str, dict]:
        now = time.monotonic()
        for replica in [r for r, (t, _) in self._stats.items() if now - t > stale_s]:
            del self._stats[replica]
        return {r: s for r, (_, s) in self._stats.items()}


def combine(per_replica: dict[str, dict]) -> dict:
    """One engine's `stats()` keys for the whole set (sums; `_SHARED` keys the smallest), plus
    `num_replicas` and `replicas` (id -> that replica's own stats)."""
    total: dict = {}
    for stats in per_replica.values():
        for key, value in stats.items():
            if key in _SHARED:
                total[key] = min(total.get(key, value), value)
            elif isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value
    if "spec_verify_steps" in total:  # speculative decoding's ratios: of the sums, not a sum of ratios
        d, a, r = total["spec_draft_tokens"], total["spec_accepted_tokens"], total["spec_verify_steps"]
        total["spec_acceptance_rate"] = a / d if d else 0.0
        total["spec_mean_accepted_length"] = 1 + a / r if r else 0.0
    total.update(num_replicas=len(per_replica), replicas=dict(per_replica))
    return total
