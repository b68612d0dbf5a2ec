"""Prometheus metrics (prefix `dilaserve:`). Per-request figures are observed as requests
end; the cluster's state (instances, batch tokens, planner runs, restarts) is read from
the engine at scrape time, so nothing has to be kept in step by hand."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dilaserve.engine import Engine, EngineClient, RequestStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TAU_BUCKETS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Metrics:
    """One registry per server: no process-global metric state."""

    def __init__(self, engine: Engine | EngineClient) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "dilaserve:request_latency_seconds",
            "End-to-end latency of finished requests",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "dilaserve:request_queue_seconds",
            "Time from arrival to the first step",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.slo_met = Counter(
            "dilaserve:slo_met", "Requests finished within their SLO", registry=r
        )
        self.slo_missed = Counter(
            "dilaserve:slo_missed", "Requests finished after their SLO", registry=r
        )
        self.steps = Histogram(
            "dilaserve:request_steps",
            "Denoising steps per finished request",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.tokens_per_step = Histogram(
            "dilaserve:tokens_per_step",
            "Tokens committed per step, per finished request",
            buckets=(1, 2, 4, 8, 16, 32),
            registry=r,
        )
        self.tau = Histogram(
            "dilaserve:threshold",
            "Confidence threshold of every step",
            buckets=TAU_BUCKETS,
            registry=r,
        )
        self.migrations = Counter("dilaserve:migrations", "Request migrations", registry=r)
        self.requests = Counter(
            "dilaserve:requests", "Requests by outcome", ["outcome"], registry=r
        )
        r.register(EngineCollector(engine))

    def finished(self, stats: RequestStats) -> None:
        self.requests.labels("finished").inc()
        self.latency.observe(stats.latency_s)
        self.queue.observe(stats.queue_s)
        (self.slo_met if stats.slo_met else self.slo_missed).inc()
        self.steps.observe(stats.steps)
        if stats.steps:
            self.tokens_per_step.observe(stats.completion_tokens / stats.steps)
        for tau in stats.taus:
            self.tau.observe(tau)
        self.migrations.inc(stats.migrations)

    def ended(self, outcome: str) -> None:
        """A request that did not finish: rejected, cancelled, failed or stopped early."""
        self.requests.labels(outcome).inc()


class EngineCollector(Collector):
    def __init__(self, engine: Engine | EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        status = self.engine.status()
        batch = GaugeMetricFamily(
            "dilaserve:instance_batch_tokens", "Tokens of the step in flight", labels=["instance"]
        )
        serving = [i for i in status.instances if i.registered]
        per_degree = Tally(inst.tp for inst in serving)
        for inst in serving:
            batch.add_metric([str(inst.id)], inst.batch_tokens)
        yield batch
        degrees = GaugeMetricFamily(
            "dilaserve:instances", "Serving instances per TP degree", labels=["tp"]
        )
        for tp, count in sorted(per_degree.items()):
            degrees.add_metric([str(tp)], count)
        yield degrees
        yield GaugeMetricFamily(
            "dilaserve:active_requests", "Requests in the engine", value=status.active_requests
        )
        yield CounterMetricFamily(
            "dilaserve:planner_runs", "Planner runs", value=status.planner_runs
        )
        yield CounterMetricFamily(
            "dilaserve:planner_solve_seconds",
            "Time spent solving plans",
            value=status.planner_solve_seconds,
        )
        yield CounterMetricFamily(
            "dilaserve:worker_restarts", "Worker processes restarted", value=status.worker_restarts
        )
        prefix = status.prefix_cache
        yield CounterMetricFamily(
            "dilaserve:prefix_cache_queries",
            "Prompt tokens looked up in the instances' prefix stores",
            value=prefix.get("queried_tokens", 0),
        )
        yield CounterMetricFamily(
            "dilaserve:prefix_cache_hits",
            "Prompt tokens found in a prefix store (their prefill saved)",
            value=prefix.get("hit_tokens", 0),
        )
