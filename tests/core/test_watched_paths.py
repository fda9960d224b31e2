"""What a file watch follows: the links met on the way to a path, what paths resolve to, symlinked model folders."""

from __future__ import annotations

import os
from pathlib import Path

from nereid.watched_paths import (WatchedPaths, awaited_targets, identity_of, links_on_the_way, nearest_folder,
                                  symlinked_folders)


def test_the_links_on_the_way_to_a_configmaps_file_are_the_file_and_the_data_link(tmp_path: Path) -> None:
    # A Kubernetes ConfigMap volume: cfg/nereid.yaml -> ..data/nereid.yaml, ..data -> ..v1 (swapped on update).
    config = tmp_path / "cfg"
    (config / "..v1").mkdir(parents=True)
    (config / "..v1" / "nereid.yaml").write_text("models: []\n")
    (config / "..data").symlink_to("..v1")
    (config / "nereid.yaml").symlink_to("..data/nereid.yaml")
    assert links_on_the_way(config / "nereid.yaml") == {str(config / "nereid.yaml"), str(config / "..data")}
    assert links_on_the_way(config / "..v1" / "nereid.yaml") == set()


def test_a_loop_of_links_ends(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    assert links_on_the_way(tmp_path / "a") == {str(tmp_path / "a"), str(tmp_path / "b")}


def test_a_folder_replaced_under_its_name_is_a_difference(tmp_path: Path) -> None:
    models = tmp_path / "ml-backends"
    models.mkdir()
    before = WatchedPaths.of([models, models])
    assert before.paths == (models,) and before.identities == (identity_of(models),)
    os.rename(models, tmp_path / "old")
    models.mkdir()  # another inode under the same name: the running watch follows the old one
    (tmp_path / "extra").mkdir()
    after = WatchedPaths.of([models, tmp_path / "extra"])
    assert after != before
    assert before.differences(after) == f"{models} is another folder now; {tmp_path / 'extra'} added"
    assert after.differences(WatchedPaths.of([models])) == f"{tmp_path / 'extra'} no longer followed"
    assert identity_of(tmp_path / "missing") is None


def test_symlinked_model_folders_are_followed_where_they_lead_when_allowed(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "ml-backends", tmp_path / "elsewhere"
    (root / ".store" / "inside").mkdir(parents=True)
    (elsewhere / "outside").mkdir(parents=True)
    (root / "plain").mkdir()
    (root / "in").symlink_to(root / ".store" / "inside")
    (root / "out").symlink_to(elsewhere / "outside")
    (root / "around").symlink_to(tmp_path)  # holds the root itself: never watched
    (root / "dangling").symlink_to(tmp_path / "gone")
    assert symlinked_folders(root, follow_symlinks=False) == ((root / ".store" / "inside").resolve(),)
    assert symlinked_folders(root, follow_symlinks=True) == tuple(sorted(
        [(root / ".store" / "inside").resolve(), (elsewhere / "outside").resolve()]))
    assert symlinked_folders(tmp_path / "missing", follow_symlinks=True) == ()


def test_model_folder_links_that_lead_nowhere_yet_are_awaited_where_they_lead(tmp_path: Path) -> None:
    # No watch can start on a folder that is not there: where it will be, and the nearest folder there on the way.
    models = tmp_path / "ml-backends"
    (models / ".versions").mkdir(parents=True)
    (models / "inside").symlink_to(".versions/m-v1")
    (models / "outside").symlink_to(tmp_path / "ext" / "deep" / "m")
    (models / ".hidden").symlink_to(tmp_path / "ext" / "hidden")  # (hidden names are never models)
    (models / "loop").symlink_to("loop")
    real = models.resolve()
    assert awaited_targets(models, follow_symlinks=False) == (real / ".versions" / "m-v1",)
    assert set(awaited_targets(models, follow_symlinks=True)) == {
        real / ".versions" / "m-v1", (tmp_path / "ext" / "deep" / "m").resolve()}
    assert nearest_folder(tmp_path / "ext" / "deep" / "m") == tmp_path
    (tmp_path / "ext" / "deep" / "m").mkdir(parents=True)  # arrived: followed as a symlinked folder from now on
    assert awaited_targets(models, follow_symlinks=True) == (real / ".versions" / "m-v1",)
