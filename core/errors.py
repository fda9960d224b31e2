"""Protocol-neutral errors. Each protocol edge maps them to its status codes once."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class NereidError(Exception):
    """Base of every error nereid reports to a client; ``str(err)`` is the message.

    ``reason`` is a short label for metrics (``nereid_request_failure_total``).
    """

    reason = "internal"


class NotFound(NereidError):
    """An unknown model (gRPC NOT_FOUND)."""

    reason = "not_found"


class InvalidArgument(NereidError):
    """A request that does not match the model's contract (gRPC INVALID_ARGUMENT)."""

    reason = "invalid_argument"


class OutputsRefused(InvalidArgument):
    """A request's requested outputs that its model does not have, or that it asks for twice (gRPC
    INVALID_ARGUMENT). Of its own kind because a meta model's sub-call refused so is its orchestration's mistake
    (it alone chose those names), not its client's."""


class Unavailable(NereidError):
    """A model that is not ready, a full queue, a server shutting down (gRPC UNAVAILABLE)."""

    reason = "unavailable"


class RunNotStarted(Unavailable):
    """A backend's run that a limit of the server's process kept from starting (out of descriptors, processes or
    memory): none of the model's code ran, so no execution is counted, and the batch is not sent again (the limit
    is likely still there): UNAVAILABLE, try again later."""


class OutOfMemory(Unavailable):
    """The server ran out of memory reading or decoding a request (or answering one): UNAVAILABLE (HTTP 503), as
    other passing conditions of the server are. Counted as a server-side failure (``internal``, as a model fault
    is), not as the client's ``invalid_argument``: the same request may well succeed later."""

    reason = "internal"


class ModelRetired(Unavailable):
    """A model version that no longer takes requests refused one at admission (it is being unloaded or replaced).

    ``scheduler`` is the refusing version's scheduler: the data plane resends
    a request refused by the very version it had chosen, once, to the version
    now serving. A copy of this error made elsewhere (a meta model passing on
    a sub-call's error) carries the sub-model's scheduler, never the one the
    data plane chose, so nothing that already ran is run again.
    """

    def __init__(self, message: str, scheduler: object = None, handed_over: bool = False) -> None:
        super().__init__(message)
        self.scheduler = scheduler
        self.handed_over = handed_over  # taken from the queue at a reload's swap: a request accepted already


class QueueFull(Unavailable):
    """A request refused because the model's queue is at capacity (gRPC UNAVAILABLE)."""

    reason = "queue_full"


class DeadlineExceeded(NereidError):
    """A request whose deadline passed before it could start (gRPC DEADLINE_EXCEEDED)."""

    reason = "deadline_exceeded"


class ModelFailure(NereidError):
    """The model failed while running a request (gRPC INTERNAL)."""

    reason = "internal"


class ModelTimedOut(ModelFailure):
    """The model ran past its time limit (``timeout_s``) and was stopped (gRPC INTERNAL, like any fault)."""

    reason = "timed_out"


class ModelKilled(ModelFailure):
    """The model's process (or a python model's warm parent) died from a signal while running a request: the
    kernel's OOM killer (SIGKILL), a crash (SIGSEGV, SIGABRT) (gRPC INTERNAL)."""

    reason = "killed"


class NotStarted(ModelFailure):
    """A backend's execution that ended before any of the model's code ran for it, so that it may be given to the
    backend once more: a python model's warm parent died before it forked the run (a new one started since).

    The scheduler sends the batch again, once, as it starts a batch taken from
    the queue: less its requests whose deadline has passed by then (answered
    DEADLINE_EXCEEDED, never run) and those whose caller has gone. A second one
    fails the batch with ``failure``, the backend's word for what happened.
    """

    def __init__(self, failure: ModelFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


class LoggedModelFailure(ModelFailure):
    """A model fault already logged where it happened (with its traceback): the scheduler does not log it again.

    A meta model passing on a sub-model's failure raises one, so that one fault is one line in the server log.
    """


class PermissionDenied(NereidError):
    """An RPC this server is configured to refuse (gRPC PERMISSION_DENIED)."""

    reason = "permission_denied"


class Unimplemented(NereidError):
    """A Triton protocol extension nereid does not implement (gRPC UNIMPLEMENTED, HTTP 501)."""

    reason = "unimplemented"


class ConfigError(NereidError):
    """A mistake in nereid.yaml or a model folder, raised at load or check time."""

    reason = "invalid_config"


class MissingModelFile(ConfigError):
    """A model folder lacks a file its backend requires (``missing main.py in ...``).

    Told apart from other ConfigErrors so that the load adds what the folder looks like (a Triton model folder, see
    :mod:`nereid.triton_hints`) to this reason alone: that explains a missing file, not a driver the device lacks.
    """


def same_kind(error: NereidError, message: str) -> NereidError:
    """A new error of ``error``'s type (so its status stays the same) carrying ``message``.

    For passing an error on with more context (the model that met it). It is
    made without calling the type's constructor, which a plugin's subclass may
    give another meaning (``Busy(seconds)`` would take the message for its
    seconds), and keeps the error's attributes; a subclass whose ``str`` is not
    its message keeps its status family at least.
    """
    kind = type(error)
    try:
        named = kind.__new__(kind)
        named.__dict__.update(getattr(error, "__dict__", {}))
        for slot in _slots(kind):
            if hasattr(error, slot):
                setattr(named, slot, getattr(error, slot))
        named.args = (message,)
        if str(named) == message:
            return named
    except Exception:  # (a subclass that cannot be made so, or whose str fails)
        pass
    # Its str is not its message (a __str__ of its own): the nearest of nereid's own classes it derives from,
    # so that its status (INVALID_ARGUMENT, NOT_FOUND, ...) is kept.
    for base in kind.__mro__:
        if issubclass(base, NereidError) and base is not NereidError and base.__module__ == __name__:
            try:
                family = base(message)
            except Exception:
                continue
            if str(family) == message:
                return family
    return ModelFailure(message)


def naming_model(model: str, error: NereidError) -> NereidError:
    """``error`` when its message says ``model 'NAME'`` (``meta model 'NAME': ...`` too); otherwise its
    :func:`same_kind` copy with ``model 'NAME': `` in front: every message a client or the log gets names the
    model, a plugin's own words (``ModelFailure("weights are cursed")``) included."""
    if f"model '{model}'" in str(error):
        return error
    return same_kind(error, f"model '{model}': {error}")


def without_model_name(model: str, message: str) -> str:
    """``message`` without the leading ``model 'NAME': `` (or ``model 'NAME' ``) that :func:`naming_model` puts
    in front: for a message that names the model itself around it."""
    return message.removeprefix(f"model '{model}': ").removeprefix(f"model '{model}' ")


def _slots(kind: type) -> list[str]:
    """The ``__slots__`` names declared along ``kind``'s classes."""
    names: list[str] = []
    for cls in kind.__mro__:
        declared = cls.__dict__.get("__slots__", ())
        names.extend([declared] if isinstance(declared, str) else declared)
    return [name for name in names if name not in ("__dict__", "__weakref__")]


# What any message built from untrusted input (a client's names, a file's contents, a
# parser's reason) may grow to before it is cut: it goes into logs, RepositoryIndex
# and gRPC trailers (whose metadata limit is 16 KiB).
MESSAGE_LIMIT = 4096


def cap_message(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` cut to ``limit`` characters in its middle, saying how much was cut when it was.

    Its end is kept as well as its start: that is where a message names what
    was expected, and where a chain of causes (a meta model's sub-call, that
    model's own sub-call, ...) names the first.
    """
    if len(text) <= limit:
        return text
    room = max(limit - 64, 0)  # room for the note, so the result stays within ``limit``
    tail = min(room // 4, 1024)
    head = room - tail
    return f"{text[:head]} ... [{len(text) - head - tail} characters cut] ... {text[len(text) - tail:]}"


# What plugin code may raise that is no Exception yet is never meant for this process.
_FOREIGN_EXITS_ON_MAIN = (Exception, SystemExit, GeneratorExit, asyncio.CancelledError)


def plugin_failures() -> tuple[type[BaseException], ...]:
    """The exceptions to catch as a plugin's (or a model's) failure around a call of its code.

    ``sys.exit()`` in a claim hook, an import or a ``load()`` is the plugin's
    fault, not a request to end the server or ``nereid check``; so is a
    CancelledError or GeneratorExit of its own. A KeyboardInterrupt is too,
    except on the main thread, where Ctrl-C delivers a real one (``nereid
    check`` loads models there).
    """
    if threading.current_thread() is threading.main_thread():
        return _FOREIGN_EXITS_ON_MAIN
    return (BaseException,)


def calling_plugin(call: Callable[[], T], failure: Callable[[BaseException], Exception],
                   also: tuple[type[BaseException], ...] = ()) -> T:
    """``call()``, plugin or model code: an exit it raises that :func:`plugin_failures` (or ``also``) takes for
    its failure (``sys.exit()``, ...) comes out as the Exception ``failure(exit)``, never as a request to end the
    process."""
    try:
        return call()
    except (*plugin_failures(), *also) as err:
        if isinstance(err, Exception):
            raise
        raise failure(err) from None


class RaisedExit(RuntimeError):
    """What plugin or model code raised that is no Exception (a ``sys.exit()`` in an ``unload()``), carried as one;
    :func:`describe_exception` says it as what was raised (``SystemExit: 3``), not as a RuntimeError."""

    def __init__(self, exit_: BaseException) -> None:
        super().__init__(describe_exception(exit_))
        self.exit = exit_


def backend_exit(model: str, exit_: BaseException, during: str) -> ConfigError:
    """The load failure of ``model`` whose backend raised ``exit_`` (a ``sys.exit()``, ...) ``during`` (``loading
    it``): said as such, since it is no reason a backend gave."""
    return ConfigError(f"model '{model}': its backend raised {describe_exception(exit_)} {during} (a backend refuses "
                       "a model by raising an Exception with the reason)")


def loop_safe_call(function: Callable[..., T], *args: Any) -> T:
    """Call ``function`` (a model's code, on a worker thread) so that what it raises reaches the event loop
    intact: a StopIteration or GeneratorExit comes out as a RuntimeError chained to it.

    An asyncio future cannot carry a StopIteration (``set_exception`` raises
    TypeError on the loop), so a stray ``next()`` in a plugin or a ``model.py``
    left its caller waiting for ever and its execution slot taken; generators
    do the same since PEP 479. A GeneratorExit can be carried, but thrown into
    the awaiting coroutines it closes each inner one with a bare
    ``GeneratorExit()`` first, so the model's message (and line) was lost.
    """
    try:
        return function(*args)
    except (StopIteration, GeneratorExit) as err:
        raise RuntimeError(f"{type(err).__name__} raised{f': {err}' if str(err) else ''}") from err


def describe_exception(error: BaseException, one_line: bool = False) -> str:
    """``Type: message``, or ``Type`` alone when the message is empty (``KeyboardInterrupt()``).

    ``one_line``: the message's runs of whitespace, newlines included, as single
    spaces (a plugin's exception may span lines).
    """
    if isinstance(error, RaisedExit):
        error = error.exit
    text = " ".join(str(error).split()) if one_line else str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class PublicText(str):
    """A message already fit for clients: ``ModelRepository.public_text`` leaves it as it is.

    For messages made only of what the client sent (a model name) and
    server-relative text: scrubbing paths in them rewrote the client's own
    name, so that a name starting with ml_backends_path answered for another,
    existing model, and a client could tell which absolute paths are real.
    """

    __slots__ = ()

    def __str__(self) -> str:
        return self  # str(err) keeps the mark (str() of a str subclass otherwise makes a plain copy)

    def plain(self) -> str:
        """The text as a plain ``str`` (gRPC takes no subclass)."""
        return str.__str__(self)

    @classmethod
    def mark(cls, error: BaseException) -> None:
        """Mark ``error``'s message (in place) as made only of what the client sent and fixed server text.

        For a boundary that every error it passes was built from the request
        alone (a codec's decode, whose helpers live in modules of their own):
        its traceback and type stay as raised. An error whose ``str`` is not
        its message (a ``__str__`` of its own) keeps an unmarked ``str``, so it
        is still scrubbed.
        """
        error.args = (cls(str(error)),)


# How many characters of a name the client sent (a load parameter's, a repository's) a refusal quotes.
SHOWN_NAME_CHARS = 64


def shown_name(name: str) -> str:
    """A name the client sent, as a refusal quotes it: as sent, up to its first SHOWN_NAME_CHARS characters.

    (``cap_message(name, 64)`` quoted none of a longer name: the note of how much was cut takes 64 of its limit.)
    """
    if len(name) <= SHOWN_NAME_CHARS:
        return repr(name)
    return f"{name[:SHOWN_NAME_CHARS]!r} ({len(name) - SHOWN_NAME_CHARS} more characters cut)"
