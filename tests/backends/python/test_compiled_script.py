"""A script run from its cached bytecode only while that bytecode matches the source (PEP 552's rules)."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from nereid.backends.python.compiled_script import bytecode_is_fresh, runnable_script
from nereid.backends.python.plugin import COLD_BOOTSTRAP
from nereid.backends.python.warm import WARM_PARENT_SCRIPT

SCRIPT = 'import sys\nprint("ran", sys.argv[1:])\nif sys.argv[1:] == ["fail"]:\n    raise ValueError("asked to")\n'


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "tool.py"
    path.write_text(SCRIPT)
    return path


def cached_of(source: Path) -> Path:
    return Path(importlib.util.cache_from_source(str(source)))


def edit_keeping_size_and_time(source: Path) -> None:
    """An edit the timestamp rule cannot see: the same length, the same modification time."""
    status = source.stat()
    source.write_text(SCRIPT.replace('"ran"', '"RAN"'))
    os.utime(source, ns=(status.st_atime_ns, status.st_mtime_ns))


def test_fresh_bytecode_is_run_and_behaves_as_the_source(script):
    py_compile.compile(str(script), doraise=True)
    assert runnable_script(script) == cached_of(script)
    for args in ([], ["fail"]):
        from_source = subprocess.run([sys.executable, "-P", str(script), *args], capture_output=True, text=True)
        from_bytecode = subprocess.run([sys.executable, "-P", str(runnable_script(script)), *args],
                                       capture_output=True, text=True)
        assert (from_bytecode.returncode, from_bytecode.stdout) == (from_source.returncode, from_source.stdout)
    # Its traceback still names the source and quotes its line.
    assert f'File "{script}", line 4' in from_bytecode.stderr and 'raise ValueError("asked to")' in from_bytecode.stderr


@pytest.mark.parametrize("damage", ["cut_short", "zeroed"])
def test_bytecode_whose_header_is_right_but_code_damaged_is_compiled_anew(script, monkeypatch, damage):
    """Found by a bug hunt of persistent caches: a .pyc cut short (or zeroed) past its 16-byte header passed the
    header's check, and the interpreter it was given to ran nothing: "Bad code object in .pyc file" at every
    warm parent's start and every cold run, never mended."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    py_compile.compile(str(script), doraise=True)
    cached = cached_of(script)
    data = cached.read_bytes()
    damaged = data[:16] + (data[16:len(data) // 2] if damage == "cut_short" else bytes(len(data) - 16))
    cached.write_bytes(damaged)
    assert bytecode_is_fresh(cached, script)  # (the header still says it is the source's)
    assert runnable_script(script) == cached and cached.read_bytes() == data  # compiled anew
    ran = subprocess.run([sys.executable, "-P", str(cached), "x"], capture_output=True, text=True)
    assert (ran.returncode, ran.stdout) == (0, "ran ['x']\n"), ran.stderr


def test_no_bytecode_is_written_when_the_interpreter_writes_none(script, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert runnable_script(script) == script
    assert not cached_of(script).exists()


def test_missing_or_stale_bytecode_is_compiled_anew(script, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert runnable_script(script) == cached_of(script) and bytecode_is_fresh(cached_of(script), script)
    script.write_text(SCRIPT + "print('edited')\n")  # a new size
    assert not bytecode_is_fresh(cached_of(script), script)
    assert runnable_script(script) == cached_of(script)
    assert "edited" in subprocess.run([sys.executable, str(cached_of(script))], capture_output=True, text=True).stdout


def test_stale_bytecode_that_cannot_be_rewritten_leaves_the_source(script, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    py_compile.compile(str(script), doraise=True)
    script.write_text(SCRIPT + "\n")
    assert runnable_script(script) == script
    # A cache folder that cannot be made (a file in its place, as a read-only install refuses it): the source too.
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    cached_of(script).unlink()
    cached_of(script).parent.rmdir()
    cached_of(script).parent.write_text("")
    assert runnable_script(script) == script


def test_hash_based_bytecode_follows_its_checking_flag(script, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    py_compile.compile(str(script), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    assert runnable_script(script) == cached_of(script)
    edit_keeping_size_and_time(script)
    assert runnable_script(script) == script  # the hash no longer matches
    py_compile.compile(str(script), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    script.write_text(SCRIPT + "\n")
    assert runnable_script(script) == cached_of(script)  # never checked, as the import system has it


def test_timestamp_bytecode_misses_an_edit_of_the_same_size_and_time_as_the_import_system_does(script):
    py_compile.compile(str(script), doraise=True)
    edit_keeping_size_and_time(script)
    assert bytecode_is_fresh(cached_of(script), script)


def test_bytecode_of_another_interpreter_or_unknown_flags_is_not_fresh(script):
    py_compile.compile(str(script), doraise=True)
    cached = cached_of(script)
    good = cached.read_bytes()
    cached.write_bytes(b"\0\0\r\n" + good[4:])
    assert not bytecode_is_fresh(cached, script)
    cached.write_bytes(good[:4] + (4).to_bytes(4, "little") + good[8:])
    assert not bytecode_is_fresh(cached, script)
    cached.write_bytes(good[:10])
    assert not bytecode_is_fresh(cached, script)


def test_a_served_python_model_starts_its_parent_and_cold_runs_from_bytecode(repo, serve):
    # The suite's conftest compiles the package once: the warm parent runs from its bytecode, not the source.
    assert bytecode_is_fresh(cached_of(WARM_PARENT_SCRIPT), WARM_PARENT_SCRIPT)
    repo.python("echo")
    server = serve(repo.write_config())
    parent = server.server.repository.entry("echo").loaded.backend._parent
    command = Path(f"/proc/{parent.pid}/cmdline").read_bytes().split(b"\0")
    assert command[2] == bytes(cached_of(WARM_PARENT_SCRIPT))
    # So does each cold run it execs (a cold model's, or this one's after its parent goes cold): fixed at load.
    assert parent.cold_argv[1:] == [str(cached_of(COLD_BOOTSTRAP))]
    tensor = triton.InferInput("input", [4], "FP32")
    tensor.set_data_from_numpy(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(server.client.infer("echo", [tensor]).as_numpy("output"), np.arange(4))


def test_a_server_run_with_dash_o_still_runs_the_plain_bytecode(script):
    # The interpreter the script is given to runs without -O: its optimized bytecode (asserts stripped) is not it.
    py_compile.compile(str(script), doraise=True)
    chosen = subprocess.run(
        [sys.executable, "-O", "-c", "import sys; from pathlib import Path; "
         "from nereid.backends.python.compiled_script import runnable_script; "
         "print(runnable_script(Path(sys.argv[1])))", str(script)],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout
    assert chosen.strip() == str(cached_of(script))
