"""Per-model statistics: Triton's ModelStatistics counters and the batcher's BatchStats.

Every figure is recorded once, here; Prometheus metrics (when enabled) are fed
from the same calls through the optional :class:`MetricsSink`.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Duration:
    """A count of events and their summed duration in nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += max(ns, 0)

    def add_many(self, count: int, total_ns: int) -> None:
        self.count += count
        self.ns += max(total_ns, 0)


@dataclass
class BatchDurations:
    """Compute time of the executions of one batch size."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class BatchStats:
    """The dynamic batcher's own figures (the seed's BatchStats).

    ``utilization`` is busy / (busy + idle), where busy is time with at least
    one execution running; 0.0 before either has advanced.
    """

    total_submitted: int = 0
    total_completed: int = 0
    total_batches: int = 0
    total_batch_size: int = 0
    total_batch_cost: int = 0
    busy_time_s: float = 0.0
    idle_time_s: float = 0.0

    @property
    def avg_batch_size(self) -> float:
        return self.total_batch_size / self.total_batches if self.total_batches else 0.0

    @property
    def avg_batch_cost(self) -> float:
        return self.total_batch_cost / self.total_batches if self.total_batches else 0.0

    @property
    def utilization(self) -> float:
        total = self.busy_time_s + self.idle_time_s
        return self.busy_time_s / total if total > 0 else 0.0


class MetricsSink(Protocol):
    """Where observations go besides the counters (Prometheus, see nereid.metrics)."""

    def request_done(self, seconds: float, failure_reason: str | None) -> None: ...
    def execution(self, rows: int, cost: int, queue_s: list[float], compute_s: float) -> None: ...


class ModelStats:
    """Thread-safe statistics of one model since it was loaded.

    Request-level figures (success, fail, queue, compute) count requests;
    ``execution_count`` and ``batches`` count backend executions.
    """

    def __init__(self, sink: MetricsSink | None = None) -> None:
        self._lock = threading.Lock()
        self._sink = sink
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.batches: dict[int, BatchDurations] = {}
        self.batcher = BatchStats()
        self._running = 0
        self._since = time.monotonic()

    def snapshot(self) -> ModelStats:
        """A consistent copy, for reporting while requests keep running."""
        with self._lock:
            self._advance_busy_idle(time.monotonic())
            clone = copy.copy(self)
            for name in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
                         "batches", "batcher"):
                setattr(clone, name, copy.deepcopy(getattr(self, name)))
            return clone

    def record_submitted(self) -> None:
        """A request entered the queue."""
        with self._lock:
            self.batcher.total_submitted += 1

    def record_success(self, total_ns: int, rows: int) -> None:
        """A request answered with outputs; ``rows`` is its batch size."""
        with self._lock:
            self.success.add(total_ns)
            self.inference_count += rows
            self.last_inference_ms = time.time_ns() // 1_000_000
        if self._sink:
            self._sink.request_done(total_ns / 1e9, None)

    def record_failure(self, total_ns: int, reason: str) -> None:
        """A request answered with an error; ``reason`` is a short label (``deadline_exceeded``)."""
        with self._lock:
            self.fail.add(total_ns)
            self.last_inference_ms = time.time_ns() // 1_000_000
        if self._sink:
            self._sink.request_done(total_ns / 1e9, reason)

    def record_dropped(self, queue_ns: int) -> None:
        """Queue time of a request that never ran (expired or cancelled)."""
        with self._lock:
            self.queue.add(queue_ns)

    def execution_started(self) -> None:
        with self._lock:
            self._advance_busy_idle(time.monotonic())
            self._running += 1

    def execution_finished(self) -> None:
        with self._lock:
            self._advance_busy_idle(time.monotonic())
            self._running -= 1

    def record_execution(self, rows: int, cost: int, queue_ns: list[int], input_ns: int, infer_ns: int,
                         output_ns: int, succeeded: bool) -> None:
        """One backend execution of ``rows`` rows serving ``len(queue_ns)`` requests."""
        requests = len(queue_ns)
        with self._lock:
            self.execution_count += 1
            # Triton's convention: each request of a batch is charged the whole batch's compute time.
            self.queue.add_many(requests, sum(queue_ns))
            self.compute_input.add_many(requests, input_ns * requests)
            self.compute_infer.add_many(requests, infer_ns * requests)
            self.compute_output.add_many(requests, output_ns * requests)
            per_size = self.batches.setdefault(rows, BatchDurations())
            per_size.compute_input.add(input_ns)
            per_size.compute_infer.add(infer_ns)
            per_size.compute_output.add(output_ns)
            self.batcher.total_batches += 1
            self.batcher.total_batch_size += rows
            self.batcher.total_batch_cost += cost
            if succeeded:
                self.batcher.total_completed += requests
        if self._sink:
            self._sink.execution(rows, cost, [ns / 1e9 for ns in queue_ns], (input_ns + infer_ns + output_ns) / 1e9)

    def _advance_busy_idle(self, now: float) -> None:
        elapsed = now - self._since
        if self._running:
            self.batcher.busy_time_s += elapsed
        else:
            self.batcher.idle_time_s += elapsed
        self._since = now
