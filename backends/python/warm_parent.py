"""The warm parent of one python model: imports once, then forks one child per batch.

Run by the server as ``python -P warm_parent.py CONTROL_FD MODULES_JSON FOLDER SOURCE``
(from its cached bytecode when fresh: see ``compiled_script.py``) with the model
folder as working directory and the model's minimal environment (``SOURCE``: the
bytes of ``main.py`` the server read when it loaded the model). It is a program
of its own, standard library only, so that a child inherits nothing but what
the model imports: not nereid, not grpc.

Protocol (``CONTROL_FD`` is an AF_UNIX SOCK_SEQPACKET socket to the server):

1. Import the modules of ``MODULES_JSON`` (``{"imports": [...], "extra": [...], "submodules": [...]}``:
   main.py's own top-level imports, then the model's other preloads, then the submodules main.py's
   ``from package import name`` statements import), as ``python main.py`` would import them (the
   folder first on ``sys.path``, ``sys.argv == ["main.py"]``, a ``__main__`` named by ``main.py``:
   see :func:`preload_as_script`), and compile ``SOURCE`` as the folder's ``main.py`` by its
   physical path (each run executes that code, not the file as it is then), then write
   one line to the stdout it was started with: ``ready`` (then, when the imports warned, a space and
   ``{"warnings": [TEXT, ...]}``); ``broken <reason>`` and exit (one
   of main.py's own imports failed: every run would stop there); or ``fallback <reason>``
   and exit (an extra preload failed, imports started Python threads: forking a threaded
   process is unsafe, or an import initialised CUDA or a JAX backend, or started an OpenMP
   thread pool, which a forked child cannot use).
   From the start, descriptor 1 is the parent's stderr: what an import prints (a
   library's banner) goes to the log, and only that line reaches the server.
2. Each message on the control socket asks for one run: a JSON object
   ``{"env": {...}, "cwd": FOLDER}`` (and ``"exec": ARGV`` for a cold run,
   which execs a fresh interpreter instead; with ``"entry": true`` too, ARGV gets one
   more argument: an inherited descriptor that holds ``SOURCE``'s bytes) with three
   or four descriptors attached: the read end of the child's stdin pipe, the
   write end of its output pipe (stdout and stderr), a reply socket, and
   (optional) an ``O_PATH`` descriptor of the loaded model folder, which the
   child enters: ``FOLDER`` may name another folder by now.
   A child forked ahead of time (the spare) takes the run.
3. On the reply socket the parent sends ``{"pid": N}`` once the child is
   forked and ``{"status": S}`` once it has ended (S as ``Popen.returncode``:
   negative for a signal). Before that it SIGKILLs the child's process group,
   so nothing the model started outlives the run. The child is reaped only when
   the server closes the reply socket, which it does once it no longer lists
   the run's group: until then the group's id cannot be reused, so a signal the
   server sends it meanwhile reaches nothing else. If the server closes the
   reply socket first (a timeout), the group is killed.
4. End of stdin (the server's lifeline) or of the control socket: kill every
   running child's group, reap them, exit.

A child starts its own session (process group), takes the pipes as stdin and
stdout/stderr, gets exactly the environment of the request and runs
``main.py`` as ``__main__`` the way ``python main.py`` would.
"""

from __future__ import annotations

import sys

# What `python main.py` has imported before main.py runs. Anything else this program imports
# for itself (json, socket, ...) must not hide a same-named module in the model folder.
INTERPRETER_MODULES = frozenset(sys.modules)

import atexit  # noqa: E402 - after the snapshot above
import collections.abc
import ctypes
import dis
import functools
import gc
import importlib
import importlib.machinery
import importlib.util
import io
import itertools
import json
import linecache
import os
import select
import signal
import socket
import threading
import time
import traceback
import types

ENTRY_FILE = "main.py"
MAX_REQUEST_BYTES = 1 << 20
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# Rounds of a sweep: each kills every orphan with all its descendants, so a round only has more to do for
# processes forked while it ran, or killed ones still being reparented here to be reaped.
MAX_SWEEPS = 1024
# What every CUDA driver API call but cuInit returns until cuInit has been called (CUresult 3).
CUDA_ERROR_NOT_INITIALIZED = 3
# How long the OpenMP probe's empty parallel region may take before it counts as hanging (see openmp_pool_hangs):
# one that works ends in a few ms, even on a loaded machine well within this.
OPENMP_PROBE_S = 2.0
# How long a preload's child process may take to end before it counts as one the runs would share (a short-lived
# Popen an import did not wait for is still running a moment later; found by the review of the change).
SHORT_LIVED_CHILD_S = 0.2
# How long a run's end waits for multiprocessing's resource tracker to unlink what the run leaked (see
# end_resource_tracker): a fresh interpreter's start and a few unlinks take tens of ms; one that hangs is killed
# with the run's group.
TRACKER_EXIT_WAIT_S = 2.0
# How a run's child that cannot enter the loaded folder (its mode changed while the model serves: chmod 000) tells
# the server, which names the folder and the remedy: this exit status, with this line, then the errno's number and
# message, as its last output (warm.py has the same two; a test keeps them equal). Told, not looked up by the server
# once the run failed: the mode may be back by then, and the run's traceback was the answer.
FOLDER_NOT_ENTERED_EXIT = 126
FOLDER_NOT_ENTERED_LINE = "nereid warm parent: the run's child cannot enter the model folder: errno "


def preload(imports: list[str], extra: list[str], submodules: tuple[str, ...] | list[str] = ()) -> str | None:
    """Import ``imports`` (main.py's), then ``extra``; None when forking is safe afterwards, else the start-up
    answer that says why not: ``broken <reason>`` or ``fallback <reason>``.

    One of main.py's own imports that fails is ``broken``: ``python main.py``
    would stop at it on every run. Python threads make forking unsafe (a lock
    held by one stays held in every child). Native threads are asked about
    where they do not survive a fork: an initialised CUDA driver
    (:func:`cuda_initialised`), an initialised JAX backend (:func:`jax_backends`)
    and GNU OpenMP's pool (:func:`openmp_pool_hangs`); OpenBLAS's pool
    registers fork handlers, and importing torch starts none.
    """
    # Each thread by the import after which it was first seen running (None: before any), for the reason.
    thread_starters: dict[threading.Thread, str | None] = dict.fromkeys(threading.enumerate())
    for name in [*imports, *extra, *submodules]:
        try:
            if name not in submodules or _submodule_to_import(name):
                importlib.import_module(name)
        except ModuleNotFoundError as err:
            if name in submodules and err.name == name:
                return _no_such_name(name)
            return _preload_failure(name, err, imports)
        except BaseException as err:  # noqa: BLE001 - any failure: the load fails, or runs go cold
            return _preload_failure(name, err, imports)
        # After each import, so that the reason names the module that did it.
        if cuda_initialised():
            return (f"fallback preloading '{name}' initialised CUDA, which a forked child cannot use; initialise "
                    "CUDA in the code that runs per batch (main.py's body or a function it calls), not at import")
        backends = jax_backends()
        if backends:
            return (f"fallback preloading '{name}' initialised JAX's backend ({', '.join(backends)}), whose thread "
                    "pools a forked run cannot use (its next compile or parallel operation hangs); run JAX operations "
                    "(jit calls, arrays) in the code that runs per batch (main.py's body or a function it calls), not "
                    "at import (importing jax is fine)")
        for thread in threading.enumerate():
            thread_starters.setdefault(thread, name)
    extra_threads = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if extra_threads:
        return _threads_reason(extra_threads, thread_starters)
    # A process an import started (a helper it talks to through pipes, multiprocessing's resource tracker) would
    # be one process shared by every run at once, where `python main.py` has its own; and each run's end sweeps
    # this parent's other children away (found by a bug hunt: the first run worked, every later one broke).
    started = _live_children()
    deadline = time.monotonic() + SHORT_LIVED_CHILD_S
    while started and time.monotonic() < deadline:  # (one about to end, not yet waited for, is no shared process)
        time.sleep(0.01)
        started = _live_children()
    if started:
        return (f"fallback preloading started a process ({', '.join(started[:3])}) that every run would share; "
                "start it in the code that runs per batch (main.py's body or a function it calls), not at import")
    # Last: the probe forks, which is safe only once no Python thread runs (found by a bug hunt: a project module
    # whose warm-up predict ran at import left every forked run that used OpenMP hanging until timeout_s, silently).
    hanging = openmp_pool_hangs()
    if hanging is not None:
        return (f"fallback preloading started an OpenMP thread pool ({hanging}), which a forked run cannot use (GNU "
                "OpenMP, which torch, scikit-learn, LightGBM and XGBoost use, has no fork handler: the run's first "
                "parallel operation hangs); run the warm-up (a first predict or forward pass) in the code that runs "
                "per batch (main.py's body or a function it calls), not at import")
    return None


def _threads_reason(threads: list[threading.Thread], starters: dict[threading.Thread, str | None]) -> str:
    """The start-up answer for Python threads still running after the preloads, naming the imports that started
    them (found by a bug hunt: a joblib Parallel at import gave "started threads (ExecutorManagerThread,
    QueueFeederThread)", which named neither the module nor the library)."""
    names = ", ".join(thread.name for thread in threads[:5])
    modules = list(dict.fromkeys(repr(starters[t]) for t in threads if starters.get(t) is not None))
    by = f" {', '.join(modules)}" if modules else ""
    return (f"fallback preloading{by} started threads ({names}); forking a threaded process is unsafe; start them in "
            "the code that runs per batch (main.py's body or a function it calls), not at import")


def _live_children() -> list[str]:
    """This process's children still running (zombies left out), each as ``name (pid N)``."""
    live = []
    for pid in _children():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone (and reaped) meanwhile
            continue
        name_end = stat.rfind(b")")
        if stat[name_end + 2:name_end + 3] != b"Z":
            live.append(f"{stat[stat.find(b'(') + 1:name_end].decode(errors='replace')} (pid {pid})")
    return live


def preload_as_script(folder: str, imports: list[str], extra: list[str],
                      submodules: tuple[str, ...] | list[str] = ()) -> str | None:
    """:func:`preload` as ``python main.py`` would import the modules: with ``folder`` first on ``sys.path``,
    ``sys.argv == ["main.py"]``, ``sys.orig_argv`` ending in ``main.py``, and a stand-in ``__main__`` whose
    ``__file__`` is ``folder/main.py`` (kept in :data:`_main_module` for the runs). All but what the imports
    themselves did is put back afterwards.

    An installed package that reads its app's settings module from the
    script's folder, or its program name from ``sys.argv[0]``, as it is
    imported, found this program's instead (its argv, the interpreter's
    ``sys.path`` under ``-P``): every warm run got what no ``python main.py``
    gets.
    """
    global _main_module
    argv, orig_argv, main_module = sys.argv, sys.orig_argv, sys.modules.get("__main__")
    stand_in = _main_module = _script_module(os.path.join(folder, ENTRY_FILE))
    sys.argv, sys.orig_argv = [ENTRY_FILE], [*orig_argv[:1], ENTRY_FILE]
    sys.path.insert(0, folder)
    sys.modules["__main__"] = stand_in
    watch = SeedWatch()
    register = atexit.register
    atexit.register = _recording_exit_function(register)  # type: ignore[assignment]
    import warnings  # (the interpreter's own, which python main.py's imports warn through)

    # Only how a warning is shown changes while they import: not catch_warnings, which puts the filters back after,
    # undoing a library's own filterwarnings("ignore", ...) for every run.
    shown, caught, importing = warnings.showwarning, [], [True]

    def recording(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if not importing[0]:
            # (An import that kept this one, to pass on what it does not silence, or logging.captureWarnings,
            # which puts it back: a run's warnings go where they always went; the review hunt.)
            return shown(message, category, filename, lineno, file, line)
        caught.append(warnings.formatwarning(message, category, filename, lineno, line))
    warnings.showwarning = recording
    recording_exits = atexit.register
    try:
        with watch:
            return preload(imports, extra, submodules)
    finally:
        importing[0] = False
        if warnings.showwarning is recording:  # (an import may have put its own in place: it stays)
            warnings.showwarning = shown
        _tell_warnings(caught)
        if atexit.register is recording_exits:  # (likewise)
            atexit.register = register  # type: ignore[assignment]
        _keep_seeded_states(watch.seeded)
        _keep_fresh_generators(watch)
        sys.argv, sys.orig_argv = argv, orig_argv
        try:
            sys.path.remove(folder)  # (each run puts it first again; what the imports added stays, as for main.py)
        except ValueError:
            pass
        if main_module is not None:
            sys.modules["__main__"] = main_module


# What the preloaded imports warned, as Python shows a warning, for the server's log (the start-up answer's):
# emitted once, in this parent, they reached only its own log, which no operator reads (the python-models hunt).
_preload_warnings: list[str] = []
# At most this many of them, each at most this long, are told.
MAX_TOLD_WARNINGS = 20
MAX_WARNING_CHARS = 2000


def _tell_warnings(caught: list[str]) -> None:
    """Write each warning the imports raised (``caught``, as Python shows one) to the log, as Python would have,
    and keep it for the start-up answer."""
    for text in caught:
        sys.stderr.write(text)
        if len(_preload_warnings) < MAX_TOLD_WARNINGS:
            _preload_warnings.append(text.rstrip()[:MAX_WARNING_CHARS])


ExitFunction = collections.abc.Callable[..., object]
# The functions the preloaded imports registered with atexit, and of those the ones that remove files, told apart
# once, after the preloads, not at each run (see keep_parent_files_at_exit).
_preload_exit_functions: list[ExitFunction] = []
_preload_removers: list[ExitFunction] = []


def _recording_exit_function(register: ExitFunction) -> ExitFunction:
    """``atexit.register`` that also notes each function in :data:`_preload_exit_functions` (a module that took
    this one as its own, ``from atexit import register``, keeps both doing their work)."""
    @functools.wraps(register)
    def recording(func: ExitFunction, *args: object, **kwargs: object) -> object:
        _preload_exit_functions.append(func)
        return register(func, *args, **kwargs)
    return recording


def keep_parent_files_at_exit() -> None:
    """Keep a run's exit from removing the files the preloaded imports made in this parent, which every later
    run shares: an installed package unpacking its weights into a ``tempfile.TemporaryDirectory`` at import
    (removed at exit by its ``weakref.finalize``), or matplotlib's ``mkdtemp`` folder with
    ``atexit.register(shutil.rmtree, ...)``. The first run's exit removed them, and every later run failed for as
    long as the version served, where ``python main.py`` removes them once, at its own end (the python-models
    hunt). The parent's finalizers are all left out of a run's exit (they are the parent's objects; a run's own
    stay), and of its atexit functions those that remove files."""
    weakref = sys.modules.get("weakref")
    if weakref is not None:
        for finalizer in list(getattr(weakref.finalize, "_registry", ())):  # (no public list of them)
            finalizer.atexit = False
    for func in _preload_removers:
        atexit.unregister(func)


def note_preload_removers() -> None:
    """Tell apart, once the preloads are done, their exit functions that remove files (see :func:`_removes_files`,
    which reads code objects): each run then only unregisters them."""
    _preload_removers[:] = [func for func in _preload_exit_functions if _removes_files(func)]


# Names whose call in an exit function's code (its own, or a function it defines) says it removes files: a library's
# clean-up of what it made at import, written as a function of its own (a lambda or def around shutil.rmtree, a
# context's __exit__ that deletes a file extracted from a zipped package, as certifi's exit_cacert_ctx).
REMOVING_NAMES = frozenset({"rmtree", "unlink", "rmdir", "removedirs", "cleanup", "__exit__"})


def _removes_files(func: object) -> bool:
    """Whether the exit function ``func`` (or the function a ``functools.partial`` or bound method holds) removes
    files or folders: one of the standard library's removers, a temporary file's, folder's or exit stack's method,
    a path's ``unlink`` or ``rmdir``, or code that calls one of :data:`REMOVING_NAMES`.

    Recognised by what it is, not run: a library's exit function that only flushes what its process recorded
    (sentry's, a profiler's) must still run at each run's end, as at ``python main.py``'s."""
    target = getattr(func, "func", func)
    owner = getattr(target, "__self__", None)
    target = getattr(target, "__func__", target)
    removers: list[object] = [os.remove, os.unlink, os.rmdir, os.removedirs]
    owners: list[type] = []
    if "shutil" in sys.modules:
        removers.append(sys.modules["shutil"].rmtree)
    if "tempfile" in sys.modules:
        tempfile = sys.modules["tempfile"]
        owners += [tempfile.TemporaryDirectory, getattr(tempfile, "_TemporaryFileWrapper", tempfile.TemporaryDirectory)]
    if "contextlib" in sys.modules:
        owners.append(sys.modules["contextlib"].ExitStack)
    if any(target is remover for remover in removers) or (owner is not None and isinstance(owner, tuple(owners))):
        return True
    if "pathlib" in sys.modules and isinstance(owner, sys.modules["pathlib"].PurePath):
        return getattr(target, "__name__", "") in ("unlink", "rmdir")
    code = getattr(target, "__code__", None)
    if not isinstance(code, types.CodeType):
        return False
    names = getattr(target, "__globals__", None)
    bound = _OsBindings()
    bound.add_values(_values_of_locals(target, code))
    return _calls_a_removal(code, names if isinstance(names, dict) else {}, bound)


# ``remove`` only as ``os``'s: an attribute of what holds the os module, or a name that holds os.remove (or unlink),
# told by what each name holds: a global by the function's globals (``os.remove``, ``import os as o``, ``from os import
# remove as rm``), a local or cell by the import that bound it in the code (``import os`` inside the function), a
# default or a closure's cell by its value. A list's ``pending.remove(item)``, a user's own global named remove, or a
# parameter named os that is a list, is none (each was taken for one, and the flusher around it skipped, its data
# lost; the review hunts).
class _OsBindings:
    """The local and cell names known to hold the os module, or os.remove / os.unlink."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.removers: set[str] = set()

    def add_values(self, values: dict[str, object]) -> None:
        """Names bound to these values (defaults, closure cells): each told by what it is."""
        for name, value in values.items():
            if value is os:
                self.modules.add(name)
            elif value is os.remove or value is os.unlink:
                self.removers.add(name)

    def with_imports_of(self, instructions: list[dis.Instruction]) -> "_OsBindings":
        """These, and the names a code object's own import statements (its ``instructions``) bind to os
        (``import os as o``) or to its remove or unlink (``from os import remove as rm``)."""
        bound = _OsBindings()
        bound.modules, bound.removers = set(self.modules), set(self.removers)
        for index, instruction in enumerate(instructions):
            if instruction.opname != "IMPORT_NAME" or instruction.argval.partition(".")[0] != "os":
                continue
            following = instructions[index + 1:index + 2]
            if following and following[0].opname.startswith("STORE_"):
                bound.modules.add(following[0].argval)  # (import os, import os as o, import os.path: os)
            step = index + 1
            while step + 1 < len(instructions) and instructions[step].opname == "IMPORT_FROM":
                if instructions[step].argval in ("remove", "unlink") and \
                        instructions[step + 1].opname.startswith("STORE_"):
                    bound.removers.add(instructions[step + 1].argval)
                step += 2
        return bound


def _values_of_locals(function: object, code: types.CodeType) -> dict[str, object]:
    """What a function's defaults and closure cells hold, by the local or free name they bind."""
    values: dict[str, object] = {}
    defaults = getattr(function, "__defaults__", None) or ()
    positional = code.co_varnames[:code.co_argcount]
    values.update(zip(positional[len(positional) - len(defaults):], defaults))
    values.update(getattr(function, "__kwdefaults__", None) or {})
    for name, cell in zip(code.co_freevars, getattr(function, "__closure__", None) or ()):
        try:
            values[name] = cell.cell_contents
        except ValueError:  # (an empty cell)
            continue
    return values


def _calls_a_removal(code: types.CodeType, names: dict[str, object], bound: _OsBindings) -> bool:
    """Whether ``code``, or a function defined in it, names one of :data:`REMOVING_NAMES` or loads ``os``'s
    ``remove`` (``names``: the function's globals; ``bound``: its locals and cells known to hold os or its
    removers, to which the code's own imports are added)."""
    instructions = _plain_instructions(dis.get_instructions(code))  # (read once: both looks below go over them)
    bound = bound.with_imports_of(instructions)
    if REMOVING_NAMES.intersection(code.co_names) or _loads_os_remove(instructions, names, bound):
        return True
    return any(_calls_a_removal(const, names, bound) for const in code.co_consts if isinstance(const, types.CodeType))


def _plain_instructions(instructions: collections.abc.Iterable[dis.Instruction]) -> list[dis.Instruction]:
    """``instructions`` with the fast-local variants of 3.12 and 3.13 as 3.11's LOAD_FAST and STORE_FAST, which
    the looks for os.remove read: LOAD_FAST_CHECK and LOAD_FAST_AND_CLEAR as LOAD_FAST, a pair
    (LOAD_FAST_LOAD_FAST ('a', 'b'), STORE_FAST_LOAD_FAST, STORE_FAST_STORE_FAST) as its two (the 3.12/3.13
    hunt: an exit function holding os.remove in a local went unrecognised there)."""
    plain = []
    for instruction in instructions:
        parts = instruction.opname.split("_FAST_")
        if len(parts) == 2 and parts[1] in ("LOAD_FAST", "STORE_FAST") and isinstance(instruction.argval, tuple):
            plain.append(instruction._replace(opname=parts[0] + "_FAST", argval=instruction.argval[0]))
            plain.append(instruction._replace(opname=parts[1], argval=instruction.argval[1]))
        elif instruction.opname.startswith("LOAD_FAST"):
            plain.append(instruction._replace(opname="LOAD_FAST"))
        else:
            plain.append(instruction)
    return plain


def _loads_os_remove(instructions: list[dis.Instruction], names: dict[str, object], bound: _OsBindings) -> bool:
    """Whether a code object itself (its ``instructions``) loads os.remove (or os.unlink): a name that holds it, or
    the attribute ``remove`` of a name that holds the os module (a global told by ``names``, a local or cell by
    ``bound``)."""
    removers = (os.remove, os.unlink)
    local = ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE")
    previous = None
    for instruction in instructions:
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            if any(names.get(instruction.argval) is remover for remover in removers):
                return True
        elif instruction.opname in local and instruction.argval in bound.removers:
            return True
        elif (instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and instruction.argval == "remove"
              and previous is not None
              and (names.get(previous.argval) is os if previous.opname in ("LOAD_GLOBAL", "LOAD_NAME")
                   else previous.opname in local and previous.argval in bound.modules)):
            return True
        previous = instruction
    return False


# The functions that set a module's global random state, by module: a seed() with a seed that is not None seeds
# it; seed() without one, or a state setter after it, leaves it as random as before (see SeedWatch).
SEEDERS = {"random": ("seed", "setstate"), "numpy.random": ("seed", "set_state")}
# Where numpy draws a new generator's seed from the OS (SeedSequence(None)): looked up at each call, so a wrapper
# sees every entropy drawn (see SeedWatch.entropies).
NUMPY_ENTROPY = types.SimpleNamespace(module="numpy.random.bit_generator", function="randbits")


class SeedWatch:
    """While entered, records which of :data:`SEEDERS`' modules a preloaded import seeds explicitly (a project
    package's ``random.seed(123); np.random.seed(123)`` for reproducible runs): ``seeded``.

    Each module's seeding functions are wrapped where it is already imported,
    and as it is imported otherwise (a finder first on ``sys.meta_path``): no
    module is imported for the watch. The wrappers are taken away on exit; one
    that an import kept (``from random import seed``) still seeds, and records
    nothing any more.
    """

    def __init__(self) -> None:
        self.seeded: set[str] = set()
        # Generator objects seeded from the OS, by id: random.Random instances (their last seed() had no seed),
        # and the entropies numpy drew for new generators (see _keep_fresh_generators).
        self.fresh_randoms: dict[int, object] = {}
        self.entropies: set[int] = set()
        self._wrapped: list[tuple[object, str, object]] = []
        self._active = False

    def __enter__(self) -> SeedWatch:
        self._active = True
        for name in (*SEEDERS, NUMPY_ENTROPY.module):
            if name in sys.modules:
                self._wrap(sys.modules[name])
        sys.meta_path.insert(0, self)  # type: ignore[arg-type]
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._active = False
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # type: ignore[arg-type]
        for module, attribute, original in reversed(self._wrapped):
            setattr(module, attribute, original)
        self._wrapped.clear()

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        """None for every module (the other finders find it); a watched one's loader wraps its seeders once it
        has run the module."""
        if (fullname not in SEEDERS and fullname != NUMPY_ENTROPY.module) or not self._active:
            return None
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)  # type: ignore[arg-type]
        except BaseException:  # noqa: BLE001 - the import itself reports it, through the other finders
            return None
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return None

        def exec_then_watch(module: types.ModuleType) -> None:
            exec_module(module)
            if self._active:
                self._wrap(module)

        loader.exec_module = exec_then_watch  # (this module's own loader)
        return spec

    def _wrap(self, module: types.ModuleType) -> None:
        if module.__name__ == NUMPY_ENTROPY.module:  # (no global state: where new generators draw their seeds)
            self._replace(module, NUMPY_ENTROPY.function, self._entropy_recording)
            return
        for attribute in SEEDERS[module.__name__]:
            self._replace(module, attribute, functools.partial(self._recording, module.__name__, attribute))
        generator = getattr(module, "Random", None) if module.__name__ == "random" else None
        if isinstance(generator, type):  # its instances' own seeding, as the module's global one is watched
            for attribute in ("seed", "setstate"):
                self._replace(generator, attribute, functools.partial(self._instance_recording, attribute))

    def _replace(self, owner: object, attribute: str,
                 wrapper: collections.abc.Callable[[collections.abc.Callable], collections.abc.Callable]) -> None:
        original = getattr(owner, attribute, None)
        if callable(original):
            setattr(owner, attribute, wrapper(original))
            self._wrapped.append((owner, attribute, original))

    def _instance_recording(self, attribute: str, original: collections.abc.Callable) -> collections.abc.Callable:
        def seeder(generator: object, *args: object, **kwargs: object) -> object:
            if self._active:
                if attribute == "seed" and _seed_given(args, kwargs) is None:
                    self.fresh_randoms[id(generator)] = generator  # drawn from the OS: afresh in each run
                else:
                    self.fresh_randoms.pop(id(generator), None)  # as the import seeded it, in each run
            return original(generator, *args, **kwargs)

        functools.update_wrapper(seeder, original)
        return seeder

    def _entropy_recording(self, original: collections.abc.Callable) -> collections.abc.Callable:
        def randbits(*args: object, **kwargs: object) -> object:
            entropy = original(*args, **kwargs)
            if self._active and isinstance(entropy, int):
                self.entropies.add(entropy)
            return entropy

        functools.update_wrapper(randbits, original)
        return randbits

    def _recording(self, name: str, attribute: str, original: collections.abc.Callable) -> collections.abc.Callable:
        def seeder(*args: object, **kwargs: object) -> object:
            if self._active:
                # seed(x) seeds; seed() draws from the OS again; a set_state after it is most often a library
                # putting back the state it saved before seeding for its own use (state = get_state(); seed(0);
                # ...; set_state(state)), which leaves the global state as random as before: not seeded.
                if attribute == "seed" and _seed_given(args, kwargs) is not None:
                    self.seeded.add(name)
                else:
                    self.seeded.discard(name)
            return original(*args, **kwargs)

        functools.update_wrapper(seeder, original)
        return seeder


def _seed_given(args: tuple, kwargs: dict) -> object:
    """The seed a ``seed()`` call was given (``random``'s ``a``, numpy's ``seed``): None for one drawn from the OS
    (``seed(version=2)`` too)."""
    return args[0] if args else kwargs.get("a", kwargs.get("seed"))


def _keep_fresh_generators(watch: SeedWatch) -> None:
    """Keep the generator objects the preloaded imports made and seeded from the OS (``random.Random()``,
    ``np.random.default_rng()``, ``RandomState()`` at a module's top level), to be seeded afresh in each run.

    Found by a bug hunt: every run forked from the parent drew the same numbers from them (sympy's ``randprime``
    gave one prime), where each ``python main.py`` draws them afresh. One seeded explicitly (``Random(0)``,
    ``default_rng(42)``) is left as the preload left it, as ``python main.py`` would have it. The module globals
    ``random`` and ``numpy.random`` use are not among them (see :func:`reseed_random_state`).
    """
    global _fresh_generators
    random = sys.modules.get("random")
    randoms = [g for g in watch.fresh_randoms.values() if g is not getattr(random, "_inst", None)]
    bit_generators = []
    numpy_random = sys.modules.get("numpy.random")
    entropies = set(watch.entropies)
    try:
        global_seeds = numpy_random.mtrand._rand._bit_generator.seed_seq  # type: ignore[union-attr]
        entropies.discard(global_seeds.entropy)
    except Exception:  # noqa: BLE001 - no numpy, or one laid out otherwise: nothing to leave out
        global_seeds = None
    if entropies and numpy_random is not None:
        # Found once, at the parent's start (a pass over the objects the collector tracks: tens of ms after
        # heavy imports), and only when a generator beside numpy's global one drew its seed from the OS.
        kind = getattr(sys.modules.get(NUMPY_ENTROPY.module), "BitGenerator", None)
        if isinstance(kind, type):
            for found in gc.get_objects():
                # type(), not isinstance(): that reads __class__, which a lazy proxy computes (Django's settings:
                # configured, or raising, in the parent; found by the review of the change).
                if not issubclass(type(found), kind):
                    continue
                try:
                    seeds = found.seed_seq
                    if seeds is not global_seeds and getattr(seeds, "entropy", None) in entropies:
                        bit_generators.append(found)
                except Exception:  # noqa: BLE001 - a generator laid out otherwise: left as it is
                    continue
    _fresh_generators = (randoms, bit_generators)


def _reseed_fresh_generators() -> None:
    """Seed the generators :func:`_keep_fresh_generators` kept from the OS again, in this run."""
    randoms, bit_generators = _fresh_generators
    for generator in randoms:
        try:
            generator.seed()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - a subclass whose seed() needs more: left as it was
            pass
    for bit_generator in bit_generators:
        try:
            bit_generator.state = type(bit_generator)().state  # (a new one of its kind draws from the OS)
        except Exception:  # noqa: BLE001 - a kind that cannot be made so: left as it was
            pass


def _keep_seeded_states(seeded: set[str]) -> None:
    """Keep the global random state of each module in ``seeded`` as the preload left it, for every run."""
    global _seeded_random_state
    random = sys.modules.get("random") if "random" in seeded else None
    try:
        _seeded_random_state = (random.getstate() if random is not None else None,  # type: ignore[union-attr]
                                "numpy.random" in seeded)
    except Exception:  # noqa: BLE001 - a random module without getstate: drawn afresh, as before
        _seeded_random_state = (None, "numpy.random" in seeded)


def _script_module(path: str) -> types.ModuleType:
    """A ``__main__`` module as ``python main.py`` makes it for ``path``, not yet run."""
    module = types.ModuleType("__main__")
    _name_script_module(module, path)
    return module


def _name_script_module(module: types.ModuleType, path: str) -> None:
    # The globals python main.py gives its __main__ (code reading __annotations__ without annotations of its
    # own, typing.get_type_hints on the module, or __cached__, fails without them).
    module.__file__, module.__cached__, module.__annotations__ = path, None, {}
    module.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    module.__builtins__ = __builtins__


def _submodule_to_import(name: str) -> bool:
    """Whether ``from package import attribute`` (``name`` is ``package.attribute``) imports a submodule: the
    package is imported and has no such attribute. Asking may run the package's own ``__getattr__`` (a lazy
    package imports there), which may raise or initialise CUDA, as main.py's ``from`` statement would."""
    package, _, attribute = name.rpartition(".")
    module = sys.modules.get(package)
    return module is not None and not hasattr(module, attribute)


def _no_such_name(name: str) -> str:
    """The start-up answer for main.py's ``from package import attribute`` (``name`` is ``package.attribute``)
    when the package has neither that attribute nor a submodule of that name: ``python main.py`` stops there with
    an ImportError on every run, as at one of its imports that fails (only main.py's leading ``from`` statements
    are asked; a hunt found a misspelt name passing the load and every request failing)."""
    package, _, attribute = name.rpartition(".")
    return (f"broken {ENTRY_FILE} imports '{attribute}' from '{package}', which fails to import (ImportError: "
            f"cannot import name '{attribute}' from '{package}': neither a name the package defines nor a "
            "submodule of it)")


def _preload_failure(name: str, err: BaseException, imports: list[str]) -> str:
    """The start-up answer for ``name`` failing to import: ``broken`` for one of main.py's own imports,
    ``fallback`` for the other preloads (a submodule a ``from`` statement takes included: main.py's own run says
    what is wrong with it, if anything)."""
    text = f"{type(err).__name__}: {err}".replace("\n", " ")[:500]
    if name in imports:
        return f"broken {ENTRY_FILE} imports '{name}', which fails to import ({text})"
    return f"fallback preloading '{name}' failed ({text})"


def cuda_initialised() -> bool:
    """True when the CUDA driver loaded into this process has been initialised (``cuInit`` ran), found out
    without initialising it.

    A child forked after ``cuInit`` cannot use CUDA ("cannot re-initialize
    CUDA in forked subprocess", CUDA_ERROR_NOT_INITIALIZED), so the model must
    run cold. Only a driver some import loaded is asked: ``libcuda.so*`` mapped
    into this process, opened again with ``RTLD_NOLOAD``, which never loads a
    library. Before ``cuInit`` every other driver call returns
    CUDA_ERROR_NOT_INITIALIZED (NVIDIA's driver API, "Initialization");
    ``cuDeviceGetCount`` is a harmless one. Any other answer means ``cuInit``
    ran here. A failed one counts too: a child would inherit the parent's
    attempt instead of making its own, as a fresh interpreter does.
    """
    # Not libcudart (the runtime, which loads the driver when it needs it: then the driver is mapped too).
    for path in _mapped_libraries("libcuda.so"):
        try:
            device_count = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL).cuDeviceGetCount
        except (OSError, AttributeError):
            continue  # unloaded since maps was read, or a file so named that is not the driver
        device_count.restype = ctypes.c_int
        device_count.argtypes = [ctypes.POINTER(ctypes.c_int)]
        if device_count(ctypes.byref(ctypes.c_int())) != CUDA_ERROR_NOT_INITIALIZED:
            return True
    return False


def _mapped_libraries(prefix: str) -> list[str]:
    """The paths of the libraries mapped into this process whose file name starts with ``prefix``; [] without
    /proc."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return []
    paths: dict[str, None] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6 and fields[5].startswith("/") and os.path.basename(fields[5]).startswith(prefix):
            paths[fields[5]] = None
    return list(paths)


def jax_backends() -> list[str]:
    """The platforms of the JAX backends initialised in this process (``["cpu"]``), found out without importing
    jax: [] when it is not imported.

    A JAX backend (XLA's client) runs thread pools that a forked child does
    not have: the child's first compile or parallel operation waits for them
    forever (jax itself warns that fork "will likely lead to a deadlock").
    Importing jax initialises none; the first array or jit call does.
    """
    bridge = sys.modules.get("jax._src.xla_bridge")
    try:
        backends = vars(bridge).get("_backends") if bridge is not None else None
    except TypeError:  # not a module with a __dict__
        return []
    return [str(platform) for platform in backends] if isinstance(backends, dict) else []


def openmp_pool_hangs() -> str | None:
    """The path of a GNU OpenMP library (``libgomp*``) mapped into this process whose parallel region hangs in a
    forked child, found out by forking one; None when none does (or none is mapped, the common case: then
    nothing is forked).

    libgomp keeps the threads of its first parallel region for the next ones
    and registers no fork handler: a child forked after a region ran believes
    it has them, and its next region waits for them forever. The probe child
    runs an empty region (libc's ``free(NULL)`` on 2 threads, no Python)
    through each mapped libgomp, writing a byte after each; one that has not
    ended within :data:`OPENMP_PROBE_S` is killed, and the library it had
    reached is the answer. A parent whose pool never started, or only ever ran
    one thread, takes a few ms (the fork, a thread started in the child).
    """
    regions = []
    for path in _mapped_libraries("libgomp"):
        try:
            region = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL).GOMP_parallel
        except (OSError, AttributeError):
            continue  # unloaded since maps was read, or a file so named that is not libgomp
        region.restype = None
        region.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        regions.append((path, region))
    if not regions:
        return None
    free = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p)
    done, progress = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the probe: it flushes nothing and runs no exit handlers
        status = 1
        try:
            os.close(done)
            _die_with_parent(parent)
            for _, region in regions:
                region(free, None, 2, 0)
                os.write(progress, b".")
            status = 0
        finally:
            os._exit(status)
    os.close(progress)
    try:
        reached, ended = _count_until_end(done, time.monotonic() + OPENMP_PROBE_S)
    finally:
        os.close(done)
    if not ended:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if ended and reached == len(regions) and os.waitstatus_to_exitcode(status) == 0:
        return None
    return regions[min(reached, len(regions) - 1)][0]  # (one that crashed the child fails every run's region too)


def _count_until_end(fd: int, deadline: float) -> tuple[int, bool]:
    """The bytes read from ``fd`` until its end or ``deadline``, and whether its end came first."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    count = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return count, False
        data = os.read(fd, 64)
        if not data:
            return count, True
        count += len(data)


class Runs:
    """The running children and the spare: their pidfds and sockets, and every descriptor the parent owns.

    One child is always forked ahead (the spare) and waits for its assignment,
    so that a request does not wait for ``fork``: the parent hands the request
    to the spare, answers with its pid, and only then forks the next spare.
    Each child still serves exactly one run.
    """

    def __init__(self, poller: select.poll, owned: set[int]) -> None:
        self.poller = poller
        self.owned = owned
        self.by_pidfd: dict[int, tuple[int, socket.socket]] = {}
        self.by_reply: dict[int, int] = {}  # reply socket fd -> pid
        # Runs reported ended, whose child is left unreaped until the server closes the reply socket (reply socket
        # fd -> pid, pidfd, reply socket).
        self.reported: dict[int, tuple[int, int, socket.socket]] = {}
        self.spare: tuple[int, int, socket.socket] | None = None  # pid, pidfd, assignment socket
        # Why the last spare could not be forked, as said in the log (None: the last one was): said once while it
        # lasts, not at every run (under a process limit that lasts, one line a run grew the log without end).
        self.spare_failure: str | None = None

    def fork_spare(self) -> None:
        """Fork the next child; it waits for a run on its assignment socket.

        Raises OSError, leaving no spare, when no child can be forked (a process
        limit reached, no memory): the caller decides what that costs.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _flush_io()  # (a preload's sys.stdout may be None, or closed, as python main.py allows)
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:
            run_spare(theirs, self.owned | {ours.fileno()}, parent)
        theirs.close()
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            ours.close()
            _kill_group(pid)
            os.waitpid(pid, 0)
            raise
        self.owned.update((pidfd, ours.fileno()))
        self.poller.register(pidfd, select.POLLIN)
        self.spare = (pid, pidfd, ours)

    def start(self, control: socket.socket) -> bool:
        """Receive one run request and hand it to the spare; False when the server is gone."""
        try:
            message, fds = _receive_fds(control, 4)
        except OSError:
            return False
        if not message:
            return False
        if len(fds) not in (3, 4):
            for fd in fds:
                os.close(fd)
            return True
        stdin_fd, output_fd, reply_fd, *folder_fd = fds  # the child's own: passed on, then closed here
        # Owned while held: a child forked meanwhile (a spare in place of a dead one) closes its copies.
        self.owned.update(fds)
        reply = socket.socket(fileno=reply_fd)
        try:
            pid, pidfd, assignments = self._assign(message, [stdin_fd, output_fd, *folder_fd])
        except OSError as err:
            # No child could be forked: this run fails, saying why; the parent serves on (it used to
            # exit here, and take the runs in progress with it).
            _send(reply, {"error": f"no child could be forked for the run: {err}", "errno": err.errno,
                          "strerror": err.strerror or str(err)})
            reply.close()
            self.owned.discard(reply_fd)
            return True
        finally:
            for fd in (stdin_fd, output_fd, *folder_fd):
                os.close(fd)
                self.owned.discard(fd)
        self.by_pidfd[pidfd] = (pid, reply)
        self.by_reply[reply_fd] = pid
        self.poller.register(reply_fd, select.POLLIN)
        _send(reply, {"pid": pid})
        # Only now may the child run it: the server knows the run started. Killed between the two, the parent
        # had a child running the batch that the server, never told, sent again to the next parent: the batch ran
        # twice (a full-suite run under load). A child that gets no go ends without running it.
        self.owned.discard(assignments.fileno())
        try:
            assignments.send(GO)
        except OSError:
            pass  # (the child died meanwhile: its end is reported as any run's)
        finally:
            assignments.close()
        self.try_fork_spare()  # while the run goes on
        return True

    def try_fork_spare(self) -> None:
        """Fork the spare ahead; when that fails, the next run forks its own child (or fails saying why)."""
        try:
            self.fork_spare()
        except OSError as err:
            if str(err) != self.spare_failure:
                print(f"nereid warm parent: cannot fork a spare child now ({err}); the next run forks its own "
                      "(said once while it lasts)", file=sys.stderr, flush=True)
            self.spare_failure = str(err)
        else:
            self.spare_failure = None

    def _assign(self, message: bytes, fds: list[int]) -> tuple[int, int, socket.socket]:
        """Give the run to the spare (forking one if there is none or it died); its pid, pidfd and the socket its
        go is sent on (see :data:`GO`)."""
        for _ in range(2):
            if self.spare is None:
                self.fork_spare()
            assert self.spare is not None
            pid, pidfd, assignments = self.spare
            self.spare = None
            try:
                socket.send_fds(assignments, [message], fds)
                return pid, pidfd, assignments
            except OSError:
                self.owned.discard(assignments.fileno())
                assignments.close()
                self.retire(pid, pidfd)  # the spare died (killed from outside): fork another
        raise OSError("the children forked for it died before it could be handed over")

    def retire(self, pid: int, pidfd: int) -> None:
        """End and reap a child that has no run (a dead spare, or the spare at shutdown)."""
        _kill_group(pid)
        os.waitpid(pid, 0)
        self.poller.unregister(pidfd)
        os.close(pidfd)
        self.owned.discard(pidfd)

    def exited(self, pidfd: int) -> None:
        """A child's pidfd fired: report a run's end, or replace a spare that died."""
        if self.spare is not None and pidfd == self.spare[1]:
            pid, _, assignments = self.spare
            self.spare = None
            self.owned.discard(assignments.fileno())
            assignments.close()
            self.retire(pid, pidfd)
            self.try_fork_spare()
            return
        pid, reply = self.by_pidfd.pop(pidfd)
        _kill_group(pid)
        # Not reaped yet (WNOWAIT): the server may signal the run's group until it has read the status, and a
        # zombie keeps the group's id from being reused by then.
        returncode = _returncode(os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT))
        self.poller.unregister(pidfd)
        if self.by_reply.pop(reply.fileno(), None) is None:  # the server had closed it already (a timeout)
            self.sweep_orphans()
            self._reap(pid, pidfd, reply)
            return
        self.reported[reply.fileno()] = (pid, pidfd, reply)  # still registered: it fires when the server closes it
        self.sweep_orphans()
        _send(reply, {"status": returncode})

    def closed(self, reply_fd: int) -> None:
        """The server closed the reply socket of a run reported ended: it lists the group no more, so reap."""
        pid, pidfd, reply = self.reported.pop(reply_fd)
        self.poller.unregister(reply_fd)
        self._reap(pid, pidfd, reply)

    def _reap(self, pid: int, pidfd: int, reply: socket.socket) -> None:
        os.waitpid(pid, 0)
        os.close(pidfd)
        self.owned.discard(pidfd)
        self.owned.discard(reply.fileno())
        reply.close()

    def sweep_orphans(self) -> None:
        """Kill and reap every child that is neither a run nor the spare.

        This process is a child subreaper: a process a model detached from its
        group (``setsid`` then fork) is reparented here when its parent exits,
        instead of to init, and ends here with the run that left it behind.
        """
        known = {pid for pid, _ in self.by_pidfd.values()} | {pid for pid, _, _ in self.reported.values()}
        if self.spare is not None:
            known.add(self.spare[0])
        _end_children(but=known)

    def abandoned(self, reply_fd: int) -> None:
        """The server closed a reply socket before the child ended (its timeout): kill the group."""
        pid = self.by_reply.pop(reply_fd)
        self.poller.unregister(reply_fd)
        _kill_group(pid)  # its pidfd fires next; the reply then fails quietly

    def end_all(self) -> None:
        """Kill and reap every child, the spare and orphans included."""
        for pidfd, (pid, reply) in list(self.by_pidfd.items()):
            _kill_group(pid)
            os.waitpid(pid, 0)
            self._forget(pidfd, reply)
            reply.close()
        for reply_fd in list(self.reported):
            self.closed(reply_fd)
        if self.spare is not None:
            pid, pidfd, assignments = self.spare
            self.spare = None
            assignments.close()
            self.retire(pid, pidfd)
        self.sweep_orphans()

    def _forget(self, pidfd: int, reply: socket.socket) -> None:
        self.poller.unregister(pidfd)
        os.close(pidfd)
        self.owned.discard(pidfd)
        self.owned.discard(reply.fileno())
        if self.by_reply.pop(reply.fileno(), None) is not None:
            self.poller.unregister(reply.fileno())


def serve(control: socket.socket, lifeline: int) -> None:
    """Hand each request to a fresh child until the server goes away (``lifeline``: a descriptor of the pipe the
    server holds open while it wants this parent)."""
    poller = select.poll()
    poller.register(lifeline, select.POLLIN)
    poller.register(control.fileno(), select.POLLIN)
    runs = Runs(poller, {lifeline, control.fileno()})
    runs.try_fork_spare()
    try:
        while True:
            # One event per poll: handling one may close descriptors and open others under the same numbers
            # (a dead spare's pidfd, reused by the child forked for a run in its place), so the rest of the
            # batch would be taken for the new holder's (that run killed as if it had ended). The events
            # left are reported again by the next poll.
            fd, _ = poller.poll()[0]
            if fd == lifeline or (fd == control.fileno() and not runs.start(control)):
                return
            if fd in runs.by_pidfd or (runs.spare is not None and fd == runs.spare[1]):
                runs.exited(fd)
            elif fd in runs.by_reply:
                runs.abandoned(fd)
            elif fd in runs.reported:
                runs.closed(fd)
    finally:
        runs.end_all()


# What the parent sends a spare that has its run once the server knows the run started (see Runs.start).
GO = b"g"


def run_spare(assignments: socket.socket, parent_fds: set[int], parent: int) -> None:
    """In a forked spare: become a session leader, wait for a run, then run it; never returns."""
    code = 1
    try:
        os.setsid()
        _die_with_parent(parent)
        if _prctl is not None:
            # Orphans of this run's detached processes come to this run, not to the warm parent, whose
            # sweep after another run ends would kill them; they come on to it when this run ends.
            _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        for fd in parent_fds:
            if fd > 2:
                os.close(fd)
        message, fds = _receive_fds(assignments, 3)
        if not message or len(fds) not in (2, 3):
            os._exit(0)  # retired before it got a run
        if assignments.recv(len(GO)) != GO:
            os._exit(0)  # the parent died before it told the server the run started: the server sends it again
        assignments.close()
        request = json.loads(message)
        stdin_fd, output_fd, *folder_fd = fds
        code = run_child(request["env"], request["cwd"], stdin_fd, output_fd, exec_argv=request.get("exec"),
                         folder_fd=folder_fd[0] if folder_fd else None, exec_entry=bool(request.get("entry")))
    except BaseException:  # noqa: BLE001 - nothing may escape into a copy of the parent's loop
        traceback.print_exc()
    finally:
        _exit(code)


def _exit(code: int) -> None:
    """Leave as the interpreter would: C stdio flushed; a negative code dies of that signal."""
    if _fflush is not None:
        _fflush(None)  # os._exit skips libc's exit(), which flushes what C code printf'd or fwrite'd
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os._exit(128 - code)  # (the signal blocked: CPython's own fallback status, 130 for SIGINT)
    os._exit(code & 0xFF)


def run_child(env: dict[str, str], cwd: str, stdin_fd: int, output_fd: int,
              exec_argv: list[str] | None = None, folder_fd: int | None = None, exec_entry: bool = False) -> int:
    """Become the model process for one run: take its folder, stdin, output and environment, run ``main.py``.

    With ``exec_argv`` (a cold run) the child execs that program instead: a
    fresh interpreter that still dies with this parent and whose detached
    processes still come back to it; ``exec_entry``: with the number of a
    descriptor that holds the loaded main.py's bytes as its last argument
    (see ``cold_bootstrap.py``). ``folder_fd``: a descriptor of the loaded
    folder, entered rather than ``cwd`` (see :func:`enter_loaded_folder`).
    """
    os.dup2(stdin_fd, 0)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    for fd in (stdin_fd, output_fd):
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    # What the preloaded imports did to the environment, as importing them in main.py would.
    os.environ.update(_preload_environ[0])
    for name in _preload_environ[1]:
        os.environ.pop(name, None)
    if "tempfile" in sys.modules:
        sys.modules["tempfile"].tempdir = None  # computed again from this run's TMPDIR
    if folder_fd is None:
        cwd = enter_folder(cwd)
    else:
        try:
            cwd = enter_loaded_folder(cwd, folder_fd)
        except PermissionError as err:
            return report_folder_not_entered(err)
        os.close(folder_fd)  # not needed past the chdir: the working directory is the loaded folder
    if exec_argv:
        if exec_entry:
            exec_argv = [*exec_argv, str(entry_descriptor())]
        os.execv(exec_argv[0], exec_argv)  # keeps the process, its session and its parent-death signal
    if _preload_sigchld is not None:  # what a preloaded import made of SIGCHLD, as importing it in main.py would
        signal.signal(signal.SIGCHLD, _preload_sigchld)
    reseed_random_state()
    keep_parent_files_at_exit()
    return run_main(os.path.join(cwd, ENTRY_FILE))


def reseed_random_state() -> None:
    """Give the global random state of preloaded libraries what a fresh interpreter's imports give it: drawn
    afresh, or as a preloaded import seeded it.

    Python's ``random`` reseeds itself after a fork; numpy's legacy global
    state (``np.random.rand``, ``choice``, ``normal``; seeded from the OS once,
    in the parent, by a preloaded ``numpy.random``, ``scipy.stats`` or
    ``sklearn``) does not: every run would draw the same numbers. But a state
    a preloaded import seeded explicitly (``random.seed(123)`` in a project
    package's ``__init__``, see :class:`SeedWatch`) is what ``python main.py``
    starts with every time: each run gets it as the preload left it.
    """
    random_state, numpy_seeded = _seeded_random_state
    random = sys.modules.get("random")
    if random_state is not None and random is not None:
        random.setstate(random_state)  # (the fork's own reseed drew it afresh)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None and not numpy_seeded:  # (seeded: this child's copy is as the preload left it)
        try:
            numpy_random.seed()  # (no argument: from the OS's entropy)
        except Exception:  # a numpy too broken to reseed: main.py's own use of it will say so
            pass
    _reseed_fresh_generators()


def enter_loaded_folder(path: str, folder_fd: int) -> str:
    """Make the loaded model folder (``folder_fd``) this process's working directory; returns a path to it.

    ``path`` is where the server last saw the folder. The run's folder
    (``__file__``, ``sys.path``, tracebacks) is named by the loaded folder's
    physical path, as ``python main.py`` names it: never ``path`` itself, which
    may lead elsewhere by now (a folder deleted, or renamed, with a new one
    put under its name before the server has loaded that, must not lend the
    loaded code the new version's files), nor through a symlink (``current ->
    release-7``: ``os.path.dirname(__file__) == os.getcwd()`` holds, as in a
    cold run). Deleted: ``path`` marked ``(deleted)``, a path that leads nowhere
    (tracebacks then say where the code came from, which a /proc/self/fd path
    would not; the folder's files are gone either way).
    """
    os.fchdir(folder_fd)
    try:
        return os.getcwd()
    except OSError:
        return f"{path} (deleted)"  # only the working directory leads to it


def report_folder_not_entered(err: OSError) -> int:
    """Tell the server that this run's child could not enter the loaded folder (``err``): the line
    :data:`FOLDER_NOT_ENTERED_LINE` on the run's output; returns :data:`FOLDER_NOT_ENTERED_EXIT`, its exit status.
    Nothing of main.py has run."""
    _write_fd2(f"{FOLDER_NOT_ENTERED_LINE}{err.errno} {err.strerror}\n".encode())
    return FOLDER_NOT_ENTERED_EXIT


def enter_folder(path: str) -> str:
    """Make the model folder at ``path`` this process's working directory (no descriptor was sent with the
    run); returns the path it has now.

    ``path`` is where the server last saw the folder (a renamed folder moves on
    without a new parent). A run queued just before the folder was renamed or
    deleted finds nothing there: it stays in the working directory inherited
    from the parent, which is the loaded folder itself, wherever it now is, and
    so still serves (a deleted folder's files are gone, but main.py's code was
    compiled at load).
    """
    try:
        os.chdir(path)
        return os.getcwd()  # its physical path, as python main.py names it (see enter_loaded_folder)
    except OSError:
        try:
            return os.getcwd()  # the renamed folder's new path
        except OSError:
            return path  # deleted: only the loaded code remains


def compile_entry(path: str, source_file: str) -> None:
    """Compile ``source_file``'s bytes as ``path``, once, before any fork: every run executes that code.

    A loaded version is what runs, as long as it serves: a run that starts while
    ``main.py`` is being rewritten in place (an edit, before the repository
    watcher swaps in the new version), or after its folder was renamed and
    then edited, must not execute what is on disk now. A compile error is kept
    too, and reported by every run as ``python main.py`` would report it.
    """
    global _entry, _entry_source
    try:
        with open(source_file, "rb") as f:
            source = _entry_source = f.read()
        # dont_inherit: this module's own `from __future__ import annotations` must not become main.py's.
        _entry = (path, compile(source, path, "exec", dont_inherit=True),
                  importlib.util.decode_source(source).splitlines(True))  # (split once, before any fork)
    except BaseException as err:  # noqa: BLE001 - reported by each run, like the interpreter does
        # Without this function's frames: python main.py reports a compile error with no traceback, only
        # the error's own file, line and caret (the run that raises it adds only its own frame, dropped).
        _entry = (path, err.with_traceback(None), [])


def entry_descriptor() -> int:
    """An inheritable descriptor, at offset 0, of a file that holds the loaded main.py's bytes, for a cold run to
    read them: this parent's copy on disk may be gone (a /tmp cleaner) or rewritten since it started."""
    assert _entry is not None, "compile_entry() first"
    if _entry_source is None:  # this parent could not read it: why, as a warm run reports it
        raise _entry[1]  # type: ignore[misc]
    try:
        fd = os.memfd_create(ENTRY_FILE, 0)
    except (AttributeError, OSError):  # no memfd here: an unlinked temporary file (imported in this child only)
        import tempfile
        with tempfile.TemporaryFile() as copy:
            fd = os.dup(copy.fileno())
    view = memoryview(_entry_source)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(fd, True)
    return fd


def entry_code(path: str) -> types.CodeType | BaseException:
    """The loaded ``main.py``'s code (or why it did not compile), its tracebacks naming ``path``."""
    assert _entry is not None, "compile_entry() first"
    loaded_path, code, lines = _entry
    if lines:
        # A traceback quotes the lines of the code that ran, not of the file on disk now (an edit not yet
        # loaded): linecache never checks again an entry without an mtime.
        linecache.cache[path] = (sum(map(len, lines)), None, lines, path)
    if isinstance(code, BaseException) or path == loaded_path:
        return code
    return _renamed(code, path)  # the folder was renamed since: same code, new file name


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` and every function body in it with ``co_filename`` set to ``filename``."""
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def run_main(path: str) -> int:
    """Run ``path`` as ``__main__``, as ``python main.py`` would; returns the exit code.

    The working directory is ``path``'s folder as the run starts (see
    :func:`run_child`); the folder's entry on ``sys.path`` imports from that
    folder wherever it is by then (see :class:`LoadedFolderFinder`).
    """
    sys.argv = [ENTRY_FILE]
    sys.orig_argv = [*sys.orig_argv[:1], ENTRY_FILE]  # as a cold run has it: not this parent's command line
    folder = os.path.dirname(path)
    sys.path.insert(0, folder)
    finder = LoadedFolderFinder(folder, working_directory_identity())
    sys.path_importer_cache[folder] = finder
    # The module the preloaded imports saw as __main__ (one that kept a reference to it sees main.py's globals,
    # as with python main.py), named by this run's path.
    module = _main_module if _main_module is not None else types.ModuleType("__main__")
    _name_script_module(module, path)
    sys.modules["__main__"] = module
    _unshadow(folder)
    preloaded = len(sys.modules)  # modules imported from here on come after these (dicts keep order)
    try:
        code_object = entry_code(path)
        if isinstance(code_object, BaseException):
            raise code_object
        exec(code_object, module.__dict__)
        _flush_io()
        code = 0
        _forget_file(module)
    except SystemExit as exit_request:
        _flush_io()
        code = _exit_code(exit_request)
    except BaseException as err:  # noqa: BLE001 - reported like the interpreter does
        _flush_io()
        # Without this function's own frame: the traceback starts in main.py, as python main.py's does
        # (the hook prints the exception's own __traceback__, so that is what is trimmed).
        if err.__traceback__ is not None:
            err.__traceback__ = err.__traceback__.tb_next
        try:
            _report_uncaught(err)
        except SystemExit as exit_request:  # main.py's hook ended it: the interpreter exits by that, at once
            code = _exit_code(exit_request)
        else:
            # An uncaught KeyboardInterrupt ends CPython by SIGINT, which the server reports as such.
            code = -signal.SIGINT if isinstance(err, KeyboardInterrupt) else 1
            _forget_file(module)
    # What the interpreter does at exit, in its order: threading's own exit hooks first (concurrent.futures
    # wakes its idle workers there, so that a pool never shut down does not hold the exit: a module-level
    # ThreadPoolExecutor hung every run until timeout_s), then a join of the non-daemon threads, then atexit's.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    if not _flush_std_files() and code >= 0:
        code = 120  # what CPython exits with when its finalization fails, whatever main.py's exit status was
    # As CPython's shutdown does before it clears the modules: an object finalized then prints to the
    # interpreter's own streams, and a stream main.py put in their place is released (and closed) with it.
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
    # (A module found after the folder was renamed has its path under the new name.)
    folders = [folder, *([finder.root] if finder.root else [])]
    _release_model_modules(folders, [module, *itertools.islice(sys.modules.values(), preloaded, None)])
    _flush_files_left_open()
    # What the interpreter's own streams hold by now: written out as they are when CPython closes them
    # last, a failure ignored.
    for stream in (sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()  # type: ignore[union-attr]
        except BaseException:  # noqa: BLE001 - ignored, as CPython ignores it
            pass
    try:
        end_resource_tracker()
    except BaseException:  # noqa: BLE001 - the run's status stands; the group kill ends the tracker anyway
        pass
    return code


def end_resource_tracker() -> None:
    """Let the ``multiprocessing`` resource tracker this run started clean up as at ``python main.py``'s exit,
    waiting for it :data:`TRACKER_EXIT_WAIT_S` at most.

    The tracker (a process started on first use of a ``SharedMemory``, a
    named semaphore, a ``spawn`` or ``forkserver`` start) unlinks what was
    registered with it and never unlinked, with a ``UserWarning`` on the
    run's stderr, once the last holder of its pipe has closed it: the
    interpreter's exit, in ``python main.py``. Here the run's process group
    is killed as soon as the run ends, the tracker with it, before it had
    cleaned up: each run left its leaked ``/dev/shm`` segments behind for
    good. So the pipe is ended now (a ``forkserver``'s hold on it too), and
    the tracker awaited. A run that never started one pays a module lookup.
    """
    tracker = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if not isinstance(fd, int) or not isinstance(pid, int) or not _is_child(pid):
        return  # none started, or the warm parent's (inherited: not this run's to end)
    forkserver = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    alive = getattr(forkserver, "_forkserver_alive_fd", None)
    for held in (fd, alive):
        if isinstance(held, int):
            _to_devnull(held)
    _wait_for_child(pid, TRACKER_EXIT_WAIT_S)


def _is_child(pid: int) -> bool:
    """Whether ``pid`` is a child of this process, ended or not, and not reaped yet."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except OSError:  # ChildProcessError: another process's, or reaped by main.py's own os.wait()
        return False
    return True


def _to_devnull(fd: int) -> None:
    """Close what ``fd`` holds, leaving ``fd`` open on ``/dev/null``: a finalizer's late message to the tracker
    then goes nowhere, where a closed descriptor would have the tracker started again (or write into whatever
    took the number)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.dup2(null, fd, inheritable=False)
    except OSError:
        pass
    finally:
        os.close(null)


def _wait_for_child(pid: int, timeout_s: float) -> None:
    """Reap the child ``pid`` once it ends, ``timeout_s`` at most; one still running is left to the group kill."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        poller = select.poll()  # (not select.select: main.py may have left descriptors past FD_SETSIZE open)
        poller.register(pidfd, select.POLLIN)
        if poller.poll(timeout_s * 1000):
            os.waitpid(pid, os.WNOHANG)
    except OSError:
        pass  # reaped meanwhile (main.py set SIGCHLD to SIG_IGN)
    finally:
        os.close(pidfd)


def _report_uncaught(err: BaseException) -> None:
    """Print the uncaught ``err`` as the interpreter's ``PyErr_Print`` does: ``sys.last_*`` set, main.py's own
    ``sys.excepthook`` called (one that fails is reported, then ``err``; its ``SystemExit`` is raised, to end the
    run by), none missing said so. (cold_bootstrap's ``report`` does the same for cold runs: each is a program of
    its own.) A hook that raised or exited skipped the run's atexit functions, thread joins and flushes, and
    ended it with status 1 and this program's traceback (the warm-start hunt)."""
    sys.last_type, sys.last_value, sys.last_traceback = type(err), err, err.__traceback__
    hook = getattr(sys, "excepthook", None)
    if hook is not None and hook is not sys.__excepthook__:
        try:
            hook(type(err), err, err.__traceback__)
            return
        except SystemExit:
            raise
        except BaseException as hook_err:  # noqa: BLE001 - reported as the interpreter reports it
            hook_err.__traceback__ = hook_err.__traceback__.tb_next if hook_err.__traceback__ else None
            if hook_err.__context__ is err:  # the interpreter calls the hook with no exception being handled
                hook_err.__context__ = None
            _write_stderr("Error in sys.excepthook:\n")
            _print_exception(hook_err)
            _write_stderr("\nOriginal exception was:\n")
    elif hook is None:
        _write_stderr("sys.excepthook is missing\n")
    _print_exception(err)


def _print_exception(err: BaseException) -> None:
    """``err``'s traceback on ``sys.stderr`` (nothing when it is None, as the interpreter prints nothing then),
    its lines quoted through linecache, which holds the loaded main.py (see entry_code), not the file on disk
    as the interpreter's own hook reads them; a failure to write ignored, as the interpreter ignores it."""
    stderr = getattr(sys, "stderr", None)
    if stderr is None:
        return
    try:
        traceback.print_exception(type(err), err, err.__traceback__, file=stderr)
        stderr.flush()
    except BaseException:  # noqa: BLE001 - ignored, as the interpreter ignores it
        pass


def _write_stderr(text: str) -> None:
    try:
        sys.stderr.write(text)
    except BaseException:  # noqa: BLE001 - PySys_WriteStderr ignores it
        pass


def _forget_file(module: types.ModuleType) -> None:
    """Remove ``__file__`` and ``__cached__`` from ``__main__`` as the interpreter does once the script's code has
    ended (its exit functions and threads no longer find them), unless that was by ``SystemExit``."""
    for name in ("__file__", "__cached__"):
        module.__dict__.pop(name, None)


def _flush_io() -> None:
    """Flush ``sys.stderr`` then ``sys.stdout``, any failure ignored: what ``python main.py`` does as
    main.py's code ends, before it prints an uncaught exception or a ``sys.exit`` message."""
    for name in ("stderr", "stdout"):
        try:
            getattr(sys, name).flush()
        except BaseException:  # noqa: BLE001 - CPython clears it, whatever it is
            pass


def _flush_std_files() -> bool:
    """Flush ``sys.stdout`` and ``sys.stderr`` as CPython's shutdown does; False when either failed.

    A stream that is None or closed is left alone (a ``closed`` that cannot
    be read counts as open). ``sys.stdout``'s failure is reported as an
    unraisable exception (``Exception ignored in: <stream>``), ``sys.stderr``'s
    is not reported: the interpreter then exits with 120.
    """
    flushed = True
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        if stream is None or _is_closed(stream):
            continue
        try:
            stream.flush()
        except BaseException as err:  # noqa: BLE001 - any failure, KeyboardInterrupt and SystemExit too
            flushed = False
            if name == "stdout":
                if sys.version_info >= (3, 13):  # (Python/pylifecycle.c: flush_std_files says which stream)
                    _write_unraisable(_from_caller(err), None, "Exception ignored on flushing sys.stdout")
                else:
                    _write_unraisable(_from_caller(err), stream)
    return flushed


def _from_caller(err: BaseException) -> BaseException:
    """``err`` without the frame that caught it (this module's): its traceback starts where the interpreter's
    would, in what that frame called."""
    if err.__traceback__ is not None:
        err.__traceback__ = err.__traceback__.tb_next
    return err


def _is_closed(stream: object) -> bool:
    try:
        return bool(stream.closed)  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001 - CPython then takes the stream for open
        return False


def _write_unraisable(err: BaseException, obj: object, err_msg: str | None = None) -> None:
    """Report ``err`` as the interpreter reports an exception it cannot raise: through main.py's own
    ``sys.unraisablehook`` if it set one, else as the default hook prints it."""
    hook = getattr(sys, "unraisablehook", None)
    if hook is not None and hook is not sys.__unraisablehook__:
        try:
            hook(_unraisable_hook_args(err, obj, err_msg))
            return
        except BaseException as hook_err:  # noqa: BLE001 - CPython reports the hook's own failure
            err, obj, message = _from_caller(hook_err), hook, "Exception ignored in sys.unraisablehook"
    else:
        message = err_msg
    file = getattr(sys, "stderr", None)
    if file is None:
        return
    # The default hook's text (Python/errors.c: write_unraisable_exc_file); traceback's functions read main.py's
    # lines through linecache, which holds the loaded main.py (see entry_code).
    try:
        try:
            shown = repr(obj)
        except BaseException:  # noqa: BLE001 - as the default hook words it
            shown = "<object repr() failed>"
        if obj is not None:
            file.write(f"{message or 'Exception ignored in'}: {shown}\n")
        elif message:
            file.write(f"{message}:\n")
        if err.__traceback__ is not None:
            file.write("Traceback (most recent call last):\n")
            traceback.print_tb(err.__traceback__, file=file)
        kind = type(err)
        module = getattr(kind, "__module__", None)
        name = "<unknown>" if not isinstance(module, str) else (
            kind.__qualname__ if module in ("builtins", "__main__") else f"{module}.{kind.__qualname__}")
        try:
            text = str(err)
        except BaseException:  # noqa: BLE001 - as the default hook words it
            text = "<exception str() failed>"
        file.write(f"{name}: {text}\n")
        file.flush()
    except BaseException:  # noqa: BLE001 - a stream that fails here has nowhere else to report to
        pass


def _unraisable_hook_args(err: BaseException, obj: object, err_msg: str | None = None) -> object:
    """A ``sys.UnraisableHookArgs`` for ``err`` and ``obj``: of the interpreter's own type, which
    ``sys.__unraisablehook__`` requires (a hook of main.py's may hand it on). The type is not exposed:
    it is taken from an unraisable exception the interpreter reports itself."""
    caught: list[object] = []
    hook, sys.unraisablehook = sys.unraisablehook, caught.append

    class Unraisable:
        def __del__(self) -> None:
            raise RuntimeError

    try:
        Unraisable()  # its __del__'s exception: reported to the hook as the object is released
    finally:
        sys.unraisablehook = hook
    return type(caught[0])((type(err), err, err.__traceback__, err_msg, obj))  # type: ignore[call-arg]


def working_directory_identity() -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the working directory; None when it cannot be read."""
    return _identity(os.curdir)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


class LoadedFolderFinder(importlib.machinery.FileFinder):
    """The import finder of a run's model folder (or of a package folder in it): it finds and reads the
    folder's modules in the folder the run started in (its working directory then), whatever that folder is
    named by then.

    By its path alone, with the folder swapped for a new version by rename
    (``mv m .m.old && mv .m.new m``), a run of the loaded version that
    started just before the renames imported its helpers from the new
    version's folder (an old ``main.py`` with a new ``helper.py``), or found
    no folder between the two renames. While the working directory is still
    the loaded folder (main.py has not changed it), modules are looked up
    through it (by paths relative to it, which lead to the directory itself
    whatever it is named) and a source module's files are read through it
    (see :class:`LoadedFolderLoader`); each module is named by the
    folder's path (``path``, ``__file__``, tracebacks) while that path leads
    to the folder, by its new path once it was renamed. Otherwise it is an
    ordinary :class:`FileFinder` on ``path``. Being one, ``pkgutil`` and
    ``pkg_resources`` list and search the folder as they do any ``sys.path``
    entry.
    """

    def __init__(self, folder: str, identity: tuple[int, int] | None, inside: str = "") -> None:
        """``folder``: the loaded folder's path; ``identity``: the folder's (see
        :func:`working_directory_identity`); ``inside``: a package folder's path relative to the folder, for
        the finder of that package (its ``path`` is then ``folder/inside``)."""
        super().__init__(os.path.join(folder, inside) if inside else folder, *_LOADER_DETAILS)
        self._folder = folder
        self._identity = identity
        self._through = importlib.machinery.FileFinder(self.path, *_LOADER_DETAILS)
        self._through.path = os.path.join(os.curdir, inside) if inside else os.curdir  # (made absolute if given)
        self._root: str | None = None  # the folder's path the last module found here was named by

    @property
    def root(self) -> str | None:
        """The loaded folder's path the last module found through this finder was named by (None before)."""
        return self._root

    def _root_now(self) -> str:
        """The path to name the folder's modules by: the one the run started with while it leads to the
        folder, its path now once it was renamed (the old one, should it have been deleted)."""
        if _identity(self._folder) == self._identity:
            return self._folder
        try:
            return os.getcwd()
        except OSError:  # deleted: its files are gone, and the lookup through it finds none
            return self._folder

    def find_spec(self, fullname: str,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        """The spec of ``fullname`` in the loaded folder; None when it holds no such module."""
        if self._identity is None or working_directory_identity() != self._identity:
            return super().find_spec(fullname, target)  # main.py left the folder: by the path, as any entry
        spec = self._through.find_spec(fullname, target)
        if spec is None:
            return None
        root = self._root = self._root_now()
        here = os.path.join(os.curdir, "")

        def named(found: str) -> str:  # ./helper.py -> ROOT/helper.py
            return os.path.join(root, found[len(here):]) if found.startswith(here) else found

        loader = spec.loader
        kinds = (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader,
                 importlib.machinery.ExtensionFileLoader)
        if type(loader) in kinds:
            spec.origin = named(loader.path)  # (spec.origin was made absolute from the working directory's path)
            if type(loader) is importlib.machinery.SourceFileLoader:
                spec.loader = LoadedFolderLoader(fullname, spec.origin, root, self._identity)
            else:  # a bare .pyc, an extension: by the name
                spec.loader = type(loader)(fullname, spec.origin)
        if spec.submodule_search_locations is not None:  # a package (a namespace one too): found the same way
            locations = [named(location) for location in spec.submodule_search_locations]
            spec.submodule_search_locations[:] = locations
            for location in locations:
                if location.startswith(os.path.join(root, "")):
                    sys.path_importer_cache[location] = LoadedFolderFinder(root, self._identity,
                                                                           location[len(root) + 1:])
        return spec

    def invalidate_caches(self) -> None:
        """As ``importlib.invalidate_caches()`` asks of every cached finder."""
        super().invalidate_caches()
        self._through.invalidate_caches()


# The interpreter's own loaders by file suffix: what its FileFinder for a sys.path entry is made with.
_LOADER_DETAILS = (
    (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
    (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES),
    (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES),
)


class LoadedFolderLoader(importlib.machinery.SourceFileLoader):
    """A source module of the loaded folder, named by its path (``__file__``, tracebacks) but read, with its
    bytecode cache, through the working directory while that is still the folder (see
    :class:`LoadedFolderFinder`)."""

    def __init__(self, fullname: str, path: str, root: str, identity: tuple[int, int] | None) -> None:
        super().__init__(fullname, path)
        self._prefix = os.path.join(root, "")
        self._identity = identity
        self._in_folder: bool | None = None  # during get_code: whether the working directory is the folder

    def get_code(self, fullname: str) -> types.CodeType | None:
        """The module's code, from its source or its cached bytecode (the working directory looked at once)."""
        self._in_folder = working_directory_identity() == self._identity
        try:
            return super().get_code(fullname)
        finally:
            self._in_folder = None

    # Named as importlib's own frames are, so that the interpreter strips this one from a traceback with theirs:
    # a helper module's SyntaxError showed five frames of the import machinery (this one among them) between
    # main.py's line and the error, where `python main.py` shows none (found by a bug hunt). (A fault of its own
    # would be named so too, with this file's line numbers.)
    get_code.__code__ = get_code.__code__.replace(co_filename="<frozen importlib._bootstrap_external>")

    def _through_folder(self, path: str) -> str:
        in_folder = self._in_folder if self._in_folder is not None else working_directory_identity() == self._identity
        if in_folder and path.startswith(self._prefix):
            return path[len(self._prefix):]  # relative: through the working directory, the folder itself
        return path

    def get_data(self, path: str) -> bytes:
        """The file's bytes (the source, its cached bytecode, or a data file of its package) from the loaded
        folder."""
        return super().get_data(self._through_folder(path))

    def path_stats(self, path: str) -> dict:
        """The source's mtime and size, from the loaded folder (they validate its cached bytecode)."""
        return super().path_stats(self._through_folder(path))

    def set_data(self, path: str, data: bytes, *, _mode: int = 0o666) -> None:
        """Write the bytecode cache into the loaded folder's ``__pycache__``."""
        super().set_data(self._through_folder(path), data, _mode=_mode)


def _unshadow(folder: str) -> None:
    """Forget the modules this parent imported that a module in the model folder would hide.

    ``python main.py`` puts the folder first on ``sys.path``, so its ``json.py``
    is what ``import json`` finds, unless the interpreter itself had imported
    ``json`` before main.py ran. Here the parent imported it (for itself, or as
    a preload): the child drops it, and main.py's import finds the folder's.
    """
    try:
        with os.scandir(folder) as entries:
            # A module file of any kind import takes (a compiled extension or a .pyc too), or a regular package.
            local = {_module_name(entry.name) if entry.is_file() else entry.name for entry in entries
                     if (entry.is_file() and _module_name(entry.name) is not None)
                     or (entry.is_dir() and os.path.exists(os.path.join(entry.path, "__init__.py")))}
    except OSError:
        return
    hidden = [name for name in sys.modules
              if name.partition(".")[0] in local and name not in INTERPRETER_MODULES and name != "__main__"]
    for name in hidden:
        del sys.modules[name]


def _module_name(file_name: str) -> str | None:
    """The module a file of this name is to import (``fastops`` for ``fastops.cpython-311-x86_64-linux-gnu.so``);
    None when it is none."""
    for suffix in importlib.machinery.all_suffixes():
        if file_name.endswith(suffix) and len(file_name) > len(suffix):
            return file_name[:-len(suffix)]
    return None


def _release_model_modules(folders: list[str], run_modules: list[types.ModuleType]) -> None:
    """Clear the globals of ``__main__`` and of the model's own modules, as the interpreter's shutdown does.

    The child leaves through ``os._exit``, which finalizes nothing: without
    this, an output file that ``main.py`` opened into a global and never
    closed would lose its buffered bytes, where ``python main.py`` flushes and
    closes it at exit. ``run_modules``: ``__main__`` and the modules imported
    during the run; of those, only the model folder's own (under one of ``folders``, its paths) are cleared.
    """
    prefix = tuple(os.path.join(folder, "") for folder in folders)
    for module in reversed(run_modules):
        if module is not run_modules[0] and not str(getattr(module, "__file__", None) or "").startswith(prefix):
            continue
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict):
            # As CPython clears a module: its objects' finalizers may still read builtins.
            builtins = namespace.get("__builtins__")
            namespace.clear()
            if builtins is not None:
                namespace["__builtins__"] = builtins


def _flush_files_left_open() -> None:
    """Flush the files the run left open where clearing its own modules does not reach them (``np._out =
    open(...)``, ``sys._out``: a preloaded module's attribute), as the interpreter's shutdown does in clearing every
    module; their buffered bytes were lost (the warm-start hunt). The parent's own objects are frozen
    (``gc.freeze``), out of ``gc.get_objects``: what is looked at is what the run made and still holds."""
    for found in gc.get_objects():
        # type(), not isinstance(): that reads __class__, which a lazy proxy computes.
        if not issubclass(type(found), io.IOBase):
            continue
        try:
            if not found.closed and found.writable():
                found.flush()
        except BaseException:  # noqa: BLE001 - one that cannot be flushed loses its bytes, as at CPython's exit
            pass


# C long's range: CPython's exit status from sys.exit(n) is `(int)PyLong_AsLong(n)`, -1 when n is out of it.
_LONG_BITS = ctypes.sizeof(ctypes.c_long) * 8


def _exit_code(exit_request: SystemExit) -> int:
    """The exit status of ``python main.py`` ended by ``exit_request``, printing its message as CPython does
    (Python/pythonrun.c: _Py_HandleSystemExit)."""
    try:
        value = exit_request.code
    except BaseException:  # noqa: BLE001 - CPython prints the exception itself then
        value = exit_request
    if value is None:
        return 0
    if isinstance(value, int):
        if not -(1 << (_LONG_BITS - 1)) <= value < 1 << (_LONG_BITS - 1):
            if sys.version_info >= (3, 12):  # PyLong_AsLong's OverflowError is left set, reported at the finalization
                _write_unraisable(OverflowError("Python int too large to convert to C long"), None,
                                  "Exception ignored on threading shutdown" if sys.version_info >= (3, 13) else None)
            return 255
        return value & 0xFF
    stderr = getattr(sys, "stderr", None)
    if stderr is not None:
        try:
            stderr.write(str(value))
        except BaseException:  # noqa: BLE001 - CPython drops it, and still ends the line
            pass
    else:  # to the C-level stderr, as PyObject_Print writes it
        try:
            text = str(value)
        except BaseException:  # noqa: BLE001 - nothing printed then
            text = ""
        _write_fd2(text.encode("utf-8", "backslashreplace"))
    try:
        sys.stderr.write("\n")
    except BaseException:  # noqa: BLE001 - PySys_WriteStderr falls back to the C-level stderr
        _write_fd2(b"\n")
    return 1


def _write_fd2(data: bytes) -> None:
    try:
        os.write(2, data)
    except OSError:
        pass  # descriptor 2 closed by main.py: the interpreter's C-level write fails silently too


def _die_with_parent(parent: int) -> None:
    """SIGKILL this child when the warm parent dies (a crash or OOM kill must not orphan it)."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _find_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: the server still kills the group on timeout and unload


def _find_fflush():
    try:
        fflush = ctypes.CDLL(None).fflush
    except (OSError, AttributeError):
        return None
    fflush.argtypes = [ctypes.c_void_p]
    return fflush


def _children() -> list[int]:
    """This process's children, forked by any of its threads (a preloaded import's thread that started a process
    was left out, and it outlived the fallback; the review hunt): see :func:`_children_of`."""
    return _children_of(os.getpid())


def _children_of(pid: int) -> list[int]:
    """The children of ``pid``, forked by any of its threads (Linux lists them per thread), from /proc; [] where
    /proc cannot tell (``pid`` gone)."""
    children: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as f:
                children.extend(int(child) for child in f.read().split())
        except OSError:  # (a thread gone since the listing)
            continue
    return children


def _end_children(but: collections.abc.Collection[int] = ()) -> None:
    """Kill and reap every child of this process but those in ``but``, with their descendants."""
    for _ in range(MAX_SWEEPS):
        orphans = [pid for pid in _children() if pid not in but]
        if not orphans:
            return
        # With their descendants: a chain of detached processes (each setsid, then fork) would otherwise
        # come here one generation a round as each parent dies.
        for pid in [*orphans, *(d for orphan in orphans for d in _descendants(orphan))]:
            _kill_group(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in orphans:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children of each of its threads, and theirs), from /proc; [] where it cannot tell."""
    found: list[int] = []
    parents = [pid]
    while parents:
        children = _children_of(parents.pop())
        found.extend(children)
        parents.extend(children)
    return found


def _returncode(ended: os.waitid_result) -> int:
    """An ended child's status as ``Popen.returncode`` gives it: the exit code, or minus the signal."""
    return ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _receive_fds(sock: socket.socket, max_fds: int) -> tuple[bytes, list[int]]:
    """One message and the descriptors that came with it, each close-on-exec at once.

    Python makes every descriptor it opens non-inheritable, but not those
    received with SCM_RIGHTS: a run's pipes and reply socket would outlive an
    exec (a cold run's) in a process that was never meant to hold them. What a
    run is meant to have reaches it through dup2 onto 0, 1 and 2, which makes
    them inheritable again.
    """
    message, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, max_fds)
    for fd in fds:
        os.set_inheritable(fd, False)
    return message, fds


def _send(reply: socket.socket, message: dict) -> None:
    try:
        reply.send(json.dumps(message).encode())
    except OSError:
        pass  # the server stopped waiting for this run


_prctl = None
_fflush = None
# (variables set or changed, variables removed) by the preloaded imports.
_preload_environ: tuple[dict[str, str], list[str]] = ({}, [])
# The SIGCHLD disposition the preloaded imports set, when not the default (given back to each run's child).
_preload_sigchld: object = None
# main.py's path at load, its code or why not, and its lines (for tracebacks).
_entry: tuple[str, types.CodeType | BaseException, list[str]] | None = None
_entry_source: bytes | None = None  # main.py's bytes, as loaded (a cold run execs a fresh interpreter on them)
_main_module: types.ModuleType | None = None  # the __main__ the preloaded imports saw (see preload_as_script)
# Python random's state as a preloaded import seeded it (None: not seeded, drawn afresh in each run), and
# whether one seeded numpy's global state (see reseed_random_state).
_seeded_random_state: tuple[object, bool] = (None, False)
# The generator objects of the preloaded imports seeded from the OS: random.Random instances and numpy bit
# generators (see _keep_fresh_generators).
_fresh_generators: tuple[list[object], list[object]] = ([], [])


def main() -> int:
    global _prctl, _fflush, _preload_environ, _preload_sigchld
    _prctl = _find_prctl()  # looked up once, not in every child
    _fflush = _find_fflush()
    if _prctl is not None:
        _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of model processes come here, not to init
    control = socket.socket(fileno=int(sys.argv[1]))
    modules = json.loads(sys.argv[2])
    # The server reads one line from stdout, ours alone: a module that prints as it is imported (a banner,
    # with or without a newline) must not come first. Descriptor 1 is the log from here on; the answer goes
    # to a private copy of the pipe (not inheritable, and closed before any child is forked).
    answer = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    # The server's end of stdin, a private copy: a preloaded import that replaces or closes sys.stdin (as
    # python main.py allows) left the lifeline at end of file (or unreadable), and every run failed, READY.
    lifeline = os.dup(sys.stdin.fileno())
    # The folder's physical path, as python main.py computes sys.path[0] and __file__ (a symlinked folder is
    # named by what it leads to); the path the server named it by if the working directory has none.
    try:
        folder = os.getcwd()
    except OSError:
        folder = sys.argv[3]
    before = dict(os.environ)
    refusal = preload_as_script(folder, modules["imports"], modules["extra"], modules.get("submodules", []))
    after = dict(os.environ)
    _preload_environ = ({k: v for k, v in after.items() if before.get(k) != v}, [k for k in before if k not in after])
    # A preloaded import that ignores SIGCHLD (or handles it) would have the kernel reap this parent's children
    # before it waits on them: every run failed ("No child processes") while the model stayed READY. The parent
    # keeps the default; each run's child gets the import's disposition back.
    if signal.getsignal(signal.SIGCHLD) not in (signal.SIG_DFL, None):
        _preload_sigchld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # What the imports printed with C stdio (a library's printf), to the log now: its buffer would otherwise
    # be copied into every child, and written by each at its exit into its run's output. (Python's own
    # buffer is flushed before each fork.)
    if _fflush is not None:
        _fflush(None)
    if refusal is not None:
        # A process a preloaded import started (the reason to fall back, or left by a failed import) ends with
        # this parent: it outlived the fallback, the unload and the server, one more at each try (the read hunt).
        _end_children()
        _answer(answer, refusal)
        return 0
    compile_entry(os.path.join(folder, ENTRY_FILE), sys.argv[4])  # named as each run names it (enter_loaded_folder)
    note_preload_removers()
    gc.freeze()  # the preloaded objects stay out of the collector's reach, so children share their pages
    _answer(answer, "ready" + (f" {json.dumps({'warnings': _preload_warnings})}" if _preload_warnings else ""))
    serve(control, lifeline)
    return 0


def _answer(fd: int, line: str) -> None:
    """Write the start-up answer's one line to ``fd`` (the server's pipe), then close it."""
    data = f"{line}\n".encode()
    try:
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
