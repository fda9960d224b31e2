"""A model folder's entry: its lock, who counts as using it, and an unload that gives up on a load."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nereid.model_entry import NOT_LISTED_REASON, ModelEntry, ModelState
from nereid.settings import ModelSettings


def entry() -> ModelEntry:
    return ModelEntry("m", Path("m"), ModelSettings(name="m"), "nereid.yaml: models[0]")


def test_a_new_entry_is_unavailable_as_not_listed_and_in_no_use() -> None:
    new = entry()
    assert (new.state, new.reason, new.in_use(), new.waiting_on_dependencies()) == (
        ModelState.UNAVAILABLE, NOT_LISTED_REASON, False, False)


def test_an_entry_is_in_use_from_the_moment_an_operation_waits_for_its_lock() -> None:
    async def scenario() -> None:
        held = entry()
        inside, release = asyncio.Event(), asyncio.Event()

        async def first() -> None:
            async with held.held():
                inside.set()
                await release.wait()

        async def second() -> None:
            async with held.held():
                pass

        tasks = [asyncio.create_task(first())]
        await inside.wait()
        tasks.append(asyncio.create_task(second()))
        await asyncio.sleep(0)
        assert held.holders == 2 and held.in_use()  # one holds, one waits: a rescan must not forget it
        release.set()
        await asyncio.gather(*tasks)
        assert held.holders == 0 and not held.in_use()
    asyncio.run(scenario())


def test_an_unload_gives_up_on_the_load_under_way() -> None:
    async def scenario() -> None:
        loading = entry()
        loading.building = asyncio.get_running_loop().create_future()
        async with loading.held_for_unload():
            assert loading.unloads_waiting == 1
        assert loading.building.cancelled() and loading.unloads_waiting == 0
    asyncio.run(scenario())
