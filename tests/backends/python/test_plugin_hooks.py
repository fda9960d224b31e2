"""backends/python/plugin.py's hooks on their own: which folders the python backend claims, and its check of
nereid.yaml's ``backends.python`` (test_plugin.py serves its models end to end)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nereid.backends.python import plugin
from nereid.errors import ConfigError


@pytest.mark.parametrize("main_py", ["file", "fifo", "folder", "dangling link"])
def test_a_folder_holding_main_py_in_any_form_is_claimed(tmp_path: Path, main_py: str) -> None:
    """A FIFO or a folder named main.py is claimed too, so that the load names what it is."""
    entry = tmp_path / "main.py"
    if main_py == "file":
        entry.write_text("")
    elif main_py == "fifo":
        os.mkfifo(entry)
    elif main_py == "folder":
        entry.mkdir()
    else:
        entry.symlink_to(tmp_path / "nowhere.py")
    assert plugin.nereid_claim_model(tmp_path, declared=False).create is plugin.PythonModel


def test_a_folder_without_main_py_is_claimed_only_when_declared(tmp_path: Path) -> None:
    (tmp_path / "main.cpp").write_text("int main() {}\n")
    assert plugin.nereid_claim_model(tmp_path, declared=False) is None
    assert plugin.nereid_claim_model(tmp_path, declared=True).create is plugin.PythonModel
    assert plugin.nereid_claim_signs() == "main.py"


@pytest.mark.parametrize("defaults,message", [
    # (The error hunt: the likely key was said for every other unknown key, not for a runtime option.)
    ({"warm_sart": True}, "nereid.yaml: backends.python.warm_sart: unknown option of the python backend (allowed: "
                          "preload, warm_start; did you mean 'warm_start'?), got true"),
    ({"zzz": True}, "nereid.yaml: backends.python.zzz: unknown option of the python backend (allowed: "
                    "preload, warm_start), got true"),
    ({"warm_start": "yes"}, "nereid.yaml: backends.python.warm_start: must be true or false, got 'yes'"),
], ids=["typo", "unknown", "not a boolean"])
def test_a_mistake_in_backends_python_is_refused_naming_where_it_is(defaults: dict, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        plugin.nereid_check_defaults(defaults, "nereid.yaml: backends.python")
    assert str(refused.value) == message


def test_backends_python_as_documented_is_accepted() -> None:
    plugin.nereid_check_defaults({"warm_start": False, "preload": ["numpy"]}, "nereid.yaml: backends.python")

