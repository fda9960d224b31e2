"""A meta model: ``model.py`` orchestrates other models of the server with data-dependent logic.

The folder holds ``manifest.yaml`` (``meta: true``, ``depends_on``, the wire
tensors under ``client_inputs`` / ``client_outputs``) and a ``model.py`` that
calls ``nereid.register_model(orchestrate=fn)``. Each client request runs
``fn(inputs, ctx)`` once; ``ctx.infer(model, inputs)`` is a sub-call through
the server's data plane, so it queues, batches and counts in the sub-model's
statistics exactly like a client's request, and carries the caller's deadline.

The deadline rule: once the request's deadline has passed, ``ctx.infer``
raises :class:`~nereid.errors.DeadlineExceeded` without issuing the call. A
sub-call already running is never interrupted; the rule only declines to start
new work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import threading
import time
import traceback
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from nereid.backend import REQUEST_DEADLINE_NS, ModelContext, RuntimeReport
from nereid.batching import deadline_passed
from nereid.backends.xla.device import check_xla_flags
from nereid.backends.xla.manifest import (MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, load_manifest,
                                          parse_manifest_text)
from nereid.backends.xla.signatures import batch_mode, build_signature
from nereid.daemon_pool import DaemonThreadPool, ThreadStartFailed
from nereid.dependencies import DependencyCycle, describe_cycle, find_cycle
from nereid.errors import (ConfigError, DeadlineExceeded, InvalidArgument, LoggedModelFailure, MissingModelFile,
                           ModelFailure, NereidError, NotFound, OutputsRefused, QueueFull, RunNotStarted, Unavailable,
                           describe_exception, loop_safe_call, same_kind)
from nereid.files import not_regular_reason, read_text_file
from nereid.model_hooks import load_model_hooks
from nereid.runtime_options import RuntimeOptions
from nereid.signature import ModelSignature, brief_description
from nereid.tensors import InferRequest, NamedTensor

log = logging.getLogger(__name__)

PLATFORM = "nereid_meta"
MODEL_PY = "model.py"
# How long a cancelled request waits for its async orchestration to end before leaving it (see _run_async). Below
# the second gRPC gives requests past a stop's grace to be answered (nereid.server.ANSWER_AT_GRACE_S): at 2 s, the
# request of an orchestration that swallows its cancellation was cut off there, never answered.
ORCHESTRATION_END_WAIT_S = 0.5


class _Orchestration:
    """One request's async orchestration: its model, and the tasks it started that have not ended."""

    __slots__ = ("model", "tasks")

    def __init__(self, model: str) -> None:
        self.model = model
        self.tasks: set[asyncio.Future] = set()

    def end(self) -> None:
        """Cancel what it started that still runs: a sub-call queued in its model is dropped, as when the client
        goes away (a fan-out whose first failure ended the request left its other sub-calls to run for nobody)."""
        for task in list(self.tasks):
            task.cancel()


# The async orchestration running in this context (None: none): the tasks it starts are contained and ended with
# it (see contain_orchestration_tasks).
_ORCHESTRATING: ContextVar[_Orchestration | None] = ContextVar("nereid_orchestrating", default=None)


class MetaContext:
    """What an ``async def`` orchestration gets as ``ctx``: one client request's handle on the server.

    ``await ctx.infer(model, inputs, outputs=None)`` calls another model and
    returns its outputs; ``asyncio.gather`` over several calls runs them at
    once. ``deadline_ns`` is the request's deadline (``time.monotonic_ns()``;
    0: none) and :meth:`time_remaining` what is left of it.
    """

    def __init__(self, model: MetaModel, deadline_ns: int) -> None:
        self._model = model
        self.model_name = model.context.name
        self.deadline_ns = deadline_ns
        self.depends_on = model.depends_on
        # Set once the request's own task is cancelled (its client went away, or the server stops): no further
        # sub-call is issued, whatever the orchestration does with the CancelledError it was sent.
        self.request_cancelled = False
        # Set once the orchestration has ended: a sub-call asked for later (a loop callback's task, which the
        # orchestration's end could not take with it) is refused, as the blocking context refuses it (the meta
        # read hunt: it ran after the request was answered).
        self.ended = False

    def time_remaining(self) -> float | None:
        """Seconds left before the request's deadline (negative once past; None: no deadline)."""
        if not self.deadline_ns:
            return None
        return (self.deadline_ns - time.monotonic_ns()) / 1e9

    async def infer(self, model_name: str, inputs: Sequence[NamedTensor],
                    outputs: Sequence[str] | None = None) -> list[NamedTensor]:
        """Run ``model_name`` on ``inputs``; its outputs in its declared order, or only ``outputs`` in that order.

        Raises DeadlineExceeded without calling when the deadline has passed,
        and the sub-call's own error (a :mod:`nereid.errors` exception, naming
        this model and the sub-model) when it fails.
        """
        if self.request_cancelled:
            # An orchestration that caught its request's cancellation (a bare `except`, a broad `except
            # BaseException`) and went on: its client has gone, so nothing more is run for it (a bug hunt).
            raise asyncio.CancelledError(f"meta model '{self.model_name}': the request was cancelled; the sub-call "
                                         f"to '{model_name}' was not issued")
        if self.ended:
            raise Unavailable(f"meta model '{self.model_name}': its orchestration had ended; the sub-call to "
                              f"'{model_name}' was not issued")
        request = self._model.sub_request(model_name, inputs, outputs, self.deadline_ns)
        return await self._model.call(request)


class BlockingMetaContext(MetaContext):
    """``ctx`` of a plain ``def`` orchestration, which runs on a worker thread: ``ctx.infer`` blocks."""

    def __init__(self, model: MetaModel, deadline_ns: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(model, deadline_ns)
        self._loop = loop
        self._lock = threading.Lock()
        # Why no further sub-call is issued (None: they are): the client's request went away, or the
        # orchestration has ended.
        self._abandoned: str | None = None
        # The sub-calls threads wait on (an orchestration may fan out over threads of its own).
        self._sub_calls: set[concurrent.futures.Future] = set()

    def abandon(self, why: str = "the request was cancelled") -> None:
        """No further sub-call is issued, for the reason ``why``; those in progress are dropped (one still queued
        in its model never runs; one running finishes with its answer discarded)."""
        with self._lock:
            if self._abandoned is None:
                self._abandoned = why
            sub_calls = list(self._sub_calls)
        for sub_call in sub_calls:
            sub_call.cancel()

    def infer(self, model_name: str, inputs: Sequence[NamedTensor],  # type: ignore[override]
              outputs: Sequence[str] | None = None) -> list[NamedTensor]:
        """Run ``model_name`` on ``inputs`` and wait for its outputs (see :meth:`MetaContext.infer`)."""
        if _on_event_loop():
            raise RuntimeError(f"meta model '{self.model_name}': this ctx belongs to a plain-def orchestration, "
                               "whose ctx.infer blocks; it cannot be called on the event loop (make the "
                               "orchestration async def and await ctx.infer instead)")
        request = self._model.sub_request(model_name, inputs, outputs, self.deadline_ns)
        with self._lock:
            if self._abandoned is not None:
                raise Unavailable(f"meta model '{self.model_name}': {self._abandoned}; the sub-call to "
                                  f"'{model_name}' was not issued")
            sub_call = asyncio.run_coroutine_threadsafe(self._model.call(request), self._loop)
            self._sub_calls.add(sub_call)
        try:
            return sub_call.result()
        except concurrent.futures.CancelledError:
            raise Unavailable(f"meta model '{self.model_name}': {self._abandoned or 'the request was cancelled'} "
                              f"during its sub-call to '{model_name}'") from None
        finally:
            with self._lock:
                self._sub_calls.discard(sub_call)
            # The future keeps the sub-call's error, whose traceback holds this frame: no cycle through it.
            del sub_call


class MetaModel:
    """A meta model (a ``nereid.backend.Model``): its ``infer`` is a coroutine run on the event loop.

    Implements :class:`~nereid.backend.CallsModels`: the repository keeps it
    READY only while its ``depends_on`` are READY, and runs each request as an
    execution of its own, up to ``queue_capacity`` at once (orchestrations wait
    on other models; they hold no thread unless they are plain functions).
    """

    platform = PLATFORM

    def __init__(self, context: ModelContext) -> None:
        self.context = context
        self.depends_on: tuple[str, ...] = ()
        self._callable: frozenset[str] = frozenset()
        self._manifest: Manifest | None = None
        self._signature: ModelSignature | None = None
        self._orchestrate: Callable[..., Any] | None = None
        self._is_async = True
        self._model_py: Path | None = None
        self._pool: DaemonThreadPool | None = None

    # -- Model protocol ---------------------------------------------------------------------------

    def uses_no_device(self) -> bool:
        """Its orchestration runs on the server's event loop; each model it calls runs on its own device."""
        return True

    def load(self) -> None:
        """Read the manifest and model.py; refuse runtime options, program files, a missing orchestration and cycles."""
        name, folder = self.context.name, self.context.folder
        RuntimeOptions(self.context.settings.runtime, self.context.settings_origin, "meta", ())  # it has none
        if self.context.device.is_gpu:  # (a ported ensemble's KIND_GPU, say): said once, then the load goes on
            log.warning("model '%s': device: %s does not apply to a meta model (its orchestration runs on the "
                        "server's event loop; each model it calls runs on its own device); ignored",
                        name, self.context.device)
        self.context.warn_timeout_ignored("a meta model's requests are bounded by their deadlines (the gRPC deadline "
                                          "or the timeout parameter), and the models it calls by their own")
        manifest_path = folder / MANIFEST_NAME
        if (reason := not_regular_reason(manifest_path)) is not None:
            raise ConfigError(reason)
        if not manifest_path.is_file():
            raise MissingModelFile(f"model '{name}': {folder} has no {MANIFEST_NAME} (a meta model holds "
                                   f"{MANIFEST_NAME} with meta: true and a {MODEL_PY})")
        manifest = load_manifest(manifest_path)
        if not manifest.is_meta:
            raise ConfigError(f"model '{name}': {manifest_path}: meta: the meta backend serves manifests with "
                              "meta: true; this one describes a bundle (serve it with backend: xla)")
        program_files = sorted(p.name for p in folder.iterdir()
                               if p.name.endswith((".mlir", ".safetensors")) and not p.name.startswith("."))
        if program_files:
            raise ConfigError(f"model '{name}': {manifest_path} says meta: true, but the folder holds program or "
                              f"weights files ({', '.join(program_files)}): a meta model runs no program of its "
                              "own. Remove them, or remove meta: true to serve the folder as a bundle (weights "
                              "model.py reads itself may sit in a subfolder: weights/proj.safetensors)")
        model_py = folder / MODEL_PY
        if (reason := not_regular_reason(model_py)) is not None:
            raise ConfigError(reason)
        if not model_py.is_file():
            raise ConfigError(f"model '{name}': {manifest_path} says meta: true, but {folder} has no {MODEL_PY}: "
                              f"a meta model's {MODEL_PY} calls nereid.register_model(orchestrate=fn)")
        self.depends_on = manifest.depends_on
        self._callable = frozenset(self.depends_on)
        cycle = find_cycle(name, self._declared_dependencies)
        if cycle is not None:
            raise DependencyCycle(f"model '{name}': depends_on forms a cycle {describe_cycle(cycle)} "
                                  f"({manifest_path}): a meta model must not reach itself through depends_on", cycle)
        check_xla_flags(name)  # (its model.py may start jax in this process: XLA_FLAGS XLA ends it on are refused)
        hooks = load_model_hooks(model_py, name, meta=True)
        if hooks.orchestrate is None:
            raise ConfigError(f"model '{name}': {model_py} registered no orchestration: a meta model's "
                              f"{MODEL_PY} calls nereid.register_model(orchestrate=fn), with "
                              "[async] def fn(inputs, ctx) -> list[NamedTensor]")
        _check_arity(name, model_py, hooks.orchestrate)
        inputs, outputs = manifest.client_inputs or (), manifest.client_outputs or ()
        mode = batch_mode(inputs, outputs, manifest.batching is not None)
        self._signature = build_signature(inputs, outputs, mode,
                                          manifest.batching.largest if manifest.batching else 0)
        self._manifest, self._model_py, self._orchestrate = manifest, model_py, hooks.orchestrate
        self._is_async = _is_async_callable(hooks.orchestrate)
        if not self._is_async:
            # Plain functions block in ctx.infer: one daemon thread per running orchestration.
            self._pool = DaemonThreadPool(self.concurrent_executions(), thread_name_prefix=f"nereid-meta-{name}")
        log.info("meta model '%s': %s orchestration over %s", name, "async" if self._is_async else "threaded",
                 ", ".join(self.depends_on) or "no models")

    def signature(self) -> ModelSignature:
        """The wire tensors of ``client_inputs`` / ``client_outputs``."""
        if self._signature is None:
            raise RuntimeError("load() first")
        return self._signature

    async def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        """Run the orchestration for one request (validated inputs, batch axis present when it batches)."""
        orchestrate = self._orchestrate
        assert orchestrate is not None, "load() first"
        deadline_ns = REQUEST_DEADLINE_NS.get()  # the request's, set by the scheduler
        ctx = MetaContext(self, deadline_ns) if self._is_async else None
        try:
            if ctx is not None:
                result = await self._run_async(orchestrate, inputs, ctx)
            else:
                result = await self._run_blocking(orchestrate, inputs, deadline_ns)
        except _MisdirectedSubCall as err:  # (with the line of model.py that made the call)
            raise ModelFailure(f"{err}{self._line_of(err).replace(' at ', '; called at ')}") from None
        except ThreadStartFailed:
            # No thread could start for a plain def orchestration (a process limit): it did not run, and never
            # will; its scheduler answers it UNAVAILABLE, as it does for a model's own worker thread. (Before the
            # NereidError it is too: not named as the orchestration's.)
            raise
        except NereidError as err:
            answered = self._as_answered(err)
            if answered is err:
                raise
            raise answered from err
        except BaseException as err:
            # A TaskGroup's failure (Python 3.11's fan-out): its sub-calls' errors in a group, which said only
            # "ExceptionGroup: unhandled errors in a TaskGroup", INTERNAL, logged again (the native hunt).
            leaf = _sole_kind_leaf(err)
            if isinstance(leaf, _MisdirectedSubCall):  # (with its line, as out of the orchestration itself)
                raise ModelFailure(f"{leaf}{self._line_of(leaf).replace(' at ', '; called at ')}") from None
            if leaf is not None:
                answered = self._as_answered(leaf)
                raise answered from (leaf if answered is not leaf else leaf.__cause__)
            if isinstance(err, asyncio.CancelledError) and (ctx.request_cancelled if ctx else _being_cancelled()):
                raise  # the client went away, or the server stops (the scheduler tells the model's own apart)
            # Any other exception, and what is none (sys.exit(), a KeyboardInterrupt or GeneratorExit of its own, a
            # CancelledError it raised itself, its task not cancelled, a BaseException of the author's): the
            # model's fault, never the server's end nor a request left unanswered. Logged once, by this model's
            # scheduler (under its per-model limit), with the author's traceback.
            hint = _AWAIT_HINT if ctx is not None and _used_a_coroutine(err) else ""
            raise ModelFailure(f"meta model '{self.context.name}': orchestrate failed{self._line_of(err)}: "
                               f"{describe_exception(err)}{hint}") from err
        finally:
            # What is raised holds this frame in its traceback: no cycle through these locals, which kept the
            # orchestration's frames (its inputs and intermediates) until a garbage collection.
            answered = leaf = None
        return self._in_declared_order(result)

    def _as_answered(self, err: NereidError) -> NereidError:
        """What the client is told of an error out of the orchestration: a sub-call's as it is (it names both
        models, with its status), the orchestration's own refusal (``raise InvalidArgument(...)``) naming this
        model, with its status."""
        if str(err).startswith(f"meta model '{self.context.name}'"):
            return err
        return same_kind(err, f"meta model '{self.context.name}': {err}")

    async def _run_async(self, orchestrate: Callable[..., Any], inputs: list[NamedTensor], ctx: MetaContext) -> Any:
        """What an ``async def`` orchestration returns, run in a task of its own.

        Its own task tells the request's cancellation (this task's: the client
        went away, or the server stops) from what the orchestration does with
        its own: one it caught and went on from, or one a TaskGroup of its own
        left counted (Python 3.11 leaves a task's ``cancelling()`` at 1 when a
        TaskGroup's child fails while it waits). On the request's cancellation
        the orchestration is cancelled and waited for, and ``ctx.infer`` issues
        nothing more; the request then ends cancelled, whatever it returns. One
        that has not ended :data:`ORCHESTRATION_END_WAIT_S` later is left running.
        """
        loop = asyncio.get_running_loop()
        contain_orchestration_tasks(loop)
        orchestration = _Orchestration(self.context.name)
        # Made outside any calling orchestration (a meta model calling this one), whose task it would be counted as.
        calling = _ORCHESTRATING.set(None)
        try:
            task = loop.create_task(_orchestrated(orchestration, orchestrate, inputs, ctx),
                                    name=f"nereid-orchestration-{self.context.name}")
        finally:
            _ORCHESTRATING.reset(calling)
        task.add_done_callback(_retrieve)
        try:
            try:
                await asyncio.wait((task,))
            except asyncio.CancelledError:
                ctx.request_cancelled = True
                task.cancel()
                # An orchestration that catches its CancelledError runs on: waited for a while, then left to end by
                # itself (it can issue no further sub-call), so that the request ends. Waited for without a bound,
                # one that swallowed every cancellation kept its request, and an unload abandoning it at its grace,
                # waiting for ever (its client, without a deadline, was never answered; the native hunt).
                # (Cancelled again meanwhile, the wait ends at once.)
                await asyncio.wait((task,), timeout=ORCHESTRATION_END_WAIT_S)
                if not task.done():
                    log.warning("meta model '%s': an orchestration did not end within %g s of its request's "
                                "cancellation (it catches CancelledError); leaving it to end by itself: it can call "
                                "no other model", self.context.name, ORCHESTRATION_END_WAIT_S)
                raise
            try:
                return task.result()
            except _Escaped as escaped:
                raise escaped.error from None
        finally:
            ctx.ended = True
            orchestration.end()
            # The task keeps its exception, whose traceback holds this frame: a cycle through this local that only
            # a garbage collection freed, with the orchestration's frame and every input and intermediate it held
            # (8 failing requests with a 100 MB local each: +477 MiB until a collection; the meta hunt).
            del task

    def unload(self) -> None:
        """Release the worker threads of a plain-def orchestration."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- CallsModels, ReportsRuntime ------------------------------------------------------------------

    def dependencies(self) -> tuple[str, ...]:
        """The models of ``depends_on``: the only ones ``ctx.infer`` may call."""
        return self.depends_on

    def concurrent_executions(self) -> int:
        """Orchestrations that may run at once: ``queue_capacity`` (they wait on other models' queues)."""
        return self.context.settings.queue_capacity

    def runtime_report(self) -> RuntimeReport:
        """``depends_on=a,b orchestrate=async`` for ``nereid check``."""
        kind = "async" if self._is_async else "thread"
        return RuntimeReport(f"depends_on={','.join(self.depends_on) or '-'} orchestrate={kind}")

    # -- sub-calls ----------------------------------------------------------------------------------

    def sub_request(self, model_name: str, inputs: Sequence[NamedTensor], outputs: Sequence[str] | None,
                    deadline_ns: int) -> InferRequest:
        """The request for one sub-call; refuses an unlisted model and a passed deadline before anything runs."""
        name = self.context.name
        if model_name not in self._callable:
            listed = ", ".join(self.depends_on) or "none"
            raise _MisdirectedSubCall(f"meta model '{name}': ctx.infer('{model_name}') refused: '{model_name}' is "
                                      f"not in depends_on of its {MANIFEST_NAME} (depends_on: {listed}); list every "
                                      "model it calls")
        if not isinstance(inputs, (list, tuple)) or not all(isinstance(t, NamedTensor) for t in inputs):
            raise TypeError(f"ctx.infer('{model_name}', inputs): inputs must be a list of nereid.tensors.NamedTensor, "
                            f"got {type(inputs).__name__}")
        if outputs is not None and (isinstance(outputs, str) or not all(isinstance(o, str) for o in outputs)):
            raise TypeError(f"ctx.infer('{model_name}', inputs, outputs): outputs must be a list of output names, "
                            f"got {outputs!r}")
        now = time.monotonic_ns()
        if deadline_passed(deadline_ns, now):
            raise DeadlineExceeded(f"meta model '{name}': the request's deadline passed "
                                   f"{(now - deadline_ns) / 1e6:.1f} ms before its sub-call to '{model_name}', "
                                   "which was not issued")
        return InferRequest(model_name, list(inputs), requested_outputs=list(outputs or ()), deadline_ns=deadline_ns)

    async def call(self, request: InferRequest) -> list[NamedTensor]:
        """Run a sub-call through the server's data plane; its errors keep their type and name both models."""
        name, sub = self.context.name, request.model_name
        caller = self.context.models
        if caller is None:
            raise Unavailable(f"meta model '{name}': cannot call '{sub}': the model was loaded outside a server "
                              "(as by nereid check)")
        try:
            response = await caller.infer(request)
        except ModelFailure as err:
            # The sub-model's scheduler logged this fault of its run (with the traceback, if any): the same
            # status and message for the client, but no second line in the log for this model.
            raise LoggedModelFailure(f"meta model '{name}': sub-call to '{sub}' failed: {err}") from err
        except (NotFound, QueueFull, RunNotStarted) as err:
            # UNAVAILABLE, whatever the sub-model's own: NOT_FOUND would say the meta model is unknown (a router
            # then treats its URL as wrong), where a model it calls is gone, as requests a moment later are told;
            # counted as this model's queue_full, a full sub-model queue would send an operator to this model's
            # queue_capacity, which was not the one full; and a sub-model's run that did not start is no
            # RunNotStarted of this model, whose orchestration did run (its own scheduler would take the kept kind
            # for one of its own: the review hunt).
            raise Unavailable(f"meta model '{name}': sub-call to '{sub}' failed: {err}") from err
        except OutputsRefused as err:
            # The orchestration alone chose those names (it is not told the client's): its mistake, INTERNAL, where
            # INVALID_ARGUMENT blamed the client (the meta hunt).
            raise _OutputsNotThere(f"meta model '{name}': ctx.infer('{sub}', ..., outputs="
                                   f"{request.requested_outputs!r}) refused: {err}") from None
        except NereidError as err:
            raise same_kind(err, f"meta model '{name}': sub-call to '{sub}' failed: {err}") from err
        # Read-only views, whatever the called backend answered: a cxx model's buffers were writable, a gRPC-read
        # or bundle's not, so `y.data += b` worked or failed by the backend called (and wrote into a buffer a
        # plugin may hand every caller). A view: the backend's own array is left as it is.
        outputs = [NamedTensor(tensor.name, tensor.dtype, _read_only(tensor.data)) for tensor in response.outputs]
        if not request.requested_outputs:
            return outputs
        # In the order asked for, as `qs, y = await ctx.infer(m, x, outputs=["qs", "y"])` reads them (the data
        # plane answers in the model's declared order: that unpacking swapped the two).
        by_name = {tensor.name: tensor for tensor in outputs}
        return [by_name[output] for output in request.requested_outputs]

    # -- helpers ------------------------------------------------------------------------------------

    async def _run_blocking(self, orchestrate: Callable[..., Any], inputs: list[NamedTensor],
                            deadline_ns: int) -> Any:
        pool = self._pool
        if pool is None:
            raise Unavailable(f"model '{self.context.name}' is being unloaded")
        context = BlockingMetaContext(self, deadline_ns, asyncio.get_running_loop())
        submitted = pool.submit(loop_safe_call, self._start_blocking, orchestrate, inputs, context)
        future = asyncio.wrap_future(submitted)
        try:
            if deadline_ns:
                await self._thread_or_deadline(future, submitted, deadline_ns)
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # Not started yet (every thread busy): it never starts. Started: a thread cannot be stopped;
            # its sub-call in progress is dropped and it issues no new one.
            if not submitted.cancel():
                context.abandon()
            future.add_done_callback(_retrieve)
            raise
        finally:
            # Threads of its own may still hold sub-calls (a fan-out whose first failure ended it): they would
            # run for nobody. Dropped, as the tasks of an async orchestration are.
            context.abandon("its orchestration had ended")
            # Both futures keep its exception, whose traceback holds this frame: no cycle through them (as in
            # _run_async).
            del future, submitted

    async def _thread_or_deadline(self, future: asyncio.Future, submitted: concurrent.futures.Future,
                                  deadline_ns: int) -> None:
        """Wait until a thread takes the orchestration (or it ends), or until ``deadline_ns``: then, when no thread
        has taken it yet, it never runs, and the request is answered DEADLINE_EXCEEDED at its deadline, as a
        request in the scheduler's queue is. It was answered only once a thread freed, seconds late, and never
        while every thread ran an orchestration that hung (the meta read hunt)."""
        waited_from = time.monotonic_ns()
        # (A little after the deadline, as the scheduler's expiry timer allows for a timer run early.)
        await asyncio.wait((future,), timeout=max(0, deadline_ns - waited_from) / 1e9 + 0.001)
        if not future.done() and submitted.cancel():
            now = time.monotonic_ns()
            raise DeadlineExceeded(f"meta model '{self.context.name}': the request's deadline passed while it waited "
                                   f"{(now - waited_from) / 1e6:.1f} ms for a thread to start its orchestration, "
                                   "which did not run (every thread ran one)")

    def _start_blocking(self, orchestrate: Callable[..., Any], inputs: list[NamedTensor],
                        context: BlockingMetaContext) -> Any:
        """On a pool thread: the orchestration, unless its request's deadline passed while it waited for the thread
        (every thread was busy, with orchestrations whose clients may have gone away)."""
        now = time.monotonic_ns()
        if deadline_passed(context.deadline_ns, now):
            raise DeadlineExceeded(f"meta model '{self.context.name}': the request's deadline passed "
                                   f"{(now - context.deadline_ns) / 1e6:.1f} ms before a thread could start its "
                                   "orchestration, which did not run")
        return orchestrate(inputs, context)

    def _in_declared_order(self, result: Any) -> list[NamedTensor]:
        """The orchestration's outputs in the manifest's order (it may return them in any order)."""
        name = self.context.name
        declared = self.signature().output_names
        if isinstance(result, list) and [getattr(t, "name", None) for t in result] == declared:
            return result  # the usual case; the scheduler checks each output's type and shape next
        if inspect.iscoroutine(result):
            # A plain function returning a coroutine (a lambda around an async def) runs on a worker thread and
            # never awaits it: said so, and closed (never awaited, Python warned of it at a random later line of
            # the log; a bug hunt).
            result.close()
            if self._is_async:  # (an async def returning f(...) where it meant await f(...): the regression hunt)
                raise ModelFailure(f"meta model '{name}': orchestrate returned a coroutine it did not await "
                                   "(return await f(...), not return f(...))")
            raise ModelFailure(f"meta model '{name}': orchestrate returned a coroutine, which nothing awaits: it is "
                               "a plain function (a lambda around an async def, say); register the async def itself")
        if not isinstance(result, (list, tuple)) or not all(isinstance(t, NamedTensor) for t in result):
            # (A list's bad item is named: "[None]" said only "got list"; the regression hunt.)
            bad = next(((index, item) for index, item in enumerate(result) if not isinstance(item, NamedTensor)),
                       None) if isinstance(result, (list, tuple)) else None
            got = (f"a {type(result).__name__} whose item {bad[0]} is {brief_description(bad[1])}" if bad is not None
                   else type(result).__name__)
            raise ModelFailure(f"meta model '{name}': orchestrate must return a list of nereid.tensors.NamedTensor "
                               f"(outputs {declared}), got {got}")
        by_name = {t.name: t for t in result}
        if len(by_name) != len(result) or set(by_name) != set(declared):
            raise ModelFailure(f"meta model '{name}': orchestrate returned outputs {[t.name for t in result]}, "
                               f"expected {declared} (client_outputs in {MANIFEST_NAME})")
        return [by_name[output] for output in declared]

    def _declared_dependencies(self, model: str) -> tuple[str, ...]:
        """``depends_on`` of a model as its folder declares it (empty for a bundle, or a manifest in error)."""
        if model == self.context.name:
            return self.depends_on
        # (The repository's folders: this version's own, from a store, is a copy of its folder there.)
        path = (self.context.repository_folder or self.context.folder).parent / model / MANIFEST_NAME
        try:
            text = read_text_file(path, MAX_MANIFEST_BYTES)
        except ConfigError:  # none there, or no regular file of text (that model reports its own when it loads)
            return ()
        return _depends_on(str(path), text)

    def _line_of(self, err: BaseException) -> str:
        """`` at model.py:<line>`` of the innermost frame in model.py, for the error message: in ``err``'s own
        traceback, else in its cause's (a StopIteration the coroutine machinery turned into a RuntimeError)."""
        seen: BaseException | None = err
        for _ in range(8):  # (a bounded walk: a cause chain may loop)
            if seen is None:
                break
            frames = [f for f in traceback.extract_tb(seen.__traceback__) if Path(f.filename) == self._model_py]
            if frames:
                return f" at {MODEL_PY}:{frames[-1].lineno}"
            seen = seen.__cause__ or seen.__context__
        return ""


async def _orchestrated(orchestration: _Orchestration, orchestrate: Callable[..., Any], inputs: list[NamedTensor],
                        ctx: MetaContext) -> Any:
    """``await orchestrate(inputs, ctx)`` in its own task, whose tasks are ``orchestration``'s; a SystemExit or
    KeyboardInterrupt comes out in an :class:`_Escaped` (asyncio lets a task's out of the event loop; the task keeps
    any other exception, a GeneratorExit the coroutine is closed with included)."""
    _ORCHESTRATING.set(orchestration)  # (this task's own copy of the context)
    try:
        return await orchestrate(inputs, ctx)
    except (SystemExit, KeyboardInterrupt) as err:
        raise _Escaped(err) from None


class _Escaped(Exception):
    """What an orchestration raised that is no Exception, carried out of its task to the request's."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


# What an async orchestration that used a coroutine as a value is asked (ctx.infer's, most likely: the one coroutine
# every orchestration gets): `(y,) = ctx.infer(...)` failed with "cannot unpack non-iterable coroutine object" alone.
_AWAIT_HINT = " (did you forget `await` before ctx.infer(...)?)"


def _used_a_coroutine(err: BaseException) -> bool:
    """Whether ``err`` is Python's complaint about a coroutine used as a value (unpacked, indexed, its attribute
    read): ``TypeError: cannot unpack non-iterable coroutine object``, ``'coroutine' object is not subscriptable``."""
    return type(err) in (TypeError, AttributeError) and "coroutine" in str(err)


def _sole_kind_leaf(err: BaseException) -> NereidError | None:
    """The first error of an exception group made only of nereid's errors (each sub-call's, with its status and
    both models' names); None for anything else."""
    if not isinstance(err, BaseExceptionGroup):
        return None
    leaves: list[BaseException] = []
    groups = [err]
    while groups and len(leaves) < 1024:  # (a bounded walk: groups nest)
        for inner in groups.pop().exceptions:
            (groups if isinstance(inner, BaseExceptionGroup) else leaves).append(inner)
    if groups or not leaves or not all(isinstance(leaf, NereidError) for leaf in leaves):
        return None
    return leaves[0]  # type: ignore[return-value]


def _being_cancelled() -> bool:
    """Whether the running task is being cancelled (or there is none): a CancelledError then is the request's
    end, not an orchestration's own."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array`` (no copy; ``array`` itself keeps its flags)."""
    view = array.view()
    view.flags.writeable = False
    return view


class _MisdirectedSubCall(ModelFailure):
    """An orchestration's sub-call that it got wrong: of a model its manifest's depends_on does not list, or asking
    the called model for outputs it does not have. Its model.py's line is added to the message."""


class _OutputsNotThere(_MisdirectedSubCall, InvalidArgument):
    """A sub-call asking the called model for outputs it does not have: the orchestration's mistake (INTERNAL once
    it escapes), still an InvalidArgument to the orchestration, as it was: one that catches that around its
    sub-calls catches it as before (the review hunt of 3df12bd)."""


@functools.lru_cache(maxsize=4096)
def _depends_on(path: str, text: str) -> tuple[str, ...]:
    """``depends_on`` of the manifest ``text`` read from ``path``, empty for a bundle's or one in error. Kept by its
    text: each meta model's load walks every manifest it reaches, and parsing is what costs (a file's read is a
    fraction of it), so a chain of N meta models parsed N**2 / 2 manifests as it loaded (400 took 96 s of CPU;
    the complexity hunt)."""
    try:
        manifest = parse_manifest_text(text, Path(path))
    except ConfigError:  # that model reports its own manifest's error when it loads
        return ()
    return manifest.depends_on if manifest.is_meta else ()


def _check_arity(model: str, model_py: Path, orchestrate: Callable[..., Any]) -> None:
    """Refuse at load an orchestration that cannot be called as ``fn(inputs, ctx)``."""
    try:
        inspect.signature(orchestrate).bind(None, None)
    except TypeError:
        raise ConfigError(f"model '{model}': {model_py}: orchestrate must take two arguments (inputs, ctx), "
                          f"got {getattr(orchestrate, '__name__', orchestrate)!r} with signature "
                          f"{inspect.signature(orchestrate)}") from None
    except ValueError:  # a builtin without a signature: found out at the first call instead
        pass


def _is_async_callable(function: Callable[..., Any]) -> bool:
    """Whether calling ``function`` makes a coroutine: an ``async def``, or an object whose ``__call__`` is one (run
    on a worker thread, its coroutine would never run, and every request fail)."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(type(function), "__call__", None))


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # retrieved, so asyncio does not log "exception never retrieved"


def contain_orchestration_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Install on ``loop``, once, a task factory under which a task an async orchestration starts (``asyncio.gather``
    of helpers, ``create_task``) cannot end the server, and ends with its orchestration.

    asyncio lets a ``SystemExit`` or ``KeyboardInterrupt`` out of a task's
    coroutine escape the event loop itself: a ``sys.exit()`` in a gathered
    helper stopped ``nereid serve`` without a word. Such a task's coroutine
    runs inside :func:`_contained`, which turns that (or a GeneratorExit, or a
    BaseException of the author's) into a ModelFailure of the meta model. One
    still running when its orchestration has ended is cancelled (see
    :meth:`_Orchestration.end`). Other tasks are made as before (one context
    variable read each).
    """
    previous = loop.get_task_factory()
    if getattr(previous, "contains_orchestrations", False):
        return

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future:
        orchestration = _ORCHESTRATING.get()
        inner = coro
        if orchestration is not None:
            coro = _contained(coro, orchestration.model)
        task = previous(loop, coro, **kwargs) if previous is not None else asyncio.Task(coro, loop=loop, **kwargs)
        if orchestration is not None:
            orchestration.tasks.add(task)
            task.add_done_callback(orchestration.tasks.discard)
            if inspect.iscoroutine(inner):
                # A task cancelled before its first step (the client left in the turn gather() made it) never
                # starts _contained, so the author's coroutine was dropped unstarted and Python logged "coroutine
                # 'MetaContext.infer' was never awaited", blaming a missing await that was not missing.
                task.add_done_callback(lambda _task: inner.close())
        return task
    factory.contains_orchestrations = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)


async def _contained(coro: Any, model: str) -> Any:
    """``await coro``, a task an orchestration of ``model`` started; what is no Exception comes out as one."""
    try:
        return await coro
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as err:
        raise ModelFailure(f"meta model '{model}': a task its orchestration started raised "
                           f"{describe_exception(err)}") from err
