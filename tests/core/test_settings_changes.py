"""What an edited nereid.yaml asks of each model, decided from the two settings and the model's state alone."""

from __future__ import annotations

from pathlib import Path

import yaml

from nereid.settings import Settings, parse_settings
from nereid.settings_changes import changed_backends, settings_step


def settings(tmp_path: Path, document: str, file_name: str = "nereid.yaml") -> Settings:
    for name in ("a", "b"):  # (a listed model's folder must be there without dynamic mode)
        (tmp_path / "ml-backends" / name).mkdir(parents=True, exist_ok=True)
    return parse_settings(yaml.safe_load(document), tmp_path / file_name)


def step(name: str, old: Settings, new: Settings, loaded_backend: str | None = None,
         asked_for: bool = True, options_changed: bool = True) -> tuple[str, str] | None:
    found = settings_step(name, old, new, old.model_or_default(name)[0], loaded_backend, asked_for,
                          changed_backends(old, new), options_changed)
    return None if found is None else (found.action, found.why)


def test_listing_and_unlisting_load_and_unload(tmp_path: Path) -> None:
    one = settings(tmp_path, "models:\n  - name: a\n")
    two = settings(tmp_path, "models:\n  - name: a\n  - name: b\n")
    assert step("b", one, two) == ("load", " is now listed in nereid.yaml; loading it")
    assert step("b", two, one, loaded_backend="python") == ("unload", " is no longer listed in nereid.yaml; "
                                                                      "unloading it")
    assert step("a", one, two, loaded_backend="python") is None  # its entry is as it was
    # Found by a bug hunt: one never loaded (listed before its folder, or its load failed) was "unloading it".
    assert step("b", two, one) == ("unload", " is no longer listed in nereid.yaml; no longer served (it was not "
                                             "loaded)")


def test_a_changed_entry_reloads_a_loaded_model_and_loads_one_that_is_not(tmp_path: Path) -> None:
    before = settings(tmp_path, "models:\n  - name: a\n")
    after = settings(tmp_path, "models:\n  - name: a\n    queue_capacity: 7\n")
    assert step("a", before, after, loaded_backend="python") == (
        "reload", ": its settings in nereid.yaml changed; reloading it")
    assert step("a", before, after) == ("load", ": its settings in nereid.yaml changed; loading it")  # a fix


def test_changed_backend_defaults_reload_that_backends_models_and_retry_failed_ones(tmp_path: Path) -> None:
    before = settings(tmp_path, "models:\n  - name: a\n")
    after = settings(tmp_path, "backends:\n  python:\n    warm_start: false\nmodels:\n  - name: a\n")
    assert changed_backends(before, after) == {"python"}
    assert step("a", before, after, loaded_backend="python") == (
        "reload", ": nereid.yaml's backends.python defaults change its options; reloading it")
    assert step("a", before, after, loaded_backend="cpp") is None
    assert step("a", before, after) == ("load", ": nereid.yaml's backends: defaults changed; loading it again")
    assert step("a", before, after, asked_for=False) is None  # unloaded on purpose, or its folder not there


def test_adding_or_removing_the_models_key_serves_what_a_restart_would(tmp_path: Path) -> None:
    """Defect (found by a bug hunt): a `models:` key added while serving left unlisted folders serving, and one
    removed left them unloaded ("not listed"), though with no key every folder is served."""
    every_folder = settings(tmp_path, "server: {}\n")
    only_a = settings(tmp_path, "models:\n  - name: a\n")
    assert step("b", every_folder, only_a, loaded_backend="python") == (
        "unload", ": nereid.yaml now lists the models to serve (models:), and not this one; unloading it")
    assert step("b", only_a, every_folder) == (
        "load", ": nereid.yaml no longer lists the models to serve (no models:), so every folder is served; "
                "loading it")
    # (served either way, its settings as they were)
    assert step("a", every_folder, only_a, loaded_backend="python") is None
    assert step("a", only_a, every_folder, loaded_backend="python") is None
    # (review: never loaded, or unloaded on purpose: nothing to do)
    assert step("b", every_folder, only_a, asked_for=False) is None
    # Found by a helper: one asked for whose load failed stayed wanted, and its fixed files then loaded.
    assert step("b", every_folder, only_a) == (
        "unload", ": nereid.yaml now lists the models to serve (models:), and not this one; no longer served (it "
                  "was not loaded)")


def test_an_empty_backends_section_changes_no_backend(tmp_path: Path) -> None:
    """Defect (found by a bug hunt): adding `backends: {python: {}}` reloaded every python model."""
    before = settings(tmp_path, "models:\n  - name: a\n")
    after = settings(tmp_path, "backends:\n  python: {}\nmodels:\n  - name: a\n")
    assert changed_backends(before, after) == changed_backends(after, before) == set()
    assert step("a", before, after, loaded_backend="python") is None


def test_changed_backend_defaults_reload_only_a_model_whose_options_they_change(tmp_path: Path) -> None:
    """The scale hunt: `backends: {python: {warm_start: true}}` (the default written out) reloaded every python
    model, 300 reloads for an edit that changed no model's options."""
    before = settings(tmp_path, "models:\n  - name: a\n")
    after = settings(tmp_path, "backends:\n  python:\n    warm_start: true\nmodels:\n  - name: a\n")
    assert step("a", before, after, loaded_backend="python", options_changed=False) is None
    # (Its own entry changed too: reloaded for that, whatever the defaults do.)
    edited = settings(tmp_path, "backends:\n  python:\n    warm_start: true\nmodels:\n  - name: a\n"
                                "    queue_capacity: 7\n")
    assert step("a", before, edited, loaded_backend="python", options_changed=False) == (
        "reload", ": its settings in nereid.yaml changed; reloading it")
    # (One whose last load failed is loaded again, as before: which backend claims it is not known.)
    assert step("a", before, after, options_changed=False) == (
        "load", ": nereid.yaml's backends: defaults changed; loading it again")


def test_each_step_names_the_file_the_server_was_started_with(tmp_path: Path) -> None:
    """`nereid serve --config prod.yaml`: each line said "nereid.yaml" whatever the file was called."""
    def prod(document: str) -> Settings:
        return settings(tmp_path, document, "prod.yaml")

    one, two = prod("models:\n  - name: a\n"), prod("models:\n  - name: a\n  - name: b\n")
    every_folder = prod("server: {}\n")
    edited = prod("backends:\n  python:\n    warm_start: false\nmodels:\n  - name: a\n    queue_capacity: 7\n")
    defaults = prod("backends:\n  python:\n    warm_start: false\nmodels:\n  - name: a\n")
    assert step("b", one, two) == ("load", " is now listed in prod.yaml; loading it")
    assert step("b", two, one, loaded_backend="python") == ("unload", " is no longer listed in prod.yaml; unloading it")
    assert step("b", every_folder, one, loaded_backend="python") == (
        "unload", ": prod.yaml now lists the models to serve (models:), and not this one; unloading it")
    assert step("b", one, every_folder) == (
        "load", ": prod.yaml no longer lists the models to serve (no models:), so every folder is served; loading it")
    assert step("a", one, edited, loaded_backend="python") == ("reload", ": its settings in prod.yaml changed; "
                                                                         "reloading it")
    assert step("a", one, edited) == ("load", ": its settings in prod.yaml changed; loading it")
    assert step("a", one, defaults, loaded_backend="python") == (
        "reload", ": prod.yaml's backends.python defaults change its options; reloading it")
    assert step("a", one, defaults) == ("load", ": prod.yaml's backends: defaults changed; loading it again")


def test_a_value_fixed_to_another_type_that_python_calls_equal_is_a_change(tmp_path: Path) -> None:
    """Found by the CLI read hunt: `warm_start: 1` fixed to `true` (or `0` to `false`, `4.0` to `4`) was no change
    to Python (1 == True), so the model that failed on it stayed failing until a restart, and a READY one edited
    the other way served on, to fail at the next start."""
    broken = settings(tmp_path, "models:\n  - name: a\n    runtime: {warm_start: 1}\n")
    fixed = settings(tmp_path, "models:\n  - name: a\n    runtime: {warm_start: true}\n")
    assert step("a", broken, fixed)[0] == "load"
    assert step("a", fixed, broken, loaded_backend="python")[0] == "reload"
    zero = settings(tmp_path, "backends:\n  python: {warm_start: 0}\n")
    false = settings(tmp_path, "backends:\n  python: {warm_start: false}\n")
    assert changed_backends(zero, false) == {"python"}
    assert step("a", fixed, fixed) is None  # (the same, as written)
