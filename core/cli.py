"""The ``nereid`` command: ``serve`` and ``check``, and the subcommands backends add (``bundle check``, ...)."""

from __future__ import annotations

import _thread
import argparse
import asyncio
import atexit
import contextlib
import errno
import faulthandler
import importlib.machinery
import logging
import os
import resource
import signal
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Coroutine

import nereid.backend_calls
from nereid.backend import (CallsModels, ChecksInputs, ModelContext, ReportsRuntime, reported_device,
                            runtime_report_problem, what_it_calls)
from nereid.backend_calls import bounded_backend_call
from nereid.daemon_pool import ThreadStartFailed, release_server_pools
from nereid.dependencies import Readiness, callers_readiness
from nereid.errors import ConfigError, backend_exit, cap_message, plugin_failures
from nereid.files import check_confined, warn_if_file_names_not_utf8
from nereid.init_process import fork_init_if_pid_1
from nereid.leftovers import ScratchFolderError, make_scratch_folder, remove_scratch_folder
from nereid.log_format import one_record_per_line, stderr_handler
from nereid.log_limit import EndedCallFilter, RateLimitFilter
from nereid.model_building import build_model
from nereid.model_entry import not_listed_reason, waiting_for_folder
from nereid.model_runner import checked_input_check
from nereid.processes import (kill_children, not_ignored, record_early_stops, redeliver_early_stops,
                              release_early_stops, stop_signals)
from nereid.plugins import (NereidPluginManager, add_commands, check_backend_defaults, error_text, make_plugin_manager,
                            streamed_files)
from nereid.run_folders import runs_folder
from nereid.storage import StorageError, materialize_model_folder, scan_model_folders
from nereid.settings import DEFAULT_CONFIG_NAME, Listeners, Settings, address_problem, load_settings

DEFAULT_CONFIG = Path(DEFAULT_CONFIG_NAME)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def main(argv: list[str] | None = None, extra_plugins: tuple[object, ...] = ()) -> int:
    """Entry point of the ``nereid`` console script.

    ``extra_plugins``: backend plugins to register besides the built-in and
    installed ones (``bench/serve_with_plugin.py`` serves its bench backends
    so, with everything else as ``nereid serve`` has it: its logging included).
    """
    # gRPC's core writes its own lines to stderr, at INFO by default, in its own format and past --log-level: one
    # per failed TLS handshake (a plaintext probe on a TLS port, any client from the internet), with no limit.
    # Not even its errors: a TLS client naming a server the certificate does not (SNI) got one ERROR line per
    # connection, without a client certificate, its text the client's own, line breaks included, so that it
    # could forge records of the log (the storage hunt). What nereid needs of gRPC's failures (a port it cannot
    # bind) it says itself. Set before grpc is first imported (reading TLS settings imports it), which reads it
    # once; an operator's own value wins.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    # gRPC's core registers fork handlers that stop its threads before each fork() and start them again after;
    # one that cannot (pthread_create failing at a process or thread limit) aborts the whole server (SIGABRT,
    # "Failed to start lifeguard thread"). subprocess.Popen falls back from vfork to fork() exactly when the
    # limit is reached, so a cpp run under a pids limit killed the server instead of failing with [Errno 11].
    # Every child the server starts execs at once and never uses gRPC: the handlers buy nothing. Read when grpc
    # is first imported, as GRPC_VERBOSITY is; an operator's own value wins.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    parser = argparse.ArgumentParser(prog="nereid", description="A Triton-compatible model server.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("serve", "serve the models over gRPC and HTTP until SIGTERM, SIGINT or SIGHUP"),
                            ("check", "validate nereid.yaml and load every model folder once")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                             help="path to nereid.yaml (default: ./nereid.yaml)")
    serve = commands.choices["serve"]
    serve.add_argument("--bind", default=None, type=_bind_address, help="override server.bind_addr (host:port)")
    serve.add_argument("--http-bind", default=None, type=_listener_address, metavar="ADDR",
                       help='override server.http_addr (host:port; "" turns HTTP off)')
    serve.add_argument("--metrics-bind", default=None, type=_listener_address, metavar="ADDR",
                       help='override server.metrics_addr (host:port; "" turns /metrics off)')
    # Checked here, so that a misspelt level is a usage error listing the levels, not a traceback from logging.
    serve.add_argument("--log-level", default="INFO", type=_log_level, choices=LOG_LEVELS, metavar="LEVEL",
                       help=f"logging level: {', '.join(LOG_LEVELS)} (any case, WARN too; default INFO)")
    # Configured before the plugins load (their commands must be known to parse the command line), so that a
    # plugin left out is logged as an ERROR line; serve's --log-level applies once parsed.
    logging.basicConfig(level=logging.WARNING, handlers=[stderr_handler()])
    # Python's warnings (a model's main.py compiled at load with a SyntaxWarning, a library's deprecation) as
    # log lines in the log's format, not raw lines between them.
    logging.captureWarnings(True)
    # One manager for the whole command, so that a plugin left out is logged once.
    manager = make_plugin_manager(extra_plugins=extra_plugins)
    add_commands(manager, commands)  # backends' own tooling
    # What runs is told by the command's own parser, not by ``command``: a plugin command's subparsers, with
    # argparse's usual dest="command", overwrote it and took over the dispatch (`nereid mytool check` ran
    # nereid's check, and failed in it; the CLI read hunt).
    for name, command in commands.choices.items():
        if command.get_default("nereid_command") is None:  # (its name, not its last alias: choices holds both)
            command.set_defaults(nereid_command=name)
    args = parser.parse_args(argv)
    serving = args.nereid_command == "serve"
    if not serving and args.nereid_command != "check":  # (the console script recorded stop signals from its start: see
        redeliver_early_stops()                  # nereid.entry; check and serve hand them over themselves)
    if "run" in args and args.nereid_command not in ("serve", "check"):
        # (Never for the built-in commands: a plugin's set_defaults(run=...) on their parsers took them over;
        # found by a plugin hunt.)
        return _plugin_command_status(args.nereid_command, _reading_stopped_quietly(lambda: _ran(args.run, args)))

    if not serving and args.nereid_command != "check":
        # A plugin's command that set no run function ran `nereid check` in its place, or failed in it with a
        # traceback (found by a plugin hunt): the plugin's mistake, said as such.
        print(one_record_per_line(f"error: the command '{args.nereid_command}' (a plugin's) sets no function to "
                                  "run: its nereid_add_commands hook must call set_defaults(run=FUNCTION) on its "
                                  "parser"),
              file=sys.stderr)
        return 2
    if not serving:
        return _check_command(args, argv, manager)
    # Until the server starts (see serve_command), a stop signal is recorded: its imports take half a second.
    # (From the console script's first instant already: see nereid.entry. Here for a caller in-process.)
    record_early_stops(stop_signals())
    try:
        return _serve_command(args, manager)
    finally:
        release_early_stops()  # (a way out before the server started: the caller's handlers back)


def _ran(run: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> Any:
    """What a plugin command's ``run`` returned, or the code of the ``sys.exit`` it called (checked as a returned
    status is: sys.exit(300) exited 44); a Ctrl-C is 130 without a traceback."""
    try:
        return run(args)
    except SystemExit as exit_request:
        if exit_request.code is None or isinstance(exit_request.code, int):
            return exit_request.code
        print(exit_request.code, file=sys.stderr)  # sys.exit("message"): said, status 1, as Python does
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def _plugin_command_status(command: str, status: Any) -> int:
    """The exit status of a plugin's command from what its run function returned: an int from 0 to 255, or None
    for 0. Anything else is the plugin's mistake, said as such (status 2): Python's exit turned 300 into 44 and
    printed a string as if it were the command's message (found by a plugin hunt)."""
    if status is None:
        return 0
    if isinstance(status, int) and 0 <= status <= 255:
        return int(status)
    print(one_record_per_line(f"error: the command '{command}' (a plugin's) returned {cap_message(repr(status), 200)}"
                              ": its run function must return an exit status from 0 to 255 (or None for 0)"),
          file=sys.stderr)
    return 2


def _check_command(args: argparse.Namespace, argv: list[str] | None, manager: NereidPluginManager) -> int:
    """``nereid check``: nereid.yaml read, then every model checked (see :func:`check`)."""
    _report_crashes()
    settings = _read_settings(args.config, Listeners())
    if settings is None:
        redeliver_early_stops()
        return 2
    # (argv None: the command line's own process, which exits once check returns; callers in a process that goes
    # on pass their argv, and get their signal handlers back.)
    return _reading_stopped_quietly(lambda: check(settings, manager, ends_process=argv is None))


def _serve_command(args: argparse.Namespace, manager: NereidPluginManager) -> int:
    """``nereid serve``: nereid.yaml read, with the command line's addresses in place of its own, then served."""
    _report_crashes()
    # Before nereid.yaml is read: what its reading logs (a certificate about to expire) obeys it too.
    _set_log_level(args.log_level)
    listeners = Listeners(args.bind, http_addr=args.http_bind, metrics_addr=args.metrics_bind)
    settings = _read_settings(args.config, listeners)
    if settings is None:
        return 2
    return serve_command(settings, listeners, manager)


def _log_level(text: str) -> str:
    """A --log-level in any case, Python's own alias WARN taken for WARNING (it was refused as "invalid choice:
    'WARN'", a spelling the user never typed: the CLI hunt)."""
    level = text.upper()
    return "WARNING" if level == "WARN" else level


def _read_settings(config: Path, listeners: Listeners) -> Settings | None:
    """nereid.yaml, its addresses checked for clashes with ``listeners``' in place; None (after the error on
    stderr) when it cannot be used."""
    if config == DEFAULT_CONFIG and not os.path.lexists(config):
        # (It said "nereid.yaml: cannot read: No such file or directory": of which folder, and what to do? The CLI
        # hunt.)
        print(one_record_per_line(f"error: no {DEFAULT_CONFIG_NAME} in {_working_folder()} (run nereid in the folder "
                                  f"that holds it, or give --config FILE)"), file=sys.stderr)
        return None
    try:
        settings = load_settings(config)
        if (clash := listeners.clash(settings.server, settings.source)) is not None:
            raise ConfigError(clash)
    except ConfigError as err:
        print(one_record_per_line(f"error: {err}"), file=sys.stderr)
        return None
    return settings


def _working_folder() -> str:
    try:
        return os.getcwd()
    except OSError:  # (removed under the shell)
        return "the working folder (which is gone)"


def _report_crashes() -> None:
    """Have a crash of the process (a segfault in a native library's code: a cxx model, an extension) print
    the Python stacks of every thread to stderr, where it said nothing: which model's call it was shows there."""
    try:
        faulthandler.enable(all_threads=True)
    except (AttributeError, OSError, RuntimeError, ValueError):  # (no usable stderr: captured, or closed)
        pass


def _set_log_level(level: str) -> None:
    """serve's --log-level, and the libraries' levels that go with it."""
    logging.getLogger().setLevel(level)
    # jax reports at INFO that it found no TPU; that is no news to a CPU or GPU server.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    if level != "DEBUG":
        # watchfiles says "N changes detected" at INFO for each batch of file events in dynamic mode; the server
        # logs what it does about them. (At DEBUG, its lines name the paths and stay.)
        logging.getLogger("watchfiles").setLevel(logging.WARNING)


# Why a report cannot be written to standard output (a full disk, a device gone): said in one line, not a traceback.
_OUTPUT_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG})


def _reading_stopped_quietly(command: Callable[[], int]) -> int:
    """Run a command that prints a report; if its reader stops reading (``nereid check | head``), end quietly
    with status 1 rather than with a BrokenPipeError traceback; if its output cannot be written (``> /dev/full``),
    say so in one line, with status 1."""
    try:
        return command()
    except BrokenPipeError:
        pass
    except OSError as err:
        if err.errno not in _OUTPUT_FAILURES or err.filename is not None:
            raise  # (a file's failure, which names it: a cache file, say, with its traceback)
        print(f"error: cannot write the output: {err.strerror}", file=sys.stderr)
    # The interpreter flushes stdout once more at exit: pointed at /dev/null, that flush cannot fail too.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1


def limit_repeated_library_lines() -> None:
    """Bound the lines a library can repeat without end (see :class:`RateLimitFilter`), and quiet grpcio's
    ERROR for an answer to a call that had already ended (see :class:`EndedCallFilter`)."""
    logging.getLogger("asyncio").addFilter(RateLimitFilter(("socket.accept() out of system resource",)))
    logging.getLogger("grpc._cython.cygrpc").addFilter(EndedCallFilter())


def raise_open_file_limit() -> None:
    """Raise the soft limit on open files to the hard one, as nginx and Go servers do.

    Every connection, model file and child pipe takes a descriptor; a soft limit
    of 1024 (a common default) is reached by about a thousand idle clients.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as err:
            logging.getLogger(__name__).debug("cannot raise the open-file limit from %d: %s", soft, err)


def _bind_address(text: str) -> str:
    """``--bind``, checked as ``server.bind_addr`` is (a usage error otherwise, exit 2)."""
    problem = address_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{problem}, got {text!r}")
    return text


def _listener_address(text: str) -> str:
    """``--http-bind`` / ``--metrics-bind``: an address checked as ``--bind`` is, or "" (that listener off)."""
    return text if text == "" else _bind_address(text)


def serve_command(settings: Settings, listeners: Listeners, manager: NereidPluginManager | None = None) -> int:
    """Run the server until a signal; 0 after a graceful stop.

    ``listeners``: the command line's addresses (checked for clashes by the caller).

    An installed plugin that could not be loaded was logged and is left out: the
    server serves what the others claim.
    """
    # As a container's PID 1, the server runs as a child of nereid's own init, which reaps the orphans the kernel
    # hands PID 1 (see init_process): before the server's imports and threads, once nereid.yaml has been read.
    fork_init_if_pid_1()
    from nereid.server import NereidServer, say_not_starting  # grpc is only needed to serve

    manager = manager or make_plugin_manager()
    limit_repeated_library_lines()
    raise_open_file_limit()

    async def run() -> None:
        await NereidServer(settings, manager, listeners=listeners).serve_until_signalled()

    # From here a stop signal acts as before, the server setting its own handlers once it serves (its start may
    # list a bucket for minutes: a stop put off until then would go unheeded). One that came during the imports
    # above ends the command before the server starts (nothing has been served, or made, yet).
    came = release_early_stops()
    if came is not None:
        say_not_starting(came)
        return 0
    # After the release: a plugin's defaults hook that hangs is stopped by a signal's default, where, recorded
    # until the server started, SIGTERM and SIGINT went unheeded while it ran (the config hunt).
    try:
        for note in check_backend_defaults(manager, settings.backend_defaults, settings.source):
            logging.getLogger("nereid.server").warning("%s", note)
    except ConfigError as err:
        print(one_record_per_line(f"error: {err}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while a hook ran: nothing started yet, no traceback
        logging.getLogger("nereid.server").info("interrupted (SIGINT) before the server started: not starting")
        return 128 + signal.SIGINT

    # Recorded again until the server's own handlers go in (NereidServer.serve_until_signalled hands them over):
    # between here and there it makes its scratch folder, and a Ctrl-C gave a traceback, a SIGTERM left the folder.
    record_early_stops(stop_signals())
    try:
        ended = run_to_the_end(run())
    except OSError as err:
        print(one_record_per_line(f"error: {err}"), file=sys.stderr)
        return _exit_past_abandoned_threads(1)
    except ThreadStartFailed as err:  # (one of the server's own threads, as it started: ulimit -v, a pids limit)
        print(one_record_per_line(f"error: the server could not start: {err}"), file=sys.stderr)
        return _exit_past_abandoned_threads(1)
    finally:
        release_early_stops()  # (when the server never got as far as its handlers: a failed construction)
    return _exit_past_abandoned_threads(0, force=not ended)


# How long the tasks still there when the server has stopped get to end once cancelled.
LEFT_TASKS_WAIT_S = 2.0


def run_to_the_end(main: Coroutine[Any, Any, None], left_tasks_wait_s: float = LEFT_TASKS_WAIT_S) -> bool:
    """Run ``main`` on a new event loop as ``asyncio.run`` does; False when tasks were left that would not end.

    ``asyncio.run`` cancels the tasks left when ``main`` returns and waits for
    every one to end: a model's coroutine that swallows its cancellation (a
    bare ``except`` in a loop) kept ``nereid serve`` from exiting after it had
    stopped. Here they get ``left_tasks_wait_s``; those still running are
    named in a WARNING and left to the process's end.
    """
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    ended = True
    try:
        loop.run_until_complete(main)
    finally:
        try:
            left = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in left:
                task.cancel()
            if left:
                _, pending = loop.run_until_complete(asyncio.wait(left, timeout=left_tasks_wait_s))
                if pending:
                    ended = False
                    names = ", ".join(sorted(task.get_name() for task in pending)[:8])
                    logging.getLogger(__name__).warning(
                        "%d task(s) did not end within %g s of their cancellation (a model's coroutine that "
                        "swallows CancelledError?); leaving them: %s", len(pending), left_tasks_wait_s, names)
            if ended:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            if ended:
                loop.close()
            release_server_pools()  # (a listing still waiting on a store is left to the process's end, see below)
    return ended


def _exit_past_abandoned_threads(code: int, force: bool = False) -> int:
    """``code``, or the process's end with it at once when a thread the server abandoned still runs (or
    ``force``: tasks were left running on the loop).

    A load abandoned at shutdown (its thread inside jaxlib's compiler, say) or
    a model call past the grace runs on a daemon thread. The interpreter's own
    shutdown ends such a thread with a forced unwind, which C++ code that
    catches and swallows it turns into an abort (SIGABRT, exit 134, "FATAL:
    exception not rethrown"). The server has stopped by now (its models
    unloaded, its children killed): run the atexit handlers, flush what was
    written and leave.
    """
    if not force and not any(thread.is_alive() and thread.daemon and thread.name.startswith(ABANDONED_THREAD_PREFIX)
                             for thread in threading.enumerate()):
        return code  # (gRPC's own poller thread is no concern: it is not inside code that swallows unwinds)
    atexit._run_exitfuncs()  # what plugins, models and the standard library registered still runs
    logging.shutdown()  # flushes every handler
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def check(settings: Settings, manager: NereidPluginManager | None = None, *, ends_process: bool = False) -> int:
    """Load every model folder once and print one line per model; 1 if any has a problem.

    An installed plugin left out (it cannot be loaded, or its
    ``nereid_add_commands`` failed) is a problem too, listed before the models:
    what it should serve would otherwise only show as unclaimed folders.
    ``ends_process``: it is the ``nereid check`` command, whose process exits
    once it returns: a stop signal from its end on is ignored (see below).
    """
    manager = manager or make_plugin_manager()
    warn_if_file_names_not_utf8()
    for problem in manager.problems:
        print(one_record_per_line(f"{problem.plugin}: {problem.what}"))
    problems = 0
    config_problems = 0  # the backends: section's, counted apart: they are no model's
    listing_problem = ""  # why the model folders could not be listed, when that leaves nothing to check
    waiting = 0  # listed models whose folders are not there (yet)
    callers_waiting = 0  # models that call only those among the models not ready
    names: list[str] = []  # the model folders checked
    # A stop the console script recorded (see nereid.entry) acts from here, right before the check's own handlers
    # go in: redelivered after the command line was read, one during nereid.yaml's reading gave a Ctrl-C traceback,
    # and as PID 1 a SIGTERM was dropped (the hunt of the redelivery).
    redeliver_early_stops()
    # Named as a server's scratch (nereid-<pid>-...): a check that is killed leaves it for the next server
    # start to remove, as that server removes any dead process's.
    try:
        scratch = make_scratch_folder("check-")
    except ScratchFolderError as err:  # TMPDIR set to a folder that cannot be used: as serve says it
        print(one_record_per_line(f"error: {err}"), file=sys.stderr)
        return 1
    # SIGTERM (`timeout 60 nereid check` in CI) and SIGHUP (a closed terminal) stop the check as Ctrl-C does: a
    # compiler it started must not run on under init, writing into a scratch folder nobody will clean.
    on_main = threading.current_thread() is threading.main_thread()  # (only there can a handler be set)
    signals = _StopSignals()
    # (A handler set outside Python reads as None, and could not be put back: that signal is left as it is.)
    previous = {signum: handler for signum in (signals.handled() if on_main else ())
                if (handler := signal.getsignal(signum)) is not None}
    for signum in previous:
        signal.signal(signum, signals)
    unraisable_hook = sys.unraisablehook
    sys.unraisablehook = signals.quiet_unraisable(unraisable_hook)
    try:
        # (Under the stop signals' handlers: a plugin's defaults hook that hangs is interrupted as a model's load
        # is, where a Ctrl-C gave a traceback and a SIGTERM killed the check without its line; the config hunt.)
        try:
            notes = check_backend_defaults(manager, settings.backend_defaults, settings.source)
        except ConfigError as err:
            notes = [str(err)]
        signals.stop_if_came()  # (a hook may have caught the interrupt and gone on)
        for note in notes:
            config_problems += 1
            print(one_record_per_line(note))
        listing_failed = False
        try:
            names = scan_model_folders(settings.server)
        except StorageError as err:
            names, listing_failed = [], True
            if settings.models_listed:
                logging.getLogger("nereid.storage").error("%s", err)  # (each listed model's line has the reason)
            else:
                # Every folder is what a server would serve: one that cannot list them serves nothing, and the
                # store's reason was only a log line on stderr before "OK" and exit 0. (With a models: key each
                # listed model is looked for by its own prefix, and its line says what failed.)
                listing_problem = str(err)
                print(one_record_per_line(listing_problem))
        if settings.server.ml_backends_url is not None or listing_failed:
            # The listed models, each by its own name, as a server loads them: a store's listing may miss a folder,
            # and a local ml_backends_path that cannot be listed (mode 311: searched, not listed) may serve them,
            # or fail each for its reason (it cannot be searched either), where check printed WAITING and exit 0
            # (the config hunt).
            names = sorted({*names, *(m.name for m in settings.models)})
        states: dict[str, tuple[str, str]] = {}  # each model as a server would have it at start
        callers: list[_Checked] = []  # loaded fine, and call other models: judged once every model is
        not_listed = not_listed_reason(settings.config_name)
        for name in names:
            checked = _check_model(settings, manager, scratch, name, signals.model_faults)
            signals.stop_if_came()  # (a model's code may have caught the interrupt and gone on)
            if checked is None:
                problems += 1
                states[name] = ("UNAVAILABLE", "its check failed")
                continue
            states[name] = ("READY", "") if checked.loaded_at_start else ("UNAVAILABLE", not_listed)
            if checked.status == "OK" and checked.depends_on:
                callers.append(checked)
            else:
                problems += 0 if checked.status == "OK" else 1
                print(checked.line())
        waiting_names: set[str] = set()
        for model in settings.models:
            if model.name not in states:  # listed before its folder, as dynamic mode allows
                waiting_names.add(model.name)
                states[model.name] = ("UNAVAILABLE", waiting_for_folder(model.name))
                print(one_record_per_line(f"{model.name}: WAITING: {waiting_for_folder(model.name)} (server.watch "
                                          "loads it when the folder lands; the server is not ready until then)"))
        waiting = len(waiting_names)
        caller_problems, callers_waiting = _check_callers(callers, states, not_listed, waiting_names)
        problems += caller_problems
    except KeyboardInterrupt as stop:
        signals.close()  # (a second signal, or a delivery pending, must not interrupt what follows)
        killed = kill_children()
        signum = stop.signum if isinstance(stop, _Terminated) else signal.SIGINT
        # A terminal that hung up (SIGHUP) refuses the line (EIO): the exit status still says what happened.
        with contextlib.suppress(OSError):
            print(one_record_per_line(f"{settings.source}: interrupted by {signum.name}"
                                      f"{f' ({killed} program(s) it had started killed)' if killed else ''}"),
                  file=sys.stderr)
        return 128 + signum  # as the shell reports a process that the signal ended
    finally:
        signals.close()
        for signum, handler in previous.items():
            # As the command, from here the process only prints its verdict and exits: a signal put back to its
            # default then (a CI timeout just as the check ends) killed it with 143 and no line, after "OK".
            signal.signal(signum, signal.SIG_IGN if ends_process else handler)
        sys.unraisablehook = unraisable_hook
        remove_scratch_folder(scratch)
    summary = [f"{config_problems} problem(s) in its backends: section"] if config_problems else []
    if listing_problem:
        summary.append("its model folders cannot be listed")
    if problems:
        summary.append(f"{problems} model(s) with problems")
    if manager.problems:
        summary.append(f"{len(manager.problems)} plugin problem(s)")
    verdict = ", ".join(summary) or "OK"
    if not names and not waiting and not summary:  # (an empty volume mount, a path's typo: "OK" alone; the CLI hunt)
        verdict += f" (no model folders in {settings.server.ml_backends_url or settings.server.ml_backends_path})"
    if waiting:
        # (Not a problem: dynamic mode allows it. But a typo in a name reads the same, and the server is not ready
        # until the folder lands: said in the verdict, where it read "OK" alone; the CLI hunt.)
        callers_too = f", and {callers_waiting} model(s) calling them" if callers_waiting else ""
        verdict += (f" ({waiting} listed model(s) waiting for their folders{callers_too}: the server is not ready "
                    "until they land)")
    print(one_record_per_line(f"{settings.source}: {verdict}"))
    return 1 if problems or config_problems or listing_problem or manager.problems else 0


# Every thread nereid runs backend code on is named so: model loads, bounded unloads, models' worker pools.
ABANDONED_THREAD_PREFIX = "nereid-"


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during ``nereid check``: it stops like Ctrl-C (a KeyboardInterrupt is no plugin's
    failure)."""

    def __init__(self, signum: signal.Signals) -> None:
        super().__init__(signum.name)
        self.signum = signum


class _StopSignals:
    """``nereid check``'s handler of SIGINT, SIGTERM and SIGHUP: it records that the signal came, then raises.

    Ctrl-C and a KeyboardInterrupt that a model's own code raises (in its
    ``load()``, say) are the same exception; only the record tells them apart.
    The first stops the check; the second is that model's failure, as it is
    under ``nereid serve`` (which loads models off the main thread).
    """

    # How long a stop that came while a native module initialised waits before it is tried again, and the
    # longest it is put off so (an initialisation that hangs must not make the check unstoppable).
    RETRY_S = 0.05
    MOST_DEFERRED_S = 5.0

    def __init__(self) -> None:
        self.came: signal.Signals | None = None  # the signal that came, if one did
        self._lock = threading.Lock()
        self._retry: threading.Timer | None = None  # at most one delivery pending
        self._deferred_since: float | None = None
        self._closed = False

    @staticmethod
    def handled() -> list[signal.Signals]:
        """The signals to handle: SIGTERM, and SIGINT and SIGHUP unless they are ignored (``nereid check &`` in a
        script, ``nohup``)."""
        return [signal.SIGTERM, *not_ignored(signal.SIGINT, signal.SIGHUP)]

    def __call__(self, signum: int, frame: types.FrameType | None) -> None:
        if self._closed:  # (the check is stopping or has ended: its cleanup is not interrupted)
            return
        self.came = signal.Signals(signum)
        if _initialising_native_module(frame):
            # Raised there, the stop unwinds through the native module's initialisation, which then aborts the
            # whole process (jaxlib's, as a bundle's load imports jax: "terminate called after throwing an
            # instance of 'nanobind::python_error'", exit 134, the scratch folder left behind). It is delivered
            # again shortly instead, once the initialisation is over, or after MOST_DEFERRED_S regardless.
            now = time.monotonic()
            with self._lock:
                if self._deferred_since is None:
                    self._deferred_since = now
                if now - self._deferred_since < self.MOST_DEFERRED_S:
                    if self._retry is None:
                        self._retry = threading.Timer(self.RETRY_S, self._deliver_again, (signum,))
                        self._retry.daemon = True
                        self._retry.start()
                    return
        self.stop_if_came()

    def _deliver_again(self, signum: int) -> None:
        with self._lock:  # (close() cannot put the previous handlers back in between)
            self._retry = None
            if not self._closed:
                _thread.interrupt_main(signum)

    def close(self) -> None:
        """Stop handling: a delivery still pending is dropped, and a signal from now on does nothing (called
        before the check cleans up and before the previous handlers are put back)."""
        with self._lock:
            self._closed = True
            retry, self._retry = self._retry, None
        if retry is not None:
            retry.cancel()

    def model_faults(self) -> tuple[type[BaseException], ...]:
        """What to catch around a model's code as its failure: :func:`plugin_failures`, and a KeyboardInterrupt
        (no signal has come, or this raises).

        Called in the ``except`` clause, so after the handler has run for a signal that interrupted that code:
        the check then stops, whatever that code made of the interrupt (a load that wraps every exception in a
        RuntimeError of its own).
        """
        self.stop_if_came()
        return (*plugin_failures(), KeyboardInterrupt)

    def quiet_unraisable(self, previous: Callable[[Any], object]) -> Callable[[Any], object]:
        """A ``sys.unraisablehook`` that drops the stop this handler raised where Python cannot pass an
        exception on, and hands anything else to ``previous``.

        A signal that comes while a finalizer or a garbage-collector callback
        runs (jax's, as a bundle loads) has its stop raised in there: Python
        would print it ("Exception ignored in ...", a traceback through this
        handler) and go on. The record stays, so the check stops at its next
        look (after the model's load at the latest), saying one line.
        """
        def hook(unraisable: Any) -> None:
            if self.came is not None and isinstance(unraisable.exc_value, KeyboardInterrupt):
                return
            previous(unraisable)
        return hook

    def stop_if_came(self) -> None:
        """Raise the stop of the signal that came, if one did."""
        if self.came is not None:
            raise KeyboardInterrupt() if self.came == signal.SIGINT else _Terminated(self.came)


def _initialising_native_module(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` runs inside the initialisation of a native (extension) module: among its callers is
    importlib's ``create_module`` or ``exec_module`` of an ExtensionFileLoader. (A plain Python module's import,
    a model.py's included, is not: a stop raised there unwinds as from any Python code.)"""
    while frame is not None:
        if (frame.f_code.co_name in ("create_module", "exec_module")
                and frame.f_code.co_filename.startswith("<frozen importlib")
                and isinstance(frame.f_locals.get("self"), importlib.machinery.ExtensionFileLoader)):
            return True
        frame = frame.f_back
    return False


@dataclass
class _Checked:
    """A model that loaded in the check: its line, and what a server needs to serve it."""

    name: str
    status: str  # "OK", or what went wrong after the load ("UNLOAD FAILED: ...; loaded as")
    details: str  # backend=... inputs=... outputs=... (not listed in nereid.yaml)
    depends_on: tuple[str, ...]
    loaded_at_start: bool  # a server would load it at start (listed, or no models: key)

    def line(self) -> str:
        return one_record_per_line(f"{self.name}: {self.status} {self.details}")


def _check_callers(callers: list[_Checked], states: dict[str, tuple[str, str]], not_listed: str,
                   waiting: set[str]) -> tuple[int, int]:
    """Print the lines of models that call other models, judged as a server would; how many have a problem, and
    how many wait only for listed models whose folders are not there yet (``waiting``). ``not_listed``: the reason
    ``states`` gives a model the configuration file does not list.

    A meta model that loads fine but calls a model the server would not serve
    (no such folder, one that fails, one not listed in nereid.yaml, a cycle)
    would stay UNAVAILABLE, and ServerReady false: a problem, said on its line.
    One that calls a listed model waiting for its folder, as dynamic mode
    allows, becomes READY once that lands, as the waiting model itself does:
    WAITING (the meta hunt: it failed the check, where its sub-model passed).
    """
    def verdicts_in(states: dict[str, tuple[str, str]]) -> dict[str, Readiness]:
        at_start = {c.name: c.depends_on for c in callers if c.loaded_at_start}
        verdicts = callers_readiness(at_start, states)
        # One not loaded at start is judged as a later load of it would be: the unlisted models it calls that
        # checked fine can be loaded first.
        loadable = {name: ("READY", "") if state == ("UNAVAILABLE", not_listed) else state
                    for name, state in states.items()}
        everyone = callers_readiness({c.name: c.depends_on for c in callers}, loadable)
        verdicts.update({name: verdict for name, verdict in everyone.items() if name not in at_start})
        return verdicts

    verdicts = verdicts_in(states)
    landed = verdicts_in({name: ("READY", "") if name in waiting else state for name, state in states.items()})
    problems = waits = 0
    for checked in callers:
        verdict = verdicts[checked.name]
        if not verdict.ready and landed[checked.name].ready:
            checked.status = f"WAITING: {verdict.why} (it is READY once the folders it waits for land); loaded as"
            waits += 1
        elif not verdict.ready:  # (said by what keeps it so once the folders waited for land: the lasting cause)
            checked.status = f"UNAVAILABLE: {landed[checked.name].why}; loaded as"
            problems += 1
        print(checked.line())
    return problems, waits


def _check_model(settings: Settings, manager: NereidPluginManager, scratch: Path, name: str,
                 model_faults: Callable[[], tuple[type[BaseException], ...]]) -> _Checked | None:
    """Load and unload one model; None, its line printed, when it fails to load (or, loaded, its ``dependencies()``
    raises, which a server takes for a failed load); else what :class:`_Checked` holds.

    A model whose ``unload`` fails is reported on its line, and the check goes
    on with the next model. ``model_faults()``: what the model's code may
    raise that is its failure (see :meth:`_StopSignals.model_faults`).
    """
    root = settings.server.ml_backends_path
    model_settings, origin = settings.model_or_default(name)
    listed = settings.model(name) is not None
    suffix = "" if listed or not settings.models_listed else f" ({not_listed_reason(settings.config_name)})"
    # A folder of its own in the scratch folder, as a server gives each model (messages name it alike).
    context = ModelContext(name, root / name, model_settings, scratch / name, origin, runs_dir=runs_folder(scratch),
                           config_name=settings.config_name)
    try:
        context.scratch_dir.mkdir(exist_ok=True)
        # From an object store: fetch it first, but for the files its backend streams from there.
        materialize_model_folder(settings.server, name, streamed_files(manager, name, model_settings.backend))
        check_confined(root / name, root, settings.server.follow_symlinks, settings.config_name)
        built = build_model(manager, context, settings.backend_defaults, settings.source)
    except model_faults() as err:
        # (A folder's name or a compiler's message may hold line breaks: one model starts each line.)
        print(one_record_per_line(f"{name}: UNAVAILABLE: {_load_failure_text(name, err)}{suffix}"))
        return None
    # Each on the model's line (the unload's overwrote the report's: the README walkthrough).
    runtime, report_problem, unload_problem = "", "", ""
    if isinstance(built.backend, ReportsRuntime):
        try:
            report = built.backend.runtime_report()
            # A report that is not one (None: a forgotten return; a str) ended the check with a traceback.
            problem = runtime_report_problem(report, with_summary=True)
        except model_faults() as err:  # the model's fault, not the check's: say so on its line and go on
            problem = error_text(err)
        if problem is not None:
            report_problem = f"RUNTIME REPORT FAILED: {problem}"
        else:
            runtime = f" {report.summary}" if report.summary else ""
            if report.warm_parent_resident_bytes is not None:
                runtime += f" warm_parent_rss={report.warm_parent_resident_bytes / 2**20:.1f}MiB"
    depends_on: tuple[str, ...] = ()
    unavailable: str | None = None  # why a server, having loaded it, would not serve it
    if isinstance(built.backend, CallsModels):
        # (Imported here: the server's loading machinery, which the check needs for this one warning only.)
        from nereid.version_loader import warn_if_settings_ignored

        try:  # asked while it is loaded, as a server asks (and, when it raises, unloads it: UNAVAILABLE)
            executions, depends_on = what_it_calls(name, built.backend)
            warn_if_settings_ignored(name, model_settings, executions)
        except model_faults() as err:
            unavailable = _load_failure_text(name, err)
    if unavailable is None and isinstance(built.backend, ChecksInputs):
        try:  # asked while it is loaded, as a server asks (and refuses the model with this reason)
            checked_input_check(name, built.backend)
        except ConfigError as err:
            unavailable = _load_failure_text(name, err)
    try:
        # Bounded, as the server's: a native library's nereid_unload that never returns must not hang the check.
        if not asyncio.run(bounded_backend_call(name, "unload", built.backend.unload)):
            unload_problem = f"UNLOAD DID NOT RETURN within {nereid.backend_calls.BACKEND_CALL_WAIT_S:g} s"
    except Exception as err:
        unload_problem = f"UNLOAD FAILED: {error_text(err)}"
    if unavailable is not None:  # (and its unload's failure, if that failed too: it was not said)
        print(one_record_per_line(f"{name}: UNAVAILABLE: {'; '.join(filter(None, (unavailable, unload_problem)))}"
                                  f"{suffix}"))
        return None
    problems = [problem for problem in (report_problem, unload_problem) if problem]
    status = "; ".join(problems) + "; loaded as" if problems else "OK"
    signature = built.signature
    inputs = ", ".join(f"{s.name} {s.dtype.kserve}{list(s.dims)}" for s in signature.inputs)
    outputs = ", ".join(f"{s.name} {s.dtype.kserve}{list(s.dims)}" for s in signature.outputs)
    batching = "on" if built.policy.enabled else "off"
    device = reported_device(model_settings.device, built.uses_device)
    # What a server logs as a WARNING at the load, at the line's end: the model is fine, its folder misleads.
    notes = "".join(f"; note: {note}" for note in built.notes)
    return _Checked(name, status, f"backend={built.backend_name} device={device} "
                                  f"max_batch_size={signature.max_batch_size} batching={batching} "
                                  f"inputs=[{inputs}] outputs=[{outputs}]{runtime}{suffix}{notes}",
                    depends_on, listed or not settings.models_listed)


def _load_failure_text(name: str, error: BaseException) -> str:
    """Why a model failed to load, for its line, as a server gives the reason: an exit its code raised (a
    KeyboardInterrupt, which :func:`build_model` lets through on the main thread) as that names it."""
    if isinstance(error, Exception):
        return str(error).strip() or type(error).__name__
    return str(backend_exit(name, error, "while loading it"))


if __name__ == "__main__":
    sys.exit(main())
