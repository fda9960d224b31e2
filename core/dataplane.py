"""The protocol-neutral data plane shared by every protocol surface.

It answers liveness, readiness, metadata, configuration, statistics and index
questions, loads and unloads models, and runs inference: validate against the
signature, queue on the model's scheduler, select the requested outputs.
Protocol modules (gRPC, HTTP) only translate messages to and from it and map
its errors to their status codes.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import re
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Coroutine, Iterable, NoReturn, TypeVar

from nereid import __version__
from nereid.classification import check_classifiable, classify
from nereid.daemon_pool import on_work_thread_or_here
from nereid.errors import (DeadlineExceeded, InvalidArgument, ModelFailure, ModelRetired, NereidError, NotFound,
                           OutputsRefused, PermissionDenied, PublicText, Unavailable, Unimplemented,
                           describe_exception, shown_name)
from nereid.model_entry import FOUND_AFTER_START_REASON, LoadedVersion, ModelState, not_listed_reason
from nereid.model_info import (MODEL_VERSION, IndexEntry, ModelConfig, ModelMetadata, describe_config,
                               describe_metadata)
from nereid.repository import ModelRepository
from nereid.scheduler import REQUEST_STARTED, ModelScheduler, QueueRefusal
from nereid.stats import ModelStats, RequestTiming
from nereid.settings import Settings
from nereid.signature import ModelSignature, duplicated, validate_inputs
from nereid.tensors import InferRequest, InferResponse, NamedTensor

log = logging.getLogger(__name__)

SERVER_NAME = "nereid"

# Triton protocol extensions nereid implements (ServerMetadata lists them).
# The most output elements classified on the event loop; more are classified on a worker thread (see _classified).
CLASSIFY_ON_LOOP_ELEMENTS = 1 << 16
EXTENSIONS: tuple[str, ...] = ("binary_tensor_data", "classification", "model_repository",
                               "model_repository(unload_dependents)", "model_configuration", "statistics")


# The failure label of a request whose client cancelled it (Triton's CANCELED failure reason).
CANCELLED = "cancelled"
# A gRPC client cancels its call at its own deadline, whose clock started before the server's did (by the
# request's transit and decoding, milliseconds on a loaded machine): a cancel this close to the request's
# deadline is that deadline passing.
CLIENT_DEADLINE_SLACK_NS = 50_000_000


# What infer_encoded makes of an answer: its wire form (JSON and binary parts, a protobuf message, ...).
Encoded = TypeVar("Encoded")
T = TypeVar("T")


def _as_is(response: InferResponse) -> InferResponse:
    return response


def past_grace_message(model: str) -> PublicText:
    """The answer of a request still running when ``shutdown_grace_s`` has passed, over either protocol (the
    model's name as the client sent it): called in the request's task, once it was cancelled. It says whether
    the model may have run it, so that a client knows whether it is safe to send it again."""
    if not REQUEST_STARTED.get():
        return PublicText(f"model '{model}': the server is shutting down, and shutdown_grace_s passed before the "
                          "request could start; it was not run: send it again to another server")
    return PublicText(f"model '{model}': the server is shutting down, and shutdown_grace_s passed before the "
                      "request finished; its answer is lost")


def cancellation_reason(deadline_ns: int, now_ns: int) -> str:
    """The failure a request ended by cancellation counts as: ``deadline_exceeded`` when its deadline
    (0: none) has passed or is within :data:`CLIENT_DEADLINE_SLACK_NS`, ``cancelled`` otherwise."""
    if deadline_ns != 0 and now_ns >= deadline_ns - CLIENT_DEADLINE_SLACK_NS:
        return DeadlineExceeded.reason
    return CANCELLED


# std::stol's reading: leading white space, a sign, the digits; whatever follows them is ignored.
_LEADING_NUMBER = re.compile(r"[ \t\n\v\f\r]*([+-]?)0*([0-9]+)")
_LONG_MAX = 2**63 - 1


def version_number(name: str, version: str) -> int:
    """A model version as Triton reads one (its std::stol: "01", "+1" and "1abc" are version 1); InvalidArgument
    for a string with no leading number or one out of a long's range, and for a negative one, as Triton answers.
    ``name`` empty: the version asked of every model (ModelStatistics)."""
    number = _LEADING_NUMBER.match(version)
    # (Past 19 digits no long holds it; and int() of thousands of digits would raise.)
    value = None if number is None or len(number.group(2)) > 19 else int(number.group(1) + number.group(2))
    subject = f"model '{name}'" if name else "statistics of every model"
    if value is None or not -_LONG_MAX - 1 <= value <= _LONG_MAX:
        raise InvalidArgument(PublicText(f"{subject}: cannot read version '{version}' as a number (a version "
                                         "is an integer > 0)"))
    if value < 0:
        raise InvalidArgument(PublicText(f"{subject}: invalid version '{version}' (a version is an "
                                         "integer > 0)"))
    return value


def _encodable(text: str) -> str:
    """``text`` with each lone surrogate written as its escape (``\\udce9``), which every protocol can encode.

    Model code makes them: a client's bytes or a file name decoded with ``surrogateescape``. gRPC could not
    encode such a status message: the call went unanswered until the client's deadline, and a stream answered
    no request after it.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


@dataclass(frozen=True)
class _LoadOutcome:
    """How one client's load ended, read from its model's entry as it ended."""

    state: ModelState
    reason: str
    store_fault: bool
    waiting_on_dependencies: bool
    abandoned: str  # why an unload gave up on it ("" if none did)


class DataPlane:
    """Inference, introspection and repository control over a :class:`ModelRepository`.

    ``repository_control`` False refuses load and unload (PermissionDenied);
    ``on_repository_change`` is awaited after each, and after a repository
    index whose rescan changed readiness (the server updates its health
    service there; the repository also reports changes as they happen).
    """

    def __init__(self, repository: ModelRepository, settings: Settings, *, repository_control: bool = True,
                 on_repository_change: Callable[[], Awaitable[None]] | None = None) -> None:
        self.repository = repository
        self.settings = settings
        self.shutting_down = False
        # Set by the server when a stop was asked for with a shutdown_delay_s: not ready from then on (so that
        # load balancers stop sending clients), while every request is still served, until the drain starts.
        self.leaving = False
        # Set by the server once shutdown_grace_s has passed: a request cancelled from then on was ended by the
        # server (answered UNAVAILABLE), not by its client, and is counted so.
        self.grace_passed = False
        self.repository_control = repository_control
        self._on_change = on_repository_change

    def live(self) -> bool:
        """The server process is up and answering."""
        return True

    def ready(self) -> bool:
        """Ready to serve: not shutting down (nor about to) and, under strict readiness, every exposed model
        READY."""
        if self.shutting_down or self.leaving:
            return False
        return self.repository.server_ready() if self.settings.server.strict_readiness else True

    def admit(self, model_name: str) -> None:
        """Refuse a client's new request once the server is shutting down (accepted ones still drain).

        The protocols call it as a request arrives, never for a meta model's
        sub-calls: those belong to a request already accepted.
        """
        if self.shutting_down:  # (the name as sent: the model is not looked up yet)
            raise Unavailable(PublicText(f"model '{model_name}': the server is shutting down; the request was not "
                                         "run"))

    def error_text(self, err: BaseException, where: str = "") -> str:
        """What a client is told of ``err``: a NereidError's message, anything else as an internal error (of
        ``where``, if given); the server's paths relative, capped (see ModelRepository.public_text)."""
        if isinstance(err, NereidError):
            return _encodable(self.repository.public_text(str(err)))
        return _encodable(self.repository.public_text(f"internal error{f' in {where}' if where else ''}: "
                                                      f"{describe_exception(err)}"))

    def refused(self, model_name: str, error: NereidError) -> None:
        """Count against its model a request its protocol refused before :meth:`infer` (unreadable, ...)."""
        self.count_failure(model_name, error.reason)

    def count_failure(self, model_name: str, reason: str) -> None:
        """Count against its model a request that failed before :meth:`infer` with ``reason`` (a client gone
        before its request could start: ``cancelled``)."""
        # (Or the version loaded but not READY, a meta model waiting for a model it calls: its statistics list the
        # requests it refuses, a wrong version or an unreadable body included; a bug hunt found them uncounted.)
        model = self._serving(model_name) or self.repository.loaded_version(model_name)
        if model is not None:
            model.stats.record_failure(0, reason)

    @staticmethod
    def refuse_extension(extension: str) -> NoReturn:
        """Answer a call of a Triton extension nereid does not implement (shared memory, trace, logging)."""
        raise Unimplemented(f"nereid does not implement Triton's {extension} extension (it implements: "
                            f"{', '.join(EXTENSIONS)})")

    def model_ready(self, name: str, version: str = "") -> bool:
        """True when the model is loaded and accepting requests.

        An unknown name or version is simply not ready, as Triton answers it
        (its ModelIsReady succeeds with ``ready = false``): a client's
        ``while not is_model_ready(m)`` loop waits rather than raising.
        """
        try:
            self.check_version(name, version)
            return self.repository.entry(name).state is ModelState.READY
        except NotFound:
            return False

    def server_metadata(self) -> tuple[str, str, tuple[str, ...]]:
        """Name, version and implemented extensions."""
        return SERVER_NAME, __version__, EXTENSIONS

    def model(self, name: str) -> LoadedVersion:
        """The ready model behind ``name`` (NotFound / Unavailable otherwise)."""
        return self.repository.ready_model(name)

    def check_version(self, name: str, version: str) -> None:
        """NotFound unless ``name`` is a model and ``version`` empty or the one version nereid serves (an
        unknown model is named as unknown first, whatever version was asked).

        The protocols call it before they decode a request's body: a request for an unknown model is answered
        NOT_FOUND whatever its body holds, as Triton answers it.
        """
        self.repository.entry(name)  # NotFound for a name with no folder
        if version and version_number(name, version) != int(MODEL_VERSION):
            raise NotFound(PublicText(f"model '{name}' has no version '{version}' (nereid serves version "
                                      f"{MODEL_VERSION})"))

    def check_target(self, name: str, version: str) -> ModelSignature:
        """What the protocols ask before they read a request's body: :meth:`check_version`, then Unavailable for a
        model that is not ready; the caller counts what it answers with :meth:`refused`. Returns the ready model's
        client-facing signature, whose input datatypes the decoders check before reading any tensor's elements
        (:meth:`infer` validates the request against the version that serves it, all of it, again).

        As Triton answers: it finds the model before it reads the inputs, so a
        malformed request to a model still loading is told to come back later
        (UNAVAILABLE), not that its request is wrong (found by a bug hunt).
        """
        self.check_version(name, version)
        # Not counted here: the protocols count what they answer (refused), which may be the listener's 400 for a
        # body it could not read rather than this (a waiting model's statistics said "unavailable"; a bug hunt).
        return self.repository.ready_model(name).signature

    def _ready_or_refused(self, name: str) -> LoadedVersion:
        """The ready model behind ``name``; NotFound, or Unavailable counted against a version loaded but not
        READY (a meta model waiting for a model it calls), whose statistics list it, as its
        nereid_protocol_requests_total does."""
        try:
            return self.repository.ready_model(name)
        except Unavailable as err:
            waiting = self.repository.loaded_version(name)
            if waiting is not None:
                waiting.stats.record_failure(0, err.reason)
            raise

    def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        """The ready model's metadata (shapes with a leading -1 when it batches)."""
        self.check_version(name, version)
        return describe_metadata(name, self.model(name))

    def model_config(self, name: str, version: str = "") -> ModelConfig:
        """The ready model's configuration."""
        self.check_version(name, version)
        model = self.model(name)
        # The settings the serving version was built with: after a reload that failed (a device it cannot
        # have), nereid.yaml's entry holds the refused ones while the running version serves on.
        return describe_config(name, model, model.settings or self.repository.entry(name).settings)

    def statistics(self, name: str = "", version: str = "") -> list[tuple[str, ModelStats]]:
        """Snapshots of one loaded model's statistics, or of every loaded model's (``name`` empty)."""
        if name:
            try:
                self.check_version(name, version)
            except NotFound as missing:
                # INVALID_ARGUMENT, as Triton answers the statistics of a model or a version it does not have (its
                # "requested model 'm' is not available"): a client matching Triton's codes was told NOT_FOUND.
                raise InvalidArgument(str(missing)) from None
            entry = self.repository.entry(name)
            loaded = entry.loaded
            if loaded is None:
                # INVALID_ARGUMENT as Triton answers it: UNAVAILABLE would tell a poller to retry as it is.
                raise InvalidArgument(f"model '{name}' is not loaded ({entry.state.value}); no statistics")
            return [(name, loaded.stats.snapshot())]
        if version:  # (read as for one model, so that every RPC refuses a version that is no number)
            version_number("", version)
        return [(entry.name, loaded.stats.snapshot()) for entry in self.repository.entries()
                if (loaded := entry.loaded) is not None]

    async def repository_index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model folder (picking up new ones, forgetting gone ones) with its state and reason."""
        ready = self.ready()
        unlisted = await self.repository.refresh(join=True)
        # Forgetting a gone folder can make the server ready: the health service must say so before we answer.
        if self._on_change is not None and self.ready() != ready:
            await self._on_change()
        if unlisted is not None and not self.repository.entries():
            # Not an empty repository, which an empty list would say (found by a bug hunt): why it is not known.
            raise Unavailable(f"the model repository cannot be listed now, so its models are not known: {unlisted}")
        return [IndexEntry(entry.name, MODEL_VERSION, entry.state.value, self._index_reason(entry.reason))
                for entry in self.repository.entries() if not ready_only or entry.state is ModelState.READY]

    def _index_reason(self, reason: str) -> str:
        """An index entry's reason, with how to load an unlisted folder where this server takes that call; lone
        surrogates escaped (a file name, or the configuration file's, that is not UTF-8: one such reason failed
        RepositoryIndex for the whole server, over gRPC and HTTP alike; the review hunt)."""
        not_listed = not_listed_reason(self.repository.settings.config_name)
        if reason in (not_listed, FOUND_AFTER_START_REASON) and self.repository_control:
            return _encodable(f"{reason}; load it with RepositoryModelLoad")
        return _encodable(reason)

    async def load(self, name: str, parameters: Iterable[str] = (), rpc: str = "RepositoryModelLoad",
                   client: str = "") -> None:
        """(Re)load a model; ModelFailure with the reason when it does not become READY.

        A model loaded already is loaded again without downtime: its running
        version serves until the new one is READY, and serves on if that fails
        (which is still this call's ModelFailure).

        ``parameters``: the names of the load request's parameters. Each is
        refused: Triton's ``config`` (a configuration override) and ``file:...``
        (model files sent with the request), since nereid loads only from the
        repository and succeeding without applying them would mislead, and any
        other name, as Triton refuses it. The refusal echoes the names as sent
        (a PublicText: a ``file:`` path that the server's path scrubbing
        rewrote told the client which absolute paths are the server's).
        """
        self._check_repository_control(rpc, name)
        _log_asked(rpc, name, client)
        keys = sorted(parameters)
        config = self.repository.settings.config_name
        unknown = [key for key in keys if key != "config" and not key.startswith("file:")]
        if unknown:  # Triton refuses them too: a misspelt "file:" must not pass for a load of those files
            raise InvalidArgument(PublicText(
                f"model '{name}': unrecognized load parameter(s) "
                f"{', '.join(map(shown_name, unknown[:4]))} (Triton's are 'config' and "
                "'file:<path>', which nereid does not support either: it loads a model only from its folder in "
                f"ml_backends_path and {config}); load again without parameters"))
        if keys:
            raise InvalidArgument(PublicText(
                f"model '{name}': load parameters {', '.join(map(shown_name, keys[:4]))} are "
                f"not supported (nereid loads a model only from its folder in ml_backends_path and {config}); "
                "change those and load again without parameters"))
        outcome = await self._to_its_end(self._load(name), f"load of model '{name}'",
                                         abandoned=f"model '{name}': load abandoned (the server is stopping); load "
                                                   "it again once the server serves")
        if outcome.abandoned:  # an unload that came meanwhile gave up on it: no fault of the model's
            raise Unavailable(outcome.abandoned)
        if outcome.waiting_on_dependencies:
            # Loaded, and kept: it turns READY by itself once the models it calls are. "failed to load" (INTERNAL)
            # said otherwise, and a client could not tell why the model was READY a moment later.
            raise Unavailable(f"model '{name}' is loaded but not ready: {outcome.reason}; it becomes READY by itself "
                              "once every model it calls is READY (unload it to stop it waiting)")
        if outcome.store_fault and (outcome.state is not ModelState.READY or outcome.reason):
            # The store could not be read (down, credentials): for the client to try again, as a load the store
            # cannot answer before it starts is; INTERNAL would blame the model.
            # (The store's reason says what to do: check a variable, load again once an upload is complete.)
            raise Unavailable(f"failed to load model '{name}' from its store: {outcome.reason}")
        if outcome.state is not ModelState.READY or outcome.reason:  # (READY with a reason: the old version serves on)
            raise ModelFailure(f"failed to load model '{name}': {outcome.reason}")

    async def unload(self, name: str, unload_dependents: bool = False, rpc: str = "RepositoryModelUnload",
                     client: str = "") -> None:
        """Unload a model once its queued and running requests have finished.

        ``unload_dependents`` (Triton's ``model_repository(unload_dependents)``):
        Triton then also unloads the models it loaded only along with this one,
        the composing models an ensemble's load pulled in, unless they were
        loaded explicitly or another model still uses them. nereid loads a
        model only when asked (nereid.yaml, the folder, a load request), never
        along with a meta model, so by that rule no other model is unloaded.
        """
        self._check_repository_control(rpc, name)
        _log_asked(rpc, name, client)
        await self._to_its_end(self._unload(name), f"unload of model '{name}'")

    async def _load(self, name: str) -> _LoadOutcome:
        """The repository's load of ``name``, then the change reported; how this load ended."""
        entry = await self.repository.load(name, requested=True)
        # Read before any wait: a load of the name that waited for this one starts as soon as this task yields,
        # and sets the entry LOADING with no reason (two overlapping loads answered the first one's failure
        # "failed to load model 'm': ", its reason lost; a bug hunt).
        outcome = _LoadOutcome(entry.state, entry.reason, entry.store_fault, entry.waiting_on_dependencies(),
                               entry.abandoned)
        if self._on_change is not None:
            await self._on_change()
        return outcome

    async def _unload(self, name: str) -> None:
        await self.repository.unload(name)
        if self._on_change is not None:
            await self._on_change()

    async def _to_its_end(self, work: Coroutine[object, object, T], what: str, abandoned: str = "") -> T:
        """Run a client's load or unload (``work``) to its end, whether or not the client still waits, as Triton
        does: a gRPC call's deadline or cancel (or an HTTP client gone) ends only the wait. Cancelled with the
        call, a load was abandoned half-way, and ServerReady stayed false until the next load or unload of the
        model. A server stop still abandons a load (``abandoned``: its client's answer then, UNAVAILABLE; see
        ModelRepository.abandon_loads)."""
        task = self.repository.accepted(work, what, load=bool(abandoned))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and not asyncio.current_task().cancelling():
                raise Unavailable(abandoned or f"{what} abandoned: the server is stopping") from None
            task.add_done_callback(functools.partial(_log_unanswered, what))
            raise

    def _check_repository_control(self, rpc: str, name: str) -> None:
        if not self.repository_control:
            why = ("server.repository_control: false" if self.settings.server.repository_control is not None
                   else "server.repository_control is not set, and is off by default when bind_addr or http_addr "
                        "is not loopback")
            raise PermissionDenied(f"model '{name}': {rpc} is turned off on this server ({why})")

    async def infer(self, request: InferRequest, *, wait_for_room: bool = False) -> InferResponse:
        """Run one request; every accepted request gets exactly one answer, success or error. ``wait_for_room``:
        a full queue does not refuse it; it waits for room, as a stream's request does (see :meth:`infer_encoded`)."""
        return await self.infer_encoded(request, _as_is, wait_for_room=wait_for_room)

    async def infer_encoded(self, request: InferRequest,
                            encode: Callable[[InferResponse], Encoded | Awaitable[Encoded]], *,
                            wait_for_room: bool = False) -> Encoded:
        """:meth:`infer`, with the answer put in its wire form by ``encode`` (awaited when it returns an
        awaitable: a large answer encoded off the loop) before the request counts as a success: a NereidError
        from ``encode`` (an output its protocol cannot carry) is the request's failure.

        A full queue refuses the request at once (QueueFull), as it does a unary call's (many clients past capacity
        are an overload to shed); ``wait_for_room`` (a gRPC stream's request, a meta model's sub-call): the request
        waits for room instead (see :meth:`ModelScheduler.wait_for_room`), as Triton's unbounded queue would take
        it.
        """
        received_ns = time.monotonic_ns()
        model = self._ready_or_refused(request.model_name)  # (again: it may have changed while the body decoded)
        timing = RequestTiming()
        while True:
            try:
                validated = validate_inputs(request.model_name, model.signature, request.inputs)
                wanted = self._requested_outputs(request, model)
                if wait_for_room:
                    outputs = await _run_when_room(model, validated.tensors, validated.batch_size, request.deadline_ns,
                                                   timing)
                else:
                    outputs = await model.run(validated.tensors, validated.batch_size, request.deadline_ns, timing)
                break
            except NereidError as err:
                # A reload may have swapped versions since ready_model: the old version refused it at
                # admission, before any of its code ran, so it goes to the new one. Only that refusal: an error
                # from work that ran (a meta model's sub-call) must not run that work again. Each time a newer
                # version serves (a retired one never serves again, so this ends): a stream's request waits for
                # room for seconds, and a second reload meanwhile refused it once more (the hunt of its wait).
                if isinstance(err, ModelRetired) and err.scheduler is model.scheduler:
                    current = self._serving(request.model_name)
                    if current is not None and current is not model:
                        model = current
                        # Accepted already: it waits for room there rather than be refused (a reload's queue handed
                        # over to a version of smaller queue_capacity lost requests; the review).
                        wait_for_room = wait_for_room or err.handed_over
                        continue
                model.stats.record_failure(time.monotonic_ns() - received_ns, err.reason)
                raise
            except asyncio.CancelledError:
                self._count_ended(model, request, received_ns)
                raise
        if wanted is not None:
            outputs = [t for t in outputs if t.name in wanted]
        if validated.batch_axis_added:
            outputs = [_strip_batch_axis(t) for t in outputs]
        try:
            if request.classifications:
                batched = model.signature.batches and not validated.batch_axis_added
                outputs = await _classified(outputs, request.classifications, batched)
            encoded = encode(InferResponse(request.model_name, outputs, request.id))
            if inspect.isawaitable(encoded):
                encoded = await encoded
        except NereidError as err:
            model.stats.record_failure(time.monotonic_ns() - received_ns, err.reason)
            raise
        except Exception:  # a failure of the encoder itself (the caller answers INTERNAL): still counted, once
            model.stats.record_failure(time.monotonic_ns() - received_ns, NereidError.reason)
            raise
        except asyncio.CancelledError:  # gone while its answer was encoded
            self._count_ended(model, request, received_ns)
            raise
        model.stats.record_success(time.monotonic_ns() - received_ns, validated.batch_size, timing)
        return encoded

    def _count_ended(self, model: LoadedVersion, request: InferRequest, received_ns: int) -> None:
        """Count a request whose task was cancelled: the client went away (it cancelled, its connection closed,
        or its deadline ended the call before the scheduler could answer DEADLINE_EXCEEDED), still one answer;
        past the grace, the server ended it (answered UNAVAILABLE)."""
        now = time.monotonic_ns()
        reason = Unavailable.reason if self.grace_passed else cancellation_reason(request.deadline_ns, now)
        model.stats.record_failure(now - received_ns, reason)

    def _serving(self, name: str) -> LoadedVersion | None:
        """The version of ``name`` serving now; None when none is READY."""
        return self.repository.serving(name)

    @staticmethod
    def _requested_outputs(request: InferRequest, model: LoadedVersion) -> set[str] | None:
        """The outputs the request asked for; None when it asked for none, meaning all of them."""
        if not request.requested_outputs:
            return None  # (the codecs classify requested outputs only)
        declared = {spec.name: spec for spec in model.signature.outputs}
        for name in request.requested_outputs:
            if name not in declared:
                # The name as sent, beside the declared ones (which ModelMetadata shows as they are).
                raise OutputsRefused(PublicText(
                    f"model '{request.model_name}': unknown requested output '{name}' "
                    f"(outputs: {', '.join(repr(n) for n in declared) or 'none'})"))
        wanted = set(request.requested_outputs)
        if len(wanted) < len(request.requested_outputs):
            raise OutputsRefused(PublicText(f"model '{request.model_name}': output "
                                            f"'{duplicated(request.requested_outputs)[0]}' is requested more "
                                            "than once"))
        for name in request.classifications:
            check_classifiable(request.model_name, name, declared[name].dtype)
        return wanted



async def _run_when_room(model: LoadedVersion, tensors: list[NamedTensor], batch_size: int, deadline_ns: int,
                         timing: RequestTiming) -> list[NamedTensor]:
    """``model.run``, for a request that waits for room where a full queue would refuse it (see
    :meth:`DataPlane.infer_encoded`): behind the requests waiting already, if any, and again each time the queue
    refuses it before any of the model's code ran for it."""
    scheduler = model.scheduler
    woken = False
    if scheduler.waiting_for_room:  # (tried at once, it could take a room freed for the first of them)
        await _wait_for_room(scheduler, deadline_ns, timing, again=False)
        woken = True
    while True:
        try:
            return await model.run(tensors, batch_size, deadline_ns, timing)
        except QueueRefusal:
            if REQUEST_STARTED.get():  # (a hook ran for it: never run again)
                raise
        # (Waited here, out of the except block: the error's traceback would hold the request's frames meanwhile.)
        await _wait_for_room(scheduler, deadline_ns, timing, again=woken)
        woken = True


async def _wait_for_room(scheduler: ModelScheduler, deadline_ns: int, timing: RequestTiming, again: bool) -> None:
    # Queue time, as Triton's unbounded queue would have counted it: left out, perf_analyzer showed the wait as the
    # server's overhead (the statistics hunt).
    began_ns = time.monotonic_ns()
    try:
        await scheduler.wait_for_room(deadline_ns, again=again)
    finally:
        waited_ns = time.monotonic_ns() - began_ns
        timing.queue_ns += waited_ns
        timing.room_wait_ns += waited_ns


def _log_asked(rpc: str, name: str, client: str) -> None:
    """Say which client asked for a load or unload (``rpc``, over the protocol's name for it): the lines of the
    repository that follow read as those of a change nobody made (the log hunt: a model unloaded over the network
    left no trace of who asked)."""
    log.info("%s of model %s asked%s", rpc, shown_name(name), f" by {client}" if client else "")


def _log_unanswered(what: str, task: asyncio.Task) -> None:
    """Log how ``what``, a load or unload whose client stopped waiting, failed: nobody else is told (its model's
    reason, if any, is also in RepositoryIndex)."""
    if task.cancelled() or task.exception() is None:
        return
    err = task.exception()
    if isinstance(err, NereidError):
        log.info("%s, whose client stopped waiting: %s", what, err)
    else:
        log.error("%s, whose client stopped waiting, failed: %s", what, describe_exception(err))


async def _classified(outputs: list[NamedTensor], counts: dict[str, int], batched: bool) -> list[NamedTensor]:
    """``outputs``, those named in ``counts`` replaced by their top classes (see :func:`classify`); on a worker
    thread when they hold more than CLASSIFY_ON_LOOP_ELEMENTS elements in all.

    Each class is a string formatted in Python: the top million of an FP64 output of large values held the event
    loop 9 s, and every client of both protocols with it (the complexity hunt).
    """
    def classified() -> list[NamedTensor]:
        return [classify(t, counts[t.name], batched) if t.name in counts else t for t in outputs]

    if sum(t.data.size for t in outputs if t.name in counts) > CLASSIFY_ON_LOOP_ELEMENTS:
        return await on_work_thread_or_here(classified)
    return classified()


def _strip_batch_axis(tensor: NamedTensor) -> NamedTensor:
    # The client sent no batch axis, so it gets none back: the response mirrors the request.
    return NamedTensor(tensor.name, tensor.dtype, tensor.data.reshape(tensor.shape[1:]))
