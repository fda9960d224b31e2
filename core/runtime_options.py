"""A backend's ``runtime:`` options from nereid.yaml, checked the same way by every backend.

The core passes ``runtime`` through unchecked: only the backend knows its
options. Each backend reads them through :class:`RuntimeOptions`, so an unknown
key, a wrong type or a bad value is refused with the same message shape:
``<file>: models[N].runtime.<key>: <problem>, got <value>``.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, NoReturn

from nereid.config_document import closest_key, yaml_spelling
from nereid.errors import ConfigError, cap_message
from nereid.settings import key_place


class LayeredRuntime(dict):
    """A model's ``runtime`` with nereid.yaml's ``backends:`` defaults under it, knowing where each key came from.

    ``origins`` names the place of each key taken from the defaults (e.g.
    ``nereid.yaml: backends.xla``), so a mistake there is reported there, not
    under a model that never wrote the key.
    """

    def __init__(self, own: Mapping[str, Any], defaults: Mapping[str, Any], defaults_origin: str) -> None:
        super().__init__({**defaults, **own})
        self.origins = {key: defaults_origin for key in defaults if key not in own}


def layered_runtime(own: Mapping[str, Any], defaults: Mapping[str, Any] | None, source: object,
                    backend: str) -> Mapping[str, Any]:
    """A model's ``runtime`` (``own``) as its backend's ``load()`` is given it: with the backend's ``defaults``
    (nereid.yaml's ``backends.<backend>``, in the file ``source``) under it, or as it is when there are none."""
    if not defaults:
        return own
    return LayeredRuntime(own, defaults, f"{source}: backends.{backend}" if source else f"backends.{backend}")


class RuntimeOptions:
    """The ``runtime`` mapping of one model, with unknown keys already refused."""

    def __init__(self, runtime: Mapping[str, Any], origin: str, backend: str, allowed: Iterable[str],
                 prefix: str = "") -> None:
        self.runtime = runtime
        self.where = f"{origin}.runtime" if origin else "runtime"
        self.origins: Mapping[str, str] = getattr(runtime, "origins", {})
        self.prefix = prefix
        allowed = sorted(allowed)
        known = f"allowed: {', '.join(allowed)}" if allowed else "it has no runtime options"
        for key, value in runtime.items():
            if key not in allowed:
                place = key_place(key) if isinstance(key, str) else None
                close = closest_key(key, allowed) if isinstance(key, str) and not place else None
                hint = (f"; {key} is {place}, not a runtime: option" if place else
                        f"; did you mean '{close}'?" if close else "")
                self.fail(key, f"unknown option of the {backend} backend ({known}{hint})", value)

    def fail(self, key: Any, problem: str, value: Any) -> NoReturn:
        """Raise ConfigError naming ``runtime.<key>``, the problem and the (capped) value."""
        # (An item's key, ``preload[1]``, is where its option is: a default's said "backends.python.runtime.preload[1]"
        # and was blamed on every model under it; the regression hunt.)
        where = self.origins.get(key.partition("[")[0] if isinstance(key, str) else key, self.where)
        if not isinstance(key, str):  # (YAML's keys may be numbers: `runtime: {1: 2}` raised AttributeError here)
            key = yaml_spelling(key)
        raise ConfigError(f"{self.prefix}{where}.{key}: {problem}, got {cap_message(yaml_spelling(value), 200)}")

    def get(self, key: str, default: Any) -> Any:
        """The raw value of ``key``, or ``default``."""
        return self.runtime.get(key, default)

    def boolean(self, key: str, default: bool) -> bool:
        """A true/false option."""
        value = self.runtime.get(key, default)
        if not isinstance(value, bool):
            self.fail(key, "must be true or false", value)
        return value

    def integer(self, key: str, default: int, minimum: int = 1) -> int:
        """An integer option of at least ``minimum``."""
        value = self.runtime.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(key, f"must be an integer >= {minimum}", value)
        return value


def defaults_options(defaults: Mapping[str, Any], origin: str, backend: str, allowed: Iterable[str]) -> RuntimeOptions:
    """A backend's defaults (nereid.yaml's ``backends.<backend>``, at ``origin``) read as a model's runtime would
    read them, unknown keys refused: for a backend's ``nereid_check_defaults`` hook."""
    return RuntimeOptions(LayeredRuntime({}, defaults, origin), origin, backend, allowed)
