"""Leftovers of killed processes: removed at the next start, a live process's files never touched."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nereid.leftovers import (OWNER_LOCK, make_scratch_folder, remove_scratch_folder, remove_stale_partials,
                              remove_stale_scratch, scratch_prefix)

from support import ECHO_MAIN


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-S", "-c", "pass"])
    process.wait()
    return process.pid


def settled(folder: Path) -> Path:
    """``folder``, last changed two minutes ago (a folder changed within the last minute is never removed)."""
    os.utime(folder, (time.time() - 120, time.time() - 120))
    return folder


def test_stale_scratch_folders_and_partials_go_live_ones_stay(tmp_path):
    stale, live, other = tmp_path / f"nereid-{dead_pid()}-abc", tmp_path / f"{scratch_prefix()}xyz", tmp_path / "x"
    for folder in (stale, live, other):
        (folder / "run-1").mkdir(parents=True)
        settled(folder)
    assert remove_stale_scratch(tmp_path) == 1
    assert not stale.exists() and live.exists() and other.exists()
    half, being_written = tmp_path / f".main-abc.{dead_pid()}.partial", tmp_path / f".main-abc.{os.getpid()}.partial"
    for partial, text in ((half, "half"), (being_written, "being written")):
        partial.write_text(text)
        settled(partial)
    assert remove_stale_partials(tmp_path) == 1
    assert [p.name for p in tmp_path.glob("*.partial")] == [being_written.name]


@pytest.mark.parametrize("tmpdir", ["real", "through a symlink"])
def test_a_run_a_killed_server_could_not_end_is_ended_with_its_group_by_the_next_start(tmp_path, caplog, tmpdir):
    """Found by a bug hunt: a cpp run that ignores SIGTERM (or hangs) outlived its SIGKILLed server for good, past
    its timeout_s and past the next start, which removed the folder its program ran from. (A review found a
    TMPDIR through a symlink matched no program: /proc gives real paths.)"""
    real = tmp_path / "real"
    real.mkdir()
    parent = real if tmpdir == "real" else tmp_path / "linked"
    if parent != real:
        parent.symlink_to(real)
    stale = parent / f"nereid-{dead_pid()}-abc"
    binary = stale / "m" / "cpp-1" / "main-0"
    binary.parent.mkdir(parents=True)
    shutil.copy2(shutil.which("sleep"), binary)
    # As the runner starts one, in a session of its own; here with a child of its own in that group, too.
    run = subprocess.Popen(["/bin/sh", "-c", f'trap "" TERM; "{binary}" 300 & "{binary}" 300; wait'],
                           start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)  # (not run from the folder)
    try:
        deadline = time.monotonic() + 10
        while sum(1 for pid in os.listdir("/proc") if pid.isdigit() and _runs(int(pid), binary)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        settled(stale)
        with caplog.at_level(logging.INFO, "nereid.leftovers"):
            assert remove_stale_scratch(parent) == 1
        assert run.wait(10) == -signal.SIGKILL and not stale.exists()  # its whole group: the shell too
        assert bystander.poll() is None
        assert any(re.match(r"ended 2 process\(es\) still running a program from ", m) for m in caplog.messages)
    finally:
        for process in (run, bystander):
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)  # (each leads a group of its own)
            process.wait()


def _runs(pid: int, program: Path) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/exe") == os.path.realpath(program)
    except OSError:
        return False


def test_a_partial_written_within_the_last_minute_stays_whatever_its_pid(tmp_path):
    """Defect: a server removed another's build output while it was being copied into a shared repository's
    .cache/, its pid being no process in this PID namespace (the other ran in a container of its own)."""
    fresh = tmp_path / f".main-abc.1a2b3c4d.{dead_pid()}.partial"
    fresh.write_text("being copied, by a server whose pid this namespace does not have")
    assert remove_stale_partials(tmp_path) == 0 and fresh.exists()
    settled(fresh)
    assert remove_stale_partials(tmp_path) == 1 and not fresh.exists()


def test_a_killed_servers_scratch_folder_is_removed_by_the_next(repo, serve, tmp_path):
    import tempfile

    leftover = Path(tempfile.gettempdir()) / f"nereid-{dead_pid()}-left"
    (leftover / "echo" / "run-1").mkdir(parents=True)
    settled(leftover)
    repo.python("echo", main=ECHO_MAIN)
    server = serve(repo.write_config())
    assert not leftover.exists()
    assert server.server.scratch_dir.name.startswith(scratch_prefix())


OWNER = """
import sys, time
from nereid.leftovers import make_scratch_folder
print(make_scratch_folder(), flush=True)
time.sleep(60)
"""


def test_a_folder_whose_owner_runs_stays_whatever_its_process_id_says(tmp_path):
    """Defect: liveness was judged by the pid in the folder's name, which says nothing across PID namespaces: a
    server in another container sharing the temporary directory (there, say, pid 7; here no such process)
    removed a live server's scratch folder, and every python run of that server failed from then on."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        made = Path(owner.stdout.readline().strip())
        assert made.parent == tmp_path and (made / OWNER_LOCK).is_file()
        # As another namespace's server names it: a pid that runs nothing here.
        elsewhere = settled(made.rename(tmp_path / f"nereid-{dead_pid()}-other"))
        assert remove_stale_scratch(tmp_path) == 0 and elsewhere.is_dir()
    finally:
        owner.kill()
        owner.wait()
    assert remove_stale_scratch(tmp_path) == 1 and not elsewhere.exists()  # its owner ended: the lock is free


def test_a_live_owners_folder_stays_when_a_cleaner_removed_its_lock_file(tmp_path):
    """Found by a bug hunt: a /tmp cleaner's age rule (systemd-tmpfiles') removed a live server's .owner.lock, never
    touched after it is made, and a server starting in another container sharing the temporary directory took the
    folder for a dead one's by its pid (which runs nothing there) and removed it. The folder's own lock tells."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        made = Path(owner.stdout.readline().strip())
        (made / OWNER_LOCK).unlink()  # as the cleaner does
        elsewhere = settled(made.rename(tmp_path / f"nereid-{dead_pid()}-other"))  # as another namespace names it
        assert remove_stale_scratch(tmp_path) == 0 and elsewhere.is_dir()
    finally:
        owner.kill()
        owner.wait()
    assert remove_stale_scratch(tmp_path) == 1 and not elsewhere.exists()  # its owner ended: nothing holds it


# A scratch folder as a nereid before the folder's own lock made and held it: its .owner.lock alone locked.
OLDER_OWNER = """
import fcntl, os, tempfile, time
folder = tempfile.mkdtemp(prefix=f"nereid-{os.getpid()}-")
descriptor = os.open(os.path.join(folder, ".owner.lock"), os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(descriptor, fcntl.LOCK_EX)
print(folder, flush=True)
time.sleep(60)
"""


def test_an_older_nereids_folder_is_still_told_by_its_lock_file(tmp_path):
    owner = subprocess.Popen([sys.executable, "-S", "-c", OLDER_OWNER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        made = Path(owner.stdout.readline().strip())
        elsewhere = settled(made.rename(tmp_path / f"nereid-{dead_pid()}-older"))
        assert remove_stale_scratch(tmp_path) == 0 and elsewhere.is_dir()
    finally:
        owner.kill()
        owner.wait()
    assert remove_stale_scratch(tmp_path) == 1 and not elsewhere.exists()


def test_a_just_made_folder_stays_and_a_given_back_one_is_gone(tmp_path, monkeypatch):
    fresh = tmp_path / f"nereid-{dead_pid()}-new"  # its owner may not have taken its lock yet
    fresh.mkdir()
    assert remove_stale_scratch(tmp_path) == 0 and fresh.is_dir()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # (read again from TMPDIR)
    mine = settled(make_scratch_folder("check-"))
    assert mine.name.startswith(f"{scratch_prefix()}check-")
    assert remove_stale_scratch(tmp_path) == 0 and mine.is_dir()  # held by this process
    remove_scratch_folder(mine)
    assert not mine.exists()


def test_a_killed_writers_partials_in_a_model_folder_go_when_it_loads(repo, serve):
    """Defect: a server killed while it wrote an executable cache entry (or migrated weights) left its .partial
    in the model folder for good; only a cpp or cxx build ever looked, and only in its own .cache/."""
    folder = repo.python("echo", main=ECHO_MAIN)
    (folder / ".cache").mkdir()
    stale = [folder / ".cache" / f".model.mlir.abc.xlaexe.1a2b3c4d.{dead_pid()}.partial",
             folder / f".weights.safetensors.5e6f7a8b.{dead_pid()}.partial"]
    for partial in stale:
        partial.write_text("half")
        settled(partial)
    fresh = folder / ".cache" / f".model.mlir.def.xlaexe.9c0d1e2f.{dead_pid()}.partial"
    fresh.write_text("being written, maybe by a server in another PID namespace")
    server = serve(repo.write_config())
    assert server.server.repository.entry("echo").state.value == "READY"
    assert not any(partial.exists() for partial in stale) and fresh.exists()


def test_a_scratch_folder_made_again_by_runs_at_once_is_locked_again(tmp_path, monkeypatch):
    """Defects: runs making their folders at once after the scratch folder was removed failed with
    FileExistsError (76 of 1,600 in a reviewer's run), and the folder made again had no lock, so a server in
    another PID namespace took it for a dead one's and removed it under a running request."""
    import threading

    from nereid.leftovers import _owner_gone, make_private_folder

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    root = make_scratch_folder()
    try:
        for _ in range(20):
            shutil.rmtree(root)
            failures: list[BaseException] = []

            def run(index: int) -> None:
                try:
                    make_private_folder(root / "model" / f"run-{index}")
                except BaseException as err:
                    failures.append(err)
            threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert failures == [] and len(list((root / "model").iterdir())) == 8
            assert root.stat().st_mode & 0o777 == 0o700
            assert not _owner_gone(str(root), dead_pid())  # held again: no other server takes it for a dead one's
            (root / OWNER_LOCK).unlink()  # (a cleaner's doing): the folder made again is itself held again too
            assert not _owner_gone(str(root), dead_pid())
    finally:
        remove_scratch_folder(root)


def test_a_tmpdir_that_cannot_be_used_fails_the_start_naming_it(tmp_path, monkeypatch):
    """Defect: a TMPDIR that is not there, not a folder, not writable or full was passed over in silence by Python's
    tempfile, and the scratch folder made in /tmp (which may be the noexec or small folder TMPDIR was set to
    avoid): the start fails, naming TMPDIR and the system's reason."""
    import pytest

    from nereid.leftovers import ScratchFolderError

    (tmp_path / "a-file").write_text("not a folder")
    for tmpdir, reason in ((tmp_path / "missing", "No such file or directory"),
                           (tmp_path / "a-file", "Not a directory")):
        monkeypatch.setenv("TMPDIR", str(tmpdir))
        monkeypatch.setattr("tempfile.tempdir", None)  # (read again from TMPDIR)
        with pytest.raises(ScratchFolderError) as caught:
            remove_scratch_folder(make_scratch_folder())  # (gives back what the old code made elsewhere)
        assert str(caught.value) == (
            f"TMPDIR={tmpdir}: the server cannot make its scratch folder there: {reason} (TMPDIR must be a writable "
            "folder with free space, on a file system that allows executables: cpp and cxx models run code from it)")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    made = make_scratch_folder()
    assert made.parent == tmp_path and sorted(p.name for p in tmp_path.iterdir()) == ["a-file", made.name]
    remove_scratch_folder(made)


# In a mount namespace of its own (no root needed): a full tmpfs as TMPDIR, then (unless "$3" is "no-tmp") one over
# /tmp with TMPDIR unset.
_FULL_TMPDIR = """
mount -t tmpfs -o size=64k tmpfs "$0" && cat /dev/zero > "$0/fill" 2>/dev/null
TMPDIR="$0" "$1" -c "$2"
[ "$3" = no-tmp ] && exit
mount -t tmpfs -o size=64k tmpfs /tmp && cat /dev/zero > /tmp/fill 2>/dev/null
env -u TMPDIR "$1" -c "$2"
mount -t tmpfs -o size=64k tmpfs /var/tmp && cat /dev/zero > /var/tmp/fill 2>/dev/null
cd /var/tmp && env -u TMPDIR "$1" -c "$2"  # the working directory, a candidate too
"""
_MAKE_SCRATCH = """
import logging, sys
logging.basicConfig(format="%(levelname)s %(message)s", stream=sys.stdout)
from nereid.leftovers import make_scratch_folder, remove_scratch_folder
try:
    folder = make_scratch_folder()
except OSError as err:
    print(type(err).__name__, err)
else:
    print("made in", folder.parent)
    remove_scratch_folder(folder)
"""


def test_a_full_tmpdir_fails_the_start_and_a_full_tmp_without_tmpdir_is_warned_about(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    unshare = ["unshare", "-rm", "sh", "-c"]
    probe = subprocess.run([*unshare, 'mount -t tmpfs -o size=64k tmpfs "$0"', str(full)], capture_output=True,
                           text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        import pytest

        pytest.skip(f"cannot mount a tmpfs in a namespace here: {probe and probe.stderr.strip()}")
    # A tmpfs over /tmp hides an interpreter or a checkout that lives there (a CI clone in /tmp): then only TMPDIR.
    import nereid

    hidden = any(Path(path).resolve().is_relative_to("/tmp") for path in (sys.executable, sys.prefix,
                                                                          nereid.__file__))
    result = subprocess.run([*unshare, _FULL_TMPDIR, str(full), sys.executable, _MAKE_SCRATCH,
                             "no-tmp" if hidden else "tmp"], capture_output=True, text=True, timeout=60, cwd="/")
    lines = result.stdout.splitlines()
    assert lines[0] == (
        f"ScratchFolderError TMPDIR={full}: the server cannot make its scratch folder there: No space left on device "
        "(TMPDIR must be a writable folder with free space, on a file system that allows executables: cpp and cxx "
        "models run code from it)"), result.stdout + result.stderr
    if hidden:
        assert lines[1:] == [], result.stdout + result.stderr
        return
    fallback = lines[2].removeprefix("made in ")
    assert lines[1:3] == [
        "WARNING the temporary directory /tmp cannot be used (No space left on device) and TMPDIR is not set: the "
        f"server's scratch folder is made in {fallback} instead; set TMPDIR to choose the folder (on a file system "
        "that allows executables)", f"made in {fallback}"], result.stdout + result.stderr
    assert fallback != "/tmp"
    # Nothing writable at all (/tmp, /var/tmp and the working directory full): Python's own message named no remedy.
    assert re.fullmatch(r"ScratchFolderError no temporary directory is writable \(TMPDIR=unset: No space left on "
                        r"device; No usable temporary directory found in \[.*\]\): set TMPDIR to a writable folder "
                        r"with free space, on a file system that allows executables \(cpp and cxx models run code "
                        r"from it\)", lines[3]), result.stdout + result.stderr
    assert len(lines) == 4, result.stdout + result.stderr


def test_dead_servers_folders_are_looked_for_where_the_operator_asked_whatever_tempfile_chose(monkeypatch) -> None:
    """With TMPDIR unset and /tmp full of dead servers' folders, tempfile chose /var/tmp, and the start looked for
    dead servers' folders there only: /tmp stayed full, and every start warned and went elsewhere."""
    from nereid.leftovers import asked_temporary_directory

    monkeypatch.setattr("tempfile.tempdir", "/var/tmp")  # what tempfile chose, /tmp being full
    monkeypatch.delenv("TMPDIR", raising=False)
    assert asked_temporary_directory() == Path("/tmp")
    monkeypatch.setenv("TMPDIR", "/srv/scratch")
    assert asked_temporary_directory() == Path("/srv/scratch")


def test_a_umask_that_takes_the_owner_s_write_permission_is_named_at_start(tmp_path, monkeypatch):
    """The deployment hunt: a server that is not root, started under `umask 0277`, failed with a bare
    `Permission denied: .../.owner.lock`, naming neither the umask nor what to do."""
    from support import run_as_non_root

    (tmp_path / "tmp").mkdir()
    (tmp_path / "ml").mkdir()
    (tmp_path / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml"\n')
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    done = run_as_non_root(["sh", "-c", 'umask 0277 && exec "$0" "$@"', sys.executable, "-m", "nereid", "check",
                            "--config", str(tmp_path / "nereid.yaml")], tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.fullmatch(
        r"error: the server's umask \(0277\) takes its own user's permissions from the folders and files it makes: "
        rf"its scratch folder {re.escape(str(tmp_path / 'tmp'))}/nereid-\d+-check-\w+ was made mode 0500, where it "
        r"writes its lock file \(\.owner\.lock\) and each model's run folders; start it under a umask that leaves "
        r"the owner read, write and search permission \(umask 0077, or 0022\)\n", done.stderr), done.stderr
    assert list((tmp_path / "tmp").iterdir()) == []  # (nothing left behind)
