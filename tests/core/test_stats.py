"""Per-model statistics on their own: Triton's counters, batch sizes, histograms and snapshots."""

from __future__ import annotations

import threading

from nereid.stats import Histogram, ModelStats, RequestTiming


def ran(queue_ns: int, input_ns: int = 10, infer_ns: int = 1000, output_ns: int = 20) -> RequestTiming:
    """A request's share of a successful execution, as the scheduler fills it in."""
    timing = RequestTiming()
    timing.queue_ns, timing.compute_ns = queue_ns, (input_ns, infer_ns, output_ns)
    return timing


def test_an_execution_charges_each_successful_request_the_whole_batch():
    stats = ModelStats()
    for _ in range(3):
        stats.record_submitted()
    stats.execution_started()
    stats.execution_finished(rows=5, cost=5, requests=3, input_ns=10, infer_ns=1000, output_ns=20, succeeded=True)
    for rows, queue_ns in ((2, 100), (1, 200)):
        stats.record_success(5_000, rows, ran(queue_ns))
    stats.record_failure(6_000, "cancelled")  # the third left as the batch ran: its share is not charged
    stats.record_failure(7_000, "deadline_exceeded")  # never ran
    assert (stats.execution_count, stats.inference_count) == (1, 3)
    assert stats.batches[5].compute_infer.count == 1 and stats.batches[5].compute_infer.ns == 1000
    # Triton's: queue and compute count the successful requests, each charged the whole batch's compute.
    assert (stats.queue.count, stats.queue.ns, sum(stats.queue_seconds.counts)) == (2, 300, 2)
    assert (stats.compute_infer.count, stats.compute_infer.ns) == (2, 2000)
    assert (stats.success.count, stats.fail.count, stats.fail.ns) == (2, 2, 13_000)
    assert sum(stats.request_seconds.counts) == 2  # (successes only, as Triton's request duration)
    assert stats.failures_by_reason == {"cancelled": 1, "deadline_exceeded": 1}
    assert stats.last_inference_ms > 0
    batcher = stats.batcher
    assert (batcher.total_submitted, batcher.total_completed, batcher.avg_batch_size) == (3, 3, 5.0)


def test_failures_count_in_fail_alone():
    """Found by a bug hunt: failed, expired and cancelled requests added to queue and compute (whose counts
    then exceeded the successes perf_analyzer divides them by), to the request and queue histograms that
    README maps to Triton's success-only durations, and set last_inference."""
    stats = ModelStats()
    stats.execution_started()
    stats.execution_finished(rows=3, cost=3, requests=2, input_ns=10, infer_ns=0, output_ns=0, succeeded=False)
    for reason in ("internal", "internal", "deadline_exceeded", "queue_full", "invalid_argument"):
        stats.record_failure(1_000, reason)
    stats.record_success(1_000, 1, RequestTiming())  # (a timing never filled in: no execution of it succeeded)
    # Triton's execution_count, compute times and batch_stats count successful executions only.
    assert (stats.execution_count, stats.compute_infer.count, stats.batches) == (0, 0, {})
    assert (stats.queue.count, sum(stats.queue_seconds.counts), sum(stats.compute_seconds.counts)) == (0, 0, 0)
    assert (stats.fail.count, stats.success.count, sum(stats.request_seconds.counts)) == (5, 1, 1)
    assert stats.last_inference_ms == 0
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
        stats.execution_finished(3, 3, 2, 1, 2, 3, True)
        stats.record_success(100, 3, ran(10))
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


def test_a_snapshot_s_histograms_have_every_field_of_the_live_ones():
    """Found by the statistics hunt: a snapshot's Histogram left out ``created``, so a reader of it met an
    AttributeError."""
    from nereid.stats import Histogram

    stats = ModelStats()
    stats.execution_started()
    stats.execution_finished(3, 3, 2, 1, 2, 3, True)
    snapshot = stats.snapshot()
    histograms = [(name, value) for name, value in vars(stats).items() if isinstance(value, Histogram)]
    assert histograms
    for name, value in histograms:
        assert set(vars(getattr(snapshot, name))) == set(vars(value)), name
        assert getattr(snapshot, name).created == value.created
