"""How one loaded model runs a request, decided once at load: [preprocess →] queue [→ postprocess].

A model without hooks runs a request by submitting it to its scheduler, and
nothing else; the data plane makes one call either way and never asks per
request which hooks a model has.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import os
import threading
import time
from typing import Any, Awaitable, Callable, Protocol, TypeVar

import numpy as np

from nereid.backend import ChecksInputs, Model, Postprocesses, Preprocesses
from nereid.batching import deadline_passed
from nereid.daemon_pool import DaemonThreadPool, ThreadStartFailed, on_work_thread_or_here
from nereid.errors import (ConfigError, DeadlineExceeded, InvalidArgument, ModelFailure, NereidError,
                           describe_exception, loop_safe_call, naming_model, without_model_name)
from nereid.scheduler import (REQUEST_STARTED, ModelScheduler, UnloadedBeforeStart, not_started, queue_full,
                              unloaded_before_start, where_cheap)
from nereid.signature import ModelSignature, brief_description, check_outputs, validate_inputs
from nereid.stats import RequestTiming
from nereid.tensors import NamedTensor

T = TypeVar("T")


class Runner(Protocol):
    """How a loaded model runs one request (see :func:`make_runner`)."""

    def __call__(self, inputs: list[NamedTensor], batch_size: int, deadline_ns: int,
                 timing: RequestTiming | None = None) -> Awaitable[list[NamedTensor]]:
        """``inputs`` validated against the client-facing signature, their batch size and absolute deadline
        (``time.monotonic_ns()``; 0: none) -> the outputs; ``timing`` gets the request's queue and compute
        times when its execution succeeds (its hooks' included: see :func:`_charge_hooks`)."""


# As many as asyncio's default executor has: hooks of different requests run at once.
HOOK_THREADS = min(32, (os.cpu_count() or 1) + 4)


class HookThreads:
    """One loaded model's own worker threads for its hooks, released with the model.

    Not asyncio's default executor: a hook that never returns (a blocking call
    with no timeout) took one of its few threads for good, so a few of them
    stalled every scan and large decode of the server, and the interpreter
    waited for them at exit (SIGTERM took as long as the hook). These are
    daemon threads, and only this model's hooks wait for them. Used from the
    event loop only.

    ``postprocess`` has threads of its own: sharing one first-come pool, a
    request whose execution had run waited for a thread behind later requests'
    ``preprocess`` calls (at an unload, 18 requests that had run in time were
    abandoned before their postprocess began).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._pools: dict[str, DaemonThreadPool] = {}  # by hook, each made at its first call
        self._released = False

    async def run(self, call: Callable[[], T], scheduler: ModelScheduler | None = None,
                  hook: str = "preprocess") -> T:
        """``call()`` on one of ``hook``'s threads; its result. ``scheduler``: the model's, told when the call is
        handed to the threads and when it has ended there (its caller may have stopped waiting long before: see
        :meth:`ModelScheduler.hook_call_began`)."""
        loop = asyncio.get_running_loop()
        if not self._released:
            pool = self._pools.get(hook)
            if pool is None:
                suffix = "" if hook == "preprocess" else f"-{hook}"
                pool = self._pools[hook] = DaemonThreadPool(
                    HOOK_THREADS, thread_name_prefix=f"nereid-{self._name}-hooks{suffix}")
            return await _on_thread(loop, pool, call, scheduler)
        # A request still finishing on a version already released: a thread of its own, gone with the call.
        straggler = DaemonThreadPool(1, thread_name_prefix=f"nereid-{self._name}-hooks")
        try:
            return await _on_thread(loop, straggler, call, scheduler)
        finally:
            straggler.shutdown(wait=False)

    def release(self) -> None:
        """The model is unloaded: idle threads end now, busy ones once their call returns (a hung one never does,
        and holds nothing else)."""
        self._released = True
        for pool in self._pools.values():
            pool.shutdown(wait=False)  # (calls already queued still run: the ends queue behind them)
        self._pools.clear()


async def _on_thread(loop: asyncio.AbstractEventLoop, pool: DaemonThreadPool, call: Callable[[], T],
                     scheduler: ModelScheduler | None) -> T:
    """``call()`` on ``pool``, awaited; ``scheduler`` (if any) counts it from now until it has ended on its thread,
    whether or not its caller still waits. _NoHookThread when no thread could be started for it (it was not
    queued, and never runs)."""
    try:
        future = pool.submit(call)
    except ThreadStartFailed as err:
        raise _NoHookThread(err) from None
    if scheduler is not None:
        scheduler.hook_call_began()

        def ended(_: concurrent.futures.Future) -> None:
            with contextlib.suppress(RuntimeError):  # (the loop closed: nothing is left to tell)
                loop.call_soon_threadsafe(scheduler.hook_call_ended)
        future.add_done_callback(ended)
    # Shielded: a caller's cancellation (its deadline, its client gone) must not cancel the call in the pool's
    # queue, which a thread then never takes; a call given up there is taken and skipped (see _HookStart.begin),
    # which frees its place in the preprocess stage (the read hunt: each such call held one for good).
    return await asyncio.shield(asyncio.wrap_future(future, loop=loop))


class _NoHookThread(Exception):
    """No thread could be started for a hook call (see ThreadStartFailed): told apart from what the hook itself
    raises, which is the model's fault."""

    def __init__(self, error: ThreadStartFailed) -> None:
        super().__init__(str(error))
        self.error = error


def _in_program_order(signature: ModelSignature, batch_signature: ModelSignature
                      ) -> Callable[[list[NamedTensor]], list[NamedTensor]] | None:
    """Where no preprocess step runs, what puts a request's inputs (validated: in ``signature``'s order) in the
    order ``infer`` takes them (``batch_signature``'s), when both name the same tensors in other orders; None
    when the orders agree (or the names differ: the program's checks refuse what it cannot take).

    A bundle whose model.py registers no preprocess may list its client_inputs in another order than its
    executable_inputs; its program takes them by position, and took them swapped: wrong answers, OK (the review
    hunt of 51cacdf, which made an omitted preprocess no step).
    """
    client, program = signature.input_names, batch_signature.input_names
    if client == program or sorted(client) != sorted(program):
        return None
    positions = [client.index(name) for name in program]
    return lambda inputs: [inputs[position] for position in positions]


def _batched_only_by_the_program(signature: ModelSignature, batch_signature: ModelSignature) -> bool:
    """Whether the client's inputs are the program's as they are, its batch axis leading, where the program batches
    and the client's tensors do not (a hook's output without a batch axis): the program's rows are then each
    request's leading axis. Not where the program's batch axis stands elsewhere (the review: a bundle's moved batch
    axis was read as the leading one, and answered transposed numbers, OK)."""
    if not batch_signature.batches or signature.batches:
        return False
    client = {spec.name: spec for spec in signature.inputs}
    return all(spec.name in client and client[spec.name].dims == (-1, *spec.dims) and
               client[spec.name].dtype is spec.dtype for spec in batch_signature.inputs)


def make_runner(backend: Model, signature: ModelSignature, batch_signature: ModelSignature,
                scheduler: ModelScheduler, hook_threads: HookThreads) -> Runner:
    """The request path of one loaded model; its hooks run on ``hook_threads``."""
    preprocess = backend.preprocess if isinstance(backend, Preprocesses) else None
    postprocess = backend.postprocess if isinstance(backend, Postprocesses) else None
    # Refused before queueing: a request no execution could run must not wait for one, nor fail the batch it joins.
    raw_check = checked_input_check(scheduler.name, backend) if isinstance(backend, ChecksInputs) else None
    check_inputs = _guarded_input_check(raw_check, scheduler) if raw_check is not None else None
    scheduler.postprocessed = postprocess is not None
    scheduler.input_check = _taking_check(raw_check, batch_signature) if preprocess is None else _takes_none
    to_program = _in_program_order(signature, batch_signature) if preprocess is None else None
    if preprocess is None and postprocess is None:
        if check_inputs is None and to_program is None:
            return scheduler.submit

        async def checked(inputs: list[NamedTensor], batch_size: int, deadline_ns: int,
                          timing: RequestTiming | None = None) -> list[NamedTensor]:
            if to_program is not None:
                inputs = to_program(inputs)
            if check_inputs is not None:
                check_inputs(inputs)
            return await scheduler.submit(inputs, batch_size, deadline_ns, timing)
        return checked

    in_hooks = _HookStage()
    rows_leading = preprocess is None and _batched_only_by_the_program(signature, batch_signature)
    if preprocess is not None:  # (the stage admits: a stream's request waiting for room waits for the stage's)
        scheduler.stage_full = functools.partial(in_hooks.full, scheduler)

    async def run(inputs: list[NamedTensor], batch_size: int, deadline_ns: int,
                  timing: RequestTiming | None = None) -> list[NamedTensor]:
        # Admitted once, before any hook: an unload waits for the request until it is answered (see hooked_request).
        with scheduler.hooked_request():
            return await run_hooked(inputs, batch_size, deadline_ns, timing)

    async def run_hooked(inputs: list[NamedTensor], batch_size: int, deadline_ns: int,
                         timing: RequestTiming | None) -> list[NamedTensor]:
        name = scheduler.name  # a renamed model reports its new name
        program_rows = batch_size
        # The request's time in its hooks, charged to its timing once it has succeeded (see _charge_hooks).
        hook_queue_ns = hook_input_ns = hook_output_ns = 0
        client_inputs = list(inputs)  # (a copy of the list: a hook may replace tensors in the one it is given)
        if preprocess is not None:
            arrived_ns = time.monotonic_ns()
            if deadline_passed(deadline_ns, arrived_ns):
                # Refused as the scheduler refuses it: no model code runs for a request already out of time (told
                # so before a full stage's QueueFull, as the queue tells it).
                raise not_started(name, deadline_ns, arrived_ns)
            in_hooks.admit(scheduler)
            try:
                inputs, waited_ns = await _call_hook(hook_threads, scheduler, "preprocess", preprocess, inputs,
                                                     deadline_ns, in_hooks)
                inputs = _program_inputs(name, batch_signature, inputs, check_inputs)
            except ModelFailure as err:
                raise _logged(scheduler, err)
            hook_queue_ns, hook_input_ns = waited_ns, time.monotonic_ns() - arrived_ns - waited_ns
            if batch_signature.batches and inputs:
                # A hook may tile, crop or split rows: the program runs its rows, the client gets its own.
                program_rows = inputs[0].shape[0]
        else:  # (a model with a postprocess hook only: the client's inputs go to the program, checked)
            if to_program is not None:
                inputs = to_program(inputs)
            if rows_leading:
                # The program batches where the client's tensors do not (an output of model.py's without a batch
                # axis): its rows are counted as the program counts them. Counted as the client's one request, a
                # request of 2 rows failed, and every request batched with it (the bundle hunt).
                validated = validate_inputs(name, batch_signature, inputs)
                inputs, program_rows = validated.tensors, validated.batch_size
            if check_inputs is not None:
                check_inputs(inputs)
        try:
            # (Logs its own faults.)
            outputs = await scheduler.submit(inputs, program_rows, deadline_ns, timing, admitted=True)
        except DeadlineExceeded as err:
            if preprocess is None:
                raise
            # "It was not run" is the program's part: the model's own code did run for it.
            raise DeadlineExceeded(f"{err} (only its preprocess hook was)") from None
        except UnloadedBeforeStart:
            if preprocess is None:
                raise
            raise UnloadedBeforeStart(unloaded_before_start(name, "preprocess hook")) from None
        except InvalidArgument as err:
            if preprocess is None or await _same_tensors(inputs, client_inputs):
                # (A hook that passed the client's tensors on made nothing the program could refuse: the refusal,
                # a plugin's InvalidArgument say, is of the client's request; the fault hunt.)
                raise
            # What the program refused (a shape no compiled variant takes) is what the hook made of a valid
            # request: the model's fault, not the client's.
            raise _logged(scheduler, _hook_result_failure(name, "preprocess", PROGRAM_CANNOT_TAKE,
                                                           without_model_name(name, str(err)))) from None
        if postprocess is not None:
            REQUEST_STARTED.set(True)  # (the execution has run; submit's return set nothing)
            began_ns = time.monotonic_ns()
            try:
                with scheduler.in_postprocess():
                    outputs, waited_ns = await _call_hook(hook_threads, scheduler, "postprocess", postprocess,
                                                          outputs)
                    try:
                        # (The list checked: a numpy scalar is the 0-d array it is. Large results, as a coroutine
                        # model's outputs, are checked on a thread of the server's, not on the loop.)
                        outputs = await where_cheap(
                            outputs, lambda made: check_outputs(name, signature, made, batch_size))
                    except ModelFailure as err:  # (named as the hook's: the program's outputs were checked already)
                        # (A preprocess that changed the rows is named too: the postprocess hook turns the program's
                        # rows back into the request's, which a plugin hunt took for the wrong hook's blame.)
                        rows = (f" (the preprocess hook made {program_rows} row(s) of the request's {batch_size}: "
                                "the postprocess hook returns the request's own rows)"
                                if program_rows != batch_size else "")
                        raise _hook_result_failure(name, "postprocess", "outputs that do not match the model's",
                                                   without_model_name(name, str(err)) + rows) from None
            except ModelFailure as err:
                raise _logged(scheduler, err)
            hook_queue_ns += waited_ns
            hook_output_ns = time.monotonic_ns() - began_ns - waited_ns
        if timing is not None:
            _charge_hooks(timing, hook_queue_ns, hook_input_ns, hook_output_ns)
        return outputs

    return run


def _charge_hooks(timing: RequestTiming, queue_ns: int, input_ns: int, output_ns: int) -> None:
    """Add a request's time in its hooks to ``timing``, whose execution succeeded: its waits for a hook thread
    (``queue_ns``) to its queue time, its preprocess stage (the hook and the check of its result, ``input_ns``) to
    its compute input time, its postprocess stage (``output_ns``) to its compute output time.

    Left out, a slow hook's time was in no figure but the request's total, which perf_analyzer reads as the
    server's own overhead (the accounting hunt). Triton's compute input is the preparing of the model's input
    tensors, its compute output their extraction: what the hooks do. Per request, as hooks run: the execution's
    times (``compute_ns``, one tuple shared by the requests of its batch) are not changed, a new tuple is this
    request's; batch_stats and the per-execution histogram keep the execution's own.
    """
    if timing.compute_ns is None:  # (no execution succeeded for it: none of its time is charged)
        return
    timing.queue_ns += queue_ns
    execution_input_ns, infer_ns, execution_output_ns = timing.compute_ns
    timing.compute_ns = (execution_input_ns + input_ns, infer_ns, execution_output_ns + output_ns)


def checked_input_check(name: str, backend: ChecksInputs) -> Callable[[list[NamedTensor]], object] | None:
    """What the model ``name``'s ``input_check()`` returns: its check of a request's inputs, or None for none.

    ConfigError naming the model when ``input_check()`` raises (anything,
    sys.exit() included) or returns something that is neither a function nor
    None: the model fails its load. Asked once per load, by the server
    (:func:`make_runner`) and by ``nereid check``, so both refuse the same models.
    """
    try:
        check = backend.input_check()
    except BaseException as err:  # (a load failure: the model is not served)
        raise ConfigError(f"model '{name}': input_check() failed: {describe_exception(err)}") from err
    if check is not None and not callable(check):  # (it loaded READY, then every request failed INTERNAL)
        raise ConfigError(f"model '{name}': input_check() returned {str(check)[:64]!r} "
                          f"({type(check).__name__}), expected a function of the inputs or None")
    if inspect.iscoroutinefunction(check):  # (each call made a coroutine that never ran: nothing was checked)
        raise ConfigError(f"model '{name}': input_check() returned an async def function; the check is called as a "
                          "plain function, before the request queues: make it plain def")
    return check


def _taking_check(check: Callable[[list[NamedTensor]], object] | None,
                  batch_signature: ModelSignature) -> Callable[[list[NamedTensor]], None]:
    """What a reload's hand-over asks of this version for a request queued at the version it replaced (see
    ModelScheduler.input_check): the request's tensors, put in this version's order of the program's inputs by
    name (the old version's order may differ), through its raw input check, which raises when it does not take
    them (a fault of the check too: the request then stays where it was accepted, and no fault is logged)."""
    names = batch_signature.input_names

    def takes(tensors: list[NamedTensor]) -> None:
        by_name = {tensor.name: tensor for tensor in tensors}
        if sorted(by_name) != sorted(names):
            raise ValueError("other inputs")
        if check is not None:
            check([by_name[name] for name in names])
    return takes


def _takes_none(tensors: list[NamedTensor]) -> None:
    """A version with a preprocess hook takes no other version's queued request: its hook makes what it queues."""
    raise ValueError("a preprocess hook's model")


def _guarded_input_check(check: Callable[[list[NamedTensor]], object],
                         scheduler: ModelScheduler) -> Callable[[list[NamedTensor]], None]:
    """The model's input check (asked for once, at load), guarded as the model code it is: its refusal names
    the model; anything else it raises (sys.exit() included) is the model's logged fault, INTERNAL, never an
    error that escapes the data plane uncounted."""

    def checked(inputs: list[NamedTensor]) -> None:
        try:
            check(inputs)
        except NereidError as err:
            named = naming_model(scheduler.name, err)
            if named is err:
                raise
            raise named from err
        except BaseException as err:
            raise scheduler.model_fault(err, "input check") from err
    return checked


def _logged(scheduler: ModelScheduler, failure: ModelFailure) -> ModelFailure:
    """``failure`` of a hook, logged among the model's faults (an execution's are logged by its scheduler)."""
    scheduler.log_fault(failure)
    return failure


# What a preprocess result is, when the program cannot run it (refused by the check of the program's inputs, or by
# the program itself: a shape no compiled variant takes).
PROGRAM_CANNOT_TAKE = "tensors the program cannot take"


def _hook_result_failure(model: str, hook: str, what: str, detail: str) -> ModelFailure:
    """A hook's result refused downstream (by the program's input check or the program, or the output check),
    named as the hook's fault: the client's request was valid, so it is not blamed."""
    return ModelFailure(f"model '{model}': the {hook} hook returned {what}: {detail}")


# Tensors holding more bytes than this are compared on a worker thread, not the event loop.
COMPARE_OFF_LOOP_BYTES = 1 << 20


async def _same_tensors(made: list[NamedTensor], sent: list[NamedTensor]) -> bool:
    """Whether a preprocess hook's result ``made`` holds the client's tensors ``sent`` as they came: the same
    names, datatypes and values (a NaN equal to a NaN), in the same order. Compared only when the program
    refused them; large ones off the event loop (a 1 GB request held it 0.7 s; the hunt of the fixes)."""
    if len(made) != len(sent) or any(a.name != b.name or a.dtype != b.dtype or a.data.shape != b.data.shape
                                     for a, b in zip(made, sent)):
        return False

    def equal() -> bool:
        return all(a.data is b.data or np.array_equal(a.data, b.data, equal_nan=a.data.dtype.kind in "fc")
                   for a, b in zip(made, sent))
    if sum(a.data.nbytes for a in made) >= COMPARE_OFF_LOOP_BYTES:
        return await on_work_thread_or_here(equal)
    return equal()


def _program_inputs(model: str, batch_signature: ModelSignature, tensors: list[NamedTensor],
                    check_inputs: Callable[[list[NamedTensor]], object] | None) -> list[NamedTensor]:
    """The preprocess hook's result checked against the program's inputs (and the model's ``check_inputs``).

    The client's request was valid (it was checked against the client tensors),
    so a result that does not fit is the model's fault: INTERNAL, naming the
    hook, never INVALID_ARGUMENT about a tensor the client never sent.
    """
    try:
        tensors = validate_inputs(model, batch_signature, tensors).tensors
    except InvalidArgument as err:
        detail = without_model_name(model, str(err))
    except Exception as err:  # a NamedTensor whose data is no array (validation reads its shape)
        detail = describe_exception(err)
    else:
        if check_inputs is None:
            return tensors
        try:
            check_inputs(tensors)  # (a fault of the check itself comes out as the model's own ModelFailure)
            return tensors
        except InvalidArgument as err:
            detail = without_model_name(model, str(err))
    raise _hook_result_failure(model, "preprocess", PROGRAM_CANNOT_TAKE, detail) from None


class _HookStage:
    """The requests of one model version in its ``preprocess`` stage: waiting for one of its hook threads, or
    running the hook there. Used on the event loop only.

    They count against ``queue_capacity`` with the scheduler's queue, which each enters next: without that, a
    flood of a model whose ``preprocess`` is slow (or hangs) was all accepted, each request waiting on a thread,
    however small its ``queue_capacity`` (1,000 of 1,000 where a model without hooks refused 990). Counted
    together, the requests leaving the stage always find a place in the queue. A call given up before a thread
    took it (its request answered DEADLINE_EXCEEDED, or its client gone) still counts until one does: behind a
    hook that hangs, none ever does, and requests with short deadlines were each admitted and left there.
    """

    def __init__(self) -> None:
        self.calls: set[_HookStart] = set()  # the stage's requests' hook calls (see _call_hook)
        self._lock = threading.Lock()  # (dropped: raised on the event loop, lowered on a hook thread)
        self.dropped = 0

    def admit(self, scheduler: ModelScheduler) -> None:
        """Refuse a request (QueueFull, as the scheduler words it) when the stage and the queue are full of
        requests still in time.

        As the scheduler's own admission does, the queued requests whose
        deadline has passed are answered and removed first, and a request
        whose hook runs past its deadline holds no place: both are answered
        within about a millisecond anyway, by their timers, and a request
        refused in that millisecond was refused for nothing.
        """
        if not self.full(scheduler):
            return
        scheduler.drop_dead()
        now_ns = time.monotonic_ns()
        late = sum(call.running_late(now_ns) for call in self.calls)  # (one pass, and only when full)
        # (The whole queue, not queued_past_free_instances: a free instance that holds off for a batching window, or
        # for a full postprocess stage, takes none of it at once, and an admitted request must find its place.)
        if len(self.calls) - late + self.dropped + scheduler.queue_depth >= scheduler.capacity:
            raise queue_full(scheduler.name, scheduler.capacity, ", requests in its preprocess hook included",
                             scheduler.config_name)

    def full(self, scheduler: ModelScheduler) -> bool:
        """Whether the stage and the queue hold ``capacity`` requests, the expired and late ones counted: true
        whenever :meth:`admit` refuses."""
        return len(self.calls) + self.dropped + scheduler.queue_depth >= scheduler.capacity

    def call_dropped(self, taken: bool) -> None:
        """A call was given up before a thread took it (``taken``: a thread has now taken it, and skips it)."""
        with self._lock:
            self.dropped += -1 if taken else 1


class _HookStart:
    """Whether one hook call has begun on its worker thread, or was given up before it did (it then never begins:
    a request answered DEADLINE_EXCEEDED, or whose client went away, while it waited for a thread)."""

    def __init__(self, stage: _HookStage | None, tensors: list[NamedTensor], deadline_ns: int = 0) -> None:
        self._lock = threading.Lock()  # (begun on the worker thread, given up on the event loop)
        self._given_up = False
        self._stage = stage
        self._deadline_ns = deadline_ns
        self.begun_ns = 0  # time.monotonic_ns() when it began; 0: it has not
        # The request's tensors, until the hook takes them: a call given up before it began holds none of the
        # request's data while it waits in the pool's queue (behind a hung hook, for good).
        self.tensors: list[NamedTensor] | None = tensors

    def begin(self) -> list[NamedTensor] | None:
        """On the worker thread: the tensors to run the hook on; None when it was given up (it is not run)."""
        with self._lock:
            if self._given_up:
                if self._stage is not None:
                    self._stage.call_dropped(taken=True)
                return None
            self.begun_ns = time.monotonic_ns()
            tensors, self.tensors = self.tensors, None
            return tensors

    def not_queued(self) -> None:
        """No thread could be started for the call, which was never queued: given up, and not counted among the
        calls a thread has yet to take and skip (it would have held a place in the stage for good)."""
        with self._lock:
            self.tensors = None
            self._given_up = True

    def give_up(self) -> int:
        """The caller no longer waits: when the hook began (0: it had not, and now never will)."""
        with self._lock:
            if not self._given_up and not self.begun_ns:
                self.tensors = None
                if self._stage is not None:
                    self._stage.call_dropped(taken=False)  # (counted until a thread takes the call and skips it)
            self._given_up = True
            return self.begun_ns

    def running_late(self, now_ns: int) -> bool:
        """Its hook began and the request's deadline has passed at ``now_ns``: its caller is answered
        DEADLINE_EXCEEDED by its timer and leaves the stage, the hook running on with no place in it. (One still
        waiting for a thread keeps its place until a thread takes it: see :class:`_HookStage`.)"""
        return bool(self.begun_ns) and deadline_passed(self._deadline_ns, now_ns)


async def _call_hook(threads: HookThreads, scheduler: ModelScheduler, hook: str,
                     function: Callable[[list[NamedTensor]], list[NamedTensor]],
                     tensors: list[NamedTensor], deadline_ns: int = 0,
                     stage: _HookStage | None = None) -> tuple[list[NamedTensor], int]:
    """Run a hook on a worker thread (so hooks of different requests overlap); its result, checked there too (the
    message about a wrong result quotes part of it: none of that work on the event loop), and how long the call
    waited for a thread to take it (ns: the request's queue time, see :func:`_charge_hooks`).

    A preprocess hook gets the request's deadline (``time.monotonic_ns()``;
    0: none; a postprocess runs after the program, and running work is not
    interrupted): its caller waits until then at most, and gets
    DeadlineExceeded saying whether the hook had begun. A thread cannot be
    stopped, so one that began runs on and its result is dropped (the thread
    serves the model's other hooks once it returns); one still waiting for a
    thread never begins. The model's scheduler counts the call until it has ended on its thread, so an unload
    waits for a hook still running after its caller stopped waiting (a deadline, a client gone).
    """
    model = scheduler.name
    start = _HookStart(stage, tensors, deadline_ns)
    del tensors  # (held by ``start`` until the hook takes them)

    def run_and_check() -> list[NamedTensor]:
        taken = start.begin()
        if taken is None:
            return []  # (its caller was answered already)
        return _checked_hook_result(model, hook, loop_safe_call(function, taken))

    queued_ns = time.monotonic_ns()
    # A little after the deadline: the loop may run a timer early (as the scheduler's expiry timer allows).
    timer = asyncio.timeout(max(0, deadline_ns - queued_ns) / 1e9 + 0.001 if deadline_ns else None)
    if stage is not None:
        stage.calls.add(start)
    try:
        async with timer:
            result = await _hook_result(threads, scheduler, hook, run_and_check)
        return result, start.begun_ns - queued_ns
    except _NoHookThread as no_thread:
        start.not_queued()
        what = f"its {hook} hook" + (", after the model had run for it" if hook == "postprocess" else "")
        raise scheduler.thread_refused(no_thread.error, what) from None
    except TimeoutError:
        if not timer.expired():  # (never: the hook's own errors come out of _hook_result as NereidError)
            raise
        now_ns = time.monotonic_ns()
        begun_ns = start.give_up()
        if not begun_ns:
            waited = f"its preprocess hook waited {(now_ns - queued_ns) / 1e6:.1f} ms for a worker thread"
            raise not_started(model, deadline_ns, now_ns, waited) from None
        raise DeadlineExceeded(
            f"model '{model}': deadline passed while the request's {hook} hook ran (for "
            f"{(now_ns - begun_ns) / 1e6:.1f} ms so far); the program was not run, and the hook runs on with its "
            "result dropped") from None
    finally:
        # (When it returned or failed: no-op; a caller gone while it waited for a thread: it never runs.)
        if start.give_up():
            # The model's own code ran for the request (see its answer past the grace): only once a thread took
            # the call. One still waiting for a thread when it was stopped was told "its answer is lost".
            REQUEST_STARTED.set(True)
        if stage is not None:
            stage.calls.discard(start)  # (after give_up: a call given up unbegun is counted as dropped first)


async def _hook_result(threads: HookThreads, scheduler: ModelScheduler, hook: str,
                       run_and_check: Callable[[], list[NamedTensor]]) -> list[NamedTensor]:
    """``run_and_check()`` on one of ``threads``; what it raises, named as the model's (a hook's BaseException
    as its ModelFailure): a caller's cancellation is all that comes out otherwise."""
    model = scheduler.name
    try:
        return await threads.run(run_and_check, scheduler, hook)
    except NereidError as err:
        # A hook's own refusal (InvalidArgument, ...): same kind, naming the model as every message does (the
        # check's verdict names it already).
        named = naming_model(model, err)
        if named is err:
            raise
        raise named from err
    except _NoHookThread:
        raise  # (the server's condition, not the hook's: see _call_hook)
    except asyncio.CancelledError as err:
        # The hook's own (a future it waited on was cancelled; the thread's CancelledError arrives as
        # asyncio's), unless this request's task was cancelled: then the caller went away.
        if asyncio.current_task().cancelling():
            raise
        raise _hook_failure(model, hook, err) from err
    except BaseException as err:  # sys.exit() or a GeneratorExit in a hook must neither end the server nor lose
        raise _hook_failure(model, hook, err) from err  # the request


def _hook_failure(model: str, hook: str, error: BaseException) -> ModelFailure:
    return ModelFailure(f"model '{model}': {hook} hook failed: {describe_exception(error)}")


def _checked_hook_result(model: str, hook: str, result: Any) -> list[NamedTensor]:
    """``result`` as a list of NamedTensor (a tuple of them is taken too); ModelFailure naming the hook and
    what it returned otherwise.

    What the hook returns goes on to code that reads tensors' names and
    shapes; anything else would fail there with an error naming neither.
    """
    if isinstance(result, (list, tuple)) and all(isinstance(item, NamedTensor) for item in result):
        return list(result)
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()  # never run, and never "was never awaited" in the log
        got = (f"a {type(result).__name__} (hooks are called on a worker thread, where an async def hook's "
               "coroutine never runs: make it a plain function)")
    elif isinstance(result, (list, tuple)):
        index, item = next((i, item) for i, item in enumerate(result) if not isinstance(item, NamedTensor))
        got = f"a {type(result).__name__} whose item {index} is {brief_description(item)}"
    else:
        got = brief_description(result)
    raise ModelFailure(f"model '{model}': the {hook} hook returned {got}, expected a list of NamedTensor")
