"""Per-model counters behind the ModelStatistics RPC (Triton's statistics extension)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class Duration:
    """A count of events and their summed duration in nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += max(ns, 0)


@dataclass
class BatchDurations:
    """Compute time of executions of one batch size."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


class ModelStats:
    """Thread-safe statistics of one model since it was loaded.

    Request-level figures (success, fail, queue, compute) count requests;
    ``execution_count`` and ``batches`` count backend executions.
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

    def record_success(self, total_ns: int, rows: int) -> None:
        """A request answered with outputs; ``rows`` is its batch size."""
        with self._lock:
            self.success.add(total_ns)
            self.inference_count += rows
            self.last_inference_ms = time.time_ns() // 1_000_000

    def record_failure(self, total_ns: int) -> None:
        """A request answered with an error (after it was accepted for this model)."""
        with self._lock:
            self.fail.add(total_ns)
            self.last_inference_ms = time.time_ns() // 1_000_000

    def record_execution(self, batch_size: int, requests: int, queue_ns: list[int],
                         input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One backend execution of ``batch_size`` rows serving ``requests`` requests."""
        with self._lock:
            self.execution_count += 1
            for ns in queue_ns:
                self.queue.add(ns)
            for _ in range(requests):
                self.compute_input.add(input_ns)
                self.compute_infer.add(infer_ns)
                self.compute_output.add(output_ns)
            per_size = self.batches.setdefault(batch_size, BatchDurations())
            per_size.compute_input.add(input_ns)
            per_size.compute_infer.add(infer_ns)
            per_size.compute_output.add(output_ns)

    def record_queue_only(self, queue_ns: int) -> None:
        """Queue time of a request that never ran (expired or cancelled)."""
        with self._lock:
            self.queue.add(queue_ns)
