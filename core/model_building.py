"""Building a model from its folder: the claim, the backend's object, its ``load()`` and what core derives.

What the repository does on a load's worker thread, and ``nereid check`` on
its main thread: one path, so a model the check passes loads the same way in
a server.
"""

from __future__ import annotations

import errno
import inspect
import logging
import math
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from nereid.backend import (BoundsItsRuns, CallsModels, HasBatchSignature, Model, ModelContext, ReturnsFreshOutputs,
                            UsesNoDevice, missing_model_parts)
from nereid.batching import BatchPolicy
from nereid.errors import (ConfigError, MissingModelFile, NereidError, RaisedExit, backend_exit, calling_plugin,
                           describe_exception, plugin_failures, same_kind)
from nereid.files import check_readable
from nereid.memory import address_space_limit_mib
from nereid.plugins import NereidPluginManager, claim_folder
from nereid.runtime_options import layered_runtime
from nereid.signature import ModelSignature, brief_description, brief_repr
from nereid.triton_hints import folder_hint, leftovers_note

log = logging.getLogger(__name__)

T = TypeVar("T")

# The load() step as the note of a long load and the reason of an abandoned one have always named it.
LOAD_CALL = "its backend's load()"


class BuildStage:
    """The step of one model's build that runs now, as the call that has not returned: set on the build's thread,
    read by whoever waits for it (the note of a load running long, the reason of a load abandoned).

    A build held by a plugin's claim hook (or by its backend's create()) was
    said to wait for its backend's load(), which had never been called.
    """

    def __init__(self, call: str) -> None:
        self._lock = threading.Lock()  # (set on the build's thread, read on the event loop's)
        self._call = call

    def enter(self, call: str) -> None:
        """The build calls ``call`` from now on ("its backend's load()", say)."""
        with self._lock:
            self._call = call

    def call(self) -> str:
        """What the build waits for now: "the create() of plugin 'x' (...)", "its backend's load()", ..."""
        with self._lock:
            return self._call


@dataclass(frozen=True)
class BuiltVersion:
    """A version as its build made it, before the core gives it a scheduler (then a
    :class:`~nereid.model_entry.LoadedVersion`): the backend's loaded :class:`~nereid.backend.Model` and what the
    core derived from it."""

    backend_name: str
    backend: Model
    signature: ModelSignature
    batch_signature: ModelSignature
    policy: BatchPolicy
    # What keeps the version folder it was built from (a model from an object store): released with the model.
    folder_hold: Any = None
    uses_device: bool = True  # False: it runs nothing on a device (see UsesNoDevice), reported on the CPU
    fresh_outputs: bool = False  # its outputs are used as they are, not copied (see ReturnsFreshOutputs)
    longest_run_s: float | None = None  # the bound it ends each execution at itself (see BoundsItsRuns); None: none
    # What the operator should know of the folder, which does not keep it from serving (Triton's files left in
    # it): a server logs each as a WARNING at the load, nereid check writes them on the model's line.
    notes: tuple[str, ...] = ()


# A model object's methods the core calls as plain functions (on a thread, or inline): an ``async def`` one only
# makes a coroutine that never runs (a READY model with nothing loaded; every request failing on a coroutine from
# its preprocess hook; a rename said done in place whose relocate never ran: the plugin hunt). Only ``infer`` may
# be ``async def``.
PLAIN_METHODS = ("load", "unload", "signature", "batch_signature", "preprocess", "postprocess", "padded_rows",
                 "input_check", "terminate_running", "relocate", "runtime_report", "dependencies",
                 "concurrent_executions", "uses_no_device", "returns_fresh_outputs", "longest_run_s")


def _is_async_def(backend: object, method: str) -> bool:
    """Whether ``backend``'s ``method`` is an ``async def``, read without running its code: before ``load()`` a
    ``__getattr__`` forwarding to what load() makes, or a property, may fail (a wrapper plugin's recursed for
    ever; the hunt of the check)."""
    member = inspect.getattr_static(backend, method, None)
    return inspect.iscoroutinefunction(getattr(member, "__func__", member))  # (a staticmethod's or classmethod's)


def build_model(manager: NereidPluginManager, context: ModelContext,
                backend_defaults: Mapping[str, Mapping[str, Any]] | None = None,
                defaults_source: Path | str = "", stage: BuildStage | None = None) -> BuiltVersion:
    """Claim, create and load one model; raise with the reason when it cannot be served.

    ``backend_defaults`` (nereid.yaml's ``backends:``, from the file
    ``defaults_source``) gives runtime options for every model of the claiming
    backend; the model's own ``runtime:`` wins.
    The model object is checked against the :class:`Model` protocol once,
    after its ``load()`` (which may set ``platform``): one lacking a part is
    refused naming its backend and what it lacks, and unloaded (when it can be).
    Blocking (backends compile and read files here): call it on a worker thread.
    A ``sys.exit()`` (or any exit) in the backend's code is its failure, a
    ConfigError naming the model, never an exit of the server or the check.
    ``stage``, when given, is told each step as it starts (see :class:`BuildStage`).
    The built model's ``notes`` name what its folder holds that nothing reads.
    """
    stage = stage if stage is not None else BuildStage("the claim of its folder")
    try:
        built = calling_plugin(
            lambda: _build_model(manager, context, backend_defaults, defaults_source, stage),
            lambda exit_: backend_exit(context.name, exit_, "while loading it"))
    except MissingModelFile as err:
        # A Triton folder a backend was told to take (nereid.yaml's backend:) failed on the files it lacks
        # ("missing main.py") without a word of what the folder is. Only there: a Triton-looking folder failing for
        # another reason (a device without its driver) was told it looked like one, which explained nothing. (A
        # folder no backend claims has the hint in the claim's reason.)
        hint = folder_hint(context.folder)
        if hint is None or hint in str(err):
            raise
        raise same_kind(err, f"{err}; {hint}") from err.__cause__
    # (A folder ported in place that kept Triton's config.pbtxt and version folders loaded READY without a word:
    # its instances, batching window and version policy dropped, another version served than Triton's.)
    leftovers = leftovers_note(context.folder)
    return replace(built, notes=(leftovers,)) if leftovers is not None else built


def _build_model(manager: NereidPluginManager, context: ModelContext,
                 backend_defaults: Mapping[str, Mapping[str, Any]] | None, defaults_source: Path | str,
                 stage: BuildStage) -> BuiltVersion:
    check_readable(context.folder)
    result = claim_folder(manager, context.folder, context.settings.backend, config_name=context.config_name,
                          asking=lambda name: stage.enter(f"the nereid_claim_model hook of {manager.describe(name)}"))
    if result.claim is None:
        raise ConfigError(result.reason)
    defaults = (backend_defaults or {}).get(result.backend_name)
    if defaults:
        runtime = layered_runtime(context.settings.runtime, defaults, defaults_source, result.backend_name)
        context = replace(context, settings=replace(context.settings, runtime=runtime))
    stage.enter(f"the create() of {manager.describe(result.backend_name)}")
    backend = _plugin_step(manager, result.backend_name, context, "create()",
                           lambda: result.claim.create(context))
    missing = missing_model_parts(backend)
    if "load()" in missing:  # nothing to load: refused at once
        raise _lacking(manager, result.backend_name, backend, missing)
    coroutines = [f"{method}()" for method in PLAIN_METHODS if _is_async_def(backend, method)]
    if coroutines:
        # Called as plain functions (on a thread), they would only make a coroutine that never runs: a model READY
        # with nothing loaded, an unload said done that never ran (found by a bug hunt).
        raise ConfigError(f"{manager.describe(result.backend_name)} made a model object ({type(backend).__name__}) "
                          f"whose {' and '.join(coroutines)} {'is' if len(coroutines) == 1 else 'are'} async def: "
                          "they are called as plain functions (only infer() may be async def); make them plain "
                          "def")
    stage.enter(LOAD_CALL)
    _plugin_step(manager, result.backend_name, context, "load()", backend.load)
    try:
        missing = missing_model_parts(backend)
        if missing:
            raise _lacking(manager, result.backend_name, backend, missing)
        stage.enter("its backend's signature()")
        # (Through _plugin_step, as load(): what they raise is named with its type and plugin, where a bare
        # "no sig" was all the reason said; found by a plugin hunt.)
        signature = _checked_signature(manager, result.backend_name, backend, "signature",
                                       _plugin_step(manager, result.backend_name, context, "signature()",
                                                    backend.signature))
        batch_signature = signature
        if isinstance(backend, HasBatchSignature):
            stage.enter("its backend's batch_signature()")
            batch_signature = _checked_signature(
                manager, result.backend_name, backend, "batch_signature",
                _plugin_step(manager, result.backend_name, context, "batch_signature()",
                             backend.batch_signature))
        uses_device = True
        if isinstance(backend, UsesNoDevice):
            # Asked once, here: a plugin's that raised on each ModelConfig failed it naming no model, and ended
            # nereid check in a traceback (the plugin hunt).
            answer = _plugin_step(manager, result.backend_name, context, "uses_no_device()",
                                  backend.uses_no_device)
            if not isinstance(answer, (bool, np.bool_)):  # (numpy's True, as a computed answer may be)
                raise ConfigError(f"model '{context.name}': uses_no_device() of "
                                  f"{manager.describe(result.backend_name)} returned {brief_description(answer)}, "
                                  "expected True or False")
            uses_device = not bool(answer)
        fresh_outputs = False
        if isinstance(backend, ReturnsFreshOutputs):
            answer = _plugin_step(manager, result.backend_name, context, "returns_fresh_outputs()",
                                  backend.returns_fresh_outputs)
            if not isinstance(answer, (bool, np.bool_)):
                raise ConfigError(f"model '{context.name}': returns_fresh_outputs() of "
                                  f"{manager.describe(result.backend_name)} returned {brief_description(answer)}, "
                                  "expected True or False")
            fresh_outputs = bool(answer)
        longest_run_s = None
        if isinstance(backend, BoundsItsRuns):
            stage.enter("its backend's longest_run_s()")
            longest_run_s = _checked_run_bound(manager, result.backend_name, context, backend)
        policy = BatchPolicy.resolve(context.settings.batching, batch_signature, context.settings_origin)
        if isinstance(backend, CallsModels):  # each request is an orchestration with its own deadline
            policy = BatchPolicy(enabled=False)
    except BaseException:
        if "unload()" not in missing:  # what load() acquired must not leak
            stage.enter("its backend's unload()")
            try:
                calling_plugin(backend.unload, RaisedExit)
            except Exception:  # logged: the reason the load is refused is the one raised here, not the cleanup's
                log.exception("model '%s': unload failed (cleaning up after its load was refused)", context.name)
        raise
    return BuiltVersion(result.backend_name, backend, signature, batch_signature, policy, uses_device=uses_device,
                      fresh_outputs=fresh_outputs, longest_run_s=longest_run_s)


def _checked_run_bound(manager: NereidPluginManager, backend_name: str, context: ModelContext,
                       backend: BoundsItsRuns) -> float | None:
    """``longest_run_s()``, asked once after the load: None or a number of seconds above 0 (else the load fails
    naming the plugin, as for uses_no_device())."""
    answer = _plugin_step(manager, backend_name, context, "longest_run_s()", backend.longest_run_s)
    if answer is None:
        return None
    seconds = None
    if isinstance(answer, (int, float, np.integer, np.floating)) and not isinstance(answer, (bool, np.bool_)):
        try:
            seconds = float(answer)
        except OverflowError:  # (an int no float can hold: 10**400)
            pass
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"model '{context.name}': longest_run_s() of {manager.describe(backend_name)} returned "
                          f"{brief_description(answer)}, expected None or a number of seconds above 0")
    return seconds


class BackendRaised(ConfigError):
    """A backend's ``create()`` or ``load()`` raised an exception that is not nereid's: its reason names the
    exception's type and the plugin (a ``KeyError`` said only ``'weights'``); ``__cause__`` is the exception,
    whose traceback the load failure's log line carries."""


def _plugin_step(manager: NereidPluginManager, backend_name: str, context: ModelContext, step: str,
                 call: Callable[[], T]) -> T:
    """``call()``, a backend's ``create()`` or ``load()``. A nereid error (a ConfigError with the reason, the
    way a backend refuses a model) passes as it is; any other exception becomes :class:`BackendRaised`."""
    try:
        return call()
    except NereidError:
        raise
    except plugin_failures() as err:  # (a sys.exit() too: named as any exception is, with the plugin and the step)
        if _mode_of_a_model_file(err, context.folder):
            # A file's mode, the operator's to fix, not a fault of the backend's code: said as such, without the
            # traceback a backend's own exception is logged with (the hunt of edc6865).
            raise ConfigError(f"model '{context.name}': {err.filename}: {err.strerror}: the server's user (uid "
                              f"{os.geteuid()}) cannot open it (met by the {step} of "
                              f"{manager.describe(backend_name)})") from None
        if isinstance(err, MemoryError):
            # The server's condition, not a bug of the backend's: a bare "MemoryError (raised by ...)" said neither,
            # nor the address-space limit that is its usual cause where one is set (the deploy hunt).
            limit = address_space_limit_mib()
            within = f"; the server's address-space limit (ulimit -v) is {limit} MiB" if limit is not None else ""
            raise BackendRaised(f"model '{context.name}': the server ran out of memory ({describe_exception(err)} "
                                f"raised by the {step} of {manager.describe(backend_name)}){within}") from err
        raise BackendRaised(f"model '{context.name}': {describe_exception(err, one_line=True)} (raised by the "
                            f"{step} of {manager.describe(backend_name)})") from err


def _mode_of_a_model_file(err: BaseException, folder: Path) -> bool:
    """Whether ``err`` is a file of the model's folder that its mode keeps from the server's user: EACCES naming a
    path inside ``folder``. Anything else (EPERM from a chmod, a library's cache elsewhere) is the backend's, said
    with its traceback (the hunt of the rewording)."""
    if not isinstance(err, PermissionError) or err.errno != errno.EACCES or not isinstance(err.filename, str):
        return False
    try:
        return Path(os.path.abspath(err.filename)).is_relative_to(os.path.abspath(folder))
    except (OSError, ValueError):
        return False


def _checked_signature(manager: NereidPluginManager, backend_name: str, model: object, method: str,
                       value: object) -> ModelSignature:
    """``value``, what ``model.<method>()`` returned, when it is a ModelSignature; ConfigError naming the backend
    otherwise (it read as "'NoneType' object has no attribute 'batches'")."""
    if not isinstance(value, ModelSignature):
        raise ConfigError(f"{manager.describe(backend_name)}: its model object ({type(model).__name__}) returned "
                          f"{type(value).__name__} {brief_repr(value)} from {method}(), expected a "
                          "nereid.signature.ModelSignature")
    return value


def _lacking(manager: NereidPluginManager, backend_name: str, model: object, missing: list[str]) -> ConfigError:
    """The reason a model object lacking ``missing`` parts of the Model protocol is refused, naming its backend."""
    return ConfigError(f"{manager.describe(backend_name)} made a model object ({type(model).__name__}) without "
                       f"{', '.join(missing)}: see the Model protocol in nereid.backend")
