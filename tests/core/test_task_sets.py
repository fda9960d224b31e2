"""Waiting for a set of tasks that their done callbacks empty (core/task_sets.py), as Python 3.11 and as 3.12+
run ``asyncio.gather``."""

from __future__ import annotations

import asyncio

import pytest

from nereid.task_sets import until_all_done


@pytest.fixture(params=["gather as this Python runs it", "gather as Python 3.12 runs it"])
def gather(request, monkeypatch) -> None:
    """asyncio.gather, or, on 3.11, a gather that does what 3.12's does for tasks all finished: a future done at
    once, awaited with no turn of the event loop (this suite's CI runs 3.11; the hunt found the spin on 3.12.1
    and 3.13.0). More than 100 such calls in a row is a loop that would never yield: failed, not hung."""
    if request.param.endswith("3.12 runs it"):
        real = asyncio.gather
        spins = []

        def gather_as_3_12(*awaitables, return_exceptions=False):
            if awaitables and all(isinstance(a, asyncio.Future) and a.done() for a in awaitables):
                spins.append(None)
                assert len(spins) < 100, "the event loop never got a turn: gathered finished tasks again and again"
                done = asyncio.get_running_loop().create_future()
                done.set_result([None] * len(awaitables))
                return done
            spins.clear()
            return real(*awaitables, return_exceptions=return_exceptions)

        monkeypatch.setattr(asyncio, "gather", gather_as_3_12)


async def _set_of(*coroutines) -> set[asyncio.Task]:
    """Tasks of ``coroutines`` in a set their done callbacks take them out of, as the server keeps them."""
    tasks: set[asyncio.Task] = set()
    for coroutine in coroutines:
        task = asyncio.create_task(coroutine)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    return tasks


def test_a_task_finished_whose_callback_has_not_run_yet_is_not_waited_on(gather) -> None:
    """Defect (the 3.12/3.13 hunt): `while tasks: await asyncio.gather(*tasks)` spun for good on 3.12+ when a
    task had finished but its done callback (the discard) had not run: ModelStreamInfer's end and the
    repository's shutdown held the event loop, the server at 100% CPU and deaf to SIGTERM."""
    async def nothing() -> None:
        return None

    async def scenario() -> set[asyncio.Task]:
        tasks = await _set_of(nothing())
        await asyncio.sleep(0)  # the task's step runs, then this one: its done callback is queued, not run
        assert all(task.done() for task in tasks) and tasks
        await until_all_done(tasks)
        await asyncio.sleep(0)
        return tasks

    assert asyncio.run(scenario()) == set()


def test_tasks_added_while_others_are_waited_for_are_waited_for_too(gather) -> None:
    async def scenario() -> list[str]:
        ended: list[str] = []

        async def step(name: str, delay_s: float, then=None) -> None:
            await asyncio.sleep(delay_s)
            if then is not None:
                task = asyncio.create_task(then)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            ended.append(name)

        async def failing() -> None:
            raise ValueError("reported by its own callback")

        tasks = await _set_of(step("first", 0.05, step("added", 0.05)), failing())
        await until_all_done(tasks)
        return ended

    assert asyncio.run(scenario()) == ["first", "added"]
