"""The server's Prometheus metrics, in a registry of their own (several servers may live in one process), exposed as
OpenMetrics text (what Prometheus asks for) or, to a client that asks for ``text/plain`` only, Prometheus text."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

# seconds. A GPU decode step of a 1-3B model is ~4-30 ms with its batch (per-output-token latency), a prefill
# tens of ms (TTFT), a queue from 0 to minutes under overload; the finer buckets sit where a GPU's values fall
TTFT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30,
                60)
TPOT_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.2, 0.5, 1)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.waiting = Gauge("ssmq_queue_length", "requests waiting for a cache slot", registry=r)
        self.running = Gauge("ssmq_running_sequences", "sequences in prefill or decode", registry=r)
        self.slots_used = Gauge("ssmq_cache_slots_used", "cache slots owned by running sequences", registry=r)
        self.slots_total = Gauge("ssmq_cache_slots_total", "cache slots (max batch)", registry=r)
        self.blocks_used = Gauge("ssmq_kv_blocks_used", "KV cache blocks in use (hybrid models)", registry=r)
        self.blocks_total = Gauge("ssmq_kv_blocks_total", "KV cache blocks (hybrid models, float or quantized KV; "
                                  "0 without attention)", registry=r)
        self.prompt_tokens = Counter("ssmq_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("ssmq_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter("ssmq_requests", "finished requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("ssmq_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("ssmq_time_per_output_token_seconds", "time between consecutive generated tokens",
                              buckets=TPOT_BUCKETS, registry=r)
        self.queue = Histogram("ssmq_queue_time_seconds", "arrival to admission into a cache slot",
                               buckets=QUEUE_BUCKETS, registry=r)

    def update(self, stats: dict) -> None:
        """Gauges from ``Engine.stats()``."""
        self.waiting.set(stats["waiting"])
        self.running.set(stats["running"])
        self.slots_used.set(stats["slots_used"])
        self.slots_total.set(stats["slots_total"])
        self.blocks_used.set(stats.get("kv_blocks_used", 0))
        self.blocks_total.set(stats.get("kv_blocks_total", 0))

    def text(self, accept: str = "") -> tuple[bytes, str]:
        """(body, content type) for a request's Accept header: OpenMetrics unless only text/plain is asked for."""
        if "text/plain" in accept and "openmetrics" not in accept:
            return generate_latest(self.registry), PROMETHEUS
        return openmetrics.generate_latest(self.registry), OPENMETRICS
