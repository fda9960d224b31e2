"""Waiting for a set of asyncio tasks that its tasks' done callbacks empty, and that may grow while it is waited on.

``while tasks: await asyncio.gather(*tasks)`` waits until the callbacks have taken every task out. From Python
3.12 on, ``gather`` of tasks that have all finished completes at once, without yielding to the event loop: a
task finished whose callback had not run yet kept that loop spinning for good, the whole server stuck at 100%
CPU (a ModelStreamInfer stream's end, found by the 3.12/3.13 hunt; the repository's shutdown too). Here only the
tasks not yet done are waited for.
"""

from __future__ import annotations

import asyncio
from typing import Collection


async def until_all_done(tasks: Collection[asyncio.Future]) -> None:
    """Return once every task in ``tasks`` has finished, including tasks added meanwhile; what each raised is
    ignored (its own done callback reports it)."""
    while unfinished := [task for task in tasks if not task.done()]:
        await asyncio.gather(*unfinished, return_exceptions=True)
