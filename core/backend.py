"""What a backend is once it has claimed a model folder: plain typed objects.

The plugin hook (:mod:`nereid.hookspecs`) is only how a backend *claims* a
folder. The claim carries a factory; the core calls it once per load and from
then on talks to the returned :class:`Model` directly.
"""

from __future__ import annotations

import logging
import numbers
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Protocol, runtime_checkable

from nereid.errors import ConfigError, NereidError, describe_exception
from nereid.settings import DEFAULT_CONFIG_NAME, DEFAULT_TIMEOUT_S, INT32_MAX, Device, ModelSettings
from nereid.signature import ModelSignature, brief_repr
from nereid.tensors import InferRequest, InferResponse, NamedTensor

# The deadline (``time.monotonic_ns()``; 0: none) of the request an execution serves; for a batch,
# the earliest in it. The scheduler sets it around each execution, so a coroutine ``infer`` (which
# runs in the execution's own task) sees it; a thread-run ``infer`` does not. Meta models read it to
# bound their sub-calls.
REQUEST_DEADLINE_NS: ContextVar[int] = ContextVar("nereid_request_deadline_ns", default=0)


class ModelCaller(Protocol):
    """How a model calls another model of the same server (the server's data plane).

    A call is an ordinary request: it is validated, queued and batched with the
    target model's other traffic, counted in its statistics, and refused
    without running once ``request.deadline_ns`` has passed. Errors are the
    :mod:`nereid.errors` exceptions a client would get as a status.
    """

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run one request on the event loop; every call gets exactly one answer."""


@dataclass(frozen=True)
class ModelContext:
    """Everything a backend needs to build one model.

    ``scratch_dir`` is a private, server-owned folder for temporary files
    (emptied and removed when the server stops). ``runs_dir`` is where a
    backend that runs a program per request makes each run's own folder (its
    TMPDIR): the server's, shared by its models, a short path that does not
    name the model (see :mod:`nereid.run_folders`); None: ``scratch_dir``.
    ``settings_origin`` says where ``settings`` came from (``"<file>: models[2]"``), for error messages about
    backend-specific ``runtime`` options. ``models`` calls the server's other
    models (None where there is no server, as in ``nereid check``).
    ``folder`` is what the model loads and runs from: for a repository in
    object storage, a version folder of its own (``repository_folder`` is then
    the model's folder in the local mirror, beside the other models').
    """

    name: str
    folder: Path
    settings: ModelSettings
    scratch_dir: Path
    settings_origin: str = ""
    models: ModelCaller | None = None
    # The model's folder in the repository, where ``folder`` is a copy of it of this version's own (a model
    # fetched from an object store runs from a version folder no later fetch changes); None: ``folder`` is it.
    repository_folder: Path | None = None
    # What folder_rewritten() tells (the repository's loader: the version's stamp of its files); None: nobody
    # keeps one (a model from a bucket, or built outside a repository).
    on_folder_rewritten: Callable[[frozenset[str]], None] | None = None
    # Where each run's folder is made (a short path: AF_UNIX sockets under a run's TMPDIR must fit); None:
    # scratch_dir (a context made outside a server).
    runs_dir: Path | None = None
    # The configuration file the server was started with, as messages name it in words ("set backend: in
    # prod.yaml"): its base name (see Settings.config_name), as the core's own messages say it.
    config_name: str = DEFAULT_CONFIG_NAME
    # Set when the server gives up on this load while create() or load() still run (an unload or removal of the
    # model came, or the server stops): a long build may stop early (the cpp and cxx backends kill their
    # compilers), since what it builds is unloaded at once if it ever returns.
    abandoned: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

    @property
    def device(self) -> Device:
        """The device nereid.yaml assigned to the model."""
        return self.settings.device

    def warn_timeout_ignored(self, why: str) -> None:
        """Log, from a backend that cannot stop a run at ``timeout_s``, that the one nereid.yaml gives this model
        does not apply (``why``); nothing for the default, which every entry has."""
        timeout_s = self.settings.timeout_s
        if timeout_s != DEFAULT_TIMEOUT_S:
            logging.getLogger("nereid.backend").warning(
                "model '%s': timeout_s: %s does not apply: %s", self.name,
                "null" if timeout_s is None else f"{timeout_s:g}", why)

    def folder_rewritten(self, names: Iterable[str]) -> None:
        """Say, from ``load()``, that it has just rewritten (or removed) the files ``names`` of ``folder`` itself
        (paths relative to it: a weights migration's): in dynamic mode those files as they are now are then part
        of what this version loaded, and the watcher, seeing the writes, does not load the model a second time.
        Call it after the last write. Any other file changed meanwhile (an operator's edit during the load)
        is still a change to load."""
        if self.on_folder_rewritten is not None:
            self.on_folder_rewritten(frozenset(names))


@runtime_checkable
class Model(Protocol):
    """One loaded model, as the core sees it.

    A plain ``infer`` is called on worker threads. A model that only awaits
    other work (the meta backend awaits the models it calls) may define
    ``async def infer`` instead: it then runs on the server's event loop and
    must never block it.

    ``infer`` receives inputs in the signature's order, each with its batch axis
    when the signature batches, and returns the declared outputs (all of them,
    in order, each with the same batch size). Raise
    :class:`~nereid.errors.ModelFailure` with a reason for a model fault; any
    other exception is reported as an internal error of the model too.
    ``infer`` is called by at most ``instances`` threads at once.
    """

    platform: str

    def load(self) -> None:
        """Prepare the model (compile, read weights); raise with a reason to refuse it."""

    def signature(self) -> ModelSignature:
        """The tensors the model takes and returns (valid after ``load``)."""

    def infer(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        """Run one batch."""

    def unload(self) -> None:
        """Release everything ``load`` acquired; called once no request is running."""


def missing_model_parts(model: object) -> list[str]:
    """What ``model`` lacks of the :class:`Model` protocol: ``"infer()"`` for a method, ``"platform (a str)"``.

    ``isinstance(model, Model)`` says only yes or no; the core checks once, when
    a model is created, and names what is missing, rather than fail later at
    the first request (or the first ModelMetadata) that needs it.
    """
    missing = []
    for name in Model.__annotations__:
        value, failure = _read_member(model, name)
        if not isinstance(value, str):
            missing.append(f"{name} (a str{failure})")
    for name, member in vars(Model).items():
        if callable(member) and not name.startswith("_"):
            value, failure = _read_member(model, name)
            if not callable(value):
                missing.append(f"{name}(){failure}")
    return missing


def _read_member(model: object, name: str) -> tuple[object, str]:
    """``model.name`` (None when it has none) and, where reading it raised (a property), what it raised for the
    reason: the bare message was the model's reason, naming neither the member nor the plugin."""
    try:
        return getattr(model, name, None), ""
    except Exception as err:
        return None, f"; reading it raised {describe_exception(err, one_line=True)}"


# Optional capabilities: small Protocols that a backend's model object may also
# satisfy. Each is checked once, with isinstance, when the model loads; simple
# backends need none of them.


@runtime_checkable
class UsesNoDevice(Protocol):
    """A model that runs nothing on a device of its own (a meta model orchestrates others from the event loop):
    nereid.yaml's ``device:`` does not apply to it, and it is reported on the CPU."""

    def uses_no_device(self) -> bool:
        """True for such a model; asked once, after ``load()`` (raising, or answering other than a bool, fails the
        load), for what ModelConfig's instance group and ``nereid check`` report."""


def reported_device(assigned: Device, uses_device: bool) -> Device:
    """The device a loaded model runs on, as ModelConfig and ``nereid check`` report it: the one nereid.yaml
    ``assigned``, but the CPU for a model that uses none (see :class:`UsesNoDevice`, asked once at load)."""
    return assigned if uses_device else Device("cpu")


@runtime_checkable
class HasBatchSignature(Protocol):
    """A model whose ``infer`` takes and returns other tensors than its clients send and get."""

    def batch_signature(self) -> ModelSignature:
        """What ``infer`` takes and returns (a bundle whose model.py transforms its I/O)."""


@runtime_checkable
class PadsBatches(Protocol):
    """A model that runs only at a few fixed batch sizes, padding a batch up to the next one."""

    def padded_rows(self, rows: int) -> int:
        """The rows a batch of ``rows`` runs at (``rows`` itself when it runs as it is).

        When the scheduler coalesces several requests, it assembles them straight
        into a zero-padded buffer of that many rows (one copy, not a concatenation
        and then a pad), and keeps the first ``rows`` rows of each output."""


@runtime_checkable
class ChecksInputs(Protocol):
    """A model with a rule on its inputs that its signature cannot state (a bundle compiled for a few sizes of its
    variable axes)."""

    def input_check(self) -> Callable[[list[NamedTensor]], object] | None:
        """Asked once, when the model loads: what checks each request's inputs before it is queued, raising
        InvalidArgument (naming the model, the tensor and what was expected), or None when the signature says
        it all. It runs on the event loop after validation (for a model with a preprocess hook, on the hook's
        result), so it must be cheap."""


@runtime_checkable
class Preprocesses(Protocol):
    """A model with a per-request hook before queueing. Read once, after ``load()``: a model whose hook is
    ``None`` then (a bundle whose model.py registered none) has no such step. The same holds for postprocess."""

    def preprocess(self, inputs: list[NamedTensor]) -> list[NamedTensor]:
        """Runs on a worker thread for each request, after validation against ``signature()`` and
        before the request is queued; returns tensors in ``batch_signature()`` order and form.
        Hooks of different requests overlap."""


@runtime_checkable
class Postprocesses(Protocol):
    """A model with a per-request hook on its own rows of the batch result."""

    def postprocess(self, outputs: list[NamedTensor]) -> list[NamedTensor]:
        """Runs on a worker thread on each request's own rows; returns the client-facing outputs."""


@runtime_checkable
class Terminable(Protocol):
    """A model whose running executions can be ended from outside."""

    def terminate_running(self) -> None:
        """Called when the server stops, or a version is retired, and the grace has passed while
        executions still run: end them now (the subprocess backends kill their children's process
        groups), so that shutdown stays bounded."""


@runtime_checkable
class ReturnsFreshOutputs(Protocol):
    """A model whose ``infer`` returns arrays of its own each call, which nothing writes to afterwards (read from a
    run's output file, made by the call, a compiled program's results).

    nereid reads a batch's outputs after ``infer`` has returned (answers are
    encoded on the event loop, large ones on worker threads), when the model's
    next batch may be running. So the outputs of any other model are copied as
    ``infer`` returns them, on its worker thread: a model that filled one
    preallocated buffer per call gave clients the rows of later requests, 200
    OK, and one returning a ``np.memmap`` of a file it rewrites killed the
    server (SIGBUS) (the outputs hunt).
    """

    def returns_fresh_outputs(self) -> bool:
        """True for such a model (its outputs are used as they are); asked once, after ``load()`` (raising, or
        answering other than a bool, fails the load)."""


@runtime_checkable
class BoundsItsRuns(Protocol):
    """A model that ends each of its executions itself within a bound (a subprocess model's ``timeout_s``)."""

    def longest_run_s(self) -> float | None:
        """The longest one execution may run before the model ends it; None: no bound."""


@dataclass(frozen=True)
class RuntimeReport:
    """How a backend runs one model, beyond its signature (``nereid check`` and ``/metrics`` show it).

    ``summary`` is one ``key=value`` phrase for the check line (``warm_start=on``);
    ``warm_parent_resident_bytes`` is the memory of a process kept warm between
    requests (None: there is none); ``warm_start`` says whether the model's runs
    start warm now (True), or each starts cold, from a fresh process (False), for a
    backend that has both ways (None: it has not).
    """

    summary: str = ""
    warm_parent_resident_bytes: int | None = None
    warm_start: bool | None = None


def runtime_report_problem(report: object, *, with_summary: bool = False) -> str | None:
    """Why ``report``, what a model's ``runtime_report()`` returned, cannot be used; None when it can.

    It must be a :class:`RuntimeReport` whose ``warm_parent_resident_bytes`` is None or a
    whole number of bytes >= 0 (a bool is not one), and whose ``warm_start`` is None or a bool.
    ``with_summary``: its ``summary`` is shown too (``nereid check``), so that must be a str. A plugin builds the
    report, so nothing in it is trusted: a forgotten ``return`` (None) or a "lots" crashed ``nereid check`` and
    failed every ``/metrics`` scrape.
    """
    if not isinstance(report, RuntimeReport):
        return f"returned {_type_name(report)}, expected a nereid RuntimeReport"
    resident = report.warm_parent_resident_bytes
    if resident is not None and (not isinstance(resident, numbers.Integral) or isinstance(resident, bool)
                                 or resident < 0):
        return (f"its warm_parent_resident_bytes is {brief_repr(resident)} ({_type_name(resident)}), "
                "expected an int >= 0 or None")
    if report.warm_start is not None and not isinstance(report.warm_start, bool):
        return (f"its warm_start is {brief_repr(report.warm_start)} ({_type_name(report.warm_start)}), "
                "expected a bool or None")
    if with_summary and not isinstance(report.summary, str):
        return f"its summary is {brief_repr(report.summary)} ({_type_name(report.summary)}), expected a str"
    return None


def _type_name(value: object) -> str:
    """``value``'s type as a plugin's author would look it up: a builtin's bare name (``NoneType``), else with
    its module (a plugin's own class named ``RuntimeReport`` must not read as nereid's)."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


@runtime_checkable
class ReportsRuntime(Protocol):
    """Optional: a model that describes how it runs (checked once with ``isinstance``)."""

    def runtime_report(self) -> RuntimeReport:
        """The current report; cheap enough to call at every metrics scrape."""


@runtime_checkable
class Relocatable(Protocol):
    """Optional: a loaded model that can follow its folder to a new name without loading again.

    Called when a folder is renamed (or copied, then the original deleted) with
    its files unchanged, after the new folder exists. Keep what was compiled
    and read; serve from ``context`` (the new name, folder and settings) from
    now on. Raise to refuse: the model is then loaded anew under the new name.
    """

    def relocate(self, context: ModelContext) -> None:
        """Take the new name and folder."""


@runtime_checkable
class CallsModels(Protocol):
    """Optional: a model that calls other models of the server (a meta model; checked once at load).

    The repository keeps it READY only while every model of ``dependencies()``
    is READY (with the reason otherwise). The scheduler runs each of its
    requests as an execution of its own, never batched with others (each
    carries its own deadline and gets its own errors), and up to
    ``concurrent_executions()`` at once instead of ``instances``: such an
    execution mostly waits on other models' queues.
    """

    def dependencies(self) -> tuple[str, ...]:
        """The names of the models it may call (valid after ``load``)."""

    def concurrent_executions(self) -> int:
        """How many of its executions may run at once."""


def what_it_calls(name: str, model: CallsModels) -> tuple[int, tuple[str, ...]]:
    """Model ``name``'s ``concurrent_executions()`` and ``dependencies()``, checked (ConfigError naming the
    method and what it returned): the server and ``nereid check`` ask them alike. A string of names was taken letter by
    letter, None as no dependency at all, and a count of 0 failed as a bare TypeError."""
    executions = _asked(name, "concurrent_executions", model.concurrent_executions)
    if (isinstance(executions, bool) or not isinstance(executions, int) or executions < 1
            or executions > INT32_MAX):  # (ModelConfig's instance_group count, an int32: past it, gRPC's failed)
        raise ConfigError(f"model '{name}': its backend's concurrent_executions() returned {str(executions)[:64]!r} "
                          f"({type(executions).__name__}), expected an int from 1 to {INT32_MAX}")
    names = _asked(name, "dependencies", model.dependencies)
    if isinstance(names, (str, bytes)) or not isinstance(names, (tuple, list)) or \
            not all(isinstance(called, str) for called in names):
        raise ConfigError(f"model '{name}': its backend's dependencies() returned {str(names)[:200]!r} "
                          f"({type(names).__name__}), expected a tuple of model names")
    return executions, tuple(names)


def _asked(name: str, method: str, call: Callable[[], object]) -> object:
    """``call()``, a model object's ``method``; what it raises, but a nereid error (a refusal with its reason), as a
    ConfigError naming the model, the method and the exception (the bare "'weights'" of a KeyError was the
    model's whole reason: the README walkthrough)."""
    try:
        return call()
    except NereidError:
        raise
    except Exception as err:
        raise ConfigError(f"model '{name}': its backend's {method}() raised {describe_exception(err, one_line=True)}"
                          ) from err


@dataclass(frozen=True)
class BackendClaim:
    """A backend's answer to "is this folder yours?": ``create`` builds the (not yet loaded) model.

    The backend's name (what ``backend:`` in nereid.yaml selects) is the name
    its plugin was registered under, never something a claim says.
    """

    create: Callable[[ModelContext], Model]
