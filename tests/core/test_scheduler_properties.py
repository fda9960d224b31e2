"""Property-based tests (hypothesis) of the per-model scheduler over random timed sequences of events.

Each example builds a :class:`ModelScheduler` (a batch policy, a queue capacity,
instances) over a small in-process backend (a plain ``def infer`` on worker
threads, or an ``async def infer`` on the loop) that runs each request as its
plan says: return, raise, sleep, or return a wrong number of rows. It then
plays a sequence of events (submits with various rows and deadlines, a caller
leaving, pauses, ``drain(grace)`` in the middle or at the end) and checks:

* every accepted submit is answered exactly once, with its own rows (the
  backend's output is a function of its input, and each request's data is
  unique) or one of the documented errors, and none hangs;
* what ran: no request twice, none refused or expired on arrival, requests of
  a batch in arrival order, no batch of several requests over ``max_rows``,
  one request per execution without batching, never more than ``instances``
  executions at once, nothing starting after ``drain`` returned, and nothing
  still running when it returned True;
* the queue never holds more than ``queue_capacity`` and is empty at the end,
  the scheduler idle;
* the ModelStats figures the scheduler records agree with what the backend
  ran (submitted, queue time per request that left the queue, executions,
  completed requests, rows per execution, per-batch-size figures).

Delays are real (the scheduler reads the monotonic clock and sleeps on the
loop) but kept to a few milliseconds. Examples are bounded so the module runs
in a few seconds; ``NEREID_HYPOTHESIS_EXAMPLES=2000`` searches deeper.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from nereid.batching import BatchPolicy
from nereid.dtypes import DType
from nereid.errors import DeadlineExceeded, ModelFailure, ModelRetired, QueueFull, Unavailable
from nereid.scheduler import ModelScheduler, UnloadedBeforeStart
from nereid.signature import ModelSignature, TensorSpec
from nereid.stats import ModelStats, RequestTiming
from nereid.tensors import NamedTensor

# NEREID_HYPOTHESIS_EXAMPLES=2000 searches deeper (a few minutes) than the suite does by default.
BOUNDED = settings(max_examples=int(os.environ.get("NEREID_HYPOTHESIS_EXAMPLES", 50)), deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

MAX_BATCH = 8
# x: [request id, row index]; the model answers y = 3x + 1, so each row's answer says whose row it is.
SIGNATURE = ModelSignature((TensorSpec("x", DType.INT64, (2,)),), (TensorSpec("y", DType.INT64, (2,)),), MAX_BATCH)
SCENARIO_TIMEOUT_S = 20.0  # a scenario lasts milliseconds; hitting this is a hang


def model(data: np.ndarray) -> np.ndarray:
    return data * 3 + 1


@dataclass
class Plan:
    """What the backend does when a request is in its execution (the batch does what its worst request says)."""

    mode: str = "ok"  # ok | raise | wrong_rows
    sleep_ms: float = 0.0


@dataclass
class Execution:
    ids: tuple[int, ...]
    rows: int
    start_ns: int
    end_ns: int = 0
    outcome: str = "running"  # ok | failed | terminated | cancelled


class Backend:
    """Runs each batch as the plans of its requests say; records every execution and the peak concurrency."""

    platform = "test"

    def __init__(self, plans: dict[int, Plan]) -> None:
        self.plans = plans
        self.lock = threading.Lock()
        self.executions: list[Execution] = []
        self.running = 0
        self.peak = 0
        self.stop = threading.Event()  # set by drain's terminate: a running batch ends early (and fails)

    def _begin(self, data: np.ndarray) -> tuple[Execution, Plan]:
        ids = tuple(dict.fromkeys(int(i) for i in data[:, 0]))
        plans = [self.plans[i] for i in ids]
        worst = next((p.mode for p in plans if p.mode == "raise"), None) or next(
            (p.mode for p in plans if p.mode == "wrong_rows"), "ok")
        execution = Execution(ids, len(data), time.monotonic_ns())
        with self.lock:
            self.executions.append(execution)
            self.running += 1
            self.peak = max(self.peak, self.running)
        return execution, Plan(worst, max(p.sleep_ms for p in plans))

    def _end(self, execution: Execution, outcome: str) -> None:
        with self.lock:
            self.running -= 1
            execution.outcome = outcome
            execution.end_ns = time.monotonic_ns()

    def _answer(self, execution: Execution, plan: Plan, data: np.ndarray) -> list[NamedTensor]:
        if self.stop.is_set():
            self._end(execution, "terminated")
            raise RuntimeError("terminated")
        if plan.mode == "raise":
            self._end(execution, "failed")
            raise RuntimeError(f"planned failure of {execution.ids}")
        out = model(data)
        if plan.mode == "wrong_rows":
            self._end(execution, "failed")
            return [NamedTensor("y", DType.INT64, np.concatenate([out, out[:1]]))]
        self._end(execution, "ok")
        return [NamedTensor("y", DType.INT64, out)]


class ThreadBackend(Backend):
    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        data = inputs[0].data
        execution, plan = self._begin(data)
        if plan.sleep_ms:
            self.stop.wait(plan.sleep_ms / 1000)
        return self._answer(execution, plan, data)


class AsyncBackend(Backend):
    async def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        data = inputs[0].data
        execution, plan = self._begin(data)
        try:
            if plan.sleep_ms:
                ends = time.monotonic() + plan.sleep_ms / 1000
                while time.monotonic() < ends and not self.stop.is_set():
                    await asyncio.sleep(min(0.001, max(0.0, ends - time.monotonic())))
        except asyncio.CancelledError:
            self._end(execution, "cancelled")
            raise
        return self._answer(execution, plan, data)


# -- events -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    rows: int
    deadline: str  # none | past | short | long
    short_ms: float
    plan: Plan


@dataclass(frozen=True)
class Cancel:
    pick: int  # which of the submits still waiting (modulo their number)


@dataclass(frozen=True)
class Pause:
    ms: float  # 0: one turn of the loop


@dataclass(frozen=True)
class Block:
    ms: float  # the loop busy (a slow handler) for that long: worker threads run on, callbacks pile up


@dataclass(frozen=True)
class Drain:
    grace_s: float | None


plans = st.builds(Plan, mode=st.sampled_from(["ok", "ok", "ok", "ok", "raise", "wrong_rows"]),
                  sleep_ms=st.sampled_from([0.0, 0.5, 1.0, 1.0, 3.0]))
submits = st.builds(Submit, rows=st.sampled_from([1, 1, 1, 2, 3, 4]),
                    deadline=st.sampled_from(["none", "none", "past", "short", "long"]),
                    short_ms=st.sampled_from([0.2, 1.0, 2.0, 5.0]), plan=plans)
graces = st.sampled_from([None, 0.0, 0.001, 0.004, 0.05])
others = st.one_of(st.builds(Cancel, st.integers(0, 7)), st.builds(Pause, st.sampled_from([0.0, 0.5, 1.0, 3.0])),
                   st.builds(Block, st.sampled_from([0.5, 2.0])))
# Steps: a submit, a burst of submits (queued together, so that batches form), or another event.
steps = st.one_of(submits.map(lambda submit: [submit]), st.lists(submits, min_size=2, max_size=5),
                  others.map(lambda other: [other]))
events = st.lists(steps, min_size=2, max_size=10).map(lambda chunks: [e for chunk in chunks for e in chunk])


@st.composite
def policies(draw) -> BatchPolicy:
    if not draw(st.booleans()):
        return BatchPolicy(enabled=False)
    max_rows = draw(st.integers(1, MAX_BATCH))
    preferred = tuple(sorted(draw(st.sets(st.integers(1, max_rows), max_size=2))))
    delay_ms = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0]))
    return BatchPolicy(True, max_rows, int(delay_ms * 1_000_000), preferred)


@dataclass
class Request:
    index: int
    event: Submit
    inputs: list[NamedTensor]
    deadline_ns: int
    depth_before: int = 0
    retired_before: bool = False  # drain had begun when it was submitted
    sent: bool = False  # its caller called submit (one cancelled before its task ran never did)
    sent_ns: int = 0  # when it did
    task: asyncio.Task | None = None
    cancelled: bool = False
    outcome: object = None  # the result's data, or the exception
    timing: RequestTiming = field(default_factory=RequestTiming)  # filled in if its execution succeeded


@dataclass
class Scenario:
    threaded: bool
    policy: BatchPolicy
    capacity: int
    instances: int
    events: list
    final_grace_s: float | None
    terminate: bool
    requests: list[Request] = field(default_factory=list)
    drain_finished: bool | None = None
    drain_returned_ns: int = 0


async def play(scenario: Scenario, backend: Backend, stats: ModelStats) -> ModelScheduler:
    scheduler = ModelScheduler("m", backend, SIGNATURE, scenario.capacity, scenario.instances, stats, scenario.policy)
    draining: asyncio.Task | None = None
    drain_began = asyncio.Event()

    async def terminate() -> None:
        backend.stop.set()

    async def drain(grace_s: float | None) -> None:
        drain_began.set()  # drain refuses new requests from its first step on
        scenario.drain_finished = await scheduler.drain(grace_s, terminate if scenario.terminate else None,
                                                        terminate_wait_s=0.001)
        scenario.drain_returned_ns = time.monotonic_ns()

    async def call(request: Request) -> None:
        request.sent, request.sent_ns = True, time.monotonic_ns()
        request.depth_before = scheduler.queue_depth  # submit's checks run in this same step
        request.retired_before = drain_began.is_set()
        try:
            outputs = await scheduler.submit(request.inputs, request.event.rows, request.deadline_ns,
                                             request.timing)
        except BaseException as err:  # noqa: B036 - the CancelledError of a caller that left is an outcome
            request.outcome = err
            if isinstance(err, asyncio.CancelledError):
                raise
            return
        request.outcome = outputs

    for step in scenario.events:
        if isinstance(step, Submit):
            index = len(scenario.requests)
            data = np.array([[index, row] for row in range(step.rows)], dtype=np.int64)
            backend.plans[index] = step.plan
            now = time.monotonic_ns()
            deadline = {"none": 0, "past": now - 1_000_000, "short": now + int(step.short_ms * 1_000_000),
                        "long": now + 10_000_000_000}[step.deadline]
            request = Request(index, step, [NamedTensor("x", DType.INT64, data)], deadline)
            scenario.requests.append(request)
            request.task = asyncio.create_task(call(request))
        elif isinstance(step, Cancel):
            waiting = [r for r in scenario.requests if r.sent and not r.task.done()]  # in the scheduler's hands
            if waiting:
                chosen = waiting[step.pick % len(waiting)]
                chosen.cancelled = True
                chosen.task.cancel()
        elif isinstance(step, Pause):
            await asyncio.sleep(step.ms / 1000)
        elif isinstance(step, Block):
            time.sleep(step.ms / 1000)
        elif isinstance(step, Drain):
            draining = asyncio.create_task(drain(step.grace_s))
        # Bounded: queue_capacity waiting for an instance, beside the requests free instances are about to take
        # (each takes one at least).
        assert scheduler.queued_past_free_instances <= scenario.capacity
        assert scheduler.queue_depth <= scenario.capacity + scenario.instances
    if draining is None:
        draining = asyncio.create_task(drain(scenario.final_grace_s))
    await draining
    # Every caller has its answer (drain True: at once; False: answered Unavailable by drain itself).
    await asyncio.gather(*(r.task for r in scenario.requests), return_exceptions=True)
    # Abandoned worker threads still run: wait for them, so that their ends are counted.
    while scheduler.running_threads:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0)
    return scheduler


@st.composite
def scenarios(draw) -> Scenario:
    sequence = draw(events)
    drain_at = draw(st.none() | st.integers(len(sequence) // 2, len(sequence)))  # None: after the last event
    if drain_at is not None:
        sequence.insert(drain_at, Drain(draw(graces)))
    return Scenario(threaded=draw(st.booleans()), policy=draw(policies()), capacity=draw(st.integers(1, 8)),
                    instances=draw(st.sampled_from([1, 1, 2, 3])), events=sequence, final_grace_s=draw(graces),
                    terminate=draw(st.booleans()))


def run_scenario(scenario: Scenario) -> tuple[Scenario, Backend, ModelStats, ModelScheduler]:
    """Play a fresh copy of ``scenario`` (the ones below are shared by several tests); what was played, and how."""
    played = dataclasses.replace(scenario, requests=[], drain_finished=None, drain_returned_ns=0)
    backend = (ThreadBackend if played.threaded else AsyncBackend)({})
    stats = ModelStats()
    scheduler = asyncio.run(asyncio.wait_for(play(played, backend, stats), SCENARIO_TIMEOUT_S))
    return played, backend, stats, scheduler


def check_answers(scenario: Scenario, backend: Backend) -> None:
    """Each submit's one answer agrees with what ran."""
    ran: dict[int, Execution] = {}
    for execution in backend.executions:
        for index in execution.ids:
            assert index not in ran, f"request {index} ran twice"
            ran[index] = execution
    abandoned = scenario.drain_finished is False
    for request in scenario.requests:
        outcome, execution = request.outcome, ran.get(request.index)
        if not request.sent:
            assert request.cancelled and execution is None
            continue
        assert outcome is not None, f"request {request.index} was never answered"
        if isinstance(outcome, ModelRetired):
            assert request.retired_before and execution is None
        elif isinstance(outcome, QueueFull):
            assert not request.retired_before and request.depth_before >= scenario.capacity and execution is None
        elif isinstance(outcome, list):
            assert execution is not None and execution.outcome == "ok", (request.index, execution)
            (y,) = outcome
            assert y.name == "y" and y.dtype is DType.INT64
            np.testing.assert_array_equal(y.data, model(request.inputs[0].data))
        elif isinstance(outcome, DeadlineExceeded):
            assert request.deadline_ns and execution is None, (request.index, execution)
        elif isinstance(outcome, ModelFailure):
            assert execution is not None and execution.outcome in ("failed", "terminated", "cancelled"), \
                (request.index, execution)
        elif isinstance(outcome, asyncio.CancelledError):
            assert request.cancelled
        elif isinstance(outcome, Unavailable) and "it was not run" in str(outcome):
            # Still queued when drain's grace passed: answered then, and never started.
            assert scenario.drain_finished is not None and execution is None, (request.index, execution)
        elif isinstance(outcome, Unavailable):
            # drain gave up on it (running past the grace and the terminate wait).
            assert abandoned, (request.index, outcome)
        else:
            raise AssertionError(f"request {request.index}: unexpected {outcome!r}")
        if request.event.deadline == "past" and not request.retired_before:
            assert execution is None, f"request {request.index} expired on arrival and still ran"
        if not request.cancelled and not abandoned and request.event.deadline in ("none", "long") \
                and not isinstance(outcome, (ModelRetired, QueueFull)):
            assert isinstance(outcome, (list, ModelFailure)) or (
                isinstance(outcome, Unavailable) and "it was not run" in str(outcome)), (request.index, outcome)
    for index in ran:
        request = scenario.requests[index]
        assert not isinstance(request.outcome, (ModelRetired, QueueFull))


def check_executions(scenario: Scenario, backend: Backend) -> None:
    policy = scenario.policy
    assert backend.peak <= scenario.instances
    for execution in backend.executions:
        assert list(execution.ids) == sorted(execution.ids), "a batch out of arrival order"
        assert execution.rows == sum(scenario.requests[i].event.rows for i in execution.ids)
        if not policy.enabled:
            assert len(execution.ids) == 1
        elif len(execution.ids) > 1:
            assert execution.rows <= policy.max_rows
        # A drain that gave up returns with calls still handed to the pool: a thread that took one as it returned
        # starts it a moment later (the pool's race, see check_stats; seen under load on Python 3.13, an execution
        # begun 9 ms after a 1 ms grace gave up). One that finished has nothing left to start.
        if scenario.drain_finished is not False:
            assert execution.start_ns <= scenario.drain_returned_ns, "an execution started after drain returned"
        if scenario.drain_finished:
            assert execution.end_ns and execution.end_ns <= scenario.drain_returned_ns, \
                "drain said everything finished while an execution still ran"


def check_stats(scenario: Scenario, backend: Backend, stats: ModelStats) -> None:
    accepted = [r for r in scenario.requests if r.sent and not isinstance(r.outcome, (ModelRetired, QueueFull))]
    ok = [e for e in backend.executions if e.outcome == "ok"]
    assert stats.batcher.total_submitted == len(accepted)
    # A request's queue and compute times are handed to its caller, for the data plane to charge to its
    # success: every request answered with outputs has them, and none whose execution did not succeed (one
    # whose caller left, or that drain answered, while it ran is charged nothing either way).
    for request in scenario.requests:
        execution = next((e for e in ok if request.index in e.ids), None)
        if isinstance(request.outcome, list) or execution is None:
            assert (request.timing.compute_ns is not None) == (execution is not None), (request.index, request.outcome)
        if execution is not None:
            assert 0 <= request.timing.queue_ns <= execution.start_ns - request.sent_ns
    assert stats.queue.count == 0 and sum(stats.queue_seconds.counts) == 0
    # A batch is counted (as a failed one) also when drain's pool shutdown dropped its call before a thread took
    # it: only when drain gave up, and then its requests were answered Unavailable.
    unstarted = stats.batcher.total_batches - len(backend.executions)
    assert unstarted == 0 or (unstarted > 0 and scenario.drain_finished is False)
    assert stats.batcher.total_batch_size >= sum(e.rows for e in backend.executions)
    assert (stats.batcher.total_batch_size == sum(e.rows for e in backend.executions)) == (unstarted == 0)
    assert sum(stats.batch_rows.counts) == stats.batcher.total_batches
    assert stats.execution_count == len(ok)
    assert stats.batcher.total_completed == sum(len(e.ids) for e in ok)
    assert {rows: d.compute_infer.count for rows, d in stats.batches.items()} == collections.Counter(e.rows for e in ok)
    assert stats.compute_infer.count == 0
    assert sum(stats.compute_seconds.counts) == len(ok)
    assert stats._running == 0
    # Only the data plane answers requests: the scheduler records no success or failure of its own.
    assert stats.success.count == 0 and stats.fail.count == 0 and stats.inference_count == 0


def describe(scenario: Scenario, backend: Backend) -> None:
    """What the example exercised (``--hypothesis-show-statistics``)."""
    event(f"drain finished: {scenario.drain_finished}")
    event(f"largest batch: {min(3, max((len(e.ids) for e in backend.executions), default=0))} request(s)")
    for kind in sorted({type(r.outcome).__name__ for r in scenario.requests if r.sent}):
        event(f"an answer: {kind}")


@BOUNDED
@given(scenarios())
def test_every_submit_is_answered_once_with_its_own_rows(scenario: Scenario) -> None:
    scenario, backend, stats, scheduler = run_scenario(scenario)
    describe(scenario, backend)
    assert scenario.drain_returned_ns, "drain never returned"
    check_answers(scenario, backend)
    check_executions(scenario, backend)
    assert scheduler.queue_depth == 0 and scheduler.running_threads == 0
    if scenario.drain_finished:  # (after an abandonment: see the statistics property)
        assert scheduler.idle


def thread_scenario(*events, grace_s: float | None = None) -> Scenario:
    return Scenario(True, BatchPolicy(enabled=False), capacity=1, instances=1, events=list(events),
                    final_grace_s=grace_s, terminate=False)


# A caller that leaves just after its worker thread ended (the loop busy a moment: the thread's end is queued
# before the cancellation is seen) lost its execution from the statistics, and ModelStats stayed "running".
LEFT_AFTER_THREAD_ENDED = thread_scenario(Submit(1, "none", 1.0, Plan("ok", 0.0)), Pause(0.0), Block(10.0), Cancel(0))
# A caller that leaves while its thread runs, whose outputs then fail the signature: it was counted as a success.
LEFT_BEFORE_WRONG_ROWS = thread_scenario(Submit(1, "none", 1.0, Plan("wrong_rows", 3.0)), Pause(0.0), Cancel(0))
# drain gives up on a run that outlasts the grace: the request still queued is answered Unavailable, and was
# never counted as having left the queue (README: queue time counts every request that left the queue, run or not).
ABANDONED_WHILE_QUEUED = thread_scenario(Submit(1, "none", 1.0, Plan("ok", 30.0)), Submit(1, "none", 1.0, Plan()),
                                         grace_s=0.0)
# drain(0) with a request waiting out the batching delay (nothing runs): the request was abandoned, and the
# scheduler, with nothing queued or running afterwards, never said idle again. Draining, it now runs at once
# (tests/core/test_scheduler.py has the deterministic test).
QUEUED_FOR_COMPANY_AT_DRAIN = Scenario(False, BatchPolicy(True, 2, 3_000_000), capacity=1, instances=1,
                                       events=[Submit(1, "none", 1.0, Plan()), Drain(0.0)], final_grace_s=None,
                                       terminate=False)


@BOUNDED
@example(LEFT_AFTER_THREAD_ENDED)
@example(LEFT_BEFORE_WRONG_ROWS)
@example(ABANDONED_WHILE_QUEUED)
@example(QUEUED_FOR_COMPANY_AT_DRAIN)
@given(scenarios())
def test_the_statistics_agree_with_what_ran(scenario: Scenario) -> None:
    scenario, backend, stats, scheduler = run_scenario(scenario)
    check_stats(scenario, backend, stats)
    assert scheduler.idle, "nothing queued or running, and yet not idle"


def test_an_execution_whose_thread_ended_as_its_caller_left_is_counted() -> None:
    _, backend, stats, _ = run_scenario(LEFT_AFTER_THREAD_ENDED)
    assert [e.outcome for e in backend.executions] == ["ok"]
    assert (stats.batcher.total_batches, stats.execution_count, stats._running) == (1, 1, 0)


def test_an_abandoned_execution_with_wrong_outputs_is_not_a_success() -> None:
    _, backend, stats, _ = run_scenario(LEFT_BEFORE_WRONG_ROWS)
    assert [e.outcome for e in backend.executions] == ["failed"]
    assert (stats.batcher.total_batches, stats.execution_count, stats.batcher.total_completed, stats.batches) == \
        (1, 0, 0, {})


def test_requests_queued_when_drain_abandons_a_model_are_answered_and_charged_nothing() -> None:
    played, backend, stats, _ = run_scenario(ABANDONED_WHILE_QUEUED)
    assert played.drain_finished is False
    assert [type(r.outcome) for r in played.requests] == [Unavailable, UnloadedBeforeStart]  # (abandoned; not run)
    assert [r.timing.compute_ns for r in played.requests] == [None, None]
    assert (stats.batcher.total_submitted, stats.queue.count, sum(stats.queue_seconds.counts)) == (2, 0, 0)
