"""When dynamic mode looks: after file events that count, at each poll of a store, and anew after a move."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import watchfiles

from nereid.file_events import RepositoryFollower, describe_error
from nereid.storage import parse_store_url


async def until(condition, what: str, timeout_s: float = 10) -> None:
    """Wait for ``condition()`` (a loaded machine starts watches slowly: no fixed sleep)."""
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def watching(events: RepositoryFollower) -> bool:
    """Whether every watch of ``events`` has started (it knows what it follows)."""
    return all(follow.current is not None for follow, _ in events.wanted_now())


def follower(tmp_path: Path, looks: list[str] | None = None, location=None, poll_s: float = 0.05,
             stop: asyncio.Event | None = None) -> RepositoryFollower:
    """A follower of ``tmp_path/ml-backends`` and ``tmp_path/nereid.yaml`` whose looks are counted in ``looks``."""
    root = tmp_path / "ml-backends"
    root.mkdir(exist_ok=True)
    (tmp_path / "nereid.yaml").touch()

    async def look() -> None:
        if looks is not None:
            looks.append("look")
    return RepositoryFollower(root, tmp_path / "nereid.yaml", location, False, 50, poll_s, look,
                              stop or asyncio.Event())


def test_editor_and_transfer_files_never_count_and_a_volume_data_link_swap_does(tmp_path):
    events = follower(tmp_path)
    root = tmp_path / "ml-backends"
    counts = {path: events.relevant(watchfiles.Change.modified, str(path)) for path in (
        root / "m" / "weights.bin", tmp_path / "nereid.yaml", root / "m" / ".weights.bin.x7Yq2",
        root / "m" / "main.py.swp", root / "m" / "main.py~", root / "m" / "__pycache__" / "main.cpython-311.pyc",
        root / ".versions" / "m", root / "m" / "..data", root / "m" / "..2026_12_02" / "main.py",
        tmp_path / "elsewhere.txt")}
    assert [path.relative_to(tmp_path).as_posix() for path, counted in counts.items() if counted] == [
        "ml-backends/m/weights.bin", "nereid.yaml", "ml-backends/m/..data"]


def test_a_file_written_in_a_model_folder_brings_a_look_and_stop_ends_the_watches(tmp_path):
    looks: list[str] = []

    async def scenario() -> None:
        stop = asyncio.Event()
        events = follower(tmp_path, looks, stop=stop, poll_s=60)  # (no look at a poll within the test)
        running = asyncio.create_task(events.run())
        await until(lambda: watching(events) and len(looks) == 2, "both watches up, each having looked once")
        await asyncio.sleep(0.2)
        assert len(looks) == 2  # nothing changed: no look
        (tmp_path / "ml-backends" / "m").mkdir()
        (tmp_path / "ml-backends" / "m" / "main.py").write_text("print('hi')\n")
        await until(lambda: len(looks) > 2, "a look after the write")
        stop.set()
        await asyncio.wait_for(running, 10)
    asyncio.run(scenario())


def test_a_local_tree_is_also_looked_at_every_poll_s_with_no_event(tmp_path):
    """Changes that send no file event (a write through mmap or a hard link from outside, another machine's on a
    network file system) are found by a look at every poll_s, as Triton's poll mode scans its repository."""
    looks: list[str] = []

    async def scenario() -> None:
        stop = asyncio.Event()
        events = follower(tmp_path, looks, stop=stop, poll_s=0.1)
        running = asyncio.create_task(events.run())
        await until(lambda: watching(events) and len(looks) >= 2, "both watches up, each having looked once")
        await until(lambda: len(looks) >= 5, "looks at the polls, nothing written")
        stop.set()
        await asyncio.wait_for(running, 10)
    asyncio.run(scenario())


def test_a_store_is_polled_every_poll_s_and_its_folder_is_not_watched(tmp_path):
    looks: list[str] = []

    async def scenario() -> None:
        stop = asyncio.Event()
        events = follower(tmp_path, looks, location=parse_store_url("s3://bucket/models"), poll_s=0.05, stop=stop)
        assert [paths.paths for _, paths in events.wanted_now()] == [(tmp_path,)]  # nereid.yaml's folder only
        running = asyncio.create_task(events.run())
        await asyncio.sleep(0.6)
        stop.set()
        await asyncio.wait_for(running, 10)
    asyncio.run(scenario())
    assert len(looks) >= 5  # about one per 50 ms, beside the one look nereid.yaml's watch made as it started


def test_a_switched_release_link_is_followed_anew_once_and_its_files_bring_looks(tmp_path, caplog):
    caplog.set_level(logging.INFO, "nereid.watch")
    looks: list[str] = []

    async def scenario() -> None:
        stop = asyncio.Event()
        events = follower(tmp_path, looks, stop=stop)
        root = tmp_path / "ml-backends"
        (tmp_path / "release-2" / "m").mkdir(parents=True)
        root.rename(tmp_path / "release-1")
        root.symlink_to(tmp_path / "release-2")  # a release switched by a link
        running = asyncio.create_task(events.run())
        await until(lambda: watching(events) and len(looks) == 2, "both watches up")
        before = [paths for _, paths in events.wanted_now()]
        root.unlink()
        root.symlink_to(tmp_path / "release-1")
        wanted = events.wanted_now()
        assert [paths for _, paths in wanted] != before
        events.restart_moved(wanted)
        events.restart_moved(wanted)  # (said once)
        # The watches start again on what the link leads to now, and look once more as each starts.
        await until(lambda: len(looks) >= 4 and all(follow.current == paths for follow, paths in wanted),
                    "the watches restarted on release-1")
        settled = len(looks)
        (tmp_path / "release-1" / "n").mkdir()
        (tmp_path / "release-1" / "n" / "main.py").write_text("")  # in the release followed now
        await until(lambda: len(looks) > settled, "a look after a write in the new release")
        stop.set()
        await asyncio.wait_for(running, 10)
    asyncio.run(scenario())
    assert len([r for r in caplog.records if "following anew" in r.getMessage()]) == 1


@pytest.mark.parametrize("target", ["real/nereid.yaml", "nereid.prod.yaml"])
def test_an_edit_in_place_of_the_file_a_symlinked_nereid_yaml_leads_to_brings_a_look(tmp_path, target):
    """Defect (a bug hunt): with nereid.yaml a symlink, to a file in another folder or beside it, an edit in place
    of that file (echo >>, touch) brought no look: only the folders of nereid.yaml and of the links on its way
    were watched, and only their names counted. The target's folder is watched and its name counts."""
    looks: list[str] = []
    (tmp_path / target).parent.mkdir(exist_ok=True)
    (tmp_path / target).write_text("models: []\n")
    (tmp_path / "nereid.yaml").symlink_to(target)

    async def scenario() -> None:
        stop = asyncio.Event()
        events = follower(tmp_path, looks, stop=stop)
        running = asyncio.create_task(events.run())
        await until(lambda: watching(events) and len(looks) == 2, "both watches up")
        assert (tmp_path / target).parent in events.wanted_now()[-1][1].paths
        with open(tmp_path / target, "a") as config:  # the same file written again: no name changes
            config.write("# edited in place\n")
        await until(lambda: len(looks) > 2, "a look after the target's edit")
        stop.set()
        await asyncio.wait_for(running, 10)
    asyncio.run(scenario())


def test_nereid_yaml_in_a_symlinked_folder_is_followed_by_that_folder_alone(tmp_path):
    """nereid.yaml and ml_backends_path in ``etc -> srv``: the file's own folder, srv, is already watched as etc.
    A second watch of one folder renames the events of the first (inotify gives the folder one watch, which
    reports by the name added last): ml_backends_path replaced would come as srv/ml-backends, which counts not."""
    looks: list[str] = []
    (tmp_path / "srv" / "ml-backends").mkdir(parents=True)
    (tmp_path / "srv" / "nereid.yaml").write_text("models: []\n")
    (tmp_path / "etc").symlink_to("srv")

    async def scenario() -> None:
        stop = asyncio.Event()
        events = RepositoryFollower(tmp_path / "etc" / "ml-backends", tmp_path / "etc" / "nereid.yaml", None, False,
                                    50, 0.05, _counted(looks), stop)
        running = asyncio.create_task(events.run())
        await until(lambda: watching(events) and len(looks) == 2, "both watches up")
        assert events.wanted_now()[-1][1].paths == (tmp_path, tmp_path / "etc")
        with open(tmp_path / "srv" / "nereid.yaml", "a") as config:
            config.write("# edited in place\n")
        await until(lambda: len(looks) > 2, "a look after the edit")
        stop.set()
        await asyncio.wait_for(running, 10)
    asyncio.run(scenario())


def _counted(looks: list[str]):
    """A look that counts itself in ``looks``."""
    async def look() -> None:
        looks.append("look")
    return look


@pytest.mark.parametrize("second", ["next/nereid.yaml", "real/nereid.next.yaml"])
def test_a_re_pointed_nereid_yaml_link_follows_its_new_target_and_no_longer_the_old(tmp_path, second):
    """The file nereid.yaml leads to is taken where the links on its way are: a link re-pointed moves the watch to
    its new target's folder (or, in the same folder, the name that counts), as the look its event brings asks."""
    looks: list[str] = []
    old, new = tmp_path / "real" / "nereid.yaml", tmp_path / second
    for path in (old, new):
        path.parent.mkdir(exist_ok=True)
        path.write_text("models: []\n")
    link = tmp_path / "nereid.yaml"
    link.symlink_to(old)

    async def scenario() -> None:
        stop = asyncio.Event()
        events = follower(tmp_path, looks, stop=stop)
        running = asyncio.create_task(events.run())
        await until(lambda: watching(events) and len(looks) == 2, "both watches up")
        (tmp_path / ".nereid.yaml.new").symlink_to(new)
        (tmp_path / ".nereid.yaml.new").rename(link)  # ln -sfn's atomic form: the link re-pointed
        await until(lambda: len(looks) > 2, "a look after the link was re-pointed")
        wanted = events.wanted_now()  # (as the watcher's look asks, and hands to restart_moved)
        events.restart_moved(wanted)
        # A watch (re)started is up once its start's look has run (that look is scheduled as it starts); a link
        # re-pointed within its folder changes no folder watched: nothing restarts.
        await until(lambda: all(follow.current == paths for follow, paths in wanted) and not events._catch_ups,
                    "the watches follow anew")
        outer = wanted[-1][1].paths
        assert new.parent in outer and (old.parent in outer) == (old.parent == new.parent)
        assert not events.relevant(watchfiles.Change.modified, str(old))
        assert events.relevant(watchfiles.Change.modified, str(new))
        settled = len(looks)
        new.write_text("models: []\n# edited in place\n")
        await until(lambda: len(looks) > settled, "a look after the new target's edit")
        stop.set()
        await asyncio.wait_for(running, 10)
    asyncio.run(scenario())


def test_a_folder_that_cannot_be_watched_is_looked_at_every_poll_s_and_said_once(tmp_path, caplog):
    looks: list[str] = []

    async def scenario() -> None:
        stop = asyncio.Event()
        events = follower(tmp_path, looks, stop=stop)
        (tmp_path / "ml-backends").rmdir()  # gone: watchfiles cannot watch it
        running = asyncio.create_task(events.run())
        await asyncio.sleep(0.6)
        stop.set()
        await asyncio.wait_for(running, 10)
    asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records if "cannot follow" in r.getMessage()]
    assert len(said) == 1 and "looking at it every 0.05 s" in said[0]
    assert len(looks) >= 5


def test_an_exception_group_is_described_one_error_at_a_time():
    group = ExceptionGroup("watch", [OSError("no such folder"), ValueError("not UTF-8")])
    assert describe_error(group) == "OSError: no such folder; ValueError: not UTF-8"


def test_an_inotify_limit_is_named_and_the_watch_working_again_is_said(tmp_path, caplog, monkeypatch):
    """Defect (the limits hunt): with every inotify instance of the uid held by another process, the watch's error
    read "Too many open files (os error 24)" and named no inotify limit; when watches could start again nothing
    said so. The line names fs.inotify.max_user_instances, and a line says when file events are followed again."""
    from nereid import file_events

    caplog.set_level(logging.INFO, logger="nereid.watch")
    looks: list[str] = []
    real = watchfiles.awatch
    failing = {"instances": True}

    def awatch(*paths, **kwargs):
        if failing["instances"]:  # (as watchfiles raises it: at the watch's start, before its first wait)
            raise RuntimeError("WatchfilesRustInternalError: Error creating recommended watcher: Too many open "
                               "files (os error 24)")
        return real(*paths, **kwargs)
    monkeypatch.setattr(file_events.watchfiles, "awatch", awatch)

    async def scenario() -> None:
        stop = asyncio.Event()
        events = follower(tmp_path, looks, stop=stop)
        running = asyncio.create_task(events.run())
        await until(lambda: len(looks) >= 6, "looks every poll_s while no watch can start")
        failing["instances"] = False
        await until(lambda: len(_lines(caplog, "with file events again")) == 2, "both watches said to be up again")
        settled = len(looks)
        (tmp_path / "ml-backends" / "m").mkdir()
        await until(lambda: len(looks) > settled, "a look after a file event")
        stop.set()
        await asyncio.wait_for(running, 10)
    asyncio.run(scenario())
    failed = _lines(caplog, "cannot follow")
    assert len(failed) == 2  # one per watch, once each
    for line in failed:
        assert line.endswith("(os error 24)); looking at it every 0.05 s (server.watch_poll_s) instead, until it "
                             "can; from the file watcher this is most often the inotify instances of the server's "
                             "user all taken: raise fs.inotify.max_user_instances (sysctl; every process of the user "
                             "counts), or the server's own limit of open files if it is at it"), line
    assert sorted(_lines(caplog, "with file events again")) == sorted(
        f"dynamic repository: following {what} with file events again (they had failed: RuntimeError: "
        "WatchfilesRustInternalError: Error creating recommended watcher: Too many open files (os error 24)); no "
        "longer looking at it every 0.05 s" for what in (tmp_path / "ml-backends", tmp_path))


def _lines(caplog, fragment: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if fragment in r.getMessage()]


def test_only_inotify_limits_get_a_hint():
    from nereid.file_events import watch_limit_hint

    assert "fs.inotify.max_user_instances" in watch_limit_hint("OSError: Too many open files (os error 24)")
    for watches in ("WatchfilesRustInternalError: OS file watch limit reached. about [\"/m\"]",
                    "OSError: No space left on device (os error 28)"):
        assert "fs.inotify.max_user_watches" in watch_limit_hint(watches)
    assert watch_limit_hint("FileNotFoundError: No path was found.") == ""


def test_a_watch_failing_after_it_started_is_said_once_not_at_every_poll(tmp_path, caplog):
    """Found by the long-life hunt: watchfiles meets a folder named in no UTF-8 after its first wait, on its own
    thread; each start was said to follow file events again, then failed, so an ERROR and an INFO line came at
    every poll for as long as the folder stayed (720 an hour at the default poll)."""
    import os

    caplog.set_level(logging.INFO, logger="nereid.watch")
    looks: list[str] = []

    async def scenario() -> None:
        stop = asyncio.Event()
        # (A poll of 0.5 s: a start is said to work again once it has stayed up for poll_s, and on a loaded machine
        # watchfiles' thread took longer than 0.05 s to meet the folder, so the failure was said twice.)
        events = follower(tmp_path, looks, stop=stop, poll_s=0.5)
        os.mkdir(os.fsencode(tmp_path / "ml-backends") + b"/odd\xffname")
        running = asyncio.create_task(events.run())
        await until(lambda: len(looks) >= 8, "looks every poll_s while the watch cannot run", timeout_s=30)
        stop.set()
        await asyncio.wait_for(running, 10)
    asyncio.run(scenario())
    failed = _lines(caplog, "cannot follow")
    assert len(failed) == 1 and "Unable to decode path" in failed[0], failed
    assert _lines(caplog, "with file events again") == []
