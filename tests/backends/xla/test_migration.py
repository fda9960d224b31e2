"""Weights migration: legacy files rewritten in program order, proved, crash-safe, stale copies noticed."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from nereid.backend import ModelContext
from nereid.backends.xla.manifest import load_manifest
from nereid.backends.xla import migration
from nereid.backends.xla.bundle import open_bundle
from nereid.backends.xla.migration import (COPY_FILE, MigrationError, make_copy, migrate_bundle, prove_copy,
                                           weights_to_load)
from nereid.backends.xla.model import XlaModel
from nereid.backends.xla.safetensors import load_weights, read_header, write_safetensors
from nereid.backends.xla.export import examples
from nereid.errors import ConfigError
from nereid.settings import ModelSettings
from nereid.tensors import NamedTensor
from support import wait_until

X = np.random.default_rng(9).standard_normal((3, 16)).astype(np.float32)


def serve_once(folder: Path, tmp_path: Path, **runtime) -> np.ndarray:
    model = XlaModel(ModelContext(folder.name, folder, ModelSettings(folder.name, runtime=runtime), tmp_path, "t"))
    model.load()
    try:
        return model.infer([NamedTensor.from_array("input", X)])[0].data
    finally:
        model.unload()


def test_copy_mode_leaves_the_original_untouched(legacy, tmp_path) -> None:
    original = legacy / "weights.safetensors"
    before_bytes, before_mtime = original.read_bytes(), original.stat().st_mtime_ns
    manifest_before = (legacy / "manifest.yaml").read_text()
    expected = serve_once(legacy, tmp_path)
    assert np.array_equal(serve_once(legacy, tmp_path, weights_migration="copy"), expected)
    assert original.read_bytes() == before_bytes and original.stat().st_mtime_ns == before_mtime
    copy = read_header(legacy / COPY_FILE)
    assert not copy.legacy and copy.metadata["migrated_from_sha256"]
    manifest_after = (legacy / "manifest.yaml").read_text()
    assert manifest_after == manifest_before + "weights_file: weights.T.safetensors\n"  # only that line added
    assert load_manifest(legacy / "manifest.yaml").format_version == "2.0"
    for (n1, a1), (n2, a2) in zip(load_weights(original), load_weights(legacy / COPY_FILE)):
        assert n1 == n2 and a1.tobytes() == a2.tobytes()
    assert migrate_bundle(legacy, "copy").changed is False  # done once


def test_replace_mode_swaps_the_copy_in(legacy, tmp_path) -> None:
    expected = serve_once(legacy, tmp_path)
    arrays = load_weights(legacy / "weights.safetensors")
    assert np.array_equal(serve_once(legacy, tmp_path, weights_migration="replace"), expected)
    assert not (legacy / COPY_FILE).exists()
    assert not read_header(legacy / "weights.safetensors").legacy
    text = (legacy / "manifest.yaml").read_text()
    assert "weights_file" not in text and 'format_version: "2.1"' in text
    assert text.startswith("# hand-written note: keep me\n") and text.endswith("# trailing note\n")
    for (_, a1), (_, a2) in zip(arrays, load_weights(legacy / "weights.safetensors")):
        assert a1.tobytes() == a2.tobytes()
    assert not [p for p in legacy.iterdir() if p.name.startswith(".") and p.name != ".cache"]  # no temporaries


def test_a_replace_keeps_the_weights_file_s_mode_and_a_manifest_s_byte_order_mark(legacy, tmp_path) -> None:
    """Found by the exporter hunt: the swapped-in weights file took the migrator's umask (027: a server of another
    user could not read it), and a manifest saved with a byte-order mark never finished its replace."""
    weights, manifest = legacy / "weights.safetensors", legacy / "manifest.yaml"
    weights.chmod(0o644)
    manifest.write_bytes(b"\xef\xbb\xbf" + manifest.read_bytes())
    previous = os.umask(0o027)
    try:
        outcome = migrate_bundle(legacy, "replace")
    finally:
        os.umask(previous)
    assert outcome.changed, outcome
    assert weights.stat().st_mode & 0o777 == 0o644
    text = manifest.read_bytes()
    assert text.startswith(b"\xef\xbb\xbf") and b'format_version: "2.1"' in text and b"weights_file" not in text
    assert not read_header(weights).legacy


@pytest.mark.parametrize("mode", ["copy", "replace"])
@pytest.mark.parametrize("ends", [b"\r\n", b"\r"], ids=["CRLF", "CR"])
def test_a_manifest_s_line_ends_are_kept(legacy, mode, ends) -> None:
    """Noticed by the stop 56 exporter hunt: a manifest saved with CRLF line ends was written back with "\\n"; the
    review hunt of that fix: one with old Mac's CR alone no longer migrated ("no top-level format_version line")."""
    manifest = legacy / "manifest.yaml"
    manifest.write_bytes(manifest.read_bytes().replace(b"\n", ends))
    assert migrate_bundle(legacy, mode).changed
    text = manifest.read_bytes()
    assert text.count(ends) > 3 and text.replace(ends, b"").count(b"\r") == text.replace(ends, b"").count(b"\n") == 0
    assert (b"weights_file: weights.T.safetensors" + ends in text) == (mode == "copy")
    assert (b'format_version: "2.1"' + ends in text) == (mode == "replace")


def test_a_manifest_with_mixed_line_ends_is_written_with_newlines(legacy) -> None:
    manifest = legacy / "manifest.yaml"
    lines = manifest.read_bytes().split(b"\n")
    manifest.write_bytes(b"\r\n".join(lines[:2]) + b"\r" + b"\n".join(lines[2:]))
    assert migrate_bundle(legacy, "replace").changed
    assert b"\r" not in manifest.read_bytes() and b'format_version: "2.1"\n' in manifest.read_bytes()


def test_a_sharded_bundle_is_left_alone_even_beside_a_legacy_weights_file(legacy, tmp_path) -> None:
    # The index picks the shards; a leftover legacy weights.safetensors (zeros here) must not be
    # migrated, since the copy's weights_file line would then win over the index.
    arrays = load_weights(legacy / "weights.safetensors")
    write_safetensors(legacy / "shard.safetensors", arrays)
    (legacy / "weights.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: "shard.safetensors" for name, _ in arrays}}))
    write_safetensors(legacy / "weights.safetensors", [(n, np.zeros_like(a)) for n, a in arrays], legacy=True)
    manifest_before = (legacy / "manifest.yaml").read_text()
    expected = serve_once(legacy, tmp_path)
    assert expected.any()  # the shard's weights, not the zeros
    for mode in ("copy", "replace"):
        assert np.array_equal(serve_once(legacy, tmp_path, weights_migration=mode), expected)
        outcome = migrate_bundle(legacy, mode)
        assert not outcome.changed and outcome.what == "a sharded bundle (weights.safetensors.index.json); left alone"
    assert not (legacy / COPY_FILE).exists() and (legacy / "manifest.yaml").read_text() == manifest_before


def test_a_copy_then_replace_resumes_from_the_copy(legacy) -> None:
    assert migrate_bundle(legacy, "copy").what == f"wrote {COPY_FILE}"
    outcome = migrate_bundle(legacy, "replace")
    assert outcome.changed and "swapped in" in outcome.what
    assert not (legacy / COPY_FILE).exists()


def test_an_interrupted_replace_still_loads_and_is_finished(legacy, tmp_path) -> None:
    expected = serve_once(legacy, tmp_path)
    migrate_bundle(legacy, "copy")
    # Stop the replace right after the swap: the copy is under both names, the manifest still names the copy.
    os.link(legacy / COPY_FILE, legacy / ".swap")
    os.replace(legacy / ".swap", legacy / "weights.safetensors")
    assert np.array_equal(serve_once(legacy, tmp_path), expected)  # migration off: loads as it stands
    outcome = migrate_bundle(legacy, "replace")
    assert outcome.what == "finished an interrupted replace"
    assert not (legacy / COPY_FILE).exists() and "weights_file" not in (legacy / "manifest.yaml").read_text()
    assert np.array_equal(serve_once(legacy, tmp_path), expected)


def test_a_load_beside_another_servers_replace_reads_the_legacy_file_whole(legacy, tmp_path, monkeypatch) -> None:
    """Found by the replicas hunt: server B (migration off) read the legacy file's header, server A's replace
    swapped the migrated file in, and B read the data at the legacy header's offsets from the new file (a
    longer header): answers off by ~1e37, served 200 OK until B's next load. The replace runs here at that
    very point, between B's header read and its data read."""
    from nereid.backends.xla import model as model_module

    expected = serve_once(legacy, tmp_path)
    read_local_weights = model_module.read_local_weights
    outcomes = []

    def after_another_servers_replace(folder, weight_set, **options):
        outcomes.append(migrate_bundle(legacy, "replace"))
        return read_local_weights(folder, weight_set, **options)

    monkeypatch.setattr(model_module, "read_local_weights", after_another_servers_replace)
    served = serve_once(legacy, tmp_path)  # (B's own migration is off)
    assert [o.changed for o in outcomes] == [True] and not read_header(legacy / "weights.safetensors").legacy
    assert np.array_equal(served, expected)
    monkeypatch.undo()
    assert np.array_equal(serve_once(legacy, tmp_path), expected)  # B's next load: the migrated file, whole

def test_a_load_whose_manifest_named_the_copy_a_replace_then_removed_reads_the_manifest_again(
        legacy, tmp_path, monkeypatch, caplog) -> None:
    """Server B read the manifest naming weights.T.safetensors (server A's copy step), then A's replace swapped
    the copy in and removed it: B's load failed ('cannot read: No such file'); now it reads the manifest again."""
    expected = serve_once(legacy, tmp_path)
    migrate_bundle(legacy, "copy")
    weights_to_load_ = migration.weights_to_load
    outcomes = []

    def after_another_servers_replace(layout):
        if not outcomes:
            outcomes.append(migrate_bundle(legacy, "replace"))
        return weights_to_load_(layout)

    monkeypatch.setattr(migration, "weights_to_load", after_another_servers_replace)
    with caplog.at_level(logging.INFO, logger="nereid.backends.xla.migration"):
        served = serve_once(legacy, tmp_path)  # (B's own migration is off)
    assert outcomes[0].changed and not (legacy / COPY_FILE).exists()
    assert np.array_equal(served, expected)
    assert "manifest.yaml changed while the bundle was read" in caplog.text


def test_a_load_that_fails_with_its_manifest_unchanged_is_not_tried_again(legacy, tmp_path, monkeypatch) -> None:
    migrate_bundle(legacy, "copy")
    (legacy / COPY_FILE).unlink()
    reads = []
    open_bundle_ = migration.open_bundle
    monkeypatch.setattr(migration, "open_bundle", lambda *args: reads.append(args) or open_bundle_(*args))
    with pytest.raises(ConfigError, match=rf"manifest.yaml: weights_file: no such file .*{COPY_FILE}"):
        serve_once(legacy, tmp_path)
    assert len(reads) == 1  # a bundle that is wrong as it stands is read once, as before

def test_a_stale_copy_is_noticed_and_rebuilt(legacy, tmp_path, caplog) -> None:
    migrate_bundle(legacy, "copy")
    redeployed = [(n, a * 2) for n, a in load_weights(legacy / "weights.safetensors")]
    write_safetensors(legacy / "weights.safetensors", redeployed, legacy=True)
    w1, b1, w2, b2 = (a for _, a in redeployed)
    expected = np.maximum(X @ w1 + b1, 0) @ w2 + b2
    with caplog.at_level(logging.WARNING):
        served = serve_once(legacy, tmp_path)  # migration off: the original, not the stale copy
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)
    assert "was made from an earlier weights.safetensors" in caplog.text
    assert migrate_bundle(legacy, "copy").what == f"rebuilt the stale {COPY_FILE}"
    np.testing.assert_allclose(serve_once(legacy, tmp_path), expected, rtol=1e-5, atol=1e-5)
    assert [a.tobytes() for _, a in load_weights(legacy / COPY_FILE)] == [a.tobytes() for _, a in redeployed]


def _mlp(weights: list[tuple[str, np.ndarray]]) -> np.ndarray:
    w1, b1, w2, b2 = (a for _, a in weights)
    return np.maximum(X @ w1 + b1, 0) @ w2 + b2


def test_a_redeploy_with_the_same_size_and_mtime_is_noticed(legacy, tmp_path, caplog) -> None:
    """cp -p, rsync -a, tar and reproducible builds redeploy new weights of the same size with the same mtime:
    the old copy was served, since only a changed size or mtime led to the recorded SHA-256 being compared."""
    original = legacy / "weights.safetensors"
    os.utime(original, ns=(1_700_000_000 * 10 ** 9, 1_700_000_000 * 10 ** 9))
    migrate_bundle(legacy, "copy")
    redeployed = [(n, a * 1000) for n, a in load_weights(original)]
    write_safetensors(legacy / "new.tmp", redeployed, legacy=True)
    os.replace(legacy / "new.tmp", original)
    os.utime(original, ns=(1_700_000_000 * 10 ** 9, 1_700_000_000 * 10 ** 9))
    with caplog.at_level(logging.WARNING):
        served = serve_once(legacy, tmp_path)  # migration off: the original, not the stale copy
    np.testing.assert_allclose(served, _mlp(redeployed), rtol=1e-5)
    assert "was made from an earlier weights.safetensors" in caplog.text
    assert migrate_bundle(legacy, "copy").what == f"rebuilt the stale {COPY_FILE}"
    np.testing.assert_allclose(serve_once(legacy, tmp_path), _mlp(redeployed), rtol=1e-5)


def test_an_unchanged_original_is_hashed_only_when_its_stat_changed(legacy, tmp_path, monkeypatch) -> None:
    migrate_bundle(legacy, "copy")
    copied = legacy.parent / "copied"
    shutil.copytree(legacy, copied)  # same bytes and mtime; a new inode and ctime: hashed, found unchanged
    assert weights_to_load(open_bundle(copied)) == copied / COPY_FILE
    assert migrate_bundle(copied, "copy").what == f"{COPY_FILE} is up to date"

    def unexpected(fd):
        raise AssertionError("the original was hashed although nothing about it changed")

    monkeypatch.setattr(migration, "_stamp", unexpected)
    assert weights_to_load(open_bundle(legacy)) == legacy / COPY_FILE
    assert migrate_bundle(legacy, "copy").what == f"{COPY_FILE} is up to date"


def test_a_copy_that_records_no_ctime_or_inode_is_still_checked_and_swapped(legacy, tmp_path) -> None:
    """A copy an earlier nereid made records the original's size, mtime and SHA-256 only."""
    expected = serve_once(legacy, tmp_path)
    migrate_bundle(legacy, "copy")
    metadata = {k: v for k, v in read_header(legacy / COPY_FILE).metadata.items()
                if k not in (migration.FROM_CTIME, migration.FROM_INODE)}
    write_safetensors(legacy / COPY_FILE, load_weights(legacy / COPY_FILE), metadata=metadata)
    assert migrate_bundle(legacy, "copy").what == f"{COPY_FILE} is up to date"  # by its hash
    assert "swapped in" in migrate_bundle(legacy, "replace").what
    assert np.array_equal(serve_once(legacy, tmp_path), expected)


@pytest.mark.parametrize("end", ["...\n", "...\n# after the end\n\n", "... # the end"])
def test_a_manifest_ending_with_a_document_end_marker_gets_its_line_before_it(legacy, tmp_path, end) -> None:
    """The line was appended after '...', the edit did not parse, and every load wrote the whole copy again."""
    expected = serve_once(legacy, tmp_path)
    manifest = legacy / "manifest.yaml"
    before = manifest.read_text() + end
    manifest.write_text(before)
    outcome = migrate_bundle(legacy, "copy")
    assert outcome.what == f"wrote {COPY_FILE}"
    assert manifest.read_text() == before.replace("...", "weights_file: weights.T.safetensors\n...")
    assert migrate_bundle(legacy, "copy").changed is False
    assert np.array_equal(serve_once(legacy, tmp_path, weights_migration="replace"), expected)
    assert manifest.read_text().endswith(end) and 'format_version: "2.1"' in manifest.read_text()


def test_a_manifest_with_indented_top_level_keys_is_edited_at_their_indentation(legacy, tmp_path) -> None:
    expected = serve_once(legacy, tmp_path)
    manifest = legacy / "manifest.yaml"
    manifest.write_text("".join(f"  {line}" if line.strip() else line
                                for line in manifest.read_text().splitlines(keepends=True)))
    assert np.array_equal(serve_once(legacy, tmp_path, weights_migration="copy"), expected)
    assert "\n  weights_file: weights.T.safetensors\n" in manifest.read_text()
    assert np.array_equal(serve_once(legacy, tmp_path, weights_migration="replace"), expected)
    text = manifest.read_text()
    assert '\n  format_version: "2.1"' in text and "weights_file" not in text
    assert not read_header(legacy / "weights.safetensors").legacy


def test_a_proved_copy_is_kept_when_only_the_manifest_edit_is_left_to_do(legacy) -> None:
    """A run that wrote the copy but could not edit the manifest: the next one wrote the whole copy again."""
    make_copy(legacy / "weights.safetensors", legacy / COPY_FILE)
    written = (legacy / COPY_FILE).stat()
    outcome = migrate_bundle(legacy, "copy")
    assert outcome.changed and outcome.what == f"kept the up-to-date {COPY_FILE}"
    now = (legacy / COPY_FILE).stat()
    assert (now.st_ino, now.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    assert load_manifest(legacy / "manifest.yaml").weights_file == COPY_FILE
    # A migration's copy under the copy's name that is not a copy of the original as it is now is written anew.
    (legacy / "manifest.yaml").write_text((legacy / "manifest.yaml").read_text().replace(
        "weights_file: weights.T.safetensors\n", ""))
    elsewhere = legacy.parent / "other-weights.safetensors"
    shutil.copy(legacy / "weights.safetensors", elsewhere)
    with open(elsewhere, "r+b") as changed:  # another original: the last byte of its last tensor changed
        changed.seek(-1, os.SEEK_END)
        last = changed.read(1)
        changed.seek(-1, os.SEEK_END)
        changed.write(bytes([last[0] ^ 1]))
    (legacy / COPY_FILE).unlink()
    make_copy(elsewhere, legacy / COPY_FILE)
    assert migrate_bundle(legacy, "copy").what == f"wrote {COPY_FILE}"


def test_a_file_of_someone_s_own_under_the_copy_s_name_is_left_alone(legacy, tmp_path, caplog) -> None:
    """Noticed by the stop 56 exporter hunt: a hand-made weights.T.safetensors that the manifest does not name was
    overwritten by the migration's copy, and lost. (Said at a load, the review hunt of that fix: silent before.)"""
    own = [(n, a + 1) for n, a in load_weights(legacy / "weights.safetensors")]
    write_safetensors(legacy / COPY_FILE, own)
    manifest = (legacy / "manifest.yaml").read_text()
    for mode in ("copy", "replace"):
        outcome = migrate_bundle(legacy, mode)
        assert (outcome.changed, outcome.what) == (False, f"{COPY_FILE} is there and is no migration's copy (its "
                                                          "metadata holds no source): left alone, and the weights "
                                                          "too; move it away to migrate")
    assert [a.tobytes() for _, a in load_weights(legacy / COPY_FILE)] == [a.tobytes() for _, a in own]
    assert (legacy / "manifest.yaml").read_text() == manifest
    (legacy / COPY_FILE).unlink()  # a link to the original (the review hunt: taken for a replace's, and removed)
    (legacy / COPY_FILE).symlink_to("weights.safetensors")
    assert migrate_bundle(legacy, "replace").what.startswith(f"{COPY_FILE} is there and is no migration's copy")
    assert (legacy / COPY_FILE).is_symlink() and read_header(legacy / "weights.safetensors").legacy
    (legacy / COPY_FILE).unlink()
    (legacy / COPY_FILE).write_bytes(b"notes")  # no safetensors file at all
    assert migrate_bundle(legacy, "copy").what.startswith(f"{COPY_FILE} is there and is no safetensors file a "
                                                          "migration wrote: left alone")
    assert (legacy / COPY_FILE).read_bytes() == b"notes"
    # The bundle loads from its own weights meanwhile, as without the migration, saying why it is not migrated.
    with caplog.at_level(logging.WARNING):
        assert np.array_equal(serve_once(legacy, tmp_path, weights_migration="replace"), serve_once(legacy, tmp_path))
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"model '{legacy.name}': weights migration (replace): {COPY_FILE} is there and is no safetensors file a "
        "migration wrote: left alone, and the weights too; move it away to migrate"]


def test_a_copy_whose_original_was_redeployed_in_program_order_is_removed(legacy, tmp_path, caplog) -> None:
    """The copy and its weights_file line stayed for good, and every load logged that the migration failed."""
    manifest_before = (legacy / "manifest.yaml").read_text()
    migrate_bundle(legacy, "copy")
    redeployed = [(n, a * 100) for n, a in load_weights(legacy / "weights.safetensors")]
    write_safetensors(legacy / "weights.safetensors", redeployed)  # axis_order: xla
    with caplog.at_level(logging.INFO):
        served = serve_once(legacy, tmp_path, weights_migration="copy")
    np.testing.assert_allclose(served, _mlp(redeployed), rtol=1e-5)
    assert (f"removed the stale {COPY_FILE}: weights.safetensors is already in the program's axis order"
            in caplog.text)
    assert "did not run" not in caplog.text
    assert not (legacy / COPY_FILE).exists() and (legacy / "manifest.yaml").read_text() == manifest_before
    assert migrate_bundle(legacy, "replace").what == "weights already in the program's axis order"


def test_a_legacy_bundle_whose_manifest_names_its_own_weights_file_is_migrated(legacy, tmp_path) -> None:
    """weights_file: weights.safetensors names the original: it was called 'not a migration copy' and left."""
    expected = serve_once(legacy, tmp_path)
    manifest = legacy / "manifest.yaml"
    before = manifest.read_text().replace("# trailing note\n", "weights_file: weights.safetensors\n# trailing note\n")
    manifest.write_text(before)
    assert migrate_bundle(legacy, "copy").what == f"wrote {COPY_FILE}"
    assert manifest.read_text() == before.replace("weights.safetensors", COPY_FILE)
    assert np.array_equal(serve_once(legacy, tmp_path), expected)
    assert "swapped in" in migrate_bundle(legacy, "replace").what
    assert not read_header(legacy / "weights.safetensors").legacy
    assert np.array_equal(serve_once(legacy, tmp_path), expected)


def test_a_copy_that_differs_is_refused(legacy) -> None:
    original = legacy / "weights.safetensors"
    make_copy(original, legacy / COPY_FILE)
    data = bytearray((legacy / COPY_FILE).read_bytes())
    data[-1] ^= 0x01
    (legacy / "bad.safetensors").write_bytes(bytes(data))
    fd = os.open(original, os.O_RDONLY)
    try:
        prove_copy(fd, original, legacy / COPY_FILE)
        with pytest.raises(MigrationError, match="tensor 'b2' differs from the original"):
            prove_copy(fd, original, legacy / "bad.safetensors")
        with pytest.raises(MigrationError, match="records the original as"):
            write_safetensors(legacy / "other.safetensors", load_weights(original))
            prove_copy(fd, original, legacy / "other.safetensors")
    finally:
        os.close(fd)


def test_a_migration_that_cannot_run_leaves_the_bundle_loading(legacy, tmp_path, caplog) -> None:
    (legacy / ".cache").write_text("not a folder: the migration lock cannot be taken")
    expected = np.asarray(examples.mlp(X, *examples.mlp_weights().values()))
    with caplog.at_level(logging.ERROR):
        served = serve_once(legacy, tmp_path, weights_migration="replace", executable_cache=False)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)
    assert "weights migration (replace) did not run" in caplog.text
    assert read_header(legacy / "weights.safetensors").legacy and not (legacy / COPY_FILE).exists()


def test_bad_option_value(legacy, tmp_path) -> None:
    from nereid.errors import ConfigError

    with pytest.raises(ConfigError, match=r"runtime.weights_migration: must be one of off, copy, replace, got 'y'"):
        serve_once(legacy, tmp_path, weights_migration="y")
    assert serve_once(legacy, tmp_path, weights_migration=False).shape == (3, 4)  # YAML's bare `off`


def test_an_unforeseen_migration_failure_is_logged_and_the_bundle_loads(legacy, tmp_path, caplog,
                                                                        monkeypatch) -> None:
    from nereid.backends.xla import migration

    def unforeseen(folder, mode):
        raise ValueError("unforeseen")

    monkeypatch.setattr(migration, "migrate_bundle", unforeseen)
    expected = np.asarray(examples.mlp(X, *examples.mlp_weights().values()))
    with caplog.at_level(logging.ERROR):
        served = serve_once(legacy, tmp_path, weights_migration="copy", executable_cache=False)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)
    assert "weights migration (copy) did not run: ValueError: unforeseen; the bundle loads as it is" in caplog.text


def test_in_dynamic_mode_the_migrations_own_writes_load_nothing_a_second_time(repo, serve, add_bundle):
    """The migration's copy and manifest line were seen as an edit of the folder: the model loaded a second
    time once they settled (for a large bundle, its weights read twice)."""
    folder = add_bundle(repo.models_dir, "mlp_legacy")
    server = serve(repo.write_config("- name: mlp_legacy\n  runtime: {weights_migration: copy}\n",
                                     server_extra="  watch: true\n  watch_settle_ms: 100\n"))
    assert (folder / COPY_FILE).is_file() and server.client.is_model_ready("mlp_legacy")
    repository = server.server.repository
    time.sleep(1.5)  # fifteen settle times: the watcher has seen the writes and acted on them
    assert repository.generation("mlp_legacy") == 1
    # An edit of the folder after the load is still a change to load.
    manifest = folder / "manifest.yaml"
    manifest.write_text(manifest.read_text() + "# edited\n")
    assert wait_until(lambda: repository.generation("mlp_legacy") == 2)
    assert server.client.is_model_ready("mlp_legacy")


def test_in_dynamic_mode_an_edit_made_while_the_migration_runs_is_still_loaded(repo, serve, add_bundle,
                                                                                 monkeypatch):
    """Found by the review of this session's diff: the folder's stamp taken after the migration's writes took in
    an operator's edit made meanwhile, so the version kept serving the old files while the watcher thought it
    had them."""
    from nereid.backends.xla import model as xla_model

    folder = add_bundle(repo.models_dir, "mlp_legacy")
    real = xla_model.migrate_for_load

    def migrating_during_an_edit(*args, **kwargs):
        changed = real(*args, **kwargs)
        (folder / "NOTES.txt").write_text("an operator's edit, landed during the load\n")
        return changed
    monkeypatch.setattr(xla_model, "migrate_for_load", migrating_during_an_edit)
    server = serve(repo.write_config("- name: mlp_legacy\n  runtime: {weights_migration: copy}\n",
                                     server_extra="  watch: true\n  watch_settle_ms: 100\n"))
    assert wait_until(lambda: server.server.repository.generation("mlp_legacy") >= 2)  # loaded again for the edit
