"""The per-model scheduler: bounded admission, deadlines, cancellation, draining, output checks, coroutine backends."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

from nereid.backend import REQUEST_DEADLINE_NS
from nereid.batching import BatchPolicy
from nereid.dtypes import DType
from nereid.dataplane import _run_when_room
from nereid.errors import (DeadlineExceeded, InvalidArgument, ModelFailure, ModelKilled, ModelRetired, NotStarted,
                           Unavailable)
from nereid.scheduler import ModelScheduler, QueueRefusal, queue_full
from nereid.settings import DEFAULT_QUEUE_CAPACITY, BatchingSettings
from nereid.signature import ModelSignature, TensorSpec
from nereid.stats import ModelStats, RequestTiming
from nereid.tensors import NamedTensor
from support import (COUNT_THE_RUN, echo_main, expect_grpc_error, fail_thread_starts, reference_counting_only,
                     scrape)

SIGNATURE = ModelSignature((TensorSpec("x", DType.FP32, (2,)),), (TensorSpec("y", DType.FP32, (2,)),), 4)


class GatedDouble:
    """An in-process backend that doubles its input once its gate opens; records what it ran."""

    platform = "test"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.ran: list[float] = []
        self.fail_next = False

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        self.gate.wait(10)
        self.ran.append(float(inputs[0].data[0, 0]))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        return [NamedTensor("y", DType.FP32, inputs[0].data * 2)]


def rows(value: float) -> list[NamedTensor]:
    return [NamedTensor("x", DType.FP32, np.full((1, 2), value, dtype=np.float32))]


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


async def caller_gone_while_it_runs(scheduler: ModelScheduler) -> None:
    """Submit one request and cancel its caller once its execution runs on a worker thread (a client whose
    deadline passed, or who went away: the thread cannot be stopped), the caller's task ended."""
    caller = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
    await until(lambda: scheduler.running_threads == 1)
    caller.cancel()
    await asyncio.gather(caller, return_exceptions=True)


def test_full_queue_refuses_at_once_and_memory_stays_bounded() -> None:
    async def scenario() -> None:
        backend = GatedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=3, instances=1, stats=ModelStats())
        first = asyncio.create_task(scheduler.submit(rows(0), 1, 0))
        await until(lambda: scheduler.queue_depth == 0 and len(backend.ran) == 0 and first is not None)
        await asyncio.sleep(0.05)  # the first request is now running (blocked at the gate)
        waiting = [asyncio.create_task(scheduler.submit(rows(i), 1, 0)) for i in range(1, 4)]
        await until(lambda: scheduler.queue_depth == 3)
        refused = 0
        for i in range(40):  # offer many times the capacity: each is refused at once
            with pytest.raises(Unavailable, match=r"model 'm': queue is full \(queue_capacity 3, "
                                                  r"models\[\]\.queue_capacity in nereid.yaml\)"):
                await scheduler.submit(rows(100 + i), 1, 0)
            refused += 1
        assert scheduler.queue_depth == 3 and refused == 40
        backend.gate.set()
        results = await asyncio.gather(first, *waiting)
        assert [float(r[0].data[0, 0]) for r in results] == [0, 2, 4, 6]
        assert backend.ran == [0, 1, 2, 3]  # arrival order; nothing refused ever ran
        await scheduler.drain()
    run(scenario())


def test_a_full_queue_of_the_default_capacity_says_it_is_the_default() -> None:
    # A Triton user's queue is unbounded by default: "queue_capacity 128 in nereid.yaml" sent them looking for a
    # value their nereid.yaml did not hold (the Triton client hunt).
    message = str(queue_full("m", DEFAULT_QUEUE_CAPACITY))
    assert message == ("model 'm': queue is full (queue_capacity 128 (the default), models[].queue_capacity in "
                       "nereid.yaml); retry later")
    assert "default" not in str(queue_full("m", 3))


def test_a_full_queue_names_the_configuration_file_the_server_was_started_with() -> None:
    """`nereid serve --config prod.yaml`: the client was sent to a queue_capacity "in nereid.yaml"."""
    async def scenario() -> None:
        backend = GatedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=1, instances=1, stats=ModelStats(),
                                   config_name="prod.yaml")
        admitted = [asyncio.create_task(scheduler.submit(rows(0), 1, 0))]
        await until(lambda: scheduler.running_threads == 1)
        admitted.append(asyncio.create_task(scheduler.submit(rows(1), 1, 0)))
        await until(lambda: scheduler.queue_depth == 1)
        with pytest.raises(Unavailable, match=r"^model 'm': queue is full \(queue_capacity 1, "
                                              r"models\[\]\.queue_capacity in prod\.yaml\); retry later$"):
            await scheduler.submit(rows(2), 1, 0)
        backend.gate.set()
        await asyncio.gather(*admitted)
        await scheduler.drain()
    run(scenario())


def test_expired_request_is_answered_and_never_runs() -> None:
    async def scenario() -> None:
        backend = GatedDouble()
        stats = ModelStats()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=stats)
        timings = [RequestTiming() for _ in range(3)]
        blocker = asyncio.create_task(scheduler.submit(rows(1), 1, 0, timings[0]))
        await asyncio.sleep(0.05)
        expiring = asyncio.create_task(scheduler.submit(rows(2), 1, time.monotonic_ns() + 20_000_000, timings[1]))
        keeps = asyncio.create_task(scheduler.submit(rows(3), 1, time.monotonic_ns() + 60_000_000_000, timings[2]))
        await asyncio.sleep(0.1)  # the 20 ms deadline passes while it waits
        backend.gate.set()
        await blocker
        with pytest.raises(DeadlineExceeded, match="model 'm': deadline passed .* it was not run"):
            await expiring
        assert float((await keeps)[0].data[0, 0]) == 6
        assert backend.ran == [1, 3]
        assert [t.compute_ns is not None for t in timings] == [True, False, True] and stats.execution_count == 2
        assert timings[2].queue_ns >= 50_000_000 and timings[2].compute_ns[1] > 0  # it waited behind the blocker
        await scheduler.drain()
    run(scenario())


def test_a_request_out_of_time_on_arrival_at_an_idle_model_is_not_said_to_have_queued() -> None:
    """Found by a bug hunt: it was told "(waited 0.0 ms in the queue)", though it never queued."""
    async def scenario() -> None:
        backend = GatedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=ModelStats())
        with pytest.raises(DeadlineExceeded, match=r"^model 'm': deadline passed [0-9.]+ ms before the request could "
                                                   r"start; it was not run$"):
            await scheduler.submit(rows(1), 1, time.monotonic_ns() - 1_000_000)
        assert backend.ran == []
        await scheduler.drain()
    run(scenario())


def test_a_request_out_of_time_meeting_a_full_queue_is_told_its_deadline_passed() -> None:
    """A request that reaches a full queue after its deadline (one whose hook ran late, say) was told QueueFull
    ("retry later"), where DEADLINE_EXCEEDED was due; a request still in time is told QueueFull."""
    async def scenario() -> None:
        backend = GatedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=1, instances=1, stats=ModelStats())
        blocker = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
        await until(lambda: scheduler.running_threads == 1)
        queued = asyncio.create_task(scheduler.submit(rows(2), 1, 0))
        await until(lambda: scheduler.queue_depth == 1)
        with pytest.raises(DeadlineExceeded, match=r"^model 'm': deadline passed [0-9.]+ ms before the request could "
                                                   r"start; it was not run$"):
            await scheduler.submit(rows(3), 1, time.monotonic_ns() - 1_000_000)
        with pytest.raises(Unavailable, match="queue is full"):
            await scheduler.submit(rows(4), 1, time.monotonic_ns() + 60_000_000_000)
        backend.gate.set()
        await asyncio.gather(blocker, queued)
        assert backend.ran == [1, 2]
        await scheduler.drain()
    run(scenario())


def test_a_call_made_as_soon_as_the_last_one_is_answered_finds_room_in_the_queue() -> None:
    """Found by a bug hunt: a pipeline's sequential sub-calls to a model of queue_capacity 1 were refused QueueFull,
    every time: the call after an answered one came before the freed instance had taken the queued request."""
    async def scenario() -> None:
        backend = GatedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=1, instances=1, stats=ModelStats())
        depth_seen = []

        async def two_calls_in_a_row() -> list[float]:  # as a pipeline makes them
            (one,) = await scheduler.submit(rows(1), 1, 0)
            depth_seen.append(scheduler.queue_depth)
            (two,) = await scheduler.submit(rows(4), 1, 0)
            return [float(one.data[0, 0]), float(two.data[0, 0])]
        pipeline = asyncio.create_task(two_calls_in_a_row())
        await until(lambda: scheduler.running_threads == 1)
        queued = asyncio.create_task(scheduler.submit(rows(2), 1, 0))
        await until(lambda: scheduler.queue_depth == 1)
        with pytest.raises(Unavailable, match="queue is full"):  # (while every instance is busy: full indeed)
            await scheduler.submit(rows(3), 1, 0)
        backend.gate.set()
        assert await pipeline == [2, 8] and float((await queued)[0].data[0, 0]) == 4
        assert depth_seen == [1]  # the second call came while the queued request had not been taken yet
        assert backend.ran == [1, 2, 4]
        await scheduler.drain()
    run(scenario())


class SteppedDouble(GatedDouble):
    """A GatedDouble whose executions each wait for a permit of their own (``permits.release()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.permits = threading.Semaphore(0)

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        self.permits.acquire(timeout=10)
        self.gate.set()
        return super().infer(inputs)


def test_a_call_made_as_soon_as_a_queued_one_is_answered_finds_room_in_the_queue() -> None:
    """The same through the batcher (the pipeline's first call queued): its execution freed its instance only at its
    task's end, a loop turn after the caller had resumed and been refused."""
    async def scenario() -> None:
        backend = SteppedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=1, instances=1, stats=ModelStats())
        blocker = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
        await until(lambda: scheduler.running_threads == 1)

        async def two_calls_in_a_row() -> list[float]:
            (one,) = await scheduler.submit(rows(2), 1, 0)  # queued behind the blocker
            (two,) = await scheduler.submit(rows(4), 1, 0)
            return [float(one.data[0, 0]), float(two.data[0, 0])]
        pipeline = asyncio.create_task(two_calls_in_a_row())
        await until(lambda: scheduler.queue_depth == 1)
        backend.permits.release()  # the blocker ends; the pipeline's first call runs, waiting for its permit
        await until(lambda: scheduler.queue_depth == 0 and scheduler.running_threads == 1 and backend.ran == [1])
        other = asyncio.create_task(scheduler.submit(rows(3), 1, 0))  # the queue is full again
        await until(lambda: scheduler.queue_depth == 1)
        backend.permits.release()  # the pipeline's first call is answered: it calls again at once
        for _ in range(2):
            backend.permits.release()
        assert await pipeline == [4, 8] and float((await other)[0].data[0, 0]) == 6
        assert float((await blocker)[0].data[0, 0]) == 2 and backend.ran == [1, 2, 3, 4]
        await scheduler.drain()
    run(scenario())


def test_cancelled_queued_request_is_dropped() -> None:
    async def scenario() -> None:
        backend = GatedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=ModelStats())
        blocker = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
        await asyncio.sleep(0.05)
        cancelled = asyncio.create_task(scheduler.submit(rows(2), 1, 0))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        backend.gate.set()
        await blocker
        await scheduler.drain()
        assert cancelled.cancelled() and backend.ran == [1]
    run(scenario())


def test_cancelled_and_expired_requests_free_their_places_in_a_full_queue() -> None:
    async def scenario() -> None:
        backend = GatedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=2, instances=1, stats=ModelStats())
        blocker = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
        await asyncio.sleep(0.05)  # running, blocked at the gate
        expiring = asyncio.create_task(scheduler.submit(rows(3), 1, time.monotonic_ns() + 300_000_000))
        await until(lambda: scheduler.queue_depth == 1)
        # Second in line, so finding it compares it with the first (their inputs are arrays of 2 rows).
        leaving = asyncio.create_task(scheduler.submit(rows(2), 1, 0))
        await until(lambda: scheduler.queue_depth == 2)
        leaving.cancel()
        await until(lambda: scheduler.queue_depth == 1)  # a caller that left frees its place at once
        filler = asyncio.create_task(scheduler.submit(rows(5), 1, 0))  # the queue is full again
        await until(lambda: scheduler.queue_depth == 2)
        # The expiring one's deadline passes while the instance is still busy: it is answered then, and
        # its place is free.
        with pytest.raises(DeadlineExceeded):
            await asyncio.wait_for(expiring, 1)
        assert scheduler.queue_depth == 1
        admitted = asyncio.create_task(scheduler.submit(rows(4), 1, 0))
        backend.gate.set()
        await blocker
        assert float((await admitted)[0].data[0, 0]) == 8 and float((await filler)[0].data[0, 0]) == 10
        assert backend.ran == [1, 5, 4]
        await scheduler.drain()
    run(scenario())


def test_drain_finishes_queued_work_then_refuses() -> None:
    async def scenario() -> None:
        backend = GatedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=8, instances=2, stats=ModelStats())
        pending = [asyncio.create_task(scheduler.submit(rows(i), 1, 0)) for i in range(5)]
        await asyncio.sleep(0.05)
        drained = asyncio.create_task(scheduler.drain())
        await asyncio.sleep(0.05)
        with pytest.raises(Unavailable, match="being unloaded"):
            await scheduler.submit(rows(9), 1, 0)
        assert not drained.done()
        backend.gate.set()
        await drained
        assert sorted(float(p.result()[0].data[0, 0]) for p in pending) == [0, 2, 4, 6, 8]
    run(scenario())


def test_a_drain_that_hands_over_refuses_the_queued_requests_as_retired_and_finishes_the_running_and_hooked() -> None:
    """A version a reload replaced (``successor``): its queued requests are refused ModelRetired naming it, which
    the data plane sends to the version now serving, their time queued counted; a request a preprocess hook ran
    for (``admitted``), one the successor's input check refuses (the review: a bundle compiled for other sizes),
    and the running one finish here."""
    async def scenario() -> None:
        backend = GatedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=8, instances=1, stats=ModelStats(),
                                   policy=BatchPolicy(enabled=False))
        successor = ModelScheduler("m", GatedDouble(), SIGNATURE, capacity=8, instances=1, stats=ModelStats())

        def refuse_threes(inputs: list[NamedTensor]) -> None:
            if inputs[0].data[0, 0] == 3:
                raise InvalidArgument("model 'm': not compiled for that")
        successor.input_check = refuse_threes
        running = asyncio.create_task(scheduler.submit(rows(0), 1, 0))
        await until(lambda: scheduler.running_threads == 1)
        timing = RequestTiming()
        queued = asyncio.create_task(scheduler.submit(rows(1), 1, 0, timing))
        refused_there = asyncio.create_task(scheduler.submit(rows(3), 1, 0))
        with scheduler.hooked_request():
            hooked = asyncio.create_task(scheduler.submit(rows(2), 1, 0, admitted=True))
            await until(lambda: scheduler.queue_depth == 3)
            await asyncio.sleep(0.01)
            drained = asyncio.create_task(scheduler.drain(successor=successor))
            with pytest.raises(ModelRetired, match="model 'm' was replaced by a new version before this request "
                                                   "could start") as refused:
                await queued
            # Queue time, and no wait for room, which a deadline's message would tell of (the review).
            assert refused.value.scheduler is scheduler and refused.value.handed_over
            assert timing.queue_ns >= 10e6 and timing.room_wait_ns == 0
            assert scheduler.queue_depth == 2 and not running.done()
            backend.gate.set()
            assert [float((await task)[0].data[0, 0]) for task in (running, refused_there, hooked)] == [0, 6, 4]
        await drained
        assert backend.ran == [0, 3, 2]
        await successor.drain()
    run(scenario())


def test_a_request_waiting_for_batch_company_runs_at_once_when_drain_begins() -> None:
    """Defect (found by the scheduler's property tests): draining, a request still waited out its batching
    window for company that could no longer come, so a grace shorter than the window gave up on it
    (Unavailable) with an instance idle."""
    async def scenario() -> None:
        backend = GatedDouble()
        backend.gate.set()
        policy = BatchPolicy(True, max_rows=4, max_delay_ns=10_000_000_000)  # a 10 s window
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=ModelStats(),
                                   policy=policy)
        waiting = asyncio.create_task(scheduler.submit(rows(3), 1, 0))
        await asyncio.sleep(0.05)
        assert backend.ran == []  # waiting for company
        started = time.monotonic()
        assert await scheduler.drain(grace_s=2.0) is True
        assert time.monotonic() - started < 1.0
        assert float(waiting.result()[0].data[0, 0]) == 6
    run(scenario())


def test_backend_exception_fails_only_its_request() -> None:
    async def scenario() -> None:
        backend = GatedDouble()
        backend.gate.set()
        backend.fail_next = True
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=ModelStats())
        with pytest.raises(ModelFailure, match="model 'm' failed: RuntimeError: boom"):
            await scheduler.submit(rows(1), 1, 0)
        assert float((await scheduler.submit(rows(2), 1, 0))[0].data[0, 0]) == 4
        await scheduler.drain()
    run(scenario())


@pytest.mark.parametrize("outputs, message", [
    ([], r"returned outputs \[\], expected \['y'\]"),
    # Defect: anything but a list was "returned outputs None", as if no output had a name.
    ("nonsense", r"^model 'm' returned str 'nonsense', expected a list of NamedTensor \(outputs \['y'\]\)$"),
    (None, r"^model 'm' returned NoneType None, expected a list of NamedTensor"),
    ([NamedTensor("y", DType.FP64, np.zeros((1, 2)))], "as FP64, expected FP32"),
    ([NamedTensor("y", DType.FP32, np.zeros((2, 2), np.float32))], r"shape \[2, 2\], expected \[1, 2\]"),
])
def test_outputs_are_held_to_the_signature(outputs, message) -> None:
    class Wrong:
        platform = "test"

        def infer(self, inputs):
            return outputs

    async def scenario() -> None:
        scheduler = ModelScheduler("m", Wrong(), SIGNATURE, capacity=4, instances=1, stats=ModelStats())
        with pytest.raises(ModelFailure, match=message):
            await scheduler.submit(rows(1), 1, 0)
        await scheduler.drain()
    run(scenario())


def test_outputs_returned_as_a_tuple_are_taken_as_the_hooks_take_them() -> None:
    """Found by a plugin hunt: a backend's infer returning a tuple of NamedTensor was refused ("returned tuple of
    1 item(s)"), where the hooks take "a list (or tuple)"."""
    class AsTuple:
        platform = "test"

        def infer(self, inputs):
            return (NamedTensor("y", DType.FP32, inputs[0].data * 3),)

    async def scenario() -> None:
        scheduler = ModelScheduler("m", AsTuple(), SIGNATURE, capacity=4, instances=1, stats=ModelStats())
        (out,) = await scheduler.submit(rows(2), 1, 0)
        assert out.name == "y" and float(out.data[0, 0]) == 6
        await scheduler.drain()
    run(scenario())


def test_a_queued_request_is_answered_at_its_deadline_while_every_instance_is_busy() -> None:
    """Defect: the batcher looks at the queue only when an instance comes free, so a request that expired
    behind a long execution was told so only when that execution ended."""
    async def scenario() -> None:
        backend, stats = GatedDouble(), ModelStats()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=stats)
        running = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
        await until(lambda: scheduler.running_threads == 1)
        now = time.monotonic_ns()
        later = asyncio.create_task(scheduler.submit(rows(3), 1, now + 2_000_000_000))
        soon = asyncio.create_task(scheduler.submit(rows(2), 1, now + 100_000_000))  # earlier, arriving later
        with pytest.raises(DeadlineExceeded, match="it was not run"):
            await asyncio.wait_for(soon, 1)
        assert time.monotonic_ns() - now < 500_000_000 and scheduler.queue_depth == 1
        backend.gate.set()
        assert float((await running)[0].data[0, 0]) == 2 and float((await later)[0].data[0, 0]) == 6
        assert backend.ran == [1, 3]
        await asyncio.wait_for(scheduler.drain(), 5)
    run(scenario())


def test_a_request_expired_on_arrival_is_refused_and_leaves_the_scheduler_idle() -> None:
    async def scenario() -> None:
        backend = GatedDouble()
        backend.gate.set()
        stats = ModelStats()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=stats)
        with pytest.raises(DeadlineExceeded, match="model 'm': deadline passed .* it was not run"):
            await scheduler.submit(rows(1), 1, time.monotonic_ns() - 1)
        assert backend.ran == [] and stats.queue.count == 0 and stats.batcher.total_submitted == 1
        await asyncio.wait_for(scheduler.drain(), 5)  # nothing runs, so unloading must not wait
    run(scenario())


def test_drain_after_an_abandoned_request_never_blocks_the_loop_and_is_bounded_by_the_grace() -> None:
    """Defect: a cancelled caller freed its slot while its thread ran on, and drain() then joined
    the thread on the event loop, freezing every other coroutine until the backend returned."""
    async def scenario() -> None:
        backend = GatedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=ModelStats())
        await caller_gone_while_it_runs(scheduler)
        assert scheduler.running_threads == 1
        # The slot stays taken while the thread runs: a new request queues instead of overcommitting.
        queued = asyncio.create_task(scheduler.submit(rows(2), 1, 0))
        await until(lambda: scheduler.queue_depth == 1)
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        beating = asyncio.create_task(heartbeat())
        terminated: list[float] = []

        async def terminate() -> None:
            terminated.append(time.monotonic())
            backend.gate.set()  # what terminate_running does for a real backend: end the work

        started = time.monotonic()
        finished = await scheduler.drain(0.3, terminate)
        elapsed = time.monotonic() - started
        beating.cancel()
        assert finished
        assert terminated and terminated[0] - started >= 0.29  # ended only once the grace had passed
        assert elapsed < 3
        assert ticks >= 15  # the loop kept running the whole time
        with pytest.raises(Unavailable, match="it was not run"):  # answered: not started after the grace
            await queued
    run(scenario())


@pytest.mark.parametrize("fails", [False, True], ids=["succeeds", "fails"])
def test_an_execution_whose_caller_left_counts_when_and_as_its_thread_ends(fails: bool) -> None:
    """Defect: a request that started at once and whose client left while the thread ran counted its
    execution as failed at that moment: a model that ran to completion showed no execution, no
    compute time, and was idle in the busy figures while its thread still ran."""
    async def scenario() -> None:
        backend, stats = GatedDouble(), ModelStats()
        backend.fail_next = fails
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=stats)
        await caller_gone_while_it_runs(scheduler)
        assert stats.batcher.total_batches == 0 and stats._running == 1  # still running: not counted yet
        time.sleep(0.05)
        backend.gate.set()
        await until(lambda: scheduler.running_threads == 0)
        assert stats._running == 0 and stats.batcher.total_batches == 1
        assert stats.execution_count == (0 if fails else 1)
        if not fails:  # (the execution's compute; no request's, as none was answered)
            assert stats.batches[1].compute_infer.ns >= 50_000_000 and stats.compute_infer.count == 0
        await asyncio.wait_for(scheduler.drain(), 5)
    run(scenario())


@pytest.mark.parametrize("fault", ["model_failure", "bug"])
def test_the_fault_of_an_execution_whose_callers_left_is_logged(fault: str, caplog) -> None:
    """Found by a bug hunt: a run killed at timeout_s (or crashing) after its client's deadline had passed was
    neither logged nor anything else: a model hanging on every request whose clients give up first left no
    trace. It is logged as a fault answered to its caller is (the requests count once, as they ended)."""
    class Failing(GatedDouble):
        def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
            self.gate.wait(10)
            if fault == "model_failure":
                raise ModelFailure("model 'm' timed out after 1 s (timeout_s in nereid.yaml)")
            raise KeyError("weights")

    async def scenario() -> None:
        backend = Failing()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=ModelStats())
        await caller_gone_while_it_runs(scheduler)
        backend.gate.set()
        await until(lambda: scheduler.running_threads == 0)
        await asyncio.wait_for(scheduler.drain(), 5)
    run(scenario())
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    expected = ("model 'm' timed out after 1 s" if fault == "model_failure" else "model 'm' raised")
    assert len(errors) == 1 and errors[0].startswith(expected), errors


NO_THREAD = ("model 'm': the server could not start a thread for this run (RuntimeError: can't start new thread: a "
             "process or thread limit, such as ulimit -u or a container's pids limit, is reached); try again later")


@pytest.mark.parametrize("batching", [False, True])
def test_a_run_no_thread_could_start_for_is_answered_unavailable_and_never_runs(batching, monkeypatch, caplog) -> None:
    """Found by the resource-limits hunt: at a process limit (ulimit -u, a pids limit) a run's worker thread could
    not start, and its requests were answered INTERNAL as the model's fault (logged with a traceback), yet the run
    stayed queued and ran once a thread came, and the count of running threads went below zero. They are answered
    UNAVAILABLE, logged as a WARNING without a traceback; the run never happens, and counts as no execution."""
    async def scenario() -> None:
        backend = GatedDouble()
        backend.gate.set()
        stats = ModelStats()
        policy = BatchPolicy(True, max_rows=2, max_delay_ns=50_000_000) if batching else None
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=stats, policy=policy)
        refused = fail_thread_starts(monkeypatch, "nereid-m_")
        answers = await asyncio.gather(*(scheduler.submit(rows(i), 1, 0) for i in range(2 if batching else 1)),
                                       return_exceptions=True)
        assert refused == ["nereid-m_0"]
        assert [(type(answer), str(answer)) for answer in answers] == [(Unavailable, NO_THREAD)] * len(answers)
        assert scheduler.running_threads == 0 and scheduler.idle
        (y,) = await scheduler.submit(rows(5), 1, 0)  # the next thread starts: served
        assert y.data.tolist() == [[10, 10]]
        await asyncio.wait_for(scheduler.drain(), 5)
        assert backend.ran == [5.0] and scheduler.running_threads == 0
        snapshot = stats.snapshot()
        assert (snapshot.execution_count, snapshot.batcher.total_batches, snapshot.running_executions) == (1, 1, 0)
    run(scenario())
    logged = [(r.levelname, r.getMessage(), r.exc_info) for r in caplog.records if r.name == "nereid.scheduler"]
    assert logged == [("WARNING", NO_THREAD, None)]


# An echo of one FP32 [4] tensor that counts its runs in calls.txt, in its folder.
COUNTED_ECHO_MAIN = echo_main(COUNT_THE_RUN)


def test_a_served_request_no_thread_could_start_for_is_unavailable_and_never_runs(repo, serve, monkeypatch) -> None:
    """The resource-limits hunt's case over gRPC: 200 requests answered INTERNAL "can't start new thread" all ran
    once threads were available again, ahead of the next request. The one refused is UNAVAILABLE (counted as such),
    and the model runs once, for the request that was served."""
    import tritonclient.grpc as triton

    folder = repo.python("counted", main=COUNTED_ECHO_MAIN)
    server = serve(repo.write_config())
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    tensor = triton.InferInput("input", [1, 4], "FP32")
    tensor.set_data_from_numpy(x)
    refused = fail_thread_starts(monkeypatch, "nereid-counted_")
    expect_grpc_error("UNAVAILABLE", lambda: server.client.infer("counted", [tensor]),
                      "model 'counted': the server could not start a thread for this run (RuntimeError: can't start "
                      "new thread: a process or thread limit", "try again later")
    assert refused == ["nereid-counted_0"]
    np.testing.assert_array_equal(server.client.infer("counted", [tensor]).as_numpy("output"), x)
    assert (folder / "calls.txt").read_text() == "1\n"  # (the refused one, queued, ran ahead of this one)
    stats = server.server.repository.ready_model("counted").stats.snapshot()
    assert (stats.execution_count, stats.failures_by_reason) == (1, {"unavailable": 1})
    samples = scrape(server.server.metrics_port)
    assert samples[("nereid_request_failure_total", (("model", "counted"), ("reason", "unavailable")))] == 1


class UnreadableOutput:
    """An output whose name raises when read (a model's own wrapper object, half built)."""

    @property
    def name(self) -> str:
        raise RuntimeError("not built yet")


class GatedUnreadable(GatedDouble):
    """GatedDouble, whose first call returns an UnreadableOutput."""

    def infer(self, inputs: list[NamedTensor]) -> list:
        outputs = super().infer(inputs)
        return [UnreadableOutput()] if len(self.ran) == 1 else outputs


def test_an_execution_whose_caller_left_gives_its_slot_back_whatever_its_outputs_raise_when_read() -> None:
    """Defect: counting the ended execution let through any error but a NereidError, out of the loop's callback
    and before the slot kept for the thread was given back: the model ran one instance short for good, was never
    idle again, and counted an execution running."""
    async def scenario() -> None:
        backend, stats = GatedUnreadable(), ModelStats()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=stats)
        await caller_gone_while_it_runs(scheduler)
        backend.gate.set()
        await until(lambda: scheduler.running_threads == 0)
        await asyncio.sleep(0.02)  # (the thread's end reaches the loop)
        assert scheduler.idle and stats.running_executions == 0
        assert stats.batcher.total_batches == 1 and stats.execution_count == 0  # counted, as failed
        np.testing.assert_array_equal((await scheduler.submit(rows(2), 1, 0))[0].data, [[4, 4]])  # its instance
        await asyncio.wait_for(scheduler.drain(), 5)
    run(scenario())


def test_drain_abandons_work_that_ignores_termination() -> None:
    async def scenario() -> None:
        backend = GatedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=ModelStats())
        caller = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
        await until(lambda: scheduler.running_threads == 1)
        caller.cancel()
        started = time.monotonic()
        # Nothing can end the thread: give up after the grace and the wait, do not hang.
        finished = await scheduler.drain(0.1, terminate_wait_s=0.2)
        assert not finished
        assert time.monotonic() - started < 1.5
        backend.gate.set()
    run(scenario())


def test_a_drain_within_a_long_grace_ends_its_wait_when_the_server_stops_starting() -> None:
    """A replaced version drains within its model's timeout_s, which may be longer than the server's grace: the
    server's stop (its grace over: stop_starting) ends that wait, ends what runs, and answers what is queued."""
    async def scenario() -> None:
        backend, scheduler, running, queued = await one_running_one_queued(batching=False)
        terminated = asyncio.Event()

        async def terminate() -> None:
            terminated.set()
            backend.gate.set()  # (the running execution ends as a killed run would)
        drained = asyncio.create_task(scheduler.drain(600, terminate, terminate_wait_s=5))
        await asyncio.sleep(0.05)
        assert not drained.done()
        started = time.monotonic()
        scheduler.stop_starting()
        assert await drained and terminated.is_set() and time.monotonic() - started < 5
        assert float(running.result()[0].data[0, 0]) == 2.0
        with pytest.raises(Unavailable, match="not run"):
            queued.result()
        assert backend.ran == [1.0]
    run(scenario())


async def one_running_one_queued(batching: bool) -> tuple[GatedDouble, ModelScheduler, asyncio.Task, asyncio.Task]:
    """A one-instance scheduler (batching or not) running one request (value 1, held by the backend's gate) and
    holding one more (value 2) in its queue."""
    backend = GatedDouble()
    policy = BatchPolicy(True, max_rows=1, max_delay_ns=1) if batching else None
    scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=ModelStats(), policy=policy)
    running = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
    await until(lambda: scheduler.running_threads == 1)
    queued = asyncio.create_task(scheduler.submit(rows(2), 1, 0))
    await until(lambda: scheduler.queue_depth == 1)
    return backend, scheduler, running, queued


@pytest.mark.parametrize("batching", [False, True], ids=["run by its caller", "run by the batcher"])
def test_a_request_queued_when_an_unloads_grace_ends_is_answered_not_run_and_never_started(batching) -> None:
    """The slot that terminating the running execution freed started the queued request after the grace:
    cut short or abandoned in turn, it was told its execution "did not end within the grace", and the unload
    took the termination wait twice."""
    async def scenario() -> None:
        backend, scheduler, running, queued = await one_running_one_queued(batching)

        async def terminate() -> None:  # the backend ends its running work at once
            backend.gate.set()

        assert await scheduler.drain(0.1, terminate=terminate, terminate_wait_s=5)
        np.testing.assert_array_equal((await running)[0].data, [[2, 2]])
        with pytest.raises(Unavailable, match=r"^model 'm' was unloaded before this request could start .*it was "
                                              "not run: send it again$"):
            await queued
        assert backend.ran == [1.0]  # the queued request never ran
    run(scenario())


@pytest.mark.parametrize("batching", [False, True], ids=["run by its caller", "run by the batcher"])
def test_callers_of_an_abandoned_execution_are_answered_unavailable(batching) -> None:
    """Defect: drain answered the queued requests of a model whose execution ignored termination, but the
    callers of that execution waited on (without a deadline, for ever) after the unload."""
    async def scenario() -> None:
        backend, scheduler, running, queued = await one_running_one_queued(batching)
        assert not await scheduler.drain(0.1, terminate_wait_s=0.1)
        with pytest.raises(Unavailable, match="model 'm' was unloaded while this request ran; its execution did "
                                              "not end within the grace and was abandoned"):
            await asyncio.wait_for(running, 1)
        # (It said only "model 'm' was unloaded": not that it never ran, so could be sent again safely.)
        with pytest.raises(Unavailable, match=r"^model 'm' was unloaded before this request could start \(what "
                                              r"ran ahead of it did not end within the grace\); it was not run: "
                                              "send it again$"):
            await asyncio.wait_for(queued, 1)
        backend.gate.set()
        await until(lambda: scheduler.running_threads == 0)
    run(scenario())


@pytest.mark.parametrize("batching, error, said", [
    (False, KeyError("weights"), "KeyError: 'weights'"),
    (True, ModelFailure("model 'm' timed out after 1 s (timeout_s in nereid.yaml)"),
     "timed out after 1 s (timeout_s in nereid.yaml)"),
], ids=["run by its caller, a bug", "run by the batcher, its own failure"])
def test_a_run_failing_after_its_unload_abandoned_it_is_a_warning_saying_so(batching, error, said, caplog) -> None:
    """Found by a review: a run on a backend that cannot be stopped (a bundle's, a cxx model's), abandoned by an
    unload past its grace, that failed afterwards was logged at ERROR as a loaded model's fault, though the model
    was gone and its caller had been answered."""
    class FailingWhenReleased(GatedDouble):
        def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
            self.gate.wait(10)
            raise error

    async def scenario() -> None:
        backend = FailingWhenReleased()
        policy = BatchPolicy(True, max_rows=1, max_delay_ns=1) if batching else None
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=ModelStats(),
                                   policy=policy)
        running = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
        await until(lambda: scheduler.running_threads == 1)
        assert not await scheduler.drain(0.05, terminate_wait_s=0.05)
        with pytest.raises(Unavailable, match="was abandoned"):
            await asyncio.wait_for(running, 1)
        backend.gate.set()  # the abandoned run ends now, failing
        await until(lambda: scheduler.running_threads == 0)

    caplog.set_level("INFO", logger="nereid.scheduler")
    run(scenario())
    logged = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "nereid.scheduler"]
    assert [message for level, message in logged if level == "ERROR"] == [
        "model 'm': 1 execution(s) did not end; abandoning them"]  # the unload's own line only
    assert logged[-1] == ("WARNING", "model 'm': a run its unload abandoned (it had not ended within the grace) "
                                     f"failed afterwards, with no request waiting for it: {said}")


def test_a_stuck_backend_call_does_not_keep_the_process_from_exiting() -> None:
    """ThreadPoolExecutor joins its threads at exit: one call that never returned made exit hang."""
    import subprocess
    import sys

    script = ("import threading\nfrom nereid.daemon_pool import DaemonThreadPool\n"
              "pool = DaemonThreadPool(1)\npool.submit(threading.Event().wait)\n"
              "pool.shutdown(wait=False, cancel_futures=True)\nprint('exiting')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == "exiting", result.stderr


class AwaitingDouble:
    """A coroutine backend (as the meta backend's models are): records its thread, deadline and batches."""

    platform = "test"

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.seen: list[tuple[int, int, list[float]]] = []  # (thread id, deadline, first column)

    async def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        await self.gate.wait()
        self.seen.append((threading.get_ident(), REQUEST_DEADLINE_NS.get(), inputs[0].data[:, 0].tolist()))
        return [NamedTensor("y", DType.FP32, inputs[0].data * 2)]


class SwallowingDouble:
    """A coroutine backend that swallows its cancellation (a bare ``except`` in a loop) until released."""

    platform = "test"

    def __init__(self) -> None:
        self.released = False

    async def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        while not self.released:
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                pass
        return [NamedTensor("y", DType.FP32, inputs[0].data * 2)]


def test_the_batchers_callers_are_answered_when_drain_abandons_a_coroutine_that_swallows_cancellation() -> None:
    """Defect: drain only cancelled the execution, and its callers were answered as the cancellation came back
    out of the model, which never happened: they waited until their own deadlines."""
    async def scenario() -> None:
        backend = SwallowingDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=ModelStats(),
                                   policy=BatchPolicy(True, max_rows=4, max_delay_ns=1))
        caller = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
        await asyncio.sleep(0.05)
        assert not await scheduler.drain(0.1, terminate_wait_s=0.1)
        with pytest.raises(Unavailable, match="execution did not end within the grace and was abandoned"):
            await asyncio.wait_for(caller, 1)
        # The execution left running is named after its model (the server's last WARNING lists such tasks).
        assert "nereid-m-execution" in {task.get_name() for task in asyncio.all_tasks() if not task.done()}
        backend.released = True
    run(scenario())


def test_a_coroutine_infer_runs_on_the_loop_with_its_batch_s_earliest_deadline() -> None:
    async def scenario() -> None:
        backend = AwaitingDouble()
        policy = BatchPolicy.resolve(BatchingSettings(), SIGNATURE, "test")
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=8, instances=1, stats=ModelStats(),
                                   policy=policy)
        soon, later = time.monotonic_ns() + 10 * 10**9, time.monotonic_ns() + 20 * 10**9
        first = asyncio.create_task(scheduler.submit(rows(1), 1, later))  # runs alone, at once
        await asyncio.sleep(0.02)
        queued = [asyncio.create_task(scheduler.submit(rows(v), 1, d)) for v, d in ((2, later), (3, soon))]
        await asyncio.sleep(0.02)
        backend.gate.set()
        results = await asyncio.gather(first, *queued)
        assert [float(r[0].data[0, 0]) for r in results] == [2, 4, 6]
        loop_thread = threading.get_ident()
        assert backend.seen == [(loop_thread, later, [1.0]), (loop_thread, soon, [2.0, 3.0])]
        await scheduler.drain()
    run(scenario())


class RaisingOnce:
    """A backend whose infer raises ``error`` once, then doubles its input."""

    platform = "test"

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        error, self.error = self.error, None
        if error is not None:
            raise error
        return [NamedTensor("y", DType.FP32, inputs[0].data * 2)]


class AsyncRaisingOnce(RaisingOnce):
    """The same as an ``async def infer``, run on the event loop."""

    async def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        await asyncio.sleep(0)
        return super().infer(inputs)


def cancelled_future_result() -> None:
    """What a model meets when a future of its own is cancelled: concurrent.futures' CancelledError."""
    future = concurrent.futures.Future()
    future.cancel()
    future.result()


def caught(call) -> BaseException:
    try:
        call()
    except BaseException as error:
        return error
    raise AssertionError("did not raise")


@pytest.mark.parametrize("coroutine", [False, True], ids=["thread", "coroutine"])
@pytest.mark.parametrize("error, message", [
    (SystemExit(3), "SystemExit: 3"),
    (KeyboardInterrupt(), "KeyboardInterrupt$"),
    (caught(cancelled_future_result), "CancelledError$"),
    (asyncio.CancelledError("an awaited call of the model's was cancelled"),
     "CancelledError: an awaited call of the model's was cancelled"),
    # A stray next(): no future can carry a StopIteration, so the request waited for ever, its slot taken.
    (StopIteration(), "(RuntimeError: coroutine raised )?StopIteration$"),  # (a coroutine's: PEP 479's)
], ids=["sys.exit", "KeyboardInterrupt", "futures.CancelledError", "asyncio.CancelledError", "StopIteration"])
def test_whatever_infer_raises_is_a_model_fault_and_the_model_serves_on(error, message, coroutine) -> None:
    """Defects: sys.exit() in a plugin's infer ended the server; concurrent.futures' CancelledError from a
    sync infer was taken for the pool's shutdown, leaving the request unanswered and its slot taken for good;
    an async infer's own CancelledError was taken for the caller's, leaving the request unanswered."""
    async def scenario() -> None:
        stats = ModelStats()
        backend = (AsyncRaisingOnce if coroutine else RaisingOnce)(error)
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=stats)
        with pytest.raises(ModelFailure, match=f"^model 'm' failed: {message}"):
            await asyncio.wait_for(scheduler.submit(rows(1), 1, 0), 5)
        assert float((await asyncio.wait_for(scheduler.submit(rows(2), 1, 0), 5))[0].data[0, 0]) == 4
        assert stats.execution_count == 1  # the failed execution was counted as one that did not succeed
        assert scheduler.running_threads == 0
        await asyncio.wait_for(scheduler.drain(), 5)
    run(scenario())


class Busy(Unavailable):
    """A plugin's own error, whose constructor takes something else than a message."""

    def __init__(self, seconds: int) -> None:
        super().__init__(f"busy, retry in {seconds} s")
        self.seconds = seconds


@pytest.mark.parametrize("error, expected", [
    (ModelFailure("weights are cursed"), ModelFailure("model 'm': weights are cursed")),
    (InvalidArgument("row 0 is negative"), InvalidArgument("model 'm': row 0 is negative")),
    (ModelFailure("meta model 'm': sub-call failed"), ModelFailure("meta model 'm': sub-call failed")),  # as it is
    # The model's name quoted as something else's (a tensor's) is no naming of the model.
    (ModelFailure("tensor 'm' came out NaN"), ModelFailure("model 'm': tensor 'm' came out NaN")),
    # It read "busy, retry in model 'm': busy, retry in 3 s s": the constructor took the message for seconds.
    (Busy(3), Unavailable("model 'm': busy, retry in 3 s")),
], ids=["ModelFailure", "InvalidArgument", "already named", "name of a tensor", "subclass"])
def test_a_plugins_own_error_names_the_model_to_the_client_and_in_the_log(error, expected, caplog) -> None:
    """Defect: a third-party backend's ModelFailure("weights are cursed") reached the client and the log as it
    was, naming no model (built-in backends name it themselves; an exception was already named)."""
    async def scenario() -> None:
        scheduler = ModelScheduler("m", RaisingOnce(error), SIGNATURE, capacity=4, instances=1, stats=ModelStats())
        with pytest.raises(type(expected)) as raised:
            await asyncio.wait_for(scheduler.submit(rows(1), 1, 0), 5)
        assert str(raised.value) == str(expected) and type(raised.value) is type(error)
        if isinstance(error, Busy):
            assert raised.value.seconds == 3  # its own attributes kept
        await scheduler.drain()
    with caplog.at_level("ERROR", logger="nereid.scheduler"):
        run(scenario())
    logged = [r.getMessage() for r in caplog.records if r.name == "nereid.scheduler"]
    assert logged == ([str(expected)] if isinstance(expected, ModelFailure) else [])


class FailingAlways:
    """A backend whose every run fails: as a subprocess does (a ModelFailure of its own), or by raising."""

    platform = "test"

    def __init__(self, error: Exception) -> None:
        self.error = error

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        raise self.error


@pytest.mark.parametrize("error, traceback", [
    (ModelFailure("model 'm': main.py exited with status 1: ValueError: bad row"), False),
    (ValueError("bad row"), True),
], ids=["backend's ModelFailure", "exception"])
def test_each_model_fault_is_logged_once_with_its_reason_and_limited(error, traceback, caplog) -> None:
    """Defect: a backend's own ModelFailure (a main.py that exited 1, with its traceback) reached the client
    only, so the operator's log said nothing; and an exception's traceback was logged for every request
    without limit (a model failing at full speed filled the disk)."""
    async def scenario() -> None:
        scheduler = ModelScheduler("m", FailingAlways(error), SIGNATURE, capacity=4, instances=1,
                                   stats=ModelStats())
        for _ in range(15):
            with pytest.raises(ModelFailure, match="bad row"):
                await asyncio.wait_for(scheduler.submit(rows(1), 1, 0), 5)
        await scheduler.drain()
    with caplog.at_level("ERROR", logger="nereid.scheduler"):
        run(scenario())
    records = [r for r in caplog.records if r.name == "nereid.scheduler"]
    assert len(records) == 10  # RateLimitedLog's burst: 10 lines per 10 s, the rest counted
    assert all("model 'm'" in r.getMessage() for r in records)
    assert all("bad row" in r.getMessage() or "bad row" in str(r.exc_info[1]) for r in records)
    assert all((r.exc_info is not None) == traceback for r in records)


class CancelledInBatches(AwaitingDouble):
    """Doubles a lone request; an awaited call of its own is cancelled when it runs a coalesced batch."""

    async def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        outputs = await super().infer(inputs)
        if len(inputs[0].data) > 1:
            raise asyncio.CancelledError()
        return outputs


def test_a_coroutine_infer_raising_cancelled_error_in_a_batch_fails_each_request() -> None:
    async def scenario() -> None:
        backend = CancelledInBatches()
        policy = BatchPolicy.resolve(BatchingSettings(), SIGNATURE, "test")
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=8, instances=1, stats=ModelStats(),
                                   policy=policy)
        first = asyncio.create_task(scheduler.submit(rows(1), 1, 0))  # runs alone, at once, and waits
        await asyncio.sleep(0.02)
        queued = [asyncio.create_task(scheduler.submit(rows(v), 1, 0)) for v in (2, 3)]
        await asyncio.sleep(0.02)
        backend.gate.set()
        assert float((await first)[0].data[0, 0]) == 2
        for task in queued:
            with pytest.raises(ModelFailure, match="^model 'm' failed: CancelledError$"):
                await asyncio.wait_for(task, 5)
        assert float((await asyncio.wait_for(scheduler.submit(rows(4), 1, 0), 5))[0].data[0, 0]) == 8
        await scheduler.drain()
    run(scenario())


def test_a_caller_going_away_still_cancels_a_running_coroutine_infer() -> None:
    """The model's own CancelledError is a fault; the caller's own cancellation is not swallowed."""
    async def scenario() -> None:
        backend = AwaitingDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=ModelStats())
        caller = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
        await asyncio.sleep(0.02)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        backend.gate.set()
        assert float((await scheduler.submit(rows(2), 1, 0))[0].data[0, 0]) == 4
        await scheduler.drain()
    run(scenario())


class Relay:
    """A coroutine backend (a meta model) that passes its inputs on to the next scheduler of a chain."""

    platform = "test"

    def __init__(self) -> None:
        self.next: ModelScheduler | None = None

    async def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        if self.next is None:
            return [NamedTensor("y", DType.FP32, inputs[0].data + 1)]
        (out,) = await self.next.submit([NamedTensor("x", DType.FP32, inputs[0].data)], inputs[0].shape[0], 0)
        return [NamedTensor("y", DType.FP32, out.data)]


def test_a_chain_of_many_coroutine_models_answers_on_an_idle_server() -> None:
    """Found by a bug hunt: on an idle server each level of a chain of meta models started at once in its
    caller's task, so 120 levels ran on one Python stack and failed with a RecursionError (under load the same
    request passed: queued levels run in tasks of their own). Past MAX_INLINE_DEPTH a level goes through the
    queue."""
    async def scenario() -> None:
        relays = [Relay() for _ in range(300)]
        schedulers = [ModelScheduler(f"m{i}", relay, SIGNATURE, capacity=4, instances=1, stats=ModelStats(),
                                     policy=BatchPolicy(enabled=False)) for i, relay in enumerate(relays)]
        for relay, following in zip(relays, schedulers[1:]):
            relay.next = following
        x = np.zeros((1, 2), np.float32)
        (out,) = await schedulers[0].submit([NamedTensor("x", DType.FP32, x)], 1, 0)
        assert out.data.tolist() == [[1.0, 1.0]]
        for scheduler in schedulers:
            await scheduler.drain()
    asyncio.run(scenario())


class NotStartedFirst:
    """Raises NotStarted (none of its code ran: a python model's warm parent died before it forked the run) on
    its first ``times`` calls, each once ``gate`` opens; doubles its input after. Records each call's rows."""

    platform = "test"

    def __init__(self, times: int = 1) -> None:
        self.gate = threading.Event()
        self.times = times
        self.calls: list[list[float]] = []

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        self.calls.append([float(v) for v in inputs[0].data[:, 0]])
        if len(self.calls) <= self.times:
            assert self.gate.wait(10)
            raise NotStarted(ModelKilled("model 'm': its warm parent process was killed by signal SIGKILL (it did "
                                         "not fork the run); it is restarted for the next request"))
        return [NamedTensor("y", DType.FP32, inputs[0].data * 2)]


@pytest.mark.parametrize("deadline", [False, True])
def test_a_run_the_backend_did_not_start_is_sent_once_more_unless_its_deadline_passed(deadline, caplog) -> None:
    """A lone request (run in its caller's task) whose run the backend did not start is sent again; not once its
    deadline has passed: it is answered DEADLINE_EXCEEDED, never run late (the warm parent hunt)."""
    async def scenario() -> None:
        backend = NotStartedFirst()
        stats = ModelStats()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=stats)
        deadline_ns = time.monotonic_ns() + 200_000_000 if deadline else 0
        answer = asyncio.create_task(scheduler.submit(rows(3), 1, deadline_ns))
        await until(lambda: backend.calls == [[3.0]])
        if deadline:
            await until(lambda: time.monotonic_ns() > deadline_ns)  # it passes while the first send is under way
        backend.gate.set()
        if deadline:
            with pytest.raises(DeadlineExceeded, match=r"^model 'm': deadline passed [0-9.]+ ms before the request "
                                                       r"could start \(waited [0-9.]+ ms since it was queued; its "
                                                       r"batch, which had not started, was to be sent again: its warm "
                                                       r"parent process was killed by signal SIGKILL \(.*\); it was "
                                                       r"not run$"):
                await answer
            assert backend.calls == [[3.0]]
        else:
            assert float((await answer)[0].data[0, 0]) == 6
            assert backend.calls == [[3.0], [3.0]] and stats.execution_count == 1
            # A send not started is no execution: nereid_batch_size counted it too (the hunt of the re-send).
            assert stats.batcher.total_batches == 1 and stats.running_executions == 0
        await scheduler.drain()
    with caplog.at_level("WARNING", logger="nereid.scheduler"):
        run(scenario())
    logged = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "nereid.scheduler"]
    assert logged == [("WARNING", "model 'm': its warm parent process was killed by signal SIGKILL (it did not fork "
                                  "the run); it is restarted for the next request; the batch had not started: it is "
                                  "sent once more, less any request whose deadline has passed")]


@pytest.mark.parametrize("batching", [False, True])
def test_a_run_the_backend_did_not_start_twice_fails_with_the_backends_failure(batching, caplog) -> None:
    async def scenario() -> None:
        backend = NotStartedFirst(times=2)
        backend.gate.set()
        stats = ModelStats()
        policy = BatchPolicy.resolve(BatchingSettings(), SIGNATURE, "test") if batching else None
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=stats, policy=policy)
        with pytest.raises(ModelKilled, match=r"^model 'm': its warm parent process was killed by signal SIGKILL"):
            await scheduler.submit(rows(3), 1, 0)
        assert backend.calls == [[3.0], [3.0]]  # sent once more, not twice
        assert float((await scheduler.submit(rows(4), 1, 0))[0].data[0, 0]) == 8
        await scheduler.drain()
    with caplog.at_level("WARNING", logger="nereid.scheduler"):
        run(scenario())
    levels = [r.levelname for r in caplog.records if r.name == "nereid.scheduler"]
    assert levels == ["WARNING", "ERROR"]  # sent once more; then the batch's fault, logged once


# --------------------------------------------------------------------------- requests waiting for room (streams')


class Waiting:
    """Requests sent as a gRPC stream's are (DataPlane.infer_encoded's ``wait_for_room``): each waits for room in the
    full queue rather than be refused. Counts the queue's refusals."""

    def __init__(self, scheduler: ModelScheduler) -> None:
        self.scheduler = scheduler
        self.refusals = 0

    async def submit(self, value: float, deadline_ns: int = 0) -> list[NamedTensor]:
        model = SimpleNamespace(scheduler=self.scheduler, run=self._run)
        return await _run_when_room(model, rows(value), 1, deadline_ns, RequestTiming())

    async def _run(self, *args) -> list[NamedTensor]:
        try:
            return await self.scheduler.submit(*args)
        except QueueRefusal:
            self.refusals += 1
            raise

    async def line(self, values: list[float], deadline_ns: int = 0) -> list[asyncio.Task]:
        """One request of each value, each waiting for room before the next is sent (their order is the line's)."""
        tasks = []
        for value in values:
            before = self.scheduler.waiting_for_room
            tasks.append(asyncio.create_task(self.submit(value, deadline_ns)))
            await until(lambda: self.scheduler.waiting_for_room == before + 1)
        return tasks


async def running_and_queue_full(capacity: int) -> tuple[GatedDouble, ModelScheduler, list[asyncio.Task]]:
    """A model of one instance running a request (held at its gate) with ``capacity`` more queued (0, 1, ...)."""
    backend = GatedDouble()
    scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=capacity, instances=1, stats=ModelStats())
    admitted = [asyncio.create_task(scheduler.submit(rows(0), 1, 0))]
    await until(lambda: scheduler.running_threads == 1)
    admitted += [asyncio.create_task(scheduler.submit(rows(i), 1, 0)) for i in range(1, capacity + 1)]
    await until(lambda: scheduler.queue_depth == capacity)
    return backend, scheduler, admitted


def test_a_waiter_for_a_preprocess_stage_is_woken_when_a_lone_request_leaves_the_queue() -> None:
    """Found by the hunt of the wait for room: a model whose preprocess stage counts the whole queue got room when
    the batcher took a lone request from it, but only a batch of several woke a waiter; it stayed out until that
    execution ended, and a unary request arriving meanwhile went in ahead of it."""
    async def scenario() -> None:
        backend = SteppedDouble()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=1, instances=1, stats=ModelStats())
        scheduler.stage_full = lambda: scheduler.queue_depth >= scheduler.capacity  # (a stage with no call in it)
        first = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
        await until(lambda: scheduler.running_threads == 1)
        second = asyncio.create_task(scheduler.submit(rows(2), 1, 0))
        await until(lambda: scheduler.queue_depth == 1)
        waiter = asyncio.create_task(Waiting(scheduler).submit(3))
        await until(lambda: scheduler.waiting_for_room == 1)
        backend.permits.release()  # the first ends; the second is taken from the queue and runs (held)
        await first
        await until(lambda: backend.ran == [1.0] and scheduler.running_threads == 1)
        await until(lambda: scheduler.waiting_for_room == 0 and scheduler.queue_depth == 1)  # in, the second running
        backend.permits.release(2)
        assert [float(r[0].data[0, 0]) for r in await asyncio.gather(second, waiter)] == [4, 6]
        await scheduler.drain()
    asyncio.run(scenario())


def test_requests_waiting_for_room_are_woken_one_at_a_time_in_the_order_they_came() -> None:
    """A first try woke every waiter at each answer: each freed place was tried for by all of them (slow, and by
    chance which one got it). Each freed place wakes the first alone; those that came behind a waiter do not try
    before their turn."""
    async def scenario() -> None:
        backend, scheduler, admitted = await running_and_queue_full(2)
        waiting = Waiting(scheduler)
        line = await waiting.line([10, 11, 12, 13, 14, 15])
        assert waiting.refusals == 1  # the first alone tried; the others found it waiting
        backend.gate.set()
        results = await asyncio.gather(*admitted, *line)
        assert [float(r[0].data[0, 0]) for r in results] == [0, 2, 4, 20, 22, 24, 26, 28, 30]
        assert backend.ran == [0, 1, 2, 10, 11, 12, 13, 14, 15]
        assert waiting.refusals == 1  # woken only with room for them: never refused again
        assert scheduler.waiting_for_room == 0
        await scheduler.drain()
    run(scenario())


def test_a_request_whose_deadline_passes_while_it_waits_for_room_is_not_run_and_the_next_gets_its_turn() -> None:
    async def scenario() -> None:
        backend, scheduler, admitted = await running_and_queue_full(1)
        waiting = Waiting(scheduler)
        (expiring,) = await waiting.line([10], deadline_ns=time.monotonic_ns() + 50_000_000)
        (keeps,) = await waiting.line([11])
        with pytest.raises(DeadlineExceeded, match=r"^model 'm': deadline passed [0-9.]+ ms before the request could "
                                                   r"start \(waited [0-9.]+ ms for room in the full queue\); it was "
                                                   r"not run$"):
            await expiring
        assert scheduler.waiting_for_room == 1
        backend.gate.set()
        results = await asyncio.gather(*admitted, keeps)
        assert [float(r[0].data[0, 0]) for r in results] == [0, 2, 22]
        assert backend.ran == [0, 1, 11]
        # nereid_batcher_submitted_total counts what entered the queue (the hunt of the wait counted the expired too).
        assert scheduler._stats.batcher.total_submitted == 3
        await scheduler.drain()
    run(scenario())


def test_a_request_that_waited_for_room_and_expired_in_the_queue_is_told_both_waits() -> None:
    """Found by the statistics hunt: a stream's request that waited for room, then expired in the queue, was told
    only of its time in the queue ("waited 392.5 ms in the queue"), after some 600 ms of waiting for room."""
    async def scenario() -> None:
        backend, scheduler, admitted = await running_and_queue_full(1)
        waiting = Waiting(scheduler)
        (expiring,) = await waiting.line([10], deadline_ns=time.monotonic_ns() + 300_000_000)
        await asyncio.sleep(0.1)  # (a wait for room of 0.1 s at least)
        admitted[1].cancel()  # the queued request's caller leaves: its room goes to the waiter, which expires there
        await until(lambda: scheduler.waiting_for_room == 0 and scheduler.queue_depth == 1)
        with pytest.raises(DeadlineExceeded, match=r"^model 'm': deadline passed [0-9.]+ ms before the request could "
                                                   r"start \(waited (\d+)\.\d ms for room in the full queue, then "
                                                   r"[0-9.]+ ms in the queue\); it was not run$") as told:
            await expiring
        assert int(re.search(r"waited (\d+)", str(told.value)).group(1)) >= 100
        backend.gate.set()
        await asyncio.gather(*admitted, return_exceptions=True)
        await scheduler.drain()
    run(scenario())


def test_a_cancelled_waiter_leaves_the_line_and_an_unload_answers_the_others_at_once() -> None:
    async def scenario() -> None:
        backend, scheduler, admitted = await running_and_queue_full(1)
        waiting = Waiting(scheduler)
        first, gone, last = await waiting.line([10, 11, 12])
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert scheduler.waiting_for_room == 2
        drain = asyncio.create_task(scheduler.drain())
        # Answered as the model starts its drain, before what it had admitted has run.
        for waiter in (first, last):
            with pytest.raises(ModelRetired, match="^model 'm' is being unloaded$"):
                await waiter
        assert backend.ran == [] and scheduler.waiting_for_room == 0
        backend.gate.set()
        assert await drain
        assert [float(r[0].data[0, 0]) for r in await asyncio.gather(*admitted)] == [0, 2]
        assert backend.ran == [0, 1]
    run(scenario())


class FailingWithALargeLocal:
    """A backend whose infer holds a large array in a local, waits for its gate, then raises; ``kept`` has a weak
    reference to each call's array."""

    platform = "test"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.kept: list[weakref.ref] = []

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        large = np.ones(1 << 20, np.float32)
        self.kept.append(weakref.ref(large))
        self.gate.wait(30)
        raise RuntimeError("boom")


class AsyncFailingWithALargeLocal(FailingWithALargeLocal):
    """The same as an ``async def infer``, run on the event loop (as a meta model's orchestration is)."""

    def __init__(self) -> None:
        super().__init__()
        self.async_gate = asyncio.Event()

    async def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        large = np.ones(1 << 20, np.float32)
        self.kept.append(weakref.ref(large))
        await self.async_gate.wait()
        raise RuntimeError("boom")


@pytest.mark.parametrize("backend_type", [FailingWithALargeLocal, AsyncFailingWithALargeLocal],
                         ids=["on a thread", "a coroutine"])
def test_a_failed_run_s_frames_are_freed_once_its_requests_are_answered_without_a_collection(backend_type) -> None:
    """Found by the meta hunt: the error's traceback holds the frames it passed through, and a local of one of
    them held the error back (the request's future, its batch, its task, the thread's waiter): cycles that only the
    garbage collector frees, so a failed run's frames, with the model's inputs and intermediates, stayed (8 failing
    requests of a meta model each holding a 100 MB local: +477 MiB until a collection). One request run by its
    caller, one by the batcher."""
    async def scenario() -> None:
        backend = backend_type()
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=4, instances=1, stats=ModelStats())
        running = asyncio.create_task(scheduler.submit(rows(1), 1, 0))
        await until(lambda: len(backend.kept) == 1)
        queued = asyncio.create_task(scheduler.submit(rows(2), 1, 0))
        await until(lambda: scheduler.queue_depth == 1)
        backend.gate.set()
        if isinstance(backend, AsyncFailingWithALargeLocal):
            backend.async_gate.set()
        for task in (running, queued):
            with pytest.raises(ModelFailure, match="^model 'm' failed: RuntimeError: boom$"):
                await task
        del task, running, queued  # (each keeps its error: the test's own references)
        await until(lambda: len(backend.kept) == 2 and scheduler.idle)
        # (A worker thread lets go of its frame a moment after its answer: waited for, with a generous bound.)
        await until(lambda: all(ref() is None for ref in backend.kept), timeout=10)
        await scheduler.drain()
    with reference_counting_only():
        run(scenario())


class OneBuffer:
    """An in-process backend that writes every result into the one buffer it keeps, and returns that buffer (or a
    view of it): a preallocated output, as a C++ author would keep one."""

    platform = "test"

    def __init__(self, view: bool) -> None:
        self.buffer = np.zeros((1, 2), np.float32)
        self.view = view
        self.checked_on: list[str] = []

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        self.buffer[:] = inputs[0].data
        return [NamedTensor("y", DType.FP32, self.buffer[:] if self.view else self.buffer)]


@pytest.mark.parametrize("view", [False, True], ids=["buffer", "view"])
def test_outputs_are_copied_as_infer_returns_them_so_a_reused_buffer_answers_each_request_its_own(view) -> None:
    """Found by the outputs hunt: a model's outputs are read after its infer returned, once its instance is free
    and its next batch may run, so a backend that filled one buffer per call gave clients later requests' rows,
    200 OK. Each request here is answered after the other has run: the first got the second's values."""
    async def scenario() -> None:
        scheduler = ModelScheduler("m", OneBuffer(view), SIGNATURE, capacity=8, instances=1, stats=ModelStats())
        answers = await asyncio.gather(*(scheduler.submit(rows(value), 1, 0) for value in (1.0, 2.0, 3.0)))
        assert [float(answer[0].data[0, 0]) for answer in answers] == [1.0, 2.0, 3.0]
        await scheduler.drain(5)

    run(scenario())


class FreshOneBuffer(OneBuffer):
    def returns_fresh_outputs(self) -> bool:  # (a false claim: the copy it spares shows)
        return True


def test_a_model_returning_fresh_outputs_has_them_used_as_they_are() -> None:
    async def scenario() -> None:
        backend = FreshOneBuffer(view=False)
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=8, instances=1, stats=ModelStats(),
                                   copies_outputs=False)
        [answer] = await scheduler.submit(rows(1.0), 1, 0)
        assert answer.data is backend.buffer
        await scheduler.drain(5)

    run(scenario())


def test_a_memory_mapped_output_is_copied_before_the_file_it_maps_can_change(tmp_path) -> None:
    """Found by the outputs hunt: a np.memmap output (accepted) was read as the answer was encoded, after the
    model's next call had truncated its file: the server died of SIGBUS."""
    class Mapped:
        platform = "test"

        def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
            mapped = np.memmap(tmp_path / "out.bin", dtype=np.float32, mode="w+", shape=(1, 2))
            mapped[:] = inputs[0].data
            return [NamedTensor("y", DType.FP32, mapped)]

    async def scenario() -> None:
        scheduler = ModelScheduler("m", Mapped(), SIGNATURE, capacity=8, instances=1, stats=ModelStats())
        [answer] = await scheduler.submit(rows(4.0), 1, 0)
        assert type(answer.data) is np.ndarray and answer.data.flags.owndata
        (tmp_path / "out.bin").write_bytes(b"")  # (truncated: reading a mapping of it now is a SIGBUS)
        assert answer.data.tolist() == [[4.0, 4.0]]
        await scheduler.drain(5)

    run(scenario())


def test_outputs_are_checked_on_the_worker_thread_not_the_event_loop(monkeypatch) -> None:
    """Found by the outputs hunt: the check of a plugin's outputs ran on the event loop, and for 16 million BYTES
    elements (each looked at for text) held every client of the server for 3.6 s."""
    from nereid import scheduler as scheduler_module

    checked_on = []
    real_check = scheduler_module.check_outputs

    def recording(*args, **kwargs):
        checked_on.append(threading.current_thread().name)
        return real_check(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "check_outputs", recording)

    async def scenario() -> None:
        scheduler = ModelScheduler("m", OneBuffer(view=False), SIGNATURE, capacity=8, instances=1,
                                   stats=ModelStats())
        await scheduler.submit(rows(1.0), 1, 0)
        await scheduler.drain(5)

    run(scenario())
    assert len(checked_on) == 1 and checked_on[0].startswith("nereid-m"), checked_on


def test_the_outputs_check_and_copy_count_as_the_executions_output_time(monkeypatch) -> None:
    """Found by the hunt of this session's changes: once the check and copy ran on the worker thread they were
    counted as compute_infer (a 4 MiB output: 1305 against 1151 us), where Triton counts output handling as
    compute_output."""
    from nereid import scheduler as scheduler_module

    real_check = scheduler_module.check_outputs

    def slow_check(*args, **kwargs):
        time.sleep(0.5)
        return real_check(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "check_outputs", slow_check)

    async def scenario() -> RequestTiming:
        scheduler = ModelScheduler("m", OneBuffer(view=False), SIGNATURE, capacity=8, instances=1,
                                   stats=ModelStats())
        timing = RequestTiming()
        await scheduler.submit(rows(1.0), 1, 0, timing)
        await scheduler.drain(5)
        return timing

    _, infer_ns, output_ns = run(scenario()).compute_ns
    assert output_ns >= 500_000_000 > infer_ns, (infer_ns, output_ns)


def test_a_coroutine_model_s_large_outputs_are_checked_off_the_loop() -> None:
    """Found by the outputs hunt (carried): a meta model's outputs were checked, and copied, on the event loop, a
    millisecond per 4 MiB and seconds for millions of BYTES elements, holding every other client meanwhile."""
    from nereid.scheduler import CHECK_OFF_LOOP_BYTES, CHECK_OFF_LOOP_ELEMENTS, costly_to_check

    small = NamedTensor("y", DType.FP32, np.zeros(16, np.float32))
    large = NamedTensor("y", DType.FP32, np.zeros(CHECK_OFF_LOOP_BYTES // 4, np.float32))
    texts = NamedTensor("t", DType.BYTES, np.array([b"x"] * CHECK_OFF_LOOP_ELEMENTS, dtype=object))
    assert not costly_to_check([small]) and costly_to_check([small, large]) and costly_to_check((texts,))
    halves = [NamedTensor("a", DType.FP32, np.zeros(CHECK_OFF_LOOP_BYTES // 8, np.float32))] * 2
    assert costly_to_check(halves)  # (in all)
    # What the check refuses anyway is cheap to refuse where it is.
    assert not costly_to_check(None) and not costly_to_check([np.zeros(CHECK_OFF_LOOP_BYTES)])
    assert not costly_to_check({"y": large})


class AsyncLargeOutputs:
    """An ``async def infer`` whose one output is large: BYTES elements, str ones, or (``wrong``) int64 data
    tagged FP32... its checks run off the loop, their answer or refusal the same."""

    def __init__(self, wrong: bool = False) -> None:
        self.wrong = wrong
        self.threads: list[str] = []

    def load(self) -> None:
        pass

    def signature(self) -> ModelSignature:
        return ModelSignature((TensorSpec("x", DType.FP32, (2,)),), (TensorSpec("t", DType.BYTES, (-1,)),), 4)

    async def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        import threading

        rows = inputs[0].data.shape[0]

        class Recording(str):
            """A str element that notes where the check encodes it (the check of a str element does)."""

            def encode(inner, *args, **kwargs):  # noqa: N805 - the element itself
                self.threads.append(threading.current_thread().name)
                return str.encode(inner, *args, **kwargs)
        texts = np.empty((rows, 1 << 16), dtype=object)
        texts[:] = "x"
        texts[0, 0] = Recording("first é")  # (non-ASCII: the check encodes it)
        if self.wrong:
            texts[0, 1] = 7
        return [NamedTensor("t", DType.BYTES, texts)]

    def unload(self) -> None:
        pass


def test_a_coroutine_model_s_many_bytes_elements_are_checked_on_a_server_thread_and_refused_alike() -> None:
    async def scenario() -> None:
        backend = AsyncLargeOutputs()
        scheduler = ModelScheduler("m", backend, backend.signature(), capacity=4, instances=1, stats=ModelStats())
        [texts] = await asyncio.wait_for(scheduler.submit(rows(1), 1, 0), 30)
        assert texts.data.shape == (1, 1 << 16) and texts.data[0, 0] == "first é"
        assert backend.threads and all(name.startswith("nereid-work") for name in backend.threads), backend.threads
        wrong = AsyncLargeOutputs(wrong=True)
        refusing = ModelScheduler("w", wrong, wrong.signature(), capacity=4, instances=1, stats=ModelStats())
        with pytest.raises(ModelFailure, match=r"^model 'w' returned output 't' tagged BYTES holding element 1 of "
                                               r"type int"):
            await asyncio.wait_for(refusing.submit(rows(1), 1, 0), 30)
        await asyncio.wait_for(scheduler.drain(), 5)
    run(scenario())
