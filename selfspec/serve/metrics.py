"""Prometheus metrics on a private registry (names follow vLLM's, prefixed `selfspec:`).

Request-level series (finished requests, tokens, latencies) are recorded as outputs are dispatched; engine-level
series (queue, batch, KV blocks, preemptions, speculative counters) are read at scrape time from the runner's latest
`EngineStats` snapshot, so a scrape never touches the engine from the HTTP thread.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from selfspec.engine.engine import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineStatsCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineStats | None]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        if s is None:
            return
        yield GaugeMetricFamily("selfspec:num_requests_waiting", "Requests queued for admission", s.waiting)
        yield GaugeMetricFamily("selfspec:num_requests_running", "Requests in the running batch", s.running)
        yield GaugeMetricFamily("selfspec:kv_blocks_used", "KV cache blocks held by requests", s.kv_blocks_used)
        yield GaugeMetricFamily("selfspec:kv_blocks_total", "KV cache blocks in the pool", s.kv_blocks_total)
        yield CounterMetricFamily("selfspec:num_preemptions", "Requests preempted to free KV blocks (recomputed "
                                  "on resume)", s.num_preemptions)
        yield CounterMetricFamily("selfspec:spec_decode_num_drafts", "Sequences that drafted, summed over rounds",
                                  s.num_drafts)
        yield CounterMetricFamily("selfspec:spec_decode_num_draft_tokens", "Tokens proposed by the draft mode",
                                  s.num_draft_tokens)
        yield CounterMetricFamily("selfspec:spec_decode_num_accepted_tokens", "Drafted tokens accepted by verify",
                                  s.num_accepted_tokens)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats | None]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.finished = Counter("selfspec:request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.rejected = Counter("selfspec:request_rejected", "Requests refused with an HTTP error, by status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("selfspec:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("selfspec:generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("selfspec:time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("selfspec:inter_token_latency_seconds",
                             "Time per output token between consecutive outputs of a request (an output of k "
                             "tokens accepted in one round counts k tokens)", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("selfspec:e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS,
                             registry=r)
        r.register(EngineStatsCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
