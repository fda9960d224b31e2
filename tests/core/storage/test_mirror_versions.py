"""Version folders of a bucket's mirror (``nereid.storage.mirror``): each server runs the version it loaded, whole,
and a version folder stays while any server holds it, against a real S3 API (moto)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import obstore
import pytest

from moto_s3 import bucket_state, upload_folder
from nereid.settings import load_settings
from support import textproto_single


# main.py of version <main> returns main * 10 + helper.FACTOR for every element, its helper.py read at each run:
# 11 and 22 are real versions, 12 and 21 mixes of two that never existed together.
MIX_MAIN = '''
import array, os, sys
import helper
MAIN = {main}
data = sys.stdin.buffer.read()
values = array.array('f', data)
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(("%s %s\\n" % (os.environ["NEREID_INPUT_DTYPE"], os.environ["NEREID_INPUT_SHAPE"])).encode())
    out.write(array.array('f', [MAIN * 10 + helper.FACTOR] * len(values)).tobytes())
'''


def _upload_mix(s3, tmp_path: Path, version: int) -> None:
    source = tmp_path / f"mix-v{version}"
    folder = source / "mix"
    folder.mkdir(parents=True)
    (folder / "model_inference.textproto").write_text(textproto_single())
    (folder / "main.py").write_text(MIX_MAIN.format(main=version))
    (folder / "helper.py").write_text(f"FACTOR = {version}\n")
    upload_folder(s3.store, source, s3.prefix)


@pytest.fixture
def mix(echo):
    """``mix(server)``: what the mix model on ``server`` answers, one value for every element."""
    def answer(server) -> float:
        values = set(echo(server.client, "mix", np.zeros((1, 4), dtype=np.float32)).ravel().tolist())
        assert len(values) == 1
        return values.pop()
    return answer


def _version_folders(mirror: Path, name: str) -> list[str]:
    import os

    versions = mirror / name / ".nereid-versions"
    return sorted(n for n in os.listdir(versions) if not n.startswith(".")) if versions.is_dir() else []


def test_servers_sharing_the_cache_each_run_the_version_they_loaded(s3, serve, tmp_path, bucket_config, until,
                                                                    mix) -> None:
    # Defect: a server's fetch rewrote the mirror folder that the loaded versions ran from, file by file: a server
    # sharing cache_dir that never reloaded (and, during a reload, a server's own old version) answered with its
    # old main.py and the new helper.py, a version that never existed, for good.
    _upload_mix(s3, tmp_path, 1)
    config = bucket_config(tmp_path, s3.url())
    a, b = serve(config), serve(config)
    assert (mix(a), mix(b)) == (11, 11)
    _upload_mix(s3, tmp_path, 2)
    a.client.load_model("mix")
    assert mix(a) == 22
    assert mix(b) == 11  # not reloaded: the version it loaded, whole (12 was old main.py + new helper.py)
    mirror = a.server.settings.server.ml_backends_path
    assert (mirror / "mix" / "helper.py").read_text() == "FACTOR = 2\n"  # the mirror itself is up to date
    assert len(_version_folders(mirror, "mix")) == 2  # B's version keeps its own
    b.client.load_model("mix")
    assert mix(b) == 22
    # The version no server runs any more is removed; the one both run stays.
    until(lambda: len(_version_folders(mirror, "mix")) == 1, "the version folder nobody holds is removed")
    b.client.unload_model("mix")
    assert mix(a) == 22


def test_a_fetch_during_a_reload_leaves_the_running_version_whole(s3, serve, tmp_path, bucket_config, mix) -> None:
    # The fetch a reload makes before its new version is READY (here made by hand, as the reload's own) changes
    # nothing the running version reads at each run.
    from nereid.storage import materialize_model_version

    _upload_mix(s3, tmp_path, 1)
    server = serve(bucket_config(tmp_path, s3.url()))
    assert mix(server) == 11
    _upload_mix(s3, tmp_path, 2)
    hold = materialize_model_version(server.server.settings.server, "mix")
    try:
        assert (hold.folder / "helper.py").read_text() == "FACTOR = 2\n"
        assert hold.folder.name == "mix"  # (a model sees a folder named as itself)
        assert mix(server) == 11
    finally:
        hold.release()
    server.client.load_model("mix")
    assert mix(server) == 22


def test_a_version_folder_stays_while_any_server_holds_it(s3, tmp_path, bucket_config, until) -> None:
    import subprocess
    import sys

    from nereid.storage import drop_mirror_folder, materialize_model_version
    from nereid.storage.mirror import IN_USE_FILE

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    mirror = server.ml_backends_path
    _upload_mix(s3, tmp_path, 1)
    first = materialize_model_version(server, "mix")
    again = materialize_model_version(server, "mix")  # the same files: the same folder
    assert again.folder == first.folder and (first.folder / "main.py").read_text() == MIX_MAIN.format(main=1)
    assert first.folder.is_relative_to(mirror / "mix")
    # Builds (a cpp model's binary, say) go to the folder's own .cache/, shared by its versions: in a version's
    # own, they went with it (review), and every restart of a cpp model from a bucket compiled it again.
    assert (first.folder / ".cache").resolve() == (mirror / "mix" / ".cache").resolve()
    _upload_mix(s3, tmp_path, 2)
    second = materialize_model_version(server, "mix")
    assert second.folder != first.folder
    assert (first.folder / "helper.py").read_text() == "FACTOR = 1\n"  # no later fetch changes a version's files
    assert (second.folder / "helper.py").read_text() == "FACTOR = 2\n"
    # Another server holds the first version too (a real process: a flock of its own).
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
                               "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()",
         str(first.folder.parent / IN_USE_FILE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        first.release()
        again.release()
        first.release()  # (a second release does nothing)
        time.sleep(0.3)
        materialize_model_version(server, "mix").release()  # a fetch, which removes what no server holds...
        assert first.folder.is_dir()  # ...leaves this one: held by the other server
        for key in bucket_state(s3.store, f"{s3.prefix}/mix/"):
            obstore.delete(s3.store, key)
        second.release()
        assert not drop_mirror_folder(server, "mix")  # a version still runs from it
        assert first.folder.is_dir()
    finally:
        holder.stdin.close()
        holder.wait(10)
    # (A release's prune, on a thread, may hold the folder's lock a moment: the drop then waits for a later try.)
    until(lambda: drop_mirror_folder(server, "mix"), "the copy dropped once no server holds a version of it")
    assert not (mirror / "mix").exists()


def test_a_version_folder_made_anew_under_the_same_path_is_held_of_its_own(s3, tmp_path, bucket_config) -> None:
    """Found by a bug hunt: after the cache was deleted and the model loaded again, its version folder (the same
    path, made anew) counted one more hold on the deleted folder's lock and took none on its own; another server
    sharing the cache (or nereid check) then removed the folder the model ran from: READY, every request failing."""
    import shutil
    import subprocess
    import sys

    from nereid.storage import materialize_model_version
    from nereid.storage.mirror import IN_USE_FILE

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    _upload_mix(s3, tmp_path, 1)
    first = materialize_model_version(server, "mix")
    shutil.rmtree(server.ml_backends_path / "mix")  # a cache cleaner, an operator
    again = materialize_model_version(server, "mix")
    assert again.folder == first.folder and (again.folder / "helper.py").is_file()

    def other_server_may_remove() -> bool:  # what another server's removal tries: an exclusive lock, no wait
        probe = subprocess.run(
            [sys.executable, "-c", "import fcntl, os, sys\ntry:\n    fd = os.open(sys.argv[1], os.O_RDWR)\n"
                                   "except FileNotFoundError:\n    print('gone'); sys.exit()\n"
                                   "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
                                   "except BlockingIOError:\n    print('held')\nelse:\n    print('free')",
             str(again.folder.parent / IN_USE_FILE)], capture_output=True, text=True, timeout=30)
        return probe.stdout.strip() in ("free", "gone")  # (gone: this server's own prune after the releases)
    try:
        assert not other_server_may_remove()
        first.release()  # the deleted folder's hold: the new folder's stays
        assert not other_server_may_remove()
    finally:
        first.release()
        again.release()
    assert other_server_may_remove()


def test_a_held_version_folder_whose_in_use_file_was_deleted_is_kept(s3, tmp_path, bucket_config) -> None:
    """(The review of the change above: keyed by the in-use file, a folder whose file a cleaner deleted was no longer
    seen as held, and this process's own prune removed the folder its model ran from.)"""
    from nereid.storage import materialize_model_version
    from nereid.storage.mirror import IN_USE_FILE, _prune_versions

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    _upload_mix(s3, tmp_path, 1)
    hold = materialize_model_version(server, "mix")
    try:
        (hold.folder.parent / IN_USE_FILE).unlink()
        assert _prune_versions(server.ml_backends_path / "mix")  # still held: kept
        assert (hold.folder / "helper.py").is_file()
    finally:
        hold.release()


def test_a_file_or_symlink_put_among_the_version_folders_does_not_keep_a_copy_for_ever(s3, tmp_path, bucket_config,
                                                                                       until) -> None:
    """Carried from a hunt: a file directly in .nereid-versions/ (someone's note, an editor's swap file) made the
    prune of version folders say "still held" for ever, so the copy of a model gone from the store was never
    dropped. Such entries are not version folders: removed (a symlink's target is left alone)."""
    from nereid.storage import drop_mirror_folder, materialize_model_version
    from nereid.storage.mirror import VERSIONS_FOLDER, _prune_versions

    server = load_settings(bucket_config(tmp_path, s3.url())).server
    _upload_mix(s3, tmp_path, 1)
    materialize_model_version(server, "mix").release()
    versions = server.ml_backends_path / "mix" / VERSIONS_FOLDER
    outside = tmp_path / "outside"
    outside.mkdir()
    (versions / "notes.txt").write_text("a file of someone's")
    (versions / "linked").symlink_to(outside)
    assert not _prune_versions(server.ml_backends_path / "mix")
    assert sorted(p.name for p in versions.iterdir()) == [] and outside.is_dir()
    for key in bucket_state(s3.store, f"{s3.prefix}/mix/"):
        obstore.delete(s3.store, key)
    until(lambda: drop_mirror_folder(server, "mix"), "the copy dropped")
    assert not (server.ml_backends_path / "mix").exists()
