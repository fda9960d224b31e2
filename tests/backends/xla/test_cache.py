"""The executable cache: a warm restart compiles nothing; bad or stale entries are rebuilt."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from nereid.backend import ModelContext
from nereid.backends.xla.cache import HASHES_FILE
from nereid.backends.xla.model import XlaModel
from nereid.backends.xla.export import examples, export_bundle
from nereid.errors import ConfigError
from nereid.files import check_confined
from nereid.settings import ModelSettings


def load(folder: Path, tmp_path: Path, **runtime) -> XlaModel:
    context = ModelContext(folder.name, folder, ModelSettings(folder.name, runtime=runtime), tmp_path, "test")
    model = XlaModel(context)
    model.load()
    return model


def entries(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (folder / ".cache").glob("*.xlaexe")}


def test_warm_cache_skips_compilation(tmp_path, add_bundle) -> None:
    folder = add_bundle(tmp_path, "mlp_bundle")
    cold = load(folder, tmp_path)
    assert (cold.report.cache.hits, cold.report.cache.compiled) == (0, 3)
    written = entries(folder)
    assert len(written) == 3
    hashes = json.loads((folder / ".cache" / HASHES_FILE).read_text())["modules"]
    assert sorted(hashes) == ["model.b1.mlir", "model.b32.mlir", "model.b8.mlir"]
    warm = load(folder, tmp_path)
    assert (warm.report.cache.hits, warm.report.cache.compiled, warm.report.cache.rebuilt) == (3, 0, 0)
    assert entries(folder) == written  # nothing rewritten
    x = np.ones((2, 16), np.float32)
    from nereid.tensors import NamedTensor

    assert np.array_equal(cold.infer([NamedTensor.from_array("input", x)])[0].data,
                          warm.infer([NamedTensor.from_array("input", x)])[0].data)


def test_corrupt_entries_are_rebuilt(tmp_path, add_bundle) -> None:
    folder = add_bundle(tmp_path, "mlp_bundle")
    load(folder, tmp_path)
    paths = sorted((folder / ".cache").glob("*.xlaexe"))
    flipped = bytearray(paths[0].read_bytes())
    flipped[-10] ^= 0xFF  # a payload byte: the checksum catches it
    paths[0].write_bytes(bytes(flipped))
    paths[1].write_bytes(b"garbage")
    reloaded = load(folder, tmp_path)
    assert (reloaded.report.cache.hits, reloaded.report.cache.rebuilt, reloaded.report.cache.compiled) == (1, 2, 2)
    again = load(folder, tmp_path)  # the rebuilt entries are good again
    assert (again.report.cache.hits, again.report.cache.compiled) == (3, 0)


def test_entries_that_are_no_files_or_nest_their_header_deeply_are_rebuilt(tmp_path, add_bundle) -> None:
    # A FIFO blocked the load for ever (/dev/zero would fill memory); a header nested 10,000 deep raised
    # RecursionError, which made the model UNAVAILABLE with a reason naming nothing.
    folder = add_bundle(tmp_path, "mlp_bundle")
    load(folder, tmp_path)
    paths = sorted((folder / ".cache").glob("*.xlaexe"))
    paths[0].unlink()
    os.mkfifo(paths[0])
    original = paths[1].read_bytes()
    nested = b"[" * 10_000 + b"]" * 10_000
    paths[1].write_bytes(original[:24] + struct.pack("<Q", len(nested)) + nested + b"payload")
    (folder / ".cache" / "mlirhashes.json").unlink()
    os.mkfifo(folder / ".cache" / "mlirhashes.json")
    reloaded = load(folder, tmp_path)
    assert (reloaded.report.cache.hits, reloaded.report.cache.rebuilt, reloaded.report.cache.compiled) == (1, 2, 2)
    assert all(path.is_file() for path in paths)  # rebuilt over
    assert load(folder, tmp_path).report.cache.hits == 3


def test_a_symlink_in_the_cache_is_under_the_folders_symlink_rule(tmp_path, add_bundle) -> None:
    """Deliberate, not a cache mistake: the cache reads through a link, so an entry linked to an executable
    outside ml_backends_path would be deserialized and run. The repository's rule that no file of a model
    folder leads outside it covers .cache/ too; with follow_symlinks the entry is judged like any other."""
    root = tmp_path / "repository"
    folder = add_bundle(root, "mlp_bundle")
    load(folder, tmp_path)
    path = sorted((folder / ".cache").glob("*.xlaexe"))[0]
    path.unlink()
    path.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match=r"\.cache/model\.b1\.mlir\.\w+\.xlaexe is a symlink to a path outside "
                                          "ml_backends_path; set server.follow_symlinks: true"):
        check_confined(folder, root, follow_symlinks=False)
    check_confined(folder, root, follow_symlinks=True)
    reloaded = load(folder, tmp_path)  # /dev/zero is no regular file: never opened, rebuilt over the link
    assert (reloaded.report.cache.hits, reloaded.report.cache.rebuilt) == (2, 1)
    assert path.is_file() and not path.is_symlink()


def test_stale_entries_are_rebuilt_and_old_ones_removed(tmp_path, add_bundle) -> None:
    folder = add_bundle(tmp_path, "mlp_bundle")
    load(folder, tmp_path)
    entry = sorted((folder / ".cache").glob("model.b1.mlir.*.xlaexe"))[0]
    data = entry.read_bytes()
    magic_end = data.index(b"\n") + 1
    (length,) = struct.unpack_from("<Q", data, magic_end)
    header = json.loads(data[magic_end + 8:magic_end + 8 + length])
    header["key"]["jaxlib_version"] = "0.0.1"  # as if written by another jaxlib
    encoded = json.dumps(header).encode()
    entry.write_bytes(data[:magic_end] + struct.pack("<Q", len(encoded)) + encoded + data[magic_end + 8 + length:])
    assert load(folder, tmp_path).report.cache.rebuilt == 1
    # A re-exported program (different contents) gets a new entry; the old one is removed.
    before = set(entries(folder))
    export_bundle(lambda x, w1, b1, w2, b2: (x @ w1 + b1) @ w2 + b2, [np.zeros((1, 16), np.float32)],
                  examples.mlp_weights(), directory=folder, batch_sizes=(1, 8, 32), input_names=["input"], output_names=["output"],
                  provenance=False)
    model = load(folder, tmp_path)
    assert model.report.cache.compiled == 3
    after = set(entries(folder))
    assert len(after) == 3 and not (after & before)


def test_disabled_or_unwritable_cache_still_loads(tmp_path, add_bundle, caplog) -> None:
    folder = add_bundle(tmp_path, "mlp_bundle")
    model = load(folder, tmp_path, executable_cache=False)
    assert model.report.cache.compiled == 3 and not (folder / ".cache").exists()
    (folder / ".cache").write_text("a file where the cache folder should be")
    assert load(folder, tmp_path).report.cache.compiled == 3  # warned, served uncached
    # Once per load, not once per program file (three lines for mlp_bundle's three batch sizes).
    assert sum("cannot use the executable cache" in r.getMessage() for r in caplog.records) == 1


def test_a_changed_xla_flags_misses_the_cache_and_a_dump_flag_does_not(tmp_path, add_bundle, monkeypatch) -> None:
    """Defect: the key left XLA_FLAGS out, so an executable compiled under one set of flags (say
    --xla_cpu_enable_fast_math=true) was reused by a server started with others. (The flags in force are those
    XLA read as it started in the process: each server's here is as if it had started with them.)"""
    from nereid.backends.xla import device
    from nereid.backends.xla.cache import compilation_flags

    def started_with(flags: str) -> None:
        monkeypatch.setattr(device, "_flags_at_start", compilation_flags({"XLA_FLAGS": flags}))

    started_with("")
    folder = add_bundle(tmp_path, "mlp_bundle")
    assert load(folder, tmp_path).report.cache.compiled == 3
    started_with("--xla_cpu_enable_fast_math=true")
    flagged = load(folder, tmp_path).report.cache
    assert (flagged.hits, flagged.compiled, flagged.rebuilt) == (0, 3, 0)
    assert len(entries(folder)) == 6  # one entry per program and flag set; the unflagged ones are kept
    # Where XLA writes its dumps is no part of the program: such flags leave the key (and the cache hit) alone.
    started_with(f"--xla_dump_to={tmp_path / 'dumps'} --xla_cpu_enable_fast_math=true")
    assert load(folder, tmp_path).report.cache.hits == 3
    started_with("")
    assert load(folder, tmp_path).report.cache.hits == 3
    assert compilation_flags({"XLA_FLAGS": " --xla_gpu_autotune_level=0  --xla_dump_hlo_as_text --b=1 --b=2"}) == \
        "--xla_gpu_autotune_level=0 --b=1 --b=2"
    assert compilation_flags({}) == ""


def test_xla_flags_naming_a_file_of_flags_is_keyed_by_the_flags_in_it(tmp_path) -> None:
    """Found by the hunt of this session's changes: XLA reads an XLA_FLAGS that does not start with '-' as a file
    of flags, and the key took its path: an edit of the file served executables compiled under the old flags."""
    from nereid.backends.xla.cache import compilation_flags

    flags = tmp_path / "xla.flags"
    flags.write_text("--xla_cpu_enable_fast_math=false\n--xla_dump_to=/tmp/dumps\n")
    assert compilation_flags({"XLA_FLAGS": str(flags)}) == "--xla_cpu_enable_fast_math=false"
    flags.write_text("--xla_cpu_enable_fast_math=true --xla_backend_optimization_level=0")
    assert compilation_flags({"XLA_FLAGS": str(flags)}) == (
        "--xla_cpu_enable_fast_math=true --xla_backend_optimization_level=0")
    # A value quoted as XLA takes it is one flag (its half was a flag of its own).
    assert compilation_flags({"XLA_FLAGS": '--xla_dump_to="/tmp/a b" --b=1'}) == "--b=1"


def test_an_entry_written_before_xla_flags_were_keyed_is_still_found() -> None:
    """Without XLA_FLAGS (the common case) the key, its header and its file name are what they were before the
    flags joined the key: an upgrade does not recompile every bundle's programs or leave their old entries behind."""
    import hashlib

    from nereid.backends.xla.cache import CacheKey

    before = {"module_sha256": "ab" * 32, "jaxlib_version": "0.10.2", "platform": "cpu", "platform_version": "cpu",
              "device_kind": "cpu"}
    key = CacheKey(**before)
    assert key.fields() == before
    assert key.digest == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:24]
    flagged = CacheKey(**before, xla_flags="--xla_cpu_enable_fast_math=true")
    assert flagged.fields() == {**before, "xla_flags": "--xla_cpu_enable_fast_math=true"}
    assert flagged.digest != key.digest


def test_cpu_entries_are_keyed_by_the_host_cpu_so_another_machine_s_are_never_loaded() -> None:
    """Found by the xla hunt: the key of a CPU executable named no CPU, and jaxlib loads an executable compiled for
    features this host lacks (AVX-512, AMX) with only a line on stderr: an entry made on a better machine (a
    bundle baked into an image, a folder on NFS) would be a hit, and end the server with SIGILL at its first run."""
    from nereid.backends.host_cpu import host_cpu
    from nereid.backends.xla.cache import CacheKey

    fingerprint = host_cpu()
    before = {"module_sha256": "ab" * 32, "jaxlib_version": "0.10.2", "platform": "cpu", "platform_version": "cpu",
              "device_kind": "cpu"}
    here, elsewhere = CacheKey(**before, host_cpu=fingerprint), CacheKey(**before, host_cpu="0" * 16)
    assert here.fields()["host_cpu"] == fingerprint and here.digest != elsewhere.digest
    assert "host_cpu" not in CacheKey(**{**before, "platform": "cuda"}).fields()  # (a GPU's kind names it)


def test_a_bundle_folder_removed_during_its_compile_is_not_made_again_by_the_cache(tmp_path, caplog) -> None:
    """Found by a bug hunt: a bundle folder deleted or renamed while it loaded came back, holding only
    .cache/<program>.xlaexe (the entry's write made every folder above it), and stayed listed as a folder no
    backend claims; a server restarted with it was never ready."""
    from nereid.backends.xla.cache import CacheKey, CompileFunctions, ExecutableCache

    folder = tmp_path / "gone"  # removed before the compile ended: never made
    cache = ExecutableCache(folder / ".cache")
    key = CacheKey(module_sha256="ab" * 32, jaxlib_version="0", platform="cpu", platform_version="cpu",
                   device_kind="cpu")
    functions = CompileFunctions(compile=lambda: "executable", serialize=lambda _: b"payload",
                                 deserialize=lambda _: "executable")
    with caplog.at_level("WARNING"):
        assert cache.load_or_compile("model.mlir", key, functions) == "executable"
    assert not folder.exists() and not caplog.records  # (nothing to warn about: the bundle itself is gone)
    folder.mkdir()  # one that is there gets its .cache
    assert cache.load_or_compile("model.mlir", key, functions) == "executable"
    assert (folder / ".cache" / HASHES_FILE).is_file()


# Compiles (stores) programs p<first>..p<first+count-1> of a cache folder, argv: folder first count.
_COMPILES_PROGRAMS = """
import sys
from nereid.backends.xla.cache import CacheKey, CompileFunctions, ExecutableCache
folder, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cache = ExecutableCache(folder)
functions = CompileFunctions(compile=lambda: b"executable", serialize=bytes, deserialize=bytes)
for i in range(first, first + count):
    cache.load_or_compile(f"p{i}", CacheKey(f"{i:064x}", "jaxlib", "cpu", "1", "cpu"), functions)
"""


def test_servers_sharing_a_cache_folder_keep_each_others_notes_of_program_hashes(tmp_path) -> None:
    """Found by the replicas hunt (read, not reproduced then): the record of the programs' hashes was read, changed
    and written back without a lock, so two servers sharing the folder compiling other programs lost each other's
    notes (and the stale entries of a program whose note was lost were never dropped when it changed)."""
    import subprocess
    import sys

    folder = tmp_path / ".cache"
    writers = [subprocess.Popen([sys.executable, "-c", _COMPILES_PROGRAMS, str(folder), str(first), "40"])
               for first in (0, 40, 80, 120)]
    assert [writer.wait(timeout=120) for writer in writers] == [0, 0, 0, 0]
    noted = json.loads((folder / HASHES_FILE).read_text())["modules"]
    assert sorted(noted) == sorted(f"p{i}" for i in range(160)), f"{160 - len(noted)} notes lost"


def test_a_fifo_in_place_of_the_hashes_lock_is_replaced_not_waited_on(tmp_path) -> None:
    """The lock of the record of hashes is the cache's own file: something else there is made again, where opening
    a FIFO would block the load for ever."""
    from nereid.backends.xla.cache import HASHES_LOCK_FILE, CacheKey, CompileFunctions, ExecutableCache

    folder = tmp_path / ".cache"
    folder.mkdir()
    os.mkfifo(folder / HASHES_LOCK_FILE)
    cache = ExecutableCache(folder)
    functions = CompileFunctions(compile=lambda: b"executable", serialize=bytes, deserialize=bytes)
    assert cache.load_or_compile("p", CacheKey("0" * 64, "jaxlib", "cpu", "1", "cpu"), functions) == b"executable"
    assert (folder / HASHES_LOCK_FILE).is_file()
    assert json.loads((folder / HASHES_FILE).read_text())["modules"] == {"p": "0" * 64}


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_cache_path_that_is_no_folder_is_said_once_per_load(tmp_path, add_bundle, caplog, kind) -> None:
    """Carried from a hunt: a .cache that was a file or a FIFO gave four WARNINGs per load of a three-program
    bundle (each entry's "Not a directory", the write's "File exists"), one cause."""
    folder = add_bundle(tmp_path, "mlp_bundle")
    shutil.rmtree(folder / ".cache", ignore_errors=True)
    if kind == "file":
        (folder / ".cache").write_text("not a folder")
    else:
        os.mkfifo(folder / ".cache")
    for _ in range(2):
        caplog.clear()
        assert load(folder, tmp_path).report.cache.compiled == 3
        what = "a regular file" if kind == "file" else "a FIFO"
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
            f"mlp_bundle: cannot use the executable cache {folder / '.cache'} (it is {what}, not a folder); its "
            "programs will be compiled at every load until it is removed"]


def test_a_folder_in_place_of_an_entry_is_replaced_by_the_entry(tmp_path, add_bundle) -> None:
    """Carried from a hunt: a folder at an entry's path was never replaced (the write failed), so its program was
    compiled at every load."""
    folder = add_bundle(tmp_path, "mlp_bundle")
    load(folder, tmp_path)
    [first, *_] = sorted((folder / ".cache").glob("*.xlaexe"))
    first.unlink()
    (first / "inside").mkdir(parents=True)
    assert load(folder, tmp_path).report.cache.rebuilt == 1
    assert first.is_file()
    assert load(folder, tmp_path).report.cache.hits == 3


def test_entries_of_program_files_no_longer_in_the_bundle_are_removed_at_its_load(tmp_path, add_bundle) -> None:
    """Found by the long-life hunt: only a changed program's entries were removed, so a release that dropped a
    batch size or renamed a program left its executables in .cache/ for good (13 entries, 3 used, after six)."""
    folder = add_bundle(tmp_path, "mlp_bundle")
    load(folder, tmp_path)
    cache = folder / ".cache"
    [kept] = sorted(cache.glob("model.b1.mlir.*.xlaexe"))
    (cache / "model.b99.mlir.0123456789abcdef01234567.xlaexe").write_bytes(kept.read_bytes())  # a dropped size's
    notes = json.loads((cache / HASHES_FILE).read_text())
    notes["modules"]["model.b99.mlir"] = "0" * 64
    (cache / HASHES_FILE).write_text(json.dumps(notes))
    assert load(folder, tmp_path).report.cache.hits == 3
    assert sorted(p.name.split(".")[1] for p in cache.glob("*.xlaexe")) == ["b1", "b32", "b8"]
    assert sorted(json.loads((cache / HASHES_FILE).read_text())["modules"]) == [
        "model.b1.mlir", "model.b32.mlir", "model.b8.mlir"]
