"""Each model's bounded queue and the workers that run its requests.

The scheduler owns admission (a full queue refuses at once), deadlines (an
expired request never starts) and concurrency (``instances`` executions at
once). Backends only ever see one batch at a time, on a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from nereid.backend import Backend
from nereid.errors import DeadlineExceeded, ModelFailure, NereidError, Unavailable
from nereid.signature import ModelSignature, check_outputs
from nereid.stats import ModelStats
from nereid.tensors import NamedTensor

log = logging.getLogger(__name__)


@dataclass
class Work:
    """One admitted request waiting for, or in, an execution."""

    inputs: list[NamedTensor]
    batch_size: int
    deadline_ns: int
    future: asyncio.Future[list[NamedTensor]]
    enqueued_ns: int = field(default_factory=time.monotonic_ns)


class ModelScheduler:
    """Queue and workers of one loaded model."""

    def __init__(self, name: str, backend: Backend, signature: ModelSignature,
                 capacity: int, instances: int, stats: ModelStats) -> None:
        self.name = name
        self.capacity = capacity
        self._backend = backend
        self._signature = signature
        self._stats = stats
        self._queue: asyncio.Queue[Work] = asyncio.Queue(maxsize=capacity)
        self._executor = ThreadPoolExecutor(max_workers=instances, thread_name_prefix=f"nereid-{name}")
        self._workers = [asyncio.create_task(self._worker(), name=f"nereid-{name}-{i}") for i in range(instances)]
        self._accepting = True

    @property
    def queue_depth(self) -> int:
        """Requests waiting (not yet running)."""
        return self._queue.qsize()

    async def submit(self, inputs: list[NamedTensor], batch_size: int, deadline_ns: int) -> list[NamedTensor]:
        """Queue one validated request and wait for its outputs.

        Raises Unavailable at once when the queue is full or the model is being
        unloaded. Cancelling the caller drops the request if it has not started.
        """
        if not self._accepting:
            raise Unavailable(f"model '{self.name}' is being unloaded")
        work = Work(inputs, batch_size, deadline_ns, asyncio.get_running_loop().create_future())
        try:
            self._queue.put_nowait(work)
        except asyncio.QueueFull:
            raise Unavailable(
                f"model '{self.name}': queue is full ({self.capacity} requests waiting, "
                "queue_capacity in nereid.yaml); retry later"
            ) from None
        return await work.future

    async def drain(self) -> None:
        """Refuse new requests, finish the queued and running ones, stop the workers."""
        self._accepting = False
        await self._queue.join()
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            work = await self._queue.get()
            try:
                await self._run(loop, work)
            except Exception:  # never let one request kill the worker
                log.exception("model '%s': unexpected scheduler error", self.name)
                if not work.future.done():
                    work.future.set_exception(ModelFailure(f"model '{self.name}': internal scheduler error"))
            finally:
                self._queue.task_done()

    async def _run(self, loop: asyncio.AbstractEventLoop, work: Work) -> None:
        start_ns = time.monotonic_ns()
        queue_ns = start_ns - work.enqueued_ns
        if work.future.cancelled():
            self._stats.record_queue_only(queue_ns)
            return
        if work.deadline_ns and start_ns >= work.deadline_ns:
            self._stats.record_queue_only(queue_ns)
            late_ms = (start_ns - work.deadline_ns) / 1e6
            work.future.set_exception(DeadlineExceeded(
                f"model '{self.name}': deadline passed {late_ms:.1f} ms before the request reached "
                f"the front of the queue (waited {queue_ns / 1e6:.1f} ms); it was not run"))
            return
        try:
            outputs = await loop.run_in_executor(self._executor, self._backend.infer, work.inputs)
            check_outputs(self.name, self._signature, outputs, work.batch_size)
        except NereidError as err:
            outputs, error = None, err
        except Exception as err:  # a model fault, whatever the backend raised
            log.exception("model '%s' raised", self.name)
            outputs, error = None, ModelFailure(f"model '{self.name}' failed: {type(err).__name__}: {err}")
        infer_ns = time.monotonic_ns() - start_ns
        self._stats.record_execution(work.batch_size, 1, [queue_ns], 0, infer_ns, 0)
        if work.future.cancelled():
            return
        if outputs is None:
            work.future.set_exception(error)
        else:
            work.future.set_result(outputs)
