"""Prometheus metrics at ``/metrics`` on ``server.metrics_addr``, with prometheus_client.

Each server has its own registry (several servers can share a process, as in
the tests). Request and batch figures are not observed a second time: a
collector reads each model's :class:`~nereid.stats.ModelStats` snapshot at
scrape time, which keeps the request path free of metric locks.
"""

from __future__ import annotations

import socket
import threading
from typing import TYPE_CHECKING, Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from nereid.repository import ModelRepository
    from nereid.stats import Histogram as StatsHistogram

# (metric name, help, ModelStats attribute)
_HISTOGRAMS = (
    ("nereid_request_duration_seconds", "Time from arrival to answer.", "request_seconds"),
    ("nereid_queue_duration_seconds", "Time a request waited in the queue.", "queue_seconds"),
    ("nereid_compute_duration_seconds", "Time of one execution (batch assembly, inference, split).",
     "compute_seconds"),
    ("nereid_batch_size", "Rows per execution.", "batch_rows"),
    ("nereid_batch_cost", "Summed request cost per execution.", "batch_cost"),
)


class ServerMetrics:
    """All metrics of one server."""

    def __init__(self, repository: ModelRepository) -> None:
        self.registry = CollectorRegistry()
        self.load_duration = Histogram("nereid_model_load_duration_seconds", "Time to load a model.", ["model"],
                                       buckets=(0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                                       registry=self.registry)
        self.registry.register(_RepositoryCollector(repository))
        self._http = None

    def model_loaded(self, model: str, seconds: float) -> None:
        """Record one model load."""
        self.load_duration.labels(model).observe(seconds)

    def serve(self, addr: str) -> int:
        """Start the HTTP endpoint on ``host:port``; returns the bound port."""
        host, _, port = addr.rpartition(":")
        host = host.strip("[]")

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        try:
            self._http = make_server(host, int(port), make_wsgi_app(self.registry), Server,
                                     handler_class=_QuietHandler)
        except OSError as err:
            raise OSError(f"cannot serve metrics on {addr} (server.metrics_addr): {err.strerror or err}") from err
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


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr for every scrape."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class _RepositoryCollector(Collector):
    """Every per-model figure, read from the repository at scrape time."""

    def __init__(self, repository: ModelRepository) -> None:
        self._repository = repository

    def collect(self) -> Iterator[Metric]:
        from nereid.repository import ModelState

        success = CounterMetricFamily("nereid_request_success", "Requests answered with outputs.", labels=["model"])
        failure = CounterMetricFamily("nereid_request_failure", "Requests answered with an error, by reason.",
                                      labels=["model", "reason"])
        submitted = CounterMetricFamily("nereid_batcher_submitted", "Requests admitted to the model's queue.",
                                        labels=["model"])
        completed = CounterMetricFamily("nereid_batcher_completed", "Requests whose execution succeeded.",
                                        labels=["model"])
        histograms = {attr: HistogramMetricFamily(name, text, labels=["model"]) for name, text, attr in _HISTOGRAMS}
        depth = GaugeMetricFamily("nereid_queue_depth", "Requests waiting in the model's queue.", labels=["model"])
        utilization = GaugeMetricFamily("nereid_batch_utilization",
                                        "Busy / (busy + idle) of the model's executions since it loaded.",
                                        labels=["model"])
        states = GaugeMetricFamily("nereid_models", "Model folders by state.", labels=["state"])
        counts = {state.value: 0 for state in ModelState}
        for entry in self._repository.entries():
            counts[entry.state.value] += 1
            if entry.loaded is None:
                continue
            stats = entry.loaded.stats.snapshot()
            success.add_metric([entry.name], stats.success.count)
            submitted.add_metric([entry.name], stats.batcher.total_submitted)
            completed.add_metric([entry.name], stats.batcher.total_completed)
            for reason, count in sorted(stats.failures_by_reason.items()):
                failure.add_metric([entry.name, reason], count)
            for attr, family in histograms.items():
                histogram: StatsHistogram = getattr(stats, attr)
                family.add_metric([entry.name], histogram.cumulative(), histogram.sum)
            depth.add_metric([entry.name], entry.loaded.scheduler.queue_depth)
            utilization.add_metric([entry.name], stats.batcher.utilization)
        for state, count in counts.items():
            states.add_metric([state], count)
        yield from (success, failure, submitted, completed, *histograms.values(), depth, utilization, states)
