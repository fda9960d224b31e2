"""Deadlines on a model's request path with a preprocess hook (nereid.model_runner): a request already out of
time runs none of the model's code, and one whose deadline passes while its hook runs is answered
DEADLINE_EXCEEDED then, saying the hook ran, while the hook finishes on its own thread.

Defect (found by a bug hunt of deadlines): the hook ran for a request sent with ``timeout`` = 1 µs, and one
with a 300 ms deadline was answered 700 ms late, when its 1 s hook returned; both were told "it was not run"."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import tritonclient.grpc as triton

from nereid.dtypes import DType
from nereid.errors import DeadlineExceeded, QueueFull
from nereid.model_runner import HOOK_THREADS, HookThreads, Runner, make_runner
from nereid.scheduler import ModelScheduler
from nereid.signature import ModelSignature, TensorSpec
from nereid.stats import ModelStats
from nereid.tensors import NamedTensor
from support import expect_grpc_error, scrape

SIGNATURE = ModelSignature((TensorSpec("x", DType.FP32, (2,)),), (TensorSpec("y", DType.FP32, (2,)),), 4)


class Slow:
    """Doubles its input; its preprocess hook and its program each wait for their event when the request's
    first value says so (1: the hook waits, 2: the program waits). Counts what ran, by request value."""

    platform = "test"

    def __init__(self) -> None:
        self.hook_release, self.program_release = threading.Event(), threading.Event()
        self.hooks_begun: list[float] = []
        self.hooks_ended: list[float] = []
        self.programs_run: list[float] = []

    def preprocess(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        value = float(inputs[0].data[0, 0])
        self.hooks_begun.append(value)
        if value == 1:
            self.hook_release.wait(10)
        self.hooks_ended.append(value)
        return inputs

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        values = inputs[0].data[:, 0].tolist()
        self.programs_run.extend(values)
        if 2 in values:
            self.program_release.wait(10)
        return [NamedTensor("y", DType.FP32, inputs[0].data * 2)]


def rows(value: float) -> list[NamedTensor]:
    return [NamedTensor("x", DType.FP32, np.full((1, 2), value, dtype=np.float32))]


def runner(backend: Slow, hooks: HookThreads) -> tuple[Runner, ModelScheduler]:
    scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=HOOK_THREADS + 2, instances=1,
                               stats=ModelStats())
    return make_runner(backend, SIGNATURE, SIGNATURE, scheduler, hooks), scheduler


def in_ms(ms: float) -> int:
    """The absolute deadline ``ms`` from now (negative: already passed)."""
    return time.monotonic_ns() + int(ms * 1e6)


async def until(condition: Callable[[], object]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def scenario(body: Callable[[Slow, HookThreads, Runner], object]) -> None:
    """Run ``body(backend, hooks, run)`` on a fresh model; its events are set afterwards, whatever happened."""
    backend, hooks = Slow(), HookThreads("deadlines")

    async def main() -> None:
        run, scheduler = runner(backend, hooks)
        try:
            await body(backend, hooks, run)
        finally:
            backend.hook_release.set()
            backend.program_release.set()
            await scheduler.drain()
            hooks.release()
    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        backend.hook_release.set()
        backend.program_release.set()


@pytest.mark.parametrize("deadline_ms", [-0.001, 0], ids=["passed", "now"])
def test_a_request_already_out_of_time_is_refused_before_its_preprocess_hook(deadline_ms: float) -> None:
    async def body(backend: Slow, hooks: HookThreads, run: Runner) -> None:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match=r"^model 'm': deadline passed \d+\.\d ms before the request "
                                                   r"could start; it was not run$"):
            await run(rows(1), 1, in_ms(deadline_ms))
        assert time.monotonic() - start < 2.0  # (not after the 10 s hook: room for a loaded machine's stalls)
        assert backend.hooks_begun == [] and backend.programs_run == []  # none of the model's code ran
        assert (await run(rows(3), 1, in_ms(5000)))[0].data.tolist() == [[6, 6]]
    scenario(body)


def test_a_deadline_passing_while_the_preprocess_hook_runs_is_answered_then_and_says_the_hook_ran() -> None:
    async def body(backend: Slow, hooks: HookThreads, run: Runner) -> None:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded) as caught:
            await run(rows(1), 1, in_ms(200))
        answered = time.monotonic() - start
        assert 0.19 < answered < 3.0, answered  # at the deadline, not when the hook returns (10 s)
        assert str(caught.value).startswith("model 'm': deadline passed while the request's preprocess hook ran "
                                            "(for "), caught.value
        assert str(caught.value).endswith(" ms so far); the program was not run, and the hook runs on with its "
                                          "result dropped"), caught.value
        assert "it was not run" not in str(caught.value)
        assert backend.hooks_begun == [1] and backend.hooks_ended == []  # still running, on its own thread
        backend.hook_release.set()
        await until(lambda: backend.hooks_ended == [1])
        await asyncio.sleep(0.05)
        assert backend.programs_run == []  # its result was dropped, never queued
        # The hook's thread is the model's again: requests go on, with and without deadlines.
        assert (await run(rows(3), 1, in_ms(5000)))[0].data.tolist() == [[6, 6]]
        assert (await run(rows(4), 1, 0))[0].data.tolist() == [[8, 8]]
    scenario(body)


def test_a_request_out_of_time_while_its_hook_waits_for_a_thread_never_runs_it() -> None:
    async def body(backend: Slow, hooks: HookThreads, run: Runner) -> None:
        busy = [asyncio.create_task(run(rows(1), 1, 0)) for _ in range(HOOK_THREADS)]  # every thread in a hook
        await until(lambda: len(backend.hooks_begun) == HOOK_THREADS)
        with pytest.raises(DeadlineExceeded, match=r"^model 'm': deadline passed \d+\.\d ms before the request "
                                                   r"could start \(its preprocess hook waited \d+\.\d ms for a "
                                                   r"worker thread\); it was not run$"):
            await run(rows(5), 1, in_ms(100))
        backend.hook_release.set()
        assert [output[0].data.tolist() for output in await asyncio.gather(*busy)] == [[[2, 2]]] * HOOK_THREADS
        await asyncio.sleep(0.05)
        assert 5 not in backend.hooks_begun  # the thread freed later did not run it for nobody
        assert (await run(rows(3), 1, in_ms(5000)))[0].data.tolist() == [[6, 6]]
    scenario(body)


def test_a_request_out_of_time_in_the_queue_after_its_hook_says_the_hook_ran() -> None:
    async def body(backend: Slow, hooks: HookThreads, run: Runner) -> None:
        running = asyncio.create_task(run(rows(2), 1, 0))  # holds the one instance
        await until(lambda: backend.programs_run == [2])
        with pytest.raises(DeadlineExceeded, match=r"^model 'm': deadline passed \d+\.\d ms before the request "
                                                   r"could start \(waited \d+\.\d ms in the queue\); it was not run "
                                                   r"\(only its preprocess hook was\)$"):
            await run(rows(3), 1, in_ms(100))
        assert backend.hooks_ended == [2, 3]
        backend.program_release.set()
        assert (await running)[0].data.tolist() == [[4, 4]]
        assert backend.programs_run == [2]
    scenario(body)


def test_a_caller_gone_while_its_hook_waits_for_a_thread_never_runs_it() -> None:
    async def body(backend: Slow, hooks: HookThreads, run: Runner) -> None:
        busy = [asyncio.create_task(run(rows(1), 1, 0)) for _ in range(HOOK_THREADS)]
        await until(lambda: len(backend.hooks_begun) == HOOK_THREADS)
        gone = asyncio.create_task(run(rows(5), 1, 0))
        await asyncio.sleep(0.05)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        backend.hook_release.set()
        await asyncio.gather(*busy)
        await asyncio.sleep(0.05)
        assert 5 not in backend.hooks_begun
    scenario(body)


# --------------------------------------------------------------------------- served: the answer and its count

SLOW_PREPROCESS = '''
import pathlib, time
import nereid

FOLDER = pathlib.Path(__file__).parent


def pre(inputs):
    (FOLDER / "begun").write_text("")
    if inputs[0].data[0, 0] == 7:  # waits for the test, 10 s at most
        for _ in range(1000):
            if (FOLDER / "release").exists():
                break
            time.sleep(0.01)
    return inputs


nereid.register_model(preprocess=pre)
'''

SHIPPED = Path(__file__).resolve().parents[2] / "ml-backends"


def test_a_served_request_out_of_time_before_or_during_its_hook_is_answered_on_time_and_counted_once(repo,
                                                                                                     serve) -> None:
    bundle = shutil.copytree(SHIPPED / "mlp_bundle", repo.models_dir / "slow_hook",
                             ignore=shutil.ignore_patterns(".cache"))
    (bundle / "model.py").write_text(SLOW_PREPROCESS)
    server = serve(repo.write_config("- name: slow_hook\n"))

    def pixels(first: float) -> list[triton.InferInput]:
        tensor = triton.InferInput("input", [1, 16], "FP32")
        tensor.set_data_from_numpy(np.full((1, 16), first, np.float32))
        return [tensor]

    start = time.monotonic()
    expect_grpc_error("DEADLINE_EXCEEDED", lambda: server.client.infer("slow_hook", pixels(7), timeout=1),  # 1 µs
                      "model 'slow_hook': deadline passed ", " before the request could start; it was not run")
    assert time.monotonic() - start < 3.0 and not (bundle / "begun").exists()  # the hook never ran
    start = time.monotonic()
    expect_grpc_error("DEADLINE_EXCEEDED", lambda: server.client.infer("slow_hook", pixels(7), timeout=300_000),
                      "model 'slow_hook': deadline passed while the request's preprocess hook ran (for ",
                      "the program was not run")
    assert 0.29 < time.monotonic() - start < 5.0  # not when the hook returned (10 s)
    assert (bundle / "begun").exists()
    (bundle / "release").write_text("")
    assert server.client.infer("slow_hook", pixels(1), timeout=30_000_000).as_numpy("output").shape == (1, 4)
    (stats,) = server.client.get_inference_statistics("slow_hook").model_stats
    counts = stats.inference_stats.fail.count, stats.inference_stats.success.count, stats.execution_count
    assert counts == (2, 1, 1)  # each request once; the program ran for the last alone
    failures = {labels: value for (name, labels), value in scrape(server.server.metrics_port).items()
                if name == "nereid_request_failure_total" and ("model", "slow_hook") in labels}
    assert failures == {(("model", "slow_hook"), ("reason", "deadline_exceeded")): 2}


def test_requests_waiting_for_a_hook_thread_count_against_queue_capacity() -> None:
    """Found by a bug hunt of isolation between models: a flood of a model whose preprocess hook is slow (or
    hangs) was all accepted, each request waiting on a hook thread, whatever its queue_capacity (1,000 of 1,000,
    where a model without hooks refused 990 at once)."""
    async def scenario() -> None:
        backend, hooks = Slow(), HookThreads("m")
        run, scheduler = runner(backend, hooks)
        admitted = scheduler.capacity  # (more than the hook threads: two of them wait for one)
        calls = [asyncio.create_task(run(rows(1), 1, 0)) for _ in range(admitted)]
        await until(lambda: len(backend.hooks_begun) == HOOK_THREADS)
        with pytest.raises(QueueFull, match=r"^model 'm': queue is full \(queue_capacity \d+( \(the default\))?, "
                                            r"models\[\]\.queue_capacity in nereid.yaml, requests in its preprocess "
                                            r"hook included\); retry later"):
            await run(rows(1), 1, 0)
        assert not any(call.done() for call in calls)
        backend.hook_release.set()
        assert len(await asyncio.gather(*calls)) == admitted  # every one admitted is answered
        assert (await run(rows(3), 1, 0))[0].data.tolist() == [[6, 6]]  # and the stage is free again
        await scheduler.drain()
        hooks.release()
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_requests_given_up_while_waiting_for_a_hung_hook_still_count_until_a_thread_takes_them() -> None:
    """Found by the review of this session's diff: behind a hook that hangs, a request whose deadline passed
    while it waited for a thread left the stage's count, but its call (holding its tensors) stayed in the pool's
    queue for good; requests with short deadlines were all admitted, and memory grew with each."""
    async def scenario() -> None:
        backend, hooks = Slow(), HookThreads("m")
        run, scheduler = runner(backend, hooks)
        hung = [asyncio.create_task(run(rows(1), 1, 0)) for _ in range(HOOK_THREADS)]
        await until(lambda: len(backend.hooks_begun) == HOOK_THREADS)
        waiting = scheduler.capacity - HOOK_THREADS
        for _ in range(waiting):
            with pytest.raises(DeadlineExceeded, match="before the request could start"):
                await run(rows(1), 1, in_ms(20))
        with pytest.raises(QueueFull):  # (the old code admitted it: it waited, then expired in turn)
            await run(rows(1), 1, in_ms(200))
        backend.hook_release.set()  # the threads take the given-up calls, skip them, and the stage is free
        await asyncio.gather(*hung)
        await until(lambda: len(backend.hooks_ended) == HOOK_THREADS)
        assert (await run(rows(3), 1, 0))[0].data.tolist() == [[6, 6]]
        assert backend.hooks_begun.count(1) == HOOK_THREADS  # the given-up calls never ran
        # Every place is free again: as many requests at once as the model takes are all admitted (the read
        # hunt: the caller's deadline cancelled its call in the pool's queue, so no thread took and skipped it,
        # and each given-up call held its place for good; the model, idle, refused every request).
        answers = await asyncio.gather(*(run(rows(1), 1, 0) for _ in range(scheduler.capacity)))
        assert [answer[0].data.tolist() for answer in answers] == [[[2, 2]]] * scheduler.capacity
        await scheduler.drain()
        hooks.release()
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_queued_requests_out_of_time_hold_no_place_from_a_request_of_the_preprocess_stage() -> None:
    """Found by a review: the preprocess stage refused a request QueueFull while the queue's places were held by
    requests whose deadline had passed (the expiry timer answers them about 1 ms later); the scheduler's own
    admission answers and removes those first."""
    async def scenario() -> None:
        backend, hooks = Slow(), HookThreads("m")
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=3, instances=1, stats=ModelStats())
        run = make_runner(backend, SIGNATURE, SIGNATURE, scheduler, hooks)
        try:
            running = asyncio.create_task(run(rows(2), 1, 0))  # holds the one instance
            await until(lambda: backend.programs_run == [2])
            # (Time for the hooks to begin and the requests to queue, on a starved machine too.)
            deadline_ns = in_ms(1000)
            queued = [asyncio.create_task(run(rows(3), 1, deadline_ns)) for _ in range(scheduler.capacity)]
            await until(lambda: scheduler.queue_depth == scheduler.capacity)
            # Past their deadline, the loop held: the expiry timer has not run yet.
            time.sleep(max(0, deadline_ns - time.monotonic_ns()) / 1e9 + 0.002)
            # Admitted (the old code refused it QueueFull): it waits in the queue behind the running program.
            with pytest.raises(DeadlineExceeded, match=r"in the queue\); it was not run \(only its preprocess hook "
                                                       r"was\)$"):
                await run(rows(4), 1, in_ms(100))
            for call in queued:
                with pytest.raises(DeadlineExceeded, match=r"in the queue\); it was not run"):
                    await call
            backend.program_release.set()
            assert (await running)[0].data.tolist() == [[4, 4]]
            assert backend.programs_run == [2]
        finally:
            backend.program_release.set()
            await scheduler.drain()
            hooks.release()
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_requests_whose_preprocess_hook_runs_past_their_deadline_hold_no_place_in_the_stage() -> None:
    """As queued requests out of time hold none: a request whose hook runs past its deadline is answered by its
    timer about 1 ms later, the hook running on with no place; a request refused QueueFull in that millisecond
    was refused for nothing."""
    async def scenario() -> None:
        backend, hooks = Slow(), HookThreads("m")
        scheduler = ModelScheduler("m", backend, SIGNATURE, capacity=2, instances=1, stats=ModelStats())
        run = make_runner(backend, SIGNATURE, SIGNATURE, scheduler, hooks)
        try:
            deadline_ns = in_ms(1000)  # (time for their hooks to begin, on a starved machine too)
            late = [asyncio.create_task(run(rows(1), 1, deadline_ns)) for _ in range(scheduler.capacity)]
            await until(lambda: backend.hooks_begun == [1] * scheduler.capacity)
            time.sleep(max(0, deadline_ns - time.monotonic_ns()) / 1e9 + 0.002)  # (their timers have not run)
            assert (await run(rows(3), 1, 0))[0].data.tolist() == [[6, 6]]  # the old code refused it QueueFull
            for call in late:
                with pytest.raises(DeadlineExceeded, match="while the request's preprocess hook ran"):
                    await call
            assert backend.programs_run == [3]
        finally:
            backend.hook_release.set()
            await scheduler.drain()
            hooks.release()
    asyncio.run(asyncio.wait_for(scenario(), 30))
