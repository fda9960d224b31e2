"""A cold run of a python model: a fresh interpreter that runs the ``main.py`` bytes its version loaded.

Execed by a model's warm parent as ``python cold_bootstrap.py FD`` (``FD``: an
inherited descriptor that holds the bytes of ``main.py`` the server read when it
loaded the model, see ``warm_parent.py``), with the model folder as working
directory. ``python main.py`` would run the file as it is on
disk now: an edit not loaded yet (or one whose reload failed) would serve in
place of the running version.

Everything else is as ``python main.py`` has it: ``sys.argv`` is
``['main.py']``, ``sys.path[0]`` the folder (as the interpreter computes it),
``__main__`` a fresh module named by the folder's ``main.py``; tracebacks and
warnings quote the loaded lines and start in ``main.py``; the interpreter's
own code ends the run (exit status, ``SystemExit``'s message, finalization,
death by SIGINT after an uncaught ``KeyboardInterrupt``). It is a program of
its own, standard library only, and leaves nothing of itself in ``sys.modules``,
``sys.path`` or ``sys.argv``. The exception: a ``multiprocessing`` child
started with the ``spawn`` method imports ``__main__`` again from
``__file__``, the file on disk.
"""

import sys

# What the interpreter has imported before main.py runs: those the bootstrap adds are candidates to forget.
INTERPRETER_MODULES = frozenset(sys.modules)

import atexit  # noqa: E402 - after the snapshot above
import builtins  # noqa: E402
import importlib.machinery  # noqa: E402
import io  # noqa: E402
import linecache  # noqa: E402
import os  # noqa: E402
import tokenize  # noqa: E402

ENTRY_FILE = "main.py"
# How long the interpreter's exit waits for multiprocessing's resource tracker (see end_resource_tracker).
TRACKER_EXIT_WAIT_S = 2.0
TRACKER_POLL_S = 0.002


def entry_path() -> str:
    """``__file__`` as ``python main.py`` sets it: the working directory's physical path (``getcwd``) joined
    with ``main.py``; ``main.py`` itself when the working directory has no path any more."""
    try:
        return os.path.join(os.getcwd(), ENTRY_FILE)
    except OSError:
        return ENTRY_FILE


def source_lines(source: bytes) -> list[str]:
    """``source`` decoded as the interpreter reads a source file (its encoding cookie or BOM, universal
    newlines), split into lines; [] when it does not decode."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
        text = io.IncrementalNewlineDecoder(None, True).decode(source.decode(encoding), final=True)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return []
    return text.splitlines(True)


def _forget_shadowed(folder: str) -> None:
    """Forget the modules this bootstrap imported that a module of the model folder would hide.

    ``python main.py`` has not imported ``linecache`` (or ``tokenize``...):
    its ``import linecache`` finds the folder's ``linecache.py`` if there is one.
    (warm_parent's ``_unshadow`` does the same for the warm parent: each is a
    program of its own, which imports nothing of the other.)
    """
    try:
        with os.scandir(folder) as entries:
            # A module file of any kind import takes, or a regular package (a namespace one hides nothing).
            local = {_module_name(entry.name) if entry.is_file() else entry.name for entry in entries
                     if (entry.is_file() and _module_name(entry.name) is not None)
                     or (entry.is_dir() and os.path.exists(os.path.join(entry.path, "__init__.py")))}
    except OSError:
        return
    for name in [n for n in sys.modules if n not in INTERPRETER_MODULES and n.partition(".")[0] in local]:
        del sys.modules[name]


def _module_name(file_name: str) -> str | None:
    """The module a file of this name is to import; None when it is none."""
    for suffix in importlib.machinery.all_suffixes():
        if file_name.endswith(suffix) and len(file_name) > len(suffix):
            return file_name[:-len(suffix)]
    return None


def main_module(path: str) -> object:
    """A fresh ``__main__`` with the globals ``python main.py`` gives it, in its order."""
    module = type(sys)("__main__")
    module.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    module.__annotations__ = {}  # (python 3.11 sets it even for a main.py without annotations)
    module.__builtins__ = builtins
    module.__file__ = path
    module.__cached__ = None
    return module


def report(err: BaseException) -> None:
    """Print the uncaught ``err`` (its traceback starting in main.py) as the interpreter's ``PyErr_Print`` does.

    The interpreter's own hook reads the lines it quotes from the file on disk;
    the ``traceback`` module reads them through linecache, which holds the loaded
    ones. A hook main.py set is called as the interpreter calls it.
    """
    sys.last_type, sys.last_value, sys.last_traceback = type(err), err, err.__traceback__
    hook = getattr(sys, "excepthook", None)
    if hook is not None and hook is not sys.__excepthook__:
        try:
            hook(type(err), err, err.__traceback__)
            return
        except SystemExit:
            raise  # the interpreter ends by it (Python/pythonrun.c: _PyErr_PrintEx)
        except BaseException as hook_err:  # noqa: BLE001 - reported as the interpreter reports it
            hook_err.__traceback__ = hook_err.__traceback__.tb_next if hook_err.__traceback__ else None
            if hook_err.__context__ is err:  # the interpreter calls the hook with no exception being handled
                hook_err.__context__ = None
            _write_stderr("Error in sys.excepthook:\n")
            _display(hook_err)
            _write_stderr("\nOriginal exception was:\n")
    elif hook is None:
        _write_stderr("sys.excepthook is missing\n")
    _display(err)


def _display(err: BaseException) -> None:
    stderr = getattr(sys, "stderr", None)
    if stderr is None:
        return  # the interpreter prints nothing then
    import traceback  # only now: python main.py that ends well has not imported it
    traceback.print_exception(type(err), err, err.__traceback__, file=stderr)
    try:
        stderr.flush()
    except BaseException:  # noqa: BLE001 - ignored, as the interpreter ignores it
        pass


def _write_stderr(text: str) -> None:
    try:
        sys.stderr.write(text)
    except BaseException:  # noqa: BLE001 - PySys_WriteStderr ignores it
        pass


def _flush_io() -> None:
    """Flush ``sys.stderr`` then ``sys.stdout``, failures ignored: what the interpreter does as the script's
    code ends, before it reports an uncaught exception."""
    for name in ("stderr", "stdout"):
        try:
            getattr(sys, name).flush()
        except BaseException:  # noqa: BLE001 - the interpreter clears it, whatever it is
            pass


def run(loaded: int) -> None:
    """Run the bytes the descriptor ``loaded`` holds as ``python main.py`` runs main.py; an uncaught exception
    is reported, then raised again for the interpreter to end by (see :func:`_hand_over`)."""
    with open(loaded, "rb") as f:  # closed: main.py's own first descriptor gets the number it would get
        source = f.read()
    path = entry_path()
    try:
        folder = os.path.dirname(os.path.realpath(path))  # as the interpreter computes sys.path[0] for a script
    except OSError:  # a deleted working directory (python main.py could not even open main.py there)
        folder = os.path.dirname(path)
    sys.argv[:] = [ENTRY_FILE]
    sys.orig_argv[1:] = [ENTRY_FILE]
    if not sys.flags.safe_path:
        sys.path[0] = folder  # this bootstrap's folder, which the interpreter put there
    _forget_shadowed(folder)
    lines = source_lines(source)
    if lines:
        # Warnings and tracebacks quote the loaded lines, not the file on disk now: linecache never checks
        # again an entry without an mtime.
        linecache.cache[path] = (len(source), None, lines, path)
    module = main_module(path)
    sys.modules["__main__"] = module
    # First registered, so last to run: after main.py's own exit functions and multiprocessing's (which joins
    # and ends the processes it started, each a holder of the tracker's pipe).
    atexit.register(end_resource_tracker)
    try:
        # dont_inherit: no future flag of this file's; the bytes' own encoding cookie is honoured.
        code = compile(source, path, "exec", dont_inherit=True)
        exec(code, module.__dict__)
    except SystemExit:
        raise  # no traceback is printed: the interpreter handles it as its own (message, exit status)
    except BaseException as err:  # noqa: BLE001 - reported like the interpreter does
        _flush_io()
        # Without this frame: the traceback starts in main.py, as python main.py's does (a compile error
        # has none of main.py's frames: only its own file, line and caret).
        err.__traceback__ = err.__traceback__.tb_next if err.__traceback__ else None
        report(err)
        _forget_file(module)
        _hand_over(err)
        raise
    _forget_file(module)


def end_resource_tracker() -> None:
    """Let the ``multiprocessing`` resource tracker this run started clean up before the interpreter exits,
    waiting for it :data:`TRACKER_EXIT_WAIT_S` at most: the last exit function (registered before main.py ran).

    The tracker unlinks what was registered with it and never unlinked (a
    leaked ``SharedMemory``), with a ``UserWarning`` on the run's stderr, once
    the last holder of its pipe has closed it: at the interpreter's exit, in
    ``python main.py``. Here the run's process group is killed as soon as the
    interpreter has exited, the tracker with it, before it had cleaned up. So
    the pipe is ended now (a ``forkserver``'s hold on it too: its own pipe
    ended), and the tracker awaited. (warm_parent's ``end_resource_tracker``
    does the same for warm runs.)
    """
    tracker = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if not isinstance(fd, int) or not isinstance(pid, int):
        return  # none started: the common case costs a lookup
    forkserver = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    alive = getattr(forkserver, "_forkserver_alive_fd", None)
    for held in (fd, alive):
        if isinstance(held, int):
            _to_devnull(held)
    _wait_for_child(pid)


def _to_devnull(fd: int) -> None:
    """Close what ``fd`` holds, leaving ``fd`` open on ``/dev/null``: a finalizer's late message to the tracker
    then goes nowhere, where a closed descriptor would have the tracker started again."""
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


def _wait_for_child(pid: int) -> None:
    """Reap the child ``pid`` once it ends, TRACKER_EXIT_WAIT_S at most (polled: ``select``, not imported
    here, could be a module of the model folder by now); one still running is left to the group kill."""
    import time  # (built in: no file of the folder can stand for it)
    deadline = time.monotonic() + TRACKER_EXIT_WAIT_S
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except OSError:  # not this process's child (reaped by main.py's own os.wait)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(TRACKER_POLL_S, left))


def _forget_file(module: object) -> None:
    """Remove ``__file__`` and ``__cached__`` from ``__main__`` as the interpreter does once the script's code has
    ended (its exit functions no longer find them), unless that was by ``SystemExit``."""
    for name in ("__file__", "__cached__"):
        module.__dict__.pop(name, None)


def _hand_over(err: BaseException) -> None:
    """Let the interpreter end the run by ``err`` (raised again from here): exit status 1, or death by SIGINT
    after finalization for a KeyboardInterrupt, 120 should flushing fail. Its report is already printed, so
    the hook it calls only puts back what the report left: ``sys.excepthook``, ``sys.last_*`` and ``err``'s
    traceback (which the raise extends with this bootstrap's frames)."""
    hook = sys.excepthook if hasattr(sys, "excepthook") else None
    trimmed = err.__traceback__

    def restore(kind: type, value: BaseException, traceback: object) -> None:
        if hook is None:
            del sys.excepthook
        else:
            sys.excepthook = hook
        value.__traceback__ = trimmed
        sys.last_traceback = trimmed

    sys.excepthook = restore


if __name__ == "__main__":
    run(int(sys.argv[1]))
