"""Plugin: claims folders with a ``main.py`` and runs it once per batch, forked from a warm parent."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from nereid.backend import BackendClaim, ModelContext, RuntimeReport
from nereid.errors import ConfigError
from nereid.files import remove_tree
from nereid.backends.python.compiled_script import runnable_script
from nereid.backends.python.options import PythonOptions, parse_options
from nereid.backends.python.preload import (Preloads, lives_in_folder, modules_to_preload, only_on_server_pythonpath,
                                           pythonpath_hint, server_pythonpath_entry, triton_python_model)
from nereid.backends.python.warm import (EntryImportFailed, WarmParent, WarmParentBlocked, WarmParentDied,
                                        WarmStartUnavailable, max_request_bytes, run_request)
from nereid.backends.scratch import scratch_folder_refused
from nereid.backends.subprocess.model import SubprocessModel
from nereid.backends.subprocess.runner import ProcessResult, StdinData
from nereid.hookspecs import hookimpl
from nereid.run_folders import make_run_folder
from nereid.runtime_options import LayeredRuntime
from nereid.signature import TEXTPROTO_NAME
from nereid.triton_hints import python_model_hint

log = logging.getLogger(__name__)

BACKEND_NAME = "python"
ENTRY_FILE = "main.py"
LOADED_ENTRY_FILE = "main.py.loaded"  # in the parent's own folder: the bytes this version loaded
COLD_BOOTSTRAP = Path(__file__).with_name("cold_bootstrap.py")


class PythonModel(SubprocessModel):
    """``main.py`` run with the interpreter that runs the server.

    With ``warm_start`` (the default) each batch is a child forked from a warm
    parent that has already imported what ``main.py`` imports; otherwise, or
    when the parent cannot be used, each batch starts a fresh interpreter.
    """

    platform = "nereid_python"
    backend_name = BACKEND_NAME
    entry_file = ENTRY_FILE

    def __init__(self, context: ModelContext) -> None:
        super().__init__(context)
        self.options = PythonOptions()
        self._parent: WarmParent | None = None  # forks every run; warm when it preloaded the imports
        self._warm = False
        self._cold_reason = ""
        # What shows main.py is ported from Triton's Python backend as it is: said at load and with failures.
        self._triton_sign: str | None = None

    def check_options(self) -> None:
        """``warm_start`` and ``preload`` (see ``options.py``); any other key is refused."""
        self.options = parse_options(self.context.settings.runtime, self.context.settings_origin)

    def prepare(self) -> None:
        self._check_run_request()
        # Read once: the imports are scanned from these bytes and the warm parent compiles these
        # same bytes, even if main.py is rewritten while the model loads.
        source = (self.context.folder / ENTRY_FILE).read_bytes()
        modules = modules_to_preload(self.context.folder, ENTRY_FILE, self.options.preload, source)
        self._triton_sign = triton_python_model(source)
        if self._triton_sign is not None:  # (a WARNING, never a refusal: such a main.py may be right; runs will tell)
            log.warning("model '%s': %s", self.context.name, python_model_hint(self._triton_sign))
        own = [name for name in self.options.preload if lives_in_folder(name, self.context.folder)]
        if own:  # (left out without a word, what was asked for seemed preloaded: a bug hunt)
            log.warning("model '%s': runtime.preload names %s of the model's own folder, which is never preloaded: "
                        "each run imports it fresh, so an edit takes effect on the next batch", self.context.name,
                        ", ".join(f"'{name}'" for name in own))
        if not self.options.warm_start:
            missing = only_on_server_pythonpath(modules.imports, self.context.folder)
            if missing is not None:
                # (As a warm load says it: every run would stop there, where the model loaded READY; the review hunt.)
                raise ConfigError(f"model '{self.context.name}': {ENTRY_FILE} imports '{missing[0]}', which model "
                                  f"runs cannot import; every run would stop there{pythonpath_hint(missing[1])}")
            # Named where it was set: the model's runtime, or nereid.yaml's backends: defaults under it.
            origin = getattr(self.context.settings.runtime, "origins", {}).get("warm_start")
            self._cold_reason = f"{origin.rpartition(': ')[2] if origin else 'runtime'}.warm_start is false"
        else:
            try:
                self._parent = self._start_warm_parent(modules, source)
                self._warm = True
                return
            except EntryImportFailed as err:
                # Like a SyntaxError: `python main.py` would stop there on every run, so the model is not READY.
                hint = f" ({python_model_hint()})" if self._triton_sign is not None else ""
                entry = server_pythonpath_entry(str(err))
                if entry is not None:
                    hint += pythonpath_hint(entry)
                raise ConfigError(f"model '{self.context.name}': {err}; every run would stop there{hint}") from None
            except WarmStartUnavailable as err:
                if isinstance(err, WarmParentDied) and not err.timed_out:
                    # Killed as they started (an out-of-memory killer at a busy start), which tells nothing about
                    # the imports: cold for now, warm start tried again later, as after a restart (it stayed cold
                    # until the next load; the warm-retry hunt).
                    try:
                        self._parent = self._start_parent(modules, source, cold_for_now=str(err))
                        self._warm = True
                        return
                    except WarmStartUnavailable as again:
                        err = again
                self._cold_reason = str(err)
                log.warning("model '%s': warm start is off, every batch starts a fresh interpreter: %s",
                            self.context.name, err)
        # Cold: a parent that imports nothing forks each run, which execs a fresh interpreter, so cold runs
        # too die with the server and leave no detached process behind.
        try:
            self._parent = self._start_parent(Preloads(), source, warm=False)
        except WarmStartUnavailable as err:
            log.warning("model '%s': no parent process (%s); runs are spawned directly", self.context.name, err)

    def failed_run_hint(self) -> str:
        """``; main.py imports triton_python_backend_utils: ...`` for a main.py ported from Triton as it is."""
        return f"; {python_model_hint(self._triton_sign)}" if self._triton_sign is not None else ""

    def _check_run_request(self) -> None:
        """Refuse tensor names too long for the request each run sends its parent (every run would fail, the model
        READY): the request is one local socket message, which the names of a multi-tensor model can outgrow.

        Measured on the request a run sends (with the cold run's program, which
        a warm parent that goes cold adds), names JSON-escaped as it carries them.
        """
        env = self.environment_at_load()
        size = len(run_request(env, str(self.context.folder), cold_command()))
        limit, bound = max_request_bytes()
        if size <= limit:
            return
        names = sum(len(json.dumps(env[variable])) - 2 for variable in ("NEREID_INPUT_NAMES", "NEREID_OUTPUT_NAMES")
                    if variable in env)
        raise ConfigError(f"model '{self.context.name}': {self.context.folder / TEXTPROTO_NAME}: its tensor names "
                          f"add up to {names} bytes in the request each run sends its parent process ({size} bytes "
                          f"in all, with the run's environment), more than the {limit} bytes a request may take "
                          f"({bound}); shorten the tensor names")

    def _start_warm_parent(self, modules: Preloads, source: bytes) -> WarmParent:
        """The warm parent that preloads ``modules``, started once more should the first end while starting.

        A parent that dies while it starts (an out-of-memory killer during a
        big import) tells nothing about its imports, as at a restart (see
        ``WarmParent._restart``): the model is not made cold for good by one
        such death. One silent until START_TIMEOUT_S is not waited on twice.
        """
        try:
            return self._start_parent(modules, source)
        except WarmParentDied as err:
            if err.timed_out:
                raise
            log.warning("model '%s': %s; starting another for the load", self.context.name, err)
        return self._start_parent(modules, source)

    def _start_parent(self, modules: Preloads, source: bytes, warm: bool = True,
                      cold_for_now: str | None = None) -> WarmParent:
        """A parent that preloads ``modules`` (forking cold runs, without ``warm``), started; with ``cold_for_now``,
        the reason it runs cold until a try at warm start again works (see ``WarmParent.start_cold_for_now``)."""
        # A folder of its own (while a changed model reloads, two versions' parents run side by side), named as a
        # run's is and beside them, not after the model: its TMPDIR is where a preloaded import makes AF_UNIX
        # sockets (multiprocessing's, at most 107 bytes a path), which a folder naming the model left no room for.
        runs = self.runs_dir()
        try:
            parent_dir = make_run_folder(runs)
        except OSError as err:
            raise scratch_folder_refused(self.context.name, "make a folder for its parent process in", runs,
                                         err) from None
        env = self.base_environment()
        # A folder apart from the parent's own files (its log, main.py's copy): a library that keeps the temporary
        # folder it found at import hands it to every run, which must not write beside them.
        env["TMPDIR"] = str(parent_dir / "tmp")
        parent = WarmParent(name=self.context.name, folder=self.context.folder, env=env, modules=modules,
                            log_path=parent_dir / "log", entry_source=parent_dir / LOADED_ENTRY_FILE,
                            entry_bytes=source, cold_argv=cold_command(), folder_fd=self.folder_fd(), warm=warm,
                            config_name=self.context.config_name)
        try:
            try:
                parent.entry_source.write_bytes(source)
            except OSError as err:  # a full disk: named, where a bare "[Errno 28] No space left" named nothing
                raise scratch_folder_refused(self.context.name, f"write a copy of its {ENTRY_FILE} into", runs,
                                             err) from None
            try:
                if cold_for_now is not None:
                    parent.start_cold_for_now(cold_for_now)
                else:
                    parent.start()
            except WarmParentBlocked as err:
                # The server's condition (a full disk, out of descriptors), not the model's: never a reason to load
                # it cold for good, nor without a parent; the load fails saying so, and a later load may work.
                raise ConfigError(f"model '{self.context.name}': its parent process could not be started: "
                                  f"{err}") from None
        except BaseException:
            # A failure after the parent had started (its exit watcher's thread not starting, as it once did) left
            # it running for the server's life (the resource-limits hunt): stopped, a no-op when none had started.
            try:
                parent.stop()
            finally:
                remove_tree(parent_dir)
            raise
        return parent

    def command(self) -> list[str]:
        """``python main.py``: only for a model left without a parent process (see ``prepare``), which holds no
        loaded bytes to run; a cold run of a parent runs the bytes it holds (see :func:`cold_command`)."""
        return [sys.executable, ENTRY_FILE]

    def launch(self, *, env: dict[str, str], stdin: StdinData) -> ProcessResult:
        parent = self._parent
        if parent is None:
            return super().launch(env=env, stdin=stdin)
        # (A run refused by the folder, warm or cold, is told by its child: see SubprocessModel.folder_refused.)
        return parent.run(env=env, stdin=stdin, timeout_s=self.context.settings.timeout_s, groups=self._groups,
                          exec_argv=None if self._warm else parent.cold_argv)

    def relocate(self, context: ModelContext) -> None:
        """Serve on from a renamed folder: the parent stays, each child runs in the new folder."""
        super().relocate(context)  # holds a descriptor of the new folder
        if self._parent is not None:
            self._parent.name, self._parent.folder = context.name, context.folder
            self._parent.folder_fd = self.folder_fd()

    def unload(self) -> None:
        """End the parent (and any child it still runs) and remove its folder."""
        parent, self._parent = self._parent, None
        if parent is not None:
            parent.stop()
            remove_tree(parent.log_path.parent)  # (with what main.py made read-only in its TMPDIR)
        super().unload()

    def runtime_report(self) -> RuntimeReport:
        """``warm_start=on`` (with the imports left to each run, if any), or ``warm_start=off (<reason>)`` (``since a
        restart``, with when warm start is tried again), and the warm parent's memory."""
        parent = self._parent
        if not self._warm or parent is None:
            return RuntimeReport(f"warm_start=off ({self._cold_reason})", warm_start=False)
        reason, retry = parent.cold_reason, parent.retry_state()
        if reason is not None:
            # (With where trying it again stands: gone cold at a restart, or its parents killed at load, a model
            # tries warm start again.)
            since = "" if parent.cold_since_load else " since a restart"
            return RuntimeReport(f"warm_start=off{since} ({reason}){f', {retry}' if retry else ''}", warm_start=False)
        left = parent.modules.left  # (main.py's imports each run makes itself: see the load's log line)
        shown = f" (not preloaded: {', '.join(left[:5])}{', ...' if len(left) > 5 else ''})" if left else ""
        return RuntimeReport(f"warm_start=on{shown}", parent.resident_bytes(), warm_start=True)


def cold_command() -> list[str]:
    """What a cold run execs (its warm parent adds a descriptor that holds the bytes of main.py this version
    loaded): a fresh interpreter that runs those bytes as ``python main.py`` would run main.py, not the file as
    it is on disk by then (an edit whose reload failed, or not loaded yet). See ``cold_bootstrap.py``.

    The bootstrap runs from its cached bytecode when that is fresh (:func:`runnable_script`, checked here, at
    each load): compiling it from source cost every cold run about 2 ms of CPU.
    """
    return [sys.executable, str(runnable_script(COLD_BOOTSTRAP))]


@hookimpl
def nereid_claim_model(folder: Path, declared: bool) -> BackendClaim | None:
    """Claim folders that contain ``main.py`` (or any folder declared ``backend: python``)."""
    # Present in any form: a FIFO or a folder named main.py is then reported as such by the load.
    if declared or os.path.lexists(folder / ENTRY_FILE):
        return BackendClaim(PythonModel)
    return None


@hookimpl
def nereid_claim_signs() -> str:
    """What makes this backend claim a folder, for the reason of a folder no backend claimed."""
    return "main.py"


@hookimpl
def nereid_check_defaults(defaults: dict, origin: str) -> None:
    """Refuse a mistake in nereid.yaml's ``backends.python`` (``warm_sart``), served model or not."""
    parse_options(LayeredRuntime({}, defaults, origin), origin)


@hookimpl
def nereid_model_options(name: str, folder: Path, runtime: dict, origin: str) -> PythonOptions:
    """The options a python model loads with (``warm_start``, ``preload``): an edit of ``backends.python`` that
    leaves them as they are (``warm_start: true`` written out) reloads no model."""
    return parse_options(runtime, origin)
