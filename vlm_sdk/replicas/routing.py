"""The routing rule, as plain functions of a prompt and the replicas' loads (no Ray here; router.py
runs it inside Ray Serve's request router).

A request goes to the replica most likely to hold its prefix in its KV cache, unless that replica is
loaded past a bound; otherwise to the least loaded one:

  1. keys of the prompt (`prompt_keys`): its first image's content key (the same `ImageInput.key`
     the engine hashes into its KV blocks), then a chain of hashes of its token ids, one per full
     `chunk_tokens` chunk up to `prefix_tokens` (each covers the whole prefix before it, like the
     engine's block hashes), longest prefix first;
  2. the owner is the replica that was last sent a request with the first of these keys found in
     the affinity table (a bounded LRU of `affinity_entries` keys);
  3. it gets the request unless its load passes a bound: `max_queue` requests queued (the generations
     this router sent it and has not seen finish, or running + waiting from its last stats report,
     whichever is larger) or KV usage of `max_kv_usage` or more;
  4. otherwise (and when no key is known) the replica with the fewest of this router's generations in
     flight (current to the request, where a report lags by up to `stats_period_s`), those within the
     bounds first; among equals, the one holding the fewest keys (the smallest share of the cached
     prefixes, as Ray's PrefixCacheAffinityRouter's "smallest tenant"), then the lowest KV usage;
  5. every key of the request is then recorded as owned by the replica that took it.

`policy="round_robin"` ignores keys and loads (the baseline the benchmark and tests compare with).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

POLICIES = ("cache_aware", "round_robin")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "cache_aware"
    max_queue: int = 16  # requests in flight on the owner past which it is passed over
    max_kv_usage: float = 0.9  # KV blocks used / total on the owner past which it is passed over
    chunk_tokens: int = 64  # prompt-prefix hash granularity
    prefix_tokens: int = 4096  # tokens of the prompt that are hashed
    affinity_entries: int = 100_000  # keys remembered
    stats_period_s: float = 0.5  # how often each replica reports its stats (Serve's routing stats)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in ("max_queue", "chunk_tokens", "prefix_tokens", "affinity_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"routing {name} must be 1 or more, got {getattr(self, name)}")
        if not 0.0 < self.max_kv_usage <= 1.0:
            raise ValueError(f"routing max_kv_usage must be in (0, 1], got {self.max_kv_usage}")
        if self.stats_period_s <= 0:
            raise ValueError(f"routing stats_period_s must be positive, got {self.stats_period_s}")


@dataclass(frozen=True)
class Load:
    in_flight: int  # generations this router sent the replica that have not finished (current to the request)
    kv_usage: float  # KV blocks used / total, as last reported
    reported: int = 0  # running + waiting, as last reported (counts other routers' requests too)

    @property
    def queue(self) -> int:
        return max(self.in_flight, self.reported)


def prompt_keys(prompt, chunk_tokens: int, prefix_tokens: int) -> list[str]:
    """The affinity keys of a built prompt (`PromptInputs`), strongest first: the first image's key,
    then the prefix hashes from the longest to the shortest. A cache salt is part of every key (a
    salted prompt shares no blocks with another salt)."""
    salt = (prompt.cache_salt or "").encode()
    keys = []
    if prompt.images and prompt.images[0].key is not None:
        keys.append("image:" + hashlib.sha1(salt + b"|" + prompt.images[0].key).hexdigest())
    ids = prompt.token_ids[:prefix_tokens]
    digest = hashlib.sha1(b"prefix|" + salt)
    chain = []
    for end in range(chunk_tokens, len(ids) + 1, chunk_tokens):
        digest.update(",".join(map(str, ids[end - chunk_tokens:end])).encode() + b";")
        chain.append("prefix:" + digest.copy().hexdigest())
    return keys + chain[::-1]


class AffinityTable:
    """Key -> the replica that last took a request with it; least recently used keys go first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._owners: OrderedDict[str, str] = OrderedDict()

    def owner(self, keys: list[str]) -> str | None:
        for key in keys:
            replica = self._owners.get(key)
            if replica is not None:
                self._owners.move_to_end(key)
                return replica
        return None

    def record(self, keys: list[str], replica: str) -> None:
        for key in keys:
            self._owners[key] = replica
            self._owners.move_to_end(key)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def counts(self) -> dict[str, int]:
        """Replica -> keys it owns."""
        counts: dict[str, int] = {}
        for replica in self._owners.values():
            counts[replica] = counts.get(replica, 0) + 1
        return counts

    def forget(self, replica: str) -> None:
        for key in [k for k, r in self._owners.items() if r == replica]:
            del self._owners[key]

    def __len__(self) -> int:
        return len(self._owners)


def overloaded(load: Load, config: RoutingConfig) -> bool:
    return load.queue >= config.max_queue or load.kv_usage >= config.max_kv_usage


def rank_replicas(owner: str | None, loads: dict[str, Load], owned: dict[str, int],
                  config: RoutingConfig) -> list[list[str]]:
    """The replicas in order of preference, one per rank: the owner first unless it is overloaded (or
    gone), then those within the bounds, then the overloaded ones, each by (in flight, keys owned, KV
    usage). `owned`: replica -> keys it owns (`AffinityTable.counts`)."""
    order = sorted(loads, key=lambda r: (overloaded(loads[r], config), loads[r].in_flight, owned.get(r, 0),
                                         loads[r].kv_usage))
    if owner in loads and not overloaded(loads[owner], config):
        order.remove(owner)
        order.insert(0, owner)
    return [[r] for r in order]
