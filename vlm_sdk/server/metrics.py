"""Prometheus metrics for one server, in a registry of its own (no process-global state).

Cache and queue gauges and the engine's token counters are read from `EngineClient.stats()` when scraped,
so they are never stale; latency histograms are observed by the request handlers as requests end.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "vlm_sdk_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; TTFT of a VLM includes image preprocessing and vision encoding, so the range reaches far
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_PREP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineCollector:
    """Reads the engine's live state at scrape time."""

    def __init__(self, stats: Callable[[], dict], model_name: str):
        self._stats = stats
        self._model = model_name

    def collect(self):
        s = self._stats()
        labels = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric([self._model], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric([self._model], value)
            return c

        total, used = s["kv_blocks_total"], s["kv_blocks_used"]
        yield gauge("kv_blocks_total", "KV cache blocks in the pool", total)
        yield gauge("kv_blocks_used", "KV cache blocks held by requests", used)
        yield gauge("kv_cache_usage_ratio", "kv_blocks_used / kv_blocks_total (1 = full)", used / total if total else 0.0)
        yield gauge("kv_blocks_free", "KV cache blocks free for new tokens", s["kv_blocks_free"])
        yield gauge("kv_block_size_tokens", "tokens per KV block", s["kv_block_size"])
        yield gauge("largest_prompt_tokens_now", "the longest prompt the free KV blocks hold right now "
                    "(at most max_model_len)", s["largest_prompt_tokens_now"])
        yield gauge("num_preemptions_last_minute", "sequences preempted in the last 60 s",
                    s["num_preemptions_last_minute"])
        yield gauge("num_requests_running", "requests scheduled in the running batch", s["num_running"])
        yield gauge("num_requests_waiting", "requests waiting for KV blocks or batch room", s["num_waiting"])
        yield counter("num_preemptions", "sequences preempted (blocks freed, recomputed later)", s["num_preemptions"])
        yield counter("prompt_tokens", "prompt tokens admitted, image tokens included", s["total_prompt_tokens"])
        yield counter("image_tokens", "image tokens admitted", s["total_image_tokens"])
        yield counter("generation_tokens", "tokens generated", s["total_generation_tokens"])
        # caches: hit / query is the hit rate (a rate of the two counters in PromQL)
        yield counter("prefix_cache_hit_tokens", "prompt tokens whose KV came from the prefix cache",
                      s["prefix_cache_hit_tokens"])
        yield counter("prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache",
                      s["prefix_cache_query_tokens"])
        yield gauge("kv_blocks_cached", "free KV blocks still holding reusable prefix content (counted in "
                    "kv_blocks_free: reclaimed when a request needs a fresh block)", s["kv_blocks_cached"])
        yield counter("encoder_cache_hits", "images whose vision embeddings came from the encoder cache",
                      s["encoder_cache_hits"])
        yield counter("encoder_cache_queries", "images looked up in the encoder cache", s["encoder_cache_queries"])
        yield gauge("encoder_cache_bytes", "bytes of vision embeddings held by the encoder cache",
                    s["encoder_cache_bytes"])
        yield gauge("grammar_cache_bytes", "compiled structured-output grammars kept for reuse, by their measured "
                    "bytes (bounded by grammar_cache_memory)", s["grammar_cache_bytes"])
        yield gauge("grammar_process_resident_bytes", "resident memory of the grammar processes, where grammars are "
                    "first compiled (not in process_resident_memory_bytes)", s["grammar_process_bytes"])
        if "spec_draft_tokens" in s:  # speculative decoding (vLLM's spec_decode_* counters; rate = accepted / drafts)
            yield counter("spec_decode_num_drafts", "verifications: (request, step) pairs that verified drafts",
                          s["spec_verify_steps"])
            yield counter("spec_decode_num_draft_tokens", "draft tokens verified", s["spec_draft_tokens"])
            yield counter("spec_decode_num_accepted_tokens", "draft tokens the target accepted",
                          s["spec_accepted_tokens"])
            yield counter("spec_decode_draft_seconds", "seconds spent proposing drafts", s["spec_draft_seconds"])
            yield gauge("spec_decode_acceptance_rate", "accepted / draft tokens since start-up",
                        s["spec_acceptance_rate"])
            yield gauge("spec_decode_mean_accepted_length", "tokens per verification (accepted drafts + the one "
                        "every verification yields) since start-up", s["spec_mean_accepted_length"])
        if "replicas" in s:  # data-parallel replicas (vlm_sdk.replicas): the figures above are sums
            yield from _per_replica(s["replicas"], self._model)


# data-parallel replicas: (metric, doc, stats key or a function of the stats, counter?)
_REPLICA_FIGURES = (
    ("prefix_cache_hit_tokens", "prompt tokens whose KV came from this replica's prefix cache",
     "prefix_cache_hit_tokens", True),
    ("prefix_cache_query_tokens", "prompt tokens looked up in this replica's prefix cache",
     "prefix_cache_query_tokens", True),
    ("prompt_tokens", "prompt tokens this replica admitted", "total_prompt_tokens", True),
    ("num_requests_running", "requests in this replica's running batch", "num_running", False),
    ("num_requests_waiting", "requests waiting on this replica", "num_waiting", False),
    ("kv_cache_usage_ratio", "this replica's kv_blocks_used / kv_blocks_total",
     lambda r: r["kv_blocks_used"] / r["kv_blocks_total"] if r["kv_blocks_total"] else 0.0, False),
)


def _per_replica(replicas: dict, model: str):
    """vlm_sdk_replica_<figure>{model_name, replica}: each replica's own share of the sums."""
    for name, doc, key, is_counter in _REPLICA_FIGURES:
        family = CounterMetricFamily if is_counter else GaugeMetricFamily
        metric = family(PREFIX + "replica_" + name, doc, labels=["model_name", "replica"])
        for replica, stats in sorted(replicas.items()):
            metric.add_metric([model, replica], key(stats) if callable(key) else stats[key])
        yield metric


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict], model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(stats, model_name))
        # process_resident_memory_bytes and friends (Linux): what a soak run watches for leaks
        ProcessCollector(registry=self.registry)
        labels = ["model_name"]

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, registry=self.registry, buckets=buckets).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "from the request's arrival to its first token", _TTFT_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "mean gap between a request's tokens after the first", _TPOT_BUCKETS)
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "from arrival to the last token", _E2E_BUCKETS)
        self.image_preprocess = histogram(
            "image_preprocess_seconds", "decoding images and building the prompt, per request with images",
            _PREP_BUCKETS)
        self._finished = Counter(PREFIX + "request_success", "requests finished, by finish reason",
                                 labels + ["finished_reason"], registry=self.registry)
        self._errors = Counter(PREFIX + "request_errors", "requests refused or failed, by HTTP status",
                               labels + ["status"], registry=self.registry)
        self._model = model_name

    def finished(self, reason: str) -> None:
        self._finished.labels(self._model, reason).inc()

    def error(self, status: int) -> None:
        self._errors.labels(self._model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Timing:
    """When a request arrived and when its first output came (the TTFT histogram's two ends)."""
    __slots__ = ("arrival", "first_token")

    def __init__(self, arrival: float, first_token: float):
        self.arrival = arrival
        self.first_token = first_token
