"""Prometheus metrics at ``/metrics`` on ``server.metrics_addr``, with prometheus_client.

Each server has its own registry (several servers can share a process, as in
the tests). Counters and histograms are fed by :class:`~nereid.stats.ModelStats`
through a per-model :class:`ModelMetrics`; gauges that describe the present
(queue depth, models by state, batcher utilization) are read at scrape time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from nereid.repository import ModelRepository

# Latency buckets from 100 µs to 60 s: gRPC overhead to slow subprocess models.
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class ServerMetrics:
    """All metrics of one server."""

    def __init__(self, repository: ModelRepository) -> None:
        self.registry = CollectorRegistry()
        labels = ["model"]
        self.success = Counter("nereid_request_success", "Requests answered with outputs.", labels,
                               registry=self.registry)
        self.failure = Counter("nereid_request_failure", "Requests answered with an error, by reason.",
                               ["model", "reason"], registry=self.registry)
        self.request_duration = Histogram("nereid_request_duration_seconds", "Time from arrival to answer.",
                                          labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_duration = Histogram("nereid_queue_duration_seconds", "Time a request waited in the queue.",
                                        labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.compute_duration = Histogram("nereid_compute_duration_seconds",
                                          "Time of one execution (batch assembly, inference, split).",
                                          labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_size = Histogram("nereid_batch_size", "Rows per execution.", labels, buckets=SIZE_BUCKETS,
                                    registry=self.registry)
        self.batch_cost = Histogram("nereid_batch_cost", "Summed request cost per execution.", labels,
                                    buckets=SIZE_BUCKETS, registry=self.registry)
        self.load_duration = Histogram("nereid_model_load_duration_seconds", "Time to load a model.", labels,
                                       buckets=(0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                                       registry=self.registry)
        self.registry.register(_RepositoryCollector(repository))
        self._http = None

    def model(self, name: str) -> ModelMetrics:
        """The label-bound metrics of one model."""
        return ModelMetrics(self, name)

    def serve(self, addr: str) -> int:
        """Start the HTTP endpoint on ``host:port``; returns the bound port."""
        host, _, port = addr.rpartition(":")
        host = host.strip("[]")

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._http = make_server(host, int(port), make_wsgi_app(self.registry), Server, handler_class=_QuietHandler)
        # A short poll interval keeps shutdown quick (the default waits up to 0.5 s).
        threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05},
                         name="nereid-metrics", daemon=True).start()
        return self._http.server_port

    def close(self) -> None:
        """Stop the HTTP endpoint."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class ModelMetrics:
    """One model's Prometheus children; implements nereid.stats.MetricsSink."""

    def __init__(self, metrics: ServerMetrics, model: str) -> None:
        self._metrics = metrics
        self._model = model
        self._success = metrics.success.labels(model)
        self._request = metrics.request_duration.labels(model)
        self._queue = metrics.queue_duration.labels(model)
        self._compute = metrics.compute_duration.labels(model)
        self._rows = metrics.batch_size.labels(model)
        self._cost = metrics.batch_cost.labels(model)

    def request_done(self, seconds: float, failure_reason: str | None) -> None:
        self._request.observe(seconds)
        if failure_reason is None:
            self._success.inc()
        else:
            self._metrics.failure.labels(self._model, failure_reason).inc()

    def execution(self, rows: int, cost: int, queue_s: list[float], compute_s: float) -> None:
        for seconds in queue_s:
            self._queue.observe(seconds)
        self._compute.observe(compute_s)
        self._rows.observe(rows)
        self._cost.observe(cost)

    def loaded(self, seconds: float) -> None:
        self._metrics.load_duration.labels(self._model).observe(seconds)


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr for every scrape."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class _RepositoryCollector(Collector):
    """Gauges read from the repository at scrape time."""

    def __init__(self, repository: ModelRepository) -> None:
        self._repository = repository

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from nereid.repository import ModelState

        depth = GaugeMetricFamily("nereid_queue_depth", "Requests waiting in the model's queue.", labels=["model"])
        utilization = GaugeMetricFamily("nereid_batch_utilization",
                                        "Batcher busy / (busy + idle) since the model loaded.", labels=["model"])
        states = GaugeMetricFamily("nereid_models", "Model folders by state.", labels=["state"])
        counts = {state.value: 0 for state in ModelState}
        for entry in self._repository.entries():
            counts[entry.state.value] += 1
            if entry.loaded is not None:
                depth.add_metric([entry.name], entry.loaded.scheduler.queue_depth)
                utilization.add_metric([entry.name], entry.loaded.stats.snapshot().batcher.utilization)
        for state, count in counts.items():
            states.add_metric([state], count)
        yield from (depth, utilization, states)
