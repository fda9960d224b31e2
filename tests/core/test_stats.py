"""Per-model statistics on their own: Triton's counters, batch sizes, histograms and snapshots."""

from __future__ import annotations

import threading

from nereid.stats import Histogram, ModelStats


def test_an_execution_charges_each_request_the_whole_batch():
    stats = ModelStats()
    for _ in range(3):
        stats.record_submitted()
    stats.execution_started()
    stats.execution_finished(rows=5, cost=5, queue_ns=[100, 200, 300], input_ns=10, infer_ns=1000, output_ns=20,
                             succeeded=True)
    for rows in (2, 1, 2):
        stats.record_success(5_000, rows)
    stats.record_failure(7_000, "deadline_exceeded")
    stats.record_dropped(400)
    assert (stats.execution_count, stats.inference_count) == (1, 5)
    assert (stats.queue.count, stats.queue.ns) == (4, 1000)  # three executed, one dropped
    assert (stats.compute_infer.count, stats.compute_infer.ns) == (3, 3000)  # Triton's convention
    assert stats.batches[5].compute_infer.count == 1 and stats.batches[5].compute_infer.ns == 1000
    assert (stats.success.count, stats.fail.count) == (3, 1)
    assert stats.failures_by_reason == {"deadline_exceeded": 1}
    batcher = stats.batcher
    assert (batcher.total_submitted, batcher.total_completed, batcher.avg_batch_size) == (3, 3, 5.0)


def test_a_failed_execution_counts_its_queue_time_and_batch_but_no_execution_or_compute():
    stats = ModelStats()
    stats.execution_started()
    stats.execution_finished(rows=3, cost=3, queue_ns=[100, 200], input_ns=10, infer_ns=0, output_ns=0,
                             succeeded=False)
    # Triton's execution_count, compute times and batch_stats count successful executions only.
    assert (stats.execution_count, stats.compute_infer.count, stats.batches) == (0, 0, {})
    assert sum(stats.compute_seconds.counts) == 0
    assert (stats.queue.count, stats.queue.ns, sum(stats.queue_seconds.counts)) == (2, 300, 2)
    batcher = stats.batcher
    assert (batcher.total_batches, batcher.total_batch_size, batcher.total_completed) == (1, 3, 0)
    assert sum(stats.batch_rows.counts) == 1


def test_histograms_are_cumulative_with_inclusive_bounds():
    histogram = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 3.0):
        histogram.observe(value)
    assert histogram.cumulative() == [("1.0", 2), ("2.0", 3), ("+Inf", 4)]
    assert histogram.sum == 6.0


def test_a_snapshot_is_consistent_and_independent():
    stats = ModelStats()
    stats.record_success(1_000, 2)
    snapshot = stats.snapshot()
    stats.record_success(1_000, 2)
    assert snapshot.success.count == 1 and stats.success.count == 2
    assert snapshot.request_seconds.counts != stats.request_seconds.counts


def test_a_snapshot_shares_nothing_mutable_with_the_live_figures():
    """The snapshot copies field by field (a deepcopy held the lock for ~0.6 ms): every field that can
    change in place must be a copy, including any field added later."""
    def record(stats: ModelStats) -> None:
        stats.record_submitted()
        stats.execution_started()
        stats.execution_finished(3, 3, [10, 20], 1, 2, 3, True)
        stats.record_success(100, 3)
        stats.record_failure(50, "internal")

    stats = ModelStats()
    record(stats)
    snapshot = stats.snapshot()
    frozen = repr(vars(snapshot))
    record(stats)
    assert repr(vars(snapshot)) == frozen  # nothing the live figures changed shows in the snapshot

    def mutable_parts(value, path):
        if isinstance(value, (int, float, str, bytes, tuple, type(None))):
            return
        yield path, value
        inner = value.items() if isinstance(value, dict) else getattr(value, "__dict__", {}).items()
        for key, item in inner:
            yield from mutable_parts(item, f"{path}.{key}")
    live = dict(mutable_parts(stats, "stats"))
    for path, part in mutable_parts(snapshot, "stats"):
        if path != "stats._lock":
            assert part is not live.get(path), f"{path} is shared"


def test_concurrent_recording_loses_nothing():
    stats = ModelStats()

    def record() -> None:
        for _ in range(2000):
            stats.record_success(10, 1)

    threads = [threading.Thread(target=record) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stats.success.count == stats.inference_count == 8000
