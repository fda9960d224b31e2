"""When dynamic mode acts on a changed folder: after the settle time unchanged, later while a transfer writes."""

from __future__ import annotations

import time

from nereid.folder_states import FolderState
from nereid.settling import MAX_GROUPING_FACTOR, SettlingFolders

A, B = FolderState((), "a"), FolderState((), "b")


def test_a_folder_is_due_once_it_has_looked_the_same_for_the_settle_time_and_a_change_starts_it_again():
    folders = SettlingFolders(1.0)
    assert not folders.settled("m", A, 10.0) and "m" in folders and folders.state("m") == A
    assert not folders.settled("m", A, 10.9)
    assert not folders.settled("m", B, 11.0)  # changed: its time starts again
    assert folders.next_due() == 12.0
    assert not folders.settled("m", B, 11.5) and folders.settled("m", B, 12.0)
    assert "m" in folders  # found due, still settling until acted on
    folders.done("m")
    assert "m" not in folders and len(folders) == 0 and folders.next_due() is None


def test_a_folder_gone_settles_as_any_other_change():
    folders = SettlingFolders(0.5)
    assert not folders.settled("m", None, 1.0)
    assert folders.settled("m", None, 1.5) and folders.state("m") is None


def test_a_hidden_file_written_just_now_holds_a_settled_folder_until_it_is_a_settle_time_old():
    folders = SettlingFolders(1.0)
    # rsync's temporary file, being filled (stamped ahead of the clock, so that no wait here can age it)
    writing = FolderState((), "a", hidden_mtime_ns=time.time_ns() + 10 ** 10)
    assert not folders.settled("m", writing, 0.0)
    assert not folders.settled("m", writing, 1.0)  # settled, but the transfer is under way
    assert folders.next_due() == 2.0  # due again a settle time later at most
    old = FolderState((), "a", hidden_mtime_ns=time.time_ns() - 5 * 10**9)  # left alone long ago (same state)
    assert folders.settled("m", old, 1.0)


def test_changes_that_never_stop_are_acted_on_after_the_grouping_limit():
    folders = SettlingFolders(0.1)
    assert not folders.settled("m", A, 0.0)
    always_writing = FolderState((), "a", hidden_mtime_ns=time.time_ns() + 10 ** 10)
    assert not folders.settled("m", always_writing, 0.1)
    assert folders.settled("m", always_writing, 0.1 * MAX_GROUPING_FACTOR)


def test_a_change_undone_before_it_settled_is_no_longer_waited_for():
    folders = SettlingFolders(1.0)
    folders.settled("back", B, 0.0)
    folders.settled("new", A, 0.0)
    folders.drop_undone({"back": A}, {"back": A, "new": A})  # 'back' is as known again; 'new' is not known
    assert list(folders) == ["new"]


def test_a_folder_held_until_a_time_is_due_then_and_not_before():
    folders = SettlingFolders(1.0)
    folders.due_at("m", A, 30.0)  # a load the store failed: tried again after its backoff
    assert folders.next_due() == 30.0
    assert not folders.settled("m", A, 29.9) and folders.settled("m", A, 30.0)
