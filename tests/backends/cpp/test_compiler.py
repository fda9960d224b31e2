"""compile_to on its own, with a stand-in compiler (a shell script) that uses TMPDIR as gcc and clang do."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from nereid.backends.cpp import compiler as cpp_compiler
from nereid.errors import ConfigError
from nereid.files import descriptor_path
from support import zero_text_section

# The flags that have a compiler build for the machine it runs on.
NATIVE_FLAGS = ("-march=native", "-mtune=native", "-mcpu=native")

# Writes an intermediate file into $TMPDIR and records where, then (with SLEEP set) hangs, else writes its -o.
STAND_IN = '''#!/bin/sh
echo "$TMPDIR" > "{record}"
echo "assembly" > "$TMPDIR/cc1234.s"
[ -n "{sleep}" ] && exec sleep 30
while [ "$1" != "-o" ]; do shift; done
echo built > "$2"
'''


def stand_in(tmp_path: Path, sleep: bool) -> tuple[tuple[str, ...], Path]:
    record = tmp_path / "tmpdir.txt"
    script = tmp_path / "cc"
    script.write_text(STAND_IN.format(record=record, sleep="yes" if sleep else ""))
    script.chmod(0o755)
    return (str(script),), record


@pytest.mark.parametrize("killed", [False, True], ids=["built", "killed past the limit"])
def test_the_compilers_intermediate_files_go_to_a_folder_that_is_removed_after_it(tmp_path, monkeypatch, killed):
    """Defect: g++ wrote its .s/.o into the system's /tmp, and a compile killed (past the limit, or with the
    server) left them there for good."""
    compiler, record = stand_in(tmp_path, sleep=killed)
    out = tmp_path / "scratch"
    out.mkdir()
    target = out / "main-abc"
    monkeypatch.setattr(cpp_compiler, "COMPILE_TIMEOUT_S", 1)
    if killed:
        with pytest.raises(ConfigError, match="compilation took longer than 1 s"):
            cpp_compiler.compile_to(compiler, ["main.cpp"], target, tmp_path, "model 'm'")
    else:
        cpp_compiler.compile_to(compiler, ["main.cpp"], target, tmp_path, "model 'm'")
        assert target.read_text() == "built\n"
    used = Path(record.read_text().strip())
    assert used.parent == out  # beside the target, in the server's scratch folder
    assert not used.exists()
    assert sorted(p.name for p in out.iterdir()) == ([] if killed else ["main-abc"])


def test_what_the_compiler_prints_for_a_build_that_succeeds_is_logged_once_naming_the_model(tmp_path, caplog):
    """Defect: a #warning (or any compiler warning) was dropped; only a failed build showed the output."""
    script = tmp_path / "cc"
    script.write_text('#!/bin/sh\necho "main.cpp:1:2: warning: #warning check this" >&2\n'
                      'while [ "$1" != "-o" ]; do shift; done\necho built > "$2"\n')
    script.chmod(0o755)
    (tmp_path / "out").mkdir()
    with caplog.at_level("WARNING", logger=cpp_compiler.__name__):
        cpp_compiler.compile_to((str(script),), ["main.cpp"], tmp_path / "out" / "main-abc", tmp_path, "x", "m")
    assert [r.getMessage() for r in caplog.records] == [
        "model 'm': the compiler warned (the build succeeded):\nmain.cpp:1:2: warning: #warning check this"]


def test_the_build_key_covers_hidden_headers_and_headers_in_a_linked_folder(tmp_path):
    """Found by a bug hunt: an edit to `#include ".factor.h"`, or to a header reached through a symlinked
    subfolder (`inc -> ../shared_inc`), kept serving the old binary, a restart too: neither was in the key."""
    folder, shared = tmp_path / "m", tmp_path / "shared_inc"
    folder.mkdir()
    shared.mkdir()
    (folder / "main.cpp").write_text('#include ".factor.h"\n#include "inc/scale.h"\nint main() {}\n')
    (folder / ".factor.h").write_text("#define FACTOR 2.0f\n")
    (shared / "scale.h").write_text("#define SCALE 1\n")
    (shared / "back").symlink_to("..")  # a link back up: followed once, not for ever
    (folder / "inc").symlink_to(shared)
    (folder / ".#main.cpp").symlink_to("someone@host.1234")  # an editor's lock: left out
    (folder / "._main.cpp").write_text("AppleDouble")  # macOS's metadata: left out
    (folder / ".old.h").symlink_to("gone.h")  # a hidden link to nothing: left out
    (folder / "data").symlink_to("/usr")  # a data link out of the repository: not walked (reviewed)
    (folder / "up").symlink_to("..")  # the repository itself: not walked
    names = [str(path.relative_to(folder)) for path in cpp_compiler.code_files(folder, cpp_compiler.SOURCE_SUFFIXES)]
    assert names == [".factor.h", "main.cpp", "inc/scale.h"], names
    compiler = cpp_compiler.find_compiler()
    keys = [cpp_compiler.source_hash(folder, compiler, "m")]
    (folder / ".factor.h").write_text("#define FACTOR 3.0f\n")
    keys.append(cpp_compiler.source_hash(folder, compiler, "m"))
    (shared / "scale.h").write_text("#define SCALE 2\n")
    keys.append(cpp_compiler.source_hash(folder, compiler, "m"))
    assert len(set(keys)) == 3, keys


def test_a_model_folder_linked_in_from_outside_the_repository_is_keyed_and_rebuilt_after_an_edit(tmp_path):
    """Found by a bug hunt: a model folder linked into the repository from elsewhere (follow_symlinks) was not
    walked at all, so its key held the compiler and flags only: every such model shared one build name, and an
    edit of main.cpp or a header was never built, not by a reload, not by a restart."""
    elsewhere, repository = tmp_path / "elsewhere", tmp_path / "repo"
    (elsewhere / "m").mkdir(parents=True)
    (elsewhere / "shared").mkdir()
    repository.mkdir()
    shutil.copy(Path(__file__).resolve().parents[3] / "ml-backends" / "cpp_scale" / "main.cpp", elsewhere / "m")
    (elsewhere / "m" / "factor.h").write_text("#define FACTOR 2\n")
    (elsewhere / "shared" / "k.h").write_text("#define K 1\n")
    (elsewhere / "m" / "inc").symlink_to("../shared")  # beside the folder's real location: followed
    (elsewhere / "m" / "data").symlink_to("/usr")  # out of there: still not walked
    (repository / "m").symlink_to(elsewhere / "m")
    folder = repository / "m"
    names = [str(path.relative_to(folder)) for path in cpp_compiler.code_files(folder, cpp_compiler.SOURCE_SUFFIXES)]
    assert names == ["factor.h", "main.cpp", "inc/k.h"], names
    compiler = cpp_compiler.find_compiler()
    keys = [cpp_compiler.source_hash(folder, compiler, "m")]
    for path, text in (("factor.h", "#define FACTOR 5\n"), ("inc/k.h", "#define K 2\n")):
        (folder / path).write_text(text)
        keys.append(cpp_compiler.source_hash(folder, compiler, "m"))
    assert len(set(keys)) == 3, keys
    (tmp_path / "scratch").mkdir()
    built = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    main = folder / "main.cpp"
    main.write_text(main.read_text().replace("v *= 2.0f", "v *= 3.0f"))
    rebuilt = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert rebuilt != built and rebuilt.is_file() and not built.exists()  # built again; the stale build removed


def test_a_build_key_with_no_source_in_it_is_refused(tmp_path):
    """A key holding no source would never go stale, whatever was edited: such a build is refused, not cached."""
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ConfigError, match=r"model 'm': no C\+\+ source was found under .* for its build key"):
        cpp_compiler.source_hash(tmp_path, ("c++",), "m")


@pytest.mark.parametrize("path", [None, ""], ids=["PATH unset", "PATH empty, CXX a full path"])
def test_a_server_without_path_runs_the_compiler_with_the_default_path(tmp_path, monkeypatch, path):
    """Found by a bug hunt: under env -i, c++ was found through Python's default path but ran with no PATH,
    and gcc's driver failed "collect2: fatal error: cannot find 'ld'" (cpp and cxx builds alike)."""
    found = shutil.which("c++")
    assert found is not None, "these tests need a C++ compiler"
    if path is None:
        monkeypatch.delenv("PATH")
        monkeypatch.delenv("CXX", raising=False)
    else:
        monkeypatch.setenv("PATH", path)
        monkeypatch.setenv("CXX", found)
    (tmp_path / "main.cpp").write_text("int main() { return 0; }\n")
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / "main-abc"
    compiler = cpp_compiler.find_compiler()
    assert cpp_compiler.compiler_version(compiler)  # the probe runs with the same environment
    cpp_compiler.compile_to(compiler, [*cpp_compiler.CXX_FLAGS, "main.cpp"], target, tmp_path, "model 'm'", "m")
    assert os.access(target, os.X_OK)


@pytest.mark.parametrize("cxx", ["c++ -std=c++20", "c++ -O0 -g -std=c++20"])
def test_flags_given_in_cxx_win_over_nereid_s_own(tmp_path, monkeypatch, cxx):
    """Found by the author hunt: nereid's -O2 -std=c++17 came after the flags $CXX gives, and GCC takes an option's
    last value: CXX="c++ -std=c++20" built C++17 ("'consteval' does not name a type"), CXX="g++ -O0 -g" at -O2."""
    monkeypatch.setenv("CXX", cxx)
    (tmp_path / "main.cpp").write_text("consteval int twice(int x) { return 2 * x; }\n"
                                       "int main() { return twice(21) == 42 ? 0 : 1; }\n")
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / "main-abc"
    cpp_compiler.compile_to(cpp_compiler.find_compiler(), [*cpp_compiler.CXX_FLAGS, "main.cpp"], target, tmp_path,
                            "model 'm'", "m")
    assert subprocess.run([str(target)]).returncode == 0
    # After the compiler's own words, a launcher's options included (the review: "env -u FOO g++" got them first).
    for launched in (("/usr/bin/ccache", "g++", "-O0"), ("/usr/bin/env", "-u", "FOO", "g++", "-O0"),
                     ("/usr/bin/nice", "-n", "5", "g++", "-O0")):
        assert cpp_compiler.compiler_command(launched, ["-O2", "-std=c++17", "main.cpp"]) == [
            *launched[:-1], "-O2", "-std=c++17", "-O0", "main.cpp"]


def test_a_source_the_server_s_user_cannot_read_is_told_to_be_made_readable(tmp_path: Path) -> None:
    """Defect (the hunt of edc6865): an unreadable main.cpp, a regular file, was told "make it a regular file or
    remove it"."""
    import sys

    from support import run_as_non_root

    source = tmp_path / "main.cpp"
    source.write_text("int main() { return 0; }\n")
    source.chmod(0)
    probe = ("import sys\nfrom pathlib import Path\nfrom nereid.backends.cpp.compiler import read_code_file\n"
             "from nereid.errors import ConfigError\ntry:\n"
             "    read_code_file(Path(sys.argv[1]), 'model m: ', 'main.cpp')\n"
             "except ConfigError as err:\n    print(err)\n")
    try:
        done = run_as_non_root([sys.executable, "-c", probe, str(source)], writable_after=tmp_path)
    finally:
        source.chmod(0o644)
    assert done.stdout.strip() == (f"model m: {source}: cannot read: Permission denied; the build reads main.cpp: "
                                   "make it readable by the server's user (uid 0) or remove it"), done
    # Readable, in a folder that is not searchable: the folder is what to fix.
    tmp_path.chmod(0o644)
    try:
        done = run_as_non_root([sys.executable, "-c", probe, str(source)], writable_after=tmp_path)
    finally:
        tmp_path.chmod(0o755)
    assert done.stdout.strip() == (f"model m: {source}: cannot read: Permission denied; the build reads main.cpp: "
                                   f"give its folder {tmp_path} search permission (x) for the server's user (uid 0)"
                                   ), done


def _model_including(tmp_path: Path, k: int) -> tuple[Path, Path]:
    """A model folder whose main.cpp returns K from a header outside it (``../../shared/k.h``): its exit status."""
    folder, shared = tmp_path / "repo" / "m", tmp_path / "shared"
    folder.mkdir(parents=True)
    shared.mkdir()
    (folder / "main.cpp").write_text('#include "../../shared/k.h"\nint main() { return K; }\n')
    (shared / "k.h").write_text(f"constexpr int K = {k};\n")
    (tmp_path / "scratch").mkdir()
    return folder, shared / "k.h"


def _exit_status(binary: Path) -> int:
    return subprocess.run([str(binary)], check=False, timeout=60).returncode


def test_an_edit_of_a_header_included_from_outside_the_model_folder_rebuilds(tmp_path, caplog):
    """Found by a bug hunt: `#include "../../shared/k.h"` was compiled in but in no key, so K = 2 edited to 3 left
    the old binary serving after every reload and restart. The compiler's list of what it read (-MMD) is kept
    beside the build with each outside file's hash, and a changed one builds it again."""
    folder, header = _model_including(tmp_path, 2)
    with caplog.at_level("INFO", logger=cpp_compiler.__name__):
        built = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert built.parent == folder / ".cache" and _exit_status(built) == 2
    assert ("model 'm': its build includes files outside its build key, checked for edits at each load: "
            "../../shared/k.h") in caplog.messages
    stamp = built.stat().st_mtime_ns, built.stat().st_ino
    assert cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m") == built
    assert (built.stat().st_mtime_ns, built.stat().st_ino) == stamp  # unchanged: reused as it is
    header.write_text("constexpr int K = 3;\n")
    rebuilt = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert rebuilt == built and _exit_status(rebuilt) == 3  # the same key, built again from the edited header
    assert sorted(p.name for p in (folder / ".cache").iterdir()) == [built.name, built.name + ".deps"]


def test_a_build_without_its_record_is_built_again(tmp_path):
    """A build in .cache/ with no record of what it included (made by an older nereid, or its record lost) may
    hold any content of an outside header: it is built again, not trusted."""
    folder, header = _model_including(tmp_path, 2)
    built = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    (folder / ".cache" / (built.name + ".deps")).unlink()
    header.write_text("constexpr int K = 4;\n")
    assert _exit_status(cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")) == 4


def test_a_compiler_that_lists_no_included_files_gives_a_build_served_once_not_cached(tmp_path, caplog,
                                                                                      monkeypatch):
    """Without -MMD's list an outside header's edit could not be noticed: the build is served, never cached."""
    folder, _ = _model_including(tmp_path, 2)
    script = tmp_path / "cc-no-list"  # drops -MMD and -MF FILE, then runs c++
    script.write_text('#!/bin/sh\nfor a do\n  shift\n  if [ -n "$skip" ]; then skip=; continue; fi\n'
                      '  case "$a" in -MMD) continue ;; -MF) skip=1; continue ;; esac\n  set -- "$@" "$a"\n'
                      'done\nexec c++ "$@"\n')
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    with caplog.at_level("WARNING", logger=cpp_compiler.__name__):
        built = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert _exit_status(built) == 2 and not built.is_relative_to(folder) and not (folder / ".cache").exists()
    assert [m for m in caplog.messages if "wrote no list" in m] == [
        "model 'm': the compiler (cc-no-list) wrote no list of the files it included (-MMD -MF), so an edit of one "
        "outside the model folder could not be noticed; this build is not cached"]


def test_a_header_from_outside_the_model_folder_edited_while_it_compiles_gives_a_build_served_once(tmp_path,
                                                                                                  monkeypatch):
    """Found by the cxx read hunt: the record hashed an outside header after the compile; edited meanwhile, the
    record held the new header's hash for a build of the old one, served as current at every load and restart."""
    folder, header = _model_including(tmp_path, 1)
    script = tmp_path / "cc-then-edit"  # compiles, then the header is edited (as during a long compile)
    script.write_text(f'#!/bin/sh\nc++ "$@" || exit $?\ncase " $* " in *" -o "*) '
                      f'echo "constexpr int K = 2;" > {header} ;; esac\n')  # (not at the key's --version)
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    built = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert _exit_status(built) == 1 and not built.is_relative_to(folder)  # served once: not cached
    monkeypatch.delenv("CXX")
    rebuilt = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert _exit_status(rebuilt) == 2 and rebuilt.parent == folder / ".cache"


def test_a_header_from_outside_with_a_time_in_the_future_is_no_edit_during_the_compile(tmp_path):
    """The review hunt of 6697234: a header whose time is in the future (a tar of an archive made ahead, a skewed
    clock) was taken for one edited during every compile: the model was built again at every load."""
    folder, header = _model_including(tmp_path, 5)
    ahead = time.time() + 86400
    os.utime(header, (ahead, ahead))
    built = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert built.parent == folder / ".cache" and _exit_status(built) == 5  # cached, not served once


def test_make_prerequisites_reads_every_rule_unescaped():
    text = "a.o: a.cpp sp\\ ace/c$$h\\#.h \\\n ../x.h\nb.o: b.cpp \\\n  a.cpp\nlonely.o:\n"
    assert cpp_compiler.make_prerequisites(text) == ["a.cpp", "sp ace/c$h#.h", "../x.h", "b.cpp"]


def _returning(folder: Path, k: int) -> Path:
    """A model folder whose main.cpp returns ``k`` (its exit status)."""
    folder.mkdir(parents=True)
    (folder / "main.cpp").write_text(f"int main() {{ return {k}; }}\n")
    return folder


@pytest.mark.parametrize("damage", ["code zeroed", "cut short", "swapped", "swapped with its record"])
def test_a_cached_build_that_is_not_the_one_built_is_named_and_built_again(tmp_path, caplog, damage):
    """Found by a bug hunt of persistent caches: a cached build was used whenever it was a whole ELF file, so one
    whose code a torn write zeroed (its headers whole) was run by every request (SIGSEGV; as a cxx library it
    crashed the server), another build copied over its name answered for it (x3 where x2 was built), and one cut
    short was built again without a word. Its record holds its name, size and sha256: a build that does not match
    is named in a WARNING, with why, and built again."""
    for name in ("scratch", "other-scratch"):
        (tmp_path / name).mkdir()
    folder = _returning(tmp_path / "m", 2)
    built = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    record = built.with_name(built.name + cpp_compiler.RECORD_SUFFIX)
    stamp = built.stat()
    if damage == "code zeroed":
        size = built.stat().st_size
        assert zero_text_section(built) > 0 and built.stat().st_size == size
        reason = "its content is not the one it was built with (sha256 "
    elif damage == "cut short":
        built.write_bytes(built.read_bytes()[:-1000])
        reason = "bytes when it was built: cut short, damaged or replaced"
    else:
        other = cpp_compiler.build_binary(_returning(tmp_path / "other", 3), "main.cpp", tmp_path / "other-scratch",
                                          "other")
        shutil.copy(other, built)
        reason = "its content is not the one it was built with"
        if damage == "swapped with its record":
            shutil.copy(other.with_name(other.name + cpp_compiler.RECORD_SUFFIX), record)
            reason = f"its record {record.name} is the record of another build ('{other.name}')"
    # Bit-rot or a torn write leaves the build's time as it was (written after its record, it is the next test's).
    os.utime(built, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    with caplog.at_level("INFO", logger=cpp_compiler.__name__):
        rebuilt = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert rebuilt == built and _exit_status(rebuilt) == 2
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith(f"model 'm': ignoring its cached build {built}: ") and reason in warning, warning
    assert warning.endswith("; building it again"), warning
    caplog.clear()  # the build made again is reused as it is, with no word
    stamp = built.stat().st_mtime_ns, built.stat().st_ino
    assert cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m") == built
    assert (built.stat().st_mtime_ns, built.stat().st_ino) == stamp and not caplog.records


def test_a_build_written_after_its_record_that_does_not_match_it_is_built_again_with_an_info_line(tmp_path, caplog):
    """Found by an upgrade hunt: an older nereid, which writes no record, built the model again under the same name
    after a rollback (an edit and its revert, an outside header changed meanwhile) and left this nereid's record
    behind (its sweep, lib-*.so, misses lib-*.so.deps); the next upgrade called that build "damaged or replaced" in
    a WARNING. A build written after its record is built again with an INFO line that says so."""
    folder, header = _model_including(tmp_path, 2)
    built = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    record = built.with_name(built.name + cpp_compiler.RECORD_SUFFIX)
    header.write_text("constexpr int K = 4;\n")  # the older nereid's build, of the header as it is now
    older = tmp_path / "older"
    cpp_compiler.compile_to(cpp_compiler.find_compiler(), [*cpp_compiler.CXX_FLAGS, "main.cpp"], older, folder, "m")
    os.replace(older, built)
    os.utime(record, ns=(record.stat().st_atime_ns, built.stat().st_mtime_ns - 10**9))  # (a second before it)
    with caplog.at_level("INFO", logger=cpp_compiler.__name__):
        rebuilt = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert rebuilt == built and _exit_status(rebuilt) == 4
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert (f"model 'm': ignoring its cached build {built}: it was written after its record {record.name} and does "
            "not match it (built again by an older nereid, which writes no record, or copied over since); building "
            "it again") in caplog.messages, caplog.messages


# Loads folder ($1)'s main.cpp with the compiler's log on stderr, printing where its build is served from.
_LOAD = """import logging, sys
from pathlib import Path
from nereid.backends.cpp import compiler
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
print(compiler.build_binary(Path(sys.argv[1]), "main.cpp", Path(sys.argv[2]), "m"))
"""


def _load_read_only(repository: Path, folder: Path, scratch: Path) -> subprocess.CompletedProcess:
    """Load ``folder``'s build with ``repository`` bind-mounted read-only (in a user and mount namespace of the
    load's own, as a Kubernetes volume is mounted; root ignores permission bits); skipped where none can be made."""
    import sys

    mount = ["unshare", "-rm", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"',
             str(repository)]
    probe = subprocess.run([*mount, "true"], capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"cannot mount a folder read-only in a namespace here: {probe and probe.stderr.strip()}")
    return subprocess.run([*mount, sys.executable, "-c", _LOAD, str(folder), str(scratch)], capture_output=True,
                          text=True, timeout=120)


def test_a_read_only_cache_holding_an_older_nereid_s_build_says_to_build_it_again_with_this_one(tmp_path):
    """Found by an upgrade hunt: an image whose .cache/ an older nereid built (no records) compiled every cpp and cxx
    model at every start, the rebuild never kept, with a WARNING that said only that .cache/ cannot be written. It
    says too that the build there is an older nereid's, and what to do."""
    folder, _ = _model_including(tmp_path, 2)
    built = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    built.with_name(built.name + cpp_compiler.RECORD_SUFFIX).unlink()  # as an older nereid leaves it
    for start in ("first", "second"):  # (each start alike: nothing is kept)
        done = _load_read_only(folder.parent, folder, tmp_path / start)
        assert done.returncode == 0, done.stderr
        served = Path(done.stdout.strip())
        assert served.is_relative_to(tmp_path / start) and _exit_status(served) == 2
        [warning] = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
        assert warning == (
            f"WARNING model 'm': cannot write the build cache {folder / '.cache'} (Read-only file system); serving the "
            "build in the server's scratch folder (built again at the next start): .cache/ holds a build an older "
            "nereid made, without the record this one checks, so it is never reused; build the repository's .cache/ "
            "again with this nereid where it can be written (nereid check on a writable copy builds every model) "
            "and ship that"), done.stderr
    shutil.rmtree(folder / ".cache")  # no build of an older nereid there: the WARNING as it was
    done = _load_read_only(folder.parent, folder, tmp_path / "third")
    assert [line for line in done.stderr.splitlines() if line.startswith("WARNING")] == [
        f"WARNING model 'm': cannot write the build cache {folder / '.cache'} (Read-only file system); serving the "
        "build in the server's scratch folder (built again at the next start)"], done.stderr


@pytest.mark.parametrize("owner, mode, how", [
    (12345, 0o700, "made by another user, under umask 077, say"),
    # The deploy hunt: one the server's own user owns was said to be another user's.
    (None, 0o600, "made under a umask that takes its owner's own rights, 0177 say")])
def test_a_cache_another_user_made_under_umask_077_is_said_to_be_unreadable(tmp_path, owner, mode, how):
    """The deployment hunt: a .cache/ built by another user under umask 077 (mode 0700) was reported as "cannot write
    the build cache": its builds were never found, and reading it is what to fix."""
    import sys

    from support import run_as_non_root

    owner = os.geteuid() if owner is None else owner
    folder, _ = _model_including(tmp_path, 2)
    cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    cache = folder / ".cache"
    for path in (cache, *cache.iterdir()):
        os.chown(path, owner, owner)
    cache.chmod(mode)
    (tmp_path / "later").mkdir()
    try:
        done = run_as_non_root([sys.executable, "-c", _LOAD, str(folder), str(tmp_path / "later")],
                               writable_after=tmp_path / "later")
    finally:
        for path in (cache, *cache.iterdir()):
            os.chown(path, 0, 0)
        cache.chmod(0o755)
    assert done.returncode == 0, done.stderr
    served = Path(done.stdout.strip())
    assert served.is_relative_to(tmp_path / "later") and _exit_status(served) == 2
    assert [line for line in done.stderr.splitlines() if line.startswith("WARNING")] == [
        f"WARNING model 'm': cannot read the build cache {cache} (mode {mode:04o}, owned by uid {owner}; the server "
        f"runs as uid {os.geteuid()}: {how}), so no build in it is reused or replaced; serving the "
        "build in the server's scratch folder (built again at the next start): make .cache/ readable, searchable "
        "and writable by the server's user, or remove it"], done.stderr


def test_a_build_and_its_record_are_published_durably(tmp_path, monkeypatch):
    """A build copied into .cache/ and renamed there with no fsync could be found, after a crash or a power loss, as
    its name over blocks never written (zeros under whole headers). Each of the build and its record is fsynced
    before its rename, and the folder after it, as atomic_write's ``durable`` does."""
    synced: list[str] = []
    fsync = os.fsync

    def noting_fsync(fd: int) -> None:
        synced.append(os.readlink(descriptor_path(fd)))  # (the file it is then)
        fsync(fd)
    (tmp_path / "scratch").mkdir()
    folder = _returning(tmp_path / "m", 2)
    monkeypatch.setattr(os, "fsync", noting_fsync)
    built = cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    monkeypatch.undo()
    cache = str(folder / ".cache")
    for name in (built.name, built.name + cpp_compiler.RECORD_SUFFIX):  # (.NAME.TOKEN.PID.partial, then renamed)
        assert [path for path in synced if re.fullmatch(re.escape(f"{cache}/.{name}.") + r"[0-9a-f]+\.\d+\.partial",
                                                           path)], (name, synced)
    assert synced.count(cache) >= 2, synced


def test_a_compiler_told_to_build_for_this_machine_keys_its_builds_by_the_host_cpu(monkeypatch):
    """CXX="g++ -march=native" builds for the instructions of the CPU it runs on: a build found in a .cache/ made on
    another machine (shipped in an image, shared over NFS) could die of SIGILL, a cxx library in the server's own
    process. With such a flag the key holds the host's CPU, as XLA's CPU executables' keys do; without one it does
    not, so that a repository's builds move between machines."""
    [program] = cpp_compiler.find_compiler()[:1]
    plain = (program, "-O3")

    def keys() -> list[bytes]:
        return [cpp_compiler.compiler_key((*plain, flag)) for flag in NATIVE_FLAGS] + [cpp_compiler.compiler_key(plain)]
    monkeypatch.setattr(cpp_compiler, "host_cpu", lambda: "a" * 16, raising=False)  # (none before)
    here = keys()
    monkeypatch.setattr(cpp_compiler, "host_cpu", lambda: "b" * 16, raising=False)
    elsewhere = keys()
    assert [a != b for a, b in zip(here, elsewhere)] == [True] * len(NATIVE_FLAGS) + [False]


def test_a_link_that_misses_a_library_says_that_only_the_standard_library_is_linked(tmp_path):
    """Found by the native backends hunt: a cpp model calling zlib's crc32 got the linker's bare `undefined
    reference to 'crc32'`, with no word that nothing beyond the C++ standard library is linked."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "main.cpp").write_text('extern "C" unsigned long crc32(unsigned long, const unsigned char*, unsigned);\n'
                                     "int main() { return static_cast<int>(crc32(0, nullptr, 0)); }\n")
    with pytest.raises(ConfigError) as failed:
        cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert "undefined reference to `crc32'" in str(failed.value)
    assert str(failed.value).endswith(
        "(nothing beyond the C++ standard library is linked into a build: a model that needs another library is a "
        "cxx model with a prebuilt library:, linked as it likes; see the README's cxx backend)")


def test_a_link_that_misses_a_function_defined_beside_main_cpp_names_that_file(tmp_path):
    """Found by the author hunt: a helper.cpp beside main.cpp, which only main.cpp's build never compiles, got the
    advice to make the model a cxx model with a prebuilt library."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "main.cpp").write_text("float helper(float);\nint main() { return static_cast<int>(helper(0)); }\n")
    (folder / "helper.cpp").write_text("float helper(float x) { return x; }\n")
    with pytest.raises(ConfigError) as failed:
        cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert str(failed.value).endswith(
        "see the README's cxx backend; only main.cpp is compiled: helper.cpp beside it in the model folder is not, "
        "#include it from main.cpp)")
    # A file that names none of what is missing is not named (the review: a folder whose main.cpp included
    # helper.cpp and missed zlib's crc32 was told to include helper.cpp).
    (folder / "main.cpp").write_text('#include "helper.cpp"\nextern "C" unsigned long crc32(unsigned long, '
                                     'const unsigned char*, unsigned);\nint main() { return crc32(0, nullptr, 0); }\n')
    with pytest.raises(ConfigError) as failed:
        cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert str(failed.value).endswith("see the README's cxx backend)")


def test_a_source_whose_name_is_not_utf8_is_keyed(tmp_path):
    """Found by the deployment hunt: a header named in Latin-1 in a cpp model's folder failed its load with
    UnicodeEncodeError (surrogates not allowed) as its key was computed."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "main.cpp").write_text("int main() { return 0; }\n")
    header = folder / os.fsdecode(b"caf\xe9.h")
    header.write_text("#define A 1\n")
    compiler = cpp_compiler.find_compiler()
    first = cpp_compiler.source_hash(folder, compiler, "m")
    header.write_text("#define A 2\n")
    assert cpp_compiler.source_hash(folder, compiler, "m") != first


@pytest.mark.parametrize("content", ["c++ -O2 \"$@\"\n", "\x7fELF\x02\x01\x01" + "\0" * 57],
                         ids=["a script without its #! line", "a cut ELF file"])
def test_a_compiler_that_is_no_program_is_named_as_such(tmp_path, monkeypatch, content):
    """Noticed by the stop 56 native hunt: a CXX that exec refuses (ENOEXEC) failed the load with a raw OSError,
    "raised by the load() of built-in backend 'cpp'", as if the backend were at fault."""
    folder, _ = _model_including(tmp_path, 3)
    script = tmp_path / "cc-not-a-program"
    script.write_text(content)
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    with pytest.raises(ConfigError) as refused:
        cpp_compiler.build_binary(folder, "main.cpp", tmp_path / "scratch", "m")
    assert str(refused.value) == (f"{folder / 'main.cpp'}: the C++ compiler {script} cannot be run: Exec format "
                                  "error (set CXX to a C++ compiler, or install g++)")
