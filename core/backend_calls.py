"""Calls into a backend that must not hold the server: on daemon threads, bounded, their failures logged.

A backend's ``load()``, ``unload()`` and ``terminate_running()`` are its own
code: they may block for long, never return, or raise anything. The server
runs them where neither its event loop nor its exit waits for them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Callable, TypeVar

from nereid.backend import Model, Terminable
from nereid.daemon_pool import start_daemon_thread
from nereid.errors import RaisedExit, calling_plugin, loop_safe_call
from nereid.model_building import LOAD_CALL

if TYPE_CHECKING:
    from nereid.model_building import BuildStage, BuiltVersion

log = logging.getLogger(__name__)

# The longest a backend's unload or terminate_running is waited for before it is abandoned.
BACKEND_CALL_WAIT_S = 30.0

T = TypeVar("T")


def on_daemon_thread(call: Callable[[], T], thread_name: str,
                      unclaimed: Callable[[T], None] | None = None) -> asyncio.Future:
    """Run ``call`` on a daemon thread; the returned future carries its result, or whatever it raised.

    Not asyncio's default executor: asyncio.run() and the interpreter both wait
    for its threads at exit (a 66 s load delayed SIGTERM by 71 s), and a call
    that never returns (a native library's nereid_unload) took one of its few
    threads for good, stalling every scan and large decode of the server. A
    result nobody takes any more (its caller cancelled the future, or the loop
    has closed) goes to ``unclaimed``, on the thread (or on a new one, when the
    future was cancelled between the call's end and the result's delivery).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def deliver(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            # Cancelled after the thread had looked (an unload giving up on a load that had just finished): the
            # result still goes to ``unclaimed``, on a thread of its own, as off the loop as the call was.
            if result is not None and unclaimed is not None:
                start_daemon_thread(unclaimed, thread_name, result)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = loop_safe_call(call)
        except BaseException as err:  # handed to the caller, whatever it is
            error = err
        if not future.cancelled():
            try:
                loop.call_soon_threadsafe(deliver, result, error)
                return
            except RuntimeError:  # the loop has closed: nobody waits any more
                pass
            finally:
                del error  # no traceback cycle through this frame
        if result is not None and unclaimed is not None:
            unclaimed(result)

    start_daemon_thread(run, thread_name)
    return future


LONG_LOAD_NOTE_S = 60.0  # a build running this long is said in the log, and again each as long


async def await_build(name: str, building: asyncio.Future, started: float,
                      running_long: Callable[[], None] | None = None,
                      stage: BuildStage | None = None) -> BuiltVersion:
    """Await ``building`` (a model's build on :func:`on_daemon_thread`); every LONG_LOAD_NOTE_S while it runs,
    say so in the log, naming the step ``stage`` says it is in (and call ``running_long`` the first time).

    A load that takes minutes (a large model compiling) or never returns was
    otherwise silent between "loading it" (dynamic mode) or nothing at all (a
    start) and its end. Awaited the way ``await building`` would be: this
    task's cancellation cancels the build too. Without ``stage``, the build is
    said to wait for its backend's load().
    """
    while True:
        try:
            done, _ = await asyncio.wait({building}, timeout=LONG_LOAD_NOTE_S)
        except asyncio.CancelledError:
            if not building.cancel() and not building.cancelled() and building.exception() is None:
                # Built already, its result delivered, this task not yet resumed: nobody takes the model now,
                # and what its load() acquired must not leak (a build still running goes to unload_unclaimed
                # by itself once cancelled).
                start_daemon_thread(unload_unclaimed, f"nereid-load-{name}", name, building.result())
            raise
        if done:
            return building.result()
        if running_long is not None:
            running_long()
            running_long = None
        # A plugin's claim hook or create() that hangs was said to be load(), which was never called.
        log.warning("model '%s' is still loading after %.0f s: %s has not returned (a RepositoryModelUnload of it "
                    "gives up on the load)", name, time.monotonic() - started,
                    stage.call() if stage is not None else LOAD_CALL)


def unload_unclaimed(name: str, built: BuiltVersion) -> None:
    """Unload a model whose load finished after its caller abandoned it: what its ``load()`` acquired must not leak."""
    log.info("model '%s': load finished after it was abandoned; unloading it", name)
    try:
        built.backend.unload()
    except Exception:
        log.exception("model '%s': unload after an abandoned load failed", name)
    finally:
        hold = getattr(built, "folder_hold", None)  # (a model from a store holds its version folder)
        if hold is not None:
            hold.release()


async def terminate_backend(name: str, backend: Model) -> None:
    """End ``backend``'s running executions if it can; a failure is logged naming the model, never raised.

    A grace has passed when this is called: a backend's bug (a wrong
    ``terminate_running`` signature, say) must not keep the model UNLOADING
    for ever, nor stop the server's shutdown before its models are unloaded.
    """
    if not isinstance(backend, Terminable):
        return
    try:
        await bounded_backend_call(name, "terminate_running", backend.terminate_running)
    except Exception:
        log.exception("model '%s': terminate_running failed; unloading it anyway", name)


async def unload_backend(name: str, backend: Model) -> None:
    """Call ``backend.unload()`` off the loop; a failure is logged naming the model, never raised."""
    try:
        await bounded_backend_call(name, "unload", backend.unload)
    except Exception:
        log.exception("model '%s': unload failed", name)


async def bounded_backend_call(name: str, what: str, call: Callable[[], object]) -> bool:
    """Run a backend's ``unload`` or ``terminate_running`` on a daemon thread, waiting at most
    :data:`BACKEND_CALL_WAIT_S`; one that does not return by then is abandoned (its thread runs on), logged,
    and False returned. What it raises is raised.
    """
    # sys.exit() in a backend's unload is no exit of the server's.
    guarded = functools.partial(calling_plugin, call, RaisedExit)
    done = on_daemon_thread(guarded, f"nereid-{what}-{name}")
    try:
        await asyncio.wait_for(asyncio.shield(done), BACKEND_CALL_WAIT_S)
    except TimeoutError:
        log.error("model '%s': %s did not return within %g s; abandoning it (its thread runs on)", name, what,
                  BACKEND_CALL_WAIT_S)
        return False
    return True
