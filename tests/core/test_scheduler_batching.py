"""The scheduler's dynamic batching end to end (asyncio, worker threads): coalescing, splitting, delays,
deadlines, failures, instances. The rules themselves are tested purely in test_batching.py."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from nereid.batching import BatchPolicy
from nereid.dtypes import DType
from nereid.errors import DeadlineExceeded, ModelFailure, ModelKilled, NotStarted
from nereid.scheduler import ModelScheduler
from nereid.settings import BatchingSettings
from nereid.signature import ModelSignature, TensorSpec
from nereid.stats import ModelStats
from nereid.tensors import NamedTensor

FIXED = ModelSignature((TensorSpec("x", DType.FP32, (2,)),), (TensorSpec("y", DType.FP32, (2,)),), 16)
VARIABLE = ModelSignature((TensorSpec("x", DType.FP32, (-1,)),), (TensorSpec("y", DType.FP32, (-1,)),), 16)


class RecordingBackend:
    """Doubles its input; records each batch's rows; holds executions until ``gate`` opens."""

    platform = "test"

    def __init__(self, fail_when=None) -> None:
        self.gate = threading.Event()
        self.batches: list[list[float]] = []
        self.fail_when = fail_when

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        self.gate.wait(10)
        self.batches.append([float(v) for v in inputs[0].data[:, 0]])
        if self.fail_when is not None and self.fail_when(inputs[0].data):
            raise RuntimeError("bad row in batch")
        return [NamedTensor("y", DType.FP32, inputs[0].data * 2)]


def request(value: float, rows: int = 1, width: int = 2) -> list[NamedTensor]:
    return [NamedTensor("x", DType.FP32, np.full((rows, width), value, dtype=np.float32))]


def policy(**settings) -> BatchPolicy:
    return BatchPolicy.resolve(BatchingSettings(**settings), FIXED, "nereid.yaml: models[0]")


async def start_blocked(scheduler: ModelScheduler, backend: RecordingBackend) -> asyncio.Task:
    """Occupy the only instance so that what follows queues up behind it."""
    blocker = asyncio.create_task(scheduler.submit(request(-1), 1, 0))
    await asyncio.sleep(0.05)
    return blocker


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


def test_queued_requests_are_coalesced_up_to_the_cap_and_split_back_by_rows() -> None:
    async def scenario() -> None:
        backend = RecordingBackend()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, ModelStats(), policy(max_batch_size=6))
        blocker = await start_blocked(scheduler, backend)
        sizes = [1, 2, 3, 1, 4]
        tasks = [asyncio.create_task(scheduler.submit(request(i, rows), rows, 0)) for i, rows in enumerate(sizes)]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await blocker
        results = await asyncio.gather(*tasks)
        for i, (rows, result) in enumerate(zip(sizes, results)):
            assert result[0].shape == (rows, 2)
            assert np.all(result[0].data == 2 * i)  # each request gets exactly its own rows
        # arrival order, never past 6 rows: [0,1,1,2,2,2] then [3,4,4,4,4]
        assert backend.batches[1:] == [[0, 1, 1, 2, 2, 2], [3, 4, 4, 4, 4]]
        await scheduler.drain()
    run(scenario())


def test_large_requests_are_stacked_into_their_batch_off_the_event_loop(monkeypatch) -> None:
    """Found by the read hunt: a batch of 32 requests of 8 MiB was stacked on the event loop, holding it for over a
    second, where each request's decode, and its outputs' check, were made off it."""
    import nereid.scheduler as scheduler_module

    stacked_on: list[str] = []
    real = scheduler_module.stack_rows

    def stack_rows(requests, rows):
        stacked_on.append(threading.current_thread().name)
        return real(requests, rows)

    monkeypatch.setattr(scheduler_module, "stack_rows", stack_rows)
    monkeypatch.setattr(scheduler_module, "CHECK_OFF_LOOP_BYTES", 16)  # (two rows of 2 x FP32 pass it)

    async def scenario() -> None:
        backend = RecordingBackend()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, ModelStats(), policy(max_batch_size=6))
        blocker = await start_blocked(scheduler, backend)
        tasks = [asyncio.create_task(scheduler.submit(request(i, 2), 2, 0)) for i in (1, 2)]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await blocker
        results = await asyncio.gather(*tasks)
        assert [result[0].data.tolist() for result in results] == [[[2, 2]] * 2, [[4, 4]] * 2]
        assert backend.batches[-1] == [1, 1, 2, 2]
        await scheduler.drain()
    run(scenario())
    assert stacked_on and threading.main_thread().name not in stacked_on, stacked_on


def test_no_memory_to_stack_a_batch_is_the_server_s_condition_and_no_execution(monkeypatch) -> None:
    """Found by the exhaustion hunt: requests that each fit, merged into a batch the server had no memory for,
    were all "model 'm' failed: MemoryError", an ERROR counted as the model's fault and as an execution."""
    import nereid.scheduler as scheduler_module
    from nereid.errors import OutOfMemory

    def no_memory(requests, rows):
        raise MemoryError()

    monkeypatch.setattr(scheduler_module, "stack_rows", no_memory)

    async def scenario() -> None:
        backend = RecordingBackend()
        stats = ModelStats()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, stats, policy(max_batch_size=6))
        blocker = await start_blocked(scheduler, backend)
        tasks = [asyncio.create_task(scheduler.submit(request(i), 1, 0)) for i in (1, 2)]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await blocker
        for task in tasks:
            with pytest.raises(OutOfMemory, match=r"^model 'm': the server ran out of memory stacking a batch of 2 "
                                                  r"requests \(16 bytes\); try again later$"):
                await task
        assert backend.batches == [[-1]]  # only the blocker ran
        assert stats.snapshot().execution_count == 1
        await scheduler.drain()
    run(scenario())


def test_requests_with_different_non_batch_shapes_are_never_mixed() -> None:
    async def scenario() -> None:
        backend = RecordingBackend()
        scheduler = ModelScheduler("m", backend, VARIABLE, 64, 1, ModelStats(),
                                   BatchPolicy.resolve(BatchingSettings(), VARIABLE, "x"))
        blocker = asyncio.create_task(scheduler.submit(request(-1, 1, 3), 1, 0))
        await asyncio.sleep(0.05)
        widths = [3, 3, 5, 3, 5]
        tasks = [asyncio.create_task(scheduler.submit(request(i, 1, w), 1, 0)) for i, w in enumerate(widths)]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await blocker
        results = await asyncio.gather(*tasks)
        assert [r[0].shape for r in results] == [(1, w) for w in widths]
        assert backend.batches[1:] == [[0, 1], [2], [3], [4]]  # a different shape starts the next batch
        await scheduler.drain()
    run(scenario())


def test_cost_budget_closes_the_batch_and_first_request_is_always_accepted() -> None:
    async def scenario() -> None:
        backend = RecordingBackend()
        budget = BatchPolicy.resolve(BatchingSettings(max_batch_cost=10), VARIABLE, "x")
        scheduler = ModelScheduler("m", backend, VARIABLE, 64, 1, ModelStats(), budget)
        blocker = asyncio.create_task(scheduler.submit(request(-1, 1, 4), 1, 0))
        await asyncio.sleep(0.05)
        # costs (rows x width): 12 (over budget alone), then 4 + 4 + 4 (closes at 12 >= 10), then 4
        specs = [(0, 3), (1, 1), (2, 1), (3, 1), (4, 1)]
        tasks = [asyncio.create_task(scheduler.submit(request(v, rows, 4), rows, 0)) for v, rows in specs]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await blocker
        await asyncio.gather(*tasks)
        assert backend.batches[1:] == [[0, 0, 0], [1, 2, 3], [4]]
        await scheduler.drain()
    run(scenario())


def test_delay_window_waits_for_company_and_zero_delay_dispatches_at_once() -> None:
    async def scenario(delay_ms: float) -> list[list[float]]:
        backend = RecordingBackend()
        backend.gate.set()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, ModelStats(), policy(max_queue_delay_ms=delay_ms))
        first = asyncio.create_task(scheduler.submit(request(0), 1, 0))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(scheduler.submit(request(1), 1, 0))
        await asyncio.gather(first, second)
        await scheduler.drain()
        return backend.batches

    assert run(scenario(400)) == [[0, 1]]
    assert run(scenario(0)) == [[0], [1]]


def test_preferred_size_dispatches_early_and_cuts_an_oversized_batch() -> None:
    async def scenario() -> None:
        backend = RecordingBackend()
        backend.gate.set()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, ModelStats(),
                                   policy(preferred_batch_sizes=[4], max_queue_delay_ms=5000))
        started = time.monotonic()
        tasks = [asyncio.create_task(scheduler.submit(request(i), 1, 0)) for i in range(6)]
        await asyncio.gather(*tasks[:4])
        assert time.monotonic() - started < 2  # the preferred size did not wait out the 5 s window
        assert backend.batches == [[0, 1, 2, 3]]  # cut back from 6 to the preferred 4
        more = [asyncio.create_task(scheduler.submit(request(i), 1, 0)) for i in (6, 7)]
        await asyncio.gather(*tasks[4:], *more)
        assert backend.batches[1] == [4, 5, 6, 7]  # the rest stayed first in line
        await scheduler.drain()
    run(scenario())


@pytest.mark.parametrize("delay_ms", [0, 300])
def test_two_requests_passing_the_largest_preferred_size_together_run_apart_as_triton_runs_them(delay_ms) -> None:
    """Found by a bug hunt: max_batch_size 8, preferred [4], two 3-row requests queued behind a running one ran as
    one batch of 6 (ModelStatistics: sizes 1 and 6); Triton's batcher runs the batch marked before the request
    that would pass 4, [3], and then [3] (with a delay, the first at once, not after the delay)."""
    async def scenario() -> None:
        backend = RecordingBackend()
        stats = ModelStats()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, stats,
                                   policy(max_batch_size=8, preferred_batch_sizes=[4], max_queue_delay_ms=delay_ms))
        blocker = asyncio.create_task(scheduler.submit(request(-1, rows=4), 4, 0))  # a preferred size: goes at once
        await until(lambda: stats.running_executions == 1)  # and holds the one instance (the gate is shut)
        tasks = [asyncio.create_task(scheduler.submit(request(i, rows=3), 3, 0)) for i in range(2)]
        await until(lambda: scheduler.queue_depth == 2)
        backend.gate.set()
        await asyncio.gather(blocker, *tasks)
        assert backend.batches == [[-1] * 4, [0] * 3, [1] * 3]
        await scheduler.drain()
        assert {rows: b.compute_infer.count for rows, b in stats.snapshot().batches.items()} == {4: 1, 3: 2}
    run(scenario())


def test_expired_request_is_answered_when_its_batch_forms_and_the_others_run() -> None:
    async def scenario() -> None:
        backend = RecordingBackend()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, ModelStats(), policy())
        blocker = await start_blocked(scheduler, backend)
        keep = asyncio.create_task(scheduler.submit(request(1), 1, 0))
        expire = asyncio.create_task(scheduler.submit(request(2), 1, time.monotonic_ns() + 10_000_000))
        keep2 = asyncio.create_task(scheduler.submit(request(3), 1, 0))
        await asyncio.sleep(0.1)
        backend.gate.set()
        await blocker
        with pytest.raises(DeadlineExceeded, match="it was not run"):
            await expire
        await asyncio.gather(keep, keep2)
        assert backend.batches[1:] == [[1, 3]]
        await scheduler.drain()
    run(scenario())


class PaddingBackend(RecordingBackend):
    """Runs only at 4 or 8 rows (PadsBatches): records the arrays it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.arrays: list[np.ndarray] = []

    def padded_rows(self, rows: int) -> int:
        return 4 if rows <= 4 else 8

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        self.arrays.append(inputs[0].data)
        return super().infer(inputs)


def test_a_padding_model_gets_coalesced_requests_in_one_zero_padded_buffer() -> None:
    async def scenario() -> None:
        backend = PaddingBackend()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, ModelStats(), policy())
        blocker = await start_blocked(scheduler, backend)
        tasks = [asyncio.create_task(scheduler.submit(request(v, rows), rows, 0)) for v, rows in ((1, 2), (2, 3))]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await blocker
        first, second = await asyncio.gather(*tasks)
        batch = backend.arrays[1]
        assert batch.shape == (8, 2)  # 5 rows assembled straight into the 8-row size
        assert batch[:, 0].tolist() == [1, 1, 2, 2, 2, 0, 0, 0]
        assert first[0].data.tolist() == [[2, 2]] * 2 and second[0].data.tolist() == [[4, 4]] * 3
        await scheduler.drain()
    run(scenario())


def test_a_failing_batch_fails_each_of_its_requests_and_the_scheduler_carries_on() -> None:
    async def scenario() -> None:
        backend = RecordingBackend(fail_when=lambda data: bool((data == 13).any()))
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, ModelStats(), policy())
        blocker = await start_blocked(scheduler, backend)
        doomed = [asyncio.create_task(scheduler.submit(request(v), 1, 0)) for v in (12, 13, 14)]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await blocker
        for task in doomed:
            with pytest.raises(ModelFailure, match="model 'm' failed: RuntimeError: bad row in batch"):
                await task
        assert float((await scheduler.submit(request(5), 1, 0))[0].data[0, 0]) == 10
        await scheduler.drain()
    run(scenario())


def test_instances_run_batches_concurrently_and_stats_count_them() -> None:
    async def scenario() -> None:
        backend = RecordingBackend()
        stats = ModelStats()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 2, stats, policy(max_batch_size=2))
        tasks = [asyncio.create_task(scheduler.submit(request(i), 1, 0)) for i in range(6)]
        await asyncio.sleep(0.1)
        # the first two found an idle instance each and started at once; the rest wait
        assert scheduler.queue_depth == 4
        backend.gate.set()
        await asyncio.gather(*tasks)
        assert sorted(backend.batches) == [[0], [1], [2, 3], [4, 5]]
        await scheduler.drain()
        snapshot = stats.snapshot()
        assert snapshot.batcher.total_submitted == 6 and snapshot.batcher.total_completed == 6
        assert snapshot.execution_count == snapshot.batcher.total_batches == len(backend.batches)
        assert snapshot.batcher.avg_batch_size == 6 / len(backend.batches)
        assert sorted(snapshot.batches) == sorted({len(b) for b in backend.batches})
        assert 0 < snapshot.batcher.utilization <= 1
    run(scenario())


def test_disabled_batching_runs_one_request_per_execution() -> None:
    async def scenario() -> None:
        backend = RecordingBackend()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, ModelStats(), policy(enabled=False))
        blocker = await start_blocked(scheduler, backend)
        tasks = [asyncio.create_task(scheduler.submit(request(i), 1, 0)) for i in range(3)]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await asyncio.gather(blocker, *tasks)
        assert backend.batches == [[-1], [0], [1], [2]]
        await scheduler.drain()
    run(scenario())


LOGGING_ECHO_MAIN = '''
import os, sys
with open("runs.log", "a") as log:
    log.write(os.environ["NEREID_INPUT_SHAPE"] + "\\n")
data = sys.stdin.buffer.read()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("float32 %s\\n" % os.environ["NEREID_INPUT_SHAPE"]).encode())
    out.write(data)
'''


def test_served_subprocess_model_runs_one_process_per_batch(repo, serve) -> None:
    import tritonclient.grpc as triton

    folder = repo.python("echo", main=LOGGING_ECHO_MAIN)
    server = serve(repo.write_config("""
        - name: echo
          batching:
            max_queue_delay_ms: 300
            max_batch_size: 8
    """))
    results: dict[int, np.ndarray] = {}
    done = threading.Event()

    def callback(index):
        def handle(result, error):
            results[index] = error if error is not None else result.as_numpy("output")
            if len(results) == 6:
                done.set()
        return handle

    for index in range(6):
        x = np.full((1, 4), index, dtype=np.float32)
        tensor = triton.InferInput("input", [1, 4], "FP32")
        tensor.set_data_from_numpy(x)
        server.client.async_infer("echo", [tensor], callback(index))
    assert done.wait(30)
    for index in range(6):
        assert np.array_equal(results[index], np.full((1, 4), index, dtype=np.float32)), results[index]
    shapes = (folder / "runs.log").read_text().split()
    assert sum(int(s.split(",")[0]) for s in shapes) == 6
    assert len(shapes) < 6  # requests shared processes: the batch's inputs were concatenated
    stats = server.client.get_inference_statistics("echo").model_stats[0]
    assert stats.execution_count == len(shapes) and stats.inference_count == 6
    assert sum(b.compute_infer.count * b.batch_size for b in stats.batch_stats) == 6


GATED_ECHO_MAIN = '''
import os, sys, time
shape = os.environ["NEREID_INPUT_SHAPE"]
with open("runs.log", "a") as log:
    log.write(shape + "\\n")
if shape.startswith("4,"):  # the first request: it holds the one instance until the test opens the gate
    open("started", "w").close()
    while not os.path.exists("gate"):
        time.sleep(0.01)
data = sys.stdin.buffer.read()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("float32 %s\\n" % shape).encode())
    out.write(data)
'''


def test_served_preferred_size_batches_are_triton_s_in_model_statistics(repo, serve) -> None:
    """The bug hunt's repro over gRPC: max_batch_size 8, preferred [4], delay 0, two 3-row requests queued behind
    a running one; ModelStatistics said batch sizes 1 and 6 (one batch of both), Triton's batcher runs [3], [3]."""
    import tritonclient.grpc as triton

    folder = repo.python("pref", main=GATED_ECHO_MAIN)
    server = serve(repo.write_config("""
        - name: pref
          batching: {max_batch_size: 8, preferred_batch_sizes: [4], max_queue_delay_ms: 0}
    """))
    answers: list = []

    def send(rows: int) -> None:
        tensor = triton.InferInput("input", [rows, 4], "FP32")
        tensor.set_data_from_numpy(np.full((rows, 4), rows, dtype=np.float32))
        server.client.async_infer("pref", [tensor], lambda result, error: answers.append(error or result))

    def wait_for(predicate) -> None:
        deadline = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    send(4)
    try:
        wait_for((folder / "started").exists)
        scheduler = server.server.repository.ready_model("pref").scheduler
        send(3)
        send(3)
        wait_for(lambda: scheduler.queue_depth == 2)
    finally:
        (folder / "gate").touch()  # (a failure above leaves no run waiting for the server's stop to end it)
    wait_for(lambda: len(answers) == 3)
    assert all(isinstance(answer, triton.InferResult) for answer in answers), answers
    assert (folder / "runs.log").read_text().split() == ["4,4", "3,4", "3,4"]
    stats = server.client.get_inference_statistics("pref").model_stats[0]
    assert {b.batch_size: b.compute_infer.count for b in stats.batch_stats} == {4: 1, 3: 2}


class BadPadding(PaddingBackend):
    """A PadsBatches backend whose padded_rows raises, or answers fewer rows than it was asked for."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def padded_rows(self, rows: int) -> int:
        if self.fault == "raises":
            raise RuntimeError("no compiled size fits")
        return rows - 1


@pytest.mark.parametrize("fault, message", [
    ("raises", r"padded_rows\(2\): RuntimeError: no compiled size fits"),
    ("fewer", r"padded_rows\(2\) returned 1, expected at least 2$"),
])
def test_a_failing_padded_rows_fails_each_request_of_the_batch_and_the_model_serves_on(fault, message) -> None:
    """Defect: padded_rows and the batch's assembly ran outside the execution's error handling: every
    request of the coalesced batch went unanswered ("Task exception was never retrieved")."""
    async def scenario() -> None:
        backend = BadPadding(fault)
        stats = ModelStats()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, stats, policy())
        blocker = await start_blocked(scheduler, backend)
        doomed = [asyncio.create_task(scheduler.submit(request(v), 1, 0)) for v in (1, 2)]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await blocker
        for task in doomed:
            with pytest.raises(ModelFailure, match=f"^model 'm' failed: {message}"):
                await asyncio.wait_for(task, 5)
        assert stats.batcher.total_batches == 2 and stats.execution_count == 1  # counted, as failed
        assert float((await scheduler.submit(request(5), 1, 0))[0].data[0, 0]) == 10
        await scheduler.drain()
    run(scenario())


class ShortPadding(PaddingBackend):
    """Given a padded batch (8 rows), answers ``rows`` of them."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        (output,) = super().infer(inputs)
        return [NamedTensor(output.name, output.dtype, output.data[:self.rows]) if len(output.data) == 8 else output]


@pytest.mark.parametrize("answered", [6, 4])
def test_a_padded_batch_answered_with_other_than_its_padded_rows_is_a_model_fault(answered) -> None:
    """Found by a bug hunt: a backend handed 8 rows (5 of requests, padded) that answered 6 was taken (its rows
    cut to 5, as if right), and one that answered 4 was refused as "expected [5, 2]": the rows were cut before
    the check, which then held the model to the requests' rows, not to those it was given."""
    async def scenario() -> None:
        backend = ShortPadding(answered)
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, ModelStats(), policy())
        blocker = await start_blocked(scheduler, backend)
        doomed = [asyncio.create_task(scheduler.submit(request(v, rows), rows, 0)) for v, rows in ((1, 2), (2, 3))]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await blocker
        for task in doomed:
            with pytest.raises(ModelFailure, match=rf"^model 'm' returned output 'y' .*\[{answered}, 2\].*\[8, 2\]"):
                await asyncio.wait_for(task, 5)
        assert float((await scheduler.submit(request(5), 1, 0))[0].data[0, 0]) == 10
        await scheduler.drain()
    run(scenario())


class TimedGates:
    """Doubles its input; records when each execution started, by its first value; holds the values that have a
    gate until it opens."""

    platform = "test"

    def __init__(self, *held: float) -> None:
        self.gates = {value: threading.Event() for value in held}
        self.started: dict[float, float] = {}

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        value = float(inputs[0].data[0, 0])
        self.started[value] = time.monotonic()
        if value in self.gates:
            self.gates[value].wait(10)
        return [NamedTensor("y", DType.FP32, inputs[0].data * 2)]


async def until_started(backend: TimedGates, value: float) -> None:
    deadline = time.monotonic() + 5
    while value not in backend.started:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


# Two-row requests go at once (a preferred size); a one-row request waits 300 ms for company.
DELAY_S = 0.3


def two_instances(backend: TimedGates) -> ModelScheduler:
    return ModelScheduler("m", backend, FIXED, 64, 2, ModelStats(),
                          policy(preferred_batch_sizes=[2], max_queue_delay_ms=DELAY_S * 1000))


def test_a_queue_too_full_for_another_request_sends_its_batch_without_waiting_for_company() -> None:
    """Defect (the config hunt): with a queue_capacity under the preferred batch size, the requests that filled
    the queue waited out max_queue_delay_ms for company the full queue refused (a minute here)."""
    from nereid.errors import Unavailable

    async def scenario() -> None:
        backend = RecordingBackend()
        backend.gate.set()
        scheduler = ModelScheduler("m", backend, FIXED, 2, 1, ModelStats(),
                                   policy(max_queue_delay_ms=60_000, preferred_batch_sizes=[4]))
        first = [asyncio.create_task(scheduler.submit(request(i), 1, 0)) for i in range(2)]
        await asyncio.sleep(0.05)
        assert backend.batches == []  # (room for one more past the free instance: it waits for company)
        last = asyncio.create_task(scheduler.submit(request(2), 1, 0))  # fills the queue: none can join
        refused = asyncio.create_task(scheduler.submit(request(3), 1, 0))
        results = await asyncio.wait_for(asyncio.gather(*first, last), 10)
        with pytest.raises(Unavailable, match="queue is full"):
            await refused
        assert backend.batches == [[0.0, 1.0, 2.0]]
        assert [float(outputs[0].data[0, 0]) for outputs in results] == [0.0, 2.0, 4.0]
        await scheduler.drain()
    run(scenario())


def test_a_request_with_an_instance_free_waits_its_delay_though_another_instance_frees_meanwhile() -> None:
    """Defect: every execution's end restarted the first request's window, also while another instance stood
    free: with 2 instances, a request waited up to twice max_queue_delay_ms."""
    async def scenario() -> None:
        backend = TimedGates(1)
        scheduler = two_instances(backend)
        running = asyncio.create_task(scheduler.submit(request(1, rows=2), 2, 0))
        await until_started(backend, 1)
        arrived = time.monotonic()
        waiting = asyncio.create_task(scheduler.submit(request(2), 1, 0))  # the second instance is free
        await asyncio.sleep(0.2)
        backend.gates[1].set()  # the first instance frees inside the waiting request's window
        await asyncio.gather(running, waiting)
        # It went at arrival + 300 ms; from the other instance's end it would have gone at arrival + 500 ms.
        assert DELAY_S - 0.05 <= backend.started[2] - arrived < DELAY_S + 0.15
        await scheduler.drain()
    run(scenario())


def test_a_request_queued_while_every_instance_is_busy_waits_its_delay_from_when_the_first_one_frees() -> None:
    """Time spent waiting for a busy model does not count as waiting for company; the second instance's end,
    with the first one free already, does not start the wait again."""
    async def scenario() -> None:
        backend = TimedGates(1, 2)
        scheduler = two_instances(backend)
        running = [asyncio.create_task(scheduler.submit(request(v, rows=2), 2, 0)) for v in (1, 2)]
        await until_started(backend, 2)
        waiting = asyncio.create_task(scheduler.submit(request(3), 1, 0))  # every instance busy
        await asyncio.sleep(0.1)
        backend.gates[1].set()
        await running[0]
        freed = time.monotonic()
        await asyncio.sleep(0.2)
        backend.gates[2].set()  # inside the waiting request's window, with the first instance free
        await asyncio.gather(running[1], waiting)
        assert DELAY_S - 0.05 <= backend.started[3] - freed < DELAY_S + 0.15
        await scheduler.drain()
    run(scenario())


class BareArrays(PaddingBackend):
    """A padding model that returns its output as a bare array, or as a 0-d NamedTensor."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        doubled = super().infer(inputs)[0].data
        return [doubled] if self.fault == "bare" else [NamedTensor("y", DType.FP32, np.array(doubled[0, 0]))]


@pytest.mark.parametrize("fault, message", [
    ("bare", r"returned a list whose item 0 is ndarray array\(.*, expected a list of NamedTensor \(outputs \['y'\]\)$"),
    ("0-d", r"returned output 'y' with shape \[\], expected \[4, 2\]$"),  # the rows it was given, padding too
])
def test_malformed_outputs_of_a_padded_batch_are_refused_as_a_lone_requests_are(fault, message) -> None:
    """Defect: the padding rows were cut off before the outputs were checked: a bare array failed the batch with
    "AttributeError: 'numpy.ndarray' object has no attribute 'name'", logged as a crash and naming no output."""
    async def scenario() -> None:
        backend = BareArrays(fault)
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, ModelStats(), policy())
        blocker = asyncio.create_task(scheduler.submit(request(-1, rows=2), 2, 0))  # (alone: not padded)
        await asyncio.sleep(0.05)
        doomed = [asyncio.create_task(scheduler.submit(request(v), 1, 0)) for v in (1, 2)]
        await asyncio.sleep(0.05)
        backend.gate.set()
        await asyncio.gather(blocker, return_exceptions=True)
        for task in doomed:
            with pytest.raises(ModelFailure, match=f"(?s)^model 'm' {message}") as caught:
                await task
            assert type(caught.value) is ModelFailure  # the model's fault as check_outputs words it, no crash
        assert backend.arrays[1].shape == (4, 2)  # the two requests ran padded
        await scheduler.drain()
    run(scenario())


def test_an_abandoned_padded_batch_with_malformed_outputs_gives_its_instance_back_when_its_thread_ends() -> None:
    """Defect: the end of the abandoned execution's thread raised in the loop's callback, before the slot it kept
    was given back: the model ran one instance short for good, was never idle, and counted an execution running."""
    async def scenario() -> None:
        backend, stats = BareArrays("bare"), ModelStats()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, stats, policy(max_queue_delay_ms=20))
        callers = [asyncio.create_task(scheduler.submit(request(v), 1, 0)) for v in (1, 2)]
        await until(lambda: scheduler.running_threads == 1)
        assert not await scheduler.drain(0.05, terminate_wait_s=0.05)  # an unload whose grace passed
        await asyncio.gather(*callers, return_exceptions=True)
        backend.gate.set()
        await until(lambda: scheduler.running_threads == 0)
        await asyncio.sleep(0.05)
        assert backend.arrays[0].shape == (4, 2)
        assert scheduler.idle and scheduler._free_slots == 1 and stats.running_executions == 0
        assert stats.batcher.total_batches == 1 and stats.execution_count == 0  # counted when it ended, as failed
    run(scenario())



class NotStartedFirst(RecordingBackend):
    """Raises NotStarted (none of its code ran: a python model's warm parent died before it forked the run) on its
    first call, once ``gate`` opens; doubles its input after."""

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        if not self.batches:
            self.batches.append([float(v) for v in inputs[0].data[:, 0]])
            assert self.gate.wait(10)
            raise NotStarted(ModelKilled("model 'm': its warm parent process was killed by signal SIGKILL (it did "
                                         "not fork the run)"))
        return super().infer(inputs)


def test_a_batch_the_backend_did_not_start_is_sent_again_without_its_requests_out_of_time() -> None:
    """Each request of a batch sent once more is looked at as when the batch left the queue: one whose deadline
    passed meanwhile is answered DEADLINE_EXCEEDED and not run; the others run (the warm parent hunt)."""
    async def scenario() -> None:
        backend = NotStartedFirst()
        stats = ModelStats()
        scheduler = ModelScheduler("m", backend, FIXED, 64, 1, stats, policy(max_batch_size=2,
                                                                            max_queue_delay_ms=60_000))
        deadline_ns = time.monotonic_ns() + 1_000_000_000  # (the two are batched at once, well before it)
        expiring = asyncio.create_task(scheduler.submit(request(1), 1, deadline_ns))
        keeps = asyncio.create_task(scheduler.submit(request(2), 1, time.monotonic_ns() + 60_000_000_000))
        await until(lambda: backend.batches == [[1.0, 2.0]])
        await until(lambda: time.monotonic_ns() > deadline_ns)
        backend.gate.set()
        with pytest.raises(DeadlineExceeded, match=r"^model 'm': deadline passed .* its batch, which had not "
                                                   r"started, was to be sent again: .*; it was not run$"):
            await expiring
        assert float((await keeps)[0].data[0, 0]) == 4
        assert backend.batches == [[1.0, 2.0], [2.0]]
        assert stats.execution_count == 1
        await scheduler.drain()
    run(scenario())
