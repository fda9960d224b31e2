"""What a backend checks of the server's scratch folder before it puts a program there, and its errors."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

from nereid.backends.scratch import require_executable_folder, scratch_folder_refused
from nereid.errors import ConfigError

from support import run_with_tmpdir_mounted_noexec


def test_a_full_scratch_folder_is_a_load_error_naming_the_model_the_folder_and_tmpdir(tmp_path: Path) -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    error = scratch_folder_refused("m", "put its binary into", tmp_path, full)
    assert isinstance(error, ConfigError)
    assert str(error) == (f"model 'm': cannot put its binary into the server's scratch folder {tmp_path}: No space "
                          "left on device (the server makes its scratch folder in TMPDIR)")


def test_a_folder_that_allows_executables_or_cannot_be_looked_at_is_let_through(tmp_path: Path) -> None:
    require_executable_folder("m", tmp_path, "its binary runs from")
    require_executable_folder("m", tmp_path / "missing", "its binary runs from")  # what writes there next fails


def test_a_folder_on_a_noexec_file_system_is_refused(tmp_path: Path) -> None:
    check = ("import os, sys; from pathlib import Path; from nereid.backends.scratch import require_executable_folder\n"
             "try:\n    require_executable_folder('m', Path(os.environ['TMPDIR']), 'its binary runs from')\n"
             "except Exception as err:\n    print(type(err).__name__, err)\n")
    done = run_with_tmpdir_mounted_noexec(tmp_path / "tmp", [sys.executable, "-c", check])
    assert done.stdout.startswith(f"ConfigError model 'm': its binary runs from the server's scratch folder "
                                  f"{tmp_path / 'tmp'}, which is on a file system mounted noexec"), done
