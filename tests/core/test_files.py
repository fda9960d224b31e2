"""Untrusted model folders read safely (bounded, never blocking, confined) and files written atomically."""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
from pathlib import Path

import pytest

from nereid import files
from nereid.errors import ConfigError
from nereid.files import (NAME_MAX, atomic_write, check_confined, escaping_link, is_model_folder_name, locked,
                          not_regular_reason, read_regular_file, read_text_file, remove_tree, temporary_name)


@pytest.mark.parametrize("name, valid", [
    ("resnet", True), ("a b-c_1.2", True), ("é" * 127, True), ("x" * NAME_MAX, True),
    ("", False), (".hidden", False), ("a/b", False), ("a\0b", False), ("x" * (NAME_MAX + 1), False),
    ("é" * 128, False),  # 256 bytes in UTF-8
    ("a\ud800b", False),  # a lone surrogate: no file name
])
def test_model_folder_names(name, valid):
    assert is_model_folder_name(name) is valid


def test_a_fifo_is_refused_at_once_never_opened_for_a_blocking_read(tmp_path):
    fifo = tmp_path / "model_inference.textproto"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"model_inference.textproto: is a FIFO, not a regular file"):
        read_regular_file(fifo, 1024)  # (a blocking open would hang this test)
    assert not_regular_reason(fifo).endswith("is a FIFO, not a regular file")


def test_a_file_over_its_limit_is_refused_by_its_size_and_its_contents_are_never_quoted(tmp_path):
    big = tmp_path / "manifest.yaml"
    big.write_bytes(b"secret: " + b"x" * 100)
    with pytest.raises(ConfigError) as caught:
        read_regular_file(big, 64)
    assert str(caught.value) == f"{big}: is 108 bytes, more than the 64-byte limit for this file"
    assert read_regular_file(big, 108) == b"secret: " + b"x" * 100


def test_text_that_is_not_utf8_names_the_offset_not_the_byte(tmp_path):
    binary = tmp_path / "main.py"
    binary.write_bytes(b"print(1)\n\xff\xfe")
    with pytest.raises(ConfigError, match=r"main.py: not UTF-8 text \(invalid byte at offset 9\); is it a binary"):
        read_text_file(binary, 100)
    (tmp_path / "note.txt").write_text("naïve\n")
    assert read_text_file(tmp_path / "note.txt", 100) == "naïve\n"


def test_what_cannot_be_read_is_named_as_what_it_is(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    assert not_regular_reason(tmp_path / "dangling") == f"{tmp_path / 'dangling'}: is a symlink to a file that " \
                                                        "does not exist"
    assert not_regular_reason(tmp_path / "absent") is None  # absent is the caller's own message
    assert not_regular_reason(tmp_path) == f"{tmp_path}: is a directory, not a regular file"
    with pytest.raises(ConfigError, match=r"absent: cannot read: No such file or directory"):
        read_regular_file(tmp_path / "absent", 10)


def test_a_symlink_out_of_the_repository_is_found_and_refused_unless_links_are_followed(tmp_path, caplog):
    root, outside = tmp_path / "ml-backends", tmp_path / "etc"
    (root / "m" / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "passwd").write_text("root:x:0:0\n")
    (root / "m" / "inside.txt").write_text("")
    (root / "m" / "sub" / "same").symlink_to(root / "m" / "inside.txt")  # stays inside: fine
    assert escaping_link(root / "m", root) is None
    (root / "m" / "sub" / "weights.bin").symlink_to(outside / "passwd")
    assert escaping_link(root / "m", root) == (root / "m" / "sub" / "weights.bin", outside / "passwd")
    with pytest.raises(ConfigError) as caught:
        check_confined(root / "m", root, follow_symlinks=False)
    assert "symlink to a path outside ml_backends_path" in str(caught.value)
    assert str(outside) not in str(caught.value)  # where it leads is for the log only: errors reach clients
    check_confined(root / "m", root, follow_symlinks=True)


def test_the_symlink_refusals_name_the_configuration_file_the_server_was_started_with(tmp_path):
    """`nereid serve --config prod.yaml`: where to set server.follow_symlinks was said to be nereid.yaml."""
    root = tmp_path / "ml-backends"
    (root / "m").mkdir(parents=True)
    (root / "m" / "weights.bin").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=r"set server\.follow_symlinks: true in prod\.yaml to allow it$"):
        check_confined(root / "m", root, False, "prod.yaml")
    # A subfolder the walk cannot list but a model can search (mode 311): told where to turn the check off too.
    # (The walk's refusal is made here: run as root, the walk lists every folder; test_cli.py's test of mode 311
    # runs the check as another user.)
    unlisted = PermissionError(errno.EACCES, "Permission denied", str(root / "m"))
    with pytest.raises(ConfigError, match=r"or set server\.follow_symlinks: true in prod\.yaml\)$"):
        files._refuse_unlisted_reachable(unlisted, "prod.yaml")


def test_a_model_folder_that_is_itself_a_symlink_out_is_found(tmp_path):
    root, outside = tmp_path / "ml-backends", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (root / "m").symlink_to(outside)
    assert escaping_link(root / "m", root) == (root / "m", outside)


def test_a_link_out_behind_a_linked_folder_inside_the_repository_is_found(tmp_path):
    """Found by the hunt of the symlink check: a linked folder that stays inside the repository was not walked
    (os.walk does not follow links), so a link in it leading out passed, and a bundle loaded its weights through
    the two hops (``v2 -> ../.shared``, ``.shared/w.safetensors -> outside``)."""
    root, outside = tmp_path / "repo", tmp_path / "outside"
    (root / "m").mkdir(parents=True)
    (root / ".shared").mkdir()
    outside.mkdir()
    (outside / "w.safetensors").write_text("x")
    (root / "m" / "v2").symlink_to("../.shared")
    assert escaping_link(root / "m", root) is None  # (a link inside, to a folder inside, holding nothing out)
    (root / ".shared" / "w.safetensors").symlink_to(outside / "w.safetensors")
    assert escaping_link(root / "m", root) == (root / "m" / "v2" / "w.safetensors", outside / "w.safetensors")


def test_a_symlink_loop_leads_nowhere_and_a_model_folder_that_is_one_is_said_to_be(tmp_path):
    """Found by a bug hunt of persistent caches: a symlink loop anywhere in a model folder (its .cache/ too) made
    it UNAVAILABLE with Python's bare "Symlink loop from '...'" (a RuntimeError of Path.resolve on 3.11)."""
    root = tmp_path / "repo"
    (root / "m" / ".cache").mkdir(parents=True)
    (root / "m" / "loop").symlink_to("loop")
    (root / "m" / ".cache" / "a").symlink_to("b")
    (root / "m" / ".cache" / "b").symlink_to("a")
    assert escaping_link(root / "m", root) is None  # (a loop leads nowhere, so not out)
    (root / "n").symlink_to("n")
    with pytest.raises(ConfigError) as caught:
        escaping_link(root / "n", root)
    assert str(caught.value) == (f"{root / 'n'}: is a symlink loop (it leads back to itself, through one link or "
                                 "more); replace it with the model's folder")


def test_links_between_folders_in_a_circle_end_the_walk(tmp_path):
    root = tmp_path / "repo"
    (root / "m" / "a").mkdir(parents=True)
    (root / "m" / "a" / "up").symlink_to("..")  # a circle through the model folder itself
    (root / "m" / "b").symlink_to("a")  # the same folder twice
    (root / "m" / "a" / "weights.bin").write_text("x")
    assert escaping_link(root / "m", root) is None


def test_an_atomic_write_replaces_the_file_whole_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "weights.safetensors"
    target.write_bytes(b"old")
    atomic_write(target, [b"new ", memoryview(b"bytes")], durable=True, mode=0o640)
    assert target.read_bytes() == b"new bytes"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.safetensors"]


def test_an_atomic_write_whose_check_or_data_fails_leaves_the_target_untouched(tmp_path):
    target = tmp_path / "cache.bin"
    target.write_bytes(b"kept")

    def refuse(temporary: Path) -> None:
        assert temporary.read_bytes() == b"half" and temporary.name.endswith(".partial")
        raise ConfigError("checksum mismatch")
    with pytest.raises(ConfigError, match="checksum mismatch"):
        atomic_write(target, [b"half"], check=refuse)

    def parts():
        yield b"first"
        raise OSError("disk gone")
    with pytest.raises(OSError, match="disk gone"):
        atomic_write(target, parts())
    assert target.read_bytes() == b"kept" and sorted(p.name for p in tmp_path.iterdir()) == ["cache.bin"]


def test_a_temporary_name_is_hidden_unique_and_fits_past_the_longest_name(tmp_path):
    first, second = temporary_name("model.so"), temporary_name("model.so")
    assert first.startswith(".model.so.") and first.endswith(f".{os.getpid()}.partial") and first != second
    longest = temporary_name("x" * NAME_MAX)
    assert len(os.fsencode(longest)) <= NAME_MAX and longest.startswith(".")
    atomic_write(tmp_path / ("x" * NAME_MAX), [b"fits"])  # a legal name too long for the plain temporary name
    assert (tmp_path / ("x" * NAME_MAX)).read_bytes() == b"fits"


def test_a_lock_makes_holders_take_turns(tmp_path):
    lock_file = tmp_path / "locks" / "build.lock"
    inside: list[int] = []
    overlaps: list[int] = []

    def hold(n: int) -> None:
        with locked(lock_file):
            inside.append(n)
            if len(inside) > 1:
                overlaps.append(n)
            threading.Event().wait(0.02)
            inside.remove(n)
    threads = [threading.Thread(target=hold, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == [] and lock_file.exists()


# A run's TMPDIR as a program may leave it (a tar extraction, Go's module cache): read-only folders, one in another,
# one that cannot even be listed, and a symlink to a read-only folder outside, whose mode must stay. Prints
# what remove_tree returned, whether the tree is still there, and the outside folder's mode.
_REMOVE_READ_ONLY_TREE = """
import os, sys
from pathlib import Path
from nereid.files import remove_tree
tree, outside = Path(sys.argv[1]), Path(sys.argv[2])
(tree / "extracted" / "nested").mkdir(parents=True)
(tree / "extracted" / "file").write_text("x")
(tree / "extracted" / "nested" / "file").write_text("y")
(tree / "extracted" / "outside").symlink_to(outside)
(tree / "unlisted").mkdir()
(tree / "unlisted" / "file").write_text("z")
for folder, mode in (("extracted/nested", 0o555), ("extracted", 0o555), ("unlisted", 0)):
    os.chmod(tree / folder, mode)
print(remove_tree(tree), tree.exists(), oct(outside.stat().st_mode & 0o777))
"""


def test_a_tree_with_read_only_folders_is_removed_whole_as_a_server_that_is_not_root(tmp_path):
    """Defect (found by a bug hunt): a run that left a read-only folder in its TMPDIR kept its whole run folder
    on disk for good under a server that is not root: every removal was rmtree(ignore_errors=True). Root (with
    CAP_DAC_OVERRIDE) obeys no permission bits, so the child drops those capabilities, as a non-root server runs."""
    from support import run_as_non_root

    (tmp_path / "run").mkdir()
    (tmp_path / "outside").mkdir(mode=0o555)
    done = run_as_non_root([sys.executable, "-c", _REMOVE_READ_ONLY_TREE, str(tmp_path / "run"),
                            str(tmp_path / "outside")], tmp_path)
    assert (done.returncode, done.stdout.split()) == (0, ["True", "False", "0o555"]), done.stderr


def test_a_tree_deeper_than_python_s_recursion_limit_or_path_max_is_removed(tmp_path):
    """Found by the warm-start hunt: a run that left 3,000 nested folders in its TMPDIR failed its own request
    (RecursionError out of shutil.rmtree in its cleanup), its server's stop (exit 1), and every later start on that
    TMPDIR (the stale scratch folder's removal raised). The path is past PATH_MAX too: made through descriptors."""
    tree = tmp_path / "run"
    tree.mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "kept").write_text("x")
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    for level in range(3000):
        os.mkdir("d", dir_fd=fd)
        if level % 500 == 0:
            os.symlink(str(tmp_path / "outside"), "link", dir_fd=fd)
            os.mkdir("side", dir_fd=fd)
            with open(os.open("file", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as file:
                file.write("y")
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    descriptors = len(os.listdir("/proc/self/fd"))
    assert remove_tree(tree) is True and not tree.exists()
    assert len(os.listdir("/proc/self/fd")) == descriptors  # (none left open)
    assert (tmp_path / "outside" / "kept").read_text() == "x"  # (the links removed, never followed)


def test_removing_a_tree_never_raises_nor_follows_a_symlink(tmp_path):
    assert remove_tree(tmp_path / "absent") is True
    target = tmp_path / "target"
    target.mkdir()
    (target / "kept").write_text("x")
    (tmp_path / "link").symlink_to(target)
    assert remove_tree(tmp_path / "link") is False  # (rmtree refuses a symlink: nothing is removed through it)
    assert (target / "kept").exists() and (tmp_path / "link").is_symlink()


def test_a_folder_that_cannot_be_moved_up_is_removed_where_it_is_and_earlier_names_never_collide(tmp_path,
                                                                                                  monkeypatch):
    """The hunt of the rewrite: on overlayfs a folder of a lower layer cannot be moved (EXDEV), and nothing below it
    was removed, while the start said the stale scratch folder was; and after eight names left by an earlier removal
    (.nereid-removing-N) a folder was given up."""
    import errno

    from nereid import files

    tree = tmp_path / "run"
    (tree / "a" / "b" / "c").mkdir(parents=True)
    (tree / "a" / "b" / "c" / "f").write_text("x")
    for index in range(1, 21):  # an earlier removal's names, in the way of a fixed numbering
        (tree / f".nereid-removing-{index}" / "x").mkdir(parents=True)
    real_rename = os.rename

    def cross_device(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        if src == "b":  # (a folder of an image's lower layer)
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    monkeypatch.setattr(files.os, "rename", cross_device)
    assert remove_tree(tree) is True and not tree.exists()


def test_a_folder_that_is_a_mount_point_is_left_as_it_is(tmp_path, monkeypatch):
    """The hunt of the in-place removal: a mount point cannot be moved either (EBUSY), and removing it in place
    would empty the file system mounted there. Only EXDEV (overlayfs) is removed in place; the rest is left."""
    import errno

    from nereid import files

    tree = tmp_path / "run"
    (tree / "a" / "mnt" / "data").mkdir(parents=True)
    (tree / "a" / "mnt" / "data" / "kept").write_text("x")
    real_rename = os.rename

    def busy(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        if src == "mnt":
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    monkeypatch.setattr(files.os, "rename", busy)
    assert remove_tree(tree) is False
    assert [p.read_text() for p in tree.rglob("kept")] == ["x"]


def test_a_process_reading_file_names_in_another_encoding_than_utf8_is_warned(tmp_path) -> None:
    """Found by the deployment hunt: under an ASCII locale (LC_ALL=C with PYTHONUTF8=0) a UTF-8 model name was
    refused as "must be a folder name" and UTF-8 folders were skipped as "not UTF-8", with nothing naming the cause.
    A real `nereid check` in that locale says it first."""
    import subprocess
    import sys

    (tmp_path / "ml-backends").mkdir()
    (tmp_path / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml-backends"\n')
    env = {key: value for key, value in os.environ.items() if not key.startswith(("LC_", "LANG", "PYTHONUTF8"))}
    env.update(LC_ALL="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    checked = subprocess.run([sys.executable, "-m", "nereid", "check", "--config", str(tmp_path / "nereid.yaml")],
                             capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert ("file names are read as ascii here (the locale: LANG/LC_ALL), not UTF-8: a model folder or name with "
            "other than ASCII characters is refused or skipped; run with LANG=C.UTF-8 or PYTHONUTF8=1") in \
        checked.stderr, checked.stderr
    utf8 = subprocess.run([sys.executable, "-m", "nereid", "check", "--config", str(tmp_path / "nereid.yaml")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "file names are read as" not in utf8.stderr
