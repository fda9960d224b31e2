"""The scratch folders and store copies a forgotten model name leaves, removed once nothing uses the name."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from nereid.folder_cleanup import FolderCleanup
from nereid.settings import ServerSettings


def cleanup_in(scratch: Path, kept: set[str], background: list) -> FolderCleanup:
    def in_background(work, what):
        task = asyncio.get_running_loop().create_task(work)
        background.append((task, what))
        return task
    return FolderCleanup(scratch, kept.__contains__, lambda: set(kept), in_background)


def test_a_scratch_folder_is_dropped_unless_a_model_still_uses_its_name(tmp_path: Path) -> None:
    kept: set[str] = {"serving"}
    folders = cleanup_in(tmp_path, kept, [])
    for name in ("serving", "forgotten"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "made-by-the-model").write_text("x")

    asyncio.run(folders.drop_scratch({"serving", "forgotten", "never-made"}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serving"]  # nothing half deleted left aside either
    assert (tmp_path / "serving" / "made-by-the-model").read_text() == "x"


def test_a_scratch_folder_dropped_soon_goes_as_background_work_or_at_once_without_a_loop(tmp_path: Path) -> None:
    background: list = []
    folders = cleanup_in(tmp_path, set(), background)
    (tmp_path / "a").mkdir()
    folders.drop_scratch_soon({"a"})  # no running loop (a rescan from a script): done before it returns
    assert not (tmp_path / "a").exists() and background == []

    async def scenario() -> None:
        (tmp_path / "b").mkdir()
        folders.drop_scratch_soon({"b"})
        assert [what for _, what in background] == ["dropping the scratch folders of forgotten models"]
        await background[0][0]
    asyncio.run(scenario())
    assert list(tmp_path.iterdir()) == []


def test_only_an_empty_scratch_folder_is_dropped_after_a_move(tmp_path: Path) -> None:
    folders = cleanup_in(tmp_path, set(), [])
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept").write_text("x")
    folders.drop_empty_scratch("empty")
    folders.drop_empty_scratch("full")
    folders.drop_empty_scratch("never-made")
    assert [p.name for p in tmp_path.iterdir()] == ["full"]


def test_store_copies_are_not_looked_at_for_a_local_repository(tmp_path: Path) -> None:
    folders = cleanup_in(tmp_path, set(), [])
    folders.drop_mirrors_soon(ServerSettings(ml_backends_path=tmp_path), ["gone"])
    # No thread for a local ml_backends_path (one would be named so, and end only once the store answered).
    assert not [thread for thread in threading.enumerate() if thread.name == "nereid-drop-mirror"]
