"""Per-model statistics: Triton's ModelStatistics counters, the batcher's BatchStats,
and the histograms behind the Prometheus metrics.

Every figure is recorded once, here, under one lock; the ModelStatistics RPC
and the ``/metrics`` endpoint both read a :meth:`ModelStats.snapshot`.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import time
from dataclasses import dataclass, field

# Latency buckets from 100 µs to 60 s: gRPC overhead to slow subprocess models.
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


@dataclass
class Duration:
    """A count of events and their summed duration in nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += ns


@dataclass
class BatchDurations:
    """Compute time of the executions of one batch size."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)

    def add(self, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.compute_input.add(input_ns)
        self.compute_infer.add(infer_ns)
        self.compute_output.add(output_ns)


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


class Histogram:
    """Counts per bucket (upper bounds, inclusive, as Prometheus's ``le``) and the sum.

    Cheaper than a prometheus_client Histogram per observation; exported at
    scrape time by nereid.metrics.
    """

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.created = time.time()  # when it began counting: its Prometheus series' _created

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs, cumulative, ending with ``+Inf``."""
        total, buckets = 0, []
        for bound, count in zip([*map(str, map(float, self.bounds)), "+Inf"], self.counts):
            total += count
            buckets.append((bound, total))
        return buckets


class RequestTiming:
    """Where one request's time went in the execution that answered it: filled in by the scheduler when that
    execution succeeds (a model's hooks add the request's own time in them: nereid.model_runner), and charged to
    the model's statistics only if the request then succeeds.

    A plain class with three slots: one is made per request.
    """

    __slots__ = ("queue_ns", "room_wait_ns", "compute_ns")

    def __init__(self) -> None:
        self.queue_ns = 0  # in the queue, waiting for room in it (a stream's request) and for a hook thread
        # Of that, waiting for room in a full queue: what a deadline's message tells apart (queue time spent in a
        # version a reload replaced is no wait for room; the review).
        self.room_wait_ns = 0
        # The execution's (input, infer, output) times, shared by its requests (one with hooks gets its own tuple, its
        # hooks' time added); None: none succeeded for it.
        self.compute_ns: tuple[int, int, int] | None = None


class ModelStats:
    """Thread-safe statistics of one model since it was loaded.

    Request-level figures count requests, as Triton's do: success and fail
    each request answered; queue and the three compute figures only the
    successful ones, so that each count equals the success count (what
    perf_analyzer divides their times by). ``execution_count`` and
    ``batches`` count successful backend executions.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
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
        self.failures_by_reason: dict[str, int] = {}
        self.request_seconds = Histogram(LATENCY_BUCKETS)
        self.queue_seconds = Histogram(LATENCY_BUCKETS)
        self.compute_seconds = Histogram(LATENCY_BUCKETS)  # per execution
        self.batch_rows = Histogram(SIZE_BUCKETS)
        self.batch_cost = Histogram(SIZE_BUCKETS)
        self._running = 0
        self._since = time.monotonic()
        # When these figures began (seconds since the epoch): their Prometheus series' _created, so that a scraper
        # tells an unload and load's fresh figures from counters that went back.
        self.created = time.time()

    def snapshot(self) -> ModelStats:
        """A consistent copy, for reporting while requests keep running.

        Taken under the lock every request's figures go through, so it copies
        field by field: a deepcopy held the lock for about 0.6 ms per model and
        scrape, stalling that model's requests.
        """
        with self._lock:
            self._advance_busy_idle(time.monotonic())
            clone = object.__new__(ModelStats)
            clone.__dict__ = {name: _copied(value) for name, value in self.__dict__.items() if name != "_lock"}
            clone._lock = threading.Lock()
            return clone

    @property
    def running_executions(self) -> int:
        """Executions started and not yet finished."""
        return self._running

    def record_submitted(self) -> None:
        """A request entered the queue."""
        with self._lock:
            self.batcher.total_submitted += 1

    def record_success(self, total_ns: int, rows: int, timing: RequestTiming | None = None) -> None:
        """A request answered with outputs; ``rows`` is its batch size, ``timing`` its share of the execution
        that answered it (charged to queue and compute when that execution ran)."""
        with self._lock:
            self.success.add(total_ns)
            self.inference_count += rows
            self.request_seconds.observe(total_ns / 1e9)
            if timing is not None and timing.compute_ns is not None:
                self.queue.add(timing.queue_ns)
                self.queue_seconds.observe(timing.queue_ns / 1e9)
                # Triton's convention: each request of a batch is charged the whole batch's compute time.
                input_ns, infer_ns, output_ns = timing.compute_ns
                self.compute_input.add(input_ns)
                self.compute_infer.add(infer_ns)
                self.compute_output.add(output_ns)

    def record_failure(self, total_ns: int, reason: str) -> None:
        """A request answered with an error; ``reason`` is a short label (``deadline_exceeded``). As in Triton,
        its time is counted in ``fail`` alone: not in the request and queue histograms, nor in queue or
        compute, whatever part of it ran."""
        with self._lock:
            self.fail.add(total_ns)
            self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + 1

    def execution_started(self) -> None:
        with self._lock:
            self._advance_busy_idle(time.monotonic())
            self._running += 1

    def execution_not_started(self) -> None:
        """What ``execution_started`` counted did not start (its backend raised NotStarted): no execution, no
        batch, whatever is sent again counted when it is."""
        with self._lock:
            self._advance_busy_idle(time.monotonic())
            self._running -= 1

    def execution_finished(self, rows: int, cost: int, requests: int, input_ns: int, infer_ns: int,
                           output_ns: int, succeeded: bool) -> None:
        """An execution of ``rows`` rows serving ``requests`` requests ended (after ``execution_started``)."""
        with self._lock:
            self._advance_busy_idle(time.monotonic())
            self._running -= 1
            batcher = self.batcher
            batcher.total_batches += 1
            batcher.total_batch_size += rows
            batcher.total_batch_cost += cost
            self.batch_rows.observe(rows)
            self.batch_cost.observe(cost)
            if not succeeded:
                # Triton counts executions, compute times and batch statistics of successful
                # executions only: a failed one (a fault partway through) would skew the averages.
                return
            batcher.total_completed += requests
            self.execution_count += 1
            self.last_inference_ms = time.time_ns() // 1_000_000  # (as Triton's: a successful execution's)
            per_size = self.batches.get(rows)
            if per_size is None:
                per_size = self.batches[rows] = BatchDurations()
            per_size.add(input_ns, infer_ns, output_ns)
            self.compute_seconds.observe((input_ns + infer_ns + output_ns) / 1e9)

    def _advance_busy_idle(self, now: float) -> None:
        elapsed = now - self._since
        if self._running:
            self.batcher.busy_time_s += elapsed
        else:
            self.batcher.idle_time_s += elapsed
        self._since = now



def _copied(value):
    """An independent copy of one statistics field (numbers and strings are immutable and shared)."""
    kind = type(value)
    if kind is Duration:
        return Duration(value.count, value.ns)
    if kind is BatchDurations:
        return BatchDurations(_copied(value.compute_input), _copied(value.compute_infer),
                              _copied(value.compute_output))
    if kind is Histogram:
        clone = object.__new__(Histogram)
        clone.bounds, clone.counts, clone.sum = value.bounds, value.counts.copy(), value.sum
        clone.created = value.created  # (every field: a reader of the snapshot's found it missing; the stats hunt)
        return clone
    if kind is BatchStats:
        return dataclasses.replace(value)  # numbers only
    if kind is dict:
        return {key: _copied(item) for key, item in value.items()}
    return value
