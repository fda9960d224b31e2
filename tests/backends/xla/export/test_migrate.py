"""``python -m nereid.backends.xla.export.migrate``: the offline weights migration, one line per bundle."""

from __future__ import annotations

import json
from pathlib import Path

from nereid.backends.xla.migration import COPY_FILE, migrate_bundle


def test_offline_tool(legacy, tmp_path, capsys) -> None:
    from nereid.backends.xla.export.migrate import main

    assert main(["--mode", "replace", str(legacy), str(tmp_path / "absent")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{legacy}: wrote {COPY_FILE}, swapped in as weights.safetensors"
    assert lines[1].startswith(f"{tmp_path / 'absent'}: FAILED:")
    assert main([str(legacy)]) == 0
    assert capsys.readouterr().out.strip() == f"{legacy}: weights already in the program's axis order"


def test_offline_tool_writes_nothing_into_what_is_no_bundle_and_names_what_it_is(tmp_path, capsys) -> None:
    """Found by the config hunt: the tool took its lock in <folder>/.cache/ before reading the bundle, so a python
    model's folder got a .cache/ it never had, and a missing path or a file was named as '<path>/.cache'."""
    from nereid.backends.xla.export.migrate import main

    python_model = tmp_path / "py"
    python_model.mkdir()
    (python_model / "main.py").write_text("")
    (tmp_path / "file.py").write_text("")
    assert main([str(python_model), str(tmp_path / "absent"), str(tmp_path / "file.py")]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{python_model}: FAILED: {python_model}: missing manifest.yaml (a bundle holds manifest.yaml, model*.mlir "
        "and usually weights.safetensors)",
        f"{tmp_path / 'absent'}: FAILED: {tmp_path / 'absent'}: no such file or folder",
        f"{tmp_path / 'file.py'}: FAILED: {tmp_path / 'file.py'}: is a file, not a folder: name a bundle's folder"]
    assert sorted(p.name for p in python_model.iterdir()) == ["main.py"]
    assert not (tmp_path / "absent").exists()


def _add_empty_tensor(path: Path, shape: list[int]) -> None:
    """Give a safetensors file one more tensor, of zero elements, at the end of its data."""
    length = int.from_bytes(path.read_bytes()[:8], "little")
    raw = path.read_bytes()
    header, data = json.loads(raw[8:8 + length]), raw[8 + length:]
    header["z"] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data)]}
    metadata = header["__metadata__"]
    metadata["argument_order"] = json.dumps([*json.loads(metadata["argument_order"]), "z"])
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


def test_offline_tool_names_a_tensor_numpy_cannot_hold_and_goes_on(legacy, tmp_path, add_bundle, capsys) -> None:
    """An empty tensor with a dimension of 2**64-1 (the safetensors library accepts it) ended the tool in a
    traceback, a bare ValueError from numpy, and the bundles after it were never migrated."""
    from nereid.backends.xla.export.migrate import main

    _add_empty_tensor(legacy / "weights.safetensors", [0, 2 ** 64 - 1])
    after = add_bundle(tmp_path, "mlp_legacy", as_name="after")
    assert main([str(legacy), str(after)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{legacy}: FAILED: {legacy / 'weights.safetensors'}: z.shape: F32 "
                               f"[0, {2 ** 64 - 1}] is past what nereid can hold")
    assert lines[1] == f"{after}: wrote {COPY_FILE}"


def test_offline_tool_reports_any_failure_on_its_line_and_goes_on(legacy, tmp_path, add_bundle, capsys,
                                                                   monkeypatch) -> None:
    from nereid.backends.xla.export import migrate

    def failing_first(folder, mode):
        if Path(folder) == legacy:
            raise ValueError("unforeseen\nacross lines")
        return migrate_bundle(folder, mode)

    monkeypatch.setattr(migrate, "migrate_bundle", failing_first)
    after = add_bundle(tmp_path, "mlp_legacy", as_name="after")
    assert migrate.main([str(legacy), str(after)]) == 1
    assert capsys.readouterr().out.splitlines() == [f"{legacy}: FAILED: ValueError: unforeseen across lines",
                                                    f"{after}: wrote {COPY_FILE}"]


def test_offline_tool_removes_a_killed_migration_s_temporary_file(legacy, capsys) -> None:
    """Found by the exporter hunt: a migrate killed mid-copy left its weights-sized temporary file, which only a
    server's load removed: a bundle migrated ahead of a deploy shipped it."""
    import os
    import time

    from nereid.backends.xla.export.migrate import main

    left = legacy / f".{COPY_FILE}.0a1b2c3d.{2**22 + 12345}.partial"  # (a pid no process has)
    left.write_bytes(b"x" * 1024)
    old = time.time() - 3600
    os.utime(left, (old, old))
    assert main([str(legacy)]) == 0
    assert not left.exists()


def test_offline_tool_exits_1_for_a_bundle_a_file_of_the_user_s_keeps_from_migrating(legacy, capsys) -> None:
    """The review hunt of fdd200e: a weights.T.safetensors of the user's own, left alone, exited 0 as if migrated."""
    from nereid.backends.xla.export.migrate import main

    (legacy / COPY_FILE).write_bytes(b"notes")
    assert main(["--mode", "replace", str(legacy)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{legacy}: {COPY_FILE} is there and is no safetensors file a migration wrote: left alone, and the weights "
        "too; move it away to migrate"]
