"""The plugin hooks (``nereid.hookspecs``): the contract a backend is written against, checked by pluggy itself (the
plugin manager nereid builds on it, with its built-in backends and entry points, is tests/core/test_plugins.py's)."""

from __future__ import annotations

import types
from pathlib import Path

import pluggy
import pytest

from nereid import hookspecs
from nereid.backend import BackendClaim
from nereid.hookspecs import PROJECT_NAME, hookimpl

# Each hook and the arguments it is called with: a plugin's implementation may take any of them, by these names.
CONTRACT = {
    "nereid_claim_model": ("folder", "declared"),
    "nereid_declaration_hint": ("folder", "config_name"),
    "nereid_claim_signs": (),
    "nereid_streamed_files": ("name", "declared", "listing", "read_small"),
    "nereid_add_commands": ("commands",),
    "nereid_check_defaults": ("defaults", "origin"),
    "nereid_model_options": ("name", "folder", "runtime", "origin"),
}


def manager(*plugins: object) -> pluggy.PluginManager:
    """A bare pluggy manager of nereid's hooks with ``plugins`` registered."""
    plugin_manager = pluggy.PluginManager(PROJECT_NAME)
    plugin_manager.add_hookspecs(hookspecs)
    for plugin in plugins:
        plugin_manager.register(plugin)
    return plugin_manager


def plugin(**hooks: object) -> types.SimpleNamespace:
    """A plugin object holding ``hooks`` (functions, marked or not) under their names."""
    return types.SimpleNamespace(**hooks)


def test_the_hooks_and_their_arguments_are_the_documented_contract() -> None:
    hook = manager().hook
    declared = {name: tuple(getattr(hook, name).spec.argnames) for name in dir(hook) if name.startswith("nereid_")}
    assert declared == CONTRACT
    assert all(getattr(hook, name).spec.opts["firstresult"] is False for name in CONTRACT)  # every answer counts


def test_an_implementation_taking_an_argument_no_hook_gives_is_refused_when_registered() -> None:
    @hookimpl
    def nereid_claim_model(folder: Path, declared: bool, settings: object) -> None:  # (no such argument)
        return None

    with pytest.raises(pluggy.PluginValidationError, match="settings"):
        manager(plugin(nereid_claim_model=nereid_claim_model))


def test_each_plugin_is_asked_with_the_arguments_it_takes_and_every_answer_is_collected(tmp_path: Path) -> None:
    asked: list[tuple[str, object]] = []

    @hookimpl
    def claims_all(folder: Path) -> BackendClaim:  # (the arguments it takes, by name: a subset)
        asked.append(("claims_all", folder))
        return BackendClaim(object)

    @hookimpl
    def claims_declared(folder: Path, declared: bool) -> BackendClaim | None:
        asked.append(("claims_declared", declared))
        return BackendClaim(object) if declared else None

    def unmarked(folder: Path, declared: bool) -> BackendClaim:  # not @hookimpl: never called
        raise AssertionError("an unmarked function was called")

    @pluggy.HookimplMarker("another_project")
    def another_projects(folder: Path, declared: bool) -> BackendClaim:  # another project's hook: never called
        raise AssertionError("another project's implementation was called")

    hook = manager(plugin(nereid_claim_model=claims_all), plugin(nereid_claim_model=claims_declared),
                   plugin(nereid_claim_model=unmarked), plugin(nereid_claim_model=another_projects)).hook
    answers = hook.nereid_claim_model(folder=tmp_path, declared=False)
    assert len(answers) == 1 and isinstance(answers[0], BackendClaim)  # (None answers are left out)
    assert sorted(asked, key=str) == [("claims_all", tmp_path), ("claims_declared", False)]
    assert len(hook.nereid_claim_model(folder=tmp_path, declared=True)) == 2
