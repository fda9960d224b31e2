"""The mirror's local cache (``nereid.storage.mirror``) shared by servers: the folder locks, a damaged or full
cache, and the removal of copies of folders gone from the store, against a real S3 API (moto)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import obstore
import pytest

from moto_s3 import bucket_state, upload_folder
from nereid.files import remove_tree
from nereid.settings import load_settings
from nereid.storage import mirror_root, parse_store_url
from nereid.storage.mirror import MARKER_FILE, read_marker
from support import wait_until


def test_a_mirror_folder_that_cannot_be_made_is_logged_with_its_path_and_the_reason(s3, tmp_path, caplog,
                                                                                    bucket_config) -> None:
    """Defect: the listing's WARNING "cannot make its local mirror folder" named the model but not the folder
    it could not make: it names the folder (under cache_dir) and the system's reason, once. Defect (found by a
    bug hunt): a stray file where a mirror folder belongs failed every load of that model ("File exists"): the
    cache is nereid's, so the file is removed (logged) and the folder made."""
    import logging

    from nereid.storage import materialize_model_folder, scan_model_folders

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    long_name = "m" * 300
    for name in (long_name, "blocked"):
        obstore.put(s3.store, f"{s3.prefix}/{name}/main.py", b"print()")
    server.ml_backends_path.mkdir(parents=True)
    (server.ml_backends_path / "blocked").write_text("a file where the mirror folder goes")
    with caplog.at_level(logging.WARNING, logger="nereid.storage"):
        for _ in range(2):  # (each listing meets them: said once)
            assert scan_model_folders(server) == ["blocked", long_name]
    lines = [r.getMessage() for r in caplog.records if "cannot make its local mirror folder" in r.getMessage()]
    assert lines == [
        f"model folder '{long_name[:80]}... (300 characters)': cannot make its local mirror folder "
        f"{server.ml_backends_path / long_name}: File name too long (a local file system allows 255 bytes per "
        "name); it cannot load"], lines
    blocked = server.ml_backends_path / "blocked"
    assert [r.getMessage() for r in caplog.records if "removed" in r.getMessage()] == [
        f"{s3.url('blocked')}: removed {blocked} from the local cache: a file where the model's folder belongs (a "
        "damaged cache?); the folder is fetched again"]
    assert blocked.is_dir()
    # Found at a load (a file put there after the listing): removed under the folder's lock, and the load goes on.
    blocked.rmdir()
    blocked.write_text("a file where the mirror folder goes")
    assert (materialize_model_folder(server, "blocked") / "main.py").read_bytes() == b"print()"


@pytest.mark.parametrize("record", ['{"url": "x", "fetched": [], "streamed": []}', "not json", '{"url": 1}',
                                    '{"url": "x", "fetched": {"main.py": {"a_field_of_a_later_nereid": 1}}, '
                                    '"streamed": {}}'],
                         ids=["wrong shape", "garbage", "fields missing", "unknown fields"])
def test_an_unreadable_fetch_record_is_fetched_again_with_a_warning(s3, tmp_path, caplog, record,
                                                                    bucket_config) -> None:
    """Defect: a record of the wrong shape failed the model with a bare AttributeError naming no file, never
    retried; any unreadable record (garbage, another nereid version's fields) failed it until someone deleted the
    folder, though the record only saves fetches."""
    from nereid.storage import materialize_model_folder

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    obstore.put(s3.store, f"{s3.prefix}/m/main.py", b"print(1)")
    local = materialize_model_folder(server, "m")
    (local / MARKER_FILE).write_text(record)
    with caplog.at_level(logging.WARNING, logger="nereid.storage"):
        assert materialize_model_folder(server, "m") == local
    assert (local / "main.py").read_bytes() == b"print(1)" and len(s3.gets("m/main.py")) == 2
    assert set(read_marker(local).fetched) == {"main.py"}  # written again, whole
    (warning,) = [r.getMessage() for r in caplog.records if MARKER_FILE in r.getMessage()]
    assert warning.startswith(f"{local / MARKER_FILE}: unreadable (") and \
        warning.endswith("); fetching the whole folder again"), warning


@pytest.mark.parametrize("damage", ["fifo", "folder"])
def test_a_fetch_record_that_is_no_regular_file_is_removed_and_the_folder_fetched_again(s3, tmp_path, caplog,
                                                                                         damage, bucket_config) -> None:
    """Defect (a bug hunt of persistent caches): a FIFO in the record's place hung the load for good, opening it
    to wait for a writer while it held the folder's lock, so that no later load of the model was answered until
    a restart; a folder there failed every load ('cannot record what it fetched ...: Is a directory') though the
    WARNING said the folder would be fetched again. Either is removed, and the load goes on."""
    from nereid.storage import materialize_model_folder

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    obstore.put(s3.store, f"{s3.prefix}/m/main.py", b"print(1)")
    local = materialize_model_folder(server, "m")
    marker = local / MARKER_FILE
    marker.unlink()
    if damage == "fifo":
        os.mkfifo(marker)
    else:
        marker.mkdir()
        (marker / "inside").write_text("x")
    loading, outcome = _loading(server)
    with caplog.at_level(logging.WARNING, logger="nereid.storage"):
        loading.start()
        loading.join(30)
        hung = loading.is_alive()
        if hung:  # blocked opening the FIFO: a writer that closes at once lets it go, so the test ends
            os.close(os.open(marker, os.O_WRONLY | os.O_NONBLOCK))
            loading.join(30)
    assert not hung, "the load waited for a writer of the record's FIFO"
    assert outcome == {"folder": local}, outcome
    assert marker.is_file() and set(read_marker(local).fetched) == {"main.py"}  # written again, whole
    assert len(s3.gets("m/main.py")) == 2
    kind = "a FIFO" if damage == "fifo" else "a directory"
    assert [r.getMessage() for r in caplog.records if MARKER_FILE in r.getMessage()] == [
        f"{marker}: unreadable (is {kind}, not a regular file); removed it, fetching the whole folder again"]


def _loading(server) -> tuple[threading.Thread, dict[str, object]]:
    """A thread (not started) that fetches model folder ``m`` of ``server``, and where it puts what it got: the
    folder, or the error it raised."""
    from nereid.storage import materialize_model_folder

    outcome: dict[str, object] = {}

    def load() -> None:
        try:
            outcome["folder"] = materialize_model_folder(server, "m")
        except BaseException as err:  # (reported by the caller's asserts)
            outcome["error"] = err
    return threading.Thread(target=load, daemon=True), outcome


def _hold_lock(path: Path):
    """A real process holding the flock of ``path`` (another server fetching that folder) until its stdin closes."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
         str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_fetch_waiting_for_a_lock_another_process_holds_says_so_once_naming_it(s3, tmp_path, caplog,
                                                                                   monkeypatch, bucket_config) -> None:
    """Defect (the bug hunt of persistent caches): a peer sharing cache_dir that hung holding a folder's lock kept
    the load waiting for good, and the only line, after 60 s, blamed the store ('the fetch of its folder from
    the object store has not returned'). The wait is a WARNING once it lasts past the quiet time, naming the lock
    and its holder."""
    from nereid.storage import mirror

    monkeypatch.setattr(mirror, "QUIET_LOCK_WAIT_S", 0.2)  # (5 s: a turn between replicas starting together)
    server = load_settings(bucket_config(tmp_path, s3.url())).server
    obstore.put(s3.store, f"{s3.prefix}/m/main.py", b"print(1)")
    lock = Path(server.ml_backends_path) / ".m.lock"
    lock.parent.mkdir(parents=True)
    holder = _hold_lock(lock)
    loading, outcome = _loading(server)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]

    try:
        with caplog.at_level(logging.DEBUG, logger="nereid.storage"):
            loading.start()
            warned = wait_until(said, 30)
            waiting = loading.is_alive() and not outcome
            holder.stdin.close()
            holder.wait(10)
            loading.join(30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert warned and waiting, (warned, outcome)
    assert outcome == {"folder": Path(server.ml_backends_path) / "m"}, outcome
    assert said() == [f"{s3.url('m')}: waiting for {lock}, held by another process sharing cache_dir (pid "
                      f"{holder.pid}); this goes on once it lets go"]
    assert [r.levelname for r in caplog.records if "waiting for" in r.getMessage()] == ["WARNING"]


def test_a_lock_held_by_this_very_server_is_waited_for_without_a_warning(tmp_path, caplog, monkeypatch) -> None:
    """Another thread of the same server (a removal of released versions, a listing making the folder) holds a
    folder's lock a moment only: its wait is said at DEBUG, never blamed on a process sharing cache_dir."""
    from nereid.storage import mirror
    from nereid.storage.mirror import _folder_lock

    monkeypatch.setattr(mirror, "QUIET_LOCK_WAIT_S", 0.0)

    lock = tmp_path / ".m.lock"
    waited = threading.Event()

    def waiter() -> None:
        with _folder_lock(lock, url="s3://b/m") as held:
            assert held
            waited.set()

    with caplog.at_level(logging.DEBUG, logger="nereid.storage"):
        with _folder_lock(lock) as held:
            assert held
            thread = threading.Thread(target=waiter, daemon=True)
            thread.start()
            assert wait_until(lambda: [r for r in caplog.records if "waiting for" in r.getMessage()], 30)
            assert not waited.is_set()
        assert waited.wait(30)
        thread.join(30)
    assert [(r.levelname, r.getMessage()) for r in caplog.records if "waiting for" in r.getMessage()] == [
        ("DEBUG", f"s3://b/m: waiting for {lock}, held by this server")]


def test_a_folder_deleted_from_the_bucket_leaves_the_cache_once_forgotten(s3, serve, tmp_path, python_folder,
                                                                          bucket_config, echo, until) -> None:
    # Defect: every deleted model's copy stayed in cache_dir for ever ('<name>/' with its marker, main.py, the
    # textproto, a bundle's .cache/ executables, and '.<name>.lock'), across restarts: a server fed versioned
    # names grew by a folder per name.
    import os

    source = tmp_path / "source"
    python_folder(source, "keep")
    python_folder(source, "v1")
    upload_folder(s3.store, source, s3.prefix)
    mirror = mirror_root(tmp_path / "cache", parse_store_url(s3.url()))
    mirror.mkdir(parents=True)
    for leftover in ("old", "busy"):  # left by an earlier server: their prefixes went while it was down
        (mirror / leftover / ".cache").mkdir(parents=True)
        (mirror / leftover / "main.py").write_text("print()")
        (mirror / leftover / ".cache" / "executable.bin").write_bytes(b"compiled")
        (mirror / f".{leftover}.lock").touch()
    (mirror / ".lockonly.lock").touch()
    holder = _hold_lock(mirror / ".busy.lock")  # another server sharing cache_dir is fetching 'busy'
    try:
        server = serve(bucket_config(tmp_path, s3.url()))

        def cached() -> list[str]:
            return sorted(os.listdir(mirror))

        until(lambda: cached() == [".busy.lock", ".keep.lock", ".v1.lock", "busy", "keep", "v1"],
               "the leftovers 'old' and '.lockonly.lock' are removed at start, and only they")
        (mirror / "v1" / ".cache").mkdir(exist_ok=True)  # what a bundle's compiled executables would be
        (mirror / "v1" / ".cache" / "executable.bin").write_bytes(b"compiled")
        for key in bucket_state(s3.store, f"{s3.prefix}/v1/"):
            obstore.delete(s3.store, key)
        # Loaded, it serves on from its copy, which stays.
        assert {m.name for m in server.client.get_model_repository_index().models} == {"keep", "v1"}
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        np.testing.assert_array_equal(echo(server.client, "v1", x), x)
        assert (mirror / "v1" / "main.py").is_file()
        server.client.unload_model("v1")
        assert [m.name for m in server.client.get_model_repository_index().models] == ["keep"]  # forgotten
        until(lambda: cached() == [".busy.lock", ".keep.lock", "busy", "keep"],  # 'busy' waits for its lock
               "the copy of the forgotten 'v1' is removed")
        holder.stdin.close()
        holder.wait(10)
        server.client.get_model_repository_index()  # the next listing tries again
        until(lambda: cached() == [".keep.lock", "keep"], "'busy' is removed once its lock is free")
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    np.testing.assert_array_equal(echo(server.client, "keep", x), x)


def test_a_cached_folder_is_removed_only_when_the_store_says_its_prefix_is_gone(s3, tmp_path, monkeypatch,
                                                                                bucket_config) -> None:
    from nereid.storage import drop_mirror_folder, materialize_model_folder

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    obstore.put(s3.store, f"{s3.prefix}/m/main.py", b"print()")
    local = materialize_model_folder(server, "m")
    lock = local.parent / ".m.lock"
    assert lock.is_file()
    assert not drop_mirror_folder(server, "m")  # still in the bucket (whatever a listing of every folder said)
    obstore.delete(s3.store, f"{s3.prefix}/m/main.py")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGKEY")
    assert not drop_mirror_folder(server, "m")  # the store cannot say: it stays
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.env()["AWS_ACCESS_KEY_ID"])
    assert (local / "main.py").is_file()
    assert drop_mirror_folder(server, "m")
    assert not local.exists() and not lock.exists()
    assert [p.name for p in local.parent.iterdir()] == []  # nothing renamed aside is left either


def test_a_lock_deleted_by_its_holder_is_taken_anew_by_the_one_waiting(tmp_path) -> None:
    # The removal of a cached folder deletes its lock file while holding it: a server that was waiting for it
    # must then hold the lock of the file there, or a third one would take that file too and both would write.
    import threading

    from nereid.storage.mirror import _folder_lock

    lock = tmp_path / ".m.lock"
    waited, release = threading.Event(), threading.Event()

    def waiter() -> None:
        with _folder_lock(lock) as held:
            assert held
            waited.set()
            release.wait(10)

    with _folder_lock(lock) as held:
        assert held
        thread = threading.Thread(target=waiter)
        thread.start()
        # It waits for the lock: blocked on this very file (a fixed sleep let it come after the unlink, take a
        # fresh file at once and pass without the case; the review of the tests).
        inode = lock.stat().st_ino
        assert wait_until(lambda: any(line.split()[1:2] == ["->"] and f":{inode} " in line
                                      for line in Path("/proc/locks").read_text().splitlines()))
        lock.unlink()
    assert waited.wait(10)
    with _folder_lock(lock, wait=False) as third:
        assert not third  # the waiter holds the file now at the path
    release.set()
    thread.join(10)
    with _folder_lock(lock, wait=False) as fourth:
        assert fourth


# Run in a child whose files may not grow past 64 bytes (RLIMIT_FSIZE, with SIGXFSZ ignored so that a write fails
# with EFBIG instead of killing it): a cache_dir on a full disk, without a disk to fill.
_MATERIALIZE_WITH_FULL_DISK = """
import resource, signal, sys
from nereid.settings import load_settings
from nereid.storage import materialize_model_folder
from nereid.storage.client import store_failed
server = load_settings(sys.argv[1]).server
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
try:
    materialize_model_folder(server, sys.argv[2])
except Exception as err:
    print(type(err).__name__, store_failed(err), err)
"""


def test_a_cache_too_full_for_the_folders_record_is_a_storage_error_naming_it(s3, tmp_path, bucket_config) -> None:
    """Defect: with every file current but no room left in cache_dir for the folder's .nereid-remote.json, a bare
    "[Errno 28] No space left on device" escaped, which the watcher took for the model's own fault (never tried
    again): it is a StorageError naming the file under server.cache_dir, as a refused copy of a file is."""
    import subprocess
    import sys

    from nereid.storage import materialize_model_folder

    config = bucket_config(tmp_path, s3.url())
    obstore.put(s3.store, f"{s3.prefix}/full/main.py", b"print()")
    local = materialize_model_folder(load_settings(config).server, "full")  # every file current from here on
    marker = (local / MARKER_FILE).read_bytes()
    assert len(marker) > 64
    child = subprocess.run([sys.executable, "-c", _MATERIALIZE_WITH_FULL_DISK, str(config), "full"],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == (
        f"StorageError True {s3.url('full')}: cannot record what it fetched in the local cache "
        f"({local / MARKER_FILE}, under server.cache_dir): File too large"), child.stdout
    assert (local / MARKER_FILE).read_bytes() == marker  # the old record stands, and no partial file is left
    assert sorted(p.name for p in local.iterdir()) == [MARKER_FILE, "main.py"]


def test_a_lock_file_the_cache_refuses_is_a_storage_error_naming_it(s3, tmp_path, bucket_config) -> None:
    """The folder's lock file was made unwrapped: one the local cache refused (a full directory, a file where its
    folder goes) escaped as a bare OSError, which the watcher took for the model's own fault and never tried
    again. (A folder where the lock file goes is removed: see the test of nereid's own names below.)"""
    from nereid.storage import StorageError, materialize_model_folder

    config = bucket_config(tmp_path, s3.url())
    obstore.put(s3.store, f"{s3.prefix}/locked/main.py", b"print()")
    server = load_settings(config).server
    root = Path(server.ml_backends_path)
    root.parent.mkdir(parents=True)
    root.write_text("a file where the mirror's folder goes")  # no lock file can be made in it
    with pytest.raises(StorageError) as refused:
        materialize_model_folder(server, "locked")
    assert str(refused.value) == (f"{s3.url('locked')}: cannot make its lock file in the local cache "
                                  f"({root / '.locked.lock'}, under server.cache_dir): File exists")
    root.unlink()
    assert (materialize_model_folder(server, "locked") / "main.py").read_bytes() == b"print()"


def _release(hold) -> None:
    """Release a version folder, and wait for its removal's thread, which takes the folder's lock."""
    hold.release()
    for thread in threading.enumerate():
        if thread.name == "nereid-version-prune":
            thread.join(30)


@pytest.mark.parametrize("name, damage, kind", [
    (".nereid-versions", "file", "a file"), (".nereid-versions", "loop", "a symlink"),
    (".cache", "file", "a file"), (".cache", "loop", "a symlink"),
    ("../.m.lock", "folder", "a folder"), ("../.m.lock", "loop", "a symlink"),
    # A symlink that leads to a folder (or a file) elsewhere: written and deleted through before (the path-safety
    # hunt: the stale-file sweep and the versions' prune emptied the folder it led to).
    ("", "elsewhere", "a symlink"), (".nereid-versions", "elsewhere", "a symlink"),
    (".cache", "elsewhere", "a symlink"), ("../.m.lock", "elsewhere", "a symlink")])
def test_nereid_s_own_names_of_the_wrong_kind_are_removed_and_the_load_goes_on(s3, tmp_path, caplog, name, damage,
                                                                              kind, bucket_config) -> None:
    """Defect (the bug hunt of persistent caches): a file (or a symlink loop) where a mirror folder's
    .nereid-versions or .cache belongs, or a folder where its lock file belongs, failed every load of the model
    UNAVAILABLE for good, a damaged .cache named as the versions' folder ('cannot make its version folder
    (.../.nereid-versions ...): File exists'): each is removed under the folder's lock (the lock file before it
    is taken), as a file where the model's folder belongs is, logged naming it."""
    from nereid.storage import materialize_model_version

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    obstore.put(s3.store, f"{s3.prefix}/m/main.py", b"print(1)")
    _release(materialize_model_version(server, "m"))
    local = Path(server.ml_backends_path) / "m"
    damaged = Path(os.path.normpath(local / name))
    assert damaged.is_dir() if not name.endswith(".lock") else damaged.is_file()  # (as nereid made it)
    remove_tree(damaged) if damaged.is_dir() else damaged.unlink()
    if damage == "file":
        damaged.write_text("x")
    elif damage == "folder":
        damaged.mkdir()
        (damaged / "inside").write_text("x")
    elif damage == "loop":
        damaged.symlink_to(damaged.name)
    else:
        elsewhere = tmp_path / "elsewhere"
        (elsewhere / "sub").mkdir(parents=True)
        (elsewhere / "important.txt").write_text("keep")
        (elsewhere / "sub" / "notes.md").write_text("keep")
        damaged.symlink_to(elsewhere / "lock" if name.endswith(".lock") else elsewhere)
    with caplog.at_level(logging.WARNING, logger="nereid.storage"):
        hold = materialize_model_version(server, "m")
    try:
        assert (hold.folder / "main.py").read_bytes() == b"print(1)"
        assert (hold.folder / ".cache").resolve() == (local / ".cache").resolve() and (local / ".cache").is_dir()
    finally:
        _release(hold)
    assert not damaged.is_symlink() and (damaged.is_file() if name.endswith(".lock") else damaged.is_dir())
    if damage == "elsewhere":
        assert sorted(p.relative_to(elsewhere).as_posix() for p in elsewhere.rglob("*")) == [
            "important.txt", "sub", "sub/notes.md"]
    then = {".nereid-versions": "they are made again", ".cache": "they are built again", "": "the folder is fetched "
            "again"}.get(name, "it is made again")
    belongs = {".nereid-versions": "the folder of its versions", ".cache": "the folder of its builds",
               "": "the model's folder"}.get(name, "the model folder's lock file")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"{s3.url('m')}: removed {damaged} from the local cache: {kind} where {belongs} belongs (a damaged cache?); "
        f"{then}"]


def test_a_forgotten_copy_whose_lock_is_held_a_moment_is_removed_without_another_listing(s3, tmp_path, bucket_config,
                                                                                         until) -> None:
    """The prune a released version starts and the removal of a forgotten copy both take the folder's lock
    without waiting: the removal gave up, and the copy stayed until the next listing (a flaky full-suite run of
    the test above found it). It is tried again a moment later."""
    import threading

    from nereid.folder_cleanup import FolderCleanup
    from nereid.storage import materialize_model_folder

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    obstore.put(s3.store, f"{s3.prefix}/gone/main.py", b"print()")
    local = materialize_model_folder(server, "gone")
    obstore.delete(s3.store, f"{s3.prefix}/gone/main.py")
    holder = _hold_lock(local.parent / ".gone.lock")  # held as a prune holds it, for a moment
    threading.Timer(0.3, holder.stdin.close).start()
    try:
        (tmp_path / "scratch").mkdir()
        cleanup = FolderCleanup(tmp_path / "scratch", lambda name: False, set, lambda work, what: None)
        cleanup.drop_mirrors_soon(server, ["gone"])
        until(lambda: not local.exists(), "the copy removed once the lock is free")
    finally:
        holder.wait(10)


def test_a_lock_another_process_lets_go_of_within_the_quiet_time_is_waited_for_unsaid(tmp_path, caplog) -> None:
    """Found by the hunt of this session's late fixes: two replicas sharing cache_dir that start together take turns
    at a folder's lock for a second or less, and each such turn logged the WARNING meant for a peer hung holding
    it, which operators alerting on WARNING learn to ignore."""
    from nereid.storage.mirror import _folder_lock

    lock = tmp_path / ".m.lock"
    holder = _hold_lock(lock)
    threading.Timer(0.5, holder.stdin.close).start()  # (it lets go half a second in)
    try:
        with caplog.at_level(logging.DEBUG, logger="nereid.storage"):
            with _folder_lock(lock, url="s3://b/m") as held:
                assert held
    finally:
        holder.wait(10)
    assert not [r for r in caplog.records if "waiting for" in r.getMessage()]


@pytest.mark.parametrize("first", ["listing", "load"])
def test_the_files_fetched_from_a_bucket_are_in_a_folder_only_the_server_s_user_can_enter(s3, tmp_path, bucket_config,
                                                                                        first) -> None:
    """Defect (the path-safety hunt): under the usual umask 022 the cache's folders were made 0755 and its files
    0644, so every user of the machine could read the code and weights fetched from a private bucket. The
    cache's repositories/ folder is made 0700, whichever comes first, a listing or a load; one there already
    keeps the mode its operator gave it."""
    from nereid.storage import materialize_model_folder, scan_model_folders

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    obstore.put(s3.store, f"{s3.prefix}/m/main.py", b"print(1)")
    repositories = Path(server.ml_backends_path).parent
    old = os.umask(0o022)
    try:
        if first == "listing":
            assert scan_model_folders(server) == ["m"]
        folder = materialize_model_folder(server, "m")
    finally:
        os.umask(old)
    assert repositories.name == "repositories" and (folder / "main.py").read_bytes() == b"print(1)"
    assert repositories.stat().st_mode & 0o777 == 0o700
    repositories.chmod(0o750)  # an operator's choice
    materialize_model_folder(server, "m")
    scan_model_folders(server)
    assert repositories.stat().st_mode & 0o777 == 0o750
