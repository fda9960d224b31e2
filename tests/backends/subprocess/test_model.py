"""SubprocessModel on its own (no server): where its runs start, and the folder descriptors it holds."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from nereid.backend import ModelContext
from nereid.settings import ModelSettings
from nereid.tensors import NamedTensor

from nereid.backends.subprocess.model import MAX_FOLDER_FDS, SubprocessModel

from support import textproto_single

# Echoes its input as the output tensor and appends where it ran to ran.txt in its folder.
ECHO_SH = """pwd -P >> ran.txt
{ printf '%s %s\\n' "$NEREID_INPUT_DTYPE" "$NEREID_INPUT_SHAPE"; cat; } > "$NEREID_OUTPUT_PATH"
"""


class ShellModel(SubprocessModel):
    """``main.sh`` run by /bin/sh: the smallest program that speaks the contract."""

    entry_file = "main.sh"

    def command(self) -> list[str]:
        return ["/bin/sh", self.entry_file]


def loaded(tmp_path: Path, name: str = "shell") -> ShellModel:
    folder = tmp_path / "models" / name
    folder.mkdir(parents=True)
    (folder / "model_inference.textproto").write_text(textproto_single())
    (folder / "main.sh").write_text(ECHO_SH)
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    model = ShellModel(ModelContext(name, folder, ModelSettings(name), scratch))
    model.load()
    return model


def echo(model: ShellModel) -> np.ndarray:
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    [output] = model.infer([NamedTensor.from_array("input", x)])
    np.testing.assert_array_equal(output.data, x)
    return output.data


def test_runs_start_in_the_model_folder(tmp_path) -> None:
    model = loaded(tmp_path)
    try:
        echo(model)
        assert (model.context.folder / "ran.txt").read_text().splitlines() == [str(model.context.folder.resolve())]
    finally:
        model.unload()


def test_a_run_after_its_folder_was_renamed_starts_in_the_renamed_folder(tmp_path) -> None:
    model = loaded(tmp_path)
    try:
        moved = model.context.folder.with_name("moved")
        model.context.folder.rename(moved)  # before the server has relocated the model
        echo(model)
        assert (moved / "ran.txt").read_text().splitlines() == [str(moved.resolve())]
    finally:
        model.unload()


def test_each_rename_holds_one_more_descriptor_and_unload_closes_them_all(tmp_path) -> None:
    model = loaded(tmp_path)
    first = model.context.folder
    moved = first.with_name("moved")
    first.rename(moved)
    model.relocate(ModelContext("moved", moved, ModelSettings("moved"), model.context.scratch_dir))
    fds = list(model._folder_fds)
    assert len(fds) == 2 and all(os.path.samefile(f"/proc/self/fd/{fd}", moved) for fd in fds)
    echo(model)
    model.unload()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert model.run_folder() == str(moved)  # nothing held any more: the path itself


def test_a_model_renamed_again_and_again_keeps_a_bounded_number_of_descriptors(tmp_path) -> None:
    model = loaded(tmp_path)
    try:
        for index in range(MAX_FOLDER_FDS + 5):
            moved = model.context.folder.with_name(f"name{index}")
            model.context.folder.rename(moved)
            model.relocate(ModelContext(moved.name, moved, ModelSettings(moved.name), model.context.scratch_dir))
        assert len(model._folder_fds) == MAX_FOLDER_FDS
        echo(model)
        assert (moved / "ran.txt").read_text().splitlines() == [str(moved.resolve())]
    finally:
        model.unload()
