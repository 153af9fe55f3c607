"""Prometheus metrics: engine gauges and counters read at scrape time, request latencies observed
by the serving layer. One registry per app, so several servers can live in one process.

Every series carries a `model_name` label (the served name) and is named as vLLM names it, under a
prefix `server.metrics_prefix` chooses: `llmserve_` (the default: `llmserve_num_requests_waiting`)
or `vllm:` (`vllm:num_requests_waiting`), so that dashboards, alerts and autoscalers written for
vLLM read this server unchanged. Counters end in `_total` in the exposition, as vLLM's do."""

from __future__ import annotations

import itertools
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from llmserve.config import EngineConfig
from llmserve.core.scheduler import ITERATION_TOKEN_BUCKETS
from llmserve.engine import Frontend

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                  480.0, 960.0, 1920.0, 7680.0)
"""vLLM's buckets for a request's prefill, decode and inference time."""
_COUNT_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))
"""1, 2, 5, 10, ... 500,000: vLLM's 1-2-5 buckets for tokens and parameters per request."""
PREFIXES = ("llmserve_", "vllm:")


class _EngineCollector:
    def __init__(self, engine: Frontend, prefix: str, model_name: str, config: EngineConfig | None) -> None:
        self.engine, self.prefix, self.model_name, self.config = engine, prefix, model_name, config

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
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_hits),
            ("num_preemptions", "Requests preempted for lack of KV blocks.", s.preemptions),
            ("prompt_tokens", "Prompt tokens computed.", s.prompt_tokens),
            ("generation_tokens", "Tokens generated.", s.generation_tokens),
            ("jump_forward_tokens", "Generated tokens appended by jump-forward decoding, not sampled.",
             s.jumped_tokens),
        ]
        if s.spec_accepted_per_pos:  # speculative decoding is on
            counters += [
                ("spec_decode_num_drafts", "Steps of a request that checked proposed tokens.", s.spec_drafts),
                ("spec_decode_num_draft_tokens", "Proposed tokens checked.", s.spec_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Proposed tokens kept.", s.spec_accepted_tokens),
            ]
        for name, doc, value in counters:
            family = CounterMetricFamily(p + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        if s.spec_accepted_per_pos:
            family = CounterMetricFamily(p + "spec_decode_num_accepted_tokens_per_pos",
                                         "Proposed tokens kept, by their position among a step's proposals.",
                                         labels=["model_name", "position"])
            for position, value in enumerate(s.spec_accepted_per_pos):
                family.add_metric(labels + [str(position)], value)
            yield family
        if s.iteration_tokens:
            family = HistogramMetricFamily(p + "iteration_tokens_total", "Tokens computed per engine step.",
                                           labels=["model_name"])
            cumulative = list(itertools.accumulate(s.iteration_tokens))
            family.add_metric(labels, [(floatToGoString(b), c) for b, c in zip(ITERATION_TOKEN_BUCKETS, cumulative)]
                              + [("+Inf", cumulative[-1])], s.iteration_tokens_sum)
            yield family
        if self.config is not None:  # vLLM's info series: the cache's configuration as labels, value 1
            c = self.config.cache
            info = {"block_size": c.block_size, "cache_dtype": c.kv_cache_dtype,
                    "enable_prefix_caching": c.enable_prefix_caching,
                    "gpu_memory_utilization": c.gpu_memory_utilization, "num_gpu_blocks": s.num_blocks}
            family = GaugeMetricFamily(p + "cache_config_info", "Information of the KV cache's configuration.",
                                       labels=["model_name", *info])
            family.add_metric(labels + [str(v) for v in info.values()], 1)
            yield family


class Metrics:
    def __init__(self, engine: Frontend, model_name: str = "", prefix: str = "llmserve_",
                 config: EngineConfig | None = None) -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"server.metrics_prefix must be one of {PREFIXES}, got {prefix!r}")
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, prefix, model_name, config))
        self.model_name = model_name
        self.request_success = Counter(prefix + "request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.request_errors = Counter(prefix + "request_errors", "Requests answered with an error (before or "
                                      "during their stream), by HTTP status and error type.",
                                      ["model_name", "status", "type"], registry=self.registry)

        def h(name: str, doc: str, buckets=_LATENCY_BUCKETS):
            return Histogram(prefix + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)
        self.ttft = h("time_to_first_token_seconds", "Arrival to first output token.")
        self.itl = h("inter_token_latency_seconds", "Time between output tokens of a request.")
        self.e2e = h("e2e_request_latency_seconds", "Arrival to last output token.")
        self.queue = h("request_queue_time_seconds", "Arrival to first being scheduled.")
        self.prefill = h("request_prefill_time_seconds", "First scheduled to first output token.", _PHASE_BUCKETS)
        self.decode = h("request_decode_time_seconds", "First to last output token.", _PHASE_BUCKETS)
        self.inference = h("request_inference_time_seconds", "First scheduled to last output token.", _PHASE_BUCKETS)
        self.prompt_tokens = h("request_prompt_tokens", "Prompt tokens of a finished request.", _COUNT_BUCKETS)
        self.generation_tokens = h("request_generation_tokens", "Tokens a finished request generated (all its "
                                   "samples).", _COUNT_BUCKETS)
        self.params_n = h("request_params_n", "The n of a finished request.", _COUNT_BUCKETS)
        self.params_max_tokens = h("request_params_max_tokens", "The max_tokens of a finished request.",
                                   _COUNT_BUCKETS)

    def count_error(self, err) -> None:
        """Count an APIError sent to a client."""
        self.request_errors.labels(self.model_name, str(err.status), err.type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, params=None) -> RequestTimer:
        """For one prompt's samples; `params` (their SamplingParams) for the per-request parameter series."""
        return RequestTimer(self, params)


class RequestTimer:
    """Observes one request's latencies from its stream of cumulative outputs."""

    def __init__(self, metrics: Metrics, params=None) -> None:
        self.m = metrics
        self.params = params
        self.start = self.last = time.monotonic()
        self.first: float | None = None  # when the first output token came
        self.tokens = 0
        self.queue_s: float | None = None

    def update(self, out) -> None:
        now = time.monotonic()
        tokens = sum(len(c.token_ids) for c in out.outputs)
        if tokens > self.tokens:
            if self.tokens == 0:
                self.m.ttft.observe(now - self.start)
                self.first = now
            else:
                gap = (now - self.last) / (tokens - self.tokens)
                for _ in range(tokens - self.tokens):
                    self.m.itl.observe(gap)
            self.tokens, self.last = tokens, now
        if self.queue_s is None and out.queue_time_s is not None:
            self.m.queue.observe(out.queue_time_s)
            self.queue_s = out.queue_time_s
        if out.finished:
            self.m.e2e.observe(now - self.start)
            scheduled = self.start + (self.queue_s or 0.0)
            if self.first is not None:
                self.m.prefill.observe(max(self.first - scheduled, 0.0))
                self.m.decode.observe(now - self.first)
            self.m.inference.observe(max(now - scheduled, 0.0))
            self.m.prompt_tokens.observe(len(out.prompt_token_ids))
            self.m.generation_tokens.observe(tokens)
            if self.params is not None:
                self.m.params_n.observe(self.params.n)
                if self.params.max_tokens is not None:
                    self.m.params_max_tokens.observe(self.params.max_tokens)
            for c in out.outputs:
                self.m.request_success.labels(self.m.model_name, c.finish_reason or "unknown").inc()
