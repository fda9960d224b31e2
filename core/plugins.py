"""Building the plugin manager and asking backends to claim a folder."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pluggy

from nereid import hookspecs
from nereid.backend import BackendClaim
from nereid.errors import ConfigError

ENTRY_POINT_GROUP = "nereid.backends"

# Built-in backends, registered exactly like third-party ones: each module is a
# plugin whose ``BACKEND_NAME`` is its registration name.
BUILTIN_BACKENDS: tuple[str, ...] = (
    "nereid.backends.python.plugin",
    "nereid.backends.cpp.plugin",
    "nereid.backends.cxx.plugin",
    "nereid.backends.xla.plugin",
    "nereid.backends.meta.plugin",
)


@dataclass(frozen=True)
class ClaimResult:
    """The outcome of asking the backends about one folder: a claim and its backend's name, or a reason."""

    claim: BackendClaim | None
    reason: str = ""
    backend_name: str = ""


def make_plugin_manager(*, load_entry_points: bool = True, extra_plugins: tuple[object, ...] = ()) -> pluggy.PluginManager:
    """A plugin manager with the built-in backends, installed plugins and ``extra_plugins``.

    Installed packages register backends under the ``nereid.backends``
    entry-point group; the entry-point name becomes the backend's plugin name.
    """
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    for module_name in BUILTIN_BACKENDS:
        module = importlib.import_module(module_name)
        manager.register(module, name=module.BACKEND_NAME)
    if load_entry_points:
        manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for plugin in extra_plugins:
        manager.register(plugin, name=getattr(plugin, "BACKEND_NAME", None))
    return manager


def backend_names(manager: pluggy.PluginManager) -> list[str]:
    """Names of every registered backend plugin (one that claims folders), sorted."""
    return sorted(impl.plugin_name for impl in _claim_impls(manager))


def check_backend_defaults(manager: pluggy.PluginManager, defaults: Iterable[str], source: object) -> None:
    """ConfigError naming ``backends.<name>`` in ``source`` for defaults given to a backend that is not installed.

    nereid.yaml is read before plugins are known, so a misspelt backend name
    there would otherwise be taken silently and apply to nothing.
    """
    installed = backend_names(manager)
    for name in defaults:
        if name not in installed:
            raise ConfigError(f"{source}: backends.{name}: no such backend is installed "
                              f"(installed: {', '.join(installed)})")


def _claim_impls(manager: pluggy.PluginManager) -> list[pluggy.HookImpl]:
    # A plugin that only wraps the claim hook (tracing, say) is not a backend and makes no claim.
    return [impl for impl in manager.hook.nereid_claim_model.get_hookimpls()
            if not (impl.wrapper or impl.hookwrapper)]


def claim_folder(manager: pluggy.PluginManager, folder: Path, backend: str | None = None) -> ClaimResult:
    """Ask the backends about ``folder``; with ``backend`` set, ask only that one.

    Each claim is attributed to the plugin that made it, by its registration name.
    """
    if backend is not None:
        if backend not in backend_names(manager):
            return ClaimResult(None, f"backend '{backend}' (from nereid.yaml) is not installed (no plugin of that "
                                     "name claims model folders); "
                                     f"installed backends: {', '.join(backend_names(manager))}")
        claims = _ask(manager, folder, declared=True, only=backend)
        if not claims:
            return ClaimResult(None, f"backend '{backend}' does not recognise the folder {folder}")
        return ClaimResult(claims[0][1], backend_name=backend)
    claims = _ask(manager, folder, declared=False)
    if len(claims) == 1:
        name, claim = claims[0]
        return ClaimResult(claim, backend_name=name)
    if not claims:
        hints = "".join(f"; {hint}" for hint in manager.hook.nereid_declaration_hint(folder=folder))
        return ClaimResult(None, f"no backend claims the folder {folder} "
                                 f"(installed backends: {', '.join(backend_names(manager))}); "
                                 f"add the backend's files or set backend: in nereid.yaml{hints}")
    names = ", ".join(sorted(name for name, _ in claims))
    return ClaimResult(None, f"several backends claim the folder {folder} ({names}); "
                             "set backend: in nereid.yaml to choose one")


def _ask(manager: pluggy.PluginManager, folder: Path, declared: bool,
         only: str | None = None) -> list[tuple[str, BackendClaim]]:
    """Each claiming plugin's registration name and claim (of plugin ``only``, when given).

    Each backend is asked through pluggy on its own, the other backends left
    out, so that its claim is attributed to it and the hook's wrappers run
    around every question.
    """
    backends = _claim_impls(manager)
    claims = []
    for impl in backends:
        if only is not None and impl.plugin_name != only:
            continue
        others = [other.plugin for other in backends if other is not impl]
        asked = manager.subset_hook_caller("nereid_claim_model", remove_plugins=others)
        for claim in asked(folder=folder, declared=declared):  # (pluggy drops None: no claim)
            claims.append((impl.plugin_name, claim))
    return claims
