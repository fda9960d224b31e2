"""Each model's bounded queue, its dynamic batcher and its executions.

The scheduler owns admission (a full queue refuses at once), batching (see
:mod:`nereid.batching`), deadlines (an expired request never starts) and
concurrency (at most ``instances`` executions at once). Backends only ever see
one batch at a time: on a worker thread, or on the event loop when their
``infer`` is a coroutine function.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import operator
import time
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable, Iterator, TypeVar

import numpy as np

from nereid.backend import REQUEST_DEADLINE_NS, Model, PadsBatches
from nereid.batching import (BatchPolicy, batch_key, deadline_passed, request_cost, split_rows, stack_rows, take_batch,
                             will_not_run)
from nereid.daemon_pool import DaemonThreadPool, ThreadStartFailed, on_work_thread_or_here
from nereid.errors import (DeadlineExceeded, LoggedModelFailure, ModelFailure, ModelRetired, NereidError, NotStarted,
                           OutOfMemory, QueueFull, RunNotStarted, Unavailable, describe_exception, naming_model,
                           without_model_name)
from nereid.log_limit import RateLimitedLog
from nereid.settings import DEFAULT_CONFIG_NAME, DEFAULT_QUEUE_CAPACITY
from nereid.signature import ModelSignature, check_outputs
from nereid.stats import ModelStats, RequestTiming
from nereid.tensors import NamedTensor

# Whether any of the model's code has begun for a request, set in the request's own task: by submit when the
# request is cancelled in an execution, and by the model's runner before a hook. Past the shutdown grace, its
# answer says whether the model may have acted on it (False, the default: it never left a queue, or never
# reached one). Only ever set to True, so a sub-call of a meta model still queued does not undo its caller's.
REQUEST_STARTED: ContextVar[bool] = ContextVar("nereid_request_started", default=False)
# How many coroutine infers (meta models' orchestrations) run nested in the current task, each started at once in
# its caller's. Past MAX_INLINE_DEPTH a call goes through the queue, whose execution is a task of its own: a chain
# of 120 meta models on an idle server ran every level on one Python stack and failed with a RecursionError.
_INLINE_DEPTH: ContextVar[int] = ContextVar("nereid_inline_depth", default=0)
MAX_INLINE_DEPTH = 16

log = logging.getLogger(__name__)

# After the grace and a termination request, how long drain() still waits before abandoning work.
TERMINATE_WAIT_S = 2.0


@dataclass(eq=False)  # compared by identity: its inputs are numpy arrays, and `in` and remove() compare
class Work:
    """One admitted request waiting for, or in, an execution."""

    inputs: list[NamedTensor]
    rows: int
    cost: int
    key: tuple
    deadline_ns: int
    future: asyncio.Future[list[NamedTensor]]
    enqueued_ns: int = field(default_factory=time.monotonic_ns)
    timing: RequestTiming | None = None  # filled in when its execution succeeds
    admitted: bool = False  # let in by hooked_request: the model's preprocess hook ran for it

    def abandoned(self) -> bool:
        return self.future.cancelled()


T = TypeVar("T")

# Outputs past this many bytes, or BYTES outputs past this many elements, are checked (and copied) off the loop
# when the model made them on it (see costly_to_check).
CHECK_OFF_LOOP_BYTES = 4 << 20
CHECK_OFF_LOOP_ELEMENTS = 1 << 16


def costly_to_check(outputs: object) -> bool:
    """Whether ``outputs`` (a coroutine model's, or a batch's rows to stack) are worth checking, or copying, off the
    event loop: arrays of at least
    CHECK_OFF_LOOP_BYTES in all, or a BYTES (object) array of at least CHECK_OFF_LOOP_ELEMENTS elements, whose
    check looks at each one. Anything that is no list of NamedTensor holding arrays is cheap to refuse."""
    if not isinstance(outputs, (list, tuple)):
        return False
    total = 0
    for tensor in outputs:
        data = getattr(tensor, "data", None) if isinstance(tensor, NamedTensor) else None
        if not isinstance(data, np.ndarray):
            continue
        if data.dtype == object and data.size >= CHECK_OFF_LOOP_ELEMENTS:
            return True
        total += data.nbytes
    return total >= CHECK_OFF_LOOP_BYTES


async def where_cheap(tensors: list[NamedTensor], work: Callable[[list[NamedTensor]], T]) -> T:
    """``work(tensors)``, work that goes over every tensor (the check and copy of outputs made on the event loop,
    the stacking of a batch's rows): on a thread of the server's when they are costly to go over (see
    :func:`costly_to_check`), else here; here too when no thread can start (the model has run, or its batch is
    formed: its requests must not be refused for that)."""
    if costly_to_check(tensors):
        return await on_work_thread_or_here(work, tensors)
    return work(tensors)


class ModelScheduler:
    """Queue, batcher and executions of one loaded model. Create it on the server's event loop."""

    def __init__(self, name: str, backend: Model, signature: ModelSignature, capacity: int, instances: int,
                 stats: ModelStats, policy: BatchPolicy | None = None, copies_outputs: bool = True,
                 config_name: str = DEFAULT_CONFIG_NAME) -> None:
        """``copies_outputs``: the backend's outputs are copied as its ``infer`` returns them, which a model that
        returns fresh arrays each call spares (see :class:`~nereid.backend.ReturnsFreshOutputs`). ``config_name``:
        the configuration file that sets ``capacity``, as a full queue's answer names it (Settings.config_name)."""
        self.name = name
        self.config_name = config_name
        self._copies_outputs = copies_outputs
        self.capacity = capacity
        self.policy = policy or BatchPolicy(enabled=False)
        self._instances = instances
        self._backend = backend
        self._signature = signature
        self._stats = stats
        # Each model fault is logged: the client has the message, the operator needs it too. Limited per
        # model, so a model failing every request at full speed neither fills the disk nor hides another's.
        self._fault_log = RateLimitedLog(log)
        self._pending: collections.deque[Work] = collections.deque()
        self._arrived = asyncio.Event()
        self._free_slots = instances  # executions that may start now
        self._freed_ns = 0  # when the model last went from every instance busy to one free
        self._slot_freed = asyncio.Event()
        # The batcher's execution tasks (kept referenced), each with its batch.
        self._running: dict[asyncio.Task, list[Work]] = {}
        self._direct: set[asyncio.Task] = set()  # callers running their own request (see submit)
        self._abandoned = False  # drain gave up on what still runs: its callers are answered Unavailable
        self._backlog = 0  # requests run and still in the model's postprocess stage (see in_postprocess)
        self.postprocessed = False  # whether every answer goes on to a postprocess hook (set by the model's runner)
        # The tasks of requests inside a model's hook stages (see hooked_request), each with how many times it is.
        self._in_hooks: collections.Counter[asyncio.Task] = collections.Counter()
        self._hook_calls = 0  # hook calls handed to the model's hook threads and not ended there (see hook_call_began)
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = True
        self._starting = True  # False once the server's shutdown grace has passed (see stop_starting)
        self._stopped_starting = asyncio.Event()  # set with _starting False: a drain's grace is over then too
        self._inline = inspect.iscoroutinefunction(backend.infer)
        self._pads = isinstance(backend, PadsBatches)
        self._variable_axes = any(-1 in spec.dims for spec in signature.inputs)  # else a request costs its rows
        # Daemon threads: a backend call that never returns must not keep the process from exiting.
        self._executor = None if self._inline else DaemonThreadPool(instances, thread_name_prefix=f"nereid-{name}")
        self._threads = 0  # backend calls running on worker threads, including abandoned ones
        # One timer, at the earliest deadline of the queue (as far as arrivals told it): the batcher looks
        # at the queue only when an instance is free, and a client must not wait out a long execution
        # to hear that its request expired in the queue.
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_ns = 0
        self._batcher = asyncio.create_task(self._batch_loop(), name=f"nereid-{name}-batcher")
        # Named for the server's last WARNING, should one swallow its cancellation and outlive the loop.
        self._execution_name = f"nereid-{name}-execution"
        # The requests waiting for room in the full queue (see wait_for_room), first come first, not yet woken; and
        # how many were woken and have not tried again yet. Each change that frees room wakes the first alone:
        # waking every waiter at every answer made a burst's requests try again by the hundred for one place.
        self._room_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._room_woken = 0
        # Whether the model's own admission is full when it is not the queue's (a model runner's preprocess stage,
        # whose requests count against capacity beside the queue's): what wakes a waiter asks first.
        self.stage_full: Callable[[], bool] | None = None
        # What a reload's hand-over asks of this model, as the successor, for each request queued at the version it
        # replaced: raises when it would not take it (its ChecksInputs rule among others; set by its runner).
        self.input_check: Callable[[list[NamedTensor]], None] | None = None

    @property
    def queue_depth(self) -> int:
        """Requests waiting (not yet in an execution)."""
        return len(self._pending)

    @property
    def queued_past_free_instances(self) -> int:
        """The queued requests that wait for an instance: those a free one takes next (one each, at least: at the
        batcher's next turn, or at the end of a batching window) left out; what ``queue_capacity`` bounds.

        An instance freed by an execution's end takes its next batch a loop
        turn later: a model calling this one, its call just answered, made
        its next call in between and was refused QueueFull, the queue full
        only of a request about to start (found by a bug hunt: every time,
        for a pipeline's sequential calls to a model of queue_capacity 1).
        """
        ready = self._free_slots if self._starting and self._backlog < self.capacity else 0
        return max(0, len(self._pending) - ready)

    async def submit(self, inputs: list[NamedTensor], rows: int, deadline_ns: int,
                     timing: RequestTiming | None = None, *, admitted: bool = False) -> list[NamedTensor]:
        """Queue one validated request and wait for its own rows of the result.

        Raises Unavailable at once when the queue is full or the model is being
        unloaded. Cancelling the caller drops the request if it has not started.
        When the execution that answers it succeeds, its queue and compute times
        go into ``timing``, for the statistics of the request's success.
        ``admitted``: the request was admitted by :meth:`hooked_request`, which
        it is inside, so a drain that began since takes it in still.
        """
        if not self._accepting:
            if not admitted:
                raise ModelRetired(f"model '{self.name}' is being unloaded", self)
            if not self._starting:
                raise UnloadedBeforeStart(unloaded_before_start(self.name))
        if len(self._pending) >= self.capacity:
            self.drop_dead()
        if self._queue_full():
            now_ns = time.monotonic_ns()
            if deadline_passed(deadline_ns, now_ns):  # (a hook's request, say): its deadline is the news, not the queue
                self._stats.record_submitted()  # (counted as one out of time on arrival at an idle model is)
                raise not_started(self.name, deadline_ns, now_ns)
            raise queue_full(self.name, self.capacity, config_name=self.config_name)
        arrived_ns = time.monotonic_ns()
        cost = request_cost(self._signature, inputs, rows) if self._variable_axes else rows
        self._stats.record_submitted()
        depth = _INLINE_DEPTH.get()
        if self._can_start_at_once() and not (self._inline and depth >= MAX_INLINE_DEPTH):
            # Nothing waits and an instance is free: batching could add no company, so run
            # here and spare the hand-offs to the batcher task.
            if deadline_passed(deadline_ns, arrived_ns):
                raise not_started(self.name, deadline_ns, arrived_ns)  # (it never queued: no wait to tell of)
            self._idle.clear()
            self._free_slots -= 1
            # A coroutine infer runs in this very task and reads its deadline from the context.
            deadline = REQUEST_DEADLINE_NS.set(deadline_ns) if self._inline else None
            nested = _INLINE_DEPTH.set(depth + 1) if self._inline else None
            caller = asyncio.current_task()
            self._direct.add(caller)
            try:
                try:
                    (outputs,) = await self._run([inputs], [rows], cost, [time.monotonic_ns() - arrived_ns], 0,
                                                 [timing])
                except NotStarted as not_run:
                    # Sent once more, as a batch of the batcher's is (see _execute): unless its deadline passed.
                    now_ns = self._sending_again(not_run)
                    if deadline_passed(deadline_ns, now_ns):
                        raise self._deadline_error(deadline_ns, arrived_ns, now_ns, not_run) from None
                    (outputs,) = await self._run([inputs], [rows], cost, [now_ns - arrived_ns], 0, [timing],
                                                 resent=True)
                return outputs
            except asyncio.CancelledError:
                REQUEST_STARTED.set(True)
                if not self._abandoned:
                    raise
                caller.uncancel()  # drain's cancellation, not the caller's: answer it
                raise Unavailable(self._abandoned_message()) from None
            finally:
                self._direct.discard(caller)
                # What fails the request holds this frame in its traceback, and the task may keep it (the task of a
                # meta model's orchestration, whose sub-call runs in it): no cycle through this local, which kept
                # the failed run's frames until a garbage collection.
                del caller
                if deadline is not None:
                    REQUEST_DEADLINE_NS.reset(deadline)
                if nested is not None:
                    _INLINE_DEPTH.reset(nested)
                self._release_slot()
        work = Work(inputs, rows, cost, batch_key(inputs), deadline_ns, asyncio.get_running_loop().create_future(),
                    arrived_ns, timing, admitted)
        self._idle.clear()
        self._pending.append(work)
        self._arrived.set()
        if deadline_ns and (not self._expiry_ns or deadline_ns < self._expiry_ns):
            self._expire_at(deadline_ns)
        try:
            return await work.future
        except asyncio.CancelledError:
            queued = work in self._pending
            if not queued:
                REQUEST_STARTED.set(True)
            # The caller went away: its place in the queue is free at once, not at the next decision.
            if work.future.cancelled() and queued:
                self._pending.remove(work)
                self._answer_dropped(work)
                self._update_idle()
                self._room_freed()
            raise
        finally:
            # Its future keeps the error that failed it, whose traceback then holds this frame: no cycle through
            # this local (see _execute).
            del work

    def _queue_full(self) -> bool:
        """Whether the queue refuses a request now (its expired requests, which :meth:`submit` drops first, counted)."""
        # (The first test alone is the common case's: the second is never true without it.)
        return len(self._pending) >= self.capacity and self.queued_past_free_instances >= self.capacity

    def _refuses(self) -> bool:
        """Whether the model's admission may refuse a request now: true whenever it would (what wakes a waiter for
        room asks: a waiter woken while it is true would be refused again)."""
        return self.stage_full() if self.stage_full is not None else self._queue_full()

    @property
    def waiting_for_room(self) -> int:
        """Requests waiting for room in the full queue (see :meth:`wait_for_room`), those woken included."""
        return len(self._room_waiters) + self._room_woken

    async def wait_for_room(self, deadline_ns: int, *, again: bool = False) -> None:
        """Wait, behind the requests waiting already, until the model's admission (its queue, or a preprocess stage
        and the queue) has room: what a gRPC stream's request does that the full queue refused, or that finds
        others waiting (a Triton client's stream queues everything it sends, as Triton's unbounded queue takes
        it). The caller tries again at once when this returns, in the same turn of the loop, and waits ``again``
        (at the front, keeping its turn) if the queue is full still, another caller having taken the room first.

        Waiters are woken one at a time, in order, each time room frees. Returns at once once the model is being
        unloaded (the caller's try is then refused as retired). DeadlineExceeded when ``deadline_ns`` (0: none)
        passes first: it was not run. A waiter cancelled after it was woken hands its room to the next.
        """
        if not self._accepting:
            return
        waited_ns = time.monotonic_ns()
        if deadline_passed(deadline_ns, waited_ns):  # (not counted as submitted: it never entered the queue)
            raise not_started(self.name, deadline_ns, waited_ns)
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if again:
            self._room_waiters.appendleft(woken)
        else:
            self._room_waiters.append(woken)
        self._room_freed()  # (room there already, when the room it was refused was freed since: it is not lost)
        # A little after the deadline: the loop may run a timer early (as the expiry timer allows).
        timer = asyncio.timeout(max(0, deadline_ns - waited_ns) / 1e9 + 0.001 if deadline_ns else None)
        try:
            async with timer:
                await woken
        except TimeoutError:
            if not timer.expired():
                raise
            self._leave_room_waiters(woken)
            now_ns = time.monotonic_ns()
            raise not_started(self.name, deadline_ns, now_ns,
                              f"waited {(now_ns - waited_ns) / 1e6:.1f} ms for room in the full queue") from None
        except asyncio.CancelledError:
            self._leave_room_waiters(woken)
            raise
        self._room_woken -= 1
        # Once the caller has tried (it does in this turn): room left over (a batch took several requests at once)
        # goes to the next waiter.
        asyncio.get_running_loop().call_soon(self._room_freed)

    def _leave_room_waiters(self, woken: asyncio.Future[None]) -> None:
        """A waiter leaves without trying (its deadline, its client gone): a room it was woken for goes to the next."""
        if woken.done() and not woken.cancelled():
            self._room_woken -= 1
            self._room_freed()
        else:
            with contextlib.suppress(ValueError):  # (not there: drain woke every waiter)
                self._room_waiters.remove(woken)

    def _room_freed(self) -> None:
        """Something that may free room happened (a request left the queue or the preprocess stage, an instance or
        a place in the postprocess stage freed): the first waiter is woken if there is room now, and none is awake
        already (one at a time: each hands what room is left to the next once it has tried)."""
        if not self._room_waiters or self._room_woken:
            return
        while self._room_waiters and not self._refuses():
            if self._wake_first():
                return

    def _wake_every_waiter(self) -> None:
        """The model is being unloaded: every waiter tries now, and is refused as retired."""
        while self._room_waiters:
            self._wake_first()

    def _wake_first(self) -> bool:
        """Take the first waiter from the line and wake it; False when it had been cancelled (its task leaves by
        itself)."""
        woken = self._room_waiters.popleft()
        if woken.done():
            return False
        self._room_woken += 1
        woken.set_result(None)
        return True

    @contextlib.contextmanager
    def hooked_request(self) -> Iterator[None]:
        """Admit one request of a model with hooks, for the whole of its way through them and the queue (its
        :meth:`submit` inside, ``admitted=True``); ModelRetired at once, before any hook, once the model is being
        unloaded (the data plane then sends it to the new version, if a reload made one).

        The model is not idle while one is inside, so a drain waits for it as for a queued request: an unload
        left a request in its preprocess hook behind, which the retired queue refused once the hook returned
        (and a reload sent it to the new version, which ran its hook a second time), and went on to unload the
        model under a running postprocess hook. One still inside when the drain abandons the model's work
        is answered Unavailable, as a running execution's callers are.
        """
        if not self._accepting:
            raise ModelRetired(f"model '{self.name}' is being unloaded", self)
        caller = asyncio.current_task()
        assert caller is not None  # (the data plane runs every request in a task of its own)
        self._in_hooks[caller] += 1
        self._idle.clear()
        try:
            yield
        except asyncio.CancelledError:
            if not self._abandoned:
                raise
            caller.uncancel()  # drain's cancellation, not the caller's: answer it
            if not REQUEST_STARTED.get():  # (still waiting for a hook thread: none of the model's code ran)
                raise UnloadedBeforeStart(unloaded_before_start(self.name)) from None
            raise Unavailable(f"model '{self.name}' was unloaded while this request ran (in a hook or an "
                              "execution), which did not end within the grace and was abandoned") from None
        finally:
            self._in_hooks[caller] -= 1
            if not self._in_hooks[caller]:
                del self._in_hooks[caller]
            self._update_idle()
            # (Here, not at hook_call_ended: that is told before the request's task has left the preprocess stage.)
            self._room_freed()

    def hook_call_began(self) -> None:
        """One of the model's hook calls was handed to its hook threads: the model is not idle until
        :meth:`hook_call_ended` (told from the thread's end, through the loop), whether or not its request still
        waits. A hook that runs on after its caller left (a deadline passed, a client gone) held nothing: an
        unload went on and unloaded the model under it."""
        self._hook_calls += 1
        self._idle.clear()

    def hook_call_ended(self) -> None:
        """A call :meth:`hook_call_began` counted has ended on its thread (or was dropped before one took it)."""
        self._hook_calls -= 1
        self._update_idle()
        self._room_freed()  # (a call given up before a thread took it held its place until now)

    @contextlib.contextmanager
    def in_postprocess(self) -> Iterator[None]:
        """Count one request that has had its execution and waits for (or runs) its postprocess hook, while the
        model's runner is inside. While ``capacity`` of them are counted, no execution starts: the queue fills and
        refuses new requests. Without that, a program faster than its postprocess ran request after request
        into the hook threads' queue, each holding its outputs, and the queue never filled."""
        self._backlog += 1
        try:
            yield
        finally:
            self._backlog -= 1
            if self._backlog == self.capacity - 1:
                self._slot_freed.set()  # (no longer full: the batcher waits for a slot, or for this)
                self._room_freed()

    def drop_dead(self) -> None:
        """Answer and remove the queued requests whose deadline passed (a full queue takes no dead weight): what
        :meth:`submit` does before it refuses a request, and the model's preprocess stage before it does."""
        now = time.monotonic_ns()
        dead = [work for work in self._pending if will_not_run(work, now)]
        for work in dead:
            self._pending.remove(work)
            self._answer_dropped(work)
        self._update_idle()
        if dead:
            self._room_freed()

    def _expire_at(self, deadline_ns: int) -> None:
        """(Re)set the expiry timer to ``deadline_ns`` (a little after it: the loop may run a timer early)."""
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry_ns = deadline_ns
        delay_s = max(0, deadline_ns - time.monotonic_ns()) / 1e9 + 0.001
        self._expiry = asyncio.get_running_loop().call_later(delay_s, self._expire)

    def _expire(self) -> None:
        """The expiry timer: answer the expired queued requests, then wait for the next deadline in the queue."""
        self._expiry, self._expiry_ns = None, 0
        self.drop_dead()
        nearest = min((work.deadline_ns for work in self._pending if work.deadline_ns), default=0)
        if nearest:
            self._expire_at(nearest)

    def stop_starting(self) -> None:
        """Start no execution from now on: the server's shutdown grace has passed. An execution ended at the
        grace frees its slot, and a request queued behind it started then was answered "its answer is lost"
        a moment later: queued, it is answered as not run, safe to send again. A drain still within its own grace
        (a replaced version's may be longer than the server's) ends its wait now."""
        self._starting = False
        self._stopped_starting.set()

    def _can_start_at_once(self) -> bool:
        return (self._free_slots > 0 and not self._pending and self._starting and self._backlog < self.capacity
                and (not self.policy.enabled or self.policy.max_delay_ns == 0))

    @property
    def instances(self) -> int:
        """Executions that may run at once (a model calling models: its own count, not ``instances``)."""
        return self._instances

    @property
    def idle(self) -> bool:
        """True when nothing is queued, running (a call whose caller went away included) or inside the model's
        hooks."""
        return self._idle.is_set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` until nothing is queued or running; True when that came."""
        return await _wait_event(self._idle, timeout_s)

    @property
    def running_threads(self) -> int:
        """Model calls still running on worker threads, including those whose caller went away."""
        return self._threads

    async def drain(self, grace_s: float | None = None,
                    terminate: Callable[[], Awaitable[None]] | None = None,
                    terminate_wait_s: float = TERMINATE_WAIT_S, *,
                    successor: ModelScheduler | None = None) -> bool:
        """Refuse new requests, finish the queued and running ones, stop the batcher.

        Never blocks the event loop. With ``grace_s``, waits at most that long;
        then awaits ``terminate`` (the backend ending its running work), waits
        up to ``terminate_wait_s`` more, and abandons what still runs.
        Returns True when everything finished, False when work was abandoned.
        ``successor`` (of a version a reload replaced, the scheduler of the
        version now serving): the queued requests it takes are handed to it
        (see :meth:`_hand_over_queue`), and only the others finish here.
        """
        self._accepting = False
        if successor is not None:
            self._hand_over_queue(successor)
        self._arrived.set()  # a batch waiting for company that can no longer come goes now (see _batch_loop)
        self._wake_every_waiter()
        finished = await self._wait_idle_within(grace_s)
        if not finished:
            # (A grace of 0: the server's shutdown_grace_s has already been spent waiting for its listeners.)
            log.warning("model '%s': %s still running after %s; ending them", self.name, self._work_left(),
                        f"the {grace_s:g} s grace" if grace_s and not self._stopped_starting.is_set()
                        else "the grace")
            # The grace is spent: what is still queued is not started by the slots the ended executions free
            # (it would start after the grace, and be abandoned or cut short in turn), and is told so now.
            self.stop_starting()
            for work in self._pending:
                if not work.future.done():
                    work.future.set_exception(UnloadedBeforeStart(unloaded_before_start(self.name)))
            self._pending.clear()
            self._update_idle()
            if terminate is not None:
                await terminate()
            finished = await _wait_event(self._idle, terminate_wait_s)
            if not finished:
                log.error("model '%s': %s did not end; abandoning them", self.name, self._work_left())
                # Their callers still wait (without a deadline, for ever): the batcher's are answered here
                # (a coroutine infer that swallows its cancellation would never hand it back), and a caller
                # running its own request as it is cancelled (see submit); a thread runs on regardless.
                self._abandoned = True
                for execution, batch in list(self._running.items()):
                    for work in batch:
                        if not work.future.done():
                            work.future.set_exception(Unavailable(self._abandoned_message()))
                    execution.cancel()
                for caller in list(self._direct):
                    caller.cancel()
                # (Not those running their own request: cancelled once above, as one cancellation answers both.)
                for caller in [task for task in self._in_hooks if task not in self._direct]:
                    caller.cancel()
        if self._expiry is not None:
            self._expiry.cancel()
        self._batcher.cancel()
        await asyncio.gather(self._batcher, return_exceptions=True)
        if self._executor is not None:
            # wait=False: a thread that ignored termination must not freeze the loop (it ends on its own).
            self._executor.shutdown(wait=False, cancel_futures=True)
        return finished

    def _hand_over_queue(self, successor: ModelScheduler) -> None:
        """Refuse the queued requests with ModelRetired, which the data plane answers by sending each to the version
        now serving, as it does a request this version refused at admission: none of this version's code ran for
        them. Their time queued here counts as queue time. Those a preprocess hook ran for stay, to finish here, and
        so do those ``successor``'s input check refuses (a bundle compiled for other sizes; the review).

        (The reload hunt: a replaced version ran its queue to the end within its grace, one request after another,
        while its successor stood idle; a queue of 100 one-second requests had 34 failed at the grace's end, and
        the one then running stopped.)
        """
        now_ns = time.monotonic_ns()
        kept: collections.deque[Work] = collections.deque()
        for work in self._pending:
            if work.admitted or not _takes(successor, work.inputs):
                kept.append(work)
            elif not work.future.done():
                if work.timing is not None:
                    work.timing.queue_ns += now_ns - work.enqueued_ns
                work.future.set_exception(ModelRetired(f"model '{self.name}' was replaced by a new version before "
                                                       "this request could start", self, handed_over=True))
        self._pending = kept
        self._update_idle()

    async def _wait_idle_within(self, grace_s: float | None) -> bool:
        """Wait until idle, at most ``grace_s`` and no longer than until :meth:`stop_starting`; True when idle."""
        if self._idle.is_set() or self._stopped_starting.is_set():
            return self._idle.is_set()
        waits = [asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._stopped_starting.wait())]
        try:
            await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return self._idle.is_set()

    # -- batch formation ----------------------------------------------------
    async def _batch_loop(self) -> None:
        """Start a batch whenever :func:`take_batch` releases one and an execution slot is free."""
        loop = asyncio.get_running_loop()
        while True:
            while not self._pending:
                self._update_idle()
                self._arrived.clear()
                await self._arrived.wait()
            # Form a batch only when an execution can start (and its answers have room in a postprocess stage).
            while self._free_slots <= 0 or not self._starting or self._backlog >= self.capacity:
                self._slot_freed.clear()
                await self._slot_freed.wait()
            self._arrived.clear()  # before deciding: an arrival from here on wakes the wait below
            # Draining, or with a queue so full that it refuses arrivals, no request can join the queue: a batch
            # does not wait for company any more. (A queue_capacity under a preferred batch size held the requests
            # that filled it for max_queue_delay_ms while others were refused; the config hunt.)
            policy = self.policy if self._accepting and not self._refuses() else \
                replace(self.policy, max_delay_ns=0)
            wake_ns = self._start_batch(policy)
            if wake_ns is not None:
                # One wake-up at the first request's window end; arrivals wake the loop in between.
                timer = loop.call_later(max(0, wake_ns - time.monotonic_ns()) / 1e9, self._arrived.set)
                try:
                    await self._arrived.wait()
                finally:
                    timer.cancel()

    def _start_batch(self, policy: BatchPolicy) -> int | None:
        """Answer the requests :func:`take_batch` drops, and start the batch it releases, if any; when none, the
        time to decide again at the latest (None: at the next arrival).

        A method of its own so that the batcher, waiting, holds none of the requests it handed on: the last
        batch's futures keep their answers (a failure's error, with the failed run's frames: a meta model's
        orchestration, its inputs and intermediates) until the model's next batch.
        """
        decision = take_batch(self._pending, policy, time.monotonic_ns(), self._freed_ns)
        for work in decision.dropped:
            self._answer_dropped(work)
        if decision.batch:
            self._free_slots -= 1
            task = asyncio.create_task(self._execute(decision.batch), name=self._execution_name)
            self._running[task] = decision.batch
            task.add_done_callback(self._execution_done)
        if decision.dropped or decision.batch:
            # (Even a batch of one, which takes an instance as well as leaving the queue: a preprocess stage
            # counts the whole queue, and its waiter stayed out until the execution ended; the hunt of the wait.)
            self._room_freed()
        return None if decision.batch else decision.wake_ns

    def _execution_done(self, task: asyncio.Task) -> None:
        # (Its instance is still held if the execution ended without answering, or answered callers that go on to a
        # postprocess hook; _end_execution frees it once.)
        self._end_execution(task)

    def _end_execution(self, task: asyncio.Task) -> None:
        """The batcher's execution ``task`` holds its instance no more (once: at its answers, or at its end)."""
        if self._running.pop(task, None) is not None:
            self._release_slot()

    def _release_slot(self) -> None:
        # Only the end of a stretch with every instance busy moves the delay window's start (see
        # nereid.batching): a slot freed while another stood free ended no one's wait for an instance, and
        # restarting the window there kept a request waiting past max_queue_delay with an instance free.
        if self._free_slots == 0:
            self._freed_ns = time.monotonic_ns()
        self._free_slots += 1
        self._slot_freed.set()
        self._update_idle()
        self._room_freed()

    def _update_idle(self) -> None:
        # Every execution holds a slot: all slots free, nothing queued and no request in a hook means idle.
        if not self._pending and self._free_slots == self._instances and not self._in_hooks and not self._hook_calls:
            self._idle.set()

    def _answer_dropped(self, work: Work, not_run: NotStarted | None = None) -> None:
        """Answer a request that will never run: an expired one (its caller still waits) gets DeadlineExceeded;
        ``not_run``: why its batch was to be sent again (see :meth:`_execute`)."""
        if not work.future.done():
            # (What it waited for room before: a stream's request told only of its time in the queue left that wait
            # out; the hunt of the statistics.)
            work.future.set_exception(self._deadline_error(work.deadline_ns, work.enqueued_ns, time.monotonic_ns(),
                                                           not_run, work.timing.room_wait_ns if work.timing else 0))

    def _deadline_error(self, deadline_ns: int, enqueued_ns: int, now: int, not_run: NotStarted | None = None,
                        room_wait_ns: int = 0) -> DeadlineExceeded:
        queued = f"{(now - enqueued_ns) / 1e6:.1f} ms"
        waited = (f"waited {room_wait_ns / 1e6:.1f} ms for room in the full queue, then {queued}" if room_wait_ns
                  else f"waited {queued}")
        if not_run is None:
            return not_started(self.name, deadline_ns, now, f"{waited} in the queue")
        return not_started(self.name, deadline_ns, now, f"{waited} since it was queued; its batch, which had not "
                                                        "started, was to be sent again: "
                                                        f"{without_model_name(self.name, str(not_run))}")

    def _still_to_run(self, batch: list[Work], now: int, not_run: NotStarted | None = None) -> list[Work]:
        """The requests of ``batch`` to run at ``now``: those whose deadline has passed, or whose caller has gone,
        are answered (see :meth:`_answer_dropped`) and left out."""
        live = []
        for work in batch:
            if will_not_run(work, now):
                self._answer_dropped(work, not_run)
            else:
                live.append(work)
        return live

    def _sending_again(self, not_run: NotStarted) -> int:
        """Say that a batch the backend did not start (``not_run``) is sent once more; the time it is."""
        # (Under the model's limit: a parent killed again and again, say by the out-of-memory killer, wrote it for
        # every batch; the hunt of the re-send.)
        self._fault_log.warning("%s; the batch had not started: it is sent once more, less any request whose "
                                "deadline has passed", naming_model(self.name, not_run))
        return time.monotonic_ns()

    # -- execution ----------------------------------------------------------
    async def _execute(self, batch: list[Work]) -> None:
        """Run a batch formed by the batcher and answer each of its requests."""
        now = time.monotonic_ns()
        live = self._still_to_run(batch, now)  # the batch left the queue one loop turn ago: look again
        if not live:
            return
        if self._inline and len(live) == 1:
            # A lone request run by a coroutine infer (a meta model's orchestration) stops when its
            # caller goes away, as it does when it started at once in the caller's own task.
            execution = asyncio.current_task()
            live[0].future.add_done_callback(lambda future: future.cancelled() and execution.cancel())
        try:
            try:
                results = await self._run_works(live, now)
            except NotStarted as not_run:
                # None of the model's code ran (a python model's warm parent died before it forked the run): sent
                # once more, as a batch taken from the queue is started, so that a request whose deadline passed
                # meanwhile (the new parent's start included) is answered DEADLINE_EXCEEDED and never runs late.
                now = self._sending_again(not_run)
                live = self._still_to_run(live, now, not_run)
                if not live:
                    return
                results = await self._run_works(live, now, resent=True)
        except NereidError as error:  # every failure _run reports (a CancelledError is this task's own)
            self._end_execution(asyncio.current_task())
            _fail_all(live, error)
            # The requests' futures keep the error, whose traceback holds this frame: no cycle through these
            # locals, which kept the failed run's frames (a meta model's orchestration, its inputs and
            # intermediates) until a garbage collection.
            batch = live = []
            return
        except asyncio.CancelledError:
            # Abandoned by drain (which answered the batch already), its lone caller gone (that future is
            # cancelled), or the loop's own end: whoever still waits gets an answer.
            for work in live:
                if not work.future.done():
                    work.future.set_exception(Unavailable(self._abandoned_message()))
            raise
        # Its instance is free before its callers hear (not at this task's end, a loop turn after they resume): a
        # caller calling again at once (a pipeline's next sub-call) finds the request queued behind it taken by
        # then, not a full queue (found by a bug hunt: QueueFull every time, at queue_capacity 1). Not where the
        # callers go on to a postprocess hook: they must be counted in its stage (in_postprocess) before the
        # batcher, woken by the freed instance, looks whether that stage is full.
        if not self.postprocessed:
            self._end_execution(asyncio.current_task())
        for work, result in zip(live, results):
            if not work.future.done():
                work.future.set_result(result)

    async def _run_works(self, live: list[Work], now: int, resent: bool = False) -> list[list[NamedTensor]]:
        """:meth:`_run` of the requests ``live``, whose assembly starts at ``now``."""
        # This task's own context: the batch's earliest deadline, for a coroutine infer.
        REQUEST_DEADLINE_NS.set(min((w.deadline_ns for w in live if w.deadline_ns), default=0))
        run = self._run([w.inputs for w in live], [w.rows for w in live], sum(w.cost for w in live),
                        [now - w.enqueued_ns for w in live], now, [w.timing for w in live], resent=resent)
        del live  # (what fails the run holds this frame in its traceback: no cycle through the requests' futures)
        return await run

    def _executions(self) -> int:
        """Executions still running: on worker threads (a caller's gone one included), or on the loop (a
        coroutine infer's, which counts no thread)."""
        return max(self._threads, len(self._running) + len(self._direct))

    def _work_left(self) -> str:
        """What a drain still waits for, in words: executions, and hook calls."""
        executions, in_hooks = self._executions(), self.requests_in_hooks
        parts = [f"{executions} execution(s)"] if executions or not in_hooks else []
        return " and ".join([*parts, *([f"{in_hooks} request(s) in its hooks"] if in_hooks else [])])

    @property
    def requests_in_hooks(self) -> int:
        """The model's hook calls running, or waiting for one of its hook threads (a request whose caller has
        left while its hook runs on included)."""
        return self._hook_calls


    def _abandoned_message(self) -> str:
        return (f"model '{self.name}' was unloaded while this request ran; its execution did not end within the "
                "grace and was abandoned")

    async def _run(self, requests: list[list[NamedTensor]], rows: list[int], cost: int, queue_ns: list[int],
                   assembly_start_ns: int, timings: list[RequestTiming | None],
                   resent: bool = False) -> list[list[NamedTensor]]:
        """One execution of ``requests`` (of ``rows`` rows each); returns each one's rows of the outputs.

        Several requests are stacked into one batch first; ``assembly_start_ns``
        (0: none) is when that began, for the input-time statistics. When it
        succeeds, each request's ``timings`` entry (None: not wanted) gets its
        ``queue_ns`` and the execution's compute times. Any failure,
        the batch's assembly included, is raised as a NereidError naming the
        model: model code can raise anything (``sys.exit()`` included), and a
        request of the batch must never be left unanswered. A backend that did not
        start the run raises NotStarted, for the caller to send it once more
        (``resent``: this is that once; its failure is then the batch's). One
        no thread could be started for (ThreadStartFailed, out of the model's
        pool or a meta model's) is answered Unavailable (see :meth:`thread_refused`).
        """
        self._stats.execution_started()
        total = sum(rows)
        input_ns = infer_ns = output_ns = 0
        succeeded = counted_later = not_started = False
        try:
            try:
                inputs, run_rows = await self._assemble(requests, total)
            except (asyncio.CancelledError, OutOfMemory):
                not_started = True  # (stopped while its rows were stacked, or no memory to stack them: no execution)
                raise
            start = time.monotonic_ns()
            if assembly_start_ns:
                input_ns = start - assembly_start_ns

            def count_when_ended(outputs: list[NamedTensor] | None, error: BaseException | None) -> None:
                # The callers went away while a worker thread ran the model, which cannot be stopped: the
                # execution still happened (and kept the model busy), so it counts when and as it ended: as a
                # success only if its outputs would have been answered (they were checked on its thread).
                succeeded = error is None
                if not succeeded:
                    # Logged as a fault answered to its callers is: a model hanging (killed at timeout_s) or
                    # crashing on every request whose client gives up first left no trace otherwise.
                    self._log_abandoned_fault(error)
                self._stats.execution_finished(total, cost, len(requests), input_ns, time.monotonic_ns() - start, 0,
                                               succeeded)

            checked_ns = [0]  # the outputs' check and copy, where the model made them: the output's time, Triton's

            def finish(outputs: list[NamedTensor]) -> list[NamedTensor]:
                began = time.monotonic_ns()
                try:
                    return self._own_rows(outputs, run_rows, total)
                finally:
                    checked_ns[0] = time.monotonic_ns() - began

            try:
                outputs = await self._infer(inputs, count_when_ended, finish)
            except asyncio.CancelledError:
                counted_later = not self._inline  # _infer handed the counting to count_when_ended
                raise
            except ThreadStartFailed as err:
                # No worker thread could start for it (a process limit): none of the model's code ran, and none
                # will (the call was not queued), so no execution and no batch is counted.
                not_started = True
                raise self.thread_refused(err) from None
            infer_ns = time.monotonic_ns() - start - checked_ns[0]
            results = [outputs] if len(rows) == 1 else split_rows(outputs, rows)
            output_ns = time.monotonic_ns() - start - infer_ns
            succeeded = True
            compute_ns = (input_ns, infer_ns, output_ns)
            for timing, waited_ns in zip(timings, queue_ns):
                if timing is not None:
                    # (Added to: a stream's request may have waited for room in the full queue first.)
                    timing.queue_ns += waited_ns
                    timing.compute_ns = compute_ns
            return results
        except NereidError as err:
            if isinstance(err, NotStarted) and not resent:
                not_started = True
                raise  # no fault yet: the caller sends the batch once more
            if isinstance(err, RunNotStarted):
                # (A limit of the server's kept it from starting: no execution, no batch, as a thread's that cannot
                # start; not sent again, the limit likely still there; the review hunt.)
                not_started = True
            failure = err.failure if isinstance(err, NotStarted) else err
            named = naming_model(self.name, failure)
            try:
                if named is not failure:
                    named.__cause__ = failure.__cause__  # what it was raised from, for the log's traceback
                if isinstance(named, ModelFailure):
                    self.log_fault(named)  # the backend's own word for its fault (a run that failed)
                if named is err:
                    raise
                raise named from failure.__cause__
            finally:
                # The error's traceback holds this frame: no cycle through these locals, which kept the failed
                # run's frames (a meta model's orchestration, its inputs and intermediates) until a garbage
                # collection (as ``err`` itself is cleared by Python).
                del failure, named
        except asyncio.CancelledError as err:
            # A coroutine infer runs in this very task: a cancellation out of it that was not this task's
            # own (an awaited call of the model's was cancelled) is the model's fault, and must not pass
            # for the caller going away, which would leave the request unanswered.
            if self._inline and not asyncio.current_task().cancelling():
                raise self.model_fault(err) from err
            raise
        except BaseException as err:
            # A model fault, whatever the backend raised: an Exception, or what is none and yet no business of the
            # server's (sys.exit() in a plugin, a KeyboardInterrupt of its own: the server takes Ctrl-C with a
            # signal handler on the loop; a GeneratorExit, a BaseException of the author's), which ended the
            # server, or left the batch's requests unanswered.
            raise self.model_fault(err) from err
        finally:
            if not_started:  # (no execution: nereid_batch_size counted it, and then its second send, the hunt)
                self._stats.execution_not_started()
            elif not counted_later:
                self._stats.execution_finished(total, cost, len(requests), input_ns, infer_ns, output_ns, succeeded)

    def _own_rows(self, outputs: list[NamedTensor], run_rows: int, total: int) -> list[NamedTensor]:
        """An execution's outputs, checked against the signature for the ``run_rows`` rows it was given, without
        the rows it was padded with (beyond ``total``), copied unless the model's own each call.

        Called where the model returned them, its instance still taken (on its worker thread, or on the loop
        for a coroutine infer): its next batch cannot have written to them yet, and a check of many BYTES elements
        (seconds for 16 million) holds no other client.
        """
        # Checked before the cut: cut first, 6 rows answered for 8 given passed for the 5 asked for.
        outputs = check_outputs(self.name, self._signature, outputs, run_rows)
        if run_rows > total:
            outputs = _without_padding(outputs, total)
        if self._copies_outputs:
            outputs = [NamedTensor(t.name, t.dtype, np.array(t.data)) for t in outputs]
        return outputs

    def _log_abandoned_fault(self, error: BaseException) -> None:
        """Log the fault of an execution whose callers had all gone (see :meth:`_run`) as :meth:`log_fault`
        logs one that is answered; what the model ended with for another reason (an unload) is no fault. One
        that an unload abandoned (see :meth:`drain`) is logged as such, at WARNING: the model is gone, and no
        request waits for it."""
        if isinstance(error, concurrent.futures.CancelledError):  # dropped unstarted by the pool's shutdown
            return
        if isinstance(error, NereidError):
            named = naming_model(self.name, error)
            if not isinstance(named, ModelFailure):
                return
            if named is not error:
                named.__cause__ = error.__cause__
            if self._abandoned:
                self._log_fault_after_unload(named)
            else:
                self.log_fault(named)
        elif self._abandoned:
            self._log_fault_after_unload(error)
        else:  # (_infer_on_thread lets only Exceptions through; a backend's bug, as in _run)
            self.model_fault(error)

    def _log_fault_after_unload(self, error: BaseException) -> None:
        """Log the failure of a run that drain abandoned (its unload's grace and termination wait had passed):
        a WARNING naming the model and the error, not the ERROR of a loaded model's fault. One already logged
        where it happened (a backend's ``sys.exit()``, see :meth:`_infer_on_thread`) is not logged again."""
        if isinstance(error, LoggedModelFailure):
            return
        if isinstance(error, ModelFailure):
            detail = without_model_name(self.name, str(error))
        else:
            detail = describe_exception(error)
        self._fault_log.warning("model '%s': a run its unload abandoned (it had not ended within the grace) failed "
                                "afterwards, with no request waiting for it: %s", self.name, detail)

    def log_fault(self, failure: ModelFailure) -> None:
        """Log a fault of this model's code (an execution's, or a preprocess or postprocess hook's) under the
        model's limit, with the traceback of what it was raised from, if anything (a meta model's orchestration
        that raised); one already logged where it happened (:class:`LoggedModelFailure`) is not logged again."""
        if not isinstance(failure, LoggedModelFailure):
            self._fault_log.error("%s", failure, exc_info=failure.__cause__)

    def thread_refused(self, error: ThreadStartFailed, what: str = "this run") -> Unavailable:
        """The answer of a request for which no worker thread could be started (``what``: what the thread was
        for), logged at WARNING under the model's limit, without a traceback: the server's passing condition (a
        process or thread limit), not a fault of the model's; what the thread was for never runs. (It was answered
        INTERNAL, "can't start new thread", and ran all the same once a thread came: the resource-limits hunt.)"""
        refusal = Unavailable(f"model '{self.name}': the server could not start a thread for {what} ({error}); "
                              "try again later")
        self._fault_log.warning("%s", refusal)
        return refusal

    def model_fault(self, error: BaseException, during: str = "") -> ModelFailure:
        """The ModelFailure a caller gets for ``error`` raised by model code (logged with its traceback, under the
        model's limit); ``during``: what the model was asked (``padded_rows(5)``, ``input check``)."""
        self._fault_log.error("model '%s' raised%s", self.name, f" in {during}" if during else "", exc_info=error)
        return LoggedModelFailure(f"model '{self.name}' failed: {during + ': ' if during else ''}"
                                   f"{describe_exception(error)}")

    async def _assemble(self, requests: list[list[NamedTensor]], total: int) -> tuple[list[NamedTensor], int]:
        """An execution's inputs: a lone request's own, or the requests' rows stacked; and their rows, padding
        included. Stacked on a thread of the server's when the rows are costly to copy (see
        :func:`costly_to_check`): 32 requests of 8 MiB held the event loop for over a second (the read hunt)."""
        if len(requests) == 1:
            return requests[0], total  # a lone request: the model pads it itself if it must
        run_rows = self._padded_rows(total) if self._pads else total
        tensors = [tensor for request in requests for tensor in request]
        try:
            return await where_cheap(tensors, lambda _: stack_rows(requests, run_rows)), run_rows
        except MemoryError:
            # The server's condition, not the model's fault (it was an ERROR with a traceback, "model 'm' failed:
            # MemoryError", counted as the model's; the exhaustion hunt): each request may well pass later.
            size = sum(tensor.data.nbytes for tensor in tensors) * run_rows // max(1, total)
            message = (f"model '{self.name}': the server ran out of memory stacking a batch of {len(requests)} "
                       f"requests ({size} bytes); try again later")
            self._fault_log.warning("%s", message)
            raise OutOfMemory(message) from None

    def _padded_rows(self, rows: int) -> int:
        """The backend's run size for a batch of ``rows`` rows, held to being at least ``rows``."""
        try:
            padded = operator.index(self._backend.padded_rows(rows))
        except Exception as err:
            raise self.model_fault(err, f"padded_rows({rows})") from err
        if padded < rows:  # fewer rows would cut requests' rows off the batch
            raise ModelFailure(f"model '{self.name}' failed: padded_rows({rows}) returned {padded}, "
                               f"expected at least {rows}")
        return padded

    async def _infer(self, inputs: list[NamedTensor], when_abandoned: _Abandoned,
                     finish: Callable[[list[NamedTensor]], list[NamedTensor]]) -> list[NamedTensor]:
        """The backend's outputs for ``inputs``, through ``finish`` where they were made: awaited in this task, or
        run on a worker thread.

        When this task is cancelled while a worker thread runs the model, the
        thread's end is still told to ``when_abandoned`` (with its outputs and
        its error), on the loop; it is told at once when the thread had already
        ended.
        """
        if self._inline:
            # A coroutine model's large outputs (a meta model's): their check and copy held the loop, a millisecond
            # per 4 MiB and seconds for millions of BYTES elements, where a plugin's run on its own thread. The
            # instance stays taken meanwhile, as it does there.
            return await where_cheap(await self._backend.infer(inputs), finish)
        loop = asyncio.get_running_loop()
        call = _ThreadCall(loop.create_future())

        def done(result: list[NamedTensor] | None, error: BaseException | None) -> None:  # on the worker thread
            if not loop.is_closed():  # closed: the server is gone and nobody waits
                loop.call_soon_threadsafe(self._thread_done, call, result, error)

        # (ThreadStartFailed: not queued, never runs)
        self._executor.call(functools.partial(self._infer_on_thread, finish=finish), inputs, done)
        self._threads += 1
        try:
            return await call.waiter
        except asyncio.CancelledError:
            if call.ended is not None:
                # The thread ended after the caller went away (its waiter was cancelled) but before this
                # task ran again: nothing is running any more.
                when_abandoned(*call.ended)
            elif call.waiter.cancelled():
                # The caller went away while the thread runs, and a thread cannot be stopped. The
                # caller gives its slot back, so take the slot again until the thread really ends:
                # otherwise drain() would see an idle model and more executions than ``instances``
                # could start.
                self._free_slots -= 1
                self._idle.clear()
                call.when_abandoned = when_abandoned
            else:  # the thread ended just before this task was cancelled
                error = call.waiter.exception()
                when_abandoned(None if error is not None else call.waiter.result(), error)
            raise
        finally:
            if not call.waiter.cancelled():
                # The thread has ended and told ``done``, which set the waiter. It keeps the model's error, whose
                # traceback holds this frame and the thread's, which holds ``done``: no cycle through this cell
                # (``done``'s too), which kept the failed run's frames, its inputs, until a garbage collection.
                del call

    def _infer_on_thread(self, inputs: list[NamedTensor],
                         finish: Callable[[list[NamedTensor]], list[NamedTensor]]) -> list[NamedTensor]:
        """The backend's infer, on a worker thread, its outputs through ``finish``; only an Exception comes out,
        and never a CancelledError.

        The pool hands a call its shutdown dropped unstarted a CancelledError;
        one the model raised itself (it waited on a future that was cancelled)
        is its fault, and is told apart here, where it is still known to be
        the model's. So are ``sys.exit()`` and the like, which on the loop would
        pass for the server's own.
        """
        try:
            return finish(self._backend.infer(inputs))  # (finish reads the outputs: what that raises is the model's)
        except (concurrent.futures.CancelledError, StopIteration) as err:
            # (No future can carry a StopIteration: its caller would wait for ever.)
            raise self.model_fault(err) from err
        except Exception:
            raise
        except BaseException as err:  # sys.exit(), an asyncio.CancelledError: none is meant for the server
            raise self.model_fault(err) from err

    def _thread_done(self, call: _ThreadCall, result: list[NamedTensor] | None, error: BaseException | None) -> None:
        """On the loop: a worker thread's call ended; answer its caller, or free the slot it kept."""
        self._threads -= 1
        waiter = call.waiter
        if waiter.cancelled():
            if call.when_abandoned is None:
                # Its caller's task has not run since its waiter was cancelled: _infer tells it there.
                call.ended = (result, error)
            else:
                try:
                    call.when_abandoned(result, error)
                finally:
                    # The slot _infer took back when its caller went away: kept for good, the model could
                    # never be idle again, and would run one instance short.
                    self._release_slot()
        elif isinstance(error, concurrent.futures.CancelledError):
            # Dropped unstarted by the pool's shutdown (_infer_on_thread lets no other through).
            waiter.set_exception(Unavailable(f"model '{self.name}' was unloaded before this execution started"))
        elif error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(result)


class UnloadedBeforeStart(Unavailable):
    """The answer of a request whose model was unloaded before the request could start: none of the model's code
    ran for it, but a hook it went through first (see :func:`unloaded_before_start`)."""


def unloaded_before_start(model: str, only: str = "") -> str:
    """The text of :class:`UnloadedBeforeStart`; ``only``: what of the model's did run for it ("preprocess hook")."""
    ran = f" (only its {only} was)" if only else ""
    return (f"model '{model}' was unloaded before this request could start (what ran ahead of it did not end "
            f"within the grace); it was not run{ran}: send it again")


def _takes(successor: ModelScheduler, inputs: list[NamedTensor]) -> bool:
    """Whether ``successor``'s input check lets ``inputs`` (a queued request's) in; a check that fails otherwise than
    by refusing them says no too: the request then runs where it was accepted."""
    if successor.input_check is None:
        return True
    try:
        successor.input_check(inputs)
    except Exception:
        return False
    return True


class QueueRefusal(QueueFull):
    """A model's admission refused a request, its queue (or preprocess stage) full: none of the model's code ran for
    it, so a request that may wait for room can try again (a QueueFull out of a model's own code, a plugin's or a
    meta model's orchestration's, must not make it run twice)."""


def queue_full(model: str, capacity: int, counted: str = "",
               config_name: str = DEFAULT_CONFIG_NAME) -> QueueRefusal:
    """The answer of a request refused because ``model``'s queue holds ``capacity`` requests (``counted``: what
    the count takes in besides; ``config_name``: the configuration file that sets it). The default is said as
    such: a Triton user's queue is unbounded by default, and "in nereid.yaml" sent them looking for a value
    nereid.yaml did not hold (the Triton client hunt)."""
    where = " (the default)" if capacity == DEFAULT_QUEUE_CAPACITY else ""
    return QueueRefusal(f"model '{model}': queue is full (queue_capacity {capacity}{where}, models[].queue_capacity "
                        f"in {config_name}{counted}); retry later")


def not_started(model: str, deadline_ns: int, now_ns: int, waited: str = "") -> DeadlineExceeded:
    """The answer of a request whose deadline passed before any of the model's code ran for it; ``waited``: where
    it waited, and how long (the queue, a hook's thread)."""
    where = f" ({waited})" if waited else ""
    return DeadlineExceeded(f"model '{model}': deadline passed {(now_ns - deadline_ns) / 1e6:.1f} ms before the "
                            f"request could start{where}; it was not run")


def _fail_all(works: list[Work], error: NereidError) -> None:
    """Answer each of ``works`` still waiting (not cancelled by its caller, nor answered by drain) with ``error``."""
    for work in works:
        if not work.future.done():
            work.future.set_exception(error)


def _without_padding(outputs: list[NamedTensor], rows: int) -> list[NamedTensor]:
    """A padded execution's checked outputs cut to their first ``rows`` rows (an output without a batch axis, of
    a model whose outputs are not all batched, as it is)."""
    return [NamedTensor(t.name, t.dtype, t.data[:rows]) if t.data.ndim else t for t in outputs]


# What a worker thread's end is told to once its caller has gone: (its outputs, its error).
_Abandoned = Callable[[list[NamedTensor] | None, BaseException | None], None]


@dataclass(eq=False)
class _ThreadCall:
    """One model call on a worker thread, between :meth:`ModelScheduler._infer` and the thread's end.

    The thread's end and its caller's departure reach the loop in either
    order: whichever comes second tells ``when_abandoned``.
    """

    waiter: asyncio.Future
    when_abandoned: _Abandoned | None = None  # set once the caller has gone while the thread runs
    ended: tuple[list[NamedTensor] | None, BaseException | None] | None = None  # the end, if it came first


async def _wait_event(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait for ``event`` (at most ``timeout_s``; None: no bound); True when it is set."""
    if event.is_set():
        return True  # (wait_for with a zero timeout would say False without looking)
    if timeout_s is None:
        await event.wait()
        return True
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
