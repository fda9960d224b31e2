"""backends/meta/model.py's ctx of a plain-def orchestration (BlockingMetaContext): sub-calls from threads of one
orchestration."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nereid.backends.meta.model import BlockingMetaContext
from nereid.errors import Unavailable


class EchoModel:
    """Stands in for the meta model: a sub-call answers its own request, once ``release`` is set."""

    depends_on = ("echo",)

    class context:
        name = "fanout"

    def __init__(self) -> None:
        self.release: asyncio.Event | None = None
        self.started = 0

    def sub_request(self, name, inputs, outputs, deadline_ns):
        return inputs

    async def call(self, request):
        self.started += 1
        if self.release is not None:
            await self.release.wait()
        await asyncio.sleep(0)
        return request


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_each_thread_of_a_fan_out_gets_its_own_sub_call_s_answer(loop) -> None:
    """Defect: the sub-call a thread waited on was kept in one attribute, so a thread could read another's
    (a wrong answer), or None (an AttributeError)."""
    ctx = BlockingMetaContext(EchoModel(), 0, loop)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to open any window
    try:
        with ThreadPoolExecutor(8) as pool:
            for _ in range(100):
                answers = [pool.submit(ctx.infer, "echo", [i]) for i in range(8)]
                assert [answer.result(10) for answer in answers] == [[i] for i in range(8)]
    finally:
        sys.setswitchinterval(interval)


def test_abandoning_drops_every_sub_call_in_progress_and_issues_no_more(loop) -> None:
    model = EchoModel()
    model.release = asyncio.run_coroutine_threadsafe(_event(), loop).result()  # never set
    ctx = BlockingMetaContext(model, 0, loop)
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(ctx.infer, "echo", [i]) for i in range(2)]
        deadline = time.monotonic() + 5
        while model.started < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ctx.abandon()
        for answer in waiting:
            with pytest.raises(Unavailable, match="the request was cancelled during its sub-call to 'echo'"):
                answer.result(5)
    with pytest.raises(Unavailable, match="the sub-call to 'echo' was not issued"):
        ctx.infer("echo", [0])


async def _event() -> asyncio.Event:
    return asyncio.Event()
