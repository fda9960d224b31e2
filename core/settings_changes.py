"""What an edited nereid.yaml asks of each model: load it, reload it, unload it, or nothing.

Decided here from the old and new settings and the model's state alone; the
repository (:meth:`~nereid.repository.ModelRepository.start_settings`) carries
the steps out, each in a task of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereid.config_document import same_values
from nereid.settings import ModelSettings, Settings


@dataclass(frozen=True)
class SettingsStep:
    """One model's step: ``action`` is ``load``, ``reload`` or ``unload``; ``why`` follows the model's name in its
    log line (``model 'm' is now listed in nereid.yaml; loading it``)."""

    action: str
    why: str


def changed_backends(old: Settings, new: Settings) -> set[str]:
    """The backends whose ``backends:`` defaults differ between ``old`` and ``new`` as written (whether a model's
    options differ with them is its backend's to say: see :func:`nereid.plugins.options_change`)."""
    # (An empty section, `python: {}`, is the same as none: it changes no model's options.)
    return {name for name in set(old.backend_defaults) | set(new.backend_defaults)
            if not same_values(old.backend_defaults.get(name) or {}, new.backend_defaults.get(name) or {})}


def served(settings: Settings, name: str) -> bool:
    """Whether ``settings`` serve the model ``name`` (its folder there): it is listed, or nothing is (no ``models:``
    key: every folder is served)."""
    return not settings.models_listed or settings.model(name) is not None


def settings_step(name: str, old: Settings, new: Settings, before: ModelSettings, loaded_backend: str | None,
                  asked_for: bool, backends_changed: set[str], options_changed: bool) -> SettingsStep | None:
    """What the edit from ``old`` to ``new`` asks of the model ``name``, whose settings were ``before``.

    ``loaded_backend``: the backend of its running version (None: not loaded; a loaded one always has a backend's
    name). ``asked_for``: the server means
    to serve it (loaded at start, or asked for since) and its folder is there. ``backends_changed``: see
    :func:`changed_backends`. ``options_changed``: its running version would load with other options under the
    new ``backends:`` defaults of its backend (as the backend reads them, under its own ``runtime:``; see
    :func:`nereid.plugins.options_change`).
    """
    was_listed, listed = old.model(name) is not None, new.model(name) is not None
    config = new.config_name  # (the file as the operator named it: `--config prod.yaml` said "nereid.yaml")
    changed = not same_values(new.model_or_default(name)[0], before)  # (types too: `1` fixed to `true` is a change)
    # (One asked for but not loaded, its load having failed, too: wanted no more, its fixed files must not load.)
    if served(old, name) and not served(new, name) and (was_listed or loaded_backend is not None or asked_for):
        # (Not "unloading it" for one never loaded: listed before its folder landed, or whose load failed.)
        then = "unloading it" if loaded_backend is not None else "no longer served (it was not loaded)"
        return SettingsStep("unload", f" is no longer listed in {config}; {then}" if was_listed else
                            f": {config} now lists the models to serve (models:), and not this one; {then}")
    if loaded_backend is None:
        # A model that is not loaded loads when its entry is new or changed: a fix to the entry of one that
        # failed (an unknown backend, a bad runtime option) must not wait for a restart.
        if listed and not was_listed:
            return SettingsStep("load", f" is now listed in {config}; loading it")
        if served(new, name) and not served(old, name):
            return SettingsStep("load", f": {config} no longer lists the models to serve (no models:), so every "
                                        "folder is served; loading it")
        if listed and changed:
            return SettingsStep("load", f": its settings in {config} changed; loading it")
        if backends_changed and asked_for:
            # Its last load failed (which backend claims it is not known): a fixed backends: default
            # (warm_sart corrected to warm_start) may be what it needed.
            return SettingsStep("load", f": {config}'s backends: defaults changed; loading it again")
        return None
    if changed:
        return SettingsStep("reload", f": its settings in {config} changed; reloading it")
    if loaded_backend in backends_changed and options_changed:
        # (Only a change of what it runs with: a default written out, or one its own runtime: overrides, reloaded
        # every model of the backend, 300 reloads for an edit that changed nothing; the scale hunt.)
        return SettingsStep("reload", f": {config}'s backends.{loaded_backend} defaults change its options; "
                                      "reloading it")
    return None
