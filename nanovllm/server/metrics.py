"""Prometheus metrics of the server, named like vLLM's with our prefix (``nanovllm:...``).

The engine thread reports each loop turn as an IterationStats; ``ServerMetrics.record`` turns it into gauges,
counters and histograms (prometheus-client is thread-safe). Each server has its own registry, so several apps can
live in one process (tests). With several front-end processes (``--api-server-count``, server/front_ends.py),
PROMETHEUS_MULTIPROC_DIR is set: each process writes its values there, and ``render`` sums them all (gauges: the
most recent value).
"""

from __future__ import annotations

import os

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from nanovllm.engine.async_engine import IterationStats

# No "<name>_created" series beside each counter and histogram (a process-wide switch; vLLM does the same).
prometheus_client.disable_created_metrics()

PREFIX = "nanovllm:"
FINISH_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0]
TPOT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
E2E_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0]


class ServerMetrics:
    content_type = prometheus_client.CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=registry,
                         multiprocess_mode="mostrecent").labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be (fully) scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that were prefilled.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Requests preempted (KV cache full) to be recomputed.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative decoding: verify steps of a request.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Speculative decoding: draft tokens accepted.")
        self._spec_accepted_per_position = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by position in the draft (0 = first).",
            labels + ["position"], registry=registry)
        self.spec_mean_acceptance_length = gauge(
            "spec_decode_mean_acceptance_length",
            "Speculative decoding: tokens a verify step produced on average (1 + accepted / drafts) since start.")
        self._spec_totals = [0, 0]  # drafts, accepted tokens
        self._finished = Counter(PREFIX + "request_success", "Finished requests, by finish reason "
                                 "(abort: cancelled, e.g. the client disconnected; error: "
                                 "a fault while processing that request).",
                                 labels + ["finished_reason"], registry=registry)
        for reason in FINISH_REASONS:
            self._finished.labels(model_name, reason)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.time_per_output_token = histogram("time_per_output_token_seconds",
                                               "Mean time per output token after the first, per request.",
                                               TPOT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between two outputs of a request.",
                                             TPOT_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.model_name = model_name

    def record(self, stats: IterationStats) -> None:
        # counters first, gauges last: a scrape that sees the server idle also sees every request it finished
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.preemptions.inc(stats.num_preemptions)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.spec_drafts.inc(stats.spec_num_drafts)
        self.spec_draft_tokens.inc(stats.spec_num_draft_tokens)
        self.spec_accepted_tokens.inc(stats.spec_num_accepted_tokens)
        for position, accepted in enumerate(stats.spec_accepted_per_position):
            if accepted:
                self._spec_accepted_per_position.labels(self.model_name, str(position)).inc(accepted)
        if stats.spec_num_drafts:
            self._spec_totals[0] += stats.spec_num_drafts
            self._spec_totals[1] += stats.spec_num_accepted_tokens
            self.spec_mean_acceptance_length.set(1 + self._spec_totals[1] / self._spec_totals[0])
        for t in stats.time_to_first_token:
            self.time_to_first_token.observe(t)
        for t in stats.inter_token_latency:
            self.inter_token_latency.observe(t)
        for request in stats.finished:
            self._finished.labels(self.model_name, request.finish_reason).inc()
            self.e2e_latency.observe(request.e2e_latency)
            if request.time_per_output_token is not None:
                self.time_per_output_token.observe(request.time_per_output_token)
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)

    def render(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # every front end's values, summed
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
