"""Leftovers of killed processes: removed at the next start, a live process's files never touched."""

from __future__ import annotations

import os
import subprocess
import sys

from nereid.leftovers import remove_stale_partials, remove_stale_scratch, scratch_prefix

from support import ECHO_MAIN


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-S", "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_scratch_folders_and_partials_go_live_ones_stay(tmp_path):
    stale, live, other = tmp_path / f"nereid-{dead_pid()}-abc", tmp_path / f"{scratch_prefix()}xyz", tmp_path / "x"
    for folder in (stale, live, other):
        (folder / "run-1").mkdir(parents=True)
    assert remove_stale_scratch(tmp_path) == 1
    assert not stale.exists() and live.exists() and other.exists()
    (tmp_path / f".main-abc.{dead_pid()}.partial").write_text("half")
    (tmp_path / f".main-abc.{os.getpid()}.partial").write_text("being written")
    assert remove_stale_partials(tmp_path) == 1
    assert [p.name for p in tmp_path.glob("*.partial")] == [f".main-abc.{os.getpid()}.partial"]


def test_a_killed_servers_scratch_folder_is_removed_by_the_next(repo, serve, tmp_path):
    import tempfile
    from pathlib import Path

    leftover = Path(tempfile.gettempdir()) / f"nereid-{dead_pid()}-left"
    (leftover / "echo" / "run-1").mkdir(parents=True)
    repo.python("echo", main=ECHO_MAIN)
    server = serve(repo.write_config())
    assert not leftover.exists()
    assert server.server.scratch_dir.name.startswith(scratch_prefix())
