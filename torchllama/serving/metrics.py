"""The server's Prometheus metrics (`GET /metrics`, through `prometheus-client`).

    torchllama_requests_total{endpoint, finish_reason}   requests answered (endpoint:
                                                           completions, chat, responses,
                                                           messages, embeddings)
    torchllama_prompt_tokens_total                         prompt tokens received
    torchllama_generation_tokens_total                     tokens generated
    torchllama_requests_running / _waiting                 rows in use / requests queued (now)
    torchllama_time_to_first_token_seconds                 request received → first token
    torchllama_inter_token_latency_seconds                 between two tokens of one request
    torchllama_request_duration_seconds                    request received → finished
    torchllama_prefix_cache_{hits,misses}_total            prompts that did / did not reuse a
                                                           cached prefix
    torchllama_prefix_cache_tokens_reused_total            prompt tokens not prefilled thanks
                                                           to it
    torchllama_prefix_cache_{bytes,entries}                its size now (entries: blocks, or
                                                           whole prompts for sliding windows)
    torchllama_prompt_tokens_prefilled_total               prompt tokens the model prefilled

Each app has its own registry (several apps in one process, as in tests, do not collide). Times
are measured in the server (what a client sees, less the network).
"""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()        # no `_created` timestamp series next to every counter

#: Latency buckets in seconds: from a fast decode step (5 ms) to a long queued prompt (60 s).
BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)


class _EngineCollector:
    """Reads the engine's own counters at scrape time (they live in the engine thread)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        engine, cache = self.engine, self.engine.prefix_cache
        yield CounterMetricFamily("torchllama_prompt_tokens_prefilled",
                                  "Prompt tokens the model prefilled (not taken from the "
                                  "prefix cache)", value=engine.prefill_tokens)
        yield CounterMetricFamily("torchllama_decode_steps", "Batched decode steps run",
                                  value=engine.steps)
        if cache is None:
            return
        yield CounterMetricFamily("torchllama_prefix_cache_hits",
                                  "Prompts that reused a cached prefix", value=cache.hits)
        yield CounterMetricFamily("torchllama_prefix_cache_misses",
                                  "Prompts that found no cached prefix", value=cache.misses)
        yield CounterMetricFamily("torchllama_prefix_cache_tokens_reused",
                                  "Prompt tokens not prefilled thanks to the prefix cache",
                                  value=cache.tokens_reused)
        yield GaugeMetricFamily("torchllama_prefix_cache_bytes",
                                "Bytes of keys and values in the prefix cache", value=cache.nbytes)
        yield GaugeMetricFamily("torchllama_prefix_cache_entries",
                                "Blocks in the prefix cache (whole prompts for a model with "
                                "sliding-window layers)",
                                value=len(cache))


class ServerMetrics:
    """The metrics of one server app (see the module docstring).

    Args:
        engine: the app's `Engine` (gauges and its counters are read from it at scrape time).
    """

    def __init__(self, engine):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("torchllama_requests", "Requests answered",
                                ["endpoint", "finish_reason"], registry=registry)
        self.prompt_tokens = Counter("torchllama_prompt_tokens", "Prompt tokens received",
                                     registry=registry)
        self.generation_tokens = Counter("torchllama_generation_tokens", "Tokens generated",
                                         registry=registry)
        Gauge("torchllama_requests_running", "Requests holding a row of the batch",
              registry=registry).set_function(lambda: engine.active)
        Gauge("torchllama_requests_waiting", "Requests queued for a row",
              registry=registry).set_function(lambda: engine.waiting)
        self.ttft = Histogram("torchllama_time_to_first_token_seconds",
                              "Time from receiving a request to its first token",
                              buckets=BUCKETS, registry=registry)
        self.itl = Histogram("torchllama_inter_token_latency_seconds",
                             "Time between two consecutive tokens of one request",
                             buckets=BUCKETS, registry=registry)
        self.duration = Histogram("torchllama_request_duration_seconds",
                                  "Time from receiving a request to its last token",
                                  buckets=BUCKETS, registry=registry)
        registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        """The text exposition format (Prometheus' `text/plain; version=0.0.4`)."""
        return generate_latest(self.registry)
