"""Model folders' states and the plan between two looks (what the dynamic repository compares), on real files."""

from __future__ import annotations

import concurrent.futures
import threading
import os
import shutil
import time

from nereid.folder_states import folder_stamp, moved_files_unloaded, plan_changes, scan_folder, scan_repository


def test_scan_ignores_server_and_editor_files_and_sees_copies_as_the_same(tmp_path):
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "main.py").write_text("print(1)\n")
    (folder / "weights.bin").write_bytes(os.urandom(300_000))
    before = scan_folder(folder)
    for junk in (".cache/main-1", ".main.py.swp", "main.py~", "#main.py#", "x.tmp", "__pycache__/m.pyc"):
        (folder / junk).parent.mkdir(exist_ok=True)
        (folder / junk).write_text("junk")
    assert scan_folder(folder) == before
    shutil.copytree(folder, tmp_path / "b", copy_function=shutil.copy)  # like cp -r: new mtimes, same files
    copy = scan_folder(tmp_path / "b")
    assert copy.identity == before.identity and copy.stamp != before.stamp
    (tmp_path / "b" / "weights.bin").write_bytes(os.urandom(300_000))
    assert scan_folder(tmp_path / "b").identity != before.identity


def test_plan_finds_renames_removals_additions_and_edits(tmp_path):
    for name in ("keep", "edit", "gone", "moved"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "main.py").write_text(f"# {name}\n")
    before = scan_repository(tmp_path)
    os.rename(tmp_path / "moved", tmp_path / "renamed")
    shutil.rmtree(tmp_path / "gone")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "main.py").write_text("# brand new\n")
    time.sleep(0.01)
    (tmp_path / "edit" / "main.py").write_text("# edited\n")
    plan = plan_changes(before, scan_repository(tmp_path))
    assert plan.renames == (("moved", "renamed"),)
    assert plan.removed == ("gone",) and plan.added == ("new",) and plan.changed == ("edit",)


def test_a_copy_is_paired_as_a_rename_only_where_its_identity_covers_every_byte(tmp_path):
    """Found by two bug hunts: a different folder copied in (`cp -r stage/v2 b && rm -rf a`), whose files differed
    from a's only between their sampled ends (a fine-tune's middle layers, a constant in a long main.py), was
    paired with a as a rename and moved in place, serving a's files until its folder changed again."""
    from nereid.folder_states import SAMPLE_BYTES

    middle = SAMPLE_BYTES + 100  # outside both samples of a file of 3 samples
    for version, offset in (("v1", b"1"), ("v2", b"2")):
        folder = tmp_path / "stage" / version
        folder.mkdir(parents=True)
        data = bytearray(3 * SAMPLE_BYTES)
        data[middle:middle + 1] = offset
        (folder / "weights.bin").write_bytes(bytes(data))
        (folder / "main.py").write_text("print(1)\n")
    repository = tmp_path / "repo"
    repository.mkdir()
    shutil.copytree(tmp_path / "stage" / "v1", repository / "a", copy_function=shutil.copy)
    before = scan_repository(repository)
    assert not before["a"].complete
    shutil.copytree(tmp_path / "stage" / "v2", repository / "b", copy_function=shutil.copy)
    shutil.rmtree(repository / "a")
    after = scan_repository(repository)
    assert after["b"].identity == before["a"].identity  # (the ends are the same)
    plan = plan_changes(before, after)
    assert plan.renames == () and plan.removed == ("a",) and plan.added == ("b",)
    # A mv of it keeps its files (inodes): still a rename, whatever the sizes.
    os.rename(repository / "b", repository / "c")
    assert plan_changes(after, scan_repository(repository)).renames == (("b", "c"),)
    # A copy of files each within two samples is compared whole: still a rename.
    small = tmp_path / "small"
    (small / "d").mkdir(parents=True)
    (small / "d" / "main.py").write_text("x" * (2 * SAMPLE_BYTES))
    first = scan_repository(small)
    assert first["d"].complete
    shutil.copytree(small / "d", small / "e", copy_function=shutil.copy)
    shutil.rmtree(small / "d")
    assert plan_changes(first, scan_repository(small)).renames == (("d", "e"),)


def test_a_move_beside_a_copy_of_the_same_files_is_paired_with_the_move(tmp_path):
    """A fuzzing review: `mv a c; cp -r c b` paired a with the copy b (the first name with the same identity),
    so b's model held c's stamps and c loaded anew."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "main.py").write_text("# a\n")
    before = scan_repository(tmp_path)
    os.rename(tmp_path / "a", tmp_path / "c")
    shutil.copytree(tmp_path / "c", tmp_path / "b", copy_function=shutil.copy)
    plan = plan_changes(before, scan_repository(tmp_path))
    assert plan.renames == (("a", "c"),) and plan.added == ("b",)


def test_a_copy_of_the_loaded_files_needs_no_load_and_an_edit_moved_with_a_mv_does(tmp_path):
    """A copy then the original deleted was loaded again after the move (its new inodes differ from every
    stamp), where the README says nothing is read again; the suite's copy-then-delete test raced that reload."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "main.py").write_text("# a\n")
    (tmp_path / "a" / "weights.bin").write_bytes(bytes(192 * 1024))
    known = scan_folder(tmp_path / "a")
    loaded = known.stamp  # the running version loaded the folder as the watcher knows it
    shutil.copytree(tmp_path / "a", tmp_path / "copy", copy_function=shutil.copy)
    copy = scan_folder(tmp_path / "copy")
    assert copy.stamp != loaded and not moved_files_unloaded(loaded, known, copy)
    assert not moved_files_unloaded(None, known, copy)  # (nothing known of what was loaded)
    os.rename(tmp_path / "a", tmp_path / "moved")
    assert not moved_files_unloaded(loaded, known, scan_folder(tmp_path / "moved"))  # a mv keeps every stamp
    with open(tmp_path / "moved" / "weights.bin", "r+b") as weights:  # an edit the watcher never saw: same
        os.pwrite(weights.fileno(), b"edited" * 16, 96 * 1024)        # size, same ends, same inode
    edited = scan_folder(tmp_path / "moved")
    assert edited.identity == known.identity and moved_files_unloaded(loaded, known, edited)
    # An edit the watcher saw whose reload failed: the running version is the one before; a copy of the edited
    # folder holds other files than it loaded.
    (tmp_path / "moved" / "main.py").write_text("# b\n")
    seen = scan_folder(tmp_path / "moved")
    shutil.copytree(tmp_path / "moved", tmp_path / "copy2", copy_function=shutil.copy)
    assert moved_files_unloaded(loaded, seen, scan_folder(tmp_path / "copy2"))


def test_a_fifo_in_a_model_folder_is_stamped_without_being_opened_for_a_read(tmp_path):
    """Defect (found by a bug hunt): the scan opened every file to hash its ends; a FIFO (a control pipe) blocked
    it until some process wrote to it, and with it the watcher, for good (and the server's exit)."""
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "main.py").write_text("print()\n")
    os.mkfifo(folder / "control.fifo")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        scanned = pool.submit(scan_folder, folder)
        try:
            state = scanned.result(timeout=10)
        finally:
            if not scanned.done():  # the old code: unblock the scan so that the test can end
                with open(folder / "control.fifo", "wb"):
                    pass
    assert state is not None and [stamp[0] for stamp in state.stamp] == ["control.fifo", "main.py"]


def test_a_link_to_nothing_is_a_file_of_the_folder_not_its_end(tmp_path):
    """Defect (found by a bug hunt): a symlink whose target did not exist (yet) made the scan take the folder for
    vanished, and the watcher unloaded its model as removed. It is stamped as the link itself; its target appearing
    is an edit."""
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "main.py").write_text("print()\n")
    (folder / "latest").symlink_to("weights-v0.bin")
    dangling = scan_folder(folder)
    assert dangling is not None and [stamp[0] for stamp in dangling.stamp] == ["latest", "main.py"]
    assert list(scan_repository(tmp_path)) == ["a"]
    (folder / "weights-v0.bin").write_bytes(b"\x01" * 10)
    resolved = scan_folder(folder)
    assert resolved is not None and resolved.stamp != dangling.stamp and resolved.identity != dangling.identity


def test_only_the_folder_itself_gone_is_a_vanished_folder(tmp_path):
    assert scan_folder(tmp_path / "never_there") is None


def test_a_fifo_is_never_opened_so_a_writer_waiting_on_it_is_left_alone(tmp_path):
    """Review: the non-blocking open woke a writer waiting for a reader, and the scan's close then broke its pipe."""
    folder = tmp_path / "a"
    folder.mkdir()
    fifo = folder / "control.fifo"
    os.mkfifo(fifo)
    opened = []
    writer = threading.Thread(target=lambda: opened.append(open(fifo, "wb")), daemon=True)
    writer.start()
    scan_folder(folder)
    writer.join(0.5)
    assert opened == []  # still waiting for a reader of its own
    with open(fifo, "rb"):  # (let it go)
        writer.join(5)
    opened[0].close()


def test_only_a_transfers_temporary_file_counts_as_a_hidden_file_being_written(tmp_path):
    """From the dynamic-mode hunt: a hidden file a model writes itself (.last_run.txt, as the README advises) was
    taken for a transfer under way, and held up every edit of its folder for 20 settle times."""
    (tmp_path / "main.py").write_text("print(1)\n")
    for name in (".last_run.txt", ".gitignore", ".state"):
        (tmp_path / name).write_text("written by the model")
    assert folder_stamp(tmp_path)[1] == 0
    (tmp_path / ".main.py.Xy12ab").write_text("rsync filling it")  # rsync's .name.XXXXXX
    assert folder_stamp(tmp_path)[1] == os.stat(tmp_path / ".main.py.Xy12ab").st_mtime_ns


def test_a_linked_sub_folder_pointed_elsewhere_is_a_change(tmp_path):
    """From the dynamic-mode hunt: `ln -sfn .w2 w` (a bundle's weights_file: w/weights.safetensors) was never
    seen: a link to a folder is not walked into, and was not stamped either."""
    (tmp_path / "manifest.yaml").write_text("name: m\n")
    for version in (".w1", ".w2"):
        (tmp_path / version).mkdir()
        (tmp_path / version / "weights.safetensors").write_text(version)
    (tmp_path / "w").symlink_to(".w1")
    before = scan_folder(tmp_path)
    (tmp_path / "w.new").symlink_to(".w2")
    os.replace(tmp_path / "w.new", tmp_path / "w")  # what ln -sfn does
    assert scan_folder(tmp_path).stamp != before.stamp


def test_a_folder_scanned_again_unchanged_reads_none_of_its_files(tmp_path, monkeypatch):
    """Found by the dynamic-repository hunt: every scan read the ends of every file of every model folder (4.3 s of
    CPU in 5 s beside a folder of 30,000 files). The identity is read again only when the stamp changed."""
    from nereid import folder_states

    folder = tmp_path / "m"
    folder.mkdir()
    for index in range(20):
        (folder / f"f{index}.bin").write_bytes(os.urandom(1000))
    reads: list[str] = []
    sampled = folder_states._sampled_bytes
    monkeypatch.setattr(folder_states, "_sampled_bytes", lambda path, size: reads.append(path.name) or
                        sampled(path, size))
    first = scan_folder(folder)
    assert len(reads) == 20
    assert scan_folder(folder) == first and len(reads) == 20  # (nothing read again)
    time.sleep(0.01)
    (folder / "f3.bin").write_bytes(os.urandom(1000))  # same size, new bytes
    edited = scan_folder(folder)
    assert edited.identity != first.identity and len(reads) == 40


def test_the_identities_kept_follow_the_repository_whatever_its_size(tmp_path, monkeypatch):
    """The hunt of the fix above: its cache dropped the oldest entry past 8,192 folders, and a scan visits the
    folders in the same order each time, so past that size every folder's files were read at every scan. Entries
    go with their folders instead."""
    from nereid import folder_states

    for index in range(30):
        (tmp_path / f"m{index}").mkdir()
        (tmp_path / f"m{index}" / "w.bin").write_bytes(b"x")
    reads: list[str] = []
    sampled = folder_states._sampled_bytes
    monkeypatch.setattr(folder_states, "_sampled_bytes", lambda path, size: reads.append(path.name) or
                        sampled(path, size))
    scan_repository(tmp_path)
    assert len(reads) == 30
    scan_repository(tmp_path)
    assert len(reads) == 30
    shutil.rmtree(tmp_path / "m3")
    scan_repository(tmp_path)
    assert not [key for key in folder_states._IDENTITIES if key.endswith(os.sep + "m3")]


def test_a_folder_nested_deeper_than_the_limit_is_stamped_to_the_limit_and_its_code_files_listed_to_it(tmp_path):
    """The path-safety hunt: Python 3.11's os.walk recursed once per level, and a folder 1,500 deep raised
    RecursionError out of every scan of its repository (and out of a cpp model's list of code files, under
    server.follow_symlinks: true, which no depth check refuses first)."""
    from nereid.backends.cpp.compiler import code_files
    from nereid.files import MAX_FOLDER_DEPTH
    from support import made_deep, removed_deep

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "main.cpp").write_text("int main() {}\n")
    made_at_limit = tmp_path / "m" / os.path.join(*["a"] * (MAX_FOLDER_DEPTH - 1))
    made_deep(tmp_path / "m", 1_500, "deep.h")
    try:
        stamp = folder_stamp(tmp_path / "m")
        assert stamp is not None
        assert [entry[0] for entry in stamp[0]] == ["main.cpp"]  # (the file at the bottom lies past the limit)
        assert code_files(tmp_path / "m", (".cpp", ".h")) == [tmp_path / "m" / "main.cpp"]
        assert scan_repository(tmp_path)["m"].stamp == stamp[0]
        (made_at_limit / "near.h").write_text("")  # (at the deepest level walked: still a file of the folder)
        assert [entry[0] for entry in folder_stamp(tmp_path / "m")[0]] == [
            "main.cpp", os.path.relpath(made_at_limit / "near.h", tmp_path / "m")]
    finally:
        (made_at_limit / "near.h").unlink(missing_ok=True)
        removed_deep(tmp_path / "m", 1_500, "deep.h")
