"""Prometheus metrics: engine gauges and counters read at scrape time, request latencies observed
by the serving layer. One registry per app, so several servers can live in one process.

Every series carries a `model_name` label (the served name) and is named as vLLM names it, under a
prefix `server.metrics_prefix` chooses: `llmserve_` (the default: `llmserve_num_requests_waiting`)
or `vllm:` (`vllm:num_requests_waiting`), so that dashboards, alerts and autoscalers written for
vLLM read this server unchanged. Counters end in `_total` in the exposition, as vLLM's do."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmserve.engine import Frontend

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PREFIXES = ("llmserve_", "vllm:")


class _EngineCollector:
    def __init__(self, engine: Frontend, prefix: str, model_name: str) -> None:
        self.engine, self.prefix, self.model_name = engine, prefix, model_name

    def collect(self):
        s = self.engine.snapshot()
        p, labels = self.prefix, [self.model_name]
        for name, doc, value in [
            ("num_requests_running", "Requests in the running set.", s.running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s.kv_usage),
        ]:
            family = GaugeMetricFamily(p + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        for name, doc, value in [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_hits),
            ("num_preemptions", "Requests preempted for lack of KV blocks.", s.preemptions),
            ("prompt_tokens", "Prompt tokens computed.", s.prompt_tokens),
            ("generation_tokens", "Tokens generated.", s.generation_tokens),
            ("jump_forward_tokens", "Generated tokens appended by jump-forward decoding, not sampled.",
             s.jumped_tokens),
        ]:
            family = CounterMetricFamily(p + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family


class Metrics:
    def __init__(self, engine: Frontend, model_name: str = "", prefix: str = "llmserve_") -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"server.metrics_prefix must be one of {PREFIXES}, got {prefix!r}")
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, prefix, model_name))
        self.model_name = model_name
        self.request_success = Counter(prefix + "request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.request_errors = Counter(prefix + "request_errors", "Requests answered with an error (before or "
                                      "during their stream), by HTTP status and error type.",
                                      ["model_name", "status", "type"], registry=self.registry)

        def h(name: str, doc: str):
            return Histogram(prefix + name, doc, ["model_name"], buckets=_LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)
        self.ttft = h("time_to_first_token_seconds", "Arrival to first output token.")
        self.itl = h("inter_token_latency_seconds", "Time between output tokens of a request.")
        self.e2e = h("e2e_request_latency_seconds", "Arrival to last output token.")
        self.queue = h("request_queue_time_seconds", "Arrival to first being scheduled.")

    def count_error(self, err) -> None:
        """Count an APIError sent to a client."""
        self.request_errors.labels(self.model_name, str(err.status), err.type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Observes one request's latencies from its stream of cumulative outputs."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self.start = self.last = time.monotonic()
        self.tokens = 0
        self.queue_seen = False

    def update(self, out) -> None:
        now = time.monotonic()
        tokens = sum(len(c.token_ids) for c in out.outputs)
        if tokens > self.tokens:
            if self.tokens == 0:
                self.m.ttft.observe(now - self.start)
            else:
                gap = (now - self.last) / (tokens - self.tokens)
                for _ in range(tokens - self.tokens):
                    self.m.itl.observe(gap)
            self.tokens, self.last = tokens, now
        if not self.queue_seen and out.queue_time_s is not None:
            self.m.queue.observe(out.queue_time_s)
            self.queue_seen = True
        if out.finished:
            self.m.e2e.observe(now - self.start)
            for c in out.outputs:
                self.m.request_success.labels(self.m.model_name, c.finish_reason or "unknown").inc()
