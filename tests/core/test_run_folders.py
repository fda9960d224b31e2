"""Run folders (a run's TMPDIR): private, short, one per run, and a server whose TMPDIR is too long says so."""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from nereid.leftovers import remove_scratch_folder
from nereid.plugins import make_plugin_manager
from nereid.run_folders import (AF_UNIX_PATH_MAX, SOCKET_ROOM, longest_run_folder, make_run_folder, runs_folder,
                                warn_if_sockets_cannot_fit)
from nereid.server import NereidServer
from nereid.settings import load_settings


def test_each_run_gets_a_private_folder_of_its_own_with_a_short_name(tmp_path):
    parent = tmp_path / "scratch" / ".r"  # not there yet: made, as after a /tmp cleaner removed it
    folders = {make_run_folder(parent) for _ in range(50)}
    assert len(folders) == 50
    for folder in folders:
        assert folder.parent == parent and re.fullmatch(r"[0-9a-f]{12}", folder.name), folder
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert len(str(folder)) == len(str(longest_run_folder(parent)))
    assert stat.S_IMODE(parent.stat().st_mode) == 0o700


def socket_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name == "nereid.run_folders" and record.levelno == logging.WARNING]


def test_a_server_whose_tmpdir_leaves_no_room_for_a_runs_sockets_says_so_once_at_start(repo, tmp_path, monkeypatch,
                                                                                      caplog):
    """A run's TMPDIR is the server's TMPDIR and 40 bytes at most: one that leaves less than 40 bytes of the 107 an
    AF_UNIX socket's path may take fails multiprocessing's forkserver and Manager() in every python model."""
    tmpdir = tmp_path / ("t" * 80)
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr("tempfile.tempdir", None)  # (read again from TMPDIR)
    caplog.set_level(logging.WARNING)
    server = NereidServer(load_settings(repo.write_config()), make_plugin_manager())
    try:
        assert server.scratch_dir.parent == tmpdir
        [warning] = socket_warnings(caplog)
        run_tmpdir = longest_run_folder(runs_folder(server.scratch_dir))
        assert f"a run's TMPDIR ({runs_folder(server.scratch_dir)}/<12 hex digits>) is {len(str(run_tmpdir))} " \
               "bytes" in warning, warning
        assert "multiprocessing forkserver or Manager() will fail" in warning, warning
        allowed = int(re.search(r"to a folder of at most (\d+) bytes", warning).group(1))
    finally:
        remove_scratch_folder(server.scratch_dir)
    # The length said is the longest that leaves the room: one byte more does not.
    scratch_name = server.scratch_dir.name
    caplog.clear()
    warn_if_sockets_cannot_fit(Path("/" + "t" * (allowed - 1)) / scratch_name)
    assert socket_warnings(caplog) == []
    fitting = longest_run_folder(runs_folder(Path("/" + "t" * (allowed - 1)) / scratch_name))
    assert len(str(fitting)) + SOCKET_ROOM == AF_UNIX_PATH_MAX
    warn_if_sockets_cannot_fit(Path("/" + "t" * allowed) / scratch_name)
    assert len(socket_warnings(caplog)) == 1


def test_a_server_in_a_short_tmpdir_says_nothing_of_sockets(repo, caplog):
    caplog.set_level(logging.WARNING)
    server = NereidServer(load_settings(repo.write_config()), make_plugin_manager())
    try:
        assert socket_warnings(caplog) == []
    finally:
        remove_scratch_folder(server.scratch_dir)


@pytest.mark.parametrize("extra, fits", [(0, True), (1, False)])
def test_the_room_said_is_exactly_what_multiprocessing_s_sockets_take_in_a_warm_parent(extra, fits):
    """The deploy hunt: the bound left 40 bytes for sockets that take 32 (and a warm parent's /tmp, 4 more), so
    the WARNING said runs "will fail" for server TMPDIRs of 30-37 bytes whose runs all made their sockets. Measured
    here with a real Manager() in a TMPDIR as long as the longest run folder the bound allows, warm: its /tmp."""
    import subprocess
    import sys
    import tempfile

    base = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        run_tmpdir = base / ("r" * (AF_UNIX_PATH_MAX - SOCKET_ROOM + extra - len(str(base)) - 1))
        assert len(str(run_tmpdir)) == AF_UNIX_PATH_MAX - SOCKET_ROOM + extra
        (run_tmpdir / "tmp").mkdir(parents=True)
        done = subprocess.run([sys.executable, "-c", "import multiprocessing\n"
                               "multiprocessing.Manager().shutdown()\n"],
                              env={**os.environ, "TMPDIR": str(run_tmpdir / "tmp")}, capture_output=True, text=True,
                              timeout=60)
        assert (done.returncode == 0) == fits, done.stderr[-1000:]
        if not fits:
            assert "AF_UNIX path too long" in done.stderr, done.stderr[-1000:]
    finally:
        shutil.rmtree(base)
