"""Fixtures: an empty model repository in tmp_path, servers that stop after the test, zombie checks."""

from __future__ import annotations

import gc
import os
import signal
from pathlib import Path
from typing import Any, Callable

import pytest

from support import ModelRepo, RunningServer, wait_until, zombie_children


@pytest.hookimpl(optionalhook=True)  # (an xdist hook: unknown when it is off, as with -p no:xdist)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: three workers per core. Most tests wait on servers and child processes (with one worker per
    core the CPUs are about half idle), so more workers than cores shortens the run: on the 2-core machine
    (2026-12-02, no bytecode cache, alternating) 111-118 s with six workers against 125 s with four and 124 s
    with eight; earlier, before each process imported half a second faster, four had measured best."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(2, cores * 3)


def pytest_configure(config: pytest.Config) -> None:
    """Before any worker starts, compile nereid's own modules once (see :func:`_compile_the_package`); on an
    xdist worker, rewrite the asserts of its share of the test modules ahead of collection (see
    :func:`_rewrite_share_of_test_modules`)."""
    _default_stop_signals()
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        _compile_the_package()
    else:
        _rewrite_share_of_test_modules(config, int(workerinput["workerid"].removeprefix("gw")),
                                       int(workerinput["workercount"]))


def _default_stop_signals() -> None:
    """SIGINT and SIGHUP as a terminal's command gets them, where the suite was started ignoring them (``pytest &``
    in a script, ``nohup pytest``): the servers and commands the tests start inherit what is ignored, and the tests
    of stop signals failed or waited out their timeouts (the flaky-test hunt: the cause of stop 47's unexplained
    failure). A test that wants one ignored sets it itself."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _compile_the_package() -> None:
    """Write the bytecode of nereid's modules (``core/``, ``backends/``) into their ``__pycache__``.

    The tests start about a hundred processes that import nereid (``nereid
    serve`` and ``check``, each worker), and an editable install has no
    bytecode: this machine sets PYTHONDONTWRITEBYTECODE, so each of them
    compiled the whole package again, about 0.15 s of CPU apiece (and each of
    the ~760 warm parents compiled ``warm_parent.py``, about 10 ms). Python still
    reads bytecode it did not write, and checks it against the source's size
    and time, so an edit made during the run is compiled afresh as before.
    """
    import compileall

    root = Path(__file__).parent.parent
    for package in ("core", "backends"):
        compileall.compile_dir(root / package, quiet=2)


def _rewrite_share_of_test_modules(config: pytest.Config, index: int, count: int) -> None:
    """Write pytest's cached, assert-rewritten code of every ``count``-th test module from ``index`` on.

    Every xdist worker collects every test module, and with no cache (a fresh
    checkout; this machine sets PYTHONDONTWRITEBYTECODE, so pytest writes
    none) each one rewrote all of them: about 9 s of CPU per worker, a sixth of
    the suite's CPU time on two cores. Each now rewrites a share and writes it
    where pytest looks first (``__pycache__``, which git ignores), so the
    others read it. It uses pytest's own rewriting functions (private: when a
    pytest release moves them, this does nothing and collection rewrites as
    before).
    """
    try:
        from _pytest.assertion.rewrite import (PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc, assertstate_key,
                                               get_cache_dir, try_makedirs)
        state = config.stash[assertstate_key]
    except (ImportError, KeyError):  # (another pytest, or --assert=plain)
        return
    modules = sorted((Path(__file__).parent).rglob("test_*.py"))
    for path in modules[index::count]:
        cache_dir = get_cache_dir(path)
        pyc = cache_dir / (path.name[:-3] + PYC_TAIL)
        if _read_pyc(path, pyc, state.trace) is not None or not try_makedirs(cache_dir):
            continue
        try:
            source_stat, code = _rewrite_test(path, config)
        except SyntaxError:  # (its collection reports it)
            continue
        _write_pyc(state, code, source_stat, pyc)


@pytest.fixture
def repo(tmp_path: Path) -> ModelRepo:
    """An empty model repository in tmp_path."""
    return ModelRepo(tmp_path)


@pytest.fixture
def serve() -> Callable[..., RunningServer]:
    """Start a server from a nereid.yaml path; every server started is stopped after the test."""
    started: list[RunningServer] = []

    def start(config: Path, **kwargs: Any) -> RunningServer:
        server = RunningServer(config, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def no_zombies():
    """Fails the test if it leaves unreaped child processes behind. A child that exits as the test ends is given a
    moment: a background thread of the code under test (a replaced warm parent's retirement) reaps it, and does so
    as soon as it has run again, which on a busy machine may be after the test's last line (CI, stop 60)."""
    yield
    assert wait_until(lambda: zombie_children() == [], timeout_s=5), zombie_children()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 API on 127.0.0.1 (a free port), for the whole session, with the bucket ``models``."""
    from moto_s3 import start_server

    state, server, thread = start_server()
    yield state
    server.shutdown()
    thread.join(5)


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """The S3 server with obstore's environment variables set for this test and a fresh ``s3.prefix``."""
    import re

    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    s3_server.prefix = "t/" + re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:60]
    with s3_server.lock:
        s3_server.faults.clear()
        s3_server.requests.clear()
    return s3_server


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze the worker's heap once collection ends (the modules, test items and parameters it made, with all
    that was there before): it keeps them to its end, and every full garbage collection of the run would otherwise
    walk them again."""
    gc.freeze()
